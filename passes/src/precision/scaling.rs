//! Dynamic loss scaling for fp16, with PyTorch GradScaler's semantics, as graph nodes:
//!
//! ```text
//!   S = loss_scale[0]                       state f32[2] = [scale, good steps], starts [2^16, 0]
//!   loss.grad = S                           the backward starts from S instead of 1: every
//!                                           gradient is scaled by S (fp16 keeps small ones)
//!   g = f32(g_C) * (1 / S)                  unscaled in f32, before clipping and AdamW
//!   finite = all_finite(g_1) * all_finite(g_2) * ...          output `grads_finite`
//!   every update u of the step (parameters, moments, step count):
//!       u' = select(finite, u, its old value)                 a non-finite step changes nothing
//!   loss_scale' = loss_scale(loss_scale, finite)              halve on overflow; double after
//!                                                             `interval` good steps in a row
//! ```

use qatc_ir::{BinaryOp, DType, Graph, InputKind, NodeId, Op, Shape, TensorType, UnaryOp};
use serde::Serialize;

use crate::error::{InPass, PassError};

use crate::pipeline::Stage;

/// The state input (and update output) holding [scale, good steps].
pub const LOSS_SCALE: &str = "loss_scale";
/// The output that is 1 when the step's gradients were finite (and the update applied), else 0.
pub const GRADS_FINITE: &str = "grads_finite";

/// GradScaler's settings; the defaults are PyTorch's.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LossScaling {
    /// The scale of the first step.
    pub init: f64,
    /// The factor after `interval` finite steps in a row.
    pub growth: f64,
    /// The factor after a step with a non-finite gradient.
    pub backoff: f64,
    pub interval: usize,
}

impl Default for LossScaling {
    fn default() -> LossScaling {
        LossScaling { init: 65536.0, growth: 2.0, backoff: 0.5, interval: 2000 }
    }
}

impl LossScaling {
    /// The value the `loss_scale` state starts from: [init, 0 good steps].
    pub fn initial_state(&self) -> [f32; 2] {
        [self.init as f32, 0.0]
    }
}

/// The scale S as a scalar of `g`, read from the state input (created here).
pub(crate) fn scale_input(g: &mut Graph) -> Result<(NodeId, NodeId), PassError> {
    let state = g.input(LOSS_SCALE, InputKind::State, DType::F32, [2]).in_pass(Stage::Precision)?;
    let s = g.add(Op::Slice { axis: 0, start: 0, end: 1 }, &[state]).in_pass(Stage::Precision)?;
    let s = g.add_named(Op::Reshape { shape: Shape::scalar() }, &[s], "loss_scale.scale").in_pass(Stage::Precision)?;
    Ok((state, s))
}

/// g * (1 / S), g an f32 gradient.
pub(crate) fn unscale(g: &mut Graph, grad: NodeId, inv: NodeId, name: Option<String>) -> Result<NodeId, PassError> {
    let shape = g.ty(grad).shape.clone();
    let inv = if shape.rank() == 0 { inv } else { g.add(Op::Broadcast { shape }, &[inv]).in_pass(Stage::Precision)? };
    g.add_node(Op::Binary(BinaryOp::Mul), &[grad, inv], name).in_pass(Stage::Precision)
}

/// 1 / S (exact: S is a power of two).
pub(crate) fn inverse(g: &mut Graph, s: NodeId) -> Result<NodeId, PassError> {
    g.add_named(Op::Unary(UnaryOp::Recip), &[s], "loss_scale.inv").in_pass(Stage::Precision)
}

/// The product of every gradient's finiteness flag, as output [`GRADS_FINITE`]; then every update
/// output is kept only when it is 1, and the scale's own update is added. Accumulating
/// (`apply`: the last micro-batch's flag), the running sums are not kept back (the last
/// micro-batch zeroes them whatever the step did) and the scale moves once per step.
pub(crate) fn gate_updates(
    g: &mut Graph,
    grads: &[NodeId],
    state: NodeId,
    h: &LossScaling,
    apply: Option<NodeId>,
) -> Result<usize, PassError> {
    let mut finite: Option<NodeId> = None;
    for &gr in grads {
        let f = g.add(Op::AllFinite, &[gr]).in_pass(Stage::Precision)?;
        finite = Some(match finite {
            None => f,
            Some(prev) => g.add(Op::Binary(BinaryOp::Mul), &[prev, f]).in_pass(Stage::Precision)?,
        });
    }
    let finite = match finite {
        Some(f) => f,
        None => return Err(PassError::Invalid { pass: Stage::Precision, msg: "loss scaling needs gradients: run autodiff first".into() }),
    };
    g.set_name(finite, GRADS_FINITE);
    let outputs = g.outputs().to_vec();
    g.clear_outputs();
    let mut gated = 0;
    for o in outputs {
        if !o.update || crate::microbatch::is_sum(&o.name) {
            if o.update {
                g.set_update(o.name, o.node).in_pass(Stage::Precision)?;
            } else {
                g.set_output(o.name, o.node).in_pass(Stage::Precision)?;
            }
            continue;
        }
        let old = g
            .find_input(&o.name)
            .ok_or_else(|| PassError::Invalid { pass: Stage::Precision, msg: format!("update {:?} has no input", o.name) })?;
        let ty: TensorType = g.ty(old).clone();
        let cond = if ty.shape.rank() == 0 {
            finite
        } else {
            g.add(Op::Broadcast { shape: ty.shape.clone() }, &[finite]).in_pass(Stage::Precision)?
        };
        let kept = g.add_named(Op::Select, &[cond, o.node, old], format!("{}.if_finite", o.name)).in_pass(Stage::Precision)?;
        g.set_update(o.name, kept).in_pass(Stage::Precision)?;
        gated += 1;
    }
    let next = g
        .add_named(Op::LossScale { interval: h.interval, growth: h.growth, backoff: h.backoff }, &[state, finite], "loss_scale.next")
        .in_pass(Stage::Precision)?;
    let next = match apply {
        Some(a) => {
            let cond = g.add(Op::Broadcast { shape: g.ty(state).shape.clone() }, &[a]).in_pass(Stage::Precision)?;
            g.add_named(Op::Select, &[cond, next, state], "loss_scale.if_applied").in_pass(Stage::Precision)?
        }
        None => next,
    };
    g.set_update(LOSS_SCALE, next).in_pass(Stage::Precision)?;
    g.set_output(GRADS_FINITE, finite).in_pass(Stage::Precision)?;
    Ok(gated)
}
