//! Causal attention, recognised in a fused body and lowered to the tiled kernels of
//! `qatc_attention.cuh`: the T x T scores and probabilities are never written to memory.
//!
//! Patterns (P = softmax(matmul(q, k^T), causal), the matmuls not in memory):
//!   out = P v                                   forward
//!   dv  = P^T dout                              lse, then dv
//!   dq  = softmax_grad(P, dout v^T) k           lse, delta, then dq
//!   dk  = softmax_grad(P, dout v^T)^T q         lse, delta, then dk (and dv, into scratch)
//! The forward's log-sum-exp is not a graph value, so a backward recomputes it (one pass over
//! the keys); lse and delta are shared by the kernels of one layer through `Lowerer::attn_stats`.
//! Where the target computes the gradients blockwise (`LowerOptions::attention_one_backward`:
//! the CPU's attention GEMMs), the first of a layer's dv, dq and dk nodes launches one kernel for
//! the three (`AttentionPart::Backward`, after lse and delta), and the other two nodes take
//! theirs from it (`Lowerer::attn_grads`; a copy each, into their own buffers). A dv node reads
//! no v, so it does so only when its q and k are the forward's (v found by them,
//! `Lowerer::attn_v`); else it runs `BackwardV` and the first of dq and dk launches the three.
//!
//! Over f16/bf16 operands (`--precision`) the math is f32: the operands widened exactly, the
//! result rounded once into the node's buffer; scores, probabilities and their gradients stay f32
//! inside, as FlashAttention's accumulators do, where the unfused graph rounds each of them to the
//! compute type (the two agree to a few of its ulps; `tests/llvm_equivalence.rs`). Where the
//! kernels read and write the stored type (`LowerOptions::attention_reads_stored`: every target,
//! CUDA's templates and the CPU's LLVM kernels and attention GEMMs) they get the 16-bit views and
//! the node's buffer themselves, and the gradients kept for a layer's other nodes are of that
//! type; else (the option off: the reference the tests hold it to) they run on f32 copies of the
//! operands (per node, so no f32 copy outlives its kernel) into an f32 result that a copy rounds
//! into the buffer. Both widen and round the same values once: the same bits
//! (`tests/attention_16bit.rs`).

use std::collections::HashMap;

use qatc_ir::{DType, Graph, NodeId, Op};

use super::builder::Pos;
use super::{elementwise, Ctx, Lowerer};
use crate::error::KernelError;
use crate::kir::{Attention, AttentionPart, BinOp, Body, Expr, Ix, Kernel, Param, ReduceOp, RowMapping, Space, Ty};
use crate::program::View;

/// A view of an operand's value, lowered into a scratch first where it is not a view of a leaf:
/// `fused::operand_view`, which lowers the rest of a fused node and calls this file, passed in so
/// that this file does not use it back.
pub type OperandView = fn(&mut Lowerer, &mut Ctx, NodeId, &str) -> Result<View, KernelError>;

#[derive(Clone, Copy, Debug)]
pub enum Match {
    Forward { q: NodeId, k: NodeId, v: NodeId, scale: f64 },
    Dv { q: NodeId, k: NodeId, dout: NodeId, scale: f64 },
    Dq { q: NodeId, k: NodeId, v: NodeId, dout: NodeId, scale: f64 },
    Dk { q: NodeId, k: NodeId, v: NodeId, dout: NodeId, scale: f64 },
}

fn inner<'g>(g: &'g Graph, n: NodeId, leaves: &HashMap<NodeId, View>) -> Option<&'g Op> {
    (!leaves.contains_key(&n)).then(|| &g.node(n).op)
}

fn two(g: &Graph, n: NodeId) -> Option<(NodeId, NodeId)> {
    let ops = g.operands(n);
    Some((*ops.first()?, *ops.get(1)?))
}

/// P = softmax(q k^T, causal) -> (q, k, scale).
fn probs(g: &Graph, p: NodeId, leaves: &HashMap<NodeId, View>) -> Option<(NodeId, NodeId, f64)> {
    let Op::Softmax { scale, causal: true } = *inner(g, p, leaves)? else { return None };
    let s = *g.operands(p).first()?;
    let Op::MatMul { ta: false, tb: true } = *inner(g, s, leaves)? else { return None };
    let (q, k) = two(g, s)?;
    Some((q, k, scale))
}

