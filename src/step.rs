//! The compile pipeline, top to bottom: lower the checkpoint to the forward graph, then the
//! passes that make it a training step. Every stage has a name (`qatc dump --after NAME`), and
//! the graph is verified after each one.

use qatc_ir::{Graph, InputKind};
use qatc_passes::optim::AdamW;
use qatc_passes::{autodiff, microbatch, optim, pipeline, Pass, PassError, PassReport};

use crate::frontend::config::Gpt2Config;
use crate::frontend::gpt2::{lower, LowerOptions};

/// Every stage in pipeline order, with what it does (for `qatc dump --list` and errors).
pub const STAGES: [(&str, &str); 6] = [
    ("lower", "the forward pass and mean cross-entropy, from the checkpoint"),
    ("trainable", "marks the weights that training updates"),
    ("microbatch", "unrolls --grad-accum K micro-batches sharing the weights"),
    ("autodiff", "reverse-mode gradients of the loss for the trainable weights"),
    ("clip", "global-norm gradient clipping (--clip X)"),
    ("adamw", "the AdamW update with its moments and step count as state"),
];

/// What the training step is built with.
#[derive(Clone, Debug)]
pub struct StepOptions {
    pub batch: usize,
    pub seq: usize,
    pub grad_accum: usize,
    pub clip: Option<f64>,
    pub adamw: AdamW,
    /// Keep `grad:NAME` outputs (parity tests read them; training does not need them).
    pub keep_grads: bool,
}

impl StepOptions {
    pub fn new(batch: usize, seq: usize) -> StepOptions {
        StepOptions { batch, seq, grad_accum: 1, clip: None, adamw: AdamW::default(), keep_grads: false }
    }
}

/// Which weights train. Full fine-tuning is the only choice until the LoRA pass exists.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Trainable {
    All,
}

pub fn forward(cfg: &Gpt2Config, batch: usize, seq: usize, logits: bool) -> Result<Graph, PassError> {
    lower(cfg, &LowerOptions { batch, seq, logits }).map_err(|source| PassError::Ir { pass: "lower", source })
}

/// Marks weights trainable.
pub fn mark_trainable(mut g: Graph, which: Trainable) -> Result<(Graph, PassReport), PassError> {
    let mut r = PassReport::new("trainable");
    for id in g.inputs() {
        if g.input_kind(id) == Some(InputKind::Frozen) && which == Trainable::All {
            g.set_input_kind(id, InputKind::Trainable);
            r.count("tensors", 1);
            r.count("elements", g.ty(id).numel() as i64);
        }
    }
    Ok((g, r))
}

/// Builds the joint forward + backward + AdamW graph from the forward graph. `after` sees the
/// graph after every stage.
pub fn train(
    fwd: Graph,
    which: Trainable,
    opts: &StepOptions,
    after: impl FnMut(&'static str, &Graph),
) -> Result<(Graph, Vec<PassReport>), PassError> {
    let k = opts.grad_accum;
    let mut passes = vec![
        Pass::new("trainable", move |g| mark_trainable(g, which)),
        Pass::new("microbatch", move |g| microbatch::microbatch(g, k)),
        Pass::new("autodiff", autodiff::autodiff),
    ];
    if let Some(x) = opts.clip {
        passes.push(Pass::new("clip", move |g| optim::clip(g, x)));
    }
    let (h, keep) = (opts.adamw.clone(), opts.keep_grads);
    passes.push(Pass::new("adamw", move |g| optim::adamw(g, &h, keep)));
    pipeline::run(fwd, passes, after)
}
