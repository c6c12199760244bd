//! `--precision bf16|fp16` against PyTorch (`tests/fixtures/gen_precision_fixtures.py`): the same
//! QAT + LoRA run of 20 AdamW steps under `torch.autocast` (bf16) and autocast + GradScaler (fp16,
//! growth every 5 steps, an overflow injected at step 7) on the tiny fixture model (interpreter)
//! and the Shakespeare model (compiled, where LLVM is built in):
//!
//! - every step's loss within 2e-2 of PyTorch's (qatc stores the residual stream, layer norms and
//!   probabilities in the compute type too; autocast keeps them f32, so the runs differ by more
//!   than rounding order);
//! - the fp16 loss scale each step used, and the steps skipped, identical;
//! - the tiny run's LoRA tensors within sqrt(2) times the distance PyTorch's own run in that
//!   precision ends up from its fp32 run (norm-relative over every LoRA tensor): two runs that
//!   each carry rounding noise of that size are sqrt(2) times it apart;
//! - qatc's fp32 run matches PyTorch's fp32 run closely, so the setups are the same;
//! - the `loss_scale` op equals `torch._amp_update_scale_` on every case of the fixture.
//!
//! The injected overflow is grafted into the step graph before the precision pass: one LoRA
//! gradient is multiplied by a data input `grad.poke` (1, or +inf at step 7), as the fixture
//! multiplies that parameter's `.grad` by inf after the backward.

mod common;

use std::collections::HashMap;
use std::f64::consts::SQRT_2;

use qatc::cli::train::Trainer;
use qatc::data::TokenFile;
use qatc::model::Model;
use qatc::step::{self, StepOptions};
use qatc_ir::{BinaryOp, DType, Graph, InputKind, Op, QuantScheme, QuantSpec, Shape};
use qatc_passes::lora::LoraOptions;
use qatc_passes::precision::{self, LossScaling, Precision, GRADS_FINITE};
use qatc_passes::quant::QuantOptions;
use qatc_runtime::{Interpreter, Tensor, Value};
use serde_json::Value as Json;

const LOSS_TOL: f64 = 2e-2;
const POKE: &str = "grad.poke";

fn fixture(name: &str) -> Json {
    serde_json::from_str(&std::fs::read_to_string(common::fixture(&format!("precision/{name}.json"))).unwrap()).unwrap()
}

fn f64s(v: &Json) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

