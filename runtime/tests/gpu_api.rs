//! The GPU API (`qatc_runtime::cuda`): the host emulation's memory, copies, capture and replay,
//! launches and GEMM plans; and the CUDA driver, which must refuse without panicking where there
//! is no CUDA (here) and pass the same checks where there is a GPU.
//!
//! The checks both must pass are functions over `&mut dyn GpuApi` (below, before the tests) with
//! a way to make each kernel's [`KernelImage`]: the emulation runs the kernel IR, a GPU a CUBIN
//! that NVRTC compiles. The HostGpu tests run them and add what only the emulation can tell (its
//! counters, its poison, bounds it checks where a GPU would not); the driver's test runs them on
//! the real GPU, so a first launch, capture, pinned copy or cuBLAS(Lt) call that fails does so
//! here, one part at a time, rather than inside a whole training step.

use std::path::PathBuf;

use qatc_ir::DType;
use qatc_kernels::cuda::blas::{self, host as blas_host, BlasMode, BlasPlan, BlasStep, Mem};
use qatc_kernels::cuda::emit::launch_dims;
use qatc_kernels::kir::{BinOp, Body, Expr, Ix, Kernel, Param, Space, Stmt, Ty};
use qatc_kernels::nvrtc::{Arch, BuildOptions, Nvrtc};
use qatc_kernels::program::{BufKind, Buffer, Gemm, View};
use qatc_runtime::cuda::{run_plan, CudaDriver, DevPtr, GpuApi, GpuError, HostGpu, KernelImage, PlanFuncs};

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn from_bytes(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// y[i] = 2 * x[i] + 1 over n elements.
fn affine(n: usize) -> Kernel {
    let x = Expr::load(0, Expr::Ix(Ix::Elem));
    let value = Expr::bin(BinOp::Add, Expr::bin(BinOp::Mul, x, Expr::f32(2.0)), Expr::f32(1.0));
    Kernel {
        family: "affine".into(),
        params: vec![
            Param { name: "x".into(), dtype: DType::F32, shape: vec![n], write: false },
            Param { name: "y".into(), dtype: DType::F32, shape: vec![n], write: true },
        ],
        index_ty: Ty::I32,
        body: Body::Loops {
            space: Space::Elements { shape: vec![n] },
            stmts: vec![Stmt::Store { param: 1, index: Expr::Ix(Ix::Elem), value }],
        },
        note: "y = 2x + 1".into(),
        names: Default::default(),
    }
}

/// How the GPU under test gets a kernel: [`host_image`] for the emulation, [`cubin_image`] for
/// a GPU.
type MakeImage<'a> = &'a dyn Fn(&Kernel) -> KernelImage;

/// The emulation's image: it runs the kernel IR, so the CUBIN is left empty (no NVRTC needed).
fn host_image(k: &Kernel) -> KernelImage {
    let cuda = qatc_kernels::cuda::emit(k).expect("emits");
    KernelImage { name: cuda.name, cubin: Vec::new(), kernel: k.clone(), launch: cuda.launch }
}

/// A GPU's image: the kernel's CUDA C compiled by NVRTC to a CUBIN for `arch` (no cache: the
/// test compiles what it runs).
fn cubin_image(nv: &Nvrtc, arch: Arch, k: &Kernel) -> KernelImage {
    let cuda = qatc_kernels::cuda::emit(k).expect("emits");
    let options = BuildOptions { arch, cache: None, jobs: 1, source_dir: None };
    let (compiled, _) = qatc_kernels::nvrtc::compile_cubins(nv, std::slice::from_ref(&cuda), &options)
        .unwrap_or_else(|e| panic!("{} for {arch}: {e}", cuda.name));
    let c = compiled.into_iter().next().expect("one kernel compiled");
    KernelImage { name: c.name, cubin: c.cubin, kernel: k.clone(), launch: c.launch }
}

/// NVRTC as the root crate's tests find it: QATC_NVRTC_LIB when set, else the wheel `make test`
/// installs under the workspace root, else the loader's path. Only called where a GPU is present,
/// and a GPU machine must have NVRTC, so a missing one is a failure with the reason, not a skip.
fn nvrtc_for_gpu() -> Nvrtc {
    let wheel = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.deps/nvrtc/nvidia/cu13/lib/libnvrtc.so.13");
    let from_env = std::env::var_os("QATC_NVRTC_LIB").filter(|v| !v.is_empty()).map(PathBuf::from);
    let lib = from_env.or_else(|| wheel.exists().then_some(wheel));
    Nvrtc::open_with(lib.as_deref()).unwrap_or_else(|e| panic!("a GPU is present but NVRTC is not: {e}"))
}

/// Bytes of device memory in use, by the API's own count.
fn used(g: &dyn GpuApi) -> usize {
    let (free, total) = g.memory().expect("known");
    total - free
}

/// Device copies and memsets, then a round trip through a pinned buffer with asynchronous
/// copies, read back after the stream is done. Allocates two 64-byte buffers and a 16-byte pinned
/// one and frees them all; a pinned buffer freed twice is an error (the API keeps the table).
fn copies_and_memsets(g: &mut dyn GpuApi) {
    let a = g.alloc(64).expect("room");
    let b = g.alloc(64).expect("room");
    g.upload(a, &f32s(&[1.0, 2.0, 3.0, 4.0])).expect("uploads");
    g.copy(b + 8, a, 8).expect("copies");
    g.memset(b, 0, 8).expect("sets");
    let mut out = vec![0u8; 16];
    g.download(&mut out, b).expect("downloads");
    assert_eq!(from_bytes(&out), [0.0, 0.0, 1.0, 2.0]);
    let p = g.alloc_pinned(16).expect("pinned");
    g.pinned(p).expect("a buffer").copy_from_slice(&f32s(&[5.0, 6.0, 7.0, 8.0]));
    g.upload_pinned(a, p, 4, 8).expect("uploads");
    g.download_pinned(p, 0, a, 4).expect("downloads");
    g.synchronize().expect("syncs");
    assert_eq!(from_bytes(g.pinned(p).expect("a buffer")), [6.0, 6.0, 7.0, 8.0]);
    g.free_pinned(p).expect("freed");
    assert!(g.free_pinned(p).is_err(), "a pinned buffer freed twice is an error");
    g.free(a).expect("freed");
    g.free(b).expect("freed");
}

/// The affine kernel over `n` elements launched once, then a launch and a device copy captured
/// and replayed twice. y is set to 0xff bytes (NaN) before the capture, so that reading it
/// between capture and replay shows that nothing captured ran; pageable copies and
/// synchronization are refused while capturing. Launches with the dims the image was written
/// for; frees what it allocates.
fn launch_capture_and_replay(g: &mut dyn GpuApi, image: MakeImage, n: usize) {
    let img = image(&affine(n));
    let f = g.load(&img).expect("loads");
    let (x, y) = (g.alloc(4 * n).expect("room"), g.alloc(4 * n).expect("room"));
    let input: Vec<f32> = (0..n).map(|i| i as f32).collect();
    g.upload(x, &f32s(&input)).expect("uploads");
    let mut out = vec![0u8; 4 * n];
    // one launch, run at once: y = 2x + 1
    g.launch(f, &img.launch, &[x, y]).expect("launches");
    g.download(&mut out, y).expect("downloads");
    assert_eq!(from_bytes(&out), input.iter().map(|&v| 2.0 * v + 1.0).collect::<Vec<_>>(), "one launch");
    // a capture records: y = 2x + 1, then x = y
    g.memset(y, 0xff, 4 * n).expect("sets");
    g.synchronize().expect("syncs");
    g.begin_capture().expect("begins");
    g.launch(f, &img.launch, &[x, y]).expect("recorded");
    g.copy(x, y, 4 * n).expect("recorded");
    assert!(g.download(&mut out, y).is_err(), "a pageable copy while capturing");
    assert!(g.synchronize().is_err(), "a synchronization while capturing");
    let graph = g.end_capture().expect("a graph");
    g.download(&mut out, y).expect("downloads");
    assert!(from_bytes(&out).iter().all(|v| v.is_nan()), "captured work does not run");
    // each replay applies y = 2x + 1, x = y
    g.replay(graph).expect("replays");
    g.replay(graph).expect("replays");
    g.download(&mut out, y).expect("downloads");
    let want: Vec<f32> = input.iter().map(|&v| 2.0 * (2.0 * v + 1.0) + 1.0).collect();
    assert_eq!(from_bytes(&out), want, "two replays");
    g.download(&mut out, x).expect("downloads");
    assert_eq!(from_bytes(&out), want, "the captured copy");
    g.free(x).expect("freed");
    g.free(y).expect("freed");
}

/// The GEMMs of the plans test, one per path through the planner (`BlasPlan::summary` says which):
/// a bias at an unaligned offset, added by a step of its own; A packed from strides no library
/// call takes; C computed in a scratch and unpacked; batch dims that do not nest, as a loop of
/// strided-batched calls; and an aligned bias as cuBLASLt's BIAS epilogue. Their views are into
/// [`plan_buffers`].
fn plan_cases() -> Vec<Gemm> {
    let view = |buf, offset, shape: &[usize], strides: &[usize]| View { buf, offset, shape: shape.to_vec(), strides: strides.to_vec() };
    let gemm = |a: View, b: View, c: View, accumulate, bias: Option<View>| {
        let r = c.shape.len();
        let (m, n, k) = (c.shape[r - 2], c.shape[r - 1], a.shape[r - 1]);
        let types = qatc_kernels::program::GemmTypes { bias: bias.as_ref().map(|_| DType::F32), ..qatc_kernels::program::GemmTypes::F32 };
        Gemm { a, b, c, m, n, k, alpha: 0.5, accumulate, bias, types, note: "test".into() }
    };
    vec![
        gemm(view(0, 0, &[3, 5], &[5, 1]), view(1, 0, &[5, 4], &[4, 1]), view(2, 0, &[3, 4], &[4, 1]), true, Some(view(3, 1, &[4], &[1]))),
        gemm(
            view(0, 1, &[3, 5], &[10, 2]),
            view(1, 0, &[5, 4], &[1, 5]),
            view(2, 0, &[3, 4], &[1, 3]),
            false,
            Some(view(3, 0, &[4], &[1])),
        ),
        gemm(view(0, 0, &[3, 5], &[5, 1]), view(1, 0, &[5, 4], &[4, 1]), view(2, 0, &[3, 4], &[9, 2]), true, None),
        gemm(
            view(0, 0, &[2, 3, 4, 2], &[72, 2, 18, 1]),
            view(1, 6, &[2, 3, 2, 4], &[72, 2, 1, 18]),
            view(2, 0, &[2, 3, 4, 4], &[48, 16, 4, 1]),
            false,
            None,
        ),
        gemm(view(0, 0, &[3, 5], &[5, 1]), view(1, 0, &[5, 4], &[4, 1]), view(2, 0, &[3, 4], &[4, 1]), true, Some(view(3, 0, &[4], &[1]))),
    ]
}

/// The element types of a plan case: A and B's, C's (and the bias's: C's, or f32 with f32 C).
#[derive(Clone, Copy, Debug)]
struct Types {
    ab: DType,
    c: DType,
}

impl Types {
    const F32: Types = Types { ab: DType::F32, c: DType::F32 };

    /// What `--precision bf16|fp16` steps multiply: 16-bit A and B, C in the same type or in f32
    /// (the chunked cross-entropy's dh, a widened pack part).
    const SIXTEEN: [Types; 4] = [
        Types { ab: DType::BF16, c: DType::BF16 },
        Types { ab: DType::BF16, c: DType::F32 },
        Types { ab: DType::F16, c: DType::F16 },
        Types { ab: DType::F16, c: DType::F32 },
    ];

    fn of(self, buf: usize) -> DType {
        if buf < 2 {
            self.ab
        } else {
            self.c
        }
    }

    /// `gemm` retyped.
    fn gemm(self, gemm: &Gemm) -> Gemm {
        let mut g = gemm.clone();
        g.types = qatc_kernels::program::GemmTypes { a: self.ab, b: self.ab, c: self.c, bias: g.bias.as_ref().map(|_| self.c) };
        g
    }

    /// Half the distance between neighbouring values of C's type, relative to 1.
    fn c_rounding(self) -> f32 {
        match self.c {
            DType::BF16 => 2f32.powi(-8),
            DType::F16 => 2f32.powi(-11),
            _ => 0.0,
        }
    }
}

/// `v` as `dtype`'s little-endian bytes (rounded to nearest even).
fn encode(dtype: DType, v: &[f32]) -> Vec<u8> {
    match dtype {
        DType::BF16 => v.iter().flat_map(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes()).collect(),
        DType::F16 => v.iter().flat_map(|&x| half::f16::from_f32(x).to_bits().to_le_bytes()).collect(),
        _ => f32s(v),
    }
}

fn decode(dtype: DType, b: &[u8]) -> Vec<f32> {
    let halves = || b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]));
    match dtype {
        DType::BF16 => halves().map(|h| half::bf16::from_bits(h).to_f32()).collect(),
        DType::F16 => halves().map(|h| half::f16::from_bits(h).to_f32()).collect(),
        _ => from_bytes(b),
    }
}

