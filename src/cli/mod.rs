//! The commands of the `qatc` binary. Each returns `anyhow::Result`; `main` prints an error as
//! one line and exits with code 2.

pub mod compile;
pub mod cubin;
pub mod diverge;
pub mod dump;
pub mod eval;
pub mod examples;
pub mod export;
pub mod generate;
pub mod kernel_cache;
pub mod options;
pub mod plan;
pub mod profile;
pub mod prt;
pub mod resume;
pub mod train;

/// What the environment asks of the GEMM libraries that differs from what qatc would pick for
/// this CPU, one line each (`main` fills it before anything runs; `qatc train` prints it under
/// its build line when the step runs on the CPU).
pub static LIBRARY_ENV_NOTES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();

use std::path::{Path, PathBuf};

use anyhow::Context;
use qatc_passes::optim::AdamW;
use qatc_passes::remat::Checkpoint;

use crate::config::DeviceFlag;
use crate::config::{self, OptimConfig, Optimizer, Precision, PrecisionConfig, RunConfig, StepConfig};
use crate::model::Model;

/// How inputs are read (every command that reads a checkpoint, adapter or resume state).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ReadArgs {
    /// Read checkpoints, adapters and resume states that hold NaN or infinity (refused by default:
    /// they make every result NaN).
    #[arg(long)]
    pub allow_nonfinite: bool,
}

/// Opens a model, refuses non-finite weights (unless allowed), and says once when its config had
/// to be inferred.
pub fn open_model(path: &Path, read: &ReadArgs) -> anyhow::Result<Model> {
    let m = Model::open(path)?;
    if !read.allow_nonfinite {
        m.ckpt.check_finite()?;
    }
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
    check_tokens(batch, seq)?;
    if seq > m.cfg.n_positions {
        return Err(crate::frontend::LoadError::SeqTooLong { seq, n_positions: m.cfg.n_positions })
            .with_context(|| format!("{}", m.ckpt.path().display()));
    }
    Ok(())
}

/// B x T tokens per micro-batch must be a count a machine can index (the IR refuses any tensor
/// past 2^60 bytes anyway; this says it in the flags' terms).
pub fn check_tokens(batch: usize, seq: usize) -> anyhow::Result<()> {
    match batch.checked_mul(seq) {
        Some(n) if n <= 1 << 40 => Ok(()),
        _ => anyhow::bail!("--batch {batch} x --seq {seq} tokens per micro-batch is more than 2^40: no step that size fits any memory"),
    }
}

/// `--compile-timeout SECONDS` as a deadline starting now.
pub fn compile_budget(seconds: f64) -> anyhow::Result<qatc_ir::Deadline> {
    if !(seconds > 0.0 && seconds.is_finite() && seconds <= 1e9) {
        anyhow::bail!("--compile-timeout must be a number of seconds above 0, got {seconds}");
    }
    Ok(qatc_ir::Deadline::within(std::time::Duration::from_secs_f64(seconds)))
}

/// What the user can do about an error, when there is something to say beyond its message.
pub fn hint(e: &anyhow::Error) -> Option<&'static str> {
    use qatc_passes::{fusion::FusionError, plan::PlanError, PassError};
    // the budget's error is carried transparently: look for each wrapper that can hold it
    let expired = |c: &(dyn std::error::Error + 'static)| {
        c.downcast_ref::<qatc_ir::Expired>().is_some()
            || matches!(c.downcast_ref::<PassError>(), Some(PassError::Expired(_)))
            || matches!(c.downcast_ref::<PlanError>(), Some(PlanError::Expired(_)))
            || matches!(c.downcast_ref::<FusionError>(), Some(FusionError::Expired(_)))
    };
    e.chain()
        .any(expired)
        .then_some(" (--compile-timeout SECONDS gives more time; --no-fuse, or a smaller --grad-accum, --batch or --seq compile faster)")
}

/// A progress bar on stderr; hidden when stderr is not a terminal.
pub fn progress(len: u64, template: &str) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(len);
    if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
        pb.set_style(style);
    }
    pb
}

