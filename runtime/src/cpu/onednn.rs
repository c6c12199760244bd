//! oneDNN's `dnnl_gemm_bf16bf16f32`, loaded at run time when the library is on the machine
//! (`make` installs Debian's libdnnl2): bf16 operands, f32 accumulation and f32 result, what
//! `GemmTypes` says a bf16 GEMM computes. Where the CPU has bf16 dot products (AVX512-BF16's
//! `vdpbf16ps`; AMX CPUs have them too) it runs them on the stored 16-bit operands, about twice the
//! f32 GEMM's rate (bench/RESULTS.md: 0.83-0.99 TFLOP/s against OpenBLAS's 0.41-0.47 on the step's
//! shapes, 2 Zen 5 cores), where the fallback (`gemm_half.rs`) widens them to f32 tiles first.
//!
//! On a CPU with AMX-BF16 the products go to the library's matmul primitive instead
//! (`onednn_matmul.rs`): this GEMM function never runs on AMX tiles.
//!
//! The same library's f32 GEMM runs the attention's small per-head products on one thread each
//! (`attn_gemm.rs`), where it loads.
//!
//! Chosen over writing qatc's own `vdpbf16ps` microkernels because it is the library PyTorch's
//! bf16 autocast itself calls on the CPU (the peer to beat runs the same GEMMs), it already
//! packs, blocks, threads and picks its kernels for the CPU by itself, and loading it keeps one binary
//! for every machine. Used only where the library reports a bf16 ISA
//! (`dnnl_get_effective_cpu_isa`): elsewhere oneDNN would emulate bf16, and the widening path
//! with OpenBLAS is the measured one there.

use std::sync::{Arc, Mutex};

use libloading::Library;

use super::onednn_matmul::{Matmul, Out, Shape};

/// dnnl_gemm_bf16bf16f32(transa, transb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc): row-major.
type GemmBf16 = unsafe extern "C" fn(u8, u8, i64, i64, i64, f32, *const u16, i64, *const u16, i64, f32, *mut f32, i64) -> i32;
/// dnnl_sgemm(transa, transb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc): row-major f32.
type Sgemm = unsafe extern "C" fn(u8, u8, i64, i64, i64, f32, *const f32, i64, *const f32, i64, f32, *mut f32, i64) -> i32;
/// dnnl_get_effective_cpu_isa()
type EffectiveIsa = unsafe extern "C" fn() -> i32;
/// omp_set_num_threads(n), of the OpenMP runtime oneDNN threads with (the calling thread's setting)
type SetThreads = unsafe extern "C" fn(i32);

/// Products with fewer multiply-adds than this, or a K shorter than `ONE_THREAD_K`, run on one
/// thread: waking OpenMP's second thread costs more than it saves. Measured on the step's shapes
/// (2 Zen 5 cores, passive waiting): 256x768x128 takes the same on one or two, 256x2304x64 and
/// 256x3072x32 15-20% longer on two, 256x768x256 30% shorter.
const ONE_THREAD_MACS: usize = 1 << 25;
const ONE_THREAD_K: usize = 128;

/// The library the CPU executor loads unless told otherwise (Debian 12's oneDNN 2.6).
pub const ONEDNN: &str = "libdnnl.so.2";

/// `dnnl_cpu_isa_avx512_core_bf16`'s bits: every ISA that has them (AMX's included) runs bf16
/// dot products natively.
const ISA_BF16: i32 = 0xe7;
/// `dnnl_cpu_isa_avx512_core_amx`'s bits.
const ISA_AMX: i32 = 0x3e7;

/// oneDNN's bf16 GEMM, on a CPU where it runs natively; and its f32 GEMM, for the attention's
/// small per-head products (`attn_gemm.rs`).
pub struct Bf16Gemm {
    gemm: GemmBf16,
    sgemm: Sgemm,
    set_threads: Option<SetThreads>,
    /// The matmul primitive, on a CPU with AMX-BF16 (onednn_matmul.rs); the GEMM function above
    /// runs what it does not take.
    matmul: Option<Matmul>,
    /// The library's file name, and the units it runs on ("AVX512-BF16" or "AMX-BF16").
    pub name: String,
    pub units: &'static str,
    _lib: Library,
}

