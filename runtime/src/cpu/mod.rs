//! The compiled-program executor for the CPU: runs a [`qatc_kernels::Program`] (what
//! `qatc_kernels::lower` makes of a graph) instead of interpreting the graph node by node.
//!
//! ```text
//! Program { buffers, kernels, steps: [Launch | Gemm], outputs }
//!    buffers  -> allocated once, 64-byte aligned (buffers.rs); inputs alone, the others in one
//!                arena, at the same bytes when never live at the same step (layout.rs)
//!    Launch   -> 0..iterations(kernel) split over rayon's pool, each range run by a Launcher
//!    Gemm     -> the gemm crate on the views' strides (gemm.rs)
//! ```
//!
//! Who compiled the kernels is the [`Launcher`]'s business: [`KirEval`] interprets the kernel IR
//! statement by statement (the fallback without LLVM, and the oracle that checks `lower` itself
//! against the graph interpreter); with the `llvm` feature, `qatc_kernels::llvm::Jit` runs
//! LLVM-compiled machine code.

mod attention;
mod attn_gemm;
pub mod blas;
mod gemm;
mod kir_eval;
mod program;
#[cfg(feature = "llvm")]
mod llvm;
mod scalar;
mod vmath;

pub use attn_gemm::GemmAttention;
pub use program::CpuProgram;
pub use kir_eval::KirEval;
pub use crate::exec::layout::{BufferLayout, LayoutReport};

use crate::error::RuntimeError;

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
