//! Library GEMM steps on the CPU, through OpenBLAS when it is installed (`blas.rs`, large GEMMs)
//! and the `gemm` crate otherwise: c = alpha * a @ b (+ c), plus an
//! optional bias row, each operand read in place through its view's row and column strides (a
//! transposed operand costs nothing). Batch dims lead and are equal on a, b and c; each batch
//! element is one call. f16/bf16 operands or destinations go through f32 tiles (`gemm_half.rs`).
//!
//! Every view is checked against its buffer once, when the program is planned
//! (`exec::check_gemm`: views, shapes, and buffers of the types the GEMM says), so the unchecked
//! pointer arithmetic of [`run`] stays inside the allocations.

use std::sync::Arc;

use gemm::Parallelism;
use qatc_kernels::program::{Gemm, View};

use super::blas::Blas;
use super::onednn::Bf16Gemm;

/// The GEMM libraries the CPU executor loaded (`CpuOptions::blas`, `CpuOptions::bf16_gemm`):
/// OpenBLAS for the large f32 GEMMs, oneDNN for bf16 ones where the CPU has bf16 units.
#[derive(Clone, Default)]
pub struct GemmLibs {
    pub blas: Option<Arc<Blas>>,
    pub bf16: Option<Arc<Bf16Gemm>>,
}

/// Below this many multiply-adds a GEMM runs on the calling thread: splitting costs more.
const PAR_MIN_FLOPS: usize = 1 << 16;

/// From this many multiply-adds on, OpenBLAS (when loaded, `blas.rs`) takes the GEMM: below it
/// its thread start-up is not repaid.
const BLAS_MIN_FLOPS: usize = 1 << 20;

/// Element offsets of batch element `i` (row-major over the batch dims) in each view.
pub(super) fn batch_offsets(g: &Gemm, i: usize) -> [usize; 3] {
    let r = g.c.shape.len();
    let mut rest = i;
    let mut off = [g.a.offset, g.b.offset, g.c.offset];
    for d in (0..r - 2).rev() {
        let (n, c) = (g.c.shape[d], rest % g.c.shape[d].max(1));
        rest /= n.max(1);
        for (o, v) in off.iter_mut().zip([&g.a, &g.b, &g.c]) {
            *o += c * v.strides[d];
        }
    }
    off
}

/// An f32 matrix in memory: base address, row stride, column stride (elements).
pub(super) type MatF32 = (*const f32, usize, usize);

/// c = alpha a @ b (+ c when `accumulate`) on f32 matrices [m, k] @ [k, n] -> [m, n], by `blas`
/// when given and the GEMM is large, else by the gemm crate.
///
/// # Safety
/// The three matrices must be live and in bounds for their strides, c's elements distinct and
/// aliasing neither a nor b, and nothing else may access c meanwhile.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn sgemm(
    blas: Option<&Blas>,
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    accumulate: bool,
    a: MatF32,
    b: MatF32,
    c: (*mut f32, usize, usize),
) {
    if k == 0 {
        // an empty sum: zeros, or c unchanged when accumulating
        if !accumulate {
            for (ii, jj) in (0..m).flat_map(|ii| (0..n).map(move |jj| (ii, jj))) {
                // SAFETY: (ii, jj) is inside c, which the caller guarantees.
                unsafe { *c.0.add(ii * c.1 + jj * c.2) = 0.0 };
            }
        }
        return;
    }
    // SAFETY: the caller's contract, which is both libraries' (beta 0 never reads c).
    unsafe {
        if m * n * k >= BLAS_MIN_FLOPS && blas.is_some_and(|bl| bl.sgemm(m, n, k, alpha, accumulate, a, b, c)) {
            return;
        }
        let par = if m * n * k >= PAR_MIN_FLOPS { Parallelism::Rayon(0) } else { Parallelism::None };
        let s = |x: usize| x as isize;
        // gemm computes dst = alpha dst + beta (lhs @ rhs), reading dst only if asked
        #[rustfmt::skip]
        gemm::gemm(m, n, k, c.0, s(c.2), s(c.1), accumulate, a.0, s(a.2), s(a.1), b.0, s(b.2), s(b.1), 1.0f32, alpha, false, false, false, par);
    }
}

/// Runs one GEMM step, the large ones by `libs.blas` when loaded: f32 in place (below), f16/bf16
/// by `libs.bf16` or through f32 tiles (`gemm_half`). `ptr(buf)` is the base address of a buffer.
///
/// # Safety
/// `g` must have passed `exec::check_gemm` against the buffers `ptr` points to, which must be
/// live and not accessed by anything else during the call.
pub unsafe fn run(g: &Gemm, libs: &GemmLibs, ptr: impl Fn(usize) -> *mut u8) {
    if !g.types.is_f32() {
        // SAFETY: the caller's contract, passed on.
        return unsafe { super::gemm_half::run(g, libs, ptr) };
    }
    let blas = libs.blas.as_deref();
    let r = g.c.shape.len();
    let (m, n, k) = (g.m, g.n, g.k);
    let s = |v: &View, d: usize| v.strides[d] as isize;
    let (a, b, c) = (ptr(g.a.buf).cast::<f32>(), ptr(g.b.buf).cast::<f32>(), ptr(g.c.buf).cast::<f32>());
    let st = |v: &View| (v.strides[r - 2], v.strides[r - 1]);
    for i in 0..g.batch() {
        let [oa, ob, oc] = batch_offsets(g, i);
        // SAFETY: `exec::check_gemm` proved every element of every view (all batch elements
        // included) lies inside its f32 buffer, and that c's elements are distinct and in a buffer
        // of their own, so the writes alias neither each other nor the operands; the caller
        // guarantees the buffers are live and otherwise untouched.
        unsafe {
            let cp = c.add(oc);
            let (sa, sb, sc) = (st(&g.a), st(&g.b), st(&g.c));
            sgemm(blas, (m, n, k), g.alpha as f32, g.accumulate, (a.add(oa), sa.0, sa.1), (b.add(ob), sb.0, sb.1), (cp, sc.0, sc.1));
            if let Some(bias) = &g.bias {
                let bp = ptr(bias.buf).cast::<f32>().add(bias.offset);
                for ii in 0..m {
                    for jj in 0..n {
                        *cp.offset(ii as isize * s(&g.c, r - 2) + jj as isize * s(&g.c, r - 1)) += *bp.add(jj * bias.strides[0]);
                    }
                }
            }
        }
    }
}