/// Four buffers of 200 elements: A, B, C (the output) and the bias, of `types`.
fn plan_buffers(types: Types) -> Vec<Buffer> {
    (0..4).map(|i| Buffer::new(format!("b{i}"), types.of(i), &[200], BufKind::Temp)).collect()
}

/// One GEMM's plan run on a GPU and on the host model.
struct PlanRun {
    plan: BlasPlan,
    /// The output buffer (C, whole) as the GPU left it.
    got: Vec<f32>,
    /// The same buffer as the host model (`blas_host::execute` on plain memory) left it.
    want: Vec<f32>,
}

/// Plans `gemm` strictly, runs the plan through [`run_plan`] on `g` (library calls through
/// `GpuApi::gemm`, data moves as kernels from `image`) and on the host model from the same
/// initial data. Scratch starts uninitialized on the GPU (the plan writes it before reading it)
/// and zeroed in the model; every allocation is freed.
fn run_plan_case(g: &mut dyn GpuApi, image: MakeImage, case: usize, gemm: &Gemm) -> PlanRun {
    run_typed_plan_case(g, image, case, gemm, Types::F32)
}

/// `run_plan_case` over buffers of `types` (the GEMM retyped to them). 16-bit data are multiples
/// of 1/8 below 2 in magnitude, exact in either type, so the GPU and the model read the same
/// values; C's 16-bit result is the f32 sum rounded once, which the model does not round.
fn run_typed_plan_case(g: &mut dyn GpuApi, image: MakeImage, case: usize, gemm: &Gemm, types: Types) -> PlanRun {
    let gemm = &types.gemm(gemm);
    let buffers = plan_buffers(types);
    let plan = blas::plan(gemm, &buffers, BlasMode::Strict).expect("plans");
    let bufs: Vec<DevPtr> = buffers.iter().map(|_| g.alloc(800).expect("room")).collect();
    let scratch: Vec<DevPtr> = plan.scratch.iter().map(|(t, n)| g.alloc(t.bytes() * n).expect("room")).collect();
    let step = if matches!(types.ab, DType::F32) && matches!(types.c, DType::F32) { 7.0 } else { 8.0 };
    let init: Vec<Vec<f32>> = (0..4).map(|b| (0..200).map(|i| ((i * 37 + b * 11) % 23) as f32 / step - 1.5).collect()).collect();
    for (b, (p, v)) in bufs.iter().zip(&init).enumerate() {
        g.upload(*p, &encode(types.of(b), v)).expect("uploads");
    }
    let mut funcs: PlanFuncs = Vec::new();
    for m in blas::move_kernels(&plan) {
        let img = image(&m.kernel);
        funcs.push((m.step, g.load(&img).expect("loads"), img.launch.clone()));
    }
    let resolve = |m: Mem| -> qatc_runtime::cuda::Result<DevPtr> {
        match m {
            Mem::Buf(b) => Ok(bufs[b]),
            Mem::Scratch(s) => Ok(scratch[s]),
        }
    };
    run_plan(g, &plan, &funcs, &resolve).unwrap_or_else(|e| panic!("case {case}: {e}\n{}", plan.summary()));
    let mut out = vec![0u8; types.c.bytes_for(200)];
    g.download(&mut out, bufs[2]).expect("downloads");
    for p in bufs.iter().chain(&scratch) {
        g.free(*p).expect("freed");
    }
    // the host model on plain memory: the buffers, then the scratch
    struct Plain(Vec<Vec<f32>>);
    impl blas_host::HostMemory for Plain {
        fn load(&self, m: Mem, i: usize, _: blas::ElemType) -> Result<f32, String> {
            let v = match m {
                Mem::Buf(b) => &self.0[b],
                Mem::Scratch(s) => &self.0[4 + s],
            };
            v.get(i).copied().ok_or_else(|| format!("{m:?} {i}"))
        }
        fn store(&mut self, m: Mem, i: usize, _: blas::ElemType, v: f32) -> Result<(), String> {
            let slot = match m {
                Mem::Buf(b) => &mut self.0[b],
                Mem::Scratch(s) => &mut self.0[4 + s],
            };
            *slot.get_mut(i).ok_or("out of range")? = v;
            Ok(())
        }
    }
    let mut plain = Plain(init.into_iter().chain(plan.scratch.iter().map(|(_, n)| vec![0.0; *n])).collect());
    blas_host::execute(&plan, &mut plain).expect("runs");
    let want = plain.0.swap_remove(2);
    PlanRun { plan, got: decode(types.c, &out), want }
}

