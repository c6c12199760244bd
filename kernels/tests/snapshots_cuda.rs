//! The CUDA text of representative kernels. A change here is a change to generated code:
//! review the diff like code (`cargo insta review`).

mod common;

use qatc_kernels::{cuda_kernels, Step};

fn cuda_of(g: &qatc_ir::Graph) -> String {
    let (prog, kernels) = cuda_kernels(g, &qatc_kernels::Target::of(qatc_kernels::TargetKind::Cuda)).unwrap();
    let mut text = format!("// {}", prog);
    for k in &kernels {
        text.push_str(&format!("\n// ---- {} ----\n{}", k.name, k.source));
    }
    text
}

#[test]
fn elementwise_chain_is_one_kernel() {
    let (prog, _) = cuda_kernels(&common::elementwise_chain(), &qatc_kernels::Target::of(qatc_kernels::TargetKind::Cuda)).unwrap();
    assert_eq!(prog.steps.len(), 1);
    insta::assert_snapshot!(cuda_of(&common::elementwise_chain()));
}

#[test]
fn residual_add_is_the_layernorm_prologue() {
    let (prog, _) = cuda_kernels(&common::residual_layernorm(), &qatc_kernels::Target::of(qatc_kernels::TargetKind::Cuda)).unwrap();
    assert_eq!(prog.steps.len(), 1);
    insta::assert_snapshot!(cuda_of(&common::residual_layernorm()));
}

#[test]
fn causal_softmax() {
    insta::assert_snapshot!(cuda_of(&common::causal_softmax()));
}

#[test]
fn attention_never_writes_the_scores() {
    let (prog, kernels) = cuda_kernels(&common::attention(), &qatc_kernels::Target::of(qatc_kernels::TargetKind::Cuda)).unwrap();
    assert_eq!(prog.steps.len(), 1, "{prog}");
    assert!(prog.buffers.iter().all(|b| b.shape.iter().rev().take(2).ne([64, 64].iter())), "no [.., T, T] buffer");
    assert!(kernels[0].name.starts_with("fused_attention_"));
    insta::assert_snapshot!(cuda_of(&common::attention()));
}

#[test]
fn adamw_is_one_kernel() {
    let (prog, _) = cuda_kernels(&common::adamw(), &qatc_kernels::Target::of(qatc_kernels::TargetKind::Cuda)).unwrap();
    assert_eq!(prog.steps.len(), 1);
    insta::assert_snapshot!(cuda_of(&common::adamw()));
}

/// The 8-bit moment's kernels: the dequantization and the update (one elementwise kernel each,
/// unfused), one program per block for the absmax (its last block partial), the requantization.
#[test]
fn adamw8bit_moment_kernels() {
    let g = common::adamw8bit_moment();
    let (prog, kernels) = cuda_kernels(&g, &qatc_kernels::Target::of(qatc_kernels::TargetKind::Cuda)).unwrap();
    assert_eq!(prog.steps.len(), 4, "{prog}");
    assert!(kernels.iter().any(|k| k.source.contains("qatc::dyn_nearest(qatc::DYN_SIGNED")));
    insta::assert_snapshot!(cuda_of(&g));
}

#[test]
fn dequant_prologue_and_bias_epilogue() {
    let (prog, _) = cuda_kernels(&common::dequant_gemm(), &qatc_kernels::Target::of(qatc_kernels::TargetKind::Cuda)).unwrap();
    let gemms: Vec<_> = prog.gemms().collect();
    assert_eq!(gemms.len(), 1);
    assert!(gemms[0].bias.is_some(), "the bias rides on the GEMM");
    assert_eq!(prog.materialized.len(), 1, "the dequantized weight is reported");
    assert!(matches!(prog.steps[0], Step::Launch { .. }));
    insta::assert_snapshot!(cuda_of(&common::dequant_gemm()));
}

#[test]
fn attention_backward_recomputes_instead_of_storing() {
    let (prog, kernels) = cuda_kernels(&common::attention_backward(), &qatc_kernels::Target::of(qatc_kernels::TargetKind::Cuda)).unwrap();
    // lse, delta, dq, dk+dv: each written into its slice of the result, no [T, T] buffer
    assert_eq!(prog.steps.len(), 4, "{prog}");
    assert!(prog.buffers.iter().all(|b| b.shape.iter().rev().take(2).ne([64, 64].iter())));
    assert!(kernels.iter().all(|k| k.name.starts_with("fused_attention_bwd_")));
    insta::assert_snapshot!(cuda_of(&common::attention_backward()));
}

/// `--precision bf16|fp16` attention (GPT-2's hs 64, T 100: a partial last tile): the forward
/// picks the tensor-core template (`qatc_attention_mma.cuh`) for sm_80+, with the fp32 template
/// behind `#if` for older architectures; `CudaSettings::GENERAL` and f32 values keep the fp32
/// template alone. Same name, params and launch dims either way (the executor cannot tell).
#[test]
fn attention_forward_on_tensor_cores_for_16_bit_values() {
    use qatc_ir::DType;
    use qatc_kernels::cuda::emit_with;
    use qatc_kernels::CudaSettings;
    let forward = |d: DType, cg: &CudaSettings| {
        let prog = qatc_kernels::lower(&common::attention_of(d, 100, 2, 64)).unwrap();
        let k = prog.kernels.iter().find(|k| k.family == "attention.flash").expect("the attention kernel");
        emit_with(k, cg).unwrap()
    };
    let bf16 = forward(DType::BF16, &CudaSettings::default());
    assert!(bf16.source.contains("qatc::attention_forward_mma<64, qatc::MmaBf16>"), "{}", bf16.source);
    assert!(bf16.source.contains("#include \"qatc_attention_mma.cuh\""));
    let fp16 = forward(DType::F16, &CudaSettings::default());
    assert!(fp16.source.contains("qatc::attention_forward_mma<64, qatc::MmaF16>"), "{}", fp16.source);
    let general = forward(DType::BF16, &CudaSettings::GENERAL);
    assert!(!general.source.contains("mma") && general.source.contains("qatc::attention_forward<64, 64, 32>"), "{}", general.source);
    assert_eq!((&general.name, &general.launch), (&bf16.name, &bf16.launch));
    let f32 = forward(DType::F32, &CudaSettings::default());
    assert!(!f32.source.contains("mma"), "{}", f32.source);
    insta::assert_snapshot!(format!("// ---- {} ----\n{}", bf16.name, bf16.source));
}

/// The bf16 backward's lse (its forward is not in this graph), delta, dq and dk/dv on tensor
/// cores (`qatc_attention_mma.cuh`).
#[test]
fn attention_backward_on_tensor_cores_for_16_bit_values() {
    let prog = qatc_kernels::lower(&common::attention_backward_of(qatc_ir::DType::BF16, 100, 2, 64)).unwrap();
    let mut text = String::new();
    let mut mma = 0;
    for k in prog.kernels.iter().filter(|k| k.family == "attention_bwd.flash") {
        let c = qatc_kernels::cuda::emit(k).unwrap();
        mma += usize::from(c.source.contains("_mma<64, qatc::MmaBf16>"));
        text.push_str(&format!("// ---- {} ----\n{}\n", c.name, c.source));
    }
    assert_eq!(mma, 4, "{text}");
    insta::assert_snapshot!(text);
}
