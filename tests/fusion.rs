//! Fusion preserves the training step: the tiny fixture (B 2, T 16) trained with and without the
//! `fuse` stage gives the same loss, the same gradients and the same updated weights and Adam
//! moments, within 1e-5 relative per tensor (max |fused - unfused| / max |unfused|), for 4-bit +
//! LoRA r=4 and for a full fine-tune. The kernels' bodies are the original ops in the original
//! order, so the interpreter's results are in fact bit-identical; 1e-5 is the contract a compiled
//! kernel (other summation orders, FMA) will be held to.

mod common;

use std::collections::HashMap;

use qatc::cli::train::Trainer;
use qatc::data::TokenFile;
use qatc::model::Model;
use qatc::step::StepOptions;
use qatc_ir::{Op, QuantScheme, QuantSpec};
use qatc_passes::fusion::cost::graph_traffic;
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::LoraOptions;
use qatc_passes::quant::QuantOptions;
use qatc_runtime::Value;

const TOL: f64 = 1e-5;

fn model() -> Model {
    Model::open(&common::fixture("tiny/f32_prefix/model.safetensors")).unwrap()
}

fn qlora(o: &mut StepOptions) {
    o.model.full_finetune = false;
    o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 32, scheme: QuantScheme::Sym }));
    o.model.lora = Some(LoraOptions::new(4));
}

fn floats(v: &Value<f32>) -> Vec<f64> {
    v.as_float().map(|t| t.data.iter().map(|&x| x as f64).collect()).unwrap_or_default()
}

/// Runs `steps` steps with and without fusion and compares every output and every state tensor.
fn compare(mut o: StepOptions, steps: usize, clip: Option<f64>) {
    let m = model();
    let data = TokenFile::open(&common::fixture("tiny/tokens.bin")).unwrap();
    o.keep_grads = true;
    o.clip = clip;
    let plain = o.clone();
    o.fuse = Some(FuseOptions::default());
    let mut a = Trainer::new(&m, plain, None, 3).unwrap();
    let mut b = Trainer::new(&m, o, None, 3).unwrap();
    let kernels = b.graph.node_ids().iter().filter(|&&n| matches!(b.graph.node(n).op, Op::Kernel { .. })).count();
    assert!(kernels > 10, "the fused step has {kernels} kernels");
    let (la, lb) = (graph_traffic(&a.graph).0, graph_traffic(&b.graph).0);
    assert!(lb.launches < la.launches && lb.bytes < la.bytes, "fusion saves launches and bytes: {la:?} -> {lb:?}");
    for s in 0..steps {
        let oa = a.step(&data, s, 1e-2).unwrap();
        let ob = b.step(&data, s, 1e-2).unwrap();
        assert_eq!(oa.len(), ob.len());
        let mut n = 0;
        for (name, va) in &oa {
            let e = common::rel_err(&floats(&ob[name]), &floats(va));
            assert!(e <= TOL, "step {s}: output {name} differs by {e:e} relative");
            n += name.starts_with("grad:") as usize;
        }
        assert!(n > 0 && oa.contains_key("loss"));
    }
    let mut checked = 0;
    let sb: HashMap<String, Value<f32>> = b.state().unwrap();
    for (name, va) in &a.state().unwrap() {
        if let (Some(vb), Value::Float(_)) = (sb.get(name), va) {
            let e = common::rel_err(&floats(vb), &floats(va));
            assert!(e <= TOL, "after {steps} steps: {name} differs by {e:e} relative");
            checked += 1;
        }
    }
    assert!(checked > 10);
}

#[test]
fn qlora_step_is_unchanged_by_fusion() {
    let mut o = StepOptions::new(2, 16);
    qlora(&mut o);
    compare(o, 2, None);
}

#[test]
fn full_finetune_step_is_unchanged_by_fusion() {
    compare(StepOptions::new(2, 16), 2, None);
}

#[test]
fn clipped_qlora_step_is_unchanged_by_fusion() {
    let mut o = StepOptions::new(2, 16);
    qlora(&mut o);
    compare(o, 1, Some(0.5));
}

