//! The training loop's state and one optimizer step (compiled for a target, or on the reference
//! interpreter: `qatc_driver::compile`), plus the resume state: every persistent input of the step (weights, Adam moments,
//! the step count) is saved bit for bit, so a resumed run continues exactly where an
//! uninterrupted one would be.
//!
//! The state lives in the executor (`qatc_runtime::TrainStep`): the weights are bound once, each
//! step's updates are written over them there, and per step only the batch, the learning rate
//! and the dropout seeds go in and the loss comes out. Parameters and moments are read back only
//! to save them or to validate.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use anyhow::Context;
use qatc_driver::{Options, Target};
use qatc_ir::{Graph, InputKind};
use qatc_passes::lora::DROPOUT_SEED;
use qatc_passes::microbatch;
use qatc_passes::precision::LOSS_SCALE;
use qatc_passes::zero::{Parallel, Shard, RANK};
use qatc_runtime::comm::Communicator;
use qatc_runtime::{IntTensor, Tensor, TrainStep, Value};

use crate::adapter::Adapter;
use crate::batches::{loss_weights, Batch, Batches};
use crate::model::{Model, Trained};
use crate::step;

mod state;
pub use state::{read_state, ShardOf};

/// Where the steps' time went (`Trainer::set_profile`, `qatc generate --profile`), summed over
/// the profiled steps.
#[derive(Default)]
pub struct Profile {
    steps: usize,
    /// (phase, what) -> (times run, seconds, bytes moved, FLOPs); the phase an index into
    /// `PHASES`, of the step the part belongs to (`qatc_runtime::exec::step_phase`)
    by: BTreeMap<(usize, String), (usize, f64, u64, u64)>,
}

/// The phases a profile tells apart, in the order it shows them: the last is what belongs to no
/// step of the program (the updates' write-back, copies in and out).
const PHASES: [&str; 5] = ["forward", "recompute", "backward", "optimizer", "other"];

impl Profile {
    /// Adds the timed parts of one run of the executor, which `ends_step` when it is a step's
    /// last (a step of K micro-batches runs it K times).
    pub fn add(&mut self, times: Vec<qatc_runtime::exec::TimedPart>, ends_step: bool) {
        self.steps += usize::from(ends_step);
        for t in times {
            let name = t.phase.map_or("other", |p| p.name());
            let phase = PHASES.iter().position(|&p| p == name).unwrap_or(PHASES.len() - 1);
            let e = self.by.entry((phase, t.what)).or_default();
            e.0 += 1;
            e.1 += t.secs;
            e.2 += t.cost.bytes;
            e.3 += t.cost.flops;
        }
    }

    /// A row per kind of step and phase, per step, largest time first; None when no step was
    /// added.
    pub fn rows(&self) -> Option<Vec<ProfileRow>> {
        if self.steps == 0 {
            return None;
        }
        let n = self.steps as f64;
        let mut v: Vec<ProfileRow> = self
            .by
            .iter()
            .map(|((p, k), &(c, s, b, f))| ProfileRow {
                what: k.clone(),
                phase: PHASES[*p],
                count: c as f64 / n,
                secs: s / n,
                bytes: b as f64 / n,
                flops: f as f64 / n,
            })
            .collect();
        v.sort_by(|a, b| b.secs.total_cmp(&a.secs));
        Some(v)
    }

    /// The profile as `qatc train/eval/generate --profile` print it (`profile_table`, the first
    /// `top` rows), one `unit` at a time; None when no step was added.
    pub fn table(&self, unit: &str, top: usize) -> Option<String> {
        Some(crate::cli::profile::profile_table(&self.rows()?, unit, top))
    }
}

/// Seconds per phase of `rows` (forward, recompute, backward, optimizer, other), those with any
/// time. A fused kernel that computes the loss and its gradient at once (the LM head's) counts
/// as backward.
pub fn phase_sums(rows: &[ProfileRow]) -> Vec<(&'static str, f64)> {
    PHASES.iter().map(|&p| (p, rows.iter().filter(|r| r.phase == p).map(|r| r.secs).sum::<f64>())).filter(|(_, s)| *s > 0.0).collect()
}

/// One kind of step in a profile (`Trainer::profile`): per step, how many ran, their seconds,
/// and what they moved and computed (0 where the executor does not count it: the CPU's).
#[derive(Clone, Debug, PartialEq)]
pub struct ProfileRow {
    pub what: String,
    /// The phase of the step it belongs to (`forward`, `backward`, ...; `other` for what is no
    /// step of the program).
    pub phase: &'static str,
    pub count: f64,
    pub secs: f64,
    pub bytes: f64,
    pub flops: f64,
}

