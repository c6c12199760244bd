//! The plan per rank (`qatc plan --ranks N --zero S`): what one rank holds of the model states
//! beside ZeRO's formula for them, and what each collective of its step moves.
//!
//! The formula is ZeRO's division (Rajbhandari et al. 2020, figure 1) applied to qatc's own bytes
//! per parameter, read off the same step built for one rank (`ModelStates` of the stage-0 graph):
//! at stage 0 a rank holds P + G + O a parameter, at 1 P + G + O / N, at 2 P + (G + O) / N, at 3
//! (P + G + O) / N. ZeRO's paper counts P 2 (fp16 weights), G 2 (fp16 gradients), O 12 (fp32
//! master, momentum, variance): 16, 4 + 12 / N, 2 + 14 / N, 16 / N. qatc's parts differ
//! (`ModelStates`): P 4 (the f32 weight is its own master), G 0 at --grad-accum 1 (gradients are
//! values of the step, freed once reduced and applied) or the sums' bytes, O 8 (Adam's moments).
//! What a rank holds is read off its own step graph, padding included, and must agree with the
//! formula (within 2% on GPT-2 1.5B, `tests/plan.rs`).

use qatc_passes::data_parallel::{traffic, Traffic};
use qatc_passes::plan::units::human;
use qatc_passes::zero::{ModelStates, Parallel};
use serde_json::{json, Value};

/// ZeRO's paper's bytes a parameter on one rank, for its 2 + 2 + 12 mixed-precision layout.
pub fn paper_bytes_per_parameter(ranks: usize, zero: u8) -> f64 {
    let n = ranks.max(1) as f64;
    match zero {
        0 => 16.0,
        1 => 4.0 + 12.0 / n,
        2 => 2.0 + 14.0 / n,
        _ => 16.0 / n,
    }
}

/// One rank's model states, the formula's, and its collectives.
pub struct RankPlan {
    pub parallel: Parallel,
    /// Micro-batches per optimizer step: the collectives run on each.
    pub grad_accum: usize,
    /// Trainable parameters (elements).
    pub parameters: usize,
    /// The states of the same step on one rank (qatc's bytes per parameter, times the parameters).
    pub whole: ModelStates,
    /// What this rank holds.
    pub rank: ModelStates,
    pub collectives: Vec<Traffic>,
}

impl RankPlan {
    /// `rank_graph` is this rank's step, `whole_graph` the same step for one rank.
    pub fn new(
        parallel: Parallel,
        grad_accum: usize,
        rank_graph: &qatc_ir::Graph,
        whole_graph: &qatc_ir::Graph,
    ) -> anyhow::Result<RankPlan> {
        let parameters = whole_graph
            .inputs()
            .into_iter()
            .filter(|&id| whole_graph.input_kind(id) == Some(qatc_ir::InputKind::Trainable))
            .map(|id| whole_graph.ty(id).numel())
            .sum();
        Ok(RankPlan {
            parallel,
            grad_accum: grad_accum.max(1),
            parameters,
            whole: ModelStates::of(whole_graph),
            rank: ModelStates::of(rank_graph),
            collectives: traffic(rank_graph)?,
        })
    }

    /// ZeRO's division of `whole` at this rank's stage.
    pub fn formula(&self) -> ModelStates {
        self.whole.zero_formula(self.parallel.ranks, self.parallel.zero)
    }

    fn per_parameter(&self, bytes: usize) -> f64 {
        bytes as f64 / self.parameters.max(1) as f64
    }

    /// How far what the rank holds is from the formula, relative to the formula.
    pub fn deviation(&self) -> f64 {
        let f = self.formula().total() as f64;
        (self.rank.total() as f64 - f).abs() / f.max(1.0)
    }

    /// Bytes this rank sends per run of the step, and per optimizer step (K runs).
    pub fn sent(&self) -> (usize, usize) {
        let run: usize = self.collectives.iter().map(|c| c.sent_bytes).sum();
        (run, run * self.grad_accum)
    }

