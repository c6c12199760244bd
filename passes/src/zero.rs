//! ZeRO (Rajbhandari et al. 2020) over `--ranks N`: what each rank holds of a trainable tensor,
//! and the stage that shards the parameters themselves.
//!
//! - stage 1 shards the optimizer state: each gradient is reduce-scattered (this rank's block of
//!   the mean), AdamW updates this rank's block of the weight with moments of that block's size,
//!   and the new weight is all-gathered (`optim::adamw` through [`Shards`]);
//! - stage 2 also shards the gradients: with `--grad-accum K` the running sums hold this rank's
//!   block, each micro-batch's gradient reduce-scattered before it is added
//!   (`microbatch::accumulate`); with K = 1 the step keeps no gradient between runs, so stage 2 is
//!   stage 1;
//! - stage 3 also shards the trainable parameters ([`zero3`]): the input `NAME` is this rank's
//!   block, all-gathered again before each use in the forward and the backward (one gather per
//!   using node, so the planner frees the whole weight after that use), and AdamW needs nothing
//!   more: the weight, its gradient and its moments are all blocks.
//!
//! One layout, every tensor on its own (as FSDP's per-parameter sharding; no flat buffer over
//! the model, so a tensor's name, type and update stay its own): flattened, padded with zeros to
//! a multiple of N (`Shard::padded`, explicit in the graph as a concatenation with a zero
//! constant), rank r holding elements [r m, (r + 1) m). Padding is zero in every weight, gradient
//! and moment, so it stays zero through AdamW and adds nothing to a norm.
//!
//! The rank's index is data: the input `rank` (i32 [1]), which the caller sets to r, so every rank
//! runs the same program. Only stages 1 and 2 read it (the block of the replicated weight AdamW
//! updates); the collectives slice their own results.

use qatc_ir::{DType, Graph, InputKind, NodeId, Op, Reduce, Shape, TensorType};

use crate::autodiff::grad_name;
use crate::error::{InPass, PassError};
use crate::pipeline::{PassReport, Stage};

/// Data input, i32 [1]: this rank's index in 0..N.
pub const RANK: &str = "rank";

/// How the step is spread over ranks: `--ranks N --zero S`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Parallel {
    /// Data-parallel ranks, each with B rows of the global batch of N B.
    pub ranks: usize,
    /// The ZeRO stage, 0 (plain data parallelism) to 3.
    pub zero: u8,
}

impl Default for Parallel {
    fn default() -> Parallel {
        Parallel { ranks: 1, zero: 0 }
    }
}

impl Parallel {
    /// The highest ZeRO stage.
    pub const MAX_ZERO: u8 = 3;

    /// Whether the step exchanges anything at all.
    pub fn distributed(self) -> bool {
        self.ranks > 1
    }

    /// The world over which gradients, moments (and at stage 3 weights) are sharded, if they are.
    pub fn sharded(self) -> Option<usize> {
        (self.ranks > 1 && self.zero >= 1).then_some(self.ranks)
    }

    /// Whether the running sums of `--grad-accum` hold blocks (stage 2 and 3).
    pub fn shards_gradients(self) -> bool {
        self.ranks > 1 && self.zero >= 2
    }

    /// Whether the trainable inputs themselves are blocks (stage 3).
    pub fn shards_parameters(self) -> bool {
        self.ranks > 1 && self.zero >= 3
    }

    /// What is wrong with these settings, if anything.
    pub fn check(self) -> Result<(), String> {
        if self.ranks == 0 {
            return Err("--ranks must be at least 1".into());
        }
        if self.zero > Self::MAX_ZERO {
            return Err(format!("--zero {} is not a ZeRO stage (0, 1, 2 or 3)", self.zero));
        }
        Ok(())
    }
}

/// One tensor's layout over `world` ranks: `numel` elements in blocks of `block`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub numel: usize,
    pub world: usize,
    /// Elements per rank: ceil(numel / world).
    pub block: usize,
}

impl Shard {
    pub fn new(numel: usize, world: usize) -> Shard {
        Shard { numel, world, block: numel.div_ceil(world.max(1)) }
    }

    /// The flattened tensor's length once padded: world * block.
    pub fn padded(self) -> usize {
        self.world * self.block
    }

    /// The zeros appended.
    pub fn padding(self) -> usize {
        self.padded() - self.numel
    }
}

