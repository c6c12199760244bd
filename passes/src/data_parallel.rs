//! Data parallelism over `--ranks N` (PyTorch DDP's semantics): each rank runs the same step on
//! its own B rows of a global batch of N B, and the gradients the optimizer reads are averaged
//! over the ranks, so every rank takes the step one rank would take on the whole batch. The loss
//! the step reports is the global one (the mean of the ranks' means: every rank has B rows), and
//! clipping reads the global norm (it clips the averaged gradients).
//!
//! Collectives, one per tensor, grouped into buckets of about [`BUCKET_BYTES`] (DDP's 25 MB)
//! in the order the backward produces the gradients (the last layers' first), each node named
//! `dp.bN:grad:NAME`. One collective per tensor rather than one over a concatenated bucket: the
//! sharded stages then cut every tensor alike (`zero::Shard`), the plan and the executors see no
//! packing copy, and a backend that overlaps communication with the backward can still issue a
//! bucket's collectives together (NCCL groups them, `ncclGroupStart`); the bucket is the unit of
//! that grouping, and of the plan's figures.
//!
//! With `--grad-accum K` the step is one micro-batch's program run K times, with no branch in
//! it, so the collectives run on every run: DDP's `no_sync` (communication only on the run that
//! applies the update) needs control flow the loop body does not have. What is exact: at ZeRO 0
//! and 1 the running sum (`accum.grad:NAME` + this micro-batch's gradient) is reduced, and only
//! the last run's result reaches the update (`apply_gate`); at ZeRO 2 and 3 each micro-batch's
//! gradient is reduce-scattered before it is added, so the sums hold blocks. Either way a step
//! moves K times the bytes of one reduction: the cost of the loop, stated in the plan.

use qatc_ir::{Graph, InputKind, NodeId, Op, Reduce};

use crate::autodiff::grad_name;
use crate::error::{InPass, PassError};
use crate::pipeline::{PassReport, Stage};
use crate::zero::{self, Parallel, Shard};

/// A bucket's size (PyTorch DDP's `bucket_cap_mb` default, 25 MiB).
pub const BUCKET_BYTES: usize = 25 << 20;

/// The name of gradient `grad`'s collective in bucket `bucket`.
pub fn collective_name(bucket: usize, grad: &str) -> String {
    format!("dp.b{bucket}:{grad}")
}

/// The trainable inputs' gradients (name, gradient node), in the order the backward produces
/// them: by the gradient's position in the graph's topological order.
pub(crate) fn backward_order(g: &Graph, grads: Vec<(String, NodeId)>, pass: Stage) -> Result<Vec<(String, NodeId)>, PassError> {
    let order = g.topo_order().in_pass(pass)?;
    let mut at = vec![usize::MAX; order.iter().map(|n| n.index() + 1).max().unwrap_or(0)];
    for (i, n) in order.iter().enumerate() {
        at[n.index()] = i;
    }
    let mut grads = grads;
    grads.sort_by_key(|(name, n)| (at.get(n.index()).copied().unwrap_or(usize::MAX), name.clone()));
    Ok(grads)
}

/// Each gradient reduced over the ranks in buckets of [`BUCKET_BYTES`]: its mean (ZeRO 0) or this
/// rank's block of its mean (ZeRO 1 to 3). Returns (name, reduced node) in bucket order.
pub(crate) fn reduce_gradients(
    g: &mut Graph,
    grads: Vec<(String, NodeId)>,
    p: Parallel,
    pass: Stage,
    report: &mut PassReport,
) -> Result<Vec<(String, NodeId)>, PassError> {
    let mut out = Vec::new();
    let (mut bucket, mut filled) = (0usize, 0usize);
    for (name, gr) in backward_order(g, grads, pass)? {
        let bytes = g.ty(gr).bytes();
        if filled > 0 && filled + bytes > BUCKET_BYTES {
            bucket += 1;
            filled = 0;
        }
        filled += bytes;
        let cname = collective_name(bucket, &name);
        let reduced = match p.sharded() {
            None => g.add_named(Op::AllReduce { reduce: Reduce::Mean, world: p.ranks }, &[gr], cname).in_pass(pass)?,
            Some(world) => {
                report.count("padding_elements", Shard::new(g.ty(gr).numel(), world).padding() as i64);
                zero::reduce_scatter(g, gr, world, cname, pass)?
            }
        };
        report.count("reduced_bytes", bytes as i64);
        out.push((name, reduced));
    }
    if !out.is_empty() {
        report.set("buckets", bucket as i64 + 1);
    }
    Ok(out)
}

