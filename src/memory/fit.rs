//! `qatc plan MODEL --memory SIZE --fit`: which configurations of the step fit a memory size, the
//! fastest first. Every candidate is planned as it would run (`qatc_driver::plan`: the fused,
//! lowered program laid out for the target), so "fits" means the executor's allocations fit.
//!
//! The search: batch sizes 1, 2, 4, ... up to `--max-batch`; at each, every precision of
//! [`precisions`] and optimizer of [`optimizers`] (fp32 and bf16, adamw and adamw8bit, unless the
//! command line pinned them: [`Pinned`]), and for each of those the checkpoint policies from the
//! fastest: `none`, `auto` (the `remat` pass's fastest plan within the memory), `blocks`, `sqrt`,
//! the first whose executed plan fits. A batch none of whose plans fits ends the search (a larger
//! batch holds more), and a policy that did not fit at one batch is not planned at the next. Candidates are ranked by estimated throughput, tokens per step over the
//! step's work: its FLOPs (recompute included) at the precision's rate ([`precision_speedup`])
//! plus a fixed cost per launch ([`launch_cost_flops`]), a model of speed, not a measurement; ties
//! go to the smaller peak. When nothing fits at batch 1, the answer is why: what the smallest
//! plan still holds, by category.

use anyhow::Context;
use qatc_driver::{Options, Target, TargetKind};
use qatc_ir::{Category, Deadline};
use qatc_passes::optim::Moments;
use qatc_passes::plan::units::{flops, human};
use qatc_passes::precision::Precision;
use qatc_passes::remat::Checkpoint;
use serde::Serialize;
use serde_json::json;

use super::replay::Replay;
use super::Executed;
use crate::frontend::config::Gpt2Config;
use crate::step::{self, StepOptions};

/// Which of the searched settings the command line gave (`--precision`, `--optim`): a pinned
/// one is the only value tried; the others are searched.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pinned {
    pub precision: bool,
    pub optim: bool,
    /// `--zero` given (with `--ranks N`, N > 1, the stage is otherwise searched).
    pub zero: bool,
}

impl Pinned {
    /// Nothing searched: the options as given.
    pub const ALL: Pinned = Pinned { precision: true, optim: true, zero: true };
}

/// The ZeRO stages `--fit` tries: with one rank, or `--zero` pinned, the one given; over ranks
/// 0 to 3, lowest first. A higher stage holds less and moves as much or more (stage 3 gathers
/// each weight before each use), and the ranking's model counts FLOPs and launches, not bytes
/// on the wire: so a stage is tried only where the lower ones did not fit with that policy.
pub fn zero_stages(base: &StepOptions, pinned: Pinned) -> Vec<u8> {
    if pinned.zero || !base.parallel.distributed() {
        vec![base.parallel.zero]
    } else {
        (0..=qatc_passes::zero::Parallel::MAX_ZERO).collect()
    }
}

/// The optimizers `--fit` tries: 32-bit and 8-bit AdamW, or the one `--optim` pinned.
pub fn optimizers(base: &StepOptions, pinned: Pinned) -> Vec<Moments> {
    if pinned.optim {
        vec![base.adamw.moments]
    } else {
        vec![Moments::F32, Moments::Blockwise8]
    }
}

/// The precisions `--fit` tries: fp32 and bf16, or the one `--precision` pinned. fp16 is tried
/// only when pinned: it stores exactly what bf16 does (2 bytes a value; the loss scale's few
/// bytes aside) at the same FLOPs, so its plans are bf16's, and bf16 needs no loss scaling.
pub fn precisions(base: &StepOptions, pinned: Pinned) -> Vec<Precision> {
    if pinned.precision {
        vec![base.precision]
    } else {
        vec![Precision::Fp32, Precision::Bf16]
    }
}

