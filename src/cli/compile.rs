//! `qatc compile MODEL -o OUT`: lowers the checkpoint, builds the training step, and writes
//! `forward.qir`, `train.qir` and `manifest.json` into OUT (all or nothing); with fusion (the
//! default; `--no-fuse` skips it) also `fused.qir`, the step as kernels, and `fusion.json`.

use std::path::PathBuf;

use anyhow::Context;
use qatc_ir::print;

use super::StepArgs;
use crate::artifacts::OutDir;
use crate::manifest::{sizes, Manifest};
use crate::step;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The GPT-2 checkpoint (`model.safetensors`; `config.json` beside it is read when present).
    pub model: PathBuf,
    /// Output directory.
    #[arg(short, long, default_value = "out")]
    pub out: PathBuf,
    #[command(flatten)]
    pub step: StepArgs,
    /// Also write every kernel as LLVM IR (`kernels/NAME.ll`), optimized for this CPU exactly as
    /// the CPU runtime JIT-compiles it.
    #[arg(long)]
    pub emit_llvm: bool,
    #[command(flatten)]
    pub cuda: super::cubin::CubinArgs,
    /// The CPU executor's dequantized weight panels, in KiB (as `qatc train --panel-kib`).
    #[arg(long, default_value_t = qatc_runtime::CpuOptions::default().panel_bytes / 1024)]
    pub panel_kib: usize,
}

/// The file that marks a directory as `qatc compile`'s (so that it may be replaced).
const MARKER: &str = "manifest.json";

#[cfg(feature = "llvm")]
fn emit_llvm(dir: &std::path::Path, program: &qatc_kernels::Program) -> anyhow::Result<()> {
    for k in &program.kernels {
        let (name, ir) = qatc_kernels::llvm::emit_ir(k).context("LLVM code generation")?;
        let path = dir.join(format!("{name}.ll"));
        std::fs::write(&path, ir).with_context(|| format!("{}", path.display()))?;
    }
    Ok(())
}

