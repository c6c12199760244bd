//! `qatc train`: runs the compiled training step (on a CUDA GPU with `--device cuda`, or `auto`
//! where one is usable; else LLVM-compiled kernels on the CPU; the reference interpreter with
//! `--interpreter` or without LLVM).
//!
//! Data order is llm.c's by default: optimizer step s consumes micro-batches s*K .. s*K+K-1
//! (wrapping at the end of the data); `--shuffle --seed N` permutes the batches every epoch. The
//! loss logged for step s is the loss of its batches before that step's update. Every
//! `--save-every N` steps (and at the end) OUT is replaced whole (`artifacts::OutDir`: written
//! beside, then swapped in) by the adapter (PEFT format) or the weights, the run's configuration
//! (`qatc.json`) and the resume state (`checkpoint/`): at every instant OUT is one complete save
//! (or absent before the first), and `--resume OUT` continues exactly, its options read from
//! the saved `qatc.json` (`cli::resume`).

use std::path::{Path, PathBuf};

use anyhow::Context;
use qatc_kernels::cuda::Variant;
use qatc_passes::lora::LoraOptions;
use qatc_passes::quant::is_learned_name;
use qatc_runtime::Tensor;

use super::resume::{self, Given, PROGRESS, STATE};
use super::{Placement, StepArgs};
use crate::artifacts::{self, Faults, OutDir};
use crate::config::{self, RunConfig, ScaleInit, Scales, TrainConfig};

use crate::config::DeviceFlag as Device;
use crate::model::Model;
use crate::schedule::Schedule;
pub use crate::trainer::{weights_safetensors, Trainer};
use run::Run;
use world::World;

