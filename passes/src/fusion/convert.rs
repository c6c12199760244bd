//! Conversion between the IR and the e-graph, both ways.
//!
//! IR -> egg: every node becomes one e-node in one e-class, in topological order, so shared nodes
//! stay shared (the e-graph is a DAG, never a tree of copies). Each node gets its own op-table
//! entry, so equal nodes do not hash-cons into one class: the `remat` pass's recomputed copies
//! of forward values are equal to the originals on purpose, and merging them would undo it. The whole graph is converted: GPT-2's blocks
//! are small enough that one e-graph for the step saturates in well under a second, and
//! cross-block patterns (the residual stream, the optimizer over every tensor) need it.
//!
//! egg -> IR: the extraction picks one e-node per materialized class. A primitive e-node becomes
//! the op it came from; a fused e-node becomes one `Op::Kernel` node whose body is the kernel's
//! primitive ops over inputs `in0..inN`, with result `out`, each body node named after the value
//! it computes. Every input of the original graph is kept, read or not (it is the step's
//! signature), and outputs keep their order.

use std::collections::{BTreeMap, HashMap};

use egg::Id;
use qatc_ir::{Graph, InputKind, NodeId, Op};

use super::body::BRef;
use super::lang::{ENode, Entry, FusionAnalysis, Kernel, EG};
use super::FusionError;

/// The graph's interface in e-graph terms.
pub struct Roots {
    pub name: String,
    /// Every input, by name order, with its class.
    pub inputs: Vec<Id>,
    /// (name, class, update) in the graph's output order.
    pub outputs: Vec<(String, Id, bool)>,
}

impl Roots {
    pub fn classes(&self, eg: &EG) -> Vec<Id> {
        self.outputs.iter().map(|o| eg.find(o.1)).collect()
    }
}

/// Builds the e-graph of `g`.
pub fn to_egraph(g: &Graph) -> Result<(EG, Roots), FusionError> {
    let mut eg = EG::new(FusionAnalysis::default());
    let order = g.topo_order().map_err(FusionError::Ir)?;
    let mut class: HashMap<NodeId, Id> = HashMap::with_capacity(order.len());
    for (i, &n) in order.iter().enumerate() {
        let node = g.node(n);
        let leaf_name = match node.op {
            Op::Input { .. } => node.name.clone(),
            _ => None,
        };
        let op = eg.analysis.table.unique(node.op.clone(), leaf_name);
        let args = g.operands(n).iter().map(|o| class[o]).collect();
        let id = eg.add(ENode { kind: node.op.kind().into(), op, args });
        let d = &mut eg[id].data;
        d.original = true;
        d.topo = Some(i as u32);
        if d.name.is_none() {
            d.name = node.name.clone();
        }
        if d.ty.is_none() {
            return Err(FusionError::Untyped(g.describe(n)));
        }
        class.insert(n, id);
    }
    for &n in &order {
        let me = class[&n];
        let mut seen = Vec::new();
        for o in g.operands(n) {
            let c = class[&o];
            if !seen.contains(&c) {
                seen.push(c);
                if !eg[c].data.users.contains(&me) {
                    eg[c].data.users.push(me);
                }
            }
        }
    }
    for o in g.outputs() {
        eg[class[&o.node]].data.output = true;
    }
    // inputs that an update writes stay materialized too
    let inputs = g.inputs().iter().map(|i| class[i]).collect();
    let outputs = g.outputs().iter().map(|o| (o.name.clone(), class[&o.node], o.update)).collect();
    eg.rebuild();
    Ok((eg, Roots { name: g.name.clone(), inputs, outputs }))
}