/// How fast the device runs the step's FLOPs in `p`, relative to fp32, for the ranking. CPU:
/// measured (bench/RESULTS.md, "Mixed precision on the demo": 339 s fp32, 409 s bf16, 465 s fp16
/// for the same 500 steps; the CPU widens half operands to f32 tiles, so they cost more). CUDA: a
/// model, 2x for bf16/fp16 (tensor cores; half the bytes for the memory-bound kernels; the GEMMs
/// alone gain more against f32 without TF32, the row kernels less), not a measurement: the CUDA
/// step has not run on a GPU yet.
pub fn precision_speedup(target: &Target, p: Precision) -> f64 {
    match (target.kind, p) {
        (_, Precision::Fp32) => 1.0,
        (TargetKind::Cpu, Precision::Bf16) => 339.0 / 409.0,
        (TargetKind::Cpu, Precision::Fp16) => 339.0 / 465.0,
        (TargetKind::Cuda, Precision::Bf16 | Precision::Fp16) => 2.0,
    }
}

/// What one launch costs, in FLOPs of the device's GEMM throughput: about 5 us of launch and
/// synchronization at ~50 TFLOP/s on a GPU, about 2 us of dispatch at ~100 GFLOP/s on the CPU.
/// Only the ranking uses it: more rows per launch is faster, by this much.
pub fn launch_cost_flops(target: &Target) -> f64 {
    match target.kind {
        TargetKind::Cuda => 2.5e8,
        TargetKind::Cpu => 2e5,
    }
}

/// One configuration and its plan.
#[derive(Clone, Debug, Serialize)]
pub struct Candidate {
    pub batch: usize,
    pub seq: usize,
    pub grad_accum: usize,
    /// Tokens per optimizer step.
    pub tokens: usize,
    pub checkpoint: String,
    pub precision: &'static str,
    pub optim: &'static str,
    /// Data-parallel ranks and the ZeRO stage (`--ranks`, `--zero`), with more than one rank.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ranks: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zero: Option<u8>,
    pub peak_bytes: usize,
    pub fits: bool,
    /// Share of the step's FLOPs spent recomputing.
    pub recompute_share: f64,
    pub total_flops: u64,
    pub launches: usize,
    /// Tokens per unit of estimated work, relative to the best candidate's (1.0).
    pub relative_throughput: f64,
    #[serde(skip)]
    score: f64,
}

fn candidate(o: &StepOptions, e: &Executed, memory: usize, target: &Target) -> Candidate {
    let tokens = o.batch * o.seq * o.grad_accum.max(1);
    let launches = e.program.launches();
    let work = e.total_flops as f64 / precision_speedup(target, o.precision) + launches as f64 * launch_cost_flops(target);
    Candidate {
        batch: o.batch,
        seq: o.seq,
        grad_accum: o.grad_accum,
        tokens,
        checkpoint: match o.checkpoint {
            Checkpoint::Auto(_) => "auto".into(),
            c => c.describe(),
        },
        precision: o.precision.name(),
        optim: crate::config::Optimizer::of(o.adamw.moments).name(),
        ranks: o.parallel.distributed().then_some(o.parallel.ranks),
        zero: o.parallel.distributed().then_some(o.parallel.zero),
        peak_bytes: e.plan.peak_bytes(),
        fits: e.plan.peak_bytes() <= memory,
        recompute_share: e.recompute_flops as f64 / e.total_flops.max(1) as f64,
        total_flops: e.total_flops,
        launches,
        relative_throughput: 0.0,
        score: tokens as f64 / work.max(1.0),
    }
}

/// The search's result: every candidate that fits, the fastest first; the fastest one's plan;
/// and, when nothing fits, the smallest plan at batch 1 to say why.
pub struct Fit {
    pub fits: Vec<Candidate>,
    pub best: Option<(StepOptions, Executed)>,
    pub smallest: Option<(Candidate, Executed)>,
    pub tried: usize,
    /// Plans whose fused step was printed from its configuration's earlier batches rather than
    /// fused again (`super::replay`).
    pub reused: usize,
}

/// `o`'s step planned for `target`; its fused step from `replay` where that configuration's earlier
/// batches allow (`super::replay`).
fn plan_of(cfg: &Gpt2Config, o: &StepOptions, target: &Target, options: &Options, replay: Option<&mut Replay>) -> anyhow::Result<Executed> {
    let g = match replay {
        Some(r) => r.fused_step(cfg, o)?,
        None => step::train(cfg, o, |_, _| {})?.0,
    };
    Ok(qatc_driver::plan(&g, target, options)?)
}

