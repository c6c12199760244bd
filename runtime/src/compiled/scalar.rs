//! The kernel IR's scalars and operators, as `kernels/src/cuda/emit.rs` and the `qatc_*.cuh`
//! helpers compute them (C's usual arithmetic conversions included), for the evaluator.
//!
//! Integer arithmetic is checked: the index arithmetic of a correct kernel never overflows its
//! index type nor divides by zero, so either is reported as an error (a lowering bug: an I32
//! index type chosen for a buffer that needs I64) instead of wrapping like the hardware would.

use half::{bf16, f16};
use qatc_kernels::kir::{BinOp, Intrinsic, Ty, UnOp};

use crate::kernels::elementwise::{gelu, gelu_grad, nan_or};
use crate::quant::{dropout_keep, nf4_nearest, NF4};
use crate::Float;

/// A scalar value of one of the IR's types.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum V {
    F(f32),
    D(f64),
    I(i32),
    L(i64),
    B(bool),
}

pub type R<T> = Result<T, String>;

impl V {
    pub fn ty(self) -> Ty {
        match self {
            V::F(_) => Ty::F32,
            V::D(_) => Ty::F64,
            V::I(_) => Ty::I32,
            V::L(_) => Ty::I64,
            V::B(_) => Ty::Bool,
        }
    }
    pub fn f32(self) -> f32 {
        match self {
            V::F(x) => x,
            V::D(x) => x as f32,
            V::I(x) => x as f32,
            V::L(x) => x as f32,
            V::B(b) => f32::from(u8::from(b)),
        }
    }
    pub fn f64(self) -> f64 {
        match self {
            V::F(x) => f64::from(x),
            V::D(x) => x,
            V::I(x) => f64::from(x),
            V::L(x) => x as f64,
            V::B(b) => f64::from(u8::from(b)),
        }
    }
    /// An integer (or bool) value, widened; floats are an error (the IR casts them explicitly).
    pub fn int(self) -> R<i64> {
        match self {
            V::I(x) => Ok(i64::from(x)),
            V::L(x) => Ok(x),
            V::B(b) => Ok(i64::from(b)),
            V::F(_) | V::D(_) => Err(format!("float {self:?} used as an integer")),
        }
    }
    /// An element index: a non-negative integer.
    pub fn index(self) -> R<usize> {
        let i = self.int()?;
        usize::try_from(i).map_err(|_| format!("negative index {i}"))
    }
    pub fn bool(self) -> R<bool> {
        match self {
            V::B(b) => Ok(b),
            V::I(x) => Ok(x != 0),
            V::L(x) => Ok(x != 0),
            V::F(_) | V::D(_) => Err(format!("float {self:?} used as a condition")),
        }
    }
}

/// An integer in type `ty` (an integer constant takes the type of what it meets).
pub fn int_as(i: i64, ty: Ty) -> R<V> {
    Ok(match ty {
        Ty::F32 => V::F(i as f32),
        Ty::F64 => V::D(i as f64),
        Ty::I32 => V::I(i32::try_from(i).map_err(|_| format!("{i} overflows the i32 index type"))?),
        Ty::I64 => V::L(i),
        Ty::Bool => V::B(i != 0),
    })
}

/// `Expr::Cast`: float to integer truncates toward zero, saturates at the type's range and maps
/// NaN to 0 (the interpreter's `to_code`, which Rust's `as` is); i32 to i64 sign-extends; an i64
/// that does not fit an i32 is an error rather than wrapped.
pub fn cast(to: Ty, v: V) -> R<V> {
    Ok(match (to, v) {
        (Ty::F32, _) => V::F(v.f32()),
        (Ty::F64, _) => V::D(v.f64()),
        (Ty::I32, V::F(x)) => V::I(x as i32),
        (Ty::I32, V::D(x)) => V::I(x as i32),
        (Ty::I64, V::F(x)) => V::L(x as i64),
        (Ty::I64, V::D(x)) => V::L(x as i64),
        (Ty::I32 | Ty::I64, _) => int_as(v.int()?, to)?,
        (Ty::Bool, V::F(_) | V::D(_)) => V::B(v.f64() != 0.0),
        (Ty::Bool, _) => V::B(v.int()? != 0),
    })
}

pub fn unary(op: UnOp, v: V) -> R<V> {
    if op == UnOp::Not {
        return Ok(V::B(!v.bool()?));
    }
    // the f32-only helpers (gelu, f16 rounding) take a float, as their C signatures do
    let f = |g: fn(f32) -> f32| V::F(g(v.f32()));
    Ok(match (op, v) {
        (UnOp::Neg, V::I(x)) => V::I(x.checked_neg().ok_or("i32 negation overflows")?),
        (UnOp::Neg, V::L(x)) => V::L(x.checked_neg().ok_or("i64 negation overflows")?),
        (UnOp::Abs, V::I(x)) => V::I(x.checked_abs().ok_or("i32 abs overflows")?),
        (UnOp::Abs, V::L(x)) => V::L(x.checked_abs().ok_or("i64 abs overflows")?),
        (UnOp::Gelu, _) => f(gelu::<f32>),
        (UnOp::RoundF16, _) => f(|x| f16::from_f32(x).to_f32()),
        (UnOp::RoundBf16, _) => f(|x| bf16::from_f32(x).to_f32()),
        (_, V::D(x)) => V::D(float_un(op, x)),
        // expf(int) and the like: C converts the integer to float first
        (_, _) => V::F(float_un(op, v.f32())),
    })
}

