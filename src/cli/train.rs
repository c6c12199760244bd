//! `qatc train`: runs the compiled training step on the reference interpreter. Data order is
//! llm.c's: optimizer step s consumes micro-batches s*K .. s*K+K-1 (wrapping at the end of the
//! file), and the loss logged for step s is the loss of those batches before the update.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use qatc_ir::{Graph, InputKind};
use qatc_passes::lora::DROPOUT_SEED;
use qatc_passes::microbatch::micro_name;
use qatc_runtime::{IntTensor, Interpreter, Tensor, Value};

use super::StepArgs;
use crate::adapter::Adapter;
use crate::artifacts::OutDir;
use crate::data::TokenFile;
use crate::model::Model;
use crate::step;

#[derive(clap::Args, Debug)]
pub struct Args {
    pub model: PathBuf,
    /// llm.c token file.
    #[arg(long)]
    pub data: PathBuf,
    #[command(flatten)]
    pub step: StepArgs,
    /// Optimizer steps.
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Where the trained weights go.
    #[arg(long)]
    pub out: PathBuf,
    /// One JSON object per step: {"step", "loss", "lr", "tokens_per_s"}.
    #[arg(long)]
    pub log_json: Option<PathBuf>,
    /// Start LoRA from this PEFT adapter instead of a fresh initialisation.
    #[arg(long)]
    pub init_adapter: Option<PathBuf>,
}

/// One logged step.
#[derive(serde::Serialize, Debug, Clone)]
pub struct StepLog {
    pub step: usize,
    pub loss: f64,
    pub lr: f64,
    pub tokens_per_s: f64,
}

/// The training loop's state: every input of the step graph that persists across steps.
pub struct Trainer {
    pub graph: Graph,
    interp: Interpreter<f32>,
    pub state: HashMap<String, Value<f32>>,
    pub opts: step::StepOptions,
    seed: u64,
}

impl Trainer {
    /// Compiles the step and binds the weights (LoRA from `adapter`, else initialised from
    /// `seed`); Adam moments and the step count start at zero.
    pub fn new(m: &Model, opts: step::StepOptions, adapter: Option<&Adapter>, seed: u64) -> anyhow::Result<Trainer> {
        let (graph, _) = step::train(&m.cfg, &opts, |_, _| {})?;
        let interp = Interpreter::<f32>::new(&graph)?;
        let mut state = m.bind::<f32>(&graph, adapter, seed)?;
        for id in graph.inputs() {
            if graph.input_kind(id) == Some(InputKind::State) {
                let ty = graph.ty(id);
                let name = graph.node(id).name.clone().unwrap_or_default();
                state.insert(name, Value::Float(Tensor { shape: ty.shape.dims().to_vec(), data: vec![0.0; ty.numel()] }));
            }
        }
        Ok(Trainer { graph, interp, state, opts, seed })
    }

    /// Runs one optimizer step on micro-batches `first .. first + K` and returns the loss
    /// before the update (and every other non-update output).
    pub fn step(&mut self, data: &TokenFile, first: usize, lr: f64) -> anyhow::Result<HashMap<String, Value<f32>>> {
        let (b, t, k) = (self.opts.batch, self.opts.seq, self.opts.grad_accum);
        let nb = data.num_batches(b, t);
        for i in 0..k {
            let (ids, tgt) = data.batch((first + i) % nb, b, t)?;
            let (ni, nt) = if k == 1 { ("ids".to_string(), "targets".to_string()) } else { (micro_name("ids", i), micro_name("targets", i)) };
            self.state.insert(ni, Value::Int(IntTensor { shape: vec![b, t], data: ids }));
            self.state.insert(nt, Value::Int(IntTensor { shape: vec![b, t], data: tgt }));
        }
        self.state.insert("lr".into(), Value::scalar(lr));
        // a fresh dropout mask every step, reproducible from the seed and the step's first batch
        let dseed = (self.seed as i64).wrapping_mul(1_000_003).wrapping_add(first as i64) as i32;
        self.state.insert(DROPOUT_SEED.into(), Value::Int(IntTensor { shape: vec![], data: vec![dseed] }));
        let mut out = self.interp.run(&self.state)?;
        for o in self.graph.outputs().iter().filter(|o| o.update) {
            if let Some(v) = out.remove(&format!("update:{}", o.name)).or_else(|| out.remove(&o.name)) {
                self.state.insert(o.name.clone(), v);
            }
        }
        Ok(out)
    }

