//! The `precision` stage: what it builds (a snapshot of `qatc dump --after precision` for a
//! 1-layer model, and the rules of `passes/src/precision/rules.rs` checked on whole steps), and
//! what loss scaling does when a step runs (skip, halve, grow, resume).

mod common;

use std::collections::HashMap;

use qatc::cli::train::Trainer;
use qatc::data::TokenFile;
use qatc::frontend::config::Gpt2Config;
use qatc::model::Model;
use qatc::step::{self, StepOptions};
use qatc_ir::{print, DType, Graph, InputKind, NodeId, Op, QuantScheme, QuantSpec};
use qatc_passes::lora::LoraOptions;
use qatc_passes::precision::{LossScaling, Precision, GRADS_FINITE, LOSS_SCALE};
use qatc_passes::quant::QuantOptions;
use qatc_runtime::Value;

fn one_layer() -> Gpt2Config {
    Gpt2Config { n_embd: 8, n_layer: 1, n_head: 2, n_positions: 8, vocab_size: 11, layer_norm_epsilon: 1e-5 }
}

fn two_layers() -> Gpt2Config {
    Gpt2Config { n_embd: 16, n_layer: 2, n_head: 2, n_positions: 8, vocab_size: 13, layer_norm_epsilon: 1e-5 }
}

fn qlora(b: usize, t: usize, p: Precision) -> StepOptions {
    let mut o = StepOptions::new(b, t);
    o.model.full_finetune = false;
    o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 4, scheme: QuantScheme::Sym }));
    o.model.lora = Some(LoraOptions::new(2));
    o.clip = Some(1.0);
    o.precision = p;
    o
}

fn stage(cfg: &Gpt2Config, o: &StepOptions, name: &str) -> Option<Graph> {
    let mut found = None;
    step::train(cfg, o, |n, g| {
        if n.name() == name {
            found = Some(g.clone());
        }
    })
    .unwrap();
    found
}

#[test]
fn the_precision_stage_of_the_one_layer_step() {
    for p in [Precision::Bf16, Precision::Fp16] {
        let g = stage(&one_layer(), &qlora(1, 4, p), "precision").expect("the stage runs");
        insta::assert_snapshot!(format!("qlora_{p}"), print(&g));
    }
    assert!(stage(&one_layer(), &qlora(1, 4, Precision::Fp32), "precision").is_none(), "fp32 has no precision stage");
}

/// Whether any operand of `n` is a float value in `d`.
fn reads(g: &Graph, n: NodeId, d: DType) -> bool {
    g.operands(n).iter().any(|&o| g.ty(o).dtype == d)
}

