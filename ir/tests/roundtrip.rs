//! Round-trip properties of the text format on random well-typed graphs.
//!
//! The generator builds graphs step by step from a flat list of random choices (the
//! "choice sequence" style: proptest shrinks the list toward zeros and shorter, which the builder
//! reads as "first option, fewer steps", so failures shrink to small graphs). It starts from a few
//! leaves, then repeatedly picks an op and operands whose types fit, creating a fitting leaf when
//! no existing node fits. Every op of the closed op set can be generated; `op_slot` below is an
//! exhaustive match, so a new op fails to compile here until the generator learns it.
//!
//! Properties:
//! - every generated graph verifies;
//! - `print(parse(print(g))) == print(g)`, and the parsed graph verifies;
//! - the text does not depend on node indices: rebuilding a graph in another insertion order
//!   (inputs declared in another order, dead nodes in between) prints the same once dead nodes
//!   are removed.

use std::collections::{BTreeSet, HashMap};

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use qatc_ir::infer::broadcasts_to;
use qatc_ir::{
    parse, print, qmap, verify, BinaryOp, DType, DynMap, Graph, InputKind, IrError, NodeId, Op, QuantParam, QuantScheme, QuantSpec, Shape,
    TensorType, UnaryOp,
};

// ---------------------------------------------------------------------------------------------
// The op list the generator draws from.

const UNARY: [UnaryOp; 9] = [
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
const BINARY: [BinaryOp; 7] =
    [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div, BinaryOp::Max, BinaryOp::Min, BinaryOp::GeluGrad];

/// Generator slots: 0..9 unary, 9..16 binary, then one per remaining op.
const N_SLOTS: usize = 52;

/// The generator slot of an op. Exhaustive on purpose (no wildcard): adding an op to the IR
/// breaks this test's build until the generator covers it.
fn op_slot(op: &Op) -> usize {
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
    }
}

/// Names with characters the printer must escape and the parser must unescape: quotes,
/// backslashes, whitespace, control characters, non-ASCII, a leading combining mark (which
/// Rust's `{:?}` escapes as `\u{301}`), text that looks like syntax, and the empty name.
const NAMES: [&str; 22] = [
    "x",
    "wte.weight",
    "h.0.attn.c_attn.lora_A",
    "with space",
    "quo\"te",
    "back\\slash",
    "\\\"both\\\"",
    "tab\tnew\nline\rcr",
    "nul\0byte",
    "del\u{7f}",
    "ünïcödé",
    "日本語",
    "🦀 crab",
    "\u{301}combining first",
    "zero\u{200b}width",
    "%0 = input",
    "} {",
    "// not a comment",
    "=,[]()",
    "'single'",
    "   ",
    "",
];

/// Float attributes and const values: ordinary, negative, signed zero, extreme, non-finite.
const FLOATS: [f64; 24] = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    -1.5,
    0.1,
    1.0 / 3.0,
    std::f64::consts::PI,
    1e-5,
    1e-300,
    -1e-300,
    5e-324,
    f64::MIN_POSITIVE,
    1e300,
    -1e300,
    f64::MAX,
    f64::MIN,
    123_456_789.0,
    -7.25e-12,
    f64::INFINITY,
    f64::NEG_INFINITY,
    f64::NAN,
    0.999,
];

// ---------------------------------------------------------------------------------------------
// The choice sequence.

/// Reads choices from a list; past its end every choice is 0 (the "simplest" option).
struct Choices {
    v: Vec<u32>,
    i: usize,
}

impl Choices {
    fn new(v: Vec<u32>) -> Choices {
        Choices { v, i: 0 }
    }
    fn next(&mut self) -> u32 {
        let x = self.v.get(self.i).copied().unwrap_or(0);
        self.i += 1;
        x
    }
    /// A number in [0, n); 0 when n is 0.
    fn below(&mut self, n: usize) -> usize {
        let x = self.next() as usize;
        if n == 0 {
            0
        } else {
            x % n
        }
    }
    /// A number in [lo, hi].
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }
    fn flip(&mut self) -> bool {
        self.next() % 2 == 1
    }
    /// True with probability about 1/n.
    fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == n - 1
    }
    fn pick<T: Clone>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())].clone()
    }
    fn float(&mut self) -> f64 {
        if self.one_in(5) {
            // Any bit pattern: subnormals, NaN payloads, everything the printer must cope with.
            f64::from_bits((u64::from(self.next()) << 32) | u64::from(self.next()))
        } else {
            self.pick(&FLOATS)
        }
    }
    fn float_dtype(&mut self) -> DType {
        self.pick(&[DType::F32, DType::F16, DType::BF16])
    }
    fn any_dtype(&mut self) -> DType {
        self.pick(&DType::ALL)
    }
    fn dim(&mut self) -> usize {
        if self.one_in(8) {
            self.pick(&[5, 7, 12])
        } else {
            self.range(1, 4)
        }
    }
    fn dims(&mut self, min_rank: usize, max_rank: usize) -> Vec<usize> {
        let r = self.range(min_rank, max_rank);
        (0..r).map(|_| self.dim()).collect()
    }
    /// A random permutation of 0..n (Fisher-Yates).
    fn perm(&mut self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = self.below(i + 1);
            p.swap(i, j);
        }
        p
    }
}

