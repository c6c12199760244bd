//! Every engine of qatc against float64 truth (issue 34): the embedded Shakespeare GPT-2 at B 4,
//! T 128, evaluated and differentiated by PyTorch in float64 on qatc's semantics
//! (`tests/fixtures/gen_fidelity_fixtures.py`, `fidelity/truth.safetensors`).
//!
//! The reference interpreter (f32) and the compiled CPU step (unfused, and fused as `qatc train`
//! runs it) are held to the truth on the first four validation batches' losses and logits, and
//! on one training step's loss and gradients, with and without 4-bit fake-quant, for LoRA and for
//! a full fine-tune. The f64 interpreter computes what the generator computes, so it must agree
//! to within f64 rounding: that checks the fixture's semantics (the fake-quant grid, LoRA's
//! scaling, the token windows), so that what the f32 engines are off by is their rounding alone.
//!
//! The bounds ([`Bounds`]) come from measurement (2026-11-27, AMD EPYC, AVX2; bench/RESULTS.md,
//! "Distance from float64"), relative: the loss |error| / truth; logits and each gradient tensor
//! max |error| / max |truth| over the sampled elements, and each gradient's L2 norm |error| /
//! truth. Issue 34 asks 1e-6 of the loss; both f32 engines are held to 2e-7 (measured at most
//! 5.5e-8, from f32 storage alone), which the f32 sums they had before fail: the interpreter's
//! gave 1.8e-5 to 2.9e-5; the LLVM kernels' f32 lanes up to 1.24e-6 (8.5e-7 or more in 10 of the
//! 12 cases); PyTorch f32 gives 1.5e-6 to 2.6e-6.
//!
//! `cargo test --release --test fidelity -- --nocapture` prints each engine's distances (the
//! figures of bench/RESULTS.md's "Distance from float64").

mod common;

use std::collections::HashMap;

use qatc::adapter::{self, Adapter};
use qatc::config::ScaleInit;
use qatc::data::TokenFile;
use qatc::model::{Model, Trained};
use qatc::step::{self, ModelOptions, StepOptions};
use qatc::trainer::Trainer;
use qatc_driver::{Options, Target};
use qatc_ir::{Graph, QuantScheme, QuantSpec};
use qatc_passes::fusion::FuseOptions;
use qatc_passes::precision::Precision;
use qatc_passes::quant::QuantOptions;
use qatc_runtime::{Float, Interpreter, Value};

const MODEL: &str = "examples/gpt2-shakespeare-small/model.safetensors";
const VAL: &str = "examples/shakespeare_val.bin";
const TRAIN: &str = "examples/shakespeare_train.bin";
const B: usize = 4;
const T: usize = 128;
/// Validation batches 0..4 (the forward truth); train batch 0 (the step's).
const BATCHES: usize = 4;

/// What an engine is held to, each relative as the module says.
struct Bounds {
    loss: f64,
    logits: f64,
    /// each gradient's sampled elements, and its norm
    grads: f64,
}

/// The f32 interpreter: f32 values, f64 sums. Measured: loss 5.1e-8, logits 1.2e-7, gradients
/// 8.0e-7 (norms 1.4e-7); with its former f32 sums 2.9e-5, 5.8e-7 and 2.8e-3.
const INTERPRETER: Bounds = Bounds { loss: 2e-7, logits: 5e-7, grads: 4e-6 };
/// The compiled CPU step: f32 GEMMs (dot products of 128 to 50,257 terms, as PyTorch's are),
/// f32 partial sums of 64 terms added in f64 in its kernels. Measured: loss 5.5e-8, logits
/// 5.7e-7, gradients 7.9e-6 (norms 1.9e-6); with f32 lanes in the kernels 1.24e-6, 5.4e-7 and
/// 1.3e-4; PyTorch f32 2.6e-6, 7.7e-7 and 2.9e-4 (norms 9.7e-5).
const COMPILED: Bounds = Bounds { loss: 2e-7, logits: 4e-6, grads: 4e-5 };
/// The f64 interpreter against PyTorch's float64, the same computation rounded differently.
/// Measured: loss 2.7e-15, logits 1.3e-15, gradients 8.3e-14, norms 6.8e-12 (wte's).
const F64: Bounds = Bounds { loss: 1e-12, logits: 1e-12, grads: 1e-10 };

