//! Gradient accumulation as a loop: the step is built, fused and planned for one micro-batch and
//! run K times (`--grad-accum K`), so the graph, the compile and the plan do not grow with K.
//!
//! Three stages make one micro-batch's step into a loop body whose K runs give exactly what one
//! batch K times larger gives, i.e. what PyTorch accumulates with `(loss_k / K).backward()`:
//!
//! - `microbatch` (before autodiff): the loss is scaled by 1/K, so the backward's seed is 1/K;
//! - `accumulate` (after autodiff): each gradient is added to a running sum, the state input
//!   `accum.grad:NAME`, and the loss to `accum.loss`; clipping and AdamW read the sums;
//! - `apply_gate` (after AdamW): every other update (weights, moments, the step count) takes
//!   effect only when the data input `accum.apply` is 1, which the caller sets on the last run of
//!   a step; that run also zeroes the sums for the next step.
//!
//! So each run computes the optimizer's update too and keeps the old values on all but the last
//! (its cost is small next to a micro-batch's forward and backward: one pass over the trainable
//! tensors). Dropout seeds, ids and targets are per run, as each micro-batch's.
//!
//! [`unroll`] is the earlier form, K copies of the forward in one graph: kept as the reference the
//! loop is tested against.

use std::collections::HashMap;

use qatc_ir::{BinaryOp, DType, Graph, InputKind, NodeId, Op, Shape};

use crate::autodiff::grad_name;
use crate::error::{InPass, PassError};
use crate::pipeline::PassReport;
use crate::pipeline::Stage;
use crate::rebuild::copy_nodes;
use crate::zero::Parallel;

/// Data input, f32 []: 1 on the last micro-batch of an optimizer step, else 0.
pub const APPLY: &str = "accum.apply";

/// State input, f32 []: the sum of the micro-batches' scaled losses so far in this step.
pub const LOSS_SUM: &str = "accum.loss";

/// The state input holding the running sum of trainable `param`'s gradient.
pub fn grad_sum_name(param: &str) -> String {
    format!("accum.{}", grad_name(param))
}

/// Whether state input `name` is one of the running sums (zeroed by the last micro-batch, never
/// kept back by a gate: the fp16 loss scaler's finiteness test reads them instead).
pub fn is_sum(name: &str) -> bool {
    name == LOSS_SUM || name.strip_prefix("accum.").is_some_and(|g| g.starts_with("grad:"))
}

/// Stage `microbatch`: `loss` becomes loss / K, so its gradient is each micro-batch's share.
pub fn scale_loss(mut g: Graph, k: usize) -> Result<(Graph, PassReport), PassError> {
    let mut report = PassReport::new(Stage::Microbatch);
    report.set("micro_batches", k as i64);
    if k <= 1 {
        return Ok((g, report));
    }
    let loss = g.output("loss").ok_or(PassError::Invalid { pass: Stage::Microbatch, msg: "the graph has no `loss` output".into() })?;
    let share = g.add_named(Op::Affine { mul: 1.0 / k as f64, add: 0.0 }, &[loss], "loss.share").in_pass(Stage::Microbatch)?;
    replace_output(&mut g, "loss", share, Stage::Microbatch)?;
    Ok((g, report))
}

/// Stage `accumulate`: every `grad:NAME` output becomes `accum.grad:NAME` + the micro-batch's
/// gradient, and `loss` the running loss; the sums are updated, to 0 on the last micro-batch.
///
/// With ZeRO 2 and 3 over several ranks (`p.shards_gradients()`) each micro-batch's gradient is
/// first reduce-scattered (`data_parallel::reduce_gradients`), so a sum holds this rank's block.
pub fn accumulate(mut g: Graph, k: usize, p: Parallel) -> Result<(Graph, PassReport), PassError> {
    let pass = Stage::Accumulate;
    let mut report = PassReport::new(pass);
    if k <= 1 {
        return Ok((g, report));
    }
    let apply = g.input(APPLY, InputKind::Data, DType::F32, Shape::scalar()).in_pass(pass)?;
    let mut sums = vec![("loss".to_string(), LOSS_SUM.to_string())];
    let mut grads = Vec::new();
    for id in g.inputs() {
        if g.input_kind(id) == Some(InputKind::Trainable) {
            let name = g.node(id).name.clone().unwrap_or_default();
            sums.push((grad_name(&name), grad_sum_name(&name)));
            let gr = g
                .output(&grad_name(&name))
                .ok_or_else(|| PassError::Invalid { pass, msg: format!("no gradient of {name:?}: run autodiff first") })?;
            grads.push((grad_name(&name), gr));
        }
    }
    if p.shards_gradients() {
        let blocks = crate::data_parallel::reduce_gradients(&mut g, grads, p, pass, &mut report)?;
        replace_outputs(&mut g, &blocks, pass)?;
    }
    let mut elems = 0i64;
    for (output, sum_name) in sums {
        let value =
            g.output(&output).ok_or_else(|| PassError::Invalid { pass, msg: format!("no output {output:?}: run autodiff first") })?;
        let ty = g.ty(value).clone();
        let sum = g.input(&sum_name, InputKind::State, ty.dtype, ty.shape.clone()).in_pass(pass)?;
        let next = g.add_named(Op::Binary(BinaryOp::Add), &[sum, value], format!("{sum_name}.next")).in_pass(pass)?;
        replace_output(&mut g, &output, next, pass)?;
        let cond = broadcast(&mut g, apply, &ty.shape, pass)?;
        let zero = g.constant(0.0, ty.dtype, ty.shape.clone()).in_pass(pass)?;
        let kept = g.add_named(Op::Select, &[cond, zero, next], format!("{sum_name}.kept")).in_pass(pass)?;
        g.set_update(sum_name, kept).in_pass(pass)?;
        elems += ty.numel() as i64;
    }
    report.set("micro_batches", k as i64);
    report.set("summed_elements", elems);
    Ok((g, report))
}

