//! Hand-checked cases for the elementwise ops: unary, binary, affine, cast, adam_m/adam_v.

mod common;

use common::{assert_close, run_f64, run_op, try_run_op, In};
use qatc_ir::{BinaryOp, DType, Op, UnaryOp};
use qatc_runtime::Value;

const XS: [f64; 6] = [-3.0, -1.0, 0.25, 0.5, 1.0, 2.0];

fn unary(u: UnaryOp, xs: &[f64]) -> Vec<f64> {
    run_f64(Op::Unary(u), &[In::f(&[2, xs.len() / 2], xs)])
}

#[test]
fn unary_ops_match_their_definitions() {
    let pos = [0.25, 0.5, 1.0, 2.0, 4.0, 9.0];
    let map = |f: fn(f64) -> f64, xs: &[f64]| xs.iter().map(|&x| f(x)).collect::<Vec<_>>();
    assert_eq!(unary(UnaryOp::Neg, &XS), vec![3.0, 1.0, -0.25, -0.5, -1.0, -2.0]);
    assert_close(&unary(UnaryOp::Exp, &XS), &map(f64::exp, &XS), 1e-15, 0.0);
    assert_close(&unary(UnaryOp::Log, &pos), &map(f64::ln, &pos), 1e-15, 0.0);
    assert_eq!(unary(UnaryOp::Sqrt, &pos), vec![0.5, 0.5_f64.sqrt(), 1.0, 2.0_f64.sqrt(), 2.0, 3.0]);
    assert_close(&unary(UnaryOp::Rsqrt, &pos), &[2.0, 2.0_f64.sqrt(), 1.0, 0.5_f64.sqrt(), 0.5, 1.0 / 3.0], 1e-15, 0.0);
    assert_eq!(unary(UnaryOp::Recip, &pos), vec![4.0, 2.0, 1.0, 0.5, 0.25, 1.0 / 9.0]);
    assert_close(&unary(UnaryOp::Tanh, &XS), &map(f64::tanh, &XS), 1e-15, 0.0);
    assert_eq!(unary(UnaryOp::Square, &XS), vec![9.0, 1.0, 0.0625, 0.25, 1.0, 4.0]);
}

#[test]
fn gelu_matches_gpt2_gelu_new() {
    // Reference values of 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) computed in Python.
    let want = [-0.0036373920817729943, -0.15880800939172324, 0.0, 0.34571400982514394, 0.8411919906082768, 1.954597694087775];
    let xs = [-3.0, -1.0, 0.0, 0.5, 1.0, 2.0];
    assert_close(&unary(UnaryOp::Gelu, &xs), &want, 1e-14, 0.0);
    assert_close(&run_op::<f32>(Op::Unary(UnaryOp::Gelu), &[In::f(&[6], &xs)]), &want, 1e-6, 1e-7);
}

#[test]
fn binary_ops() {
    let a = [1.0, -2.0, 3.0, 0.5];
    let b = [4.0, 5.0, -6.0, 0.5];
    let bin = |op| run_f64(Op::Binary(op), &[In::f(&[2, 2], &a), In::f(&[2, 2], &b)]);
    assert_eq!(bin(BinaryOp::Add), vec![5.0, 3.0, -3.0, 1.0]);
    assert_eq!(bin(BinaryOp::Sub), vec![-3.0, -7.0, 9.0, 0.0]);
    assert_eq!(bin(BinaryOp::Mul), vec![4.0, -10.0, -18.0, 0.25]);
    assert_eq!(bin(BinaryOp::Div), vec![0.25, -0.4, -0.5, 1.0]);
    assert_eq!(bin(BinaryOp::Max), vec![4.0, 5.0, 3.0, 0.5]);
    assert_eq!(bin(BinaryOp::Min), vec![1.0, -2.0, -6.0, 0.5]);
}

#[test]
fn max_and_min_propagate_nan() {
    let ins = [In::f(&[2], &[f64::NAN, 1.0]), In::f(&[2], &[0.0, f64::NAN])];
    for op in [BinaryOp::Max, BinaryOp::Min] {
        let y = run_f64(Op::Binary(op), &ins);
        assert!(y[0].is_nan() && y[1].is_nan(), "{op:?}: {y:?}");
    }
}

