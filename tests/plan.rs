//! The memory plan, end to end: executing the planned step inside one arena gives the
//! interpreter's results bit for bit; every checkpoint policy gives the same gradients and the
//! same updated weights bit for bit; `qatc plan --json` (snapshot), `--svg` and the errors.

mod common;

use std::collections::HashMap;
use std::process::Command;

use qatc::cli::train::Trainer;
use qatc::data::TokenFile;
use qatc::frontend::config::Gpt2Config;
use qatc::model::Model;
use qatc::step::{self, StepOptions};
use qatc_ir::{Graph, InputKind, QuantScheme, QuantSpec};
use qatc_passes::lora::LoraOptions;
use qatc_passes::plan;
use qatc_passes::quant::QuantOptions;
use qatc_passes::remat::Checkpoint;
use qatc_runtime::{ArenaInterpreter, ArenaLayout, IntTensor, Interpreter, Slot, Value};

/// The graph-level plan (the `remat` pass's model) as the arena interpreter takes it.
fn arena_layout(p: &plan::Plan) -> ArenaLayout {
    let slots: HashMap<_, _> = p
        .location
        .iter()
        .map(|(id, loc)| {
            let slot = match loc {
                plan::Location::Arena { offset } => Slot::Arena(*offset),
                plan::Location::Input { name } => Slot::Input(name.clone()),
            };
            (*id, slot)
        })
        .collect();
    ArenaLayout { order: p.order(), slots, arena_bytes: p.arena_bytes }
}

fn tiny() -> Model {
    Model::open(&common::fixture("tiny/f32_prefix/model.safetensors")).unwrap()
}

fn quant_lora(o: &mut StepOptions, r: usize) {
    o.model.full_finetune = false;
    o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 16, scheme: QuantScheme::Sym }));
    o.model.lora = Some(LoraOptions::new(r));
}

/// Every input of a trainer's step: weights and state as bound, plus batch 0 of the tokens.
fn step_inputs(tr: &Trainer, b: usize, t: usize) -> HashMap<String, Value<f32>> {
    let data = TokenFile::open(&common::fixture("tiny/tokens.bin")).unwrap();
    let (ids, tgt) = data.batch(0, b, t).unwrap();
    let mut m = tr.state().unwrap();
    m.insert("ids".into(), Value::Int(IntTensor { shape: vec![b, t], data: ids }));
    m.insert("targets".into(), Value::Int(IntTensor { shape: vec![b, t], data: tgt }));
    m.insert("lr".into(), Value::scalar(1e-3));
    m
}

/// Runs `g` with the interpreter and inside its planned arena; both must agree bit for bit.
fn arena_matches_interpreter(g: &Graph, inputs: &HashMap<String, Value<f32>>) -> usize {
    let want = Interpreter::<f32>::new(g).unwrap().run_split(inputs).unwrap();
    let p = plan::plan(g, &Default::default()).unwrap();
    p.verify().unwrap();
    let got = ArenaInterpreter::new(g, &arena_layout(&p)).unwrap().run_split(inputs).unwrap();
    for (name, v) in &want.outputs {
        assert_eq!(common::bits(v), common::bits(&got.outputs[name]), "output {name}");
    }
    for (name, v) in &want.updates {
        assert_eq!(common::bits(v), common::bits(&got.updates[name]), "update {name}");
    }
    want.outputs.len() + want.updates.len()
}

fn policies(m: &Model, o: &StepOptions) -> Vec<Checkpoint> {
    // a budget halfway between the smallest plan and no recompute: per-op choices in between
    let peak = |c: Checkpoint| {
        let mut o = o.clone();
        o.checkpoint = c;
        let (g, _) = step::train(&m.cfg, &o, |_, _| {}).unwrap();
        plan::plan(&g, &Default::default()).unwrap().peak_bytes()
    };
    // (on the tiny model the peak can be the head's, which no policy lowers: then the budget is
    // the smallest peak, still solved by the DP)
    let (none, blocks) = (peak(Checkpoint::None), peak(Checkpoint::Blocks));
    assert!(blocks <= none, "blocks ({blocks}) never needs more than none ({none})");
    vec![Checkpoint::None, Checkpoint::Blocks, Checkpoint::Sqrt, Checkpoint::Budget(blocks + (none - blocks) / 2)]
}