/// Stage `apply_gate`: every update but the sums keeps its input's value unless `accum.apply`
/// is 1, so the optimizer's step happens once per K micro-batches.
pub fn gate(mut g: Graph) -> Result<(Graph, PassReport), PassError> {
    let pass = Stage::ApplyGate;
    let mut report = PassReport::new(pass);
    let Some(apply) = g.find_input(APPLY) else {
        return Err(PassError::Invalid { pass, msg: format!("no input {APPLY:?}: run accumulate first") });
    };
    let updates: Vec<(String, NodeId)> =
        g.outputs().iter().filter(|o| o.update && !is_sum(&o.name)).map(|o| (o.name.clone(), o.node)).collect();
    for (name, new) in updates {
        let old = g.find_input(&name).ok_or_else(|| PassError::Invalid { pass, msg: format!("update {name:?} has no input") })?;
        let shape = g.ty(old).shape.clone();
        let cond = broadcast(&mut g, apply, &shape, pass)?;
        let kept = g.add_named(Op::Select, &[cond, new, old], format!("{name}.if_applied")).in_pass(pass)?;
        replace_update(&mut g, &name, kept, pass)?;
        report.count("updates_gated", 1);
    }
    Ok((g, report))
}

/// `x` [] as `shape` (itself when `shape` is a scalar).
fn broadcast(g: &mut Graph, x: NodeId, shape: &Shape, pass: Stage) -> Result<NodeId, PassError> {
    if shape.rank() == 0 {
        return Ok(x);
    }
    g.add(Op::Broadcast { shape: shape.clone() }, &[x]).in_pass(pass)
}

/// Points each output (not an update) named in `new` at its node, keeping the outputs' order.
pub(crate) fn replace_outputs(g: &mut Graph, new: &[(String, NodeId)], pass: Stage) -> Result<(), PassError> {
    rewrite_outputs(g, pass, |o| if o.update { None } else { new.iter().find(|(n, _)| *n == o.name).map(|(_, id)| *id) })
}

/// Points output `name` (not an update) at `node`, keeping the outputs' order.
fn replace_output(g: &mut Graph, name: &str, node: NodeId, pass: Stage) -> Result<(), PassError> {
    rewrite_outputs(g, pass, |o| (o.name == name && !o.update).then_some(node))
}

/// Points update `name` at `node`, keeping the outputs' order.
fn replace_update(g: &mut Graph, name: &str, node: NodeId, pass: Stage) -> Result<(), PassError> {
    rewrite_outputs(g, pass, |o| (o.name == name && o.update).then_some(node))
}

fn rewrite_outputs(g: &mut Graph, pass: Stage, new: impl Fn(&qatc_ir::Output) -> Option<NodeId>) -> Result<(), PassError> {
    let outputs = g.outputs().to_vec();
    g.clear_outputs();
    for o in outputs {
        let node = new(&o).unwrap_or(o.node);
        if o.update {
            g.set_update(o.name, node).in_pass(pass)?;
        } else {
            g.set_output(o.name, node).in_pass(pass)?;
        }
    }
    Ok(())
}

/// The most nodes [`unroll`] may make (about 1.3 KB per node once differentiated).
pub const MAX_NODES: usize = 1 << 21;

/// The name of data input `name` in micro-batch `k` of an unrolled graph (`ids` -> `ids.0`).
pub fn micro_name(name: &str, k: usize) -> String {
    format!("{name}.{k}")
}

/// The unrolled form, the reference the loop is tested against: `k` copies of the model graph
/// sharing weights and state, data inputs renamed per micro-batch, `loss` the mean of the K
/// losses. Run it where `microbatch` would run, with K = 1 for the rest of the pipeline.
pub fn unroll(g: Graph, k: usize) -> Result<Graph, PassError> {
    let pass = Stage::Microbatch;
    if k <= 1 {
        return Ok(g);
    }
    let loss = g.output("loss").ok_or(PassError::Invalid { pass, msg: "the graph has no `loss` output".into() })?;
    if k.saturating_mul(g.len()) > MAX_NODES {
        return Err(PassError::Invalid { pass, msg: format!("{k} micro-batches of {} nodes exceed {MAX_NODES} nodes", g.len()) });
    }
    let order = g.topo_order().in_pass(pass)?;
    let mut out = Graph::new(g.name.clone());
    let mut shared = HashMap::new();
    for &n in &order {
        if matches!(g.input_kind(n), Some(kind) if kind != InputKind::Data) {
            let node = g.node(n);
            let id = out.add_node(node.op.clone(), &[], node.name.clone()).in_pass(pass)?;
            shared.insert(n, id);
        }
    }
    let mut total = None;
    for i in 0..k {
        let mut map = shared.clone();
        copy_nodes(&g, &mut out, &order, &mut map, &|name| micro_name(name, i)).in_pass(pass)?;
        let l = map[&loss];
        total = Some(match total {
            None => l,
            Some(t) => out.add(Op::Binary(BinaryOp::Add), &[t, l]).in_pass(pass)?,
        });
    }
    let total = total.ok_or(PassError::Invalid { pass, msg: "no micro-batches".into() })?;
    let mean = out.add_named(Op::Affine { mul: 1.0 / k as f64, add: 0.0 }, &[total], "loss.mean").in_pass(pass)?;
    out.set_output("loss", mean).in_pass(pass)?;
    out.remove_dead(false);
    Ok(out)
}
