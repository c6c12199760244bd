//! The training loop's state and one optimizer step (compiled, or on the reference interpreter:
//! `runner`), plus the
//! resume state: every persistent input of the step (weights, Adam moments, the step count) is
//! saved bit for bit, so a resumed run continues exactly where an uninterrupted one would be.

use std::collections::HashMap;
use std::path::Path;

use anyhow::Context;
use qatc_ir::{Graph, InputKind};
use qatc_passes::lora::DROPOUT_SEED;
use qatc_passes::microbatch::micro_name;
use qatc_runtime::{IntTensor, Tensor, Value};

use crate::adapter::Adapter;
use crate::data::TokenFile;
use crate::model::Model;
use crate::runner::{Engine, Runner};
use crate::step;

/// The training loop's state: every input of the step graph that persists across steps.
pub struct Trainer {
    pub graph: Graph,
    runner: Runner,
    pub state: HashMap<String, Value<f32>>,
    pub opts: step::StepOptions,
    seed: u64,
}

impl Trainer {
    /// Compiles the step and binds the weights (LoRA from `adapter`, else initialised from
    /// `seed`); Adam moments and the step count start at zero.
    pub fn new(m: &Model, opts: step::StepOptions, adapter: Option<&Adapter>, seed: u64) -> anyhow::Result<Trainer> {
        Self::with_engine(m, opts, adapter, seed, Engine::Interpreter)
    }

    /// As `new`, with the step run by `engine`.
    pub fn with_engine(
        m: &Model,
        opts: step::StepOptions,
        adapter: Option<&Adapter>,
        seed: u64,
        engine: Engine,
    ) -> anyhow::Result<Trainer> {
        let (graph, _) = step::train(&m.cfg, &opts, |_, _| {})?;
        let runner = Runner::new(&graph, engine)?;
        let mut state = m.bind::<f32>(&graph, adapter, seed)?;
        for id in graph.inputs() {
            if graph.input_kind(id) == Some(InputKind::State) {
                let ty = graph.ty(id);
                let name = graph.node(id).name.clone().unwrap_or_default();
                state.insert(name, Value::Float(Tensor { shape: ty.shape.dims().to_vec(), data: vec![0.0; ty.numel()] }));
            }
        }
        Ok(Trainer { graph, runner, state, opts, seed })
    }

    /// Runs one optimizer step on micro-batches `first .. first + K` (llm.c's sequential order,
    /// wrapping at the end of the data) and returns the loss before the update (and every other
    /// non-update output).
    pub fn step(&mut self, data: &TokenFile, first: usize, lr: f64) -> anyhow::Result<HashMap<String, Value<f32>>> {
        let nb = data.num_batches(self.opts.batch, self.opts.seq).max(1);
        let batches: Vec<usize> = (0..self.opts.grad_accum).map(|i| (first + i) % nb).collect();
        self.step_on(data, &batches, lr, first as u64)
    }

    /// One optimizer step on the given micro-batches (K of them). `salt` varies the dropout mask
    /// from step to step; it is derived from the run's position, so a resumed run reproduces it.
    pub fn step_on(&mut self, data: &TokenFile, batches: &[usize], lr: f64, salt: u64) -> anyhow::Result<HashMap<String, Value<f32>>> {
        let (b, t, k) = (self.opts.batch, self.opts.seq, self.opts.grad_accum);
        if batches.len() != k {
            anyhow::bail!("internal: {} micro-batches for --grad-accum {k}", batches.len());
        }
        for (i, &s) in batches.iter().enumerate() {
            let (ids, tgt) = data.batch(s, b, t)?;
            let (ni, nt) =
                if k == 1 { ("ids".to_string(), "targets".to_string()) } else { (micro_name("ids", i), micro_name("targets", i)) };
            self.state.insert(ni, Value::Int(IntTensor { shape: vec![b, t], data: ids }));
            self.state.insert(nt, Value::Int(IntTensor { shape: vec![b, t], data: tgt }));
        }
        self.state.insert("lr".into(), Value::scalar(lr));
        // a fresh dropout mask every step, reproducible from the seed and the step's first batch
        let dseed = (self.seed as i64).wrapping_mul(1_000_003).wrapping_add(salt as i64) as i32;
        // micro-batching renames per-step data inputs (`dropout.seed.0`, ..): a mask of its own each
        let names: Vec<String> = if k == 1 { vec![DROPOUT_SEED.into()] } else { (0..k).map(|i| micro_name(DROPOUT_SEED, i)).collect() };
        for (i, n) in names.into_iter().enumerate() {
            self.state.insert(n, Value::Int(IntTensor { shape: vec![], data: vec![dseed.wrapping_add(i as i32)] }));
        }
        let mut out = self.runner.run(&self.state)?;
        for o in self.graph.outputs().iter().filter(|o| o.update) {
            if let Some(v) = out.remove(&format!("update:{}", o.name)).or_else(|| out.remove(&o.name)) {
                self.state.insert(o.name.clone(), v);
            }
        }
        Ok(out)
    }

    /// Where the compiled step's time goes (see `Runner::profile`).
    pub fn profile(&mut self) -> anyhow::Result<Option<Vec<(String, usize, f64)>>> {
        self.runner.profile()
    }

    /// What runs the step, in words.
    pub fn describe(&self) -> String {
        self.runner.describe()
    }

    /// The persistent state: trainable weights, Adam moments and the step count, by name.
    pub fn persistent(&self) -> Vec<(String, &Tensor<f32>)> {
        let mut v = Vec::new();
        for id in self.graph.inputs() {
            if matches!(self.graph.input_kind(id), Some(InputKind::Trainable | InputKind::State)) {
                let name = self.graph.node(id).name.clone().unwrap_or_default();
                if let Some(Value::Float(t)) = self.state.get(&name) {
                    v.push((name, t));
                }
            }
        }
        v
    }

    /// Saves the persistent state as one safetensors file (raw f32: bit for bit).
    pub fn save_state(&self) -> anyhow::Result<Vec<u8>> {
        weights_safetensors(&self.persistent())
    }

    /// Restores what `save_state` wrote; every persistent input must be there with its shape.
    pub fn load_state(&mut self, path: &Path) -> anyhow::Result<()> {
        let bytes = std::fs::read(path).with_context(|| format!("{}", path.display()))?;
        let st = safetensors::SafeTensors::deserialize(&bytes).with_context(|| format!("{}: not a qatc resume state", path.display()))?;
        let names: Vec<String> = self.persistent().into_iter().map(|(n, _)| n).collect();
        for name in names {
            let v = st.tensor(&name).with_context(|| format!("{}: no state for {name:?}: were the options the same?", path.display()))?;
            let want = self.state.get(&name).map(|v| v.shape().to_vec()).unwrap_or_default();
            if v.shape() != want.as_slice() || v.dtype() != safetensors::Dtype::F32 {
                anyhow::bail!("{}: {name:?} is {:?} {:?}, the step needs f32 {want:?}", path.display(), v.dtype(), v.shape());
            }
            let data = v.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            self.state.insert(name, Value::Float(Tensor { shape: want, data }));
        }
        Ok(())
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
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> =
        ws.iter().map(|(n, t)| (n.clone(), t.data.iter().flat_map(|v| v.to_le_bytes()).collect(), t.shape.clone())).collect();
    let views = bytes
        .iter()
        .map(|(n, b, s)| Ok((n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    Ok(safetensors::serialize(views, Some(meta))?)
}
