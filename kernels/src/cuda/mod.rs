//! The CUDA C backend: kernel IR -> readable CUDA C for NVRTC, with shared helpers in
//! `include/*.cuh` and the tables the IR defines written as `qatc_tables.cuh` (`tables.rs`).
//!
//! The files read in one direction: each uses only files to its left (`a <- b`: b uses a), so a
//! shared piece lives in the lowest file that needs it (`kernels/tests/module_layers.rs` checks
//! this line against the files' `super::` paths):
//!
//! Layers: writer <- syntax <- tables <- stmts <- codegen <- launch <- loop_nest <- attention <- emit
//!
//! `writer` is the indenting text writer; `syntax` spells the IR's types, literals and params in
//! C; `tables` writes `qatc_tables.cuh`; `stmts` answers what a kernel's statements load, store and
//! loop over; `codegen` chooses the variants; `launch` gives each kernel its grid and block;
//! `loop_nest` and `attention` write the two kinds of kernel body; `emit` puts a kernel's text
//! together. `blas/` plans GEMMs and uses none of them.

pub mod attention;
pub mod blas;
pub mod codegen;
pub mod emit;
mod launch;
mod loop_nest;
mod stmts;
pub mod syntax;
pub mod tables;
pub mod writer;

pub use codegen::{Variant, Variants};
pub use emit::{emit, emit_with, headers, CudaKernel, LaunchDims};
