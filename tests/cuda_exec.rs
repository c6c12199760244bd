//! The CUDA executor (`qatc_runtime::cuda::CudaProgram`) driven as the trainer drives any
//! executor (`TrainStep`: state set once, per step only the data in and the outputs out, the
//! state read back at the end):
//!
//! - on the host emulation of the GPU (`HostGpu`: kernels through the kernel-IR evaluator, GEMMs
//!   through the cuBLAS host model), always: the tiny training step, 4-bit + LoRA and full
//!   fine-tune, fused and unfused, with and without graph capture, over several steps, against
//!   the CPU executor (`CpuProgram` with the same evaluator); with and without the graph and
//!   hoisting bit for bit; what crosses between host and device per step; a forward-only graph
//!   (eval) against the interpreter; the kernels built by NVRTC through the executor's build;
//!   `--precision bf16|fp16` (16-bit buffers and GEMMs, fp16 loss scaling resident, an injected
//!   overflow skipping the update) against the CPU;
//! - on a GPU (`CudaDriver`), where there is one: ten steps of the tiny and Shakespeare GPT-2
//!   steps against the CPU, in fp32 and in bf16 and fp16 (bench/gpu.sh runs them).

mod common;
#[path = "common/lockstep.rs"]
mod lockstep;

use std::collections::HashMap;

use qatc::data::TokenFile;
use qatc::model::Model;
use qatc::step::StepOptions;
use qatc::trainer::Trainer;
use qatc_ir::{DType, InputKind};
use qatc_kernels::program::BufKind;
use qatc_kernels::{CudaSettings, Hoist, Program, Target};
use qatc_passes::precision::{LossScaling, Precision, GRADS_FINITE, LOSS_SCALE};
use qatc_runtime::cuda::{CudaDriver, CudaProgram, GpuApi, HostGpu, KernelBuild};
use qatc_runtime::{CpuProgram, Interpreter, TrainStep, Value};

use common::gpu::{gpu, options, SHAKESPEARE, TINY};
use lockstep::{bits_equal, drive, floats, give_batch, judge16, lockstep, read_state, set};

/// A step's program and its initial state (weights, zero moments), on a model and token file
/// from the repository.
fn setup(model: &str, tokens: &str, o: &StepOptions) -> (Program, HashMap<String, Value<f32>>, TokenFile) {
    let m = Model::open(&common::root().join(model)).expect("the model");
    let data = TokenFile::open(&common::root().join(tokens)).expect("tokens");
    let tr = Trainer::new(&m, o.clone(), None, 3).expect("a trainer");
    let prog = qatc_kernels::lower(&tr.graph).expect("lowers");
    (prog, tr.state().expect("the state"), data)
}

/// A CUDA target with the default settings (strict fp32 GEMMs, every variant, graph replay,
/// the frozen steps that shrink hoisted).
fn cuda() -> Target {
    Target::cuda(None, CudaSettings::default())
}

/// `cuda()` with or without graph replay.
fn cuda_graph(graph: bool) -> Target {
    Target::cuda(None, CudaSettings { no_graph: !graph, ..CudaSettings::default() })
}

fn emulated(prog: &Program, t: Target) -> CudaProgram<HostGpu> {
    CudaProgram::new(prog.clone(), HostGpu::new(1 << 30), &t, None).expect("builds on the emulated GPU")
}

