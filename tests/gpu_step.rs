//! Training steps run on the GPU API (`qatc_runtime::cuda::GpuApi`) by the simplest driver there
//! is ([`Plain`]: one allocation per buffer, each step in order, launches with the CUDA writer's
//! launch dimensions, GEMMs through their cuBLAS plans), compared with the CPU executor:
//!
//! - on the host emulation (`HostGpu`), always: the tiny step, full fine-tune and 4-bit + LoRA;
//! - on the GPU (`CudaDriver`, kernels compiled to CUBINs by NVRTC for the device, strict fp32),
//!   where there is one: the tiny and the Shakespeare GPT-2 steps over 10 steps (each step from
//!   the CPU's state: losses within 1e-5, gradients within 1e-4 relative), and every kernel of
//!   the demo step (`examples/demo.sh`'s configuration; in fp32 and in bf16) launched alone on the
//!   GPU's copy of the evaluator's inputs and compared with the kernel-IR evaluator. `bench/gpu.sh` runs these.
//!
//! This is not the CUDA executor (`CudaProgram`: an arena, resident state, a captured step;
//! tests/cuda_exec.rs); it checks the parts it is built from with nothing of its own between
//! them, so that a failure on a real GPU can be told apart from one of the executor.

mod common;

use std::collections::{HashMap, HashSet};

use qatc::step::StepOptions;
use qatc_ir::{DType, QuantScheme, QuantSpec};
use qatc_kernels::cuda::blas::{self, BlasMode, Mem};
use qatc_kernels::cuda::emit::launch_dims;
use qatc_kernels::nvrtc::BuildOptions;
use qatc_kernels::program::{BufKind, View};
use qatc_kernels::{Program, Step};
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::LoraOptions;
use qatc_passes::precision::Precision;
use qatc_passes::quant::QuantOptions;
use qatc_runtime::cuda::{run_plan, CudaDriver, DevPtr, FuncId, GpuApi, HostGpu, KernelImage};
use qatc_runtime::{CpuProgram, Value};

use common::bytes::{element, to_bytes};
use common::gpu::{gpu, inputs, options, planned_gemms, setup, PlannedGemm, SHAKESPEARE, TINY};

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

/// A program on a GPU: an allocation per buffer, its kernels and plans loaded.
struct Plain<'a> {
    gpu: &'a mut dyn GpuApi,
    prog: &'a Program,
    ptrs: Vec<DevPtr>,
    funcs: Vec<FuncId>,
    gemms: Vec<Option<PlannedGemm>>,
}

