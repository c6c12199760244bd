//! f32 and f64 modes agree on random inputs for every op. Inputs are drawn as f32 values so both
//! modes see identical data; the remaining difference is f32 arithmetic, bounded by 1e-4 relative
//! (elementwise ops compute in the stored type). The ops that sum (GEMMs, row statistics,
//! softmax, cross-entropy, the reductions of gradients) compute in f64 in both modes and round
//! once (`WideSum`): their f32 result is the f64 one rounded to f32, bit for bit.

mod common;

use common::ops::{all_ops, case, fin};
use common::{try_run_op, Rng};
use qatc_ir::Op;
use qatc_runtime::Value;

const REL: f64 = 1e-4;
const ABS: f64 = 1e-5;

/// The ops whose arithmetic is f64 whatever the stored type, each result rounded once.
fn rounds_once(op: &Op) -> bool {
    matches!(
        op,
        Op::MatMul { .. }
            | Op::SumTo { .. }
            | Op::ScatterAdd { .. }
            | Op::LayerNorm { .. }
            | Op::LayerNormGradX { .. }
            | Op::LayerNormGradGamma { .. }
            | Op::Softmax { .. }
            | Op::SoftmaxGrad { .. }
            | Op::CrossEntropy
            | Op::CrossEntropyGrad
            | Op::WeightedCrossEntropy
            | Op::WeightedCrossEntropyGrad
            | Op::PackedSoftmax { .. }
    )
}

#[test]
fn f32_and_f64_agree_on_every_op() {
    let mut rng = Rng::new(99);
    let mut seen = std::collections::BTreeSet::new();
    let mut rounded_once = 0;
    for op in all_ops() {
        seen.insert(op.mnemonic());
        let ins = case(&op, &mut rng);
        let a = try_run_op::<f64>(op.clone(), &ins).unwrap_or_else(|e| panic!("{op:?} in f64: {e}"));
        let b = try_run_op::<f32>(op.clone(), &ins).unwrap_or_else(|e| panic!("{op:?} in f32: {e}"));
        assert_eq!(a.shape(), b.shape(), "{op:?}");
        match (&a, &b) {
            (Value::Float(a), Value::Float(b)) => {
                for (i, (&x, &y)) in a.data.iter().zip(&b.data).enumerate() {
                    if rounds_once(&op) {
                        assert_eq!(y.to_bits(), (x as f32).to_bits(), "{op:?} element {i}: f32 {y} is not f64's {x} rounded once");
                        rounded_once += 1;
                    }
                    let y = f64::from(y);
                    let tol = REL * x.abs().max(y.abs()) + ABS;
                    assert!((x - y).abs() <= tol, "{op:?} element {i}: f64 {x} vs f32 {y}");
                }
            }
            (Value::Int(a), Value::Int(b)) => assert_eq!(a, b, "{op:?}"),
            _ => panic!("{op:?}: value kinds differ"),
        }
    }
    // Causal softmax needs square trailing dims.
    let ins = [fin(&mut rng, &[2, 6, 6], -3.0, 3.0)];
    let op = Op::Softmax { scale: 0.4, causal: true };
    let a = common::run_op::<f64>(op.clone(), &ins);
    let b = common::run_op::<f32>(op, &ins);
    assert!(a.iter().zip(&b).all(|(&x, &y)| (x as f32) as f64 == y), "causal softmax: f32 is not f64 rounded once");
    // Every op but the leaves (covered by the other tests) appears above; the thirteen that round
    // once gave elements to compare.
    assert_eq!(seen.len(), 53, "{seen:?}");
    assert!(rounded_once > 100, "{rounded_once} elements rounded once");
}
