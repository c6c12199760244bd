//! The scalar type the interpreter computes in. f64 mode is the oracle for gradient checks; f32
//! mode behaves like f32 device code (same accumulation precision), so the two are compared.

use std::fmt::{Debug, Display};
use std::ops::{Add, AddAssign, Div, DivAssign, Mul, MulAssign, Neg, Sub, SubAssign};

/// A float the interpreter can compute in: implemented for `f32` and `f64`.
pub trait Float:
    Copy
    + Debug
    + Display
    + Default
    + PartialEq
    + PartialOrd
    + Send
    + Sync
    + 'static
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
    + DivAssign
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INFINITY: Self;
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
    fn from_i32(v: i32) -> Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn powf(self, y: Self) -> Self;
    fn sqrt(self) -> Self;
    fn tanh(self) -> Self;
    fn is_nan(self) -> bool;
    fn abs(self) -> Self;
    fn trunc(self) -> Self;
    /// Round half to even: what torch.round, CUDA's rintf and the FPU default mode do.
    fn round_ties_even(self) -> Self;
    /// Rounds to the nearest IEEE half value (what storing into an f16 buffer does).
    fn round_f16(self) -> Self;
    /// Rounds to the nearest bfloat16 value.
    fn round_bf16(self) -> Self;

    /// C [m, n] = A [m, k] * B [k, n] (C is overwritten, never read), with arbitrary element
    /// strides, which is how transposed operands are read without copying.
    ///
    /// # Safety
    /// Every element `a + i*rsa + p*csa` (i < m, p < k), `b + p*rsb + j*csb` (p < k, j < n) and
    /// `c + i*rsc + j*csc` (i < m, j < n) must be in bounds of live allocations, C's elements
    /// must not alias each other nor A or B, and no other reference may access C meanwhile.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm(
        m: usize,
        k: usize,
        n: usize,
        a: *const Self,
        rsa: isize,
        csa: isize,
        b: *const Self,
        rsb: isize,
        csb: isize,
        c: *mut Self,
        rsc: isize,
        csc: isize,
    );
}

macro_rules! impl_float {
    ($t:ty, $gemm:path) => {
        impl Float for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            #[inline]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline]
            fn from_i32(v: i32) -> Self {
                v as $t
            }
            #[inline]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline]
            fn powf(self, y: Self) -> Self {
                <$t>::powf(self, y)
            }
            #[inline]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline]
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            #[inline]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            #[inline]
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            #[inline]
            fn trunc(self) -> Self {
                <$t>::trunc(self)
            }
            #[inline]
            fn round_ties_even(self) -> Self {
                <$t>::round_ties_even(self)
            }
            #[inline]
            fn round_f16(self) -> Self {
                // Converting straight from the wide type rounds once, as a hardware store does.
                half::f16::from_f64(self as f64).to_f64() as $t
            }
            #[inline]
            fn round_bf16(self) -> Self {
                half::bf16::from_f64(self as f64).to_f64() as $t
            }
            unsafe fn gemm(
                m: usize,
                k: usize,
                n: usize,
                a: *const Self,
                rsa: isize,
                csa: isize,
                b: *const Self,
                rsb: isize,
                csb: isize,
                c: *mut Self,
                rsc: isize,
                csc: isize,
            ) {
                // SAFETY: the caller upholds this function's contract, which is exactly
                // matrixmultiply's; beta = 0 means C is only written.
                unsafe { $gemm(m, k, n, 1.0, a, rsa, csa, b, rsb, csb, 0.0, c, rsc, csc) }
            }
        }
    };
}

impl_float!(f32, matrixmultiply::sgemm);
impl_float!(f64, matrixmultiply::dgemm);

#[cfg(test)]
mod tests {
    use super::Float;

    #[test]
    fn half_rounding_matches_half_crate() {
        let x = 0.1_f64;
        assert_eq!(x.round_f16(), half::f16::from_f64(0.1).to_f64());
        assert_eq!((x as f32).round_bf16(), half::bf16::from_f32(0.1).to_f32());
        // 2049 is not representable in f16 (11-bit significand): it rounds to even, 2048.
        assert_eq!(2049.0_f32.round_f16(), 2048.0);
    }
}
