//! Row ops: each row of the last dim is one program that reduces over the row and then writes it
//! (LayerNorm and its input gradient, softmax and its gradient, cross-entropy, act-quant). The
//! operand of a row op may be any inlinable expression (a residual add before a LayerNorm is read,
//! not materialized) and the output may pass through an elementwise epilogue before its store.
//! The arithmetic follows the interpreter (`runtime/src/kernels/{norm,softmax}.rs`) operation for
//! operation: the same association, f32 throughout, biased variance.

use qatc_ir::{qmap, Graph, Grid, Node, NodeId, Op, QuantScheme};

use super::anchor::{emit_out, Anchor};
use super::builder::{clamp, KernelBuilder, Pos};
use super::{Ctx, Lowerer};
use crate::error::KernelError;
use crate::kir::{BinOp, Expr, Ix, ReduceOp, RowMapping, Space, Ty, UnOp};
use crate::program::View;

fn f(v: f64) -> Expr {
    Expr::f32(v)
}
fn add(a: Expr, b: Expr) -> Expr {
    Expr::bin(BinOp::Add, a, b)
}
fn sub(a: Expr, b: Expr) -> Expr {
    Expr::bin(BinOp::Sub, a, b)
}
fn mul(a: Expr, b: Expr) -> Expr {
    Expr::bin(BinOp::Mul, a, b)
}
fn div(a: Expr, b: Expr) -> Expr {
    Expr::bin(BinOp::Div, a, b)
}

/// Element (row, j) of a tensor with rows of `c`.
fn at(kb: &KernelBuilder, c: usize, j: &Expr) -> Pos {
    let b = &kb.bounds;
    Pos::Lin(b.add(b.mul(Expr::Ix(Ix::Row), c as i64), j.clone()))
}

/// Reduces `f(x at (row, j))` over the row with `op`.
fn reduce(
    kb: &mut KernelBuilder,
    op: ReduceOp,
    len: usize,
    extent: Expr,
    mut body: impl FnMut(&mut KernelBuilder, &Expr) -> Result<Expr, KernelError>,
) -> Result<Expr, KernelError> {
    let (lp, j) = kb.open_loop(extent, len);
    let v = body(kb, &j)?;
    Ok(kb.close_reduce(lp, op, Ty::F32, v))
}

/// LayerNorm's statistics of row `row` of x: (mean, rstd), var biased.
fn ln_stats(kb: &mut KernelBuilder, x: NodeId, c: usize, eps: f64) -> Result<(Expr, Expr), KernelError> {
    let sum = reduce(kb, ReduceOp::Sum, c, Expr::Int(c as i64), |kb, j| {
        let p = at(kb, c, j);
        kb.value(x, &p)
    })?;
    kb.name(&sum, "sum");
    let mean = kb.bind(Ty::F32, div(sum, f(c as f64)));
    kb.name(&mean, "mean");
    let var = reduce(kb, ReduceOp::Sum, c, Expr::Int(c as i64), |kb, j| {
        let p = at(kb, c, j);
        let xv = kb.value(x, &p)?;
        let d = kb.bind(Ty::F32, sub(xv, mean.clone()));
        kb.name(&d, "d");
        Ok(mul(d.clone(), d))
    })?;
    let rstd = div(f(1.0), Expr::un(UnOp::Sqrt, add(div(var.clone(), f(c as f64)), f(eps))));
    let rstd = kb.bind(Ty::F32, rstd);
    kb.name(&rstd, "rstd");
    kb.name(&var, "var");
    Ok((mean, rstd))
}

