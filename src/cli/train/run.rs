//! One `qatc train` run after its checks (`run_with`): the model and data opened, the trainer
//! built and restored, then step by step its update, validation, log line and save, and at the
//! end its profile, plot and summary.

use std::collections::HashMap;
use std::io::Write;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use qatc_passes::precision::GRADS_FINITE;
use qatc_runtime::{CpuOptions, Value};

use super::best::{self, Best};
use super::world::{self, World};
use super::{save, weight_files, Args, SaveOf, StepLog, Trainer};
use crate::artifacts::{write_atomic, Faults};
use crate::batches::{Batches, Dataset};
use crate::calibrate::{self, Calibration};
use crate::cli::eval::{EvalSetup, EvalSums, Evaluator};
use crate::cli::resume::{self, PROGRESS, STATE};
use crate::config::{RunConfig, ScaleInit, ScaleStarts, StepConfig, TrainConfig};
use crate::model::{Model, Trained};
use crate::schedule::{DataOrder, LrSchedule};
use crate::step::StepOptions;

/// One `qatc train` run after its checks: what it reads, its trainer, and what its steps have
/// shown so far (the loss curves, the last finite loss, the last save).
pub(super) struct Run<'r> {
    a: &'r Args,
    cfg: &'r RunConfig,
    train: &'r TrainConfig,
    faults: &'r Faults,
    model_path: PathBuf,
    m: Model,
    data: Dataset,
    /// Batches in the data, and the validation data.
    nb: usize,
    val: Option<Dataset>,
    tr: Trainer,
    /// Micro-batches per optimizer step (K), and the tokens of one step.
    k: usize,
    tokens_per_step: usize,
    sched: LrSchedule,
    order: DataOrder,
    log: Option<std::io::BufWriter<std::fs::File>>,
    /// How validation runs, and its evaluator: compiled at the first validation, given the
    /// trained weights before each one.
    val_setup: EvalSetup,
    validator: Option<Evaluator>,
    pb: indicatif::ProgressBar,
    /// The first step this run takes, and the steps fp16 loss scaling skipped so far.
    pub(super) start: usize,
    skipped: usize,
    first: f64,
    last: f64,
    curve: Vec<(usize, f64)>,
    val_curve: Vec<(usize, f64)>,
    /// What a divergence message says: the last finite loss, the last save.
    last_finite: Option<(usize, f64)>,
    saved: Option<usize>,
    /// With `--keep-best`: the best weights so far; with `--patience`: the step the run stopped
    /// after, out of patience.
    best: Option<Best>,
    stopped: Option<usize>,
    /// What the calibration chose (saved in `qatc.json`); None when it did not run.
    scale_starts: Option<ScaleStarts>,
    /// This process's rank: only rank 0 prints, logs and writes.
    world: World,
}

