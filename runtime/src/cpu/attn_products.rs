//! The attention's products for `attn_gemm.rs`, on f32 copies of a head or on its bf16 rows.
//!
//! f32 ([`mm`]): a GEMM on the calling thread per product (heads run side by side), oneDNN's
//! AVX-512 sgemm where it loads, else the gemm crate's.
//!
//! bf16 on AMX ([`Half`]): a head's q, k, v and dout rows are copied as they are stored (bf16, no
//! f32 copy) into contiguous [T, hs] blocks and multiplied by oneDNN's matmul primitive on the
//! tile units (bf16 operands, f32 accumulation and results), each thread on its own primitives
//! (`onednn_matmul.rs`). Every operand is a dense matrix or a dense transpose (K^T, V^T, P^T and
//! dS^T read as "ba"), because brgemm runs nothing else well: a left operand whose rows lie
//! further apart than its width took 22.5 us instead of 7.4 (64x256x64, one thread; the f32 GEMM
//! 20), and a right one with a row stride past its width is not brgemm's at all (the GEMM
//! function's 48.6 us instead of 5.6). A qkv head's rows are 3C apart, hence the copies.
//!
//! The products that take a computed block, P V, P^T dO, dS K and dS^T Q, take it rounded to
//! bf16 once, as FlashAttention's tensor-core kernels take P and dS (and PyTorch's bf16
//! attention on this CPU); everything else (the scores, softmax, lse, delta, dP, the results'
//! sums over blocks) stays f32. A result differs from the f32 path's by that rounding: within
//! two bf16 units in the last place of the result's largest magnitude
//! (`runtime/tests/attention_gemm.rs`; one is what the f32 path keeps).

use gemm::Parallelism;

use super::convert::narrow_bf16;
use super::onednn::{Bf16Gemm, MatBf16};

/// A [T, hs] matrix of one head: row r at `ptr + r * rs`, its hs elements contiguous.
#[derive(Clone, Copy)]
pub(super) struct Mat {
    pub ptr: *mut f32,
    pub rs: usize,
}

impl Mat {
    /// # Safety
    /// `ptr` must be valid for the head's T rows.
    pub unsafe fn row(self, r: usize) -> *mut f32 {
        // SAFETY: the caller's guarantee.
        unsafe { self.ptr.add(r * self.rs) }
    }
}

/// dst[m, n] (= or +=) beta * lhs[m, k] @ rhs[k, n], single-threaded (heads run in parallel),
/// by oneDNN when given and it takes the layout, else the gemm crate; each operand as (pointer,
/// row stride, column stride).
///
/// # Safety
/// Every element the strides reach must be valid, and dst must not overlap lhs or rhs.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn mm(
    lib: Option<&Bf16Gemm>,
    m: usize,
    n: usize,
    k: usize,
    dst: (*mut f32, isize, isize),
    acc: bool,
    lhs: (*const f32, isize, isize),
    rhs: (*const f32, isize, isize),
    beta: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    if let Some(lib) = lib {
        let u = |x: isize| x as usize;
        // SAFETY: the caller's guarantee (the strides are the views' own, never negative).
        if unsafe {
            lib.sgemm_one_thread(
                (m, n, k),
                beta,
                acc,
                (lhs.0, u(lhs.1), u(lhs.2)),
                (rhs.0, u(rhs.1), u(rhs.2)),
                (dst.0, u(dst.1), u(dst.2)),
            )
        } {
            return;
        }
    }
    // SAFETY: the caller's guarantee; gemm reads dst only when `acc`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.0,
            dst.2,
            dst.1,
            acc,
            lhs.0,
            lhs.2,
            lhs.1,
            rhs.0,
            rhs.2,
            rhs.1,
            1.0,
            beta,
            false,
            false,
            false,
            Parallelism::None,
        )
    }
}

/// A bf16 matrix of one head as stored: row r at `ptr + r * rs`, its hs elements contiguous.
#[derive(Clone, Copy)]
pub(super) struct Mat16 {
    pub ptr: *const u16,
    pub rs: usize,
}

impl Mat16 {
    /// Rows r.. as a product's operand ([rows, hs]).
    ///
    /// # Safety
    /// Row r must lie within the head.
    pub unsafe fn rows(self, r: usize) -> MatBf16 {
        // SAFETY: the caller's guarantee.
        (unsafe { self.ptr.add(r * self.rs) }, self.rs, 1)
    }

    /// The head transposed, [hs, T]: K^T, V^T (dense where the rows are, `rs` = hs).
    pub fn t(self) -> MatBf16 {
        (self.ptr, 1, self.rs)
    }
}

/// A head's bf16 operands and this thread's bf16 block.
pub(super) struct Half<'a> {
    pub lib: &'a Bf16Gemm,
    pub q: Mat16,
    pub k: Mat16,
    pub v: Option<Mat16>,
    pub dout: Option<Mat16>,
    /// [BLOCK, T] of bf16: a block of P or dS, rounded.
    pub p: *mut u16,
}

impl Half<'_> {
    pub fn v(&self) -> Result<Mat16, String> {
        self.v.ok_or_else(|| "attention without v".into())
    }

    pub fn dout(&self) -> Result<Mat16, String> {
        self.dout.ok_or_else(|| "attention without dout".into())
    }

    /// c [m, n] (= or +=) alpha lhs [m, k] @ rhs [k, n] on the calling thread; c f32 with
    /// contiguous rows at stride `c.1`.
    ///
    /// # Safety
    /// Every element the strides reach must be valid, c apart from lhs and rhs.
    pub unsafe fn mm(
        &self,
        mnk: (usize, usize, usize),
        c: (*mut f32, usize),
        accumulate: bool,
        lhs: MatBf16,
        rhs: MatBf16,
        alpha: f32,
    ) -> Result<(), String> {
        if mnk.0 == 0 || mnk.1 == 0 {
            return Ok(());
        }
        // SAFETY: the caller's guarantee.
        if unsafe { self.lib.gemm_one_thread(mnk, alpha, accumulate, lhs, rhs, (c.0, c.1, 1)) } {
            Ok(())
        } else {
            Err(format!("oneDNN refused the bf16 attention product {}x{}x{}", mnk.0, mnk.1, mnk.2))
        }
    }

    /// The [bm, n] f32 block `src` rounded to bf16 (nearest even) into `p`: (P, P^T) as
    /// product operands ([bm, n], and [n, bm] read transposed).
    pub fn round(&self, src: &[f32], bm: usize, n: usize) -> (MatBf16, MatBf16) {
        // SAFETY: `p` holds BLOCK * T elements (bm <= BLOCK, n <= T), this thread's alone, and
        // no operand of a product running meanwhile.
        let p = unsafe { std::slice::from_raw_parts_mut(self.p, bm * n) };
        narrow_bf16(&src[..bm * n], p);
        ((self.p.cast_const(), n, 1), (self.p.cast_const(), 1, n))
    }
}

/// A head's T rows of hs bf16 elements at `src` (row stride `rs`) copied into `dst` as [T, hs].
///
/// # Safety
/// `src` must address T rows of hs elements at stride `rs`; `dst` T * hs elements apart from
/// them.
pub(super) unsafe fn gather(src: *const u16, rs: usize, t: usize, hs: usize, dst: *mut u16) {
    // SAFETY: the caller's guarantee.
    unsafe {
        if rs == hs {
            std::ptr::copy_nonoverlapping(src, dst, t * hs);
        } else {
            for r in 0..t {
                std::ptr::copy_nonoverlapping(src.add(r * rs), dst.add(r * hs), hs);
            }
        }
    }
}
