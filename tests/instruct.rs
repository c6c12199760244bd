//! Instruction data (issue 32, 1 and 2) against PyTorch (`tests/fixtures/gen_instruct_fixtures.py`,
//! `instruct/truth.safetensors`): qatc's batches of `instruct/data.jsonl` are the reference
//! pipeline's, token for token (packed by best-fit decreasing with position ids, or padded); the
//! step's masked loss over its micro-batches equals PyTorch's hand-written masked cross-entropy
//! under a block-diagonal causal mask within 1e-6, on the interpreter and compiled (fused, the
//! chunked cross-entropy), with its gradients; evaluation is the mean over the counted targets;
//! and `qatc train` / `qatc eval` (and `qatc prt`) do the same from the command line, with bad
//! records named by file and line or counted.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use qatc::batches::{Batches, Dataset};
use qatc::cli::eval::{EvalSetup, Evaluator};
use qatc::instruct::{ExampleOptions, Template, TrainOn};
use qatc::model::Model;
use qatc::step::StepOptions;
use qatc::trainer::Trainer;
use qatc_driver::{Options, Target};
use qatc_passes::fusion::FuseOptions;
use qatc_runtime::Value;

use common::cli::{qatc, refused};

/// One configuration of the fixture (`gen_instruct_fixtures.py`'s CASES).
struct Case {
    name: &'static str,
    template: &'static str,
    train_on: TrainOn,
    packed: bool,
    b: usize,
    t: usize,
    /// The step's micro-batches.
    step: &'static [usize],
}

const CASES: [Case; 3] = [
    Case { name: "packed", template: "alpaca", train_on: TrainOn::Completion, packed: true, b: 2, t: 64, step: &[0, 1] },
    Case { name: "padded", template: "alpaca", train_on: TrainOn::Completion, packed: false, b: 2, t: 64, step: &[0, 1, 2] },
    Case { name: "packed_all", template: r"Q: {prompt}\nA: {completion}", train_on: TrainOn::All, packed: true, b: 2, t: 64, step: &[1] },
];

const GRADS: [&str; 6] =
    ["wte.weight", "wpe.weight", "h.0.attn.c_attn.weight", "h.1.attn.c_proj.bias", "h.3.mlp.c_proj.weight", "ln_f.weight"];

fn data_path() -> PathBuf {
    common::fixture("instruct/data.jsonl")
}

fn model_path() -> PathBuf {
    common::root().join("examples/gpt2-shakespeare-small/model.safetensors")
}

struct Truth(HashMap<String, common::T>);

impl Truth {
    fn load() -> Truth {
        Truth(common::read_safetensors("instruct/truth.safetensors"))
    }
    fn get(&self, key: &str) -> &common::T {
        self.0.get(key).unwrap_or_else(|| panic!("truth.safetensors has no {key}"))
    }
    fn scalar(&self, key: &str) -> f64 {
        self.get(key).data[0]
    }
}

fn dataset(c: &Case) -> Dataset {
    let o = ExampleOptions { template: Template::parse(c.template).unwrap(), train_on: c.train_on, pack: c.packed, skip_bad: false };
    Dataset::load(&data_path(), c.t, &o).unwrap()
}

fn floats(v: &Value<f32>) -> Vec<f64> {
    match v {
        Value::Float(t) => t.data.iter().map(|&x| f64::from(x)).collect(),
        Value::Int(t) => t.data.iter().map(|&x| f64::from(x)).collect(),
    }
}

#[test]
fn batches_are_the_reference_pipelines() {
    let truth = Truth::load();
    for c in &CASES {
        let d = dataset(c);
        let ids = truth.get(&format!("{}/ids", c.name));
        let n = ids.shape[0];
        assert_eq!(d.num_batches(c.b, c.t), n, "{}: batches", c.name);
        let per = c.b * c.t;
        for s in 0..n {
            let got = d.batch(s, c.b, c.t).unwrap();
            let span = s * per..(s + 1) * per;
            let what = format!("{}, batch {s}", c.name);
            assert_eq!(got.ids, ids.ints[span.clone()], "{what}: ids");
            assert_eq!(got.targets, truth.get(&format!("{}/targets", c.name)).ints[span.clone()], "{what}: targets");
            let mask: Vec<f64> = got.mask.as_ref().unwrap().iter().map(|&m| f64::from(m)).collect();
            assert_eq!(mask, truth.get(&format!("{}/mask", c.name)).data[span.clone()], "{what}: mask");
            match &got.positions {
                Some(p) => assert_eq!(*p, truth.get(&format!("{}/positions", c.name)).ints[span], "{what}: positions"),
                None => assert!(!c.packed, "{what}: packed sequences give position ids"),
            }
        }
        // what the summary says is what the batches hold
        let s = d.summary(c.b).unwrap();
        let counted: f64 = truth.get(&format!("{}/mask", c.name)).data.iter().sum();
        let want = format!("the loss counts {:.1}%", 100.0 * counted / (n * per) as f64);
        assert!(s.contains(&want), "{s}");
    }
}