impl<'r> Run<'r> {
    /// Opens the model and the data, builds the trainer for the target the run resolves to, and
    /// restores the saved state when it resumes.
    pub(super) fn open(
        a: &'r Args,
        cfg: &'r RunConfig,
        train: &'r TrainConfig,
        step: &StepConfig,
        resume_at: Option<resume::Progress>,
        faults: &'r Faults,
        world: World,
    ) -> anyhow::Result<Run<'r>> {
        let leads = world.leads();
        let say = |s: String| {
            if leads {
                eprintln!("{s}");
            }
        };
        let sched = train.lr_schedule();
        let (model_path, data_path) = (PathBuf::from(&cfg.model.path), PathBuf::from(&train.data));
        // the run's GPU settings: the command line's, or on --resume the saved run's
        let resolved = qatc_driver::resolve(step.device.kind(), step.interpreter, step.cuda)?;
        if let Some(n) = &resolved.notice {
            say(format!("qatc: {n}"));
        }
        let m = crate::cli::open_model(&model_path, &a.step.read)?;
        crate::cli::check_seq(&m, step.batch, step.seq)?;
        let mut opts = cfg.step_options().map_err(anyhow::Error::msg)?;
        opts.deadline = a.step.compile_budget()?;
        crate::cli::options::name_bit_map(&mut opts.model, &a.step.quant);
        let reading = crate::cli::examples::options_of(train.examples.as_ref())?;
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
        // every rank reads its rows of the same global batches (`Trainer::my_rows`)
        let global = opts.batch * world.size();
        let nb = data.require_batches(global, opts.seq)?;
        if let Some(s) = data.summary(global) {
            say(format!("qatc: {s}"));
        }
        // the step takes what the batches give: instruction data's loss weights and position ids
        opts.model.inputs = data.inputs();
        let val = match &a.val {
            Some(p) => {
                let v = Dataset::load(p, opts.seq, &reading)?;
                v.check_vocab(m.cfg.vocab_size)?;
                // each rank evaluates its rows of the same global batches (`Run::validate`)
                v.require_batches(global, opts.seq)?;
                if let Some(s) = v.summary(global) {
                    say(format!("qatc: --val {s}"));
                }
                Some(v)
            }
            None => None,
        };
        let init =
            train.init_adapter.as_deref().map(|p| crate::adapter::read_with(Path::new(p), a.step.read.allow_nonfinite)).transpose()?;
        let k = opts.grad_accum;
        let tokens_per_step = global * opts.seq * k;
        let cpu = CpuOptions { panel_bytes: a.panel_kib.saturating_mul(1024), ..CpuOptions::default() };
        let mut build = crate::cli::driver_options(resolved.interpreter, cpu, a.cache.dir());
        build.comm = Some(world.comm.clone());
        // --memory is room the step's plan may use: the chunked cross-entropy grows into it
        build.room = a.step.memory.map(|m| resolved.target.step_budget(m));
        let calibration = calibrated_start(&m, &opts, &data, init.is_some() || resume_at.is_some())?;
        let trained = match (&init, &calibration) {
            (Some(a), _) => Trained::Adapter(a),
            (None, Some(c)) => Trained::Started { seed: train.seed, starts: &c.tensors },
            // a resumed run's scales come from its state (`restore`), over the min-max start
            (None, None) if opts.scale_init.calibrates() => Trained::Fresh { seed: train.seed, scale_init: ScaleInit::Minmax },
            (None, None) => Trained::Fresh { seed: train.seed, scale_init: opts.scale_init },
        };
        let mut tr = Trainer::with_target_from(&m, opts, &trained, train.seed, &resolved.target, &build)?;
        let scale_starts = calibration.as_ref().map(Calibration::starts);
        tr.set_profile(a.profile);
        say(format!("qatc: the step runs {}", tr.describe()));
        if tr.describe().starts_with("compiled for this CPU") {
            for note in crate::cli::LIBRARY_ENV_NOTES.get().into_iter().flatten() {
                say(note.clone());
            }
        }
        say(format!("qatc: built the step in {}", tr.built()));
        if world.size() > 1 {
            say(format!(
                "qatc: {} ranks of {} rows (a global batch of {global}), ZeRO stage {}",
                world.size(),
                tr.opts.batch,
                tr.opts.parallel.zero
            ));
        }
        let (start, skipped) = match (resume_at.as_ref(), &a.resume) {
            (Some(done), Some(dir)) => restore(&mut tr, done, dir, a.step.read.allow_nonfinite, &world)?,
            _ => (0, 0),
        };
        // without --keep-best a resumed run's saves no longer carry the best weights
        let best = match (resume_at.as_ref(), &a.resume) {
            (Some(done), Some(dir)) if a.keep_best => Best::restore(dir, done)?,
            _ => None,
        };
        let log = if leads { step_log(a, resume_at.is_some().then_some(start))? } else { None };
        let order = if train.shuffle { DataOrder::Shuffle { seed: train.seed } } else { DataOrder::Sequential };
        let val_setup = EvalSetup { comm: build.comm.clone(), ..validation(&tr, &resolved, build.kernel_cache.clone(), val.as_ref()) };
        let pb = crate::cli::progress(train.steps.saturating_sub(start) as u64, "train {bar:30} step {pos}/{len}  {msg}  eta {eta}");
        if !leads {
            pb.set_draw_target(indicatif::ProgressDrawTarget::hidden());
        }
        Ok(Run {
            a,
            cfg,
            train,
            faults,
            model_path,
            m,
            data,
            nb,
            val,
            tr,
            k,
            tokens_per_step,
            sched,
            order,
            log,
            val_setup,
            validator: None,
            pb,
            start,
            skipped,
            first: f64::NAN,
            last: f64::NAN,
            curve: Vec::new(),
            val_curve: Vec::new(),
            last_finite: None,
            saved: resume_at.as_ref().map(|_| start),
            // a run that stopped early stays stopped when resumed
            stopped: best.as_ref().filter(|b| best::out_of_patience(&b.at, start, a.eval_every, a.patience)).map(|_| start),
            best,
            scale_starts,
            world,
        })
    }

    /// Optimizer step `s`: its batches, the update, the validation, log line and save it is due;
    /// `Break` when the run stops early (`--patience`), after its save.
    pub(super) fn step(&mut self, s: usize) -> anyhow::Result<ControlFlow<()>> {
        let t0 = Instant::now();
        let batches: Vec<usize> = (0..self.k).map(|i| self.order.batch(s * self.k + i, self.nb)).collect();
        let lr = self.sched.at(s);
        let scale = self.tr.loss_scale()?;
        let out = self.tr.step_on(&self.data, &batches, lr, (s * self.k) as u64)?;
        let loss = crate::cli::eval::scalar(&out, "loss")?;
        if out.contains_key(GRADS_FINITE) && crate::cli::eval::scalar(&out, GRADS_FINITE)? == 0.0 {
            self.skipped += 1;
        }
        let tps = self.tokens_per_step as f64 / t0.elapsed().as_secs_f64();
        if !loss.is_finite() {
            anyhow::bail!(self.diverged(s, crate::cli::diverge::Symptom::Loss(loss), &out, lr));
        }
        self.last_finite = Some((s, loss));
        let done = s + 1;
        let val_loss = self.validate(done)?;
        let flow = self.keep_best(done, val_loss)?;
        if let Some(w) = self.log.as_mut() {
            let skipped = scale.map(|_| self.skipped);
            writeln!(
                w,
                "{}",
                serde_json::to_string(&StepLog {
                    step: s,
                    loss,
                    lr,
                    tokens_per_s: tps,
                    val_loss,
                    loss_scale: scale,
                    skipped,
                    build: (s == self.start).then(|| self.tr.built().clone()),
                })?
            )?;
            w.flush()?;
        }
        if self.first.is_nan() {
            self.first = loss;
        }
        self.curve.push((s, loss));
        if let Some(v) = val_loss {
            self.val_curve.push((done, v));
        }
        self.last = loss;
        let scaling = match scale {
            Some(sc) => format!("  scale {sc}  skipped {}", self.skipped),
            None => String::new(),
        };
        self.pb.set_message(match val_loss {
            Some(v) => format!("loss {loss:.4}  val {v:.4}  {tps:.0} tok/s{scaling}"),
            None => format!("loss {loss:.4}  {tps:.0} tok/s{scaling}"),
        });
        self.pb.inc(1);
        if (self.a.save_every > 0 && done.is_multiple_of(self.a.save_every)) || done == self.train.steps || flow.is_break() {
            // every rank gives its blocks of the weights ZeRO 3 shards, which rank 0 saves whole
            // (each rank saves its blocks of the optimizer's state itself)
            self.tr.gather()?;
            // a save never writes non-finite weights over the last good one
            if let Some((tensor, i, v)) = self.nonfinite_state()? {
                anyhow::bail!(self.diverged(s, crate::cli::diverge::Symptom::State(tensor, i, v), &out, lr));
            }
            let progress = resume::Progress {
                step: done,
                skipped: self.skipped,
                data_tokens: Some(self.data.tokens()),
                best: self.best.as_ref().map(|b| b.at),
            };
            let cfg = self.saved_config();
            save(&self.world, &self.a.out, &self.tr, &SaveOf { m: &self.m, cfg: &cfg, best: self.best.as_ref() }, &progress, self.faults)?;
            self.saved = Some(done);
        }
        Ok(flow)
    }

    /// Whether the run has stopped early (`--patience`): then no step is left to take.
    pub(super) fn stopped(&self) -> bool {
        self.stopped.is_some()
    }

    /// `--keep-best`: after a validation at `done` steps with loss `val_loss`, the weights kept
    /// when it is the lowest so far (their files made on rank 0, which saves); `Break` when
    /// `--patience` validations in a row have not improved on the best.
    fn keep_best(&mut self, done: usize, val_loss: Option<f64>) -> anyhow::Result<ControlFlow<()>> {
        let (true, Some(v)) = (self.a.keep_best, val_loss) else { return Ok(ControlFlow::Continue(())) };
        if best::improves(self.best.as_ref().map(|b| &b.at), v) {
            let files = match self.world.leads() {
                true => weight_files(self.tr.weights()?, self.tr.opts.model.lora.as_ref(), &self.m, &self.saved_config())?,
                false => Vec::new(),
            };
            self.best = Some(Best::new(done, v, files)?);
        }
        match &self.best {
            Some(b) if best::out_of_patience(&b.at, done, self.a.eval_every, self.a.patience) => {
                self.stopped = Some(done);
                Ok(ControlFlow::Break(()))
            }
            _ => Ok(ControlFlow::Continue(())),
        }
    }

    /// The validation loss after `done` steps, where one is due (every `--eval-every` steps and
    /// at the end), on the trained weights read back from the executor. Over ranks each
    /// evaluates its rows of the global batches (as it trains on them) and the ranks' sums of
    /// the losses and their weights are added up: every rank has the loss one rank of the
    /// global batch would.
    fn validate(&mut self, done: usize) -> anyhow::Result<Option<f64>> {
        let Some(v) = &self.val else { return Ok(None) };
        if !((self.a.eval_every > 0 && done.is_multiple_of(self.a.eval_every)) || done == self.train.steps) {
            return Ok(None);
        }
        let (rank, ranks) = (self.world.rank(), self.world.size());
        let n = self.a.val_batches.min(v.num_batches(self.tr.opts.batch * ranks, self.tr.opts.seq)).max(1);
        // the weights ZeRO 3 shards, gathered whole from every rank's blocks
        self.tr.gather()?;
        let weights: HashMap<String, Value<f32>> = self.tr.weights()?.into_iter().map(|(n, t)| (n, Value::Float(t))).collect();
        let e = match self.validator.as_mut() {
            Some(e) => {
                e.set_state(&self.m, &weights)?;
                e
            }
            None => self.validator.insert(Evaluator::new(&self.m, self.tr.opts.batch, self.tr.opts.seq, &self.val_setup, Some(&weights))?),
        };
        if ranks == 1 {
            return Ok(Some(e.run(v, n, false)?.loss));
        }
        let (mine, outcome) = match e.sums(v, n, Some((rank, ranks)), false) {
            Ok(s) => (s, Ok(())),
            Err(err) => (EvalSums::default(), Err(err)),
        };
        world::agree(&self.world, outcome)?;
        // added in rank order, as every rank does
        let all = world::gather(&self.world, &mine.to_bytes())?;
        let sums =
            all.chunks_exact(24).map(|c| EvalSums::from_bytes(c.try_into().unwrap_or(&[0; 24]))).fold(EvalSums::default(), |a, b| a + b);
        Ok(Some(sums.result().loss))
    }

    /// The first non-finite element of the persistent state (`diverge::nonfinite_state`) over
    /// every rank's blocks: the lowest rank's finding, the same on every rank.
    fn nonfinite_state(&self) -> anyhow::Result<Option<(String, usize, f32)>> {
        let mine = crate::cli::diverge::nonfinite_state(&self.tr)?;
        if self.world.size() == 1 {
            return Ok(mine);
        }
        let text = mine.map(|(name, i, v)| format!("{i} {} {name}", v.to_bits())).unwrap_or_default();
        let all = world::gather_text(&self.world, &text)?;
        Ok(all.iter().find(|t| !t.is_empty()).and_then(|t| {
            let mut parts = t.splitn(3, ' ');
            let i = parts.next()?.parse().ok()?;
            let v = f32::from_bits(parts.next()?.parse().ok()?);
            Some((parts.next()?.to_string(), i, v))
        }))
    }

    /// The configuration a save writes: the run's, with what the calibration chose.
    fn saved_config(&self) -> RunConfig {
        let mut cfg = self.cfg.clone();
        if let (Some(t), Some(starts)) = (cfg.train.as_mut(), &self.scale_starts) {
            t.scale_starts = Some(starts.clone());
        }
        cfg
    }

    /// What a divergence at step `s` says: the symptom, the last finite loss, the last save.
    fn diverged(&self, s: usize, symptom: crate::cli::diverge::Symptom, out: &HashMap<String, Value<f32>>, lr: f64) -> String {
        crate::cli::diverge::message(&crate::cli::diverge::Known {
            step: s,
            symptom,
            last_finite: self.last_finite,
            lr,
            outputs: out,
            state: &crate::cli::diverge::state_for_message(&self.tr),
            lora: self.tr.opts.model.lora.as_ref().map(|l| (l.alpha, l.scaling())),
            allowed_nonfinite: self.a.step.read.allow_nonfinite,
            saved: self.saved,
            out: &self.a.out,
        })
    }

    /// After the last step: the profile, the plot, and the summary line.
    pub(super) fn finish(self, levels: &[(String, f64)]) -> anyhow::Result<()> {
        self.pb.finish_and_clear();
        if !self.world.leads() {
            return Ok(());
        }
        if self.a.profile {
            match self.tr.profile().and_then(|p| p.table("step", 40)) {
                Some(table) => eprint!("{table}"),
                None => eprintln!("qatc: --profile: nothing timed (the interpreter does not time its parts; the first step is not timed)"),
            }
        }
        if let Some(p) = &self.a.plot {
            let title = format!("qatc train: {}", self.model_path.display());
            write_atomic(
                p,
                crate::plot::loss_svg(&title, &self.curve, &self.val_curve, levels, self.best.as_ref().map(|b| (b.at.step, b.at.val_loss)))
                    .as_bytes(),
            )
            .with_context(|| format!("{}", p.display()))?;
        }
        let what = if self.tr.opts.model.lora.is_some() { "adapter (PEFT format)" } else { "weights" };
        if self.curve.is_empty() {
            // a resumed run that had done all its steps: no loss to report, not a NaN
            match self.stopped {
                Some(done) => println!(
                    "nothing left to train: the run stopped early after step {done} (--patience {}); {what} in {}",
                    self.a.patience,
                    self.a.out.display()
                ),
                None => {
                    println!("nothing left to train: the run had done its {} steps; {what} in {}", self.train.steps, self.a.out.display())
                }
            }
            return Ok(());
        }
        // one batch's loss is noisy: the means of the first and last (up to) ten steps of this run
        let curve = &self.curve;
        let n = curve.len().min(10);
        let mean = |xs: &[(usize, f64)]| if xs.is_empty() { f64::NAN } else { xs.iter().map(|x| x.1).sum::<f64>() / xs.len() as f64 };
        let (head, tail) = if n > 1 { (mean(&curve[..n]), mean(&curve[curve.len() - n..])) } else { (self.first, self.last) };
        let scaling = match self.tr.loss_scale()? {
            Some(sc) => format!("; loss scale {sc}, {} steps skipped (non-finite gradients)", self.skipped),
            None => String::new(),
        };
        let stopped = match self.stopped {
            Some(done) => format!(
                "; stopped early after step {done} of {}: {} validations in a row did not lower the validation loss",
                self.train.steps, self.a.patience
            ),
            None => String::new(),
        };
        let best = match &self.best {
            Some(b) => {
                format!("; best validation loss {:.4} after step {} in {}", b.at.val_loss, b.at.step, self.a.out.join(best::DIR).display())
            }
            None => String::new(),
        };
        println!(
            "trained steps {}..{}: loss {head:.4} -> {tail:.4} (mean of the first and last {} steps){scaling}{stopped}; {what} in {}{best}",
            self.start,
            self.stopped.unwrap_or(self.train.steps),
            n.max(1),
            self.a.out.display()
        );
        Ok(())
    }
}

