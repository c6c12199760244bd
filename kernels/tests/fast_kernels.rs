//! The generator's fast variants (`cuda::codegen`, allowed by a target's `CudaSettings`) compiled by NVRTC for sm_80 and sm_90,
//! with ptxas' report: at most a few bytes spilled, within the static shared memory. Their
//! numbers are checked on a GPU by `tests/gpu_step.rs` (each kernel against the kernel-IR
//! evaluator); here, with no GPU, that they build and how large they are.

mod common;
#[path = "../../tests/common/nvrtc.rs"]
#[allow(dead_code)]
mod nvrtc;

use qatc_ir::DType;
use qatc_kernels::cuda::{emit_with, Variant};
use qatc_kernels::nvrtc::Arch;
use qatc_kernels::CudaKernel;
use qatc_kernels::CudaSettings;

/// The repository's root (what `nvrtc` finds the NVRTC wheel and its cache under).
fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Which attention graph: the forward, the backward of dq and dk (lse, delta, dq, dk/dv), or dv
/// alone (lse, dv).
#[derive(Clone, Copy, Debug)]
enum Part {
    Forward,
    Backward,
    Dv,
}

impl Part {
    /// How many attention kernels its lowering has.
    fn kernels(self) -> usize {
        match self {
            Part::Forward => 1,
            Part::Backward => 4,
            Part::Dv => 2,
        }
    }
}

/// The attention kernels (families `attention*`) of `part` over `dtype` values, T `t`, `nh`
/// heads of `hs`, as `cg` writes them.
fn attention_kernels(part: Part, dtype: DType, t: usize, nh: usize, hs: usize, cg: &CudaSettings) -> Vec<CudaKernel> {
    let g = match part {
        Part::Forward => common::attention_of(dtype, t, nh, hs),
        Part::Backward => common::attention_backward_of(dtype, t, nh, hs),
        Part::Dv => common::attention_dv_of(dtype, t, nh, hs),
    };
    let prog = qatc_kernels::lower(&g).expect("lowers");
    let ks: Vec<CudaKernel> =
        prog.kernels.iter().filter(|k| k.family.starts_with("attention")).map(|k| emit_with(k, cg).expect("emits")).collect();
    assert_eq!(ks.len(), part.kernels(), "{part:?}: {prog}");
    ks
}

/// bf16 and fp16, hs 32, 48 and 64 (GPT-2's), T 100 (a partial last tile) and 1: the
/// tensor-core forward and backward (lse, delta, dq, dk/dv, dv) for both architectures, at most a few
/// bytes spilled, within the static 48 KB of shared memory.
#[test]
fn the_tensor_core_attention_kernels_compile_for_sm80_and_sm90() {
    let Some(nv) = nvrtc::nvrtc() else { return };
    let mut kernels = Vec::new();
    for part in [Part::Forward, Part::Backward, Part::Dv] {
        for dtype in [DType::BF16, DType::F16] {
            for (t, hs) in [(100, 64), (100, 32), (100, 48), (1, 64)] {
                let ks = attention_kernels(part, dtype, t, 2, hs, &CudaSettings::default());
                assert!(ks.iter().all(|k| k.source.contains("_mma<")), "{part:?} {dtype} {t} {hs}");
                kernels.extend(ks);
            }
        }
    }
    // the same kernel may come from several graphs (the lse of the backward and of dv)
    kernels.sort_by(|a, b| a.name.cmp(&b.name));
    kernels.dedup_by(|a, b| a.name == b.name);
    for arch in Arch::ALL {
        let (built, _) = nvrtc::build(&nv, &format!("fast-attention-{arch}"), &kernels, arch, None);
        assert_eq!(built.len(), kernels.len());
        for b in &built {
            let r = &b.resources.expect("ptxas reported");
            eprintln!("{arch} {}: {} registers, {} bytes shared, {} stack", b.name, r.registers, r.shared_bytes, r.stack_bytes);
            // ptxas spills a few bytes in some (fp16 hs 32 dk/dv at 168 registers, seen with
            // NVRTC 13.0): a bound, so that a change that spills in earnest fails here
            assert!(r.spill_store_bytes <= 32 && r.stack_bytes <= 32, "{arch} {}: {r:?}", b.name);
            assert!(r.shared_bytes <= 48 << 10, "{arch} {}: {r:?}", b.name);
        }
    }
}