/// One step of the case's micro-batches (a full fine-tune, gradients kept): its outputs.
fn step(c: &Case, d: &Dataset, m: &Model, interpreter: bool) -> HashMap<String, Value<f32>> {
    let mut o = StepOptions::new(c.b, c.t);
    o.keep_grads = true;
    o.grad_accum = c.step.len();
    o.model.inputs = d.inputs();
    // compiled as `qatc train` runs it: fused, the cross-entropy chunked
    o.fuse = (!interpreter).then(FuseOptions::default);
    let options = Options { interpreter, ..Options::default() };
    let mut tr = Trainer::with_target(m, o, None, 0, &Target::cpu(), &options).unwrap();
    tr.step_on(d, c.step, 1e-3, 0).unwrap()
}

#[test]
fn the_step_is_pytorchs_masked_loss() {
    let truth = Truth::load();
    let m = Model::open(&model_path()).unwrap();
    for c in &CASES {
        let d = dataset(c);
        for (interpreter, grad_tol) in [(true, 1e-5), (false, 1e-4)] {
            let what = format!("{}, {}", c.name, if interpreter { "interpreter" } else { "compiled" });
            let out = step(c, &d, &m, interpreter);
            let loss = floats(&out["loss"])[0];
            let want = truth.scalar(&format!("{}/step_loss", c.name));
            eprintln!("{what}: loss {loss} against PyTorch's {want}: {:.2e}", (loss - want).abs());
            assert!((loss - want).abs() <= 1e-6, "{what}: loss {loss}, PyTorch's masked loss {want}");
            for g in GRADS {
                let got = floats(&out[&format!("grad:{g}")]);
                let idx = &truth.get(&format!("{}/grad/{g}/index", c.name)).ints;
                let sampled: Vec<f64> = idx.iter().map(|&i| got[i as usize]).collect();
                let e = common::rel_err(&sampled, &truth.get(&format!("{}/grad/{g}/value", c.name)).data);
                assert!(e <= grad_tol, "{what}: the gradient of {g} is {e:e} from PyTorch's");
            }
        }
    }
}

#[test]
fn evaluation_is_the_mean_over_the_counted_targets() {
    let truth = Truth::load();
    let m = Model::open(&model_path()).unwrap();
    for c in &CASES {
        let d = dataset(c);
        let mut setup = EvalSetup { interpreter: false, ..Default::default() };
        setup.model.inputs = d.inputs();
        let n = d.num_batches(c.b, c.t);
        let r = Evaluator::new(&m, c.b, c.t, &setup, None).unwrap().run(&d, n, false).unwrap();
        let want = truth.scalar(&format!("{}/eval_loss", c.name));
        assert!((r.loss - want).abs() <= 1e-6, "{}: eval loss {}, PyTorch's {want}", c.name, r.loss);
        let counted: f64 = truth.get(&format!("{}/mask", c.name)).data.iter().sum();
        assert_eq!(r.tokens as f64, counted, "{}: the targets counted", c.name);
    }
    // packed with the block-diagonal mask is the padded evaluation: the same examples, seen alone
    let (p, q) = (truth.scalar("packed/eval_loss"), truth.scalar("padded/eval_loss"));
    assert!((p - q).abs() <= 1e-12, "PyTorch: packed {p} vs padded {q}");
}

fn log_losses(log: &std::path::Path) -> Vec<f64> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64().unwrap())
        .collect()
}

