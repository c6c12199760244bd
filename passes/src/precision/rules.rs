//! The mixed-precision table: which type each op runs in, one arm per op, no catch-all (a new op
//! cannot be missed). C is the compute type (`--precision bf16` or `fp16`); "f32" is the master
//! type. Whatever the storage type, every op computes in f32 and rounds once when it stores
//! (round to nearest even): reductions (layer-norm statistics, softmax's and cross-entropy's max
//! and sum, the loss) and GEMM accumulation are f32 inside.
//!
//! An operand is never converted when it is an integer (ids, targets, codes), a rank-0 scalar (a
//! scale, dloss, the learning rate: kept in f32 so 2^16 survives in fp16), or a [`Select`]'s
//! condition (rounding could turn a tiny nonzero into zero).
//!
//! [`Select`]: qatc_ir::Op::Select

use qatc_ir::Op;

/// How the pass types one op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// Unchanged: leaves keep their storage (f32 master weights, frozen weights, data), and a
    /// cast already in the graph says what it wants.
    Keep,
    /// Float operands in C; the result in C, or what the op's type rule says (the loss is f32).
    Compute,
    /// The result in C, the operands as stored: packed codes dequantize straight to C.
    Produce,
    /// C when any float operand is in C (the others converted to it), else as they are:
    /// elementwise and layout ops take the type of what they combine.
    Follow,
    /// Float operands and result in f32: the optimizer on the master weights, fake-quant of a
    /// master weight (the GEMM that reads it takes its C copy), the loss-scaling state.
    Master,
    /// Not expected here: fused kernels appear only after the pass.
    Refuse,
}

pub fn rule(op: &Op) -> Rule {
    match op {
        // leaves: f32 masters, frozen weights and data stay as stored; C copies are made where read
        Op::Input { .. } | Op::Const { .. } => Rule::Keep,
        // an explicit conversion keeps its target
        Op::Cast { .. } => Rule::Keep,

        // elementwise: y = f(a, b) in the type of its operands (residual adds, biases, GELU, LoRA's
        // scaling, the backward's products)
        Op::Unary(_) | Op::Binary(_) | Op::Affine { .. } | Op::Select => Rule::Follow,
        // layout moves values without arithmetic; sum_to adds in f32 and rounds once
        Op::Broadcast { .. } | Op::SumTo { .. } | Op::Reshape { .. } | Op::Transpose { .. } => Rule::Follow,
        Op::Slice { .. } | Op::Concat { .. } => Rule::Follow,
        // collectives move (and add) values in the type they are given: a gradient reaches them
        // in f32 where it has entered the optimizer
        Op::AllReduce { .. } | Op::ReduceScatter { .. } | Op::AllGather { .. } => Rule::Follow,

        // GEMM: C operands (tensor cores on a GPU), f32 accumulation, C result
        Op::MatMul { .. } => Rule::Compute,
        // embedding rows are read in C; their gradient accumulates rows in f32, stored in C
        Op::Gather | Op::ScatterAdd { .. } => Rule::Compute,
        // layer norm: mean and variance in f32 over C inputs, C result (gamma, beta read in C)
        Op::LayerNorm { .. } | Op::LayerNormGradX { .. } | Op::LayerNormGradGamma { .. } => Rule::Compute,
        // softmax: running max and sum in f32, probabilities stored in C
        Op::Softmax { .. } | Op::SoftmaxGrad { .. } | Op::PackedSoftmax { .. } => Rule::Compute,
        // cross-entropy: C logits, max and log-sum-exp in f32, the loss f32; its gradient in C
        Op::CrossEntropy | Op::CrossEntropyGrad => Rule::Compute,
        // the same with a weight per row: the weights stay f32 (`convertible`)
        Op::WeightedCrossEntropy | Op::WeightedCrossEntropyGrad => Rule::Compute,
        // activation fake-quant: per-row absmax in f32, the rounded values stored in C
        Op::ActQuant { .. } => Rule::Compute,
        // dropout: a mask and a scale, in C
        Op::Dropout { .. } => Rule::Compute,

        // frozen 4-bit weights: codes and scales as stored, dequantized straight to C
        Op::Dequantize { .. } => Rule::Produce,
        // the quantization grid of a master weight is found in f32 (the GEMM reads its C copy)
        Op::FakeQuant { .. } => Rule::Master,
        // learned scales are f32 masters too: the grid and each part of its gradient (dy read in
        // f32) are found in f32, as the scales' AdamW update needs them
        Op::FakeQuantLearned { .. } | Op::FakeQuantLearnedGrad { .. } => Rule::Master,

        // AdamW runs in f32 on the master weights and moments
        Op::AdamM { .. } | Op::AdamV { .. } | Op::AdamParam { .. } => Rule::Master,
        // so do the 8-bit moments' dequantization, block absmax and requantization
        Op::BlockDequant { .. } | Op::BlockAbsMax | Op::BlockQuant { .. } => Rule::Master,
        // loss scaling's finiteness test and state are f32
        Op::AllFinite | Op::LossScale { .. } => Rule::Master,

        // fusion runs after this pass
        Op::Kernel { .. } => Rule::Refuse,
    }
}

/// Whether operand `slot` of `op` may be converted at all (see the module docs).
pub fn convertible(op: &Op, slot: usize) -> bool {
    // a selector is a flag; the loss weights are f32 data, as the host gives them
    !matches!((op, slot), (Op::Select, 0) | (Op::WeightedCrossEntropy | Op::WeightedCrossEntropyGrad, 2))
}