/// Searches the configurations of `base` (its model options; batch, policy, and the precision and
/// optimizer unless `pinned`, varied) for those that fit a device of `memory` bytes: plans within
/// what the target's reserve leaves (`Target::step_budget`).
///
/// A plan's peak grows with the batch, so a policy that does not fit at batch B (or `auto`, which
/// finds no plan of its model) does not at 2B either: each precision and optimizer starts at the
/// policy that fitted at the batch before, and one none of whose policies fitted is not tried
/// again. [`search_every`] plans them all; the answer is the same (`tests/plan.rs`), in fewer
/// plans (GPT-2 1.5B + LoRA at T 1024 on an H100: 58 -> 44, bench/RESULTS.md).
#[allow(clippy::too_many_arguments)]
pub fn search(
    cfg: &Gpt2Config,
    base: &StepOptions,
    pinned: Pinned,
    memory: usize,
    max_batch: usize,
    target: &Target,
    options: &Options,
) -> anyhow::Result<Fit> {
    search_with(cfg, base, pinned, memory, max_batch, target, options, Shortcuts::ALL, &|_| {})
}

/// Where a search is, after each plan: for a progress display (a 1.5B search takes 10-11 s
/// on two cores).
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    /// The batch size being searched.
    pub batch: usize,
    /// Plans made so far, every precision and optimizer counted.
    pub planned: usize,
}

/// [`search`], calling `progress` after each plan (from the threads that plan).
#[allow(clippy::too_many_arguments)]
pub fn search_reporting(
    cfg: &Gpt2Config,
    base: &StepOptions,
    pinned: Pinned,
    memory: usize,
    max_batch: usize,
    target: &Target,
    options: &Options,
    progress: &(dyn Fn(Progress) + Sync),
) -> anyhow::Result<Fit> {
    search_with(cfg, base, pinned, memory, max_batch, target, options, Shortcuts::ALL, progress)
}

/// [`search`] without its shortcuts: every policy of every precision and optimizer at every batch
/// until the first that fits, each step fused for real; the reference the search is tested
/// against.
#[allow(clippy::too_many_arguments)]
pub fn search_every(
    cfg: &Gpt2Config,
    base: &StepOptions,
    pinned: Pinned,
    memory: usize,
    max_batch: usize,
    target: &Target,
    options: &Options,
) -> anyhow::Result<Fit> {
    search_with(cfg, base, pinned, memory, max_batch, target, options, Shortcuts::NONE, &|_| {})
}

/// What [`search`] does that [`search_every`] does not; each gives the same answer.
#[derive(Clone, Copy, Debug)]
pub struct Shortcuts {
    /// A policy that did not fit at batch B is not planned at 2B (nor a precision and optimizer
    /// none of whose policies fitted).
    pub prune: bool,
    /// A configuration's fused step printed from its earlier batches (`super::replay`).
    pub replay: bool,
}

impl Shortcuts {
    pub const ALL: Shortcuts = Shortcuts { prune: true, replay: true };
    pub const NONE: Shortcuts = Shortcuts { prune: false, replay: false };
}

