//! The ops the generator draws from: one generator slot per op (per unary and binary op), how
//! `Builder::step` builds a node of each slot, and `op_slot`, the exhaustive map back.

use qatc_ir::infer::broadcasts_to;
use qatc_ir::{
    qmap, BinaryOp, DType, DynMap, Graph, InputKind, IrError, NodeId, Op, QuantParam, QuantScheme, QuantSpec, Reduce, Shape, TensorType,
    UnaryOp,
};

use crate::builder::Builder;
use crate::choices::families;

pub const UNARY: [UnaryOp; 9] = [
    UnaryOp::Neg,
    UnaryOp::Exp,
    UnaryOp::Log,
    UnaryOp::Sqrt,
    UnaryOp::Rsqrt,
    UnaryOp::Recip,
    UnaryOp::Tanh,
    UnaryOp::Square,
    UnaryOp::Gelu,
];
pub const BINARY: [BinaryOp; 7] =
    [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div, BinaryOp::Max, BinaryOp::Min, BinaryOp::GeluGrad];

/// Generator slots: 0..9 unary, 9..16 binary, then one per remaining op.
pub const N_SLOTS: usize = 58;

/// The generator slot of an op. Exhaustive on purpose (no wildcard): adding an op to the IR
/// breaks this test's build until the generator covers it.
pub fn op_slot(op: &Op) -> usize {
    match op {
        Op::Unary(u) => match u {
            UnaryOp::Neg => 0,
            UnaryOp::Exp => 1,
            UnaryOp::Log => 2,
            UnaryOp::Sqrt => 3,
            UnaryOp::Rsqrt => 4,
            UnaryOp::Recip => 5,
            UnaryOp::Tanh => 6,
            UnaryOp::Square => 7,
            UnaryOp::Gelu => 8,
        },
        Op::Binary(b) => match b {
            BinaryOp::Add => 9,
            BinaryOp::Sub => 10,
            BinaryOp::Mul => 11,
            BinaryOp::Div => 12,
            BinaryOp::Max => 13,
            BinaryOp::Min => 14,
            BinaryOp::GeluGrad => 15,
        },
        Op::Affine { .. } => 16,
        Op::Cast { .. } => 17,
        Op::Broadcast { .. } => 18,
        Op::SumTo { .. } => 19,
        Op::Reshape { .. } => 20,
        Op::Transpose { .. } => 21,
        Op::Slice { .. } => 22,
        Op::Concat { .. } => 23,
        Op::MatMul { .. } => 24,
        Op::Gather => 25,
        Op::ScatterAdd { .. } => 26,
        Op::LayerNorm { .. } => 27,
        Op::LayerNormGradX { .. } => 28,
        Op::LayerNormGradGamma { .. } => 29,
        Op::Softmax { .. } => 30,
        Op::SoftmaxGrad { .. } => 31,
        Op::CrossEntropy => 32,
        Op::CrossEntropyGrad => 33,
        Op::AdamM { .. } => 34,
        Op::AdamV { .. } => 35,
        Op::AdamParam { .. } => 36,
        Op::Const { .. } => 37,
        Op::Input { .. } => 38,
        Op::FakeQuant { .. } => 39,
        Op::Dequantize { .. } => 40,
        Op::ActQuant { .. } => 41,
        Op::Dropout { .. } => 42,
        Op::Kernel { .. } => 43,
        Op::AllFinite => 44,
        Op::Select => 45,
        Op::LossScale { .. } => 46,
        Op::BlockDequant { .. } => 47,
        Op::BlockAbsMax => 48,
        Op::BlockQuant { .. } => 49,
        Op::FakeQuantLearned { .. } => 50,
        Op::FakeQuantLearnedGrad { .. } => 51,
        Op::AllReduce { .. } => 52,
        Op::ReduceScatter { .. } => 53,
        Op::AllGather { .. } => 54,
        Op::WeightedCrossEntropy => 55,
        Op::WeightedCrossEntropyGrad => 56,
        Op::PackedSoftmax { .. } => 57,
    }
}

