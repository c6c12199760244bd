//! The kernel IR's scalars and operators, as `kernels/src/cuda/emit.rs` and the `qatc_*.cuh`
//! helpers compute them (C's usual arithmetic conversions included), for the evaluator.
//!
//! Integer arithmetic is checked: the index arithmetic of a correct kernel never overflows its
//! index type nor divides by zero, so either is reported as an error (a lowering bug: an I32
//! index type chosen for a buffer that needs I64) instead of wrapping like the hardware would.

use half::{bf16, f16};
use qatc_kernels::kir::{BinOp, Intrinsic, Ty, UnOp};

use crate::ops::elementwise::{gelu, gelu_grad, nan_or};
use crate::quant::{dropout_keep, nf4_nearest, NF4};
use crate::Float;

/// A scalar value of one of the IR's types.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar {
    F32(f32),
    F64(f64),
    I32(i32),
    I64(i64),
    Bool(bool),
}

pub type R<T> = Result<T, String>;

impl Scalar {
    pub fn ty(self) -> Ty {
        match self {
            Scalar::F32(_) => Ty::F32,
            Scalar::F64(_) => Ty::F64,
            Scalar::I32(_) => Ty::I32,
            Scalar::I64(_) => Ty::I64,
            Scalar::Bool(_) => Ty::Bool,
        }
    }
    pub fn f32(self) -> f32 {
        match self {
            Scalar::F32(x) => x,
            Scalar::F64(x) => x as f32,
            Scalar::I32(x) => x as f32,
            Scalar::I64(x) => x as f32,
            Scalar::Bool(b) => f32::from(u8::from(b)),
        }
    }
    pub fn f64(self) -> f64 {
        match self {
            Scalar::F32(x) => f64::from(x),
            Scalar::F64(x) => x,
            Scalar::I32(x) => f64::from(x),
            Scalar::I64(x) => x as f64,
            Scalar::Bool(b) => f64::from(u8::from(b)),
        }
    }
    /// An integer (or bool) value, widened; floats are an error (the IR casts them explicitly).
    pub fn int(self) -> R<i64> {
        match self {
            Scalar::I32(x) => Ok(i64::from(x)),
            Scalar::I64(x) => Ok(x),
            Scalar::Bool(b) => Ok(i64::from(b)),
            Scalar::F32(_) | Scalar::F64(_) => Err(format!("float {self:?} used as an integer")),
        }
    }
    /// An element index: a non-negative integer.
    pub fn index(self) -> R<usize> {
        let i = self.int()?;
        usize::try_from(i).map_err(|_| format!("negative index {i}"))
    }
    pub fn bool(self) -> R<bool> {
        match self {
            Scalar::Bool(b) => Ok(b),
            Scalar::I32(x) => Ok(x != 0),
            Scalar::I64(x) => Ok(x != 0),
            Scalar::F32(_) | Scalar::F64(_) => Err(format!("float {self:?} used as a condition")),
        }
    }
}

/// An integer in type `ty` (an integer constant takes the type of what it meets).
pub fn int_as(i: i64, ty: Ty) -> R<Scalar> {
    Ok(match ty {
        Ty::F32 => Scalar::F32(i as f32),
        Ty::F64 => Scalar::F64(i as f64),
        Ty::I32 => Scalar::I32(i32::try_from(i).map_err(|_| format!("{i} overflows the i32 index type"))?),
        Ty::I64 => Scalar::I64(i),
        Ty::Bool => Scalar::Bool(i != 0),
    })
}

/// `Expr::Cast`: float to integer truncates toward zero, saturates at the type's range and maps
/// NaN to 0 (the interpreter's `to_code`, which Rust's `as` is); i32 to i64 sign-extends; an i64
/// that does not fit an i32 is an error rather than wrapped.
pub fn cast(to: Ty, v: Scalar) -> R<Scalar> {
    Ok(match (to, v) {
        (Ty::F32, _) => Scalar::F32(v.f32()),
        (Ty::F64, _) => Scalar::F64(v.f64()),
        (Ty::I32, Scalar::F32(x)) => Scalar::I32(x as i32),
        (Ty::I32, Scalar::F64(x)) => Scalar::I32(x as i32),
        (Ty::I64, Scalar::F32(x)) => Scalar::I64(x as i64),
        (Ty::I64, Scalar::F64(x)) => Scalar::I64(x as i64),
        (Ty::I32 | Ty::I64, _) => int_as(v.int()?, to)?,
        (Ty::Bool, Scalar::F32(_) | Scalar::F64(_)) => Scalar::Bool(v.f64() != 0.0),
        (Ty::Bool, _) => Scalar::Bool(v.int()? != 0),
    })
}

