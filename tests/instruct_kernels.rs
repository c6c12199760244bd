//! The kernels of an instruction step (packed examples: the weighted cross-entropy and the packed
//! softmax, position ids through the position embedding) on every path, against the reference
//! interpreter, on the tiny model (B 4, T 32: more rows of logits than its width, so that fusion
//! chunks the cross-entropy even where the head trains; a mask with prompts and padding out,
//! sequences of several examples and padding, and of one): the compiled CPU step (LLVM) unfused and fused, its
//! cross-entropy chunked as the CPU runs it, as CUDA runs it (threads sharing a row), and in tiles
//! with an online softmax (a frozen head); the CUDA executor on the emulated GPU against the CPU
//! executor; and every kernel of the step through NVRTC. (`tests/cuda_c_on_cpu.rs` runs the
//! step's CUDA C on the CPU.)

mod common;

use std::collections::HashMap;

use qatc::batches::loss_weights;
use qatc::model::Model;
use qatc::step::{BatchInputs, StepOptions};
use qatc::trainer::Trainer;
use qatc_kernels::{CudaSettings, LowerOptions, Program, Target};
use qatc_runtime::cuda::{CudaProgram, HostGpu};
use qatc_runtime::{CpuProgram, Interpreter, Value};

use common::gpu::{options, TINY};

const B: usize = 4;
const T: usize = 32;
const LR: f64 = 1e-3;

/// The step of the tiny model (4-bit + LoRA or a full fine-tune), taking loss weights and
/// position ids.
fn step_options(lora: bool, fuse: bool) -> StepOptions {
    let mut o = options(lora, fuse, B, T);
    o.model.inputs = BatchInputs { weights: true, positions: true };
    o
}

/// Each sequence's examples (positions each), the rest padding: several, one, one that fills it.
const EXAMPLES: [&[usize]; B] = [&[6, 7, 11], &[20], &[32], &[3, 5, 9, 9]];

/// The position ids, and which positions are padding.
fn positions() -> (Vec<i32>, Vec<bool>) {
    let (mut pos, mut pad) = (Vec::new(), Vec::new());
    for ex in EXAMPLES {
        let used: usize = ex.iter().sum();
        for &n in ex {
            pos.extend(0..n as i32);
        }
        pos.extend(0..(T - used) as i32);
        pad.extend((0..T).map(|i| i >= used));
    }
    (pos, pad)
}

/// Prompts (the first 3 targets of each example) and padding out of the loss.
fn mask() -> Vec<f32> {
    let (pos, pad) = positions();
    (0..B * T).map(|i| if pad[i] || pos[i] < 3 { 0.0 } else { 1.0 }).collect()
}

/// The step's state and one batch of data.
fn inputs(tr: &Trainer) -> HashMap<String, Value<f32>> {
    let data = qatc::data::TokenFile::open(&common::root().join(TINY.1)).expect("tokens");
    let (ids, targets) = data.batch(0, B, T).expect("a batch");
    let mut v = tr.state().expect("the state");
    v.insert("ids".into(), Value::ints([B, T], ids).expect("ids"));
    v.insert("targets".into(), Value::ints([B, T], targets).expect("targets"));
    v.insert(
        "weights".into(),
        Value::floats(vec![B, T], &loss_weights(&[&mask()], 1.0)[0].iter().map(|&w| f64::from(w)).collect::<Vec<_>>()).expect("weights"),
    );
    v.insert("positions".into(), Value::ints([B, T], positions().0).expect("positions"));
    v.insert("lr".into(), Value::scalar(LR));
    v
}

fn trainer(lora: bool, fuse: bool) -> Trainer {
    let m = Model::open(&common::root().join(TINY.0)).expect("the model");
    Trainer::new(&m, step_options(lora, fuse), None, 3).expect("a trainer")
}

fn floats(v: &Value<f32>) -> Vec<f64> {
    match v {
        Value::Float(t) => t.data.iter().map(|&x| f64::from(x)).collect(),
        Value::Int(t) => t.data.iter().map(|&x| f64::from(x)).collect(),
    }
}

fn cpu(prog: Program) -> CpuProgram {
    #[cfg(feature = "llvm")]
    {
        let jit = qatc_kernels::llvm::Jit::compile(&prog.kernels).expect("compiles");
        CpuProgram::new(prog, Box::new(jit)).expect("a CPU program")
    }
    #[cfg(not(feature = "llvm"))]
    CpuProgram::with_kir_eval(prog).expect("a CPU program")
}

/// The loss and every gradient of `got` against `want`: the loss within 1e-6, each gradient
/// within `tol` of its largest element.
fn compare(what: &str, got: &HashMap<String, Value<f32>>, want: &HashMap<String, Value<f32>>, tol: f64) {
    let (l, w) = (floats(&got["loss"])[0], floats(&want["loss"])[0]);
    assert!((l - w).abs() <= 1e-6, "{what}: loss {l} against {w}");
    let mut grads = 0;
    for (name, v) in want.iter().filter(|(n, _)| n.starts_with("grad:")) {
        let e = common::rel_err(&floats(&got[name]), &floats(v));
        assert!(e <= tol, "{what}: {name} is {e:e} off");
        grads += 1;
    }
    assert!(grads > 3, "{what}: {grads} gradients compared");
}

