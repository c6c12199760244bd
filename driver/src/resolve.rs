//! Which target a run gets: `--device auto|cpu|cuda` (a requested kind, or none for auto) and
//! `--interpreter` resolved against what this machine and this build can run, with a notice for
//! the user where the choice is not the obvious one.

use qatc_kernels::{CudaSettings, Target, TargetKind};

use crate::DriverError;

/// Why the CUDA executor cannot run here, or Ok: a GPU the driver reports, the CUDA libraries
/// (driver, cuBLAS, cuBLASLt) and NVRTC.
pub fn cuda_ready() -> Result<(), String> {
    qatc_kernels::device::probe_cuda()?;
    qatc_runtime::cuda::probe_libraries().map_err(|e| e.to_string())?;
    qatc_kernels::nvrtc::Nvrtc::open().map_err(|e| format!("a GPU is here but NVRTC is not ({e})"))?;
    Ok(())
}

/// The target a run resolves to, and how it runs there.
#[derive(Clone, Debug, PartialEq)]
pub struct Resolved {
    pub target: Target,
    /// On the reference interpreter (asked for, or the only CPU engine of a build without LLVM).
    pub interpreter: bool,
    /// What the user should be told about the choice (auto without a usable GPU: the CPU).
    pub notice: Option<String>,
}

/// Resolves a requested kind (None: auto) and `--interpreter` to a target, with `cuda` its GPU
/// settings. `--device cuda` where CUDA cannot run is an error that says why; GPU settings on a
/// step that runs on the CPU are refused.
pub fn resolve(request: Option<TargetKind>, interpreter: bool, cuda: CudaSettings) -> Result<Resolved, DriverError> {
    if interpreter && request == Some(TargetKind::Cuda) {
        return Err(DriverError::Unsupported("--interpreter runs on the CPU; it excludes --device cuda".into()));
    }
    let cpu = |why: Option<String>| -> Resolved {
        let target = Target::cpu();
        if interpreter {
            let notice = why.map(|w| format!("{w}: running on the CPU (reference interpreter)"));
            return Resolved { target, interpreter: true, notice };
        }
        if cfg!(feature = "llvm") {
            Resolved { target, interpreter: false, notice: why.map(|w| format!("{w}: running on the CPU")) }
        } else {
            let w = why.map(|w| format!("{w}; ")).unwrap_or_default();
            Resolved {
                target,
                interpreter: true,
                notice: Some(format!("{w}this qatc was built without LLVM: running on the reference interpreter")),
            }
        }
    };
    let resolved = match request {
        Some(TargetKind::Cpu) => cpu(None),
        None if interpreter => cpu(None),
        None => match cuda_ready() {
            Ok(()) => Resolved { target: Target::cuda(None, cuda), interpreter: false, notice: None },
            Err(why) => cpu(Some(why)),
        },
        Some(TargetKind::Cuda) => match cuda_ready() {
            Ok(()) => Resolved { target: Target::cuda(None, cuda), interpreter: false, notice: None },
            Err(why) => return Err(DriverError::Unsupported(format!("--device cuda: {why}"))),
        },
    };
    if cuda != CudaSettings::default() && !resolved.target.is_cuda() {
        return Err(DriverError::Unsupported(
            "--tf32, --no-cuda-graph, --general-kernels and --no-variant are for the GPU; the step runs on the CPU here".into(),
        ));
    }
    Ok(resolved)
}

/// The target a plan is made for (`qatc plan`, `compile`'s memory plan, `--checkpoint auto`'s
/// budget): CUDA for `cuda`, and for auto where CUDA can run (as [`resolve`] decides); else the
/// CPU (the interpreter's too).
pub fn planned_target(request: Option<TargetKind>, interpreter: bool) -> Target {
    match request {
        _ if interpreter => Target::cpu(),
        Some(TargetKind::Cuda) => Target::cuda(None, CudaSettings::default()),
        None if cuda_ready().is_ok() => Target::cuda(None, CudaSettings::default()),
        None | Some(TargetKind::Cpu) => Target::cpu(),
    }
}