/// The tiny step through the CUDA executor on the emulated GPU equals the CPU executor, step by
/// step from the same state over 3 steps (the executor keeping its state resident): the loss
/// within 1e-6, the gradients within 5e-6 of each tensor's largest element (f32 sums of many
/// rows in two orders), the parameters and moments the
/// step updated (read back) within 1e-4 norm-wise (AdamW's first steps move a parameter by about
/// lr whatever its gradient's size, so a gradient near zero that differs in its last bits moves
/// it differently: LoRA's B, zero at the start, shows 1e-5). Not bit for bit: the kernels are the same
/// evaluator on both, but the GEMMs sum in other orders (the cuBLAS model against the gemm
/// crate). The executor with and without its graph and hoisting, and with the general kernels
/// (`CudaSettings::GENERAL`): bit for bit.
#[test]
fn the_tiny_step_through_the_cuda_executor_equals_the_cpu() {
    let steps = 3;
    for (qlora, fuse, graph) in [(true, true, true), (true, false, false), (false, true, false), (false, false, true)] {
        let what = format!("4-bit + LoRA {qlora}, fused {fuse}, graph {graph}");
        let o = options(qlora, fuse, 2, 16);
        let (prog, state, data) = setup(TINY.0, TINY.1, &o);
        let mut cpu = CpuProgram::with_kir_eval(prog.clone()).expect("a CPU program");
        let mut gpu = emulated(&prog, cuda_graph(graph));
        let (worst, losses) = lockstep(&mut gpu, &mut cpu, &prog, &state, &data, &o, steps);
        let (launches, calls) = gpu.per_step();
        let b = gpu.bytes();
        eprintln!(
            "{what}: {launches} launches and {calls} GEMM calls per step, {} hoisted steps; device {} (arena {}, persistent {}, data {}, scratch {}); worst output error {:.1e} ({}), state {:.1e} ({})",
            gpu.plan().hoisted_steps(),
            b.device_total(),
            b.arena,
            b.persistent,
            b.data,
            b.scratch,
            worst.outputs.0,
            worst.outputs.1,
            worst.state.0,
            worst.state.1
        );
        let loss_err = losses.chunks(2).map(|p| (p[0] - p[1]).abs() / p[1].abs()).fold(0.0f64, f64::max);
        assert!(loss_err <= 1e-6, "{what}: a loss off by {loss_err:e}");
        assert!(worst.outputs.0 <= 5e-6, "{what}: {} off by {:e}", worst.outputs.1, worst.outputs.0);
        assert!(worst.state.0 <= 1e-4, "{what}: {} off by {:e}", worst.state.1, worst.state.0);
        assert_eq!(gpu.api().captures, usize::from(graph), "{what}: captured once, replayed after");
        // the other way of running it: the same arithmetic, so the same bits; with the general
        // kernels instead of the writer's variants (other launch dims for the row kernels, which
        // the emulation checks every launch against)
        let one = drive(&mut emulated(&prog, cuda_graph(graph)), &prog, &state, &data, &o, steps);
        let settings = if graph { CudaSettings { no_graph: true, ..CudaSettings::GENERAL } } else { CudaSettings::default() };
        let hoist = if graph { Hoist::Shrinking } else { Hoist::Everything };
        let other = Target { hoist, ..Target::cuda(None, settings) };
        let mut hoisting = emulated(&prog, other);
        if qlora && !graph {
            // by default the 4-bit weights stay 4-bit (their dequantization grows what it reads:
            // `Hoist::Shrinking`); hoisting everything runs it once too
            assert!(
                hoisting.plan().hoisted_steps() > gpu.plan().hoisted_steps(),
                "{what}: with Hoist::Everything the 4-bit weights' dequantization is hoisted"
            );
        }
        let two = drive(&mut hoisting, &prog, &state, &data, &o, steps);
        assert!(bits_equal(&one, &two), "{what}: the graph and hoisting change no bit");
    }
}

/// The kernel families of the steps `gpu` hoisted.
fn hoisted_families<A: GpuApi>(prog: &Program, gpu: &CudaProgram<A>) -> Vec<String> {
    prog.steps
        .iter()
        .zip(&gpu.plan().hoisted)
        .filter(|(_, &h)| h)
        .map(|(s, _)| match s {
            qatc_kernels::Step::Launch { kernel, .. } => prog.kernels[*kernel].family.clone(),
            qatc_kernels::Step::Gemm(g) => format!("gemm {}", g.note),
            qatc_kernels::Step::Collective(c) => c.exchange.mnemonic().to_string(),
        })
        .collect()
}

fn options16(p: Precision, fuse: bool) -> StepOptions {
    let mut o = options(true, fuse, 2, 16);
    o.precision = p;
    o.clip = Some(1.0);
    o
}