/// `x` flattened and padded with zeros to [world * block] (the padding a node of its own).
pub(crate) fn flat_padded(g: &mut Graph, x: NodeId, world: usize, pass: Stage) -> Result<NodeId, PassError> {
    let ty = g.ty(x).clone();
    let s = Shard::new(ty.numel(), world);
    let flat = if ty.shape.rank() == 1 { x } else { g.add(Op::Reshape { shape: Shape::new([s.numel]) }, &[x]).in_pass(pass)? };
    if s.padding() == 0 {
        return Ok(flat);
    }
    let zeros = g.constant(0.0, ty.dtype, Shape::new([s.padding()])).in_pass(pass)?;
    g.add(Op::Concat { axis: 0 }, &[flat, zeros]).in_pass(pass)
}

/// This rank's block of the mean over ranks of `x` (a gradient): [block].
pub(crate) fn reduce_scatter(g: &mut Graph, x: NodeId, world: usize, name: String, pass: Stage) -> Result<NodeId, PassError> {
    let flat = flat_padded(g, x, world, pass)?;
    g.add_named(Op::ReduceScatter { reduce: Reduce::Mean, world }, &[flat], name).in_pass(pass)
}

/// This rank's block of `x`, which every rank holds whole (a replicated weight): the padded
/// tensor as [world, block], row `rank` gathered locally, no communication.
pub(crate) fn local_block(g: &mut Graph, x: NodeId, world: usize, name: String, pass: Stage) -> Result<NodeId, PassError> {
    let s = Shard::new(g.ty(x).numel(), world);
    let rank = match g.find_input(RANK) {
        Some(r) => r,
        None => g.input(RANK, InputKind::Data, DType::I32, Shape::new([1])).in_pass(pass)?,
    };
    let flat = flat_padded(g, x, world, pass)?;
    let rows = g.add(Op::Reshape { shape: Shape::new([world, s.block]) }, &[flat]).in_pass(pass)?;
    let row = g.add(Op::Gather, &[rows, rank]).in_pass(pass)?;
    g.add_named(Op::Reshape { shape: Shape::new([s.block]) }, &[row], name).in_pass(pass)
}

/// The whole tensor of type `ty` from every rank's block [block] over `world` ranks:
/// all-gathered, the padding sliced off, reshaped.
pub(crate) fn gather_whole(
    g: &mut Graph,
    block: NodeId,
    ty: &TensorType,
    world: usize,
    name: String,
    pass: Stage,
) -> Result<NodeId, PassError> {
    let numel = ty.numel();
    let all = g.add_named(Op::AllGather { world }, &[block], name).in_pass(pass)?;
    let cut = if g.ty(all).numel() == numel { all } else { g.add(Op::Slice { axis: 0, start: 0, end: numel }, &[all]).in_pass(pass)? };
    if ty.shape.rank() == 1 {
        return Ok(cut);
    }
    g.add(Op::Reshape { shape: ty.shape.clone() }, &[cut]).in_pass(pass)
}

/// Trainable input `p` as the step uses it: its element count and the nodes that take it, each
/// with the node it takes (`(user, p)`); where `zero3` made it this rank's block, the whole
/// tensor's count and the users of each whole gathered from it (`gather_whole`'s all-gather,
/// the padding's slice, the reshape).
pub fn whole_uses(g: &Graph, p: NodeId) -> (usize, Vec<(NodeId, NodeId)>) {
    let users = g.users(p);
    let gathered =
        |u: NodeId| matches!(g.node(u).op, Op::AllGather { .. }) && g.node(u).name.as_deref().is_some_and(|n| n.starts_with("zero3:"));
    if users.is_empty() || !users.iter().all(|&u| gathered(u)) {
        return (g.ty(p).numel(), users.into_iter().map(|u| (u, p)).collect());
    }
    let mut numel = g.ty(p).numel();
    let mut uses = Vec::new();
    for all in users {
        let mut whole = all;
        if let ([cut], Op::AllGather { world }) = (&g.users(whole)[..], &g.node(all).op) {
            let padded = g.ty(all).numel();
            // the padding's slice: to the element count that pads to the gathered length
            if let Op::Slice { axis: 0, start: 0, end } = g.node(*cut).op {
                if end < padded && Shard::new(end, *world).padded() == padded {
                    whole = *cut;
                }
            }
        }
        if let [shaped] = g.users(whole)[..] {
            if matches!(g.node(shaped).op, Op::Reshape { .. }) && g.ty(whole).shape.rank() == 1 && g.ty(shaped).shape.rank() > 1 {
                whole = shaped;
            }
        }
        numel = g.ty(whole).numel();
        uses.extend(g.users(whole).into_iter().map(|u| (u, whole)));
    }
    (numel, uses)
}

