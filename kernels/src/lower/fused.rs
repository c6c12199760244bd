//! Lowering one root node whose leaves are in memory: the body of a fused `Op::Kernel` node, or a
//! single op of the unfused step.
//!
//! The nodes under the root that cannot be inlined (matmuls, row ops, reductions: "anchors") need
//! a pass of their own. One of them may share the root's kernel: the root itself, or a row op the
//! root reads only through elementwise ops at the same position (its epilogue). The others are
//! computed first into scratch buffers, which is a split of the fused node, recorded in
//! `Program::splits`.

use std::collections::{HashMap, HashSet};

use qatc_ir::{Graph, KernelFamily, NodeId, Op, OpKind};

use super::anchor::Anchor;
use super::inline::inlinable;
use super::{attention, memo, reduce, rows, scatter};
use super::{elementwise, pack_parts, Ctx, Lowerer, PackPart};
use crate::error::KernelError;
use crate::program::{Gemm, GemmTypes, Materialized, Step, View};

/// Lowers `Op::Kernel { family, body }` with its operands in `operands` into `dest`; its kernels
/// are named after the family.
pub fn lower_kernel_node(
    lw: &mut Lowerer,
    g: &Graph,
    id: NodeId,
    family: &KernelFamily,
    body: &Graph,
    operands: &[View],
    dest: View,
) -> Result<(), KernelError> {
    let mut cx = body_ctx(g, id, body, operands)?;
    let root =
        body.output("out").ok_or_else(|| KernelError::Unsupported { node: g.describe(id), why: "body has no output `out`".into() })?;
    let family = &family.to_string();
    let before = lw.prog.steps.len();
    if cx.leaves.contains_key(&root) {
        // the body returns an operand as is: a copy
        elementwise(lw, &cx, root, &dest, family)?;
    } else {
        // a node like one lowered before (another layer's) replays its steps on its own buffers
        let d = dest.clone();
        memo::lower_or_replay(lw, family, body, operands, &[&d], |lw| lower_root(lw, &mut cx, root, dest, family))?;
    }
    let steps = &lw.prog.steps[before..];
    if steps.len() > 1 {
        let kinds: Vec<String> = steps
            .iter()
            .map(|s| match s {
                Step::Gemm(_) => "gemm".to_string(),
                Step::Launch { kernel, .. } => lw.prog.kernels[*kernel].family.clone(),
                Step::Collective(c) => c.exchange.mnemonic().to_string(),
            })
            .collect();
        lw.prog.splits.push(format!("{} ({family}): {} steps: {}", g.describe(id), steps.len(), kinds.join(" + ")));
    }
    Ok(())
}

/// The context of fused node `id`'s `body` on `operands`: body input `in{i}` is operand i, and
/// names the kernels' parameter on its buffer.
pub fn body_ctx<'g>(g: &Graph, id: NodeId, body: &'g Graph, operands: &[View]) -> Result<Ctx<'g>, KernelError> {
    let mut cx = Ctx { g: body, leaves: HashMap::new(), names: HashMap::new(), order: operands.iter().map(|v| v.buf).collect() };
    for (i, v) in operands.iter().enumerate() {
        let name = format!("in{i}");
        let inp = body
            .find_input(&name)
            .ok_or_else(|| KernelError::Unsupported { node: g.describe(id), why: format!("body has no input {name}") })?;
        cx.names.entry(v.buf).or_insert(name);
        cx.leaves.insert(inp, v.clone());
    }
    Ok(cx)
}

/// The parts of a packed multi-result kernel whose parts are computed by steps of their own
/// (its root a concat along axis 0 with a GEMM or a row op under it): (part node, start, length)
/// along the pack. None when the body is computed in one pass (an elementwise concat) or is not
/// a pack.
pub fn separate_parts(body: &Graph, operands: usize) -> Option<Vec<PackPart>> {
    let root = body.output("out")?;
    let Op::Concat { axis: 0 } = body.node(root).op else { return None };
    let leaves: HashMap<NodeId, View> =
        (0..operands).filter_map(|i| body.find_input(&format!("in{i}"))).map(|n| (n, View::contiguous(0, &body.ty(n).shape.0))).collect();
    if anchors_under(body, root, &leaves).is_empty() {
        return None;
    }
    Some(pack_parts(body, root))
}

