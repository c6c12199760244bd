//! The CUDA C backend: kernel IR -> readable CUDA C for NVRTC, with shared helpers in
//! `include/*.cuh`.

pub mod attention;
pub mod emit;
pub mod writer;

pub use emit::{emit, CudaKernel, LaunchDims, HEADERS};
