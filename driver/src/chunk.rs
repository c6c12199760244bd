//! Rows per chunk of the chunked linear + cross-entropy, chosen by the planner: memory against
//! speed. This is the rule's one home; the plan (`qatc plan`, `memory_plan.json`, `memory.svg`)
//! and the executors built from it (`crate::compile`) run what it chooses.
//!
//! The floor is the fusion rule's choice, a field of the kernel's family
//! (`KernelFamily::CrossEntropyLinear`'s `chunk_rows`, printed `chunk=R`;
//! `qatc_passes::fusion::rules::cross_entropy::chunk_rows`: the largest power of two whose
//! [R, V] f32 tile fits 32 MiB, 128 rows for GPT-2's vocabulary), below which the chunks' GEMMs
//! get too thin to run at full speed. Above it, more rows per chunk are fewer launches and
//! taller GEMMs (speed) and a larger [R, V] scratch (memory): the planner doubles R from the
//! floor, up to every row in one chunk, and keeps the largest R whose executed plan peaks no
//! higher than the floor's (the scratch fits under a peak that lies elsewhere, so it is free;
//! "no higher" allows 0.1%, the per-row statistics' few KiB). The step's peak never moves for
//! it; when the cross-entropy is where the peak is, the floor stays. Where the lowering walks
//! the vocabulary in tiles (a frozen head on the CPU, `kernels/src/lower/xent_online.rs`) the
//! scratch is one 8 MiB tile whatever R, so R grows to every row: the head weight is then read
//! once per step.

use qatc_ir::Graph;
use qatc_kernels::{LowerOptions, NodeMemo, Program, Target};
use qatc_passes::plan::units::human;
use serde::Serialize;

use crate::lower::{lay_out, LaidOut};
use crate::{DriverError, Options};

/// The planner's choice and why.
#[derive(Clone, Debug, Serialize)]
pub struct ChunkChoice {
    /// Rows per chunk chosen.
    pub rows: usize,
    /// The fusion rule's rows per chunk: the floor.
    pub floor: usize,
    /// Rows of the logits (B x T).
    pub total_rows: usize,
    /// Every size planned: (rows per chunk, the executed plan's peak).
    pub tried: Vec<(usize, usize)>,
    /// One line on the choice.
    pub why: String,
}

impl ChunkChoice {
    /// The choice in a few words, for the picture.
    pub fn short(&self) -> String {
        if self.rows == self.total_rows {
            format!("planner: one chunk (floor {})", self.floor)
        } else if self.rows == self.floor {
            "planner: the floor (more rows would raise the peak)".to_string()
        } else {
            format!("planner: the most that keeps the peak, floor {}", self.floor)
        }
    }
}

/// `g` lowered for `target` in `schedule`'s order with `rows` per chunk (None: the fusion rule's).
pub fn lower(g: &Graph, schedule: &[qatc_ir::NodeId], rows: Option<usize>, target: &Target) -> Result<Program, DriverError> {
    lower_reusing(g, schedule, rows, target, &mut NodeMemo::default())
}

/// [`lower`] reusing the node lowerings `memo` holds from lowering `g` before.
fn lower_reusing(
    g: &Graph,
    schedule: &[qatc_ir::NodeId],
    rows: Option<usize>,
    target: &Target,
    memo: &mut NodeMemo,
) -> Result<Program, DriverError> {
    let options = LowerOptions { ce_chunk_rows: rows, order: Some(schedule.to_vec()), ..target.lower_options() };
    Ok(qatc_kernels::lower_with_memo(g, &options, memo)?)
}

/// `g` lowered in `schedule`'s order for `target` with the rows per chunk of its chunked
/// cross-entropy chosen (see the module doc; None when the step has none), before the target's
/// rewrites; and the chosen program laid out as the target's executor lays it out.
pub(crate) fn choose(
    g: &Graph,
    schedule: &[qatc_ir::NodeId],
    target: &Target,
    options: &Options,
) -> Result<(Program, Option<ChunkChoice>, LaidOut), DriverError> {
    // the sizes lower the same graph: each kind of node is lowered once for all of them
    let mut memo = NodeMemo::default();
    let first = lower_reusing(g, schedule, None, target, &mut memo)?;
    let first_laid = lay_out(&first, target, options)?;
    let Some(c) = first.cross_entropy.first().cloned() else { return Ok((first, None, first_laid)) };
    let (floor, n) = (c.chunk_rows, c.rows);
    let base = first_laid.plan.peak_bytes();
    // a rise this small is the per-row statistics' few KiB, not a larger scratch
    let keeps = |p: usize| p <= base + base / 1000;
    let mut scratch_of = std::collections::HashMap::from([(floor, c.scratch_bytes())]);
    let mut tried = vec![(floor, base)];
    // the sizes to choose from: the floor doubled, up to every row in one chunk
    let mut ladder = vec![floor];
    while ladder[ladder.len() - 1] < n {
        ladder.push((ladder[ladder.len() - 1] * 2).min(n));
    }
    // The peak grows with the rows (only the scratch does), so the largest size that keeps it is
    // found by bisection on the ladder, the top first: where the peak lies elsewhere (and where
    // the lowering walks the vocabulary in tiles, whose scratch does not grow) every row in one
    // chunk keeps it, and two lowerings decide instead of one per doubling.
    let (mut lo, mut hi) = (0, ladder.len());
    let (mut chosen, mut rows, mut refused) = ((first, first_laid), floor, None);
    let mut next = ladder.len() - 1;
    while lo + 1 < hi {
        let r = ladder[next];
        let prog = lower_reusing(g, schedule, Some(r), target, &mut memo)?;
        // the lowering caps the chunk count: a size it does not take is not a choice (only the
        // smallest sizes are capped, so the search goes on above it)
        if prog.cross_entropy.first().map(|x| x.chunk_rows) != Some(r) {
            lo = next;
        } else {
            let laid = lay_out(&prog, target, options)?;
            let p = laid.plan.peak_bytes();
            tried.push((r, p));
            scratch_of.extend(prog.cross_entropy.first().map(|x| (r, x.scratch_bytes())));
            if keeps(p) {
                (lo, rows, chosen) = (next, r, (prog, laid));
            } else {
                (hi, refused) = (next, Some((r, p)));
            }
        }
        next = (lo + hi) / 2;
    }
    tried.sort_unstable();
    let scratch = |r: usize| human(scratch_of.get(&r).copied().unwrap_or(c.elem_bytes * r * c.vocab));
    let why = match (rows == floor, refused) {
        (true, Some((r, p))) => format!(
            "{rows} rows per chunk, the floor (the fusion rule's, for GEMM efficiency): the cross-entropy is at the peak, {r} rows ({} scratch) would raise it to {}",
            scratch(r),
            human(p)
        ),
        (true, None) => format!("{rows} rows per chunk: every row in one chunk"),
        (false, Some((r, p))) => format!(
            "{rows} rows per chunk ({} scratch), up from the floor of {floor}: the largest that keeps the peak at {} ({r} rows would raise it to {})",
            scratch(rows),
            human(base),
            human(p)
        ),
        (false, None) => format!(
            "{rows} rows per chunk ({} scratch), up from the floor of {floor}: every row in one chunk keeps the peak at {}",
            scratch(rows),
            human(base)
        ),
    };
    let (program, laid) = chosen;
    Ok((program, Some(ChunkChoice { rows, floor, total_rows: n, tried, why }), laid))
}