/// Lowers one part of a pack into `slice` (its place, of the part's shape): through its
/// reshapes where the destination allows, elementwise when nothing under it needs a pass of its
/// own.
pub fn lower_part(lw: &mut Lowerer, cx: &mut Ctx, part: NodeId, slice: View, family: &str) -> Result<(), KernelError> {
    let g = cx.g;
    let (mut node, mut d) = (part, slice.clone());
    while let (Op::Reshape { .. }, false) = (&g.node(node).op, cx.leaves.contains_key(&node)) {
        let src = g.operands(node)[0];
        match d.reshape(&g.ty(src).shape.0) {
            Some(v) => (node, d) = (src, v),
            None => break,
        }
    }
    if anchors_under(g, node, &cx.leaves).is_empty() {
        elementwise(lw, cx, part, &slice, family)
    } else {
        lower_root(lw, cx, node, d, family)
    }
}

fn is_matmul(op: &Op) -> bool {
    matches!(op, Op::MatMul { .. })
}

/// Nodes under `root` (itself included) that need a pass of their own, operands first.
fn anchors_under(g: &Graph, root: NodeId, leaves: &HashMap<NodeId, View>) -> Vec<NodeId> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    let mut stack = vec![(root, false)];
    while let Some((n, expanded)) = stack.pop() {
        if expanded {
            if !inlinable(&g.node(n).op) {
                out.push(n);
            }
            continue;
        }
        if leaves.contains_key(&n) || !seen.insert(n) {
            continue;
        }
        stack.push((n, true));
        for o in g.operands(n).into_iter().rev() {
            stack.push((o, false));
        }
    }
    out
}

/// Ops that keep a position: the value at p depends only on operands at p (same shape).
fn keeps_position(op: &Op) -> bool {
    matches!(
        op,
        Op::Unary(_) | Op::Binary(_) | Op::Affine { .. } | Op::Cast { .. } | Op::Dropout { .. } | Op::AdamM { .. } | Op::AdamV { .. }
    )
}

/// The row op among `anchors` that `root` reads only through position-keeping ops of its own
/// shape, so its kernel can apply the root as an epilogue before the store.
fn epilogue_anchor(g: &Graph, root: NodeId, anchors: &[NodeId], leaves: &HashMap<NodeId, View>) -> Option<NodeId> {
    let shape = &g.ty(root).shape;
    anchors.iter().rev().copied().find(|&a| {
        if is_matmul(&g.node(a).op) || &g.ty(a).shape != shape || a == root {
            return false;
        }
        // every node on a path from root down to `a` must keep positions
        let mut memo: HashMap<NodeId, bool> = HashMap::new();
        reaches_only_elementwise(g, root, a, leaves, &mut memo).unwrap_or(false)
    })
}

/// Some(true) if `n` reaches `a` and every node on the way keeps positions at `a`'s shape,
/// Some(false) if it reaches it otherwise, None if it does not reach it.
fn reaches_only_elementwise(
    g: &Graph,
    n: NodeId,
    a: NodeId,
    leaves: &HashMap<NodeId, View>,
    memo: &mut HashMap<NodeId, bool>,
) -> Option<bool> {
    if n == a {
        return Some(true);
    }
    if leaves.contains_key(&n) {
        return None;
    }
    if let Some(&ok) = memo.get(&n) {
        return Some(ok);
    }
    let mut reached = None;
    for o in g.operands(n) {
        if let Some(ok) = reaches_only_elementwise(g, o, a, leaves, memo) {
            let here = ok && keeps_position(&g.node(n).op) && g.ty(n).shape == g.ty(a).shape;
            reached = Some(reached.unwrap_or(true) && here);
        }
    }
    if let Some(ok) = reached {
        memo.insert(n, ok);
    }
    reached
}

