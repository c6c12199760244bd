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

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use qatc_kernels::cuda::Variant;
use qatc_passes::quant::is_learned_name;
use qatc_runtime::{CpuOptions, Value};

use super::eval::{EvalSetup, Evaluator};
use super::resume::{self, Given, PROGRESS, STATE};
use super::{Placement, StepArgs};
use crate::artifacts::{self, write_atomic, Faults, OutDir};
use crate::batches::{Batches, Dataset};
use crate::config::{self, RunConfig, ScaleInit, Scales, TrainConfig};

use crate::config::DeviceFlag as Device;
use crate::model::Model;
use crate::schedule::{DataOrder, Schedule};
pub use crate::trainer::{weights_safetensors, Trainer};
use qatc_passes::precision::GRADS_FINITE;

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
    /// How learned scales start: minmax (each group's range), or search (the fraction of it with
    /// the least squared quantization error).
    #[arg(long, value_enum, default_value_t = ScaleInit::Minmax)]
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
    /// One JSON object per step: {"step", "loss", "lr", "tokens_per_s"} (and "val_loss").
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
        let mut c = self.step.config(model, Placement { device: self.device, interpreter: self.interpreter, cuda })?;
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

/// Replaces OUT whole with this save: the adapter (or the full weights), the configuration and
/// the resume state, so that the adapter and the checkpoint of one save are never apart.
fn save(out: &Path, tr: &Trainer, m: &Model, cfg: &RunConfig, progress: &resume::Progress, faults: &Faults) -> anyhow::Result<()> {
    let dir = OutDir::create_with(out, &MARKERS, &[], faults)?;
    // learned quantization scales go beside the adapter (or weights), in a file of their own
    let (learned, weights): (Vec<_>, Vec<_>) = tr.weights()?.into_iter().partition(|(n, _)| is_learned_name(n));
    match &tr.opts.model.lora {
        Some(l) => {
            let (peft_config, st) = crate::adapter::to_files(l, &weights, &cfg.model.path)?;
            dir.write("adapter_config.json", peft_config)?;
            dir.write("adapter_model.safetensors", st)?;
        }
        None => {
            dir.write("model.safetensors", weights_safetensors(&weights)?)?;
            dir.write("config.json", serde_json::to_string_pretty(&m.cfg.to_hf_json())? + "\n")?;
        }
    }
    if !learned.is_empty() {
        dir.write(crate::adapter::QUANT_FILE, weights_safetensors(&learned)?)?;
    }
    dir.write(config::FILE, cfg.to_json())?;
    dir.write(STATE, tr.save_state()?)?;
    dir.write(PROGRESS, serde_json::to_string_pretty(progress)? + "\n")?;
    dir.commit()?;
    Ok(())
}

/// `qatc train`; `given` says which options the command line gave (with `--resume`, the others
/// are the saved run's).
pub fn run(a: &Args, given: &Given) -> anyhow::Result<()> {
    run_with(a, given, Faults::none())
}

