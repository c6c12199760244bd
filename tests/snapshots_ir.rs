//! Snapshots of the IR after every stage of the pipeline for a 1-layer tiny GPT-2
//! (C 8, NH 2, V 11, B 1, T 4): lower, trainable (full fine-tune and LoRA), clip, autodiff and
//! adamw here with clipping; fake_quant, lora and fold with 4-bit + LoRA; microbatch with K = 2;
//! remat with the `blocks` policy. The fused step (`fuse`), its lowered program and an LLVM module
//! are in `snapshots_fusion.rs`. A change here is a change to what qatc builds: review the diff
//! like code (`cargo insta review`).

use qatc::frontend::config::Gpt2Config;
use qatc::step::{self, StepOptions};
use qatc_ir::print;

fn tiny() -> Gpt2Config {
    Gpt2Config { n_embd: 8, n_layer: 1, n_head: 2, n_positions: 8, vocab_size: 11, layer_norm_epsilon: 1e-5 }
}

#[test]
fn every_stage_of_the_one_layer_step() {
    let mut o = StepOptions::new(1, 4);
    o.clip = Some(1.0);
    let mut stages = Vec::new();
    step::train(&tiny(), &o, |name, g| stages.push((name.name(), print(g)))).unwrap();
    let names: Vec<_> = stages.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, ["lower", "trainable", "fold", "microbatch", "autodiff", "clip", "adamw"]);
    for (name, text) in stages {
        if ["lower", "trainable", "autodiff", "clip", "adamw"].contains(&name) {
            insta::assert_snapshot!(name, text);
        }
    }
}

#[test]
fn printing_is_deterministic_across_builds() {
    let a = print(&step::forward(&tiny(), 1, 4, false).unwrap());
    let b = print(&step::forward(&tiny(), 1, 4, false).unwrap());
    assert_eq!(a, b);
    assert_eq!(print(&qatc_ir::parse(&a).unwrap()), a, "the printed step parses back to itself");
}

/// The QAT + LoRA stages on the same 1-layer model: fake_quant (4-bit g4 sym on all linears),
/// lora (r 2, all linears), trainable (only A and B) and fold (frozen fake-quants become i4
/// codes + scales).
#[test]
fn qat_and_lora_stages() {
    use qatc_ir::{QuantScheme, QuantSpec};
    use qatc_passes::lora::LoraOptions;
    use qatc_passes::quant::QuantOptions;
    let mut o = StepOptions::new(1, 4);
    o.model.full_finetune = false;
    o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 4, scheme: QuantScheme::Sym }));
    o.model.lora = Some(LoraOptions::new(2));
    let mut stages = Vec::new();
    step::train(&tiny(), &o, |name, g| stages.push((name.name(), print(g)))).unwrap();
    for (name, text) in stages {
        if ["fake_quant", "lora", "trainable", "fold"].contains(&name) {
            insta::assert_snapshot!(format!("qat_{name}"), text);
        }
    }
}

/// One stage after another on its own: the step after `stage` with options `o`.
fn after(o: &StepOptions, stage: &str) -> String {
    let mut found = None;
    step::train(&tiny(), o, |name, g| {
        if name.name() == stage {
            found = Some(print(g));
        }
    })
    .unwrap();
    found.unwrap_or_else(|| panic!("stage {stage} did not run"))
}

/// Gradient accumulation as a loop (K = 2): one micro-batch's graph whose loss is scaled by 1/K
/// (`loss.share`); after autodiff the gradients and the loss are added to the sums `accum.*`,
/// which clipping and AdamW read; after AdamW every other update waits for `accum.apply`.
#[test]
fn microbatch_stages_with_two_micro_batches() {
    let mut o = StepOptions::new(1, 4);
    o.grad_accum = 2;
    insta::assert_snapshot!("microbatch_k2", after(&o, "microbatch"));
    let accumulated = after(&o, "accumulate");
    assert!(accumulated.contains("\"accum.grad:wte.weight\"") && accumulated.contains("\"accum.loss.kept\""));
    insta::assert_snapshot!("accumulate_k2", accumulated);
    let gated = after(&o, "apply_gate");
    assert!(gated.contains("\"wte.weight.if_applied\"") && gated.contains("\"step.if_applied\""));
    insta::assert_snapshot!("apply_gate_k2", gated);
}

