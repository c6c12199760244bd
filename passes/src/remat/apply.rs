//! The rewrite: every forward value the backward reads but the policy does not keep is
//! recomputed. Its backward uses are pointed at a clone, made from kept values and inputs
//! (cloning further non-kept values as needed), named `NAME.recompute` so that it shows in
//! `train.qir`. One clone per forward node, shared by all its backward uses; the memory
//! planner schedules clones lazily, just before their first use in the backward.
//!
//! The clone computes the same op on the same operand values, so everything downstream,
//! gradients included, is bit for bit what the unrewritten step computes.

use std::collections::HashMap;

use qatc_ir::{Graph, IrError, NodeId, Op};

use super::super::plan::region::{Dense, RECOMPUTE_SUFFIX};

/// What the rewrite did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Rewrite {
    pub recomputed_nodes: usize,
    pub recompute_flops: u64,
    /// Forward values the backward reads that stay saved, and their bytes.
    pub saved_values: usize,
    pub saved_bytes: usize,
}

/// Rebuilds `g` with the backward reading clones of the non-kept forward values. `keep[i]`
/// (dense ids of `d`, built from `g`) says a forward value is kept; a view (reshape) is kept
/// when the value it views is, since they share storage.
pub(crate) fn rewrite(g: &Graph, d: &Dense, keep: &[bool]) -> Result<(Graph, Rewrite), IrError> {
    let kept = |i: usize| d.is_input(i) || keep[d.view_root(i)];
    let mut out = Graph::new(g.name.clone());
    let mut map: HashMap<NodeId, NodeId> = HashMap::new();
    let mut clones: HashMap<usize, NodeId> = HashMap::new();
    let mut stats = Rewrite::default();
    for n in g.topo_order()? {
        let node = g.node(n);
        let dn = d.index.get(&n).copied();
        let backward = dn.is_some_and(|i| !d.forward[i]);
        let mut ops = Vec::new();
        for o in g.operands(n) {
            let mapped = match d.index.get(&o).copied() {
                Some(oi) if backward && d.forward[oi] && !kept(oi) => clone_of(g, d, oi, &kept, &mut out, &map, &mut clones, &mut stats)?,
                _ => *map.get(&o).ok_or(IrError::UnknownNode(o.index() as u32))?,
            };
            ops.push(mapped);
        }
        let id = out.add_node(node.op.clone(), &ops, node.name.clone())?;
        map.insert(n, id);
    }
    for o in g.outputs() {
        let id = *map.get(&o.node).ok_or(IrError::UnknownNode(o.node.index() as u32))?;
        if o.update {
            out.set_update(o.name.clone(), id)?;
        } else {
            out.set_output(o.name.clone(), id)?;
        }
    }
    for i in 0..d.len() {
        if super::chain::Chains::needed(d, i) && kept(i) && !d.view[i] {
            stats.saved_values += 1;
            stats.saved_bytes += d.bytes[i];
        }
    }
    Ok((out, stats))
}

/// The clone of dense node `i` in `out`, made (with the clones it needs) if it does not exist.
#[allow(clippy::too_many_arguments)]
fn clone_of(
    g: &Graph,
    d: &Dense,
    i: usize,
    kept: &dyn Fn(usize) -> bool,
    out: &mut Graph,
    map: &HashMap<NodeId, NodeId>,
    clones: &mut HashMap<usize, NodeId>,
    stats: &mut Rewrite,
) -> Result<NodeId, IrError> {
    // iterative post-order: a segment's recompute chain can be hundreds of nodes deep
    let mut stack = vec![(i, false)];
    while let Some((v, expanded)) = stack.pop() {
        if clones.contains_key(&v) {
            continue;
        }
        if !expanded {
            stack.push((v, true));
            for &p in &d.operands[v] {
                if !kept(p) && !clones.contains_key(&p) {
                    stack.push((p, false));
                }
            }
            continue;
        }
        let mut ops = Vec::with_capacity(d.operands[v].len());
        for &p in &d.operands[v] {
            let id = if kept(p) {
                *map.get(&d.ids[p]).ok_or(IrError::UnknownNode(d.ids[p].index() as u32))?
            } else {
                *clones.get(&p).ok_or(IrError::UnknownNode(d.ids[p].index() as u32))?
            };
            ops.push(id);
        }
        let node = g.node(d.ids[v]);
        let name = match &node.name {
            Some(n) => format!("{n}{RECOMPUTE_SUFFIX}"),
            None => "recompute".to_string(),
        };
        debug_assert!(!matches!(node.op, Op::Input { .. }));
        let id = out.add_node(node.op.clone(), &ops, Some(name))?;
        clones.insert(v, id);
        stats.recomputed_nodes += 1;
        stats.recompute_flops += d.flops[v];
    }
    clones.get(&i).copied().ok_or(IrError::UnknownNode(d.ids[i].index() as u32))
}
