//! The generated CUDA C, executed: every distinct kernel of a training step (and of its GEMM
//! plans' data moves) compiled by the system C++ compiler (`g++ -std=c++20 -O1`) against
//! `tests/cxx/cuda_on_cpu.h`, a shim that runs CUDA's execution model on the CPU (blocks in turn,
//! a block's threads as fibers meeting at real barriers, warp shuffles, the tensor cores' mma,
//! atomics, shared memory, CUDA's conversion semantics; `tests/cxx/cuda_on_cpu.cpp` is its
//! launcher), run once on the
//! bytes the kernel-IR evaluator (`HostGpu`, wrapped by [`OnCpu`]) has at the kernel's first
//! launch, and compared with the evaluator's result: every param it writes, floats within 1e-5
//! (`common::rel_err`; 16-bit ones within an ulp of their type), integers exactly.
//!
//! What this catches that the other checks cannot: CI evaluates the kernel IR and compiles the
//! CUDA C with NVRTC where NVRTC is installed, but nothing else executes the CUDA C *text*: a
//! bound written `j < rank == 0 ? 1 : 0` (valid C, an endless loop) passes both. Here such a
//! kernel is killed at its time limit (or stopped by the overflow check) and named. Each kernel
//! runs twice, threads, warps and blocks in ascending then descending order, and the two results
//! must be bitwise equal (a missing barrier is an order-dependent result); an access past a
//! param's end faults (guard pages); signed overflow, out-of-range shifts and indices past a
//! fixed-size array stop it (`-fsanitize=undefined`). A failing kernel's inputs are kept under
//! `target/cuda-c-on-cpu/failed/<kernel>/` with a script that runs it again.
//!
//! The evaluator accumulates an f32 sum in f64 (`runtime/src/cpu/kir_eval.rs`): added in order
//! in f32, a 50,257-long cross-entropy row drifts by ~1e-3, and the CUDA C's tree of partial sums
//! was judged against that drift (7.6e-4 on the logits' gradient) before it did.
//!
//! The shim is an sm_80: the tensor-core attention (`qatc_attention_mma.cuh`, in 16-bit steps
//! with head size 32-64) takes its mma branch, whose `mma.sync.m16n8k16` the shim emulates
//! warp-wide from the PTX ISA's fragment layouts; its results that pass through a 16-bit rounding
//! (P and dS as mma operands) are compared norm-wise (`on_cpu::mma_tolerance`), and every such
//! kernel must have reached the emulated mma. Skipped (counted, with the reason): kernels with
//! other inline PTX. The f16 conversions of `qatc_common.cuh`, inline PTX too, the shim runs.
//! GEMMs are cuBLAS calls, not CUDA C: the evaluator runs them (`run_plan` on `HostGpu`), and
//! their data-move kernels are checked like the program's own.
//!
//! Executables are cached under `target/cuda-c-on-cpu/` (a second run compiles nothing). Without
//! a C++ compiler the tests skip, saying so, unless `$CI` is set. Here: the cases and the shim's
//! own checks; `cuda_c_on_cpu/on_cpu.rs`: the GPU they drive (the evaluator with every first
//! launch also run as CUDA C); `cuda_c_on_cpu/attention.rs`: hand-made programs of the attention
//! kernels; `common/cxx.rs`: compiling and running the executables.

#[path = "cuda_c_on_cpu/attention.rs"]
mod attention;
mod common;
#[path = "common/cxx.rs"]
mod cxx;
#[path = "cuda_c_on_cpu/on_cpu.rs"]
mod on_cpu;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use qatc::step::StepOptions;
use qatc_ir::{DType, QuantScheme, QuantSpec};
use qatc_kernels::cuda::blas::{BlasCall, Compute, Mem};
use qatc_kernels::cuda::LaunchDims;
use qatc_kernels::kir::{Body, Kernel, Param};
use qatc_kernels::program::{BufKind, Buffer, Gemm, GemmTypes, View};
use qatc_kernels::CudaSettings;
use qatc_kernels::{Program, Step};
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::LoraOptions;
use qatc_passes::precision::Precision;
use qatc_passes::quant::QuantOptions;
use qatc_runtime::cuda::{
    run_plan, DevPtr, FuncId, GemmPtrs, GpuApi, GpuDevice, GraphId, HostGpu, KernelImage, MarkId, PinnedId, Result as GpuResult,
};

use common::bytes::{element, to_bytes};
use common::gpu::{inputs, options, planned_gemms, setup, SHAKESPEARE, TINY};
use cxx::{Cxx, Outcome};
use on_cpu::*;

