//! What executes a step: the compiled program on the CPU (kernels JIT-compiled by LLVM, GEMMs by
//! OpenBLAS or the gemm crate, rayon's threads) or the reference interpreter (the numerical
//! oracle, and the fallback of a build without LLVM). `--device` picks one; the choice is said in
//! one line. Either is a `TrainStep`: the step's state stays on it between steps.

use qatc_ir::Graph;
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

/// How a step runs on the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    /// Lowered to kernels and GEMMs, the kernels JIT-compiled by LLVM.
    Compiled,
    /// The reference interpreter, node by node.
    Interpreter,
}

/// Resolves `--device` (and `--interpreter`) to an engine, with a notice for the user when the
/// choice is not the obvious one. `--device cuda` fails here: this build has no CUDA runtime yet.
pub fn resolve(device: Device, interpreter: bool) -> anyhow::Result<(Engine, Option<String>)> {
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
    match device {
        Device::Cpu => Ok(cpu(None)),
        Device::Auto => Ok(match qatc_kernels::device::probe_cuda() {
            Ok(p) => cpu(Some(format!("{} CUDA device(s) found, but this qatc has no CUDA runtime yet", p.devices))),
            Err(why) => cpu(Some(why)),
        }),
        Device::Cuda => match qatc_kernels::device::probe_cuda() {
            Ok(_) => anyhow::bail!(
                "--device cuda: this qatc has no CUDA runtime yet (kernels compile through NVRTC, but nothing runs them); use --device cpu"
            ),
            Err(why) => anyhow::bail!("--device cuda: {why}"),
        },
    }
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

/// One line: what the compiled step is and the memory it holds.
#[cfg(feature = "llvm")]
fn describe_compiled(p: &qatc_runtime::CpuProgram, panels: &qatc_kernels::panels::PanelReport) -> String {
    let human = qatc_passes::plan::units::human;
    let prog = p.program();
    let fed = if panels.lines.is_empty() {
        String::new()
    } else {
        format!(
            ", {} 4-bit weights dequantized into GEMM panels ({} of dequantized copies never made)",
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
/// largest first, at most `top` lines. `rows` are (what, times per step, seconds per step).
pub fn profile_table(rows: &[(String, f64, f64)], top: usize) -> String {
    let total: f64 = rows.iter().map(|r| r.2).sum();
    let mut s = format!("one step, {:.1} ms:\n", total * 1e3);
    for (what, n, secs) in rows.iter().take(top) {
        s += &format!("  {:>8.2} ms {:>5.1}%  x{:<5} {what}\n", secs * 1e3, 100.0 * secs / total.max(f64::MIN_POSITIVE), format!("{n:.0}"));
    }
    if rows.len() > top {
        s += &format!("  ({} more kinds of step, {:.1} ms)\n", rows.len() - top, rows[top..].iter().map(|r| r.2).sum::<f64>() * 1e3);
    }
    s
}
