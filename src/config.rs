//! The run's configuration as data: `qatc.json`, written beside every adapter, export and
//! checkpoint. `qatc eval --adapter DIR` and `qatc export --adapter DIR` read it instead of
//! asking for the quantization flags again, and `qatc train --resume` continues with it (an
//! option given must agree with it, field by field: `cli::resume`).
//!
//! One value, three sections: `model` (what the graph is built with: quantization, LoRA, full
//! fine-tune; all that eval and export need), `step` (the training step's shape, precision,
//! optimizer, checkpoint policy, fusion and device) and `train` (the run: data, schedule, seed).
//! The command line builds it in one place (`cli::StepArgs::config`, `cli::options`,
//! `cli::train::Args::config`); it becomes the pipeline's
//! `ModelOptions` / `StepOptions` here, in one place.
//!
//! The file is versioned (`version`), and unknown fields are refused: a file from a newer qatc
//! is an error that says so, never silently half-read. A field added later is an `Option` or
//! has a `#[serde(default)]`, so that the files of this version still read.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use qatc_ir::{QuantScheme, QuantSpec};
use qatc_passes::lora::LoraOptions;
use qatc_passes::optim::{AdamW, Moments};
use qatc_passes::quant::QuantOptions;
use qatc_passes::remat::Checkpoint;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::schedule::Schedule;
use crate::step::{ModelOptions, StepOptions};
use qatc_driver::{CudaSettings, TargetKind};

mod diff;
pub use diff::{differences, first_difference};

/// The file's name in an adapter, export or training output directory.
pub const FILE: &str = "qatc.json";
/// The version this qatc writes and reads.
pub const VERSION: u32 = 1;

#[derive(Debug, Error)]
pub enum ConfigError {
    // `error`, not `source`: the message already says it, and a source would print it twice
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{path}: {why}")]
    Invalid { path: PathBuf, why: String },
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    pub version: u32,
    pub model: ModelConfig,
    /// The training step (absent for an export of an adapter qatc did not train).
    pub step: Option<StepConfig>,
    /// The training run (absent outside `qatc train`).
    pub train: Option<TrainConfig>,
}

/// What the model graph is built with: everything eval and export need.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The base checkpoint, as an absolute path.
    pub path: String,
    pub quant: Option<QuantConfig>,
    pub lora: Option<LoraConfig>,
    /// Every weight trains (no LoRA).
    pub full_finetune: bool,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct QuantConfig {
    /// The default quantization of the targeted modules.
    pub bits: u8,
    pub group: usize,
    pub scheme: QuantScheme,
    /// Module suffixes quantized with the default (`attn.c_attn`, `c_proj`, `lm_head`, ...).
    pub targets: Vec<String>,
    /// Per-module quantization from a bit map (`h.3.mlp.c_fc` -> spec; null: full precision).
    pub modules: BTreeMap<String, Option<QuantSpec>>,
    /// Dynamic per-token activation quantization of the targeted linears' inputs.
    pub act_bits: Option<u8>,
    pub qat: Qat,
    pub scales: Scales,
}

/// `--qat`: what the fake-quantization sees.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Qat {
    /// Fake-quantize the frozen base weight; LoRA adds in full precision.
    #[default]
    Base,
    /// Fake-quantize W + scaling (BA)^T, the weight an export merges.
    Merged,
}

/// `--scales`: how the quantization scales are found.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Scales {
    /// From each group's range (absmax, or min and max), recomputed from the weight.
    #[default]
    Minmax,
    /// Per-group scales (and asym's zero points) trained with the weights (LSQ), initialized by
    /// the min-max rule and saved beside the adapter.
    Learned,
}

/// How fresh learned scales start (`--scale-init`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ScaleInit {
    /// The min-max scale, rounded to fp16 away from zero: nothing clips (`quant::init_learned`).
    #[default]
    Minmax,
    /// The fraction of the min-max scale with the least squared error per group
    /// (`quant::init_learned_searched`).
    Search,
    /// The per-group clipping with the least error of the layer's output on calibration
    /// activations (`quant::init_learned_activation`; the trainer's `calibrate` step).
    Activation,
    /// Per weight, whichever of minmax, search and activation gives its layer's output the least
    /// calibration error (`crate::calibrate`); `--scales learned`'s default on the command line.
    Auto,
}

impl ScaleInit {
    /// Whether this start needs the training data's activations (the `calibrate` step).
    pub fn calibrates(self) -> bool {
        matches!(self, ScaleInit::Activation | ScaleInit::Auto)
    }

    /// How the run's output names a chosen start.
    pub fn described(self) -> &'static str {
        match self {
            ScaleInit::Minmax => "min-max",
            ScaleInit::Search => "weight search",
            ScaleInit::Activation => "activation-aware",
            ScaleInit::Auto => "auto",
        }
    }
}

