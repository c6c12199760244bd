//! `qatc eval MODEL --data FILE`: mean loss and perplexity over the first N batches of a token
//! file: the forward compiled like the training step (fused by the same stage, then
//! `qatc_driver::compile`: LLVM kernels on the CPU, the CUDA executor with `--device cuda` or
//! `auto` where a GPU is usable), the weights uploaded once; `--interpreter` runs the reference
//! interpreter instead, on the unfused graph. `--profile` says where a batch's time goes.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::Context;
use qatc_driver::{CudaSettings, Target};
use qatc_passes::precision::Precision;
use qatc_runtime::{CpuOptions, IntTensor, RuntimeError, Value};

use super::options;
use crate::adapter::Adapter;
use crate::batches::{Batches, Dataset};
use crate::config::DeviceFlag as Device;
use crate::config::ScaleInit;
use crate::model::{Model, Trained};
use crate::step::{self, ModelOptions};

#[derive(clap::Args, Debug)]
pub struct Args {
    pub model: PathBuf,
    /// llm.c token file (256 x int32 header, then uint16 tokens), UTF-8 text, or instruction
    /// data (.jsonl: the loss over the tokens `--train-on` counts).
    #[arg(long)]
    pub data: PathBuf,
    #[command(flatten)]
    pub examples: super::examples::ExampleArgs,
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    #[arg(long, default_value_t = 128)]
    pub seq: usize,
    /// Evaluate the first N batches (default: every whole batch in the file).
    #[arg(long)]
    pub batches: Option<usize>,
    /// Print one JSON object: {"loss", "ppl", "tokens", "engine", "build"}.
    #[arg(long)]
    pub json: bool,
    // quantization (with --adapter: read from the adapter's qatc.json when it has one)
    #[command(flatten)]
    pub quant: options::QuantArgs,
    /// A PEFT LoRA adapter directory to apply (with the quantization it was trained with, when
    /// qatc trained it).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Storage type of activations (and GEMM operands): fp32, bf16 or fp16.
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub precision: Precision,
    /// With --scales learned and no adapter: the scales a training run would start from (minmax:
    /// the post-training grid; search: each group's least-squared-error fraction of it), so that
    /// post-training quantization at searched scales is measured by itself.
    #[arg(long, value_enum)]
    pub scale_init: Option<ScaleInit>,
    /// Where the model runs: auto (a CUDA GPU when qatc can use one, else the CPU), cpu, cuda.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
    /// Run the reference interpreter, node by node (the numerical oracle; slower), instead of
    /// the compiled forward.
    #[arg(long)]
    pub interpreter: bool,
    /// After the batches: where a batch's time went, kernel by kernel and GEMM by GEMM (the
    /// first batch, which also computes what later ones reuse, is not timed), as `train
    /// --profile` shows a step's.
    #[arg(long)]
    pub profile: bool,
    #[command(flatten)]
    pub cache: super::kernel_cache::KernelCacheArgs,
    #[command(flatten)]
    pub read: super::ReadArgs,
}

#[derive(serde::Serialize, Debug, Clone, Copy)]
pub struct EvalResult {
    pub loss: f64,
    pub ppl: f64,
    pub tokens: usize,
}

/// What batches evaluated add up to: their losses, each times its weight (1 for a token file's
/// batch; for instruction data the targets its mask counts), the weights, and the targets
/// counted. Sums of parts (a rank's rows of each batch) add up to the whole's.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EvalSums {
    pub weighted: f64,
    pub weight: f64,
    pub tokens: usize,
}

impl EvalSums {
    /// The mean loss they give.
    pub fn result(self) -> EvalResult {
        let loss = if self.weight > 0.0 { self.weighted / self.weight } else { 0.0 };
        EvalResult { loss, ppl: loss.exp(), tokens: self.tokens }
    }

    /// As bytes, to be exchanged between ranks (`from_bytes` reads them back).
    pub fn to_bytes(self) -> [u8; 24] {
        let mut b = [0u8; 24];
        b[..8].copy_from_slice(&self.weighted.to_le_bytes());
        b[8..16].copy_from_slice(&self.weight.to_le_bytes());
        b[16..].copy_from_slice(&(self.tokens as u64).to_le_bytes());
        b
    }

