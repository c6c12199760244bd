//! NVRTC for the tests that compile generated CUDA (no GPU needed): the library `make test`
//! installs, and a kernel cache under `target/` so a second run compiles nothing.

use std::path::PathBuf;

use qatc_kernels::nvrtc::{Arch, BuildOptions, BuildReport, CompiledKernel, KernelCache, Nvrtc};
use qatc_kernels::CudaKernel;

/// NVRTC, or None (with the reason printed) where there is none; CI must have it.
pub fn nvrtc() -> Option<Nvrtc> {
    // an explicit path wins; else the wheel `make test` installs; else the loader's path
    let wheel = super::root().join(".deps/nvrtc/nvidia/cu13/lib/libnvrtc.so.13");
    let from_env = std::env::var_os("QATC_NVRTC_LIB").filter(|v| !v.is_empty()).map(PathBuf::from);
    let lib = from_env.or_else(|| wheel.exists().then_some(wheel));
    match Nvrtc::open_with(lib.as_deref()) {
        Ok(n) => Some(n),
        // CI installs it (`make test`), so there a missing library is a failure, not a skip
        Err(e) if std::env::var_os("CI").is_some() => panic!("CI must have NVRTC: {e}"),
        Err(e) => {
            eprintln!("SKIPPED: {e}");
            None
        }
    }
}

/// The tests' kernel cache: kept between runs, like a user's.
pub fn test_cache() -> KernelCache {
    KernelCache::new(super::root().join("target/nvrtc-cache"))
}

/// The bound of every `for (init; VAR < BOUND; step)` in `source` that is not one operand: a
/// `?:`, comparison or logical operator outside parentheses, which C would bind to `VAR <`
/// first (`j < rank == 0 ? 1 : 0` loops forever). NVRTC accepts such text and the evaluator
/// runs the kernel IR, not the C, so only a GPU would find it: this reads every generated loop.
pub fn loose_loop_bounds(source: &str) -> Vec<String> {
    let mut bad = Vec::new();
    for line in source.lines().map(str::trim).filter(|l| l.starts_with("for (")) {
        let Some(cond) = line.split(';').nth(1) else { continue };
        let Some((_, bound)) = cond.split_once(" < ") else { continue };
        let (mut depth, mut loose) = (0i32, false);
        let b = bound.as_bytes();
        for (i, &c) in b.iter().enumerate() {
            match c {
                b'(' | b'[' => depth += 1,
                b')' | b']' => depth -= 1,
                b'?' | b'<' | b'>' | b'|' => loose |= depth == 0,
                b'=' | b'&' if b.get(i + 1) == Some(&c) => loose |= depth == 0,
                b'!' if b.get(i + 1) == Some(&b'=') => loose |= depth == 0,
                _ => {}
            }
        }
        if loose {
            bad.push(line.to_string());
        }
    }
    bad
}

/// Writes the sources to `target/nvrtc-kernels/<name>/` (so a failure names a file to open) and
/// builds every kernel for `arch` through `cache`; first, every loop bound must be one operand
/// ([`loose_loop_bounds`]).
pub fn build(
    nv: &Nvrtc,
    name: &str,
    kernels: &[CudaKernel],
    arch: Arch,
    cache: Option<&KernelCache>,
) -> (Vec<CompiledKernel>, BuildReport) {
    for k in kernels {
        let bad = loose_loop_bounds(&k.source);
        assert!(bad.is_empty(), "{name}: {}: a loop bound C would misparse: {bad:?}", k.name);
    }
    let dir = super::root().join("target/nvrtc-kernels").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    qatc_kernels::write_cuda(&dir, kernels).expect("sources written");
    let jobs = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let o = BuildOptions { arch, cache, jobs, source_dir: Some(&dir) };
    qatc_kernels::nvrtc::compile_cubins(nv, kernels, &o).unwrap_or_else(|e| panic!("{name}: {e}"))
}
