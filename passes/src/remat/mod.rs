//! Rematerialization: checkpoint policies as a graph -> graph pass. A policy decides which
//! forward values the backward reads are kept (saved from the forward) and which are
//! recomputed; `apply` clones the recomputed ones into the backward region (`NAME.recompute`).
//!
//! - `none`: keep everything (the pass changes nothing).
//! - `blocks`: keep each transformer block's input and output only; everything inside a block
//!   is recomputed during its backward (Hugging Face's gradient checkpointing). The embedding
//!   and the head keep their values.
//! - `sqrt`: Chen et al. (2016): the L blocks are cut into segments of round(sqrt(L)) blocks;
//!   only segment boundaries are kept, and a segment's backward recomputes all of its blocks.
//! - `budget=SIZE`: the fewest recompute FLOPs whose planned peak fits SIZE (`budget`: a DP
//!   over the block chain with per-op choices inside; exact for its memory model, checked
//!   against the real plan).
//! - `auto` (with `--memory SIZE`): the fastest plan that fits: `none` if it fits, else the
//!   least recompute among `budget=SIZE`, `blocks` and `sqrt` that fit.
//!
//! SIZE is always the whole step's peak: inputs' storage plus the arena.

mod apply;
pub mod budget;
mod chain;

use qatc_ir::Graph;
use serde::{Deserialize, Serialize};

pub use apply::Rewrite;

use crate::error::PassError;
use crate::pipeline::PassReport;
use crate::pipeline::Stage;
use crate::plan::region::Dense;
use crate::plan::units::{flag, flops, human, parse_size};
use crate::plan::{self, PlanOptions};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Checkpoint {
    #[default]
    None,
    Blocks,
    Sqrt,
    /// The step's peak must fit this many bytes.
    Budget(usize),
    /// The fastest plan within this many bytes.
    Auto(usize),
}

impl Checkpoint {
    /// Parses `--checkpoint` (`none | blocks | sqrt | budget=SIZE | auto`); `auto` takes its
    /// size from `--memory`.
    pub fn parse(s: &str, memory: Option<usize>) -> Result<Checkpoint, String> {
        let t = s.trim();
        match t {
            "none" => Ok(Checkpoint::None),
            "blocks" => Ok(Checkpoint::Blocks),
            "sqrt" => Ok(Checkpoint::Sqrt),
            "auto" => {
                memory.map(Checkpoint::Auto).ok_or_else(|| "--checkpoint auto needs --memory SIZE (the device memory to fit)".to_string())
            }
            _ => match t.strip_prefix("budget=") {
                Some(size) => parse_size(size).map(Checkpoint::Budget).map_err(|e| format!("--checkpoint {t}: {e}")),
                None => Err(format!("unknown --checkpoint `{t}`; expected none, blocks, sqrt, budget=SIZE (e.g. budget=4GiB) or auto")),
            },
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Checkpoint::None => "none".into(),
            Checkpoint::Blocks => "blocks".into(),
            Checkpoint::Sqrt => "sqrt".into(),
            Checkpoint::Budget(b) => format!("budget={}", flag(*b)),
            Checkpoint::Auto(m) => format!("auto (--memory {})", flag(*m)),
        }
    }
}

/// One candidate rewrite and its real plan's peak.
struct Candidate {
    policy: String,
    graph: Graph,
    rw: Rewrite,
    peak: usize,
}

fn err(msg: String) -> PassError {
    PassError::Invalid { pass: Stage::Remat, msg }
}

/// A planner error as this pass's, the compile budget's kept as such.
fn plan_err(e: plan::PlanError) -> PassError {
    match e {
        plan::PlanError::Expired(x) => PassError::Expired(x),
        e => err(e.to_string()),
    }
}

fn peak(g: &Graph, po: &PlanOptions) -> Result<usize, PassError> {
    plan::plan(g, po).map(|p| p.peak_bytes()).map_err(plan_err)
}

/// Keeps what policy `blocks` (`seg` = 1) or `sqrt` (`seg` = segment length) keeps.
fn keep_segments(d: &Dense, ch: &chain::Chains, seg: usize) -> Vec<bool> {
    let mut keep = vec![true; d.len()];
    for (i, k) in keep.iter_mut().enumerate() {
        let Some((_, s)) = ch.stage[i] else { continue };
        if (1..=ch.layers).contains(&s) {
            *k = match ch.boundary_index[i] {
                Some(b) => b % seg == 0 || b == ch.layers,
                None => false,
            };
        }
    }
    keep
}

fn candidate(g: &Graph, d: &Dense, keep: &[bool], policy: String, po: &PlanOptions) -> Result<Candidate, PassError> {
    let (graph, rw) = apply::rewrite(g, d, keep).map_err(|source| PassError::Ir { pass: Stage::Remat, error: source })?;
    let peak = peak(&graph, po)?;
    Ok(Candidate { policy, graph, rw, peak })
}

