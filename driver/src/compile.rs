//! [`compile`]: a step graph and a target in, the executor that runs the step out, with what it
//! is in one line. Each executor is a `TrainStep`: the step's state stays on it between steps.
//!
//! | target | executor | kernels | GEMMs |
//! |---|---|---|---|
//! | CPU, `interpreter` | `InterpretedStep`: the reference interpreter, node by node | none | f64-summed loops |
//! | CPU | `CpuProgram` | LLVM, JIT for this CPU, through the kernel cache | OpenBLAS or the gemm crate, fed panel by panel |
//! | CUDA | `CudaProgram` on device r mod (the devices), rank r | NVRTC for the device, through the kernel cache | cuBLAS(Lt) |
//!
//! A step over ranks exchanges its collectives through `Options::comm`: on the CPU by MPI; on
//! CUDA by NCCL in the stream, or staged through the host and MPI (`Options::cuda_collectives`,
//! [`cuda_collectives`] when not given).

use std::path::PathBuf;
use std::sync::Arc;

use qatc_ir::Graph;
use qatc_kernels::{Target, TargetKind};
use qatc_runtime::comm::{Communicator, OneRank};
use qatc_runtime::cuda::Collectives;
use qatc_runtime::{CpuOptions, InterpretedStep, TrainStep};

use crate::describe;
use crate::lower::lower;
use crate::DriverError;

/// How to build the executor, beyond what the target says.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// The reference interpreter instead of compiled kernels (`--interpreter`; the CPU only).
    pub interpreter: bool,
    /// The CPU executor's settings (its panel size changes the program it runs).
    pub cpu: CpuOptions,
    /// Where compiled kernels are kept between runs: CUBINs by NVRTC under `DIR/cubin/` (their
    /// sources in `DIR/sources/`), the CPU's object code by LLVM under `DIR/cpu/`; None: keep
    /// nothing (the CPU's kernels are still compiled once per process).
    pub kernel_cache: Option<PathBuf>,
    /// Who a step over several ranks exchanges its collectives with (this process's rank of
    /// `mpirun`'s world); None: the world of one.
    pub comm: Option<Arc<dyn Communicator>>,
    /// The path of a CUDA step's collectives; None: [`cuda_collectives`]'s choice.
    pub cuda_collectives: Option<Collectives>,
    /// Planning only to learn whether the step fits in this many bytes (`qatc plan --fit`):
    /// where no rows per chunk can bring it within them, the chunk size is not searched
    /// (`chunk::least_peak`). None: always searched.
    pub fit_within: Option<usize>,
    /// Bytes the step's plan may use (`--memory`, less the device's reserve:
    /// `Target::step_budget`): the chunked cross-entropy's rows per chunk grow while the plan
    /// stays within them, past the floor's peak (`chunk.rs`). None: the peak never moves for them.
    pub room: Option<usize>,
}

/// A step ready to run.
pub struct Executable {
    pub step: Box<dyn TrainStep>,
    /// What runs it, in one line: the device, its kernels, and what it holds against the plan.
    pub description: String,
    /// The target it was built for (a CUDA target with the device's architecture and memory).
    pub target: Target,
    /// Where its kernels came from and how long getting them took (None on the interpreter).
    pub kernels: Option<KernelsBuilt>,
}

/// How an executor's kernels were built: by the compiler (LLVM, NVRTC) or read from a kernel
/// cache (in this process or on disk), and in how long. `qatc train` and `eval` print it and
/// write it in their JSON.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct KernelsBuilt {
    pub kernels: usize,
    /// From a kernel cache: linked earlier in this process, or read from the disk.
    pub cached: usize,
    pub compiled: usize,
    /// Wall-clock seconds from the first kernel to the last.
    pub seconds: f64,
    /// Why the cache on disk could not keep what was compiled (the build went on without it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
}

impl std::fmt::Display for KernelsBuilt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} kernels in {:.2} s ({} from the kernel cache, {} compiled)", self.kernels, self.seconds, self.cached, self.compiled)?;
        match &self.warning {
            Some(w) => write!(f, "; the cache kept nothing: {w}"),
            None => Ok(()),
        }
    }
}

/// Builds the executor of step graph `g` for `target`: the program `qatc plan` plans for it (the
/// same schedule, chunk size and rewrites), compiled and loaded.
pub fn compile(g: &Graph, target: &Target, options: &Options) -> Result<Executable, DriverError> {
    if options.interpreter {
        if has_collectives(g) {
            return Err(DriverError::Unsupported(
                "--interpreter runs one process's graph; a step over several ranks runs compiled (its collectives through MPI)".into(),
            ));
        }
        if target.kind != TargetKind::Cpu {
            return Err(DriverError::Unsupported("--interpreter runs on the CPU; it excludes --device cuda".into()));
        }
        let step = Box::new(InterpretedStep::new(g)?);
        return Ok(Executable { step, description: "the reference interpreter".into(), target: *target, kernels: None });
    }
    match target.kind {
        TargetKind::Cpu => compile_cpu(g, target, options),
        TargetKind::Cuda => compile_cuda(g, target, options),
    }
}