fn float_un<T: Float>(op: UnOp, x: T) -> T {
    match op {
        UnOp::Neg => -x,
        UnOp::Exp => x.exp(),
        UnOp::Log => x.ln(),
        UnOp::Sqrt => x.sqrt(),
        UnOp::Rsqrt => T::ONE / x.sqrt(),
        UnOp::Recip => T::ONE / x,
        UnOp::Tanh => x.tanh(),
        UnOp::Abs => x.abs(),
        UnOp::RoundEven => x.round_ties_even(),
        UnOp::Trunc => x.trunc(),
        // handled by `unary` before it gets here
        UnOp::Gelu | UnOp::RoundF16 | UnOp::RoundBf16 | UnOp::Not => x,
    }
}

/// `a op b` on values already converted to their common type (`common`).
pub fn binary(op: BinOp, a: V, b: V) -> R<V> {
    if op == BinOp::And {
        return Ok(V::B(a.bool()? && b.bool()?));
    }
    if op == BinOp::GeluGrad {
        return Ok(V::F(gelu_grad::<f32>(a.f32(), b.f32())));
    }
    let cmp = |o: std::cmp::Ordering| -> Option<bool> {
        Some(match op {
            BinOp::Lt => o.is_lt(),
            BinOp::Le => o.is_le(),
            BinOp::Eq => o.is_eq(),
            BinOp::Ne => o.is_ne(),
            _ => return None,
        })
    };
    Ok(match (a, b) {
        (V::F(x), V::F(y)) => match op.is_compare() {
            // NaN compares false except with !=
            true => V::B(x.partial_cmp(&y).and_then(cmp).unwrap_or(op == BinOp::Ne)),
            false => V::F(float_bin(op, x, y)?),
        },
        (V::D(x), V::D(y)) => match op.is_compare() {
            true => V::B(x.partial_cmp(&y).and_then(cmp).unwrap_or(op == BinOp::Ne)),
            false => V::D(float_bin(op, x, y)?),
        },
        (V::I(x), V::I(y)) => match op.is_compare() {
            true => V::B(cmp(x.cmp(&y)).unwrap_or(false)),
            false => {
                V::I(i32::try_from(int_bin(op, i64::from(x), i64::from(y))?).map_err(|_| format!("i32 {op:?} of {x} and {y} overflows"))?)
            }
        },
        (V::L(x), V::L(y)) => match op.is_compare() {
            true => V::B(cmp(x.cmp(&y)).unwrap_or(false)),
            false => V::L(int_bin(op, x, y)?),
        },
        (V::B(x), V::B(y)) if matches!(op, BinOp::Eq | BinOp::Ne) => V::B((x == y) == (op == BinOp::Eq)),
        _ => return Err(format!("{op:?} of {a:?} and {b:?}")),
    })
}

fn float_bin<T: Float>(op: BinOp, x: T, y: T) -> R<T> {
    Ok(match op {
        BinOp::Add => x + y,
        BinOp::Sub => x - y,
        BinOp::Mul => x * y,
        BinOp::Div => x / y,
        BinOp::Max => nan_or(x, y, x >= y),
        BinOp::Min => nan_or(x, y, x <= y),
        BinOp::Pow => x.powf(y),
        _ => return Err(format!("{op:?} of floats")),
    })
}

fn int_bin(op: BinOp, x: i64, y: i64) -> R<i64> {
    let r = match op {
        BinOp::Add => x.checked_add(y),
        BinOp::Sub => x.checked_sub(y),
        BinOp::Mul => x.checked_mul(y),
        BinOp::Div => x.checked_div(y),
        BinOp::Rem => x.checked_rem(y),
        BinOp::Max => Some(x.max(y)),
        BinOp::Min => Some(x.min(y)),
        _ => return Err(format!("{op:?} of integers")),
    };
    r.ok_or_else(|| format!("integer {op:?} of {x} and {y} overflows or divides by zero"))
}

/// The intrinsics, through `runtime/src/quant.rs` (the one definition of each).
pub fn call(i: Intrinsic, args: &[V]) -> R<V> {
    let arg = |n: usize| args.get(n).copied().ok_or_else(|| format!("{i:?} lacks argument {n}"));
    Ok(match i {
        Intrinsic::DropoutKeep { stream } => {
            // (seed, element index, p): the seed's bits as i32, as the C helper takes an int
            let seed = arg(0)?.int()? as i32;
            V::B(dropout_keep(seed, stream as usize, arg(1)?.index()?, arg(2)?.f64()))
        }
        Intrinsic::Nf4Value => V::F(NF4[(arg(0)?.int()? & 15) as usize]),
        Intrinsic::Nf4Nearest => V::I(i32::from(nf4_nearest(arg(0)?.f32()))),
        Intrinsic::F16Round => V::F(f16::from_f32(arg(0)?.f32()).to_f32()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_propagates_nan_and_casts_saturate() {
        let nan = f32::NAN;
        assert!(matches!(binary(BinOp::Max, V::F(1.0), V::F(nan)), Ok(V::F(x)) if x.is_nan()));
        assert!(matches!(binary(BinOp::Min, V::F(nan), V::F(1.0)), Ok(V::F(x)) if x.is_nan()));
        assert_eq!(binary(BinOp::Max, V::F(1.0), V::F(2.0)), Ok(V::F(2.0)));
        assert_eq!(cast(Ty::I32, V::F(nan)), Ok(V::I(0)));
        assert_eq!(cast(Ty::I32, V::F(-3.9e10)), Ok(V::I(i32::MIN)));
        assert_eq!(cast(Ty::I32, V::F(-2.7)), Ok(V::I(-2)));
        assert_eq!(binary(BinOp::Ne, V::F(nan), V::F(nan)), Ok(V::B(true)));
        assert!(binary(BinOp::Add, V::I(i32::MAX), V::I(1)).is_err());
        assert_eq!(unary(UnOp::RoundEven, V::F(2.5)), Ok(V::F(2.0)));
    }
}