/// `got` equals `want` within `rel` times the largest magnitude in `want`: a GPU's cuBLAS sums
/// in another order than the host model (NaN never passes).
fn assert_close(got: &[f32], want: &[f32], rel: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let tol = rel * want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol, "{what}: element {i} is {g}, the model's {w} (tolerance {tol})");
    }
}

#[test]
fn memory_copies_and_memsets_round_trip() {
    let mut g = HostGpu::new(1 << 20);
    copies_and_memsets(&mut g);
    assert_eq!((used(&g), g.peak_memory()), (0, 128), "two 64-byte buffers at once, all freed");
    // beyond an allocation, or in none: errors, not corruption
    let a = g.alloc(64).expect("room");
    let mut out = vec![0u8; 16];
    assert!(g.upload(a + 60, &[0; 8]).is_err());
    assert!(g.download(&mut out, a + 4096).is_err());
    g.free(a).expect("freed");
    assert!(g.free(a).is_err(), "a double free is an error");
}

#[test]
fn out_of_memory_is_cudas_error() {
    let mut g = HostGpu::new(1000);
    g.alloc(600).expect("room");
    let e = g.alloc(600).expect_err("too much");
    assert!(matches!(&e, GpuError::Driver { name, .. } if name == "CUDA_ERROR_OUT_OF_MEMORY"), "{e}");
    assert!(e.to_string().contains("cuMemAlloc(600)"));
}