/// The fixture, by key, as f64 (or i32 for indices).
struct Truth(HashMap<String, common::T>);

impl Truth {
    fn load() -> Truth {
        Truth(common::read_safetensors("fidelity/truth.safetensors"))
    }
    fn get(&self, key: &str) -> &common::T {
        self.0.get(key).unwrap_or_else(|| panic!("truth.safetensors has no {key}"))
    }
    fn floats(&self, key: &str) -> &[f64] {
        &self.get(key).data
    }
    fn ints(&self, key: &str) -> &[i32] {
        &self.get(key).ints
    }
}

fn model() -> Model {
    Model::open(&common::root().join(MODEL)).expect("the embedded model")
}

fn tokens(path: &str) -> TokenFile {
    TokenFile::open(&common::root().join(path)).expect("the token file")
}

fn lora_adapter() -> Adapter {
    adapter::read(&common::fixture("fidelity/adapter")).expect("the fixture's adapter")
}

fn q4() -> QuantOptions {
    QuantOptions::all_linears(QuantSpec { bits: 4, group: 32, scheme: QuantScheme::Sym })
}

fn floats<T: Float>(v: &Value<T>) -> Vec<f64> {
    v.as_float().expect("a float output").to_f64_vec()
}

fn rel(got: f64, want: f64) -> f64 {
    (got - want).abs() / want.abs()
}

/// One engine's forward: per validation batch its loss, and batch 0's logits at the sampled
/// places (flat indices into [B, T, V]).
struct Forward {
    losses: Vec<f64>,
    logits: Vec<f64>,
}

/// The sampled logits' flat indices.
fn logit_places(truth: &Truth, vocab: usize) -> Vec<usize> {
    let (pos, cols) = (truth.ints("logits/positions"), truth.ints("logits/columns"));
    let mut at = Vec::new();
    for p in pos.chunks_exact(2) {
        let row = p[0] as usize * T + p[1] as usize;
        at.extend(cols.iter().map(|&c| row * vocab + c as usize));
    }
    at
}

fn batch_inputs<T: Float>(data: &TokenFile, s: usize) -> [(String, Value<T>); 2] {
    let (ids, tgt) = data.batch(s, B, T).expect("a batch");
    [("ids".into(), Value::ints([B, T], ids).expect("ids")), ("targets".into(), Value::ints([B, T], tgt).expect("targets"))]
}

/// The evaluation graph's forward on the interpreter over `T`.
fn forward_interpreted<T: Float>(g: &Graph, m: &Model, places: &[usize]) -> Forward {
    let interp = Interpreter::<T>::new(g).expect("an interpreter");
    let mut inputs = m.bind_trained::<T>(g, &Trained::Fresh { seed: 0, scale_init: ScaleInit::Minmax }).expect("binds");
    let data = tokens(VAL);
    let mut f = Forward { losses: Vec::new(), logits: Vec::new() };
    for s in 0..BATCHES {
        inputs.extend(batch_inputs(&data, s));
        let out = interp.run(&inputs).expect("runs");
        f.losses.push(out["loss"].item().expect("a scalar loss"));
        if s == 0 {
            let l = floats(&out["logits"]);
            f.logits = places.iter().map(|&i| l[i]).collect();
        }
    }
    f
}