/// The search with the chosen `shortcuts` (tests compare them).
#[allow(clippy::too_many_arguments)]
pub fn search_with(
    cfg: &Gpt2Config,
    base: &StepOptions,
    pinned: Pinned,
    memory: usize,
    max_batch: usize,
    target: &Target,
    options: &Options,
    shortcuts: Shortcuts,
    progress: &(dyn Fn(Progress) + Sync),
) -> anyhow::Result<Fit> {
    let planned = std::sync::atomic::AtomicUsize::new(0);
    let memory = target.step_budget(memory);
    // a plan that cannot fit whatever its cross-entropy's rows per chunk does not search them
    let options = &Options { fit_within: Some(memory), ..options.clone() };
    let max_batch = max_batch.max(1);
    // each policy at each ZeRO stage searched, lowest first: the first pair that fits recomputes
    // least, at the lowest stage that holds it
    let stages = zero_stages(base, pinned);
    let policies: Vec<(Checkpoint, u8)> = [Checkpoint::None, Checkpoint::Auto(memory), Checkpoint::Blocks, Checkpoint::Sqrt]
        .into_iter()
        .flat_map(|p| stages.iter().map(move |&z| (p, z)))
        .collect();
    let kinds: Vec<(Precision, Moments)> =
        precisions(base, pinned).into_iter().flat_map(|p| optimizers(base, pinned).into_iter().map(move |m| (p, m))).collect();
    // per precision and optimizer, per policy: its fused steps so far
    let mut replays: Vec<Vec<Replay>> = kinds.iter().map(|_| policies.iter().map(|_| Replay::default()).collect()).collect();
    // One precision and optimizer at one batch: its policies from `first` (the one that fitted
    // at the batch before) until one fits.
    let at = |batch: usize, (precision, optim): (Precision, Moments), first: usize, replays: &mut [Replay], best: &mut f64| {
        let mut k = KindSearch::default();
        for (i, &(policy, zero)) in policies.iter().enumerate().skip(first) {
            let mut o = base.clone();
            o.parallel.zero = zero;
            o.batch = batch;
            o.adamw.moments = optim;
            o.precision = precision;
            o.checkpoint = policy;
            // --compile-timeout bounds each plan, as it bounds building one step
            o.deadline = base.deadline.budget().map_or_else(Deadline::unlimited, Deadline::within);
            k.tried += 1;
            let made = plan_of(cfg, &o, target, options, shortcuts.replay.then_some(&mut replays[i]));
            let n = planned.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            progress(Progress { batch, planned: n });
            let e = match made {
                Ok(e) => e,
                // auto fails when no plan of its model (the graph-level planner's, which
                // overstates the executed program) fits: blocks and sqrt are still tried
                Err(e) if matches!(policy, Checkpoint::Auto(_)) && !expired(&e) => continue,
                Err(e) => {
                    k.error = Some(e.context(format!("--fit: planning batch {batch}, --checkpoint {}", policy.describe())));
                    break;
                }
            };
            let c = candidate(&o, &e, memory, target);
            if c.fits {
                // the first policy that fits is the fastest at this batch: none recomputes
                // nothing, auto least within the memory, then blocks, then sqrt; its plan is
                // kept only while it is this kind's fastest (the answer's can only be one)
                let e = (c.score > *best).then_some(e);
                *best = best.max(c.score);
                k.fitted = Some((i, c, o, e));
                break;
            }
            if batch == 1 && k.smallest.as_ref().is_none_or(|(s, _)| c.peak_bytes < s.peak_bytes) {
                k.smallest = Some((c, e));
            }
        }
        k
    };
    use rayon::prelude::*;
    let mut searched: Vec<Searched> = Vec::new();
    let mut reused = 0;
    if shortcuts.prune {
        // A kind's next batch depends only on its own last one (the policy that fitted, or none:
        // then it is done), so each precision and optimizer runs its batches on a thread of its
        // own and none waits for the others at each batch. The results are taken in batch, then
        // kind order: the same answer as one after the other.
        // They start in an order that pairs each kind with its opposite (fp32 + AdamW beside
        // bf16 + 8-bit AdamW): two cores split the list in halves, and halves of like kinds
        // (both fp32, both bf16) left one core idle for a second of a 1.5B search, the 8-bit
        // moments' per-tensor kernels and bf16's casts each costing more.
        let mut chains_in: Vec<(usize, (Precision, Moments), &mut Vec<Replay>)> =
            kinds.iter().zip(replays.iter_mut()).enumerate().map(|(i, (&k, r))| (i, k, r)).collect();
        let n = chains_in.len();
        // kinds 0, n-1, 1, n-2, ...
        chains_in.sort_by_key(|c| if c.0 < n.div_ceil(2) { 2 * c.0 } else { 2 * (n - 1 - c.0) + 1 });
        let chains: Vec<(Vec<Searched>, usize)> = chains_in
            .into_par_iter()
            .map(|(kind, kind_of, replays)| {
                let (mut out, mut reused, mut best) = (Vec::new(), 0, f64::NEG_INFINITY);
                let (mut batch, mut first) = (1, 0);
                while batch <= max_batch && first < policies.len() {
                    let s = at(batch, kind_of, first, replays, &mut best);
                    let stop = s.error.is_some();
                    first = s.fitted.as_ref().map_or(policies.len(), |f| f.0);
                    // the policies before it are not planned again: their texts (a 1.5B step's
                    // are megabytes) can go
                    for r in &mut replays[..first] {
                        reused += std::mem::take(r).reused;
                    }
                    out.push((batch, kind, s));
                    if stop {
                        break;
                    }
                    batch *= 2;
                }
                (out, reused)
            })
            .collect();
        for (chain, r) in chains {
            searched.extend(chain);
            reused += r;
        }
        searched.sort_by_key(|&(batch, kind, _)| (batch, kind));
    } else {
        // every kind's every policy at each batch, until a batch where nothing fits
        let mut best = vec![f64::NEG_INFINITY; kinds.len()];
        let mut batch = 1;
        while batch <= max_batch {
            let round: Vec<KindSearch> =
                kinds.par_iter().zip(replays.par_iter_mut()).zip(best.par_iter_mut()).map(|((&k, r), b)| at(batch, k, 0, r, b)).collect();
            let any = round.iter().any(|s| s.fitted.is_some());
            searched.extend(round.into_iter().enumerate().map(|(kind, s)| (batch, kind, s)));
            if !any {
                break;
            }
            batch *= 2;
        }
    }
    let mut fits: Vec<(Candidate, StepOptions)> = Vec::new();
    let mut best: Option<(f64, StepOptions, Executed)> = None;
    let mut smallest: Option<(Candidate, Executed)> = None;
    let mut tried = 0;
    for (_, _, s) in searched {
        tried += s.tried;
        if let Some(e) = s.error {
            return Err(e);
        }
        if let Some((c, e)) = s.smallest {
            if smallest.as_ref().is_none_or(|(m, _)| c.peak_bytes < m.peak_bytes) {
                smallest = Some((c, e));
            }
        }
        if let Some((_, c, o, e)) = s.fitted {
            if best.as_ref().is_none_or(|(s, _, _)| c.score > *s) {
                let e = e.context("--fit: the fastest plan was not kept")?;
                best = Some((c.score, o.clone(), e));
            }
            fits.push((c, o));
        }
    }
    fits.sort_by(|a, b| b.0.score.total_cmp(&a.0.score).then(a.0.peak_bytes.cmp(&b.0.peak_bytes)));
    let top = fits.first().map_or(1.0, |f| f.0.score);
    let fits: Vec<Candidate> = fits.into_iter().map(|(mut c, _)| (c.relative_throughput = c.score / top, c).1).collect();
    let smallest = if fits.is_empty() { smallest } else { None };
    reused += replays.iter().flatten().map(|r| r.reused).sum::<usize>();
    Ok(Fit { fits, best: best.map(|(_, o, e)| (o, e)), smallest, tried, reused })
}

