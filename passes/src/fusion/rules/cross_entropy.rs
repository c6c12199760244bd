//! Cross-entropy over the vocabulary: the largest tensor of a GPT-2 step is the [B*T, V] logits
//! (V = 50257), so these kernels either read it once or never write it at all.
//!
//! The `linear` kernels compute the logits chunk by chunk of rows, the family's `chunk_rows` R
//! (`KernelFamily::CrossEntropyLinear`, printed `chunk=R`): R is
//! the largest power of two whose [R, V] f32 tile fits in 32 MiB (on-chip L2 on an H100 with room
//! for the weight tiles), 128 rows for GPT-2's vocabulary: the floor from which the memory planner
//! chooses the rows the step runs with (`src/memory/chunk.rs`). A code generator loops over row chunks:
//! logits of a chunk, their softmax, loss and gradient, and the gradient's products with the head
//! weight and the hidden states, before the next chunk (Liger/Cut Cross-Entropy).

use egg::Id;
use qatc_ir::{KernelFamily, OpKind};

use super::{consumers_inside, first_time, Custom, Rule};
use crate::fusion::body::{self, add_kernel, add_pack, BRef, Builder};
use crate::fusion::lang::{ENode, Kind, EG};

/// Rows per chunk for a vocabulary of `v` (see the module docs).
pub fn chunk_rows(v: usize, n: usize) -> usize {
    let fit = (32usize << 20) / (v.max(1) * 4);
    let mut r = 1;
    while r * 2 <= fit {
        r *= 2;
    }
    r.clamp(1, n.max(1))
}

pub fn rules() -> Vec<Rule> {
    vec![
        // { cross_entropy(L, t), cross_entropy_grad(L, t, d) }  =>  pack[loss, dL](L, t, d)
        //   one pass over the logits: softmax, loss and gradient per row, the gradient written
        //   over the logits it was computed from (in place: L dies here)
        //   (and the weighted pair, weighted_cross_entropy(L, t, w) with its gradient, alike)
        Rule::Custom(Custom { name: "xent-softmax-fused", roots: GRADS, global: false, apply: softmax_fused }),
        // { cross_entropy(matmul(h, W^T), t), matmul(cross_entropy_grad(matmul(h, W^T), t, d), ..) }
        //   =>  pack[loss, dh, dW](h, W, t)       the [B*T, V] logits and their gradient are
        //   never written: each row chunk's logits are computed once and consumed in registers
        Rule::Custom(Custom { name: "xent-linear", roots: GRADS, global: false, apply: linear }),
        // cross_entropy(matmul(h, W^T), t)  =>  cross_entropy.linear(h, W, t)     (evaluation)
        Rule::Custom(Custom { name: "xent-linear-fwd", roots: LOSSES, global: false, apply: linear_fwd }),
    ]
}

/// The cross-entropies, as (loss, its gradient): the mean over the rows, and the sum weighted by
/// a per-row input (instruction data). A gradient's operands are its loss's and then dloss.
const PAIRS: [(OpKind, OpKind); 2] =
    [(OpKind::CrossEntropy, OpKind::CrossEntropyGrad), (OpKind::WeightedCrossEntropy, OpKind::WeightedCrossEntropyGrad)];
const GRADS: &[Kind] = &[Kind::Op(OpKind::CrossEntropyGrad), Kind::Op(OpKind::WeightedCrossEntropyGrad)];
const LOSSES: &[Kind] = &[Kind::Op(OpKind::CrossEntropy), Kind::Op(OpKind::WeightedCrossEntropy)];

/// A gradient node in class `c`, the kind of its loss, and its loss's operands and dloss.
fn grad_in(eg: &EG, c: Id) -> Option<(ENode, OpKind, Vec<Id>, Id)> {
    PAIRS.iter().find_map(|&(loss, grad)| {
        let g = node(eg, c, grad)?;
        let (&d, args) = g.args.split_last()?;
        let args = args.iter().map(|&a| eg.find(a)).collect();
        Some((g.clone(), loss, args, eg.find(d)))
    })
}

/// A loss node in class `c` and its operands.
fn loss_in(eg: &EG, c: Id) -> Option<(ENode, Vec<Id>)> {
    PAIRS.iter().find_map(|&(loss, _)| node(eg, c, loss)).map(|n| {
        let args = n.args.iter().map(|&a| eg.find(a)).collect();
        (n, args)
    })
}

/// The loss e-class of kind `kind` over `args` (the logits first) among the logits' consumers.
fn loss_of(eg: &EG, kind: OpKind, args: &[Id]) -> Option<(Id, ENode)> {
    for &u in &eg[args[0]].data.users {
        let u = eg.find(u);
        let same = |n: &&ENode| n.is(kind) && n.args.len() == args.len() && n.args.iter().zip(args).all(|(&a, &b)| eg.find(a) == b);
        if let Some(n) = eg[u].nodes.iter().find(same) {
            return Some((u, n.clone()));
        }
    }
    None
}

fn node(eg: &EG, c: Id, kind: OpKind) -> Option<ENode> {
    eg[c].nodes.iter().find(|n| n.is(kind)).cloned()
}

/// Inlines `c` when it is a layout op or constant (targets reshaped, the loss seed), else reads it.
fn cheap(eg: &EG, b: &mut Builder, c: Id) -> BRef {
    match body::best(eg, c, |f| f.layout_only(eg)) {
        Some(f) => b.splice(eg, &f, &[]),
        None => b.input(eg, c),
    }
}

