//! The closed op set. Every graph qatc builds, from the GPT-2 forward to the fused training step,
//! is made of these ops and nothing else, so every pass, the interpreter and every backend can
//! match on them exhaustively. Each op has one output.
//!
//! Shapes below use llm.c's vocabulary: B batch, T sequence, C channels, NH heads, V vocab.

use crate::family::KernelFamily;
use crate::kind::OpKind;
use crate::qmap::DynMap;
pub use crate::quant::{QuantParam, QuantScheme, QuantSpec, NF4};
use crate::types::{DType, Shape};

/// What an `Input` leaf is, which decides who provides its value and whether it changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum InputKind {
    /// A model weight that training does not change.
    Frozen,
    /// A weight that training updates (it has a gradient and optimizer state).
    Trainable,
    /// Per-step data: token ids, targets, the learning rate.
    Data,
    /// Optimizer or step state carried between steps (Adam moments, the step count).
    State,
}

impl InputKind {
    pub fn name(self) -> &'static str {
        match self {
            InputKind::Frozen => "frozen",
            InputKind::Trainable => "trainable",
            InputKind::Data => "data",
            InputKind::State => "state",
        }
    }
    pub fn from_name(s: &str) -> Option<InputKind> {
        [InputKind::Frozen, InputKind::Trainable, InputKind::Data, InputKind::State].into_iter().find(|k| k.name() == s)
    }
    pub fn is_param(self) -> bool {
        matches!(self, InputKind::Frozen | InputKind::Trainable)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    Neg,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Recip,
    Tanh,
    Square,
    /// GPT-2's `gelu_new`: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
    Gelu,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Max,
    Min,
    /// (x, dy) -> dy * gelu'(x): GELU's backward, one op so it is not re-derived from primitives.
    GeluGrad,
}

