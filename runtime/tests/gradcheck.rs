//! Backward ops against central finite differences of their forward ops, in f64.
//!
//! Tolerance: |analytic - numeric| <= 1e-6 * max(|analytic|, |numeric|) + 1e-9. The absolute
//! floor only matters for entries near zero, where the difference quotient's own rounding error
//! (about 1e-16 * |L| / h) dominates any relative measure.

mod common;

use std::collections::HashMap;

use common::{input_map, op_graph, run_f64, In, Rng};
use qatc_ir::{BinaryOp, Op, UnaryOp};
use qatc_runtime::{Interpreter, Value};

const REL_TOL: f64 = 1e-6;
const ABS_FLOOR: f64 = 1e-9;
const H: f64 = 1e-5;

/// d/d(input `wrt`) of sum(weights * op(inputs)) by central differences. `weights` is dy, or
/// [dloss] for a scalar-valued op.
fn numeric_grad(op: Op, ins: &[In], wrt: usize, weights: &[f64]) -> Vec<f64> {
    let (g, _) = op_graph(op, ins);
    let interp = Interpreter::<f64>::new(&g).unwrap();
    let base = input_map::<f64>(ins);
    let name = format!("a{wrt}");
    let x = base[&name].as_float().unwrap().clone();
    let loss = |inputs: &HashMap<String, Value<f64>>| -> f64 {
        let y = interp.run(inputs).unwrap().remove("y").unwrap().into_float().unwrap();
        assert_eq!(y.data.len(), weights.len());
        y.data.iter().zip(weights).map(|(a, b)| a * b).sum()
    };
    (0..x.data.len())
        .map(|i| {
            let mut inputs = base.clone();
            let mut xp = x.clone();
            xp.data[i] += H;
            inputs.insert(name.clone(), Value::Float(xp));
            let lp = loss(&inputs);
            let mut xm = x.clone();
            xm.data[i] -= H;
            inputs.insert(name.clone(), Value::Float(xm));
            let lm = loss(&inputs);
            (lp - lm) / (2.0 * H)
        })
        .collect()
}

fn assert_grad(what: &str, analytic: &[f64], numeric: &[f64]) {
    assert_eq!(analytic.len(), numeric.len());
    for (i, (&a, &n)) in analytic.iter().zip(numeric).enumerate() {
        let tol = REL_TOL * a.abs().max(n.abs()) + ABS_FLOOR;
        assert!((a - n).abs() <= tol, "{what}[{i}]: analytic {a}, numeric {n}, tol {tol}");
    }
}

#[test]
fn gelu_grad_matches_finite_differences() {
    let mut rng = Rng::new(21);
    let x = rng.vec(24, -4.0, 4.0);
    let dy = rng.vec(24, -1.0, 1.0);
    let numeric = numeric_grad(Op::Unary(UnaryOp::Gelu), &[In::f(&[4, 6], &x)], 0, &dy);
    let analytic = run_f64(Op::Binary(BinaryOp::GeluGrad), &[In::f(&[4, 6], &x), In::f(&[4, 6], &dy)]);
    assert_grad("gelu_grad", &analytic, &numeric);
}

#[test]
fn softmax_grad_matches_finite_differences() {
    let mut rng = Rng::new(22);
    for (causal, scale) in [(false, 1.0), (false, 0.35), (true, 0.125), (true, 1.0)] {
        let shape = [2, 5, 5];
        let x = rng.vec(50, -3.0, 3.0);
        let dy = rng.vec(50, -1.0, 1.0);
        let op = Op::Softmax { scale, causal };
        let y = run_f64(op.clone(), &[In::f(&shape, &x)]);
        let numeric = numeric_grad(op, &[In::f(&shape, &x)], 0, &dy);
        let analytic = run_f64(Op::SoftmaxGrad { scale }, &[In::f(&shape, &y), In::f(&shape, &dy)]);
        assert_grad(&format!("softmax_grad causal={causal} scale={scale}"), &analytic, &numeric);
    }
}

#[test]
fn layernorm_grads_match_finite_differences() {
    let mut rng = Rng::new(23);
    let (shape, c, eps) = ([2, 3, 7], 7, 1e-5);
    let x = rng.vec(42, -2.0, 2.0);
    let gamma = rng.vec(c, 0.5, 1.5);
    let beta = rng.vec(c, -0.5, 0.5);
    let dy = rng.vec(42, -1.0, 1.0);
    let ins = [In::f(&shape, &x), In::f(&[c], &gamma), In::f(&[c], &beta)];
    let op = Op::LayerNorm { eps };

    let numeric = numeric_grad(op.clone(), &ins, 0, &dy);
    let analytic = run_f64(Op::LayerNormGradX { eps }, &[In::f(&shape, &x), In::f(&[c], &gamma), In::f(&shape, &dy)]);
    assert_grad("layernorm_grad_x", &analytic, &numeric);

    let numeric = numeric_grad(op, &ins, 1, &dy);
    let analytic = run_f64(Op::LayerNormGradGamma { eps }, &[In::f(&shape, &x), In::f(&shape, &dy)]);
    assert_grad("layernorm_grad_gamma", &analytic, &numeric);
}

#[test]
fn cross_entropy_grad_matches_finite_differences() {
    let mut rng = Rng::new(24);
    let (n, v, dloss) = (6, 11, 0.7);
    let logits = rng.vec(n * v, -3.0, 3.0);
    let targets = rng.ints(n, v as i32);
    let ins = [In::f(&[n, v], &logits), In::i(&[n], &targets)];
    let numeric = numeric_grad(Op::CrossEntropy, &ins, 0, &[dloss]);
    let analytic = run_f64(Op::CrossEntropyGrad, &[ins[0].clone(), ins[1].clone(), In::f(&[], &[dloss])]);
    assert_grad("cross_entropy_grad", &analytic, &numeric);
}

#[test]
fn matmul_and_broadcast_adjoints_match_finite_differences() {
    // Not backward ops of their own, but autodiff builds these identities from them:
    // d/dA sum(dY * A B) = dY B^T, and d/dx sum(dy * broadcast(x)) = sum_to(dy).
    let mut rng = Rng::new(25);
    let (m, k, n) = (3, 4, 5);
    let (a, b, dy) = (rng.vec(m * k, -1.0, 1.0), rng.vec(k * n, -1.0, 1.0), rng.vec(m * n, -1.0, 1.0));
    let numeric = numeric_grad(Op::MatMul { ta: false, tb: false }, &[In::f(&[m, k], &a), In::f(&[k, n], &b)], 0, &dy);
    let analytic = run_f64(Op::MatMul { ta: false, tb: true }, &[In::f(&[m, n], &dy), In::f(&[k, n], &b)]);
    assert_grad("matmul dA", &analytic, &numeric);

    let x = rng.vec(3, -1.0, 1.0);
    let dy = rng.vec(12, -1.0, 1.0);
    let shape = qatc_ir::Shape::new([4, 3]);
    let numeric = numeric_grad(Op::Broadcast { shape }, &[In::f(&[3], &x)], 0, &dy);
    let analytic = run_f64(Op::SumTo { shape: qatc_ir::Shape::new([3]) }, &[In::f(&[4, 3], &dy)]);
    assert_grad("sum_to", &analytic, &numeric);
}