/// `run`, with every filesystem step of every save passed through `faults` (the crash tests).
pub fn run_with(a: &Args, given: &Given, faults: &Faults) -> anyhow::Result<()> {
    if a.eval_every > 0 && a.val.is_none() {
        anyhow::bail!("--eval-every needs --val FILE");
    }
    let levels = plot_levels(a)?;
    let (cfg, resume_at) = configure(a, given, faults)?;
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
    // what a killed save left beside OUT goes first
    artifacts::recover(&a.out, faults).with_context(|| format!("--out {}", a.out.display()))?;
    let sched = train.lr_schedule();
    let (model_path, data_path) = (PathBuf::from(&cfg.model.path), PathBuf::from(&train.data));
    // the run's GPU settings: the command line's, or on --resume the saved run's
    let resolved = qatc_driver::resolve(step.device.kind(), step.interpreter, step.cuda)?;
    if let Some(n) = &resolved.notice {
        eprintln!("qatc: {n}");
    }
    let m = super::open_model(&model_path, &a.step.read)?;
    super::check_seq(&m, step.batch, step.seq)?;
    let mut opts = cfg.step_options().map_err(anyhow::Error::msg)?;
    opts.deadline = a.step.compile_budget()?;
    super::options::name_bit_map(&mut opts.model, &a.step.quant);
    let reading = super::examples::options_of(train.examples.as_ref())?;
    let data = Dataset::load(&data_path, opts.seq, &reading)?;
    if let Some(resume::Progress { step, data_tokens: Some(n), .. }) = &resume_at {
        if *n != data.tokens() {
            anyhow::bail!(
                "{}: holds {} tokens, but the run saved at step {step} was trained on data of {n}: the data changed, so its position in it (micro-batch {}) would not continue the run; resume on the data it was trained on",
                data_path.display(),
                data.tokens(),
                step * opts.grad_accum
            );
        }
    }
    data.check_vocab(m.cfg.vocab_size)?;
    let nb = data.require_batches(opts.batch, opts.seq)?;
    if let Some(s) = data.summary(opts.batch) {
        eprintln!("qatc: {s}");
    }
    // the step takes what the batches give: instruction data's loss weights and position ids
    opts.model.inputs = data.inputs();
    let val = match &a.val {
        Some(p) => {
            let v = Dataset::load(p, opts.seq, &reading)?;
            v.check_vocab(m.cfg.vocab_size)?;
            v.require_batches(opts.batch, opts.seq)?;
            if let Some(s) = v.summary(opts.batch) {
                eprintln!("qatc: --val {s}");
            }
            Some(v)
        }
        None => None,
    };
    let init = train.init_adapter.as_deref().map(|p| crate::adapter::read_with(Path::new(p), a.step.read.allow_nonfinite)).transpose()?;
    let k = opts.grad_accum;
    let tokens_per_step = opts.batch * opts.seq * k;
    let cpu = CpuOptions { panel_bytes: a.panel_kib.saturating_mul(1024), ..CpuOptions::default() };
    let build = super::driver_options(resolved.interpreter, cpu);
    let mut tr = Trainer::with_target(&m, opts, init.as_ref(), train.seed, &resolved.target, &build)?;
    tr.set_profile(a.profile);
    eprintln!("qatc: the step runs {}", tr.describe());
    let (start, mut skipped) = match (resume_at.as_ref(), &a.resume) {
        (Some(done), Some(dir)) => {
            let state = dir.join(STATE);
            tr.load_state(&state, a.step.read.allow_nonfinite)?;
            // the optimizer's step count is saved with the tensors: both files must be one save's
            // (a step fp16 loss scaling skipped does not count)
            let count = tr.persistent()?.into_iter().find(|(n, _)| n == "step").and_then(|(_, t)| t.data.first().copied());
            if count.is_none() || done.skipped > done.step || count != Some((done.step - done.skipped) as f32) {
                anyhow::bail!(
                    "{}: AdamW's step count is {}, but {PROGRESS} says {} steps were done ({} skipped): the two files are not from one save",
                    state.display(),
                    count.map_or("missing".into(), |c| c.to_string()),
                    done.step,
                    done.skipped
                );
            }
            (done.step, done.skipped)
        }
        _ => (0, 0),
    };
    let resuming = resume_at.is_some();
    let mut log = match &a.log_json {
        Some(p) => Some(std::io::BufWriter::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(resuming)
                .write(true)
                .truncate(!resuming)
                .open(p)
                .with_context(|| format!("{}", p.display()))?,
        )),
        None => None,
    };
    let order = if train.shuffle { DataOrder::Shuffle { seed: train.seed } } else { DataOrder::Sequential };
    let val_setup = EvalSetup {
        model: {
            let mut mo = tr.opts.model.clone();
            if let Some(l) = mo.lora.as_mut() {
                l.dropout = 0.0;
            }
            // what the validation data's batches give, which may differ from the training data's
            mo.inputs = val.as_ref().map(Batches::inputs).unwrap_or_default();
            mo
        },
        adapter: None,
        precision: tr.opts.precision,
        // validation runs where the step runs, as the step does
        target: resolved.target,
        interpreter: resolved.interpreter,
        ..Default::default()
    };
    // compiled at the first validation, given the trained weights before each one
    let mut validator: Option<Evaluator> = None;
    let pb = super::progress(train.steps.saturating_sub(start) as u64, "train {bar:30} step {pos}/{len}  {msg}  eta {eta}");
    let (mut first, mut last) = (f64::NAN, f64::NAN);
    let (mut curve, mut val_curve) = (Vec::new(), Vec::new());
    // what a divergence message says: the last finite loss, the last save
    let (mut last_finite, mut saved) = (None, resume_at.as_ref().map(|_| start));
    let known = |step, symptom, last_finite, saved, out: &_, tr: &Trainer, lr| {
        super::diverge::message(&super::diverge::Known {
            step,
            symptom,
            last_finite,
            lr,
            outputs: out,
            state: &super::diverge::state_for_message(tr),
            lora: tr.opts.model.lora.as_ref().map(|l| (l.alpha, l.scaling())),
            allowed_nonfinite: a.step.read.allow_nonfinite,
            saved,
            out: &a.out,
        })
    };
    for s in start..train.steps {
        let t0 = Instant::now();
        let batches: Vec<usize> = (0..k).map(|i| order.batch(s * k + i, nb)).collect();
        let lr = sched.at(s);
        let scale = tr.loss_scale()?;
        let out = tr.step_on(&data, &batches, lr, (s * k) as u64)?;
        let loss = super::eval::scalar(&out, "loss")?;
        if out.contains_key(GRADS_FINITE) && super::eval::scalar(&out, GRADS_FINITE)? == 0.0 {
            skipped += 1;
        }
        let tps = tokens_per_step as f64 / t0.elapsed().as_secs_f64();
        if !loss.is_finite() {
            anyhow::bail!(known(s, super::diverge::Symptom::Loss(loss), last_finite, saved, &out, &tr, lr));
        }
        last_finite = Some((s, loss));
        let done = s + 1;
        let val_loss = match &val {
            Some(v) if (a.eval_every > 0 && done % a.eval_every == 0) || done == train.steps => {
                let n = a.val_batches.min(v.num_batches(tr.opts.batch, tr.opts.seq)).max(1);
                // the trained weights, read back from the executor
                let weights: HashMap<String, Value<f32>> = tr.weights()?.into_iter().map(|(n, t)| (n, Value::Float(t))).collect();
                let e = match validator.as_mut() {
                    Some(e) => {
                        e.set_state(&m, &weights)?;
                        e
                    }
                    None => validator.insert(Evaluator::new(&m, tr.opts.batch, tr.opts.seq, &val_setup, Some(&weights))?),
                };
                Some(e.run(v, n, false)?.loss)
            }
            _ => None,
        };
        if let Some(w) = log.as_mut() {
            let skipped = scale.map(|_| skipped);
            writeln!(
                w,
                "{}",
                serde_json::to_string(&StepLog { step: s, loss, lr, tokens_per_s: tps, val_loss, loss_scale: scale, skipped })?
            )?;
            w.flush()?;
        }
        if first.is_nan() {
            first = loss;
        }
        curve.push((s, loss));
        if let Some(v) = val_loss {
            val_curve.push((done, v));
        }
        last = loss;
        let scaling = match scale {
            Some(sc) => format!("  scale {sc}  skipped {skipped}"),
            None => String::new(),
        };
        pb.set_message(match val_loss {
            Some(v) => format!("loss {loss:.4}  val {v:.4}  {tps:.0} tok/s{scaling}"),
            None => format!("loss {loss:.4}  {tps:.0} tok/s{scaling}"),
        });
        pb.inc(1);
        if (a.save_every > 0 && done % a.save_every == 0) || done == train.steps {
            // a save never writes non-finite weights over the last good one
            if let Some((tensor, i, v)) = super::diverge::nonfinite_state(&tr)? {
                anyhow::bail!(known(s, super::diverge::Symptom::State(tensor, i, v), last_finite, saved, &out, &tr, lr));
            }
            save(&a.out, &tr, &m, &cfg, &resume::Progress { step: done, skipped, data_tokens: Some(data.tokens()) }, faults)?;
            saved = Some(done);
        }
    }
    pb.finish_and_clear();
    if a.profile {
        match tr.profile() {
            Some(rows) => eprint!("{}", super::profile::profile_table(&rows, 40)),
            None => eprintln!("qatc: --profile: nothing timed (the interpreter does not time its parts; the first step is not timed)"),
        }
    }
    if let Some(p) = &a.plot {
        let title = format!("qatc train: {}", model_path.display());
        write_atomic(p, crate::plot::loss_svg(&title, &curve, &val_curve, &levels).as_bytes())
            .with_context(|| format!("{}", p.display()))?;
    }
    let what = if tr.opts.model.lora.is_some() { "adapter (PEFT format)" } else { "weights" };
    // one batch's loss is noisy: the means of the first and last (up to) ten steps of this run
    let n = curve.len().min(10);
    let mean = |xs: &[(usize, f64)]| if xs.is_empty() { f64::NAN } else { xs.iter().map(|x| x.1).sum::<f64>() / xs.len() as f64 };
    let (head, tail) = if n > 1 { (mean(&curve[..n]), mean(&curve[curve.len() - n..])) } else { (first, last) };
    let scaling = match tr.loss_scale()? {
        Some(sc) => format!("; loss scale {sc}, {skipped} steps skipped (non-finite gradients)"),
        None => String::new(),
    };
    println!(
        "trained steps {start}..{}: loss {head:.4} -> {tail:.4} (mean of the first and last {} steps){scaling}; {what} in {}",
        train.steps,
        n.max(1),
        a.out.display()
    );
    Ok(())
}
