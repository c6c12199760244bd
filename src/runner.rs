//! What executes a step: the compiled program on a CUDA GPU (`qatc_runtime::cuda::CudaProgram`:
//! kernels built by NVRTC for the device, GEMMs by cuBLAS(Lt), the step one CUDA graph), on the
//! CPU (kernels JIT-compiled by LLVM, GEMMs by OpenBLAS or the gemm crate, rayon's threads) or
//! the reference interpreter (the numerical oracle, and the fallback of a build without LLVM).
//! `--device` picks one; the choice is said in one line. Each is a `TrainStep`: the step's state
//! stays on it between steps.

use anyhow::Context;
use qatc_ir::Graph;
use qatc_kernels::cuda::blas::BlasMode;
use qatc_kernels::cuda::{CudaCodegen, Variants};
use qatc_runtime::cuda::{CudaDriver, CudaOptions, CudaProgram, KernelBuild};
use qatc_runtime::{CpuOptions, InterpretedStep, TrainStep};

/// `--device`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    /// CUDA when a GPU and qatc's CUDA runtime are both there, else the CPU.
    #[default]
    Auto,
    Cpu,
    Cuda,
}

/// How a step runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    /// Lowered to kernels and GEMMs, the kernels JIT-compiled by LLVM, on the CPU.
    Compiled,
    /// The reference interpreter, node by node.
    Interpreter,
    /// Lowered to kernels and GEMMs, on CUDA device 0.
    Cuda(CudaSettings),
}

/// How the step runs on the GPU (`qatc train --tf32`, `--no-cuda-graph`, `--general-kernels`,
/// `--no-variant`);
/// saved in the run's `qatc.json` (`step.cuda`), since TF32 changes the numbers and the others
/// what runs: a resumed run keeps them (a file from before they were saved reads as all off).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CudaSettings {
    /// fp32 GEMMs on TF32 tensor cores instead of strict IEEE fp32.
    pub tf32: bool,
    /// Submit every launch on every step, each waited for, instead of replaying the step as one
    /// CUDA graph (slower; an asynchronous error then names its kernel).
    pub no_graph: bool,
    /// The general kernels only: none of the generator's fast variants (`CudaCodegen`), to rule
    /// one out when a step on the GPU goes wrong.
    pub general_kernels: bool,
    /// These variants off, the others as chosen (`--no-variant`; absent when none).
    #[serde(skip_serializing_if = "Variants::is_empty")]
    pub no_variants: Variants,
}

/// Why the CUDA executor cannot run here, or Ok: a GPU the driver reports, the CUDA libraries
/// (driver, cuBLAS, cuBLASLt) and NVRTC.
pub fn cuda_ready() -> Result<(), String> {
    qatc_kernels::device::probe_cuda()?;
    qatc_runtime::cuda::probe_libraries().map_err(|e| e.to_string())?;
    qatc_kernels::nvrtc::Nvrtc::open().map_err(|e| format!("a GPU is here but NVRTC is not ({e})"))?;
    Ok(())
}

/// The executor `--device` runs a step on, for plans (`qatc plan`, `compile`'s memory plan,
/// `--checkpoint auto`'s budget): CUDA for `cuda`, and for `auto` where CUDA can run (as
/// [`resolve`] decides); else the CPU.
pub fn exec_device(device: Device) -> qatc_runtime::exec::Device {
    match device {
        Device::Cuda => qatc_runtime::exec::Device::Cuda,
        Device::Auto if cuda_ready().is_ok() => qatc_runtime::exec::Device::Cuda,
        Device::Auto | Device::Cpu => qatc_runtime::exec::Device::Cpu,
    }
}

/// Resolves `--device` (and `--interpreter`) to an engine, with a notice for the user when the
/// choice is not the obvious one (`auto` without a usable GPU: the CPU). `--device cuda` where
/// CUDA cannot run is an error that says why.
pub fn resolve(device: Device, interpreter: bool, cuda: CudaSettings) -> anyhow::Result<(Engine, Option<String>)> {
    if interpreter && device == Device::Cuda {
        anyhow::bail!("--interpreter runs on the CPU; it excludes --device cuda");
    }
    let cpu = |why: Option<String>| -> (Engine, Option<String>) {
        if interpreter {
            return (Engine::Interpreter, why.map(|w| format!("{w}: running on the CPU (reference interpreter)")));
        }
        if cfg!(feature = "llvm") {
            (Engine::Compiled, why.map(|w| format!("{w}: running on the CPU")))
        } else {
            let w = why.map(|w| format!("{w}; ")).unwrap_or_default();
            (Engine::Interpreter, Some(format!("{w}this qatc was built without LLVM: running on the reference interpreter")))
        }
    };
    let (engine, notice) = match device {
        Device::Cpu => cpu(None),
        Device::Auto if interpreter => cpu(None),
        Device::Auto => match cuda_ready() {
            Ok(()) => (Engine::Cuda(cuda), None),
            Err(why) => cpu(Some(why)),
        },
        Device::Cuda => match cuda_ready() {
            Ok(()) => (Engine::Cuda(cuda), None),
            Err(why) => anyhow::bail!("--device cuda: {why}"),
        },
    };
    if cuda != CudaSettings::default() && !matches!(engine, Engine::Cuda(_)) {
        anyhow::bail!("--tf32, --no-cuda-graph, --general-kernels and --no-variant are for the GPU; the step runs on the CPU here");
    }
    Ok((engine, notice))
}

