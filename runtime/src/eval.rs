//! One node's evaluation: the exhaustive match over the op set, plus the dtype semantics (casts,
//! and rounding of every f16/bf16 result so mixed-precision graphs behave as on hardware).

use qatc_ir::{DType, Op, TensorType};

use crate::float::Float;
use crate::ops::{elementwise as ew, embed, layout, matmul, norm, scaling, softmax};
use crate::quant;
use crate::value::{IntTensor, Tensor, Value};

fn fl<'a, T>(v: &'a Value<T>, what: &str) -> Result<&'a Tensor<T>, String> {
    match v {
        Value::Float(t) => Ok(t),
        Value::Int(_) => Err(format!("{what} must be a float tensor, got an int tensor")),
    }
}

fn int<'a, T>(v: &'a Value<T>, what: &str) -> Result<&'a IntTensor, String> {
    match v {
        Value::Int(t) => Ok(t),
        Value::Float(_) => Err(format!("{what} must be an int tensor, got a float tensor")),
    }
}

/// A float tensor's values as f32 (the blockwise quantization runs in f32 whatever `T`).
fn f32s<T: Float>(t: &Tensor<T>) -> Vec<f32> {
    t.data.iter().map(|v| v.to_f64() as f32).collect()
}

fn blockwise_len(n: usize, blocks: usize) -> Result<(), String> {
    if blocks != qatc_ir::qmap::blocks(n) {
        return Err(format!("{blocks} absmax values for {n} elements (blocks of {})", qatc_ir::qmap::BLOCK));
    }
    Ok(())
}

fn scalar<T: Float>(v: &Value<T>, what: &str) -> Result<f64, String> {
    match v {
        Value::Float(t) if t.data.len() == 1 => Ok(t.data[0].to_f64()),
        _ => Err(format!("{what} must be a float scalar, got shape {:?}", v.shape())),
    }
}

/// What an integer dtype's element can hold. Quantization codes are unsigned (sym codes are
/// offset by qmax; see `crate::quant`), so a 4-bit element holds 0..=15 and a byte 0..=255.
fn int_range(d: DType) -> (f64, f64) {
    match d {
        DType::U8 => (0.0, 255.0),
        DType::I4 => (0.0, 15.0),
        DType::I32 | DType::F32 | DType::F16 | DType::BF16 => (f64::from(i32::MIN), f64::from(i32::MAX)),
    }
}

/// Float to integer code: truncation toward zero, saturating at the dtype's range, NaN to 0 (Rust
/// `as` semantics, which is what CUDA's saturating conversions do too).
pub(crate) fn to_code(x: f64, d: DType) -> i32 {
    let (lo, hi) = int_range(d);
    if x.is_nan() {
        0
    } else {
        x.trunc().clamp(lo, hi) as i32
    }
}

/// FakeQuantLearned's operands: the weight, the scales and the zero points (empty without).
#[allow(clippy::type_complexity)]
fn learned_args<'a, T>(args: &[&'a Value<T>], zero_points: bool) -> Result<(&'a Tensor<T>, &'a [T], &'a [T]), String> {
    let w = fl(args[0], "weight")?;
    let s = &fl(args[1], "scales")?.data;
    let z: &[T] = if zero_points { &fl(args[2], "zero points")?.data } else { &[] };
    Ok((w, s, z))
}

/// Rounds a value to its node's dtype. F32 is the compute precision itself (f32 in f32 mode, and
/// deliberately not rounded in f64 mode, which is the high-precision oracle).
pub(crate) fn round_to_dtype<T: Float>(v: &mut Value<T>, d: DType) {
    let Value::Float(t) = v else { return };
    match d {
        DType::F16 => t.data.iter_mut().for_each(|x| *x = x.round_f16()),
        DType::BF16 => t.data.iter_mut().for_each(|x| *x = x.round_bf16()),
        DType::F32 | DType::I32 | DType::U8 | DType::I4 => {}
    }
}

fn cast<T: Float>(v: &Value<T>, to: DType) -> Value<T> {
    match (v, to.is_float()) {
        // Float to float: the rounding to `to` happens in round_to_dtype, like any f16 result.
        (Value::Float(t), true) => Value::Float(t.clone()),
        (Value::Float(t), false) => {
            Value::Int(IntTensor { shape: t.shape.clone(), data: t.data.iter().map(|x| to_code(x.to_f64(), to)).collect() })
        }
        (Value::Int(t), true) => Value::Float(Tensor { shape: t.shape.clone(), data: t.data.iter().map(|&x| T::from_i32(x)).collect() }),
        (Value::Int(t), false) => {
            Value::Int(IntTensor { shape: t.shape.clone(), data: t.data.iter().map(|&x| to_code(f64::from(x), to)).collect() })
        }
    }
}