impl<'a> Plain<'a> {
    /// `cubins` by kernel name (empty for the emulation).
    fn new(gpu: &'a mut dyn GpuApi, prog: &'a Program, cubins: &HashMap<String, Vec<u8>>) -> Plain<'a> {
        let image = |k: &qatc_kernels::kir::Kernel| {
            let name = qatc_kernels::cuda::emit(k).expect("emits").name;
            KernelImage { cubin: cubins.get(&name).cloned().unwrap_or_default(), name, kernel: k.clone(), launch: launch_dims(k) }
        };
        let ptrs: Vec<DevPtr> = prog.buffers.iter().map(|b| gpu.alloc(b.device_bytes().max(4)).expect("device memory")).collect();
        let funcs = prog.kernels.iter().map(|k| gpu.load(&image(k)).expect("loads")).collect();
        let gemms = planned_gemms(gpu, prog, &image);
        Plain { gpu, prog, ptrs, funcs, gemms }
    }

    fn set_inputs(&mut self, inputs: &HashMap<String, Value<f32>>) {
        for (b, &p) in self.prog.buffers.iter().zip(&self.ptrs) {
            if let BufKind::Input(name, _) = &b.kind {
                if let Some(v) = inputs.get(name) {
                    self.gpu.upload(p, &to_bytes(b, v)).expect("uploads");
                }
            }
        }
    }

    /// Runs step `i` of the program.
    fn step(&mut self, i: usize) {
        match &self.prog.steps[i] {
            Step::Launch { kernel, args, .. } => {
                let a: Vec<DevPtr> = args.iter().map(|&b| self.ptrs[b]).collect();
                self.gpu.launch(self.funcs[*kernel], &launch_dims(&self.prog.kernels[*kernel]), &a).expect("launches");
            }
            Step::Gemm(g) => {
                let pg = self.gemms[i].as_ref().expect("planned");
                let (ptrs, scratch) = (&self.ptrs, &pg.scratch);
                let resolve = |m: Mem| -> qatc_runtime::cuda::Result<DevPtr> {
                    Ok(match m {
                        Mem::Buf(b) => ptrs[b],
                        Mem::Scratch(s) => scratch[s],
                    })
                };
                run_plan(self.gpu, &pg.plan, &pg.moves, &resolve).unwrap_or_else(|e| panic!("{}: {e}\n{}", g.note, pg.plan.summary()));
            }
            Step::Collective(c) => panic!("a one-rank step has no collective ({})", c.note),
        }
    }

    fn run(&mut self, inputs: &HashMap<String, Value<f32>>) -> HashMap<String, Vec<f64>> {
        self.set_inputs(inputs);
        for i in 0..self.prog.steps.len() {
            self.step(i);
        }
        self.gpu.synchronize().expect("synchronizes");
        // the outputs, and the updates under the names of the inputs they are the new values of
        self.prog.outputs.iter().chain(&self.prog.updates).map(|(name, v)| (name.clone(), self.read(v.buf, v))).collect()
    }

    fn bytes(&mut self, b: usize) -> Vec<u8> {
        let mut bytes = vec![0u8; self.prog.buffers[b].device_bytes()];
        self.gpu.download(&mut bytes, self.ptrs[b]).expect("downloads");
        bytes
    }

    fn read(&mut self, b: usize, v: &View) -> Vec<f64> {
        let bytes = self.bytes(b);
        gather(self.prog.buffers[b].dtype, &bytes, v)
    }
}

impl Drop for Plain<'_> {
    fn drop(&mut self) {
        for p in self.ptrs.drain(..).chain(self.gemms.iter_mut().flatten().flat_map(|g| g.scratch.drain(..))) {
            let _ = self.gpu.free(p);
        }
    }
}

/// Every output near the CPU's: the loss within 1e-5 and gradients within 1e-4 element-wise
/// (max |gpu - cpu| / max |cpu|), the AdamW results (which amplify f32 noise:
/// tests/compiled_cpu.rs) norm-wise within 1e-3. Returns the worst error and where.
fn compare(what: &str, got: &HashMap<String, Vec<f64>>, want: &HashMap<String, Value<f32>>) -> (f64, String) {
    let mut worst = (0.0f64, String::new());
    for (name, w) in want {
        let w: Vec<f64> = match w {
            Value::Float(t) => t.data.iter().map(|&x| f64::from(x)).collect(),
            Value::Int(t) => t.data.iter().map(|&x| f64::from(x)).collect(),
        };
        let g = got.get(name).unwrap_or_else(|| panic!("{what}: no output {name}"));
        assert!(g.iter().all(|x| x.is_finite()) || w.iter().any(|x| !x.is_finite()), "{what}: {name} is not finite");
        let (err, tol) = match name.as_str() {
            "loss" => (common::rel_err(g, &w), 1e-5),
            n if n.starts_with("grad:") => (common::rel_err(g, &w), 1e-4),
            _ => (common::norm_rel_err(g, &w), 1e-3),
        };
        assert!(err <= tol, "{what}: {name} off by {err:e} (tolerance {tol:e})");
        if err > worst.0 {
            worst = (err, name.clone());
        }
    }
    worst
}