#[test]
fn the_planned_step_runs_bit_identically_inside_one_arena() {
    let m = tiny();
    for lora in [false, true] {
        let mut o = StepOptions::new(2, 16);
        o.keep_grads = true;
        if lora {
            quant_lora(&mut o, 4);
        }
        for c in policies(&m, &o) {
            let mut o = o.clone();
            o.checkpoint = c;
            let tr = Trainer::new(&m, o, None, 0).unwrap();
            let n = arena_matches_interpreter(&tr.graph, &step_inputs(&tr, 2, 16));
            assert!(n > 10, "{c:?}: compared {n} values");
        }
    }
}

/// Plans work on fused steps too: a kernel node is one value, its body's intermediates take no
/// arena bytes; the fused step runs inside its arena exactly as the interpreter runs it.
#[test]
fn fused_steps_run_bit_identically_inside_one_arena() {
    let m = tiny();
    for lora in [false, true] {
        let mut o = StepOptions::new(2, 16);
        if lora {
            quant_lora(&mut o, 4);
        }
        o.fuse = Some(qatc_passes::fusion::FuseOptions::default());
        let tr = Trainer::new(&m, o, None, 0).unwrap();
        assert!(qatc_ir::print(&tr.graph).contains("kernel["), "the step is fused");
        arena_matches_interpreter(&tr.graph, &step_inputs(&tr, 2, 16));
        // the schedule the lowering takes is the plan's order, made without the plan's offsets
        let p = plan::plan(&tr.graph, &plan::PlanOptions::default()).unwrap();
        assert_eq!(plan::schedule(&tr.graph).unwrap(), p.order(), "lora {lora}");
    }
}

#[test]
fn gradients_and_updates_are_bit_identical_under_every_policy() {
    let m = tiny();
    let data = TokenFile::open(&common::fixture("tiny/tokens.bin")).unwrap();
    // full fine-tune; 4-bit + LoRA; 4-bit + LoRA with two micro-batches (two chains to checkpoint)
    for (lora, accum) in [(false, 1), (true, 1), (true, 2)] {
        let mut base = StepOptions::new(2, 16);
        base.keep_grads = true;
        base.grad_accum = accum;
        if lora {
            quant_lora(&mut base, 4);
        }
        // (gradients and loss, weights and moments after the update) under `none`
        type Values = HashMap<String, Value<f32>>;
        let mut reference: Option<(Values, Values)> = None;
        for c in policies(&m, &base) {
            let mut o = base.clone();
            o.checkpoint = c;
            let mut tr = Trainer::new(&m, o, None, 0).unwrap();
            let recomputed = qatc_ir::print(&tr.graph).matches(".recompute\"").count();
            match c {
                Checkpoint::None => assert_eq!(recomputed, 0),
                Checkpoint::Blocks | Checkpoint::Sqrt => assert!(recomputed > 0, "{c:?} recomputes"),
                _ => {}
            }
            let out = tr.step(&data, 0, 1e-3).unwrap();
            let grads = out.into_iter().filter(|(k, _)| k.starts_with("grad:") || k == "loss").collect::<HashMap<_, _>>();
            let after = tr
                .state()
                .unwrap()
                .iter()
                .filter(|(k, _)| k.contains("weight") || k.starts_with("adam"))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            match &reference {
                None => reference = Some((grads, after)),
                Some((g0, a0)) => {
                    assert_eq!(g0.len(), grads.len());
                    for (k, v) in g0 {
                        assert_eq!(common::bits(v), common::bits(&grads[k]), "{c:?}: {k} differs from checkpoint none");
                    }
                    for (k, v) in a0 {
                        assert_eq!(common::bits(v), common::bits(&after[k]), "{c:?}: {k} after the update differs");
                    }
                }
            }
        }
    }
}

