//! The pipeline: one table of stages, in order, each with what it does and the function that runs
//! it. [`run`] runs a span of the table on a graph, skipping the stages its options leave off,
//! verifying after each and naming the stage that broke an invariant.
//!
//! ```text
//! lower -> fake_quant -> lora -> trainable -> fold            the model (eval stops here)
//!       -> microbatch -> autodiff -> accumulate               the training step
//!       -> data_parallel -> zero -> clip -> adamw -> apply_gate
//!       -> precision -> remat -> fuse                         how it is stored, saved, fused
//! ```
//!
//! `lower` is the frontend's (the checkpoint to the forward graph, `qatc::frontend`); every
//! other stage is a pass of this crate.

use std::collections::BTreeMap;

use qatc_ir::{verify, Deadline, Graph, InputKind};
use serde::Serialize;

use crate::error::PassError;
use crate::lora::LoraOptions;
use crate::optim::AdamW;
use crate::precision::{LossScaling, Precision};
use crate::quant::QuantOptions;
use crate::remat::Checkpoint;

/// A stage of the pipeline: the name `qatc dump --after` takes, what passes report and errors
/// name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    Lower,
    FakeQuant,
    Lora,
    Trainable,
    Fold,
    Microbatch,
    Autodiff,
    Accumulate,
    DataParallel,
    Zero,
    Clip,
    Adamw,
    ApplyGate,
    Precision,
    Remat,
    Fuse,
}

/// A stage's pass: the graph and the pipeline's options in, the new graph and its report out.
pub type StageFn = fn(Graph, &PipelineOptions) -> Result<(Graph, PassReport), PassError>;

/// One row of [`STAGES`].
pub struct StageRow {
    pub stage: Stage,
    pub name: &'static str,
    /// What it does (and the option that turns it on).
    pub about: &'static str,
    /// Whether the options turn it on.
    pub on: fn(&PipelineOptions) -> bool,
    /// None for `lower`, which the frontend runs before the table.
    pub run: Option<StageFn>,
}

/// A stage whose options are absent (never run: `on` says so first) hands the graph back.
fn unchanged(g: Graph, stage: Stage) -> Result<(Graph, PassReport), PassError> {
    Ok((g, PassReport::new(stage)))
}