/// Lowers a row op (with its prologue inlined and `a.epilogue` fused) into one or two kernels.
pub fn lower(lw: &mut Lowerer, cx: &Ctx, a: &Anchor) -> Result<(), KernelError> {
    match cx.g.node(a.node).op.clone() {
        Op::LayerNorm { eps } => layer_norm(lw, cx, a, eps),
        Op::LayerNormGradX { eps } => layer_norm_grad_x(lw, cx, a, eps),
        Op::Softmax { scale, causal } => softmax(lw, cx, a, scale, causal),
        Op::SoftmaxGrad { scale } => softmax_grad(lw, cx, a, scale),
        Op::CrossEntropyGrad => cross_entropy_grad(lw, cx, a),
        Op::CrossEntropy => cross_entropy(lw, cx, a),
        Op::ActQuant { bits } => act_quant(lw, cx, a, bits),
        Op::BlockAbsMax => block_abs_max(lw, cx, a),
        Op::PackedSoftmax { scale } => {
            let note = lw.note(cx, a.node, a.epilogue);
            packed_softmax(lw, cx, a, note, scale)
        }
        Op::WeightedCrossEntropyGrad => {
            let note = lw.note(cx, a.node, a.epilogue);
            weighted_cross_entropy_grad(lw, cx, a, note)
        }
        Op::WeightedCrossEntropy => {
            let note = lw.note(cx, a.node, a.epilogue);
            weighted_cross_entropy(lw, cx, a, note)
        }
        other => Err(KernelError::Internal(format!(
            "{}: {} is not a row op (fused::lower_anchor routes it)",
            cx.g.describe(a.node),
            other.mnemonic()
        ))),
    }
}

/// What each row op's lowering reads of its anchor: the graph, the node, its operands and shape,
/// and the note its kernels carry.
struct RowOp<'g> {
    g: &'g Graph,
    node: &'g Node,
    ops: Vec<NodeId>,
    shape: Vec<usize>,
    note: String,
}