/// A step graph ready to run, and what runs it in words.
pub struct Runner {
    pub step: Box<dyn TrainStep>,
    pub description: String,
}

impl Runner {
    /// Builds the executor of `g` for `engine`; `cpu` are the compiled CPU executor's settings.
    pub fn new(g: &Graph, engine: Engine, cpu: &CpuOptions) -> anyhow::Result<Runner> {
        match engine {
            Engine::Interpreter => Ok(Runner { step: Box::new(InterpretedStep::new(g)?), description: "the reference interpreter".into() }),
            Engine::Cuda(settings) => {
                // the program `qatc plan --device cuda` plans: its schedule and chunk size
                let p = cuda_program(crate::memory::lower_cuda(g)?, settings)?;
                let description = describe_cuda(&p);
                Ok(Runner { step: Box::new(p), description })
            }
            #[cfg(feature = "llvm")]
            Engine::Compiled => {
                let (p, panels) = crate::memory::compile_cpu(g, cpu)?;
                let description = describe_compiled(&p, &panels);
                Ok(Runner { step: Box::new(p), description })
            }
            #[cfg(not(feature = "llvm"))]
            Engine::Compiled => {
                let _ = cpu;
                anyhow::bail!("this qatc was built without LLVM; the compiled CPU runtime needs it")
            }
        }
    }
}

/// A lowered program on CUDA device 0: its kernels built by NVRTC for the device through the
/// kernel cache (`qatc compile --device cuda`'s), their sources written beside it so that a
/// compile error names a file.
pub fn cuda_program(prog: qatc_kernels::Program, settings: CudaSettings) -> anyhow::Result<CudaProgram<CudaDriver>> {
    let driver = CudaDriver::open(0).context("--device cuda")?;
    let nv = qatc_kernels::nvrtc::Nvrtc::open().context("--device cuda compiles kernels with NVRTC")?;
    let dir = crate::cli::cubin::default_cache_dir();
    let cache = dir.as_ref().map(qatc_kernels::nvrtc::KernelCache::new);
    let sources = dir.map(|d| d.join("sources"));
    let jobs = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let build = KernelBuild { nvrtc: &nv, cache: cache.as_ref(), jobs, source_dir: sources.as_deref() };
    let codegen = if settings.general_kernels { CudaCodegen::GENERAL } else { CudaCodegen::default().without(settings.no_variants) };
    let options = CudaOptions {
        blas: if settings.tf32 { BlasMode::Tf32 } else { BlasMode::Strict },
        graph: !settings.no_graph,
        codegen,
        // as planned (`Device::Cuda`): frozen weights stay 4-bit on the device, dequantized around
        // their GEMMs; only the frozen steps that shrink what they read run once
        ..CudaOptions::default()
    };
    Ok(CudaProgram::new(prog, driver, options, Some(&build))?)
}

/// One line: the GPU, what the step is there, and what it holds on the device against the
/// executor's plan (`ExecPlan`'s layout, which `qatc plan` prints too).
pub fn describe_cuda(p: &CudaProgram<CudaDriver>) -> String {
    let human = qatc_passes::plan::units::human;
    let d = p.device();
    let (launches, calls) = p.per_step();
    let built = match p.build_report() {
        Some(r) => format!("{} from the NVRTC cache, {} compiled in {:.1} s", r.cached, r.compiled, r.wall_s),
        None => "no machine code built".into(),
    };
    let b = p.bytes();
    let l = p.layout();
    let o = p.options();
    format!(
        "on CUDA: {} ({}, {} SMs, {}; {}): {} kernels ({built}), {launches} launches and {calls} cuBLAS calls per step{}, {} steps hoisted (run once), GEMMs {}; device memory {}: arena {} (the plan: {} of buffers, at least {} live at once), persistent {}, data {}, GEMM scratch {}; pinned {}; the device reports {} in use ({} beyond the step's: the CUDA context, modules and BLAS workspace, for which a plan keeps {})",
        d.name,
        d.arch,
        d.multiprocessors,
        human(d.total_memory),
        d.libraries,
        p.distinct_kernels(),
        if o.graph { " replayed as one CUDA graph" } else { "" },
        p.plan().hoisted_steps(),
        if o.blas == BlasMode::Tf32 { "TF32" } else { "strict fp32" },
        human(b.device_total()),
        human(b.arena),
        human(l.placed_bytes),
        human(l.lower_bound),
        human(b.persistent),
        human(b.data),
        human(b.scratch),
        human(b.pinned),
        human(b.device_used),
        human(b.device_used.saturating_sub(b.device_total())),
        human(qatc_runtime::exec::Device::Cuda.reserved_bytes())
    )
}