/// How long building a step (or a forward) took, from the options to an executor ready to run,
/// by part, and where its kernels came from (`kernels`: the kernel cache or the compiler; None on
/// the interpreter). `qatc train` and `eval` print it in one line and write it in their JSON as
/// `build`.
#[derive(serde::Serialize, Debug, Clone, Default)]
pub struct Built {
    /// The whole build, in seconds: the three parts below.
    pub seconds: f64,
    /// The graph's passes, from the checkpoint's model to the fused step (0 where the caller
    /// built the graph).
    pub passes_s: f64,
    /// The driver's part: the lowering, the kernels, the executor.
    pub compile_s: f64,
    /// Giving the executor its weights (quantized where the step keeps them quantized) and state.
    pub bind_s: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernels: Option<qatc_driver::KernelsBuilt>,
}

impl Built {
    /// A build of `compile_s` and `bind_s` seconds, on a graph built in `passes_s`.
    pub fn new(passes_s: f64, compile_s: f64, bind_s: f64, kernels: Option<qatc_driver::KernelsBuilt>) -> Built {
        Built { seconds: passes_s + compile_s + bind_s, passes_s, compile_s, bind_s, kernels }
    }
}

impl std::fmt::Display for Built {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.2} s (graph passes {:.2} s, lowering and kernels {:.2} s, weights bound {:.2} s)",
            self.seconds, self.passes_s, self.compile_s, self.bind_s
        )?;
        match &self.kernels {
            Some(k) => write!(f, "; {k}"),
            None => Ok(()),
        }
    }
}

/// The training loop: the step graph and its executor, which holds every input that persists
/// across steps.
pub struct Trainer {
    pub graph: Graph,
    step: Box<dyn TrainStep>,
    description: String,
    built: Built,
    pub opts: step::StepOptions,
    seed: u64,
    /// The graph's input names: per-step inputs it does not have (a dropout seed without
    /// dropout) are not given.
    inputs: HashSet<String>,
    runs: usize,
    profile: Option<Profile>,
    /// This process's rank and the world of a step over several ranks (`mpirun`); None: one.
    world: Option<Arc<dyn Communicator>>,
    /// The whole shape of each input that ZeRO shards to this rank's block (moments at stage 1
    /// and up, the trainable weights at 3): what is saved and restored.
    whole: HashMap<String, Vec<usize>>,
    /// The sharded inputs gathered whole (`gather`), until the next step changes them.
    gathered: HashMap<String, Value<f32>>,
}

impl Trainer {
    /// Compiles the step for the reference interpreter and binds the weights (LoRA from
    /// `adapter`, else initialised from `seed`); Adam moments and the step count start at zero,
    /// fp16's loss scale at its initial value.
    pub fn new(m: &Model, opts: step::StepOptions, adapter: Option<&Adapter>, seed: u64) -> anyhow::Result<Trainer> {
        let interpreter = Options { interpreter: true, ..Options::default() };
        Self::with_target(m, opts, adapter, seed, &Target::cpu(), &interpreter)
    }

    /// As `new`, with the step compiled for `target` as `options` say (the interpreter, the CPU
    /// executor's settings, the kernel cache).
    pub fn with_target(
        m: &Model,
        opts: step::StepOptions,
        adapter: Option<&Adapter>,
        seed: u64,
        target: &Target,
        options: &Options,
    ) -> anyhow::Result<Trainer> {
        let trained = match adapter {
            Some(a) => Trained::Adapter(a),
            None => Trained::Fresh { seed, scale_init: opts.scale_init },
        };
        Self::with_target_from(m, opts, &trained, seed, target, options)
    }

    /// As `with_target`, the trained tensors (LoRA, learned scales) bound from `trained` (the
    /// calibrated start, `Trained::Started`).
    pub fn with_target_from(
        m: &Model,
        opts: step::StepOptions,
        trained: &Trained,
        seed: u64,
        target: &Target,
        options: &Options,
    ) -> anyhow::Result<Trainer> {
        let start = std::time::Instant::now();
        let (graph, _) = step::train(&m.cfg, &opts, |_, _| {})?;
        let passes_s = start.elapsed().as_secs_f64();
        let mut tr = Self::with_graph_from(m, graph, opts, trained, seed, target, options)?;
        tr.built = Built::new(passes_s, tr.built.compile_s, tr.built.bind_s, tr.built.kernels.take());
        Ok(tr)
    }