/// The pipeline, in order: the one home of each stage's name, description and pass.
pub const STAGES: [StageRow; 16] = [
    StageRow {
        stage: Stage::Lower,
        name: "lower",
        about: "the forward pass and mean cross-entropy, from the checkpoint",
        on: |_| true,
        run: None,
    },
    StageRow {
        stage: Stage::FakeQuant,
        name: "fake_quant",
        about: "FakeQuant on the targeted weights, straight-through gradient (--bits)",
        on: |o| o.quant.is_some(),
        run: Some(|g, o| match &o.quant {
            Some(q) => crate::quant::fake_quant(g, q),
            None => unchanged(g, Stage::FakeQuant),
        }),
    },
    StageRow {
        stage: Stage::Lora,
        name: "lora",
        about: "LoRA branches y += scaling * (x A^T) B^T with trainable A, B (--lora)",
        on: |o| o.lora.is_some(),
        run: Some(|g, o| match &o.lora {
            // evaluation runs without dropout
            Some(l) => crate::lora::lora(g, &LoraOptions { dropout: if o.training { l.dropout } else { 0.0 }, ..l.clone() }),
            None => unchanged(g, Stage::Lora),
        }),
    },
    StageRow {
        stage: Stage::Trainable,
        name: "trainable",
        about: "marks the weights that training updates (LoRA's, or all with --full-finetune)",
        on: |_| true,
        run: Some(|g, o| Ok(mark_trainable(g, o))),
    },
    StageRow {
        stage: Stage::Fold,
        name: "fold",
        about: "frozen FakeQuant -> packed codes + Dequantize, bit-identical",
        on: |_| true,
        run: Some(|g, _| crate::quant::fold(g)),
    },
    StageRow {
        stage: Stage::Microbatch,
        name: "microbatch",
        about: "the loss of one of --grad-accum K micro-batches, scaled by 1/K (the step runs K times)",
        on: |_| true,
        run: Some(|g, o| crate::microbatch::scale_loss(g, o.grad_accum)),
    },
    StageRow {
        stage: Stage::Autodiff,
        name: "autodiff",
        about: "reverse-mode gradients of the loss for the trainable weights",
        on: |_| true,
        run: Some(|g, _| crate::autodiff::autodiff(g)),
    },
    StageRow {
        stage: Stage::Accumulate,
        name: "accumulate",
        about: "gradients and loss summed over the micro-batches in state accum.* (--grad-accum K)",
        on: |o| o.grad_accum > 1,
        run: Some(|g, o| crate::microbatch::accumulate(g, o.grad_accum, o.parallel)),
    },
    StageRow {
        stage: Stage::DataParallel,
        name: "data_parallel",
        about: "gradients averaged over --ranks N in 25 MiB buckets (ZeRO 1+: this rank's block), the loss global",
        on: |o| o.parallel.distributed(),
        run: Some(|g, o| crate::data_parallel::data_parallel(g, o.parallel)),
    },
    StageRow {
        stage: Stage::Zero,
        name: "zero",
        about: "ZeRO 3: each trainable weight held as this rank's block, all-gathered before each use (--zero 3)",
        on: |o| o.parallel.shards_parameters(),
        run: Some(|g, o| crate::zero::zero3(g, o.parallel)),
    },
    StageRow {
        stage: Stage::Clip,
        name: "clip",
        about: "global-norm gradient clipping (--clip X)",
        on: |o| o.clip.is_some(),
        run: Some(|g, o| match o.clip {
            Some(x) => crate::optim::clip(g, x, o.parallel),
            None => unchanged(g, Stage::Clip),
        }),
    },
    StageRow {
        stage: Stage::Adamw,
        name: "adamw",
        about: "the AdamW update with its moments and step count as state",
        on: |_| true,
        run: Some(|g, o| crate::optim::adamw(g, &o.adamw, o.keep_grads, o.parallel)),
    },
    StageRow {
        stage: Stage::ApplyGate,
        name: "apply_gate",
        about: "the optimizer's updates take effect on the last micro-batch only (input accum.apply)",
        on: |o| o.grad_accum > 1,
        run: Some(|g, _| crate::microbatch::gate(g)),
    },
    StageRow {
        stage: Stage::Precision,
        name: "precision",
        about: "bf16/fp16 activations, gradients and GEMM operands, f32 master weights; fp16 loss scaling (--precision)",
        on: |o| o.precision != Precision::Fp32,
        run: Some(|g, o| crate::precision::precision(g, o.precision, &o.loss_scaling)),
    },
    StageRow {
        stage: Stage::Remat,
        name: "remat",
        about: "checkpointing: forward values recomputed in the backward, NAME.recompute (--checkpoint)",
        on: |o| o.checkpoint != Checkpoint::None,
        run: Some(|g, o| crate::remat::remat(g, o.checkpoint, &crate::plan::PlanOptions { deadline: o.deadline, ..Default::default() })),
    },
    StageRow {
        stage: Stage::Fuse,
        name: "fuse",
        about: "kernel fusion by equality saturation (egg): one Kernel node per fused group (--no-fuse)",
        on: |o| o.fuse.is_some(),
        run: Some(|g, o| match &o.fuse {
            Some(f) => crate::fusion::fuse(g, f, &o.deadline),
            None => unchanged(g, Stage::Fuse),
        }),
    },
];

impl Stage {
    pub const ALL: [Stage; 16] = {
        let mut all = [Stage::Lower; 16];
        let mut i = 0;
        while i < 16 {
            all[i] = STAGES[i].stage;
            i += 1;
        }
        all
    };

