//! The gradient rule table: one rule per op. A rule receives the forward node (its operands `x`,
//! its output `y`) and the gradient `dy` of the loss with respect to `y`, and returns the
//! gradient contribution for each operand that `wants` one. It never builds a gradient nobody
//! wants: that is how a frozen weight gets no weight-gradient matmul.

use qatc_ir::{BinaryOp as B, Graph, IrError, NodeId, Op, QuantParam, Shape, UnaryOp as U};

use crate::error::PassError;
use crate::pipeline::Stage;

pub(crate) struct Ctx<'a> {
    pub g: &'a mut Graph,
    /// The forward node's operands.
    pub x: Vec<NodeId>,
    /// The forward node itself (its value, for rules such as exp's that reuse it).
    pub y: NodeId,
    /// The incoming gradient, same type as `y`.
    pub dy: NodeId,
    /// Which operands need a gradient.
    pub wants: Vec<bool>,
}

type Grads = Vec<Option<NodeId>>;

impl Ctx<'_> {
    fn op(&mut self, op: Op, args: &[NodeId]) -> Result<NodeId, IrError> {
        self.g.add(op, args)
    }
    fn un(&mut self, u: U, a: NodeId) -> Result<NodeId, IrError> {
        self.op(Op::Unary(u), &[a])
    }
    fn bin(&mut self, b: B, a: NodeId, c: NodeId) -> Result<NodeId, IrError> {
        self.op(Op::Binary(b), &[a, c])
    }
    fn affine(&mut self, a: NodeId, mul: f64, add: f64) -> Result<NodeId, IrError> {
        self.op(Op::Affine { mul, add }, &[a])
    }
    /// Builds operand i's gradient only when it is wanted.
    fn each(&mut self, mut f: impl FnMut(&mut Self, usize) -> Result<NodeId, IrError>) -> Result<Grads, PassError> {
        (0..self.x.len())
            .map(|i| if self.wants[i] { f(self, i).map(Some) } else { Ok(None) })
            .collect::<Result<Grads, IrError>>()
            .map_err(|source| PassError::Ir { pass: Stage::Autodiff, error: source })
    }
}