pub(crate) mod best;
mod run;
mod world;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The GPT-2 checkpoint (with --resume: the saved run's, unless given).
    #[arg(required_unless_present = "resume")]
    pub model: Option<PathBuf>,
    /// llm.c token file, UTF-8 text (tokenized with GPT-2's BPE), or instruction data: a .jsonl
    /// file of {"text"}, {"prompt", "completion"} or {"messages"} records (with --resume: the
    /// saved run's, unless given).
    #[arg(long, required_unless_present = "resume")]
    pub data: Option<PathBuf>,
    #[command(flatten)]
    pub step: StepArgs,
    #[command(flatten)]
    pub examples: super::examples::ExampleArgs,
    /// Optimizer steps.
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Peak learning rate of learned quantization scales (`--scales learned`); it follows the
    /// same warmup and schedule as --lr. Zero points train at --lr.
    #[arg(long, default_value_t = 1e-4)]
    pub scale_lr: f64,
    /// How learned scales start: minmax (each group's range), search (the fraction of it with
    /// the least squared quantization error), activation (the clipping with the least error of
    /// the layer's output on the first batches of the training data), or auto (per weight, the
    /// one of the three with the least output error).
    #[arg(long, value_enum, default_value_t = ScaleInit::Auto)]
    pub scale_init: ScaleInit,
    /// Linear warmup steps.
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
    /// The learning rate after warmup.
    #[arg(long, value_enum, default_value_t = Schedule::Constant)]
    pub schedule: Schedule,
    #[arg(long, default_value_t = 0.0)]
    pub min_lr: f64,
    /// Visit the batches in a seeded random order (a new order every epoch).
    #[arg(long)]
    pub shuffle: bool,
    /// Where the adapter (or weights) and the resume state go.
    #[arg(long)]
    pub out: PathBuf,
    /// One JSON object per step: {"step", "loss", "lr", "tokens_per_s"} (and "val_loss"; the
    /// first step of a process: "build", how long building the step took).
    #[arg(long)]
    pub log_json: Option<PathBuf>,
    /// Start LoRA from this PEFT adapter instead of a fresh initialisation.
    #[arg(long)]
    pub init_adapter: Option<PathBuf>,
    /// Validation data, evaluated every --eval-every steps and at the end.
    #[arg(long)]
    pub val: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    pub eval_every: usize,
    /// Batches per validation.
    #[arg(long, default_value_t = 4)]
    pub val_batches: usize,
    /// Keep the adapter (or weights) of the lowest validation loss so far in OUT/best/, beside
    /// the last step's (needs --val and --eval-every; `best/best.json` says which step).
    #[arg(long)]
    pub keep_best: bool,
    /// Early stopping: end the run when N validations in a row have not lowered the best
    /// validation loss (needs --keep-best; 0: every --steps step is trained).
    #[arg(long, default_value_t = 0)]
    pub patience: usize,
    /// Save the adapter and the resume state every N steps (0: only at the end).
    #[arg(long, default_value_t = 0)]
    pub save_every: usize,
    /// Draw the loss curve (train and validation) as SVG.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// A labelled reference level in the plot, e.g. "full precision=4.95" (repeatable).
    #[arg(long, value_name = "LABEL=LOSS")]
    pub plot_line: Vec<String>,
    /// Continue the run whose OUT this is, from its last saved step, with its options (those
    /// given must agree with them).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Where the step runs: auto (a CUDA GPU when qatc can use one, else the CPU), cpu, cuda.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
    /// Run the step on the reference interpreter instead of the compiled kernels (slow; the
    /// numerical oracle).
    #[arg(long)]
    pub interpreter: bool,
    /// Print where a step's time goes at the end: per kernel family and GEMM shape, averaged
    /// over every step but the first (the compiled CPU step; on CUDA each step's parts between
    /// CUDA events, submitted without the graph, so the steps are a little slower than without).
    #[arg(long)]
    pub profile: bool,
    /// The most KiB of one dequantized 4-bit weight panel fed to a GEMM (compiled CPU step); 0
    /// keeps whole dequantized weights instead (4 bytes per parameter).
    #[arg(long, default_value_t = 8192)]
    pub panel_kib: usize,
    /// On the GPU: fp32 GEMMs on TF32 tensor cores (10-bit mantissa products, fp32 sums) instead
    /// of strict IEEE fp32.
    #[arg(long)]
    pub tf32: bool,
    /// On the GPU: submit every launch on every step, each waited for, instead of replaying the
    /// step as one CUDA graph (slower; a kernel's asynchronous error is then reported with its
    /// name).
    #[arg(long)]
    pub no_cuda_graph: bool,
    /// On the GPU: the general kernels only, none of the fast variants the generator picks where
    /// they apply (tensor-core attention), to rule one out.
    #[arg(long)]
    pub general_kernels: bool,
    /// On the GPU: without this one of the fast variants (repeatable), the others as chosen; to
    /// time the step without it or rule it out.
    #[arg(long = "no-variant", value_name = "VARIANT", value_parser = variant_name)]
    pub no_variant: Vec<Variant>,
    #[command(flatten)]
    pub cache: crate::cli::kernel_cache::KernelCacheArgs,
}

/// `--no-variant`'s value: a variant's name, or an error listing them.
fn variant_name(name: &str) -> Result<Variant, String> {
    Variant::from_name(name).ok_or_else(|| {
        let names: Vec<&str> = Variant::ALL.iter().map(|v| v.name()).collect();
        format!("not a kernel variant; the variants: {}", names.join(", "))
    })
}

/// One logged step.
#[derive(serde::Serialize, Debug, Clone)]
pub struct StepLog {
    pub step: usize,
    pub loss: f64,
    pub lr: f64,
    pub tokens_per_s: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// With loss scaling (fp16): the scale this step used, and the steps skipped so far (a
    /// non-finite gradient leaves the weights, moments and step count unchanged).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<usize>,
    /// On the first step this process runs: how long building the step took, and where its
    /// kernels came from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub build: Option<crate::trainer::Built>,
}

/// What marks a directory as a training output qatc may replace: `qatc.json`, or the
/// `checkpoint/` of a qatc from before it.
const MARKERS: [&str; 2] = [config::FILE, "checkpoint"];

