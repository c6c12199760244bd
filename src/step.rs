//! The compile pipeline, top to bottom: the stages of `Stage`, in its order, each one named pass
//! (`qatc dump --after NAME`), the graph verified after each one. `model` runs lower ..= fold,
//! `train_from` the rest; a stage whose option is off does not run.

use qatc_ir::{Deadline, Graph, InputKind};
use qatc_passes::lora::{self, LoraOptions};
use qatc_passes::optim::AdamW;
use qatc_passes::precision::{self, LossScaling, Precision};
use qatc_passes::quant::{self, QuantOptions};
use qatc_passes::{autodiff, microbatch, optim, pipeline, Pass, PassError, PassReport};

use crate::frontend::config::Gpt2Config;
use crate::frontend::gpt2::{lower, LowerOptions};

/// The pipeline's stages in order: the one list `qatc dump` offers and the passes are named by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Lower,
    FakeQuant,
    Lora,
    Trainable,
    Fold,
    Microbatch,
    Autodiff,
    Clip,
    Adamw,
    Precision,
    Remat,
    Fuse,
}

impl Stage {
    pub const ALL: [Stage; 12] = [
        Stage::Lower,
        Stage::FakeQuant,
        Stage::Lora,
        Stage::Trainable,
        Stage::Fold,
        Stage::Microbatch,
        Stage::Autodiff,
        Stage::Clip,
        Stage::Adamw,
        Stage::Precision,
        Stage::Remat,
        Stage::Fuse,
    ];

    /// The name `qatc dump --after` takes and the `after` hooks see.
    pub fn name(self) -> &'static str {
        self.row().0
    }

    /// What the stage does (and the option that turns it on).
    pub fn about(self) -> &'static str {
        self.row().1
    }

    fn row(self) -> (&'static str, &'static str) {
        match self {
            Stage::Lower => ("lower", "the forward pass and mean cross-entropy, from the checkpoint"),
            Stage::FakeQuant => ("fake_quant", "FakeQuant on the targeted weights, straight-through gradient (--bits)"),
            Stage::Lora => ("lora", "LoRA branches y += scaling * (x A^T) B^T with trainable A, B (--lora)"),
            Stage::Trainable => ("trainable", "marks the weights that training updates (LoRA's, or all with --full-finetune)"),
            Stage::Fold => ("fold", "frozen FakeQuant -> packed codes + Dequantize, bit-identical"),
            Stage::Microbatch => ("microbatch", "unrolls --grad-accum K micro-batches sharing the weights"),
            Stage::Autodiff => ("autodiff", "reverse-mode gradients of the loss for the trainable weights"),
            Stage::Clip => ("clip", "global-norm gradient clipping (--clip X)"),
            Stage::Adamw => ("adamw", "the AdamW update with its moments and step count as state"),
            Stage::Precision => {
                ("precision", "bf16/fp16 activations, gradients and GEMM operands, f32 master weights; fp16 loss scaling (--precision)")
            }
            Stage::Remat => ("remat", "checkpointing: forward values recomputed in the backward, NAME.recompute (--checkpoint)"),
            Stage::Fuse => ("fuse", "kernel fusion by equality saturation (egg): one Kernel node per fused group (--no-fuse)"),
        }
    }
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `qatc dump --after`: the values are `Stage::ALL`, with what each does.
impl clap::ValueEnum for Stage {
    fn value_variants<'a>() -> &'a [Self] {
        &Stage::ALL
    }
    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(clap::builder::PossibleValue::new(self.name()).help(self.about()))
    }
}

/// What the model graph is built with (shared by eval, compile and train).
#[derive(Clone, Debug, Default)]
pub struct ModelOptions {
    pub quant: Option<QuantOptions>,
    pub lora: Option<LoraOptions>,
    /// Every weight trains (else only LoRA's A and B).
    pub full_finetune: bool,
    /// Building for training: weights may be trainable. For evaluation everything is frozen
    /// (and LoRA dropout is off).
    pub training: bool,
}

/// What the training step adds.
#[derive(Clone, Debug)]
pub struct StepOptions {
    pub batch: usize,
    pub seq: usize,
    pub grad_accum: usize,
    pub clip: Option<f64>,
    pub adamw: AdamW,
    /// Keep `grad:NAME` outputs (parity tests read them; training does not need them).
    pub keep_grads: bool,
    pub model: ModelOptions,
    /// Which forward values the backward recomputes instead of saving (`remat`).
    pub checkpoint: qatc_passes::remat::Checkpoint,
    /// Fuse the step into kernels, last (None skips it; the CLI fuses unless --no-fuse).
    pub fuse: Option<qatc_passes::fusion::FuseOptions>,
    /// The storage type of activations, gradients and GEMM operands (`precision`).
    pub precision: Precision,
    /// fp16's dynamic loss scaling (GradScaler's defaults).
    pub loss_scaling: LossScaling,
    /// How fresh learned scales start (`--scales learned` without an adapter that has them).
    pub scale_init: crate::config::ScaleInit,
    /// The compile budget (`--compile-timeout`): every pass, and the long loops inside remat,
    /// the planner and fusion, stop with an error once it is spent.
    pub deadline: Deadline,
}

impl StepOptions {
    pub fn new(batch: usize, seq: usize) -> StepOptions {
        StepOptions {
            batch,
            seq,
            grad_accum: 1,
            clip: None,
            adamw: AdamW::default(),
            keep_grads: false,
            model: ModelOptions { full_finetune: true, training: true, ..Default::default() },
            checkpoint: Default::default(),
            fuse: None,
            precision: Precision::Fp32,
            loss_scaling: LossScaling::default(),
            scale_init: Default::default(),
            deadline: Deadline::unlimited(),
        }
    }
}