/// `--precision bf16|fp16` through the CUDA executor on the emulated GPU: bf16/fp16 buffers, the
/// casts, the 16-bit GEMMs (A/B 16-bit, compute 32F: the cuBLAS model rounding its 16-bit
/// outputs to nearest even) and fp16's loss-scaling state resident on the device; 3 steps in
/// lock step with the CPU executor, within [`ulps16`] (a parameter's elements whose gradient is
/// within that bound of zero may step another way: at most 1% of them, by at most 2.5 lr; see
/// [`Worst::add`]). The graph and hoisting change no bit.
#[test]
fn the_tiny_step_in_bf16_and_fp16_through_the_cuda_executor_equals_the_cpu() {
    for (p, fuse) in [(Precision::Bf16, true), (Precision::Bf16, false), (Precision::Fp16, true)] {
        let what = format!("4-bit + LoRA, {p}, fused {fuse}");
        let o = options16(p, fuse);
        let (prog, state, data) = setup(TINY.0, TINY.1, &o);
        let halves = prog.buffers.iter().filter(|b| matches!(b.dtype, DType::BF16 | DType::F16)).count();
        assert!(halves > 10, "{what}: {halves} 16-bit buffers");
        let sixteen = prog.gemms().filter(|g| matches!(prog.buffers[g.a.buf].dtype, DType::BF16 | DType::F16)).count();
        assert!(sixteen > 0, "{what}: 16-bit GEMMs");
        let mut cpu = CpuProgram::with_kir_eval(prog.clone()).expect("a CPU program");
        let mut gpu = emulated(&prog, cuda());
        let (worst, losses) = lockstep(&mut gpu, &mut cpu, &prog, &state, &data, &o, 3);
        judge16(&format!("{what}: {sixteen} 16-bit GEMMs of {}", prog.gemms().count()), p, &worst, &losses);
        let one = drive(&mut emulated(&prog, cuda()), &prog, &state, &data, &o, 2);
        // by default (`Hoist::Shrinking`, as planned) the frozen f32 weights' casts to the compute
        // type run once, and no 4-bit weight's dequantization does
        let hoisted = hoisted_families(&prog, &gpu);
        assert!(hoisted.iter().any(|f| f.contains("cast")), "{what}: casts of frozen weights hoisted: {hoisted:?}");
        assert!(!hoisted.iter().any(|f| f.contains("dequant")), "{what}: no dequantization hoisted: {hoisted:?}");
        let other = Target { hoist: Hoist::Everything, ..cuda_graph(false) };
        let mut everything = emulated(&prog, other);
        let two = drive(&mut everything, &prog, &state, &data, &o, 2);
        assert!(bits_equal(&one, &two), "{what}: the graph and hoisting change no bit");
        let nothing = Target { hoist: Hoist::Nothing, ..cuda() };
        let three = drive(&mut emulated(&prog, nothing), &prog, &state, &data, &o, 2);
        assert!(bits_equal(&one, &three), "{what}: hoisting nothing changes no bit");
    }
}

/// fp16 loss scaling on the device, as on the CPU: with a growth interval of 2, two finite steps
/// double the scale (state [scale, good steps] read back from the device); an injected overflow
/// (a scale whose products leave fp16's range) skips the update (weights, moments and step count
/// unchanged, `grads_finite` 0) and halves the scale exactly, the count reset; the CPU executor
/// given the same state does the same, to the bit for the scale.
#[test]
fn fp16_loss_scaling_lives_on_the_device_and_an_overflow_skips_the_step() {
    let mut o = options16(Precision::Fp16, true);
    o.loss_scaling = LossScaling { interval: 2, ..Default::default() };
    let (prog, state, data) = setup(TINY.0, TINY.1, &o);
    let mut gpu = emulated(&prog, cuda());
    let mut cpu = CpuProgram::with_kir_eval(prog.clone()).expect("a CPU program");
    let run = drive(&mut gpu, &prog, &state, &data, &o, 2);
    assert!(run.steps.iter().all(|s| floats(&s[GRADS_FINITE]) == [1.0]), "two finite steps");
    let init = LossScaling::default().initial_state();
    assert_eq!(floats(&gpu.read_input(LOSS_SCALE).expect("read back")), [f64::from(init[0]) * 2.0, 0.0], "doubled, count reset");
    let before = read_state(&gpu, &prog);
    let overflow = Value::floats([2], &[3e38, 1.0]).expect("a scale");
    for step in [&mut gpu as &mut dyn TrainStep, &mut cpu] {
        // the frozen weights (the CPU's first), then the state after the two steps
        for (name, v) in state.iter().chain(&before) {
            set(step, name, v.clone());
        }
        set(step, LOSS_SCALE, overflow.clone());
        give_batch(step, &data, &o, 2);
        step.run().expect("the step runs");
        let out = step.outputs().expect("outputs");
        assert_eq!(floats(&out[GRADS_FINITE]), [0.0], "the step is skipped");
        assert!(floats(&out["loss"])[0].is_finite(), "the loss is computed before scaling");
        let after = read_state(step, &prog);
        for (name, v) in &before {
            if name != LOSS_SCALE {
                assert!(bits_equal_value(&after[name], v), "{name} changed on a skipped step");
            }
        }
        assert_eq!(floats(&after[LOSS_SCALE]), [f64::from(3e38f32 / 2.0), 0.0], "halved exactly, count reset");
    }
}