/// Each switch turns its kernels back into the fp32 templates, and only its own.
#[test]
fn each_switch_forces_the_general_attention_kernels() {
    let only_forward = CudaSettings::default().without(Variant::TensorCoreAttentionBackward);
    let only_backward = CudaSettings::default().without(Variant::TensorCoreAttention);
    for (cg, forward, backward) in [
        (CudaSettings::default(), true, true),
        (only_forward, true, false),
        (only_backward, false, true),
        (CudaSettings::GENERAL, false, false),
    ] {
        for (part, on) in [(Part::Forward, forward), (Part::Backward, backward), (Part::Dv, backward)] {
            for k in attention_kernels(part, DType::BF16, 100, 2, 64, &cg) {
                assert_eq!(k.source.contains("_mma<"), on, "{cg:?}, {part:?}: {}", k.source);
            }
        }
    }
    // f32 values never: rounding them to 16 bits would change the result
    for part in [Part::Forward, Part::Backward, Part::Dv] {
        assert!(attention_kernels(part, DType::F32, 100, 2, 64, &CudaSettings::default()).iter().all(|k| !k.source.contains("mma")));
    }
}

/// A Block-mapped row kernel of up to `WARP_ROW_MAX` a row becomes one warp per row (4 rows per
/// block, warp reductions, no shared scratch); longer rows keep the block; `GENERAL` keeps the
/// block everywhere, with the block's launch dims.
#[test]
fn short_rows_are_one_warp_each_where_the_switch_allows() {
    use qatc_kernels::cuda::codegen::WARP_ROW_MAX;
    use qatc_kernels::cuda::emit::launch_dims_with;
    let softmax = |len: usize| {
        common::fused(qatc_ir::KernelFamily::Softmax, &[common::f32s(&[3, len])], |b, i| {
            b.add(qatc_ir::Op::Softmax { scale: 1.0, causal: false }, &[i[0]]).unwrap()
        })
    };
    for (g, warp) in [(common::residual_layernorm(), true), (softmax(WARP_ROW_MAX), true), (softmax(WARP_ROW_MAX + 1), false)] {
        let prog = qatc_kernels::lower(&g).expect("lowers");
        let k = &prog.kernels[0];
        let fast = emit_with(k, &CudaSettings::default()).expect("emits");
        let general = emit_with(k, &CudaSettings::GENERAL).expect("emits");
        assert_eq!(fast.launch, launch_dims_with(k, &CudaSettings::default()));
        assert_eq!(general.launch, launch_dims_with(k, &CudaSettings::GENERAL));
        assert!(general.source.contains("qatc::block_") && !general.source.contains("warp_"), "{}", general.source);
        if warp {
            assert!(fast.source.contains("qatc::warp_sum") && !fast.source.contains("__shared__"), "{}", fast.source);
            let rows = general.launch.grid[0];
            assert_eq!((fast.launch.block, fast.launch.grid[0]), (128, rows.div_ceil(4)), "{}", fast.source);
        } else {
            assert_eq!(fast, general);
        }
    }
}

/// A bias gradient, sum_to([N, 96] -> [96]): one thread per column summing N rows in general; split
/// (N >= `SPLIT_MIN`), 32 columns per block and each column's rows over 8 warps, the parts added
/// in warp order; under `SPLIT_MIN` or with `GENERAL`, one thread per column. Both compile for
/// sm_80 and sm_90; the split text is snapshotted.
#[test]
fn long_column_sums_are_split_over_warps_where_the_switch_allows() {
    use qatc_kernels::cuda::codegen::SPLIT_MIN;
    let bias_grad = |n: usize| {
        common::fused(qatc_ir::KernelFamily::ReduceSum, &[common::f32s(&[n, 96])], |b, i| {
            b.add(qatc_ir::Op::SumTo { shape: [96].into() }, &[i[0]]).unwrap()
        })
    };
    let mut all = Vec::new();
    for (n, split) in [(4099, true), (SPLIT_MIN, true), (SPLIT_MIN - 1, false)] {
        let prog = qatc_kernels::lower(&bias_grad(n)).expect("lowers");
        let k = &prog.kernels[0];
        let fast = emit_with(k, &CudaSettings::default()).expect("emits");
        let general = emit_with(k, &CudaSettings::GENERAL).expect("emits");
        assert!(general.source.contains("one thread per row") && general.launch.block == 256, "{}", general.source);
        if split {
            assert_eq!((fast.launch.grid[0], fast.launch.block), (3, 256), "{}", fast.source);
            for want in ["part[slice][lane] = ", "part[0][lane] + part[1][lane]", "if (owner) "] {
                assert!(fast.source.contains(want), "{want}:\n{}", fast.source);
            }
            if n == 4099 {
                insta::assert_snapshot!(format!("// ---- {} ----\n{}", fast.name, fast.source));
            }
        } else {
            assert_eq!(fast, general);
        }
        all.extend([fast, general]);
    }
    all.sort_by(|a, b| a.source.cmp(&b.source));
    all.dedup_by(|a, b| a.source == b.source);
    let Some(nv) = nvrtc::nvrtc() else { return };
    for arch in Arch::ALL {
        nvrtc::build(&nv, &format!("fast-split-{arch}"), &all, arch, None);
    }
}
