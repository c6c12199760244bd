//! Type inference: the output type of an op from its operands' types. The graph builder calls it
//! on every insertion and the verifier calls it again on every node, so a pass cannot leave a node
//! whose recorded type disagrees with what its op computes.

use crate::op::{Op, QuantParam, QuantSpec};
use crate::types::{DType, Shape, TensorType};

/// Why an op rejects its operands, without the node context (the caller adds it).
pub type InferError = String;

fn float(t: &TensorType, what: &str) -> Result<(), InferError> {
    if t.dtype.is_float() {
        Ok(())
    } else {
        Err(format!("{what} must be a float tensor, got {t}"))
    }
}

fn same(a: &TensorType, b: &TensorType, what: &str) -> Result<(), InferError> {
    if a == b {
        Ok(())
    } else {
        Err(format!("{what}: operand types differ: {a} vs {b}"))
    }
}

fn ints(t: &TensorType, what: &str) -> Result<(), InferError> {
    if t.dtype == DType::I32 {
        Ok(())
    } else {
        Err(format!("{what} must be i32, got {t}"))
    }
}

/// True when `from` broadcasts to `to` under numpy's trailing-aligned rules.
pub fn broadcasts_to(from: &Shape, to: &Shape) -> bool {
    if from.rank() > to.rank() {
        return false;
    }
    let off = to.rank() - from.rank();
    from.0.iter().enumerate().all(|(i, &d)| d == to.0[i + off] || d == 1)
}

fn vector_of(t: &TensorType, c: usize, what: &str) -> Result<(), InferError> {
    if t.shape.0 == [c] && t.dtype.is_float() {
        Ok(())
    } else {
        Err(format!("{what} must be [{c}], got {t}"))
    }
}