/// The ops. Operand lists are written `(a, b)` in the comments; attributes are the fields.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    // ---- leaves ----
    /// A value supplied from outside the graph; its name is the node's name.
    Input {
        kind: InputKind,
        dtype: DType,
        shape: Shape,
    },
    /// A tensor filled with one value.
    Const {
        value: f64,
        dtype: DType,
        shape: Shape,
    },

    // ---- elementwise (operands of equal shape; see Broadcast) ----
    Unary(UnaryOp),
    Binary(BinaryOp),
    /// x * mul + add
    Affine {
        mul: f64,
        add: f64,
    },
    /// Element type conversion.
    Cast {
        to: DType,
    },

    // ---- shape ----
    /// Numpy-style broadcast to `shape` (trailing dims aligned; each input dim equals or is 1).
    Broadcast {
        shape: Shape,
    },
    /// The adjoint of Broadcast: sums the broadcast dimensions away, down to `shape`.
    SumTo {
        shape: Shape,
    },
    Reshape {
        shape: Shape,
    },
    /// out.dims[i] = in.dims[perm[i]]
    Transpose {
        perm: Vec<usize>,
    },
    /// Elements [start, end) along `axis`.
    Slice {
        axis: usize,
        start: usize,
        end: usize,
    },
    /// (a, b, ...) joined along `axis`.
    Concat {
        axis: usize,
    },

    // ---- linear algebra ----
    /// (a [.., M, K], b [.., K, N]) -> [.., M, N]; `ta`/`tb` read a or b transposed in its last two
    /// dims. Batch dims must be equal.
    MatMul {
        ta: bool,
        tb: bool,
    },

    // ---- neural-network ops ----
    /// (table [V, C], ids [..] i32) -> [.., C]
    Gather,
    /// (ids [..] i32, dy [.., C]) -> [rows, C]: the adjoint of Gather, summing rows hit twice.
    ScatterAdd {
        rows: usize,
    },
    /// (x [.., C], gamma [C], beta [C]) -> [.., C], normalized over the last dim.
    LayerNorm {
        eps: f64,
    },
    /// (x, gamma, dy) -> dx
    LayerNormGradX {
        eps: f64,
    },
    /// (x, dy) -> dgamma [C] = sum over rows of dy * xhat
    LayerNormGradGamma {
        eps: f64,
    },
    /// x [.., T, S] -> softmax over the last dim of scale * x; with `causal`, entries j > i are
    /// masked out (T == S).
    Softmax {
        scale: f64,
        causal: bool,
    },
    /// (x [B, NH, T, T], positions [B, T] i32) -> softmax over the last dim of scale * x, row i
    /// of batch b over keys i - positions[b, i] ..= i (clamped to 0 ..= i), the rest exactly 0:
    /// the causal softmax of packed sequences, where each example's tokens are numbered from 0 and
    /// attend only to their own example. Its gradient is SoftmaxGrad's (masked entries have y 0).
    PackedSoftmax {
        scale: f64,
    },
    /// (y, dy) -> dx = scale * y * (dy - sum(dy * y)) where y is Softmax's output.
    SoftmaxGrad {
        scale: f64,
    },
    /// (logits [N, V], targets [N] i32) -> [] : mean over N of -log softmax(logits)[target].
    CrossEntropy,
    /// (logits [N, V], targets [N] i32, dloss []) -> dlogits [N, V]
    CrossEntropyGrad,
    /// (logits [N, V], targets [N] i32, weights [N] f32) -> [] : sum over N of
    /// weights[i] * -log softmax(logits)[target]. The loss of instruction data: a token that does
    /// not count (a prompt's, padding) has weight 0, and the host scales the rest so that they sum
    /// to 1 over the step (a plain mean over N is weights 1/N). A target of weight 0 may be any id
    /// in [0, V).
    WeightedCrossEntropy,
    /// (logits [N, V], targets [N] i32, weights [N] f32, dloss []) -> dlogits [N, V] =
    /// dloss * weights[i] * (softmax(logits) - onehot(target)) per row i.
    WeightedCrossEntropyGrad,

    // ---- quantization and LoRA ----
    /// w [in, out] -> the weight rounded to the quantization grid of `spec` (same type). Its
    /// gradient is the straight-through estimator: dy passes through unchanged.
    FakeQuant {
        spec: QuantSpec,
    },
    /// (codes [in, out] i4/u8, scales [in/G, out] f32 (f16 for q4_0)[, zero_points [in/G, out] f32
    /// for asym]) -> `to` [in, out]; with `to` f32 it equals FakeQuant of the original weight bit
    /// for bit; with f16/bf16 (mixed precision: frozen weights dequantize straight to the compute
    /// type) that value rounded once to `to`.
    Dequantize {
        spec: QuantSpec,
        to: DType,
    },
    /// (w [in, out], scales [in/G, out] f32[, zero points [in/G, out] f32 for asym]) -> f32 [in, out]:
    /// w rounded to the grid of GIVEN scales, which training learns (LSQ, Esser et al. 2020). Each
    /// scale is used as its fp16 value s (as deployment formats store it); x = w / s, and the grid
    /// point is x rounded and clamped to the grid's range (`quant::Grid::range`; nf4: the
    /// nearest code), times s. A group whose s is 0 is 0. Equals Dequantize of
    /// `quant::quantize_learned` bit for bit.
    FakeQuantLearned {
        spec: QuantSpec,
    },
    /// (w, scales[, zero points], dy) -> [in, out]: one element's part of FakeQuantLearned's
    /// gradient with respect to `wrt` (LSQ's rule, x = w / s): weight, dy where x lies in the
    /// range (else 0: the clipped straight-through estimator); scale, dy (q - x) inside and dy q
    /// outside, q the grid point in units of s; zero point, -s dy outside (else 0). The autodiff
    /// rule sums the scale and zero-point parts over each group and applies LSQ's gradient scale.
    FakeQuantLearnedGrad {
        spec: QuantSpec,
        wrt: QuantParam,
    },
    /// x [.., C] -> dynamic per-token (per row) symmetric fake-quant to `bits`: S = absmax/qmax.
    /// Straight-through inside the range (which the absmax scale always covers).
    ActQuant {
        bits: u8,
    },
    /// (x, seed i32 []) -> x * mask / (1 - p), the mask drawn from a counter-based hash of
    /// (seed, stream, element index): deterministic, so the backward applies the same mask.
    Dropout {
        p: f64,
        stream: usize,
    },

    // ---- mixed precision (the `precision` pass; PyTorch GradScaler's semantics) ----
    /// x (any float) -> f32 []: 1 when every element of x is finite, else 0.
    AllFinite,
    /// (cond, a, b), all of one shape, cond float -> a where cond != 0, else b (elementwise; a and
    /// b of one type, which is the result's). Lazy as a choice: the value not chosen may be NaN.
    Select,
    /// (state f32[2] = [scale, good steps], finite f32 []) -> the next state, as
    /// `torch._amp_update_scale_`: finite == 0 multiplies the scale by `backoff` and zeroes the
    /// count; otherwise the count grows by one and, reaching `interval`, resets to 0 while the
    /// scale is multiplied by `growth` (kept only if the product is finite).
    LossScale {
        interval: usize,
        growth: f64,
        backoff: f64,
    },

    // ---- fusion ----
    /// A fused kernel: `body` computes this node's value from its operands in one pass over
    /// memory. The body's inputs are `in0`, `in1`, ... (operand order, kind data) and its one
    /// output is `out`; intermediates inside it are never written to device memory.
    Kernel {
        family: KernelFamily,
        body: Box<crate::graph::Graph>,
    },

    // ---- optimizer (PyTorch AdamW semantics) ----
    /// (m, g) -> beta1 * m + (1 - beta1) * g
    AdamM {
        beta1: f64,
    },
    /// (v, g) -> beta2 * v + (1 - beta2) * g^2
    AdamV {
        beta2: f64,
    },
    /// (p, m', v', lr [], t []) -> p * (1 - lr * wd) - lr / (1 - beta1^t) * m' / (sqrt(v' / (1 - beta2^t)) + eps)
    AdamParam {
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    },

    // ---- collectives over `world` ranks (`crate::collective`) ----
    /// x -> the sum (or mean) over ranks of x, on every rank
    AllReduce {
        reduce: crate::collective::Reduce,
        world: usize,
    },
    /// x [world * m, ...] -> [m, ...]: this rank's block of the sum (or mean) over ranks of x
    ReduceScatter {
        reduce: crate::collective::Reduce,
        world: usize,
    },
    /// x [m, ...] -> [world * m, ...]: every rank's x, in rank order
    AllGather {
        world: usize,
    },

    // ---- 8-bit optimizer state: blockwise dynamic quantization (`crate::qmap`) ----
    /// (codes u8, absmax f32 [blocks]) -> f32 of the codes' shape: map[code] * absmax[element / BLOCK]
    BlockDequant {
        map: DynMap,
    },
    /// (x f32) -> f32 [blocks]: max |x| over each block of BLOCK elements (row-major; the last
    /// block may be partial)
    BlockAbsMax,
    /// (x f32, absmax f32 [blocks]) -> u8 of x's shape: the code of the map value nearest to
    /// x / absmax[element / BLOCK] (the lower on a tie; the code of 0 where absmax is 0)
    BlockQuant {
        map: DynMap,
    },
}