fn bits_equal_value(a: &Value<f32>, b: &Value<f32>) -> bool {
    let (x, y) = (floats(a), floats(b));
    x.len() == y.len() && x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits())
}

/// Per step, only the data inputs go to the device and only the outputs come back; nothing is
/// allocated after the build; frozen 4-bit weights stay packed on the device (never f32).
#[test]
fn state_stays_on_the_device_between_steps() {
    let o = options(true, true, 2, 16);
    let (prog, state, data) = setup(TINY.0, TINY.1, &o);
    let mut gpu = emulated(&prog, cuda());
    let allocated = gpu.api().allocations;
    let mut out_bufs: Vec<usize> = prog.outputs.iter().map(|(_, v)| v.buf).collect();
    out_bufs.sort();
    out_bufs.dedup();
    let readback: usize = out_bufs.iter().map(|&b| prog.buffers[b].bytes()).sum();
    let data_bytes = gpu.layout().data_bytes;
    for (name, v) in &state {
        gpu.set_input(name, v).expect("the state");
    }
    let mut traffic = Vec::new();
    for s in 0..4 {
        let (ids, targets) = data.batch(s, o.batch, o.seq).expect("a batch");
        gpu.set_input("ids", &Value::ints([o.batch, o.seq], ids).expect("ids")).expect("ids");
        gpu.set_input("targets", &Value::ints([o.batch, o.seq], targets).expect("targets")).expect("targets");
        gpu.set_input("lr", &Value::scalar(1e-2)).expect("lr");
        let before = (gpu.api().bytes_in, gpu.api().bytes_out);
        gpu.execute().expect("runs");
        TrainStep::outputs(&gpu).expect("the outputs");
        traffic.push((gpu.api().bytes_in - before.0, gpu.api().bytes_out - before.1));
    }
    eprintln!("bytes in and out per step: {traffic:?}; the data region is {data_bytes}, the outputs {readback}");
    assert!(traffic.iter().all(|&t| t == (data_bytes, readback)), "{traffic:?}: only the data in and the outputs out");
    assert_eq!(gpu.api().allocations, allocated, "no allocation after the build");
    let mut packed = 0;
    for (b, buf) in prog.buffers.iter().enumerate() {
        if matches!(buf.kind, BufKind::Input(_, InputKind::Frozen)) && buf.dtype == DType::I4 {
            packed += 1;
            let held = gpu.layout().places[b].bytes;
            assert!(held <= buf.numel().div_ceil(2).next_multiple_of(256), "{}: {held} bytes for {} codes", buf.name, buf.numel());
        }
    }
    assert!(packed > 0, "frozen weights held as packed 4-bit codes");
    // a parameter read back after the steps is what the steps wrote there, not what was set
    let lora = prog.updates.iter().map(|(n, _)| n.clone()).find(|n| n.contains("lora_B")).expect("a LoRA B");
    assert_ne!(floats(&gpu.read_input(&lora).expect("read back")), floats(&state[&lora]), "{lora} trained on the device");
}

