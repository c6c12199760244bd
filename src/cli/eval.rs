//! `qatc eval MODEL --data FILE`: mean loss and perplexity over the first N batches of a token
//! file, on the reference interpreter, or on the GPU (`--device cuda`, or `auto` where one is
//! usable: the forward graph through the CUDA executor, the weights uploaded once).

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::Context;
use qatc_passes::precision::Precision;
use qatc_driver::{CudaSettings, Target};
use qatc_runtime::{CpuOptions, IntTensor, RuntimeError, Value};

use super::options;
use crate::adapter::Adapter;
use crate::config::ScaleInit;
use crate::data::TokenFile;
use crate::model::{Model, Trained};
use crate::config::DeviceFlag as Device;
use crate::step::{self, ModelOptions};

#[derive(clap::Args, Debug)]
pub struct Args {
    pub model: PathBuf,
    /// llm.c token file (256 x int32 header, then uint16 tokens).
    #[arg(long)]
    pub data: PathBuf,
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    #[arg(long, default_value_t = 128)]
    pub seq: usize,
    /// Evaluate the first N batches (default: every whole batch in the file).
    #[arg(long)]
    pub batches: Option<usize>,
    /// Print one JSON object: {"loss", "ppl", "tokens"}.
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
    /// Where the model runs: auto (a CUDA GPU when qatc can use one, else the CPU's reference
    /// interpreter), cpu, cuda.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
    #[command(flatten)]
    pub read: super::ReadArgs,
}

#[derive(serde::Serialize, Debug, Clone, Copy)]
pub struct EvalResult {
    pub loss: f64,
    pub ppl: f64,
    pub tokens: usize,
}

/// What to evaluate: the model options (quantization, LoRA) and the adapter's tensors; where.
pub struct EvalSetup {
    pub model: ModelOptions,
    pub adapter: Option<Adapter>,
    /// The storage type the forward runs in (`--precision`).
    pub precision: Precision,
    /// How learned scales start when no adapter has them.
    pub scale_init: ScaleInit,
    /// Where the forward runs: the CPU (on the reference interpreter) or a GPU (the CUDA
    /// executor, the weights uploaded once).
    pub target: Target,
}

impl Default for EvalSetup {
    fn default() -> EvalSetup {
        EvalSetup {
            model: ModelOptions::default(),
            adapter: None,
            precision: Precision::default(),
            scale_init: ScaleInit::default(),
            target: Target::cpu(),
        }
    }
}

