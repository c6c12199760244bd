//! The generator's fast variants (`cuda::CudaCodegen`) compiled by NVRTC for sm_80 and sm_90,
//! with ptxas' report: no spills, no stack frame, within the hardware's shared memory. Their
//! numbers are checked on a GPU by `tests/gpu_step.rs` (each kernel against the kernel-IR
//! evaluator); here, with no GPU, that they build and how large they are.

mod common;
#[path = "../../tests/common/nvrtc.rs"]
mod nvrtc;

use qatc_ir::DType;
use qatc_kernels::cuda::{emit_with, CudaCodegen};
use qatc_kernels::nvrtc::Arch;
use qatc_kernels::CudaKernel;

/// The repository's root (what `nvrtc` finds the NVRTC wheel and its cache under).
fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The attention forward of a `dtype` qkv, T `t`, `nh` heads of `hs`, as `cg` writes it.
fn attention_forward(dtype: DType, t: usize, nh: usize, hs: usize, cg: &CudaCodegen) -> CudaKernel {
    let prog = qatc_kernels::lower(&common::attention_of(dtype, t, nh, hs)).expect("lowers");
    let k = prog.kernels.iter().find(|k| k.family == "attention").expect("the attention kernel");
    emit_with(k, cg).expect("emits")
}

/// bf16 and fp16, hs 16, 32 and 64 (GPT-2's), T 100 (a partial last tile) and 1: the tensor-core
/// forward for both architectures, no spills.
#[test]
fn the_tensor_core_attention_forward_compiles_without_spills() {
    let Some(nv) = nvrtc::nvrtc() else { return };
    let mut kernels = Vec::new();
    for dtype in [DType::BF16, DType::F16] {
        for (t, hs) in [(100, 64), (100, 32), (100, 16), (1, 64)] {
            let k = attention_forward(dtype, t, 2, hs, &CudaCodegen::default());
            assert!(k.source.contains("attention_forward_mma"), "{}", k.source);
            kernels.push(k);
        }
    }
    for arch in Arch::ALL {
        let (built, _) = nvrtc::build(&nv, &format!("fast-attention-{arch}"), &kernels, arch, None);
        assert_eq!(built.len(), kernels.len());
        for b in &built {
            let r = &b.resources;
            eprintln!("{arch} {}: {} registers, {} bytes shared, {} stack", b.name, r.registers, r.shared_bytes, r.stack_bytes);
            assert!(!r.spills() && r.stack_bytes == 0, "{arch} {}: {r:?}", b.name);
            assert!(r.shared_bytes <= 48 << 10, "{arch} {}: {r:?}", b.name);
        }
    }
}
