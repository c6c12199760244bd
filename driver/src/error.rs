//! The driver's errors: each names the stage that failed and carries the error of the crate
//! that failed (the pass, the kernel build with NVRTC's log, the executor with its buffer).

use qatc_kernels::KernelError;
use qatc_passes::plan::PlanError;
use qatc_runtime::cuda::GpuError;
use qatc_runtime::RuntimeError;

#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("scheduling the step: {0}")]
    Schedule(#[from] PlanError),
    #[error("lowering the step to kernels: {0}")]
    Lower(#[from] KernelError),
    #[error("planning the program's execution: {0}")]
    Exec(#[from] RuntimeError),
    #[error("--device cuda: {0}")]
    Gpu(#[from] GpuError),
    /// The target cannot run here, or the options ask for what it does not do.
    #[error("{0}")]
    Unsupported(String),
}