/// Gradient accumulation: each micro-batch's weight gradient is folded into the running sum as
/// it is made, so the planned arena does not grow with K (it did: every micro-batch's
/// contribution was held until the first micro-batch's, made last, could be added).
#[test]
fn accumulated_gradients_do_not_pile_up_in_the_arena() {
    let m = tiny();
    let arena = |k: usize| {
        let mut o = StepOptions::new(2, 16);
        quant_lora(&mut o, 4);
        o.grad_accum = k;
        let (g, _) = step::train(&m.cfg, &o, |_, _| {}).unwrap();
        let p = plan::plan(&g, &Default::default()).unwrap();
        p.verify().unwrap();
        p.arena_bytes
    };
    let (two, eight) = (arena(2), arena(8));
    assert_eq!(two, eight, "arena with 2 micro-batches {two} B, with 8 {eight} B");
}

/// sqrt on the 2-layer fixture is blocks (segments of round(sqrt 2) = 1); on 4 layers its
/// segments hold 2 blocks. Random weights, every policy, gradients compared bit for bit.
#[test]
fn sqrt_segments_of_two_blocks_give_the_same_gradients() {
    let cfg = Gpt2Config { n_embd: 16, n_layer: 4, n_head: 2, n_positions: 16, vocab_size: 23, layer_norm_epsilon: 1e-5 };
    let mut o = StepOptions::new(2, 8);
    o.keep_grads = true;
    quant_lora(&mut o, 2);
    o.model.quant.as_mut().unwrap().spec.group = 8;
    let mut reference: Option<HashMap<String, Value<f32>>> = None;
    let mut inputs: HashMap<String, Value<f32>> = HashMap::new();
    for c in [Checkpoint::None, Checkpoint::Sqrt, Checkpoint::Blocks] {
        let mut oc = o.clone();
        oc.checkpoint = c;
        let (g, _) = step::train(&cfg, &oc, |_, _| {}).unwrap();
        if inputs.is_empty() {
            let mut x = 7u64;
            for id in g.inputs() {
                let ty = g.ty(id);
                let name = g.node(id).name.clone().unwrap();
                let n = ty.numel();
                let v = match (g.input_kind(id), ty.dtype.is_float()) {
                    (_, false) => {
                        let hi = if name.ends_with("qcodes") { 16 } else { 23 };
                        Value::Int(IntTensor { shape: ty.shape.dims().to_vec(), data: (0..n as i32).map(|i| (i * 7 + 3) % hi).collect() })
                    }
                    (Some(InputKind::State), true) => Value::floats(ty.shape.dims().to_vec(), &vec![0.0; n]).unwrap(),
                    _ => {
                        let d: Vec<f64> = (0..n)
                            .map(|_| {
                                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                                ((x >> 33) as f64 / (1u64 << 31) as f64 - 0.5) * 0.2
                            })
                            .collect();
                        Value::floats(ty.shape.dims().to_vec(), &d).unwrap()
                    }
                };
                inputs.insert(name, v);
            }
            inputs.insert("lr".into(), Value::scalar(1e-3));
        }
        arena_matches_interpreter(&g, &inputs);
        let out = Interpreter::<f32>::new(&g).unwrap().run(&inputs).unwrap();
        match &reference {
            None => reference = Some(out),
            Some(r) => {
                for (k, v) in r {
                    assert_eq!(common::bits(v), common::bits(&out[k]), "{c:?}: {k}");
                }
            }
        }
    }
}

fn qatc(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_qatc")).args(args).current_dir(common::root()).output().unwrap()
}