    /// The trainable weights, by name.
    pub fn weights(&self) -> Vec<(String, &Tensor<f32>)> {
        let mut v = Vec::new();
        for id in self.graph.inputs() {
            if self.graph.input_kind(id) == Some(InputKind::Trainable) {
                let name = self.graph.node(id).name.clone().unwrap_or_default();
                if let Some(Value::Float(t)) = self.state.get(&name) {
                    v.push((name, t));
                }
            }
        }
        v
    }
}

/// Serializes weights as a Hugging Face safetensors file (F32, names without prefix).
pub fn weights_safetensors(ws: &[(String, &Tensor<f32>)]) -> anyhow::Result<Vec<u8>> {
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = ws
        .iter()
        .map(|(n, t)| (n.clone(), t.data.iter().flat_map(|v| v.to_le_bytes()).collect(), t.shape.clone()))
        .collect();
    let views = bytes
        .iter()
        .map(|(n, b, s)| Ok((n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    Ok(safetensors::serialize(views, Some(meta))?)
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    if a.step.full_finetune && a.step.lora.is_some() {
        anyhow::bail!("--full-finetune and --lora exclude each other");
    }
    if a.step.lora.is_none() && !a.step.full_finetune {
        anyhow::bail!("nothing to train: pass --lora r=N (an adapter) or --full-finetune (every weight)");
    }
    if a.steps == 0 {
        anyhow::bail!("--steps must be at least 1");
    }
    if !(a.lr > 0.0 && a.lr.is_finite()) {
        anyhow::bail!("--lr must be a positive number, got {}", a.lr);
    }
    let m = super::open_model(&a.model)?;
    super::check_seq(&m, a.step.batch, a.step.seq)?;
    let opts = a.step.options()?;
    let data = TokenFile::load(&a.data)?;
    data.check_vocab(m.cfg.vocab_size)?;
    if data.num_batches(opts.batch, opts.seq) == 0 {
        data.batch(0, opts.batch, opts.seq)?;
    }
    let init = match &a.init_adapter {
        Some(d) => Some(crate::adapter::read(d)?),
        None => None,
    };
    let out = OutDir::create(&a.out, "train.json").with_context(|| format!("{}", a.out.display()))?;
    let mut log = match &a.log_json {
        Some(p) => Some(std::io::BufWriter::new(std::fs::File::create(p).with_context(|| format!("{}", p.display()))?)),
        None => None,
    };
    let k = opts.grad_accum;
    let tokens_per_step = opts.batch * opts.seq * k;
    let lora = opts.model.lora.clone();
    let mut tr = Trainer::new(&m, opts, init.as_ref(), a.step.seed)?;
    let pb = super::progress(a.steps as u64, "train {bar:30} step {pos}/{len}  {msg}  eta {eta}");
    let mut logs = Vec::new();
    for s in 0..a.steps {
        let t0 = Instant::now();
        let out = tr.step(&data, s * k, a.lr)?;
        let loss = super::eval::scalar(&out, "loss")?;
        let tps = tokens_per_step as f64 / t0.elapsed().as_secs_f64();
        let entry = StepLog { step: s, loss, lr: a.lr, tokens_per_s: tps };
        if let Some(w) = log.as_mut() {
            writeln!(w, "{}", serde_json::to_string(&entry)?)?;
            w.flush()?;
        }
        pb.set_message(format!("loss {loss:.4}  {tps:.0} tok/s"));
        pb.inc(1);
        if !loss.is_finite() {
            anyhow::bail!("step {s}: the loss is {loss}; stopping (lower --lr or set --clip)");
        }
        logs.push(entry);
    }
    pb.finish_and_clear();
    match &lora {
        Some(l) => {
            let (cfg, st) = crate::adapter::to_files(l, &tr.weights(), &a.model.display().to_string())?;
            out.write("adapter_config.json", cfg)?;
            out.write("adapter_model.safetensors", st)?;
        }
        None => {
            out.write("model.safetensors", weights_safetensors(&tr.weights())?)?;
            out.write("config.json", serde_json::to_string_pretty(&m.cfg.to_hf_json())? + "\n")?;
        }
    }
    let summary = serde_json::json!({"steps": a.steps, "first_loss": logs.first().map(|l| l.loss), "last_loss": logs.last().map(|l| l.loss), "lr": a.lr});
    out.write("train.json", serde_json::to_string_pretty(&summary)? + "\n")?;
    let dir = out.commit()?;
    let (first, last) = (logs.first().map(|l| l.loss).unwrap_or(f64::NAN), logs.last().map(|l| l.loss).unwrap_or(f64::NAN));
    let what = if lora.is_some() { "adapter (PEFT format)" } else { "weights" };
    println!("trained {} steps: loss {first:.4} -> {last:.4}; {what} in {}", a.steps, dir.display());
    Ok(())
}