/// What the `calibrate` step chose (`--scale-init activation|auto`): on how many batches of the
/// training data, and each quantized weight's start.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ScaleStarts {
    pub batches: usize,
    /// Weight name -> the start its scales took (minmax, search or activation).
    pub chosen: std::collections::BTreeMap<String, ScaleInit>,
}

/// LoRA as PEFT configures it (`adapter_config.json` says the same in PEFT's words).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LoraConfig {
    pub r: usize,
    pub alpha: f64,
    pub dropout: f64,
    pub targets: Vec<String>,
    pub rslora: bool,
}

/// The training step.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StepConfig {
    pub batch: usize,
    pub seq: usize,
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    pub precision: PrecisionConfig,
    pub optim: OptimConfig,
    /// Which forward values the backward recomputes (`auto` and `budget` carry their bytes).
    pub checkpoint: Checkpoint,
    /// Kernel fusion (the `fuse` stage).
    pub fuse: bool,
    pub device: DeviceFlag,
    /// The reference interpreter instead of the compiled kernels.
    pub interpreter: bool,
    /// How the step runs on a GPU (absent in files from before it was saved: all off).
    #[serde(default)]
    pub cuda: CudaSettings,
    /// Data-parallel ranks (`mpirun -np N`, `--ranks N`): the step is one rank's of `batch` rows
    /// (absent: one rank, as in files from before it was saved).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub ranks: usize,
    /// The ZeRO stage over the ranks (absent: 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub zero: u8,
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

fn is_zero(n: &u8) -> bool {
    *n == 0
}

/// `--device`: the target a run asks for, `auto` (CUDA where a GPU and qatc's CUDA runtime are
/// both there, else the CPU; `qatc_driver::resolve` decides) or a kind. A request, not a device:
/// what it resolves to is a `qatc_driver::Target`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceFlag {
    /// CUDA when a GPU and qatc's CUDA runtime are both there, else the CPU.
    #[default]
    Auto,
    Cpu,
    Cuda,
}

impl DeviceFlag {
    /// The kind asked for (None: auto).
    pub fn kind(self) -> Option<TargetKind> {
        match self {
            DeviceFlag::Auto => None,
            DeviceFlag::Cpu => Some(TargetKind::Cpu),
            DeviceFlag::Cuda => Some(TargetKind::Cuda),
        }
    }
}

/// `--precision` (its home is the precision pass).
pub use qatc_passes::precision::Precision;

/// Mixed precision (fp16's loss scaling runs with GradScaler's default settings).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PrecisionConfig {
    pub mode: Precision,
}

/// `--optim`: the optimizer, and how it keeps its state.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Optimizer {
    /// AdamW (PyTorch's), moments in f32.
    #[default]
    Adamw,
    /// AdamW with 8-bit blockwise-quantized moments (bitsandbytes' AdamW8bit) for every tensor of
    /// 4096 elements or more but the embedding tables, which keep f32 moments: a quarter of the
    /// quantized tensors' moment bytes (0.25x AdamW's optimizer memory with LoRA, 0.48x for a
    /// full fine-tune of GPT-2 124M, whose embeddings are a third of its weights).
    Adamw8bit,
}

impl Optimizer {
    /// The optimizer whose moments are stored so.
    pub fn of(m: Moments) -> Optimizer {
        match m {
            Moments::F32 => Optimizer::Adamw,
            Moments::Blockwise8 => Optimizer::Adamw8bit,
        }
    }

    /// Its `--optim` value.
    pub fn name(self) -> &'static str {
        match self {
            Optimizer::Adamw => "adamw",
            Optimizer::Adamw8bit => "adamw8bit",
        }
    }

    /// How the AdamW pass stores the moments.
    pub fn moments(self) -> Moments {
        match self {
            Optimizer::Adamw => Moments::F32,
            Optimizer::Adamw8bit => Moments::Blockwise8,
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OptimConfig {
    pub kind: Optimizer,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Clip the global gradient norm to this.
    pub clip: Option<f64>,
}

/// The training run: what data, for how long, in what order, at what learning rate.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// The training data, as an absolute path.
    pub data: String,
    pub steps: usize,
    pub lr: f64,
    pub schedule: Schedule,
    pub warmup: usize,
    pub min_lr: f64,
    pub shuffle: bool,
    /// LoRA's initialisation and dropout masks, and the shuffled order.
    pub seed: u64,
    /// The adapter LoRA started from (absolute path), instead of a fresh initialisation.
    pub init_adapter: Option<String>,
    /// The peak learning rate of learned quantization scales (`--scale-lr`; only with
    /// `--scales learned`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_lr: Option<f64>,
    /// How the learned scales started (`--scale-init`; only with `--scales learned`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_init: Option<ScaleInit>,
    /// What the calibration chose per weight (`--scale-init activation|auto`, a fresh start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_starts: Option<ScaleStarts>,
    /// How instruction data (`.jsonl`) is read into batches (absent for a token file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub examples: Option<ExamplesConfig>,
}

/// Instruction data's reading: the template, what the loss counts, packing, bad records
/// (`cli::examples`, `crate::instruct`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ExamplesConfig {
    /// A named template (alpaca, plain) or the user's text with {prompt} and {completion}.
    pub template: String,
    pub train_on: crate::instruct::TrainOn,
    /// Several examples to a sequence (else one each, padded).
    pub pack: bool,
    pub skip_bad_records: bool,
}

