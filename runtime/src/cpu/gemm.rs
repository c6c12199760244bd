//! Library GEMM steps on the CPU, through OpenBLAS when it is installed (`blas.rs`, large GEMMs)
//! and the `gemm` crate otherwise: c = alpha * a @ b (+ c), plus an
//! optional bias row, each operand read in place through its view's row and column strides (a
//! transposed operand costs nothing). Batch dims lead and are equal on a, b and c; each batch
//! element is one call.
//!
//! Every view is checked against its buffer once, when the program is planned
//! (`exec::check_gemm`, and [`check_f32`]), so the unchecked pointer arithmetic of [`run`] stays
//! inside the allocations.

use gemm::Parallelism;
use qatc_ir::DType;
use qatc_kernels::program::{Buffer, Gemm, View};

use super::blas::Blas;
use crate::error::RuntimeError;

/// Below this many multiply-adds a GEMM runs on the calling thread: splitting costs more.
const PAR_MIN_FLOPS: usize = 1 << 16;

/// From this many multiply-adds on, OpenBLAS (when loaded, `blas.rs`) takes the GEMM: below it
/// its thread start-up is not repaid.
const BLAS_MIN_FLOPS: usize = 1 << 20;

/// The CPU's own check of a GEMM step, beyond `exec::check_gemm`'s: every operand f32.
pub fn check_f32(g: &Gemm, bufs: &[Buffer]) -> Result<(), RuntimeError> {
    for (v, what) in [(Some(&g.a), "a"), (Some(&g.b), "b"), (Some(&g.c), "c"), (g.bias.as_ref(), "bias")] {
        if let Some(b) = v.and_then(|v| bufs.get(v.buf)) {
            if b.dtype != DType::F32 {
                return Err(RuntimeError::Gemm {
                    note: g.note.clone(),
                    msg: format!("{what} ({}) is {}: the CPU GEMM is f32 only", b.name, b.dtype),
                });
            }
        }
    }
    Ok(())
}

/// Element offsets of batch element `i` (row-major over the batch dims) in each view.
fn batch_offsets(g: &Gemm, i: usize) -> [usize; 3] {
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

/// Runs one GEMM step, the large ones by `blas` when given. `ptr(buf)` is the base address of a
/// buffer.
///
/// # Safety
/// `g` must have passed `exec::check_gemm` and [`check_f32`] against the buffers `ptr` points
/// to, which must be live and not accessed by anything else during the call.
pub unsafe fn run(g: &Gemm, blas: Option<&Blas>, ptr: impl Fn(usize) -> *mut u8) {
    let r = g.c.shape.len();
    let (m, n, k) = (g.m, g.n, g.k);
    let s = |v: &View, d: usize| v.strides[d] as isize;
    let (a, b, c) = (ptr(g.a.buf).cast::<f32>(), ptr(g.b.buf).cast::<f32>(), ptr(g.c.buf).cast::<f32>());
    let par = if m * n * k >= PAR_MIN_FLOPS { Parallelism::Rayon(0) } else { Parallelism::None };
    for i in 0..g.batch() {
        let [oa, ob, oc] = batch_offsets(g, i);
        // SAFETY: `exec::check_gemm` proved every element of every view (all batch elements included) lies
        // inside its f32 buffer, and that c's elements are distinct and in a buffer of their own,
        // so the writes alias neither each other nor the operands; the caller guarantees the
        // buffers are live and otherwise untouched.
        unsafe {
            let cp = c.add(oc);
            if k == 0 {
                // an empty sum: zeros, or c unchanged when accumulating
                if !g.accumulate {
                    for (ii, jj) in (0..m).flat_map(|ii| (0..n).map(move |jj| (ii, jj))) {
                        *cp.offset(ii as isize * s(&g.c, r - 2) + jj as isize * s(&g.c, r - 1)) = 0.0;
                    }
                }
            } else if m * n * k >= BLAS_MIN_FLOPS
                && blas.is_some_and(|bl| {
                    bl.sgemm(
                        m,
                        n,
                        k,
                        g.alpha as f32,
                        g.accumulate,
                        (a.add(oa), g.a.strides[r - 2], g.a.strides[r - 1]),
                        (b.add(ob), g.b.strides[r - 2], g.b.strides[r - 1]),
                        (cp, g.c.strides[r - 2], g.c.strides[r - 1]),
                    )
                })
            {
                // OpenBLAS did it
            } else {
                // gemm computes dst = alpha dst + beta (lhs @ rhs), reading dst only if asked
                gemm::gemm(
                    m,
                    n,
                    k,
                    cp,
                    s(&g.c, r - 1),
                    s(&g.c, r - 2),
                    g.accumulate,
                    a.add(oa),
                    s(&g.a, r - 1),
                    s(&g.a, r - 2),
                    b.add(ob),
                    s(&g.b, r - 1),
                    s(&g.b, r - 2),
                    1.0f32,
                    g.alpha as f32,
                    false,
                    false,
                    false,
                    par,
                );
            }
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