/// The library of that name, loaded once per process and name; None when it cannot be loaded,
/// lacks the function, or the CPU has no bf16 units.
pub fn load(name: &str) -> Option<Arc<Bf16Gemm>> {
    static LOADED: super::blas::Loaded<Bf16Gemm> = Mutex::new(Vec::new());
    super::blas::load_once(&LOADED, name, open)
}

fn open(name: &str) -> Option<Bf16Gemm> {
    // SAFETY: loading oneDNN runs its initializers, as linking it would.
    let lib = unsafe { Library::new(name) }.ok()?;
    // SAFETY: the symbols are looked up with the signatures of oneDNN's dnnl.h.
    unsafe {
        let gemm: GemmBf16 = *lib.get::<GemmBf16>(b"dnnl_gemm_bf16bf16f32\0").ok()?;
        let sgemm: Sgemm = *lib.get::<Sgemm>(b"dnnl_sgemm\0").ok()?;
        let isa: EffectiveIsa = *lib.get::<EffectiveIsa>(b"dnnl_get_effective_cpu_isa\0").ok()?;
        let isa = isa();
        if isa & ISA_BF16 != ISA_BF16 {
            return None;
        }
        let units = if isa & ISA_AMX == ISA_AMX { "AMX-BF16" } else { "AVX512-BF16" };
        // found among the library's dependencies (libgomp), when it threads with OpenMP
        let set_threads = lib.get::<SetThreads>(b"omp_set_num_threads\0").ok().map(|f| *f);
        let matmul = if units == "AMX-BF16" { Matmul::open(&lib) } else { None };
        Some(Bf16Gemm { gemm, sgemm, set_threads, matmul, name: name.to_string(), units, _lib: lib })
    }
}

/// Whether the library of that name runs bf16 GEMMs on AMX tiles here (its matmul primitive):
/// where `--precision auto` picks bf16.
pub fn bf16_runs_on_amx(name: &str) -> bool {
    load(name).is_some_and(|l| l.on_amx())
}

/// A bf16 matrix in memory: base address, row stride, column stride (elements).
pub type MatBf16 = (*const u16, usize, usize);

/// A oneDNN operand: (transpose flag, leading dimension).
fn operand(rows: usize, cols: usize, rs: usize, cs: usize) -> Option<(u8, i64)> {
    super::blas::row_major(rows, cols, rs, cs).map(|(t, ld)| (if t { b'T' } else { b'N' }, ld as i64))
}

/// One call's arguments as the library takes them (row-major, c possibly transposed into it).
struct Call<T> {
    m: i64,
    n: i64,
    ta: u8,
    lda: i64,
    tb: u8,
    ldb: i64,
    ldc: i64,
    a: *const T,
    b: *const T,
}

/// The call computing c = a @ b on these strides, if the library takes them: c's rows or its
/// columns contiguous (a column-major c is computed as c^T = b^T @ a^T), each operand's too.
#[allow(clippy::type_complexity)]
fn layout<T>(
    (m, n, k): (usize, usize, usize),
    a: (*const T, usize, usize),
    b: (*const T, usize, usize),
    c: (usize, usize),
) -> Option<Call<T>> {
    if m == 0 || n == 0 || k == 0 {
        return None;
    }
    let ((m, n), (a, b), c) =
        if c.1 != 1 && c.0 == 1 { ((n, m), ((b.0, b.2, b.1), (a.0, a.2, a.1)), (c.1, c.0)) } else { ((m, n), (a, b), c) };
    let ldc = if c.1 == 1 && c.0 >= n {
        c.0
    } else if m == 1 && c.1 == 1 {
        n
    } else {
        return None;
    };
    let (ta, lda) = operand(m, k, a.1, a.2)?;
    let (tb, ldb) = operand(k, n, b.1, b.2)?;
    Some(Call { m: m as i64, n: n as i64, ta, lda, tb, ldb, ldc: ldc as i64, a: a.0, b: b.0 })
}

/// The matmul primitive's view of a row-major call.
fn primitive_shape(l: &Call<u16>, k: usize, threads: i32, alpha: f32, accumulate: bool, out: Out) -> Shape {
    let strides = |t: u8, ld: i64| if t == b'N' { (ld as usize, 1) } else { (1, ld as usize) };
    Shape {
        mnk: (l.m as usize, l.n as usize, k),
        a: strides(l.ta, l.lda),
        b: strides(l.tb, l.ldb),
        c: (l.ldc as usize, 1),
        threads,
        alpha: alpha.to_bits(),
        accumulate,
        out,
    }
}

