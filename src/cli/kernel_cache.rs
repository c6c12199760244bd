//! `--kernel-cache DIR` and `--no-kernel-cache`, as `qatc compile`, `train`, `eval` and `prt`
//! take them: where compiled kernels are kept between runs (NVRTC's CUBINs under `DIR/`, the CPU
//! backend's object code under `DIR/cpu/`). The one place the directory is resolved: the flag,
//! else `$XDG_CACHE_HOME/qatc`, else `~/.cache/qatc`; the libraries below take it as a value.

use std::path::PathBuf;

#[derive(clap::Args, Debug, Clone, Default)]
pub struct KernelCacheArgs {
    /// Where compiled kernels are kept between runs (default: $XDG_CACHE_HOME/qatc, else
    /// ~/.cache/qatc).
    #[arg(long, value_name = "DIR")]
    pub kernel_cache: Option<PathBuf>,
    /// Keep no compiled kernel on disk: compile every kernel (once per process).
    #[arg(long, conflicts_with = "kernel_cache")]
    pub no_kernel_cache: bool,
}

impl KernelCacheArgs {
    /// The cache directory these flags name, or None (with a note when no default exists).
    pub fn dir(&self) -> Option<PathBuf> {
        if self.no_kernel_cache {
            return None;
        }
        let dir = self.kernel_cache.clone().or_else(default_cache_dir);
        if dir.is_none() {
            eprintln!("note: no kernel cache (neither --kernel-cache, XDG_CACHE_HOME nor HOME is set): compiling everything");
        }
        dir
    }
}

/// The default cache directory, resolved the XDG way.
pub fn default_cache_dir() -> Option<PathBuf> {
    let xdg = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()).map(PathBuf::from).filter(|p| p.is_absolute());
    xdg.or_else(|| std::env::var_os("HOME").filter(|v| !v.is_empty()).map(|h| PathBuf::from(h).join(".cache"))).map(|d| d.join("qatc"))
}
