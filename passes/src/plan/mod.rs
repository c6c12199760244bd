//! The memory plan of a step: a memory-aware schedule, every value's lifetime, one arena with a
//! byte offset for every activation and temporary, and the step's bytes by category.
//!
//! - [`region`]: the needed nodes, the forward region, lazy nodes, write-backs, views;
//! - [`schedule`]: the memory-aware topological order;
//! - [`liveness`]: storage sharing (views, write-backs, in place), lifetimes, the lower bound;
//! - offsets: `qatc_arena::place`, the placer the executors lay their memory out with too;
//! - [`cost`]: bytes and FLOPs per op; [`breakdown`]: categories;
//!
//! What users see (`qatc plan`'s JSON and SVG) is the executed program's layout (`src/memory`),
//! not this graph-level plan, which schedules the step and drives the `remat` pass's search.
//!
//! Inputs of the step (weights, trainable parameters, optimizer state, data) are not arena
//! values: each has its own storage for the whole step (the persistent region). An update
//! output is written into its input's storage when the schedule can order every other reader
//! of that input first (AdamW's new parameters and moments are: see `region`), so optimizer
//! updates take no arena bytes.

pub mod breakdown;
pub mod cost;
mod liveness;
pub mod region;
mod schedule;
pub mod units;

use std::collections::HashMap;

use qatc_ir::{Deadline, Expired, Graph, IrError, NodeId};
use serde::Serialize;
use thiserror::Error;

pub use breakdown::Category;
use region::Dense;
use schedule::Priority;

#[derive(Debug, Error)]
pub enum PlanError {
    #[error("memory plan: {0}")]
    Ir(IrError),
    #[error("memory plan: internal error: {0}")]
    Internal(String),
    #[error(transparent)]
    Expired(#[from] Expired),
    #[error("memory plan: {0}")]
    TooLarge(String),
}

/// Knobs of the planner.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    /// Every buffer's offset and size are multiples of this (bytes).
    pub align: usize,
    /// The compile budget, checked between the planner's phases (and by `remat` between the
    /// candidate plans it tries).
    pub deadline: Deadline,
}

impl Default for PlanOptions {
    fn default() -> PlanOptions {
        PlanOptions { align: 64, deadline: Deadline::unlimited() }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Region {
    /// The one allocation shared by activations, gradients and temporaries.
    Arena,
    /// An input's own storage (weights, parameters, optimizer state, data), for the whole step.
    Persistent,
}

pub use qatc_ir::Phase;

/// One storage buffer.
#[derive(Clone, Debug, Serialize)]
pub struct Buffer {
    pub id: usize,
    /// The name of the first value stored in it (or `%N op` for unnamed values).
    pub name: String,
    pub category: Category,
    pub region: Region,
    /// Bytes of the value at its dtype.
    pub bytes: usize,
    /// Bytes reserved (aligned).
    pub size: usize,
    /// Offset in its region.
    pub offset: usize,
    pub first_step: usize,
    pub last_step: usize,
    /// The op that produced the first value (`input` for persistent buffers).
    pub producer: &'static str,
    /// How many values it holds over the step (views, in-place results, a write-back).
    pub values: usize,
}

/// One step of the schedule: a node run.
#[derive(Clone, Debug, Serialize)]
pub struct Step {
    pub index: usize,
    #[serde(skip)]
    pub node: NodeId,
    pub name: String,
    pub op: &'static str,
    pub buffer: usize,
    pub flops: u64,
    pub phase: Phase,
    /// The result took over a dying operand's buffer.
    pub in_place: bool,
    /// Arena bytes live during this step.
    pub live_bytes: usize,
}

/// Where a node's value is stored (for executing a plan).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    Arena {
        offset: usize,
    },
    /// The storage of the input of that name.
    Input {
        name: String,
    },
}