/// Loads the saved state of a resumed run from `dir` into `tr`: the state every rank holds
/// alike, and over ranks with ZeRO this rank's shard of the rest (all ranks agree that each read
/// its own, or every one refuses with the first failure); (the steps done, the steps skipped),
/// checked against the optimizer's own step count.
fn restore(tr: &mut Trainer, done: &resume::Progress, dir: &Path, allow_nonfinite: bool, world: &World) -> anyhow::Result<(usize, usize)> {
    let state = dir.join(STATE);
    let loaded = tr.load_state(&state, allow_nonfinite).and_then(|()| match tr.shard(done.step) {
        Some(of) => tr.load_shard(&dir.join(resume::shard_file(of.rank, of.ranks)), done.step, allow_nonfinite),
        None => Ok(()),
    });
    world::agree(world, loaded)?;
    // the optimizer's step count is saved with the tensors: both files must be one save's
    // (a step fp16 loss scaling skipped does not count)
    let count = tr.step_count()?;
    if count.is_none() || done.skipped > done.step || count != Some((done.step - done.skipped) as f32) {
        anyhow::bail!(
            "{}: AdamW's step count is {}, but {PROGRESS} says {} steps were done ({} skipped): the two files are not from one save",
            state.display(),
            count.map_or("missing".into(), |c| c.to_string()),
            done.step,
            done.skipped
        );
    }
    Ok((done.step, done.skipped))
}

