//! Elementwise ops: unary, binary (both sides, one side, the same operand twice), affine, cast.

use qatc_ir::{BinaryOp, DType, Op, UnaryOp};

use crate::harness::{Case, Dist, ANY, POSITIVE};

#[test]
fn unary_ops() {
    let cases = [
        (UnaryOp::Neg, ANY),
        (UnaryOp::Exp, ANY),
        (UnaryOp::Log, POSITIVE),
        (UnaryOp::Sqrt, POSITIVE),
        (UnaryOp::Rsqrt, POSITIVE),
        (UnaryOp::Recip, Dist::AwayFromZero(0.4, 2.0)),
        (UnaryOp::Tanh, ANY),
        (UnaryOp::Square, ANY),
        (UnaryOp::Gelu, Dist::U(-3.0, 3.0)),
    ];
    for (k, (u, d)) in cases.into_iter().enumerate() {
        let mut c = Case::new(&format!("{u:?}"), 100 + k as u64);
        let x = c.param("x", &[2, 3, 5], d);
        let y = c.un(u, x);
        c.check(y);
    }
}

#[test]
fn binary_ops() {
    for (k, b) in [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div].into_iter().enumerate() {
        let mut c = Case::new(&format!("{b:?}"), 200 + k as u64);
        let x = c.param("a", &[3, 1, 5], ANY);
        let y = c.param("b", &[3, 1, 5], Dist::AwayFromZero(0.5, 2.0));
        let z = c.bin(b, x, y);
        c.check(z);
    }
}

#[test]
fn binary_ops_with_one_side_frozen() {
    // Only the trainable side wants a gradient; the rule must still be right for it.
    for (k, b) in [BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div].into_iter().enumerate() {
        for trainable_lhs in [true, false] {
            let mut c = Case::new(&format!("{b:?} lhs-trainable={trainable_lhs}"), 250 + 2 * k as u64 + u64::from(trainable_lhs));
            let (x, y) = if trainable_lhs {
                (c.param("a", &[7], ANY), c.frozen("b", &[7], Dist::AwayFromZero(0.5, 2.0)))
            } else {
                (c.frozen("a", &[7], ANY), c.param("b", &[7], Dist::AwayFromZero(0.5, 2.0)))
            };
            let z = c.bin(b, x, y);
            c.check(z);
        }
    }
}

#[test]
fn same_operand_twice() {
    // mul(x, x), div(x, x), sub(x, x), add(x, x): both slots' contributions must be summed.
    for (k, b) in [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div].into_iter().enumerate() {
        let mut c = Case::new(&format!("{b:?}(x, x)"), 300 + k as u64);
        let x = c.param("x", &[4, 3], Dist::AwayFromZero(0.5, 2.0));
        let y = c.bin(b, x, x);
        c.check(y);
    }
}

#[test]
fn affine() {
    let mut c = Case::new("affine", 400);
    let x = c.param("x", &[5, 3], ANY);
    let y = c.op(Op::Affine { mul: -1.7, add: 0.3 }, &[x]);
    c.check(y);
}

#[test]
fn cast_f32_to_f32() {
    // Only the float-to-same-precision cast: see the module comment on f16/bf16.
    let mut c = Case::new("cast", 401);
    let x = c.param("x", &[3, 5], ANY);
    let y = c.op(Op::Cast { to: DType::F32 }, &[x]);
    let z = c.un(UnaryOp::Tanh, y);
    c.check(z);
}