impl QuantConfig {
    /// The quantization pass's options.
    pub fn options(&self) -> QuantOptions {
        QuantOptions {
            spec: QuantSpec { bits: self.bits, group: self.group, scheme: self.scheme },
            targets: self.targets.clone(),
            per_module: self.modules.clone(),
            act_bits: self.act_bits,
            learned_scales: self.scales == Scales::Learned,
            // the bit map's file, when there is one, is named by the command line (`cli::options`)
            per_module_source: None,
        }
    }

    fn check(&self) -> Result<(), String> {
        if !(2..=8).contains(&self.bits) {
            return Err(format!("--bits must be 2..8, got {}", self.bits));
        }
        if let Some(a) = self.act_bits {
            if !(2..=8).contains(&a) {
                return Err(format!("--act-bits must be 2..8, got {a}"));
            }
        }
        Ok(())
    }
}

impl LoraConfig {
    pub fn from_options(o: &LoraOptions) -> LoraConfig {
        LoraConfig { r: o.r, alpha: o.alpha, dropout: o.dropout, targets: o.targets.clone(), rslora: o.rslora }
    }

    /// The LoRA pass's options; `merged` with `--qat merged`.
    pub fn options(&self, merged: bool) -> LoraOptions {
        LoraOptions { r: self.r, alpha: self.alpha, dropout: self.dropout, targets: self.targets.clone(), rslora: self.rslora, merged }
    }
}

impl ModelConfig {
    /// The model graph's options; `training` false freezes every weight (and LoRA dropout).
    pub fn options(&self, training: bool) -> ModelOptions {
        let merged = self.quant.as_ref().is_some_and(|q| q.qat == Qat::Merged);
        ModelOptions {
            quant: self.quant.as_ref().map(QuantConfig::options),
            lora: self.lora.as_ref().map(|l| l.options(merged)),
            full_finetune: self.full_finetune,
            training,
            inputs: Default::default(),
        }
    }

    /// The rules a model configuration obeys, whether the flags or a file made it.
    pub fn check(&self) -> Result<(), String> {
        if let Some(q) = &self.quant {
            q.check()?;
            if q.qat == Qat::Merged && self.lora.is_none() {
                return Err("--qat merged needs --bits and --lora".into());
            }
        }
        if self.full_finetune && self.lora.is_some() {
            return Err("--full-finetune and --lora exclude each other".into());
        }
        if let Some(l) = &self.lora {
            if l.r == 0 {
                return Err("--lora r must be at least 1".into());
            }
        }
        Ok(())
    }
}

/// The most micro-batches per optimizer step (`--grad-accum`): 2^32, so that the data positions
/// of a long run (steps x K micro-batches) stay far from overflowing.
pub const MAX_GRAD_ACCUM: usize = 1 << 32;

impl StepConfig {
    pub fn check(&self) -> Result<(), String> {
        if self.batch == 0 || self.seq == 0 {
            return Err("--batch and --seq must be at least 1".into());
        }
        if self.grad_accum == 0 {
            return Err("--grad-accum must be at least 1".into());
        }
        // the step is one micro-batch's whatever K is; K only counts runs and data positions,
        // which must not overflow
        let tokens = self.batch.checked_mul(self.seq).and_then(|t| t.checked_mul(self.grad_accum));
        if self.grad_accum > MAX_GRAD_ACCUM || tokens.is_none() {
            return Err(format!(
                "--grad-accum {k}: {k} micro-batches of {} x {} tokens per optimizer step are more than qatc counts (at most {MAX_GRAD_ACCUM} micro-batches)",
                self.batch,
                self.seq,
                k = self.grad_accum
            ));
        }
        let o = &self.optim;
        if let Some(c) = o.clip {
            if !(c > 0.0 && c.is_finite()) {
                return Err(format!("--clip must be a positive number, got {c}"));
            }
        }
        if !(o.weight_decay >= 0.0 && o.weight_decay.is_finite()) {
            return Err(format!("--weight-decay must be >= 0, got {}", o.weight_decay));
        }
        Ok(())
    }
}

