//! The verifier: re-infers every node's type, checks operand counts, acyclicity, input names and
//! update targets. Passes run it after themselves (in tests, and in `qatc` after every pass) so
//! the pass that broke an invariant is the one named.

use std::collections::HashMap;

use crate::error::IrError;
use crate::graph::{Graph, NodeId};
use crate::infer::infer;
use crate::op::{InputKind, Op};

/// Checks every invariant of `g`. Errors name the node as the printer numbers it (`%12`), plus its
/// name and op, so the message points into a `qatc dump`.
pub fn verify(g: &Graph) -> Result<(), IrError> {
    let order = g.topo_order()?;
    let number: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let label = |id: NodeId| {
        let n = g.node(id);
        match &n.name {
            Some(name) => format!("%{} {:?} ({})", number[&id], name, n.op.mnemonic()),
            None => format!("%{} ({})", number[&id], n.op.mnemonic()),
        }
    };
    for &id in &order {
        let node = g.node(id);
        let ops = g.operands(id);
        let tys: Vec<_> = ops.iter().map(|&o| g.ty(o)).collect();
        let ty = infer(&node.op, &tys).map_err(|msg| IrError::Type { node: label(id), msg })?;
        if ty != node.ty {
            return Err(IrError::Type { node: label(id), msg: format!("recorded type {} but the op computes {ty}", node.ty) });
        }
        if let Op::Input { .. } = node.op {
            match &node.name {
                Some(name) if g.find_input(name) == Some(id) => {}
                _ => return Err(IrError::Type { node: label(id), msg: "input is unnamed or not registered".into() }),
            }
        }
    }
    for o in g.outputs() {
        if !g.contains(o.node) {
            return Err(IrError::UnknownNode(o.node.0));
        }
        if o.update {
            let inp = g.find_input(&o.name).ok_or_else(|| IrError::BadUpdateTarget(o.name.clone()))?;
            if !matches!(g.input_kind(inp), Some(InputKind::Trainable | InputKind::State)) {
                return Err(IrError::BadUpdateTarget(o.name.clone()));
            }
            if g.ty(inp) != g.ty(o.node) {
                return Err(IrError::UpdateType { name: o.name.clone(), got: g.ty(o.node).to_string(), want: g.ty(inp).to_string() });
            }
        }
    }
    Ok(())
}