/// The memory plan runs on the fused step: what a kernel computes inside takes no arena bytes, so
/// the 4-bit + LoRA step's arena shrinks. (A full fine-tune's grows: the multi-tensor AdamW kernel
/// writes every new parameter and moment into one packed buffer, which the planner keeps and
/// copies back: this graph-level planner does not see the lowering write it in place,
/// `tests/inplace_adamw.rs`.)
#[test]
fn the_memory_plan_runs_on_the_fused_step() {
    use qatc_passes::plan::{plan, PlanOptions};
    for full in [false, true] {
        let m = model();
        let mut o = StepOptions::new(2, 16);
        if !full {
            qlora(&mut o);
        }
        let (g, _) = qatc::step::train(&m.cfg, &o, |_, _| {}).unwrap();
        o.fuse = Some(FuseOptions::default());
        let (f, _) = qatc::step::train(&m.cfg, &o, |_, _| {}).unwrap();
        let (pg, pf) = (plan(&g, &PlanOptions::default()).unwrap(), plan(&f, &PlanOptions::default()).unwrap());
        pg.verify().unwrap();
        pf.verify().unwrap();
        eprintln!("full={full}: arena peak {} -> {} bytes", pg.peak_bytes(), pf.peak_bytes());
        if !full {
            assert!(pf.peak_bytes() < pg.peak_bytes(), "{} -> {}", pg.peak_bytes(), pf.peak_bytes());
        }
    }
}

/// `qatc compile` writes the fused step and the report, prints what it saved; `--no-fuse` does
/// neither.
#[test]
fn compile_writes_the_fused_step_and_the_report() {
    let model = common::fixture("tiny/f32_prefix/model.safetensors");
    let dir = tempfile::tempdir().unwrap();
    for (sub, extra) in [("fused", vec![]), ("plain", vec!["--no-fuse"])] {
        let out = dir.path().join(sub);
        let mut args =
            vec!["compile", model.to_str().unwrap(), "--batch", "2", "--seq", "16", "--bits", "4", "--group", "32", "--lora", "r=4"];
        args.extend(extra);
        args.extend(["-o", out.to_str().unwrap()]);
        let run = std::process::Command::new(env!("CARGO_BIN_EXE_qatc")).args(&args).output().unwrap();
        let stdout = String::from_utf8_lossy(&run.stdout);
        assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
        if sub == "fused" {
            assert!(stdout.contains("fusion      kernels") && stdout.contains("rules fired"), "{stdout}");
            let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("fusion.json")).unwrap()).unwrap();
            assert!(report["kernels_after"].as_u64() < report["kernels_before"].as_u64());
            assert!(report["bytes_after"].as_u64() < report["bytes_before"].as_u64());
            assert_eq!(report["saturation"]["stop_reason"], "saturated");
            let fused = qatc_ir::parse(&std::fs::read_to_string(out.join("fused.qir")).unwrap()).unwrap();
            let train = qatc_ir::parse(&std::fs::read_to_string(out.join("train.qir")).unwrap()).unwrap();
            assert!(fused.node_ids().iter().any(|&n| matches!(fused.node(n).op, Op::Kernel { .. })));
            assert!(!train.node_ids().iter().any(|&n| matches!(train.node(n).op, Op::Kernel { .. })), "train.qir is the unfused step");
        } else {
            assert!(!out.join("fused.qir").exists() && !out.join("fusion.json").exists());
            assert!(!stdout.contains("fusion "), "{stdout}");
        }
    }
}

/// After `remat` (block checkpointing), the recomputed copies of forward values stay copies: fusion
/// neither merges them back into the saved originals nor changes a result.
#[test]
fn remat_then_fusion_is_unchanged() {
    let mut o = StepOptions::new(2, 16);
    qlora(&mut o);
    o.checkpoint = qatc_passes::remat::Checkpoint::Blocks;
    compare(o.clone(), 1, None);
    o.fuse = Some(FuseOptions::default());
    let (f, _) = qatc::step::train(&model().cfg, &o, |_, _| {}).unwrap();
    let recomputed = |g: &qatc_ir::Graph| -> usize {
        g.node_ids().iter().filter(|&&n| qatc_passes::plan::region::is_recompute_name(g.node(n).name.as_deref())).count()
    };
    let text = qatc_ir::print(&f);
    assert!(recomputed(&f) > 0 || text.contains(".recompute\""), "the fused step still recomputes");
}

/// Gradient accumulation fuses too: K micro-batches' steps are fused (the loss gradient's seed,
/// scaled by 1/K, is a body of constants alone and stays unfused instead of failing the whole
/// extraction), with the same results as the unfused step.
#[test]
fn accumulated_qlora_step_is_fused_and_unchanged() {
    let mut o = StepOptions::new(2, 16);
    qlora(&mut o);
    o.grad_accum = 3;
    compare(o.clone(), 1, None);
    o.fuse = Some(FuseOptions::default());
    let (_, reports) = qatc::step::train(&model().cfg, &o, |_, _| {}).unwrap();
    let report = reports.iter().find_map(|r| r.fusion.as_deref()).expect("a fusion report");
    assert_eq!(report.extraction.fallback, None, "the accumulated step was left unfused");
    assert!(report.kernels_after * 2 < report.kernels_before, "{} -> {} kernels", report.kernels_before, report.kernels_after);
}
