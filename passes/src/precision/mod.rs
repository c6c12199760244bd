//! Mixed precision as a pass (`--precision bf16|fp16`): activations, their gradients and GEMM
//! operands are stored in the compute type C; reductions and GEMM accumulation stay f32 inside
//! the ops; trainable parameters keep f32 master copies that AdamW updates in f32, and the C copy
//! the forward reads is one cast per parameter per step. With fp16, the loss is scaled
//! dynamically (`scaling.rs`, PyTorch GradScaler's semantics). The op-by-op choices are one table,
//! `rules.rs`.
//!
//! It runs after autodiff and the optimizer (so it sees the whole step) and before remat and
//! fusion (so the planner and the kernels see the real byte sizes). The step splits in two:
//!
//! - the model: the forward and the backward, everything the loss and the raw gradients
//!   (`grad:NAME`, as autodiff made them) depend on. Typed by the table.
//! - the optimizer: what the raw gradients feed (clipping, AdamW). Left in f32; a gradient enters
//!   it through one conversion to f32 (and, with loss scaling, one multiplication by 1 / S).
//!
//! Conversions are `cast` nodes (`qatc dump --after precision` shows them), one per value and
//! type, placed under views (a C copy of a weight, then its transpose), named `NAME.bf16` after
//! what they convert.

mod rules;
mod scaling;

use std::collections::{HashMap, HashSet};

use qatc_ir::{DType, Graph, InputKind, NodeId, Op};
use serde::Serialize;

use crate::autodiff::{grad_name, LOSS_GRAD};
use crate::error::{InPass, PassError};
use crate::pipeline::PassReport;
use crate::pipeline::Stage;

pub use rules::{convertible, rule, Rule};
pub use scaling::{LossScaling, GRADS_FINITE, LOSS_SCALE};

/// `--precision`: the storage type of activations, gradients and GEMM operands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Precision {
    /// Everything in f32 (the pass does not run).
    #[default]
    Fp32,
    /// bfloat16 storage: f32's range, 8 bits of mantissa; no loss scaling needed.
    Bf16,
    /// IEEE half storage: 11 bits of mantissa, range to 65504; dynamic loss scaling.
    Fp16,
}

impl Precision {
    pub const ALL: [Precision; 3] = [Precision::Fp32, Precision::Bf16, Precision::Fp16];

    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }

    /// The type activations, their gradients and GEMM operands are stored in.
    pub fn compute(self) -> DType {
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::Fp16 => DType::F16,
        }
    }

    /// Whether the step scales its loss (fp16's narrow range needs it; bf16 has f32's).
    pub fn loss_scaling(self) -> bool {
        self == Precision::Fp16
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The raw gradient of every trainable input: the first node (in topological order) named
/// `grad:NAME`, which is autodiff's (clipping names its result the same, later).
fn raw_gradients(g: &Graph, order: &[NodeId]) -> Result<Vec<NodeId>, PassError> {
    let mut want: HashMap<String, Option<NodeId>> = HashMap::new();
    for p in g.inputs() {
        if g.input_kind(p) == Some(InputKind::Trainable) {
            want.insert(grad_name(g.node(p).name.as_deref().unwrap_or("")), None);
        }
    }
    if want.is_empty() {
        return Ok(Vec::new());
    }
    for &n in order {
        if let Some(slot @ None) = g.node(n).name.as_ref().and_then(|name| want.get_mut(name)) {
            *slot = Some(n);
        }
    }
    let mut grads = Vec::new();
    let mut names: Vec<_> = want.into_iter().collect();
    names.sort();
    for (name, n) in names {
        match n {
            Some(n) => grads.push(n),
            // a forward graph for evaluation has trainable weights but no gradients
            None if !g.outputs().iter().any(|o| o.update) => {}
            None => {
                return Err(PassError::Invalid { pass: Stage::Precision, msg: format!("no node {name:?}: the pass runs after autodiff") })
            }
        }
    }
    Ok(grads)
}

/// The optimizer's part of the step: strict descendants of the raw gradients that neither the
/// loss nor a raw gradient depends on, and the nodes that only they read (ZeRO's block of a
/// weight, which AdamW updates, is cut from the f32 master, not from its compute-type copy).
fn optimizer_region(g: &Graph, order: &[NodeId], grads: &[NodeId]) -> HashSet<NodeId> {
    let mut below: HashSet<NodeId> = HashSet::new();
    let grads: HashSet<NodeId> = grads.iter().copied().collect();
    for &n in order {
        if g.operands(n).iter().any(|o| grads.contains(o) || below.contains(o)) {
            below.insert(n);
        }
    }
    let mut above: HashSet<NodeId> = HashSet::new();
    let mut stack: Vec<NodeId> = grads.iter().copied().chain(g.output("loss")).collect();
    while let Some(n) = stack.pop() {
        if above.insert(n) {
            stack.extend(g.operands(n));
        }
    }
    below.retain(|n| !above.contains(n));
    for &n in order.iter().rev() {
        let users = g.users(n);
        let feeds_only_optimizer = !users.is_empty() && users.iter().all(|u| below.contains(u));
        if feeds_only_optimizer && !above.contains(&n) && !matches!(g.node(n).op, Op::Input { .. }) {
            below.insert(n);
        }
    }
    below
}

/// The new graph being built, with the conversions made so far.
struct Rewrite<'a> {
    src: &'a Graph,
    dst: Graph,
    /// src node -> its value in dst.
    map: HashMap<NodeId, NodeId>,
    /// (dst node, type) -> its converted copy.
    casts: HashMap<(NodeId, DType), NodeId>,
    compute: DType,
    report: PassReport,
}

