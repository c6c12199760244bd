//! `qatc compile --device cuda [--arch sm_90]`: every kernel to a CUBIN through NVRTC (in
//! parallel, through the kernel cache), and the report of each kernel's registers, spills and
//! shared memory (`OUT/kernels/report.json`, `OUT/kernels/NAME.cubin`).

use std::path::Path;

use anyhow::{bail, Context};
use qatc_kernels::nvrtc::{self, Arch, BuildOptions, BuildReport, CompiledKernel, KernelCache, Nvrtc};
use qatc_kernels::CudaKernel;

use crate::config::DeviceFlag as Device;

#[derive(clap::Args, Debug, Clone)]
pub struct CubinArgs {
    /// `cuda`: also compile every kernel to machine code for the GPU (or --arch) and report
    /// registers, spills and shared memory; `auto`: so when a GPU is here; `cpu`: sources only.
    /// `memory_plan.json` and `memory.svg` are the plan of this device's executor (`auto`: the
    /// one `qatc train` would run on).
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
    /// The GPU architecture to compile for (sm_80, sm_90, ...): needed without a GPU, else the
    /// GPU's own.
    #[arg(long)]
    pub arch: Option<String>,
    #[command(flatten)]
    pub cache: super::kernel_cache::KernelCacheArgs,
}

/// The architecture to build for, or None when nothing is to be built (sources only).
fn target(a: &CubinArgs) -> anyhow::Result<Option<Arch>> {
    let named = a.arch.as_deref().map(Arch::parse).transpose().map_err(|e| anyhow::anyhow!("--arch: {e}"))?;
    match (a.device, named) {
        (Device::Cpu, Some(_)) => bail!("--arch is for --device cuda (or auto)"),
        (Device::Cpu, None) => Ok(None),
        (_, Some(arch)) => Ok(Some(arch)),
        (device, None) => match qatc_kernels::device::probe_cuda() {
            Ok(p) => match p.first.as_ref().and_then(|d| d.arch()) {
                Some(arch) => Ok(Some(arch)),
                None => bail!("--device cuda: the driver did not say which GPU this is; name it with --arch sm_90"),
            },
            Err(_) if device == Device::Auto => Ok(None),
            Err(why) => bail!("--device cuda: {why}; to compile without a GPU, name the architecture: --arch sm_90"),
        },
    }
}

/// Compiles every kernel when `--device`/`--arch` ask for machine code; None when they do not.
pub fn build(a: &CubinArgs, kernels: &[CudaKernel]) -> anyhow::Result<Option<(Vec<CompiledKernel>, BuildReport)>> {
    let Some(arch) = target(a)? else { return Ok(None) };
    let nv = match Nvrtc::open() {
        Ok(nv) => nv,
        Err(e) if a.device == Device::Auto && a.arch.is_none() => {
            eprintln!("note: a GPU is here but NVRTC is not ({e}): writing the kernels' sources only");
            return Ok(None);
        }
        Err(e) => return Err(e).context("--device cuda compiles kernels with NVRTC"),
    };
    let cache = a.cache.dir().map(KernelCache::new);
    let jobs = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let opts = BuildOptions { arch, cache: cache.as_ref(), jobs, source_dir: None };
    let built = nvrtc::compile_cubins(&nv, kernels, &opts).context("CUDA code generation")?;
    Ok(Some(built))
}

/// `NAME.cubin` per kernel and `report.json` into the kernels directory.
pub fn write(dir: &Path, cubins: &[CompiledKernel], report: &BuildReport) -> anyhow::Result<()> {
    for c in cubins {
        let p = dir.join(format!("{}.cubin", c.name));
        std::fs::write(&p, &c.cubin).with_context(|| format!("{}", p.display()))?;
    }
    let p = dir.join("report.json");
    std::fs::write(&p, serde_json::to_string_pretty(report)? + "\n").with_context(|| format!("{}", p.display()))?;
    Ok(())
}
