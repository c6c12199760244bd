//! Compiling generated CUDA with NVRTC, loaded at run time through cudarc's bindings.
//!
//! cudarc panics when it cannot load the library, so nothing here calls into it before
//! `is_culib_present` said yes. The library is found by the names cudarc tries (`libnvrtc.so`,
//! `libnvrtc.so.13`, `libnvrtc.so.12`, ...) on the loader's path, or at `QATC_NVRTC_LIB`: a path
//! to one `libnvrtc.so.*` that is loaded first, so the later lookup by soname finds it (this is
//! how the PyPI wheel `nvidia-cuda-nvrtc`, which `make test` installs, is used without touching
//! the loader's path). That path is the one setting read from the environment.
//!
//! - [`program`]: one NVRTC program (source + in-memory headers) to PTX or CUBIN, with its log.
//! - [`resources`]: registers, spills, stack and shared memory per kernel, read from ptxas'
//!   verbose report (`--ptxas-options=-v`).
//! - [`cache`]: CUBINs on disk, keyed by a hash of the source, headers, options, architecture and
//!   NVRTC version: a second build compiles nothing.
//! - [`batch`]: every kernel of a program compiled in parallel through the cache, and the report
//!   `qatc compile --device cuda` prints and writes (`OUT/kernels/report.json`).

pub mod batch;
pub mod cache;
pub mod program;
pub mod resources;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::cuda::emit::{headers, CudaKernel};
use crate::error::KernelError;

pub use batch::{compile_cubins, BuildOptions, BuildReport, CompiledKernel};
pub use cache::KernelCache;
pub use resources::Resources;

/// A GPU generation, `sm_{major}{minor}`: what NVRTC compiles machine code (CUBIN) for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Arch {
    pub major: u32,
    pub minor: u32,
}

impl Arch {
    /// Ampere (A100).
    pub const SM80: Arch = Arch { major: 8, minor: 0 };
    /// Hopper (H100, H200).
    pub const SM90: Arch = Arch { major: 9, minor: 0 };
    /// The generations the tests compile every kernel for.
    pub const ALL: [Arch; 2] = [Arch::SM80, Arch::SM90];

    /// `sm_90` (or `90`, `9.0`) -> Arch.
    pub fn parse(s: &str) -> Result<Arch, String> {
        let t = s.trim();
        let digits = t.strip_prefix("sm_").unwrap_or(t);
        let (major, minor) = match digits.split_once('.') {
            Some((a, b)) => (a.parse::<u32>().ok(), b.parse::<u32>().ok()),
            None if digits.len() >= 2 && digits.bytes().all(|b| b.is_ascii_digit()) => {
                let (a, b) = digits.split_at(digits.len() - 1);
                (a.parse::<u32>().ok(), b.parse::<u32>().ok())
            }
            None => (None, None),
        };
        match (major, minor) {
            (Some(major), Some(minor)) if (5..=20).contains(&major) && minor < 10 => Ok(Arch { major, minor }),
            _ => Err(format!("`{s}` is not a GPU architecture (expected sm_80, sm_90, ...)")),
        }
    }

    /// From a compute capability as the driver reports it (9, 0).
    pub fn from_capability(major: i32, minor: i32) -> Option<Arch> {
        Some(Arch { major: u32::try_from(major).ok()?, minor: u32::try_from(minor).ok()? })
    }

    /// `sm_90`.
    pub fn name(self) -> String {
        format!("sm_{}{}", self.major, self.minor)
    }

    /// NVRTC's number for it (90).
    pub fn number(self) -> i32 {
        (self.major * 10 + self.minor) as i32
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sm_{}{}", self.major, self.minor)
    }
}

/// The library given by path, held for the life of the process (cudarc keeps using it).
static PRELOADED: OnceLock<libloading::Library> = OnceLock::new();

/// NVRTC's builtins library beside an NVRTC given by path, loaded first. NVRTC opens
/// `libnvrtc-builtins.so.MAJOR.MINOR` by name at its first compile; NVRTC 13.0 (the GPU
/// machine's toolkit, and the wheel `make test` pins to it) carries no `$ORIGIN` search path, so
/// from a wheel's folder that open fails ("failed to open libnvrtc-builtins.so.13.0": every
/// compile then fails with NVRTC_ERROR_BUILTIN_OPERATION_FAILURE). Once loaded, the loader finds
/// it by its soname. A folder without one (a toolkit on the loader's path) is left as it is.
static BUILTINS: OnceLock<libloading::Library> = OnceLock::new();

fn preload_builtins_beside(nvrtc: &Path) -> Result<(), KernelError> {
    let Some(dir) = nvrtc.parent() else { return Ok(()) };
    let Ok(entries) = std::fs::read_dir(dir) else { return Ok(()) };
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libnvrtc-builtins.so.")))
        .collect();
    found.sort();
    let Some(builtins) = found.first() else { return Ok(()) };
    if BUILTINS.get().is_none() {
        // SAFETY: as NVRTC's own load below: the builtins library's ELF initializers have no
        // preconditions, and the handle lives in a static, so it stays mapped for NVRTC's use.
        let l = unsafe { libloading::Library::new(builtins) }
            .map_err(|e| KernelError::NvrtcMissing(format!("{} (beside QATC_NVRTC_LIB): {e}", builtins.display())))?;
        let _ = BUILTINS.set(l);
    }
    Ok(())
}

