//! Collectives over a world of ranks: what data parallelism and ZeRO sharding exchange. They are
//! ops like any other (typed, verified, printed and parsed); what a rank computes is its own
//! program, and a collective's result depends on every rank's operand, so a graph with one runs
//! on N ranks in step: the reference interpreter simulates them in one process
//! (`qatc_runtime::Interpreter::run_ranks`), MPI and NCCL run them across processes and GPUs.
//!
//! Shapes, for a world of N ranks (every rank's operand has the same type):
//! - `all_reduce[reduce=sum|mean, world=N]` x -> x's type: the sum (or mean) over ranks;
//! - `reduce_scatter[reduce, world=N]` x [N m, ...] -> [m, ...]: rank r's block r of the sum (or
//!   mean) over ranks;
//! - `all_gather[world=N]` x [m, ...] -> [N m, ...]: every rank's x in rank order.
//!
//! Sizes N does not divide are padded explicitly by the passes that shard (a reduce-scatter
//! refuses a first dimension N does not divide), so every rank's block has one size.

/// How a reducing collective combines the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reduce {
    Sum,
    /// The sum divided by the world's size (DDP's gradient averaging).
    Mean,
}

impl Reduce {
    pub const ALL: [Reduce; 2] = [Reduce::Sum, Reduce::Mean];

    pub fn name(self) -> &'static str {
        match self {
            Reduce::Sum => "sum",
            Reduce::Mean => "mean",
        }
    }

    pub fn from_name(s: &str) -> Option<Reduce> {
        Reduce::ALL.into_iter().find(|r| r.name() == s)
    }
}