/// Lowers `root` into `dest`.
pub fn lower_root(lw: &mut Lowerer, cx: &mut Ctx, root: NodeId, dest: View, family: &str) -> Result<(), KernelError> {
    let g = cx.g;
    if let Some(m) = attention::matches(g, root, &cx.leaves) {
        return attention::lower(lw, cx, m, root, dest, family, operand_view);
    }
    if let Some((mm, bias)) = gemm_bias(g, root, &cx.leaves) {
        let b = operand_view(lw, cx, bias, family)?;
        return gemm(lw, cx, mm, dest, Some(b), family);
    }
    // a sum of GEMMs (a weight's product plus its LoRA branch) accumulates into one buffer: the
    // destination itself when the root reads it position by position, so no product is held apart
    if let Some((sum, terms)) = gemm_sum(g, root, &cx.leaves) {
        let into_dest =
            sum == root || (dest.is_contiguous() && reaches_only_elementwise(g, root, sum, &cx.leaves, &mut HashMap::new()) == Some(true));
        let shape = g.ty(sum).shape.0.clone();
        let target = if into_dest {
            View { shape: shape.clone(), strides: crate::index::strides(&shape), ..dest.clone() }
        } else {
            lw.temp(&format!("t{}", sum.index()), g.ty(sum).dtype, &shape)
        };
        for (i, t) in terms.iter().enumerate() {
            let bias = match t.bias {
                Some(b) => Some(operand_view(lw, cx, b, family)?),
                None => None,
            };
            gemm_into(lw, cx, t.mm, target.clone(), bias, t.alpha, i > 0, family)?;
        }
        cx.leaves.insert(sum, target);
        if sum == root {
            return Ok(());
        }
    }
    let anchors = anchors_under(g, root, &cx.leaves);
    if let (Op::Concat { axis }, false) = (&g.node(root).op, anchors.is_empty()) {
        return concat_into_slices(lw, cx, root, *axis, dest, family);
    }
    let fused = if !inlinable(&g.node(root).op) { Some(root) } else { epilogue_anchor(g, root, &anchors, &cx.leaves) };
    for &a in &anchors {
        if Some(a) == fused || cx.leaves.contains_key(&a) {
            continue;
        }
        let t = temp_for(lw, cx, a, family)?;
        cx.leaves.insert(a, t);
    }
    match fused {
        None => elementwise(lw, cx, root, &dest, family),
        Some(a) if is_matmul(&g.node(a).op) => gemm(lw, cx, a, dest, None, family),
        Some(a) => lower_anchor(lw, cx, &Anchor { node: a, dest, epilogue: (a != root).then_some(root), family: family.to_string() }),
    }
}

/// Lowers an anchor by the file that lowers its op: the row ops by `rows.rs`, scatter_add by
/// `scatter.rs`, the other reductions by `reduce.rs`. Exhaustive over the op table's kinds, so a
/// new op must be routed here before the crate compiles (a catch-all once sent the packed softmax
/// and the weighted cross-entropy to `reduce.rs`, which has no lowering for them).
fn lower_anchor(lw: &mut Lowerer, cx: &Ctx, a: &Anchor) -> Result<(), KernelError> {
    use OpKind as K;
    let op = &cx.g.node(a.node).op;
    match op.kind() {
        K::LayerNorm
        | K::LayerNormGradX
        | K::Softmax
        | K::SoftmaxGrad
        | K::PackedSoftmax
        | K::CrossEntropyGrad
        | K::CrossEntropy
        | K::WeightedCrossEntropy
        | K::WeightedCrossEntropyGrad
        | K::ActQuant
        | K::BlockAbsMax => rows::lower(lw, cx, a),
        K::ScatterAdd => match *op {
            Op::ScatterAdd { rows } => scatter::lower(lw, cx, a, rows),
            _ => unreachable_kind(cx, a),
        },
        K::SumTo | K::LayerNormGradGamma | K::FakeQuant | K::AllFinite => reduce::lower(lw, cx, a),
        // pointwise chains, GEMMs, leaves, whole kernels, the optimizer's and the collectives:
        // never an anchor of a row or reduction kernel (fusion and the lowering route them)
        K::Input
        | K::Const
        | K::Neg
        | K::Exp
        | K::Log
        | K::Sqrt
        | K::Rsqrt
        | K::Recip
        | K::Tanh
        | K::Square
        | K::Gelu
        | K::Add
        | K::Sub
        | K::Mul
        | K::Div
        | K::Max
        | K::Min
        | K::GeluGrad
        | K::Affine
        | K::Cast
        | K::Broadcast
        | K::Reshape
        | K::Transpose
        | K::Slice
        | K::Concat
        | K::MatMul
        | K::Gather
        | K::Dequantize
        | K::FakeQuantLearned
        | K::FakeQuantLearnedGrad
        | K::Dropout
        | K::Select
        | K::LossScale
        | K::Kernel
        | K::AdamM
        | K::AdamV
        | K::AdamParam
        | K::BlockDequant
        | K::BlockQuant
        | K::AllReduce
        | K::ReduceScatter
        | K::AllGather => reduce::lower(lw, cx, a),
    }
}

