//! The optimizer step as graph nodes: global-norm clipping and AdamW with PyTorch's semantics.
//! Adam's moments (`adam.m:NAME`, `adam.v:NAME`) and the step count (`step`) are `State` inputs
//! whose new values are `update` outputs; the learning rate (`lr`) is a `Data` input so a
//! schedule can change it every step without recompiling.
//!
//! With `Moments::Blockwise8` (`--optim adamw8bit`; bitsandbytes' 8-bit Adam) each moment of a
//! tensor of at least `MIN_8BIT_ELEMS` elements is stored as u8 codes plus one f32 absmax per
//! block (`qatc_ir::qmap`): the step dequantizes it, updates it and the weight in f32 exactly as
//! the 32-bit step does, and requantizes it with the block's new absmax. Smaller tensors (biases,
//! LayerNorm gains) keep f32 moments, as bitsandbytes' `min_8bit_size` does: their bytes are
//! negligible and their updates the most sensitive; so do embedding tables (`is_blockwise`).

use qatc_ir::{qmap, BinaryOp, DType, DynMap, Graph, InputKind, NodeId, Op, Reduce, Shape, UnaryOp};
use serde::Serialize;

use crate::autodiff::grad_name;
use crate::error::{InPass, PassError};
use crate::pipeline::PassReport;
use crate::pipeline::Stage;
use crate::zero::Parallel;

/// Elements per block of an 8-bit moment (one absmax per block), bitsandbytes' optimizer block.
pub const BLOCK_8BIT: usize = 2048;

/// AdamW's hyperparameters (PyTorch's defaults but for the learning rate, which is an input)
/// and how its moments are stored.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AdamW {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// The learning rate of learned quantization scales (`W.scales`) as a multiple of `lr`, so
    /// that a schedule moves both: a step size wants much smaller steps than LoRA's A and B. A
    /// parameter group of its own, as PyTorch's `param_groups`; learned scales and zero points
    /// (which train at `lr`) never decay.
    pub scale_lr_mul: f64,
    /// How the moments are stored between steps.
    pub moments: Moments,
}

impl Default for AdamW {
    fn default() -> AdamW {
        AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, scale_lr_mul: 1.0, moments: Moments::F32 }
    }
}

/// The storage of Adam's moments between steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub enum Moments {
    #[default]
    F32,
    /// 8-bit blockwise dynamic quantization for tensors of at least `MIN_8BIT_ELEMS` elements.
    Blockwise8,
}

/// The smallest tensor whose moments `Moments::Blockwise8` quantizes (bitsandbytes' default
/// `min_8bit_size`).
pub const MIN_8BIT_ELEMS: usize = 4096;

pub fn moment_names(param: &str) -> (String, String) {
    (format!("adam.m:{param}"), format!("adam.v:{param}"))
}

/// The state of a tensor's 8-bit moments: (first moment's codes, its absmax, second moment's
/// codes, its absmax).
pub fn blockwise_moment_names(param: &str) -> [String; 4] {
    [format!("adam.m8:{param}"), format!("adam.m8.absmax:{param}"), format!("adam.v8:{param}"), format!("adam.v8.absmax:{param}")]
}

/// In a step whose moments ZeRO 1-2 shards (one rank's step), the first tensor whose 8-bit
/// moments' block on each rank is not a whole number of quantization blocks (`qmap::BLOCK`):
/// (its name, the elements of its block). Each rank quantizes its block's moments in blocks
/// that start where its block does; those are one rank's blocks, and the ranks train as one rank
/// does, only where every rank's block starts on a quantization block's boundary.
pub fn split_8bit_blocks(g: &Graph) -> Option<(String, usize)> {
    g.inputs().into_iter().find_map(|id| {
        let name = g.node(id).name.as_deref()?;
        let [codes, ..] = blockwise_moment_names("");
        let param = name.strip_prefix(codes.as_str())?;
        let block = g.ty(id).numel();
        (!block.is_multiple_of(qmap::BLOCK)).then(|| (param.to_string(), block))
    })
}

