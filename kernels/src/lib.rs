//! qatc's code generation. A graph lowers to a [`Program`] (kernel launches, library GEMMs,
//! views) whose kernels are described in the backend-neutral kernel IR ([`kir`]); the CUDA
//! backend ([`cuda`]) writes each kernel as CUDA C and [`nvrtc`] compiles it; the LLVM backend
//! (`llvm`, cargo feature `llvm`) compiles the same kernel IR for the host CPU.
//!
//! ```text
//! Graph --lower--> Program { buffers, views, steps: [Launch(kir::Kernel) | Gemm] }
//!                              kir::Kernel --cuda::emit--> fused_{family}_{hash8}.cu --nvrtc--> PTX
//! ```

pub mod cephes;
pub mod cuda;
pub mod device;
mod disk_cache;
pub mod error;
pub mod index;
pub mod kir;
#[cfg(feature = "llvm")]
pub mod llvm;
pub mod lower;
pub mod nvrtc;
pub mod panels;
pub mod program;
pub mod target;

use std::path::Path;

pub use cuda::CudaKernel;
pub use error::KernelError;
pub use lower::memo::NodeMemo;
pub use lower::{lower, lower_with, lower_with_memo, LowerOptions};
pub use program::{Gemm, GemmTypes, Program, Step, View};
pub use target::{CudaSettings, Hoist, Target, TargetKind};

/// Lowers a graph as `target`'s executor runs it (a CUDA target's attention reading and writing
/// the stored 16-bit type) and writes every distinct kernel as CUDA C with the target's variants:
/// the program and its kernels, in the program's kernel order.
pub fn cuda_kernels(g: &qatc_ir::Graph, target: &Target) -> Result<(Program, Vec<CudaKernel>), KernelError> {
    let prog = lower_with(g, &target.lower_options())?;
    let kernels = prog.kernels.iter().map(|k| cuda::emit_with(k, &target.cuda)).collect::<Result<Vec<_>, _>>()?;
    Ok((prog, kernels))
}

/// Writes `NAME.cu` for each kernel and the helper headers into `dir`; returns the paths of the
/// sources, in order.
pub fn write_cuda(dir: &Path, kernels: &[CudaKernel]) -> Result<Vec<std::path::PathBuf>, KernelError> {
    nvrtc::write_headers(dir)?;
    let mut paths = Vec::new();
    for k in kernels {
        let p = dir.join(format!("{}.cu", k.name));
        std::fs::write(&p, &k.source).map_err(|source| KernelError::Io { path: p.clone(), error: source })?;
        paths.push(p);
    }
    Ok(paths)
}
