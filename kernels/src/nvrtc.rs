//! Compiling generated CUDA with NVRTC, loaded at run time through cudarc.
//!
//! cudarc panics when it cannot load the library, so nothing here calls into it before
//! `is_culib_present` said yes. The library is found by the names cudarc tries (`libnvrtc.so`,
//! `libnvrtc.so.13`, `libnvrtc.so.12`, ...) on the loader's path, or at `QATC_NVRTC_LIB`: a path
//! to one `libnvrtc.so.*` that is loaded first, so the later lookup by soname finds it (this is
//! how the PyPI wheel `nvidia-cuda-nvrtc`, which `make test` installs, is used without touching
//! the loader's path).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::cuda::emit::{CudaKernel, HEADERS};
use crate::error::KernelError;

/// The GPU generations qatc compiles for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// Ampere (A100).
    Sm80,
    /// Hopper (H100, H200).
    Sm90,
}

impl Arch {
    pub const ALL: [Arch; 2] = [Arch::Sm80, Arch::Sm90];
    pub fn name(self) -> &'static str {
        match self {
            Arch::Sm80 => "sm_80",
            Arch::Sm90 => "sm_90",
        }
    }
}

/// The library given by path, held for the life of the process (cudarc keeps using it).
static PRELOADED: OnceLock<libloading::Library> = OnceLock::new();

/// A usable NVRTC.
#[derive(Debug)]
pub struct Nvrtc {
    pub version: (i32, i32),
}

impl Nvrtc {
    /// Finds NVRTC: `QATC_NVRTC_LIB` when set, else the loader's search path.
    pub fn open() -> Result<Nvrtc, KernelError> {
        let from_env = std::env::var_os("QATC_NVRTC_LIB").filter(|v| !v.is_empty()).map(PathBuf::from);
        Nvrtc::open_with(from_env.as_deref())
    }

    pub fn open_with(lib: Option<&Path>) -> Result<Nvrtc, KernelError> {
        if let Some(path) = lib {
            if PRELOADED.get().is_none() {
                // SAFETY: loading NVRTC runs only its ELF initializers, which have no
                // preconditions; the handle lives in a static, so the code stays mapped while
                // cudarc calls into it.
                let l = unsafe { libloading::Library::new(path) }
                    .map_err(|e| KernelError::NvrtcMissing(format!("QATC_NVRTC_LIB={}: {e}", path.display())))?;
                let _ = PRELOADED.set(l);
            }
        }
        // SAFETY: is_culib_present only tries to dlopen the candidate names and drops what it
        // opened; it is the check that keeps the calls below from panicking.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(KernelError::NvrtcMissing(
                "libnvrtc.so(.13/.12) is not on the loader's path and QATC_NVRTC_LIB is not set \
                 (`make test` installs the PyPI wheel nvidia-cuda-nvrtc into .deps/ and sets it)"
                    .into(),
            ));
        }
        let (mut major, mut minor) = (0, 0);
        // SAFETY: the library is present (checked above); nvrtcVersion writes two ints through
        // valid pointers to locals.
        let rc = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
        if rc != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(KernelError::Nvrtc(format!("nvrtcVersion failed: {rc:?}")));
        }
        Ok(Nvrtc { version: (major, minor) })
    }

    /// The options every kernel compiles with.
    pub fn options(arch: Arch, include_dir: &Path) -> Vec<String> {
        vec![
            format!("--gpu-architecture={}", arch.name()),
            "--std=c++17".into(),
            "-default-device".into(),
            format!("--include-path={}", include_dir.display()),
        ]
    }

    /// Compiles one kernel to PTX. `source_path` is where its source was written, named in
    /// errors; `include_dir` holds the helper headers (see [`write_headers`]).
    pub fn compile(&self, k: &CudaKernel, arch: Arch, include_dir: &Path, source_path: &Path) -> Result<String, KernelError> {
        if k.source.contains('\0') {
            return Err(KernelError::Internal(format!("{}: source contains a NUL byte", k.name)));
        }
        let opts = cudarc::nvrtc::CompileOptions {
            options: Nvrtc::options(arch, include_dir),
            name: Some(format!("{}.cu", k.name)),
            ..Default::default()
        };
        match cudarc::nvrtc::compile_ptx_with_opts(&k.source, opts) {
            Ok(ptx) => Ok(ptx.to_src()),
            Err(cudarc::nvrtc::CompileError::CompileError { log, options, .. }) => Err(KernelError::Compile {
                name: k.name.clone(),
                arch: arch.name().into(),
                path: source_path.display().to_string(),
                log: format!("{}\noptions: {}", log.to_string_lossy().trim_end(), options.join(" ")),
            }),
            Err(e) => Err(KernelError::Nvrtc(format!("{}: {e:?}", k.name))),
        }
    }
}

/// Writes the helper headers into `dir` (generated sources include them by file name).
pub fn write_headers(dir: &Path) -> Result<(), KernelError> {
    let io = |source| KernelError::Io { path: dir.to_path_buf(), error: source };
    std::fs::create_dir_all(dir).map_err(io)?;
    for (name, text) in HEADERS {
        let p = dir.join(name);
        std::fs::write(&p, text).map_err(|source| KernelError::Io { path: p.clone(), error: source })?;
    }
    Ok(())
}