#[derive(Clone, Debug)]
pub struct Plan {
    pub steps: Vec<Step>,
    pub buffers: Vec<Buffer>,
    /// Planned arena size (the highest byte any buffer reaches).
    pub arena_bytes: usize,
    /// The most arena bytes live at one step: no assignment can use less.
    pub lower_bound: usize,
    /// The step where `lower_bound` is reached (the peak of the timeline).
    pub peak_step: usize,
    /// Bytes of the inputs' storage, by category.
    pub persistent: Vec<(Category, usize)>,
    /// Arena bytes live at the peak step, by category.
    pub at_peak: Vec<(Category, usize)>,
    /// Arena bytes live at every step, by category (indexed as `Category::ALL`).
    pub profile: Vec<[usize; 7]>,
    pub total_flops: u64,
    pub recompute_flops: u64,
    pub recomputed_nodes: usize,
    pub in_place_steps: usize,
    /// Which scheduler produced the order (`greedy`, `greedy, depth first` or `structural`:
    /// whichever had the least live at its peak).
    pub scheduler: &'static str,
    /// First backward step (the forward/backward boundary), if the step has a loss.
    pub backward_starts: Option<usize>,
    pub location: HashMap<NodeId, Location>,
}

impl Plan {
    pub fn persistent_bytes(&self) -> usize {
        self.persistent.iter().map(|(_, b)| b).sum()
    }
    /// The step's peak: persistent storage plus the arena.
    pub fn peak_bytes(&self) -> usize {
        self.persistent_bytes() + self.arena_bytes
    }
    /// Planned arena over its lower bound (1.0 is optimal).
    pub fn ratio(&self) -> f64 {
        if self.lower_bound == 0 {
            1.0
        } else {
            self.arena_bytes as f64 / self.lower_bound as f64
        }
    }
    /// The schedule as node ids.
    pub fn order(&self) -> Vec<NodeId> {
        self.steps.iter().map(|s| s.node).collect()
    }
    /// Checks that arena buffers live at the same time never share a byte.
    pub fn verify(&self) -> Result<(), PlanError> {
        let (iv, off): (Vec<qatc_arena::Interval>, Vec<usize>) = self
            .buffers
            .iter()
            .filter(|b| b.region == Region::Arena)
            .map(|b| (qatc_arena::Interval { first: b.first_step, last: b.last_step, size: b.size }, b.offset))
            .unzip();
        qatc_arena::check(&iv, &off, 1).map_err(|e| PlanError::Internal(e.to_string()))?;
        if self.buffers.iter().any(|b| b.region == Region::Arena && b.offset + b.size > self.arena_bytes) {
            return Err(PlanError::Internal("a buffer reaches past the arena".into()));
        }
        Ok(())
    }
}

/// Plans `g`: schedule, lifetimes, offsets, categories.
pub fn plan(g: &Graph, opts: &PlanOptions) -> Result<Plan, PlanError> {
    opts.deadline.check("memory plan")?;
    let d = Dense::new(g)?;
    d.check_total()?;
    let greedy = greedy_orders(&d, opts)?;
    let (lv, order, scheduler) = best_order(&d, opts, greedy)?;
    opts.deadline.check("memory plan (offsets)")?;
    build(&d, lv, order, scheduler)
}