impl Args {
    /// The run's configuration as the command line says it (defaults filled in): the step's
    /// (`StepArgs::config`) and this run's, for the checkpoint `model` and the data `data`.
    pub fn config(&self, model: &Path, data: &Path) -> anyhow::Result<RunConfig> {
        let no_variants = self.no_variant.iter().copied().collect();
        let cuda =
            qatc_driver::CudaSettings { tf32: self.tf32, no_graph: self.no_cuda_graph, general_kernels: self.general_kernels, no_variants };
        let placement = Placement { device: self.device, interpreter: self.interpreter, cuda };
        let mut c = self.step.config(model, placement)?;
        if let (_, Some(why)) = self.step.resolved_precision(placement)? {
            eprintln!("qatc: {why}");
        }
        let learned = c.model.quant.as_ref().is_some_and(|q| q.scales == Scales::Learned);
        let train = TrainConfig {
            data: config::absolute(data),
            steps: self.steps,
            lr: self.lr,
            schedule: self.schedule,
            warmup: self.warmup,
            min_lr: self.min_lr,
            shuffle: self.shuffle,
            seed: self.step.seed,
            init_adapter: self.init_adapter.as_deref().map(config::absolute),
            scale_lr: learned.then_some(self.scale_lr),
            scale_init: learned.then_some(self.scale_init),
            scale_starts: None,
            examples: self.examples.config(data, self.val.as_deref())?,
        };
        train.check().map_err(anyhow::Error::msg)?;
        c.train = Some(train);
        Ok(c)
    }
}

/// The run's configuration, and where the saved run stands when it resumes: the command line's,
/// or the saved run's (the options given checked against it).
fn configure(a: &Args, given: &Given, faults: &Faults) -> anyhow::Result<(RunConfig, Option<resume::Progress>)> {
    let Some(dir) = &a.resume else {
        let (Some(model), Some(data)) = (&a.model, &a.data) else {
            anyhow::bail!("MODEL and --data are needed (with --resume they come from the saved run)");
        };
        if a.step.lora.is_none() && !a.step.full_finetune {
            anyhow::bail!("nothing to train: pass --lora r=N (an adapter) or --full-finetune (every weight)");
        }
        return Ok((a.config(model, data)?, None));
    };
    // a swap a kill cut short is completed before the saved run is read
    artifacts::recover(dir, faults).with_context(|| format!("--resume {}", dir.display()))?;
    let saved = RunConfig::read(dir).with_context(|| format!("--resume {}: no saved run", dir.display()))?;
    let model = a.model.clone().unwrap_or_else(|| PathBuf::from(&saved.model.path));
    let data = match (&a.data, &saved.train) {
        (Some(d), _) => d.clone(),
        (None, Some(t)) => PathBuf::from(&t.data),
        (None, None) => anyhow::bail!("--resume {}: the saved configuration has no training run", dir.display()),
    };
    let cfg = resume::reconcile(saved, &a.config(&model, &data)?, given, dir)?;
    Ok((cfg, Some(resume::read_progress(dir)?)))
}

/// `--plot-line LABEL=LOSS` values.
fn plot_levels(a: &Args) -> anyhow::Result<Vec<(String, f64)>> {
    a.plot_line
        .iter()
        .map(|s| {
            let (label, v) = s.rsplit_once('=').with_context(|| format!("--plot-line {s:?}: want LABEL=LOSS"))?;
            let v: f64 = v.trim().parse().with_context(|| format!("--plot-line {s:?}: {v:?} is not a number"))?;
            if !v.is_finite() {
                anyhow::bail!("--plot-line {s:?}: the level must be finite");
            }
            Ok((label.trim().to_string(), v))
        })
        .collect()
}

/// Refuses, before any work, an output that would destroy an input or that cannot be written.
fn check_outputs(a: &Args, cfg: &RunConfig, train: &TrainConfig) -> anyhow::Result<()> {
    // every input must survive the run: none may lie in OUT, which each save replaces whole
    let mut inputs: Vec<PathBuf> = vec![PathBuf::from(&cfg.model.path), PathBuf::from(&train.data)];
    inputs.extend(a.val.clone());
    inputs.extend(train.init_adapter.as_ref().map(PathBuf::from));
    match &a.resume {
        Some(r) if !same_dir(r, &a.out) => inputs.push(r.clone()),
        _ => {}
    }
    let inputs: Vec<&Path> = inputs.iter().map(PathBuf::as_path).collect();
    artifacts::check_target(&a.out, &MARKERS, &inputs).with_context(|| format!("--out {}", a.out.display()))?;
    for (flag, p) in [("--log-json", &a.log_json), ("--plot", &a.plot)] {
        let Some(p) = p else { continue };
        if artifacts::is_within(p, &a.out) {
            anyhow::bail!(
                "{flag} {} is inside --out {}, which every save replaces whole; write it elsewhere",
                p.display(),
                a.out.display()
            );
        }
        artifacts::check_writable(p).with_context(|| format!("{flag} {}", p.display()))?;
    }
    Ok(())
}