/// The `calibrate` step, where learned scales start with `--scale-init activation|auto` (a fresh
/// start only: an adapter brings its scales, a resumed run its state); its cost and choice printed.
fn calibrated_start(m: &Model, opts: &StepOptions, data: &Dataset, restored: bool) -> anyhow::Result<Option<Calibration>> {
    let learned = opts.model.quant.as_ref().is_some_and(|q| q.learned_scales);
    if !learned || restored || !opts.scale_init.calibrates() {
        return Ok(None);
    }
    let c = calibrate::calibrate(m, &opts.model, (opts.batch, opts.seq), data, opts.scale_init)?;
    eprintln!("qatc: {}: {} batches ({} tokens) in {:.1} s; scale starts: {}", calibrate::NAME, c.batches, c.tokens, c.seconds, c.counts());
    Ok(Some(c))
}

/// `--log-json`'s file: started afresh, or, when the run resumes at step `resumed`, kept up to
/// that step and appended to. The lines of the steps a killed run logged after its last save are
/// dropped (rewritten through a temporary file, then renamed): the resumed run takes those steps
/// again, and the log holds each step once.
fn step_log(a: &Args, resumed: Option<usize>) -> anyhow::Result<Option<std::io::BufWriter<std::fs::File>>> {
    let Some(p) = &a.log_json else { return Ok(None) };
    if let Some(start) = resumed {
        keep_log_before(p, start).with_context(|| format!("{}", p.display()))?;
    }
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(resumed.is_some())
        .write(true)
        .truncate(resumed.is_none())
        .open(p)
        .with_context(|| format!("{}", p.display()))?;
    Ok(Some(std::io::BufWriter::new(f)))
}