/// Whether `moments` stores the moments of trainable input `p` as 8-bit blocks: tensors of at
/// least `MIN_8BIT_ELEMS` elements, except embedding tables (read by a gather). An embedding's
/// rows see gradients as rarely as their tokens occur, so one block mixes second moments many
/// orders of magnitude apart and a rare row's rounds to 0 while its first moment does not: a step
/// of lr * m / eps. bitsandbytes keeps them in 32 bits for this reason (`StableEmbedding`).
/// Where ZeRO 3 made `p` this rank's block, the tensor is the whole one gathered before each use
/// (`zero::whole_uses`), so that every rank decides as one rank does.
pub fn is_blockwise(g: &Graph, p: NodeId, moments: Moments) -> bool {
    let (numel, uses) = crate::zero::whole_uses(g, p);
    let embedding = uses.iter().any(|&(u, w)| matches!(g.node(u).op, Op::Gather) && g.operands(u).first() == Some(&w));
    moments == Moments::Blockwise8 && numel >= MIN_8BIT_ELEMS && !embedding
}

/// The trainable inputs with their gradient outputs, in name order.
fn grads(g: &Graph, pass: Stage) -> Result<Vec<(String, NodeId, NodeId)>, PassError> {
    let mut v = Vec::new();
    for p in g.inputs() {
        if g.input_kind(p) != Some(InputKind::Trainable) {
            continue;
        }
        let name = g.node(p).name.clone().unwrap_or_default();
        let gr = g
            .output(&grad_name(&name))
            .ok_or_else(|| PassError::Invalid { pass, msg: format!("trainable {name:?} has no gradient output: run autodiff first") })?;
        v.push((name, p, gr));
    }
    Ok(v)
}

/// Replaces the gradient outputs with a copy of the given name-to-node map, keeping the rest.
fn rewire_outputs(g: &mut Graph, new: &[(String, NodeId)], pass: Stage) -> Result<(), PassError> {
    let keep: Vec<_> = g.outputs().iter().filter(|o| !new.iter().any(|(n, _)| *n == o.name && !o.update)).cloned().collect();
    g.clear_outputs();
    for o in keep {
        if o.update {
            g.set_update(o.name, o.node).in_pass(pass)?;
        } else {
            g.set_output(o.name, o.node).in_pass(pass)?;
        }
    }
    for (n, id) in new {
        g.set_output(n.clone(), *id).in_pass(pass)?;
    }
    Ok(())
}