fn same_dir(a: &Path, b: &Path) -> bool {
    artifacts::is_within(a, b) && artifacts::is_within(b, a)
}

/// What a save writes besides the trainer's state: the model's configuration, the run's, and the
/// best weights so far (`--keep-best`).
struct SaveOf<'s> {
    m: &'s Model,
    cfg: &'s RunConfig,
    best: Option<&'s best::Best>,
}

/// Replaces OUT whole with this save (every rank calls it, at the same step): the adapter (or the
/// full weights), the configuration and the resume state, so that the adapter and the checkpoint
/// of one save are never apart. Rank 0 writes it into a staging directory; over ranks with a
/// ZeRO-sharded state every rank adds its own shard there (`resume::shard_file`, written to a
/// temporary name and renamed), and rank 0 writes the progress and swaps the directory in only
/// once every rank says its shard is written: a save cut short anywhere leaves the last one whole.
fn save(world: &World, out: &Path, tr: &Trainer, of: &SaveOf, progress: &resume::Progress, faults: &Faults) -> anyhow::Result<()> {
    // this rank's blocks of the sharded state, read back from the executor
    let (shard, read) = match tr.save_shard(progress.step) {
        Ok(s) => (s, Ok(())),
        Err(e) => (None, Err(e)),
    };
    let (dir, staged) = match world.leads().then(|| stage(out, tr, of, faults)) {
        Some(Ok(d)) => (Some(d), read),
        Some(Err(e)) => (None, Err(e)),
        None => (None, read),
    };
    world::agree(world, staged)?;
    if let Some(shard) = shard {
        // where rank 0 stages OUT, absolute: every rank sees its filesystem (as a checkpoint of
        // ZeRO's shards needs), not necessarily its working directory
        let at = match &dir {
            Some(d) => std::path::absolute(d.path()).map_err(anyhow::Error::from).and_then(|p| {
                p.to_str().map(String::from).with_context(|| {
                    format!("{}: the ranks are told where to write their shards in UTF-8, which this path is not", p.display())
                })
            }),
            None => Ok(String::new()),
        };
        let mine = at.as_ref().cloned().unwrap_or_default();
        world::agree(world, at.map(|_| ()))?;
        let at = world::gather_text(world, &mine)?.swap_remove(0);
        let name = resume::shard_file(world.rank(), world.size());
        let wrote = match &dir {
            Some(d) => d.write(&name, shard).map_err(anyhow::Error::from),
            None => {
                let p = Path::new(&at).join(&name);
                artifacts::write_atomic_with(&p, &shard, faults).with_context(|| format!("{}", p.display()))
            }
        };
        world::agree(world, wrote.with_context(|| format!("its shard of the save at step {}", progress.step)))?;
    }
    let committed = match dir {
        Some(d) => d
            .write(PROGRESS, serde_json::to_string_pretty(progress)? + "\n")
            .and_then(|()| d.commit().map(|_| ()))
            .map_err(anyhow::Error::from),
        None => Ok(()),
    };
    world::agree(world, committed)
}

/// Rank 0's part of a save, staged beside OUT: the adapter (or weights), learned scales, the
/// configuration, the best weights so far (`--keep-best`), and the state every rank holds alike.
fn stage<'f>(out: &Path, tr: &Trainer, of: &SaveOf, faults: &'f Faults) -> anyhow::Result<OutDir<'f>> {
    let dir = OutDir::create_with(out, &MARKERS, &[], faults)?;
    for (name, bytes) in weight_files(tr.weights()?, tr.opts.model.lora.as_ref(), of.m, of.cfg)? {
        dir.write(&name, bytes)?;
    }
    for (name, bytes) in of.best.into_iter().flat_map(best::Best::files) {
        dir.write(&name, bytes)?;
    }
    dir.write(STATE, tr.save_state()?)?;
    Ok(dir)
}