    /// As `with_target`, on a step graph built by the caller from `opts` (tests graft nodes into
    /// it, e.g. an injected overflow).
    pub fn with_graph(
        m: &Model,
        graph: Graph,
        opts: step::StepOptions,
        adapter: Option<&Adapter>,
        seed: u64,
        target: &Target,
        options: &Options,
    ) -> anyhow::Result<Trainer> {
        let trained = match adapter {
            Some(a) => Trained::Adapter(a),
            None => Trained::Fresh { seed, scale_init: opts.scale_init },
        };
        Self::with_graph_from(m, graph, opts, &trained, seed, target, options)
    }

    fn with_graph_from(
        m: &Model,
        graph: Graph,
        opts: step::StepOptions,
        trained: &Trained,
        seed: u64,
        target: &Target,
        options: &Options,
    ) -> anyhow::Result<Trainer> {
        if let (Some(world), Some((name, block))) = (opts.parallel.sharded(), qatc_passes::optim::split_8bit_blocks(&graph)) {
            anyhow::bail!(
                "--optim adamw8bit with --zero {} over {world} ranks: each rank holds {block} elements of {name}'s moments, not a whole number of the {}-element blocks whole moments are quantized in, so the ranks would quantize them in other blocks and not train as with --zero 0 (or on one rank); use a number of ranks that splits every such tensor into whole blocks, --zero 0, or --optim adamw",
                opts.parallel.zero,
                qatc_ir::qmap::BLOCK
            );
        }
        let start = std::time::Instant::now();
        let qatc_driver::Executable { mut step, description, kernels, .. } = qatc_driver::compile(&graph, target, options)?;
        let compile_s = start.elapsed().as_secs_f64();
        opts.deadline.check("lowering and compiling the kernels")?;
        let world = options.comm.clone().filter(|c| c.size() > 1);
        let (rank, size) = world.as_ref().map_or((0, 1), |c| (c.rank(), c.size()));
        if opts.parallel.ranks != size {
            anyhow::bail!("internal: a step over {} ranks in a world of {size}", opts.parallel.ranks);
        }
        // the step as one rank of the same rows would be: the whole shapes of what ZeRO shards
        let whole = match opts.parallel.sharded() {
            Some(_) => {
                let one = step::StepOptions { parallel: Parallel::default(), ..opts.clone() };
                Some(step::train(&m.cfg, &one, |_, _| {})?.0)
            }
            None => None,
        };
        let whole_shapes = whole.as_ref().map_or_else(HashMap::new, |w| sharded_shapes(&graph, w));
        // the weights go to the executor once; no host copy is kept
        for (name, v) in m.bind_trained::<f32>(whole.as_ref().unwrap_or(&graph), trained)? {
            let v = if whole_shapes.contains_key(&name) { block_of(&v, size, rank) } else { v };
            step.set_input(&name, &v).with_context(|| format!("binding {name}"))?;
        }
        if graph.find_input(RANK).is_some() {
            step.set_input(RANK, &Value::Int(IntTensor { shape: vec![1], data: vec![rank as i32] }))?;
        }
        let mut inputs = HashSet::new();
        for id in graph.inputs() {
            let name = graph.node(id).name.clone().unwrap_or_default();
            if graph.input_kind(id) == Some(InputKind::State) {
                let ty = graph.ty(id);
                let shape = ty.shape.dims().to_vec();
                // moments start at 0 (f32 zeros, or 8-bit codes 0 with absmax 0); the loss scale at its initial state
                let init = if !ty.dtype.is_float() {
                    Value::Int(IntTensor { shape, data: vec![0; ty.numel()] })
                } else if name == LOSS_SCALE {
                    Value::Float(Tensor { shape, data: opts.loss_scaling.initial_state().to_vec() })
                } else {
                    Value::Float(Tensor { shape, data: vec![0.0; ty.numel()] })
                };
                step.set_input(&name, &init).with_context(|| format!("binding {name}"))?;
            }
            inputs.insert(name);
        }
        let built = Built::new(0.0, compile_s, start.elapsed().as_secs_f64() - compile_s, kernels);
        Ok(Trainer {
            graph,
            step,
            description,
            built,
            opts,
            seed,
            inputs,
            runs: 0,
            profile: None,
            world,
            whole: whole_shapes,
            gathered: HashMap::new(),
        })
    }

