//! The tiny training step, lowered, run on the GPU API (`qatc_runtime::cuda::GpuApi`) by the
//! simplest driver there is (one allocation per buffer, each step in order: launches with the
//! CUDA writer's launch dimensions, GEMMs through their cuBLAS plans) and compared with the CPU
//! executor: on the host emulation (`HostGpu`) always, and on the GPU (`CudaDriver`, kernels
//! compiled to CUBINs by NVRTC for the device) where there is one. This is not the CUDA executor
//! (an arena, resident state, a captured step: `cudaexec`'s work); it checks that what the
//! executor will be built from fits together, and gives a GPU session a first comparison with the
//! CPU to run.

mod common;

use std::collections::HashMap;

use half::{bf16, f16};
use qatc::data::TokenFile;
use qatc::model::Model;
use qatc::step::StepOptions;
use qatc::trainer::Trainer;
use qatc_ir::{DType, QuantScheme, QuantSpec};
use qatc_kernels::cuda::blas::{self, BlasMode, BlasPlan, Mem};
use qatc_kernels::cuda::emit::launch_dims;
use qatc_kernels::nvrtc::BuildOptions;
use qatc_kernels::program::{Buffer, View};
use qatc_kernels::{Program, Step};
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::{LoraOptions, DROPOUT_SEED};
use qatc_passes::quant::QuantOptions;
use qatc_runtime::cuda::{run_plan, CudaDriver, DevPtr, FuncId, GpuApi, HostGpu, KernelImage, PlanFuncs};
use qatc_runtime::{CpuProgram, Value};

/// A value as a buffer's bytes.
fn to_bytes(buf: &Buffer, v: &Value<f32>) -> Vec<u8> {
    let mut out = vec![0u8; buf.device_bytes()];
    match (buf.dtype, v) {
        (DType::F32, Value::Float(t)) => out.chunks_exact_mut(4).zip(&t.data).for_each(|(o, x)| o.copy_from_slice(&x.to_le_bytes())),
        (DType::F16, Value::Float(t)) => {
            out.chunks_exact_mut(2).zip(&t.data).for_each(|(o, &x)| o.copy_from_slice(&f16::from_f32(x).to_le_bytes()))
        }
        (DType::BF16, Value::Float(t)) => {
            out.chunks_exact_mut(2).zip(&t.data).for_each(|(o, &x)| o.copy_from_slice(&bf16::from_f32(x).to_le_bytes()))
        }
        (DType::I32, Value::Int(t)) => out.chunks_exact_mut(4).zip(&t.data).for_each(|(o, x)| o.copy_from_slice(&x.to_le_bytes())),
        (DType::U8, Value::Int(t)) => out.iter_mut().zip(&t.data).for_each(|(o, &c)| *o = c as u8),
        (DType::I4, Value::Int(t)) => {
            out.iter_mut().zip(t.data.chunks(2)).for_each(|(o, p)| *o = (p[0] as u8) | (p.get(1).copied().unwrap_or(0) as u8) << 4)
        }
        (d, _) => panic!("{}: a {d} buffer given {v:?}", buf.name),
    }
    out
}

/// Element `i` of a buffer's bytes, as f64.
fn element(d: DType, b: &[u8], i: usize) -> f64 {
    match d {
        DType::F32 => f64::from(f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])),
        DType::I32 => f64::from(i32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])),
        DType::F16 => f64::from(f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32()),
        DType::BF16 => f64::from(bf16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32()),
        DType::U8 => f64::from(b[i]),
        DType::I4 => f64::from((b[i / 2] >> (4 * (i % 2))) & 15),
    }
}

/// The elements of a view, row-major.
fn gather(d: DType, bytes: &[u8], v: &View) -> Vec<f64> {
    (0..v.numel())
        .map(|e| {
            let (mut rest, mut at) = (e, v.offset);
            for (&n, &s) in v.shape.iter().zip(&v.strides).rev() {
                at += (rest % n) * s;
                rest /= n;
            }
            element(d, bytes, at)
        })
        .collect()
}