/// Checkpointing by blocks: the block's inner values are recomputed in the backward
/// (`NAME.recompute`) instead of being kept.
#[test]
fn remat_stage_with_the_blocks_policy() {
    let mut o = StepOptions::new(1, 4);
    o.checkpoint = qatc_passes::remat::Checkpoint::Blocks;
    let text = after(&o, "remat");
    assert!(text.contains(".recompute\""), "blocks recomputes something");
    insta::assert_snapshot!("remat_blocks", text);
}

/// Generation's cached pass (`qatc generate`): S 2 new positions over a KV cache of M 5, as
/// lowered, and with 4-bit + LoRA r 2 after fold (the passes find its linears by the names the
/// training forward gives them; everything is frozen, the caches are state with updates).
#[test]
fn cached_generation_pass() {
    use qatc_ir::{QuantScheme, QuantSpec};
    use qatc_passes::lora::LoraOptions;
    use qatc_passes::quant::QuantOptions;
    let plain = step::cached(&tiny(), 2, 5, &step::ModelOptions::default(), |_, _| {}).unwrap().0;
    insta::assert_snapshot!("cached_lower", print(&plain));
    let mo = step::ModelOptions {
        quant: Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 4, scheme: QuantScheme::Sym })),
        lora: Some(LoraOptions::new(2)),
        ..Default::default()
    };
    let mut stages = Vec::new();
    let (qat, _) = step::cached(&tiny(), 2, 5, &mo, |name, _| stages.push(name.name())).unwrap();
    assert_eq!(stages, ["lower", "fake_quant", "lora", "trainable", "fold"]);
    insta::assert_snapshot!("cached_qat_fold", print(&qat));
}

/// Data parallelism over N = 2 ranks: after `data_parallel` each gradient is all-reduced (mean;
/// `dp.b0:grad:NAME`, one 25 MiB bucket here) and the loss too (`loss.global`); at ZeRO 1 each
/// gradient is padded to a multiple of 2, reduce-scattered to this rank's block, clipping's sum of
/// squares all-reduced, and AdamW updates the block of the weight row `rank` selects, then
/// all-gathers it (`zero:NAME`); at ZeRO 2 with K = 2 the sums `accum.grad:NAME` hold blocks;
/// at ZeRO 3 (`zero`) each trainable input is a block, all-gathered before each use
/// (`zero3:NAME`).
#[test]
fn data_parallel_and_zero_stages_over_two_ranks() {
    use qatc_passes::zero::Parallel;
    let mut o = StepOptions::new(1, 4);
    o.clip = Some(1.0);
    o.parallel = Parallel { ranks: 2, zero: 0 };
    let dp = after(&o, "data_parallel");
    assert!(dp.contains("\"dp.b0:grad:wte.weight\"") && dp.contains("\"loss.global\""));
    insta::assert_snapshot!("data_parallel_n2", dp);
    o.parallel.zero = 1;
    insta::assert_snapshot!("data_parallel_n2_zero1", after(&o, "data_parallel"));
    let adamw = after(&o, "adamw");
    assert!(adamw.contains("\"zero:wte.weight\"") && adamw.contains("\"rank\""));
    insta::assert_snapshot!("adamw_n2_zero1", adamw);
    let mut k2 = o.clone();
    k2.grad_accum = 2;
    k2.parallel.zero = 2;
    insta::assert_snapshot!("accumulate_k2_n2_zero2", after(&k2, "accumulate"));
    o.parallel.zero = 3;
    let z3 = after(&o, "zero");
    assert!(z3.contains("\"zero3:wte.weight\""));
    insta::assert_snapshot!("zero_n2_zero3", z3);
}