/// The table, checked on every node of whole steps (QAT + LoRA with clipping, and full
/// fine-tune), unfused as the planner sees them.
#[test]
fn the_table_holds_on_whole_steps() {
    for p in [Precision::Bf16, Precision::Fp16] {
        let c = p.compute();
        let mut full = StepOptions::new(2, 8);
        full.precision = p;
        for (what, o) in [("qlora", qlora(2, 8, p)), ("full fine-tune", full)] {
            let (g, reports) = step::train(&two_layers(), &o, |_, _| {}).unwrap();
            let what = format!("{what} {p}");
            let report = reports.iter().find(|r| r.pass == qatc::step::Stage::Precision).expect("a report");
            assert!(report.counters["casts"] > 0 && report.counters["values_in_compute_type"] > 0, "{what}: {report}");
            let mut casts_of: HashMap<NodeId, Vec<DType>> = HashMap::new();
            for n in g.node_ids() {
                let node = g.node(n);
                let ty = &node.ty;
                match &node.op {
                    // GEMMs: operands and result in C
                    Op::MatMul { .. } => {
                        assert!(g.operands(n).iter().all(|&o| g.ty(o).dtype == c) && ty.dtype == c, "{what}: {}", g.describe(n))
                    }
                    // row ops store C; the loss is f32
                    Op::LayerNorm { .. } | Op::Softmax { .. } | Op::CrossEntropyGrad | Op::Gather => {
                        assert_eq!(ty.dtype, c, "{what}: {}", g.describe(n))
                    }
                    Op::CrossEntropy => assert_eq!(ty.dtype, DType::F32, "{what}: the loss"),
                    Op::Dequantize { to, .. } => assert_eq!(*to, c, "{what}: 4-bit weights dequantize straight to {c}"),
                    // AdamW on f32 masters: no operand in a lower type
                    Op::AdamM { .. } | Op::AdamV { .. } | Op::AdamParam { .. } => {
                        assert!(!reads(&g, n, c) && ty.dtype == DType::F32, "{what}: {}", g.describe(n))
                    }
                    Op::Cast { to } => casts_of.entry(g.operands(n)[0]).or_default().push(*to),
                    _ => {}
                }
            }
            // every trainable input: an f32 master, converted to C once (its one copy per step)
            for id in g.inputs() {
                if g.input_kind(id) == Some(InputKind::Trainable) {
                    assert_eq!(g.ty(id).dtype, DType::F32, "{what}: master {}", g.describe(id));
                    let copies = casts_of.get(&id).map_or(0, |v| v.iter().filter(|&&d| d == c).count());
                    assert_eq!(copies, 1, "{what}: {} has {copies} {c} copies", g.describe(id));
                }
            }
            // no value is converted twice to the same type
            for (n, tos) in &casts_of {
                let mut t = tos.clone();
                t.dedup();
                assert_eq!(t.len(), tos.len(), "{what}: {} converted twice", g.describe(*n));
            }
            for o in g.outputs().iter().filter(|o| o.update) {
                assert_eq!(g.ty(o.node).dtype, DType::F32, "{what}: update {}", o.name);
            }
            let scaled = g.find_input(LOSS_SCALE).is_some();
            assert_eq!(scaled, p.loss_scaling(), "{what}: loss scaling only for fp16");
            if scaled {
                // every update but the scale's own is kept only when the gradients were finite
                let finite = g.output(GRADS_FINITE).expect("grads_finite");
                for o in g.outputs().iter().filter(|o| o.update) {
                    let op = &g.node(o.node).op;
                    if o.name == LOSS_SCALE {
                        assert!(matches!(op, Op::LossScale { interval: 2000, .. }), "{what}");
                        assert_eq!(g.operands(o.node)[1], finite);
                    } else {
                        assert!(matches!(op, Op::Select), "{what}: update {} is not gated", o.name);
                    }
                }
                assert!(g.node_ids().iter().all(|&n| g.node(n).name.as_deref() != Some("loss.grad")), "{what}: the seed is the scale");
            }
        }
    }
}

/// The tiny fixture model, 4-bit + LoRA, fp16 with a growth interval of 3, run by the trainer on
/// the interpreter; a steps' scale is read before it runs.
fn fp16_trainer(interval: usize) -> (Trainer, TokenFile) {
    let m = Model::open(&common::fixture("tiny/f32_prefix/model.safetensors")).unwrap();
    let data = TokenFile::load(&common::fixture("tiny/tokens.bin")).unwrap();
    let mut o = qlora(2, 16, Precision::Fp16);
    o.loss_scaling = LossScaling { interval, ..Default::default() };
    (Trainer::new(&m, o, None, 0).unwrap(), data)
}

/// The scale state [scale, good steps], read back from the executor.
fn scale_state(tr: &Trainer) -> Vec<f32> {
    tr.state().unwrap()[LOSS_SCALE].as_float().unwrap().data.clone()
}

#[test]
fn a_non_finite_step_changes_nothing_but_the_scale_and_good_steps_grow_it() {
    let (mut tr, data) = fp16_trainer(3);
    assert_eq!(tr.loss_scale().unwrap(), Some(65536.0));
    let mut scales = Vec::new();
    for s in 0..4 {
        scales.push(tr.loss_scale().unwrap().unwrap());
        let out = tr.step(&data, s, 1e-3).unwrap();
        assert_eq!(out[GRADS_FINITE].item(), Some(1.0));
    }
    // three good steps double the scale; the count restarts
    assert_eq!(scales, [65536.0, 65536.0, 65536.0, 131072.0]);
    assert_eq!(scale_state(&tr), [131072.0, 1.0]);
    // an overflow: a scale whose products leave fp16's range makes every gradient infinite
    let before = tr.state().unwrap();
    tr.set_input(LOSS_SCALE, Value::floats([2], &[3e38, 1.0]).unwrap()).unwrap();
    let out = tr.step(&data, 4, 1e-3).unwrap();
    assert_eq!(out[GRADS_FINITE].item(), Some(0.0), "the step is skipped");
    let after = tr.state().unwrap();
    let mut kept = 0;
    for (name, v) in &before {
        let kind = tr.graph.find_input(name).and_then(|i| tr.graph.input_kind(i));
        if name != LOSS_SCALE && matches!(kind, Some(InputKind::Trainable | InputKind::State)) {
            assert_eq!(&after[name], v, "{name} changed on a skipped step");
            kept += 1;
        }
    }
    assert!(kept > 20, "weights, moments and the step count: {kept}");
    assert_eq!(scale_state(&tr), [1.5e38, 0.0], "halved, count reset");
    assert!(out["loss"].item().unwrap().is_finite(), "the loss is computed before scaling");
}