#[test]
fn a_capture_records_and_a_replay_runs() {
    let mut g = HostGpu::new(1 << 20);
    launch_capture_and_replay(&mut g, &host_image, 300);
    assert_eq!(g.launches, 3, "the direct launch and one per replay: the capture ran nothing");
    assert_eq!(g.captures, 1);
    assert_eq!(used(&g), 0, "all freed");
}

#[test]
fn a_launch_checks_what_a_gpu_would_not() {
    let n = 300;
    let k = affine(n);
    let mut g = HostGpu::new(1 << 20);
    let f = g.load(&host_image(&k)).expect("loads");
    let (x, y) = (g.alloc(4 * n).expect("room"), g.alloc(4 * n).expect("room"));
    let dims = launch_dims(&k);
    g.upload(x, &vec![0u8; 4 * n]).expect("uploads");
    // a grid too small would skip work on a GPU
    let mut small = dims.clone();
    small.grid[0] -= 1;
    assert!(g.launch(f, &small, &[x, y]).expect_err("a short grid").to_string().contains("mapping needs"));
    // an allocation smaller than the param
    let short = g.alloc(4 * n - 4).expect("room");
    assert!(g.launch(f, &dims, &[x, short]).expect_err("too small").to_string().contains("needs 1200 bytes"));
    // a written param overlapping another
    assert!(g.launch(f, &dims, &[x, x]).expect_err("aliased").to_string().contains("overlap"));
    // a misaligned pointer
    assert!(g.launch(f, &dims, &[x + 2, y]).is_err());
    // a packed 4-bit param needs its padded size: 5 codes are 3 bytes, padded to 4
    let codes = Kernel {
        family: "codes".into(),
        params: vec![Param { name: "q".into(), dtype: DType::I4, shape: vec![5], write: true }],
        index_ty: Ty::I32,
        body: Body::Loops {
            space: Space::Elements { shape: vec![5] },
            stmts: vec![Stmt::Store { param: 0, index: Expr::Ix(Ix::Elem), value: Expr::Int(7) }],
        },
        note: "q = 7".into(),
        names: Default::default(),
    };
    let fc = g.load(&host_image(&codes)).expect("loads");
    let exact = g.alloc(3).expect("room");
    let err = g.launch(fc, &launch_dims(&codes), &[exact]).expect_err("unpadded");
    assert!(err.to_string().contains("needs 4 bytes"), "{err}");
    let buf = Buffer::new("q", DType::I4, &[5], BufKind::Temp);
    let padded = g.alloc(buf.device_bytes()).expect("room");
    g.launch(fc, &launch_dims(&codes), &[padded]).expect("padded as Buffer::device_bytes says");
    let mut out = [0u8; 3];
    g.download(&mut out, padded).expect("downloads");
    assert_eq!(out, [0x77, 0x77, 0xf7], "five nibbles of 7; the sixth keeps its poison");
}