    pub fn from_bytes(b: &[u8; 24]) -> EvalSums {
        let word = |i: usize| <[u8; 8]>::try_from(&b[i..i + 8]).unwrap_or([0; 8]);
        EvalSums {
            weighted: f64::from_le_bytes(word(0)),
            weight: f64::from_le_bytes(word(8)),
            tokens: u64::from_le_bytes(word(16)) as usize,
        }
    }
}

/// These and `other`.
impl std::ops::Add for EvalSums {
    type Output = EvalSums;
    fn add(self, other: EvalSums) -> EvalSums {
        EvalSums { weighted: self.weighted + other.weighted, weight: self.weight + other.weight, tokens: self.tokens + other.tokens }
    }
}

/// What to evaluate: the model options (quantization, LoRA) and the adapter's tensors; where.
pub struct EvalSetup {
    pub model: ModelOptions,
    pub adapter: Option<Adapter>,
    /// The storage type the forward runs in (`--precision`).
    pub precision: Precision,
    /// How learned scales start when no adapter has them.
    pub scale_init: ScaleInit,
    /// Where the forward runs: the CPU (compiled by LLVM) or a GPU (the CUDA executor), the
    /// weights uploaded once.
    pub target: Target,
    /// On the reference interpreter instead (`--interpreter`, or a build without LLVM).
    pub interpreter: bool,
    /// Where compiled kernels are kept between runs (None: nowhere on disk).
    pub kernel_cache: Option<PathBuf>,
    /// The world a training run's validation runs in (None: one process): on CUDA it picks this
    /// rank's device, as the training step's does (the forward itself has no collectives).
    pub comm: Option<std::sync::Arc<dyn qatc_runtime::comm::Communicator>>,
}

impl Default for EvalSetup {
    fn default() -> EvalSetup {
        EvalSetup {
            model: ModelOptions::default(),
            adapter: None,
            precision: Precision::default(),
            scale_init: ScaleInit::default(),
            target: Target::cpu(),
            interpreter: !cfg!(feature = "llvm"),
            kernel_cache: None,
            comm: None,
        }
    }
}

/// Where `--device` and `--interpreter` put an evaluation (as `qatc train` resolves them): the
/// GPU for `auto` where CUDA is usable, else the CPU, compiled by LLVM unless `--interpreter` (or
/// a build without LLVM) says the reference interpreter; `cuda` or an error saying why not. The
/// evaluation says in one line what ran it.
pub fn placement(device: Device, interpreter: bool) -> anyhow::Result<(Target, bool)> {
    let r = qatc_driver::resolve(device.kind(), interpreter, CudaSettings::default())?;
    Ok((r.target, r.interpreter))
}

impl EvalSetup {
    /// What `qatc eval` evaluates: with an adapter, the configuration saved beside it (the
    /// quantization flags, when given, must agree with it); else the flags. The precision is
    /// this evaluation's choice, not the training run's. Adapter tensors must be finite unless
    /// `allow_nonfinite`.
    pub fn new(
        quant: &options::QuantArgs,
        adapter: Option<&std::path::Path>,
        precision: Precision,
        allow_nonfinite: bool,
    ) -> anyhow::Result<EvalSetup> {
        match adapter {
            Some(dir) => {
                let (cfg, ad) = options::adapter_config(quant, dir, std::path::Path::new(""), allow_nonfinite)?;
                let mut model = cfg.model.options(false);
                options::name_bit_map(&mut model, quant);
                Ok(EvalSetup { model, adapter: Some(ad), precision, ..Default::default() })
            }
            None => {
                Ok(EvalSetup { model: options::model_options(quant, None, false, false)?, adapter: None, precision, ..Default::default() })
            }
        }
    }
}

/// Evaluates `model` on the first `n` batches of `data` (`setup.model.inputs` must be what its
/// batches give).
pub fn evaluate(m: &Model, data: &impl Batches, b: usize, t: usize, n: usize, setup: &EvalSetup, show: bool) -> anyhow::Result<EvalResult> {
    Evaluator::new(m, b, t, setup, None)?.run(data, n, show)
}