/// A schedule, its liveness, and which scheduler made it.
type Scheduled = (liveness::Liveness, Vec<usize>, &'static str);

/// The two greedy schedules (by net bytes, then depth first) and their liveness: what
/// [`estimate`] reads and [`plan`] chooses among.
fn greedy_orders(d: &Dense, opts: &PlanOptions) -> Result<[Scheduled; 2], PlanError> {
    let align = opts.align.max(1);
    let greedy = schedule::greedy(d, align, Priority::NetBytes)?;
    let by_net = (liveness::analyze(d, &greedy, align), greedy, "greedy");
    opts.deadline.check("memory plan (schedule)")?;
    let recent = schedule::greedy(d, align, Priority::Recent)?;
    let depth_first = (liveness::analyze(d, &recent, align), recent, "greedy, depth first");
    Ok([by_net, depth_first])
}

/// The order [`plan`] runs the nodes in: of the candidate orders (the two greedy ones, then the
/// graph's own), the one with the least live at its peak; its liveness, and which scheduler made
/// it.
fn best_order(d: &Dense, opts: &PlanOptions, [by_net, depth_first]: [Scheduled; 2]) -> Result<Scheduled, PlanError> {
    let align = opts.align.max(1);
    schedule::check(d, &by_net.1)?;
    let mut best = by_net;
    schedule::check(d, &depth_first.1)?;
    if depth_first.0.lower_bound < best.0.lower_bound {
        best = depth_first;
    }
    let structural: Vec<usize> = (0..d.len()).filter(|&i| !d.is_input(i)).collect();
    if schedule::check(d, &structural).is_ok() {
        let lv = liveness::analyze(d, &structural, align);
        if lv.lower_bound < best.0.lower_bound {
            best = (lv, structural, "structural");
        }
    }
    Ok(best)
}

/// The memory-aware schedule alone (what [`plan`] orders the nodes by): the order to run the
/// step in. The lowering takes it as the program's step order (`qatc_kernels::LowerOptions`).
/// Without [`plan`]'s offsets, which the lowering does not read (building them, the arena
/// placement of a graph-level plan above all, was more than half of its cost on GPT-2 1.5B).
pub fn schedule(g: &Graph) -> Result<Vec<NodeId>, PlanError> {
    let d = Dense::new(g)?;
    d.check_total()?;
    let opts = PlanOptions::default();
    let (_, order, _) = best_order(&d, &opts, greedy_orders(&d, &opts)?)?;
    Ok(order.iter().map(|&i| d.ids[i]).collect())
}

/// A quick estimate of the step's peak without assigning offsets: the inputs' storage plus the
/// lower bound of the memory-aware schedule (the planned arena is within a fraction of a percent
/// of it on transformer steps; `plan` gives the real figure). Used inside search loops.
pub fn estimate(g: &Graph, opts: &PlanOptions) -> Result<usize, PlanError> {
    estimate_then_plan(g, opts, |_| false).map(|(est, _)| est)
}

/// [`estimate`], and [`plan`] where `wanted` says so of the estimate: one pass over what both
/// read (the graph's dense form, the two greedy schedules and their liveness), where a search
/// that plans only the candidates whose estimate may fit made it twice (`remat`).
pub fn estimate_then_plan(g: &Graph, opts: &PlanOptions, wanted: impl FnOnce(usize) -> bool) -> Result<(usize, Option<Plan>), PlanError> {
    opts.deadline.check("memory plan (estimate)")?;
    let d = Dense::new(g)?;
    d.check_total()?;
    let orders = greedy_orders(&d, opts)?;
    let lv = if orders[1].0.lower_bound < orders[0].0.lower_bound { &orders[1].0 } else { &orders[0].0 };
    let persistent: usize = lv.bufs.iter().filter(|b| b.persistent.is_some()).map(|b| b.bytes).sum();
    let est = persistent + lv.lower_bound;
    if !wanted(est) {
        return Ok((est, None));
    }
    let (lv, order, scheduler) = best_order(&d, opts, orders)?;
    opts.deadline.check("memory plan (offsets)")?;
    Ok((est, Some(build(&d, lv, order, scheduler)?)))
}

/// Bytes of the inputs' storage (weights, parameters, optimizer state, data).
pub fn persistent_bytes(g: &Graph) -> usize {
    g.inputs().into_iter().map(|i| cost::value_bytes(g.ty(i))).sum()
}

fn build(d: &Dense, lv: liveness::Liveness, order: Vec<usize>, scheduler: &'static str) -> Result<Plan, PlanError> {
    let prof = breakdown::profile(d, &lv);
    // arena offsets
    let arena_ids: Vec<usize> = (0..lv.bufs.len()).filter(|&b| lv.bufs[b].persistent.is_none()).collect();
    let iv: Vec<qatc_arena::Interval> =
        arena_ids.iter().map(|&b| qatc_arena::Interval { first: lv.bufs[b].first, last: lv.bufs[b].last, size: lv.bufs[b].size }).collect();
    // sizes are aligned already (`liveness`)
    let qatc_arena::Placement { offsets: offs, size: arena_bytes } = qatc_arena::place(&iv, 1);
    let mut offset = vec![0usize; lv.bufs.len()];
    for (k, &b) in arena_ids.iter().enumerate() {
        offset[b] = offs[k];
    }
    // persistent offsets: one after the other
    let mut persistent: HashMap<Category, usize> = HashMap::new();
    let mut top = 0usize;
    for (b, buf) in lv.bufs.iter().enumerate() {
        if buf.persistent.is_some() {
            offset[b] = top;
            top += buf.size;
            *persistent.entry(prof.buffer_category[b]).or_insert(0) += buf.bytes;
        }
    }
    let buffers: Vec<Buffer> = lv
        .bufs
        .iter()
        .enumerate()
        .map(|(b, buf)| Buffer {
            id: b,
            name: d.name(buf.members[0]),
            category: prof.buffer_category[b],
            region: if buf.persistent.is_some() { Region::Persistent } else { Region::Arena },
            bytes: buf.bytes,
            size: buf.size,
            offset: offset[b],
            first_step: buf.first,
            last_step: buf.last,
            producer: d.mnemonic[buf.members[0]],
            values: buf.members.len(),
        })
        .collect();
    let in_place: std::collections::HashSet<usize> = lv.in_place.iter().map(|&(i, _)| i).collect();
    let mut steps = Vec::with_capacity(order.len());
    let mut recompute_flops = 0;
    let mut recomputed_nodes = 0;
    let mut backward_starts = None;
    for (s, &i) in order.iter().enumerate() {
        let phase = d.phase[i];
        if phase == Phase::Recompute {
            recompute_flops += d.flops[i];
            recomputed_nodes += 1;
        }
        if d.has_loss && matches!(phase, Phase::Backward | Phase::Recompute) && backward_starts.is_none() {
            backward_starts = Some(s);
        }
        steps.push(Step {
            index: s,
            node: d.ids[i],
            name: d.name(i),
            op: d.mnemonic[i],
            buffer: lv.buf_of[i],
            flops: d.flops[i],
            phase,
            in_place: in_place.contains(&i),
            live_bytes: lv.live[s],
        });
    }
    let mut location = HashMap::new();
    for i in 0..d.len() {
        let b = &lv.bufs[lv.buf_of[i]];
        let loc = match b.persistent {
            Some(p) => Location::Input { name: d.names[p].clone().unwrap_or_default() },
            None => Location::Arena { offset: offset[lv.buf_of[i]] },
        };
        location.insert(d.ids[i], loc);
    }
    let peak_row = prof.by_step.get(lv.lower_bound_step).copied().unwrap_or([0; 7]);
    let at_peak = Category::ALL.iter().enumerate().filter(|(_, c)| !c.persistent()).map(|(k, &c)| (c, peak_row[k])).collect();
    let persistent = Category::ALL.iter().filter(|c| c.persistent()).map(|&c| (c, persistent.get(&c).copied().unwrap_or(0))).collect();
    let plan = Plan {
        total_flops: order.iter().map(|&i| d.flops[i]).sum(),
        steps,
        buffers,
        arena_bytes,
        lower_bound: lv.lower_bound,
        peak_step: lv.lower_bound_step,
        persistent,
        at_peak,
        profile: prof.by_step,
        recompute_flops,
        recomputed_nodes,
        in_place_steps: lv.in_place.len(),
        scheduler,
        backward_starts,
        location,
    };
    Ok(plan)
}
