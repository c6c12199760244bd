//! [`CpuOptions`]: the CPU executor's settings, passed in (the `qatc` command line sets the ones
//! a user would want; benchmarks and tests set their own). Nothing here reads the environment.

use super::blas::OPENBLAS;
use super::onednn::ONEDNN;

/// How the attention kernels run on the CPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CpuAttention {
    /// As GEMMs over blocks of query rows ([`super::GemmAttention`]).
    #[default]
    Gemm,
    /// As the generated per-row programs, like every other kernel (for comparison).
    Kernels,
}

/// The CPU executor's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuOptions {
    /// The most bytes of one dequantized weight panel (`qatc_kernels::panels`: one scratch,
    /// shared by every fed GEMM); 0 materializes whole dequantized weights instead, once (4 bytes
    /// per parameter, as the CUDA path does). Small panels split the GEMMs finely, and each
    /// partial GEMM costs a library call and a pass over its output: at 512 KiB the 124M step's
    /// fed GEMMs took 1.5x as long as on whole weights, at 8 MiB the same (bench/RESULTS.md).
    pub panel_bytes: usize,
    pub attention: CpuAttention,
    /// The vector width LLVM should prefer, in bits; None: 512 where the host has AVX-512
    /// (`qatc_kernels::llvm::JitOptions`).
    pub vector_width: Option<u32>,
    /// The BLAS library the large GEMMs go to (a name the dynamic loader finds, or a path),
    /// loaded at run time; None: the gemm crate only. Without the library: the gemm crate, too.
    pub blas: Option<String>,
    /// The library GEMMs with bf16 operands go to where the CPU has bf16 units (oneDNN; a name
    /// the dynamic loader finds, or a path), loaded at run time; None, or without the library
    /// or the units: widened to f32 tiles (`gemm_half.rs`).
    pub bf16_gemm: Option<String>,
    /// Profiles name each kernel (its family, iterations and index) rather than its family.
    pub profile_by_kernel: bool,
}

impl Default for CpuOptions {
    fn default() -> CpuOptions {
        CpuOptions {
            panel_bytes: 8 << 20,
            attention: CpuAttention::Gemm,
            vector_width: None,
            blas: Some(OPENBLAS.to_string()),
            bf16_gemm: Some(ONEDNN.to_string()),
            profile_by_kernel: false,
        }
    }
}