fn softmax_fused(eg: &mut EG, class: Id, index: usize) -> Vec<Id> {
    let root = eg.find(class);
    let Some((g, kind, args, d)) = grad_in(eg, root) else { return vec![] };
    let Some((loss, ce)) = loss_of(eg, kind, &args) else { return vec![] };
    if !first_time(eg, index, vec![usize::from(root)]) {
        return vec![];
    }
    let mut b = Builder::new();
    let lr = b.input(eg, args[0]);
    // the targets (and weights), then dloss
    let rest: Vec<BRef> = args[1..].iter().map(|&a| cheap(eg, &mut b, a)).collect();
    let dr = cheap(eg, &mut b, d);
    let lo = b.node(eg, ce.op, [lr].into_iter().chain(rest.iter().copied()).collect(), Some(loss));
    let gr = b.node(eg, g.op, [lr].into_iter().chain(rest).chain([dr]).collect(), Some(root));
    let name = eg[root].data.name.clone().unwrap_or_else(|| "cross_entropy".into());
    match b.finish_pack(eg, &[(loss, lo), (root, gr)], KernelFamily::CrossEntropySoftmaxInPlace, "xent-softmax-fused") {
        Some((k, args)) => add_pack(eg, k, args, &name),
        None => vec![],
    }
}

fn linear(eg: &mut EG, class: Id, index: usize) -> Vec<Id> {
    let root = eg.find(class);
    let Some((g, kind, args, d)) = grad_in(eg, root) else { return vec![] };
    let l = args[0];
    let Some(mm) = node(eg, l, OpKind::MatMul) else { return vec![] };
    let Some((loss, ce)) = loss_of(eg, kind, &args) else { return vec![] };
    // the gradient's consumers are GEMMs (dh = dL W, dW = dL^T h) that the kernel absorbs
    let mut consumers = Vec::new();
    for &u in &eg[root].data.users {
        let u = eg.find(u);
        match node(eg, u, OpKind::MatMul) {
            Some(m) => consumers.push((u, m)),
            None => return vec![],
        }
    }
    if consumers.is_empty() || eg[root].data.output || !first_time(eg, index, vec![usize::from(root)]) {
        return vec![];
    }
    let mut b = Builder::new();
    let (h, w) = (b.input(eg, mm.args[0]), b.input(eg, mm.args[1]));
    let lr = b.node(eg, mm.op, vec![h, w], Some(l));
    let rest: Vec<BRef> = args[1..].iter().map(|&a| cheap(eg, &mut b, a)).collect();
    let dr = cheap(eg, &mut b, d);
    let lo = b.node(eg, ce.op, [lr].into_iter().chain(rest.iter().copied()).collect(), Some(loss));
    let gr = b.node(eg, g.op, [lr].into_iter().chain(rest).chain([dr]).collect(), Some(root));
    let mut outs = vec![(loss, lo)];
    for (u, m) in &consumers {
        let args = m.args.iter().map(|&a| if eg.find(a) == root { gr } else { b.input(eg, a) }).collect();
        outs.push((*u, b.node(eg, m.op, args, Some(*u))));
    }
    let mut inside: Vec<Id> = b.origins().collect();
    inside.push(root);
    if !consumers_inside(eg, l, &inside) {
        return vec![];
    }
    let rows = eg[l].data.ty.as_ref().map(|t| chunk_rows(t.shape.last(), t.shape.dims()[0])).unwrap_or(1);
    let name = eg[loss].data.name.clone().unwrap_or_else(|| "loss".into());
    // under --precision bf16|fp16 the loss is f32 and the gradient products 16-bit: widened into
    // an f32 pack (dh at twice its bytes, where the logits and their gradient are never written)
    match b.finish_pack_widened(eg, &outs, KernelFamily::CrossEntropyLinear { chunk_rows: rows }, "xent-linear") {
        Some((k, args)) => add_pack(eg, k, args, &name),
        None => vec![],
    }
}

fn linear_fwd(eg: &mut EG, class: Id, index: usize) -> Vec<Id> {
    let root = eg.find(class);
    let Some((ce, args)) = loss_in(eg, root) else { return vec![] };
    let l = args[0];
    let Some(mm) = node(eg, l, OpKind::MatMul) else { return vec![] };
    if !consumers_inside(eg, l, &[root]) || !first_time(eg, index, vec![usize::from(root)]) {
        return vec![];
    }
    let mut b = Builder::new();
    let (h, w) = (b.input(eg, mm.args[0]), b.input(eg, mm.args[1]));
    let lr = b.node(eg, mm.op, vec![h, w], Some(l));
    let rest: Vec<BRef> = args[1..].iter().map(|&a| cheap(eg, &mut b, a)).collect();
    let out = b.node(eg, ce.op, [lr].into_iter().chain(rest).collect(), Some(root));
    let rows = eg[l].data.ty.as_ref().map(|t| chunk_rows(t.shape.last(), t.shape.dims()[0])).unwrap_or(1);
    match b.finish(eg, out, KernelFamily::CrossEntropyLinear { chunk_rows: rows }, "xent-linear-fwd") {
        Some((k, args)) => add_kernel(eg, root, k, args).into_iter().collect(),
        None => vec![],
    }
}
