//! The commands of the `qatc` binary. Each returns `anyhow::Result`; `main` prints an error as
//! one line and exits with code 2.

pub mod compile;
pub mod dump;
pub mod eval;
pub mod export;
pub mod options;
pub mod plan;
pub mod prt;
pub mod train;

use std::path::Path;

use anyhow::Context;
use qatc_passes::precision::Precision;

use crate::model::Model;

/// Opens a model and says so once when its config had to be inferred.
pub fn open_model(path: &Path) -> anyhow::Result<Model> {
    let m = Model::open(path)?;
    if let Some(n) = &m.notice {
        eprintln!("note: {n}");
    }
    Ok(m)
}

/// Checks `--seq` against the model's context.
pub fn check_seq(m: &Model, batch: usize, seq: usize) -> anyhow::Result<()> {
    if batch == 0 || seq == 0 {
        anyhow::bail!("--batch and --seq must be at least 1");
    }
    if seq > m.cfg.n_positions {
        return Err(crate::frontend::LoadError::SeqTooLong { seq, n_positions: m.cfg.n_positions })
            .with_context(|| format!("{}", m.ckpt.path().display()));
    }
    Ok(())
}

/// A progress bar on stderr; hidden when stderr is not a terminal.
pub fn progress(len: u64, template: &str) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(len);
    if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
        pb.set_style(style);
    }
    pb
}

/// The shape of the step and its optimizer settings, shared by compile, dump and train.
#[derive(clap::Args, Debug, Clone)]
pub struct StepArgs {
    /// Batch size B (sequences per micro-batch).
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    /// Sequence length T (at most the model's n_positions).
    #[arg(long, default_value_t = 128)]
    pub seq: usize,
    /// Gradient accumulation: K micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    pub grad_accum: usize,
    /// Clip the global gradient norm to X.
    #[arg(long)]
    pub clip: Option<f64>,
    /// AdamW's decoupled weight decay.
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    #[command(flatten)]
    pub quant: options::QuantArgs,
    /// LoRA: r=16[,alpha=32][,dropout=0.05][,targets=c_attn,c_proj,c_fc][,rslora].
    #[arg(long)]
    pub lora: Option<String>,
    /// Train every weight (without --lora, the default).
    #[arg(long)]
    pub full_finetune: bool,
    /// Seed for LoRA's initialisation and dropout.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Recompute instead of saving: none | blocks | sqrt | budget=SIZE | auto (default: none,
    /// or auto with --memory).
    #[arg(long)]
    pub checkpoint: Option<String>,
    /// Device memory the step must fit (e.g. 4GiB, 512MiB, 1.5GB).
    #[arg(long)]
    pub memory: Option<String>,
    /// Skip kernel fusion (the `fuse` stage): the step stays one op per node.
    #[arg(long)]
    pub no_fuse: bool,
    /// Storage type of activations, gradients and GEMM operands: fp32, bf16 (f32 master weights),
    /// or fp16 (f32 masters and dynamic loss scaling).
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub precision: Precision,
}

impl StepArgs {
    pub fn options(&self) -> anyhow::Result<crate::step::StepOptions> {
        if self.grad_accum == 0 {
            anyhow::bail!("--grad-accum must be at least 1");
        }
        if let Some(c) = self.clip {
            if !(c > 0.0 && c.is_finite()) {
                anyhow::bail!("--clip must be a positive number, got {c}");
            }
        }
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            anyhow::bail!("--weight-decay must be >= 0, got {}", self.weight_decay);
        }
        let mut o = crate::step::StepOptions::new(self.batch, self.seq);
        let lora = self.lora.as_deref().map(options::parse_lora).transpose()?;
        let full = self.full_finetune || lora.is_none();
        o.model = options::model_options(&self.quant, lora, full, true)?;
        o.grad_accum = self.grad_accum;
        o.clip = self.clip;
        o.adamw.weight_decay = self.weight_decay;
        o.checkpoint = self.checkpoint_policy()?;
        o.fuse = (!self.no_fuse).then(qatc_passes::fusion::FuseOptions::default);
        o.precision = self.precision;
        Ok(o)
    }
}

impl StepArgs {
    /// `--memory` in bytes, if given.
    pub fn memory_bytes(&self) -> anyhow::Result<Option<usize>> {
        self.memory.as_deref().map(|m| qatc_passes::plan::units::parse_size(m).map_err(|e| anyhow::anyhow!("--memory: {e}"))).transpose()
    }

    /// The checkpoint policy: `--checkpoint`, else `auto` when `--memory` is given, else none.
    pub fn checkpoint_policy(&self) -> anyhow::Result<qatc_passes::remat::Checkpoint> {
        let memory = self.memory_bytes()?;
        let policy = self.checkpoint.as_deref().unwrap_or(if memory.is_some() { "auto" } else { "none" });
        qatc_passes::remat::Checkpoint::parse(policy, memory).map_err(anyhow::Error::msg)
    }
}