/// The fixture's run as qatc options.
fn options(j: &Json, p: Precision) -> StepOptions {
    let u = |k: &str| j[k].as_u64().unwrap() as usize;
    let mut o = StepOptions::new(u("batch"), u("seq"));
    let q = &j["quant"];
    let scheme = QuantScheme::from_name(q["scheme"].as_str().unwrap()).unwrap();
    let spec = QuantSpec { bits: q["bits"].as_u64().unwrap() as u8, group: q["group"].as_u64().unwrap() as usize, scheme };
    o.model.quant = Some(QuantOptions::all_linears(spec));
    let mut l = LoraOptions::new(j["lora"]["r"].as_u64().unwrap() as usize);
    l.alpha = j["lora"]["alpha"].as_f64().unwrap();
    l.targets = j["lora"]["targets"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect();
    o.model.lora = Some(l);
    o.model.full_finetune = false;
    o.adamw.weight_decay = j["weight_decay"].as_f64().unwrap();
    let gs = &j["grad_scaler"];
    o.loss_scaling = LossScaling {
        init: gs["init"].as_f64().unwrap(),
        growth: gs["growth"].as_f64().unwrap(),
        backoff: gs["backoff"].as_f64().unwrap(),
        interval: gs["interval"].as_u64().unwrap() as usize,
    };
    o.precision = p;
    o
}

/// Multiplies the raw gradient of `param` by a new data input `grad.poke`: the product takes the
/// name autodiff gave the gradient (`grad:NAME`), which is how the precision pass finds it.
fn graft_poke(g: &mut Graph, param: &str) {
    let name = format!("grad:{param}");
    let grad = g.topo_order().unwrap().into_iter().find(|&n| g.node(n).name.as_deref() == Some(name.as_str())).unwrap();
    let poke = g.input(POKE, InputKind::Data, DType::F32, Shape::scalar()).unwrap();
    let shape = g.ty(grad).shape.clone();
    let b = g.add(Op::Broadcast { shape }, &[poke]).unwrap();
    let poked = g.add(Op::Binary(BinaryOp::Mul), &[grad, b]).unwrap();
    g.replace_all_uses(grad, poked);
    g.set_name(grad, format!("{name}.before_poke"));
    g.set_name(poked, name);
}

struct Run {
    losses: Vec<f64>,
    scales: Vec<f64>,
    skipped: Vec<bool>,
    lora: HashMap<String, Vec<f64>>,
}

fn run(model: &str, p: Precision, interpreter: bool) -> Run {
    let target = qatc_driver::Target::cpu();
    let build = qatc_driver::Options { interpreter, ..Default::default() };
    let j = fixture(model);
    let root = common::root();
    let m = Model::open(&root.join(j["model"].as_str().unwrap()).join("model.safetensors")).unwrap();
    let data = TokenFile::load(&root.join(j["tokens"].as_str().unwrap())).unwrap();
    let init = qatc::adapter::read(&root.join(j["adapter_init"].as_str().unwrap())).unwrap();
    let o = options(&j, p);
    let gs = &j["grad_scaler"];
    let inject = p == Precision::Fp16;
    let mut tr = if inject {
        // the step up to AdamW, the poke grafted in, then the precision pass as the pipeline runs it
        let mut o32 = o.clone();
        o32.precision = Precision::Fp32;
        let (mut g, _) = step::train(&m.cfg, &o32, |_, _| {}).unwrap();
        graft_poke(&mut g, gs["overflow_param"].as_str().unwrap());
        let (g, _) = precision::precision(g, p, &o.loss_scaling).unwrap();
        qatc_ir::verify(&g).unwrap();
        Trainer::with_graph(&m, g, o.clone(), Some(&init), 0, &target, &build).unwrap()
    } else {
        Trainer::with_target(&m, o.clone(), Some(&init), 0, &target, &build).unwrap()
    };
    let steps = j["steps"].as_u64().unwrap() as usize;
    let overflow = gs["overflow_step"].as_u64().unwrap() as usize;
    let batches = j["batches"].as_u64().map(|b| b as usize);
    let lr = j["lr"].as_f64().unwrap();
    let mut r = Run { losses: Vec::new(), scales: Vec::new(), skipped: Vec::new(), lora: HashMap::new() };
    for s in 0..steps {
        if inject {
            tr.set_input(POKE, Value::scalar(if s == overflow { f64::INFINITY } else { 1.0 })).unwrap();
        }
        let scale = tr.loss_scale().unwrap();
        let b = batches.map_or(s, |n| s % n);
        let out = tr.step_on(&data, &[b], lr, s as u64).unwrap();
        r.losses.push(f64::from(out["loss"].as_float().unwrap().data[0]));
        if let Some(sc) = scale {
            r.scales.push(sc);
            r.skipped.push(out[GRADS_FINITE].as_float().unwrap().data[0] == 0.0);
        }
    }
    for (name, t) in tr.weights().unwrap() {
        r.lora.insert(name, t.data.iter().map(|&v| f64::from(v)).collect());
    }
    r
}

/// ||a - b|| / ||b|| over every LoRA tensor of the fixture's `prefix/` run.
fn lora_distance(ours: &HashMap<String, Vec<f64>>, prefix: &str) -> f64 {
    let st = common::read_safetensors("precision/tiny_adapters.safetensors");
    let (mut num, mut den, mut n) = (0.0, 0.0, 0);
    for (key, t) in &st {
        let Some(name) = key.strip_prefix(&format!("{prefix}/")) else { continue };
        let o = &ours[name];
        assert_eq!(o.len(), t.data.len(), "{name}");
        num += o.iter().zip(&t.data).map(|(a, b)| (a - b) * (a - b)).sum::<f64>();
        den += t.data.iter().map(|b| b * b).sum::<f64>();
        n += 1;
    }
    assert_eq!(n, ours.len(), "every LoRA tensor is compared");
    (num / den).sqrt()
}

fn check_losses(what: &str, ours: &[f64], torch: &[f64], tol: f64) -> f64 {
    assert_eq!(ours.len(), torch.len());
    let worst = ours.iter().zip(torch).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    eprintln!("{what}: worst step loss difference from PyTorch {worst:.2e}");
    for (s, (a, b)) in ours.iter().zip(torch).enumerate() {
        assert!((a - b).abs() <= tol, "{what}: step {s} loss {a} vs PyTorch {b} (limit {tol:e})");
    }
    worst
}

fn check_scaling(what: &str, r: &Run, torch: &Json) {
    let want_scales = f64s(&torch["scales"]);
    let want_skipped: Vec<bool> = torch["skipped"].as_array().unwrap().iter().map(|x| x.as_bool().unwrap()).collect();
    assert_eq!(r.scales, want_scales, "{what}: the loss scale of each step");
    assert_eq!(r.skipped, want_skipped, "{what}: the skipped steps");
    assert!(r.skipped.iter().any(|&s| s) && want_scales.iter().any(|&s| s > want_scales[0]), "{what}: the run must skip and grow");
}

#[test]
fn tiny_bf16_and_fp16_follow_pytorch_autocast_and_grad_scaler() {
    let j = fixture("tiny");
    let fp32 = run("tiny", Precision::Fp32, true);
    check_losses("tiny fp32", &fp32.losses, &f64s(&j["fp32"]["losses"]), 1e-4);
    assert!(lora_distance(&fp32.lora, "fp32") <= 1e-5, "qatc's fp32 run is PyTorch's: the setups agree");
    for p in [Precision::Bf16, Precision::Fp16] {
        let what = format!("tiny {p}");
        let r = run("tiny", p, true);
        check_losses(&what, &r.losses, &f64s(&j[p.name()]["losses"]), LOSS_TOL);
        if p == Precision::Fp16 {
            check_scaling(&what, &r, &j["fp16"]);
        }
        // PyTorch's own distance between this precision and fp32 is the tolerance
        let tol = j[p.name()]["adapter_vs_fp32"]["norm_rel"].as_f64().unwrap();
        let d = lora_distance(&r.lora, p.name());
        eprintln!(
            "{what}: LoRA tensors {d:.3e} from PyTorch's {p} run, {:.3e} from its fp32 run (PyTorch's {p} run is {tol:.3e} from it)",
            lora_distance(&r.lora, "fp32")
        );
        // two runs that each carry their own rounding noise of that size are sqrt(2) times it apart
        assert!(d <= SQRT_2 * tol, "{what}: LoRA tensors {d:e} from PyTorch's (limit sqrt(2) x PyTorch's {p} vs fp32, {tol:e})");
    }
}

#[test]
fn shakespeare_bf16_and_fp16_follow_pytorch() {
    let interpreter = !cfg!(feature = "llvm");
    let j = fixture("shakespeare");
    for p in [Precision::Bf16, Precision::Fp16] {
        let what = format!("shakespeare {p}");
        let r = run("shakespeare", p, interpreter);
        check_losses(&what, &r.losses, &f64s(&j[p.name()]["losses"]), LOSS_TOL);
        if p == Precision::Fp16 {
            check_scaling(&what, &r, &j["fp16"]);
        }
    }
}

#[test]
fn loss_scale_op_equals_torch_amp_update_scale() {
    let cases: Json = serde_json::from_str(&std::fs::read_to_string(common::fixture("precision/loss_scale_update.json")).unwrap()).unwrap();
    for c in cases.as_array().unwrap() {
        let f = |k: &str| c[k].as_f64().unwrap();
        let mut g = Graph::new("loss_scale");
        let state = g.input("state", InputKind::State, DType::F32, [2]).unwrap();
        let finite = g.input("finite", InputKind::Data, DType::F32, Shape::scalar()).unwrap();
        let op = Op::LossScale { interval: c["interval"].as_u64().unwrap() as usize, growth: f("growth"), backoff: f("backoff") };
        let y = g.add(op, &[state, finite]).unwrap();
        g.set_output("next", y).unwrap();
        let ins = HashMap::from([
            ("state".to_string(), Value::Float(Tensor { shape: vec![2], data: vec![f("scale") as f32, f("good") as f32] })),
            ("finite".to_string(), Value::scalar(1.0 - f("found_inf"))),
        ]);
        let want = [f("next_scale") as f32, f("next_good") as f32];
        let got = Interpreter::<f32>::new(&g).unwrap().run(&ins).unwrap();
        assert_eq!(got["next"].as_float().unwrap().data, want, "interpreter, {c}");
        let mut cp = qatc_runtime::CpuProgram::with_kir_eval(qatc_kernels::lower(&g).unwrap()).unwrap();
        assert_eq!(cp.run(&ins).unwrap()["next"].as_float().unwrap().data, want, "compiled, {c}");
    }
}