#[test]
fn plan_json_of_the_tiny_model() {
    let tiny = "tests/fixtures/tiny/f32_prefix/model.safetensors";
    let r = qatc(&[
        "plan",
        tiny,
        "--batch",
        "1",
        "--seq",
        "4",
        "--bits",
        "4",
        "--group",
        "16",
        "--lora",
        "r=2",
        "--checkpoint",
        "blocks",
        "--json",
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let text = String::from_utf8(r.stdout).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["schema"], "qatc.memory_plan");
    assert_eq!(v["version"], 2);
    let s = &v["summary"];
    assert!(s["arena_bytes"].as_u64() >= s["lower_bound_bytes"].as_u64());
    assert!(s["recomputed_nodes"].as_u64().unwrap() > 0);
    let regions: u64 = ["persistent_bytes", "arena_bytes", "data_bytes"].iter().map(|k| s[k].as_u64().unwrap()).sum();
    assert_eq!(s["peak_bytes"].as_u64().unwrap(), regions);
    insta::assert_snapshot!("plan_json_tiny_blocks", text);
}

/// `qatc plan MODEL | head -1`: the reader has closed the pipe by the time qatc prints; qatc ends
/// quietly (as Unix tools do on SIGPIPE), not with a panic about a failed print.
#[cfg(unix)]
#[test]
fn plan_into_a_closed_pipe_ends_quietly() {
    use std::io::Read;
    use std::process::Stdio;
    let tiny = "tests/fixtures/tiny/f32_prefix/model.safetensors";
    let mut child = Command::new(env!("CARGO_BIN_EXE_qatc"))
        .args(["plan", tiny, "--batch", "1", "--seq", "4", "--lora", "r=2", "--json"])
        .current_dir(common::root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // closed at once: planning takes milliseconds, so the first print finds no reader
    drop(child.stdout.take());
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let status = child.wait().unwrap();
    assert!(!err.contains("panicked"), "{err}");
    assert_ne!(status.code(), Some(101), "a panic's exit code: {err}");
}

/// A minimal XML well-formedness check: balanced tags, quoted attributes, escaped text.
fn well_formed(xml: &str) -> Result<usize, String> {
    let mut stack: Vec<String> = Vec::new();
    let mut rest = xml.trim_start();
    if let Some(r) = rest.strip_prefix("<?xml") {
        rest = &r[r.find("?>").ok_or("unterminated declaration")? + 2..];
    }
    let mut elements = 0;
    while let Some(i) = rest.find('<') {
        let text = &rest[..i];
        if text.contains('>')
            || text.replace("&amp;", "").replace("&lt;", "").replace("&gt;", "").replace("&quot;", "").replace("&apos;", "").contains('&')
        {
            return Err(format!("unescaped text {text:?}"));
        }
        let end = rest[i..].find('>').ok_or("unterminated tag")? + i;
        let tag = &rest[i + 1..end];
        if let Some(name) = tag.strip_prefix('/') {
            if stack.pop().as_deref() != Some(name.trim()) {
                return Err(format!("unbalanced </{name}>"));
            }
        } else {
            let self_closing = tag.ends_with('/');
            let body = tag.trim_end_matches('/');
            let name = body.split_whitespace().next().ok_or("empty tag")?.to_string();
            if !body.matches('"').count().is_multiple_of(2) {
                return Err(format!("unquoted attribute in <{name}>"));
            }
            elements += 1;
            if !self_closing {
                stack.push(name);
            }
        }
        rest = &rest[end + 1..];
    }
    if !stack.is_empty() || !rest.trim().is_empty() {
        return Err(format!("unclosed {stack:?}"));
    }
    Ok(elements)
}

#[test]
fn svg_is_well_formed_and_marks_the_peak() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("m.svg");
    let r = qatc(&[
        "plan",
        "124M",
        "--batch",
        "2",
        "--seq",
        "256",
        "--bits",
        "4",
        "--lora",
        "r=8",
        "--checkpoint",
        "blocks",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let table = String::from_utf8(r.stdout).unwrap();
    assert!(table.contains("activations") && table.contains("total (peak)"), "{table}");
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(well_formed(&text).unwrap() > 20);
    assert!(text.contains(r#"id="peak""#) && text.contains(">peak "), "the peak is marked");
    for c in ["weights", "activations", "temporaries", "optimizer"] {
        assert!(text.contains(&format!("band {c}")), "band {c}");
    }
    assert!(well_formed("<a><b></a></b>").is_err() && well_formed("<a x=\"1></a>").is_err());
}

#[test]
fn compile_writes_the_memory_plan_and_its_picture() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let m = common::fixture("tiny/f32_prefix/model.safetensors");
    let r = qatc(&[
        "compile",
        m.to_str().unwrap(),
        "--batch",
        "1",
        "--seq",
        "8",
        "--checkpoint",
        "blocks",
        "--no-fuse",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let plan: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("memory_plan.json")).unwrap()).unwrap();
    assert_eq!(plan["schema"], "qatc.memory_plan");
    assert!(well_formed(&std::fs::read_to_string(out.join("memory.svg")).unwrap()).is_ok());
    assert!(std::fs::read_to_string(out.join("train.qir")).unwrap().contains(".recompute\""), "recompute is visible in train.qir");
}

/// One line, exit code 2, stating the smallest budget that fits.
fn fails(args: &[&str]) -> String {
    let r = qatc(args);
    let stderr = String::from_utf8_lossy(&r.stderr).into_owned();
    assert_eq!(r.status.code(), Some(2), "{args:?}: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr:?}");
    assert!(stderr.starts_with("error: ") && !stderr.contains("panicked"), "{stderr}");
    stderr
}

#[test]
fn an_impossible_budget_states_the_smallest_that_fits() {
    let base = ["plan", "124M", "--batch", "8", "--seq", "1024", "--bits", "4", "--lora", "r=16"];
    let e = fails(&[&base[..], &["--checkpoint", "budget=1MiB"]].concat());
    assert!(e.contains("smallest plan needs") && e.contains("--checkpoint budget="), "{e}");
    // and the budget it suggests does fit
    let suggested = e.rsplit("--checkpoint ").next().unwrap().split_whitespace().next().unwrap();
    let r = qatc(&[&base[..], &["--checkpoint", suggested]].concat());
    assert!(r.status.success(), "{suggested}: {}", String::from_utf8_lossy(&r.stderr));
    let e = fails(&[&base[..], &["--memory", "10MiB"]].concat());
    assert!(e.contains("smallest plan needs") && e.contains("GiB"), "{e}");
    let e = fails(&[&base[..], &["--memory", "4GX"]].concat());
    assert!(e.contains("invalid size `4GX`") && e.contains("512MiB"), "{e}");
    let e = fails(&[&base[..], &["--checkpoint", "auto"]].concat());
    assert!(e.contains("needs --memory"), "{e}");
    let e = fails(&[&base[..], &["--checkpoint", "none", "--memory", "2GiB"]].concat());
    assert!(e.contains("more than --memory") && e.contains("auto"), "{e}");
}

/// `auto` takes no recompute when the step fits, and recomputes when it must.
#[test]
fn auto_picks_the_fastest_plan_that_fits() {
    let run = |mem: &str| -> serde_json::Value {
        let r = qatc(&["plan", "124M", "--batch", "4", "--seq", "512", "--bits", "4", "--lora", "r=16", "--memory", mem, "--json"]);
        assert!(r.status.success(), "{mem}: {}", String::from_utf8_lossy(&r.stderr));
        serde_json::from_str(&String::from_utf8(r.stdout).unwrap()).unwrap()
    };
    let roomy = run("40GiB");
    assert_eq!(roomy["summary"]["recompute_flops"], 0);
    assert_eq!(roomy["context"]["fits"], true);
    let tight = run("1.5GiB");
    assert!(tight["summary"]["recompute_flops"].as_u64().unwrap() > 0);
    assert!(tight["summary"]["peak_bytes"].as_u64().unwrap() <= 1610612736);
}

/// `--fit`: the configurations that fit, fastest first, each one's peak what `qatc plan` says of
/// it alone; `--svg` draws the first; a memory nothing fits in says what the smallest plan holds.
#[test]
fn fit_lists_what_fits_and_says_why_nothing_does() {
    let demo = "examples/gpt2-shakespeare-small/model.safetensors";
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("fit.svg");
    let base = ["plan", demo, "--seq", "128", "--bits", "4", "--scheme", "q4_0", "--group", "32", "--lora", "r=16"];
    let fit = |extra: &[&str]| -> serde_json::Value {
        let r = qatc(&[&base[..], &["--fit", "--json", "--max-batch", "8"], extra].concat());
        assert!(r.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&r.stderr));
        serde_json::from_str(&String::from_utf8(r.stdout).unwrap()).unwrap()
    };
    let v = fit(&["--memory", "64MiB", "--svg", svg.to_str().unwrap()]);
    assert_eq!((v["schema"].as_str(), v["version"].as_u64()), (Some("qatc.fit"), Some(1)));
    let fits = v["fits"].as_array().unwrap();
    assert!(!fits.is_empty() && v["cannot_fit"].is_null(), "{v}");
    let rel: Vec<f64> = fits.iter().map(|c| c["relative_throughput"].as_f64().unwrap()).collect();
    assert!(rel[0] == 1.0 && rel.windows(2).all(|w| w[0] >= w[1]), "fastest first: {rel:?}");
    for c in fits {
        assert!(c["peak_bytes"].as_u64().unwrap() <= 64 << 20, "{c}");
    }
    // the first row planned alone: the same peak
    let first = &fits[0];
    let (b, policy) = (first["batch"].to_string(), first["checkpoint"].as_str().unwrap().to_string());
    let mut alone = vec!["--batch", &b, "--checkpoint", &policy, "--json"];
    if policy == "auto" {
        alone.extend(["--memory", "64MiB"]);
    }
    let r = qatc(&[&base[..], &alone].concat());
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let plan: serde_json::Value = serde_json::from_str(&String::from_utf8(r.stdout).unwrap()).unwrap();
    assert_eq!(plan["summary"]["peak_bytes"], first["peak_bytes"]);
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert!(picture.contains("--fit") && picture.contains(&format!("B {b} ")), "the picture shows the chosen configuration");
    // nothing fits: the smallest plan's bytes, by category, add up to its peak
    let v = fit(&["--memory", "30MiB"]);
    assert!(v["fits"].as_array().unwrap().is_empty());
    let why = &v["cannot_fit"];
    assert!(why["message"].as_str().unwrap().contains("smallest plan (batch 1"), "{why}");
    let by: u64 = why["at_peak"].as_object().unwrap().values().map(|x| x.as_u64().unwrap()).sum();
    let peak = why["smallest"]["peak_bytes"].as_u64().unwrap();
    assert!(by <= peak && peak > 30 << 20, "{by} by category, peak {peak}");
    // a GPU's name, a size without weights; the table
    let r = qatc(&["plan", "124M", "--seq", "256", "--bits", "4", "--lora", "r=16", "--memory", "l4", "--fit", "--max-batch", "2"]);
    let out = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success() && out.contains("fits in 22.35 GiB") && out.contains("relative"), "{out}");
    let e = fails(&["plan", "124M", "--fit"]);
    assert!(e.contains("--fit needs --memory"), "{e}");
}

/// `--fit` searches the precision (fp32, bf16) and the optimizer (adamw, adamw8bit) unless the
/// command line pins them; a pinned one is the only one tried (fp16 only so). At each batch and
/// policy, bf16 holds less than fp32 and 8-bit moments less than 32-bit (a full fine-tune).
#[test]
fn fit_searches_precision_and_optimizer_unless_pinned() {
    use std::collections::{BTreeMap, BTreeSet};
    let tiny = "tests/fixtures/tiny/f32_prefix/model.safetensors";
    let base = ["plan", tiny, "--seq", "16", "--full-finetune", "--memory", "1GiB", "--fit", "--json", "--max-batch", "2"];
    let fits = |extra: &[&str]| -> Vec<serde_json::Value> {
        let r = qatc(&[&base[..], extra].concat());
        assert!(r.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&r.stderr));
        let v: serde_json::Value = serde_json::from_str(&String::from_utf8(r.stdout).unwrap()).unwrap();
        v["fits"].as_array().unwrap().clone()
    };
    let kinds = |fits: &[serde_json::Value]| -> BTreeSet<(String, String)> {
        fits.iter().map(|c| (c["precision"].as_str().unwrap().to_string(), c["optim"].as_str().unwrap().to_string())).collect()
    };
    let set = |v: &[(&str, &str)]| -> BTreeSet<(String, String)> { v.iter().map(|(p, o)| (p.to_string(), o.to_string())).collect() };
    let all = fits(&[]);
    assert_eq!(kinds(&all), set(&[("bf16", "adamw"), ("bf16", "adamw8bit"), ("fp32", "adamw"), ("fp32", "adamw8bit")]));
    let peak: BTreeMap<(String, String, u64, String), u64> = all
        .iter()
        .map(|c| {
            let key = (
                c["precision"].as_str().unwrap().into(),
                c["optim"].as_str().unwrap().into(),
                c["batch"].as_u64().unwrap(),
                c["checkpoint"].as_str().unwrap().into(),
            );
            (key, c["peak_bytes"].as_u64().unwrap())
        })
        .collect();
    for b in [1, 2] {
        let at = |p: &str, o: &str| peak[&(p.to_string(), o.to_string(), b, "none".to_string())];
        assert!(at("bf16", "adamw") < at("fp32", "adamw"), "B {b}: bf16 holds less than fp32");
        assert!(at("fp32", "adamw8bit") < at("fp32", "adamw"), "B {b}: 8-bit moments hold less than 32-bit");
    }
    assert_eq!(kinds(&fits(&["--optim", "adamw"])), set(&[("bf16", "adamw"), ("fp32", "adamw")]));
    assert_eq!(kinds(&fits(&["--precision", "fp16"])), set(&[("fp16", "adamw"), ("fp16", "adamw8bit")]));
    assert_eq!(kinds(&fits(&["--precision", "fp32", "--optim", "adamw8bit"])), set(&[("fp32", "adamw8bit")]));
    // the table has the columns
    let r = qatc(&["plan", tiny, "--seq", "16", "--full-finetune", "--memory", "1GiB", "--fit", "--max-batch", "1"]);
    let out = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success() && out.contains("precision") && out.contains("adamw8bit") && out.contains("bf16"), "{out}");
}