/// dS = softmax_grad(P, dout v^T) -> (q, k, v, dout, scale).
fn dscores(g: &Graph, ds: NodeId, leaves: &HashMap<NodeId, View>) -> Option<(NodeId, NodeId, NodeId, NodeId, f64)> {
    let Op::SoftmaxGrad { scale } = *inner(g, ds, leaves)? else { return None };
    let (p, dp) = two(g, ds)?;
    let (q, k, s) = probs(g, p, leaves)?;
    let Op::MatMul { ta: false, tb: true } = *inner(g, dp, leaves)? else { return None };
    let (dout, v) = two(g, dp)?;
    (s == scale).then_some((q, k, v, dout, scale))
}

pub fn matches(g: &Graph, root: NodeId, leaves: &HashMap<NodeId, View>) -> Option<Match> {
    let Op::MatMul { ta, tb: false } = *inner(g, root, leaves)? else { return None };
    let shape = &g.ty(root).shape.0;
    let dtype = g.ty(root).dtype;
    if shape.len() != 4 || !dtype.is_float() {
        return None;
    }
    let (a, b) = two(g, root)?;
    let m = match (ta, &g.node(a).op) {
        (false, Op::Softmax { .. }) => probs(g, a, leaves).map(|(q, k, scale)| Match::Forward { q, k, v: b, scale }),
        (true, Op::Softmax { .. }) => probs(g, a, leaves).map(|(q, k, scale)| Match::Dv { q, k, dout: b, scale }),
        (false, Op::SoftmaxGrad { .. }) => {
            dscores(g, a, leaves).filter(|d| d.1 == b).map(|(q, k, v, dout, scale)| Match::Dq { q, k, v, dout, scale })
        }
        (true, Op::SoftmaxGrad { .. }) => {
            dscores(g, a, leaves).filter(|d| d.0 == b).map(|(q, k, v, dout, scale)| Match::Dk { q, k, v, dout, scale })
        }
        _ => None,
    }?;
    let operands = match m {
        Match::Forward { q, k, v, .. } => vec![q, k, v],
        Match::Dv { q, k, dout, .. } => vec![q, k, dout],
        Match::Dq { q, k, v, dout, .. } | Match::Dk { q, k, v, dout, .. } => vec![q, k, v, dout],
    };
    operands.iter().all(|&n| g.ty(n).shape.0 == *shape && g.ty(n).dtype == dtype).then_some(m)
}

/// Node `n`'s value (in `from`) copied into `to`, converted to its type (widened exactly, or
/// rounded to nearest even).
fn copy(lw: &mut Lowerer, cx: &Ctx, n: NodeId, from: View, to: &View) -> Result<(), KernelError> {
    let sub = Ctx { g: cx.g, leaves: HashMap::from([(n, from)]), names: cx.names.clone(), order: cx.order.clone() };
    elementwise(lw, &sub, n, to, "copy")
}

/// Whether the kernels read and write a buffer of type `d` as it is (else through an f32 copy).
fn direct(lw: &Lowerer, d: DType) -> bool {
    d == DType::F32 || (lw.options.attention_reads_stored && d.is_float())
}

/// A [B, NH, T, hs] view of `n` with hs contiguous, as the kernels read it: (the view that
/// identifies the value, for `attn_stats`; the view the kernels get, copied out when it is
/// strided or of a type they do not read: into the value's own type where they read it stored,
/// else f32).
fn head_view(lw: &mut Lowerer, cx: &mut Ctx, n: NodeId, family: &str, operand_view: OperandView) -> Result<(View, View), KernelError> {
    let v = operand_view(lw, cx, n, family)?;
    let t = kernel_view(lw, cx, n, v.clone(), &format!("t{}", n.index()))?;
    Ok((v, t))
}

/// `v`, holding a value of node `n`'s type and shape, as the kernels read it: itself, or copied
/// into a temporary `name` (of the value's type where they read it stored, else f32).
fn kernel_view(lw: &mut Lowerer, cx: &Ctx, n: NodeId, v: View, name: &str) -> Result<View, KernelError> {
    if v.strides[3] == 1 && direct(lw, lw.prog.buffers[v.buf].dtype) {
        return Ok(v);
    }
    let value = cx.g.ty(n).dtype;
    let dtype = if direct(lw, value) { value } else { DType::F32 };
    let t = lw.temp(name, dtype, &cx.g.ty(n).shape.0);
    copy(lw, cx, n, v, &t)?;
    Ok(t)
}

struct Launch<'a> {
    part: AttentionPart,
    dims: [usize; 4],
    scale: f64,
    family: &'a str,
    note: String,
    /// The graph type of q, k, v and dout (`Attention::values`).
    values: DType,
}