/// The evaluation graph's forward, compiled for the CPU as `qatc train` compiles a step.
#[cfg(feature = "llvm")]
fn forward_compiled(g: &Graph, m: &Model, places: &[usize]) -> Forward {
    let mut step = qatc_driver::compile(g, &Target::cpu(), &Options::default()).expect("compiles").step;
    for (name, v) in m.bind_trained::<f32>(g, &Trained::Fresh { seed: 0, scale_init: ScaleInit::Minmax }).expect("binds") {
        step.set_input(&name, &v).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    let data = tokens(VAL);
    let mut f = Forward { losses: Vec::new(), logits: Vec::new() };
    for s in 0..BATCHES {
        for (name, v) in batch_inputs::<f32>(&data, s) {
            step.set_input(&name, &v).expect("a batch");
        }
        step.run().expect("runs");
        f.losses.push(step.output("loss").expect("a loss").item().expect("a scalar loss"));
        // a graph of the loss alone (what `qatc eval` compiles) has no logits to compare
        if s == 0 && g.output("logits").is_some() {
            let l = floats(&step.output("logits").expect("logits"));
            f.logits = places.iter().map(|&i| l[i]).collect();
        }
    }
    f
}

/// Distances of one forward from the truth: (the 4-batch mean's |error|, its relative error,
/// the worst batch's relative error, the logits' error).
fn forward_errors(f: &Forward, losses: &[f64], logits: &[f64]) -> (f64, f64, f64, f64) {
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let d = (mean(&f.losses) - mean(losses)).abs();
    let worst = f.losses.iter().zip(losses).map(|(&g, &w)| rel(g, w)).fold(0.0, f64::max);
    let logit = if f.logits.is_empty() { 0.0 } else { common::rel_err(&f.logits, logits) };
    (d, d / mean(losses), worst, logit)
}

fn check_forward(quant: &str) {
    let truth = Truth::load();
    let m = model();
    let mo = ModelOptions { quant: (quant == "q4").then(q4), ..Default::default() };
    let (g, _) = step::evaluation(&m.cfg, B, T, true, &mo, Precision::Fp32, None, |_, _| {}).expect("the evaluation graph");
    let places = logit_places(&truth, m.cfg.vocab_size);
    let (losses, logits) = (truth.floats(&format!("forward/{quant}/loss")), truth.floats(&format!("forward/{quant}/logits")));

    // PyTorch's float32 losses are the fixture's, shown for comparison (it judges nothing)
    let torch32 = Forward { losses: truth.floats(&format!("forward/{quant}/f32_loss")).to_vec(), logits: Vec::new() };
    let unjudged = Bounds { loss: f64::INFINITY, logits: f64::INFINITY, grads: f64::INFINITY };
    let mut engines = vec![("PyTorch f32", torch32, &unjudged)];
    engines.push(("interpreter f64", forward_interpreted::<f64>(&g, &m, &places), &F64));
    engines.push(("interpreter f32", forward_interpreted::<f32>(&g, &m, &places), &INTERPRETER));
    #[cfg(feature = "llvm")]
    {
        engines.push(("compiled CPU, unfused", forward_compiled(&g, &m, &places), &COMPILED));
        // the graph `qatc eval` compiles: the evaluation with the fusion stage
        let fuse = Some(FuseOptions::default());
        let (fused, _) =
            step::evaluation(&m.cfg, B, T, true, &mo, Precision::Fp32, fuse.clone(), |_, _| {}).expect("the fused evaluation graph");
        engines.push(("compiled CPU, fused", forward_compiled(&fused, &m, &places), &COMPILED));
        // without the logits as an output, the head's cross-entropy walks the vocabulary in
        // tiles with an online softmax (`xent_online.rs`'s forward), never a chunk's whole rows
        let (loss_only, _) = step::evaluation(&m.cfg, B, T, false, &mo, Precision::Fp32, fuse, |_, _| {}).expect("the loss alone");
        engines.push(("compiled CPU, loss only", forward_compiled(&loss_only, &m, &places), &COMPILED));
    }
    let mean = losses.iter().sum::<f64>() / losses.len() as f64;
    eprintln!("forward, {quant}: float64 mean loss of validation batches 0..{BATCHES} {mean:.10}");
    // every engine's distances are shown before any is judged
    let errors: Vec<_> = engines.iter().map(|(_, f, _)| forward_errors(f, losses, logits)).collect();
    for ((what, ..), (d, r, worst, logit)) in engines.iter().zip(&errors) {
        eprintln!("  {what:22}: mean loss {d:.2e} off ({r:.2e} relative), worst batch {worst:.2e}, logits {logit:.2e}");
    }
    for ((what, _, bound), (_, _, worst, logit)) in engines.iter().zip(&errors) {
        assert!(*worst <= bound.loss, "{quant}, {what}: a validation loss {worst:e} from float64's (limit {:e})", bound.loss);
        assert!(*logit <= bound.logits, "{quant}, {what}: the logits {logit:e} from float64's (limit {:e})", bound.logits);
    }
}

#[test]
fn forward_within_bounds_of_float64() {
    check_forward("plain");
}

#[test]
fn forward_4bit_within_bounds_of_float64() {
    check_forward("q4");
}

/// The step of configuration `cfg` (`lora_plain`, `lora_q4`, `full_plain`, `full_q4`): LoRA from
/// the fixture's adapter, or every weight trainable; the gradients kept as outputs.
fn step_options(cfg: &str, fuse: bool) -> StepOptions {
    let mut o = StepOptions::new(B, T);
    o.keep_grads = true;
    o.fuse = fuse.then(FuseOptions::default);
    if cfg.ends_with("q4") {
        o.model.quant = Some(q4());
    }
    if cfg.starts_with("lora") {
        o.model.full_finetune = false;
        o.model.lora = Some(lora_adapter().options());
    }
    o
}

/// One engine's loss and gradients (`grad:NAME` by NAME) of train batch 0.
struct Grads {
    loss: f64,
    grads: HashMap<String, Vec<f64>>,
}

fn grads_of<T: Float>(out: &HashMap<String, Value<T>>) -> Grads {
    let grads = out.iter().filter_map(|(n, v)| n.strip_prefix("grad:").map(|n| (n.to_string(), floats(v)))).collect();
    Grads { loss: out["loss"].item().expect("a scalar loss"), grads }
}

/// The step's loss and gradients on the f64 interpreter (only what they need: no AdamW).
fn step_f64(cfg: &str, m: &Model) -> Grads {
    let o = step_options(cfg, false);
    let (g, _) = step::train(&m.cfg, &o, |_, _| {}).expect("the step graph");
    let ad = lora_adapter();
    let trained = if cfg.starts_with("lora") { Trained::Adapter(&ad) } else { Trained::Fresh { seed: 0, scale_init: ScaleInit::Minmax } };
    let mut inputs = m.bind_trained::<f64>(&g, &trained).expect("binds");
    inputs.extend(batch_inputs(&tokens(TRAIN), 0));
    let wanted: Vec<(String, qatc_ir::NodeId)> =
        g.outputs().iter().filter(|o| o.name == "loss" || o.name.starts_with("grad:")).map(|o| (o.name.clone(), o.node)).collect();
    let interp = Interpreter::<f64>::new(&g).expect("an interpreter");
    let vals = interp.run_nodes(&inputs, &wanted.iter().map(|w| w.1).collect::<Vec<_>>()).expect("runs");
    grads_of(&wanted.into_iter().map(|w| w.0).zip(vals).collect::<HashMap<_, _>>())
}

/// The step's loss and gradients as `qatc train` computes them on the CPU: on the interpreter
/// (`--interpreter`) or compiled.
fn step_f32(cfg: &str, m: &Model, interpreter: bool, fuse: bool) -> Grads {
    let ad = lora_adapter();
    let adapter = cfg.starts_with("lora").then_some(&ad);
    let options = Options { interpreter, ..Options::default() };
    let mut tr = Trainer::with_target(m, step_options(cfg, fuse), adapter, 0, &Target::cpu(), &options).expect("a trainer");
    grads_of(&tr.step(&tokens(TRAIN), 0, 1e-3).expect("a step"))
}

/// Distances of one step from the truth: (the loss's relative error, the worst tensor's sampled
/// gradient error and its name, the worst norm error and its name).
fn grad_errors(cfg: &str, g: &Grads, truth: &Truth) -> (f64, (f64, String), (f64, String)) {
    let prefix = format!("train/{cfg}/grad/");
    let names: Vec<&str> = truth.0.keys().filter_map(|k| k.strip_prefix(&prefix)).collect();
    let mut got_names: Vec<&str> = g.grads.keys().map(String::as_str).collect();
    let mut want_names = names.clone();
    got_names.sort();
    want_names.sort();
    assert_eq!(got_names, want_names, "{cfg}: qatc's trainable tensors are the truth's");
    let (mut worst, mut worst_norm) = ((0.0, String::new()), (0.0, String::new()));
    for name in names {
        let got = &g.grads[name];
        let sampled: Vec<f64> = truth.ints(&format!("index/{name}")).iter().map(|&i| got[i as usize]).collect();
        let e = common::rel_err(&sampled, truth.floats(&format!("{prefix}{name}")));
        let norm = got.iter().map(|x| x * x).sum::<f64>().sqrt();
        let n = rel(norm, truth.floats(&format!("train/{cfg}/norm/{name}"))[0]);
        if e > worst.0 {
            worst = (e, name.to_string());
        }
        if n > worst_norm.0 {
            worst_norm = (n, name.to_string());
        }
    }
    (rel(g.loss, truth.floats(&format!("train/{cfg}/loss"))[0]), worst, worst_norm)
}

fn check_step(cfg: &str) {
    let truth = Truth::load();
    let m = model();
    let mut engines = vec![("interpreter f64", step_f64(cfg, &m), &F64)];
    engines.push(("interpreter f32", step_f32(cfg, &m, true, false), &INTERPRETER));
    if cfg!(feature = "llvm") {
        engines.push(("compiled CPU, unfused", step_f32(cfg, &m, false, false), &COMPILED));
        engines.push(("compiled CPU, fused", step_f32(cfg, &m, false, true), &COMPILED));
    }
    eprintln!("train step, {cfg}: float64 loss {:.10}", truth.floats(&format!("train/{cfg}/loss"))[0]);
    let errors: Vec<_> = engines.iter().map(|(_, g, _)| grad_errors(cfg, g, &truth)).collect();
    for ((what, ..), (l, (e, en), (n, nn))) in engines.iter().zip(&errors) {
        eprintln!("  {what:22}: loss {l:.2e}, gradients {e:.2e} ({en}), norms {n:.2e} ({nn})");
    }
    for ((what, _, bound), (l, (e, en), (n, nn))) in engines.iter().zip(&errors) {
        assert!(*l <= bound.loss, "{cfg}, {what}: the loss {l:e} from float64's (limit {:e})", bound.loss);
        assert!(*e <= bound.grads, "{cfg}, {what}: {en}'s gradient {e:e} from float64's (limit {:e})", bound.grads);
        assert!(*n <= bound.grads, "{cfg}, {what}: {nn}'s gradient norm {n:e} from float64's (limit {:e})", bound.grads);
    }
}

#[test]
fn lora_step_within_bounds_of_float64() {
    check_step("lora_plain");
}

#[test]
fn lora_4bit_step_within_bounds_of_float64() {
    check_step("lora_q4");
}

#[test]
fn full_finetune_step_within_bounds_of_float64() {
    check_step("full_plain");
}

#[test]
fn full_finetune_4bit_step_within_bounds_of_float64() {
    check_step("full_q4");
}
