//! The pass pipeline: an ordered list of named passes, each verified after it runs.

use std::collections::BTreeMap;

use qatc_ir::{verify, Deadline, Graph};
use serde::Serialize;

use crate::error::PassError;

/// What a pass did, in counters a person (and `qatc compile`'s summary) can read.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct PassReport {
    pub pass: &'static str,
    pub counters: BTreeMap<&'static str, i64>,
    pub notes: Vec<String>,
    /// The fusion pass's full report (`qatc compile` writes it to `fusion.json`).
    #[serde(skip)]
    pub fusion: Option<Box<crate::fusion::FusionReport>>,
}

impl PassReport {
    pub fn new(pass: &'static str) -> PassReport {
        PassReport { pass, ..Default::default() }
    }
    pub fn count(&mut self, key: &'static str, by: i64) {
        *self.counters.entry(key).or_insert(0) += by;
    }
    pub fn set(&mut self, key: &'static str, v: i64) {
        self.counters.insert(key, v);
    }
}

impl std::fmt::Display for PassReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:", self.pass)?;
        for (k, v) in &self.counters {
            write!(f, " {k}={v}")?;
        }
        Ok(())
    }
}

/// A named step of the pipeline. `run` takes the graph by value and returns the new one (passes
/// that rebuild, like autodiff's, and passes that edit in place look the same from outside).
pub struct Pass<'a> {
    pub name: &'static str,
    pub run: PassFn<'a>,
}

/// A pass body: the graph in, the new graph and its report out.
pub type PassFn<'a> = Box<dyn FnOnce(Graph) -> Result<(Graph, PassReport), PassError> + 'a>;

impl<'a> Pass<'a> {
    pub fn new(name: &'static str, run: impl FnOnce(Graph) -> Result<(Graph, PassReport), PassError> + 'a) -> Pass<'a> {
        Pass { name, run: Box::new(run) }
    }
}

/// Runs `passes` in order on `g`, verifying after each. `after` sees the graph after every pass
/// (for `qatc dump --after` and snapshots).
pub fn run(g: Graph, passes: Vec<Pass<'_>>, after: impl FnMut(&'static str, &Graph)) -> Result<(Graph, Vec<PassReport>), PassError> {
    run_within(g, passes, &Deadline::unlimited(), after)
}

/// [`run`], stopping with [`PassError::Expired`] after the pass during which `deadline` passed
/// (passes that can run long also check it inside, and stop sooner).
pub fn run_within(
    mut g: Graph,
    passes: Vec<Pass<'_>>,
    deadline: &Deadline,
    mut after: impl FnMut(&'static str, &Graph),
) -> Result<(Graph, Vec<PassReport>), PassError> {
    let mut reports = Vec::new();
    for p in passes {
        let name = p.name;
        let (ng, report) = (p.run)(g)?;
        deadline.check(&format!("pass {name}"))?;
        verify(&ng).map_err(|source| PassError::Ir { pass: name, error: source })?;
        after(name, &ng);
        reports.push(report);
        g = ng;
    }
    Ok((g, reports))
}