/// An attention kernel's operands by role; `launch` puts each at the param its role has
/// (`AttentionPart::roles`, the order every backend reads), named as the kernel's text names it.
#[derive(Clone, Copy)]
struct Operands<'v> {
    q: &'v View,
    k: &'v View,
    v: Option<&'v View>,
    dout: Option<&'v View>,
    lse: &'v View,
    delta: Option<&'v View>,
    /// out | dq | dk, then dv for `BackwardKV`; dq, dk, dv for `Backward`.
    out: [Option<(&'static str, &'v View)>; 3],
}

impl<'v> Operands<'v> {
    fn new(q: &'v View, k: &'v View, lse: &'v View) -> Operands<'v> {
        Operands { q, k, v: None, dout: None, lse, delta: None, out: [None, None, None] }
    }
}

fn launch<'v>(lw: &mut Lowerer, l: &Launch, ops: &Operands<'v>) -> Result<(), KernelError> {
    let r = l.part.roles();
    let mut slots: Vec<Option<(&'static str, &'v View, bool)>> = vec![None; r.count()];
    let mut put = |at: Option<usize>, operand: Option<(&'static str, &'v View, bool)>| -> Result<(), KernelError> {
        match (at, operand) {
            (Some(i), Some(o)) => slots[i] = Some(o),
            (None, None) => {}
            (at, o) => return Err(KernelError::Internal(format!("attention {:?}: operand {:?} for param {at:?}", l.part, o.map(|o| o.0)))),
        }
        Ok(())
    };
    put(Some(r.q), Some(("q", ops.q, false)))?;
    put(Some(r.k), Some(("k", ops.k, false)))?;
    put(r.v, ops.v.map(|v| ("v", v, false)))?;
    put(r.dout, ops.dout.map(|v| ("dout", v, false)))?;
    put(Some(r.lse), Some(("lse", ops.lse, l.part.writes_lse())))?;
    put(r.delta, ops.delta.map(|v| ("delta", v, l.part.writes_delta())))?;
    for (at, o) in r.out.into_iter().zip(ops.out) {
        put(at, o.map(|(name, v)| (name, v, true)))?;
    }
    let params = slots
        .into_iter()
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| KernelError::Internal(format!("attention {:?}: a param without an operand", l.part)))?;
    let [b, nh, t, hs] = l.dims;
    let ps: Vec<Param> = params
        .iter()
        .map(|(name, v, write)| {
            let buf = &lw.prog.buffers[v.buf];
            Param { name: name.to_string(), dtype: buf.dtype, shape: buf.shape.clone(), write: *write }
        })
        .collect();
    let strides =
        params.iter().map(|(_, v, _)| if v.strides.len() == 4 { [v.strides[0], v.strides[1], v.strides[2]] } else { [0; 3] }).collect();
    let offsets = params.iter().map(|(_, v, _)| v.offset).collect();
    let att = Attention { b, nh, t, hs, scale: l.scale, strides, offsets, part: l.part, values: l.values };
    let index_ty = if ps.iter().all(|p| p.numel() < i32::MAX as usize) { Ty::I32 } else { Ty::I64 };
    let kernel = Kernel {
        family: l.family.to_string(),
        params: ps,
        index_ty,
        body: Body::Attention(att),
        note: l.note.clone(),
        names: Default::default(),
    };
    let args = params.iter().map(|(_, v, _)| v.buf).collect();
    lw.push_kernel((kernel, args));
    Ok(())
}

/// The row log-sum-exp of scale q k^T, computed once per (q, k) (`key`: the views that hold
/// their values).
fn lse(lw: &mut Lowerer, l: &Launch, key: Vec<View>, q: &View, k: &View) -> Result<View, KernelError> {
    if let Some(v) = lw.attn_stats.get(&key) {
        return Ok(v.clone());
    }
    let [b, nh, t, _] = l.dims;
    let out = lw.temp("attn_lse", DType::F32, &[b, nh, t]);
    let stats = Launch { part: AttentionPart::Lse, note: format!("{}: row log-sum-exp", l.note), ..*l };
    launch(lw, &stats, &Operands::new(q, k, &out))?;
    lw.attn_stats.insert(key, out.clone());
    Ok(out)
}

