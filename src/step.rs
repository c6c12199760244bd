//! The compile pipeline, top to bottom: `qatc_passes::pipeline::STAGES`, each stage one named
//! pass (`qatc dump --after NAME`), the graph verified after each one. `model` runs lower ..=
//! fold, `train_from` the rest; a stage whose option is off does not run. This file only turns
//! the step's options into the pipeline's and runs spans of the table.

use qatc_ir::{Deadline, Graph};
use qatc_passes::lora::LoraOptions;
use qatc_passes::optim::AdamW;
use qatc_passes::pipeline::{self, PipelineOptions};
use qatc_passes::precision::{LossScaling, Precision};
use qatc_passes::quant::QuantOptions;
use qatc_passes::zero::Parallel;
use qatc_passes::{PassError, PassReport};

use crate::frontend::config::Gpt2Config;
use crate::frontend::gpt2::{lower, lower_cached, CachedOptions, LowerOptions};

pub use crate::frontend::gpt2::BatchInputs;

pub use qatc_passes::pipeline::Stage;

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
    /// What the batches give beside ids and targets (instruction data: per-token loss weights).
    pub inputs: BatchInputs,
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
    /// Data-parallel ranks and ZeRO stage (`--ranks`, `--zero`): the step is one rank's, of
    /// `batch` rows.
    pub parallel: Parallel,
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
            parallel: Parallel::default(),
        }
    }
}

/// The bare forward graph (the `lower` stage alone).
pub fn forward(cfg: &Gpt2Config, batch: usize, seq: usize, logits: bool) -> Result<Graph, PassError> {
    forward_with(cfg, &LowerOptions { batch, seq, logits, inputs: BatchInputs::default() })
}

/// The bare forward graph as `o` says.
pub fn forward_with(cfg: &Gpt2Config, o: &LowerOptions) -> Result<Graph, PassError> {
    lower(cfg, o).map_err(|source| PassError::Ir { pass: Stage::Lower, error: source })
}

impl ModelOptions {
    /// The pipeline's options for the model stages alone (an evaluation at precision `p`).
    fn pipeline(&self, p: Precision, deadline: Deadline) -> PipelineOptions {
        PipelineOptions {
            quant: self.quant.clone(),
            lora: self.lora.clone(),
            full_finetune: self.full_finetune,
            training: self.training,
            grad_accum: 1,
            clip: None,
            adamw: AdamW::default(),
            keep_grads: false,
            precision: p,
            loss_scaling: LossScaling::default(),
            checkpoint: qatc_passes::remat::Checkpoint::None,
            fuse: None,
            parallel: Parallel::default(),
            deadline,
        }
    }
}

impl StepOptions {
    /// The pipeline's options for this step.
    pub fn pipeline(&self) -> PipelineOptions {
        PipelineOptions {
            grad_accum: self.grad_accum,
            clip: self.clip,
            adamw: self.adamw.clone(),
            keep_grads: self.keep_grads,
            loss_scaling: self.loss_scaling.clone(),
            checkpoint: self.checkpoint,
            fuse: self.fuse.clone(),
            parallel: self.parallel,
            ..self.model.pipeline(self.precision, self.deadline)
        }
    }
}

/// lower -> fake_quant -> lora -> trainable -> fold: the model as it will be trained or evaluated.
pub fn model(
    cfg: &Gpt2Config,
    batch: usize,
    seq: usize,
    logits: bool,
    mo: &ModelOptions,
    after: impl FnMut(Stage, &Graph),
) -> Result<(Graph, Vec<PassReport>), PassError> {
    let lo = LowerOptions { batch, seq, logits, inputs: mo.inputs };
    model_with(cfg, &lo, &mo.pipeline(Precision::Fp32, Deadline::unlimited()), after)
}

fn model_with(
    cfg: &Gpt2Config,
    lo: &LowerOptions,
    o: &PipelineOptions,
    after: impl FnMut(Stage, &Graph),
) -> Result<(Graph, Vec<PassReport>), PassError> {
    model_stages(forward_with(cfg, lo)?, o, after)
}