/// Stage `zero` (ZeRO-3, after `data_parallel`, whose gradients are already this rank's blocks):
/// every trainable input `NAME` becomes this rank's block [block], and each node that used it
/// gets its own all-gather of the whole, so no whole weight outlives the use it was gathered for.
pub fn zero3(mut g: Graph, p: Parallel) -> Result<(Graph, PassReport), PassError> {
    let pass = Stage::Zero;
    let mut report = PassReport::new(pass);
    let Some(world) = p.sharded().filter(|_| p.shards_parameters()) else {
        return Ok((g, report));
    };
    for id in g.inputs() {
        if g.input_kind(id) != Some(InputKind::Trainable) {
            continue;
        }
        let name = g.node(id).name.clone().unwrap_or_default();
        let ty = g.ty(id).clone();
        let s = Shard::new(ty.numel(), world);
        let users = g.users(id);
        g.set_input_shape(id, Shape::new([s.block]));
        for u in users {
            let whole = gather_whole(&mut g, id, &ty, world, format!("zero3:{name}"), pass)?;
            g.replace_use(u, id, whole);
            report.count("gathers", 1);
        }
        if g.output(&grad_name(&name)).is_some_and(|gr| g.ty(gr).shape != Shape::new([s.block])) {
            return Err(PassError::Invalid {
                pass,
                msg: format!("the gradient of {name:?} is not this rank's block: run data_parallel first"),
            });
        }
        report.count("sharded_tensors", 1);
        report.count("padding_elements", s.padding() as i64);
    }
    Ok((g, report))
}

/// What one rank holds of the model states between steps (ZeRO's accounting: parameters,
/// gradients, optimizer state), in bytes, read off the step graph's persistent inputs. qatc's
/// parts differ from ZeRO's 2 + 2 + 12 bytes a parameter: the trainable weights are their own
/// f32 masters (the 16-bit copies are values of the step, cast at each use), the only gradients
/// kept between runs are `--grad-accum`'s sums (none at K = 1: a gradient lives from the backward
/// to its reduction and update), and the optimizer state is Adam's two moments.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ModelStates {
    /// Trainable weights (`Trainable` inputs).
    pub parameters: usize,
    /// Gradients kept between runs (`accum.grad:NAME`).
    pub gradients: usize,
    /// Adam's moments (`adam.*`, 8-bit codes and absmax included).
    pub optimizer: usize,
    /// Frozen weights: not model states in ZeRO's sense, replicated on every rank.
    pub frozen: usize,
}

impl ModelStates {
    /// The persistent inputs of step `g` by part.
    pub fn of(g: &Graph) -> ModelStates {
        let mut s = ModelStates::default();
        for id in g.inputs() {
            let name = g.node(id).name.clone().unwrap_or_default();
            let bytes = g.ty(id).bytes();
            match g.input_kind(id) {
                Some(InputKind::Trainable) => s.parameters += bytes,
                Some(InputKind::Frozen) => s.frozen += bytes,
                Some(InputKind::State) if name.starts_with("adam.") => s.optimizer += bytes,
                Some(InputKind::State) if name.starts_with("accum.grad:") => s.gradients += bytes,
                _ => {}
            }
        }
        s
    }

    /// Parameters, gradients and optimizer state together.
    pub fn total(self) -> usize {
        self.parameters + self.gradients + self.optimizer
    }

    /// ZeRO's division of one rank's whole states (`self`, as at stage 0) over `ranks` at
    /// `zero`: 1 divides the optimizer state, 2 the gradients too, 3 the parameters too.
    pub fn zero_formula(self, ranks: usize, zero: u8) -> ModelStates {
        let n = ranks.max(1);
        let div = |b: usize, from: u8| if zero >= from { b.div_ceil(n) } else { b };
        ModelStates {
            parameters: div(self.parameters, 3),
            gradients: div(self.gradients, 2),
            optimizer: div(self.optimizer, 1),
            frozen: self.frozen,
        }
    }
}