/// The engine an evaluation runs on, in a word (`qatc eval --json`'s `engine`).
pub fn engine_name(setup: &EvalSetup) -> &'static str {
    match (setup.interpreter, setup.target.is_cuda()) {
        (true, _) => "interpreter",
        (false, true) => "cuda",
        (false, false) => "llvm",
    }
}

/// The forward of a model compiled once for its target (the executor holding its weights), run
/// over batches as often as asked: `qatc eval`, `prt`, and validation during training, which
/// builds one and gives it the trained weights before each validation.
pub struct Evaluator {
    graph: qatc_ir::Graph,
    step: Box<dyn qatc_runtime::TrainStep>,
    /// What runs it, in one line.
    pub description: String,
    /// How long building it took: the graph, the lowering and its kernels.
    pub built: crate::trainer::Built,
    b: usize,
    t: usize,
    /// The adapter's scaling, for the message when a loss overflows.
    lora_scaling: Option<(f64, f64)>,
    /// Where the batches' time goes (`--profile`), from the second batch on.
    pub profile: Option<crate::trainer::Profile>,
}

impl Evaluator {
    /// Builds the forward of `m` (B `b`, T `t`) as `setup` says, compiled for `setup.target` (or
    /// the reference interpreter), with its weights bound: from `state` where a training run's
    /// state has them, else the adapter's, else fresh ones.
    pub fn new(m: &Model, b: usize, t: usize, setup: &EvalSetup, state: Option<&HashMap<String, Value<f32>>>) -> anyhow::Result<Evaluator> {
        let start = std::time::Instant::now();
        // compiled, the forward is fused as the training step's is; the interpreter runs the
        // reference graph
        let fuse = (!setup.interpreter).then(qatc_passes::fusion::FuseOptions::default);
        let (g, _) = step::evaluation(&m.cfg, b, t, false, &setup.model, setup.precision, fuse, |_, _| {})?;
        let passes_s = start.elapsed().as_secs_f64();
        // the weights go to the executor once; per batch only the ids and targets
        let bound = compile_bound(m, &g, setup, state)?;
        Ok(Evaluator {
            graph: g,
            step: bound.step,
            description: bound.description,
            built: crate::trainer::Built::new(passes_s, bound.compile_s, bound.bind_s, bound.kernels),
            b,
            t,
            lora_scaling: setup.model.lora.as_ref().map(|l| (l.alpha, l.scaling())),
            profile: None,
        })
    }

    /// Binds a training run's state anew (before a validation): every input, since a frozen one
    /// may be derived from a trained weight (a full fine-tune's quantized codes).
    pub fn set_state(&mut self, m: &Model, state: &HashMap<String, Value<f32>>) -> anyhow::Result<()> {
        let inputs = m.bind_trained::<f32>(&self.graph, &Trained::State(state))?;
        self.set(&inputs)
    }

    fn set(&mut self, inputs: &HashMap<String, Value<f32>>) -> anyhow::Result<()> {
        give(self.step.as_mut(), inputs)
    }

    /// The mean loss over the first `n` batches of `data`: over every target they hold, or for
    /// instruction data over the targets each batch's mask counts (each batch's loss weighted by
    /// how many it counts).
    pub fn run(&mut self, data: &impl Batches, n: usize, show: bool) -> anyhow::Result<EvalResult> {
        Ok(self.sums(data, n, None, show)?.result())
    }

