//! Finite-difference checks of every gradient rule in `autodiff/rules.rs`.
//!
//! Each case builds `x (trainable inputs) -> op -> y`, then `loss = sum_to(y * w, [])` with `w`
//! a fixed random Data input of y's shape, so the loss depends on every output element with a
//! different weight (a plain sum would hide rules that are wrong by a per-element permutation or
//! that only get the row sums right, as softmax's would). `autodiff` adds the `grad:NAME`
//! outputs; the interpreter evaluates them in f64 and each element is compared with a central
//! difference of the forward loss, also in f64:
//!
//!   |analytic - numeric| <= 1e-6 * max(1, |numeric|),   numeric = (L(x + h) - L(x - h)) / 2h, h = 1e-6.
//!
//! Why this tolerance holds: the truncation error of the central difference is ~h^2 |L'''| ~ 1e-12
//! and the rounding error ~eps_f64 |L| / h ~ 1e-10 |L|, with |L| = O(10) here, so a correct rule
//! passes with three orders of magnitude to spare while a wrong one is off by O(1).
//!
//! Graph dtypes are f32: the f64 interpreter does not round f32-typed values (it is the oracle),
//! so f32 graphs are differentiated in full f64 precision. Casts to f16/bf16 are not checked:
//! those values are rounded to 8-11 significant bits, so a difference with h = 1e-6 measures the
//! rounding steps, not the derivative. The cast rule is checked on f32 -> f32, where it is exact.
//! Inputs are drawn away from the kinks and poles of the ops (log, sqrt, rsqrt, recip, div near 0).
//!
//! Dropout is linear in x for a fixed seed, so it is finite-difference checked like the rest.
//! FakeQuant and ActQuant round (derivative 0 almost everywhere) and their rule is the
//! straight-through estimator by definition, so they are checked against the same graph without
//! the op instead (see `check_straight_through`). Ops with no rule must fail with
//! `PassError::NoRule` when a trainable input reaches them. `covering_test` is an exhaustive
//! match over the op set, so an op added to the IR fails to compile here until it is placed.
//!
//! Here: `covering_test` and the harness's own tests; `gradcheck/harness.rs`: the harness
//! (`Case`); the rules, by kind of op: `gradcheck/elementwise.rs`, `gradcheck/shape_ops.rs`,
//! `gradcheck/nn.rs` (matmul, the NN ops, a transformer block), `gradcheck/quant.rs`
//! (quantization and dropout), `gradcheck/no_rule.rs` (ops without a rule).

#[path = "gradcheck/elementwise.rs"]
mod elementwise;
#[path = "gradcheck/harness.rs"]
mod harness;
#[path = "gradcheck/nn.rs"]
mod nn;
#[path = "gradcheck/no_rule.rs"]
mod no_rule;
#[path = "gradcheck/quant.rs"]
mod quant;
#[path = "gradcheck/shape_ops.rs"]
mod shape_ops;

use qatc_ir::{BinaryOp, Op, UnaryOp};

use harness::{Case, ANY};

/// Where each op's rule is checked. Exhaustive on purpose (no wildcard).
fn covering_test(op: &Op) -> &'static str {
    match op {
        Op::Input { .. } | Op::Const { .. } => "every test (leaves)",
        Op::Unary(_) => "unary_ops",
        Op::Binary(BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::Div) => "binary_ops",
        Op::Binary(BinaryOp::Max | BinaryOp::Min | BinaryOp::GeluGrad) => "ops_without_a_rule_report_no_rule",
        Op::Affine { .. } => "affine",
        Op::Cast { .. } => "cast_f32_to_f32",
        Op::Broadcast { .. } => "broadcast",
        Op::SumTo { .. } => "sum_to",
        Op::Reshape { .. } => "reshape",
        Op::Transpose { .. } => "transpose",
        Op::Slice { .. } => "slice_with_padding_at_start_middle_and_end",
        Op::Concat { .. } => "concat",
        Op::MatMul { .. } => "matmul_all_transpose_combinations_with_batch_dims",
        Op::Gather => "gather_with_repeated_ids",
        Op::LayerNorm { .. } => "layernorm_each_operand",
        Op::Softmax { .. } => "softmax_plain_causal_and_scaled",
        Op::CrossEntropy => "cross_entropy_wrt_logits",
        Op::WeightedCrossEntropy => "weighted_cross_entropy_wrt_logits",
        Op::PackedSoftmax { .. } => "packed_softmax_within_each_example",
        Op::Dropout { .. } => "dropout_applies_the_same_mask_backward",
        Op::FakeQuant { .. } => "fake_quant_is_straight_through",
        Op::ActQuant { .. } => "act_quant_is_straight_through",
        Op::FakeQuantLearned { .. } => "gradcheck_lsq.rs (LSQ against its straight-through surrogate)",
        Op::Dequantize { .. }
        | Op::Kernel { .. }
        | Op::ScatterAdd { .. }
        | Op::FakeQuantLearnedGrad { .. }
        | Op::LayerNormGradX { .. }
        | Op::LayerNormGradGamma { .. }
        | Op::SoftmaxGrad { .. }
        | Op::CrossEntropyGrad
        | Op::WeightedCrossEntropyGrad
        | Op::AdamM { .. }
        | Op::AdamV { .. }
        | Op::AdamParam { .. }
        | Op::AllFinite
        | Op::Select
        | Op::LossScale { .. }
        | Op::BlockDequant { .. }
        | Op::BlockAbsMax
        // data parallelism and ZeRO insert collectives after autodiff
        | Op::AllReduce { .. }
        | Op::ReduceScatter { .. }
        | Op::AllGather { .. } => "ops_without_a_rule_report_no_rule",
        Op::BlockQuant { .. } => "none: its u8 result is never on a path to a float loss",
    }
}

#[test]
fn every_op_has_a_covering_test() {
    // The real check is that `covering_test` compiles; this keeps it from being dead code.
    assert_eq!(covering_test(&Op::Gather), "gather_with_repeated_ids");
}

// ---------------------------------------------------------------------------------------------
// The harness itself.

#[test]
#[should_panic(expected = "d loss / d x[4]")]
fn harness_catches_an_error_of_ten_times_the_tolerance() {
    // An analytic gradient off by 1e-5 in one element must fail the check: the comparison is
    // per element and the tolerance is as tight as the module comment says.
    let mut c = Case::new("tampered", 1);
    let x = c.param("x", &[2, 3], ANY);
    let y = c.un(UnaryOp::Tanh, x);
    c.tamper = Some(("x".into(), 4, 1e-5));
    c.check(y);
}

#[test]
fn harness_passes_an_error_of_a_tenth_of_the_tolerance() {
    let mut c = Case::new("tampered slightly", 1);
    let x = c.param("x", &[2, 3], ANY);
    let y = c.un(UnaryOp::Tanh, x);
    c.tamper = Some(("x".into(), 4, 1e-7));
    c.check(y);
}