/// Applies a generic element-copying kernel to a float or int operand, keeping its kind.
macro_rules! any_kind {
    ($v:expr, $out:expr, |$s:ident, $d:ident| $body:expr) => {
        match $v {
            Value::Float(t) => {
                let ($s, $d) = (&t.shape[..], &t.data[..]);
                Value::Float(Tensor { shape: $out, data: $body? })
            }
            Value::Int(t) => {
                let ($s, $d) = (&t.shape[..], &t.data[..]);
                Value::Int(IntTensor { shape: $out, data: $body? })
            }
        }
    };
}

/// Evaluates a non-input node on its operand values; `ty` is the node's inferred type, which
/// fixes the output shape. Errors are bare messages; the interpreter adds the node.
pub(crate) fn eval<T: Float>(op: &Op, ty: &TensorType, args: &[&Value<T>]) -> Result<Value<T>, String> {
    if let Some(n) = op.arity() {
        if args.len() != n {
            return Err(format!("takes {n} operand(s), got {}", args.len()));
        }
    }
    let out = ty.shape.0.clone();
    let float = |data: Vec<T>| Value::Float(Tensor { shape: ty.shape.0.clone(), data });
    let mut v = match op {
        Op::Input { .. } => return Err("inputs are supplied by the caller, not evaluated".into()),
        Op::Const { value, dtype, shape } => {
            if dtype.is_float() {
                Value::Float(Tensor::full(shape.0.clone(), T::from_f64(*value)))
            } else {
                Value::Int(IntTensor::full(shape.0.clone(), to_code(*value, *dtype)))
            }
        }
        Op::Unary(u) => float(ew::unary(*u, &fl(args[0], "operand")?.data)),
        Op::Binary(b) => float(ew::binary(*b, &fl(args[0], "lhs")?.data, &fl(args[1], "rhs")?.data)?),
        Op::Affine { mul, add } => float(ew::affine(&fl(args[0], "operand")?.data, *mul, *add)),
        Op::Cast { to } => cast(args[0], *to),
        Op::Broadcast { shape } => any_kind!(args[0], out, |s, d| layout::broadcast(s, d, &shape.0)),
        Op::SumTo { shape } => {
            let x = fl(args[0], "operand")?;
            float(layout::sum_to(&x.shape, &x.data, &shape.0)?)
        }
        Op::Reshape { .. } => {
            let n: usize = out.iter().product();
            if args[0].len() != n {
                return Err(format!("reshape of {} elements to {out:?}", args[0].len()));
            }
            match args[0] {
                Value::Float(t) => Value::Float(Tensor { shape: out, data: t.data.clone() }),
                Value::Int(t) => Value::Int(IntTensor { shape: out, data: t.data.clone() }),
            }
        }
        Op::Transpose { perm } => any_kind!(args[0], out, |s, d| layout::transpose(s, d, perm)),
        Op::Slice { axis, start, end } => any_kind!(args[0], out, |s, d| layout::slice(s, d, *axis, *start, *end)),
        Op::Concat { axis } => concat(args, *axis, out)?,
        Op::MatMul { ta, tb } => {
            let (a, b) = (fl(args[0], "lhs")?, fl(args[1], "rhs")?);
            float(matmul::matmul(&a.shape, &a.data, &b.shape, &b.data, *ta, *tb, &out)?)
        }
        Op::Gather => {
            let (table, ids) = (fl(args[0], "table")?, int(args[1], "ids")?);
            float(embed::gather(&table.shape, &table.data, &ids.data)?)
        }
        Op::ScatterAdd { rows } => {
            let (ids, dy) = (int(args[0], "ids")?, fl(args[1], "dy")?);
            float(embed::scatter_add(&ids.data, &dy.data, *rows, ty.shape.last())?)
        }
        Op::LayerNorm { eps } => {
            let (x, g, b) = (fl(args[0], "x")?, fl(args[1], "gamma")?, fl(args[2], "beta")?);
            float(norm::layernorm(&x.data, &g.data, &b.data, *eps)?)
        }
        Op::LayerNormGradX { eps } => {
            let (x, g, dy) = (fl(args[0], "x")?, fl(args[1], "gamma")?, fl(args[2], "dy")?);
            float(norm::layernorm_grad_x(&x.data, &g.data, &dy.data, *eps)?)
        }
        Op::LayerNormGradGamma { eps } => {
            let (x, dy) = (fl(args[0], "x")?, fl(args[1], "dy")?);
            float(norm::layernorm_grad_gamma(&x.data, &dy.data, ty.shape.last(), *eps)?)
        }
        Op::Softmax { scale, causal } => {
            let x = fl(args[0], "x")?;
            float(softmax::softmax(&x.shape, &x.data, *scale, *causal)?)
        }
        Op::PackedSoftmax { scale } => {
            let (x, positions) = (fl(args[0], "x")?, int(args[1], "positions")?);
            float(softmax::packed_softmax(&x.shape, &x.data, &positions.data, *scale)?)
        }
        Op::SoftmaxGrad { scale } => {
            let (y, dy) = (fl(args[0], "y")?, fl(args[1], "dy")?);
            float(softmax::softmax_grad(ty.shape.last(), &y.data, &dy.data, *scale)?)
        }
        Op::CrossEntropy => {
            let (logits, targets) = (fl(args[0], "logits")?, int(args[1], "targets")?);
            let v = logits.shape.get(1).copied().unwrap_or(0);
            float(vec![softmax::cross_entropy(&logits.data, &targets.data, v)?])
        }
        Op::CrossEntropyGrad => {
            let (logits, targets) = (fl(args[0], "logits")?, int(args[1], "targets")?);
            let dloss = T::from_f64(scalar(args[2], "dloss")?);
            let v = logits.shape.get(1).copied().unwrap_or(0);
            float(softmax::cross_entropy_grad(&logits.data, &targets.data, v, dloss)?)
        }
        Op::WeightedCrossEntropy => {
            let (logits, targets, weights) = (fl(args[0], "logits")?, int(args[1], "targets")?, fl(args[2], "weights")?);
            let v = logits.shape.get(1).copied().unwrap_or(0);
            float(vec![softmax::weighted_cross_entropy(&logits.data, &targets.data, &weights.data, v)?])
        }
        Op::WeightedCrossEntropyGrad => {
            let (logits, targets, weights) = (fl(args[0], "logits")?, int(args[1], "targets")?, fl(args[2], "weights")?);
            let dloss = T::from_f64(scalar(args[3], "dloss")?);
            let v = logits.shape.get(1).copied().unwrap_or(0);
            float(softmax::weighted_cross_entropy_grad(&logits.data, &targets.data, &weights.data, v, dloss)?)
        }
        Op::FakeQuant { spec } => {
            let w = fl(args[0], "weight")?;
            let (n_in, n_out) = (w.shape[0], w.shape[1]);
            let w32: Vec<f32> = w.data.iter().map(|v| v.to_f64() as f32).collect();
            float(quant::fake_quant(&w32, n_in, n_out, *spec).into_iter().map(|v| T::from_f64(v as f64)).collect())
        }
        Op::Dequantize { spec, .. } => {
            let codes = int(args[0], "codes")?;
            let scales: Vec<f32> = fl(args[1], "scales")?.data.iter().map(|v| v.to_f64() as f32).collect();
            let zeros: Vec<f32> = match args.get(2) {
                Some(z) => fl(z, "zero points")?.data.iter().map(|v| v.to_f64() as f32).collect(),
                None => Vec::new(),
            };
            let (n_in, n_out) = (codes.shape[0], codes.shape[1]);
            let bytes: Vec<u8> = codes.data.iter().map(|&c| c.clamp(0, 255) as u8).collect();
            let w = quant::dequantize_parts(*spec, n_in, n_out, &bytes, &scales, &zeros);
            float(w.into_iter().map(|v| T::from_f64(v as f64)).collect())
        }
        Op::FakeQuantLearned { spec } => {
            let (w, s, z) = learned_args(args, spec.scheme.has_zero_point())?;
            float(quant::fake_quant_learned(*spec, w.shape[0], w.shape[1], &w.data, s, z))
        }
        Op::FakeQuantLearnedGrad { spec, wrt } => {
            let (w, s, z) = learned_args(args, spec.scheme.has_zero_point())?;
            let dy = fl(args[args.len() - 1], "dy")?;
            float(quant::fake_quant_learned_grad(*spec, *wrt, w.shape[0], w.shape[1], &w.data, s, z, &dy.data))
        }
        Op::BlockDequant { map } => {
            let codes: Vec<u8> = int(args[0], "codes")?.data.iter().map(|&c| c.clamp(0, 255) as u8).collect();
            let absmax = f32s(fl(args[1], "absmax")?);
            blockwise_len(codes.len(), absmax.len())?;
            float(quant::block_dequant(*map, &codes, &absmax).into_iter().map(|v| T::from_f64(v as f64)).collect())
        }
        Op::BlockAbsMax => {
            let x = f32s(fl(args[0], "x")?);
            let a = quant::block_absmax(&x);
            Value::Float(Tensor { shape: vec![a.len()], data: a.into_iter().map(|v| T::from_f64(v as f64)).collect() })
        }
        // one rank is the whole world: each collective gives its operand back (over more ranks
        // the interpreter's `run_ranks` combines every rank's operand)
        Op::AllReduce { world: 1, .. } | Op::ReduceScatter { world: 1, .. } | Op::AllGather { world: 1 } => args[0].clone(),
        Op::AllReduce { world, .. } | Op::ReduceScatter { world, .. } | Op::AllGather { world } => {
            return Err(format!("a collective over {world} ranks runs on all of them at once (Interpreter::run_ranks)"))
        }
        Op::BlockQuant { map } => {
            let x = fl(args[0], "x")?;
            let absmax = f32s(fl(args[1], "absmax")?);
            blockwise_len(x.data.len(), absmax.len())?;
            let codes = quant::block_quant(*map, &f32s(x), &absmax);
            Value::Int(IntTensor { shape: x.shape.clone(), data: codes.into_iter().map(i32::from).collect() })
        }
        Op::ActQuant { bits } => {
            let x = fl(args[0], "x")?;
            let x32: Vec<f32> = x.data.iter().map(|v| v.to_f64() as f32).collect();
            let c = x.shape.last().copied().unwrap_or(1);
            float(quant::act_quant(&x32, c, *bits).into_iter().map(|v| T::from_f64(v as f64)).collect())
        }
        Op::Dropout { p, stream } => {
            let x = fl(args[0], "x")?;
            let seed = int(args[1], "seed")?.data.first().copied().unwrap_or(0);
            let k = T::from_f64(1.0 / (1.0 - p));
            let data = x
                .data
                .iter()
                .enumerate()
                .map(|(i, &v)| if quant::dropout_keep(seed, *stream, i, *p) { v * k } else { T::from_f64(0.0) })
                .collect();
            float(data)
        }
        Op::AllFinite => float(vec![scaling::all_finite(&fl(args[0], "operand")?.data)]),
        Op::Select => float(scaling::select(&fl(args[0], "cond")?.data, &fl(args[1], "a")?.data, &fl(args[2], "b")?.data)?),
        Op::LossScale { interval, growth, backoff } => {
            let next = scaling::loss_scale(&fl(args[0], "state")?.data, scalar(args[1], "finite")?, *interval, *growth, *backoff)?;
            float(next.iter().map(|&v| T::from_f64(f64::from(v))).collect())
        }
        Op::Kernel { body, .. } => {
            // the reference semantics of a fused kernel is its body, run on the operands
            let interp = crate::Interpreter::<T>::new(body).map_err(|e| format!("kernel body: {e}"))?;
            let inputs = args.iter().enumerate().map(|(i, v)| (format!("in{i}"), (*v).clone())).collect();
            let mut out = interp.run(&inputs).map_err(|e| format!("kernel body: {e}"))?;
            out.remove("out").ok_or("kernel body produced no `out`")?
        }
        Op::AdamM { beta1 } => float(ew::adam_m(&fl(args[0], "m")?.data, &fl(args[1], "g")?.data, *beta1)?),
        Op::AdamV { beta2 } => float(ew::adam_v(&fl(args[0], "v")?.data, &fl(args[1], "g")?.data, *beta2)?),
        Op::AdamParam { beta1, beta2, eps, weight_decay } => {
            let (p, m, v) = (fl(args[0], "param")?, fl(args[1], "m")?, fl(args[2], "v")?);
            let (lr, t) = (scalar(args[3], "lr")?, scalar(args[4], "step")?);
            let h = ew::AdamHyper { beta1: *beta1, beta2: *beta2, eps: *eps, weight_decay: *weight_decay };
            float(ew::adam_param(&p.data, &m.data, &v.data, lr, t, h)?)
        }
    };
    let want = ty.numel();
    if v.len() != want || v.shape() != ty.shape.dims() {
        return Err(format!("produced shape {:?} with {} elements, its type is {ty}", v.shape(), v.len()));
    }
    round_to_dtype(&mut v, ty.dtype);
    Ok(v)
}

fn concat<T: Float>(args: &[&Value<T>], axis: usize, out: Vec<usize>) -> Result<Value<T>, String> {
    let Some(first) = args.first() else {
        return Err("concat of nothing".into());
    };
    Ok(match first {
        Value::Float(_) => {
            let parts = args.iter().map(|a| fl(a, "operand").map(|t| (&t.shape[..], &t.data[..]))).collect::<Result<Vec<_>, _>>()?;
            Value::Float(Tensor { shape: out, data: layout::concat(&parts, axis)? })
        }
        Value::Int(_) => {
            let parts = args.iter().map(|a| int(a, "operand").map(|t| (&t.shape[..], &t.data[..]))).collect::<Result<Vec<_>, _>>()?;
            Value::Int(IntTensor { shape: out, data: layout::concat(&parts, axis)? })
        }
    })
}