/// Runs a program as tests/gpu_step.rs's `Plain` does: an allocation per buffer, each step in
/// order, launches with the CUDA writer's dims, GEMMs through their cuBLAS plans.
/// `init` gives each buffer's first bytes, where it has any.
fn run_program(gpu: &mut OnCpu, prog: &Program, init: &dyn Fn(&Buffer) -> Option<Vec<u8>>) {
    let image = |k: &Kernel| {
        let cuda = qatc_kernels::cuda::emit(k).expect("emits");
        KernelImage { cubin: Vec::new(), name: cuda.name, kernel: k.clone(), launch: cuda.launch }
    };
    let ptrs: Vec<DevPtr> = prog.buffers.iter().map(|b| gpu.alloc(b.device_bytes().max(4)).expect("device memory")).collect();
    let funcs: Vec<FuncId> = prog.kernels.iter().map(|k| gpu.load(&image(k)).expect("loads")).collect();
    let gemms = planned_gemms(gpu, prog, &image);
    // every kernel compiled before the first launch, several at a time
    gpu.build();
    for (b, &p) in prog.buffers.iter().zip(&ptrs) {
        if let Some(bytes) = init(b) {
            gpu.upload(p, &bytes).expect("uploads");
        }
    }
    for (step, planned) in prog.steps.iter().zip(&gemms) {
        match step {
            Step::Launch { kernel, args, .. } => {
                let a: Vec<DevPtr> = args.iter().map(|&b| ptrs[b]).collect();
                gpu.launch(funcs[*kernel], &qatc_kernels::cuda::emit::launch_dims(&prog.kernels[*kernel]), &a).expect("launches");
            }
            Step::Gemm(g) => {
                let pg = planned.as_ref().expect("planned");
                let resolve = |m: Mem| -> GpuResult<DevPtr> {
                    Ok(match m {
                        Mem::Buf(b) => ptrs[b],
                        Mem::Scratch(s) => pg.scratch[s],
                    })
                };
                run_plan(gpu, &pg.plan, &pg.moves, &resolve).unwrap_or_else(|e| panic!("{}: {e}\n{}", g.note, pg.plan.summary()));
            }
            Step::Collective(c) => panic!("a one-rank step has no collective ({})", c.note),
        }
    }
    gpu.synchronize().expect("synchronizes");
}

/// Every distinct kernel of one step (`o` on `model`), its CUDA C run on the CPU at its first
/// launch against the evaluator. Prints one line; fails listing every kernel that disagrees.
fn case(what: &str, model_tokens: (&str, &str), o: StepOptions) {
    case_with(what, model_tokens, o, &[]);
}

/// [`case`], with inputs beyond the batch's (instruction data's loss weights, position ids).
fn case_with(what: &str, (model, tokens): (&str, &str), o: StepOptions, extra: &[(&str, qatc_runtime::Value<f32>)]) {
    let Some(cxx) = Cxx::find(qatc_kernels::cuda::headers()) else { return };
    let start = Instant::now();
    let (prog, tr, data) = setup(model, tokens, o.clone());
    let mut inp = inputs(&tr.state().expect("the state"), &data, &o, 0);
    inp.extend(extra.iter().map(|(n, v)| (n.to_string(), v.clone())));
    let built = start.elapsed();
    let init = |b: &Buffer| match &b.kind {
        BufKind::Input(name, _) => inp.get(name).map(|v| to_bytes(b, v)),
        _ => None,
    };
    check_program(&cxx, what, &prog, &init, start, built);
}

/// Runs `prog` (its buffers first filled by `init`) with every kernel's first launch checked;
/// prints one line (and one per param of a tensor-core kernel); fails listing every kernel that
/// disagrees. Returns how many kernels ran, how many were GEMM data moves, and the tensor-core
/// kernels' params as compared.
fn check_program(
    cxx: &Cxx,
    what: &str,
    prog: &Program,
    init: &dyn Fn(&Buffer) -> Option<Vec<u8>>,
    start: Instant,
    built: Duration,
) -> (usize, usize, Vec<MmaCheck>) {
    check_program_with(cxx, what, prog, init, start, built, CudaSettings::default())
}

