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

/// Writes the sources to `target/nvrtc-kernels/<name>/` (so a failure names a file to open) and
/// builds every kernel for `arch` through `cache`.
pub fn build(
    nv: &Nvrtc,
    name: &str,
    kernels: &[CudaKernel],
    arch: Arch,
    cache: Option<&KernelCache>,
) -> (Vec<CompiledKernel>, BuildReport) {
    let dir = super::root().join("target/nvrtc-kernels").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    qatc_kernels::write_cuda(&dir, kernels).expect("sources written");
    let jobs = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let o = BuildOptions { arch, cache, jobs, source_dir: Some(&dir) };
    qatc_kernels::nvrtc::compile_cubins(nv, kernels, &o).unwrap_or_else(|e| panic!("{name}: {e}"))
}
