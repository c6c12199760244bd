//! `qatc plan MODEL --batch B --seq T [--bits 4 --lora r=16 ...] [--checkpoint ...] [--memory SIZE]`:
//! will the training step fit, and where does its memory go. The plan is the executed program's
//! (`crate::memory`): the fused step lowered for `--device`, laid out as that device's executor
//! lays it out; the buffers it lists are the ones the executor allocates. A table by default,
//! `--json` for the document (schema `qatc.memory_plan` v2, `docs/memory_plan.md`), `--svg FILE`
//! for its timeline; `--fit` searches batch sizes and checkpoint policies for the fastest
//! configurations that fit `--memory` (`crate::memory::fit`). MODEL is a checkpoint, or a size
//! (124M, 355M, 774M, 1.5B; or gpt2, gpt2-medium, ...) whose shapes are all a plan needs.

use std::path::PathBuf;

use anyhow::Context;
use qatc_driver::{Options, Target};
use qatc_ir::Category;
use qatc_passes::plan::units::{flag, flops, human};
use qatc_passes::PassReport;
use qatc_runtime::CpuOptions;
use serde_json::json;

use super::StepArgs;
use crate::frontend::config::Gpt2Config;
use crate::memory::ranks::RankPlan;
use crate::memory::{self, json as plan_json, svg, Executed};
use crate::step::{self, StepOptions};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A GPT-2 checkpoint (`model.safetensors`), or a size: 124M, 355M, 774M, 1.5B.
    pub model: String,
    #[command(flatten)]
    pub step: StepArgs,
    /// The device whose executor the plan is for: auto (the one `qatc train` would run on), cpu,
    /// cuda. A plan needs no GPU.
    #[arg(long, value_enum, default_value_t = crate::config::DeviceFlag::Auto)]
    pub device: crate::config::DeviceFlag,
    /// The CPU executor's dequantized weight panels, in KiB (as `qatc train --panel-kib`).
    #[arg(long, default_value_t = CpuOptions::default().panel_bytes / 1024)]
    pub panel_kib: usize,
    /// Print the plan as JSON (schema qatc.memory_plan, version 2) instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Write the memory timeline as an SVG picture (with --fit: the chosen configuration's).
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Search batch sizes and checkpoint policies for the fastest configurations that fit
    /// --memory (needs --memory; --batch is ignored, batches 1, 2, 4, ... up to --max-batch
    /// are tried).
    #[arg(long)]
    pub fit: bool,
    /// The largest batch --fit tries.
    #[arg(long, default_value_t = 256)]
    pub max_batch: usize,
}