/// One line: what the compiled step is and the memory it holds.
#[cfg(feature = "llvm")]
fn describe_compiled(p: &qatc_runtime::CpuProgram, panels: &qatc_kernels::panels::PanelReport) -> String {
    let human = qatc_passes::plan::units::human;
    let prog = p.program();
    let fed = if panels.lines.is_empty() {
        String::new()
    } else {
        format!(
            ", {} quantized weights computed into GEMM panels ({} of dequantized copies never made)",
            panels.lines.len(),
            human(panels.bytes_saved)
        )
    };
    let gemms = match p.blas_name() {
        Some(b) => format!("large ones by OpenBLAS ({b})"),
        None => "by the gemm crate".into(),
    };
    // what the plan says (the executed plan is this program's layout) against what the executor
    // allocated
    let plan = qatc_runtime::exec::MemoryPlan::new(prog, p.plan());
    format!(
        "compiled for this CPU: {} LLVM kernels, {} launches and {} GEMMs per step ({gemms}), {} threads{fed}; memory: planned peak {} (arena {}, at least {} live at once; inputs {}), held {}",
        prog.kernels.len(),
        prog.launches(),
        prog.gemms().count(),
        rayon::current_num_threads(),
        human(plan.peak_bytes()),
        human(plan.arena_bytes),
        human(plan.lower_bound),
        human(plan.input_bytes()),
        human(p.held_bytes())
    )
}

/// Where a step's time goes, as a table: one line per kind of step (kernel family or GEMM shape),
/// largest first, at most `top` lines, with the rates it ran at where the executor counts what
/// it moves and computes (CUDA: GB/s of its compulsory bytes, TFLOP/s of a GEMM's; to set
/// against the device's peaks, e.g. an H100 SXM's 3.35 TB/s and 989 dense bf16 TFLOP/s).
pub fn profile_table(rows: &[crate::trainer::ProfileRow], top: usize) -> String {
    let total: f64 = rows.iter().map(|r| r.secs).sum();
    let counted = rows.iter().any(|r| r.bytes > 0.0);
    let mut s = format!("one step, {:.1} ms:\n", total * 1e3);
    if counted {
        s += &format!("  {:>11} {:>6}  {:<6} {:>8} {:>8}  what\n", "time", "share", "count", "GB/s", "TFLOP/s");
    }
    let rate = |x: f64, secs: f64, unit: f64| if x > 0.0 && secs > 0.0 { format!("{:.1}", x / secs / unit) } else { "-".into() };
    for r in rows.iter().take(top) {
        let share = 100.0 * r.secs / total.max(f64::MIN_POSITIVE);
        let count = format!("x{:.0}", r.count);
        let rates = if counted { format!(" {:>8} {:>8} ", rate(r.bytes, r.secs, 1e9), rate(r.flops, r.secs, 1e12)) } else { String::new() };
        s += &format!("  {:>8.2} ms {share:>5.1}%  {count:<6}{rates} {}\n", r.secs * 1e3, r.what);
    }
    if rows.len() > top {
        s += &format!("  ({} more kinds of step, {:.1} ms)\n", rows.len() - top, rows[top..].iter().map(|r| r.secs).sum::<f64>() * 1e3);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trainer::ProfileRow;

    fn row(what: &str, secs: f64, bytes: f64, flops: f64) -> ProfileRow {
        ProfileRow { what: what.into(), count: 2.0, secs, bytes, flops }
    }

    /// Where the executor counts what a step moves and computes (CUDA), the table shows the rates:
    /// 1 GB in 1 ms is 1000 GB/s, 2 TFLOP in 10 ms 200 TFLOP/s; a kernel has no FLOP rate.
    #[test]
    fn the_profile_shows_rates_where_costs_are_counted() {
        let t = profile_table(&[row("gemm 8x8x8", 0.010, 3e9, 2e12), row("layernorm", 0.001, 1e9, 0.0)], 10);
        assert!(t.contains("GB/s") && t.contains("TFLOP/s"), "{t}");
        let gemm = t.lines().find(|l| l.ends_with("gemm 8x8x8")).expect("a gemm line");
        assert!(gemm.contains(" 300.0 ") && gemm.contains(" 200.0 "), "{gemm}");
        let ln = t.lines().find(|l| l.ends_with("layernorm")).expect("a kernel line");
        assert!(ln.contains(" 1000.0 ") && ln.contains(" - "), "{ln}");
        // the CPU counts nothing: no rate columns
        let cpu = profile_table(&[row("layernorm", 0.001, 0.0, 0.0)], 10);
        assert!(!cpu.contains("GB/s"), "{cpu}");
    }
}