/// An attribute value, as printed in the text format.
#[derive(Clone, Debug, PartialEq)]
pub enum Attr {
    Float(f64),
    Int(usize),
    Bool(bool),
    Dims(Vec<usize>),
    DType(DType),
    Word(&'static str),
    Str(String),
}

impl Op {
    /// The op's name in the text format.
    pub fn mnemonic(&self) -> &'static str {
        self.kind().mnemonic()
    }

    /// The op without its attributes, whose properties `crate::kind`'s table gives.
    pub fn kind(&self) -> OpKind {
        match self {
            Op::Input { .. } => OpKind::Input,
            Op::Const { .. } => OpKind::Const,
            Op::Unary(u) => match u {
                UnaryOp::Neg => OpKind::Neg,
                UnaryOp::Exp => OpKind::Exp,
                UnaryOp::Log => OpKind::Log,
                UnaryOp::Sqrt => OpKind::Sqrt,
                UnaryOp::Rsqrt => OpKind::Rsqrt,
                UnaryOp::Recip => OpKind::Recip,
                UnaryOp::Tanh => OpKind::Tanh,
                UnaryOp::Square => OpKind::Square,
                UnaryOp::Gelu => OpKind::Gelu,
            },
            Op::Binary(b) => match b {
                BinaryOp::Add => OpKind::Add,
                BinaryOp::Sub => OpKind::Sub,
                BinaryOp::Mul => OpKind::Mul,
                BinaryOp::Div => OpKind::Div,
                BinaryOp::Max => OpKind::Max,
                BinaryOp::Min => OpKind::Min,
                BinaryOp::GeluGrad => OpKind::GeluGrad,
            },
            Op::Affine { .. } => OpKind::Affine,
            Op::Cast { .. } => OpKind::Cast,
            Op::Broadcast { .. } => OpKind::Broadcast,
            Op::SumTo { .. } => OpKind::SumTo,
            Op::Reshape { .. } => OpKind::Reshape,
            Op::Transpose { .. } => OpKind::Transpose,
            Op::Slice { .. } => OpKind::Slice,
            Op::Concat { .. } => OpKind::Concat,
            Op::MatMul { .. } => OpKind::MatMul,
            Op::Gather => OpKind::Gather,
            Op::ScatterAdd { .. } => OpKind::ScatterAdd,
            Op::LayerNorm { .. } => OpKind::LayerNorm,
            Op::LayerNormGradX { .. } => OpKind::LayerNormGradX,
            Op::LayerNormGradGamma { .. } => OpKind::LayerNormGradGamma,
            Op::Softmax { .. } => OpKind::Softmax,
            Op::SoftmaxGrad { .. } => OpKind::SoftmaxGrad,
            Op::PackedSoftmax { .. } => OpKind::PackedSoftmax,
            Op::CrossEntropy => OpKind::CrossEntropy,
            Op::CrossEntropyGrad => OpKind::CrossEntropyGrad,
            Op::WeightedCrossEntropy => OpKind::WeightedCrossEntropy,
            Op::WeightedCrossEntropyGrad => OpKind::WeightedCrossEntropyGrad,
            Op::FakeQuant { .. } => OpKind::FakeQuant,
            Op::Dequantize { .. } => OpKind::Dequantize,
            Op::FakeQuantLearned { .. } => OpKind::FakeQuantLearned,
            Op::FakeQuantLearnedGrad { .. } => OpKind::FakeQuantLearnedGrad,
            Op::ActQuant { .. } => OpKind::ActQuant,
            Op::Dropout { .. } => OpKind::Dropout,
            Op::AllFinite => OpKind::AllFinite,
            Op::Select => OpKind::Select,
            Op::LossScale { .. } => OpKind::LossScale,
            Op::Kernel { .. } => OpKind::Kernel,
            Op::AdamM { .. } => OpKind::AdamM,
            Op::AdamV { .. } => OpKind::AdamV,
            Op::AdamParam { .. } => OpKind::AdamParam,
            Op::BlockDequant { .. } => OpKind::BlockDequant,
            Op::BlockAbsMax => OpKind::BlockAbsMax,
            Op::BlockQuant { .. } => OpKind::BlockQuant,
            Op::AllReduce { .. } => OpKind::AllReduce,
            Op::ReduceScatter { .. } => OpKind::ReduceScatter,
            Op::AllGather { .. } => OpKind::AllGather,
        }
    }

