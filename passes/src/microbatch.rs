//! Gradient accumulation as graph structure: K copies of the forward pass, one per micro-batch,
//! sharing the weights, with `loss` = the mean of the K losses. Differentiating that loss gives
//! exactly the gradient of one batch K times larger, i.e. what PyTorch accumulates with
//! `(loss_k / K).backward()` over K micro-batches. The memory planner later orders the copies so
//! that one micro-batch's activations die before the next one's are made.

use std::collections::HashMap;

use qatc_ir::{BinaryOp, Graph, InputKind, Op};

use crate::error::{InPass, PassError};
use crate::pipeline::PassReport;
use crate::pipeline::Stage;
use crate::rebuild::copy_nodes;

/// The most nodes unrolling may make. A step graph takes about 1.3 KB per node once
/// differentiated (2.2 nodes per unrolled one), so this is a few gigabytes: the embedded model
/// unrolls about 6,600 micro-batches within it. More is refused rather than left to exhaust
/// memory.
pub const MAX_NODES: usize = 1 << 21;

/// The name of data input `name` in micro-batch `k` (`ids` -> `ids.0`, `ids.1`, ...).
pub fn micro_name(name: &str, k: usize) -> String {
    format!("{name}.{k}")
}

/// Unrolls `k` micro-batches. Data inputs are renamed per micro-batch; weights, state and the
/// other outputs' nodes are shared. Only the `loss` output survives (per-batch logits do not).
pub fn microbatch(g: Graph, k: usize) -> Result<(Graph, PassReport), PassError> {
    let mut report = PassReport::new(Stage::Microbatch);
    report.set("micro_batches", k as i64);
    if k <= 1 {
        return Ok((g, report));
    }
    let loss = g.output("loss").ok_or(PassError::Invalid { pass: Stage::Microbatch, msg: "the graph has no `loss` output".into() })?;
    if k.saturating_mul(g.len()) > MAX_NODES {
        return Err(PassError::Invalid {
            pass: Stage::Microbatch,
            msg: format!(
                "{k} micro-batches of {} nodes each would make a graph of more than {MAX_NODES} nodes; accumulate fewer (--grad-accum) over larger micro-batches (--batch)",
                g.len()
            ),
        });
    }
    let order = g.topo_order().in_pass(Stage::Microbatch)?;
    let mut out = Graph::new(g.name.clone());
    let mut shared = HashMap::new();
    // Weights and state first, once.
    for &n in &order {
        if matches!(g.input_kind(n), Some(kind) if kind != InputKind::Data) {
            let node = g.node(n);
            let id = out.add_node(node.op.clone(), &[], node.name.clone()).in_pass(Stage::Microbatch)?;
            shared.insert(n, id);
        }
    }
    let mut total = None;
    for i in 0..k {
        let mut map = shared.clone();
        copy_nodes(&g, &mut out, &order, &mut map, &|name| micro_name(name, i)).in_pass(Stage::Microbatch)?;
        let l = map[&loss];
        total = Some(match total {
            None => l,
            Some(t) => out.add(Op::Binary(BinaryOp::Add), &[t, l]).in_pass(Stage::Microbatch)?,
        });
    }
    let total = total.ok_or(PassError::Invalid { pass: Stage::Microbatch, msg: "no micro-batches".into() })?;
    let mean = out.add_named(Op::Affine { mul: 1.0 / k as f64, add: 0.0 }, &[total], "loss.mean").in_pass(Stage::Microbatch)?;
    out.set_output("loss", mean).in_pass(Stage::Microbatch)?;
    out.remove_dead(false);
    report.set("nodes", out.len() as i64);
    Ok((out, report))
}
