//! The CUDA C backend: kernel IR -> readable CUDA C for NVRTC, with shared helpers in
//! `include/*.cuh` and the tables the IR defines written as `qatc_tables.cuh` (`tables.rs`).

pub mod attention;
pub mod blas;
pub mod codegen;
pub mod emit;
mod launch;
mod loop_nest;
pub mod tables;
pub mod writer;

pub use codegen::{Variant, Variants};
pub use emit::{emit, emit_with, headers, CudaKernel, LaunchDims};