    /// The collectives by kind: (op, count, bytes sent per run).
    fn by_op(&self) -> Vec<(&'static str, usize, usize)> {
        let mut v: Vec<(&'static str, usize, usize)> = Vec::new();
        for c in &self.collectives {
            match v.iter_mut().find(|(op, _, _)| *op == c.op) {
                Some(e) => {
                    e.1 += 1;
                    e.2 += c.sent_bytes;
                }
                None => v.push((c.op, 1, c.sent_bytes)),
            }
        }
        v
    }

    /// The lines `qatc plan` prints under its table.
    pub fn table(&self) -> String {
        let p = self.parallel;
        let f = self.formula();
        let mut o = format!(
            "\n  ranks {}, ZeRO {}: one rank's step, {} trainable parameters; model states per rank\n",
            p.ranks, p.zero, self.parameters
        );
        o += &format!("  {:<12} {:>12} {:>9} {:>12} {:>9} {:>11}\n", "", "this rank", "B/param", "ZeRO formula", "B/param", "one rank");
        let mut row = |label: &str, got: usize, want: usize, whole: usize| {
            o += &format!(
                "  {label:<12} {:>12} {:>9.3} {:>12} {:>9.3} {:>11}\n",
                human(got),
                self.per_parameter(got),
                human(want),
                self.per_parameter(want),
                human(whole)
            );
        };
        row("parameters", self.rank.parameters, f.parameters, self.whole.parameters);
        row("gradients", self.rank.gradients, f.gradients, self.whole.gradients);
        row("optimizer", self.rank.optimizer, f.optimizer, self.whole.optimizer);
        row("total", self.rank.total(), f.total(), self.whole.total());
        o += &format!(
            "  within {:.2}% of the formula; ZeRO's paper (2 + 2 + 12 bytes a parameter) gives {:.3} B/param at this stage, qatc's parts are {:.0} + {:.0} + {:.0}\n",
            100.0 * self.deviation(),
            paper_bytes_per_parameter(p.ranks, p.zero),
            self.per_parameter(self.whole.parameters),
            self.per_parameter(self.whole.gradients),
            self.per_parameter(self.whole.optimizer),
        );
        if self.rank.frozen > 0 {
            o += &format!("  frozen weights {} on every rank (not sharded)\n", human(self.rank.frozen));
        }
        let (run, step) = self.sent();
        o += &format!(
            "  collectives: {} sent per rank per run (ring algorithm), {} per optimizer step ({} run{})\n",
            human(run),
            human(step),
            self.grad_accum,
            if self.grad_accum == 1 { "" } else { "s: the loop runs them on every micro-batch" }
        );
        for (op, n, bytes) in self.by_op() {
            o += &format!("    {op:<15} {n:>5} x, {} per run\n", human(bytes));
        }
        o
    }

    /// The `ranks` object of `qatc plan --json`.
    pub fn to_json(&self) -> Value {
        let p = self.parallel;
        let states = |s: ModelStates| {
            json!({
                "parameters": s.parameters,
                "gradients": s.gradients,
                "optimizer": s.optimizer,
                "total": s.total(),
                "bytes_per_parameter": self.per_parameter(s.total()),
                "frozen": s.frozen,
            })
        };
        let (run, step) = self.sent();
        json!({
            "ranks": p.ranks,
            "zero": p.zero,
            "trainable_parameters": self.parameters,
            "model_states": {
                "this_rank": states(self.rank),
                "zero_formula": states(self.formula()),
                "one_rank": states(self.whole),
                "deviation": self.deviation(),
                "paper_bytes_per_parameter": paper_bytes_per_parameter(p.ranks, p.zero),
            },
            "collectives": {
                "algorithm": "ring",
                "sent_bytes_per_run": run,
                "runs_per_step": self.grad_accum,
                "sent_bytes_per_step": step,
                "each": self.collectives,
            },
        })
    }
}