#[test]
fn the_tiny_step_on_the_emulated_gpu_matches_the_cpu() {
    for (qlora, fuse) in [(false, false), (true, true)] {
        let what = format!("HostGpu, 4-bit + LoRA {qlora}, fused {fuse}");
        let o = options(qlora, fuse, 2, 16);
        let (prog, tr, data) = setup(TINY.0, TINY.1, o.clone());
        let inp = inputs(&tr.state().expect("the state"), &data, &o, 0);
        let want = CpuProgram::with_kir_eval(prog.clone()).expect("a program").run(&inp).expect("runs");
        let mut gpu = HostGpu::new(1 << 30);
        let got = Plain::new(&mut gpu, &prog, &HashMap::new()).run(&inp);
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

/// CUBINs for the device of every kernel a program runs: its own and its plans' data moves.
fn cubins(gpu: &CudaDriver, nv: &qatc_kernels::nvrtc::Nvrtc, prog: &Program) -> HashMap<String, Vec<u8>> {
    let mut kernels = prog.kernels.clone();
    for g in prog.gemms() {
        let plan = blas::plan(g, &prog.buffers, BlasMode::Strict).expect("plans");
        kernels.extend(blas::move_kernels(&plan).into_iter().map(|m| m.kernel));
    }
    let cuda: Vec<_> = kernels.iter().map(|k| qatc_kernels::cuda::emit(k).expect("emits")).collect();
    let jobs = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4);
    let o = BuildOptions { arch: gpu.device().arch, cache: Some(&common::nvrtc::test_cache()), jobs, source_dir: None };
    let (built, report) = qatc_kernels::nvrtc::compile_cubins(nv, &cuda, &o).unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{}", report.summary());
    built.into_iter().map(|c| (c.name, c.cubin)).collect()
}

/// Ten steps on the GPU, each from the CPU's state, against the CPU executor.
/// On the GPU machine (`QATC_REQUIRE_GPU=1`, set by bench/gpu.sh) a GPU that does not open
/// fails the test; elsewhere it is a skip. bench/gpu.sh --dry-run checks the same end to end.
#[test]
fn a_required_gpu_that_does_not_open_fails_the_test() {
    assert!(common::gpu::skip_or_fail::<()>(false, "no driver here").is_none());
    let failed = std::panic::catch_unwind(|| common::gpu::skip_or_fail::<()>(true, "no driver here"));
    let why = failed.expect_err("required: a failure").downcast::<String>().expect("a message");
    assert!(why.contains("QATC_REQUIRE_GPU=1") && why.contains("no driver here"), "{why}");
}

#[test]
fn ten_steps_on_the_gpu_track_the_cpu() {
    let Some((mut gpu, nv)) = gpu() else { return };
    let cases = [
        ("tiny, full fine-tune, unfused", TINY, options(false, false, 2, 16)),
        ("tiny, 4-bit + LoRA, fused", TINY, options(true, true, 2, 16)),
        ("Shakespeare GPT-2, 4-bit + LoRA, fused", SHAKESPEARE, options(true, true, 2, 64)),
    ];
    for (what, (model, tokens), o) in cases {
        let (prog, tr, data) = setup(model, tokens, o.clone());
        let bins = cubins(&gpu, &nv, &prog);
        let mut cpu = CpuProgram::with_kir_eval(prog.clone()).expect("a program");
        let updates: Vec<String> = prog.updates.iter().map(|(name, _)| name.clone()).collect();
        assert!(!updates.is_empty(), "{what}: the step updates its inputs");
        let mut state = tr.state().expect("the state");
        let mut plain = Plain::new(&mut gpu, &prog, &bins);
        for s in 0..10 {
            let inp = inputs(&state, &data, &o, s);
            let want = cpu.run(&inp).expect("runs");
            let got = plain.run(&inp);
            let worst = compare(&format!("{what}, step {s}"), &got, &want);
            let loss = want.get("loss").and_then(|v| v.as_float()).map_or(f32::NAN, |t| t.data[0]);
            eprintln!("{what}, step {s}: loss {loss:.6}; worst error {:.1e} ({})", worst.0, worst.1);
            for u in &updates {
                state.insert(u.clone(), want[u].clone());
            }
        }
    }
}

/// Each distinct kernel of the demo step (4-bit Q4_0 + LoRA r=16, B 4, T 128, fused) launched
/// alone on the GPU, on the evaluator's own inputs at that point of the step, and compared with
/// the evaluator: max |gpu - evaluator| / max |evaluator| of every param it writes within 1e-5
/// (reductions fold in other orders; integer and packed outputs exactly).
#[test]
fn every_kernel_of_the_demo_step_matches_the_evaluator() {
    let Some((mut gpu, nv)) = gpu() else { return };
    demo_kernels(&mut gpu, &nv, Precision::Fp32);
}

/// The same in bf16: a 16-bit param within one ulp of its type (an f32 result a hair from a
/// rounding boundary rounds the other way: 2^-7 relative for bf16, 2^-10 for f16), f32 ones
/// within 1e-5; the params of a kernel the CUDA writer put on tensor cores (the attention
/// kernels, `the tensor-core-attention variants`: 16-bit operands, P and dS rounded to the type
/// before their products, as FlashAttention does) within 2e-2.
#[test]
fn every_kernel_of_the_bf16_demo_step_matches_the_evaluator() {
    let Some((mut gpu, nv)) = gpu() else { return };
    demo_kernels(&mut gpu, &nv, Precision::Bf16);
}

fn demo_kernels(gpu: &mut CudaDriver, nv: &qatc_kernels::nvrtc::Nvrtc, precision: Precision) {
    let mut o = StepOptions::new(4, 128);
    o.model.full_finetune = false;
    o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 32, scheme: QuantScheme::Q4_0 }));
    o.model.lora = Some(LoraOptions::new(16));
    o.fuse = Some(FuseOptions::default());
    o.precision = precision;
    let (prog, tr, data) = setup(SHAKESPEARE.0, SHAKESPEARE.1, o.clone());
    let bins = cubins(gpu, nv, &prog);
    let inp = inputs(&tr.state().expect("the state"), &data, &o, 0);
    let mut host = HostGpu::new(64 << 30);
    let mut reference = Plain::new(&mut host, &prog, &HashMap::new());
    reference.set_inputs(&inp);
    let mut device = Plain::new(gpu, &prog, &bins);
    let mut checked = HashSet::new();
    let mut worst = (0.0f64, String::new());
    for i in 0..prog.steps.len() {
        if let Step::Launch { kernel, args, .. } = &prog.steps[i] {
            if checked.insert(*kernel) {
                let k = &prog.kernels[*kernel];
                // the inputs exactly as the evaluator has them at this point
                for &b in args {
                    let bytes = reference.bytes(b);
                    let p = device.ptrs[b];
                    device.gpu.upload(p, &bytes).expect("uploads");
                }
                device.step(i);
                reference.step(i);
                for (p, &b) in k.params.iter().zip(args).filter(|(p, _)| p.write) {
                    let whole = View::contiguous(b, &prog.buffers[b].shape);
                    let (got, want) = (device.read(b, &whole), reference.read(b, &whole));
                    let err = if p.dtype.is_float() { common::rel_err(&got, &want) } else { common::max_abs(&got, &want) };
                    let cuda = qatc_kernels::cuda::emit(k).expect("emits");
                    let name = format!("{precision}: {} param {}", cuda.name, p.name);
                    let tol = match p.dtype {
                        _ if cuda.source.contains("_mma<") => 2e-2,
                        DType::BF16 => 2f64.powi(-7),
                        DType::F16 => 2f64.powi(-10),
                        _ => 1e-5,
                    };
                    assert!(err <= tol, "{name} ({}): off by {err:e}", k.note);
                    if err > worst.0 {
                        worst = (err, name);
                    }
                }
                continue;
            }
        }
        reference.step(i);
    }
    eprintln!(
        "{precision}: {} distinct kernels checked on the GPU against the evaluator; worst {:.1e} ({})",
        checked.len(),
        worst.0,
        worst.1
    );
}
