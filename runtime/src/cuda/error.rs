//! Errors of the GPU side: each names the call that failed and carries CUDA's own words.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum GpuError {
    /// No usable CUDA here (a library missing, no device): why, in words.
    #[error("no CUDA: {0}")]
    Unavailable(String),
    /// A CUDA driver call failed: its CUresult name (CUDA_ERROR_OUT_OF_MEMORY, ...) and string.
    #[error("{call}: {name} ({message})")]
    Driver { call: String, name: String, message: String },
    /// A cuBLAS or cuBLASLt call failed: its status.
    #[error("{call}: {status}")]
    Blas { call: String, status: String },
    /// An NCCL call failed: its ncclResult_t and NCCL's string for it.
    #[error("{call}: {status}")]
    Nccl { call: String, status: String },
    /// A request this GPU cannot meet (too much memory, an unknown pointer, a misuse of the API).
    #[error("{0}")]
    Invalid(String),
    /// The emulation found a kernel doing something wrong (an out-of-bounds access, ...).
    #[error("kernel {kernel}: {msg}")]
    Kernel { kernel: String, msg: String },
}
