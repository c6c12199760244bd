//! OpenBLAS's `cblas_sgemm`, loaded at run time when the library is on the machine (`make`
//! installs Debian's libopenblas0-pthread). Its AVX-512 kernels are about twice as fast as the
//! gemm crate's AVX2 ones (which need a nightly compiler for AVX-512), and the GEMMs are most of a
//! CPU step. Loading, not linking: a machine without OpenBLAS builds and runs the same binary on
//! the gemm crate. `QATC_BLAS=off` turns it off (to compare), `QATC_BLAS_LIB=PATH` picks a library.

use std::sync::OnceLock;

use libloading::Library;

/// cblas_sgemm(order, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
type Sgemm = unsafe extern "C" fn(i32, i32, i32, i32, i32, i32, f32, *const f32, i32, *const f32, i32, f32, *mut f32, i32);
type SetThreads = unsafe extern "C" fn(i32);

pub struct Blas {
    sgemm: Sgemm,
    pub name: String,
    _lib: Library,
}

const ROW_MAJOR: i32 = 101;
const NO_TRANS: i32 = 111;
const TRANS: i32 = 112;

/// The loaded library, once per process; None when there is none (or QATC_BLAS=off).
pub fn get() -> Option<&'static Blas> {
    static BLAS: OnceLock<Option<Blas>> = OnceLock::new();
    BLAS.get_or_init(load).as_ref()
}

fn load() -> Option<Blas> {
    if std::env::var("QATC_BLAS").is_ok_and(|v| v == "off") {
        return None;
    }
    let name = std::env::var("QATC_BLAS_LIB").unwrap_or_else(|_| "libopenblas.so.0".into());
    // OpenBLAS picks its kernels from the CPU model; on a VM whose model it does not know it falls
    // back to Prescott's SSE3 kernels (seen here: 6x slower than SkylakeX's). Name the kernel set
    // from the features instead, unless the user did. Set before the library loads, which reads it.
    #[cfg(target_arch = "x86_64")]
    if std::env::var_os("OPENBLAS_CORETYPE").is_none() {
        let core = if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vl") {
            Some("SkylakeX")
        } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            Some("Haswell")
        } else {
            None
        };
        if let Some(c) = core {
            std::env::set_var("OPENBLAS_CORETYPE", c);
        }
    }
    // SAFETY: loading OpenBLAS runs its initializers (thread pool set-up), as linking it would.
    let lib = unsafe { Library::new(&name) }.ok()?;
    // SAFETY: the symbols are looked up with the signatures of cblas.h / OpenBLAS's openblas_config.h.
    unsafe {
        let sgemm: Sgemm = *lib.get::<Sgemm>(b"cblas_sgemm\0").ok()?;
        if let Ok(set) = lib.get::<SetThreads>(b"openblas_set_num_threads\0") {
            // as many threads as the kernels get: the two never run at once
            set(rayon::current_num_threads() as i32);
        }
        Some(Blas { sgemm, name, _lib: lib })
    }
}

/// A row-major matrix operand for CBLAS: (transpose flag, leading dimension), if its strides
/// allow one (one of them 1, the other at least the row length).
fn operand(rows: usize, cols: usize, rs: usize, cs: usize) -> Option<(i32, i32)> {
    if cs == 1 && rs >= cols.max(1) {
        Some((NO_TRANS, rs as i32))
    } else if rs == 1 && cs >= rows.max(1) {
        Some((TRANS, cs as i32))
    } else if rows == 1 && cs == 1 {
        Some((NO_TRANS, cols.max(1) as i32))
    } else {
        None
    }
}

impl Blas {
    /// c = alpha a @ b (+ c when `accumulate`) on row/column strides; false (nothing done) when
    /// the layout or the sizes are not CBLAS's.
    ///
    /// # Safety
    /// The pointers and strides must describe live, in-bounds f32 matrices, c distinct from a and b.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn sgemm(
        &self,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        accumulate: bool,
        a: (*const f32, usize, usize),
        b: (*const f32, usize, usize),
        c: (*mut f32, usize, usize),
    ) -> bool {
        let fits = [m, n, k, a.1, a.2, b.1, b.2, c.1].iter().all(|&v| v < i32::MAX as usize);
        let (Some((ta, lda)), Some((tb, ldb))) = (operand(m, k, a.1, a.2), operand(k, n, b.1, b.2)) else { return false };
        let ldc = if c.2 == 1 && c.1 >= n.max(1) {
            c.1
        } else if m == 1 && c.2 == 1 {
            n.max(1)
        } else {
            return false;
        };
        if !fits || m == 0 || n == 0 || k == 0 {
            return false;
        }
        let beta = if accumulate { 1.0 } else { 0.0 };
        // SAFETY: the caller's contract; CBLAS reads a and b and writes c within the given
        // leading dimensions, which `operand` checked against the strides.
        unsafe { (self.sgemm)(ROW_MAJOR, ta, tb, m as i32, n as i32, k as i32, alpha, a.0, lda, b.0, ldb, beta, c.0, ldc as i32) };
        true
    }
}