/// An op whose kind and variant disagree (cannot happen: `Op::kind` is one match).
fn unreachable_kind(cx: &Ctx, a: &Anchor) -> Result<(), KernelError> {
    Err(KernelError::Internal(format!("{}: its kind and its op disagree", cx.g.describe(a.node))))
}

/// root = matmul + broadcast(bias [N]) over the matmul's [.., M, N]: cuBLASLt's BIAS epilogue.
fn gemm_bias(g: &Graph, root: NodeId, leaves: &HashMap<NodeId, View>) -> Option<(NodeId, NodeId)> {
    if leaves.contains_key(&root) || !matches!(g.node(root).op, Op::Binary(qatc_ir::BinaryOp::Add)) {
        return None;
    }
    let ops = g.operands(root);
    let (mm, other) = match (&g.node(ops[0]).op, &g.node(ops[1]).op) {
        (Op::MatMul { .. }, _) if !leaves.contains_key(&ops[0]) => (ops[0], ops[1]),
        (_, Op::MatMul { .. }) if !leaves.contains_key(&ops[1]) => (ops[1], ops[0]),
        _ => return None,
    };
    let Op::Broadcast { .. } = g.node(other).op else { return None };
    let src = g.operands(other)[0];
    let n = *g.ty(mm).shape.0.last()?;
    // the bias adds in f32 before the one rounding of a f16/bf16 result (cuBLASLt's epilogue)
    let ok = g.ty(src).shape.0 == [n] && g.ty(src).dtype.is_float() && g.ty(mm).dtype.is_float();
    ok.then_some((mm, src))
}

/// A view of `node`'s value: shape ops over a leaf compose into one view; anything else is
/// computed into a scratch buffer first (a dequantized weight, recorded with its traffic).
pub fn operand_view(lw: &mut Lowerer, cx: &mut Ctx, node: NodeId, family: &str) -> Result<View, KernelError> {
    if let Some(v) = view_chain(cx, node) {
        return Ok(v);
    }
    let g = cx.g;
    let ty = g.ty(node).clone();
    let sub_family = match g.node(node).op {
        Op::Dequantize { .. } => "dequant",
        _ => family,
    };
    let t = temp_for(lw, cx, node, sub_family)?;
    if let Op::Dequantize { .. } = g.node(node).op {
        let read: usize = g.operands(node).iter().map(|&o| g.ty(o).bytes()).sum();
        lw.prog.materialized.push(Materialized { what: memo::dequantized(g, node), bytes_read: read, bytes_written: ty.bytes() });
    }
    cx.leaves.insert(node, t.clone());
    Ok(t)
}

/// Lowers `node` into a scratch of its own, or over its logits for a cross-entropy gradient
/// whose logits die here (`inplace.rs`); returns where its value is.
fn temp_for(lw: &mut Lowerer, cx: &mut Ctx, node: NodeId, family: &str) -> Result<View, KernelError> {
    let g = cx.g;
    let logits = g.operands(node).first().and_then(|l| cx.leaves.get(l)).cloned();
    let over = super::inplace::over_logits(lw, g, node, logits.as_ref());
    let first = lw.prog.steps.len();
    let t = match &over {
        Some(v) => v.clone(),
        None => lw.temp(&format!("t{}", node.index()), g.ty(node).dtype, &g.ty(node).shape.0),
    };
    lower_root(lw, cx, node, t.clone(), family)?;
    if let Some(v) = &over {
        super::inplace::verify(&lw.prog, first, v.buf)?;
    }
    Ok(t)
}