#[cfg(feature = "llvm")]
fn compile_cpu(g: &Graph, target: &Target, options: &Options) -> Result<Executable, DriverError> {
    let (p, panels, built) = cpu_program_built(g, options)?;
    let p = match &options.comm {
        Some(comm) => p.with_communicator(comm.clone()),
        None => p,
    };
    let description = describe::compiled(&p, &panels);
    let kernels = KernelsBuilt {
        kernels: built.kernels,
        cached: built.cached(),
        compiled: built.compiled,
        seconds: built.wall_s,
        warning: built.cache_warning,
    };
    Ok(Executable { step: Box::new(p), description, target: *target, kernels: Some(kernels) })
}

/// The CPU executor of step graph `g`, as `compile` builds it for `Target::cpu()` (the program
/// `plan` plans for the CPU: the executor applies the same rewrites and the same layout), and
/// what its panel rewrite did; for callers that look inside the executor.
#[cfg(feature = "llvm")]
pub fn cpu_program(g: &Graph, options: &Options) -> Result<(qatc_runtime::CpuProgram, qatc_kernels::panels::PanelReport), DriverError> {
    let (p, panels, _) = cpu_program_built(g, options)?;
    Ok((p, panels))
}

/// `cpu_program`, and where its kernels came from (the kernel cache, or LLVM).
#[cfg(feature = "llvm")]
fn cpu_program_built(
    g: &Graph,
    options: &Options,
) -> Result<(qatc_runtime::CpuProgram, qatc_kernels::panels::PanelReport, qatc_kernels::llvm::JitReport), DriverError> {
    let program = lower(g, &Target::cpu(), options)?.program;
    let cache = options.kernel_cache.as_ref().map(qatc_kernels::llvm::ObjectCache::new);
    Ok(qatc_runtime::CpuProgram::compile_cached(program, &options.cpu, cache.as_ref())?)
}

#[cfg(not(feature = "llvm"))]
fn compile_cpu(_: &Graph, _: &Target, _: &Options) -> Result<Executable, DriverError> {
    Err(DriverError::Unsupported("this qatc was built without LLVM; the compiled CPU runtime needs it".into()))
}

/// The path a CUDA step's collectives take unless told: in a world of one the host path, whose
/// collectives are then copies in the stream (nothing to load, the step's graph kept, the bits
/// exact); over ranks NCCL when it loads (about 2 blocks moved per reduction, in the network, on
/// device memory, the step one CUDA graph), else the host path (every rank's block through MPI
/// and host memory, the step without its graph, but correct on any GPU). Asking for
/// `Collectives::Host` over ranks keeps the CPU ranks' bits, which NCCL's sums give only within
/// rounding.
pub fn cuda_collectives(ranks: usize) -> Collectives {
    if ranks > 1 && qatc_runtime::cuda::probe_nccl().is_ok() {
        Collectives::Device
    } else {
        Collectives::Host
    }
}

/// A lowered program on CUDA device r mod (the devices the driver sees) for rank r of the
/// world (one rank per GPU; device 0 alone), its collectives through the world's communicator:
/// its kernels built by NVRTC for the device through the kernel cache, their sources written
/// beside it so that a compile error names a file.
fn compile_cuda(g: &Graph, target: &Target, options: &Options) -> Result<Executable, DriverError> {
    use qatc_kernels::nvrtc::{KernelCache, Nvrtc};
    use qatc_runtime::cuda::{CudaDriver, CudaProgram, GpuApi, KernelBuild};
    let program = lower(g, target, options)?.program;
    let comm: Arc<dyn Communicator> = options.comm.clone().unwrap_or_else(|| Arc::new(OneRank));
    let driver = CudaDriver::open(comm.rank() % CudaDriver::device_count()?.max(1))?;
    let nv = Nvrtc::open().map_err(|e| DriverError::Unsupported(format!("--device cuda compiles kernels with NVRTC: {e}")))?;
    let cache = options.kernel_cache.as_ref().map(KernelCache::new);
    let sources = options.kernel_cache.as_ref().map(|d| d.join("sources"));
    let jobs = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let build = KernelBuild { nvrtc: &nv, cache: cache.as_ref(), jobs, source_dir: sources.as_deref() };
    // the device's own architecture and memory, whatever the target guessed
    let d = driver.device().clone();
    let target = Target { arch: Some(d.arch), memory: Some(d.total_memory), ..*target };
    let how = options.cuda_collectives.unwrap_or_else(|| cuda_collectives(comm.size()));
    let p = CudaProgram::new(program, driver, &target, Some(&build))?.with_communicator(comm, how)?;
    let description = describe::cuda(&p);
    let kernels = p.build_report().map(|r| KernelsBuilt {
        kernels: r.kernels,
        cached: r.cached,
        compiled: r.compiled,
        seconds: r.wall_s,
        warning: None,
    });
    Ok(Executable { step: Box::new(p), description, target, kernels })
}

/// Whether `g` has any collective (at its top level: a collective is never fused).
fn has_collectives(g: &Graph) -> bool {
    use qatc_ir::Op;
    g.node_ids().into_iter().any(|n| matches!(g.node(n).op, Op::AllReduce { .. } | Op::ReduceScatter { .. } | Op::AllGather { .. }))
}