/// A usable NVRTC.
#[derive(Debug)]
pub struct Nvrtc {
    pub version: (i32, i32),
}

fn check(rc: cudarc::nvrtc::sys::nvrtcResult, what: &str) -> Result<(), KernelError> {
    if rc == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(KernelError::Nvrtc(format!("{what} failed: {rc:?}")))
    }
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
                preload_builtins_beside(path)?;
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
        check(unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }, "nvrtcVersion")?;
        Ok(Nvrtc { version: (major, minor) })
    }

    /// The architectures this NVRTC can compile for (`nvrtcGetSupportedArchs`).
    pub fn supported_archs(&self) -> Result<Vec<Arch>, KernelError> {
        let mut n = 0;
        // SAFETY: NVRTC is loaded (an `Nvrtc` exists only after `open` checked it); the call
        // writes one int through a valid pointer.
        check(unsafe { cudarc::nvrtc::sys::nvrtcGetNumSupportedArchs(&mut n) }, "nvrtcGetNumSupportedArchs")?;
        let mut archs = vec![0i32; usize::try_from(n).unwrap_or(0)];
        if !archs.is_empty() {
            // SAFETY: as above; the buffer holds exactly the count NVRTC reported.
            check(unsafe { cudarc::nvrtc::sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }, "nvrtcGetSupportedArchs")?;
        }
        Ok(archs.into_iter().filter_map(|a| Arch::from_capability(a / 10, a % 10)).collect())
    }

    /// An error naming the supported architectures when `arch` is not one of them.
    pub fn check_arch(&self, arch: Arch) -> Result<(), KernelError> {
        let archs = self.supported_archs()?;
        if archs.is_empty() || archs.contains(&arch) {
            return Ok(());
        }
        let names: Vec<String> = archs.iter().map(|a| a.name()).collect();
        Err(KernelError::Nvrtc(format!(
            "NVRTC {}.{} cannot compile for {arch}; it supports {}",
            self.version.0,
            self.version.1,
            names.join(", ")
        )))
    }

    /// The options every kernel compiles with, for PTX (`compute_XY`) or CUBIN (`sm_XY`).
    /// Strict IEEE float (no `--use_fast_math`); FMA contraction is NVRTC's default (`kir`).
    pub fn options(arch: Arch, cubin: bool) -> Vec<String> {
        let target = if cubin { arch.name() } else { format!("compute_{}{}", arch.major, arch.minor) };
        let mut o = vec![format!("--gpu-architecture={target}"), "--std=c++17".into(), "-default-device".into(), "-lineinfo".into()];
        if cubin {
            // ptxas' resource report (registers, spills, stack, shared memory) goes to the log
            o.push("--ptxas-options=-v".into());
        }
        o
    }

    /// Compiles one kernel to PTX (no GPU needed to check that it compiles). `source_path` is
    /// where its source was written, named in errors.
    pub fn compile(&self, k: &CudaKernel, arch: Arch, source_path: &Path) -> Result<String, KernelError> {
        let out = program::compile(k, &Nvrtc::options(arch, false), false).map_err(|e| e.into_error(k, arch, source_path))?;
        String::from_utf8(out.image).map_err(|e| KernelError::Nvrtc(format!("{}: PTX is not UTF-8: {e}", k.name)))
    }
}

/// Writes the helper headers into `dir` beside the sources (NVRTC gets them in memory; on disk
/// they make `OUT/kernels/` a directory nvcc can compile as is).
pub fn write_headers(dir: &Path) -> Result<(), KernelError> {
    let io = |source| KernelError::Io { path: dir.to_path_buf(), error: source };
    std::fs::create_dir_all(dir).map_err(io)?;
    for (name, text) in headers() {
        let p = dir.join(name);
        std::fs::write(&p, text).map_err(|source| KernelError::Io { path: p.clone(), error: source })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Arch;

    #[test]
    fn architectures_parse_from_their_names() {
        assert_eq!(Arch::parse("sm_90"), Ok(Arch::SM90));
        assert_eq!(Arch::parse("80"), Ok(Arch::SM80));
        assert_eq!(Arch::parse("8.6"), Ok(Arch { major: 8, minor: 6 }));
        assert_eq!(Arch::parse("sm_100"), Ok(Arch { major: 10, minor: 0 }));
        assert_eq!(Arch::SM90.name(), "sm_90");
        assert_eq!(Arch::SM90.number(), 90);
        for bad in ["", "sm_", "gfx90a", "sm_9", "sm_9x"] {
            assert!(Arch::parse(bad).is_err(), "{bad}");
        }
    }
}