impl Rewrite<'_> {
    /// `n` (a dst node) in type `to`: itself, a constant of that type, the view of a converted
    /// operand (so a weight is converted once, before its transposes and broadcasts), or a cast.
    fn convert(&mut self, n: NodeId, to: DType) -> Result<NodeId, PassError> {
        let node = self.dst.node(n).clone();
        if node.ty.dtype == to || !node.ty.dtype.is_float() {
            return Ok(n);
        }
        if let Some(&c) = self.casts.get(&(n, to)) {
            return Ok(c);
        }
        let c = match node.op {
            Op::Const { value, shape, .. } => self.dst.add(Op::Const { value, dtype: to, shape }, &[]).in_pass(Stage::Precision)?,
            Op::Reshape { .. } | Op::Transpose { .. } | Op::Slice { .. } | Op::Broadcast { .. } => {
                let src = self.dst.operands(n)[0];
                let inner = self.convert(src, to)?;
                self.dst.add(node.op.clone(), &[inner]).in_pass(Stage::Precision)?
            }
            _ => {
                self.report.count("casts", 1);
                let name = node.name.as_ref().map(|s| format!("{s}.{to}"));
                self.dst.add_node(Op::Cast { to }, &[n], name).in_pass(Stage::Precision)?
            }
        };
        self.casts.insert((n, to), c);
        Ok(c)
    }

    /// Copies model node `n` with the types of the table.
    fn model_node(&mut self, n: NodeId) -> Result<NodeId, PassError> {
        let node = self.src.node(n);
        let ops: Vec<NodeId> = self.src.operands(n).iter().map(|o| self.map[o]).collect();
        let c = self.compute;
        // operands the table may convert: floats of rank > 0 (see rules.rs)
        let open = |dst: &Graph, slot: usize, o: NodeId| {
            let t = dst.ty(o);
            t.dtype.is_float() && t.shape.rank() > 0 && convertible(&node.op, slot)
        };
        let (op, want) = match rule(&node.op) {
            Rule::Keep => (node.op.clone(), None),
            Rule::Compute => (node.op.clone(), Some(c)),
            Rule::Produce => match &node.op {
                Op::Dequantize { spec, .. } => (Op::Dequantize { spec: *spec, to: c }, None),
                other => (other.clone(), None),
            },
            Rule::Follow => {
                let any_c = ops.iter().enumerate().any(|(i, &o)| open(&self.dst, i, o) && self.dst.ty(o).dtype == c);
                (node.op.clone(), any_c.then_some(c))
            }
            Rule::Master => (node.op.clone(), Some(DType::F32)),
            Rule::Refuse => {
                return Err(PassError::Invalid {
                    pass: Stage::Precision,
                    msg: format!("{} must come after this pass", self.src.describe(n)),
                })
            }
        };
        let mut args = Vec::with_capacity(ops.len());
        for (i, &o) in ops.iter().enumerate() {
            args.push(match want {
                Some(t) if open(&self.dst, i, o) || (t == DType::F32 && self.dst.ty(o).dtype.is_float()) => self.convert(o, t)?,
                _ => o,
            });
        }
        let id = self.dst.add_node(op, &args, node.name.clone()).in_pass(Stage::Precision)?;
        if self.dst.ty(id).dtype == c {
            self.report.count("values_in_compute_type", 1);
        }
        Ok(id)
    }
}