// ---------------------------------------------------------------------------------------------
// The graph builder.

struct Builder<'a> {
    g: Graph,
    ch: &'a mut Choices,
    /// Every node built so far, in build order (the pool operands are drawn from).
    nodes: Vec<NodeId>,
    input_names: BTreeSet<String>,
}

impl<'a> Builder<'a> {
    fn new(ch: &'a mut Choices) -> Builder<'a> {
        let name = format!("g {}", ch.pick(&NAMES));
        Builder { g: Graph::new(name), ch, nodes: Vec::new(), input_names: BTreeSet::new() }
    }

    fn ty(&self, id: NodeId) -> TensorType {
        self.g.ty(id).clone()
    }

    /// A fresh input name: an odd name from the list, suffixed when already taken.
    fn fresh_input_name(&mut self) -> String {
        let base = self.ch.pick(&NAMES).to_string();
        let mut name = base.clone();
        let mut k = 0;
        while self.input_names.contains(&name) {
            k += 1;
            name = format!("{base}#{k}");
        }
        self.input_names.insert(name.clone());
        name
    }

    fn push(&mut self, id: NodeId) -> NodeId {
        self.nodes.push(id);
        id
    }

    fn input(&mut self, ty: TensorType) -> Result<NodeId, IrError> {
        let kind = self.ch.pick(&[InputKind::Frozen, InputKind::Trainable, InputKind::Data, InputKind::State]);
        let name = self.fresh_input_name();
        let id = self.g.input(name, kind, ty.dtype, ty.shape)?;
        Ok(self.push(id))
    }

    fn constant(&mut self, ty: TensorType) -> Result<NodeId, IrError> {
        let v = self.ch.float();
        let id = self.g.constant(v, ty.dtype, ty.shape)?;
        Ok(self.push(id))
    }

    /// A new leaf (input or const) of type `ty`.
    fn leaf(&mut self, ty: TensorType) -> Result<NodeId, IrError> {
        if self.ch.flip() {
            self.input(ty)
        } else {
            self.constant(ty)
        }
    }

    /// An existing node satisfying `pred` (usually), or None.
    fn existing(&mut self, pred: impl Fn(&TensorType) -> bool) -> Option<NodeId> {
        let cands: Vec<NodeId> = self.nodes.iter().copied().filter(|&n| pred(self.g.ty(n))).collect();
        if cands.is_empty() || self.ch.one_in(4) {
            None
        } else {
            Some(self.ch.pick(&cands))
        }
    }

    /// A node of exactly type `ty`: an existing one or a new leaf.
    fn of_type(&mut self, ty: TensorType) -> Result<NodeId, IrError> {
        match self.existing(|t| *t == ty) {
            Some(n) => Ok(n),
            None => self.leaf(ty),
        }
    }

    /// A float node of rank in [min_rank, max_rank].
    fn float_operand(&mut self, min_rank: usize, max_rank: usize) -> Result<NodeId, IrError> {
        match self.existing(|t| t.dtype.is_float() && (min_rank..=max_rank).contains(&t.shape.rank())) {
            Some(n) => Ok(n),
            None => {
                let ty = TensorType::new(self.ch.float_dtype(), self.ch.dims(min_rank, max_rank.min(4)));
                self.leaf(ty)
            }
        }
    }

    /// A node of any dtype of rank in [min_rank, 4].
    fn any_operand(&mut self, min_rank: usize) -> Result<NodeId, IrError> {
        match self.existing(|t| t.shape.rank() >= min_rank) {
            Some(n) => Ok(n),
            None => {
                let ty = TensorType::new(self.ch.any_dtype(), self.ch.dims(min_rank, 3));
                self.leaf(ty)
            }
        }
    }

    /// An i32 node of rank <= 2.
    fn ids(&mut self) -> Result<NodeId, IrError> {
        match self.existing(|t| t.dtype == DType::I32 && t.shape.rank() <= 2) {
            Some(n) => Ok(n),
            None => {
                let ty = TensorType::new(DType::I32, self.ch.dims(0, 2));
                self.leaf(ty)
            }
        }
    }

    /// A float scalar of any float dtype (learning rate, step, dloss).
    fn float_scalar(&mut self) -> Result<NodeId, IrError> {
        let d = self.ch.float_dtype();
        self.of_type(TensorType::new(d, Shape::scalar()))
    }

    /// Adds an op node, naming some of them (non-input names need not be unique).
    fn op(&mut self, op: Op, operands: &[NodeId]) -> Result<NodeId, IrError> {
        let name = if self.ch.one_in(4) { Some(self.ch.pick(&NAMES).to_string()) } else { None };
        let id = self.g.add_node(op, operands, name)?;
        Ok(self.push(id))
    }

    /// A shape with `n` elements: n's prime factors spread over a random rank, 1s mixed in.
    fn factor_shape(&mut self, n: usize) -> Vec<usize> {
        let r = if n == 1 { self.ch.range(0, 3) } else { self.ch.range(1, 4) };
        let mut dims = vec![1; r];
        let (mut m, mut p) = (n, 2);
        while m > 1 {
            while m % p == 0 {
                let i = self.ch.below(r);
                dims[i] *= p;
                m /= p;
            }
            p += 1;
        }
        dims
    }

    /// Builds one node in generator slot `slot`.
    fn step(&mut self, slot: usize) -> Result<NodeId, IrError> {
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
            _ => {
                // a kernel whose body is gelu(in0) [* in1]: bodies nest a whole graph in the text
                let x = self.float_operand(0, 4)?;
                let ty = self.g.ty(x).clone();
                let two = self.ch.flip();
                let family = self.ch.pick(&NAMES).to_string();
                let mut body = Graph::new(family.clone());
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

    /// Declares 1..=3 outputs and, for some trainable/state inputs, an update of equal type.
    fn outputs(&mut self) -> Result<(), IrError> {
        let mut names = BTreeSet::new();
        for _ in 0..self.ch.range(1, 3) {
            let node = self.ch.pick(&self.nodes);
            let base = self.ch.pick(&NAMES).to_string();
            let mut name = base.clone();
            let mut k = 0;
            while names.contains(&name) {
                k += 1;
                name = format!("{base}~{k}");
            }
            names.insert(name.clone());
            self.g.set_output(name, node)?;
        }
        for inp in self.g.inputs() {
            if !matches!(self.g.input_kind(inp), Some(InputKind::Trainable | InputKind::State)) || self.ch.flip() {
                continue;
            }
            let ty = self.ty(inp);
            let cands: Vec<NodeId> = self.nodes.iter().copied().filter(|&n| *self.g.ty(n) == ty).collect();
            let node = self.ch.pick(&cands);
            let name = self.g.node(inp).name.clone().unwrap_or_default();
            self.g.set_update(name, node)?;
        }
        Ok(())
    }
}

/// Builds a random graph: a few leaves, `steps` ops drawn from `ch`, then outputs.
fn random_graph(ch: &mut Choices, steps: usize) -> Result<Graph, IrError> {
    let mut b = Builder::new(ch);
    for _ in 0..b.ch.range(1, 4) {
        let ty = TensorType::new(b.ch.any_dtype(), b.ch.dims(0, 4));
        b.input(ty)?;
    }
    for _ in 0..steps {
        let slot = b.ch.below(N_SLOTS);
        b.step(slot)?;
    }
    b.outputs()?;
    Ok(b.g)
}

/// A graph with one node of every generator slot (plus the leaves they needed).
fn every_op_graph(seed: u32) -> Result<Graph, IrError> {
    let mut ch = Choices::new((0..4000u32).map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 7).collect());
    let mut b = Builder::new(&mut ch);
    for slot in 0..N_SLOTS {
        b.step(slot)?;
    }
    b.outputs()?;
    Ok(b.g)
}

// ---------------------------------------------------------------------------------------------
// Properties.

fn fail(what: &str, e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(format!("{what}: {e}"))
}

/// The round-trip property on one graph.
fn check_roundtrip(g: &Graph) -> Result<(), TestCaseError> {
    verify(g).map_err(|e| fail("the built graph does not verify", e))?;
    let text = print(g);
    let g2 = parse(&text).map_err(|e| fail(&format!("parse failed on\n{text}"), e))?;
    verify(&g2).map_err(|e| fail(&format!("the parsed graph does not verify\n{text}"), e))?;
    let text2 = print(&g2);
    prop_assert_eq!(&text2, &text, "print(parse(print(g))) != print(g)");
    prop_assert_eq!(g2.len(), g.len());
    prop_assert_eq!(g2.op_counts(), g.op_counts());
    prop_assert_eq!(&g2.name, &g.name);
    prop_assert_eq!(g2.outputs().len(), g.outputs().len());
    Ok(())
}

/// Rebuilds `g` in a random valid insertion order (a random linear extension of the operand
/// order, so inputs are declared in another order too), with dead nodes mixed in.
fn reinsert(g: &Graph, ch: &mut Choices) -> Result<Graph, IrError> {
    let mut h = Graph::new(g.name.clone());
    let mut map: HashMap<NodeId, NodeId> = HashMap::new();
    let mut todo: Vec<NodeId> = g.node_ids();
    while !todo.is_empty() {
        if ch.one_in(3) {
            // A dead node: a const, or an op on something already built.
            let c = h.constant(ch.float(), ch.float_dtype(), ch.dims(0, 2))?;
            if ch.flip() {
                h.add(Op::Unary(ch.pick(&UNARY)), &[c])?;
            }
            let made: Vec<NodeId> = map.values().copied().collect();
            if !made.is_empty() {
                let x = ch.pick(&made);
                h.add(Op::Reshape { shape: h.ty(x).shape.clone() }, &[x])?;
            }
        }
        let ready: Vec<usize> = (0..todo.len()).filter(|&i| g.operands(todo[i]).iter().all(|o| map.contains_key(o))).collect();
        let i = ready[ch.below(ready.len())];
        let n = todo.swap_remove(i);
        let ops: Vec<NodeId> = g.operands(n).iter().map(|o| map[o]).collect();
        let node = g.node(n);
        let id = h.add_node(node.op.clone(), &ops, node.name.clone())?;
        map.insert(n, id);
    }
    for o in g.outputs() {
        if o.update {
            h.set_update(o.name.clone(), map[&o.node])?;
        } else {
            h.set_output(o.name.clone(), map[&o.node])?;
        }
    }
    Ok(h)
}

/// Makes every node of `g` live: each node no output reaches becomes an output of its own, so
/// `remove_dead` keeps exactly the same nodes in both graphs compared.
fn keep_all(g: &mut Graph) -> Result<(), IrError> {
    let live: BTreeSet<NodeId> = {
        let mut stack: Vec<NodeId> = g.outputs().iter().map(|o| o.node).collect();
        let mut seen = BTreeSet::new();
        while let Some(n) = stack.pop() {
            if seen.insert(n) {
                stack.extend(g.operands(n));
            }
        }
        seen
    };
    for (k, n) in g.node_ids().into_iter().enumerate() {
        if !live.contains(&n) && g.users(n).is_empty() {
            g.set_output(format!("keep {k}"), n)?;
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, max_shrink_iters: 4096, .. ProptestConfig::default() })]

    #[test]
    fn print_parse_print_is_identity(choices in vec(any::<u32>(), 0..1500), steps in 0usize..40) {
        let mut ch = Choices::new(choices);
        let g = random_graph(&mut ch, steps).map_err(|e| fail("generator built an ill-typed node", e))?;
        check_roundtrip(&g)?;
    }

    #[test]
    fn text_is_independent_of_insertion_order(
        choices in vec(any::<u32>(), 0..1500),
        order in vec(any::<u32>(), 0..400),
        steps in 0usize..30,
    ) {
        let mut ch = Choices::new(choices);
        let mut g = random_graph(&mut ch, steps).map_err(|e| fail("generator", e))?;
        keep_all(&mut g).map_err(|e| fail("keep_all", e))?;
        let mut h = reinsert(&g, &mut Choices::new(order)).map_err(|e| fail("reinsert", e))?;
        // The rebuilt graph carries dead nodes; they print after the live ones, so drop them.
        h.remove_dead(false);
        g.remove_dead(false);
        prop_assert_eq!(print(&h), print(&g));
    }
}

// ---------------------------------------------------------------------------------------------
// Deterministic checks.

/// The generator really can produce every op: one graph holding each generator slot round-trips,
/// and its op set is the whole closed op set.
#[test]
fn every_op_round_trips() {
    for seed in 0..32 {
        let g = every_op_graph(seed).expect("every_op_graph builds");
        check_roundtrip(&g).expect("round trip");
        let seen: BTreeSet<usize> = g.node_ids().iter().map(|&n| op_slot(&g.node(n).op)).collect();
        assert_eq!(seen, (0..N_SLOTS).collect::<BTreeSet<_>>(), "seed {seed}: some op was not generated");
    }
}

/// Const values and float attributes come back bit for bit (NaN: as some NaN).
#[test]
fn floats_round_trip_exactly() {
    let mut g = Graph::new("floats");
    let mut ids = Vec::new();
    let extra = [1.0 + f64::EPSILON, 0.1 + 0.2, 2.5e-308, 9_007_199_254_740_993.0, -1e-320];
    for (i, &v) in FLOATS.iter().chain(&extra).enumerate() {
        let c = g.constant(v, DType::F32, [2]).expect("const");
        let a = g.add(Op::Affine { mul: v, add: -v }, &[c]).expect("affine");
        g.set_output(format!("o{i}"), a).expect("output");
        ids.push(v);
    }
    let text = print(&g);
    let h = parse(&text).expect("parse");
    assert_eq!(print(&h), text);
    let mut got = Vec::new();
    for o in h.outputs() {
        let Op::Affine { mul, add } = h.node(o.node).op else { panic!("not an affine: {:?}", h.node(o.node).op) };
        let c = h.operands(o.node)[0];
        let Op::Const { value, .. } = h.node(c).op else { panic!("not a const") };
        got.push((value, mul, add));
    }
    for (v, (value, mul, add)) in ids.iter().zip(got) {
        for w in [value, mul] {
            assert!(w.to_bits() == v.to_bits() || (v.is_nan() && w.is_nan()), "{v:?} came back as {w:?}");
        }
        assert!(add.to_bits() == (-v).to_bits() || (v.is_nan() && add.is_nan()), "{:?} came back as {add:?}", -v);
    }
}

/// Odd names survive the round trip exactly, as graph, input, node, output and update names.
#[test]
fn odd_names_round_trip_exactly() {
    for (i, &name) in NAMES.iter().enumerate() {
        let mut g = Graph::new(name);
        let x = g.input(name, InputKind::Trainable, DType::F32, [3]).expect("input");
        let y = g.add_named(Op::Unary(UnaryOp::Neg), &[x], name).expect("neg");
        g.set_output(name, y).expect("output");
        g.set_update(name, y).expect("update");
        let text = print(&g);
        let h = parse(&text).unwrap_or_else(|e| panic!("name #{i} {name:?}: {e}\n{text}"));
        assert_eq!(h.name, name);
        let hx = h.find_input(name).unwrap_or_else(|| panic!("input {name:?} lost"));
        assert_eq!(h.node(hx).name.as_deref(), Some(name));
        let hy = h.output(name).unwrap_or_else(|| panic!("output {name:?} lost"));
        assert_eq!(h.node(hy).name.as_deref(), Some(name));
        assert_eq!(h.outputs().iter().filter(|o| o.update && o.name == name).count(), 1);
        assert_eq!(print(&h), text);
    }
}

/// Hand-built: the same graph with inputs declared in opposite orders and a dead node in between
/// prints the same (after the dead node is removed); the numbering follows the outputs.
#[test]
fn input_declaration_order_does_not_change_the_text() {
    let build = |flip: bool| -> Result<Graph, IrError> {
        let mut g = Graph::new("order");
        let (a, b) = if flip {
            let b = g.input("b", InputKind::Frozen, DType::F32, [2, 3])?;
            let dead = g.constant(7.0, DType::F32, [5])?;
            g.add(Op::Unary(UnaryOp::Exp), &[dead])?;
            let a = g.input("a", InputKind::Data, DType::F32, [2, 3])?;
            (a, b)
        } else {
            let a = g.input("a", InputKind::Data, DType::F32, [2, 3])?;
            let b = g.input("b", InputKind::Frozen, DType::F32, [2, 3])?;
            (a, b)
        };
        let s = g.add(Op::Binary(BinaryOp::Sub), &[a, b])?;
        let t = g.add(Op::Unary(UnaryOp::Tanh), &[s])?;
        g.set_output("t", t)?;
        g.set_output("s", s)?;
        Ok(g)
    };
    let g1 = build(false).expect("build");
    let mut g2 = build(true).expect("build");
    assert_ne!(print(&g1), print(&g2), "the dead nodes print before removal");
    assert_eq!(g2.remove_dead(false), 2);
    assert_eq!(print(&g1), print(&g2));
    let want = "graph \"order\" {\n  %0 = input[kind=data] : f32[2, 3] \"a\"\n  %1 = input[kind=frozen] : f32[2, 3] \"b\"\n  %2 = sub(%0, %1) : f32[2, 3]\n  %3 = tanh(%2) : f32[2, 3]\n  output \"t\" = %3\n  output \"s\" = %2\n}\n";
    assert_eq!(print(&g1), want);
}
