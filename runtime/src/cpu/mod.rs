//! The compiled-program executor for the CPU: runs a [`qatc_kernels::Program`] (what
//! `qatc_kernels::lower` makes of a graph) instead of interpreting the graph node by node, on the
//! executor core (`crate::exec`: checks, lifetimes, hoisting, the layout, write-backs).
//!
//! ```text
//! Program { buffers, kernels, steps: [Launch | Gemm], outputs, updates }
//!    buffers  -> the ExecPlan's layout: three zeroed allocations, 64-byte aligned (memory.rs)
//!    Launch   -> 0..iterations(kernel) split over rayon's pool, each range run by a Launcher
//!    Gemm     -> OpenBLAS or the gemm crate on the views' strides (gemm.rs, blas.rs); bf16 ones
//!                by oneDNN where the CPU has bf16 units (onednn.rs; its matmul primitive
//!                on AMX, onednn_matmul.rs), other f16/bf16 ones
//!                through f32 tiles (gemm_half.rs); fed a
//!                dequantized panel at a time when `qatc_kernels::panels` rewrote it
//!    updates  -> copied over their inputs after the last step
//! ```
//!
//! Who compiled the kernels is the [`Launcher`]'s business: [`KirEval`] interprets the kernel IR
//! statement by statement (the fallback without LLVM, and the oracle that checks `lower` itself
//! against the graph interpreter); with the `llvm` feature, `qatc_kernels::llvm::Jit` runs
//! LLVM-compiled machine code.

mod attention;
mod attn_gemm;
mod attn_products;
pub mod blas;
mod convert;
mod gemm;
mod gemm_half;
mod kir_eval;
#[cfg(feature = "llvm")]
mod llvm;
mod memory;
pub mod onednn;
mod onednn_matmul;
mod options;
mod program;
mod scalar;
mod steps;
mod vmath;

pub use attn_gemm::GemmAttention;
pub use kir_eval::KirEval;
pub use memory::ALIGN;
pub use options::{CpuAttention, CpuOptions};
pub use program::{prepare, CpuProgram};

use crate::error::RuntimeError;

/// The environment variables the GEMM libraries read when they load, as this CPU wants them, for
/// the binary's `main` to set before any thread starts (unless the user set them):
/// - `OPENBLAS_CORETYPE`: OpenBLAS picks its kernels from the CPU model, which it may not know on
///   a VM (then: SSE3 kernels, 6x slower); named from the CPU's features (`blas.rs`).
/// - `OMP_WAIT_POLICY=passive`: oneDNN's OpenMP threads (the bf16 GEMMs, `onednn.rs`) otherwise
///   spin for a while after each GEMM on the cores the next kernels run on; with them spinning,
///   124M's bf16 step took 0.57 s instead of 0.39 (attention's backward 83 ms instead of 44).
pub fn library_env() -> Vec<(&'static str, String)> {
    let mut env = Vec::new();
    if let Some(core) = blas::openblas_core_type() {
        env.push(("OPENBLAS_CORETYPE", core.to_string()));
    }
    env.push(("OMP_WAIT_POLICY", "passive".to_string()));
    env
}

/// Runs ranges of a program's kernels.
pub trait Launcher: Send + Sync {
    /// Runs iterations `start..end` of kernel `kernel` (an index into `Program::kernels`; see
    /// `qatc_kernels::kir::iterations`) with one base pointer per kernel param: the buffer the
    /// Launch step names, not offset (kernels add view offsets themselves). Disjoint ranges of one
    /// launch may run at the same time on different threads.
    ///
    /// # Safety
    /// `args` must have one pointer per param of the kernel, each to a live allocation of at
    /// least that param's element count in its dtype (`DType::bytes_for`), aligned to 4 bytes,
    /// that nothing else reads or writes during the call except other ranges of the same launch.
    unsafe fn launch(&self, kernel: usize, args: &[*mut u8], start: usize, end: usize) -> Result<(), RuntimeError>;
}