    /// Operand count, or None for variadic ops (Concat takes one or more).
    pub fn arity(&self) -> Option<usize> {
        Some(match self {
            Op::Input { .. } | Op::Const { .. } => 0,
            Op::Unary(_) | Op::Affine { .. } | Op::Cast { .. } => 1,
            Op::Broadcast { .. } | Op::SumTo { .. } | Op::Reshape { .. } => 1,
            Op::Transpose { .. } | Op::Slice { .. } | Op::Softmax { .. } => 1,
            Op::FakeQuant { .. } | Op::ActQuant { .. } | Op::AllFinite => 1,
            Op::Dropout { .. } | Op::LossScale { .. } => 2,
            Op::Select => 3,
            Op::Binary(_) | Op::MatMul { .. } | Op::Gather | Op::ScatterAdd { .. } => 2,
            Op::LayerNormGradGamma { .. } | Op::SoftmaxGrad { .. } | Op::CrossEntropy => 2,
            Op::PackedSoftmax { .. } => 2,
            Op::AdamM { .. } | Op::AdamV { .. } => 2,
            Op::BlockAbsMax => 1,
            Op::AllReduce { .. } | Op::ReduceScatter { .. } | Op::AllGather { .. } => 1,
            Op::BlockDequant { .. } | Op::BlockQuant { .. } => 2,
            Op::LayerNorm { .. } | Op::LayerNormGradX { .. } | Op::CrossEntropyGrad => 3,
            Op::WeightedCrossEntropy => 3,
            Op::WeightedCrossEntropyGrad => 4,
            Op::AdamParam { .. } => 5,
            Op::Concat { .. } | Op::Dequantize { .. } | Op::Kernel { .. } => return None,
            Op::FakeQuantLearned { .. } | Op::FakeQuantLearnedGrad { .. } => return None,
        })
    }

    /// The optimizer's ops (AdamW and its 8-bit moments' quantization).
    pub fn is_optimizer(&self) -> bool {
        matches!(
            self,
            Op::AdamM { .. } | Op::AdamV { .. } | Op::AdamParam { .. } | Op::BlockDequant { .. } | Op::BlockAbsMax | Op::BlockQuant { .. }
        )
    }

