//! A step's collectives on the CUDA executor (`CudaProgram::with_communicator`): on the emulated
//! GPU, over a world of one and over 2 and 3 ranks in one process (a thread per rank, each with
//! its own emulated GPU, exchanging through an in-process communicator), both paths (staged
//! through the host; in the stream, the emulation standing in for NCCL) give every rank the
//! reference interpreter's bits (`run_ranks`); the device path is captured in the step's graph,
//! the host path runs without one. Without NCCL its probe says why instead of panicking; on a GPU
//! (`QATC_REQUIRE_GPU=1`, bench/gpu.sh) NCCL runs each collective at one rank on device 0.

use std::collections::HashMap;
use std::sync::Arc;

use qatc_ir::{DType, Graph, InputKind, Op, Reduce};
use qatc_kernels::{CudaSettings, Target};
use qatc_runtime::comm::threads::threads as ranks;
use qatc_runtime::comm::{Communicator, OneRank};
use qatc_runtime::cuda::{probe_nccl, Collectives, CudaDriver, CudaProgram, GpuApi, GpuError, HostGpu};
use qatc_runtime::{Interpreter, RuntimeError, Value};

/// x [4, 2] of `dtype` through `ops` in turn, output `y`.
fn graph(dtype: DType, ops: &[Op]) -> Graph {
    let mut g = Graph::new("collective");
    let mut y = g.input("x", InputKind::Data, dtype, [4, 2]).unwrap();
    for op in ops {
        y = g.add(op.clone(), &[y]).unwrap();
    }
    g.set_output("y", y).unwrap();
    g
}

/// Rank r's x: 8 values that the sums over the ranks round in bf16 and f16.
fn inputs(rank: usize) -> HashMap<String, Value<f32>> {
    let data: Vec<f64> = (0..8).map(|i| (rank * 10 + i) as f64 * 1.37 + 0.11).collect();
    HashMap::from([("x".to_string(), Value::floats([4, 2], &data).unwrap())])
}

/// `v` rounded to `dtype` (to nearest even), as f32.
fn rounded(v: f32, dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => half::bf16::from_f32(v).to_f32(),
        DType::F16 => half::f16::from_f32(v).to_f32(),
        _ => v,
    }
}

fn bits(v: &Value<f32>) -> Vec<u32> {
    v.as_float().expect("a float output").data.iter().map(|x| x.to_bits()).collect()
}

fn cuda(graph: bool) -> Target {
    Target::cuda(None, CudaSettings { no_graph: !graph, ..CudaSettings::default() })
}