#[cfg(not(feature = "llvm"))]
fn emit_llvm(_: &std::path::Path, _: &qatc_kernels::Program) -> anyhow::Result<()> {
    anyhow::bail!("--emit-llvm: this qatc was built without the `llvm` feature")
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    crate::artifacts::check_target(&a.out, &[MARKER], &[&a.model]).with_context(|| format!("-o {}", a.out.display()))?;
    let m = super::open_model(&a.model, &a.step.read)?;
    super::check_seq(&m, a.step.batch, a.step.seq)?;
    let opts = a.step.options_on(&a.model, a.cuda.device)?;
    let mut fwd_text = String::new();
    let mut unfused: Option<qatc_ir::Graph> = None;
    let (train, reports) = step::train(&m.cfg, &opts, |stage, g| {
        if stage == step::Stage::Lower {
            fwd_text = print(g);
        }
        if stage != step::Stage::Fuse {
            unfused = Some(g.clone());
        }
    })?;
    let fusion = reports.iter().find_map(|r| r.fusion.as_deref());
    let fwd_nodes = fwd_text.lines().filter(|l| l.trim_start().starts_with('%')).count();
    let (groups, trainable, frozen) = sizes(&m, &train);
    let mut artifacts = vec!["forward.qir", "train.qir", "manifest.json"];
    if fusion.is_some() {
        artifacts.extend(["fused.qir", "fusion.json"]);
    }
    // the memory plan: the program the device's executor runs, as it lays it out
    let memory = a.step.memory;
    let cpu = qatc_runtime::CpuOptions { panel_bytes: a.panel_kib.saturating_mul(1024), ..Default::default() };
    let target = super::plan::plan_target(a.cuda.device);
    // as `qatc train` plans it: --memory is room the chunked cross-entropy may grow into
    let options = qatc_driver::Options { cpu, room: memory.map(|m| target.step_budget(m)), ..qatc_driver::Options::default() };
    let executed = qatc_driver::plan(&train, &target, &options)?;
    let (plan_json, plan_svg) = super::plan::artifacts(&a.model.display().to_string(), &m.cfg, &opts, &reports, &executed, memory)?;
    artifacts.extend(["memory_plan.json", "memory.svg"]);
    // code generation: every kernel of the step as CUDA C, with the helper headers it includes
    opts.deadline.check("code generation")?;
    // the program `qatc train --device cuda` runs (`qatc_driver::lower` for a CUDA target: the
    // planner's schedule and chunk size, a kernel per attention gradient), which the plan already
    // is when it was made for CUDA; `--emit-llvm` writes the CPU's
    let cuda = qatc_driver::Target::cuda(None, qatc_driver::CudaSettings::default());
    let program = match executed.target.kind {
        qatc_driver::TargetKind::Cuda => executed.program.clone(),
        qatc_driver::TargetKind::Cpu => qatc_driver::lower(&train, &cuda, &options)?.program,
    };
    let kernels = program.kernels.iter().map(qatc_kernels::cuda::emit).collect::<Result<Vec<_>, _>>().context("code generation")?;
    opts.deadline.check("code generation")?;
    artifacts.push("kernels/");
    // machine code for the GPU (--device cuda, or a GPU found): CUBINs and their resource report
    let build = super::cubin::build(&a.cuda, &kernels)?;
    if build.is_some() {
        artifacts.push("kernels/report.json");
    }
    let manifest = Manifest {
        qatc_version: env!("CARGO_PKG_VERSION"),
        model: a.model.display().to_string(),
        config: &m.cfg,
        config_source: match &m.config_source {
            crate::frontend::config::ConfigSource::File(p) => p.display().to_string(),
            crate::frontend::config::ConfigSource::Inferred => "inferred from tensor shapes".into(),
        },
        batch: opts.batch,
        seq: opts.seq,
        params_total: groups.values().map(|g| g.params).sum(),
        params_by_group: groups.clone(),
        trainable: trainable.clone(),
        frozen: frozen.clone(),
        passes: reports.iter().collect(),
        artifacts: artifacts.clone(),
    };
    let out = OutDir::create(&a.out, &[MARKER], &[&a.model]).with_context(|| format!("{}", a.out.display()))?;
    out.write("forward.qir", &fwd_text)?;
    out.write("train.qir", print(unfused.as_ref().unwrap_or(&train)))?;
    if let Some(f) = fusion {
        out.write("fused.qir", print(&train))?;
        out.write("fusion.json", serde_json::to_string_pretty(f)? + "\n")?;
    }
    out.write("manifest.json", serde_json::to_string_pretty(&manifest)? + "\n")?;
    out.write("memory_plan.json", &plan_json)?;
    out.write("memory.svg", &plan_svg)?;
    qatc_kernels::write_cuda(&out.path().join("kernels"), &kernels)?;
    if let Some((cubins, report)) = &build {
        super::cubin::write(&out.path().join("kernels"), cubins, report)?;
    }
    if a.emit_llvm {
        let cpu_program = qatc_kernels::lower_with(&train, &qatc_driver::Target::cpu().lower_options()).context("code generation")?;
        emit_llvm(&out.path().join("kernels"), &cpu_program)?;
    }
    let dir = out.commit().with_context(|| format!("{}", a.out.display()))?;

    let c = &m.cfg;
    println!(
        "qatc: GPT-2 {} layers, n_embd {}, {} heads, vocab {}, context {}; B {} T {}",
        c.n_layer, c.n_embd, c.n_head, c.vocab_size, c.n_positions, opts.batch, opts.seq
    );
    println!("  parameters  {:>12}  ({})", manifest.params_total, human_bytes(groups.values().map(|g| g.stored_bytes).sum()));
    println!("  trainable   {:>12}  ({})", trainable.params, human_bytes(trainable.stored_bytes));
    println!("  frozen      {:>12}  ({})", frozen.params, human_bytes(frozen.stored_bytes));
    println!("  forward graph {fwd_nodes} nodes; training step {} nodes", train.len());
    for r in &reports {
        println!("  pass {r}");
    }
    if let Some(f) = fusion {
        print_fusion(f);
    }
    println!("  kernels {} distinct CUDA kernels; {}", kernels.len(), program.to_string().lines().next().unwrap_or_default());
    if let Some((_, r)) = &build {
        println!("  cubins  {}", r.summary());
        for w in &r.warnings {
            eprintln!("warning: {w}");
        }
        for line in r.table().lines() {
            println!("    {line}");
        }
    }
    println!("  wrote {}/{{{}}}", dir.display(), artifacts.join(", "));
    Ok(())
}

/// The fusion summary: what was fused and what it saves.
fn print_fusion(f: &qatc_passes::fusion::FusionReport) {
    let s = &f.saturation;
    println!(
        "  fusion      kernels {} -> {}, bytes moved {} -> {} (ideal step {}: {:.2}x -> {:.2}x)",
        f.kernels_before,
        f.kernels_after,
        human_bytes(f.bytes_before as usize),
        human_bytes(f.bytes_after as usize),
        human_bytes(f.ideal_bytes as usize),
        f.ratio_before_to_ideal(),
        f.ratio_to_ideal()
    );
    println!(
        "  e-graph     {} after {} iterations, {} -> {} e-nodes, {:.2} s; extraction {:.2} s",
        s.stop_reason, s.iterations, s.start_enodes, s.enodes, s.time_s, f.extraction.time_s
    );
    if let Some(why) = &f.extraction.fallback {
        println!("  fusion      left the step unfused: {why}");
    }
    let mut fams: Vec<_> = f.families.iter().filter(|(k, _)| !k.starts_with("unfused.")).collect();
    fams.sort_by(|a, b| b.1.kernels.cmp(&a.1.kernels).then(a.0.cmp(b.0)));
    let list: Vec<String> = fams.iter().map(|(k, t)| format!("{k} x{}", t.kernels)).collect();
    println!("  fused into  {}", list.join(", "));
    let fired: Vec<String> = s.rules_fired.iter().map(|(k, n)| format!("{k} {n}")).collect();
    println!("  rules fired {}", fired.join(", "));
}

/// `1.50 GiB`, `12.00 MiB`, `512 B` (one formatter for every command).
pub use qatc_passes::plan::units::human as human_bytes;