/// Runs `prog` once on `gpu`: one allocation per buffer, inputs uploaded, every step in order,
/// outputs downloaded. `cubins` are the kernels' CUBINs by name (empty for the emulation).
fn run_on(
    gpu: &mut dyn GpuApi,
    prog: &Program,
    cubins: &HashMap<String, Vec<u8>>,
    inputs: &HashMap<String, Value<f32>>,
) -> HashMap<String, Vec<f64>> {
    let image = |k: &qatc_kernels::kir::Kernel| {
        let name = qatc_kernels::cuda::emit(k).expect("emits").name;
        KernelImage { cubin: cubins.get(&name).cloned().unwrap_or_default(), name, kernel: k.clone() }
    };
    let ptrs: Vec<DevPtr> = prog.buffers.iter().map(|b| gpu.alloc(b.device_bytes().max(4)).expect("device memory")).collect();
    for (b, &p) in prog.buffers.iter().zip(&ptrs) {
        if let qatc_kernels::program::BufKind::Input(name) = &b.kind {
            if let Some(v) = inputs.get(name) {
                gpu.upload(p, &to_bytes(b, v)).expect("uploads");
            }
        }
    }
    let funcs: Vec<FuncId> = prog.kernels.iter().map(|k| gpu.load(&image(k)).expect("loads")).collect();
    for step in &prog.steps {
        match step {
            Step::Launch { kernel, args, .. } => {
                let a: Vec<DevPtr> = args.iter().map(|&b| ptrs[b]).collect();
                gpu.launch(funcs[*kernel], &launch_dims(&prog.kernels[*kernel]), &a).expect("launches");
            }
            Step::Gemm(g) => {
                let plan: BlasPlan = blas::plan(g, &prog.buffers, BlasMode::Strict).expect("plans");
                let scratch: Vec<DevPtr> = plan.scratch.iter().map(|(t, n)| gpu.alloc((t.bytes() * n).max(4)).expect("scratch")).collect();
                let moves: PlanFuncs =
                    blas::move_kernels(&plan).iter().map(|m| (m.step, gpu.load(&image(&m.kernel)).expect("loads"))).collect();
                let resolve = |m: Mem| -> qatc_runtime::cuda::Result<DevPtr> {
                    Ok(match m {
                        Mem::Buf(b) => ptrs[b],
                        Mem::Scratch(s) => scratch[s],
                    })
                };
                run_plan(gpu, &plan, &moves, &resolve).unwrap_or_else(|e| panic!("{}: {e}\n{}", g.note, plan.summary()));
                for s in scratch {
                    gpu.free(s).expect("freed");
                }
            }
        }
    }
    gpu.synchronize().expect("synchronizes");
    let mut out = HashMap::new();
    for (name, v) in &prog.outputs {
        let b = &prog.buffers[v.buf];
        let mut bytes = vec![0u8; b.device_bytes()];
        gpu.download(&mut bytes, ptrs[v.buf]).expect("downloads");
        out.insert(name.clone(), gather(b.dtype, &bytes, v));
    }
    for p in ptrs {
        gpu.free(p).expect("freed");
    }
    out
}

/// (the program, its inputs, the CPU executor's outputs) for the tiny model's step.
fn tiny_step(o: StepOptions) -> (Program, HashMap<String, Value<f32>>, HashMap<String, Value<f32>>) {
    let m = Model::open(&common::fixture("tiny/f32_prefix/model.safetensors")).expect("the tiny model");
    let data = TokenFile::open(&common::fixture("tiny/tokens.bin")).expect("tokens");
    let (b, t) = (o.batch, o.seq);
    let tr = Trainer::new(&m, o, None, 3).expect("a trainer");
    let prog = qatc_kernels::lower(&tr.graph).expect("lowers");
    let mut state = tr.state.clone();
    let (ids, targets) = data.batch(0, b, t).expect("a batch");
    state.insert("ids".into(), Value::ints([b, t], ids).expect("ids"));
    state.insert("targets".into(), Value::ints([b, t], targets).expect("targets"));
    state.insert(DROPOUT_SEED.into(), Value::ints([], vec![5]).expect("a seed"));
    state.insert("lr".into(), Value::scalar(1e-2));
    let want = CpuProgram::with_kir_eval(prog.clone()).expect("a program").run(&state).expect("runs");
    (prog, state, want)
}