/// [`check_program`] with the CUDA writer's variants `codegen`.
fn check_program_with(
    cxx: &Cxx,
    what: &str,
    prog: &Program,
    init: &dyn Fn(&Buffer) -> Option<Vec<u8>>,
    start: Instant,
    built: Duration,
    codegen: CudaSettings,
) -> (usize, usize, Vec<MmaCheck>) {
    let mut gpu = OnCpu::new(cxx, 64 << 30);
    gpu.codegen = codegen;
    run_program(&mut gpu, prog, init);
    let f = &gpu.found;
    let moves = gpu.kernels.len() - prog.kernels.len();
    eprintln!(
        "{what}: {} distinct kernels ({} of the program, {moves} GEMM data moves); {} run as CUDA C on the CPU, {} skipped (inline PTX), \
         {} failing; worst error {:.1e} ({}); {} compiled ({}); the step built in {:.1}s, the checked launches {:.1}s (CPU and evaluator side by side), the evaluator's GEMMs {:.1}s, {:.1}s in all",
        gpu.kernels.len(),
        prog.kernels.len(),
        f.run,
        f.skipped.len(),
        f.failures.len(),
        f.worst.0,
        f.worst.1,
        f.compiled,
        cxx.version(),
        built.as_secs_f64(),
        f.cpu.as_secs_f64(),
        f.gemm.as_secs_f64(),
        start.elapsed().as_secs_f64()
    );
    for (name, why) in &f.skipped {
        eprintln!("  skipped {name}: {why}");
    }
    for m in &f.mma {
        eprintln!(
            "  tensor cores, {:?} over {} values ({}, {} warp-wide mma): param {} off by {:.1e} norm-wise, {:.1e} max-wise",
            m.part, m.values, m.name, m.mma, m.param, m.norm, m.max
        );
    }
    let launched = gpu.checked.len();
    assert_eq!(launched, gpu.kernels.len(), "{what}: every loaded kernel is launched");
    assert!(
        f.failures.is_empty(),
        "{what}: {} kernels' CUDA C, run on the CPU, disagree with the kernel-IR evaluator (a bug in the generated CUDA C, \
         unless the shim tests/cxx/cuda_on_cpu.h is wrong):\n\n{}",
        f.failures.len(),
        f.failures.join("\n\n")
    );
    (f.run, moves, std::mem::take(&mut gpu.found.mma))
}

#[test]
fn the_tiny_packed_instruction_step() {
    // loss weights (a prompt's and padding's 0) and position ids: the weighted cross-entropy
    // (fused: chunked) and the packed softmax, and the position embedding gathered
    let positions: Vec<i32> = (0..32).map(|i| if i < 16 { i % 6 } else { i - 16 }).collect();
    let weights: Vec<f64> = (0..32).map(|i| if i % 5 == 0 { 0.0 } else { 1.0 / 25.0 }).collect();
    for (qlora, fuse) in [(true, true), (false, false)] {
        let mut o = options(qlora, fuse, 2, 16);
        o.model.inputs = qatc::step::BatchInputs { weights: true, positions: true };
        let extra = [
            ("positions", qatc_runtime::Value::ints([2, 16], positions.clone()).expect("positions")),
            ("weights", qatc_runtime::Value::floats(vec![2, 16], &weights).expect("weights")),
        ];
        case_with(&format!("tiny, packed instruction data, 4-bit + LoRA {qlora}, fused {fuse}"), TINY, o, &extra);
    }
}

#[test]
fn the_tiny_full_finetune_unfused() {
    case("tiny, full fine-tune, unfused", TINY, options(false, false, 2, 16));
}

#[test]
fn the_tiny_full_finetune_fused() {
    case("tiny, full fine-tune, fused", TINY, options(false, true, 2, 16));
}

#[test]
fn the_tiny_4bit_lora_fused() {
    case("tiny, 4-bit + LoRA, fused", TINY, options(true, true, 2, 16));
}

/// The tiny 4-bit + LoRA step in bf16 and in fp16 (`--precision`): 16-bit activations, stores
/// rounded to nearest even, fp16 loss scaling.
#[test]
fn the_tiny_4bit_lora_fused_in_bf16_and_fp16() {
    for p in [Precision::Bf16, Precision::Fp16] {
        let mut o = options(true, true, 2, 16);
        o.precision = p;
        case(&format!("tiny, 4-bit + LoRA, fused, {p}"), TINY, o);
    }
}

/// The demo's configuration (examples/demo.sh: Q4_0 g32 + LoRA r 16, fused) at B x T.
fn demo(b: usize, t: usize) -> StepOptions {
    let mut o = StepOptions::new(b, t);
    o.model.full_finetune = false;
    o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 32, scheme: QuantScheme::Q4_0 }));
    o.model.lora = Some(LoraOptions::new(16));
    o.fuse = Some(FuseOptions::default());
    o
}

/// The demo's model and configuration at B 1 T 64: what the tiny steps do not have (f16 scales
/// and checkpoint, Q4_0, cross-entropy rows of the whole 50257-token vocabulary, attention over
/// two key tiles) at a quarter of the demo step's time.
#[test]
fn the_demo_model_at_b1_t64() {
    case("Shakespeare GPT-2 (Q4_0 + LoRA 16, B 1, T 64, fused)", SHAKESPEARE, demo(1, 64));
}

