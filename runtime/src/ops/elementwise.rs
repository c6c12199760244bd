//! Unary, binary and affine maps, and the Adam updates (elementwise too).

use qatc_ir::{BinaryOp, UnaryOp};

use super::{expect_len, map1, map2, par_chunks};
use crate::float::Float;

const GELU_C: f64 = 0.044_715;

fn sqrt_2_over_pi<T: Float>() -> T {
    T::from_f64((2.0 / std::f64::consts::PI).sqrt())
}

/// GPT-2's tanh GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
#[inline]
pub fn gelu<T: Float>(x: T) -> T {
    let half = T::from_f64(0.5);
    let u = sqrt_2_over_pi::<T>() * (x + T::from_f64(GELU_C) * x * x * x);
    half * x * (T::ONE + u.tanh())
}

/// dy * gelu'(x), with u = sqrt(2/pi) (x + c x^3), t = tanh u:
/// gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 c x^2).
#[inline]
pub fn gelu_grad<T: Float>(x: T, dy: T) -> T {
    let half = T::from_f64(0.5);
    let k = sqrt_2_over_pi::<T>();
    let c = T::from_f64(GELU_C);
    let t = (k * (x + c * x * x * x)).tanh();
    let d = half * (T::ONE + t) + half * x * (T::ONE - t * t) * k * (T::ONE + T::from_f64(3.0) * c * x * x);
    dy * d
}

/// max/min that propagate NaN (as torch.maximum does): an oracle should surface NaNs, not hide
/// them behind the other operand.
#[inline]
pub(crate) fn nan_or<T: Float>(a: T, b: T, pick_a: bool) -> T {
    if a.is_nan() {
        a
    } else if b.is_nan() {
        b
    } else if pick_a {
        a
    } else {
        b
    }
}

pub fn unary<T: Float>(op: UnaryOp, x: &[T]) -> Vec<T> {
    match op {
        UnaryOp::Neg => map1(x, |v| -v),
        UnaryOp::Exp => map1(x, T::exp),
        UnaryOp::Log => map1(x, T::ln),
        UnaryOp::Sqrt => map1(x, T::sqrt),
        UnaryOp::Rsqrt => map1(x, |v| T::ONE / v.sqrt()),
        UnaryOp::Recip => map1(x, |v| T::ONE / v),
        UnaryOp::Tanh => map1(x, T::tanh),
        UnaryOp::Square => map1(x, |v| v * v),
        UnaryOp::Gelu => map1(x, gelu),
    }
}

pub fn binary<T: Float>(op: BinaryOp, a: &[T], b: &[T]) -> Result<Vec<T>, String> {
    expect_len("rhs", b.len(), a.len())?;
    Ok(match op {
        BinaryOp::Add => map2(a, b, |x, y| x + y),
        BinaryOp::Sub => map2(a, b, |x, y| x - y),
        BinaryOp::Mul => map2(a, b, |x, y| x * y),
        BinaryOp::Div => map2(a, b, |x, y| x / y),
        BinaryOp::Max => map2(a, b, |x, y| nan_or(x, y, x >= y)),
        BinaryOp::Min => map2(a, b, |x, y| nan_or(x, y, x <= y)),
        BinaryOp::GeluGrad => map2(a, b, gelu_grad),
    })
}

pub fn affine<T: Float>(x: &[T], mul: f64, add: f64) -> Vec<T> {
    let (m, a) = (T::from_f64(mul), T::from_f64(add));
    map1(x, |v| v * m + a)
}

/// beta1 * m + (1 - beta1) * g
pub fn adam_m<T: Float>(m: &[T], g: &[T], beta1: f64) -> Result<Vec<T>, String> {
    expect_len("g", g.len(), m.len())?;
    let (b, c) = (T::from_f64(beta1), T::from_f64(1.0 - beta1));
    Ok(map2(m, g, |m, g| b * m + c * g))
}

/// beta2 * v + (1 - beta2) * g^2
pub fn adam_v<T: Float>(v: &[T], g: &[T], beta2: f64) -> Result<Vec<T>, String> {
    expect_len("g", g.len(), v.len())?;
    let (b, c) = (T::from_f64(beta2), T::from_f64(1.0 - beta2));
    Ok(map2(v, g, |v, g| b * v + c * g * g))
}

/// The AdamW hyper-parameters of one `adam_param` node.
#[derive(Clone, Copy, Debug)]
pub struct AdamHyper {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// PyTorch's AdamW step (`torch.optim.AdamW`, non-amsgrad, non-fused). Like PyTorch, the scalar
/// factors are formed in f64 (Python floats there) and the tensor arithmetic runs in `T`:
/// p1 = p * (1 - lr wd); denom = sqrt(v) / sqrt(1 - beta2^t) + eps; p1 - lr / (1 - beta1^t) * m / denom.
pub fn adam_param<T: Float>(p: &[T], m: &[T], v: &[T], lr: f64, t: f64, h: AdamHyper) -> Result<Vec<T>, String> {
    expect_len("m", m.len(), p.len())?;
    expect_len("v", v.len(), p.len())?;
    let bc1 = 1.0 - h.beta1.powf(t);
    let bc2 = 1.0 - h.beta2.powf(t);
    let decay = T::from_f64(1.0 - lr * h.weight_decay);
    let step = T::from_f64(lr / bc1);
    let bc2_sqrt = T::from_f64(bc2.sqrt());
    let eps = T::from_f64(h.eps);
    let mut out = p.to_vec();
    par_chunks(&mut out, 1, |start, c| {
        for (i, o) in c.iter_mut().enumerate() {
            let j = start + i;
            let denom = v[j].sqrt() / bc2_sqrt + eps;
            *o = *o * decay - step * (m[j] / denom);
        }
    });
    Ok(out)
}