    /// Gives the step an input's value (a weight, a moment, data): it stays until set again.
    pub fn set_input(&mut self, name: &str, v: Value<f32>) -> anyhow::Result<()> {
        self.step.set_input(name, &v).with_context(|| format!("input {name}"))
    }

    /// Gives the step a per-step input, if the graph has it.
    fn give(&mut self, name: &str, v: Value<f32>) -> anyhow::Result<()> {
        if self.inputs.contains(name) {
            self.step.set_input(name, &v).with_context(|| format!("input {name}"))?;
        }
        Ok(())
    }

    /// Runs one optimizer step on micro-batches `first .. first + K` (llm.c's sequential order,
    /// wrapping at the end of the data) and returns the loss before the update (and every other
    /// non-update output).
    pub fn step(&mut self, data: &impl Batches, first: usize, lr: f64) -> anyhow::Result<HashMap<String, Value<f32>>> {
        let nb = data.num_batches(self.global_batch(), self.opts.seq).max(1);
        let batches: Vec<usize> = (0..self.opts.grad_accum).map(|i| (first + i) % nb).collect();
        self.step_on(data, &batches, lr, first as u64)
    }

    /// One optimizer step on the given micro-batches (K of them). `salt` varies the dropout mask
    /// from step to step; it is derived from the run's position, so a resumed run reproduces it.
    ///
    /// Instruction data's loss weights are the batches' masks scaled so that they sum to K over
    /// the step: each micro-batch's loss is its weighted sum, the step's (their mean, the
    /// `microbatch` pass) is then the mean over every target the step counts, however they fall
    /// into its micro-batches. Over N ranks they are the global batches' masks scaled to sum to
    /// K N, of which each rank takes its rows: the ranks' mean loss (and gradient), which the
    /// step's collectives take, is then the mean over every target the global step counts,
    /// however they fall into the ranks' rows, as one rank of the global batch has it.
    pub fn step_on(&mut self, data: &impl Batches, batches: &[usize], lr: f64, salt: u64) -> anyhow::Result<HashMap<String, Value<f32>>> {
        let (b, t, k) = (self.opts.batch, self.opts.seq, self.opts.grad_accum);
        if batches.len() != k {
            anyhow::bail!("internal: {} micro-batches for --grad-accum {k}", batches.len());
        }
        let (rank, ranks) = self.world.as_ref().map_or((0, 1), |c| (c.rank(), c.size()));
        let global: Vec<Batch> = batches.iter().map(|&s| data.batch(s, b * ranks, t)).collect::<Result<_, _>>()?;
        self.gathered.clear();
        let masks: Vec<&[f32]> = global.iter().filter_map(|m| m.mask.as_deref()).collect();
        let mut weights = loss_weights(&masks, (k * ranks) as f64).into_iter().map(|w| w[rank * b * t..(rank + 1) * b * t].to_vec());
        // this rank's rows r B .. (r + 1) B of each global batch
        let micro: Vec<Batch> = global.iter().map(|g| g.rows(rank * b, b, t)).collect();
        self.give("lr", Value::scalar(lr))?;
        // a fresh dropout mask every step, reproducible from the seed and the step's first batch
        let dseed = (self.seed as i64).wrapping_mul(1_000_003).wrapping_add(salt as i64) as i32;
        // the step is one micro-batch's, run K times: the last run applies the optimizer's update
        for (i, batch) in micro.into_iter().enumerate() {
            self.give("ids", Value::Int(IntTensor { shape: vec![b, t], data: batch.ids }))?;
            self.give("targets", Value::Int(IntTensor { shape: vec![b, t], data: batch.targets }))?;
            if batch.mask.is_some() {
                let weights = weights.next().unwrap_or_default();
                self.require("weights", data)?;
                self.give("weights", Value::Float(Tensor { shape: vec![b, t], data: weights }))?;
            }
            if let Some(positions) = batch.positions {
                self.require("positions", data)?;
                self.give("positions", Value::Int(IntTensor { shape: vec![b, t], data: positions }))?;
            }
            // a mask of its own for each micro-batch
            self.give(DROPOUT_SEED, Value::Int(IntTensor { shape: vec![], data: vec![dseed.wrapping_add(i as i32)] }))?;
            self.give(microbatch::APPLY, Value::scalar(if i + 1 == k { 1.0 } else { 0.0 }))?;
            // the first run also computes what is hoisted out of later ones: not profiled
            match self.profile.as_mut() {
                Some(p) if self.runs > 0 => {
                    if let Some(times) = self.step.run_timed()? {
                        p.add(times, i + 1 == k);
                    }
                }
                _ => self.step.run()?,
            }
        }
        self.runs += 1;
        Ok(self.step.outputs()?)
    }