/// The demo's model (hs 32) at B 1 T 80 in bf16 and in fp16: the step's own attention kernels
/// (forward; delta, dq, dk/dv, dv) on the tensor-core path, with the views the lowering gives
/// them. Measured: out/dq/dk/dv 8.3e-4..2.8e-3 norm-wise in bf16, 9.6e-5..3.2e-4 in fp16; lse and
/// delta 1.1e-7. Ignored by default: 3.4 minutes on 2 cores, nearly all in the evaluator's GEMMs
/// (the hand-made `the_tensor_core_attention` covers the same templates in seconds); run it
/// with `-- --ignored`.
#[test]
#[ignore = "3.4 minutes on 2 cores (the evaluator's GEMMs); run with --ignored"]
fn the_demo_model_in_bf16_and_fp16() {
    for p in [Precision::Bf16, Precision::Fp16] {
        let mut o = demo(1, 80);
        o.precision = p;
        case(&format!("Shakespeare GPT-2 {p} (B 1, T 80)"), SHAKESPEARE, o);
    }
}

/// tests/gpu_step.rs's demo step (B 4, T 128), each kernel as `every_kernel_of_the_demo_step_matches_the_evaluator`
/// checks it on a GPU. Ignored by default: 3.5 minutes on a 2-core machine, 190 s of them in the
/// evaluator's GEMMs (`HostGpu`'s host model of cuBLAS); run it with `-- --ignored`.
#[test]
#[ignore = "3.5 minutes on 2 cores (the evaluator's GEMMs); run with --ignored"]
fn the_demo_step() {
    case("Shakespeare GPT-2 demo step (Q4_0 + LoRA 16, B 4, T 128, fused)", SHAKESPEARE, demo(4, 128));
}

/// The GEMM plans' data moves (`blas::move_kernels`: pack, unpack, zero, bias), which the steps
/// above do not need: hand-made GEMMs whose plans do (tests/blas_plan.rs's fallbacks), on
/// buffers of arbitrary values.
#[test]
fn the_gemm_plans_data_moves() {
    let Some(cxx) = Cxx::find(qatc_kernels::cuda::headers()) else { return };
    let view = |buf: usize, offset: usize, shape: &[usize], strides: &[usize]| View {
        buf,
        offset,
        shape: shape.to_vec(),
        strides: strides.to_vec(),
    };
    let gemm = |a: View, b: View, c: View, accumulate: bool, bias: Option<View>| {
        let r = c.shape.len();
        let (m, n, k) = (c.shape[r - 2], c.shape[r - 1], a.shape[r - 1]);
        let types = GemmTypes { bias: bias.as_ref().map(|_| DType::F32), ..GemmTypes::F32 };
        Gemm { a, b, c, m, n, k, alpha: 0.5, accumulate, bias, types, note: "hand-made".into() }
    };
    let gemms = vec![
        // a packed operand (no unit stride) and a broadcast one (stride 0)
        gemm(view(0, 1, &[3, 5], &[10, 2]), view(1, 0, &[5, 4], &[4, 1]), view(2, 0, &[3, 4], &[4, 1]), false, None),
        gemm(view(0, 0, &[3, 5], &[0, 1]), view(1, 0, &[5, 4], &[4, 1]), view(4, 0, &[3, 4], &[4, 1]), false, None),
        // a strided destination, accumulating, with a bias: packed, computed, unpacked, the bias added
        gemm(view(0, 0, &[3, 5], &[5, 1]), view(1, 0, &[5, 4], &[4, 1]), view(5, 0, &[3, 4], &[9, 2]), true, Some(view(3, 0, &[4], &[1]))),
        // a bias off a 16-byte boundary, and a column-major destination with a bias: bias steps
        gemm(view(0, 0, &[3, 5], &[5, 1]), view(1, 0, &[5, 4], &[4, 1]), view(6, 0, &[3, 4], &[4, 1]), true, Some(view(3, 1, &[4], &[1]))),
        gemm(view(0, 0, &[3, 5], &[5, 1]), view(1, 0, &[5, 4], &[4, 1]), view(7, 0, &[3, 4], &[1, 3]), false, Some(view(3, 0, &[4], &[1]))),
        // k = 0: c = bias, no call (zero, then the bias)
        gemm(view(0, 0, &[3, 0], &[0, 1]), view(1, 0, &[0, 4], &[4, 1]), view(8, 0, &[3, 4], &[4, 1]), false, Some(view(3, 0, &[4], &[1]))),
    ];
    let buffers = (0..9).map(|i| Buffer::new(format!("b{i}"), DType::F32, &[200], BufKind::Temp)).collect();
    let prog = Program { buffers, steps: gemms.into_iter().map(|g| Step::Gemm(Box::new(g))).collect(), ..Default::default() };
    let init = |b: &Buffer| {
        let seed: u32 = b.name.bytes().map(u32::from).sum();
        let v: Vec<f32> = (0..200u32).map(|i| ((i.wrapping_mul(2654435761).wrapping_add(seed * 97)) % 1000) as f32 / 250.0 - 2.0).collect();
        Some(bytes_of(&v, f32::to_le_bytes))
    };
    let start = Instant::now();
    let (run, moves, _) = check_program(&cxx, "hand-made GEMMs' data moves", &prog, &init, start, Duration::ZERO);
    assert!(moves >= 4 && run == moves, "the plans move data: {moves} move kernels, {run} run");
}