    pub fn is_elementwise(&self) -> bool {
        matches!(
            self,
            Op::Unary(_) | Op::Binary(_) | Op::Affine { .. } | Op::Cast { .. } | Op::Select | Op::AdamM { .. } | Op::AdamV { .. }
        )
    }

    /// The attributes in print order. Leaves print their type after the colon, not here.
    pub fn attrs(&self) -> Vec<(&'static str, Attr)> {
        use Attr::*;
        match self {
            Op::Input { kind, .. } => vec![("kind", Word(kind.name()))],
            Op::Const { value, .. } => vec![("value", Float(*value))],
            Op::Unary(_) | Op::Binary(_) | Op::Gather | Op::CrossEntropy | Op::CrossEntropyGrad | Op::BlockAbsMax => vec![],
            Op::WeightedCrossEntropy | Op::WeightedCrossEntropyGrad => vec![],
            Op::BlockDequant { map } | Op::BlockQuant { map } => vec![("map", Word(map.name()))],
            Op::AllReduce { reduce, world } | Op::ReduceScatter { reduce, world } => {
                vec![("reduce", Word(reduce.name())), ("world", Int(*world))]
            }
            Op::AllGather { world } => vec![("world", Int(*world))],
            Op::AllFinite | Op::Select => vec![],
            Op::LossScale { interval, growth, backoff } => {
                vec![("interval", Int(*interval)), ("growth", Float(*growth)), ("backoff", Float(*backoff))]
            }
            Op::Affine { mul, add } => vec![("mul", Float(*mul)), ("add", Float(*add))],
            Op::Cast { to } => vec![("to", DType(*to))],
            Op::Broadcast { shape } | Op::SumTo { shape } | Op::Reshape { shape } => {
                vec![("shape", Dims(shape.0.clone()))]
            }
            Op::Transpose { perm } => vec![("perm", Dims(perm.clone()))],
            Op::Slice { axis, start, end } => vec![("axis", Int(*axis)), ("start", Int(*start)), ("end", Int(*end))],
            Op::Concat { axis } => vec![("axis", Int(*axis))],
            Op::MatMul { ta, tb } => vec![("ta", Bool(*ta)), ("tb", Bool(*tb))],
            Op::ScatterAdd { rows } => vec![("rows", Int(*rows))],
            Op::LayerNorm { eps } | Op::LayerNormGradX { eps } | Op::LayerNormGradGamma { eps } => {
                vec![("eps", Float(*eps))]
            }
            Op::Softmax { scale, causal } => vec![("scale", Float(*scale)), ("causal", Bool(*causal))],
            Op::SoftmaxGrad { scale } | Op::PackedSoftmax { scale } => vec![("scale", Float(*scale))],
            Op::FakeQuant { spec } => quant_attrs(spec),
            // `to` is printed only when it is not f32 (the type after the colon says it too)
            Op::Dequantize { spec, to } => {
                let mut v = quant_attrs(spec);
                if *to != crate::types::DType::F32 {
                    v.push(("to", DType(*to)));
                }
                v
            }
            Op::FakeQuantLearned { spec } => quant_attrs(spec),
            Op::FakeQuantLearnedGrad { spec, wrt } => {
                let mut v = quant_attrs(spec);
                v.push(("wrt", Word(wrt.name())));
                v
            }
            Op::ActQuant { bits } => vec![("bits", Int(*bits as usize))],
            Op::Dropout { p, stream } => vec![("p", Float(*p)), ("stream", Int(*stream))],
            Op::Kernel { family, .. } => vec![("family", Str(family.to_string()))],
            Op::AdamM { beta1 } => vec![("beta1", Float(*beta1))],
            Op::AdamV { beta2 } => vec![("beta2", Float(*beta2))],
            Op::AdamParam { beta1, beta2, eps, weight_decay } => {
                vec![("beta1", Float(*beta1)), ("beta2", Float(*beta2)), ("eps", Float(*eps)), ("weight_decay", Float(*weight_decay))]
            }
        }
    }
}

fn quant_attrs(spec: &QuantSpec) -> Vec<(&'static str, Attr)> {
    vec![("bits", Attr::Int(spec.bits as usize)), ("group", Attr::Int(spec.group)), ("scheme", Attr::Word(spec.scheme.name()))]
}

pub(crate) const UNARY_OPS: [UnaryOp; 9] = [
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

pub(crate) const BINARY_OPS: [BinaryOp; 7] =
    [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div, BinaryOp::Max, BinaryOp::Min, BinaryOp::GeluGrad];
