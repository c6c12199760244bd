//! The GPU API (`qatc_runtime::cuda`): the host emulation's memory, copies, capture and replay,
//! launches and GEMM plans; and the CUDA driver, which must refuse without panicking where there
//! is no CUDA (here) and pass the same checks where there is a GPU.

use qatc_ir::DType;
use qatc_kernels::cuda::blas::{self, host as blas_host, BlasMode, Mem};
use qatc_kernels::cuda::emit::launch_dims;
use qatc_kernels::kir::{BinOp, Body, Expr, Ix, Kernel, Param, Space, Stmt, Ty};
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

fn image(k: &Kernel) -> KernelImage {
    let cuda = qatc_kernels::cuda::emit(k).expect("emits");
    KernelImage { name: cuda.name, cubin: Vec::new(), kernel: k.clone(), launch: cuda.launch }
}

#[test]
fn memory_copies_and_memsets_round_trip() {
    let mut g = HostGpu::new(1 << 20);
    let a = g.alloc(64).expect("room");
    let b = g.alloc(64).expect("room");
    g.upload(a, &f32s(&[1.0, 2.0, 3.0, 4.0])).expect("uploads");
    g.copy(b + 8, a, 8).expect("copies");
    g.memset(b, 0, 8).expect("sets");
    let mut out = vec![0u8; 16];
    g.download(&mut out, b).expect("downloads");
    assert_eq!(from_bytes(&out), [0.0, 0.0, 1.0, 2.0]);
    // beyond an allocation, or in none: errors, not corruption
    assert!(g.upload(a + 60, &[0; 8]).is_err());
    assert!(g.download(&mut out, a + 4096).is_err());
    // pinned buffers: asynchronous copies, read back after the stream is done
    let p = g.alloc_pinned(16).expect("pinned");
    g.pinned(p).expect("a buffer").copy_from_slice(&f32s(&[5.0, 6.0, 7.0, 8.0]));
    g.upload_pinned(a, p, 4, 8).expect("uploads");
    g.download_pinned(p, 0, a, 4).expect("downloads");
    g.synchronize().expect("syncs");
    assert_eq!(from_bytes(g.pinned(p).expect("a buffer")), [6.0, 6.0, 7.0, 8.0]);
    g.free_pinned(p).expect("freed");
    assert!(g.free_pinned(p).is_err());
    let (free, total) = g.memory().expect("known");
    assert_eq!((total - free, g.peak_memory()), (128, 128));
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
    let n = 300;
    let mut g = HostGpu::new(1 << 20);
    let f = g.load(&image(&affine(n))).expect("loads");
    let (x, y) = (g.alloc(4 * n).expect("room"), g.alloc(4 * n).expect("room"));
    let input: Vec<f32> = (0..n).map(|i| i as f32).collect();
    g.upload(x, &f32s(&input)).expect("uploads");
    let dims = launch_dims(&affine(n));
    g.begin_capture().expect("begins");
    g.launch(f, &dims, &[x, y]).expect("recorded");
    g.copy(x, y, 4 * n).expect("recorded");
    // nothing ran: y is still the 0xff poison (NaN), and pageable copies are refused
    let mut out = vec![0u8; 4 * n];
    assert!(g.download(&mut out, y).is_err() && g.synchronize().is_err());
    let graph = g.end_capture().expect("a graph");
    assert_eq!(g.launches, 0);
    g.download(&mut out, y).expect("downloads");
    assert!(from_bytes(&out).iter().all(|v| v.is_nan()), "captured work does not run");
    // each replay applies y = 2x + 1, x = y
    g.replay(graph).expect("replays");
    g.replay(graph).expect("replays");
    g.download(&mut out, y).expect("downloads");
    let want: Vec<f32> = input.iter().map(|&v| 2.0 * (2.0 * v + 1.0) + 1.0).collect();
    assert_eq!(from_bytes(&out), want);
    assert_eq!(g.launches, 2);
}