/// The model's config and how to call it, from a path or a size name.
pub fn config(model: &str, step: &StepArgs) -> anyhow::Result<(Gpt2Config, String)> {
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
pub fn describe_options(o: &StepOptions) -> (serde_json::Value, String) {
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
    words.push(crate::config::Optimizer::of(o.adamw.moments).name().to_string());
    if o.parallel.distributed() {
        words.push(format!("{} ranks ZeRO {}", o.parallel.ranks, o.parallel.zero));
    }
    let v = json!({
        "precision": o.precision,
        "quant": q,
        "lora": l,
        "full_finetune": o.model.full_finetune,
        "grad_accum": o.grad_accum,
        "clip": o.clip,
        "optim": crate::config::Optimizer::of(o.adamw.moments).name(),
        "fused": o.fuse.is_some(),
    });
    (v, words.join(" + "))
}

/// The `context` object of the JSON and the picture's title.
pub fn context(
    name: &str,
    cfg: &Gpt2Config,
    opts: &StepOptions,
    reports: &[PassReport],
    memory: Option<usize>,
    e: &Executed,
) -> (serde_json::Value, String) {
    let (options, words) = describe_options(opts);
    let remat = reports.iter().find(|r| r.pass == crate::step::Stage::Remat);
    let ctx = json!({
        "qatc_version": env!("CARGO_PKG_VERSION"),
        "model": name,
        "config": cfg,
        "batch": opts.batch,
        "seq": opts.seq,
        "device": e.target.kind.name(),
        "options": options,
        "checkpoint": opts.checkpoint.describe(),
        "remat": remat.map(|r| json!({ "counters": r.counters, "notes": r.notes })),
        "memory_limit": memory,
        "reserved": memory.map(|_| e.target.reserved_bytes),
        "fits": memory.map(|m| e.plan.peak_bytes() <= e.target.step_budget(m)),
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

/// The step built as `opts` says and planned for `target`.
pub fn build(cfg: &Gpt2Config, opts: &StepOptions, target: &Target, options: &Options) -> anyhow::Result<(Vec<PassReport>, Executed)> {
    let (g, reports) = step::train(cfg, opts, |_, _| {})?;
    let e = qatc_driver::plan(&g, target, options)?;
    Ok((reports, e))
}

/// `memory_plan.json` and `memory.svg` for a built step (`qatc compile` writes them).
pub fn artifacts(
    name: &str,
    cfg: &Gpt2Config,
    opts: &StepOptions,
    reports: &[PassReport],
    e: &Executed,
    memory: Option<usize>,
) -> anyhow::Result<(String, String)> {
    let (ctx, title) = context(name, cfg, opts, reports, memory, e);
    Ok((plan_json::to_json(e, ctx)?, svg::render(e, &title, memory)))
}

/// With `--ranks N` (N > 1), the plan per rank: `g` is this rank's step; the same step on one
/// rank (not fused, not rematerialized: neither changes its inputs) gives qatc's bytes per
/// parameter for ZeRO's formula.
pub fn rank_plan(cfg: &Gpt2Config, opts: &StepOptions, g: &qatc_ir::Graph) -> anyhow::Result<Option<RankPlan>> {
    if !opts.parallel.distributed() {
        return Ok(None);
    }
    let one = StepOptions { parallel: Default::default(), fuse: None, checkpoint: qatc_passes::remat::Checkpoint::None, ..opts.clone() };
    let (whole, _) = step::train(cfg, &one, |_, _| {})?;
    Ok(Some(RankPlan::new(opts.parallel, opts.grad_accum, g, &whole)?))
}

/// The human table.
pub fn table(e: &Executed, title: &str, memory: Option<usize>) -> String {
    let p = &e.plan;
    let mut o = String::new();
    let total = p.peak_bytes().max(1) as f64;
    o += &format!("qatc plan: {title}\n");
    o += &format!(
        "  {} executor: {} steps ({} kernel launches, {} GEMMs, {} run once), {} buffers\n",
        e.target.kind.name(),
        e.program.steps.len(),
        e.program.launches(),
        e.program.gemms().count(),
        e.exec.hoisted_steps(),
        p.buffers.len()
    );
    o += &format!(
        "  {} for the step, {} of it recompute ({:.1}%, {} values)\n",
        flops(e.total_flops),
        flops(e.recompute_flops),
        100.0 * e.recompute_flops as f64 / e.total_flops.max(1) as f64,
        e.recomputed_nodes
    );
    for c in &e.program.cross_entropy {
        o += &format!("  {}\n", memory::chunking_line(c));
    }
    if let Some(k) = &e.chunk {
        o += &format!("  chunk size: {}\n", k.why);
    }
    o += &format!("\n  {:<22} {:>12} {:>7}\n", "at the peak", "bytes", "share");
    let mut row = |label: &str, b: usize| {
        o += &format!("  {label:<22} {:>12} {:>6.1}%\n", human(b), 100.0 * b as f64 / total);
    };
    for c in Category::ALL {
        row(c.label(), p.at_peak(c));
    }
    row("arena fragmentation", p.fragmentation());
    o += &format!("  {:<22} {:>12}\n\n", "total (peak)", human(p.peak_bytes()));
    let at = p.steps.get(p.peak_step).map(|s| s.what.as_str()).unwrap_or("");
    o += &format!(
        "  arena {} planned, lower bound {} (most bytes live at once), ratio {:.4}; peak at step {} ({at})\n",
        human(p.arena_bytes),
        human(p.lower_bound),
        p.ratio(),
        p.peak_step
    );
    o += &format!("  inputs {} (persistent {}, data {})\n", human(p.input_bytes()), human(p.persistent_bytes), human(p.data_bytes));
    if let Some(m) = memory {
        let budget = e.target.step_budget(m);
        let verdict = if p.peak_bytes() <= budget { format!("yes, {} to spare", human(budget - p.peak_bytes())) } else { "no".into() };
        o += &format!("  fits in {}: {verdict}\n", memory::fit::budget_words(m, &e.target));
    }
    o
}

/// The target a plan is for: what `qatc train --device` would run on.
pub fn plan_target(d: crate::config::DeviceFlag) -> Target {
    qatc_driver::planned_target(d.kind(), false)
}

/// `given`: which options the command line gave (a `--precision` or `--optim` given pins it for
/// `--fit`; the others are searched).
pub fn run(a: &Args, given: &super::resume::Given) -> anyhow::Result<()> {
    if let Some(path) = &a.svg {
        // written after planning: refused now rather than after the work
        crate::artifacts::check_writable(path).with_context(|| format!("--svg {}", path.display()))?;
    }
    let (cfg, name) = config(&a.model, &a.step)?;
    let opts = a.step.options_on(std::path::Path::new(&a.model), a.device)?;
    let memory = a.step.memory;
    let target = plan_target(a.device);
    let cpu = CpuOptions { panel_bytes: a.panel_kib.saturating_mul(1024), ..CpuOptions::default() };
    let options = Options { cpu, ..Options::default() };
    if a.fit {
        let pinned = memory::fit::Pinned { precision: given.has("precision"), optim: given.has("optim"), zero: given.has("zero") };
        return fit(a, &cfg, &name, &opts, pinned, memory, &target, &options);
    }
    // as `qatc train` plans it: --memory is room the chunked cross-entropy may grow into
    let options = Options { room: memory.map(|m| target.step_budget(m)), ..options };
    let (g, reports) = step::train(&cfg, &opts, |_, _| {})?;
    let e = qatc_driver::plan(&g, &target, &options)?;
    let ranks = rank_plan(&cfg, &opts, &g)?;
    drop(g);
    if let Some(m) = memory {
        if e.plan.peak_bytes() > target.step_budget(m) {
            anyhow::bail!(
                "the plan with --checkpoint {} needs {}, more than --memory {} leaves ({}); --checkpoint auto (the default with --memory) finds the fastest plan that fits, --fit the batch sizes that do",
                opts.checkpoint.describe(),
                human(e.plan.peak_bytes()),
                flag(m),
                memory::fit::budget_words(m, &target)
            );
        }
    }
    let (ctx, title) = context(&name, &cfg, &opts, &reports, memory, &e);
    if let Some(path) = &a.svg {
        crate::artifacts::write_atomic(path, svg::render(&e, &title, memory).as_bytes()).with_context(|| format!("{}", path.display()))?;
    }
    if a.json {
        print!("{}", plan_json::to_json_with(&e, ctx, ranks.as_ref().map(RankPlan::to_json))?);
    } else {
        print!("{}", table(&e, &title, memory));
        if let Some(r) = &ranks {
            print!("{}", r.table());
        }
        if opts.grad_accum > 1 {
            let sums: usize = e.plan.buffers.iter().filter(|b| b.name.starts_with("accum.")).map(|b| b.bytes).sum();
            println!(
                "  grad-accum: the step is one micro-batch's, run {} times per optimizer step; its gradient and loss sums (accum.*) hold {} of the optimizer states",
                opts.grad_accum,
                human(sums)
            );
        }
        if let Some(r) = reports.iter().find(|r| r.pass == crate::step::Stage::Remat) {
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

/// `--fit`: the search (`crate::memory::fit`), as a table or JSON; `--svg` draws the fastest
/// configuration's plan.
#[allow(clippy::too_many_arguments)]
fn fit(
    a: &Args,
    cfg: &Gpt2Config,
    name: &str,
    opts: &StepOptions,
    pinned: memory::fit::Pinned,
    memory: Option<usize>,
    target: &Target,
    options: &Options,
) -> anyhow::Result<()> {
    let Some(memory) = memory else { anyhow::bail!("--fit needs --memory (a size such as 24GiB, or a GPU's name such as h100)") };
    if a.max_batch == 0 {
        anyhow::bail!("--max-batch must be at least 1");
    }
    // minutes for the largest models: a spinner on the terminal (none when stderr is not one)
    let t0 = std::time::Instant::now();
    let pb = indicatif::ProgressBar::new_spinner();
    pb.set_message("--fit: planning batch 1");
    pb.enable_steady_tick(std::time::Duration::from_millis(200));
    let show = |p: memory::fit::Progress| pb.set_message(format!("--fit: planning batch {}, {} plans so far", p.batch, p.planned));
    let f = memory::fit::search_reporting(cfg, opts, pinned, memory, a.max_batch, target, options, &show);
    pb.finish_and_clear();
    let f = f?;
    if !a.json {
        eprintln!(
            "qatc: --fit made {} plans in {:.1} s ({} of them on a fused step reused from other batch sizes)",
            f.tried,
            t0.elapsed().as_secs_f64(),
            f.reused
        );
    }
    let (_, words) = describe_options(opts);
    let title = format!("{name} ({} layers, C {}), T {}, {words}", cfg.n_layer, cfg.n_embd, opts.seq);
    if let (Some(path), Some((o, e))) = (&a.svg, &f.best) {
        // the choice first: a long title is shortened in its middle
        let (_, title) = context(name, cfg, o, &[], Some(memory), e);
        let choice = format!(
            "--fit's choice: B {} T {}, checkpoint {}, {}, {}; {title}",
            o.batch,
            o.seq,
            o.checkpoint.describe(),
            o.precision.name(),
            crate::config::Optimizer::of(o.adamw.moments).name()
        );
        crate::artifacts::write_atomic(path, svg::render(e, &choice, Some(memory)).as_bytes())
            .with_context(|| format!("{}", path.display()))?;
    }
    if a.json {
        let (options, _) = describe_options(opts);
        let ctx = json!({ "qatc_version": env!("CARGO_PKG_VERSION"), "model": name, "config": cfg, "seq": opts.seq, "device": target.kind.name(), "options": options });
        println!("{}", memory::fit::to_json(&f, ctx, memory, target)?);
    } else {
        print!("{}", memory::fit::table(&f, &title, memory, target));
        if let (Some(path), Some(_)) = (&a.svg, &f.best) {
            println!("  wrote {} (the first row's plan)", path.display());
        }
    }
    Ok(())
}