/// Dispatches to the rule for `op`. Ops with no rule are listed explicitly (no wildcard), so a new
/// op cannot silently get no gradient.
pub(crate) fn vjp(op: &Op, c: &mut Ctx, describe: &dyn Fn() -> String) -> Result<Grads, PassError> {
    let no_rule = || PassError::NoRule { op: op.mnemonic(), node: describe() };
    let (x, y, dy) = (c.x.clone(), c.y, c.dy);
    match op {
        // leaves: nothing to propagate to
        Op::Input { .. } | Op::Const { .. } => Ok(vec![]),

        // d(-x) = -dy
        Op::Unary(U::Neg) => c.each(|c, _| c.un(U::Neg, dy)),
        // d exp(x) = dy * y
        Op::Unary(U::Exp) => c.each(|c, _| c.bin(B::Mul, dy, y)),
        // d log(x) = dy / x
        Op::Unary(U::Log) => c.each(|c, _| c.bin(B::Div, dy, x[0])),
        // d sqrt(x) = dy / (2 y)
        Op::Unary(U::Sqrt) => c.each(|c, _| {
            let two_y = c.affine(y, 2.0, 0.0)?;
            c.bin(B::Div, dy, two_y)
        }),
        // d x^-1/2 = dy * (-1/2) y^3
        Op::Unary(U::Rsqrt) => c.each(|c, _| {
            let y2 = c.un(U::Square, y)?;
            let y3 = c.bin(B::Mul, y2, y)?;
            let k = c.affine(y3, -0.5, 0.0)?;
            c.bin(B::Mul, dy, k)
        }),
        // d 1/x = -dy * y^2
        Op::Unary(U::Recip) => c.each(|c, _| {
            let y2 = c.un(U::Square, y)?;
            let t = c.bin(B::Mul, dy, y2)?;
            c.un(U::Neg, t)
        }),
        // d tanh(x) = dy * (1 - y^2)
        Op::Unary(U::Tanh) => c.each(|c, _| {
            let y2 = c.un(U::Square, y)?;
            let k = c.affine(y2, -1.0, 1.0)?;
            c.bin(B::Mul, dy, k)
        }),
        // d x^2 = dy * 2x
        Op::Unary(U::Square) => c.each(|c, _| {
            let k = c.affine(x[0], 2.0, 0.0)?;
            c.bin(B::Mul, dy, k)
        }),
        // d gelu(x) = gelu_grad(x, dy)
        Op::Unary(U::Gelu) => c.each(|c, _| c.bin(B::GeluGrad, x[0], dy)),

        // d(a + b) = (dy, dy)
        Op::Binary(B::Add) => c.each(|_, _| Ok(dy)),
        // d(a - b) = (dy, -dy)
        Op::Binary(B::Sub) => c.each(|c, i| if i == 0 { Ok(dy) } else { c.un(U::Neg, dy) }),
        // d(a * b) = (dy * b, dy * a)
        Op::Binary(B::Mul) => c.each(|c, i| c.bin(B::Mul, dy, x[1 - i])),
        // d(a / b) = (dy / b, -dy * y / b)
        Op::Binary(B::Div) => c.each(|c, i| {
            let q = c.bin(B::Div, dy, x[1])?;
            if i == 0 {
                Ok(q)
            } else {
                let t = c.bin(B::Mul, q, y)?;
                c.un(U::Neg, t)
            }
        }),
        // max/min are used only outside the differentiated region (clipping's coefficient)
        Op::Binary(B::Max | B::Min | B::GeluGrad) => Err(no_rule()),

        // d(mul x + add) = mul dy
        Op::Affine { mul, .. } => c.each(|c, _| c.affine(dy, *mul, 0.0)),
        // d cast(x) = cast back to x's type
        Op::Cast { .. } => c.each(|c, _| {
            let to = c.g.ty(x[0]).dtype;
            c.op(Op::Cast { to }, &[dy])
        }),

        // d broadcast(x) = sum_to(dy, x.shape)
        Op::Broadcast { .. } => c.each(|c, _| {
            let shape = c.g.ty(x[0]).shape.clone();
            c.op(Op::SumTo { shape }, &[dy])
        }),
        // d sum_to(x) = broadcast(dy, x.shape)
        Op::SumTo { .. } => c.each(|c, _| {
            let shape = c.g.ty(x[0]).shape.clone();
            c.op(Op::Broadcast { shape }, &[dy])
        }),
        // d reshape(x) = reshape(dy, x.shape)
        Op::Reshape { .. } => c.each(|c, _| {
            let shape = c.g.ty(x[0]).shape.clone();
            c.op(Op::Reshape { shape }, &[dy])
        }),
        // d transpose(x, perm) = transpose(dy, perm^-1)
        Op::Transpose { perm } => c.each(|c, _| {
            let mut inv = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            c.op(Op::Transpose { perm: inv }, &[dy])
        }),
        // d slice(x) = dy padded with zeros back to x's extent along the axis
        Op::Slice { axis, start, end } => c.each(|c, _| {
            let xt = c.g.ty(x[0]).clone();
            let mut parts = Vec::new();
            for (from, to) in [(0, *start), (*start, *end), (*end, xt.shape.dims()[*axis])] {
                if from == *start && to == *end {
                    parts.push(dy);
                } else if to > from {
                    let mut dims = xt.shape.dims().to_vec();
                    dims[*axis] = to - from;
                    parts.push(c.g.constant(0.0, xt.dtype, dims)?);
                }
            }
            if parts.len() == 1 {
                Ok(dy)
            } else {
                c.op(Op::Concat { axis: *axis }, &parts)
            }
        }),
        // d concat(a, b, ..) = the matching slices of dy
        Op::Concat { axis } => c.each(|c, i| {
            let start: usize = x[..i].iter().map(|&o| c.g.ty(o).shape.dims()[*axis]).sum();
            let end = start + c.g.ty(x[i]).shape.dims()[*axis];
            c.op(Op::Slice { axis: *axis, start, end }, &[dy])
        }),

        // C = op_a(A) op_b(B):  dA = dC op_b(B)^T (transposed back if ta),  dB = op_a(A)^T dC (same)
        Op::MatMul { ta, tb } => c.each(|c, i| match (i, *ta, *tb) {
            (0, false, tb) => c.op(Op::MatMul { ta: false, tb: !tb }, &[dy, x[1]]),
            (0, true, tb) => c.op(Op::MatMul { ta: tb, tb: true }, &[x[1], dy]),
            (_, ta, false) => c.op(Op::MatMul { ta: !ta, tb: false }, &[x[0], dy]),
            (_, ta, true) => c.op(Op::MatMul { ta: true, tb: ta }, &[dy, x[0]]),
        }),

        // d gather(table, ids) = scatter_add(ids, dy) into the table's rows; ids get none
        Op::Gather => c.each(|c, i| {
            if i == 1 {
                return Err(IrError::Type { node: "gather ids".into(), msg: "integer ids have no gradient".into() });
            }
            let rows = c.g.ty(x[0]).shape.dims()[0];
            c.op(Op::ScatterAdd { rows }, &[x[1], dy])
        }),
        // layernorm(x, gamma, beta): dx by its backward op, dgamma = sum(dy * xhat), dbeta = sum(dy)
        Op::LayerNorm { eps } => c.each(|c, i| match i {
            0 => c.op(Op::LayerNormGradX { eps: *eps }, &[x[0], x[1], dy]),
            1 => c.op(Op::LayerNormGradGamma { eps: *eps }, &[x[0], dy]),
            _ => {
                let shape = c.g.ty(x[2]).shape.clone();
                c.op(Op::SumTo { shape }, &[dy])
            }
        }),
        // d softmax(scale x) = softmax_grad(y, dy); masked entries have y = 0 and get 0
        Op::Softmax { scale, .. } => c.each(|c, _| c.op(Op::SoftmaxGrad { scale: *scale }, &[y, dy])),
        // the same for packed sequences' softmax (its masked entries are 0 too); positions get none
        Op::PackedSoftmax { scale } => c.each(|c, i| {
            if i == 1 {
                return Err(IrError::Type { node: "packed_softmax positions".into(), msg: "integer positions have no gradient".into() });
            }
            c.op(Op::SoftmaxGrad { scale: *scale }, &[y, dy])
        }),
        // d mean cross-entropy = dloss / N * (softmax(logits) - onehot(targets)); targets get none
        Op::CrossEntropy => c.each(|c, i| {
            if i == 1 {
                return Err(IrError::Type { node: "cross_entropy targets".into(), msg: "targets have no gradient".into() });
            }
            c.op(Op::CrossEntropyGrad, &[x[0], x[1], dy])
        }),
        // d sum_i w_i nll_i = dloss * w_i * (softmax(logits) - onehot(targets)); targets and the
        // weights (data, given by the host) get none
        Op::WeightedCrossEntropy => c.each(|c, i| {
            if i > 0 {
                return Err(IrError::Type {
                    node: "weighted_cross_entropy targets and weights".into(),
                    msg: "targets and weights have no gradient".into(),
                });
            }
            c.op(Op::WeightedCrossEntropyGrad, &[x[0], x[1], x[2], dy])
        }),

        // straight-through estimator: rounding passes the gradient through unchanged
        Op::FakeQuant { .. } => c.each(|_, _| Ok(dy)),
        // LSQ: the weight's part elementwise; the scale's and zero point's parts summed over each
        // group of G rows ([in, out] -> [in/G, G, out] -> [in/G, 1, out]) and scaled by 1/sqrt(G Q_P)
        Op::FakeQuantLearned { spec } => c.each(|c, i| {
            let wrt = [QuantParam::Weight, QuantParam::Scale, QuantParam::Zero][i];
            let mut args = x.clone();
            args.push(dy);
            let part = c.op(Op::FakeQuantLearnedGrad { spec: *spec, wrt }, &args)?;
            if wrt == QuantParam::Weight {
                return Ok(part);
            }
            let dims = c.g.ty(x[0]).shape.dims().to_vec();
            let (n_in, n_out, gsz) = (dims[0], dims[1], spec.group_for(dims[0]));
            let grouped = c.op(Op::Reshape { shape: Shape::new([n_in / gsz, gsz, n_out]) }, &[part])?;
            let sums = c.op(Op::SumTo { shape: Shape::new([n_in / gsz, 1, n_out]) }, &[grouped])?;
            let sums = c.op(Op::Reshape { shape: Shape::new([n_in / gsz, n_out]) }, &[sums])?;
            c.affine(sums, spec.lsq_grad_scale(n_in), 0.0)
        }),
        // per-token absmax scaling never clips, so the whole range is "inside": straight through
        Op::ActQuant { .. } => c.each(|_, _| Ok(dy)),
        // the same deterministic mask on the way back: d dropout(x) = dropout(dy) (seed gets none)
        Op::Dropout { p, stream } => c.each(|c, i| {
            if i == 1 {
                return Err(IrError::Type { node: "dropout seed".into(), msg: "an integer seed has no gradient".into() });
            }
            c.op(Op::Dropout { p: *p, stream: *stream }, &[dy, x[1]])
        }),

        // packed codes are frozen storage; backward and optimizer ops are never differentiated
        Op::Dequantize { .. } => Err(no_rule()),
        // fusion runs after autodiff: kernels are never differentiated
        Op::Kernel { .. } => Err(no_rule()),
        // the precision pass runs after autodiff: loss-scaling ops are never differentiated
        Op::AllFinite | Op::Select | Op::LossScale { .. } => Err(no_rule()),
        // data parallelism and ZeRO insert collectives after autodiff (on gradients and shards)
        Op::AllReduce { .. } | Op::ReduceScatter { .. } | Op::AllGather { .. } => Err(no_rule()),
        Op::ScatterAdd { .. }
        | Op::FakeQuantLearnedGrad { .. }
        | Op::LayerNormGradX { .. }
        | Op::LayerNormGradGamma { .. }
        | Op::SoftmaxGrad { .. }
        | Op::CrossEntropyGrad
        | Op::WeightedCrossEntropyGrad
        | Op::AdamM { .. }
        | Op::AdamV { .. }
        | Op::AdamParam { .. }
        | Op::BlockDequant { .. }
        | Op::BlockAbsMax
        | Op::BlockQuant { .. } => Err(no_rule()),
    }
}
