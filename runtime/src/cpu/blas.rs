//! OpenBLAS's `cblas_sgemm`, loaded at run time when the library is on the machine (`make`
//! installs Debian's libopenblas0-pthread). Its AVX-512 kernels are about twice as fast as the
//! gemm crate's AVX2 ones (which need a nightly compiler for AVX-512), and the GEMMs are most of a
//! CPU step. Loading, not linking: a machine without OpenBLAS builds and runs the same binary on
//! the gemm crate. Which library (or none) is `CpuOptions::blas`.
//!
//! A product of one row (a decode step of `qatc generate`: every linear and the LM head at M = 1)
//! goes to `cblas_sgemv`: OpenBLAS before 0.3.27 (Debian 12 has 0.3.21) runs an M = 1 sgemm
//! through its GEMM path, packing all of B on every call, which made the 124M model's LM head take
//! 83 ms a token on this VM where reading its 154 MB once takes about 30.

use std::sync::{Arc, Mutex};

use libloading::Library;

/// cblas_sgemm(order, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
type Sgemm = unsafe extern "C" fn(i32, i32, i32, i32, i32, i32, f32, *const f32, i32, *const f32, i32, f32, *mut f32, i32);
/// cblas_sgemv(order, trans, m, n, alpha, a, lda, x, incx, beta, y, incy)
type Sgemv = unsafe extern "C" fn(i32, i32, i32, i32, f32, *const f32, i32, *const f32, i32, f32, *mut f32, i32);
type SetThreads = unsafe extern "C" fn(i32);

/// The library the CPU executor loads unless told otherwise.
pub const OPENBLAS: &str = "libopenblas.so.0";

pub struct Blas {
    sgemm: Sgemm,
    sgemv: Option<Sgemv>,
    pub name: String,
    _lib: Library,
}

const ROW_MAJOR: i32 = 101;
const NO_TRANS: i32 = 111;
const TRANS: i32 = 112;

/// The library of that name (a file name the dynamic loader finds, or a path), loaded once per
/// process and name; None when it cannot be loaded or has no `cblas_sgemm`.
pub fn load(name: &str) -> Option<Arc<Blas>> {
    static LOADED: Loaded<Blas> = Mutex::new(Vec::new());
    load_once(&LOADED, name, open)
}

/// The libraries of one kind loaded so far, by name (None: it did not load).
pub(super) type Loaded<T> = Mutex<Vec<(String, Option<Arc<T>>)>>;

/// The library `name` as `open` makes it, opened once per process and name (a failure too).
pub(super) fn load_once<T>(loaded: &Loaded<T>, name: &str, open: impl FnOnce(&str) -> Option<T>) -> Option<Arc<T>> {
    let mut loaded = loaded.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, b)) = loaded.iter().find(|(n, _)| n == name) {
        return b.clone();
    }
    let b = open(name).map(Arc::new);
    loaded.push((name.to_string(), b.clone()));
    b
}

/// The kernel set OpenBLAS should use on this CPU, for its `OPENBLAS_CORETYPE` variable: OpenBLAS
/// picks its kernels from the CPU model, and on a VM whose model it does not know it falls back
/// to Prescott's SSE3 kernels (seen here: 6x slower than SkylakeX's). The variable is read when
/// the library loads, and is process-wide: the `qatc` binary sets it in `main`, before any thread
/// starts, unless the user did.
pub fn openblas_core_type() -> Option<&'static str> {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vl") {
            return Some("SkylakeX");
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return Some("Haswell");
        }
    }
    None
}

fn open(name: &str) -> Option<Blas> {
    // SAFETY: loading OpenBLAS runs its initializers (thread pool set-up), as linking it would.
    let lib = unsafe { Library::new(name) }.ok()?;
    // SAFETY: the symbols are looked up with the signatures of cblas.h / OpenBLAS's openblas_config.h.
    unsafe {
        let sgemm: Sgemm = *lib.get::<Sgemm>(b"cblas_sgemm\0").ok()?;
        let sgemv = lib.get::<Sgemv>(b"cblas_sgemv\0").ok().map(|f| *f);
        if let Ok(set) = lib.get::<SetThreads>(b"openblas_set_num_threads\0") {
            // as many threads as the kernels get: the two never run at once
            set(rayon::current_num_threads() as i32);
        }
        Some(Blas { sgemm, sgemv, name: name.to_string(), _lib: lib })
    }
}

/// A matrix of `rows x cols` on these strides as a row-major BLAS-style library reads it:
/// (stored transposed, leading dimension), if its strides allow one (one of them 1, the other at
/// least the row length). CBLAS and oneDNN's GEMMs both take it.
pub(super) fn row_major(rows: usize, cols: usize, rs: usize, cs: usize) -> Option<(bool, usize)> {
    if cs == 1 && rs >= cols.max(1) {
        Some((false, rs))
    } else if rs == 1 && cs >= rows.max(1) {
        Some((true, cs))
    } else if rows == 1 && cs == 1 {
        Some((false, cols.max(1)))
    } else {
        None
    }
}

/// A CBLAS operand: (transpose flag, leading dimension).
fn operand(rows: usize, cols: usize, rs: usize, cs: usize) -> Option<(i32, i32)> {
    row_major(rows, cols, rs, cs).map(|(t, ld)| (if t { TRANS } else { NO_TRANS }, ld as i32))
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
        if let Some(sgemv) = self.sgemv.filter(|_| m == 1 && a.2 >= 1 && c.2 >= 1) {
            // c [1, n] = a [1, k] @ b [k, n]: y = B^T x for B stored [k, n], y = B' x for B
            // stored transposed as B' [n, k] (the tied LM head's wte); x and y strided
            let (trans, rows, cols) = if tb == NO_TRANS { (TRANS, k, n) } else { (NO_TRANS, n, k) };
            // SAFETY: the caller's contract; B is the matrix `operand` checked (rows x cols with
            // leading dimension ldb), x holds k elements a.2 apart and y n elements c.2 apart.
            unsafe { sgemv(ROW_MAJOR, trans, rows as i32, cols as i32, alpha, b.0, ldb, a.0, a.2 as i32, beta, c.0, c.2 as i32) };
            return true;
        }
        // SAFETY: the caller's contract; CBLAS reads a and b and writes c within the given
        // leading dimensions, which `operand` checked against the strides.
        unsafe { (self.sgemm)(ROW_MAJOR, ta, tb, m as i32, n as i32, k as i32, alpha, a.0, lda, b.0, ldb, beta, c.0, ldc as i32) };
        true
    }
}
