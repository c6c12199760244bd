//! What a plan puts where a collective is: the executors do not run collectives yet (MPI and
//! NCCL, issue 31's items 5 to 7), and the lowering refuses them by name, so `plan` lays out one
//! rank's program with each collective replaced by a stand-in that writes a buffer of its
//! result's type from its operand: all_reduce and reduce_scatter by a copy (of the block, for a
//! reduce-scatter), all_gather by N copies of the operand side by side. The stand-in carries the
//! collective's name, so the plan lists the buffer a backend receives into (NCCL may reduce in
//! place, so an all-reduce's buffer is the plan's upper bound). `compile` gets no stand-ins.

use qatc_ir::{Graph, IrError, Op};

/// Whether `g` has any collective (at its top level: a collective is never fused).
pub fn has_collectives(g: &Graph) -> bool {
    g.node_ids().into_iter().any(|n| is_collective(&g.node(n).op))
}

fn is_collective(op: &Op) -> bool {
    matches!(op, Op::AllReduce { .. } | Op::ReduceScatter { .. } | Op::AllGather { .. })
}

/// `g` with every collective replaced by its stand-in (see the module doc).
pub fn stand_ins(g: &Graph) -> Result<Graph, IrError> {
    let mut g = g.clone();
    for n in g.node_ids() {
        let op = g.node(n).op.clone();
        if !is_collective(&op) {
            continue;
        }
        let name = g.node(n).name.clone().unwrap_or_else(|| op.mnemonic().to_string());
        let x = g.operands(n)[0];
        let copy = Op::Affine { mul: 1.0, add: 0.0 };
        let s = match op {
            Op::AllReduce { .. } => g.add_named(copy, &[x], name)?,
            Op::ReduceScatter { world, .. } => {
                let rows = g.ty(x).shape.dims()[0] / world;
                let block = g.add(Op::Slice { axis: 0, start: 0, end: rows }, &[x])?;
                g.add_named(copy, &[block], name)?
            }
            Op::AllGather { world } => g.add_named(Op::Concat { axis: 0 }, &vec![x; world], name)?,
            _ => continue,
        };
        g.replace_all_uses(n, s);
    }
    g.remove_dead(false);
    Ok(g)
}
