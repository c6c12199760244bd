//! The compile budget: an instant by which building a step must be done. It is a value handed to
//! every stage that can run long (the pass pipeline between passes, equality saturation inside
//! its runner, extraction's local search, the checkpoint search between candidate plans, the
//! planner between its schedules), never a global: two compiles in one process keep their own.
//! A stage that finds it expired stops with [`Expired`], naming itself.

use std::time::{Duration, Instant};

/// When compiling must stop. `Deadline::default()` never expires.
#[derive(Clone, Copy, Debug)]
pub struct Deadline {
    start: Instant,
    budget: Option<Duration>,
}

impl Default for Deadline {
    fn default() -> Deadline {
        Deadline::unlimited()
    }
}

/// A stage found the budget spent.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("the compile budget of {budget_s} s ran out in {stage}, {elapsed_s:.1} s in")]
pub struct Expired {
    pub stage: String,
    pub budget_s: f64,
    pub elapsed_s: f64,
}

impl Deadline {
    /// No budget.
    pub fn unlimited() -> Deadline {
        Deadline { start: Instant::now(), budget: None }
    }

    /// `budget` from now.
    pub fn within(budget: Duration) -> Deadline {
        Deadline { start: Instant::now(), budget: Some(budget) }
    }

    pub fn budget(&self) -> Option<Duration> {
        self.budget
    }

    /// Time left (None: unlimited; zero once expired).
    pub fn remaining(&self) -> Option<Duration> {
        self.budget.map(|b| b.saturating_sub(self.start.elapsed()))
    }

    pub fn expired(&self) -> bool {
        self.remaining().is_some_and(|r| r.is_zero())
    }

    /// `Err` naming `stage` once the budget is spent.
    pub fn check(&self, stage: &str) -> Result<(), Expired> {
        match self.budget {
            Some(b) if self.expired() => {
                Err(Expired { stage: stage.to_string(), budget_s: b.as_secs_f64(), elapsed_s: self.start.elapsed().as_secs_f64() })
            }
            _ => Ok(()),
        }
    }

    /// `limit` or the time left, whichever is shorter (for a stage with a time limit of its own).
    pub fn cap(&self, limit: Duration) -> Duration {
        self.remaining().map_or(limit, |r| r.min(limit))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spent_budget_names_the_stage() {
        assert!(Deadline::unlimited().check("fuse").is_ok());
        assert_eq!(Deadline::unlimited().cap(Duration::from_secs(5)), Duration::from_secs(5));
        let d = Deadline::within(Duration::ZERO);
        let e = d.check("fuse (equality saturation)").unwrap_err();
        assert_eq!(e.stage, "fuse (equality saturation)");
        assert!(e.to_string().starts_with("the compile budget of 0 s ran out in fuse (equality saturation)"), "{e}");
        assert_eq!(d.cap(Duration::from_secs(5)), Duration::ZERO);
        assert!(Deadline::within(Duration::from_secs(3600)).check("lower").is_ok());
    }
}
