//! The op catalogue the tests share: every op of the IR with random operands for it.

use qatc_ir::{BinaryOp, DType, Op, QuantParam, QuantScheme, QuantSpec, Shape, UnaryOp};

use super::{try_run_op, In, Rng};

pub fn f32s(rng: &mut Rng, n: usize, lo: f64, hi: f64) -> Vec<f64> {
    rng.vec(n, lo, hi).into_iter().map(|v| v as f32 as f64).collect()
}

pub fn fin(rng: &mut Rng, shape: &[usize], lo: f64, hi: f64) -> In {
    In::F(shape.to_vec(), f32s(rng, shape.iter().product(), lo, hi))
}

/// Operands for `op`. The match has no wildcard, so a new op fails to compile here until it is
/// covered.
pub fn case(op: &Op, rng: &mut Rng) -> Vec<In> {
    let x = |rng: &mut Rng| fin(rng, &[3, 5, 7], -3.0, 3.0);
    match op {
        Op::Input { .. } | Op::Const { .. } => vec![],
        Op::Unary(u) => match u {
            UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Recip => vec![fin(rng, &[3, 5, 7], 0.1, 4.0)],
            UnaryOp::Neg | UnaryOp::Exp | UnaryOp::Tanh | UnaryOp::Square | UnaryOp::Gelu => vec![x(rng)],
        },
        Op::Binary(b) => match b {
            BinaryOp::Div => vec![x(rng), fin(rng, &[3, 5, 7], 0.5, 2.0)],
            BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::Max | BinaryOp::Min | BinaryOp::GeluGrad => {
                vec![x(rng), x(rng)]
            }
        },
        Op::Affine { .. } | Op::Cast { .. } | Op::Transpose { .. } | Op::Slice { .. } | Op::Softmax { .. } => vec![x(rng)],
        Op::ActQuant { .. } | Op::Reshape { .. } => vec![x(rng)],
        Op::Broadcast { .. } => vec![fin(rng, &[5, 1], -1.0, 1.0)],
        Op::SumTo { .. } => vec![x(rng)],
        Op::Concat { .. } => vec![fin(rng, &[3, 2, 7], -1.0, 1.0), x(rng)],
        Op::MatMul { ta, tb } => {
            let a = if *ta { [2, 50, 3] } else { [2, 3, 50] };
            let b = if *tb { [2, 7, 50] } else { [2, 50, 7] };
            vec![fin(rng, &a, -1.0, 1.0), fin(rng, &b, -1.0, 1.0)]
        }
        Op::Gather => vec![fin(rng, &[11, 4], -1.0, 1.0), In::I(vec![2, 3], rng.ints(6, 11))],
        Op::ScatterAdd { .. } => vec![In::I(vec![2, 3], rng.ints(6, 11)), fin(rng, &[2, 3, 4], -1.0, 1.0)],
        Op::LayerNorm { .. } => vec![x(rng), fin(rng, &[7], 0.5, 1.5), fin(rng, &[7], -0.5, 0.5)],
        Op::LayerNormGradX { .. } => vec![x(rng), fin(rng, &[7], 0.5, 1.5), x(rng)],
        Op::LayerNormGradGamma { .. } => vec![x(rng), x(rng)],
        Op::SoftmaxGrad { .. } => {
            let y = try_run_op::<f64>(Op::Softmax { scale: 1.0, causal: false }, &[x(rng)]).unwrap();
            let y = y.as_float().unwrap().data.iter().map(|&v| v as f32 as f64).collect::<Vec<_>>();
            vec![In::F(vec![3, 5, 7], y), x(rng)]
        }
        Op::CrossEntropy => vec![fin(rng, &[6, 13], -4.0, 4.0), In::I(vec![6], rng.ints(6, 13))],
        Op::CrossEntropyGrad => {
            vec![fin(rng, &[6, 13], -4.0, 4.0), In::I(vec![6], rng.ints(6, 13)), In::f(&[], &[0.75])]
        }
        // weights 0 (a prompt's token, padding) and not, summing to 1 as the host makes them
        Op::WeightedCrossEntropy | Op::WeightedCrossEntropyGrad => {
            let w = [0.0, 0.25, 0.0, 0.125, 0.5, 0.125];
            let mut ins = vec![fin(rng, &[6, 13], -4.0, 4.0), In::I(vec![6], rng.ints(6, 13)), In::f(&[6], &w)];
            if let Op::WeightedCrossEntropyGrad = op {
                ins.push(In::f(&[], &[0.75]));
            }
            ins
        }
        // two sequences of 5: examples of 2 and 3 tokens, then 1, 3 and 1
        Op::PackedSoftmax { .. } => {
            vec![fin(rng, &[2, 3, 5, 5], -3.0, 3.0), In::i(&[2, 5], &[0, 1, 0, 1, 2, 0, 0, 1, 2, 0])]
        }
        Op::FakeQuant { .. } => vec![fin(rng, &[64, 3], -1.0, 1.0)],
        Op::Dequantize { spec, .. } => {
            let groups = 64 / spec.group_for(64);
            let mut ins = vec![
                In::ID(spec.code_dtype(), vec![64, 3], rng.ints(64 * 3, 16)),
                In::FD(spec.scale_dtype(), vec![groups, 3], f32s(rng, groups * 3, 0.01, 0.1)),
            ];
            if spec.scheme.has_zero_point() {
                ins.push(In::F(vec![groups, 3], rng.ints(groups * 3, 16).into_iter().map(f64::from).collect()));
            }
            ins
        }
        Op::FakeQuantLearned { spec } | Op::FakeQuantLearnedGrad { spec, .. } => {
            // scales 0.6 to 1.1 times about the min-max ones of U(-1, 1) weights: some clip
            let groups = 64 / spec.group_for(64);
            let unit = match spec.scheme {
                QuantScheme::Asym => 2.0 / spec.lsq_qp(),
                QuantScheme::Q4_0 => 1.0 / 8.0,
                _ => 1.0 / spec.lsq_qp(),
            };
            let mut ins = vec![fin(rng, &[64, 3], -1.0, 1.0), fin(rng, &[groups, 3], 0.6 * unit, 1.1 * unit)];
            if spec.scheme.has_zero_point() {
                let mid = spec.lsq_qp() / 2.0;
                ins.push(fin(rng, &[groups, 3], mid - 2.0, mid + 2.0));
            }
            if let Op::FakeQuantLearnedGrad { .. } = op {
                ins.push(fin(rng, &[64, 3], -1.0, 1.0));
            }
            ins
        }
        Op::Dropout { .. } => vec![x(rng), In::i(&[], &[1234])],
        // one infinite element among finite ones: the flag must be 0
        Op::AllFinite => {
            let mut v = f32s(rng, 105, -3.0, 3.0);
            v[57] = f64::INFINITY;
            vec![In::F(vec![3, 5, 7], v)]
        }
        // a condition of zeros and nonzeros (negative ones too)
        Op::Select => vec![In::F(vec![3, 5, 7], rng.ints(105, 3).into_iter().map(|c| f64::from(c) - 1.0).collect()), x(rng), x(rng)],
        // the step that completes an interval: the scale doubles and the count resets
        Op::LossScale { .. } => vec![In::f(&[2], &[65536.0, 1999.0]), In::f(&[], &[1.0])],
        // a kernel's body gelu(in0) * in1 is evaluated by the interpreter itself
        Op::Kernel { .. } => vec![x(rng), x(rng)],
        Op::AdamM { .. } => vec![x(rng), x(rng)],
        Op::AdamV { .. } => vec![fin(rng, &[3, 5, 7], 0.0, 1.0), x(rng)],
        Op::AdamParam { .. } => {
            vec![x(rng), fin(rng, &[3, 5, 7], -0.1, 0.1), fin(rng, &[3, 5, 7], 0.0, 0.01), In::f(&[], &[1e-3]), In::f(&[], &[3.0])]
        }
        // 8-bit moments over 5000 elements: blocks of 2048, 2048 and 904; the middle block's
        // absmax is 0 (all its codes become the code of 0)
        Op::BlockDequant { .. } => vec![In::ID(DType::U8, vec![5000], rng.ints(5000, 256)), In::f(&[3], &[0.5, 0.0, 2.0])],
        Op::BlockAbsMax => vec![fin(rng, &[5000], -3.0, 3.0)],
        Op::BlockQuant { .. } => vec![fin(rng, &[5000], -3.0, 3.0), In::f(&[3], &[3.0, 0.0, 2.5])],
        // over one rank the identity (tests/collectives.rs runs them over several; the kernel
        // backends do not lower them, so they are not in `all_ops`)
        Op::AllReduce { .. } | Op::ReduceScatter { .. } | Op::AllGather { .. } => vec![x(rng)],
    }
}