fn view_chain(cx: &Ctx, node: NodeId) -> Option<View> {
    if let Some(v) = cx.leaves.get(&node) {
        return Some(v.clone());
    }
    let g = cx.g;
    let src = || g.operands(node).first().and_then(|&o| view_chain(cx, o));
    match &g.node(node).op {
        Op::Reshape { shape } => src()?.reshape(&shape.0),
        Op::Transpose { perm } => Some(src()?.transpose(perm)),
        Op::Slice { axis, start, end } => Some(src()?.slice(*axis, *start, *end)),
        Op::Broadcast { shape } => Some(src()?.broadcast(&shape.0)),
        _ => None,
    }
}

/// A matrix operand the GEMM library reads directly: unit stride along one of the last two dims.
fn gemm_ready(v: &View) -> bool {
    let r = v.shape.len();
    r >= 2 && (v.strides[r - 1] == 1 || v.strides[r - 2] == 1) && v.strides[r - 2..].iter().all(|&s| s > 0 || v.shape[r - 2..].contains(&1))
}

fn swap_last2(v: &View) -> View {
    let r = v.shape.len();
    let mut perm: Vec<usize> = (0..r).collect();
    perm.swap(r - 1, r - 2);
    v.transpose(&perm)
}

/// One GEMM of a [`gemm_sum`]: `alpha * mm (+ bias)`.
struct Term {
    mm: NodeId,
    alpha: f64,
    bias: Option<NodeId>,
}

/// The GEMM terms of `n` when it is a sum of them: a matmul, a matmul scaled by
/// `affine[mul=s, add=0]`, a matmul plus a broadcast bias row, and sums of those; each matmul
/// (and its scale) read by nothing else, every term f32 of `n`'s shape.
fn terms_of(g: &Graph, n: NodeId, leaves: &HashMap<NodeId, View>, out: &mut Vec<Term>) -> bool {
    if leaves.contains_key(&n) || g.ty(n).dtype != qatc_ir::DType::F32 {
        return false;
    }
    let only_user = |x: NodeId, u: NodeId| g.users(x) == [u];
    match &g.node(n).op {
        Op::MatMul { .. } => {
            out.push(Term { mm: n, alpha: 1.0, bias: None });
            true
        }
        Op::Affine { mul, add } if *add == 0.0 => {
            let x = g.operands(n)[0];
            let ok = matches!(g.node(x).op, Op::MatMul { .. }) && !leaves.contains_key(&x) && only_user(x, n);
            if ok {
                out.push(Term { mm: x, alpha: *mul, bias: None });
            }
            ok
        }
        Op::Binary(qatc_ir::BinaryOp::Add) => {
            if let Some((mm, bias)) = gemm_bias(g, n, leaves) {
                if !only_user(mm, n) || out.iter().any(|t| t.bias.is_some()) {
                    return false;
                }
                out.push(Term { mm, alpha: 1.0, bias: Some(bias) });
                return true;
            }
            let ops = g.operands(n);
            let shape = &g.ty(n).shape;
            ops.len() == 2
                && ops.iter().all(|&o| &g.ty(o).shape == shape && (only_user(o, n) || leaves.contains_key(&o)))
                && terms_of(g, ops[0], leaves, out)
                && terms_of(g, ops[1], leaves, out)
        }
        _ => false,
    }
}

/// The largest sum of two or more GEMM terms under `root`, reached through position-keeping
/// ops, with its terms (the one with a bias first: a GEMM writes its bias, later ones
/// accumulate).
fn gemm_sum(g: &Graph, root: NodeId, leaves: &HashMap<NodeId, View>) -> Option<(NodeId, Vec<Term>)> {
    let mut stack = vec![root];
    let mut seen = HashSet::new();
    while let Some(n) = stack.pop() {
        if leaves.contains_key(&n) || !seen.insert(n) {
            continue;
        }
        if matches!(g.node(n).op, Op::Binary(qatc_ir::BinaryOp::Add)) {
            let mut terms = Vec::new();
            if terms_of(g, n, leaves, &mut terms) && terms.len() >= 2 {
                terms.sort_by_key(|t| t.bias.is_none());
                return Some((n, terms));
            }
        }
        if keeps_position(&g.node(n).op) || n == root {
            stack.extend(g.operands(n).into_iter().filter(|&o| g.ty(o).shape == g.ty(n).shape));
        }
    }
    None
}