    /// Rows per global batch: `--batch` on each of the ranks.
    pub fn global_batch(&self) -> usize {
        self.opts.batch * self.opts.parallel.ranks
    }

    /// Gathers the trainable weights ZeRO 3 shards whole from the ranks' blocks (a collective:
    /// every rank calls it, at the same point), so that reading them back (`weights`) gives what
    /// one rank would hold, until the next step: what rank 0 saves as the adapter (or model) and
    /// what validation evaluates. The optimizer's sharded state is never gathered: each rank
    /// saves its own blocks (`save_shard`). Nothing to do on one rank or below ZeRO 3.
    pub fn gather(&mut self) -> anyhow::Result<()> {
        let Some(world) = self.world.clone() else { return Ok(()) };
        let mut names: Vec<&String> = self
            .whole
            .keys()
            .filter(|n| self.graph.find_input(n).and_then(|id| self.graph.input_kind(id)) == Some(InputKind::Trainable))
            .collect();
        names.sort();
        if names.iter().all(|n| self.gathered.contains_key(*n)) {
            return Ok(());
        }
        let mut gathered = HashMap::new();
        for name in names {
            let Value::Float(mine) = self.step.read_input(name).with_context(|| format!("reading {name} back"))? else {
                anyhow::bail!("internal: the trainable {name} holds integers");
            };
            let send: Vec<u8> = mine.data.iter().flat_map(|x| x.to_le_bytes()).collect();
            let mut recv = vec![0u8; send.len() * world.size()];
            world.all_gather_bytes(&send, &mut recv).with_context(|| format!("gathering {name}"))?;
            let shape = self.whole[name].clone();
            let numel: usize = shape.iter().product();
            let data: Vec<f32> = recv.chunks_exact(4).take(numel).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            gathered.insert(name.clone(), Value::Float(Tensor { shape, data }));
        }
        self.gathered = gathered;
        Ok(())
    }

    /// A data input the batches give must be one the step was built with.
    fn require(&self, name: &str, data: &impl Batches) -> anyhow::Result<()> {
        if !self.inputs.contains(name) {
            anyhow::bail!("internal: {} gives `{name}`, which the step was not built to take", data.source().display());
        }
        Ok(())
    }

    /// Times every part of the steps from now on (but the first step run), for `profile`.
    pub fn set_profile(&mut self, on: bool) {
        self.profile = on.then(Profile::default);
    }

    /// Where the steps' time went, from the steps profiled (`set_profile`; `Profile::rows` and
    /// `phases` are None when nothing was: the interpreter does not time its parts, and the
    /// first step is not profiled).
    pub fn profile(&self) -> Option<&Profile> {
        self.profile.as_ref()
    }

    /// The loss scale the next step uses (fp16 with loss scaling), read back; else None.
    pub fn loss_scale(&self) -> anyhow::Result<Option<f64>> {
        if !self.inputs.contains(LOSS_SCALE) {
            return Ok(None);
        }
        match self.step.read_input(LOSS_SCALE).context("reading the loss scale back")? {
            Value::Float(t) => Ok(t.data.first().map(|&s| f64::from(s))),
            Value::Int(_) => anyhow::bail!("internal: {LOSS_SCALE} holds integers"),
        }
    }

    /// What runs the step, in words.
    pub fn describe(&self) -> &str {
        &self.description
    }

    /// How long building the step took (from the options, with `with_target`; from the graph,
    /// with `with_graph`) and where its kernels came from.
    pub fn built(&self) -> &Built {
        &self.built
    }