/// The tensor-core attention (`qatc_attention_mma.cuh`, never run on a GPU yet) with its mma
/// emulated by the shim from the PTX ISA's fragment layouts: every part (forward; lse, delta, dq,
/// dk/dv, dv) in bf16 and f16, hs 64, 32 and 48, more than one (b, h), T not a multiple of the
/// 64-row tiles (the masked, zero-padded last tile). Each kernel's text is checked to call the
/// mma template (no silent fp32 fallback) and its run to reach the shim's mma.
///
/// The evaluator keeps P and dS in f32 where the kernels round them to the 16-bit type as mma
/// operands, so out, dq, dk and dv are compared norm-wise (`mma_tolerance`: 1e-2 with bf16,
/// 1.5e-3 with f16); lse and delta, which sum unrounded P, at the f32 tolerance (1e-5 max-wise).
/// Measured here, norm-wise: out 4.2e-4..8.0e-4, dq/dk/dv 1.4e-3..2.0e-3 with bf16 (whose unit
/// roundoff is 3.9e-3); out 5.7e-5..9.7e-5, dq/dk/dv 1.7e-4..2.8e-4 with f16 (4.9e-4); lse and
/// delta at most 3.9e-7 max-wise. Broken on purpose: with the shim's A registers a1 and a2
/// swapped, out is off by 1.0 norm-wise, dq 4.9, dk 2.8, dv 2.1, lse 0.42 and delta 1.9
/// max-wise; with the causal mask letting key i + 1 into row i (forward and dq), out by 0.23,
/// dq 11, lse 0.29, delta 7.1.
#[test]
fn the_tensor_core_attention() {
    let Some(cxx) = Cxx::find(qatc_kernels::cuda::headers()) else { return };
    let shapes = [
        attention::Dims { b: 2, nh: 2, t: 100, hs: 64 },
        attention::Dims { b: 1, nh: 3, t: 77, hs: 32 },
        // one block of rows, partly past T
        attention::Dims { b: 2, nh: 1, t: 50, hs: 48 },
    ];
    for values in [DType::BF16, DType::F16] {
        for d in shapes {
            let prog = attention::program(d, values, false);
            for k in &prog.kernels {
                let source = qatc_kernels::cuda::emit(k).expect("emits").source;
                assert!(source.contains("_mma<"), "{}: not the tensor-core template:\n{source}", k.note);
            }
            let what = format!("tensor-core attention, {values} values, B {} NH {} T {} hs {}", d.b, d.nh, d.t, d.hs);
            let init = |b: &Buffer| attention::init(b, values);
            let (run, _, mma) = check_program(&cxx, &what, &prog, &init, Instant::now(), Duration::ZERO);
            assert_eq!(run, prog.kernels.len(), "{what}: every part runs");
            for k in &prog.kernels {
                let Body::Attention(a) = &k.body else { unreachable!("attention kernels only") };
                let checked = mma.iter().filter(|m| m.part == a.part && m.mma > 0).count();
                assert!(checked > 0, "{what}: {:?} was compared with its mma emulated", a.part);
            }
        }
    }
}

// ---- the harness itself: hand-written kernels with the bugs it is for ----