pub fn infer(op: &Op, ins: &[&TensorType]) -> Result<TensorType, InferError> {
    if let Some(n) = op.arity() {
        if ins.len() != n {
            return Err(format!("{} takes {n} operand(s), got {}", op.mnemonic(), ins.len()));
        }
    } else if ins.is_empty() {
        return Err(format!("{} takes at least one operand", op.mnemonic()));
    }
    match op {
        Op::Input { dtype, shape, .. } | Op::Const { dtype, shape, .. } => Ok(TensorType::new(*dtype, shape.clone())),
        Op::Unary(_) => {
            float(ins[0], "operand")?;
            Ok(ins[0].clone())
        }
        Op::Binary(_) | Op::AdamM { .. } | Op::AdamV { .. } => {
            float(ins[0], "lhs")?;
            same(ins[0], ins[1], op.mnemonic())?;
            Ok(ins[0].clone())
        }
        Op::Affine { .. } => {
            float(ins[0], "operand")?;
            Ok(ins[0].clone())
        }
        Op::Cast { to } => Ok(TensorType::new(*to, ins[0].shape.clone())),
        Op::Broadcast { shape } => {
            if broadcasts_to(&ins[0].shape, shape) {
                Ok(TensorType::new(ins[0].dtype, shape.clone()))
            } else {
                Err(format!("cannot broadcast {} to {shape}", ins[0]))
            }
        }
        Op::SumTo { shape } => {
            float(ins[0], "operand")?;
            if broadcasts_to(shape, &ins[0].shape) {
                Ok(TensorType::new(ins[0].dtype, shape.clone()))
            } else {
                Err(format!("cannot sum {} down to {shape}", ins[0]))
            }
        }
        Op::Reshape { shape } => {
            if shape.numel() == ins[0].numel() {
                Ok(TensorType::new(ins[0].dtype, shape.clone()))
            } else {
                Err(format!("reshape of {} to {shape} changes the element count", ins[0]))
            }
        }
        Op::Transpose { perm } => {
            let r = ins[0].shape.rank();
            let mut seen = vec![false; r];
            if perm.len() != r || perm.iter().any(|&p| p >= r || std::mem::replace(&mut seen[p], true)) {
                return Err(format!("perm {perm:?} is not a permutation of the {r} dims of {}", ins[0]));
            }
            let dims = perm.iter().map(|&p| ins[0].shape.0[p]).collect::<Vec<_>>();
            Ok(TensorType::new(ins[0].dtype, dims))
        }
        Op::Slice { axis, start, end } => {
            let s = &ins[0].shape;
            if *axis >= s.rank() || start >= end || *end > s.0[*axis] {
                return Err(format!("slice axis {axis} [{start}, {end}) out of range for {}", ins[0]));
            }
            let mut dims = s.0.clone();
            dims[*axis] = end - start;
            Ok(TensorType::new(ins[0].dtype, dims))
        }
        Op::Concat { axis } => {
            let first = ins[0];
            if *axis >= first.shape.rank() {
                return Err(format!("concat axis {axis} out of range for {first}"));
            }
            let mut dims = first.shape.0.clone();
            for t in &ins[1..] {
                let ok = t.dtype == first.dtype
                    && t.shape.rank() == first.shape.rank()
                    && (0..dims.len()).all(|i| i == *axis || t.shape.0[i] == first.shape.0[i]);
                if !ok {
                    return Err(format!("concat along {axis}: {t} does not fit {first}"));
                }
                dims[*axis] += t.shape.0[*axis];
            }
            Ok(TensorType::new(first.dtype, dims))
        }
        Op::MatMul { ta, tb } => {
            let (a, b) = (ins[0], ins[1]);
            float(a, "lhs")?;
            if a.dtype != b.dtype {
                return Err(format!("matmul dtypes differ: {a} vs {b}"));
            }
            let r = a.shape.rank();
            if r < 2 || b.shape.rank() != r || a.shape.0[..r - 2] != b.shape.0[..r - 2] {
                return Err(format!("matmul needs equal-rank (>= 2) operands with equal batch dims: {a} x {b}"));
            }
            let (m, k) = if *ta { (a.shape.0[r - 1], a.shape.0[r - 2]) } else { (a.shape.0[r - 2], a.shape.0[r - 1]) };
            let (k2, n) = if *tb { (b.shape.0[r - 1], b.shape.0[r - 2]) } else { (b.shape.0[r - 2], b.shape.0[r - 1]) };
            if k != k2 {
                return Err(format!("matmul inner dims differ ({k} vs {k2}): {a} x {b} (ta={ta}, tb={tb})"));
            }
            let mut dims = a.shape.0[..r - 2].to_vec();
            dims.extend([m, n]);
            Ok(TensorType::new(a.dtype, dims))
        }
        Op::Gather => {
            let (table, ids) = (ins[0], ins[1]);
            float(table, "table")?;
            ints(ids, "ids")?;
            if table.shape.rank() != 2 {
                return Err(format!("gather table must be [V, C], got {table}"));
            }
            let mut dims = ids.shape.0.clone();
            dims.push(table.shape.0[1]);
            Ok(TensorType::new(table.dtype, dims))
        }
        Op::ScatterAdd { rows } => {
            let (ids, dy) = (ins[0], ins[1]);
            ints(ids, "ids")?;
            float(dy, "dy")?;
            if dy.shape.rank() != ids.shape.rank() + 1 || dy.shape.0[..ids.shape.rank()] != ids.shape.0[..] {
                return Err(format!("scatter_add: dy {dy} must be ids {ids} plus a channel dim"));
            }
            Ok(TensorType::new(dy.dtype, vec![*rows, dy.shape.last()]))
        }
        Op::LayerNorm { .. } | Op::LayerNormGradX { .. } => {
            let x = ins[0];
            float(x, "x")?;
            if x.shape.rank() == 0 {
                return Err("layernorm of a scalar".into());
            }
            let c = x.shape.last();
            if let Op::LayerNorm { .. } = op {
                vector_of(ins[1], c, "gamma")?;
                vector_of(ins[2], c, "beta")?;
                same(&TensorType::new(x.dtype, [c]), &TensorType::new(ins[1].dtype, [c]), "x and gamma")?;
                same(&TensorType::new(x.dtype, [c]), &TensorType::new(ins[2].dtype, [c]), "x and beta")?;
            } else {
                vector_of(ins[1], c, "gamma")?;
                same(x, ins[2], "x and dy")?;
            }
            Ok(x.clone())
        }
        Op::LayerNormGradGamma { .. } => {
            float(ins[0], "x")?;
            same(ins[0], ins[1], "x and dy")?;
            Ok(TensorType::new(ins[0].dtype, vec![ins[0].shape.last()]))
        }
        Op::Softmax { causal, .. } => {
            let x = ins[0];
            float(x, "x")?;
            let r = x.shape.rank();
            if r == 0 || (*causal && (r < 2 || x.shape.0[r - 1] != x.shape.0[r - 2])) {
                return Err(format!("softmax needs rank >= 1 (square last dims when causal), got {x}"));
            }
            Ok(x.clone())
        }
        Op::PackedSoftmax { .. } => {
            let (x, positions) = (ins[0], ins[1]);
            float(x, "x")?;
            ints(positions, "positions")?;
            let d = &x.shape.0;
            if d.len() != 4 || d[2] != d[3] || positions.shape.0 != [d[0], d[3]] {
                return Err(format!("packed_softmax needs x [B, NH, T, T] and positions [B, T]: {x}, {positions}"));
            }
            Ok(x.clone())
        }
        Op::SoftmaxGrad { .. } => {
            float(ins[0], "y")?;
            same(ins[0], ins[1], "y and dy")?;
            Ok(ins[0].clone())
        }
        Op::CrossEntropy | Op::CrossEntropyGrad => {
            let (logits, targets) = (ins[0], ins[1]);
            float(logits, "logits")?;
            ints(targets, "targets")?;
            if logits.shape.rank() != 2 || targets.shape.0 != [logits.shape.0[0]] {
                return Err(format!("cross_entropy needs logits [N, V] and targets [N]: {logits}, {targets}"));
            }
            if let Op::CrossEntropyGrad = op {
                float(ins[2], "dloss")?;
                if ins[2].shape.rank() != 0 {
                    return Err(format!("dloss must be a scalar, got {}", ins[2]));
                }
                return Ok(logits.clone());
            }
            // the loss is a reduction: f32 whatever the logits' type (mixed precision keeps it so)
            Ok(TensorType::new(DType::F32, Shape::scalar()))
        }
        Op::WeightedCrossEntropy | Op::WeightedCrossEntropyGrad => {
            let (logits, targets, weights) = (ins[0], ins[1], ins[2]);
            float(logits, "logits")?;
            ints(targets, "targets")?;
            if logits.shape.rank() != 2 || targets.shape.0 != [logits.shape.0[0]] {
                return Err(format!("weighted_cross_entropy needs logits [N, V] and targets [N]: {logits}, {targets}"));
            }
            if weights.dtype != DType::F32 || weights.shape != targets.shape {
                return Err(format!("weighted_cross_entropy needs f32 weights [N] (one per row of the logits), got {weights}"));
            }
            if let Op::WeightedCrossEntropyGrad = op {
                float(ins[3], "dloss")?;
                if ins[3].shape.rank() != 0 {
                    return Err(format!("dloss must be a scalar, got {}", ins[3]));
                }
                return Ok(logits.clone());
            }
            Ok(TensorType::new(DType::F32, Shape::scalar()))
        }
        Op::FakeQuant { spec } => {
            let w = ins[0];
            float(w, "weight")?;
            if w.shape.rank() != 2 {
                return Err(format!("fake_quant expects a weight [in, out], got {w}"));
            }
            spec.check(w.shape.0[0])?;
            Ok(w.clone())
        }
        Op::Dequantize { spec, to } => {
            if !to.is_float() {
                return Err(format!("dequantize to {to}: the result must be a float type"));
            }
            let want = if spec.scheme.has_zero_point() { 3 } else { 2 };
            if ins.len() != want {
                return Err(format!("dequantize ({}) takes {want} operands, got {}", spec.scheme.name(), ins.len()));
            }
            let codes = ins[0];
            if codes.dtype != spec.code_dtype() || codes.shape.rank() != 2 {
                return Err(format!("codes must be {}[in, out], got {codes}", spec.code_dtype()));
            }
            let (n_in, n_out) = (codes.shape.0[0], codes.shape.0[1]);
            spec.check(n_in)?;
            let groups = n_in / spec.group_for(n_in);
            let sshape = Shape::new([groups, n_out]);
            if ins[1].shape != sshape || ins[1].dtype != spec.scale_dtype() {
                return Err(format!("scales must be {}{sshape}, got {}", spec.scale_dtype(), ins[1]));
            }
            if want == 3 && (ins[2].shape != sshape || ins[2].dtype != DType::F32) {
                return Err(format!("zero points must be f32{sshape}, got {}", ins[2]));
            }
            Ok(TensorType::new(*to, vec![n_in, n_out]))
        }
        Op::FakeQuantLearned { spec } => learned_operands(spec, ins, "fake_quant_learned", 0),
        Op::FakeQuantLearnedGrad { spec, wrt } => {
            let ty = learned_operands(spec, ins, "fake_quant_learned_grad", 1)?;
            if *wrt == QuantParam::Zero && !spec.scheme.has_zero_point() {
                return Err(format!("fake_quant_learned_grad wrt zero: scheme {} has no zero points", spec.scheme.name()));
            }
            let dy = ins[ins.len() - 1];
            if dy != &ty {
                return Err(format!("dy must be {ty}, got {dy}"));
            }
            Ok(ty)
        }
        Op::ActQuant { bits } => {
            float(ins[0], "x")?;
            if !(2..=8).contains(bits) || ins[0].shape.rank() == 0 {
                return Err(format!("act_quant needs bits 2..8 and rank >= 1, got {bits} bits on {}", ins[0]));
            }
            Ok(ins[0].clone())
        }
        Op::Dropout { p, .. } => {
            float(ins[0], "x")?;
            if !(0.0..1.0).contains(p) {
                return Err(format!("dropout p must be in [0, 1), got {p}"));
            }
            if ins[1].dtype != DType::I32 || ins[1].shape.rank() != 0 {
                return Err(format!("dropout seed must be i32[], got {}", ins[1]));
            }
            Ok(ins[0].clone())
        }
        Op::AllFinite => {
            float(ins[0], "operand")?;
            Ok(TensorType::f32(Shape::scalar()))
        }
        Op::Select => {
            float(ins[0], "cond")?;
            same(ins[1], ins[2], "select's choices")?;
            if ins[0].shape != ins[1].shape {
                return Err(format!("select's condition {} and choices {} differ in shape", ins[0], ins[1]));
            }
            Ok(ins[1].clone())
        }
        Op::LossScale { interval, growth, backoff } => {
            if *ins[0] != TensorType::f32([2]) || *ins[1] != TensorType::f32(Shape::scalar()) {
                return Err(format!("loss_scale takes (state f32[2], finite f32[]), got ({}, {})", ins[0], ins[1]));
            }
            if *interval == 0 || !(growth.is_finite() && *growth > 0.0 && backoff.is_finite() && *backoff > 0.0) {
                return Err(format!("loss_scale needs interval >= 1 and positive factors, got {interval}, {growth}, {backoff}"));
            }
            Ok(ins[0].clone())
        }
        Op::Kernel { body, .. } => {
            for (i, t) in ins.iter().enumerate() {
                let want = body.find_input(&format!("in{i}")).map(|id| body.ty(id));
                if want != Some(*t) {
                    return Err(format!("kernel operand {i} is {t} but the body's in{i} is {want:?}"));
                }
            }
            if body.inputs().len() != ins.len() {
                return Err(format!("kernel body has {} inputs for {} operands", body.inputs().len(), ins.len()));
            }
            let out = body.output("out").ok_or("kernel body has no `out` output")?;
            crate::verify::verify(body).map_err(|e| format!("kernel body: {e}"))?;
            Ok(body.ty(out).clone())
        }
        Op::BlockDequant { .. } => {
            blocks_of(ins[0], ins[1], DType::U8)?;
            Ok(TensorType::new(DType::F32, ins[0].shape.clone()))
        }
        Op::AllReduce { world, .. } => {
            world_of(*world)?;
            float(ins[0], "all_reduce's operand")?;
            Ok(ins[0].clone())
        }
        Op::ReduceScatter { world, .. } => {
            world_of(*world)?;
            float(ins[0], "reduce_scatter's operand")?;
            let dims = ins[0].shape.dims();
            match dims.first() {
                Some(&d0) if d0 % world == 0 => {
                    let mut out = dims.to_vec();
                    out[0] = d0 / world;
                    Ok(TensorType::new(ins[0].dtype, Shape(out)))
                }
                _ => Err(format!("reduce_scatter over {world} ranks needs a first dimension they divide (pad it), got {}", ins[0])),
            }
        }
        Op::AllGather { world } => {
            world_of(*world)?;
            let dims = ins[0].shape.dims();
            if dims.is_empty() {
                return Err(format!("all_gather needs a tensor of rank 1 or more, got {}", ins[0]));
            }
            let mut out = dims.to_vec();
            out[0] *= world;
            Ok(TensorType::new(ins[0].dtype, Shape(out)))
        }
        Op::BlockAbsMax => {
            if ins[0].dtype != DType::F32 {
                return Err(format!("block_absmax takes f32, got {}", ins[0]));
            }
            Ok(TensorType::new(DType::F32, Shape::new([crate::qmap::blocks(ins[0].numel())])))
        }
        Op::BlockQuant { .. } => {
            blocks_of(ins[0], ins[1], DType::F32)?;
            Ok(TensorType::new(DType::U8, ins[0].shape.clone()))
        }
        Op::AdamParam { .. } => {
            let p = ins[0];
            float(p, "param")?;
            same(p, ins[1], "param and m")?;
            same(p, ins[2], "param and v")?;
            for (t, what) in [(ins[3], "lr"), (ins[4], "step")] {
                if t.shape.rank() != 0 || !t.dtype.is_float() {
                    return Err(format!("{what} must be a float scalar, got {t}"));
                }
            }
            Ok(p.clone())
        }
    }
}