    /// The inputs of these kinds, read back from the executor, in the graph's input order.
    fn read(&self, kinds: &[InputKind]) -> anyhow::Result<Vec<(String, Value<f32>)>> {
        let mut v = Vec::new();
        for id in self.graph.inputs() {
            if self.graph.input_kind(id).is_some_and(|k| kinds.contains(&k)) {
                let name = self.graph.node(id).name.clone().unwrap_or_default();
                let val = match (self.gathered.get(&name), self.whole.contains_key(&name)) {
                    (Some(g), _) => g.clone(),
                    (None, true) => anyhow::bail!("internal: {name} is this rank's block: gather the ranks' first"),
                    (None, false) => self.step.read_input(&name).with_context(|| format!("reading {name} back"))?,
                };
                v.push((name, val));
            }
        }
        Ok(v)
    }

    /// The values as f32 tensors: 8-bit moment codes (0..=255) are exact in f32.
    fn tensors(v: Vec<(String, Value<f32>)>) -> anyhow::Result<Vec<(String, Tensor<f32>)>> {
        v.into_iter()
            .map(|(n, v)| match v {
                Value::Float(t) => Ok((n, t)),
                Value::Int(t) => Ok((n, Tensor { shape: t.shape, data: t.data.into_iter().map(|c| c as f32).collect() })),
            })
            .collect()
    }

    /// The persistent state, read back: trainable weights, Adam moments and the step count (not
    /// the gradient accumulation's sums, which are 0 between optimizer steps).
    pub fn persistent(&self) -> anyhow::Result<Vec<(String, Tensor<f32>)>> {
        let all = self.read(&[InputKind::Trainable, InputKind::State])?;
        Self::tensors(all.into_iter().filter(|(n, _)| !microbatch::is_sum(n)).collect())
    }

    /// The trainable weights, read back.
    pub fn weights(&self) -> anyhow::Result<Vec<(String, Tensor<f32>)>> {
        Self::tensors(self.read(&[InputKind::Trainable])?)
    }

    /// Every input that persists across steps, read back (frozen weights as the step holds them:
    /// 4-bit codes as integers), by name.
    pub fn state(&self) -> anyhow::Result<HashMap<String, Value<f32>>> {
        Ok(self.read(&[InputKind::Frozen, InputKind::Trainable, InputKind::State])?.into_iter().collect())
    }
}

/// Serializes weights as a Hugging Face safetensors file (F32, names without prefix).
pub fn weights_safetensors(ws: &[(String, Tensor<f32>)]) -> anyhow::Result<Vec<u8>> {
    f32_safetensors(ws, HashMap::new())
}

/// `ws` as a safetensors file of F32 tensors, its metadata `meta` and `"format": "pt"`.
fn f32_safetensors(ws: &[(String, Tensor<f32>)], mut meta: HashMap<String, String>) -> anyhow::Result<Vec<u8>> {
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> =
        ws.iter().map(|(n, t)| (n.clone(), t.data.iter().flat_map(|v| v.to_le_bytes()).collect(), t.shape.clone())).collect();
    let views = bytes
        .iter()
        .map(|(n, b, s)| Ok((n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    meta.insert("format".to_string(), "pt".to_string());
    Ok(safetensors::serialize(views, Some(meta))?)
}

/// The inputs of `rank_graph` (one rank's step under ZeRO) whose shape differs from `whole`'s
/// (the same step on one rank): name -> the whole shape.
fn sharded_shapes(rank_graph: &Graph, whole: &Graph) -> HashMap<String, Vec<usize>> {
    let mut out = HashMap::new();
    for id in rank_graph.inputs() {
        let Some(name) = rank_graph.node(id).name.clone() else { continue };
        if let Some(w) = whole.find_input(&name) {
            if whole.ty(w).shape != rank_graph.ty(id).shape {
                out.insert(name, whole.ty(w).shape.dims().to_vec());
            }
        }
    }
    out
}

/// Rank `rank`'s block of `whole` over `world` ranks (`qatc_passes::zero::Shard`: flattened, the
/// last block padded with zeros).
fn block_of(whole: &Value<f32>, world: usize, rank: usize) -> Value<f32> {
    match whole {
        Value::Float(t) => {
            let s = Shard::new(t.data.len(), world);
            let mut b: Vec<f32> = t.data.iter().skip(rank * s.block).take(s.block).copied().collect();
            b.resize(s.block, 0.0);
            Value::Float(Tensor { shape: vec![s.block], data: b })
        }
        Value::Int(t) => {
            let s = Shard::new(t.data.len(), world);
            let mut b: Vec<i32> = t.data.iter().skip(rank * s.block).take(s.block).copied().collect();
            b.resize(s.block, 0);
            Value::Int(IntTensor { shape: vec![s.block], data: b })
        }
    }
}
