//! Snapshots of the fused training step of the 1-layer tiny GPT-2 (C 8, NH 2, V 11, B 1, T 4; the
//! config of `snapshots_ir.rs`): a full fine-tune with clipping, and 4-bit + LoRA r=2; the
//! 4-bit + LoRA step lowered to a program (every buffer, launch, GEMM and view), and one of its
//! kernels as the LLVM backend builds it, unoptimized. A change here is a change to which
//! kernels qatc builds: review the diff like code (`cargo insta review`).

use qatc::frontend::config::Gpt2Config;
use qatc::step::{self, StepOptions};
use qatc_ir::{print, Graph, Op, QuantScheme, QuantSpec};
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::LoraOptions;
use qatc_passes::quant::QuantOptions;

fn tiny() -> Gpt2Config {
    Gpt2Config { n_embd: 8, n_layer: 1, n_head: 2, n_positions: 8, vocab_size: 11, layer_norm_epsilon: 1e-5 }
}

fn fused(mut o: StepOptions) -> (Graph, String) {
    o.fuse = Some(FuseOptions::default());
    let mut summary = String::new();
    let (g, reports) = step::train(&tiny(), &o, |_, _| {}).unwrap();
    let r = reports.iter().find_map(|r| r.fusion.as_deref()).expect("the fuse stage ran");
    summary.push_str(&format!(
        "kernels {} -> {}\nbytes {} -> {} (ideal {})\nstop: {}\n",
        r.kernels_before, r.kernels_after, r.bytes_before, r.bytes_after, r.ideal_bytes, r.saturation.stop_reason
    ));
    for (fam, t) in &r.families {
        summary.push_str(&format!("{fam}: {} kernels, {} bytes\n", t.kernels, t.bytes));
    }
    (g, summary)
}

fn qlora() -> StepOptions {
    let mut o = StepOptions::new(1, 4);
    o.model.full_finetune = false;
    o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 4, scheme: QuantScheme::Sym }));
    o.model.lora = Some(LoraOptions::new(2));
    o
}

#[test]
fn fused_full_finetune_step() {
    let mut o = StepOptions::new(1, 4);
    o.clip = Some(1.0);
    let (g, summary) = fused(o);
    insta::assert_snapshot!("fused_full_finetune", print(&g));
    insta::assert_snapshot!("fused_full_finetune_report", summary);
}

#[test]
fn fused_qlora_step() {
    let (g, summary) = fused(qlora());
    insta::assert_snapshot!("fused_qlora", print(&g));
    insta::assert_snapshot!("fused_qlora_report", summary);
}

#[test]
fn fusion_is_deterministic_and_the_fused_step_parses_back() {
    let (a, _) = fused(qlora());
    let (b, _) = fused(qlora());
    let text = print(&a);
    assert_eq!(text, print(&b));
    assert_eq!(print(&qatc_ir::parse(&text).unwrap()), text);
    assert!(a.node_ids().iter().any(|&n| matches!(a.node(n).op, Op::Kernel { .. })));
}

/// The lowered 4-bit + LoRA step: which kernel each launch runs on which buffers, every GEMM's
/// operand views, where each output lives.
#[test]
fn lowered_qlora_program() {
    let (g, _) = fused(qlora());
    let prog = qatc_kernels::lower(&g).unwrap();
    insta::assert_snapshot!("lowered_qlora_program", prog.listing());
}

/// One kernel (the first layernorm of the lowered 4-bit + LoRA step) as LLVM IR before
/// optimization: the backend's own output, independent of the host.
#[cfg(feature = "llvm")]
#[test]
fn unoptimized_llvm_module() {
    let (g, _) = fused(qlora());
    let prog = qatc_kernels::lower(&g).unwrap();
    let k = prog.kernels.iter().find(|k| k.family == "layernorm").expect("a layernorm kernel");
    let (name, ir) = qatc_kernels::llvm::emit_unoptimized_ir(k).unwrap();
    assert!(ir.contains(&format!("define void @{name}(")), "{ir}");
    insta::assert_snapshot!("unoptimized_llvm_layernorm", ir);
}