/// Runs each plan on the emulated GPU (library calls through `gemm`, data moves as evaluated
/// kernels) and checks it against the host model run on plain memory: the same sums in the same
/// order, so exactly.
#[test]
fn plans_with_every_fallback_run_on_the_emulated_gpu() {
    let mut epilogues = 0;
    for (case, gemm) in plan_cases().iter().enumerate() {
        let mut gpu = HostGpu::new(1 << 20);
        let run = run_plan_case(&mut gpu, &host_image, case, gemm);
        assert_eq!(run.got, run.want, "case {case}: {}", run.plan.summary());
        assert!(gpu.gemms > 0);
        assert_eq!(used(&gpu), 0, "case {case}: all freed");
        epilogues += run.plan.steps.iter().filter(|s| matches!(s, BlasStep::Call(c) if c.bias.is_some())).count();
    }
    assert!(epilogues > 0, "a case takes cuBLASLt's BIAS epilogue, so the driver's test calls cuBLASLt");
}

/// Each plan case over 16-bit A and B, C 16-bit or f32 (`Types::SIXTEEN`), on the emulated GPU
/// against the host model: within C's rounding (the model keeps the f32 sum).
#[test]
fn sixteen_bit_plans_run_on_the_emulated_gpu() {
    for types in Types::SIXTEEN {
        for (case, gemm) in plan_cases().iter().enumerate() {
            let mut gpu = HostGpu::new(1 << 20);
            let run = run_typed_plan_case(&mut gpu, &host_image, case, gemm, types);
            let what = format!("case {case} {types:?}: {}", run.plan.summary());
            assert_close(&run.got, &run.want, types.c_rounding(), &what);
            if types.c == DType::F32 {
                assert_eq!(run.got, run.want, "{what}: an f32 C is the model's sum exactly");
            }
            assert_eq!(used(&gpu), 0, "{what}: all freed");
        }
    }
}

