//! Saturation skips a rule application whose classes are all settled (`passes/src/fusion/
//! runner.rs`, `lang::settled`): the e-graph must grow exactly as it does when every match is
//! applied every iteration (`FuseOptions::recheck`, egg's plain scheduling). Checked on the
//! training steps of fp32 and bf16, AdamW and 8-bit AdamW, no checkpointing and `blocks`, LoRA
//! on 4-bit weights and a full fine-tune: the same e-nodes, e-classes, rules fired and fused
//! graph, and each case must have skipped something, or it would prove nothing.

use qatc::cli::options::{model_options, QuantArgs};
use qatc::frontend::config::Gpt2Config;
use qatc::step::{self, StepOptions};
use qatc_passes::fusion::{fuse_graph, FuseOptions};
use qatc_passes::lora::LoraOptions;
use qatc_passes::optim::Moments;
use qatc_passes::precision::Precision;
use qatc_passes::remat::Checkpoint;

fn config() -> Gpt2Config {
    Gpt2Config { n_embd: 64, n_layer: 3, n_head: 4, n_positions: 128, vocab_size: 512, layer_norm_epsilon: 1e-5 }
}

/// The step before fusion.
fn unfused(precision: Precision, moments: Moments, checkpoint: Checkpoint, lora: bool) -> qatc_ir::Graph {
    let mut o = StepOptions::new(2, 32);
    let q = QuantArgs { bits: Some(4), group: Some(32), ..Default::default() };
    o.model = if lora {
        model_options(&q, Some(LoraOptions::new(8)), false, true)
    } else {
        model_options(&QuantArgs::default(), None, true, true)
    }
    .expect("model options");
    o.precision = precision;
    o.adamw.moments = moments;
    o.checkpoint = checkpoint;
    o.fuse = None;
    step::train(&config(), &o, |_, _| {}).expect("the step builds").0
}

#[test]
fn skipping_settled_matches_grows_the_same_e_graph() {
    for (precision, moments, checkpoint, lora) in [
        (Precision::Fp32, Moments::F32, Checkpoint::None, true),
        (Precision::Bf16, Moments::F32, Checkpoint::None, true),
        (Precision::Fp32, Moments::Blockwise8, Checkpoint::Blocks, true),
        (Precision::Bf16, Moments::Blockwise8, Checkpoint::Blocks, true),
        (Precision::Fp32, Moments::F32, Checkpoint::Blocks, false),
        (Precision::Bf16, Moments::Blockwise8, Checkpoint::None, false),
    ] {
        let what = format!("{precision:?}, {moments:?}, {}, lora {lora}", checkpoint.describe());
        let g = unfused(precision, moments, checkpoint, lora);
        let skipping = fuse_graph(&g, &FuseOptions::default()).expect("fuses");
        let every = fuse_graph(&g, &FuseOptions { recheck: true, ..Default::default() }).expect("fuses");
        let (s, e) = (&skipping.report.saturation, &every.report.saturation);
        assert!(s.complete && e.complete, "{what}: saturated ({} / {})", s.stop_reason, e.stop_reason);
        assert_eq!(e.settled_skipped, 0, "{what}: recheck skips nothing");
        assert!(s.settled_skipped > 0, "{what}: nothing was skipped, so this case proves nothing");
        assert_eq!((s.enodes, s.eclasses, s.iterations), (e.enodes, e.eclasses, e.iterations), "{what}: the e-graph's size");
        assert_eq!(s.rules_fired, e.rules_fired, "{what}: rules fired");
        assert_eq!(qatc_ir::print(&skipping.graph), qatc_ir::print(&every.graph), "{what}: the fused step");
    }
}