/// The shape of the step and its optimizer settings, shared by compile, dump, plan and train.
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
    /// The optimizer: adamw (f32 moments) or adamw8bit (8-bit blockwise moments for tensors of
    /// 4096 elements or more, embedding tables kept in f32: 0.25x AdamW's optimizer memory with
    /// LoRA, 0.48x for a full fine-tune of GPT-2 124M, whose embeddings are a third of it).
    #[arg(long, value_enum, default_value_t = Optimizer::Adamw)]
    pub optim: Optimizer,
    /// AdamW's decoupled weight decay.
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// AdamW's betas B1,B2: how slowly its first and second moments forget (PyTorch's `betas`;
    /// default 0.9,0.999). GPT-2-style training from scratch commonly uses 0.9,0.95.
    #[arg(long, value_parser = parse_betas, value_name = "B1,B2")]
    pub betas: Option<(f64, f64)>,
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
    #[arg(long, value_parser = parse_checkpoint)]
    pub checkpoint: Option<CheckpointArg>,
    /// Device memory the step must fit (e.g. 4GiB, 512MiB, 1.5GB, or a GPU's name: h100, a100, l4, ...);
    /// the chunked cross-entropy takes more rows per chunk while the plan fits it (fewer, taller GEMMs).
    #[arg(long, value_parser = parse_memory)]
    pub memory: Option<usize>,
    /// Skip kernel fusion (the `fuse` stage): the step stays one op per node.
    #[arg(long)]
    pub no_fuse: bool,
    /// Storage type of activations, gradients and GEMM operands: fp32, bf16 (f32 master weights),
    /// fp16 (f32 masters and dynamic loss scaling), or auto (the faster of fp32 and bf16 on this
    /// CPU).
    #[arg(long, value_enum, default_value_t = PrecisionArg::Fp32)]
    pub precision: PrecisionArg,
    /// Data-parallel ranks N: the step is one rank's program, of --batch rows each (a global
    /// batch of N x B), its gradients averaged over the ranks (`qatc plan` and `dump` lay it
    /// out; `mpirun -np N qatc train` runs it on the CPU, where --ranks may be left out).
    #[arg(long, default_value_t = 1)]
    pub ranks: usize,
    /// ZeRO stage with --ranks: 0 none, 1 optimizer state sharded, 2 also gradients, 3 also the
    /// trainable weights.
    #[arg(long, default_value_t = 0)]
    pub zero: u8,
    /// Give up building the step after this many seconds, with a message naming the stage.
    #[arg(long, default_value_t = 300.0, value_name = "SECONDS")]
    pub compile_timeout: f64,
    #[command(flatten)]
    pub read: ReadArgs,
}

/// `--checkpoint` as given: a policy, or `auto`, whose size `--memory` gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckpointArg {
    Policy(Checkpoint),
    Auto,
}

fn parse_checkpoint(s: &str) -> Result<CheckpointArg, String> {
    if s.trim() == "auto" {
        return Ok(CheckpointArg::Auto);
    }
    Checkpoint::parse(s, None).map(CheckpointArg::Policy)
}

/// `--betas B1,B2`: two decay rates, each in [0, 1).
fn parse_betas(s: &str) -> Result<(f64, f64), String> {
    let beta = |t: &str| match t.trim().parse::<f64>() {
        Ok(b) if (0.0..1.0).contains(&b) => Ok(b),
        _ => Err(format!("{:?} is not a decay rate in [0, 1)", t.trim())),
    };
    match s.split(',').collect::<Vec<_>>()[..] {
        [b1, b2] => Ok((beta(b1)?, beta(b2)?)),
        _ => Err(format!("expected B1,B2 (two decay rates, as 0.9,0.95), got {s:?}")),
    }
}

fn parse_memory(s: &str) -> Result<usize, String> {
    qatc_passes::plan::units::parse_memory(s)
}

/// What the driver builds with beyond the target: the interpreter or compiled kernels, the CPU
/// executor's settings, and the kernel cache's directory (`kernel_cache::KernelCacheArgs::dir`;
/// None keeps nothing on disk).
pub fn driver_options(interpreter: bool, cpu: qatc_runtime::CpuOptions, kernel_cache: Option<PathBuf>) -> qatc_driver::Options {
    qatc_driver::Options { interpreter, cpu, kernel_cache, ..qatc_driver::Options::default() }
}

/// `--precision`: a storage type, or the faster one on this CPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum PrecisionArg {
    /// Everything in f32.
    #[default]
    Fp32,
    /// bfloat16 storage, f32 master weights and accumulation.
    Bf16,
    /// IEEE half storage, f32 masters, dynamic loss scaling.
    Fp16,
    /// bf16 where this CPU's bf16 GEMMs run on AMX tiles, else fp32 (CPU only).
    Auto,
}

/// Where and how the step runs (train's `--device`, `--interpreter` and GPU settings; the
/// defaults elsewhere).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    pub device: DeviceFlag,
    pub interpreter: bool,
    pub cuda: qatc_driver::CudaSettings,
}

impl StepArgs {
    /// The run configuration these flags describe (no `train` section): the one place the
    /// command line becomes a `RunConfig`.
    pub fn config(&self, model: &Path, placement: Placement) -> anyhow::Result<RunConfig> {
        let lora = self.lora.as_deref().map(options::parse_lora).transpose()?;
        let full = self.full_finetune || lora.is_none();
        if self.full_finetune && lora.is_some() {
            anyhow::bail!("--full-finetune and --lora exclude each other");
        }
        let model = options::model_config(&self.quant, lora.as_ref(), full, model)?;
        let defaults = AdamW::default();
        let (beta1, beta2) = self.betas.unwrap_or((defaults.beta1, defaults.beta2));
        let step = StepConfig {
            batch: self.batch,
            seq: self.seq,
            grad_accum: self.grad_accum,
            precision: PrecisionConfig { mode: self.resolved_precision(placement)?.0 },
            optim: OptimConfig { kind: self.optim, beta1, beta2, eps: defaults.eps, weight_decay: self.weight_decay, clip: self.clip },
            checkpoint: self.checkpoint_policy(placement)?,
            fuse: !self.no_fuse,
            device: placement.device,
            interpreter: placement.interpreter,
            cuda: placement.cuda,
            ranks: self.ranks,
            zero: self.zero,
        };
        step.check().map_err(anyhow::Error::msg)?;
        Ok(RunConfig { version: config::VERSION, model, step: Some(step), train: None })
    }