    /// What the first `n` batches of `data` add up to (`run`'s mean); with `part` (rank r of N
    /// ranks, this evaluator's B rows each), of rows r B .. (r + 1) B of each of the first `n`
    /// batches of N B rows: the ranks' sums add up to those of one rank of N B rows.
    pub fn sums(&mut self, data: &impl Batches, n: usize, part: Option<(usize, usize)>, show: bool) -> anyhow::Result<EvalSums> {
        let (b, t) = (self.b, self.t);
        let pb = super::progress(n as u64, "eval {bar:30} {pos}/{len} batches  loss {msg}  eta {eta}");
        if !show {
            pb.set_draw_target(indicatif::ProgressDrawTarget::hidden());
        }
        let mut sum = 0.0f64;
        // how much the batches so far weigh, and the targets they count
        let (mut weight, mut tokens) = (0.0f64, 0usize);
        for s in 0..n {
            let batch = match part {
                Some((rank, ranks)) => data.batch(s, b * ranks, t)?.rows(rank * b, b, t),
                None => data.batch(s, b, t)?,
            };
            let counted = batch.counted();
            // a token file's batches weigh 1 each: the plain mean of their losses
            let w = if batch.mask.is_some() { counted as f64 } else { 1.0 };
            self.step.set_input("ids", &Value::Int(IntTensor { shape: vec![b, t], data: batch.ids }))?;
            self.step.set_input("targets", &Value::Int(IntTensor { shape: vec![b, t], data: batch.targets }))?;
            if let Some(mask) = &batch.mask {
                let weights = crate::batches::loss_weights(&[mask], 1.0).concat();
                self.step.set_input("weights", &Value::Float(qatc_runtime::Tensor { shape: vec![b, t], data: weights }))?;
            }
            if let Some(positions) = batch.positions {
                self.step.set_input("positions", &Value::Int(IntTensor { shape: vec![b, t], data: positions }))?;
            }
            // the first batch also computes what is hoisted out of later ones: not profiled
            match self.profile.as_mut() {
                Some(p) if s > 0 => {
                    if let Some(times) = self.step.run_timed()? {
                        p.add(times, true);
                    }
                }
                _ => self.step.run()?,
            }
            let out = HashMap::from([("loss".to_string(), self.step.output("loss")?)]);
            let loss = scalar(&out, "loss")?;
            if !loss.is_finite() {
                // never a NaN result: say where it appeared and what can cause it
                let lora = self.lora_scaling.map(|(_, s)| format!(", or the adapter's scaling alpha/r = {s}")).unwrap_or_default();
                anyhow::bail!(
                    "{}: batch {s} gives a loss of {loss}: the model overflows on it (finite but huge weights{lora}, or non-finite ones let in by --allow-nonfinite); no result",
                    data.source().display()
                );
            }
            sum += loss * w;
            weight += w;
            tokens += counted;
            pb.set_message(format!("{:.4}", sum / weight.max(f64::MIN_POSITIVE)));
            pb.inc(1);
        }
        pb.finish_and_clear();
        if n == 0 {
            anyhow::bail!("internal: evaluating 0 batches");
        }
        Ok(EvalSums { weighted: sum, weight, tokens })
    }
}

/// An executor with its weights bound, and how long building it took.
pub struct Bound {
    pub step: Box<dyn qatc_runtime::TrainStep>,
    /// What runs it, in one line.
    pub description: String,
    pub kernels: Option<qatc_driver::KernelsBuilt>,
    pub compile_s: f64,
    pub bind_s: f64,
}

/// Graph `g` of model `m` compiled for `setup`'s target (or the reference interpreter, with the
/// kernel cache `setup` names), its weights bound as an evaluation binds them: from `state` where
/// a training run's state has them, else the adapter's, else fresh ones.
pub fn compile_bound(
    m: &Model,
    g: &qatc_ir::Graph,
    setup: &EvalSetup,
    state: Option<&HashMap<String, Value<f32>>>,
) -> anyhow::Result<Bound> {
    let start = std::time::Instant::now();
    let options = qatc_driver::Options {
        comm: setup.comm.clone(),
        ..super::driver_options(setup.interpreter, CpuOptions::default(), setup.kernel_cache.clone())
    };
    let mut exe = qatc_driver::compile(g, &setup.target, &options)?;
    let compile_s = start.elapsed().as_secs_f64();
    let inputs = match state {
        Some(st) => m.bind_trained::<f32>(g, &Trained::State(st))?,
        None => match &setup.adapter {
            Some(a) => m.bind_trained::<f32>(g, &Trained::Adapter(a))?,
            None => m.bind_trained::<f32>(g, &Trained::Fresh { seed: 0, scale_init: setup.scale_init })?,
        },
    };
    give(exe.step.as_mut(), &inputs)?;
    Ok(Bound {
        step: exe.step,
        description: exe.description,
        kernels: exe.kernels,
        compile_s,
        bind_s: start.elapsed().as_secs_f64() - compile_s,
    })
}

/// Gives an executor these inputs' values; an input no step reads (lowering dropped its use) is
/// not in the program.
pub fn give(step: &mut dyn qatc_runtime::TrainStep, inputs: &HashMap<String, Value<f32>>) -> anyhow::Result<()> {
    for (name, v) in inputs {
        match step.set_input(name, v) {
            Err(RuntimeError::UnknownInput(_)) => {}
            r => r.with_context(|| format!("binding {name}"))?,
        }
    }
    Ok(())
}