/// Kernel { body: gelu(in0) * in1 } on [3, 5, 7].
pub fn gelu_mul_kernel() -> Op {
    use qatc_ir::{Graph, InputKind};
    let mut b = Graph::new("gelu_mul");
    let a = b.input("in0", InputKind::Data, DType::F32, [3, 5, 7]).unwrap();
    let c = b.input("in1", InputKind::Data, DType::F32, [3, 5, 7]).unwrap();
    let g = b.add(Op::Unary(UnaryOp::Gelu), &[a]).unwrap();
    let y = b.add(Op::Binary(BinaryOp::Mul), &[g, c]).unwrap();
    b.set_output("out", y).unwrap();
    Op::Kernel { family: qatc_ir::KernelFamily::Pointwise, body: Box::new(b) }
}

pub fn all_ops() -> Vec<Op> {
    use BinaryOp as B;
    use UnaryOp as U;
    let mut ops: Vec<Op> =
        [U::Neg, U::Exp, U::Log, U::Sqrt, U::Rsqrt, U::Recip, U::Tanh, U::Square, U::Gelu].into_iter().map(Op::Unary).collect();
    ops.extend([B::Add, B::Sub, B::Mul, B::Div, B::Max, B::Min, B::GeluGrad].into_iter().map(Op::Binary));
    for ta in [false, true] {
        for tb in [false, true] {
            ops.push(Op::MatMul { ta, tb });
        }
    }
    for scheme in QuantScheme::ALL {
        let group = if scheme == QuantScheme::Q4_0 { 32 } else { 16 };
        ops.push(Op::FakeQuant { spec: QuantSpec { bits: 4, group, scheme } });
        ops.push(Op::Dequantize { spec: QuantSpec { bits: 4, group, scheme }, to: DType::F32 });
    }
    ops.push(Op::FakeQuant { spec: QuantSpec { bits: 8, group: 0, scheme: QuantScheme::Sym } });
    for spec in [
        QuantSpec { bits: 3, group: 16, scheme: QuantScheme::Sym },
        QuantSpec { bits: 2, group: 0, scheme: QuantScheme::Sym },
        QuantSpec { bits: 4, group: 16, scheme: QuantScheme::Asym },
        QuantSpec { bits: 4, group: 16, scheme: QuantScheme::Nf4 },
        QuantSpec { bits: 4, group: 32, scheme: QuantScheme::Q4_0 },
    ] {
        ops.push(Op::FakeQuantLearned { spec });
        for wrt in QuantParam::ALL.into_iter().filter(|&w| w != QuantParam::Zero || spec.scheme.has_zero_point()) {
            ops.push(Op::FakeQuantLearnedGrad { spec, wrt });
        }
    }
    ops.extend([
        Op::Affine { mul: 1.5, add: -0.25 },
        Op::Cast { to: DType::F16 },
        Op::Cast { to: DType::BF16 },
        Op::Cast { to: DType::I32 },
        Op::Broadcast { shape: Shape::new([2, 5, 3]) },
        Op::SumTo { shape: Shape::new([5, 1]) },
        Op::Reshape { shape: Shape::new([15, 7]) },
        Op::Transpose { perm: vec![2, 0, 1] },
        Op::Slice { axis: 1, start: 1, end: 4 },
        Op::Concat { axis: 1 },
        Op::Gather,
        Op::ScatterAdd { rows: 11 },
        Op::LayerNorm { eps: 1e-5 },
        Op::LayerNormGradX { eps: 1e-5 },
        Op::LayerNormGradGamma { eps: 1e-5 },
        Op::Softmax { scale: 0.7, causal: false },
        Op::SoftmaxGrad { scale: 0.7 },
        Op::CrossEntropy,
        Op::CrossEntropyGrad,
        Op::WeightedCrossEntropy,
        Op::WeightedCrossEntropyGrad,
        Op::PackedSoftmax { scale: 0.7 },
        Op::ActQuant { bits: 8 },
        Op::ActQuant { bits: 4 },
        Op::Dropout { p: 0.3, stream: 2 },
        gelu_mul_kernel(),
        Op::AdamM { beta1: 0.9 },
        Op::AdamV { beta2: 0.999 },
        Op::AdamParam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 },
        Op::Dequantize { spec: QuantSpec { bits: 4, group: 16, scheme: QuantScheme::Sym }, to: DType::BF16 },
        Op::Dequantize { spec: QuantSpec { bits: 4, group: 32, scheme: QuantScheme::Q4_0 }, to: DType::F16 },
        Op::AllFinite,
        Op::Select,
        Op::LossScale { interval: 2000, growth: 2.0, backoff: 0.5 },
        Op::BlockAbsMax,
    ]);
    for map in qatc_ir::DynMap::ALL {
        ops.push(Op::BlockDequant { map });
        ops.push(Op::BlockQuant { map });
    }
    ops
}
