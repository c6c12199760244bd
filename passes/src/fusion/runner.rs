//! Equality saturation, bounded. egg's defaults (10,000 e-nodes, 30 iterations, 5 s) are too small
//! for a 48-layer training step (pitfalls.md, section 3), so the node limit scales with the input:
//! max(50,000, 20 x the starting e-nodes). The limits are set before `run` (egg #154) and the
//! stop reason is reported: only `saturated` means every rule was applied everywhere. Whatever the
//! reason, the e-graph still holds every original op, so extraction always finds a valid graph.
//!
//! The scheduler is egg's `SimpleScheduler` (every rule every iteration): the rules only add
//! kernels to existing classes (no commutativity or associativity), so nothing explodes, and
//! `BackoffScheduler`'s bans would stop the per-op rules on a large graph before saturation. One
//! thing is left out ([`Changed`]): a pattern rule's match none of whose classes changed since the
//! iteration before, which that iteration applied already.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use egg::{Rewrite, RewriteScheduler, Runner, SearchMatches, StopReason, Symbol};
use serde::Serialize;

use qatc_ir::Deadline;

use super::lang::{all_settled, ENode, FusionAnalysis, EG};

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
    /// Rule applications skipped because everything they read was settled ([`Changed`]).
    pub settled_skipped: usize,
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

/// egg's `SimpleScheduler` less the matches that cannot add anything. What a pattern rule
/// (`rules::Rule::Fuse`) adds for a match is a function of the match's root class, its variables'
/// classes and the nodes in them (its shape check reads their types; the candidate fragments are
/// the kernels in the variables' classes; the rest of the pattern matches primitive ops, which no
/// rule adds), and the rules' memo refuses a match it has built before. So a match whose classes
/// are all settled (`lang::settled`) as it is about to be applied is dropped before anything is
/// built: on a 48-layer step the last iterations of saturation were such re-checks. It is decided
/// then, not at the search, since a rule applied earlier in the iteration may have changed a
/// class; so the e-graph grows exactly as it would without this (`FuseOptions::recheck`, tested).
struct Changed {
    /// The pattern rules (custom rules read beyond their match and check `settled` themselves).
    local: HashSet<Symbol>,
    /// Apply every match (the reference).
    recheck: bool,
}

impl RewriteScheduler<ENode, FusionAnalysis> for Changed {
    fn apply_rewrite(
        &mut self,
        iteration: usize,
        eg: &mut EG,
        rw: &Rewrite<ENode, FusionAnalysis>,
        mut matches: Vec<SearchMatches<ENode>>,
    ) -> usize {
        eg.analysis.now = iteration as u32;
        eg.analysis.settled_before = (!self.recheck && iteration >= 2).then(|| iteration as u32 - 1);
        if self.local.contains(&rw.name) {
            let vars = rw.searcher.vars();
            let before: usize = matches.iter().map(|m| m.substs.len()).sum();
            for m in &mut matches {
                // a variable without a class in the match is read as unsettled: the match is kept
                m.substs.retain(|s| {
                    let bound = vars.iter().all(|v| s.get(*v).is_some());
                    !(bound && all_settled(eg, m.eclass, vars.iter().filter_map(|v| s.get(*v).copied())))
                });
            }
            matches.retain(|m| !m.substs.is_empty());
            eg.analysis.skipped += before - matches.iter().map(|m| m.substs.len()).sum::<usize>();
        }
        rw.apply(eg, &matches).len()
    }
}

/// Runs `rules` on `eg` within `limits`, and within `deadline`: its time limit is capped by the
/// time left, and a hook checks it before every iteration (the caller reports an expired
/// deadline; saturation itself just stops). `local` names the pattern rules, and `recheck`
/// applies every match every iteration ([`Changed`]).
pub fn saturate(
    eg: EG,
    rules: &[Rewrite<ENode, FusionAnalysis>],
    local: HashSet<Symbol>,
    recheck: bool,
    limits: &Limits,
    deadline: &Deadline,
) -> (EG, SaturationReport) {
    let t0 = Instant::now();
    let start_enodes = eg.total_size();
    let d = *deadline;
    let runner = Runner::<ENode, FusionAnalysis, ()>::new(FusionAnalysis::default())
        .with_egraph(eg)
        .with_node_limit(limits.node_limit)
        .with_iter_limit(limits.iter_limit)
        .with_time_limit(deadline.cap(Duration::from_secs_f64(limits.time_limit_s)))
        .with_scheduler(Changed { local, recheck })
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
        settled_skipped: runner.egraph.analysis.skipped,
    };
    (runner.egraph, report)
}
