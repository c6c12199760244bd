//! The cost model and extraction.
//!
//! Cost = bytes moved to and from device memory + `launch_bytes` per kernel launch. A kernel (a
//! fused one, or an unfused op, which is a kernel of its own) reads each operand once and writes
//! its result once; what stays inside a fused kernel costs nothing. Three refinements keep the
//! figure honest:
//! - an operand a kernel only slices, or only gathers rows from, costs the bytes of those
//!   slices or rows, not the whole tensor ([`footprint`]);
//! - `reshape` and a `slice` along axis 0 are views of their operand (a contiguous sub-buffer):
//!   no launch, no bytes;
//! - inputs cost nothing by themselves: the kernels that read them pay for the read.
//!
//! `launch_bytes` converts a launch into the bytes the device could have moved meanwhile: the
//! default, 8 MiB, is about 2.5 us at an H100's 3.35 TB/s, the order of a launch plus its ramp-up
//! and tail. FLOPs are not counted: the rules never duplicate a GEMM except where the family says
//! so (the LM head's logits in `cross_entropy.linear` are computed once per row chunk).
//!
//! Extraction (choosing, per value, the primitive op or one of the kernels that compute it) is in
//! `extract.rs`.

use std::collections::BTreeMap;

use egg::Id;
use qatc_ir::{CostClass, Graph, Op, TensorType};

use super::body::{BRef, Body};
use super::lang::{ENode, Entry, EG};

/// The bytes an op reads from operand `slot` when that operand has `full` bytes and the op
/// produces `out` bytes: slices and gathered rows touch only what they return
/// ([`CostClass::Partial`], from `qatc_ir`'s op table).
pub fn footprint(op: &Op, slot: usize, full: u64, out: u64) -> u64 {
    match (op.kind().props().cost, slot) {
        (CostClass::Partial, 0) => full.min(out),
        _ => full,
    }
}

/// Whether `op` is a view of its operand (no launch, no bytes): a [`CostClass::View`], or a
/// slice along axis 0 (a contiguous sub-buffer).
pub fn is_view(op: &Op) -> bool {
    match op.kind().props().cost {
        CostClass::View => true,
        CostClass::Partial => matches!(op, Op::Slice { axis: 0, .. }),
        CostClass::Free | CostClass::Fill | CostClass::Launch => false,
    }
}

/// Bytes a kernel body reads: per input, the sum of its uses' footprints, at most its size.
pub fn body_read_bytes(eg: &EG, body: &Body, arg_tys: &[TensorType], tys: &[TensorType]) -> u64 {
    let mut per_arg: Vec<(u64, bool)> = vec![(0, false); arg_tys.len()];
    for (j, n) in body.nodes.iter().enumerate() {
        let Some(op) = eg.analysis.table.op(n.op) else { continue };
        for (slot, a) in n.args.iter().enumerate() {
            if let BRef::In(i) = *a {
                let full = arg_tys[i as usize].bytes() as u64;
                let f = footprint(op, slot, full, tys[j].bytes() as u64);
                let e = &mut per_arg[i as usize];
                e.0 += f;
                e.1 |= f == full;
            }
        }
    }
    per_arg.iter().zip(arg_tys).map(|((sum, whole), t)| if *whole { t.bytes() as u64 } else { (*sum).min(t.bytes() as u64) }).sum()
}

/// Launches and bytes of one kernel (or unfused op), from its op, operand types and result type.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Traffic {
    pub launches: u64,
    pub bytes: u64,
}

impl Traffic {
    /// The cost in bytes: traffic plus `launch_bytes` per launch.
    pub fn cost(&self, launch_bytes: u64) -> Cost {
        self.bytes as Cost + self.launches as Cost * launch_bytes as Cost
    }
}

/// Costs are exact integers (bytes), so the local search's running total never drifts.
pub type Cost = i128;

/// The cost of what cannot be computed (a class with no usable e-node).
pub const INF: Cost = 1 << 100;