    fn row(self) -> &'static StageRow {
        // the table is in `Stage`'s order (checked by a test)
        &STAGES[self as usize]
    }

    /// The name `qatc dump --after` takes and the `after` hooks see.
    pub fn name(self) -> &'static str {
        self.row().name
    }

    /// What the stage does (and the option that turns it on).
    pub fn about(self) -> &'static str {
        self.row().about
    }

    pub fn from_name(name: &str) -> Option<Stage> {
        STAGES.iter().find(|r| r.name == name).map(|r| r.stage)
    }
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A stage is written by its name (manifest.json's `passes`).
impl Serialize for Stage {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// `qatc dump --after`: the values are the stages, with what each does.
#[cfg(feature = "clap")]
impl clap::ValueEnum for Stage {
    fn value_variants<'a>() -> &'a [Self] {
        &Stage::ALL
    }
    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(clap::builder::PossibleValue::new(self.name()).help(self.about()))
    }
}

/// What the stages are configured by, all in one value: a stage reads its own part.
#[derive(Clone, Debug)]
pub struct PipelineOptions {
    pub quant: Option<QuantOptions>,
    pub lora: Option<LoraOptions>,
    /// Every weight trains (else only LoRA's A and B).
    pub full_finetune: bool,
    /// Building for training: weights may be trainable. For evaluation everything is frozen
    /// (and LoRA dropout is off).
    pub training: bool,
    /// Micro-batches per optimizer step (`--grad-accum`).
    pub grad_accum: usize,
    pub clip: Option<f64>,
    pub adamw: AdamW,
    /// Keep `grad:NAME` outputs (parity tests read them; training does not need them).
    pub keep_grads: bool,
    pub precision: Precision,
    /// fp16's dynamic loss scaling (GradScaler's defaults).
    pub loss_scaling: LossScaling,
    pub checkpoint: Checkpoint,
    /// None skips fusion.
    pub fuse: Option<crate::fusion::FuseOptions>,
    /// Ranks and ZeRO stage (`--ranks`, `--zero`): one rank's program.
    pub parallel: crate::zero::Parallel,
    /// The compile budget: every stage, and the long loops inside remat, the planner and fusion,
    /// stop with an error once it is spent.
    pub deadline: Deadline,
}

/// Marks weights trainable: everything for a full fine-tune; otherwise only what the LoRA pass
/// created as trainable stays so. For evaluation, nothing trains.
pub fn mark_trainable(mut g: Graph, o: &PipelineOptions) -> (Graph, PassReport) {
    let mut r = PassReport::new(Stage::Trainable);
    for id in g.inputs() {
        let Some(kind) = g.input_kind(id) else { continue };
        if !kind.is_param() {
            continue;
        }
        let train = o.training && (o.full_finetune || kind == InputKind::Trainable);
        g.set_input_kind(id, if train { InputKind::Trainable } else { InputKind::Frozen });
        if train {
            r.count("tensors", 1);
            r.count("elements", g.ty(id).numel() as i64);
        }
    }
    (g, r)
}

/// What a pass did, in counters a person (and `qatc compile`'s summary) can read.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PassReport {
    pub pass: Stage,
    pub counters: BTreeMap<&'static str, i64>,
    pub notes: Vec<String>,
    /// The fusion pass's full report (`qatc compile` writes it to `fusion.json`).
    #[serde(skip)]
    pub fusion: Option<Box<crate::fusion::FusionReport>>,
}

impl PassReport {
    pub fn new(pass: Stage) -> PassReport {
        PassReport { pass, counters: BTreeMap::new(), notes: Vec::new(), fusion: None }
    }
    pub fn count(&mut self, key: &'static str, by: i64) {
        *self.counters.entry(key).or_insert(0) += by;
    }
    pub fn set(&mut self, key: &'static str, v: i64) {
        self.counters.insert(key, v);
    }
}

impl std::fmt::Display for PassReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:", self.pass)?;
        for (k, v) in &self.counters {
            write!(f, " {k}={v}")?;
        }
        Ok(())
    }
}

/// Runs the stages `from ..= to` of [`STAGES`] on `g` (`lower` is the caller's), those its
/// options leave on, verifying after each and stopping with [`PassError::Expired`] after the
/// stage during which the deadline passed. `after` sees the graph after every stage that ran
/// (for `qatc dump --after` and snapshots).
pub fn run(
    mut g: Graph,
    from: Stage,
    to: Stage,
    o: &PipelineOptions,
    mut after: impl FnMut(Stage, &Graph),
) -> Result<(Graph, Vec<PassReport>), PassError> {
    let mut reports = Vec::new();
    for row in STAGES.iter().filter(|r| (from..=to).contains(&r.stage) && (r.on)(o)) {
        let Some(run) = row.run else { continue };
        let (ng, report) = run(g, o)?;
        o.deadline.check(&format!("pass {}", row.name))?;
        verify(&ng).map_err(|source| PassError::Ir { pass: row.stage, error: source })?;
        after(row.stage, &ng);
        reports.push(report);
        g = ng;
    }
    Ok((g, reports))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Stage::row` indexes the table by the enum's order, and names are unique.
    #[test]
    fn the_table_is_in_stage_order_with_unique_names() {
        for (i, row) in STAGES.iter().enumerate() {
            assert_eq!(row.stage as usize, i, "{}", row.name);
            assert_eq!(Stage::from_name(row.name), Some(row.stage));
        }
        assert_eq!(Stage::ALL.len(), STAGES.len());
    }
}
