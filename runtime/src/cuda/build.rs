//! What [`CudaProgram`](super::CudaProgram) builds before its first step, once: every kernel it
//! launches (the program's and its GEMM plans' data moves) as machine code for the device's
//! architecture and loaded, and every `Gemm` planned as cuBLAS(Lt) calls with its scratch placed
//! in one allocation that all GEMMs share (they run one after another on one stream).

use std::collections::HashMap;
use std::path::Path;

use qatc_arena::aligned;
use qatc_kernels::cuda::blas::{self, BlasMode, BlasPlan};
use qatc_kernels::cuda::CudaKernel;
use qatc_kernels::kir::Kernel;
use qatc_kernels::nvrtc::{self, Arch, BuildOptions, BuildReport, KernelCache, Nvrtc};
use qatc_kernels::program::{Program, Step};
use qatc_kernels::target::CUDA_ALIGN;
use qatc_kernels::CudaSettings;

use super::{FuncId, GpuApi, KernelImage, PlanFuncs};
use crate::error::RuntimeError;

/// How kernels become machine code: NVRTC for the device's architecture, through the disk cache.
/// Without one (the host emulation, `HostGpu`, runs the kernel IR) no CUBIN is made.
#[derive(Clone, Copy)]
pub struct KernelBuild<'a> {
    pub nvrtc: &'a Nvrtc,
    /// None: compile everything, keep nothing.
    pub cache: Option<&'a KernelCache>,
    /// Compiles at a time.
    pub jobs: usize,
    /// Where the sources are written before compiling, so that a compile error names a file
    /// that exists (None: not written; the error still carries NVRTC's log).
    pub source_dir: Option<&'a Path>,
}

/// One GEMM step ready to run: its plan, its data moves loaded, its scratch (byte offsets in the
/// shared scratch allocation, by the plan's scratch index).
pub struct PlannedGemm {
    pub plan: BlasPlan,
    pub moves: PlanFuncs,
    pub scratch: Vec<usize>,
    pub note: String,
}

/// Every GEMM step planned (None for launches, by step), and the scratch they share.
pub struct Plans {
    pub gemms: Vec<Option<PlannedGemm>>,
    pub scratch_bytes: usize,
}

/// The GEMM plans of `prog`, their data moves not yet loaded.
pub fn plan_gemms(prog: &Program, mode: BlasMode) -> Result<Plans, RuntimeError> {
    let mut gemms = Vec::with_capacity(prog.steps.len());
    let mut scratch_bytes = 0;
    for step in &prog.steps {
        gemms.push(match step {
            Step::Launch { .. } | Step::Collective(_) => None,
            Step::Gemm(g) => {
                let err = |msg: String| RuntimeError::Gemm { note: g.note.clone(), msg };
                let plan = blas::plan(g, &prog.buffers, mode).map_err(|e| err(e.to_string()))?;
                let mut at = 0;
                let scratch = plan
                    .scratch
                    .iter()
                    .map(|(t, n)| {
                        let o = at;
                        at += aligned(t.bytes() * n, CUDA_ALIGN);
                        o
                    })
                    .collect();
                scratch_bytes = scratch_bytes.max(at);
                Some(PlannedGemm { plan, moves: Vec::new(), scratch, note: g.note.clone() })
            }
        });
    }
    Ok(Plans { gemms, scratch_bytes })
}

/// What building the kernels did.
pub struct Loaded {
    /// The function of each kernel of the program, by kernel index.
    pub funcs: Vec<FuncId>,
    /// Distinct kernels loaded (the program's and the data moves').
    pub distinct: usize,
    /// NVRTC's report (None for the emulation): compiled, from the cache, resources.
    pub report: Option<BuildReport>,
}

/// Emits every kernel of `prog` and of the plans' data moves as CUDA C (with the variants
/// `codegen` allows), compiles the distinct
/// ones for `arch` (when `build` is given), loads each once, and fills in the plans' move
/// functions.
pub fn load_kernels<A: GpuApi>(
    api: &mut A,
    prog: &Program,
    plans: &mut Plans,
    arch: Arch,
    build: Option<&KernelBuild>,
    codegen: &CudaSettings,
) -> Result<Loaded, RuntimeError> {
    let emit = |k: &Kernel| {
        qatc_kernels::cuda::emit_with(k, codegen)
            .map_err(|e| RuntimeError::Kernel { kernel: crate::exec::kernel_label(k), msg: e.to_string() })
    };
    // (kernel IR, its CUDA C) of every kernel, distinct by name, in first-use order
    let mut all: Vec<(Kernel, CudaKernel)> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut add = |k: &Kernel| -> Result<usize, RuntimeError> {
        let c = emit(k)?;
        if let Some(&i) = index.get(&c.name) {
            return Ok(i);
        }
        index.insert(c.name.clone(), all.len());
        all.push((k.clone(), c));
        Ok(all.len() - 1)
    };
    let prog_idx: Vec<usize> = prog.kernels.iter().map(&mut add).collect::<Result<_, _>>()?;
    let mut move_idx: Vec<Vec<(usize, usize)>> = Vec::with_capacity(plans.gemms.len());
    for g in &plans.gemms {
        let mut v = Vec::new();
        if let Some(g) = g {
            for m in blas::move_kernels(&g.plan) {
                v.push((m.step, add(&m.kernel)?));
            }
        }
        move_idx.push(v);
    }
    let (cubins, report) = match build {
        Some(b) => {
            let sources: Vec<CudaKernel> = all.iter().map(|(_, c)| c.clone()).collect();
            if let Some(dir) = b.source_dir {
                std::fs::create_dir_all(dir).map_err(|e| RuntimeError::Compile(format!("{}: {e}", dir.display())))?;
                qatc_kernels::write_cuda(dir, &sources).map_err(|e| RuntimeError::Compile(e.to_string()))?;
            }
            let o = BuildOptions { arch, cache: b.cache, jobs: b.jobs.max(1), source_dir: b.source_dir };
            let (built, report) = nvrtc::compile_cubins(b.nvrtc, &sources, &o).map_err(|e| RuntimeError::Compile(e.to_string()))?;
            let cubins: HashMap<String, Vec<u8>> = built.into_iter().map(|c| (c.name, c.cubin)).collect();
            (cubins, Some(report))
        }
        None => (HashMap::new(), None),
    };
    let mut funcs = Vec::with_capacity(all.len());
    for (k, c) in &all {
        let image = KernelImage {
            name: c.name.clone(),
            cubin: cubins.get(&c.name).cloned().unwrap_or_default(),
            kernel: k.clone(),
            launch: c.launch.clone(),
        };
        let f = api.load(&image).map_err(|e| RuntimeError::Device { what: format!("loading kernel {}", c.name), msg: e.to_string() })?;
        funcs.push(f);
    }
    for (g, idx) in plans.gemms.iter_mut().zip(move_idx) {
        if let Some(g) = g {
            g.moves = idx.into_iter().map(|(step, i)| (step, funcs[i], all[i].1.launch.clone())).collect();
        }
    }
    Ok(Loaded { funcs: prog_idx.into_iter().map(|i| funcs[i]).collect(), distinct: all.len(), report })
}