/// Rewrites log `p` without the lines of steps `start` and later (a line without a step, or one
/// that is not JSON, stays). Nothing to do when `p` does not exist or has no such line.
fn keep_log_before(p: &std::path::Path, start: usize) -> std::io::Result<()> {
    let text = match std::fs::read_to_string(p) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let step_of = |l: &str| serde_json::from_str::<serde_json::Value>(l).ok().and_then(|v| v["step"].as_u64());
    let kept: Vec<&str> = text.lines().filter(|l| step_of(l).is_none_or(|s| s < start as u64)).collect();
    if kept.len() == text.lines().count() {
        return Ok(());
    }
    let tmp = p.with_extension("jsonl.tmp");
    std::fs::write(&tmp, kept.iter().map(|l| format!("{l}\n")).collect::<String>())?;
    std::fs::rename(&tmp, p)
}

/// How validation evaluates: the step's model without dropout, where the step runs, as it runs.
fn validation(tr: &Trainer, resolved: &qatc_driver::Resolved, kernel_cache: Option<PathBuf>, val: Option<&Dataset>) -> EvalSetup {
    let mut model = tr.opts.model.clone();
    if let Some(l) = model.lora.as_mut() {
        l.dropout = 0.0;
    }
    // what the validation data's batches give, which may differ from the training data's
    model.inputs = val.map(Batches::inputs).unwrap_or_default();
    EvalSetup {
        model,
        adapter: None,
        precision: tr.opts.precision,
        // validation runs where the step runs, as the step does
        target: resolved.target,
        interpreter: resolved.interpreter,
        kernel_cache,
        ..Default::default()
    }
}