#[test]
fn the_compiled_cpu_step_equals_the_interpreter() {
    for lora in [true, false] {
        let reference = trainer(lora, false);
        let inp = inputs(&reference);
        let want = Interpreter::<f32>::new(&reference.graph).expect("an interpreter").run(&inp).expect("runs");
        let unfused = cpu(qatc_kernels::lower(&reference.graph).expect("lowers")).run(&inp).expect("runs");
        compare(&format!("lora {lora}, unfused"), &unfused, &want, 1e-5);
        let fused = trainer(lora, true);
        for sequential_rows in [false, true] {
            let what = format!("lora {lora}, fused, sequential rows {sequential_rows}");
            // chunks of 5 rows (a last one of 3); a frozen head on one thread per row walks the
            // vocabulary in tiles of 16 with an online softmax
            let o = LowerOptions { ce_chunk_rows: Some(5), sequential_rows, ce_tile_cols: Some(16), ..Default::default() };
            let prog = qatc_kernels::lower_with(&fused.graph, &o).expect("lowers");
            assert_eq!(prog.cross_entropy.len(), 1, "{what}: the cross-entropy is chunked");
            let online = prog.kernels.iter().any(|k| k.family == "cross_entropy.online_tile");
            assert_eq!(online, lora && sequential_rows, "{what}: the online softmax where the head is frozen");
            let packed = prog.kernels.iter().filter(|k| k.params.iter().any(|p| p.name == "positions")).count();
            assert!(packed > 0, "{what}: kernels read the position ids");
            let got = cpu(prog).run(&inp).expect("runs");
            compare(&what, &got, &want, 1e-5);
        }
    }
}

#[test]
fn the_cuda_executor_on_the_emulated_gpu_equals_the_cpu() {
    for (lora, fuse) in [(true, true), (false, false)] {
        let tr = trainer(lora, fuse);
        let inp = inputs(&tr);
        let target = Target::cuda(None, CudaSettings::default());
        let prog = qatc_kernels::lower_with(&tr.graph, &target.lower_options()).expect("lowers");
        let want = CpuProgram::with_kir_eval(prog.clone()).expect("a CPU program").run(&inp).expect("runs");
        let mut gpu = CudaProgram::new(prog, HostGpu::new(1 << 30), &target, None).expect("builds on the emulated GPU");
        let got = gpu.run(&inp).expect("runs");
        compare(&format!("lora {lora}, fused {fuse}"), &got, &want, 5e-6);
        let interp = Interpreter::<f32>::new(&tr.graph).expect("an interpreter").run(&inp).expect("runs");
        compare(&format!("lora {lora}, fused {fuse}, against the interpreter"), &got, &interp, 1e-5);
    }
}

#[test]
fn every_kernel_compiles_with_nvrtc() {
    let Some(nv) = common::nvrtc::nvrtc() else { return };
    for (lora, fuse) in [(true, true), (false, false)] {
        let tr = trainer(lora, fuse);
        let (_, kernels) = qatc_kernels::cuda_kernels(&tr.graph, &Target::of(qatc_kernels::TargetKind::Cuda)).expect("lowers");
        assert!(kernels.iter().any(|k| k.source.contains("positions")), "the packed softmax reads the position ids");
        for arch in qatc_kernels::nvrtc::Arch::ALL {
            let (_, report) =
                common::nvrtc::build(&nv, &format!("instruct-{lora}-{fuse}"), &kernels, arch, Some(&common::nvrtc::test_cache()));
            eprintln!("lora {lora}, fused {fuse}: {}", report.summary());
        }
    }
}

#[test]
fn the_plan_holds_the_loss_weights_and_position_ids() {
    // what `qatc train` allocates (the executed plan, `qatc_driver::plan`) has the two data
    // inputs of instruction batches, B x T each, among the step's per-step data
    let tr = trainer(true, true);
    for target in [Target::cpu(), Target::cuda(None, CudaSettings::default())] {
        let planned = qatc_driver::plan(&tr.graph, &target, &qatc_driver::Options::default()).expect("plans");
        for name in ["weights", "positions", "ids", "targets"] {
            let b = planned.plan.buffers.iter().find(|b| b.name == name).unwrap_or_else(|| panic!("{target:?}: no {name} in the plan"));
            assert_eq!(b.bytes, B * T * 4, "{name}");
        }
        let data: usize = planned
            .plan
            .buffers
            .iter()
            .filter(|b| ["weights", "positions", "ids", "targets"].contains(&b.name.as_str()))
            .map(|b| b.size)
            .sum();
        assert!(planned.plan.data_bytes >= data, "{target:?}: {} data bytes for {data}", planned.plan.data_bytes);
    }
}