/// The segment length of `sqrt` for L blocks.
pub fn sqrt_segment(layers: usize) -> usize {
    ((layers as f64).sqrt().round() as usize).max(1)
}

/// `budget=M`: the DP's cheapest plan for a target, built and planned for real. The model's
/// working-set terms are estimates, so the target T given to it is searched: a plan that does
/// not fit lowers T by its excess, one that fits with more than 1% to spare raises T by the
/// headroom (fewer FLOPs may then fit too), always inside the bracket of targets known to fit
/// and known not to. Every plan is real; the cheapest that fits wins.
fn solve_budget(
    g: &Graph,
    d: &Dense,
    m: usize,
    base: Option<usize>,
    po: &PlanOptions,
    notes: &mut Vec<String>,
) -> Result<Option<Candidate>, PassError> {
    let base = match base {
        Some(b) => b,
        None => plan::estimate(g, po).map_err(plan_err)?,
    };
    let model = budget::Model::new(d, plan::persistent_bytes(g), base).map_err(err)?;
    if !model.exact {
        notes.push("a stage has more than 20 candidate values: its choices were ranked greedily, not enumerated".into());
    }
    let floor = model.solve_floor();
    let (mut fits, mut fails) = (floor, usize::MAX); // targets known to fit (as a bound) / not to
    let mut target = m.max(floor);
    let mut best: Option<(Candidate, budget::Solution)> = None;
    // what offsets add to the lower bound, from the last full plan
    let mut fragmentation = 0usize;
    let close = m / 256 + 1;
    let (mut step, mut last_keep): (usize, Option<Vec<u32>>) = (0, None);
    for _ in 0..8 {
        let Some(sol) = model.solve(target) else { break };
        let keep = model.keep_vector(d, &sol.keep);
        let masks = sol.keep.clone();
        let (graph, rw) = apply::rewrite(g, d, &keep).map_err(|source| PassError::Ir { pass: Stage::Remat, error: source })?;
        // the estimate (schedule and lifetimes, no offsets) bounds the real peak from below;
        // offsets are assigned only for plans that may fit
        let (est, planned) = plan::estimate_then_plan(&graph, po, |est| est + fragmentation <= m).map_err(plan_err)?;
        let real = match planned {
            Some(p) => {
                let r = p.peak_bytes();
                fragmentation = r.saturating_sub(est);
                r
            }
            None => est + fragmentation,
        };
        if real <= m {
            fits = fits.max(target);
            if best.as_ref().is_none_or(|(b, _)| rw.recompute_flops < b.rw.recompute_flops) {
                best = Some((Candidate { policy: format!("budget={}", flag(m)), graph, rw, peak: real }, sol));
            }
            if m - real <= m / 100 || best.as_ref().is_some_and(|(b, _)| b.rw.recompute_flops == 0) {
                break;
            }
            target = (target + (m - real)).min(fails.saturating_sub(close));
        } else {
            fails = fails.min(target);
            // the DP's answer moves in steps: lower by the excess, and twice as far each time
            // the same answer comes back
            let same = last_keep.as_ref() == Some(&masks);
            step = if same { step * 2 } else { real - m + m / 1000 };
            target = target.saturating_sub(step).max(fits + (fails - fits) / 2).min(fails.saturating_sub(1));
        }
        last_keep = Some(masks);
        if target <= fits && best.is_some() || fails.saturating_sub(fits) <= close || target < floor {
            break;
        }
    }
    Ok(best.map(|(c, sol)| {
        notes.push(format!(
            "budget: recompute {} (model: {}, planned {})",
            flops(c.rw.recompute_flops),
            human(sol.modeled_peak),
            human(c.peak)
        ));
        c
    }))
}

/// The smallest peak any policy reaches (for the error of an impossible budget).
fn smallest(g: &Graph, d: &Dense, po: &PlanOptions) -> Result<(usize, String), PassError> {
    let ch = chain::find(d).map_err(err)?;
    let mut best: Option<(usize, String)> = None;
    for (seg, name) in [(1, "blocks".to_string()), (sqrt_segment(ch.layers), "sqrt".to_string())] {
        let c = candidate(g, d, &keep_segments(d, &ch, seg), name, po)?;
        if best.as_ref().is_none_or(|(p, _)| c.peak < *p) {
            best = Some((c.peak, c.policy));
        }
    }
    let base = plan::estimate(g, po).map_err(plan_err)?;
    if let Ok(model) = budget::Model::new(d, plan::persistent_bytes(g), base) {
        let keep = model.keep_vector(d, &model.minimal());
        let c = candidate(g, d, &keep, "budget (keeping only block boundaries)".into(), po)?;
        if best.as_ref().is_none_or(|(p, _)| c.peak < *p) {
            best = Some((c.peak, c.policy));
        }
    }
    best.ok_or_else(|| err("no checkpoint policy applies".into()))
}