#[test]
fn gelu_grad_matches_the_derivative_formula() {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    let dy = [1.0, 2.0, -1.0, 0.5, 3.0, 1.0];
    let want: Vec<f64> = XS
        .iter()
        .zip(dy)
        .map(|(&x, d)| {
            let t = (k * (x + 0.044715 * x * x * x)).tanh();
            d * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x))
        })
        .collect();
    let got = run_f64(Op::Binary(BinaryOp::GeluGrad), &[In::f(&[6], &XS), In::f(&[6], &dy)]);
    assert_close(&got, &want, 1e-14, 0.0);
    // gelu'(0) = 0.5 exactly.
    assert_eq!(run_f64(Op::Binary(BinaryOp::GeluGrad), &[In::f(&[], &[0.0]), In::f(&[], &[1.0])]), vec![0.5]);
}

#[test]
fn affine() {
    let y = run_f64(Op::Affine { mul: 2.0, add: -1.0 }, &[In::f(&[3], &[0.0, 1.5, -2.0])]);
    assert_eq!(y, vec![-1.0, 2.0, -5.0]);
}

fn cast(to: DType, x: In) -> Value<f64> {
    try_run_op::<f64>(Op::Cast { to }, &[x]).unwrap()
}

#[test]
fn casts_between_floats_and_ints() {
    let xs = [-2.7, -0.5, 0.5, 2.7, 1e10, -1e10, f64::NAN];
    let y = cast(DType::I32, In::f(&[7], &xs));
    assert_eq!(y.as_int().unwrap().data, vec![-2, 0, 0, 2, i32::MAX, i32::MIN, 0]);
    let y = cast(DType::U8, In::f(&[4], &[-3.5, 300.2, 7.9, 255.0]));
    assert_eq!(y.as_int().unwrap().data, vec![0, 255, 7, 255]);
    // Codes are unsigned (qatc_runtime::quant offsets sym codes by qmax): i4 holds 0..=15.
    let y = cast(DType::I4, In::f(&[4], &[-9.5, 7.9, 15.7, 20.0]));
    assert_eq!(y.as_int().unwrap().data, vec![0, 7, 15, 15]);
    let y = cast(DType::F32, In::i(&[3], &[-7, 0, 16_777_217]));
    assert_eq!(y.as_float().unwrap().data, vec![-7.0, 0.0, 16_777_217.0]);
    let y = cast(DType::U8, In::i(&[3], &[-1, 77, 1000]));
    assert_eq!(y.as_int().unwrap().data, vec![0, 77, 255]);
    let y = cast(DType::I32, In::i(&[2], &[-1, 1000]));
    assert_eq!(y.as_int().unwrap().data, vec![-1, 1000]);
}

#[test]
fn casts_to_half_types_round() {
    let xs = [0.1, 1.0 + 1.0 / 4096.0, 65519.0, 3.0e-8];
    let f16: Vec<f64> = xs.iter().map(|&x| half::f16::from_f64(x).to_f64()).collect();
    let bf16: Vec<f64> = xs.iter().map(|&x| half::bf16::from_f64(x).to_f64()).collect();
    assert_eq!(f16[0], 0.0999755859375);
    assert_eq!(f16[1], 1.0);
    let y = cast(DType::F16, In::f(&[4], &xs));
    assert_eq!(y.as_float().unwrap().data, f16);
    let y = cast(DType::BF16, In::f(&[4], &xs));
    assert_eq!(y.as_float().unwrap().data, bf16);
    // f32 mode rounds the same way.
    assert_eq!(run_op::<f32>(Op::Cast { to: DType::F16 }, &[In::f(&[4], &xs)]), f16);
}

#[test]
fn adam_moments() {
    let m = [0.5, -1.0, 0.0];
    let g = [1.0, 2.0, -4.0];
    let y = run_f64(Op::AdamM { beta1: 0.9 }, &[In::f(&[3], &m), In::f(&[3], &g)]);
    assert_close(&y, &[0.9 * 0.5 + 0.1, -0.9 + 0.2, -0.4], 1e-15, 1e-17);
    let y = run_f64(Op::AdamV { beta2: 0.99 }, &[In::f(&[3], &[1.0, 0.0, 2.0]), In::f(&[3], &g)]);
    assert_close(&y, &[0.99 + 0.01, 0.04, 1.98 + 0.16], 1e-15, 0.0);
}