pub fn unary(op: UnOp, v: Scalar) -> R<Scalar> {
    if op == UnOp::Not {
        return Ok(Scalar::Bool(!v.bool()?));
    }
    // the f32-only helpers (gelu, f16 rounding) take a float, as their C signatures do
    let f = |g: fn(f32) -> f32| Scalar::F32(g(v.f32()));
    Ok(match (op, v) {
        (UnOp::Neg, Scalar::I32(x)) => Scalar::I32(x.checked_neg().ok_or("i32 negation overflows")?),
        (UnOp::Neg, Scalar::I64(x)) => Scalar::I64(x.checked_neg().ok_or("i64 negation overflows")?),
        (UnOp::Abs, Scalar::I32(x)) => Scalar::I32(x.checked_abs().ok_or("i32 abs overflows")?),
        (UnOp::Abs, Scalar::I64(x)) => Scalar::I64(x.checked_abs().ok_or("i64 abs overflows")?),
        (UnOp::Gelu, _) => f(gelu::<f32>),
        (UnOp::RoundF16, _) => f(|x| f16::from_f32(x).to_f32()),
        (UnOp::RoundBf16, _) => f(|x| bf16::from_f32(x).to_f32()),
        (_, Scalar::F64(x)) => Scalar::F64(float_un(op, x)),
        // expf(int) and the like: C converts the integer to float first
        (_, _) => Scalar::F32(float_un(op, v.f32())),
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
pub fn binary(op: BinOp, a: Scalar, b: Scalar) -> R<Scalar> {
    if op == BinOp::And {
        return Ok(Scalar::Bool(a.bool()? && b.bool()?));
    }
    if op == BinOp::GeluGrad {
        return Ok(Scalar::F32(gelu_grad::<f32>(a.f32(), b.f32())));
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
        (Scalar::F32(x), Scalar::F32(y)) => match op.is_compare() {
            // NaN compares false except with !=
            true => Scalar::Bool(x.partial_cmp(&y).and_then(cmp).unwrap_or(op == BinOp::Ne)),
            false => Scalar::F32(float_bin(op, x, y)?),
        },
        (Scalar::F64(x), Scalar::F64(y)) => match op.is_compare() {
            true => Scalar::Bool(x.partial_cmp(&y).and_then(cmp).unwrap_or(op == BinOp::Ne)),
            false => Scalar::F64(float_bin(op, x, y)?),
        },
        (Scalar::I32(x), Scalar::I32(y)) => match op.is_compare() {
            true => Scalar::Bool(cmp(x.cmp(&y)).unwrap_or(false)),
            false => Scalar::I32(
                i32::try_from(int_bin(op, i64::from(x), i64::from(y))?).map_err(|_| format!("i32 {op:?} of {x} and {y} overflows"))?,
            ),
        },
        (Scalar::I64(x), Scalar::I64(y)) => match op.is_compare() {
            true => Scalar::Bool(cmp(x.cmp(&y)).unwrap_or(false)),
            false => Scalar::I64(int_bin(op, x, y)?),
        },
        (Scalar::Bool(x), Scalar::Bool(y)) if matches!(op, BinOp::Eq | BinOp::Ne) => Scalar::Bool((x == y) == (op == BinOp::Eq)),
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
pub fn call(i: Intrinsic, args: &[Scalar]) -> R<Scalar> {
    let arg = |n: usize| args.get(n).copied().ok_or_else(|| format!("{i:?} lacks argument {n}"));
    Ok(match i {
        Intrinsic::DropoutKeep { stream } => {
            // (seed, element index, p): the seed's bits as i32, as the C helper takes an int
            let seed = arg(0)?.int()? as i32;
            Scalar::Bool(dropout_keep(seed, stream as usize, arg(1)?.index()?, arg(2)?.f64()))
        }
        Intrinsic::Nf4Value => Scalar::F32(NF4[(arg(0)?.int()? & 15) as usize]),
        Intrinsic::Nf4Nearest => Scalar::I32(i32::from(nf4_nearest(arg(0)?.f32()))),
        Intrinsic::F16Round => Scalar::F32(f16::from_f32(arg(0)?.f32()).to_f32()),
        Intrinsic::DynValue(map) => Scalar::F32(map.values()[(arg(0)?.int()? & 255) as usize]),
        Intrinsic::DynNearest(map) => Scalar::I32(i32::from(map.nearest(arg(0)?.f32()))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_propagates_nan_and_casts_saturate() {
        let nan = f32::NAN;
        assert!(matches!(binary(BinOp::Max, Scalar::F32(1.0), Scalar::F32(nan)), Ok(Scalar::F32(x)) if x.is_nan()));
        assert!(matches!(binary(BinOp::Min, Scalar::F32(nan), Scalar::F32(1.0)), Ok(Scalar::F32(x)) if x.is_nan()));
        assert_eq!(binary(BinOp::Max, Scalar::F32(1.0), Scalar::F32(2.0)), Ok(Scalar::F32(2.0)));
        assert_eq!(cast(Ty::I32, Scalar::F32(nan)), Ok(Scalar::I32(0)));
        assert_eq!(cast(Ty::I32, Scalar::F32(-3.9e10)), Ok(Scalar::I32(i32::MIN)));
        assert_eq!(cast(Ty::I32, Scalar::F32(-2.7)), Ok(Scalar::I32(-2)));
        assert_eq!(binary(BinOp::Ne, Scalar::F32(nan), Scalar::F32(nan)), Ok(Scalar::Bool(true)));
        assert!(binary(BinOp::Add, Scalar::I32(i32::MAX), Scalar::I32(1)).is_err());
        assert_eq!(unary(UnOp::RoundEven, Scalar::F32(2.5)), Ok(Scalar::F32(2.0)));
    }
}