/// Without CUDA the driver says why, without panicking; with a GPU it passes the emulation's
/// checks (kernels compiled by NVRTC for its arch), one part per line of the log.
#[test]
fn the_cuda_driver_opens_or_says_why_not() {
    match CudaDriver::open(0) {
        Err(e) => {
            assert!(matches!(e, GpuError::Unavailable(_) | GpuError::Driver { .. }), "{e}");
            // bench/gpu.sh sets QATC_REQUIRE_GPU=1 on the GPU machine: there a driver or cuBLAS
            // that does not load fails this test rather than passing it as a skip
            assert!(
                std::env::var_os("QATC_REQUIRE_GPU").is_none_or(|v| v != "1"),
                "QATC_REQUIRE_GPU=1, but the CUDA driver did not open: {e}"
            );
            eprintln!("SKIPPED (no GPU): {e}");
        }
        Ok(mut gpu) => {
            let d = gpu.device().clone();
            eprintln!("GPU: {} ({}), {} SMs, {} bytes; {}", d.name, d.arch, d.multiprocessors, d.total_memory, d.libraries);
            let a = gpu.alloc(1024).expect("room");
            gpu.upload(a, &f32s(&[1.0, 2.0])).expect("uploads");
            gpu.memset(a + 4, 0, 4).expect("sets");
            let mut out = vec![0u8; 8];
            gpu.download(&mut out, a).expect("downloads");
            assert_eq!(from_bytes(&out), [1.0, 0.0]);
            gpu.free(a).expect("freed");
            eprintln!("GPU: alloc, upload, memset, download: ok");
            copies_and_memsets(&mut gpu);
            eprintln!("GPU: device copies, memsets, pinned round trip: ok");
            let nv = nvrtc_for_gpu();
            let image = |k: &Kernel| cubin_image(&nv, d.arch, k);
            launch_capture_and_replay(&mut gpu, &image, 300);
            eprintln!("GPU: kernel (NVRTC, {}) launch, capture and replay: ok", d.arch);
            for (case, gemm) in plan_cases().iter().enumerate() {
                let run = run_plan_case(&mut gpu, &image, case, gemm);
                assert_close(&run.got, &run.want, 1e-5, &format!("case {case}: {}", run.plan.summary()));
                eprintln!("GPU: GEMM plan case {case} (cuBLAS/cuBLASLt and data moves): ok");
            }
            // 16-bit A and B (tensor cores, f32 sums): C's rounding plus the GPU's order of sums
            for types in Types::SIXTEEN {
                for (case, gemm) in plan_cases().iter().enumerate() {
                    let run = run_typed_plan_case(&mut gpu, &image, case, gemm, types);
                    let what = format!("case {case} {types:?}: {}", run.plan.summary());
                    assert_close(&run.got, &run.want, types.c_rounding() + 1e-5, &what);
                }
                eprintln!("GPU: GEMM plan cases over {types:?}: ok");
            }
        }
    }
}