/// Softmax's backward term delta = rowsum(P * dP) per query row, computed once per (q, k, v,
/// dout). Where the forward's output is known (`Lowerer::attn_out`, on the targets that compute
/// the gradients blockwise) it is rowsum(dout * out), FlashAttention-2's D: since out = P v and
/// dP = dout v^T, sum_j P_ij dP_ij = dout_i . sum_j P_ij v_j. That reads [T, hs] per head where
/// the pass over the scores recomputes q k^T and dout v^T ([T, T] each); out is held for the
/// output projection's weight or LoRA gradient anyway, a few steps before this (under
/// checkpointing its recomputed copy now lives those few steps longer). Over 16-bit values it
/// reads the stored out, as FlashAttention-2 does.
fn delta(lw: &mut Lowerer, cx: &Ctx, l: &Launch, key: Vec<View>, qkvd: [&View; 4], lse: &View) -> Result<View, KernelError> {
    if let Some(v) = lw.attn_stats.get(&key) {
        return Ok(v.clone());
    }
    let [b, nh, t, hs] = l.dims;
    let out = lw.temp("attn_delta", DType::F32, &[b, nh, t]);
    if let Some(o) = lw.attn_out.get(&key[..2]).cloned().filter(|_| lw.options.attention_one_backward) {
        let dout = qkvd[3];
        let rows = b * nh * t;
        let mut kb = lw.kb_rows(cx, rows, &[dout, &o, &out]);
        let (lp, j) = kb.open_loop(Expr::Int(hs as i64), hs);
        let pos = Pos::Lin(kb.bounds.add(kb.bounds.mul(Expr::Ix(Ix::Row), hs as i64), j));
        let (x, y) = (kb.load_view(dout, &pos), kb.load_view(&o, &pos));
        let d = kb.close_reduce(lp, ReduceOp::Sum, Ty::F32, Expr::bin(BinOp::Mul, x, y));
        kb.name(&d, "delta");
        kb.store_view(&out, &Pos::Lin(Expr::Ix(Ix::Row)), d);
        let note = format!("{}: delta = rowsum(dout * out)", l.note);
        launch!(lw, kb, "attention.delta", Space::Rows { rows, mapping: RowMapping::Block }, note)?;
        lw.attn_stats.insert(key, out.clone());
        return Ok(out);
    }
    let d = Launch { part: AttentionPart::BackwardDelta, note: format!("{}: delta", l.note), ..*l };
    let [q, k, v, dout] = qkvd;
    launch(lw, &d, &Operands { v: Some(v), dout: Some(dout), delta: Some(&out), ..Operands::new(q, k, lse) })?;
    lw.attn_stats.insert(key, out.clone());
    Ok(out)
}

