//! What one node costs: the bytes of its value and the floating-point operations to compute it.
//! FLOPs drive the recompute decisions (`remat`), so what matters is that the big terms are
//! right (matmuls: 2 M N K) and that the small ones are not zero when the op does arithmetic;
//! per-element constants for transcendental ops are estimates, documented in `docs/memory_plan.md`.

use qatc_ir::{BinaryOp, Graph, NodeId, Op, TensorType, UnaryOp};

/// Floating-point operations of `op` producing `ty` from operands of types `ins`. Layout ops
/// (reshape, transpose, slice, concat, broadcast, gather, cast) move memory and count 0.
pub fn op_flops(op: &Op, ty: &TensorType, ins: &[&TensorType]) -> u64 {
    let n = ty.numel() as u64;
    let n_in = |i: usize| ins.get(i).map(|t| t.numel() as u64).unwrap_or(0);
    match op {
        Op::Input { .. } | Op::Const { .. } => 0,
        Op::Reshape { .. } | Op::Transpose { .. } | Op::Slice { .. } | Op::Concat { .. } => 0,
        Op::Broadcast { .. } | Op::Gather | Op::Cast { .. } => 0,
        Op::Unary(u) => {
            n * match u {
                UnaryOp::Neg | UnaryOp::Square => 1,
                UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Recip => 2,
                UnaryOp::Exp | UnaryOp::Log | UnaryOp::Tanh => 4,
                // 0.5 x (1 + tanh(k (x + 0.044715 x^3))): 4 mul/add + tanh
                UnaryOp::Gelu => 8,
            }
        }
        Op::Binary(b) => n * if *b == BinaryOp::GeluGrad { 12 } else { 1 },
        Op::Affine { .. } => 2 * n,
        // summing the broadcast dimensions away: one add per input element
        Op::SumTo { .. } => n_in(0),
        Op::ScatterAdd { .. } => n_in(1),
        Op::MatMul { ta, .. } => {
            // out [.., M, N]; K is the contracted dim of the left operand
            let Some(a) = ins.first() else { return 0 };
            let d = a.shape.dims();
            let k = match (d.len(), ta) {
                (0 | 1, _) => 1,
                (r, false) => d[r - 1],
                (r, true) => d[r - 2],
            };
            2 * n * k as u64
        }
        Op::LayerNorm { .. } => 8 * n,
        Op::LayerNormGradX { .. } => 10 * n,
        Op::LayerNormGradGamma { .. } => 6 * n_in(0),
        Op::Softmax { .. } | Op::PackedSoftmax { .. } => 5 * n,
        Op::SoftmaxGrad { .. } => 4 * n,
        Op::CrossEntropy => 4 * n_in(0),
        Op::CrossEntropyGrad => 4 * n,
        Op::WeightedCrossEntropy => 4 * n_in(0),
        Op::WeightedCrossEntropyGrad => 4 * n,
        Op::FakeQuant { .. } | Op::ActQuant { .. } => 4 * n,
        Op::Dequantize { .. } => 2 * n,
        // divide, round, clamp (two compares), multiply; the gradient parts a few more
        Op::FakeQuantLearned { .. } => 5 * n,
        Op::FakeQuantLearnedGrad { .. } => 7 * n,
        Op::Dropout { .. } => 2 * n,
        // a finiteness test per element; a choice per element; a handful of scalar operations
        Op::AllFinite => n_in(0),
        Op::Select => n,
        Op::LossScale { .. } => 4,
        // a fused kernel does what its body does: intermediates stay on chip, FLOPs do not vanish
        Op::Kernel { body, .. } => graph_flops(body),
        Op::AdamM { .. } => 3 * n,
        Op::AdamV { .. } => 4 * n,
        Op::AdamParam { .. } => 10 * n,
        // 8-bit moments: a table lookup and a multiply; a max per element; a division and an
        // 8-step binary search
        Op::BlockDequant { .. } => n,
        Op::BlockAbsMax => n_in(0),
        // a reduction adds every rank's element once (counted per rank: its operand's size);
        // a gather only moves
        Op::AllReduce { .. } | Op::ReduceScatter { .. } => n_in(0),
        Op::AllGather { .. } => 0,
        Op::BlockQuant { .. } => 10 * n,
    }
}

/// FLOPs of one node of `g`.
pub fn node_flops(g: &Graph, id: NodeId) -> u64 {
    let ops = g.operands(id);
    let ins: Vec<&TensorType> = ops.iter().map(|&o| g.ty(o)).collect();
    let node = g.node(id);
    op_flops(&node.op, &node.ty, &ins)
}

/// FLOPs of every node of `g` (a kernel body's, or a whole step's).
pub fn graph_flops(g: &Graph) -> u64 {
    g.node_ids().into_iter().map(|id| node_flops(g, id)).sum()
}

/// Bytes of a node's value at its dtype (packed 4-bit: half a byte per element, rounded up).
pub fn value_bytes(ty: &TensorType) -> usize {
    ty.bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use qatc_ir::{DType, InputKind};

    #[test]
    fn matmul_is_2mnk_and_kernels_cost_their_body() {
        let mut g = Graph::new("t");
        let a = g.input("a", InputKind::Data, DType::F32, [3, 5]).unwrap();
        let b = g.input("b", InputKind::Data, DType::F32, [5, 7]).unwrap();
        let m = g.add(Op::MatMul { ta: false, tb: false }, &[a, b]).unwrap();
        assert_eq!(node_flops(&g, m), 2 * 3 * 7 * 5);
        let at = g.input("at", InputKind::Data, DType::F32, [5, 3]).unwrap();
        let m2 = g.add(Op::MatMul { ta: true, tb: false }, &[at, b]).unwrap();
        assert_eq!(node_flops(&g, m2), 2 * 3 * 7 * 5);

        let mut body = Graph::new("k");
        let x = body.input("in0", InputKind::Data, DType::F32, [4]).unwrap();
        let y = body.add(Op::Unary(UnaryOp::Gelu), &[x]).unwrap();
        let z = body.add(Op::Binary(BinaryOp::Add), &[y, x]).unwrap();
        body.set_output("out", z).unwrap();
        let mut h = Graph::new("h");
        let x = h.input("x", InputKind::Data, DType::F32, [4]).unwrap();
        let k = h.add(Op::Kernel { family: qatc_ir::KernelFamily::Pointwise, body: Box::new(body) }, &[x]).unwrap();
        assert_eq!(node_flops(&h, k), 4 * 8 + 4);
    }
}
