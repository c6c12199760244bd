//! The fusion report (`OUT/fusion.json`): kernels and bytes before and after, the bytes an ideal
//! step must move, what saturation and extraction did, and which rules built what.

use std::collections::{BTreeMap, HashSet};

use qatc_ir::{Graph, NodeId, Op};
use serde::Serialize;

use super::cost::{graph_traffic, Traffic};
use super::runner::SaturationReport;

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ExtractionReport {
    /// Cost (bytes + launch_bytes per launch) of the greedy choice and after the local search.
    pub greedy_cost: u64,
    pub final_cost: u64,
    pub switches: usize,
    pub time_s: f64,
    /// Set when extraction failed and the unfused graph was kept.
    pub fallback: Option<String>,
}

/// Traffic of one kernel family in the fused graph.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct FamilyTraffic {
    pub kernels: u64,
    pub bytes: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct FusionReport {
    pub nodes_before: usize,
    pub nodes_after: usize,
    /// Kernel launches: every op that is not a view or an input before; kernels and the unfused
    /// ops left after.
    pub kernels_before: u64,
    pub kernels_after: u64,
    /// Bytes read and written in device memory by all kernels (see `cost`).
    pub bytes_before: u64,
    pub bytes_after: u64,
    /// What an ideal step moves: every input read once, every output written once, and every
    /// activation the backward reads written once and read once (see [`ideal_bytes`]).
    pub ideal_bytes: u64,
    pub launch_bytes: u64,
    pub saturation: SaturationReport,
    pub extraction: ExtractionReport,
    /// Fused kernels in the result, by the rule that built them.
    pub rules_used: BTreeMap<String, usize>,
    /// The fused graph's traffic by kernel family (`unfused.OP` for ops left alone).
    pub families: BTreeMap<String, FamilyTraffic>,
}

impl FusionReport {
    pub fn bytes_saved(&self) -> i64 {
        self.bytes_before as i64 - self.bytes_after as i64
    }
    /// bytes_after / ideal_bytes.
    pub fn ratio_to_ideal(&self) -> f64 {
        self.bytes_after as f64 / (self.ideal_bytes.max(1)) as f64
    }
    pub fn ratio_before_to_ideal(&self) -> f64 {
        self.bytes_before as f64 / (self.ideal_bytes.max(1)) as f64
    }
}

/// Fills the before/after figures from the two graphs.
pub fn compare(before: &Graph, after: &Graph, r: &mut FusionReport) {
    let (tb, _) = graph_traffic(before);
    let (ta, fam) = graph_traffic(after);
    r.nodes_before = before.len();
    r.nodes_after = after.len();
    r.kernels_before = tb.launches;
    r.kernels_after = ta.launches;
    r.bytes_before = tb.bytes;
    r.bytes_after = ta.bytes;
    r.ideal_bytes = ideal_bytes(after);
    r.families = fam.into_iter().map(|(k, Traffic { launches, bytes })| (k, FamilyTraffic { kernels: launches, bytes })).collect();
}

/// Follows reshapes (which alias their operand entirely) to the tensor they view.
fn unreshape(g: &Graph, mut n: NodeId) -> NodeId {
    while matches!(g.node(n).op, Op::Reshape { .. }) {
        n = g.operands(n)[0];
    }
    n
}

use qatc_ir::role::holds_gradient_seed as holds_seed;

/// The bytes an ideal step moves (see [`FusionReport::ideal_bytes`]), measured on the step as it
/// will run (the fused graph): which activations cross from the forward to the backward is the
/// step's choice (fusion recomputes dequantized weights and never writes the logits), the rest
/// is the minimum for that choice. The backward is what depends on autodiff's seed; a
/// forward-only graph saves nothing.
pub fn ideal_bytes(g: &Graph) -> u64 {
    let Ok(order) = g.topo_order() else { return 0 };
    let mut backward: HashSet<NodeId> = HashSet::new();
    for &n in &order {
        if holds_seed(g, n) || g.operands(n).iter().any(|o| backward.contains(o)) {
            backward.insert(n);
        }
    }
    let mut total = 0u64;
    for &n in &order {
        let node = g.node(n);
        if matches!(node.op, Op::Input { .. }) && !g.users(n).is_empty() {
            total += node.ty.bytes() as u64;
        }
    }
    let mut written: HashSet<NodeId> = HashSet::new();
    for o in g.outputs() {
        if !matches!(g.node(o.node).op, Op::Input { .. }) && written.insert(o.node) {
            total += g.ty(o.node).bytes() as u64;
        }
    }
    let mut saved: HashSet<NodeId> = HashSet::new();
    for &n in &order {
        if backward.contains(&n) || matches!(g.node(n).op, Op::Input { .. } | Op::Const { .. }) {
            continue;
        }
        if g.users(n).iter().any(|u| backward.contains(u)) {
            let b = unreshape(g, n);
            if !matches!(g.node(b).op, Op::Input { .. }) && saved.insert(b) {
                // written once (unless it is an output, counted above) and read once
                total += if written.contains(&n) { 1 } else { 2 } * g.ty(b).bytes() as u64;
            }
        }
    }
    total
}