/// Reads a scalar output.
pub fn scalar(out: &HashMap<String, Value<f32>>, name: &str) -> anyhow::Result<f64> {
    match out.get(name) {
        Some(Value::Float(t)) if t.data.len() == 1 => Ok(t.data[0] as f64),
        _ => anyhow::bail!("internal: the step produced no scalar `{name}`"),
    }
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let m = super::open_model(&a.model, &a.read)?;
    super::check_seq(&m, a.batch, a.seq)?;
    let reading = super::examples::options_of(a.examples.config(&a.data, None)?.as_ref())?;
    let data = Dataset::load(&a.data, a.seq, &reading)?;
    data.check_vocab(m.cfg.vocab_size)?;
    // explains how many tokens one batch needs and the file has
    let avail = data.require_batches(a.batch, a.seq)?;
    if let Some(s) = data.summary(a.batch) {
        eprintln!("qatc: {s}");
    }
    let n = match (a.batches, &data) {
        (Some(0), _) => anyhow::bail!("--batches must be at least 1"),
        (Some(n), Dataset::Tokens { file, .. }) if n > avail => anyhow::bail!(
            "{}: --batches {n} needs {} tokens but the file has {} ({avail} whole batches of B {} x T {})",
            a.data.display(),
            n * a.batch * a.seq + 1,
            file.len(),
            a.batch,
            a.seq
        ),
        (Some(n), Dataset::Examples(e)) if n > avail => anyhow::bail!(
            "{}: --batches {n}, but its examples fill {} sequences of T {}: {avail} batches of B {}",
            a.data.display(),
            e.rows(),
            a.seq,
            a.batch
        ),
        (Some(n), _) => n,
        (None, _) => avail,
    };
    let mut setup = EvalSetup::new(&a.quant, a.adapter.as_deref(), a.precision, a.read.allow_nonfinite)?;
    if let Some(init) = a.scale_init {
        if a.adapter.is_some() || setup.model.quant.as_ref().is_none_or(|q| !q.learned_scales) {
            anyhow::bail!("--scale-init needs --scales learned and no --adapter (an adapter brings its own scales)");
        }
        if init.calibrates() {
            // calibrating on the data being measured would fit the scales to it
            anyhow::bail!(
                "--scale-init {}: qatc eval does not calibrate (it would fit the scales to the data it measures); a run of qatc train does, on its training data, and saves what it chose",
                if init == ScaleInit::Auto { "auto" } else { "activation" }
            );
        }
        setup.scale_init = init;
    }
    (setup.target, setup.interpreter) = placement(a.device, a.interpreter)?;
    setup.kernel_cache = a.cache.dir();
    setup.model.inputs = data.inputs();
    let mut e = Evaluator::new(&m, a.batch, a.seq, &setup, None)?;
    e.profile = a.profile.then(crate::trainer::Profile::default);
    eprintln!("qatc: eval runs {}", e.description);
    eprintln!("qatc: built the forward in {}", e.built);
    let r = e.run(&data, n, !a.json)?;
    if let Some(p) = &e.profile {
        match p.table("batch", 40) {
            Some(table) => eprint!("{table}"),
            None => eprintln!("qatc: --profile: nothing timed (the interpreter does not time its parts; the first batch is not timed)"),
        }
    }
    if a.json {
        // a perplexity past f64 (a mean loss over 709) is null, as JSON has no infinity
        let mut v = serde_json::to_value(r)?;
        v["engine"] = engine_name(&setup).into();
        v["build"] = serde_json::to_value(&e.built)?;
        println!("{}", serde_json::to_string(&v)?);
    } else if r.ppl.is_finite() {
        println!("loss {:.6}  ppl {:.3}  ({} batches x B {} x T {} = {} tokens)", r.loss, r.ppl, n, a.batch, a.seq, r.tokens);
    } else {
        println!("loss {:.6}  ppl over 1.8e308 ({} batches x B {} x T {} = {} tokens)", r.loss, n, a.batch, a.seq, r.tokens);
    }
    Ok(())
}