/// `qatc train --profile` on CUDA: a timed step (`execute_timed`: submitted without the graph, a
/// mark between its parts) is the same step, bit for bit, as an untimed one; its parts are every
/// step the run submits, in order (each kernel by family, each GEMM by shape), then the updates'
/// write-back and the outputs' read-back, each a time that is finite and not negative.
#[test]
fn a_timed_step_is_the_same_step_and_names_its_parts() {
    let o = options(true, true, 2, 16);
    let (prog, state, data) = setup(TINY.0, TINY.1, &o);
    let plain = drive(&mut emulated(&prog, cuda()), &prog, &state, &data, &o, 3);
    let mut gpu = emulated(&prog, cuda());
    for (name, v) in &state {
        set(&mut gpu, name, v.clone());
    }
    let mut steps = Vec::new();
    let mut parts = Vec::new();
    for s in 0..3 {
        give_batch(&mut gpu, &data, &o, s);
        // as the trainer does: the first step (which also runs the hoisted work) untimed
        if s == 0 {
            TrainStep::run(&mut gpu).expect("runs");
        } else {
            parts = gpu.run_timed().expect("runs").expect("CUDA times its parts");
        }
        steps.push(TrainStep::outputs(&gpu).expect("the outputs"));
    }
    let timed = lockstep::Run { steps, state: read_state(&gpu, &prog) };
    assert!(bits_equal(&plain, &timed), "a timed step computes what an untimed one does");
    let submitted = (0..prog.steps.len()).filter(|&i| !gpu.plan().hoisted[i]).count();
    let data_part = usize::from(gpu.layout().data_bytes > 0);
    assert_eq!(parts.len(), data_part + submitted + 2, "one part per step, and the copies: {parts:?}");
    assert!(parts.iter().all(|p| p.secs.is_finite() && p.secs >= 0.0), "{parts:?}");
    assert!(parts.iter().any(|p| p.what.starts_with("gemm ")) && parts.iter().any(|p| p.what.starts_with("adamw")), "{parts:?}");
    assert_eq!(parts.last().map(|p| p.what.as_str()), Some("outputs back (pinned copy)"));
    // each part's cost, for the profile's rates: every step moves bytes, a GEMM its 2 m n k
    // FLOPs (the step's total those of the program's GEMMs that ran), a kernel none counted
    assert!(parts.iter().all(|p| p.cost.bytes > 0), "{parts:?}");
    let flops: u64 = parts.iter().map(|p| p.cost.flops).sum();
    let want: u64 = (0..prog.steps.len())
        .filter(|&i| !gpu.plan().hoisted[i])
        .filter_map(|i| match &prog.steps[i] {
            qatc_kernels::Step::Gemm(g) => Some(2 * (g.m * g.n * g.k * g.c.shape.iter().rev().skip(2).product::<usize>()) as u64),
            _ => None,
        })
        .sum();
    assert!(flops > 0 && flops == want, "{flops} FLOPs counted, {want} in the GEMMs");
    assert!(parts.iter().filter(|p| !p.what.starts_with("gemm ")).all(|p| p.cost.flops == 0), "{parts:?}");
    eprintln!("{} parts, {:.1} ms on the emulated GPU", parts.len(), parts.iter().map(|p| p.secs).sum::<f64>() * 1e3);
}

/// A forward-only graph (what `qatc eval` builds) through the executor: the loss within two f32
/// ulps (2.5e-7) of the interpreter's. Equal on this machine: the emulated GPU's kernels (the
/// evaluator) and its cuBLAS model sum in f64 and round once, as the interpreter does since
/// issue 34 (its f32 sums set the bound at 1e-6 before).
#[test]
fn a_forward_graph_through_the_cuda_executor_equals_the_interpreter() {
    let m = Model::open(&common::root().join(TINY.0)).expect("the model");
    let data = TokenFile::open(&common::root().join(TINY.1)).expect("tokens");
    let mo = options(true, true, 2, 16).model;
    let (g, _) = qatc::step::model(&m.cfg, 2, 16, false, &mo, |_, _| {}).expect("a forward graph");
    let mut inputs = m.bind::<f32>(&g, None, 0).expect("binds");
    let (ids, targets) = data.batch(1, 2, 16).expect("a batch");
    inputs.insert("ids".into(), Value::ints([2, 16], ids).expect("ids"));
    inputs.insert("targets".into(), Value::ints([2, 16], targets).expect("targets"));
    let want = Interpreter::<f32>::new(&g).expect("interp").run(&inputs).expect("runs")["loss"].clone();
    let prog = qatc_kernels::lower(&g).expect("lowers");
    let mut gpu = emulated(&prog, cuda());
    let got = gpu.run(&inputs).expect("runs")["loss"].clone();
    let e = common::rel_err(&floats(&got), &floats(&want));
    eprintln!("eval loss {:?} against {:?}: {e:.1e}", floats(&got), floats(&want));
    assert!(e <= 2.5e-7, "off by {e:e}");
}

