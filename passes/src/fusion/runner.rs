//! Equality saturation, bounded. egg's defaults (10,000 e-nodes, 30 iterations, 5 s) are too small
//! for a 48-layer training step (pitfalls.md, section 3), so the node limit scales with the input:
//! max(50,000, 20 x the starting e-nodes). The limits are set before `run` (egg #154) and the
//! stop reason is reported: only `saturated` means every rule was applied everywhere. Whatever the
//! reason, the e-graph still holds every original op, so extraction always finds a valid graph.
//!
//! The scheduler is egg's `SimpleScheduler`: the rules only add kernels to existing classes (no
//! commutativity or associativity), so nothing explodes, and `BackoffScheduler`'s bans would stop
//! the per-op rules on a large graph before saturation.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use egg::{Rewrite, Runner, SimpleScheduler, StopReason};
use serde::Serialize;

use qatc_ir::Deadline;

use super::lang::{ENode, FusionAnalysis, EG};

/// The runner's bounds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Limits {
    pub node_limit: usize,
    pub iter_limit: usize,
    pub time_limit_s: f64,
}

/// What saturation did.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SaturationReport {
    /// `saturated`, `iteration_limit`, `node_limit`, `time_limit` or `other: ...`.
    pub stop_reason: String,
    /// Only a saturated run applied every rule everywhere.
    pub complete: bool,
    pub iterations: usize,
    pub start_enodes: usize,
    pub enodes: usize,
    pub eclasses: usize,
    pub time_s: f64,
    pub node_limit: usize,
    pub iter_limit: usize,
    pub time_limit_s: f64,
    /// Rule name -> times it added something new (egg's `applied`, summed over iterations).
    pub rules_fired: BTreeMap<String, usize>,
}

pub fn stop_name(r: &Option<StopReason>) -> String {
    match r {
        Some(StopReason::Saturated) => "saturated".into(),
        Some(StopReason::IterationLimit(n)) => format!("iteration_limit ({n})"),
        Some(StopReason::NodeLimit(n)) => format!("node_limit ({n})"),
        Some(StopReason::TimeLimit(s)) => format!("time_limit ({s} s)"),
        Some(StopReason::Other(s)) => format!("other: {s}"),
        None => "not run".into(),
    }
}

/// Runs `rules` on `eg` within `limits`, and within `deadline`: its time limit is capped by the
/// time left, and a hook checks it before every iteration (the caller reports an expired
/// deadline; saturation itself just stops).
pub fn saturate(eg: EG, rules: &[Rewrite<ENode, FusionAnalysis>], limits: &Limits, deadline: &Deadline) -> (EG, SaturationReport) {
    let t0 = Instant::now();
    let start_enodes = eg.total_size();
    let d = *deadline;
    let runner = Runner::<ENode, FusionAnalysis, ()>::new(FusionAnalysis::default())
        .with_egraph(eg)
        .with_node_limit(limits.node_limit)
        .with_iter_limit(limits.iter_limit)
        .with_time_limit(deadline.cap(Duration::from_secs_f64(limits.time_limit_s)))
        .with_scheduler(SimpleScheduler)
        .with_hook(move |_| d.check("fuse (equality saturation)").map_err(|e| e.to_string()))
        .run(rules);
    let mut fired: BTreeMap<String, usize> = BTreeMap::new();
    for it in &runner.iterations {
        for (name, n) in &it.applied {
            *fired.entry(name.to_string()).or_default() += n;
        }
    }
    let report = SaturationReport {
        stop_reason: stop_name(&runner.stop_reason),
        complete: matches!(runner.stop_reason, Some(StopReason::Saturated)),
        iterations: runner.iterations.len(),
        start_enodes,
        enodes: runner.egraph.total_size(),
        eclasses: runner.egraph.number_of_classes(),
        time_s: t0.elapsed().as_secs_f64(),
        node_limit: limits.node_limit,
        iter_limit: limits.iter_limit,
        time_limit_s: limits.time_limit_s,
        rules_fired: fired,
    };
    (runner.egraph, report)
}