/// The bare forward graph (the `lower` stage alone).
pub fn forward(cfg: &Gpt2Config, batch: usize, seq: usize, logits: bool) -> Result<Graph, PassError> {
    lower(cfg, &LowerOptions { batch, seq, logits }).map_err(|source| PassError::Ir { pass: Stage::Lower.name(), error: source })
}

/// Marks weights trainable: everything for a full fine-tune; otherwise only what the LoRA pass
/// created as trainable stays so. For evaluation, nothing trains.
pub fn mark_trainable(mut g: Graph, mo: &ModelOptions) -> Result<(Graph, PassReport), PassError> {
    let mut r = PassReport::new(Stage::Trainable.name());
    for id in g.inputs() {
        let Some(kind) = g.input_kind(id) else { continue };
        if !kind.is_param() {
            continue;
        }
        let train = mo.training && (mo.full_finetune || kind == InputKind::Trainable);
        g.set_input_kind(id, if train { InputKind::Trainable } else { InputKind::Frozen });
        if train {
            r.count("tensors", 1);
            r.count("elements", g.ty(id).numel() as i64);
        }
    }
    Ok((g, r))
}

/// lower -> fake_quant -> lora -> trainable -> fold: the model as it will be trained or evaluated.
pub fn model(
    cfg: &Gpt2Config,
    batch: usize,
    seq: usize,
    logits: bool,
    mo: &ModelOptions,
    mut after: impl FnMut(&'static str, &Graph),
) -> Result<(Graph, Vec<PassReport>), PassError> {
    let g = forward(cfg, batch, seq, logits)?;
    qatc_ir::verify(&g).map_err(|source| PassError::Ir { pass: Stage::Lower.name(), error: source })?;
    after(Stage::Lower.name(), &g);
    let mut passes = Vec::new();
    if let Some(q) = mo.quant.clone() {
        passes.push(Pass::new(Stage::FakeQuant.name(), move |g| quant::fake_quant(g, &q)));
    }
    if let Some(mut l) = mo.lora.clone() {
        if !mo.training {
            l.dropout = 0.0;
        }
        passes.push(Pass::new(Stage::Lora.name(), move |g| lora::lora(g, &l)));
    }
    let m2 = mo.clone();
    passes.push(Pass::new(Stage::Trainable.name(), move |g| mark_trainable(g, &m2)));
    passes.push(Pass::new(Stage::Fold.name(), quant::fold));
    pipeline::run(g, passes, after)
}

/// The model graph for evaluation (the loss, and the logits when asked): `model`, then the
/// `precision` stage when `p` is not fp32.
pub fn evaluation(
    cfg: &Gpt2Config,
    batch: usize,
    seq: usize,
    logits: bool,
    mo: &ModelOptions,
    p: Precision,
    mut after: impl FnMut(&'static str, &Graph),
) -> Result<(Graph, Vec<PassReport>), PassError> {
    let (g, mut reports) = model(cfg, batch, seq, logits, mo, &mut after)?;
    if p == Precision::Fp32 {
        return Ok((g, reports));
    }
    let h = LossScaling::default();
    let (g, more) = pipeline::run(g, vec![Pass::new(Stage::Precision.name(), move |g| precision::precision(g, p, &h))], after)?;
    reports.extend(more);
    Ok((g, reports))
}

/// The joint forward + backward + AdamW step from the model graph.
pub fn train_from(g: Graph, opts: &StepOptions, after: impl FnMut(&'static str, &Graph)) -> Result<(Graph, Vec<PassReport>), PassError> {
    let k = opts.grad_accum;
    let mut passes = vec![
        Pass::new(Stage::Microbatch.name(), move |g| microbatch::microbatch(g, k)),
        Pass::new(Stage::Autodiff.name(), autodiff::autodiff),
    ];
    if let Some(x) = opts.clip {
        passes.push(Pass::new(Stage::Clip.name(), move |g| optim::clip(g, x)));
    }
    let (h, keep) = (opts.adamw.clone(), opts.keep_grads);
    passes.push(Pass::new(Stage::Adamw.name(), move |g| optim::adamw(g, &h, keep)));
    if opts.precision != Precision::Fp32 {
        let (p, s) = (opts.precision, opts.loss_scaling.clone());
        passes.push(Pass::new(Stage::Precision.name(), move |g| precision::precision(g, p, &s)));
    }
    if opts.checkpoint != qatc_passes::remat::Checkpoint::None {
        let c = opts.checkpoint;
        let po = qatc_passes::plan::PlanOptions { deadline: opts.deadline, ..Default::default() };
        passes.push(Pass::new(Stage::Remat.name(), move |g| qatc_passes::remat::remat(g, c, &po)));
    }
    if let Some(f) = opts.fuse.clone() {
        let d = opts.deadline;
        passes.push(Pass::new(Stage::Fuse.name(), move |g| qatc_passes::fusion::fuse(g, &f, &d)));
    }
    pipeline::run_within(g, passes, &opts.deadline, after)
}

/// The whole pipeline for a training step.
pub fn train(
    cfg: &Gpt2Config,
    opts: &StepOptions,
    mut after: impl FnMut(&'static str, &Graph),
) -> Result<(Graph, Vec<PassReport>), PassError> {
    let (g, mut reports) = model(cfg, opts.batch, opts.seq, false, &opts.model, &mut after)?;
    let (g, more) = train_from(g, opts, &mut after)?;
    reports.extend(more);
    Ok((g, reports))
}