/// The pass: retypes the step for `p` (a no-op for fp32), with `scaling` for fp16.
pub fn precision(g: Graph, p: Precision, scaling: &LossScaling) -> Result<(Graph, PassReport), PassError> {
    if p == Precision::Fp32 {
        return Ok((g, PassReport::new(Stage::Precision)));
    }
    let order = g.topo_order().in_pass(Stage::Precision)?;
    let grads = raw_gradients(&g, &order)?;
    let optimizer = optimizer_region(&g, &order, &grads);
    let scale_loss = p.loss_scaling() && !grads.is_empty();
    let mut rw = Rewrite {
        src: &g,
        dst: Graph::new(g.name.clone()),
        map: HashMap::new(),
        casts: HashMap::new(),
        compute: p.compute(),
        report: PassReport::new(Stage::Precision),
    };
    // with loss scaling the backward starts from S: dloss = S instead of 1
    let scale = if scale_loss { Some(scaling::scale_input(&mut rw.dst)?) } else { None };
    let mut inv = None;
    // a raw gradient as the optimizer reads it: f32, unscaled
    let mut entering: HashMap<NodeId, NodeId> = HashMap::new();
    for &n in &order {
        let id = if optimizer.contains(&n) {
            let node = g.node(n);
            let mut args = Vec::new();
            for o in g.operands(n) {
                let v = rw.map[&o];
                args.push(if rw.dst.ty(v).dtype.is_float() && rw.dst.ty(v).dtype != DType::F32 {
                    enter_optimizer(&mut rw, o, &grads, scale, &mut inv, &mut entering)?
                } else {
                    v
                });
            }
            rw.dst.add_node(node.op.clone(), &args, node.name.clone()).in_pass(Stage::Precision)?
        } else if let (Some((_, s)), Some(LOSS_GRAD)) = (scale, g.node(n).name.as_deref()) {
            if !matches!(g.node(n).op, Op::Const { .. }) {
                return Err(PassError::Invalid { pass: Stage::Precision, msg: format!("{LOSS_GRAD:?} is not autodiff's seed") });
            }
            s
        } else {
            rw.model_node(n)?
        };
        rw.map.insert(n, id);
    }
    // outputs: a raw gradient read by the caller (parity tests) is the f32 unscaled one
    for o in g.outputs() {
        let v = if grads.contains(&o.node) && rw.dst.ty(rw.map[&o.node]).dtype != DType::F32 {
            enter_optimizer(&mut rw, o.node, &grads, scale, &mut inv, &mut entering)?
        } else {
            rw.map[&o.node]
        };
        if o.update {
            rw.dst.set_update(o.name.clone(), v).in_pass(Stage::Precision)?;
        } else {
            rw.dst.set_output(o.name.clone(), v).in_pass(Stage::Precision)?;
        }
    }
    if let Some((state, _)) = scale {
        // the finiteness test reads every gradient as the optimizer does: f32 and unscaled
        let mut checked = Vec::new();
        let apply = g.find_input(crate::microbatch::APPLY);
        if apply.is_some() {
            // accumulating: the optimizer reads the sums, so a non-finite micro-batch makes the
            // whole step non-finite and it is skipped, as GradScaler skips it
            for o in g.outputs().iter().filter(|o| o.update && o.name != crate::microbatch::LOSS_SUM && crate::microbatch::is_sum(&o.name))
            {
                let next = g.operands(o.node).get(2).copied().ok_or_else(|| PassError::Invalid {
                    pass: Stage::Precision,
                    msg: format!("update {:?} is not accumulate's select", o.name),
                })?;
                checked.push(rw.map[&next]);
            }
        } else {
            for &gr in &grads {
                checked.push(enter_optimizer(&mut rw, gr, &grads, scale, &mut inv, &mut entering)?);
            }
        }
        let apply = apply.map(|a| rw.map[&a]);
        let gated = scaling::gate_updates(&mut rw.dst, &checked, state, scaling, apply)?;
        rw.report.set("updates_gated", gated as i64);
    }
    rw.report.set("gradients", grads.len() as i64);
    let Rewrite { mut dst, report, .. } = rw;
    dst.remove_dead(false);
    Ok((dst, report))
}

/// The f32 value of model node `o` where the optimizer reads it: a cast, then 1 / S with loss
/// scaling. Only gradients cross over in a lower type.
fn enter_optimizer(
    rw: &mut Rewrite,
    o: NodeId,
    grads: &[NodeId],
    scale: Option<(NodeId, NodeId)>,
    inv: &mut Option<NodeId>,
    entering: &mut HashMap<NodeId, NodeId>,
) -> Result<NodeId, PassError> {
    if let Some(&v) = entering.get(&o) {
        return Ok(v);
    }
    if !grads.contains(&o) {
        let what = rw.src.describe(o);
        return Err(PassError::Invalid {
            pass: Stage::Precision,
            msg: format!("{what} reaches the optimizer in a lower type but is not a gradient"),
        });
    }
    let v = rw.convert(rw.map[&o], DType::F32)?;
    let v = match scale {
        Some((_, s)) => {
            let i = match *inv {
                Some(i) => i,
                None => *inv.insert(scaling::inverse(&mut rw.dst, s)?),
            };
            let name = rw.src.node(o).name.as_ref().map(|n| format!("{n}.unscaled"));
            scaling::unscale(&mut rw.dst, v, i, name)?
        }
        None => v,
    };
    rw.report.count("gradients_to_f32", 1);
    entering.insert(o, v);
    Ok(v)
}
