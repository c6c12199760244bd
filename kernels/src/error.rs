//! The crate's one error type. Compile errors keep NVRTC's whole log and say where the kernel's
//! source was written, so a failure can be read without rerunning anything.

use std::path::PathBuf;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum KernelError {
    #[error(transparent)]
    Ir(#[from] qatc_ir::IrError),
    #[error("node {node}: {why}")]
    Unsupported { node: String, why: String },
    /// A bug in the lowering: an invariant the graph's verifier should have guaranteed.
    #[error("kernel lowering: {0}")]
    Internal(String),
    #[error("no NVRTC library: {0}")]
    NvrtcMissing(String),
    #[error("NVRTC could not compile {name} for {arch} (source: {path}):\n{log}")]
    Compile { name: String, arch: String, path: String, log: String },
    #[error("NVRTC: {0}")]
    Nvrtc(String),
    /// The LLVM backend failed on a kernel (an invalid module is a bug in the backend; its
    /// verifier message names the instruction).
    #[error("LLVM, kernel {kernel}: {message}")]
    Llvm { kernel: String, message: String },
    #[error("{}: {error}", path.display())]
    Io { path: PathBuf, error: std::io::Error },
}
