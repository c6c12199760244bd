//! Library GEMM steps on the CPU, through OpenBLAS when it is installed (`blas.rs`, large GEMMs)
//! and the `gemm` crate otherwise: c = alpha * a @ b (+ c), plus an
//! optional bias row, each operand read in place through its view's row and column strides (a
//! transposed operand costs nothing). Batch dims lead and are equal on a, b and c; each batch
//! element is one call.
//!
//! Every view is checked against its buffer once, when the program is built ([`check`]), so the
//! unchecked pointer arithmetic of [`run`] stays inside the allocations.

use gemm::Parallelism;
use qatc_ir::DType;
use qatc_kernels::program::{Buffer, Gemm, View};

use crate::exec::values::check_view;
use crate::error::RuntimeError;

/// Below this many multiply-adds a GEMM runs on the calling thread: splitting costs more.
const PAR_MIN_FLOPS: usize = 1 << 16;

/// From this many multiply-adds on, OpenBLAS (when loaded, `blas.rs`) takes the GEMM: below it
/// its thread start-up is not repaid.
const BLAS_MIN_FLOPS: usize = 1 << 20;

fn err(g: &Gemm, msg: String) -> RuntimeError {
    RuntimeError::Gemm { note: g.note.clone(), msg }
}

/// No two elements of `v` share an address (a GEMM's destination must not).
fn distinct_elements(v: &View) -> bool {
    let mut dims: Vec<(usize, usize)> = v.shape.iter().zip(&v.strides).filter(|(&d, _)| d > 1).map(|(&d, &s)| (s, d)).collect();
    dims.sort_unstable();
    let mut span = 0; // elements spanned by the dims so far, minus one
    for (s, d) in dims {
        if s <= span {
            return false;
        }
        span += (d - 1) * s;
    }
    true
}

/// Checks a GEMM step against the program's buffers: f32 operands of matching shapes, views
/// inside their buffers, a destination that overlaps neither itself nor an operand's buffer.
pub fn check(g: &Gemm, bufs: &[Buffer]) -> Result<(), RuntimeError> {
    let buf = |v: &View, what: &str| -> Result<&Buffer, RuntimeError> {
        let b = bufs.get(v.buf).ok_or_else(|| err(g, format!("{what} is in buffer {} of {}", v.buf, bufs.len())))?;
        if b.dtype != DType::F32 {
            return Err(err(g, format!("{what} ({}) is {}: the CPU GEMM is f32 only", b.name, b.dtype)));
        }
        check_view(b, v, what)?;
        Ok(b)
    };
    buf(&g.a, "a")?;
    buf(&g.b, "b")?;
    buf(&g.c, "c")?;
    let r = g.c.shape.len();
    if r < 2 || g.a.shape.len() != r || g.b.shape.len() != r {
        return Err(err(g, format!("ranks of a {:?}, b {:?}, c {:?}", g.a.shape, g.b.shape, g.c.shape)));
    }
    let batch = &g.c.shape[..r - 2];
    let want = |v: &View, rows: usize, cols: usize| v.shape[..r - 2] == *batch && v.shape[r - 2..] == [rows, cols];
    if !(want(&g.a, g.m, g.k) && want(&g.b, g.k, g.n) && want(&g.c, g.m, g.n)) {
        return Err(err(
            g,
            format!("a {:?} @ b {:?} -> c {:?} is not [.., {}, {}] @ [.., {}, {}]", g.a.shape, g.b.shape, g.c.shape, g.m, g.k, g.k, g.n),
        ));
    }
    if g.c.buf == g.a.buf || g.c.buf == g.b.buf || !distinct_elements(&g.c) {
        return Err(err(g, "the destination overlaps itself or an operand".into()));
    }
    if let Some(bias) = &g.bias {
        buf(bias, "bias")?;
        if bias.shape != [g.n] || bias.buf == g.c.buf {
            return Err(err(g, format!("bias of shape {:?} for {} columns", bias.shape, g.n)));
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

/// Runs one GEMM step. `ptr(buf)` is the base address of a buffer.
///
/// # Safety
/// `g` must have passed [`check`] against the buffers `ptr` points to, which must be live and
/// not accessed by anything else during the call.
pub unsafe fn run(g: &Gemm, ptr: impl Fn(usize) -> *mut u8) {
    let r = g.c.shape.len();
    let (m, n, k) = (g.m, g.n, g.k);
    let s = |v: &View, d: usize| v.strides[d] as isize;
    let (a, b, c) = (ptr(g.a.buf).cast::<f32>(), ptr(g.b.buf).cast::<f32>(), ptr(g.c.buf).cast::<f32>());
    let par = if m * n * k >= PAR_MIN_FLOPS { Parallelism::Rayon(0) } else { Parallelism::None };
    for i in 0..g.batch() {
        let [oa, ob, oc] = batch_offsets(g, i);
        // SAFETY: `check` proved every element of every view (all batch elements included) lies
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
                && super::blas::get().is_some_and(|bl| {
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