/// One precision and optimizer's search at one batch: (batch, the kind's index, what it gave).
type Searched = (usize, usize, KindSearch);

/// What one precision and optimizer's policies gave at one batch (`search_with`): the plans
/// tried, the first policy that fits (its index, candidate, options and plan), at batch 1 the
/// smallest plan that does not, and the error that stopped it.
#[derive(Default)]
struct KindSearch {
    tried: usize,
    /// The plan kept only while it is its kind's fastest so far.
    fitted: Option<(usize, Candidate, StepOptions, Option<Executed>)>,
    smallest: Option<(Candidate, Executed)>,
    error: Option<anyhow::Error>,
}

/// Whether planning stopped because the compile budget ran out (an answer without that plan
/// would depend on the machine's speed).
fn expired(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(c.downcast_ref::<qatc_passes::PassError>(), Some(qatc_passes::PassError::Expired(_)))
            || c.downcast_ref::<qatc_ir::Expired>().is_some()
    })
}

/// Why the smallest plan does not fit: its bytes at its peak, by category, largest first.
pub fn why_not(c: &Candidate, e: &Executed, memory: usize) -> String {
    let p = &e.plan;
    let mut parts: Vec<(usize, &str)> = Category::ALL.iter().map(|&k| (p.at_peak(k), k.label())).filter(|(b, _)| *b > 0).collect();
    parts.sort_by_key(|p| std::cmp::Reverse(p.0));
    let list: Vec<String> = parts.iter().map(|(b, l)| format!("{l} {}", human(*b))).collect();
    format!(
        "nothing fits in {}: the smallest plan (batch 1, T {}, --checkpoint {}, {}, {}) still holds {}: {}",
        human(memory),
        c.seq,
        c.checkpoint,
        c.precision,
        c.optim,
        human(c.peak_bytes),
        list.join(", ")
    )
}