fn impossible(g: &Graph, d: &Dense, what: &str, m: usize, po: &PlanOptions) -> PassError {
    match smallest(g, d, po) {
        Ok((p, policy)) => err(format!(
            "{what} cannot fit this step in {}: the smallest plan needs {} (--checkpoint {policy}); use --checkpoint budget={} or more",
            human(m),
            human(p),
            flag(p)
        )),
        Err(e) => e,
    }
}

/// The plan with the fewest recompute FLOPs whose real peak fits `m`, among the budget DP's
/// and the fixed policies `blocks` and `sqrt` (planned only when they could be cheaper than
/// what already fits). `base` is the step's estimated peak without recompute, if known.
fn cheapest_fit(
    g: &Graph,
    d: &Dense,
    m: usize,
    base: Option<usize>,
    po: &PlanOptions,
    notes: &mut Vec<String>,
) -> Result<Option<Candidate>, PassError> {
    let mut fits: Vec<Candidate> = Vec::new();
    if let Some(c) = solve_budget(g, d, m, base, po, notes)? {
        fits.push(c);
    }
    let ch = chain::find(d).map_err(err)?;
    for (seg, name) in [(1, "blocks"), (sqrt_segment(ch.layers), "sqrt")] {
        let keep = keep_segments(d, &ch, seg);
        if fits.iter().any(|f| f.rw.recompute_flops <= estimate_flops(d, &keep)) {
            continue;
        }
        let c = candidate(g, d, &keep, name.into(), po)?;
        if c.peak <= m {
            fits.push(c);
        }
    }
    Ok(fits.into_iter().min_by_key(|c| (c.rw.recompute_flops, c.peak)))
}

/// The pass.
pub fn remat(g: Graph, policy: Checkpoint, po: &PlanOptions) -> Result<(Graph, PassReport), PassError> {
    let mut report = PassReport::new(Stage::Remat);
    let d = Dense::new(&g).map_err(|e| err(e.to_string()))?;
    let chosen = match policy {
        Checkpoint::None => {
            report.notes.push("checkpoint none: every forward value the backward reads is kept".into());
            return Ok((g, report));
        }
        Checkpoint::Blocks | Checkpoint::Sqrt => {
            let ch = chain::find(&d).map_err(|e| err(format!("--checkpoint {}: {e}", policy.describe())))?;
            let seg = if policy == Checkpoint::Blocks { 1 } else { sqrt_segment(ch.layers) };
            if policy == Checkpoint::Sqrt {
                report.notes.push(format!("sqrt: {} blocks in segments of {seg}", ch.layers));
            }
            let (graph, rw) = apply::rewrite(&g, &d, &keep_segments(&d, &ch, seg))
                .map_err(|source| PassError::Ir { pass: Stage::Remat, error: source })?;
            Candidate { policy: policy.describe(), graph, rw, peak: 0 }
        }
        Checkpoint::Budget(m) => match cheapest_fit(&g, &d, m, None, po, &mut report.notes)? {
            Some(c) => c,
            None => return Err(impossible(&g, &d, &format!("--checkpoint budget={}", flag(m)), m, po)),
        },
        Checkpoint::Auto(m) => {
            // the estimate bounds the real peak from below: plan for real only if it may fit
            let (est, planned) = plan::estimate_then_plan(&g, po, |est| est <= m).map_err(plan_err)?;
            let none_peak = planned.map_or(est, |p| p.peak_bytes());
            if none_peak <= m {
                report.notes.push(format!("auto: no recompute needed (peak {} of {})", human(none_peak), human(m)));
                report.set("planned_peak", none_peak as i64);
                return Ok((g, report));
            }
            let Some(best) = cheapest_fit(&g, &d, m, Some(est), po, &mut report.notes)? else {
                return Err(impossible(&g, &d, &format!("--memory {}", flag(m)), m, po));
            };
            report.notes.push(format!("auto: chose {} (peak {} of {})", best.policy, human(best.peak), human(m)));
            best
        }
    };
    report.set("recomputed_nodes", chosen.rw.recomputed_nodes as i64);
    report.set("recompute_flops", chosen.rw.recompute_flops as i64);
    report.set("saved_values", chosen.rw.saved_values as i64);
    report.set("saved_bytes", chosen.rw.saved_bytes as i64);
    if chosen.peak > 0 {
        report.set("planned_peak", chosen.peak as i64);
    }
    Ok((chosen.graph, report))
}

/// The FLOPs a keep vector recomputes, without building the graph.
fn estimate_flops(d: &Dense, keep: &[bool]) -> u64 {
    let kept = |i: usize| d.is_input(i) || keep[d.view_root(i)];
    let mut need: Vec<bool> = (0..d.len()).map(|i| chain::Chains::needed(d, i) && !kept(i)).collect();
    let mut total = 0;
    for i in (0..d.len()).rev() {
        if need[i] {
            total += d.flops[i];
            for &o in &d.operands[i] {
                if !kept(o) {
                    need[o] = true;
                }
            }
        }
    }
    total
}