pub fn lower(
    lw: &mut Lowerer,
    cx: &mut Ctx,
    m: Match,
    root: NodeId,
    dest: View,
    family: &str,
    operand_view: OperandView,
) -> Result<(), KernelError> {
    let shape = cx.g.ty(root).shape.0.clone();
    let dims = [shape[0], shape[1], shape[2], shape[3]];
    let note = lw.note(cx, root, None);
    // `matches` checked that q, k, v and dout have the result's type
    let values = cx.g.ty(root).dtype;
    // a result the kernels do not write as stored is computed in f32 first, then rounded into `dest`
    let mut out = if direct(lw, lw.prog.buffers[dest.buf].dtype) { dest.clone() } else { lw.temp("attn_out", DType::F32, &shape) };
    // gradients computed beside this node's, for their own nodes to take: of the values' type
    // where the kernels write it (rounded once, as their nodes' copies would round an f32 one)
    let grad_ty = if direct(lw, values) { values } else { DType::F32 };
    let mut keys = Vec::new();
    let mut views = |lw: &mut Lowerer, ns: &[NodeId]| -> Result<Vec<View>, KernelError> {
        keys.clear();
        let mut vs = Vec::new();
        for &n in ns {
            let (key, v) = head_view(lw, cx, n, family, operand_view)?;
            keys.push(key);
            vs.push(v);
        }
        Ok(vs)
    };
    match m {
        Match::Forward { q, k, v, scale } => {
            let vs = views(lw, &[q, k, v])?;
            let l = Launch { part: AttentionPart::Forward, dims, scale, family, note, values };
            let lse = lw.temp("attn_lse", DType::F32, &[dims[0], dims[1], dims[2]]);
            let ops = Operands { v: Some(&vs[2]), out: [Some(("out", &out)), None, None], ..Operands::new(&vs[0], &vs[1], &lse) };
            launch(lw, &l, &ops)?;
            // the backward of this layer reads it instead of recomputing it
            lw.attn_stats.insert(keys[..2].to_vec(), lse);
            lw.attn_v.insert(keys[..2].to_vec(), keys[2].clone());
            // the stored output, which the backward's delta reads
            lw.attn_out.insert(keys[..2].to_vec(), dest.clone());
        }
        Match::Dv { q, k, dout, scale } => {
            let vs = views(lw, &[q, k, dout])?;
            // v, where the one-pass backward can run here: the forward's, held in q's buffer
            // (so reading it here keeps nothing alive longer than q does)
            let v_key = lw.attn_v.get(&keys[..2]).filter(|v| v.buf == keys[0].buf).cloned();
            if let Some(dv) = lw.attn_grads.get(&(keys.clone(), 2)).cloned() {
                // computed with dq and dk by the layer's one-pass backward
                out = dv;
            } else if let (true, Some(v_key)) = (lw.options.attention_one_backward, v_key) {
                // the first of the layer's gradients: all three here, dq and dk kept for their
                // nodes. v typed by dout, which `matches` checked has v's type and shape.
                let v = kernel_view(lw, cx, dout, v_key.clone(), "attn_v")?;
                let key4 = vec![keys[0].clone(), keys[1].clone(), v_key, keys[2].clone()];
                let l = Launch { part: AttentionPart::Backward, dims, scale, family, note, values };
                let lse = lse(lw, &l, keys[..2].to_vec(), &vs[0], &vs[1])?;
                let delta = delta(lw, cx, &l, key4.clone(), [&vs[0], &vs[1], &v, &vs[2]], &lse)?;
                let (dq, dk) = (lw.temp("attn_dq", grad_ty, &shape), lw.temp("attn_dk", grad_ty, &shape));
                let ops = Operands {
                    v: Some(&v),
                    dout: Some(&vs[2]),
                    delta: Some(&delta),
                    out: [Some(("dq", &dq)), Some(("dk", &dk)), Some(("dv", &out))],
                    ..Operands::new(&vs[0], &vs[1], &lse)
                };
                launch(lw, &l, &ops)?;
                lw.attn_grads.insert((key4.clone(), 0), dq);
                lw.attn_grads.insert((key4, 1), dk);
            } else {
                let l = Launch { part: AttentionPart::BackwardV, dims, scale, family, note, values };
                let lse = lse(lw, &l, keys[..2].to_vec(), &vs[0], &vs[1])?;
                let ops = Operands { dout: Some(&vs[2]), out: [Some(("dv", &out)), None, None], ..Operands::new(&vs[0], &vs[1], &lse) };
                launch(lw, &l, &ops)?;
            }
        }
        Match::Dq { q, k, v, dout, scale } | Match::Dk { q, k, v, dout, scale } => {
            let vs = views(lw, &[q, k, v, dout])?;
            let is_dq = matches!(m, Match::Dq { .. });
            if let Some(g) = lw.attn_grads.get(&(keys.clone(), if is_dq { 0 } else { 1 })).cloned() {
                // computed by the layer's one-pass backward at its first gradient node
                out = g;
            } else {
                let l = Launch { part: AttentionPart::BackwardQ, dims, scale, family, note, values };
                let lse = lse(lw, &l, keys[..2].to_vec(), &vs[0], &vs[1])?;
                let delta = delta(lw, cx, &l, keys.clone(), [&vs[0], &vs[1], &vs[2], &vs[3]], &lse)?;
                let base = Operands { v: Some(&vs[2]), dout: Some(&vs[3]), delta: Some(&delta), ..Operands::new(&vs[0], &vs[1], &lse) };
                if lw.options.attention_one_backward {
                    // all three at once: this node's gradient into its own result, the other two
                    // into f32 buffers their nodes take (or copy) when they are lowered
                    let other = lw.temp(if is_dq { "attn_dk" } else { "attn_dq" }, grad_ty, &shape);
                    let dv = lw.temp("attn_dv", grad_ty, &shape);
                    let (dq, dk) = if is_dq { (&out, &other) } else { (&other, &out) };
                    let ops = Operands { out: [Some(("dq", dq)), Some(("dk", dk)), Some(("dv", &dv))], ..base };
                    launch(lw, &Launch { part: AttentionPart::Backward, ..l }, &ops)?;
                    lw.attn_grads.insert((keys.clone(), if is_dq { 1 } else { 0 }), other);
                    lw.attn_grads.insert((vec![keys[0].clone(), keys[1].clone(), keys[3].clone()], 2), dv);
                } else if is_dq {
                    launch(lw, &l, &Operands { out: [Some(("dq", &out)), None, None], ..base })?;
                } else {
                    // one pass gives dk and dv; dv is not this node's value
                    let dv = lw.temp("attn_dv", grad_ty, &shape);
                    let ops = Operands { out: [Some(("dk", &out)), Some(("dv", &dv)), None], ..base };
                    launch(lw, &Launch { part: AttentionPart::BackwardKV, ..l }, &ops)?;
                }
            }
        }
    }
    if out != dest {
        copy(lw, cx, root, out, &dest)?;
    }
    Ok(())
}
