use std::collections::HashMap;
use std::fmt::Write;

use crate::graph::{Graph, NodeId};
use crate::op::{Attr, Op};

fn attr(out: &mut String, a: &Attr) {
    // Writing into a String cannot fail.
    let _ = match a {
        Attr::Float(v) => write!(out, "{v:?}"),
        Attr::Int(v) => write!(out, "{v}"),
        Attr::Bool(v) => write!(out, "{v}"),
        Attr::Dims(d) => write!(out, "{}", crate::types::Shape(d.clone())),
        Attr::DType(d) => write!(out, "{d}"),
        Attr::Word(w) => write!(out, "{w}"),
        Attr::Str(s) => write!(out, "{s:?}"),
    };
}

/// Prints `g` in the text format. A graph with a cycle cannot be ordered; it prints its nodes in
/// insertion order with a comment saying so (the verifier reports the cycle itself).
pub fn print(g: &Graph) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "graph {:?} {{", g.name);
    print_into(g, &mut out, "");
    out
}

/// Prints `g`'s nodes and outputs at `indent`, then its closing brace (the caller wrote the
/// opening line: `graph "name" {` at top level, the kernel node's line for a body).
fn print_into(g: &Graph, out: &mut String, indent: &str) {
    let (order, note) = match g.topo_order() {
        Ok(o) => (o, None),
        Err(e) => (g.node_ids(), Some(e.to_string())),
    };
    let number: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    if let Some(n) = note {
        let _ = writeln!(out, "{indent}  // not ordered: {n}");
    }
    for &id in &order {
        let node = g.node(id);
        let _ = write!(out, "{indent}  %{} = {}", number[&id], node.op.mnemonic());
        let attrs = node.op.attrs();
        if !attrs.is_empty() {
            out.push('[');
            for (i, (k, v)) in attrs.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(k);
                out.push('=');
                attr(out, v);
            }
            out.push(']');
        }
        if !matches!(node.op, Op::Input { .. } | Op::Const { .. }) {
            out.push('(');
            for (i, o) in g.operands(id).iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                let _ = write!(out, "%{}", number.get(o).copied().unwrap_or(usize::MAX));
            }
            out.push(')');
        }
        let _ = write!(out, " : {}", node.ty);
        if let Some(name) = &node.name {
            let _ = write!(out, " {name:?}");
        }
        if let Op::Kernel { body, .. } = &node.op {
            // the body follows as a nested graph, indented, closed by its own `}`
            out.push_str(" {\n");
            print_into(body, out, &format!("{indent}  "));
            continue;
        }
        out.push('\n');
    }
    for o in g.outputs() {
        let kw = if o.update { "update" } else { "output" };
        let _ = writeln!(out, "{indent}  {kw} {:?} = %{}", o.name, number.get(&o.node).copied().unwrap_or(usize::MAX));
    }
    out.push_str(indent);
    out.push_str("}\n");
}