/// Traffic of an unfused op, by its [`CostClass`]: one launch, distinct operands read once
/// (their footprints), result written once.
pub fn prim_traffic(op: &Op, args: &[(Id, &TensorType)], out: &TensorType) -> Traffic {
    match op.kind().props().cost {
        CostClass::Free => Traffic::default(),
        _ if is_view(op) => Traffic::default(),
        CostClass::Fill => Traffic { launches: 1, bytes: out.bytes() as u64 },
        CostClass::View | CostClass::Partial | CostClass::Launch => {
            let mut seen: Vec<(Id, u64)> = Vec::new();
            for (slot, (id, t)) in args.iter().enumerate() {
                let f = footprint(op, slot, t.bytes() as u64, out.bytes() as u64);
                match seen.iter_mut().find(|(s, _)| s == id) {
                    Some(e) => e.1 = e.1.max(f),
                    None => seen.push((*id, f)),
                }
            }
            Traffic { launches: 1, bytes: seen.iter().map(|s| s.1).sum::<u64>() + out.bytes() as u64 }
        }
    }
}

/// Traffic of an e-node.
pub fn enode_traffic(eg: &EG, n: &ENode, out: &TensorType) -> Traffic {
    match eg.analysis.table.get(n.op) {
        Some(Entry::Prim { op, .. }) => {
            let tys: Vec<(Id, TensorType)> =
                n.args.iter().map(|&a| (eg.find(a), eg[a].data.ty.clone().unwrap_or_else(|| out.clone()))).collect();
            let refs: Vec<(Id, &TensorType)> = tys.iter().map(|(i, t)| (*i, t)).collect();
            prim_traffic(op, &refs, out)
        }
        Some(Entry::Fused(k)) => Traffic { launches: 1, bytes: k.read_bytes + k.ty.bytes() as u64 },
        None => Traffic { launches: 1, bytes: u64::MAX / 4 },
    }
}

/// Traffic of a whole IR graph (fused or not), with the same rules as the e-graph's.
pub fn graph_traffic(g: &Graph) -> (Traffic, BTreeMap<String, Traffic>) {
    let mut total = Traffic::default();
    let mut by_family: BTreeMap<String, Traffic> = BTreeMap::new();
    for id in g.node_ids() {
        let node = g.node(id);
        let ops = g.operands(id);
        let t = match &node.op {
            Op::Kernel { family, body } => {
                let tr = kernel_traffic(g, &ops, body, &node.ty);
                let e = by_family.entry(family.to_string()).or_default();
                e.launches += tr.launches;
                e.bytes += tr.bytes;
                tr
            }
            op => {
                let args: Vec<(Id, &TensorType)> = ops.iter().map(|o| (Id::from(o.index()), g.ty(*o))).collect();
                let tr = prim_traffic(op, &args, &node.ty);
                if tr.launches > 0 {
                    let e = by_family.entry(format!("unfused.{}", op.mnemonic())).or_default();
                    e.launches += tr.launches;
                    e.bytes += tr.bytes;
                }
                tr
            }
        };
        total.launches += t.launches;
        total.bytes += t.bytes;
    }
    (total, by_family)
}

fn kernel_traffic(g: &Graph, ops: &[qatc_ir::NodeId], body: &Graph, out: &TensorType) -> Traffic {
    let mut read = 0u64;
    for (i, &o) in ops.iter().enumerate() {
        let full = g.ty(o).bytes() as u64;
        let Some(inp) = body.find_input(&format!("in{i}")) else { continue };
        let mut sum = 0u64;
        let mut whole = false;
        for u in body.users(inp) {
            let un = body.node(u);
            for (slot, a) in body.operands(u).iter().enumerate() {
                if *a == inp {
                    let f = footprint(&un.op, slot, full, un.ty.bytes() as u64);
                    sum += f;
                    whole |= f == full;
                }
            }
        }
        read += if whole { full } else { sum.min(full) };
    }
    Traffic { launches: 1, bytes: read + out.bytes() as u64 }
}
