//! `qatc train`: runs the compiled training step (LLVM-compiled kernels on the CPU; the reference
//! interpreter with `--interpreter` or without LLVM).
//!
//! Data order is llm.c's by default: optimizer step s consumes micro-batches s*K .. s*K+K-1
//! (wrapping at the end of the data); `--shuffle --seed N` permutes the batches every epoch. The
//! loss logged for step s is the loss of its batches before that step's update. Every
//! `--save-every N` steps (and at the end) OUT gets the adapter (PEFT format) or the weights, and
//! `OUT/checkpoint/` the resume state, each replaced atomically; `--resume OUT` continues exactly.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use qatc_runtime::{CpuOptions, Value};

use super::eval::{evaluate_with, EvalSetup};
use super::StepArgs;
use crate::artifacts::{write_atomic, OutDir};
use crate::data::TokenFile;
use crate::model::Model;
use crate::runner::Device;
use crate::schedule::{DataOrder, LrSchedule};
pub use crate::trainer::{weights_safetensors, Trainer};
use qatc_passes::precision::GRADS_FINITE;

#[derive(clap::Args, Debug)]
pub struct Args {
    pub model: PathBuf,
    /// llm.c token file, or UTF-8 text (tokenized with GPT-2's BPE).
    #[arg(long)]
    pub data: PathBuf,
    #[command(flatten)]
    pub step: StepArgs,
    /// Optimizer steps.
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Linear warmup steps.
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
    /// constant | cosine (decays to --min-lr by the end of the run).
    #[arg(long, default_value = "constant")]
    pub schedule: String,
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
    /// Continue the run whose OUT this is, from its last saved step.
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
    /// over every step but the first (compiled step only).
    #[arg(long)]
    pub profile: bool,
    /// The most KiB of one dequantized 4-bit weight panel fed to a GEMM (compiled CPU step); 0
    /// keeps whole dequantized weights instead (4 bytes per parameter).
    #[arg(long, default_value_t = 8192)]
    pub panel_kib: usize,
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

/// What a resume needs besides the tensors: where the run stands and what it was run with.
#[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
struct ResumeInfo {
    /// Steps completed.
    step: usize,
    /// The options that must match for an exact continuation.
    fingerprint: String,
    /// Steps skipped by loss scaling so far.
    #[serde(default)]
    skipped: usize,
}

fn fingerprint(a: &Args) -> String {
    let s = &a.step;
    format!(
        "model={} data={} B={} T={} K={} clip={:?} wd={} precision={} quant={:?} lora={:?} full={} seed={} lr={} warmup={} schedule={} min_lr={} shuffle={} steps={}",
        a.model.display(), a.data.display(), s.batch, s.seq, s.grad_accum, s.clip, s.weight_decay, s.precision,
        (s.quant.bits, s.quant.group, &s.quant.scheme, &s.quant.quant_targets, s.quant.act_bits, &s.quant.qat),
        s.lora, s.full_finetune, s.seed, a.lr, a.warmup, a.schedule, a.min_lr, a.shuffle, a.steps
    )
}

fn check(a: &Args) -> anyhow::Result<LrSchedule> {
    if a.step.full_finetune && a.step.lora.is_some() {
        anyhow::bail!("--full-finetune and --lora exclude each other");
    }
    if a.step.lora.is_none() && !a.step.full_finetune {
        anyhow::bail!("nothing to train: pass --lora r=N (an adapter) or --full-finetune (every weight)");
    }
    if a.steps == 0 {
        anyhow::bail!("--steps must be at least 1");
    }
    if !(a.lr > 0.0 && a.lr.is_finite() && (0.0..=a.lr).contains(&a.min_lr)) {
        anyhow::bail!("--lr must be a positive number and --min-lr within [0, lr]");
    }
    if !["constant", "cosine"].contains(&a.schedule.as_str()) {
        anyhow::bail!("--schedule must be constant or cosine, got `{}`", a.schedule);
    }
    if a.eval_every > 0 && a.val.is_none() {
        anyhow::bail!("--eval-every needs --val FILE");
    }
    Ok(LrSchedule { lr: a.lr, warmup: a.warmup, kind: a.schedule.clone(), min_lr: a.min_lr, total: a.steps })
}

/// Writes the adapter (or full weights) into `out` and the resume state into `out/checkpoint`,
/// each file atomically, the checkpoint directory swapped in whole.
fn save(out: &Path, tr: &Trainer, m: &Model, a: &Args, step: usize, skipped: usize) -> anyhow::Result<()> {
    match &tr.opts.model.lora {
        Some(l) => {
            let (cfg, st) = crate::adapter::to_files(l, &tr.weights()?, &a.model.display().to_string())?;
            write_atomic(&out.join("adapter_config.json"), cfg.as_bytes())?;
            write_atomic(&out.join("adapter_model.safetensors"), &st)?;
        }
        None => {
            write_atomic(&out.join("model.safetensors"), &weights_safetensors(&tr.weights()?)?)?;
            write_atomic(&out.join("config.json"), (serde_json::to_string_pretty(&m.cfg.to_hf_json())? + "\n").as_bytes())?;
        }
    }
    let ck = OutDir::create(&out.join("checkpoint"), "resume.json")?;
    ck.write("state.safetensors", tr.save_state()?)?;
    ck.write("resume.json", serde_json::to_string_pretty(&ResumeInfo { step, fingerprint: fingerprint(a), skipped })? + "\n")?;
    ck.commit()?;
    Ok(())
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let sched = check(a)?;
    let (engine, notice) = crate::runner::resolve(a.device, a.interpreter)?;
    if let Some(n) = notice {
        eprintln!("qatc: {n}");
    }
    let m = super::open_model(&a.model)?;
    super::check_seq(&m, a.step.batch, a.step.seq)?;
    let opts = a.step.options()?;
    let data = TokenFile::load(&a.data)?;
    data.check_vocab(m.cfg.vocab_size)?;
    let nb = data.require_batches(opts.batch, opts.seq)?;
    let val = match &a.val {
        Some(p) => {
            let v = TokenFile::load(p)?;
            v.check_vocab(m.cfg.vocab_size)?;
            v.require_batches(opts.batch, opts.seq)?;
            Some(v)
        }
        None => None,
    };
    let init = a.init_adapter.as_deref().map(crate::adapter::read).transpose()?;
    let resume = match &a.resume {
        Some(dir) => {
            let p = dir.join("checkpoint/resume.json");
            let text = std::fs::read_to_string(&p).with_context(|| format!("{}: no resume state", p.display()))?;
            let info: ResumeInfo = serde_json::from_str(&text).with_context(|| format!("{}", p.display()))?;
            if info.fingerprint != fingerprint(a) {
                anyhow::bail!("{}: the run was started with other options; resume with the same ones ({})", p.display(), info.fingerprint);
            }
            Some((info.step, info.skipped, dir.join("checkpoint/state.safetensors")))
        }
        None => None,
    };
    let k = opts.grad_accum;
    let tokens_per_step = opts.batch * opts.seq * k;
    let cpu = CpuOptions { panel_bytes: a.panel_kib.saturating_mul(1024), ..CpuOptions::default() };
    let mut tr = Trainer::with_engine(&m, opts, init.as_ref(), a.step.seed, engine, &cpu)?;
    tr.set_profile(a.profile);
    eprintln!("qatc: the step runs {}", tr.describe());
    let (start, mut skipped) = match &resume {
        Some((step, skipped, state)) => {
            tr.load_state(state)?;
            (*step, *skipped)
        }
        None => (0, 0),
    };
    // OUT is created up front so that saves land in it; a fresh run refuses a foreign directory.
    if resume.is_none() {
        OutDir::create(&a.out, "checkpoint").with_context(|| format!("{}", a.out.display()))?.commit()?;
    }
    let mut log = match &a.log_json {
        Some(p) => Some(std::io::BufWriter::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(resume.is_some())
                .write(true)
                .truncate(resume.is_none())
                .open(p)
                .with_context(|| format!("{}", p.display()))?,
        )),
        None => None,
    };
    let order = if a.shuffle { DataOrder::Shuffle { seed: a.step.seed } } else { DataOrder::Sequential };
    let val_setup = EvalSetup {
        model: {
            let mut mo = tr.opts.model.clone();
            if let Some(l) = mo.lora.as_mut() {
                l.dropout = 0.0;
            }
            mo
        },
        adapter: None,
        precision: tr.opts.precision,
    };
    let pb = super::progress((a.steps - start) as u64, "train {bar:30} step {pos}/{len}  {msg}  eta {eta}");
    let (mut first, mut last) = (f64::NAN, f64::NAN);
    let (mut curve, mut val_curve) = (Vec::new(), Vec::new());
    for s in start..a.steps {
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
            anyhow::bail!("step {s}: the loss is {loss}; stopping (lower --lr or set --clip)");
        }
        let done = s + 1;
        let val_loss = match &val {
            Some(v) if (a.eval_every > 0 && done % a.eval_every == 0) || done == a.steps => {
                let n = a.val_batches.min(v.num_batches(tr.opts.batch, tr.opts.seq)).max(1);
                // the trained weights, read back from the executor
                let weights = tr.weights()?.into_iter().map(|(n, t)| (n, Value::Float(t))).collect();
                Some(evaluate_with(&m, v, tr.opts.batch, tr.opts.seq, n, &val_setup, &weights)?.loss)
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
        if (a.save_every > 0 && done % a.save_every == 0) || done == a.steps {
            save(&a.out, &tr, &m, a, done, skipped)?;
        }
    }
    pb.finish_and_clear();
    if a.profile {
        match tr.profile() {
            Some(rows) => eprint!("{}", crate::runner::profile_table(&rows, 40)),
            None => eprintln!("qatc: --profile: nothing timed (the interpreter does not time its parts; the first step is not timed)"),
        }
    }
    if let Some(p) = &a.plot {
        let title = format!("qatc train: {}", a.model.display());
        write_atomic(p, crate::plot::loss_svg(&title, &curve, &val_curve).as_bytes()).with_context(|| format!("{}", p.display()))?;
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
        a.steps,
        n.max(1),
        a.out.display()
    );
    Ok(())
}
