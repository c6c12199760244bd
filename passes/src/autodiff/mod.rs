//! Reverse-mode autodiff. Given a graph with a scalar `loss` output and some `Trainable` inputs,
//! appends the backward pass and declares one output `grad:NAME` per trainable input.
//!
//! Only what is needed is built: a node gets a gradient when it lies on a path from a trainable
//! input to the loss, so frozen weights get no weight-gradient matmul and frozen branches that no
//! trainable tensor feeds get no backward at all.

mod assemble;
mod rules;

use std::collections::HashMap;

use qatc_ir::{BinaryOp, Graph, InputKind, NodeId, Op, Shape};

use crate::error::{InPass, PassError};
use crate::pipeline::PassReport;
use crate::pipeline::Stage;

/// The name of the backward's seed, d loss / d loss = 1 (loss scaling replaces it by the scale).
pub const LOSS_GRAD: &str = qatc_ir::role::GRADIENT_SEED;

/// The output name of a trainable input's gradient.
pub fn grad_name(param: &str) -> String {
    format!("grad:{param}")
}

/// Differentiates output `loss` with respect to every `Trainable` input.
pub fn autodiff(mut g: Graph) -> Result<(Graph, PassReport), PassError> {
    let mut report = PassReport::new(Stage::Autodiff);
    let loss = g.output("loss").ok_or(PassError::Invalid { pass: Stage::Autodiff, msg: "the graph has no `loss` output".into() })?;
    if g.ty(loss).shape.rank() != 0 {
        return Err(PassError::Invalid { pass: Stage::Autodiff, msg: format!("loss must be a scalar, got {}", g.ty(loss)) });
    }
    let trainable: Vec<NodeId> = g.inputs().into_iter().filter(|&i| g.input_kind(i) == Some(InputKind::Trainable)).collect();
    if trainable.is_empty() {
        return Err(PassError::Invalid { pass: Stage::Autodiff, msg: "no trainable inputs: nothing to differentiate".into() });
    }
    let order = g.topo_order().in_pass(Stage::Autodiff)?;

    // needs[n]: n depends on a trainable input, so its gradient can reach one.
    let mut needs: HashMap<NodeId, bool> = HashMap::new();
    for &n in &order {
        let v = g.input_kind(n) == Some(InputKind::Trainable) || g.operands(n).iter().any(|o| needs[o]);
        needs.insert(n, v);
    }
    // Only nodes the loss depends on matter; walk back from the loss.
    let position: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let forward_nodes = order.len();

    // Gradient contributions per node, summed when the node is first visited in reverse order.
    let mut pending: HashMap<NodeId, Vec<NodeId>> = HashMap::new();
    let seed = g.constant(1.0, g.ty(loss).dtype, Shape::scalar()).in_pass(Stage::Autodiff)?;
    g.set_name(seed, LOSS_GRAD);
    pending.insert(loss, vec![seed]);
    let mut grads: HashMap<NodeId, NodeId> = HashMap::new();

    for &n in order[..=position[&loss]].iter().rev() {
        let Some(mut parts) = pending.remove(&n) else { continue };
        // Contributions arrive in reverse topological order of their readers; summing them in
        // forward order lets a schedule that runs the readers' backwards one after the other
        // (micro-batches under --grad-accum) fold each contribution in as it is made, instead of
        // holding all of them until the first reader's comes last.
        parts.reverse();
        if parts.len() > 1 {
            let before = parts.len();
            parts = assemble::assemble_slices(&mut g, &parts).in_pass(Stage::Autodiff)?;
            if parts.len() < before {
                report.count("slice_grads_assembled", (before - parts.len() + 1) as i64);
            }
        }
        let mut dy = parts[0];
        for &p in &parts[1..] {
            dy = g.add(Op::Binary(BinaryOp::Add), &[dy, p]).in_pass(Stage::Autodiff)?;
            report.count("grad_sums", 1);
        }
        grads.insert(n, dy);
        let x = g.operands(n);
        let wants: Vec<bool> = x.iter().map(|o| needs[o]).collect();
        if !wants.iter().any(|&w| w) {
            continue;
        }
        let op = g.node(n).op.clone();
        let describe = g.describe(n);
        let mut ctx = rules::Ctx { g: &mut g, x: x.clone(), y: n, dy, wants };
        let dx = rules::vjp(&op, &mut ctx, &|| describe.clone())?;
        for (o, d) in x.iter().zip(dx) {
            if let Some(d) = d {
                pending.entry(*o).or_default().push(d);
            }
        }
        report.count("rules_applied", 1);
    }

    for &p in &trainable {
        let name = g.node(p).name.clone().unwrap_or_default();
        let gr = match grads.get(&p) {
            Some(&gr) => gr,
            None => {
                // Trainable but unused by the loss: its gradient is zero.
                report.notes.push(format!("{name} does not reach the loss; its gradient is zero"));
                let ty = g.ty(p).clone();
                g.constant(0.0, ty.dtype, ty.shape).in_pass(Stage::Autodiff)?
            }
        };
        g.set_name(gr, grad_name(&name));
        g.set_output(grad_name(&name), gr).in_pass(Stage::Autodiff)?;
    }
    // the zero-padded slice gradients `assemble` replaced
    let dead = g.remove_dead(false);
    if dead > 0 {
        report.count("dead_removed", dead as i64);
    }
    report.set("trainable", trainable.len() as i64);
    report.set("forward_nodes", forward_nodes as i64);
    report.set("backward_nodes", (g.len() - forward_nodes) as i64);
    Ok((g, report))
}
