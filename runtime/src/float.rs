//! The scalar type the interpreter stores values in. f64 mode is the oracle for gradient checks;
//! f32 mode stores every value in f32 as device code does, but accumulates every sum in f64 and
//! rounds it once ([`WideSum`]), so it is more accurate than any summation order a device uses.

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
    /// strides, which is how transposed operands are read without copying. The dot products are
    /// f64 ([`WideSum`]'s rule): f32's widens its operands and rounds each element of C once.
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
                // SAFETY: the caller upholds this function's contract, which `$gemm`'s repeats.
                unsafe { $gemm(m, k, n, a, rsa, csa, b, rsb, csb, c, rsc, csc) }
            }
        }
    };
}

impl_float!(f32, widened_sgemm);
impl_float!(f64, dgemm);

/// A sum as the reference computes it: accumulated in f64 whatever the stored type, and rounded
/// once to that type at its end. Added in order in f32, a long row (a cross-entropy row of
/// 50,257 logits, a [512, 50,257] GEMM's dot products, a gradient summed over 512 positions)
/// drifts by up to ~1e-3 relative, where a GPU's tree of partial sums or the CPU's vector lanes
/// stay near 1e-6: the reference every kernel is judged against must not be the least precise of
/// the orders it judges. In f64 mode this is plain f64 addition.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WideSum(f64);

impl WideSum {
    #[inline]
    pub fn add<T: Float>(&mut self, x: T) {
        self.0 += x.to_f64();
    }
    /// Adds x * y, the product formed in f64 too.
    #[inline]
    pub fn add_product<T: Float>(&mut self, x: T, y: T) {
        self.0 += x.to_f64() * y.to_f64();
    }
    /// The sum so far, unrounded (for what is computed from it before the one rounding).
    #[inline]
    pub fn wide(self) -> f64 {
        self.0
    }
    /// The sum rounded once to `T`.
    #[inline]
    pub fn round<T: Float>(self) -> T {
        T::from_f64(self.0)
    }
}

/// matrixmultiply's dgemm with beta = 0 (C only written).
///
/// # Safety
/// [`Float::gemm`]'s contract.
#[allow(clippy::too_many_arguments)]
unsafe fn dgemm(
    m: usize,
    k: usize,
    n: usize,
    a: *const f64,
    rsa: isize,
    csa: isize,
    b: *const f64,
    rsb: isize,
    csb: isize,
    c: *mut f64,
    rsc: isize,
    csc: isize,
) {
    // SAFETY: the caller upholds this function's contract, which is exactly matrixmultiply's;
    // beta = 0 means C is only written.
    unsafe { matrixmultiply::dgemm(m, k, n, 1.0, a, rsa, csa, b, rsb, csb, 0.0, c, rsc, csc) }
}

/// The most bytes of f64 copies of A's rows and C's rows that `widened_sgemm` holds at once
/// (B's f64 copy is whole).
const WIDE_BLOCK_BYTES: usize = 32 << 20;

/// An f32 GEMM whose dot products are f64 (`WideSum`'s rule): B widened once, A and C a block of
/// rows at a time, each element of C rounded once to f32.
///
/// # Safety
/// [`Float::gemm`]'s contract.
#[allow(clippy::too_many_arguments)]
unsafe fn widened_sgemm(
    m: usize,
    k: usize,
    n: usize,
    a: *const f32,
    rsa: isize,
    csa: isize,
    b: *const f32,
    rsb: isize,
    csb: isize,
    c: *mut f32,
    rsc: isize,
    csc: isize,
) {
    if m == 0 || n == 0 {
        return;
    }
    // `as isize` of an index below m, k or n: each addresses an element of a live allocation
    // (the contract), so it is below isize::MAX
    let at = |i: usize, j: usize, rs: isize, cs: isize| i as isize * rs + j as isize * cs;
    let mut bw = vec![0f64; k * n];
    for p in 0..k {
        for j in 0..n {
            // SAFETY: p < k, j < n: in bounds of B by the contract
            bw[p * n + j] = f64::from(unsafe { *b.offset(at(p, j, rsb, csb)) });
        }
    }
    let rows = (WIDE_BLOCK_BYTES / (8 * (k + n))).clamp(1, m);
    let (mut aw, mut cw) = (vec![0f64; rows * k], vec![0f64; rows * n]);
    for i0 in (0..m).step_by(rows) {
        let mb = rows.min(m - i0);
        for i in 0..mb {
            for p in 0..k {
                // SAFETY: i0 + i < m, p < k: in bounds of A by the contract
                aw[i * k + p] = f64::from(unsafe { *a.offset(at(i0 + i, p, rsa, csa)) });
            }
        }
        if k == 0 {
            cw.fill(0.0);
        } else {
            // SAFETY: aw holds mb x k row-major, bw k x n, cw mb x n (rows >= mb): every element
            // addressed is in bounds; cw is a unique borrow, disjoint from aw and bw
            unsafe {
                dgemm(mb, k, n, aw.as_ptr(), k as isize, 1, bw.as_ptr(), n as isize, 1, cw.as_mut_ptr(), n as isize, 1);
            }
        }
        for i in 0..mb {
            for j in 0..n {
                // SAFETY: i0 + i < m, j < n: in bounds of C, which no one else accesses (the
                // contract)
                unsafe { *c.offset(at(i0 + i, j, rsc, csc)) = cw[i * n + j] as f32 };
            }
        }
    }
}

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

    /// f32's GEMM sums in f64 and rounds once: 1e8 + 1 - 1e8 is 0 added in f32 (1e8 + 1 rounds to
    /// 1e8), 1 in f64; through a transposed A, a block of rows at a time.
    #[test]
    fn f32_gemm_dot_products_are_f64() {
        let a = [1e8f32, 1.0, -1e8, 1e8, 1.0, -1e8];
        let b = [1.0f32; 3];
        let mut c = [7.0f32; 2];
        // A [2, 3] row-major: strides (3, 1); read transposed from [3, 2] storage: (1, 2)
        // SAFETY: every index of A (i < 2, p < 3), B (3 x 1) and C (2 x 1) is in bounds
        unsafe { f32::gemm(2, 3, 1, a.as_ptr(), 3, 1, b.as_ptr(), 1, 1, c.as_mut_ptr(), 1, 1) };
        assert_eq!(c, [1.0, 1.0]);
        let at = [1e8f32, 1e8, 1.0, 1.0, -1e8, -1e8];
        // SAFETY: as above, A read as [3, 2] transposed
        unsafe { f32::gemm(2, 3, 1, at.as_ptr(), 1, 2, b.as_ptr(), 1, 1, c.as_mut_ptr(), 1, 1) };
        assert_eq!(c, [1.0, 1.0]);
        let mut s = super::WideSum::default();
        [1e8f32, 1.0, -1e8].iter().for_each(|&x| s.add(x));
        assert_eq!(s.round::<f32>(), 1.0);
    }
}