impl Builder<'_> {
    pub fn step(&mut self, slot: usize) -> Result<NodeId, IrError> {
        let ch_f = |b: &mut Self| b.ch.float();
        match slot {
            0..=8 => {
                let x = self.float_operand(0, 4)?;
                self.op(Op::Unary(UNARY[slot]), &[x])
            }
            9..=15 => {
                let a = self.float_operand(0, 4)?;
                let b = self.of_type(self.ty(a))?;
                self.op(Op::Binary(BINARY[slot - 9]), &[a, b])
            }
            16 => {
                let x = self.float_operand(0, 4)?;
                let (mul, add) = (ch_f(self), ch_f(self));
                self.op(Op::Affine { mul, add }, &[x])
            }
            17 => {
                let x = self.any_operand(0)?;
                let to = self.ch.any_dtype();
                self.op(Op::Cast { to }, &[x])
            }
            18 => {
                let x = self.any_operand(0)?;
                let mut dims: Vec<usize> = (0..self.ch.below(3)).map(|_| self.ch.dim()).collect();
                for d in self.ty(x).shape.0 {
                    dims.push(if d == 1 && self.ch.flip() { self.ch.dim() } else { d });
                }
                self.op(Op::Broadcast { shape: Shape(dims) }, &[x])
            }
            19 => {
                let x = self.float_operand(0, 4)?;
                let s = self.ty(x).shape.0;
                let keep = self.ch.below(s.len() + 1);
                let dims: Vec<usize> = s[s.len() - keep..].iter().map(|&d| if self.ch.one_in(3) { 1 } else { d }).collect();
                let shape = Shape(dims);
                debug_assert!(broadcasts_to(&shape, &Shape(s)));
                self.op(Op::SumTo { shape }, &[x])
            }
            20 => {
                let x = self.any_operand(0)?;
                let shape = Shape(self.factor_shape(self.ty(x).numel()));
                self.op(Op::Reshape { shape }, &[x])
            }
            21 => {
                let x = self.any_operand(0)?;
                let perm = self.ch.perm(self.ty(x).shape.rank());
                self.op(Op::Transpose { perm }, &[x])
            }
            22 => {
                let x = self.any_operand(1)?;
                let s = self.ty(x).shape.0;
                let axis = self.ch.below(s.len());
                let start = self.ch.below(s[axis]);
                let end = self.ch.range(start + 1, s[axis]);
                self.op(Op::Slice { axis, start, end }, &[x])
            }
            23 => {
                let x = self.any_operand(1)?;
                let t = self.ty(x);
                let axis = self.ch.below(t.shape.rank());
                let mut parts = vec![x];
                for _ in 0..self.ch.below(3) {
                    if self.ch.one_in(3) {
                        // The same operand twice: two edges from one node.
                        parts.push(x);
                    } else {
                        let mut dims = t.shape.0.clone();
                        dims[axis] = self.ch.dim();
                        parts.push(self.of_type(TensorType::new(t.dtype, dims))?);
                    }
                }
                self.op(Op::Concat { axis }, &parts)
            }
            24 => {
                let a = self.float_operand(2, 4)?;
                let t = self.ty(a);
                let r = t.shape.rank();
                let (ta, tb) = (self.ch.flip(), self.ch.flip());
                let k = if ta { t.shape.0[r - 2] } else { t.shape.0[r - 1] };
                let n = self.ch.dim();
                let mut dims = t.shape.0[..r - 2].to_vec();
                dims.extend(if tb { [n, k] } else { [k, n] });
                let b = self.of_type(TensorType::new(t.dtype, dims))?;
                self.op(Op::MatMul { ta, tb }, &[a, b])
            }
            25 => {
                let table = self.float_operand(2, 2)?;
                let ids = self.ids()?;
                self.op(Op::Gather, &[table, ids])
            }
            26 => {
                let ids = self.ids()?;
                let mut dims = self.ty(ids).shape.0;
                dims.push(self.ch.dim());
                let d = self.ch.float_dtype();
                let dy = self.of_type(TensorType::new(d, dims))?;
                let rows = self.ch.range(1, 6);
                self.op(Op::ScatterAdd { rows }, &[ids, dy])
            }
            27..=29 => {
                let x = self.float_operand(1, 4)?;
                let t = self.ty(x);
                let vec_ty = TensorType::new(t.dtype, [t.shape.last()]);
                let eps = ch_f(self);
                match slot {
                    27 => {
                        let (gamma, beta) = (self.of_type(vec_ty.clone())?, self.of_type(vec_ty)?);
                        self.op(Op::LayerNorm { eps }, &[x, gamma, beta])
                    }
                    28 => {
                        let (gamma, dy) = (self.of_type(vec_ty)?, self.of_type(t)?);
                        self.op(Op::LayerNormGradX { eps }, &[x, gamma, dy])
                    }
                    _ => {
                        let dy = self.of_type(t)?;
                        self.op(Op::LayerNormGradGamma { eps }, &[x, dy])
                    }
                }
            }
            30 => {
                let scale = ch_f(self);
                if self.ch.flip() {
                    let square = |t: &TensorType| {
                        let d = &t.shape.0;
                        t.dtype.is_float() && d.len() >= 2 && d[d.len() - 1] == d[d.len() - 2]
                    };
                    let x = match self.existing(square) {
                        Some(x) => x,
                        None => {
                            let mut dims = self.ch.dims(0, 2);
                            let s = self.ch.dim();
                            dims.extend([s, s]);
                            let d = self.ch.float_dtype();
                            self.leaf(TensorType::new(d, dims))?
                        }
                    };
                    let causal = self.ch.flip();
                    self.op(Op::Softmax { scale, causal }, &[x])
                } else {
                    let x = self.float_operand(1, 4)?;
                    self.op(Op::Softmax { scale, causal: false }, &[x])
                }
            }
            31 | 34 | 35 => {
                let y = self.float_operand(0, 4)?;
                let dy = self.of_type(self.ty(y))?;
                let v = ch_f(self);
                let op = match slot {
                    31 => Op::SoftmaxGrad { scale: v },
                    34 => Op::AdamM { beta1: v },
                    _ => Op::AdamV { beta2: v },
                };
                self.op(op, &[y, dy])
            }
            32 | 33 => {
                let logits = self.float_operand(2, 2)?;
                let n = self.ty(logits).shape.0[0];
                let targets = self.of_type(TensorType::new(DType::I32, [n]))?;
                if slot == 32 {
                    self.op(Op::CrossEntropy, &[logits, targets])
                } else {
                    let dloss = self.float_scalar()?;
                    self.op(Op::CrossEntropyGrad, &[logits, targets, dloss])
                }
            }
            36 => {
                let p = self.float_operand(0, 4)?;
                let t = self.ty(p);
                let (m, v) = (self.of_type(t.clone())?, self.of_type(t)?);
                let (lr, step) = (self.float_scalar()?, self.float_scalar()?);
                let (beta1, beta2, eps, weight_decay) = (ch_f(self), ch_f(self), ch_f(self), ch_f(self));
                self.op(Op::AdamParam { beta1, beta2, eps, weight_decay }, &[p, m, v, lr, step])
            }
            37 => {
                let ty = TensorType::new(self.ch.any_dtype(), self.ch.dims(0, 4));
                self.constant(ty)
            }
            38 => {
                let ty = TensorType::new(self.ch.any_dtype(), self.ch.dims(0, 4));
                self.input(ty)
            }
            39 => {
                let scheme = self.ch.pick(&QuantScheme::ALL);
                let w = if scheme == QuantScheme::Q4_0 {
                    // Q4_0's block is 32 rows: the weight needs a multiple of 32 input rows.
                    match self.existing(|t| t.dtype.is_float() && t.shape.rank() == 2 && t.shape.0[0] % 32 == 0) {
                        Some(w) => w,
                        None => {
                            let dims = vec![32 * self.ch.range(1, 2), self.ch.dim()];
                            let d = self.ch.float_dtype();
                            self.leaf(TensorType::new(d, dims))?
                        }
                    }
                } else {
                    self.float_operand(2, 2)?
                };
                let spec = self.quant_spec(scheme, self.ty(w).shape.0[0]);
                self.op(Op::FakeQuant { spec }, &[w])
            }
            40 => {
                let scheme = self.ch.pick(&QuantScheme::ALL);
                let n_in = if scheme == QuantScheme::Q4_0 { 32 * self.ch.range(1, 2) } else { self.ch.dim() };
                let n_out = self.ch.dim();
                let spec = self.quant_spec(scheme, n_in);
                let groups = n_in / spec.group_for(n_in);
                let codes = self.of_type(TensorType::new(spec.code_dtype(), [n_in, n_out]))?;
                let scales = self.of_type(TensorType::new(spec.scale_dtype(), [groups, n_out]))?;
                let mut args = vec![codes, scales];
                if scheme.has_zero_point() {
                    args.push(self.of_type(TensorType::new(DType::F32, [groups, n_out]))?);
                }
                let to = self.ch.float_dtype();
                self.op(Op::Dequantize { spec, to }, &args)
            }
            41 => {
                let x = self.float_operand(1, 4)?;
                let bits = self.ch.range(2, 8) as u8;
                self.op(Op::ActQuant { bits }, &[x])
            }
            42 => {
                let x = self.float_operand(0, 4)?;
                let seed = self.of_type(TensorType::new(DType::I32, Shape::scalar()))?;
                let p = self.ch.pick(&[0.0, -0.0, 0.1, 0.5, 1.0 / 3.0, 0.999_999, 5e-324]);
                let stream = self.ch.pick(&[0, 1, 7, 123_456, usize::MAX]);
                self.op(Op::Dropout { p, stream }, &[x, seed])
            }
            44 => {
                let x = self.float_operand(0, 4)?;
                self.op(Op::AllFinite, &[x])
            }
            45 => {
                let a = self.float_operand(0, 4)?;
                let t = self.ty(a);
                let d = self.ch.float_dtype();
                let cond = self.of_type(TensorType::new(d, t.shape.clone()))?;
                let b = self.of_type(t)?;
                self.op(Op::Select, &[cond, a, b])
            }
            46 => {
                let state = self.of_type(TensorType::f32([2]))?;
                let finite = self.of_type(TensorType::f32(Shape::scalar()))?;
                let interval = self.ch.pick(&[1, 2, 2000, usize::MAX]);
                let (growth, backoff) = (self.ch.pick(&[2.0, 1.5, 1e300]), self.ch.pick(&[0.5, 0.25, 1e-300]));
                self.op(Op::LossScale { interval, growth, backoff }, &[state, finite])
            }
            47 | 49 => {
                // a blockwise-quantized tensor: codes (u8) or values (f32) and one absmax per block
                let dims = self.ch.dims(1, 3);
                let n: usize = dims.iter().product();
                let map = self.ch.pick(&DynMap::ALL);
                let dtype = if slot == 47 { DType::U8 } else { DType::F32 };
                let x = self.of_type(TensorType::new(dtype, dims))?;
                let absmax = self.of_type(TensorType::new(DType::F32, [qmap::blocks(n)]))?;
                let op = if slot == 47 { Op::BlockDequant { map } } else { Op::BlockQuant { map } };
                self.op(op, &[x, absmax])
            }
            48 => {
                let ty = TensorType::new(DType::F32, self.ch.dims(0, 3));
                let x = self.of_type(ty)?;
                self.op(Op::BlockAbsMax, &[x])
            }
            50 | 51 => {
                // (w f32 [in, out], scales f32 [in/G, out][, zeros][, dy]): learned scales
                let scheme = self.ch.pick(&QuantScheme::ALL);
                let n_in = if scheme == QuantScheme::Q4_0 { 32 * self.ch.range(1, 2) } else { self.ch.dim() };
                let n_out = self.ch.dim();
                let spec = self.quant_spec(scheme, n_in);
                let groups = n_in / spec.group_for(n_in);
                let w = self.of_type(TensorType::new(DType::F32, [n_in, n_out]))?;
                let mut args = vec![w, self.of_type(TensorType::new(DType::F32, [groups, n_out]))?];
                if scheme.has_zero_point() {
                    args.push(self.of_type(TensorType::new(DType::F32, [groups, n_out]))?);
                }
                if slot == 50 {
                    return self.op(Op::FakeQuantLearned { spec }, &args);
                }
                args.push(self.of_type(TensorType::new(DType::F32, [n_in, n_out]))?);
                let wrts: Vec<QuantParam> =
                    QuantParam::ALL.into_iter().filter(|&q| q != QuantParam::Zero || scheme.has_zero_point()).collect();
                let wrt = self.ch.pick(&wrts);
                self.op(Op::FakeQuantLearnedGrad { spec, wrt }, &args)
            }
            52..=54 => {
                // a collective over 1 to 4 ranks; a reduce-scatter's first dimension a multiple
                let world = self.ch.range(1, 4);
                let reduce = self.ch.pick(&Reduce::ALL);
                if slot == 53 {
                    let mut dims = self.ch.dims(0, 2);
                    dims.insert(0, world * self.ch.range(1, 3));
                    let dtype = self.ch.float_dtype();
                    let x = self.of_type(TensorType::new(dtype, dims))?;
                    return self.op(Op::ReduceScatter { reduce, world }, &[x]);
                }
                let x = self.float_operand(1, 4)?;
                let op = if slot == 52 { Op::AllReduce { reduce, world } } else { Op::AllGather { world } };
                self.op(op, &[x])
            }
            55 | 56 => {
                // (logits [N, V], targets [N] i32, weights [N] f32[, dloss])
                let logits = self.float_operand(2, 2)?;
                let n = self.ty(logits).shape.0[0];
                let targets = self.of_type(TensorType::new(DType::I32, [n]))?;
                let weights = self.of_type(TensorType::new(DType::F32, [n]))?;
                if slot == 55 {
                    self.op(Op::WeightedCrossEntropy, &[logits, targets, weights])
                } else {
                    let dloss = self.float_scalar()?;
                    self.op(Op::WeightedCrossEntropyGrad, &[logits, targets, weights, dloss])
                }
            }
            57 => {
                // (x [B, NH, T, T], positions [B, T] i32)
                let (b, nh, t) = (self.ch.dim(), self.ch.dim(), self.ch.dim());
                let dtype = self.ch.float_dtype();
                let x = self.of_type(TensorType::new(dtype, [b, nh, t, t]))?;
                let positions = self.of_type(TensorType::new(DType::I32, [b, t]))?;
                let scale = ch_f(self);
                self.op(Op::PackedSoftmax { scale }, &[x, positions])
            }
            _ => {
                // a kernel whose body is gelu(in0) [* in1]: bodies nest a whole graph in the text
                let x = self.float_operand(0, 4)?;
                let ty = self.g.ty(x).clone();
                let two = self.ch.flip();
                let family = self.ch.pick(&families());
                let mut body = Graph::new(family.to_string());
                let a = body.input("in0", InputKind::Data, ty.dtype, ty.shape.clone())?;
                let mut y = body.add(Op::Unary(UnaryOp::Gelu), &[a])?;
                let mut operands = vec![x];
                if two {
                    let b = body.input("in1", InputKind::Data, ty.dtype, ty.shape.clone())?;
                    y = body.add(Op::Binary(BinaryOp::Mul), &[y, b])?;
                    operands.push(self.of_type(ty)?);
                }
                body.set_output("out", y)?;
                self.op(Op::Kernel { family, body: Box::new(body) }, &operands)
            }
        }
    }

    /// A valid quantization spec of `scheme` for a weight with `n_in` input rows.
    fn quant_spec(&mut self, scheme: QuantScheme, n_in: usize) -> QuantSpec {
        let (bits, group) = match scheme {
            QuantScheme::Q4_0 => (4, 32),
            QuantScheme::Nf4 => (4, 0),
            QuantScheme::Sym | QuantScheme::Asym => (self.ch.range(2, 8) as u8, 0),
        };
        let group = if scheme == QuantScheme::Q4_0 || self.ch.flip() {
            group
        } else {
            // An explicit divisor of n_in instead of 0 (one group per column).
            let divisors: Vec<usize> = (1..=n_in).filter(|d| n_in.is_multiple_of(*d)).collect();
            self.ch.pick(&divisors)
        };
        QuantSpec { bits, group, scheme }
    }
}