/// Builds the IR graph of an extraction.
pub fn to_graph(eg: &EG, roots: &Roots, choice: &BTreeMap<Id, ENode>) -> Result<Graph, FusionError> {
    let mut g = Graph::new(roots.name.clone());
    let mut made: HashMap<Id, NodeId> = HashMap::new();
    for &i in &roots.inputs {
        let c = eg.find(i);
        let (op, name) = prim(eg, c, choice)?;
        let id = g.add_node(op, &[], name).map_err(FusionError::Ir)?;
        made.insert(c, id);
    }
    // iterative post-order over the chosen e-nodes, detecting cycles
    let mut open: HashMap<Id, bool> = HashMap::new();
    for (_, root, _) in &roots.outputs {
        let mut stack = vec![(eg.find(*root), false)];
        while let Some((c, expanded)) = stack.pop() {
            if made.contains_key(&c) {
                continue;
            }
            let n = choice.get(&c).ok_or_else(|| FusionError::Extract(format!("no e-node chosen for {}", describe(eg, c))))?;
            if expanded {
                let args: Vec<NodeId> = n
                    .args
                    .iter()
                    .map(|a| made.get(&eg.find(*a)).copied())
                    .collect::<Option<_>>()
                    .ok_or_else(|| FusionError::Extract(format!("operand of {} not built", describe(eg, c))))?;
                let id = build(eg, c, n, &args, &mut g)?;
                made.insert(c, id);
                open.remove(&c);
                continue;
            }
            if open.insert(c, true).is_some() {
                return Err(FusionError::Cycle(describe(eg, c)));
            }
            stack.push((c, true));
            for a in n.args.iter().rev() {
                let a = eg.find(*a);
                if made.contains_key(&a) {
                    continue;
                }
                if open.contains_key(&a) {
                    return Err(FusionError::Cycle(describe(eg, a)));
                }
                stack.push((a, false));
            }
        }
    }
    for (name, root, update) in &roots.outputs {
        let id = made[&eg.find(*root)];
        let r = if *update { g.set_update(name.clone(), id) } else { g.set_output(name.clone(), id) };
        r.map_err(FusionError::Ir)?;
    }
    Ok(g)
}

fn describe(eg: &EG, c: Id) -> String {
    match &eg[c].data.name {
        Some(n) => format!("{n:?}"),
        None => format!("e-class {c}"),
    }
}

fn prim(eg: &EG, c: Id, choice: &BTreeMap<Id, ENode>) -> Result<(Op, Option<String>), FusionError> {
    let n = match choice.get(&c) {
        Some(n) => n.clone(),
        None => eg[c].nodes.first().cloned().ok_or_else(|| FusionError::Extract(format!("empty {}", describe(eg, c))))?,
    };
    match eg.analysis.table.get(n.op) {
        Some(Entry::Prim { op, name }) => Ok((op.clone(), name.clone().or_else(|| eg[c].data.name.clone()))),
        _ => Err(FusionError::Extract(format!("input {} is not a primitive", describe(eg, c)))),
    }
}

fn build(eg: &EG, c: Id, n: &ENode, args: &[NodeId], g: &mut Graph) -> Result<NodeId, FusionError> {
    let name = eg[c].data.name.clone();
    match eg.analysis.table.get(n.op) {
        Some(Entry::Prim { op, .. }) => g.add_node(op.clone(), args, name).map_err(FusionError::Ir),
        Some(Entry::Fused(k)) => {
            let body = body_graph(eg, k, args.iter().map(|a| g.ty(*a).clone()).collect())?;
            let op = Op::Kernel { family: k.family.clone(), body: Box::new(body) };
            g.add_node(op, args, name).map_err(FusionError::Ir)
        }
        None => Err(FusionError::Extract(format!("unknown op for {}", describe(eg, c)))),
    }
}

/// The IR graph of a kernel body: inputs `in0..inN` (kind data), result `out`.
pub fn body_graph(eg: &EG, k: &Kernel, arg_tys: Vec<qatc_ir::TensorType>) -> Result<Graph, FusionError> {
    let mut b = Graph::new(k.family.to_string());
    let mut ins = Vec::new();
    for (i, t) in arg_tys.into_iter().enumerate() {
        ins.push(b.input(format!("in{i}"), InputKind::Data, t.dtype, t.shape).map_err(FusionError::Ir)?);
    }
    let mut nodes: Vec<NodeId> = Vec::new();
    for n in &k.body.nodes {
        let op = eg.analysis.table.op(n.op).ok_or_else(|| FusionError::Extract(format!("kernel {} has a non-primitive node", k.family)))?;
        let args: Vec<NodeId> = n
            .args
            .iter()
            .map(|r| match *r {
                BRef::In(i) => ins[i as usize],
                BRef::Node(j) => nodes[j as usize],
            })
            .collect();
        let name = n.origin.and_then(|o| eg[o].data.name.clone());
        nodes.push(b.add_node(op.clone(), &args, name).map_err(FusionError::Ir)?);
    }
    let out = *nodes.last().ok_or_else(|| FusionError::Extract(format!("kernel {} has an empty body", k.family)))?;
    b.set_output("out", out).map_err(FusionError::Ir)?;
    Ok(b)
}
