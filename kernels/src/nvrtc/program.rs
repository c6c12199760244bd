//! One NVRTC program: a kernel's source with the helper headers given in memory (no include
//! directory on disk), compiled with a list of options to PTX or CUBIN. Written on cudarc's raw
//! bindings rather than its `compile_ptx`, which has no CUBIN output and unwraps in its error
//! and drop paths; here every failure is a value carrying NVRTC's log.

use std::ffi::{c_char, CStr, CString};
use std::path::Path;

use cudarc::nvrtc::sys::{self, nvrtcProgram, nvrtcResult};

use super::Arch;
use crate::cuda::emit::{headers, CudaKernel};
use crate::error::KernelError;

/// What a successful compile gives: the image (PTX text or CUBIN bytes) and the log (warnings,
/// and with `--ptxas-options=-v` the resource report).
pub struct Output {
    pub image: Vec<u8>,
    pub log: String,
}

/// Why a compile failed, before it is tied to a source path.
pub enum Failure {
    /// NVRTC rejected the source: its log.
    Compile { log: String, options: Vec<String> },
    /// Anything else (NUL in the source, an NVRTC API error).
    Other(String),
}

impl Failure {
    pub fn into_error(self, k: &CudaKernel, arch: Arch, source_path: &Path) -> KernelError {
        match self {
            Failure::Compile { log, options } => KernelError::Compile {
                name: k.name.clone(),
                arch: arch.name(),
                path: source_path.display().to_string(),
                log: format!("{}\noptions: {}", log.trim_end(), options.join(" ")),
            },
            Failure::Other(why) => KernelError::Nvrtc(format!("{}: {why}", k.name)),
        }
    }
}

fn rc(r: nvrtcResult, what: &str) -> Result<(), Failure> {
    if r == nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(Failure::Other(format!("{what}: {r:?}")))
    }
}

fn cstring(s: &str, what: &str) -> Result<CString, Failure> {
    CString::new(s).map_err(|_| Failure::Other(format!("{what} contains a NUL byte")))
}

/// An NVRTC program handle, destroyed on drop.
struct Program(nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the handle came from nvrtcCreateProgram and is destroyed exactly once, here; a
        // failure to destroy leaks it and is not worth a panic.
        let _ = unsafe { sys::nvrtcDestroyProgram(&mut self.0) };
    }
}

impl Program {
    fn log(&self) -> String {
        let mut n = 0usize;
        // SAFETY: a live program handle; NVRTC writes the size through a valid pointer.
        if unsafe { sys::nvrtcGetProgramLogSize(self.0, &mut n) } != nvrtcResult::NVRTC_SUCCESS || n == 0 {
            return String::new();
        }
        let mut buf = vec![0u8; n];
        // SAFETY: the buffer holds the log size NVRTC reported, terminating NUL included.
        if unsafe { sys::nvrtcGetProgramLog(self.0, buf.as_mut_ptr().cast::<c_char>()) } != nvrtcResult::NVRTC_SUCCESS {
            return String::new();
        }
        CStr::from_bytes_until_nul(&buf).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default()
    }

    fn image(&self, cubin: bool) -> Result<Vec<u8>, Failure> {
        let mut n = 0usize;
        // SAFETY (both calls): a compiled program handle; the buffer holds the size NVRTC
        // reported for that same image kind.
        unsafe {
            if cubin {
                rc(sys::nvrtcGetCUBINSize(self.0, &mut n), "nvrtcGetCUBINSize")?;
            } else {
                rc(sys::nvrtcGetPTXSize(self.0, &mut n), "nvrtcGetPTXSize")?;
            }
            let mut buf = vec![0u8; n];
            if cubin {
                rc(sys::nvrtcGetCUBIN(self.0, buf.as_mut_ptr().cast::<c_char>()), "nvrtcGetCUBIN")?;
            } else {
                rc(sys::nvrtcGetPTX(self.0, buf.as_mut_ptr().cast::<c_char>()), "nvrtcGetPTX")?;
                // PTX comes NUL-terminated
                while buf.last() == Some(&0) {
                    buf.pop();
                }
            }
            Ok(buf)
        }
    }
}

/// Compiles `k` with `options`; `cubin` picks the image (the options must name an `sm_`
/// architecture for a CUBIN, `compute_` for PTX). NVRTC must be loaded (an `Nvrtc` exists).
pub fn compile(k: &CudaKernel, options: &[String], cubin: bool) -> Result<Output, Failure> {
    let src = cstring(&k.source, "the generated source")?;
    let name = cstring(&format!("{}.cu", k.name), "the kernel name")?;
    let header_texts: Vec<CString> = headers().iter().map(|(_, t)| cstring(t, "a header")).collect::<Result<_, _>>()?;
    let header_names: Vec<CString> = headers().iter().map(|(n, _)| cstring(n, "a header name")).collect::<Result<_, _>>()?;
    let text_ptrs: Vec<*const c_char> = header_texts.iter().map(|c| c.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = header_names.iter().map(|c| c.as_ptr()).collect();
    let opts: Vec<CString> = options.iter().map(|o| cstring(o, "an option")).collect::<Result<_, _>>()?;
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|c| c.as_ptr()).collect();
    let mut raw: nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer is to a NUL-terminated string owned by a local that outlives the
    // program's creation (NVRTC copies them); the arrays have headers().len() entries each.
    rc(
        unsafe {
            sys::nvrtcCreateProgram(&mut raw, src.as_ptr(), name.as_ptr(), headers().len() as i32, text_ptrs.as_ptr(), name_ptrs.as_ptr())
        },
        "nvrtcCreateProgram",
    )?;
    let prog = Program(raw);
    // SAFETY: a live program; the option array holds opts.len() valid C strings.
    let r = unsafe { sys::nvrtcCompileProgram(prog.0, opt_ptrs.len() as i32, opt_ptrs.as_ptr()) };
    if r == nvrtcResult::NVRTC_ERROR_COMPILATION {
        return Err(Failure::Compile { log: prog.log(), options: options.to_vec() });
    }
    rc(r, "nvrtcCompileProgram")?;
    Ok(Output { image: prog.image(cubin)?, log: prog.log() })
}