/// torch.nn.utils.clip_grad_norm_: total = sqrt(sum of every gradient's squares);
/// every gradient is scaled by min(1, max_norm / (total + 1e-6)). Adds output `grad_norm`.
/// Where ZeRO shards the gradients (`par.sharded()`) each rank sums its blocks' squares and the
/// sums are all-reduced, so every rank clips by the global norm (the padding adds zeros).
pub fn clip(mut g: Graph, max_norm: f64, par: Parallel) -> Result<(Graph, PassReport), PassError> {
    let mut report = PassReport::new(Stage::Clip);
    let gs = grads(&g, Stage::Clip)?;
    let mut total: Option<NodeId> = None;
    for (_, _, gr) in &gs {
        let sq = g.add(Op::Unary(UnaryOp::Square), &[*gr]).in_pass(Stage::Clip)?;
        let s = g.add(Op::SumTo { shape: Shape::scalar() }, &[sq]).in_pass(Stage::Clip)?;
        total = Some(match total {
            None => s,
            Some(t) => g.add(Op::Binary(BinaryOp::Add), &[t, s]).in_pass(Stage::Clip)?,
        });
    }
    let mut total = total.ok_or(PassError::Invalid { pass: Stage::Clip, msg: "no gradients to clip".into() })?;
    if let Some(world) = par.sharded() {
        total = g.add_named(Op::AllReduce { reduce: Reduce::Sum, world }, &[total], "grad_norm.squares").in_pass(Stage::Clip)?;
    }
    let norm = g.add_named(Op::Unary(UnaryOp::Sqrt), &[total], "grad_norm").in_pass(Stage::Clip)?;
    let den = g.add(Op::Affine { mul: 1.0, add: 1e-6 }, &[norm]).in_pass(Stage::Clip)?;
    let inv = g.add(Op::Unary(UnaryOp::Recip), &[den]).in_pass(Stage::Clip)?;
    let coef = g.add(Op::Affine { mul: max_norm, add: 0.0 }, &[inv]).in_pass(Stage::Clip)?;
    let one = g.constant(1.0, g.ty(coef).dtype, Shape::scalar()).in_pass(Stage::Clip)?;
    let coef = g.add_named(Op::Binary(BinaryOp::Min), &[coef, one], "clip_coef").in_pass(Stage::Clip)?;
    let mut new = Vec::new();
    for (name, _, gr) in &gs {
        let shape = g.ty(*gr).shape.clone();
        let c = g.add(Op::Broadcast { shape }, &[coef]).in_pass(Stage::Clip)?;
        let clipped = g.add_named(Op::Binary(BinaryOp::Mul), &[*gr, c], grad_name(name)).in_pass(Stage::Clip)?;
        new.push((grad_name(name), clipped));
    }
    new.push(("grad_norm".to_string(), norm));
    rewire_outputs(&mut g, &new, Stage::Clip)?;
    report.set("clipped_tensors", gs.len() as i64);
    Ok((g, report))
}