/// What each rank's CUDA program gives (two runs: the second captured as the step's graph where
/// the path allows), with the emulated GPU's graph captures and device collectives.
fn on_emulated_gpus(g: &Graph, comms: Vec<Arc<dyn Communicator>>, how: Collectives) -> Vec<(Vec<u32>, usize, usize)> {
    let prog = qatc_kernels::lower(g).expect("lowers");
    let threads: Vec<_> = comms
        .into_iter()
        .map(|comm| {
            let prog = prog.clone();
            std::thread::spawn(move || {
                let rank = comm.rank();
                let p = CudaProgram::new(prog, HostGpu::new(1 << 24), &cuda(true), None).expect("builds");
                let mut p = p.with_communicator(comm, how).expect("joins the world");
                let mut outs = Vec::new();
                for _ in 0..2 {
                    outs.push(bits(&p.run(&inputs(rank)).expect("runs")["y"]));
                }
                assert_eq!(outs[0], outs[1], "rank {rank}: the replayed step gives the first run's bits");
                let api = p.api();
                (outs.remove(0), api.captures, api.collectives)
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().expect("a rank finished")).collect()
}

/// What the interpreter gives each rank. It computes in f32 whatever the graph's type, so for a
/// 16-bit graph it is given the inputs the device stores (rounded to the type) and its results
/// are rounded once more: its f64 sums of 2 or 4 such values are exact in f32, so this is one
/// rounding of the exact sum, the host rule's.
fn reference(g: &Graph, world: usize, dtype: DType) -> Vec<Vec<u32>> {
    let round = |v: &Value<f32>| {
        let t = v.as_float().expect("floats");
        let data: Vec<f64> = t.data.iter().map(|&x| f64::from(rounded(x, dtype))).collect();
        Value::floats(t.shape.clone(), &data).expect("the same shape")
    };
    let all: Vec<HashMap<String, Value<f32>>> = (0..world).map(|r| inputs(r).into_iter().map(|(k, v)| (k, round(&v))).collect()).collect();
    let out = if world == 1 {
        vec![Interpreter::<f32>::new(g).unwrap().run(&all[0]).unwrap()]
    } else {
        Interpreter::<f32>::new(g).unwrap().run_ranks(&all).unwrap().into_iter().map(|o| o.outputs).collect()
    };
    out.iter().map(|o| bits(&round(&o["y"]))).collect()
}

#[test]
fn both_paths_give_every_rank_the_interpreters_bits() {
    for world in [1, 2, 4] {
        let cases = [
            vec![Op::AllReduce { reduce: Reduce::Sum, world }],
            vec![Op::AllReduce { reduce: Reduce::Mean, world }],
            vec![Op::ReduceScatter { reduce: Reduce::Mean, world }],
            vec![Op::AllGather { world }],
            vec![Op::ReduceScatter { reduce: Reduce::Sum, world }, Op::AllGather { world }],
        ];
        for (ops, dtype) in cases.iter().flat_map(|ops| [DType::F32, DType::BF16, DType::F16].map(|d| (ops, d))) {
            let g = graph(dtype, ops);
            let want = reference(&g, world, dtype);
            let steps = ops.len();
            for how in [Collectives::Host, Collectives::Device] {
                let got = on_emulated_gpus(&g, ranks(world), how);
                let what = format!("{ops:?} over {world} in {dtype} by {how:?}");
                for (r, (y, captures, collectives)) in got.iter().enumerate() {
                    assert_eq!(y, &want[r], "{what}: rank {r}");
                    match how {
                        // in the stream: captured on the second run, replayed from then on
                        Collectives::Device => assert_eq!((*captures, *collectives), (1, 2 * steps), "{what}"),
                        // a world of one copies in the stream (graph kept); more ranks go without it
                        Collectives::Host => assert_eq!((*captures, *collectives), (usize::from(world == 1), 0), "{what}"),
                    }
                }
            }
        }
    }
}

#[test]
fn a_world_of_one_is_the_default_and_other_worlds_are_refused_before_any_run() {
    let one = graph(DType::F32, &[Op::AllReduce { reduce: Reduce::Mean, world: 1 }]);
    let prog = qatc_kernels::lower(&one).unwrap();
    let mut p = CudaProgram::new(prog, HostGpu::new(1 << 24), &cuda(true), None).expect("builds");
    assert_eq!(bits(&p.run(&inputs(0)).unwrap()["y"]), bits(&inputs(0)["x"]));
    assert_eq!(p.collectives().as_deref(), Some("1 collectives of one rank (copies in the stream)"));
    let two = graph(DType::F32, &[Op::AllGather { world: 2 }]);
    let prog = qatc_kernels::lower(&two).unwrap();
    let p = CudaProgram::new(prog, HostGpu::new(1 << 24), &cuda(true), None).expect("builds");
    let e = p.with_communicator(Arc::new(OneRank), Collectives::Device).err().expect("refused").to_string();
    assert!(e.contains("compiled for 2 ranks, the world has 1"), "{e}");
}

/// Whether a GPU that does not open fails the test (bench/gpu.sh) instead of skipping it.
fn gpu_required() -> bool {
    std::env::var_os("QATC_REQUIRE_GPU").is_some_and(|v| v == "1")
}

/// NCCL is probed before any call (cudarc panics on a missing library): where it is absent the
/// probe names it; on a GPU each collective runs through NCCL at one rank on device 0, in f32,
/// bf16 and f16, captured in the step's graph, and gives the host path's bits (a one-rank
/// collective is a copy whatever the order of sums).
#[test]
fn nccl_runs_at_one_rank_on_a_gpu_or_says_why_not() {
    let nccl = probe_nccl();
    if let Err(e) = &nccl {
        let e = e.to_string();
        assert!(e.contains("libnccl.so.2") && e.contains("Collectives::Host"), "{e}");
    }
    let gpu = match CudaDriver::open(0) {
        Ok(gpu) => gpu,
        Err(e) => {
            assert!(!gpu_required(), "QATC_REQUIRE_GPU=1, but the CUDA driver did not open: {e}");
            eprintln!("SKIPPED (no GPU): {e}");
            return;
        }
    };
    drop(gpu);
    if let Err(e) = nccl {
        assert!(!gpu_required(), "QATC_REQUIRE_GPU=1, but NCCL did not load: {e}");
        eprintln!("SKIPPED (no NCCL): {e}");
        return;
    }
    let nvrtc = qatc_kernels::nvrtc::Nvrtc::open();
    let nv = match &nvrtc {
        Ok(nv) => nv,
        Err(e) => {
            assert!(!gpu_required(), "QATC_REQUIRE_GPU=1, but NVRTC did not load: {e}");
            eprintln!("SKIPPED (no NVRTC): {e}");
            return;
        }
    };
    let build = qatc_runtime::cuda::KernelBuild { nvrtc: nv, cache: None, jobs: 1, source_dir: None };
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for ops in [
            vec![Op::AllReduce { reduce: Reduce::Sum, world: 1 }],
            vec![Op::AllReduce { reduce: Reduce::Mean, world: 1 }],
            vec![Op::ReduceScatter { reduce: Reduce::Mean, world: 1 }, Op::AllGather { world: 1 }],
        ] {
            let g = graph(dtype, &ops);
            let prog = qatc_kernels::lower(&g).unwrap();
            let mut each = Vec::new();
            for how in [Collectives::Host, Collectives::Device] {
                let gpu = CudaDriver::open(0).expect("opened above");
                let t = Target { arch: Some(gpu.device().arch), ..cuda(true) };
                let p = CudaProgram::new(prog.clone(), gpu, &t, Some(&build)).expect("builds on the GPU");
                let mut p = p.with_communicator(Arc::new(OneRank), how).unwrap_or_else(|e: RuntimeError| panic!("{how:?}: {e}"));
                eprintln!("{dtype} {ops:?} {how:?}: {}", p.collectives().unwrap_or_default());
                let mut runs: Vec<_> = (0..3).map(|_| bits(&p.run(&inputs(0)).expect("runs")["y"])).collect();
                assert!(runs.iter().all(|r| r == &runs[0]), "{how:?}: the graph's replays give the first run's bits");
                each.push(runs.remove(0));
            }
            assert_eq!(each[0], each[1], "{dtype} {ops:?}: NCCL against the host path");
            assert_eq!(each[0], reference(&g, 1, dtype)[0], "{dtype} {ops:?}: against the interpreter");
        }
    }
}

/// The emulated GPU's device collectives need a world joined first.
#[test]
fn a_device_collective_without_a_world_is_an_error() {
    let g = graph(DType::F32, &[Op::AllGather { world: 1 }]);
    let prog = qatc_kernels::lower(&g).unwrap();
    let p = CudaProgram::new(prog.clone(), HostGpu::new(1 << 24), &cuda(false), None).expect("builds");
    let mut p = p.with_communicator(Arc::new(OneRank), Collectives::Device).unwrap();
    assert!(p.collectives().unwrap().contains("emulated device collectives over 1 ranks"), "{:?}", p.collectives());
    p.run(&inputs(0)).expect("runs");
    let mut gpu = HostGpu::new(1 << 20);
    let e = gpu.collective(&qatc_runtime::cuda::DeviceCollective {
        step: prog.collectives().next().unwrap().clone(),
        dtype: DType::F32,
        src: 0,
        dst: 0,
    });
    assert!(matches!(&e, Err(GpuError::Invalid(m)) if m.contains("no world was joined")), "{e:?}");
}
