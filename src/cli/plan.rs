//! `qatc plan MODEL --batch B --seq T [--bits 4 --lora r=16 ...] [--checkpoint ...] [--memory SIZE]`:
//! the training step's memory plan. A table by default: where the memory goes at the peak, by
//! the categories of the usual tables, and whether it fits `--memory`. `--json` prints the plan
//! (schema `qatc.memory_plan` v1, `docs/memory_plan.md`); `--svg FILE` draws its timeline.
//! MODEL is a checkpoint, or a size (124M, 355M, 774M, 1.5B; or gpt2, gpt2-medium, ...) whose
//! shapes are all a plan needs.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::Context;
use qatc_ir::Graph;
use qatc_passes::plan::units::{flag, flops, human};
use qatc_passes::plan::{self, json, svg, Category, Location, Plan};
use qatc_passes::PassReport;
use qatc_runtime::{ArenaLayout, Slot};
use serde_json::json;

use super::StepArgs;
use crate::frontend::config::Gpt2Config;
use crate::step::{self, StepOptions};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A GPT-2 checkpoint (`model.safetensors`), or a size: 124M, 355M, 774M, 1.5B.
    pub model: String,
    #[command(flatten)]
    pub step: StepArgs,
    /// Print the plan as JSON (schema qatc.memory_plan, version 1) instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Write the memory timeline as an SVG picture.
    #[arg(long)]
    pub svg: Option<PathBuf>,
}

/// The model's config and how to call it, from a path or a size name.
fn config(model: &str, step: &StepArgs) -> anyhow::Result<(Gpt2Config, String)> {
    let path = std::path::Path::new(model);
    if path.exists() {
        let m = super::open_model(path, &step.read)?;
        super::check_seq(&m, step.batch, step.seq)?;
        return Ok((m.cfg.clone(), model.to_string()));
    }
    let Some(cfg) = Gpt2Config::preset(model) else {
        anyhow::bail!("{model}: no such checkpoint, and not a GPT-2 size (124M, 355M, 774M, 1.5B, gpt2, gpt2-medium, gpt2-large, gpt2-xl)");
    };
    if step.batch == 0 || step.seq == 0 {
        anyhow::bail!("--batch and --seq must be at least 1");
    }
    super::check_tokens(step.batch, step.seq)?;
    if step.seq > cfg.n_positions {
        anyhow::bail!("--seq {} exceeds GPT-2's context of {} positions", step.seq, cfg.n_positions);
    }
    Ok((cfg, format!("GPT-2 {model}")))
}

/// What the step was built with, for the JSON's `context` and the picture's title.
fn describe_options(o: &StepOptions) -> (serde_json::Value, String) {
    let q = o.model.quant.as_ref().map(|q| json!({ "bits": q.spec.bits, "group": q.spec.group, "scheme": q.spec.scheme }));
    let l = o.model.lora.as_ref().map(|l| json!({ "r": l.r, "alpha": l.alpha, "targets": l.targets }));
    let mut words = Vec::new();
    if let Some(q) = &o.model.quant {
        words.push(format!("{}-bit {} g{}", q.spec.bits, q.spec.scheme.name(), q.spec.group));
    }
    match &o.model.lora {
        Some(l) => words.push(format!("LoRA r={}", l.r)),
        None => words.push("full fine-tune".into()),
    }
    if o.grad_accum > 1 {
        words.push(format!("grad-accum {}", o.grad_accum));
    }
    if o.precision != qatc_passes::precision::Precision::Fp32 {
        words.push(o.precision.name().to_string());
    }
    let v = json!({
        "precision": o.precision,
        "quant": q,
        "lora": l,
        "full_finetune": o.model.full_finetune,
        "grad_accum": o.grad_accum,
        "clip": o.clip,
        "fused": false,
    });
    (v, words.join(" + "))
}

/// Builds the step up to `remat` and plans it. Fusion is skipped: the plan is the unfused
/// step's (every intermediate counted; what the interpreter runs). Planning fused graphs works
/// (a kernel's intermediates take no arena bytes), but fusion, being equality saturation,
/// currently merges recomputed values back into their originals, which would undo the
/// checkpoint policy; see docs/memory_plan.md.
pub fn build(cfg: &Gpt2Config, opts: &StepOptions) -> anyhow::Result<(Graph, Vec<PassReport>, Plan)> {
    let mut o = opts.clone();
    o.fuse = None;
    let (g, reports) = step::train(cfg, &o, |_, _| {})?;
    let p = plan::plan(&g, &plan::PlanOptions { deadline: opts.deadline, ..Default::default() }).context("memory plan")?;
    Ok((g, reports, p))
}