/// The OpenMP threads a product of these sizes runs on (`ONE_THREAD_MACS`, `ONE_THREAD_K`).
fn threads_for((m, n, k): (usize, usize, usize)) -> i32 {
    if m * n * k < ONE_THREAD_MACS || k < ONE_THREAD_K {
        1
    } else {
        rayon::current_num_threads().max(1) as i32
    }
}

impl Bf16Gemm {
    /// Calls the matmul primitive completed into bf16 results (0 without it).
    #[cfg(test)]
    pub fn primitive_runs_into_bf16(&self) -> usize {
        self.matmul.as_ref().map_or(0, Matmul::runs_into_bf16)
    }

    /// Whether the bf16 products run on AMX tiles (the matmul primitive).
    pub fn on_amx(&self) -> bool {
        self.matmul.is_some()
    }

    /// Which of the library's bf16 paths runs the large products: "matmul primitive" (AMX) or
    /// "GEMM function".
    pub fn path(&self) -> &'static str {
        if self.matmul.is_some() {
            "matmul primitive"
        } else {
            "GEMM function"
        }
    }

    /// Whether [`Bf16Gemm::gemm`] takes a product of these sizes and strides (c's row and column
    /// strides); a sub-block of a matrix it takes is taken too (the same strides, fewer rows or
    /// columns).
    pub fn takes(&self, mnk: (usize, usize, usize), a: MatBf16, b: MatBf16, c: (usize, usize)) -> bool {
        layout(mnk, a, b, c).is_some()
    }

    /// Sets the calling thread's OpenMP thread count for a product of these sizes
    /// ([`threads_for`]) and returns it.
    fn use_threads_for(&self, mnk: (usize, usize, usize)) -> i32 {
        self.use_threads(threads_for(mnk))
    }

    /// Sets the calling thread's OpenMP thread count and returns it.
    fn use_threads(&self, threads: i32) -> i32 {
        if let Some(set) = self.set_threads {
            // SAFETY: sets the calling thread's OpenMP thread count for its next parallel regions.
            unsafe { set(threads) };
        }
        threads
    }

    /// c = alpha a @ b (+ c when `accumulate`) on bf16 a [m, k] and b [k, n] into f32 c [m, n];
    /// false (nothing done) when the layout is not one the library takes ([`Bf16Gemm::takes`])
    /// or the library refuses the call.
    ///
    /// # Safety
    /// The pointers and strides must describe live, in-bounds matrices, c's elements distinct and
    /// apart from a's and b's, and nothing else may access c meanwhile.
    pub unsafe fn gemm(
        &self,
        mnk: (usize, usize, usize),
        alpha: f32,
        accumulate: bool,
        a: MatBf16,
        b: MatBf16,
        c: (*mut f32, usize, usize),
    ) -> bool {
        let threads = self.use_threads_for(mnk);
        // SAFETY: the caller's contract.
        unsafe { self.gemm_on(threads, mnk, alpha, accumulate, a, b, c) }
    }

    /// [`Bf16Gemm::gemm`] on the calling thread alone: the attention's per-head products over
    /// bf16 heads (`attn_gemm.rs`), which rayon's threads run side by side, each on its own
    /// primitives on AMX (onednn_matmul.rs).
    ///
    /// # Safety
    /// As [`Bf16Gemm::gemm`].
    pub unsafe fn gemm_one_thread(
        &self,
        mnk: (usize, usize, usize),
        alpha: f32,
        accumulate: bool,
        a: MatBf16,
        b: MatBf16,
        c: (*mut f32, usize, usize),
    ) -> bool {
        let threads = self.use_threads(1);
        // SAFETY: the caller's contract.
        unsafe { self.gemm_on(threads, mnk, alpha, accumulate, a, b, c) }
    }

    /// [`Bf16Gemm::gemm`] on `threads` OpenMP threads (the calling thread's count, set).
    ///
    /// # Safety
    /// As [`Bf16Gemm::gemm`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm_on(
        &self,
        threads: i32,
        mnk: (usize, usize, usize),
        alpha: f32,
        accumulate: bool,
        a: MatBf16,
        b: MatBf16,
        c: (*mut f32, usize, usize),
    ) -> bool {
        let Some(l) = layout(mnk, a, b, (c.1, c.2)) else { return false };
        let beta = if accumulate { 1.0 } else { 0.0 };
        if let Some(mm) = &self.matmul {
            let s = primitive_shape(&l, mnk.2, threads, alpha, accumulate, Out::F32);
            // SAFETY: the caller's contract; `s` states the same matrices as `l`.
            if unsafe { mm.run(&s, l.a, l.b, c.0.cast(), std::ptr::null()) } {
                return true;
            }
        }
        // SAFETY: the caller's contract; the library reads a and b and writes c within the
        // leading dimensions `layout` checked against the strides.
        let status = unsafe { (self.gemm)(l.ta, l.tb, l.m, l.n, mnk.2 as i64, alpha, l.a, l.lda, l.b, l.ldb, beta, c.0, l.ldc) };
        status == 0
    }

    /// c = round(alpha a @ b + bias (+ c when `accumulate`)) on bf16 a [m, k] and b [k, n] into
    /// a bf16 c [m, n] whose rows are contiguous, the f32 sum rounded once to nearest even by the
    /// matmul primitive (AMX only), the f32 bias row [n] added before. False, nothing written,
    /// without the primitive, for a layout it does not take, or with both a bias and an alpha
    /// other than 1 (the primitive's order of the two is not `GemmTypes`'s).
    ///
    /// # Safety
    /// As [`Bf16Gemm::gemm`], c bf16; `bias` [n] f32 when given.
    #[allow(clippy::too_many_arguments)] // `gemm`'s arguments and the bias row
    pub unsafe fn gemm_bf16_out(
        &self,
        mnk: (usize, usize, usize),
        alpha: f32,
        accumulate: bool,
        a: MatBf16,
        b: MatBf16,
        bias: Option<*const f32>,
        c: (*mut u16, usize, usize),
    ) -> bool {
        let Some(mm) = &self.matmul else { return false };
        if c.2 != 1 || (bias.is_some() && alpha != 1.0) {
            return false;
        }
        let Some(l) = layout(mnk, a, b, (c.1, c.2)) else { return false };
        let threads = self.use_threads_for(mnk);
        let s = primitive_shape(&l, mnk.2, threads, alpha, accumulate, Out::Bf16 { bias: bias.is_some() });
        // SAFETY: the caller's contract; with c's columns contiguous `layout` kept the call as
        // stated, so `s` describes a, b, c and the bias row as given.
        unsafe { mm.run(&s, l.a, l.b, c.0.cast(), bias.unwrap_or(std::ptr::null())) }
    }

    /// c = alpha a @ b (+ c when `accumulate`) in f32 on the calling thread alone: the
    /// attention's per-head products, which rayon's threads run side by side. oneDNN's AVX-512
    /// kernels against the gemm crate's AVX2 ones (it needs a nightly compiler for AVX-512):
    /// 124M's attention backward at B 1, T 256 took 27 ms instead of 48, its forward 8 instead
    /// of 11. False, nothing done, when the layout is not one the library takes.
    ///
    /// # Safety
    /// As [`Bf16Gemm::gemm`], on f32 matrices.
    #[allow(clippy::type_complexity)]
    pub unsafe fn sgemm_one_thread(
        &self,
        mnk: (usize, usize, usize),
        alpha: f32,
        accumulate: bool,
        a: (*const f32, usize, usize),
        b: (*const f32, usize, usize),
        c: (*mut f32, usize, usize),
    ) -> bool {
        let Some(l) = layout(mnk, a, b, (c.1, c.2)) else { return false };
        let beta = if accumulate { 1.0 } else { 0.0 };
        self.use_threads(1);
        // SAFETY: as in `gemm`.
        let status = unsafe { (self.sgemm)(l.ta, l.tb, l.m, l.n, mnk.2 as i64, alpha, l.a, l.lda, l.b, l.ldb, beta, c.0, l.ldc) };
        status == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// bf16 bits of small integers (exact).
    fn bf(x: f32) -> u16 {
        (x.to_bits() >> 16) as u16
    }

    /// A column-major c (rows contiguous) is computed as its transpose; a transposed a and an
    /// accumulating call too. Small integers: every sum is exact.
    #[test]
    fn products_on_every_layout_it_takes() {
        let Some(lib) = load(ONEDNN) else {
            eprintln!("SKIPPED: oneDNN or the CPU's bf16 units missing");
            return;
        };
        let (m, n, k) = (3, 5, 4);
        let a: Vec<u16> = (0..m * k).map(|i| bf((i % 7) as f32 - 3.0)).collect(); // [m, k] row-major
        let at: Vec<u16> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect(); // the same, stored [k, m]
        let b: Vec<u16> = (0..k * n).map(|i| bf((i % 5) as f32 - 2.0)).collect(); // [k, n]
        let f = |x: u16| f32::from_bits(u32::from(x) << 16);
        let want = |i: usize, j: usize| (0..k).map(|p| f(a[i * k + p]) * f(b[p * n + j])).sum::<f32>();
        let b_mat = (b.as_ptr(), n, 1);
        for (a_mat, c_col_major) in [((a.as_ptr(), k, 1), false), ((at.as_ptr(), 1, m), false), ((a.as_ptr(), k, 1), true)] {
            let mut c = vec![1f32; m * n];
            let cs = if c_col_major { (1, m) } else { (n, 1) };
            assert!(lib.takes((m, n, k), a_mat, b_mat, cs));
            // SAFETY: the matrices are the vectors above, in bounds for these strides.
            assert!(unsafe { lib.gemm((m, n, k), 2.0, true, a_mat, b_mat, (c.as_mut_ptr(), cs.0, cs.1)) });
            for i in 0..m {
                for j in 0..n {
                    assert_eq!(c[i * cs.0 + j * cs.1], 1.0 + 2.0 * want(i, j), "({i}, {j}), c column-major {c_col_major}");
                }
            }
        }
        // strides with no unit dimension are refused
        assert!(!lib.takes((m, n, k), (a.as_ptr(), 2 * k, 2), b_mat, (n, 1)));
    }

    /// On a CPU with AMX-BF16 the products go to the matmul primitive's brgemm kernels, not the
    /// GEMM function: b transposed (the LM head's layout), alpha and accumulation included, every
    /// value exact (small integers). Elsewhere there is no primitive, and nothing to check.
    #[test]
    fn amx_products_run_on_the_matmul_primitive() {
        let Some(lib) = load(ONEDNN) else {
            eprintln!("SKIPPED: oneDNN or the CPU's bf16 units missing");
            return;
        };
        let Some(mm) = lib.matmul.as_ref() else {
            assert_ne!(lib.units, "AMX-BF16", "AMX-BF16 without the matmul primitive");
            eprintln!("SKIPPED: no AMX-BF16 ({})", lib.units);
            return;
        };
        let (m, n, k) = (64, 96, 128);
        let a: Vec<u16> = (0..m * k).map(|i| bf((i % 5) as f32 - 2.0)).collect(); // [m, k]
        let bt: Vec<u16> = (0..n * k).map(|i| bf((i % 3) as f32 - 1.0)).collect(); // b^T, [n, k]
        let f = |x: u16| f32::from_bits(u32::from(x) << 16);
        let mut c: Vec<f32> = (0..m * n).map(|i| (i % 4) as f32).collect();
        let c0 = c.clone();
        let (a_mat, b_mat) = ((a.as_ptr(), k, 1), (bt.as_ptr(), 1, k));
        // SAFETY: the matrices are the vectors above, in bounds for these strides.
        assert!(unsafe { lib.gemm((m, n, k), 0.5, true, a_mat, b_mat, (c.as_mut_ptr(), n, 1)) });
        let l = layout((m, n, k), a_mat, b_mat, (n, 1)).expect("a layout the library takes");
        let s = primitive_shape(&l, k, threads_for((m, n, k)), 0.5, true, Out::F32);
        let (imp, runs) = mm.implementation(&s).expect("the primitive was made for the product");
        assert!(imp.contains("amx"), "oneDNN chose {imp}");
        assert_eq!(runs, 1, "the product ran on the matmul primitive");
        for i in 0..m {
            for j in 0..n {
                let want = c0[i * n + j] + 0.5 * (0..k).map(|p| f(a[i * k + p]) * f(bt[j * k + p])).sum::<f32>();
                assert_eq!(c[i * n + j], want, "({i}, {j})");
            }
        }
    }
}