/// FakeQuantLearned's operands (w [in, out] f32, scales [in/G, out] f32, zero points for asym),
/// followed by `extra` more (the gradient op's dy): the type of w.
fn learned_operands(spec: &QuantSpec, ins: &[&TensorType], what: &str, extra: usize) -> Result<TensorType, String> {
    let want = if spec.scheme.has_zero_point() { 3 } else { 2 } + extra;
    if ins.len() != want {
        return Err(format!("{what} ({}) takes {want} operands, got {}", spec.scheme.name(), ins.len()));
    }
    let w = ins[0];
    if w.dtype != DType::F32 || w.shape.rank() != 2 {
        return Err(format!("{what} expects a weight f32[in, out], got {w}"));
    }
    let (n_in, n_out) = (w.shape.0[0], w.shape.0[1]);
    spec.check(n_in)?;
    let sshape = Shape::new([n_in / spec.group_for(n_in), n_out]);
    if ins[1].shape != sshape || ins[1].dtype != DType::F32 {
        return Err(format!("scales must be f32{sshape}, got {}", ins[1]));
    }
    if spec.scheme.has_zero_point() && (ins[2].shape != sshape || ins[2].dtype != DType::F32) {
        return Err(format!("zero points must be f32{sshape}, got {}", ins[2]));
    }
    Ok(w.clone())
}

/// Checks a blockwise-quantized pair: `x` of dtype `dtype`, `absmax` f32 with one value per block.
fn blocks_of(x: &TensorType, absmax: &TensorType, dtype: DType) -> Result<(), String> {
    let nb = crate::qmap::blocks(x.numel());
    if x.dtype != dtype {
        return Err(format!("the blockwise tensor must be {dtype}, got {x}"));
    }
    if absmax.dtype != DType::F32 || absmax.shape.dims() != [nb] {
        return Err(format!("absmax must be f32[{nb}] for {x}, got {absmax}"));
    }
    Ok(())
}

/// A collective's world: at least one rank.
fn world_of(world: usize) -> Result<(), String> {
    if world == 0 {
        return Err("a collective needs a world of at least 1 rank".into());
    }
    Ok(())
}
