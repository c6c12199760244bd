//! The executor core: what running a lowered [`qatc_kernels::Program`] takes on any device, before
//! and besides the device's own work. The CPU executor (`crate::cpu`) is built on it, and so is
//! the CUDA executor.
//!
//! ```text
//! Program --ExecPlan::new(prog, ExecOptions::for_target(&target))--> ExecPlan
//!   check.rs    every launch, GEMM, output and update checked against the buffers, once
//!   access.rs   what each step reads and writes
//!   hoist.rs    the steps that read only frozen weights: run once, not every step
//!   layout.rs   each buffer's lifetime, and its place: the arena (offsets by qatc_arena, shared
//!               by lifetime), the persistent inputs, the per-step data inputs
//!   plan.rs     the plan itself, and the updates' write-backs into their inputs; a target's
//!               layout parameters (`ExecOptions::for_target`)
//!   memory_plan.rs  what an executor holds, buffer by buffer and step by step (`qatc plan`)
//!   cost.rs     what a step moves and computes (a profile's rates)
//! values.rs       host bytes <-> interpreter values (inputs in, outputs out)
//! train_step.rs   TrainStep: a training step whose state stays on its executor
//! ```

mod access;
mod check;
mod cost;
mod hoist;
mod layout;
mod memory_plan;
mod plan;
mod train_step;
pub mod values;

pub use access::{written_params_read, Access};
pub use check::{check_collective, check_gemm, check_launch, check_view, gemm_label, kernel_label, view_extent};
pub use cost::{step_cost, step_phase, PartCost, TimedPart};
pub use hoist::Hoist;
pub use layout::{lay_out, lifetimes, BufferLayout, Live, MemoryLayout, Place, Region};
pub use memory_plan::{MemoryPlan, PlannedBuffer, PlannedStep};
pub use plan::{ExecOptions, ExecPlan, InputBuf, WriteBack};
pub use train_step::{InterpretedStep, TrainStep};