impl TrainConfig {
    pub fn check(&self) -> Result<(), String> {
        if self.steps == 0 {
            return Err("--steps must be at least 1".into());
        }
        if !(self.lr > 0.0 && self.lr.is_finite() && (0.0..=self.lr).contains(&self.min_lr)) {
            return Err("--lr must be a positive number and --min-lr within [0, lr]".into());
        }
        if let Some(l) = self.scale_lr {
            if !(l > 0.0 && l.is_finite()) {
                return Err(format!("--scale-lr must be a positive number, got {l}"));
            }
        }
        Ok(())
    }

    /// The learning rate of every step.
    pub fn lr_schedule(&self) -> crate::schedule::LrSchedule {
        crate::schedule::LrSchedule { lr: self.lr, warmup: self.warmup, kind: self.schedule, min_lr: self.min_lr, total: self.steps }
    }
}

impl RunConfig {
    /// Checks every section present.
    pub fn check(&self) -> Result<(), String> {
        self.model.check()?;
        if let Some(s) = &self.step {
            s.check()?;
        }
        if let Some(t) = &self.train {
            t.check()?;
        }
        Ok(())
    }

    /// The training step's options (the model's, `training` on). Needs the `step` section.
    pub fn step_options(&self) -> Result<StepOptions, String> {
        let s = self.step.as_ref().ok_or("internal: a configuration without a step section")?;
        let mut o = StepOptions::new(s.batch, s.seq);
        o.model = self.model.options(true);
        o.grad_accum = s.grad_accum;
        o.clip = s.optim.clip;
        // learned scales train at their own rate, a multiple of --lr so that the schedule moves both
        let scale_lr_mul = self.train.as_ref().and_then(|t| Some(t.scale_lr? / t.lr)).unwrap_or(1.0);
        o.adamw = AdamW {
            beta1: s.optim.beta1,
            beta2: s.optim.beta2,
            eps: s.optim.eps,
            weight_decay: s.optim.weight_decay,
            scale_lr_mul,
            moments: s.optim.kind.moments(),
        };
        o.checkpoint = s.checkpoint;
        o.scale_init = self.train.as_ref().and_then(|t| t.scale_init).unwrap_or_default();
        o.fuse = s.fuse.then(qatc_passes::fusion::FuseOptions::default);
        o.precision = s.precision.mode;
        o.parallel = qatc_passes::zero::Parallel { ranks: s.ranks, zero: s.zero };
        Ok(o)
    }

    /// The file's text: pretty JSON, one trailing newline.
    pub fn to_json(&self) -> String {
        // a tree of plain values: serializing it cannot fail
        serde_json::to_string_pretty(self).map(|s| s + "\n").unwrap_or_default()
    }

    /// Parses a `qatc.json`'s text; `path` names it in errors.
    pub fn from_json(text: &str, path: &Path) -> Result<RunConfig, ConfigError> {
        let bad = |why: String| ConfigError::Invalid { path: path.to_path_buf(), why };
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
        match v.get("version").and_then(|v| v.as_u64()) {
            Some(n) if n == u64::from(VERSION) => {}
            Some(n) => {
                return Err(bad(format!("version {n} is not one this qatc reads (it reads version {VERSION}); a newer qatc wrote it?")))
            }
            None => return Err(bad("no `version`: not a qatc run configuration".into())),
        }
        let c: RunConfig = serde_json::from_value(v).map_err(|e| bad(format!("not a qatc run configuration: {e}")))?;
        c.check().map_err(bad)?;
        Ok(c)
    }

    /// Reads `DIR/qatc.json`.
    pub fn read(dir: &Path) -> Result<RunConfig, ConfigError> {
        let path = dir.join(FILE);
        let bytes = std::fs::read(&path).map_err(|error| ConfigError::Io { path: path.clone(), error })?;
        let text = crate::input::text(&bytes)
            .map_err(|why| ConfigError::Invalid { path: path.clone(), why: format!("not a qatc configuration: {why}") })?;
        RunConfig::from_json(text, &path)
    }

    /// `DIR/qatc.json` if the directory has one.
    pub fn read_if_any(dir: &Path) -> Result<Option<RunConfig>, ConfigError> {
        if dir.join(FILE).exists() {
            RunConfig::read(dir).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// A path as the configuration records it: absolute (and canonical when it exists), so that
/// the same file named from another directory compares equal.
pub fn absolute(p: &Path) -> String {
    let abs = std::fs::canonicalize(p).or_else(|_| std::path::absolute(p)).unwrap_or_else(|_| p.to_path_buf());
    abs.display().to_string()
}

#[cfg(test)]
mod tests;