/// The executor's build through NVRTC: every kernel it loads (the program's and the GEMM plans'
/// data moves) compiles for the emulated device's architecture (sm_90), in fp32, bf16 and fp16;
/// a second build takes every CUBIN from the cache.
#[test]
fn the_executor_builds_its_kernels_with_nvrtc_through_the_cache() {
    let Some(nv) = common::nvrtc::nvrtc() else { return };
    let o = options(true, true, 2, 16);
    let (prog, _, _) = setup(TINY.0, TINY.1, &o);
    let cache = common::nvrtc::test_cache();
    let build = KernelBuild { nvrtc: &nv, cache: Some(&cache), jobs: 2, source_dir: None };
    let first = CudaProgram::new(prog.clone(), HostGpu::new(1 << 30), &cuda(), Some(&build)).expect("builds");
    let r1 = first.build_report().expect("a report").clone();
    let second = CudaProgram::new(prog, HostGpu::new(1 << 30), &cuda(), Some(&build)).expect("builds");
    let r2 = second.build_report().expect("a report");
    eprintln!("{}\n{}", r1.summary(), r2.summary());
    assert_eq!(r1.kernels, first.distinct_kernels());
    assert!(r1.kernels >= prog_kernels(&first), "the program's kernels and the GEMM plans' data moves");
    assert_eq!((r2.cached, r2.compiled), (r2.kernels, 0), "the second build compiles nothing");
    // the bf16 and fp16 steps' kernels (16-bit loads and stores, loss scaling) and data moves
    for p in [Precision::Bf16, Precision::Fp16] {
        let (prog, _, _) = setup(TINY.0, TINY.1, &options16(p, true));
        let built = CudaProgram::new(prog, HostGpu::new(1 << 30), &cuda(), Some(&build)).unwrap_or_else(|e| panic!("{p}: {e}"));
        let r = built.build_report().expect("a report");
        eprintln!("{p}: {}", r.summary());
        assert_eq!(r.kernels, built.distinct_kernels(), "{p}");
    }
}

fn prog_kernels<A: GpuApi>(p: &CudaProgram<A>) -> usize {
    let mut names: Vec<String> = p.program().kernels.iter().map(|k| k.name()).collect();
    names.sort();
    names.dedup();
    names.len()
}

/// Ten steps through the executor on the GPU (strict fp32 GEMMs, the step captured as a graph),
/// its state resident there, in lock step with the CPU executor (each step from the state the
/// GPU read back): losses within 1e-5, gradients within 1e-4 of their largest element, the
/// updated state within 1e-4 norm-wise.
#[test]
fn ten_steps_of_the_cuda_executor_track_the_cpu() {
    let Some((driver, nv)) = gpu() else { return };
    let cases = [
        ("tiny, full fine-tune, unfused", TINY, options(false, false, 2, 16)),
        ("tiny, 4-bit + LoRA, fused", TINY, options(true, true, 2, 16)),
        ("Shakespeare GPT-2, 4-bit + LoRA, fused", SHAKESPEARE, options(true, true, 2, 64)),
    ];
    let cache = common::nvrtc::test_cache();
    let jobs = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4);
    let build = KernelBuild { nvrtc: &nv, cache: Some(&cache), jobs, source_dir: None };
    let mut driver = Some(driver);
    for (what, (model, tokens), o) in cases {
        let (prog, state, data) = setup(model, tokens, &o);
        let mut cpu = CpuProgram::with_kir_eval(prog.clone()).expect("a CPU program");
        let api = match driver.take() {
            Some(d) => d,
            None => CudaDriver::open(0).expect("the GPU again"),
        };
        // strict fp32 GEMMs (no --tf32), as the CPU computes them
        let mut gpu = CudaProgram::new(prog.clone(), api, &cuda(), Some(&build)).unwrap_or_else(|e| panic!("{what}: {e}"));
        let (launches, calls) = gpu.per_step();
        let (worst, losses) = lockstep(&mut gpu, &mut cpu, &prog, &state, &data, &o, 10);
        let loss_err = losses.chunks(2).map(|p| (p[0] - p[1]).abs() / p[1].abs().max(1e-30)).fold(0.0f64, f64::max);
        eprintln!(
            "{what}: {launches} launches and {calls} GEMM calls per step; losses {:?}; worst loss error {loss_err:.1e}, output {:.1e} ({}), state {:.1e} ({})",
            losses.chunks(2).map(|p| p[0] as f32).collect::<Vec<_>>(),
            worst.outputs.0,
            worst.outputs.1,
            worst.state.0,
            worst.state.1
        );
        assert!(loss_err <= 1e-5, "{what}: a loss off by {loss_err:e}");
        assert!(worst.outputs.0 <= 1e-4, "{what}: {} off by {:e}", worst.outputs.1, worst.outputs.0);
        assert!(worst.state.0 <= 1e-4, "{what}: {} off by {:e}", worst.state.1, worst.state.0);
    }
}