#[test]
fn train_and_eval_take_jsonl_from_the_command_line() {
    let truth = Truth::load();
    let dir = tempfile::tempdir().unwrap();
    let (m, d) = (model_path(), data_path());
    let (m, d) = (m.to_str().unwrap(), d.to_str().unwrap());
    let common = ["--batch", "2", "--seq", "64", "--steps", "1", "--full-finetune", "--device", "cpu"];
    for (c, extra) in [(&CASES[0], &["--grad-accum", "2"][..]), (&CASES[1], &["--no-pack", "--grad-accum", "3"][..])] {
        let out = dir.path().join(c.name);
        let log = dir.path().join(format!("{}.jsonl", c.name));
        // validation on instruction data too
        let mut args = vec!["train", m, "--data", d, "--val", d, "--out", out.to_str().unwrap(), "--log-json", log.to_str().unwrap()];
        args.extend(common);
        args.extend(extra);
        let o = qatc(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{}: {err}", c.name);
        // the padding share is printed
        assert!(err.contains("% of the positions are padding"), "{err}");
        let first: serde_json::Value = serde_json::from_str(std::fs::read_to_string(&log).unwrap().lines().next().unwrap()).unwrap();
        assert!(first["val_loss"].as_f64().is_some_and(f64::is_finite), "{}: {first}", c.name);
        let loss = log_losses(&log)[0];
        let want = truth.scalar(&format!("{}/step_loss", c.name));
        assert!((loss - want).abs() <= 1e-6, "{}: qatc train's first loss {loss}, PyTorch's {want}", c.name);
        let saved = std::fs::read_to_string(out.join("qatc.json")).unwrap();
        assert!(saved.contains("\"template\": \"alpaca\""), "{saved}");
    }
    // eval with a template of the user's, counting every token
    let c = &CASES[2];
    let o = qatc(&[
        "eval",
        m,
        "--data",
        d,
        "--batch",
        "2",
        "--seq",
        "64",
        "--json",
        "--device",
        "cpu",
        "--template",
        c.template,
        "--train-on",
        "all",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let want = truth.scalar("packed_all/eval_loss");
    assert!((v["loss"].as_f64().unwrap() - want).abs() <= 1e-6, "eval {v}, PyTorch's {want}");
    let counted: f64 = truth.get("packed_all/mask").data.iter().sum();
    assert_eq!(v["tokens"].as_f64().unwrap(), counted);
}

#[test]
fn prt_measures_instruction_data_as_eval_does() {
    // its full-precision loss over the first two packed batches is the packed step's masked loss
    let truth = Truth::load();
    let dir = tempfile::tempdir().unwrap();
    let (m, d) = (model_path(), data_path());
    let map = dir.path().join("bits.json");
    let args = ["prt", m.to_str().unwrap(), "--data", d.to_str().unwrap(), "--batch", "2", "--seq", "64", "--batches", "2"];
    let o = qatc(&[&args[..], &["--targets", "h.0.mlp.c_fc", "--device", "cpu", "--json", "--bits-map", map.to_str().unwrap()]].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let want = truth.scalar("packed/step_loss");
    assert!((v["full_precision_loss"].as_f64().unwrap() - want).abs() <= 1e-6, "prt {v}, PyTorch's {want}");
}

#[test]
fn bad_records_are_named_or_counted() {
    let dir = tempfile::tempdir().unwrap();
    let m = model_path();
    let m = m.to_str().unwrap();
    let bad = dir.path().join("bad.jsonl");
    let mut text = std::fs::read_to_string(data_path()).unwrap();
    text.push_str("{\"prompt\": \"a question\", \"completion\": \"\"}\nnot json\n");
    std::fs::write(&bad, &text).unwrap();
    let b = bad.to_str().unwrap();
    let eval = |seq: &str, extra: &[&str]| {
        let mut args = vec!["eval", m, "--data", b, "--batch", "2", "--seq", seq, "--batches", "1", "--interpreter"];
        args.extend(extra);
        qatc(&args)
    };
    let e = refused(&eval("64", &[]));
    assert!(e.contains("bad.jsonl:15: empty `completion`"), "{e}");
    let o = eval("64", &["--skip-bad-records"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("14 records (") && err.contains("2 bad records skipped (the first, line 15: empty `completion`"), "{err}");
    // an example longer than T
    let e = refused(&eval("8", &[]));
    assert!(e.contains("bad.jsonl:1: the example is") && e.contains("more than --seq 8"), "{e}");
    // the options of instruction data, given for a token file, do nothing: refused
    let tokens = common::root().join("examples/shakespeare_val.bin");
    let e = refused(&qatc(&["eval", m, "--data", tokens.to_str().unwrap(), "--no-pack"]));
    assert!(e.contains("--no-pack is for instruction data (a .jsonl file of records)"), "{e}");
    let e = refused(&eval("64", &["--template", "{completion} then {prompt}"]));
    assert!(e.contains("--template \"{completion} then {prompt}\": a template is alpaca, plain or a text holding"), "{e}");
}