/// The files of trained weights `weights` (`Trainer::weights`), as a save writes them: the
/// adapter in PEFT's format (or the weights with their Hugging Face config), learned
/// quantization scales in a file of their own, and the run's configuration.
fn weight_files(
    weights: Vec<(String, Tensor<f32>)>,
    lora: Option<&LoraOptions>,
    m: &Model,
    cfg: &RunConfig,
) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
    let (learned, weights): (Vec<_>, Vec<_>) = weights.into_iter().partition(|(n, _)| is_learned_name(n));
    let mut files = Vec::new();
    match lora {
        Some(l) => {
            let (peft_config, st) = crate::adapter::to_files(l, &weights, &cfg.model.path)?;
            files.push(("adapter_config.json".to_string(), peft_config.into_bytes()));
            files.push(("adapter_model.safetensors".to_string(), st));
        }
        None => {
            files.push(("model.safetensors".to_string(), weights_safetensors(&weights)?));
            files.push(("config.json".to_string(), (serde_json::to_string_pretty(&m.cfg.to_hf_json())? + "\n").into_bytes()));
        }
    }
    if !learned.is_empty() {
        files.push((crate::adapter::QUANT_FILE.to_string(), weights_safetensors(&learned)?));
    }
    files.push((config::FILE.to_string(), cfg.to_json().into_bytes()));
    Ok(files)
}

/// `qatc train`; `given` says which options the command line gave (with `--resume`, the others
/// are the saved run's).
pub fn run(a: &Args, given: &Given) -> anyhow::Result<()> {
    run_with(a, given, Faults::none())
}

/// `run`, with every filesystem step of every save passed through `faults` (the crash tests).
pub fn run_with(a: &Args, given: &Given, faults: &Faults) -> anyhow::Result<()> {
    a.step.parallel()?;
    let world = world::join(given.has("ranks").then_some(a.step.ranks))?;
    if a.eval_every > 0 && a.val.is_none() {
        anyhow::bail!("--eval-every needs --val FILE");
    }
    if a.keep_best && (a.val.is_none() || a.eval_every == 0) {
        anyhow::bail!("--keep-best needs --val FILE and --eval-every N (the validations that find the best weights)");
    }
    if a.patience > 0 && !a.keep_best {
        anyhow::bail!("--patience needs --keep-best (early stopping keeps the best weights, not the last)");
    }
    let levels = plot_levels(a)?;
    let (mut cfg, resume_at) = configure(a, given, faults)?;
    if let Some(s) = cfg.step.as_mut() {
        match &a.resume {
            // a saved run's ranks are its own (its stage too: `configure` refuses another
            // --zero, naming both): the same world resumes it
            Some(dir) if s.ranks != world.size() => anyhow::bail!(
                "--resume {}: the run was trained on {} ranks (ZeRO stage {}), this one has {}: resume it with `mpirun -np {}`",
                dir.display(),
                s.ranks,
                s.zero,
                world.size(),
                s.ranks
            ),
            Some(_) => {}
            None => s.ranks = world.size(),
        }
        qatc_passes::zero::Parallel { ranks: s.ranks, zero: s.zero }.check().map_err(anyhow::Error::msg)?;
    }
    world::check_alike(&world, &cfg, world::model_checksum(std::path::Path::new(&cfg.model.path))?)?;
    let cfg = cfg;
    let (Some(train), Some(step)) = (cfg.train.clone(), cfg.step.clone()) else {
        anyhow::bail!("internal: a training configuration without its train or step section");
    };
    if let (Some(done), Some(dir)) = (resume_at.as_ref().map(|p| p.step), &a.resume) {
        if done > train.steps {
            anyhow::bail!(
                "{}: step {done} is beyond --steps {}: not a state this run could have saved",
                dir.join(PROGRESS).display(),
                train.steps
            );
        }
    }
    check_outputs(a, &cfg, &train)?;
    // what a killed save left beside OUT goes first (rank 0 writes OUT)
    if world.leads() {
        artifacts::recover(&a.out, faults).with_context(|| format!("--out {}", a.out.display()))?;
    }
    let mut run = Run::open(a, &cfg, &train, &step, resume_at, faults, world)?;
    for s in run.start..train.steps {
        if run.stopped() || run.step(s)?.is_break() {
            break;
        }
    }
    run.finish(&levels)
}