/// The target `--device` puts an evaluation on: the GPU for `auto` where CUDA is usable
/// (silently: the CPU is what eval always ran on), for `cuda` or an error saying why not.
pub fn eval_target(device: Device) -> anyhow::Result<Target> {
    let gpu = || Target::cuda(None, CudaSettings::default());
    match device {
        Device::Cpu => Ok(Target::cpu()),
        Device::Auto => Ok(if qatc_driver::cuda_ready().is_ok() { gpu() } else { Target::cpu() }),
        Device::Cuda => qatc_driver::cuda_ready().map(|()| gpu()).map_err(|why| anyhow::anyhow!("--device cuda: {why}")),
    }
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

/// Evaluates `model` on the first `n` batches of `data`.
pub fn evaluate(m: &Model, data: &TokenFile, b: usize, t: usize, n: usize, setup: &EvalSetup, show: bool) -> anyhow::Result<EvalResult> {
    run_eval(m, data, b, t, n, setup, None, show)
}

/// Evaluates with weights taken from a training run's state where it has them (validation
/// during training: LoRA, learned scales, a full fine-tune's weights).
pub fn evaluate_with(
    m: &Model,
    data: &TokenFile,
    b: usize,
    t: usize,
    n: usize,
    setup: &EvalSetup,
    state: &HashMap<String, Value<f32>>,
) -> anyhow::Result<EvalResult> {
    run_eval(m, data, b, t, n, setup, Some(state), false)
}

#[allow(clippy::too_many_arguments)]
fn run_eval(
    m: &Model,
    data: &TokenFile,
    b: usize,
    t: usize,
    n: usize,
    setup: &EvalSetup,
    state: Option<&HashMap<String, Value<f32>>>,
    show: bool,
) -> anyhow::Result<EvalResult> {
    let (g, _) = step::evaluation(&m.cfg, b, t, false, &setup.model, setup.precision, |_, _| {})?;
    let inputs = match state {
        Some(st) => m.bind_trained::<f32>(&g, &Trained::State(st))?,
        None => match &setup.adapter {
            Some(a) => m.bind_trained::<f32>(&g, &Trained::Adapter(a))?,
            None => m.bind_trained::<f32>(&g, &Trained::Fresh { seed: 0, scale_init: setup.scale_init })?,
        },
    };
    // the weights go to the executor once; per batch only the ids and targets
    let interpreter = !setup.target.is_cuda();
    let mut step = qatc_driver::compile(&g, &setup.target, &super::driver_options(interpreter, CpuOptions::default()))?.step;
    for (name, v) in &inputs {
        match step.set_input(name, v) {
            // an input no step reads (lowering dropped its use) is not in the program
            Err(RuntimeError::UnknownInput(_)) => {}
            r => r.with_context(|| format!("binding {name}"))?,
        }
    }
    let pb = super::progress(n as u64, "eval {bar:30} {pos}/{len} batches  loss {msg}  eta {eta}");
    if !show {
        pb.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let mut sum = 0.0f64;
    for s in 0..n {
        let (ids, tgt) = data.batch(s, b, t)?;
        let ids = Value::Int(IntTensor { shape: vec![b, t], data: ids });
        let tgt = Value::Int(IntTensor { shape: vec![b, t], data: tgt });
        step.set_input("ids", &ids)?;
        step.set_input("targets", &tgt)?;
        step.run()?;
        let out = HashMap::from([("loss".to_string(), step.output("loss")?)]);
        let loss = scalar(&out, "loss")?;
        if !loss.is_finite() {
            // never a NaN result: say where it appeared and what can cause it
            let lora =
                setup.model.lora.as_ref().map(|l| format!(", or the adapter's scaling alpha/r = {}", l.scaling())).unwrap_or_default();
            anyhow::bail!(
                "{}: batch {s} gives a loss of {loss}: the model overflows on it (finite but huge weights{lora}, or non-finite ones let in by --allow-nonfinite); no result",
                data.path().display()
            );
        }
        sum += loss;
        pb.set_message(format!("{:.4}", sum / (s + 1) as f64));
        pb.inc(1);
    }
    pb.finish_and_clear();
    if n == 0 {
        anyhow::bail!("internal: evaluating 0 batches");
    }
    let loss = sum / n as f64;
    Ok(EvalResult { loss, ppl: loss.exp(), tokens: n * b * t })
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
    let data = TokenFile::load(&a.data)?;
    data.check_vocab(m.cfg.vocab_size)?;
    let avail = data.num_batches(a.batch, a.seq);
    if avail == 0 {
        // batch(0) explains how many tokens it needs and has.
        data.batch(0, a.batch, a.seq)?;
    }
    let n = match a.batches {
        Some(0) => anyhow::bail!("--batches must be at least 1"),
        Some(n) if n > avail => anyhow::bail!(
            "{}: --batches {n} needs {} tokens but the file has {} ({avail} whole batches of B {} x T {})",
            a.data.display(),
            n * a.batch * a.seq + 1,
            data.len(),
            a.batch,
            a.seq
        ),
        Some(n) => n,
        None => avail,
    };
    let mut setup = EvalSetup::new(&a.quant, a.adapter.as_deref(), a.precision, a.read.allow_nonfinite)?;
    if let Some(init) = a.scale_init {
        if a.adapter.is_some() || setup.model.quant.as_ref().is_none_or(|q| !q.learned_scales) {
            anyhow::bail!("--scale-init needs --scales learned and no --adapter (an adapter brings its own scales)");
        }
        setup.scale_init = init;
    }
    setup.target = eval_target(a.device)?;
    let r = evaluate(&m, &data, a.batch, a.seq, n, &setup, !a.json)?;
    if a.json {
        // a perplexity past f64 (a mean loss over 709) is null, as JSON has no infinity
        println!("{}", serde_json::to_string(&r)?);
    } else if r.ppl.is_finite() {
        println!("loss {:.6}  ppl {:.3}  ({} batches x B {} x T {} = {} tokens)", r.loss, r.ppl, n, a.batch, a.seq, r.tokens);
    } else {
        println!("loss {:.6}  ppl over 1.8e308 ({} batches x B {} x T {} = {} tokens)", r.loss, n, a.batch, a.seq, r.tokens);
    }
    Ok(())
}