    /// The precision `--precision` names, `auto` resolved for the target the step would run on,
    /// with a line saying why for `auto`. Auto is bf16 where this CPU's bf16 GEMMs run on AMX
    /// tiles (oneDNN's matmul primitive), fp32 elsewhere: measured, the demo's step ran
    /// 1.3-1.5x faster in bf16 on an AMX Xeon and no faster on a Zen 5 with AVX512-BF16 alone,
    /// and 124M's 1.6-2.2x faster on the former (bench/RESULTS.md). Not for the GPU: nothing
    /// has been measured there.
    pub fn resolved_precision(&self, placement: Placement) -> anyhow::Result<(Precision, Option<String>)> {
        let named = match self.precision {
            PrecisionArg::Fp32 => Precision::Fp32,
            PrecisionArg::Bf16 => Precision::Bf16,
            PrecisionArg::Fp16 => Precision::Fp16,
            PrecisionArg::Auto => {
                let target = qatc_driver::planned_target(placement.device.kind(), placement.interpreter);
                if target.is_cuda() {
                    anyhow::bail!("--precision auto chooses for the CPU; name fp32, bf16 or fp16 for a step on the GPU");
                }
                let lib = qatc_runtime::CpuOptions::default().bf16_gemm;
                let amx = !placement.interpreter && lib.as_deref().is_some_and(qatc_runtime::cpu::onednn::bf16_runs_on_amx);
                let (p, why) = if amx {
                    (Precision::Bf16, "this CPU's bf16 GEMMs run on AMX tiles")
                } else if placement.interpreter {
                    (Precision::Fp32, "the reference interpreter")
                } else {
                    (Precision::Fp32, "no AMX-BF16 tiles for bf16 GEMMs here (or no oneDNN)")
                };
                return Ok((p, Some(format!("--precision auto: {} ({why})", p.name()))));
            }
        };
        Ok((named, None))
    }

    /// The step's options for these flags (through `config`).
    pub fn options(&self, model: &Path) -> anyhow::Result<crate::step::StepOptions> {
        self.options_on(model, DeviceFlag::Auto)
    }

    /// The step's options for these flags, for a step that runs on `device` (what `--checkpoint
    /// auto` plans within: `--memory` less the device's reserve).
    pub fn options_on(&self, model: &Path, device: DeviceFlag) -> anyhow::Result<crate::step::StepOptions> {
        let mut o = self.config(model, Placement { device, ..Placement::default() })?.step_options().map_err(anyhow::Error::msg)?;
        options::name_bit_map(&mut o.model, &self.quant);
        o.deadline = self.compile_budget()?;
        o.parallel = self.parallel()?;
        Ok(o)
    }

    /// `--ranks` and `--zero`, checked.
    pub fn parallel(&self) -> anyhow::Result<qatc_passes::zero::Parallel> {
        let p = qatc_passes::zero::Parallel { ranks: self.ranks, zero: self.zero };
        p.check().map_err(anyhow::Error::msg)?;
        Ok(p)
    }

    /// `--compile-timeout` as a deadline starting now (not part of the run's configuration: a
    /// limit on this invocation, not a fact of the run).
    pub fn compile_budget(&self) -> anyhow::Result<qatc_ir::Deadline> {
        compile_budget(self.compile_timeout)
    }

    /// The checkpoint policy: `--checkpoint`, else `auto` when `--memory` is given, else none.
    /// `auto` plans within what `--memory` leaves on the device the step runs on
    /// (`Target::step_budget`: on CUDA, less the context and the BLAS workspace).
    pub fn checkpoint_policy(&self, placement: Placement) -> anyhow::Result<Checkpoint> {
        let target = qatc_driver::planned_target(placement.device.kind(), placement.interpreter);
        match (self.checkpoint, self.memory) {
            (Some(CheckpointArg::Policy(p)), _) => Ok(p),
            (Some(CheckpointArg::Auto) | None, Some(m)) => Ok(Checkpoint::Auto(target.step_budget(m))),
            (Some(CheckpointArg::Auto), None) => anyhow::bail!("--checkpoint auto needs --memory SIZE (the device memory to fit)"),
            (None, None) => Ok(Checkpoint::None),
        }
    }
}

/// Prints a refusal's one line, `error: MSG`, in one write: ranks under mpirun share one stderr,
/// and eprintln!'s pieces (stderr is unbuffered) would interleave with another rank's.
pub fn print_error(msg: &str) {
    let line = format!("error: {msg}\n");
    let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
}