/// Stage `data_parallel` (after `accumulate`, before `clip`): the loss is all-reduced (mean) and
/// each trainable gradient the optimizer reads is averaged over the ranks, in buckets; from
/// ZeRO 1 on as this rank's block. At one rank it changes nothing.
pub fn data_parallel(mut g: Graph, p: Parallel) -> Result<(Graph, PassReport), PassError> {
    let pass = Stage::DataParallel;
    let mut report = PassReport::new(pass);
    if !p.distributed() {
        return Ok((g, report));
    }
    report.set("ranks", p.ranks as i64);
    report.set("zero", i64::from(p.zero));
    let mut grads = Vec::new();
    for id in g.inputs() {
        if g.input_kind(id) != Some(InputKind::Trainable) {
            continue;
        }
        let name = grad_name(&g.node(id).name.clone().unwrap_or_default());
        let gr = g.output(&name).ok_or_else(|| PassError::Invalid { pass, msg: format!("no output {name:?}: run autodiff first") })?;
        // stage 2 and 3 with --grad-accum: `accumulate` already reduce-scattered it into a block
        if g.ty(gr).shape == g.ty(id).shape {
            grads.push((name, gr));
        }
    }
    let reduced = reduce_gradients(&mut g, grads, p, pass, &mut report)?;
    let loss = g.output("loss").ok_or(PassError::Invalid { pass, msg: "the graph has no `loss` output".into() })?;
    let global = g.add_named(Op::AllReduce { reduce: Reduce::Mean, world: p.ranks }, &[loss], "loss.global").in_pass(pass)?;
    let mut new = reduced;
    new.push(("loss".into(), global));
    crate::microbatch::replace_outputs(&mut g, &new, pass)?;
    Ok((g, report))
}

/// What one collective of a rank's step moves.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Traffic {
    /// The collective's node name (`dp.bN:grad:NAME`, `loss.global`, `zero:NAME`, ...).
    pub name: String,
    pub op: &'static str,
    pub world: usize,
    /// The bytes of its operand and of its result on this rank.
    pub operand_bytes: usize,
    pub result_bytes: usize,
    /// The bytes this rank sends per run under a ring algorithm (NCCL's and MPI's for large
    /// messages): all-reduce 2 (N - 1) / N of the tensor, reduce-scatter (N - 1) / N of its
    /// operand, all-gather (N - 1) / N of its result.
    pub sent_bytes: usize,
}

/// Every collective of step `g` (fused or not: a collective is never fused), in the graph's
/// topological order, with what it moves per run.
pub fn traffic(g: &Graph) -> Result<Vec<Traffic>, qatc_ir::IrError> {
    let mut out = Vec::new();
    for n in g.topo_order()? {
        let node = g.node(n);
        let (world, factor) = match node.op {
            Op::AllReduce { world, .. } => (world, 2),
            Op::ReduceScatter { world, .. } | Op::AllGather { world } => (world, 1),
            _ => continue,
        };
        let operand_bytes = g.operands(n).first().map_or(0, |&x| g.ty(x).bytes());
        let result_bytes = g.ty(n).bytes();
        let whole = if matches!(node.op, Op::AllGather { .. }) { result_bytes } else { operand_bytes };
        let sent_bytes = (factor * (world - 1) * whole).div_ceil(world.max(1));
        out.push(Traffic {
            name: node.name.clone().unwrap_or_default(),
            op: node.op.mnemonic(),
            world,
            operand_bytes,
            result_bytes,
            sent_bytes,
        });
    }
    Ok(out)
}