impl<'g> RowOp<'g> {
    fn of(lw: &Lowerer, cx: &Ctx<'g>, a: &Anchor) -> RowOp<'g> {
        let g = cx.g;
        let node = g.node(a.node);
        RowOp { g, node, ops: g.operands(a.node), shape: node.ty.shape.0.clone(), note: lw.note(cx, a.node, a.epilogue) }
    }
}

/// LayerNorm: y = (x - mean) * rstd * gamma + beta over each row of C (x [.., C], gamma and
/// beta [C]).
fn layer_norm(lw: &mut Lowerer, cx: &Ctx, a: &Anchor, eps: f64) -> Result<(), KernelError> {
    let RowOp { node, ops, shape, note, .. } = RowOp::of(lw, cx, a);
    let c = shape.last().copied().unwrap_or(1);
    let rows = node.ty.numel() / c.max(1);
    let mut kb = lw.kb_rows(cx, rows, &[&a.dest]);
    let (mean, rstd) = ln_stats(&mut kb, ops[0], c, eps)?;
    let (lp, j) = kb.open_loop(Expr::Int(c as i64), c);
    let p = at(&kb, c, &j);
    let xv = kb.value(ops[0], &p)?;
    let gamma = kb.value(ops[1], &Pos::Lin(j.clone()))?;
    let beta = kb.value(ops[2], &Pos::Lin(j))?;
    let y = add(mul(mul(sub(xv, mean), rstd), gamma), beta);
    emit_out(&mut kb, a, p, y)?;
    kb.close_foreach(lp);
    launch!(lw, kb, &a.family, Space::Rows { rows, mapping: RowMapping::Block }, note)
}

/// LayerNorm's input gradient (x, gamma, dy) -> dx, each row recomputing its statistics.
fn layer_norm_grad_x(lw: &mut Lowerer, cx: &Ctx, a: &Anchor, eps: f64) -> Result<(), KernelError> {
    let RowOp { node, ops, shape, note, .. } = RowOp::of(lw, cx, a);
    // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma
    let c = shape.last().copied().unwrap_or(1);
    let rows = node.ty.numel() / c.max(1);
    let (x, gamma, dy) = (ops[0], ops[1], ops[2]);
    let mut kb = lw.kb_rows(cx, rows, &[&a.dest]);
    let (mean, rstd) = ln_stats(&mut kb, x, c, eps)?;
    let gj = |kb: &mut KernelBuilder, j: &Expr| -> Result<Expr, KernelError> {
        let p = at(kb, c, j);
        let d = kb.value(dy, &p)?;
        let w = kb.value(gamma, &Pos::Lin(j.clone()))?;
        Ok(kb.bind(Ty::F32, mul(d, w)))
    };
    let mg = reduce(&mut kb, ReduceOp::Sum, c, Expr::Int(c as i64), gj)?;
    let mgx = reduce(&mut kb, ReduceOp::Sum, c, Expr::Int(c as i64), |kb, j| {
        let gv = gj(kb, j)?;
        let p = at(kb, c, j);
        let xv = kb.value(x, &p)?;
        Ok(mul(mul(gv, sub(xv, mean.clone())), rstd.clone()))
    })?;
    let mg = kb.bind(Ty::F32, div(mg, f(c as f64)));
    let mgx = kb.bind(Ty::F32, div(mgx, f(c as f64)));
    kb.name(&mg, "mean_g");
    kb.name(&mgx, "mean_gx");
    let (lp, j) = kb.open_loop(Expr::Int(c as i64), c);
    let p = at(&kb, c, &j);
    let xv = kb.value(x, &p)?;
    let xhat = kb.bind(Ty::F32, mul(sub(xv, mean), rstd.clone()));
    let gv = gj(&mut kb, &j)?;
    let y = mul(rstd, sub(sub(gv, mg), mul(xhat, mgx)));
    emit_out(&mut kb, a, p, y)?;
    kb.close_foreach(lp);
    launch!(lw, kb, &a.family, Space::Rows { rows, mapping: RowMapping::Block }, note)
}

/// Softmax over each row of scale * x; causal rows see their first i + 1 columns.
fn softmax(lw: &mut Lowerer, cx: &Ctx, a: &Anchor, scale: f64, causal: bool) -> Result<(), KernelError> {
    let RowOp { node, ops, shape, note, .. } = RowOp::of(lw, cx, a);
    let s = shape.last().copied().unwrap_or(1);
    let t = if causal && shape.len() >= 2 { shape[shape.len() - 2] } else { 1 };
    let rows = node.ty.numel() / s.max(1);
    let mut kb = lw.kb_rows(cx, rows, &[&a.dest]);
    // a causal row i of each [T, S] matrix sees columns j <= i
    let valid = if causal { kb.bind(Ty::I32, add(kb.bounds.rem(Expr::Ix(Ix::Row), t as i64), Expr::Int(1))) } else { Expr::Int(s as i64) };
    kb.name(&valid, "valid");
    let x = ops[0];
    let max = reduce(&mut kb, ReduceOp::Max, s, valid.clone(), |kb, j| {
        let p = at(kb, s, j);
        let xv = kb.value(x, &p)?;
        Ok(mul(f(scale), xv))
    })?;
    let sum = reduce(&mut kb, ReduceOp::Sum, s, valid.clone(), |kb, j| {
        let p = at(kb, s, j);
        let xv = kb.value(x, &p)?;
        Ok(Expr::un(UnOp::Exp, sub(mul(f(scale), xv), max.clone())))
    })?;
    kb.name(&max, "row_max");
    kb.name(&sum, "row_sum");
    let (lp, j) = kb.open_loop(Expr::Int(s as i64), s);
    let p = at(&kb, s, &j);
    kb.enter_lazy();
    let xv = kb.value(x, &p);
    kb.leave_lazy();
    let e = div(Expr::un(UnOp::Exp, sub(mul(f(scale), xv?), max)), sum);
    let y = if causal { Expr::select(Expr::bin(BinOp::Lt, j, valid), e, f(0.0)) } else { e };
    emit_out(&mut kb, a, p, y)?;
    kb.close_foreach(lp);
    launch!(lw, kb, &a.family, Space::Rows { rows, mapping: RowMapping::Block }, note)
}

/// Softmax's gradient (y, dy) -> scale * y * (dy - sum(dy * y)), a row at a time.
fn softmax_grad(lw: &mut Lowerer, cx: &Ctx, a: &Anchor, scale: f64) -> Result<(), KernelError> {
    let RowOp { node, ops, shape, note, .. } = RowOp::of(lw, cx, a);
    let s = shape.last().copied().unwrap_or(1);
    let rows = node.ty.numel() / s.max(1);
    let (y, dy) = (ops[0], ops[1]);
    let mut kb = lw.kb_rows(cx, rows, &[&a.dest]);
    let dot = reduce(&mut kb, ReduceOp::Sum, s, Expr::Int(s as i64), |kb, j| {
        let p = at(kb, s, j);
        let d = kb.value(dy, &p)?;
        let yv = kb.value(y, &p)?;
        Ok(mul(d, yv))
    })?;
    kb.name(&dot, "dot");
    let (lp, j) = kb.open_loop(Expr::Int(s as i64), s);
    let p = at(&kb, s, &j);
    let yv = kb.value(y, &p)?;
    let d = kb.value(dy, &p)?;
    let out = mul(mul(f(scale), yv), sub(d, dot));
    emit_out(&mut kb, a, p, out)?;
    kb.close_foreach(lp);
    launch!(lw, kb, &a.family, Space::Rows { rows, mapping: RowMapping::Block }, note)
}

/// Cross-entropy's gradient (logits [N, V], targets [N], dloss []) -> dlogits [N, V], a row at a
/// time.
fn cross_entropy_grad(lw: &mut Lowerer, cx: &Ctx, a: &Anchor) -> Result<(), KernelError> {
    let RowOp { ops, shape, note, .. } = RowOp::of(lw, cx, a);
    // dlogits = dloss / N * (softmax(row) - onehot(target))
    let (logits, targets, dloss) = (ops[0], ops[1], ops[2]);
    let (n, v) = (shape[0], shape[1]);
    let stats = ce_stats(lw, cx, logits, n);
    let touched: Vec<&View> = [&a.dest].into_iter().chain(stats.as_ref().map(|s| [&s.0 .0, &s.0 .1]).into_iter().flatten()).collect();
    let mut kb = lw.kb_rows(cx, n, &touched);
    let dl = kb.value(dloss, &Pos::Coords(vec![]))?;
    let k = kb.bind(Ty::F32, div(dl, f(n as f64)));
    kb.name(&k, "k");
    let target = kb.value(targets, &Pos::Lin(Expr::Ix(Ix::Row)))?;
    let (max, sum) = shared_max_sumexp(&mut kb, logits, v, &stats)?;
    let (lp, j) = kb.open_loop(Expr::Int(v as i64), v);
    let p = at(&kb, v, &j);
    let xv = kb.value(logits, &p)?;
    let prob = div(Expr::un(UnOp::Exp, sub(xv, max)), sum);
    let hit = Expr::select(Expr::bin(BinOp::Eq, j, target), k.clone(), f(0.0));
    emit_out(&mut kb, a, p, sub(mul(k, prob), hit))?;
    kb.close_foreach(lp);
    launch!(lw, kb, &a.family, Space::Rows { rows: n, mapping: RowMapping::Block }, note)
}

/// Cross-entropy (logits [N, V], targets [N]) -> the mean loss [], in two kernels.
fn cross_entropy(lw: &mut Lowerer, cx: &Ctx, a: &Anchor) -> Result<(), KernelError> {
    let RowOp { g, ops, note, .. } = RowOp::of(lw, cx, a);
    // per-row losses into a scratch [N], then their mean in a second pass (deterministic)
    let (logits, targets) = (ops[0], ops[1]);
    let lt = g.ty(logits).shape.0.clone();
    let (n, v) = (lt[0], lt[1]);
    let losses = row_losses(lw, cx, (logits, targets), (n, v), &note)?;
    let mut kb = lw.kb_rows(cx, 1, &[&a.dest]);
    let total = reduce(&mut kb, ReduceOp::Sum, n, Expr::Int(n as i64), |kb, j| Ok(kb.load_view(&losses, &Pos::Lin(j.clone()))))?;
    kb.name(&total, "total");
    emit_out(&mut kb, a, Pos::Coords(vec![]), div(total, f(n as f64)))?;
    launch!(lw, kb, &a.family, Space::Rows { rows: 1, mapping: RowMapping::Block }, format!("{note}: mean of the row losses"))
}

/// Per-row symmetric fake-quant of activations to `bits` (S = absmax / qmax).
fn act_quant(lw: &mut Lowerer, cx: &Ctx, a: &Anchor, bits: u8) -> Result<(), KernelError> {
    let RowOp { node, ops, shape, note, .. } = RowOp::of(lw, cx, a);
    // per-row symmetric fake-quant: S = absmax / qmax
    let c = shape.last().copied().unwrap_or(1);
    let rows = node.ty.numel() / c.max(1);
    let qmax = Grid::of(QuantScheme::Sym, bits).range(0.0).1;
    let mut kb = lw.kb_rows(cx, rows, &[&a.dest]);
    let x = ops[0];
    let absmax = reduce(&mut kb, ReduceOp::Max, c, Expr::Int(c as i64), |kb, j| {
        let p = at(kb, c, j);
        let xv = kb.value(x, &p)?;
        Ok(Expr::un(UnOp::Abs, xv))
    })?;
    let s = kb.bind(Ty::F32, div(absmax.clone(), f(qmax)));
    kb.name(&absmax, "absmax");
    kb.name(&s, "scale");
    let (lp, j) = kb.open_loop(Expr::Int(c as i64), c);
    let p = at(&kb, c, &j);
    let xv = kb.value(x, &p)?;
    let q = clamp(Expr::un(UnOp::RoundEven, div(xv, s.clone())), -qmax, qmax);
    let y = Expr::select(Expr::bin(BinOp::Eq, s.clone(), f(0.0)), f(0.0), mul(q, s));
    emit_out(&mut kb, a, p, y)?;
    kb.close_foreach(lp);
    launch!(lw, kb, &a.family, Space::Rows { rows, mapping: RowMapping::Block }, note)
}

/// The absmax of each block of `qmap::BLOCK` elements of the flattened operand (the 8-bit
/// moments' scales).
fn block_abs_max(lw: &mut Lowerer, cx: &Ctx, a: &Anchor) -> Result<(), KernelError> {
    let RowOp { g, ops, note, .. } = RowOp::of(lw, cx, a);
    // one program per block of the flattened operand; the last block may be partial
    let (n, bl) = (g.ty(ops[0]).numel(), qmap::BLOCK);
    let rows = qmap::blocks(n);
    let mut kb = lw.kb_rows(cx, rows, &[&a.dest]);
    let left = Expr::bin(BinOp::Sub, Expr::Int(n as i64), Expr::bin(BinOp::Mul, Expr::Ix(Ix::Row), Expr::Int(bl as i64)));
    let extent = Expr::bin(BinOp::Min, Expr::Int(bl as i64), left);
    let x = ops[0];
    let absmax = reduce(&mut kb, ReduceOp::Max, bl, extent, |kb, j| {
        let p = at(kb, bl, j);
        Ok(Expr::un(UnOp::Abs, kb.value(x, &p)?))
    })?;
    kb.name(&absmax, "absmax");
    emit_out(&mut kb, a, Pos::Lin(Expr::Ix(Ix::Row)), absmax)?;
    launch!(lw, kb, &a.family, Space::Rows { rows, mapping: RowMapping::Block }, note)
}

/// Scratch rows for the (max, sum) statistics of materialized logits, and whether another
/// cross-entropy kernel already fills them (true: read them; false: this kernel writes them).
/// None when the logits are computed inline (nothing to share).
fn ce_stats(lw: &mut Lowerer, cx: &Ctx, logits: NodeId, n: usize) -> Option<((View, View), bool)> {
    let key = cx.leaves.get(&logits)?.clone();
    if let Some(s) = lw.ce_stats.get(&key) {
        return Some((s.clone(), true));
    }
    let s = (lw.temp("ce_max", qatc_ir::DType::F32, &[n]), lw.temp("ce_sum", qatc_ir::DType::F32, &[n]));
    lw.ce_stats.insert(key, s.clone());
    Some((s, false))
}

/// The row's (max, sum of exp(x - max)): read from the shared scratch when another kernel
/// computed them (bit-identical: the same reductions in the same backend), else computed here
/// and, when there is a scratch, stored for the other kernel.
fn shared_max_sumexp(
    kb: &mut KernelBuilder,
    logits: NodeId,
    v: usize,
    stats: &Option<((View, View), bool)>,
) -> Result<(Expr, Expr), KernelError> {
    let row = Pos::Lin(Expr::Ix(Ix::Row));
    match stats {
        Some(((mx, sm), true)) => {
            let max = kb.load_view(mx, &row);
            let max = kb.bind(Ty::F32, max);
            let sum = kb.load_view(sm, &row);
            let sum = kb.bind(Ty::F32, sum);
            kb.name(&max, "row_max");
            kb.name(&sum, "row_sum");
            Ok((max, sum))
        }
        Some(((mx, sm), false)) => {
            let (max, sum) = max_sumexp(kb, logits, v)?;
            kb.store_view(mx, &row, max.clone());
            kb.store_view(sm, &row, sum.clone());
            Ok((max, sum))
        }
        None => max_sumexp(kb, logits, v),
    }
}

/// (max, sum of exp(x - max)) of row `row` of logits [N, V].
fn max_sumexp(kb: &mut KernelBuilder, logits: NodeId, v: usize) -> Result<(Expr, Expr), KernelError> {
    let max = reduce(kb, ReduceOp::Max, v, Expr::Int(v as i64), |kb, j| {
        let p = at(kb, v, j);
        kb.value(logits, &p)
    })?;
    let sum = reduce(kb, ReduceOp::Sum, v, Expr::Int(v as i64), |kb, j| {
        let p = at(kb, v, j);
        let xv = kb.value(logits, &p)?;
        Ok(Expr::un(UnOp::Exp, sub(xv, max.clone())))
    })?;
    kb.name(&max, "row_max");
    kb.name(&sum, "row_sum");
    Ok((max, sum))
}

/// dlogits = dloss * w[row] * (softmax(row) - onehot(target)): `Op::CrossEntropyGrad`'s kernel
/// with the row's weight where the mean has 1/N.
fn weighted_cross_entropy_grad(lw: &mut Lowerer, cx: &Ctx, a: &Anchor, note: String) -> Result<(), KernelError> {
    let ops = cx.g.operands(a.node);
    let (logits, targets, weights, dloss) = (ops[0], ops[1], ops[2], ops[3]);
    let (n, v) = (cx.g.ty(logits).shape.0[0], cx.g.ty(logits).shape.0[1]);
    let stats = ce_stats(lw, cx, logits, n);
    let touched: Vec<&View> = [&a.dest].into_iter().chain(stats.as_ref().map(|s| [&s.0 .0, &s.0 .1]).into_iter().flatten()).collect();
    let mut kb = lw.kb_rows(cx, n, &touched);
    let dl = kb.value(dloss, &Pos::Coords(vec![]))?;
    let w = kb.value(weights, &Pos::Lin(Expr::Ix(Ix::Row)))?;
    let k = kb.bind(Ty::F32, mul(dl, w));
    kb.name(&k, "k");
    let target = kb.value(targets, &Pos::Lin(Expr::Ix(Ix::Row)))?;
    let (max, sum) = shared_max_sumexp(&mut kb, logits, v, &stats)?;
    let (lp, j) = kb.open_loop(Expr::Int(v as i64), v);
    let p = at(&kb, v, &j);
    let xv = kb.value(logits, &p)?;
    let prob = div(Expr::un(UnOp::Exp, sub(xv, max)), sum);
    let hit = Expr::select(Expr::bin(BinOp::Eq, j, target), k.clone(), f(0.0));
    emit_out(&mut kb, a, p, sub(mul(k, prob), hit))?;
    kb.close_foreach(lp);
    launch!(lw, kb, &a.family, Space::Rows { rows: n, mapping: RowMapping::Block }, note)
}

/// sum over rows of w[row] * (logsumexp(row) - row[target]): `Op::CrossEntropy`'s two kernels
/// (the row losses, then their sum in row order) with each row's loss weighted in the sum.
fn weighted_cross_entropy(lw: &mut Lowerer, cx: &Ctx, a: &Anchor, note: String) -> Result<(), KernelError> {
    let ops = cx.g.operands(a.node);
    let (logits, targets, weights) = (ops[0], ops[1], ops[2]);
    let (n, v) = (cx.g.ty(logits).shape.0[0], cx.g.ty(logits).shape.0[1]);
    let losses = row_losses(lw, cx, (logits, targets), (n, v), &note)?;
    let mut kb = lw.kb_rows(cx, 1, &[&a.dest, &losses]);
    let total = reduce(&mut kb, ReduceOp::Sum, n, Expr::Int(n as i64), |kb, j| {
        let l = kb.load_view(&losses, &Pos::Lin(j.clone()));
        let w = kb.value(weights, &Pos::Lin(j.clone()))?;
        Ok(mul(w, l))
    })?;
    kb.name(&total, "total");
    emit_out(&mut kb, a, Pos::Coords(vec![]), total)?;
    launch!(lw, kb, &a.family, Space::Rows { rows: 1, mapping: RowMapping::Block }, format!("{note}: weighted sum of the row losses"))
}

/// Packed sequences' causal softmax (`Op::PackedSoftmax`): `Op::Softmax`'s kernel with row i of
/// batch b over keys first ..= i, first = i - positions[b, i] clamped to 0 ..= i (its own
/// example's tokens so far), and exactly 0 elsewhere.
fn packed_softmax(lw: &mut Lowerer, cx: &Ctx, a: &Anchor, note: String, scale: f64) -> Result<(), KernelError> {
    let ops = cx.g.operands(a.node);
    let (x, positions) = (ops[0], ops[1]);
    let shape = cx.g.ty(a.node).shape.0.clone();
    let (nh, t) = (shape[1], shape[3]);
    let rows = cx.g.ty(a.node).numel() / t.max(1);
    let mut kb = lw.kb_rows(cx, rows, &[&a.dest]);
    // row = (b NH + h) T + i
    let i = kb.bounds.rem(Expr::Ix(Ix::Row), t as i64);
    let bi = kb.bounds.div(Expr::Ix(Ix::Row), (nh * t) as i64);
    let at_bi = kb.bounds.add(kb.bounds.mul(bi, t as i64), i.clone());
    let back = kb.value(positions, &Pos::Lin(at_bi))?;
    let back = Expr::bin(BinOp::Min, Expr::bin(BinOp::Max, back, Expr::Int(0)), i.clone());
    let first = kb.bind(Ty::I32, sub(i.clone(), back));
    let valid = kb.bind(Ty::I32, add(i, Expr::Int(1)));
    kb.name(&first, "first");
    kb.name(&valid, "valid");
    let count = kb.bind(Ty::I32, sub(valid.clone(), first.clone()));
    let key = |kb: &KernelBuilder, k: &Expr| kb.bounds.add(first.clone(), k.clone());
    let max = reduce(&mut kb, ReduceOp::Max, t, count.clone(), |kb, k| {
        let p = at(kb, t, &key(kb, k));
        let xv = kb.value(x, &p)?;
        Ok(mul(f(scale), xv))
    })?;
    let sum = reduce(&mut kb, ReduceOp::Sum, t, count, |kb, k| {
        let p = at(kb, t, &key(kb, k));
        let xv = kb.value(x, &p)?;
        Ok(Expr::un(UnOp::Exp, sub(mul(f(scale), xv), max.clone())))
    })?;
    kb.name(&max, "row_max");
    kb.name(&sum, "row_sum");
    let (lp, j) = kb.open_loop(Expr::Int(t as i64), t);
    let p = at(&kb, t, &j);
    kb.enter_lazy();
    let xv = kb.value(x, &p);
    kb.leave_lazy();
    let e = div(Expr::un(UnOp::Exp, sub(mul(f(scale), xv?), max)), sum);
    let inside = Expr::bin(BinOp::And, Expr::bin(BinOp::Le, first, j.clone()), Expr::bin(BinOp::Lt, j, valid));
    emit_out(&mut kb, a, p, Expr::select(inside, e, f(0.0)))?;
    kb.close_foreach(lp);
    launch!(lw, kb, &a.family, Space::Rows { rows, mapping: RowMapping::Block }, note)
}

/// The cross-entropy's first kernel, shared by the mean and the weighted sum: each row's loss
/// logsumexp(row) - row[target] into a scratch [N].
fn row_losses(
    lw: &mut Lowerer,
    cx: &Ctx,
    (logits, targets): (NodeId, NodeId),
    (n, v): (usize, usize),
    note: &str,
) -> Result<View, KernelError> {
    let losses = lw.temp("ce_rows", qatc_ir::DType::F32, &[n]);
    let stats = ce_stats(lw, cx, logits, n);
    let touched: Vec<&View> = [&losses].into_iter().chain(stats.as_ref().map(|s| [&s.0 .0, &s.0 .1]).into_iter().flatten()).collect();
    let mut kb = lw.kb_rows(cx, n, &touched);
    let target = kb.value(targets, &Pos::Lin(Expr::Ix(Ix::Row)))?;
    let (max, sum) = shared_max_sumexp(&mut kb, logits, v, &stats)?;
    let clamped = Expr::bin(BinOp::Min, Expr::bin(BinOp::Max, target, Expr::Int(0)), Expr::Int(v as i64 - 1));
    let t = kb.bind(Ty::I32, clamped);
    let t = kb.to_index(t);
    let col = at(&kb, v, &t);
    let xt = kb.value(logits, &col)?;
    let loss = sub(add(max, Expr::un(UnOp::Log, sum)), xt);
    kb.store_view(&losses, &Pos::Lin(Expr::Ix(Ix::Row)), loss);
    launch!(lw, kb, "cross_entropy", Space::Rows { rows: n, mapping: RowMapping::Block }, format!("{note}: per-row losses"))?;
    Ok(losses)
}