/// The `context` object of the JSON and the picture's title.
pub fn context(
    name: &str,
    cfg: &Gpt2Config,
    opts: &StepOptions,
    reports: &[PassReport],
    memory: Option<usize>,
    p: &Plan,
) -> (serde_json::Value, String) {
    let (options, words) = describe_options(opts);
    let remat = reports.iter().find(|r| r.pass == "remat");
    let ctx = json!({
        "qatc_version": env!("CARGO_PKG_VERSION"),
        "model": name,
        "config": cfg,
        "batch": opts.batch,
        "seq": opts.seq,
        "options": options,
        "checkpoint": opts.checkpoint.describe(),
        "remat": remat.map(|r| json!({ "counters": r.counters, "notes": r.notes })),
        "memory_limit": memory,
        "fits": memory.map(|m| p.peak_bytes() <= m),
    });
    let title = format!(
        "{name} ({} layers, C {}), B {} T {}, {}, checkpoint {}",
        cfg.n_layer,
        cfg.n_embd,
        opts.batch,
        opts.seq,
        words,
        opts.checkpoint.describe()
    );
    (ctx, title)
}

/// `memory_plan.json` and `memory.svg` for a built step (`qatc compile` writes them).
pub fn artifacts(
    name: &str,
    cfg: &Gpt2Config,
    opts: &StepOptions,
    reports: &[PassReport],
    g: &Graph,
    memory: Option<usize>,
) -> anyhow::Result<(String, String)> {
    let p = plan::plan(g, &plan::PlanOptions { deadline: opts.deadline, ..Default::default() }).context("memory plan")?;
    let (ctx, title) = context(name, cfg, opts, reports, memory, &p);
    Ok((json::to_json(&p, ctx)?, svg::render(&p, &title, memory)))
}

/// The plan as the arena executor takes it.
pub fn arena_layout(p: &Plan) -> ArenaLayout {
    let slots: HashMap<_, _> = p
        .location
        .iter()
        .map(|(id, loc)| {
            let slot = match loc {
                Location::Arena { offset } => Slot::Arena(*offset),
                Location::Input { name } => Slot::Input(name.clone()),
            };
            (*id, slot)
        })
        .collect();
    ArenaLayout { order: p.order(), slots, arena_bytes: p.arena_bytes }
}

/// The human table.
pub fn table(p: &Plan, title: &str, memory: Option<usize>) -> String {
    let mut o = String::new();
    let total = p.peak_bytes().max(1) as f64;
    o += &format!("qatc plan: {title}\n");
    o += &format!(
        "  schedule {} steps ({} recomputed), {} for the step, {} of it recompute ({:.1}%)\n\n",
        p.steps.len(),
        p.recomputed_nodes,
        flops(p.total_flops),
        flops(p.recompute_flops),
        100.0 * p.recompute_flops as f64 / p.total_flops.max(1) as f64
    );
    o += &format!("  {:<22} {:>12} {:>7}\n", "at the peak", "bytes", "share");
    let mut row = |label: &str, b: usize| {
        o += &format!("  {label:<22} {:>12} {:>6.1}%\n", human(b), 100.0 * b as f64 / total);
    };
    for c in Category::ALL {
        let b = if c.persistent() {
            p.persistent.iter().find(|(x, _)| *x == c).map(|(_, b)| *b)
        } else {
            p.at_peak.iter().find(|(x, _)| *x == c).map(|(_, b)| *b)
        };
        row(c.label(), b.unwrap_or(0));
    }
    row("arena fragmentation", p.arena_bytes.saturating_sub(p.lower_bound));
    o += &format!("  {:<22} {:>12}\n\n", "total (peak)", human(p.peak_bytes()));
    let at = p.steps.get(p.peak_step).map(|s| s.name.as_str()).unwrap_or("");
    o += &format!(
        "  arena {} planned, lower bound {} (most bytes live at once), ratio {:.4}; peak at step {} ({at})\n",
        human(p.arena_bytes),
        human(p.lower_bound),
        p.ratio(),
        p.peak_step
    );
    if let Some(m) = memory {
        let verdict = if p.peak_bytes() <= m { format!("yes, {} to spare", human(m - p.peak_bytes())) } else { "no".into() };
        o += &format!("  fits in {}: {verdict}\n", human(m));
    }
    o
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    if let Some(path) = &a.svg {
        // written after planning: refused now rather than after the work
        crate::artifacts::check_writable(path).with_context(|| format!("--svg {}", path.display()))?;
    }
    let (cfg, name) = config(&a.model, &a.step)?;
    let opts = a.step.options(std::path::Path::new(&a.model))?;
    let memory = a.step.memory;
    let (_g, reports, p) = build(&cfg, &opts)?;
    if let Some(m) = memory {
        if p.peak_bytes() > m {
            anyhow::bail!(
                "the plan with --checkpoint {} needs {}, more than --memory {}; --checkpoint auto (the default with --memory) finds the fastest plan that fits",
                opts.checkpoint.describe(),
                human(p.peak_bytes()),
                flag(m)
            );
        }
    }
    let (ctx, title) = context(&name, &cfg, &opts, &reports, memory, &p);
    if let Some(path) = &a.svg {
        crate::artifacts::write_atomic(path, svg::render(&p, &title, memory).as_bytes()).with_context(|| format!("{}", path.display()))?;
    }
    if a.json {
        print!("{}", json::to_json(&p, ctx)?);
    } else {
        print!("{}", table(&p, &title, memory));
        if let Some(r) = reports.iter().find(|r| r.pass == "remat") {
            for n in &r.notes {
                println!("  remat: {n}");
            }
        }
        if let Some(path) = &a.svg {
            println!("  wrote {}", path.display());
        }
    }
    Ok(())
}