/// `--precision bf16|fp16` on the GPU: ten steps of the tiny and Shakespeare 4-bit + LoRA steps
/// through the executor (16-bit GEMMs on the tensor cores, fp32 accumulation; fp16's loss scale
/// resident), in lock step with the CPU executor: losses, outputs and updated state within
/// [`ulps16`], the emulation's bound; fp16's scale state equal to the CPU's at every step.
#[test]
fn ten_bf16_and_fp16_steps_of_the_cuda_executor_track_the_cpu() {
    let Some((driver, nv)) = gpu() else { return };
    let cache = common::nvrtc::test_cache();
    let jobs = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4);
    let build = KernelBuild { nvrtc: &nv, cache: Some(&cache), jobs, source_dir: None };
    let mut driver = Some(driver);
    for p in [Precision::Bf16, Precision::Fp16] {
        let mut shakespeare = options16(p, true);
        shakespeare.seq = 64;
        for (what, (model, tokens), o) in [("tiny", TINY, options16(p, true)), ("Shakespeare GPT-2", SHAKESPEARE, shakespeare)] {
            let what = format!("{what}, 4-bit + LoRA, fused, {p}");
            let (prog, state, data) = setup(model, tokens, &o);
            let mut cpu = CpuProgram::with_kir_eval(prog.clone()).expect("a CPU program");
            let api = match driver.take() {
                Some(d) => d,
                None => CudaDriver::open(0).expect("the GPU again"),
            };
            let mut gpu = CudaProgram::new(prog.clone(), api, &cuda(), Some(&build)).unwrap_or_else(|e| panic!("{what}: {e}"));
            let (worst, losses) = lockstep(&mut gpu, &mut cpu, &prog, &state, &data, &o, 10);
            judge16(&what, p, &worst, &losses);
        }
    }
}

/// `qatc train --device cuda` where CUDA cannot run: one line saying why, exit code 2, nothing
/// written; `--device auto` says it falls back to the CPU and trains; the GPU-only settings are
/// refused on the CPU; `qatc eval --device cuda` fails as train does. (Where a GPU is usable, bench/gpu.sh runs `--device cuda` itself.)
#[test]
fn the_device_flag_without_a_gpu() {
    if qatc_driver::cuda_ready().is_ok() {
        eprintln!("SKIPPED: CUDA is usable here; this test is for machines without it");
        return;
    }
    let dir = std::env::temp_dir().join(format!("qatc-cuda-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let train = |device: &str, extra: &[&str], out: &str| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_qatc"));
        c.args(["train", &common::root().join(TINY.0).display().to_string(), "--data", &common::root().join(TINY.1).display().to_string()]);
        c.args(["--batch", "2", "--seq", "16", "--steps", "1", "--lora", "r=4", "--device", device, "--out"]);
        c.arg(dir.join(out)).args(extra);
        c.output().expect("qatc runs")
    };
    let r = train("cuda", &[], "cuda");
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(err.starts_with("error: --device cuda: "), "{err}");
    assert!(!dir.join("cuda").exists(), "nothing written");
    let r = train("auto", &[], "auto");
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(r.status.success(), "{err}");
    assert!(err.lines().next().is_some_and(|l| l.starts_with("qatc: ") && l.contains("running on the CPU")), "{err}");
    let r = train("cpu", &["--tf32"], "tf32");
    assert_eq!(r.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&r.stderr).contains("--tf32"));
    // eval on the GPU: the same error where there is none
    let r = std::process::Command::new(env!("CARGO_BIN_EXE_qatc"))
        .args(["eval", &common::root().join(TINY.0).display().to_string(), "--data", &common::root().join(TINY.1).display().to_string()])
        .args(["--batch", "2", "--seq", "16", "--batches", "1", "--device", "cuda"])
        .output()
        .expect("qatc runs");
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{err}");
    assert!(err.starts_with("error: --device cuda: ") && err.trim().lines().count() == 1, "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
