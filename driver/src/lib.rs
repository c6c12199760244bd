//! One way through the compiler's back half: a step graph (from `qatc_passes`' pipeline) and a
//! [`Target`] in, the executor that runs it out.
//!
//! ```text
//! Graph --lower(g, &target, &options)--> Lowered { program, chunk }     schedule, chunk size
//!       --plan(...)-------------------> Executed { program, panels,     the target's rewrites,
//!                                                  exec, plan }          its executor's layout
//!       --compile(...)----------------> Executable { step: TrainStep }   LLVM / NVRTC, loaded
//! ```
//!
//! `qatc plan`, `compile`, `train`, `eval` and `prt` all go through here, so a plan is the
//! program that runs, on the target it runs on. [`resolve`] turns `--device` into a target.

pub mod chunk;
mod compile;
mod describe;
mod error;
mod lower;
mod resolve;

#[cfg(feature = "llvm")]
pub use compile::cpu_program;
pub use compile::{compile, cuda_collectives, Executable, KernelsBuilt, Options};
pub use error::DriverError;
pub use lower::{lower, plan, prepare, Executed, Lowered};
pub use qatc_kernels::{CudaSettings, Hoist, Target, TargetKind};
pub use resolve::{cuda_ready, planned_target, resolve, Resolved};