/// Builds one hand-written kernel; runs it on `bufs` (one param each) with `grid` x `block`;
/// returns the outcome and the buffers after (as before where the run failed).
fn run_hand(cxx: &Cxx, name: &str, source: &str, bufs: &[Vec<u8>], grid: u32, block: u32, limit: Duration) -> (Outcome, Vec<Vec<u8>>) {
    let (built, _) = cxx.build(&[(name.to_string(), unit(name, source))], 1);
    let exe = built.into_iter().next().expect("one").unwrap_or_else(|e| panic!("{name}: {e}"));
    let dir = tempfile::tempdir().expect("a directory");
    for (s, b) in bufs.iter().enumerate() {
        std::fs::write(dir.path().join(format!("in{s}.bin")), b).expect("writes");
    }
    let slots: Vec<String> = (0..bufs.len()).map(|s| s.to_string()).collect();
    let argv = [
        dir.path().display().to_string(),
        slots.join(","),
        format!("{grid},1,1"),
        format!("{block},1,1"),
        if needs_fibers(source) { "fibers" } else { "direct" }.to_string(),
    ];
    let outcome = cxx::start(&exe, &argv, &dir.path().join("stderr.txt")).expect("starts").wait(limit);
    let after =
        (0..bufs.len()).map(|s| std::fs::read(dir.path().join(format!("out{s}.bin"))).unwrap_or_else(|_| bufs[s].clone())).collect();
    (outcome, after)
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn ints(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn bytes_of<T: Copy, const N: usize>(v: &[T], to: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| to(x)).collect()
}

/// The bug that started this: a loop bound `j < rank == 0 ? 1 : 0` (C reads
/// `((j < rank) == 0) ? 1 : 0`: for rank 0 a loop that never ends). The parenthesized bound
/// computes; the misparsed one is killed at the time limit and reported as such.
#[test]
fn an_endless_loop_bound_is_caught() {
    let Some(cxx) = Cxx::find(qatc_kernels::cuda::headers()) else { return };
    let kernel = |bound: &str| {
        format!(
            "#include \"qatc_common.cuh\"\n\
             extern \"C\" __global__ void __launch_bounds__(256) fused_bound_test(const int* __restrict__ rank, float* __restrict__ y) {{\n\
             const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n\
             if (idx >= 4) return;\n\
             float acc = 0.0f;\n\
             for (long long j = 0; j < {bound}; ++j) acc += 1.0f;\n\
             y[idx] = acc;\n}}\n"
        )
    };
    let bufs = [bytes_of(&[0i32], i32::to_le_bytes), vec![0u8; 16]];
    let (good, after) = run_hand(&cxx, "fused_bound_test", &kernel("(rank[0] == 0 ? 1 : 0)"), &bufs, 1, 256, Duration::from_secs(20));
    assert!(matches!(good, Outcome::Ok), "{good:?}");
    assert_eq!(floats(&after[1]), [1.0; 4]);
    let (bad, _) = run_hand(&cxx, "fused_bound_test", &kernel("rank[0] == 0 ? 1 : 0"), &bufs, 1, 256, Duration::from_secs(2));
    assert!(matches!(bad, Outcome::TimedOut(_)), "the misparsed bound runs forever: {bad:?}");
}

/// A block whose threads read shared memory that others wrote, with and without the barrier
/// between: without it the result depends on the order the threads run in, which the two runs
/// (ascending, descending) see. And threads stuck at different barriers.
#[test]
fn a_missing_barrier_is_caught() {
    let Some(cxx) = Cxx::find(qatc_kernels::cuda::headers()) else { return };
    let kernel = |sync: &str| {
        format!(
            "extern \"C\" __global__ void fused_barrier_test(const float* __restrict__ x, float* __restrict__ y) {{\n\
             __shared__ float s[64];\n\
             s[threadIdx.x] = x[blockIdx.x * 64 + threadIdx.x];\n\
             {sync}\n\
             y[blockIdx.x * 64 + threadIdx.x] = s[63 - threadIdx.x];\n}}\n"
        )
    };
    let x: Vec<f32> = (0..128).map(|i| i as f32).collect();
    let bufs = [bytes_of(&x, f32::to_le_bytes), vec![0u8; 512]];
    let (ok, after) = run_hand(&cxx, "fused_barrier_test", &kernel("__syncthreads();"), &bufs, 2, 64, TIME_LIMIT);
    assert!(matches!(ok, Outcome::Ok), "{ok:?}");
    let want: Vec<f32> = (0..128).map(|i| (i / 64 * 64 + 63 - i % 64) as f32).collect();
    assert_eq!(floats(&after[1]), want);
    let (racy, _) = run_hand(&cxx, "fused_barrier_test", &kernel("__syncwarp();"), &bufs, 2, 64, TIME_LIMIT);
    match racy {
        Outcome::Failed(_, err) => assert!(err.contains("depends on the order"), "{err}"),
        o => panic!("a race across warps is caught: {o:?}"),
    }
    // threads of one warp at different barriers: a deadlock, reported at once
    let split = "extern \"C\" __global__ void fused_deadlock_test(float* __restrict__ y) {\n\
                 if (threadIdx.x % 2) __syncthreads(); else __syncwarp();\n\
                 y[threadIdx.x] = 1.0f;\n}\n";
    match run_hand(&cxx, "fused_deadlock_test", split, &[vec![0u8; 128]], 1, 32, TIME_LIMIT).0 {
        Outcome::Failed(_, err) => assert!(err.contains("deadlock"), "{err}"),
        o => panic!("a deadlock is caught: {o:?}"),
    }
}

/// An index one past a param's end faults, and the report names the buffer; signed overflow in
/// index arithmetic stops the kernel.
#[test]
fn out_of_bounds_and_overflow_are_caught() {
    let Some(cxx) = Cxx::find(qatc_kernels::cuda::headers()) else { return };
    let oob = "extern \"C\" __global__ void fused_oob_test(const float* __restrict__ x, float* __restrict__ y) {\n\
               const int idx = blockIdx.x * blockDim.x + threadIdx.x;\n\
               if (idx > 16) return;\n\
               y[idx] = x[idx];\n}\n";
    let bufs = [vec![0u8; 64], vec![0u8; 64]];
    match run_hand(&cxx, "fused_oob_test", oob, &bufs, 1, 32, TIME_LIMIT).0 {
        Outcome::Failed(_, err) => assert!(err.contains("bytes past the end of buffer 0"), "{err}"),
        o => panic!("an access past the end is caught: {o:?}"),
    }
    // one byte past a 5-byte buffer: between its end and the guard page, caught after the launch
    let byte = "extern \"C\" __global__ void fused_byte_test(unsigned char* __restrict__ y) { y[threadIdx.x] = 1; }\n";
    match run_hand(&cxx, "fused_byte_test", byte, &[vec![0u8; 5]], 1, 6, TIME_LIMIT).0 {
        Outcome::Failed(_, err) => assert!(err.contains("a write 0 bytes past the end of buffer 0"), "{err}"),
        o => panic!("a write just past the end is caught: {o:?}"),
    }
    let overflow = "extern \"C\" __global__ void fused_overflow_test(const int* __restrict__ n, int* __restrict__ y) {\n\
                    const int big = n[0] * 65536;\n\
                    y[threadIdx.x] = big / 65536;\n}\n";
    let bufs = [bytes_of(&[65536i32], i32::to_le_bytes), vec![0u8; 4]];
    match run_hand(&cxx, "fused_overflow_test", overflow, &bufs, 1, 1, TIME_LIMIT).0 {
        Outcome::Failed(_, err) => assert!(err.contains("signed integer overflow"), "{err}"),
        o => panic!("signed overflow is caught: {o:?}"),
    }
}

/// The shim's mma.sync is the warp's: each lane gets its own part of D = A B + C back (A and B
/// all ones: D = C + 16, whatever the layouts), and a warp with lanes that returned before it
/// stops the run, naming the first missing lane.
#[test]
fn the_shims_mma_needs_the_whole_warp() {
    let Some(cxx) = Cxx::find(qatc_kernels::cuda::headers()) else { return };
    let kernel = |live: u32| {
        format!(
            "#include \"qatc_common.cuh\"\n#include \"qatc_attention.cuh\"\n#include \"qatc_attention_mma.cuh\"\n\
             extern \"C\" __global__ void fused_mma_test(float* __restrict__ d) {{\n\
             const int lane = threadIdx.x;\n\
             if (lane >= {live}) return;\n\
             const unsigned one = qatc::pack_half2(0x3f80, 0x3f80);  // bf16 1.0, twice\n\
             const unsigned a[4] = {{one, one, one, one}}, b[2] = {{one, one}};\n\
             float c[4];\n\
             for (int i = 0; i < 4; ++i) c[i] = (float)(lane * 4 + i);\n\
             qatc::MmaBf16::mma(c, a, b);\n\
             for (int i = 0; i < 4; ++i) d[lane * 4 + i] = c[i];\n}}\n"
        )
    };
    let (ok, after) = run_hand(&cxx, "fused_mma_test", &kernel(32), &[vec![0u8; 512]], 1, 32, TIME_LIMIT);
    assert!(matches!(ok, Outcome::Ok), "{ok:?}");
    assert_eq!(floats(&after[0]), (0..128).map(|i| i as f32 + 16.0).collect::<Vec<_>>());
    match run_hand(&cxx, "fused_mma_test", &kernel(16), &[vec![0u8; 512]], 1, 32, TIME_LIMIT).0 {
        Outcome::Failed(_, err) => assert!(err.contains("without lane 16 of the warp, which has returned"), "{err}"),
        o => panic!("an mma.sync without the whole warp is caught: {o:?}"),
    }
}

/// The shim's scalar semantics are CUDA's (float -> integer conversions saturate toward zero,
/// NaN -> 0; max/min helpers; 4-bit stores), and qatc's block and warp reductions sum as a GPU
/// does.
#[test]
fn the_shim_has_cudas_semantics() {
    let Some(cxx) = Cxx::find(qatc_kernels::cuda::headers()) else { return };
    let source = "#include \"qatc_common.cuh\"\n#include \"qatc_reduce.cuh\"\n\
        extern \"C\" __global__ void __launch_bounds__(128) fused_semantics_test(const float* __restrict__ x, int* __restrict__ out, \
        unsigned char* __restrict__ codes, float* __restrict__ sums) {\n\
        __shared__ float scratch[32];\n\
        const int t = threadIdx.x;\n\
        if (t == 0) {\n\
            out[0] = __float2int_rz(__int_as_float(0x7fffffff));\n\
            out[1] = __float2int_rz(3.0e9f);\n\
            out[2] = __float2int_rz(-3.0e9f);\n\
            out[3] = __float2int_rz(-2.7f);\n\
            out[4] = (int)(__double2ll_rz(1e300) >> 32);\n\
            out[5] = (int)__double2ll_rz(-7.9);\n\
            out[6] = __float_as_int(qatc::max_nan(1.0f, __int_as_float(0x7fc00000)));\n\
            out[7] = __float_as_int(fmaxf(1.0f, __int_as_float(0x7fc00000)));\n\
            out[8] = max(-3, 2) + 10 * min(-3, 2);\n\
        }\n\
        qatc::store_i4(codes, t, t % 16);\n\
        const float b = qatc::block_sum(x[blockIdx.x * 128 + t], scratch);\n\
        const float w = qatc::warp_sum(x[blockIdx.x * 128 + t]);\n\
        const float m = qatc::block_max(x[blockIdx.x * 128 + t], scratch);\n\
        if (t == 0) sums[blockIdx.x * 3] = b;\n\
        if (t == 32) sums[blockIdx.x * 3 + 1] = w;\n\
        if (t == 127) sums[blockIdx.x * 3 + 2] = m;\n}\n";
    let x: Vec<f32> = (0..256).map(|i| i as f32).collect();
    let bufs = [bytes_of(&x, f32::to_le_bytes), vec![0u8; 9 * 4], vec![0u8; 64], vec![0u8; 6 * 4]];
    let (o, after) = run_hand(&cxx, "fused_semantics_test", source, &bufs, 2, 128, TIME_LIMIT);
    assert!(matches!(o, Outcome::Ok), "{o:?}");
    let nan = 0x7fc00000u32 as i32;
    assert_eq!(ints(&after[1]), [0, i32::MAX, i32::MIN, -2, i32::MAX, -7, nan, 1.0f32.to_bits() as i32, 2 - 30]);
    let codes: Vec<u8> = (0..64).map(|b| ((2 * b % 16) | ((2 * b + 1) % 16) << 4) as u8).collect();
    assert_eq!(after[2], codes);
    let sum = |r: std::ops::Range<i32>| r.map(|i| i as f32).sum::<f32>();
    assert_eq!(floats(&after[3]), [sum(0..128), sum(32..64), 127.0, sum(128..256), sum(160..192), 255.0]);
}

/// The tables of the generated `qatc_tables.cuh` (NF4, the 8-bit maps) read back in C as the IR's
/// constants, bit for bit: the C compiler parses every literal to the f32 the IR holds.
#[test]
fn the_generated_tables_read_back_in_c_as_the_irs() {
    let Some(cxx) = Cxx::find(qatc_kernels::cuda::headers()) else { return };
    let source = "#include \"qatc_common.cuh\"\n#include \"qatc_quant.cuh\"\n\
        extern \"C\" __global__ void __launch_bounds__(256) fused_tables_test(float* __restrict__ out) {\n\
        const int t = threadIdx.x;\n\
        if (t < 16) out[t] = qatc::nf4_value(t);\n\
        out[16 + t] = qatc::dyn_value(qatc::DYN_SIGNED, t);\n\
        out[272 + t] = qatc::dyn_value(qatc::DYN_UNSIGNED, t);\n}\n";
    let (o, after) = run_hand(&cxx, "fused_tables_test", source, &[vec![0u8; 528 * 4]], 1, 256, TIME_LIMIT);
    assert!(matches!(o, Outcome::Ok), "{o:?}");
    let want: Vec<f32> =
        qatc_ir::NF4.iter().chain(qatc_ir::DynMap::Signed.values()).chain(qatc_ir::DynMap::Unsigned.values()).copied().collect();
    let got = floats(&after[0]);
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "element {i}: {g} vs {w}");
    }
}