/// Appends the AdamW update of every trainable input. With `keep_grads` the gradient outputs stay
/// (parity tests read them); otherwise they are dropped so gradients die as soon as the update
/// has consumed them.
///
/// With ZeRO 1 and 2 (`par.sharded()`, the weights whole on every rank) the gradients are this
/// rank's blocks: AdamW updates the weight's block (`zero::local_block`) with moments of the
/// block's size, and the new weight is all-gathered. At ZeRO 3 the weight is itself a block.
pub fn adamw(mut g: Graph, h: &AdamW, keep_grads: bool, par: Parallel) -> Result<(Graph, PassReport), PassError> {
    let mut report = PassReport::new(Stage::Adamw);
    let gs = grads(&g, Stage::Adamw)?;
    let lr = g.input("lr", InputKind::Data, DType::F32, Shape::scalar()).in_pass(Stage::Adamw)?;
    let step = g.input("step", InputKind::State, DType::F32, Shape::scalar()).in_pass(Stage::Adamw)?;
    // t = step + 1: bias correction uses the step number after this step, as torch does.
    let t = g.add_named(Op::Affine { mul: 1.0, add: 1.0 }, &[step], "step.next").in_pass(Stage::Adamw)?;
    g.set_update("step", t).in_pass(Stage::Adamw)?;
    let mut elems = 0i64;
    let mut scale_lr = None;
    let mut blockwise = 0i64;
    let blocks = par.sharded().filter(|_| !par.shards_parameters());
    for (name, whole, gr) in &gs {
        let p = &match blocks {
            Some(world) => crate::zero::local_block(&mut g, *whole, world, format!("{name}.block"), Stage::Adamw)?,
            None => *whole,
        };
        let ty = g.ty(*p).clone();
        let learned = crate::quant::is_learned_name(name);
        let lr = match (name.ends_with(".scales") && learned, scale_lr) {
            (false, _) => lr,
            (true, Some(l)) => l,
            (true, None) => {
                let l = g.add_named(Op::Affine { mul: h.scale_lr_mul, add: 0.0 }, &[lr], "lr.scales").in_pass(Stage::Adamw)?;
                scale_lr = Some(l);
                l
            }
        };
        let weight_decay = if learned { 0.0 } else { h.weight_decay };
        let (mn, vn) = moment_names(name);
        let eight = is_blockwise(&g, *whole, h.moments);
        let (m, v) = if eight {
            let [mc, ma, vc, va] = blockwise_moment_names(name);
            let nb = Shape::new([qmap::blocks(ty.numel())]);
            let mc = g.input(&mc, InputKind::State, DType::U8, ty.shape.clone()).in_pass(Stage::Adamw)?;
            let ma = g.input(&ma, InputKind::State, DType::F32, nb.clone()).in_pass(Stage::Adamw)?;
            let vc = g.input(&vc, InputKind::State, DType::U8, ty.shape.clone()).in_pass(Stage::Adamw)?;
            let va = g.input(&va, InputKind::State, DType::F32, nb).in_pass(Stage::Adamw)?;
            let m = g.add(Op::BlockDequant { map: DynMap::Signed }, &[mc, ma]).in_pass(Stage::Adamw)?;
            let v = g.add(Op::BlockDequant { map: DynMap::Unsigned }, &[vc, va]).in_pass(Stage::Adamw)?;
            blockwise += 1;
            (m, v)
        } else {
            let m = g.input(&mn, InputKind::State, ty.dtype, ty.shape.clone()).in_pass(Stage::Adamw)?;
            let v = g.input(&vn, InputKind::State, ty.dtype, ty.shape.clone()).in_pass(Stage::Adamw)?;
            (m, v)
        };
        let m1 = g.add_named(Op::AdamM { beta1: h.beta1 }, &[m, *gr], mn.clone()).in_pass(Stage::Adamw)?;
        let v1 = g.add_named(Op::AdamV { beta2: h.beta2 }, &[v, *gr], vn.clone()).in_pass(Stage::Adamw)?;
        let op = Op::AdamParam { beta1: h.beta1, beta2: h.beta2, eps: h.eps, weight_decay };
        let mut p1 = g.add_named(op, &[*p, m1, v1, lr, t], format!("{name}.next")).in_pass(Stage::Adamw)?;
        if let Some(world) = blocks {
            let whole_ty = g.ty(*whole).clone();
            p1 = crate::zero::gather_whole(&mut g, p1, &whole_ty, world, format!("zero:{name}"), Stage::Adamw)?;
        }
        g.set_update(name.clone(), p1).in_pass(Stage::Adamw)?;
        if eight {
            // requantized with each block's new absmax (the update above used the f32 values)
            let [mc, ma, vc, va] = blockwise_moment_names(name);
            for (x, map, codes, absmax) in [(m1, DynMap::Signed, mc, ma), (v1, DynMap::Unsigned, vc, va)] {
                let a = g.add_named(Op::BlockAbsMax, &[x], absmax.clone()).in_pass(Stage::Adamw)?;
                let c = g.add_named(Op::BlockQuant { map }, &[x, a], codes.clone()).in_pass(Stage::Adamw)?;
                g.set_update(codes, c).in_pass(Stage::Adamw)?;
                g.set_update(absmax, a).in_pass(Stage::Adamw)?;
            }
        } else {
            g.set_update(mn, m1).in_pass(Stage::Adamw)?;
            g.set_update(vn, v1).in_pass(Stage::Adamw)?;
        }
        elems += ty.numel() as i64;
    }
    if !keep_grads {
        let keep: Vec<_> = g.outputs().iter().filter(|o| o.update || !o.name.starts_with("grad:")).cloned().collect();
        g.clear_outputs();
        for o in keep {
            if o.update {
                g.set_update(o.name, o.node).in_pass(Stage::Adamw)?;
            } else {
                g.set_output(o.name, o.node).in_pass(Stage::Adamw)?;
            }
        }
    }
    report.set("params", gs.len() as i64);
    report.set("elements", elems);
    report.set("blockwise_8bit", blockwise);
    Ok((g, report))
}