#[test]
fn a_launch_checks_what_a_gpu_would_not() {
    let n = 300;
    let k = affine(n);
    let mut g = HostGpu::new(1 << 20);
    let f = g.load(&image(&k)).expect("loads");
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
    let fc = g.load(&image(&codes)).expect("loads");
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

/// Runs a plan on the emulated GPU (library calls through `gemm`, data moves as evaluated
/// kernels) and checks it against the host model run on plain memory.
#[test]
fn plans_with_every_fallback_run_on_the_emulated_gpu() {
    let view = |buf, offset, shape: &[usize], strides: &[usize]| View { buf, offset, shape: shape.to_vec(), strides: strides.to_vec() };
    let gemm = |a: View, b: View, c: View, accumulate, bias: Option<View>| {
        let r = c.shape.len();
        let (m, n, k) = (c.shape[r - 2], c.shape[r - 1], a.shape[r - 1]);
        let types = qatc_kernels::program::GemmTypes { bias: bias.as_ref().map(|_| DType::F32), ..qatc_kernels::program::GemmTypes::F32 };
        Gemm { a, b, c, m, n, k, alpha: 0.5, accumulate, bias, types, note: "test".into(), feed: None }
    };
    let cases = [
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
    ];
    let buffers: Vec<Buffer> = (0..4).map(|i| Buffer::new(format!("b{i}"), DType::F32, &[200], BufKind::Temp)).collect();
    for (case, g) in cases.iter().enumerate() {
        let plan = blas::plan(g, &buffers, BlasMode::Strict).expect("plans");
        let mut gpu = HostGpu::new(1 << 20);
        let bufs: Vec<DevPtr> = buffers.iter().map(|_| gpu.alloc(800).expect("room")).collect();
        let scratch: Vec<DevPtr> = plan.scratch.iter().map(|(t, n)| gpu.alloc(t.bytes() * n).expect("room")).collect();
        let init: Vec<Vec<f32>> = (0..4).map(|b| (0..200).map(|i| ((i * 37 + b * 11) % 23) as f32 / 7.0 - 1.5).collect()).collect();
        for (p, v) in bufs.iter().zip(&init) {
            gpu.upload(*p, &f32s(v)).expect("uploads");
        }
        let mut funcs: PlanFuncs = Vec::new();
        for m in blas::move_kernels(&plan) {
            funcs.push((m.step, gpu.load(&image(&m.kernel)).expect("loads")));
        }
        let resolve = |m: Mem| -> qatc_runtime::cuda::Result<DevPtr> {
            match m {
                Mem::Buf(b) => Ok(bufs[b]),
                Mem::Scratch(s) => Ok(scratch[s]),
            }
        };
        run_plan(&mut gpu, &plan, &funcs, &resolve).unwrap_or_else(|e| panic!("case {case}: {e}\n{}", plan.summary()));
        // the host model on plain memory
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
        let mut plain = Plain(init.iter().cloned().chain(plan.scratch.iter().map(|(_, n)| vec![0.0; *n])).collect());
        blas_host::execute(&plan, &mut plain).expect("runs");
        let mut out = vec![0u8; 800];
        gpu.download(&mut out, bufs[2]).expect("downloads");
        assert_eq!(from_bytes(&out), plain.0[2], "case {case}: {}", plan.summary());
        assert!(gpu.gemms > 0);
    }
}

/// Without CUDA the driver says why, without panicking; with a GPU it works like the emulation.
#[test]
fn the_cuda_driver_opens_or_says_why_not() {
    match CudaDriver::open(0) {
        Err(e) => {
            assert!(matches!(e, GpuError::Unavailable(_) | GpuError::Driver { .. }), "{e}");
            eprintln!("SKIPPED (no GPU): {e}");
        }
        Ok(mut gpu) => {
            let d = gpu.device().clone();
            eprintln!("GPU: {} ({}), {} SMs, {} bytes", d.name, d.arch, d.multiprocessors, d.total_memory);
            let a = gpu.alloc(1024).expect("room");
            gpu.upload(a, &f32s(&[1.0, 2.0])).expect("uploads");
            gpu.memset(a + 4, 0, 4).expect("sets");
            let mut out = vec![0u8; 8];
            gpu.download(&mut out, a).expect("downloads");
            assert_eq!(from_bytes(&out), [1.0, 0.0]);
            gpu.free(a).expect("freed");
        }
    }
}