/// Every output near the CPU's: the loss and gradients element-wise, the AdamW results (which
/// amplify f32 noise: tests/compiled_cpu.rs) norm-wise. Returns the worst error and where.
fn compare(what: &str, got: &HashMap<String, Vec<f64>>, want: &HashMap<String, Value<f32>>) -> (f64, String) {
    let mut worst = (0.0f64, String::new());
    for (name, w) in want {
        let w: Vec<f64> = match w {
            Value::Float(t) => t.data.iter().map(|&x| f64::from(x)).collect(),
            Value::Int(t) => t.data.iter().map(|&x| f64::from(x)).collect(),
        };
        let g = got.get(name).unwrap_or_else(|| panic!("{what}: no output {name}"));
        let (err, tol) =
            if name == "loss" || name.starts_with("grad:") { (common::rel_err(g, &w), 1e-4) } else { (common::norm_rel_err(g, &w), 1e-3) };
        assert!(err <= tol, "{what}: {name} off by {err:e} (tolerance {tol:e})");
        if err > worst.0 {
            worst = (err, name.clone());
        }
    }
    worst
}

fn options(qlora: bool, fuse: bool) -> StepOptions {
    let mut o = StepOptions::new(2, 16);
    if qlora {
        o.model.full_finetune = false;
        o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 32, scheme: QuantScheme::Sym }));
        o.model.lora = Some(LoraOptions::new(4));
    }
    o.fuse = fuse.then(FuseOptions::default);
    o.keep_grads = true;
    o
}

#[test]
fn the_tiny_step_on_the_emulated_gpu_matches_the_cpu() {
    for (qlora, fuse) in [(false, false), (true, true)] {
        let what = format!("HostGpu, 4-bit + LoRA {qlora}, fused {fuse}");
        let (prog, inputs, want) = tiny_step(options(qlora, fuse));
        let mut gpu = HostGpu::new(1 << 30);
        let got = run_on(&mut gpu, &prog, &HashMap::new(), &inputs);
        let worst = compare(&what, &got, &want);
        eprintln!(
            "{what}: {} launches, {} GEMM calls, peak {} bytes; worst error {:.1e} ({})",
            gpu.launches,
            gpu.gemms,
            gpu.peak_memory(),
            worst.0,
            worst.1
        );
    }
}

/// The same on the GPU, strict fp32, where there is one (and NVRTC to compile for it).
#[test]
fn the_tiny_step_on_the_gpu_matches_the_cpu() {
    let mut gpu = match CudaDriver::open(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("SKIPPED (no GPU): {e}");
            return;
        }
    };
    let Some(nv) = common::nvrtc::nvrtc() else { return };
    let arch = gpu.device().arch;
    eprintln!("GPU: {} ({arch})", gpu.device().name);
    for (qlora, fuse) in [(false, false), (false, true), (true, true)] {
        let what = format!("CUDA {arch}, 4-bit + LoRA {qlora}, fused {fuse}");
        let (prog, inputs, want) = tiny_step(options(qlora, fuse));
        // the program's kernels and every plan's data moves, as CUBINs
        let mut kernels: Vec<qatc_kernels::kir::Kernel> = prog.kernels.clone();
        for g in prog.gemms() {
            let plan = blas::plan(g, &prog.buffers, BlasMode::Strict).expect("plans");
            kernels.extend(blas::move_kernels(&plan).into_iter().map(|m| m.kernel));
        }
        let cuda: Vec<_> = kernels.iter().map(|k| qatc_kernels::cuda::emit(k).expect("emits")).collect();
        let o = BuildOptions { arch, cache: Some(&common::nvrtc::test_cache()), jobs: 8, source_dir: None };
        let (built, report) =
            qatc_kernels::nvrtc::compile_cubins(&nv, &cuda, &o).unwrap_or_else(|e: qatc_kernels::KernelError| panic!("{what}: {e}"));
        eprintln!("{what}: {}", report.summary());
        let cubins: HashMap<String, Vec<u8>> = built.into_iter().map(|c| (c.name, c.cubin)).collect();
        let got = run_on(&mut gpu, &prog, &cubins, &inputs);
        let worst = compare(&what, &got, &want);
        eprintln!("{what}: worst error {:.1e} ({})", worst.0, worst.1);
    }
}
