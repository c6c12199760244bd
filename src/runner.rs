//! What executes a step: the compiled program on the CPU (kernels JIT-compiled by LLVM, GEMMs by
//! the gemm crate, rayon's threads) or the reference interpreter (the numerical oracle, and the
//! fallback of a build without LLVM). `--device` picks one; the choice is said in one line.

use std::collections::HashMap;

#[cfg(feature = "llvm")]
use anyhow::Context;
use qatc_ir::Graph;
use qatc_runtime::{Interpreter, Value};

/// `--device`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
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

/// The most bytes of one dequantized weight panel (one scratch, shared by every fed GEMM). Small
/// panels split the GEMMs finely, and each partial GEMM costs a library call and a pass over its
/// output: at 512 KiB the 124M step's fed GEMMs took 1.5x as long as on whole weights, at 8 MiB
/// the same (bench/RESULTS.md). `QATC_PANEL_KIB=0` materializes whole weights instead, once
/// (as the CUDA path does).
#[cfg(feature = "llvm")]
fn panel_bytes() -> usize {
    match std::env::var("QATC_PANEL_KIB").ok().and_then(|v| v.parse::<usize>().ok()) {
        Some(0) => 0,
        Some(k) => k * 1024,
        None => 8 << 20,
    }
}

/// A step graph ready to run.
pub enum Runner {
    Interpreter(Box<Interpreter<f32>>),
    #[cfg(feature = "llvm")]
    Compiled {
        prog: Box<qatc_runtime::cpu::CpuProgram>,
        /// Frozen weights: copied in on the first run only (they never change while training).
        frozen: std::collections::HashSet<String>,
        bound: bool,
        /// The 4-bit weights the GEMMs dequantize a panel at a time.
        panels: qatc_kernels::panels::PanelReport,
    },
}

impl Runner {
    pub fn new(g: &Graph, engine: Engine) -> anyhow::Result<Runner> {
        match engine {
            Engine::Interpreter => Ok(Runner::Interpreter(Box::new(Interpreter::<f32>::new(g)?))),
            #[cfg(feature = "llvm")]
            Engine::Compiled => {
                let mut prog = qatc_kernels::lower(g).context("lowering the step to kernels")?;
                let panels = qatc_kernels::panels::feed_panels(&mut prog, panel_bytes());
                let jit = qatc_kernels::llvm::Jit::compile(&prog.kernels).context("compiling the kernels with LLVM")?;
                // attention runs as GEMMs over blocks of query rows (QATC_ATTENTION=llvm: as the
                // generated per-row programs, for comparison); every other kernel as LLVM made it
                let launcher: Box<dyn qatc_runtime::Launcher> = if std::env::var("QATC_ATTENTION").is_ok_and(|v| v == "llvm") {
                    Box::new(jit)
                } else {
                    Box::new(qatc_runtime::cpu::GemmAttention::new(jit, &prog.kernels))
                };
                let mut p = qatc_runtime::cpu::CpuProgram::new(prog, launcher)?;
                let frozen: std::collections::HashSet<String> = g
                    .inputs()
                    .into_iter()
                    .filter(|&id| g.input_kind(id) == Some(qatc_ir::InputKind::Frozen))
                    .filter_map(|id| g.node(id).name.clone())
                    .collect();
                // the dequantized frozen weights are the same every step: computed once
                p.hoist(&frozen)?;
                Ok(Runner::Compiled { prog: Box::new(p), frozen, bound: false, panels })
            }
            #[cfg(not(feature = "llvm"))]
            Engine::Compiled => anyhow::bail!("this qatc was built without LLVM; the compiled CPU runtime needs it"),
        }
    }

    pub fn run(&mut self, inputs: &HashMap<String, Value<f32>>) -> anyhow::Result<HashMap<String, Value<f32>>> {
        Ok(match self {
            Runner::Interpreter(i) => i.run(inputs)?,
            #[cfg(feature = "llvm")]
            Runner::Compiled { prog, frozen, bound, .. } => {
                for (name, v) in inputs {
                    if !*bound || !frozen.contains(name) {
                        // names the step does not read are not an error (as `run`)
                        match prog.set_input(name, v) {
                            Ok(()) | Err(qatc_runtime::RuntimeError::UnknownInput(_)) => {}
                            Err(e) => return Err(e.into()),
                        }
                    }
                }
                *bound = true;
                prog.execute()?;
                prog.outputs()?
            }
        })
    }

    /// Runs the compiled step again on its last inputs, timing every launch and GEMM: seconds by
    /// what ran (kernel family or GEMM shape), largest first. None on the interpreter.
    pub fn profile(&mut self) -> anyhow::Result<Option<Vec<(String, usize, f64)>>> {
        match self {
            Runner::Interpreter(_) => Ok(None),
            #[cfg(feature = "llvm")]
            Runner::Compiled { prog: p, .. } => {
                let mut by: HashMap<String, (usize, f64)> = HashMap::new();
                for (what, s) in p.execute_timed()? {
                    let e = by.entry(what).or_default();
                    e.0 += 1;
                    e.1 += s;
                }
                let mut v: Vec<(String, usize, f64)> = by.into_iter().map(|(k, (n, s))| (k, n, s)).collect();
                v.sort_by(|a, b| b.2.total_cmp(&a.2));
                Ok(Some(v))
            }
        }
    }

    /// One line: what runs the step.
    pub fn describe(&self) -> String {
        match self {
            Runner::Interpreter(_) => "the reference interpreter".into(),
            #[cfg(feature = "llvm")]
            Runner::Compiled { prog: p, panels, .. } => {
                let prog = p.program();
                let fed = if panels.lines.is_empty() {
                    String::new()
                } else {
                    format!(
                        ", {} 4-bit weights dequantized into GEMM panels ({} of f32 copies never made)",
                        panels.lines.len(),
                        qatc_passes::plan::units::human(panels.bytes_saved)
                    )
                };
                let gemms = match qatc_runtime::cpu::blas::get() {
                    Some(b) => format!("large ones by OpenBLAS ({})", b.name),
                    None => "by the gemm crate".into(),
                };
                // buffers never live at the same step share the arena: what it holds against what
                // one allocation per buffer would take, and the least any layout could
                let (r, human) = (p.layout_report(), qatc_passes::plan::units::human);
                format!(
                    "compiled for this CPU: {} LLVM kernels, {} launches and {} GEMMs per step ({gemms}), {} threads, buffers: {} (arena {} for {} of buffers, at least {} live at once; inputs {}){fed}",
                    prog.kernels.len(),
                    prog.launches(),
                    prog.gemms().count(),
                    rayon::current_num_threads(),
                    human(p.allocated_bytes()),
                    human(r.arena_bytes),
                    human(r.placed_bytes),
                    human(r.peak_live_bytes),
                    human(r.input_bytes)
                )
            }
        }
    }
}
