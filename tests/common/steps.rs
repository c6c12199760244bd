//! The small training steps that tests of a pass or lowering shortcut sweep: every setting that
//! changes the step's shape of work (precision, optimizer, checkpointing, LoRA or a full fine-tune).

use qatc::cli::options::{model_options, QuantArgs};
use qatc::frontend::config::Gpt2Config;
use qatc::step::{self, StepOptions};
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::LoraOptions;
use qatc_passes::optim::Moments;
use qatc_passes::precision::Precision;
use qatc_passes::remat::Checkpoint;

/// Three layers, so that every layer's kernels have two like them.
pub fn three_layers() -> Gpt2Config {
    Gpt2Config { n_embd: 64, n_layer: 3, n_head: 4, n_positions: 128, vocab_size: 512, layer_norm_epsilon: 1e-5 }
}

/// One setting: precision, optimizer moments, checkpoint policy, LoRA on 4-bit weights (or a
/// full fine-tune).
pub type Setting = (Precision, Moments, Checkpoint, bool);

/// fp32 and bf16, AdamW and 8-bit AdamW, no checkpointing and `blocks`, LoRA and a full fine-tune.
pub const SETTINGS: [Setting; 6] = [
    (Precision::Fp32, Moments::F32, Checkpoint::None, true),
    (Precision::Bf16, Moments::F32, Checkpoint::None, true),
    (Precision::Fp32, Moments::Blockwise8, Checkpoint::Blocks, true),
    (Precision::Bf16, Moments::Blockwise8, Checkpoint::Blocks, true),
    (Precision::Fp32, Moments::F32, Checkpoint::Blocks, false),
    (Precision::Bf16, Moments::Blockwise8, Checkpoint::None, false),
];

/// The training step of [`three_layers`] at B 2, T 32 in setting `s` (4-bit q4_0 g32 + LoRA r 8),
/// fused or not.
pub fn train_step(s: Setting, fuse: bool) -> qatc_ir::Graph {
    let (precision, moments, checkpoint, lora) = s;
    let mut o = StepOptions::new(2, 32);
    let q = QuantArgs { bits: Some(4), group: Some(32), scheme: qatc_ir::QuantScheme::from_name("q4_0"), ..Default::default() };
    o.model = if lora {
        model_options(&q, Some(LoraOptions::new(8)), false, true)
    } else {
        model_options(&QuantArgs::default(), None, true, true)
    }
    .expect("model options");
    o.precision = precision;
    o.adamw.moments = moments;
    o.checkpoint = checkpoint;
    o.fuse = fuse.then(FuseOptions::default);
    step::train(&three_layers(), &o, |_, _| {}).expect("the step builds").0
}

/// A setting in words, for failure messages.
pub fn describe((precision, moments, checkpoint, lora): Setting) -> String {
    format!("{precision:?}, {moments:?}, {}, lora {lora}", checkpoint.describe())
}