fn gemm(lw: &mut Lowerer, cx: &mut Ctx, mm: NodeId, dest: View, bias: Option<View>, family: &str) -> Result<(), KernelError> {
    gemm_into(lw, cx, mm, dest, bias, 1.0, false, family)
}

/// Whether `x` is plus or minus a power of two (a scale that changes no bit but the exponent).
fn power_of_two(x: f64) -> bool {
    let m = x.abs();
    m.is_normal() && m.log2().round().exp2() == m
}

/// `dest (+)= alpha * mm (+ bias)` as one library GEMM.
#[allow(clippy::too_many_arguments)]
fn gemm_into(
    lw: &mut Lowerer,
    cx: &mut Ctx,
    mm: NodeId,
    dest: View,
    bias: Option<View>,
    alpha: f64,
    accumulate: bool,
    family: &str,
) -> Result<(), KernelError> {
    let g = cx.g;
    let Op::MatMul { ta, tb } = g.node(mm).op else { return Err(KernelError::Internal("gemm of a non-matmul".into())) };
    let ops = g.operands(mm);
    let mut alpha = alpha;
    let mut views = Vec::new();
    for &o in &ops {
        // an operand scaled by a power of two (LoRA's alpha / r on its way into the adapter's
        // GEMMs) is read unscaled, the scale the GEMM's alpha: (2^k x) . y = 2^k (x . y) exactly,
        // product by product and sum by sum (short of overflow), where a scaled copy would cost a
        // kernel that reads and writes the whole operand
        // (only where the scaled copy is not there already and the unscaled operand is: a leaf of
        // this node, or a view of one)
        let o = match g.node(o).op {
            Op::Affine { mul, add }
                if add == 0.0 && power_of_two(mul) && !cx.leaves.contains_key(&o) && view_chain(cx, g.operands(o)[0]).is_some() =>
            {
                alpha *= mul;
                g.operands(o)[0]
            }
            _ => o,
        };
        let mut v = operand_view(lw, cx, o, family)?;
        if !gemm_ready(&v) {
            // a broadcast or doubly strided operand: copy it out first
            let t = lw.temp(&format!("t{}", o.index()), g.ty(o).dtype, &g.ty(o).shape.0);
            let sub = Ctx { g, leaves: HashMap::from([(o, v)]), names: cx.names.clone(), order: cx.order.clone() };
            elementwise(lw, &sub, o, &t, "copy")?;
            v = t;
        }
        views.push(v);
    }
    let a = if ta { swap_last2(&views[0]) } else { views[0].clone() };
    let b = if tb { swap_last2(&views[1]) } else { views[1].clone() };
    let shape = &g.ty(mm).shape.0;
    let r = shape.len();
    let (m, n, k) = (shape[r - 2], shape[r - 1], a.shape[r - 1]);
    let c = if dest.shape == *shape { dest } else { View { shape: shape.clone(), strides: crate::index::strides(shape), ..dest } };
    let note = lw.note(cx, mm, None);
    let dtype = |v: &View| lw.prog.buffers[v.buf].dtype;
    let types = GemmTypes { a: dtype(&a), b: dtype(&b), c: dtype(&c), bias: bias.as_ref().map(dtype) };
    lw.push_gemm(Gemm { a, b, c, m, n, k, alpha, accumulate, bias, types, note });
    Ok(())
}

/// A concat computes each part straight into its slice of `dest` (a fused node with several
/// results returns them concatenated): no scratch buffers and no copy. Reshapes of a part are
/// peeled off where the slice is contiguous, so a matmul writes its rows in place.
fn concat_into_slices(lw: &mut Lowerer, cx: &mut Ctx, root: NodeId, axis: usize, dest: View, family: &str) -> Result<(), KernelError> {
    let g = cx.g;
    let mut start = 0;
    for part in g.operands(root) {
        let len = g.ty(part).shape.0[axis];
        let slice = dest.slice(axis, start, start + len);
        start += len;
        lower_part(lw, cx, part, slice, family)?;
    }
    Ok(())
}