/// On CUDA a plan gets a device's memory less what the process holds outside the executor's
/// allocations (the context and the BLAS workspace, `Target::reserved_bytes`): `--fit` and
/// `--memory` say so and plan within the rest; the CPU keeps no reserve.
#[test]
fn cuda_plans_leave_room_for_the_context_and_the_blas_workspace() {
    let reserve = qatc_driver::Target::cuda(None, Default::default()).reserved_bytes as u64;
    assert_eq!(reserve, (512 + 32) << 20, "the context's estimate and cuBLAS's workspace");
    assert_eq!(qatc_driver::Target::cpu().reserved_bytes, 0);
    let base = ["plan", "124M", "--seq", "256", "--bits", "4", "--lora", "r=16", "--memory", "l4", "--fit", "--max-batch", "2"];
    for (device, kept) in [("cuda", reserve), ("cpu", 0)] {
        let r = qatc(&[&base[..], &["--device", device, "--json"]].concat());
        assert!(r.status.success(), "{device}: {}", String::from_utf8_lossy(&r.stderr));
        let v: serde_json::Value = serde_json::from_str(&String::from_utf8(r.stdout).unwrap()).unwrap();
        let (memory, budget) = (v["memory_limit"].as_u64().unwrap(), v["plan_budget"].as_u64().unwrap());
        assert_eq!((v["reserved"].as_u64(), budget), (Some(kept), memory - kept), "{device}");
        for c in v["fits"].as_array().unwrap() {
            assert!(c["peak_bytes"].as_u64().unwrap() <= budget, "{device}: {c}");
        }
    }
    let r = qatc(&[&base[..], &["--device", "cuda"]].concat());
    let out = String::from_utf8_lossy(&r.stdout);
    assert!(out.contains("fits in 21.82 GiB (22.35 GiB less 544.00 MiB for the CUDA context and the BLAS workspace)"), "{out}");
    // a memory the CUDA plan fits in only without the reserve
    let demo = "examples/gpt2-shakespeare-small/model.safetensors";
    let plan = ["plan", demo, "--seq", "128", "--bits", "4", "--scheme", "q4_0", "--group", "32", "--lora", "r=16", "--device", "cuda"];
    let r = qatc(&[&plan[..], &["--json"]].concat());
    let v: serde_json::Value = serde_json::from_str(&String::from_utf8(r.stdout).unwrap()).unwrap();
    let peak = v["summary"]["peak_bytes"].as_u64().unwrap();
    let memory = format!("{}MiB", (peak + reserve / 2) >> 20);
    let e = fails(&[&plan[..], &["--checkpoint", "none", "--memory", &memory]].concat());
    assert!(e.contains("leaves") && e.contains("CUDA context"), "{e}");
    // the CPU keeps no reserve: the same memory fits its plan (a few KiB apart from CUDA's)
    let cpu: Vec<&str> = plan.iter().map(|&a| if a == "cuda" { "cpu" } else { a }).collect();
    let r = qatc(&[&cpu[..], &["--checkpoint", "none", "--memory", &memory]].concat());
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
}