/// A lowered graph verified, then fake_quant ..= fold.
fn model_stages(g: Graph, o: &PipelineOptions, mut after: impl FnMut(Stage, &Graph)) -> Result<(Graph, Vec<PassReport>), PassError> {
    qatc_ir::verify(&g).map_err(|source| PassError::Ir { pass: Stage::Lower, error: source })?;
    after(Stage::Lower, &g);
    pipeline::run(g, Stage::FakeQuant, Stage::Fold, o, after)
}

/// A generation pass over a KV cache (`qatc generate`): `tokens` new positions, a cache of
/// `capacity`, built as an evaluation is (lower, then fake_quant ..= fold, fp32), so the model it
/// samples from is the one `qatc eval` measures: the same quantization, LoRA and folded codes.
pub fn cached(
    cfg: &Gpt2Config,
    tokens: usize,
    capacity: usize,
    mo: &ModelOptions,
    after: impl FnMut(Stage, &Graph),
) -> Result<(Graph, Vec<PassReport>), PassError> {
    let g = lower_cached(cfg, &CachedOptions { tokens, capacity }).map_err(|source| PassError::Ir { pass: Stage::Lower, error: source })?;
    model_stages(g, &mo.pipeline(Precision::Fp32, Deadline::unlimited()), after)
}

/// The model graph for evaluation (the loss, and the logits when asked): `model`, then the
/// `precision` stage when `p` is not fp32, then fusion when `fuse` is given (the compiled
/// forward of `qatc eval`, `prt` and validation: the kernels of the training step's forward,
/// flash attention, GEMMs fed 4-bit panels with their epilogues, the LM head's cross-entropy
/// chunk by chunk of rows, never the whole [B T, V] logits).
#[allow(clippy::too_many_arguments)]
pub fn evaluation(
    cfg: &Gpt2Config,
    batch: usize,
    seq: usize,
    logits: bool,
    mo: &ModelOptions,
    p: Precision,
    fuse: Option<qatc_passes::fusion::FuseOptions>,
    mut after: impl FnMut(Stage, &Graph),
) -> Result<(Graph, Vec<PassReport>), PassError> {
    let o = PipelineOptions { fuse, ..mo.pipeline(p, Deadline::unlimited()) };
    let lo = LowerOptions { batch, seq, logits, inputs: mo.inputs };
    let (g, mut reports) = model_with(cfg, &lo, &o, &mut after)?;
    let (g, more) = pipeline::run(g, Stage::Precision, Stage::Precision, &o, &mut after)?;
    reports.extend(more);
    if o.fuse.is_none() {
        return Ok((g, reports));
    }
    let (g, more) = pipeline::run(g, Stage::Fuse, Stage::Fuse, &o, after)?;
    reports.extend(more);
    Ok((g, reports))
}

/// The joint forward + backward + AdamW step from the model graph: microbatch ..= fuse.
pub fn train_from(g: Graph, opts: &StepOptions, after: impl FnMut(Stage, &Graph)) -> Result<(Graph, Vec<PassReport>), PassError> {
    pipeline::run(g, Stage::Microbatch, Stage::Fuse, &opts.pipeline(), after)
}

/// The whole pipeline for a training step.
pub fn train(cfg: &Gpt2Config, opts: &StepOptions, mut after: impl FnMut(Stage, &Graph)) -> Result<(Graph, Vec<PassReport>), PassError> {
    let o = opts.pipeline();
    let lo = LowerOptions { batch: opts.batch, seq: opts.seq, logits: false, inputs: opts.model.inputs };
    let (g, mut reports) = model_with(cfg, &lo, &o, &mut after)?;
    let (g, more) = pipeline::run(g, Stage::Microbatch, Stage::Fuse, &o, after)?;
    reports.extend(more);
    Ok((g, reports))
}