/// What a device of `memory` bytes leaves a plan, in words: the size, and on CUDA the reserve.
pub fn budget_words(memory: usize, target: &Target) -> String {
    match target.reserved_bytes {
        0 => human(memory),
        r => format!(
            "{} ({} less {} for the CUDA context and the BLAS workspace)",
            human(target.step_budget(memory)),
            human(memory),
            human(r)
        ),
    }
}

/// The table `qatc plan --fit` prints.
pub fn table(f: &Fit, title: &str, memory: usize, target: &Target) -> String {
    let mut o = format!(
        "qatc plan --fit: {title}\n  fits in {} on the {} executor ({} plans tried)\n",
        budget_words(memory, target),
        target.kind.name(),
        f.tried
    );
    if f.fits.is_empty() {
        if let Some((c, e)) = &f.smallest {
            o += &format!("  {}\n", why_not(c, e, target.step_budget(memory)));
        }
        return o;
    }
    o += "  ranked by estimated throughput: tokens / (FLOPs + a fixed cost per launch), a model, not a measurement\n";
    if let Some(ranks) = f.fits.first().and_then(|c| c.ranks) {
        o += &format!("  one rank's step of {ranks} ranks: batch is per rank, peak is per rank; ZeRO stage lowest that fits\n");
    }
    o += "\n";
    o += &format!(
        "  {:>5} {:>6} {:>8} {:<14} {:<9} {:<9} {:>10} {:>12} {:>10} {:>9}\n",
        "batch", "seq", "tokens", "checkpoint", "precision", "optim", "recompute", "step FLOPs", "peak", "relative"
    );
    for c in &f.fits {
        o += &format!(
            "  {:>5} {:>6} {:>8} {:<14} {:<9} {:<9} {:>9.1}% {:>12} {:>10} {:>9.2}\n",
            c.batch,
            c.seq,
            c.tokens,
            match c.zero {
                Some(z) => format!("{} zero{z}", c.checkpoint),
                None => c.checkpoint.clone(),
            },
            c.precision,
            c.optim,
            100.0 * c.recompute_share,
            flops(c.total_flops),
            human(c.peak_bytes),
            c.relative_throughput
        );
    }
    o
}

/// The JSON `qatc plan --fit --json` prints (schema `qatc.fit`, version 1, `docs/memory_plan.md`).
pub fn to_json(f: &Fit, context: serde_json::Value, memory: usize, target: &Target) -> anyhow::Result<String> {
    let budget = target.step_budget(memory);
    let why = f.smallest.as_ref().map(|(c, e)| {
        let by: serde_json::Map<String, serde_json::Value> =
            Category::ALL.iter().map(|&k| (k.name().to_string(), json!(e.plan.at_peak(k)))).collect();
        json!({ "message": why_not(c, e, budget), "smallest": c, "at_peak": by })
    });
    let v = json!({
        "schema": "qatc.fit",
        "version": 1,
        "context": context,
        "memory_limit": memory,
        "reserved": target.reserved_bytes,
        "plan_budget": budget,
        "plans_tried": f.tried,
        "fits": f.fits,
        "cannot_fit": why,
    });
    serde_json::to_string_pretty(&v).context("writing the fit as JSON")
}