#[test]
fn the_loss_scale_is_saved_and_restored_with_the_run() {
    let (mut tr, data) = fp16_trainer(2);
    for s in 0..3 {
        tr.step(&data, s, 1e-3).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.safetensors");
    std::fs::write(&path, tr.save_state().unwrap()).unwrap();
    let (mut resumed, _) = fp16_trainer(2);
    resumed.load_state(&path, false).unwrap();
    assert_eq!(scale_state(&resumed), scale_state(&tr));
    assert_eq!(scale_state(&tr), [131072.0, 1.0]);
    // and both continue identically
    let (a, b) = (tr.step(&data, 3, 1e-3).unwrap(), resumed.step(&data, 3, 1e-3).unwrap());
    assert_eq!(a["loss"], b["loss"]);
    assert_eq!(scale_state(&tr), scale_state(&resumed));
}

/// The most activation bytes the executed plan (`qatc plan`'s, for the CPU) holds at once.
fn activations_at_most(cfg: &Gpt2Config, o: &StepOptions) -> usize {
    let (_, e) = qatc::cli::plan::build(cfg, o, &qatc_driver::Target::cpu(), &qatc_driver::Options::default()).unwrap();
    e.plan.max_of(qatc_ir::Category::Activations)
}

/// `qatc plan --precision bf16` on GPT-2 124M, B 8, T 1024, 4-bit + LoRA: the activations the
/// plan holds at most are at most 0.55x of fp32's (the bound; they are stored in 2 bytes
/// instead of 4).
#[test]
fn bf16_plans_at_most_0_55x_of_the_f32_activations_on_124m() {
    let cfg = Gpt2Config::preset("124M").unwrap();
    let mut o = StepOptions::new(8, 1024);
    o.model.full_finetune = false;
    o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 64, scheme: QuantScheme::Sym }));
    o.model.lora = Some(LoraOptions::new(16));
    let a32 = activations_at_most(&cfg, &o);
    o.precision = Precision::Bf16;
    let a16 = activations_at_most(&cfg, &o);
    eprintln!("124M B8 T1024 activations at most: fp32 {a32} B, bf16 {a16} B ({:.3}x)", a16 as f64 / a32 as f64);
    assert!(a32 > 0 && (a16 as f64) <= 0.55 * a32 as f64, "bf16 {a16} vs fp32 {a32}");
}

/// The compiled CPU executor of a bf16 step holds what the plan of it says, to the byte.
#[cfg(feature = "llvm")]
#[test]
fn the_cpu_executor_holds_what_the_bf16_plan_says() {
    let m = Model::open(&common::root().join("examples/gpt2-shakespeare-small/model.safetensors")).unwrap();
    let mut o = qlora(4, 128, Precision::Bf16);
    o.clip = None;
    o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 32, scheme: QuantScheme::Q4_0 }));
    o.model.lora = Some(LoraOptions::new(16));
    o.fuse = Some(Default::default());
    let options = qatc_driver::Options::default();
    let (_, e) = qatc::cli::plan::build(&m.cfg, &o, &qatc_driver::Target::cpu(), &options).unwrap();
    let (g, _) = step::train(&m.cfg, &o, |_, _| {}).unwrap();
    let (exec, _) = qatc_driver::cpu_program(&g, &options).unwrap();
    eprintln!("bf16 demo step: executor holds {} B, planned peak {} B", exec.held_bytes(), e.plan.peak_bytes());
    assert_eq!(exec.held_bytes(), e.plan.peak_bytes());
}
