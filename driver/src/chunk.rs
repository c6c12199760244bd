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
//! it; when the cross-entropy is where the peak is, the floor stays. Unless the step was given
//! memory (`--memory`: `Options::room`): then R grows while the plan fits it, past the floor's
//! peak (on AMX the LM head's dh product packs the head weight once per chunk, 20 ms of a
//! 128-row product's 27: 124M at B 4 in one chunk of 1024 rows took 276 ms of head GEMMs a step
//! instead of 385, for 84 MiB more at the peak). Where the lowering walks
//! the vocabulary in tiles (a frozen head on the CPU, `kernels/src/lower/xent_online.rs`) the
//! scratch is one 8 MiB tile whatever R, so R grows to every row: the head weight is then read
//! once per step.
//!
//! Sizes whose peak the floor's plan already bounds above the floor's are not lowered at all
//! ([`peak_bound`]): with whole rows of the vocabulary in the scratch (16-bit logits, a trainable
//! head) a bf16 step's bisection lowered and laid out 3 to 5 sizes, most of them to refuse them.
//! Where the vocabulary is walked in tiles, every row in one chunk is planned first, and where
//! its peak is what the step holds outside the cross-entropy whatever the rows ([`least_peak`],
//! read off any size's plan), no size can keep a lower one: the floor is not planned (an fp32
//! LoRA step's usual case once the batch is large). And a plan asked only whether it fits in
//! some memory (`Options::fit_within`, `qatc plan --fit`) searches no size where no size can
//! bring it within ([`least_peak`]).

use qatc_ir::Graph;
use qatc_kernels::lower::{CE_BUFFER_PREFIX, CE_CHUNK_FIRST_ROW, CE_CHUNK_SCRATCH, CE_TILE_FIRST_COL};
use qatc_kernels::program::CeChunking;
use qatc_kernels::{LowerOptions, NodeMemo, Program, Target};
use qatc_passes::plan::units::human;
use qatc_runtime::exec::{MemoryPlan, Region};
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
    /// Sizes not planned, the floor's plan or a larger size's bounding their peak above the
    /// floor's: (rows per chunk, the least their peak can be; [`peak_bound`]).
    pub ruled_out: Vec<(usize, usize)>,
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
    // Where the vocabulary is walked in tiles (the scratch does not grow with the rows) every row
    // in one chunk is planned first: where its peak is no higher than what any size holds outside
    // the cross-entropy, no size keeps a lower one, and the floor is not planned at all.
    let mut top_planned = None;
    if let Some(p) = qatc_kernels::lower::xent::planned(g, &target.lower_options()).filter(|p| p.online && p.floor < p.rows) {
        let top = lower_reusing(g, schedule, Some(p.rows), target, &mut memo)?;
        if let Some(c) = top.cross_entropy.first().filter(|c| c.chunk_rows == p.rows && c.tile_cols != c.vocab).cloned() {
            let laid = lay_out(&top, target, options)?;
            let peak = laid.plan.peak_bytes();
            let least = least_peak(&laid.plan);
            // asked only whether the step fits, and no size can bring it within: not searched
            let why = if let Some((least, limit)) = least.zip(options.fit_within).filter(|(l, limit)| l > limit) {
                Some(format!(
                    "{} rows per chunk (every row in one chunk; the floor is {}): {}",
                    p.rows,
                    p.floor,
                    not_searched(least, limit)
                ))
            } else {
                least.filter(|&l| peak <= l + l / 1000).map(|least| {
                    format!(
                        "{} rows per chunk (every row in one chunk; the floor is {}): its peak, {}, is what the step holds outside the cross-entropy whatever the rows ({}; 0.1% allowed), so no size keeps a lower one",
                        p.rows,
                        p.floor,
                        human(peak),
                        human(least)
                    )
                })
            };
            if let Some(why) = why {
                let choice = ChunkChoice {
                    rows: p.rows,
                    floor: p.floor,
                    total_rows: c.rows,
                    tried: vec![(p.rows, peak)],
                    ruled_out: Vec::new(),
                    why,
                };
                return Ok((top, Some(choice), laid));
            }
            top_planned = Some((top, laid));
        }
    }
    let first = lower_reusing(g, schedule, None, target, &mut memo)?;
    let first_laid = lay_out(&first, target, options)?;
    let Some(c) = first.cross_entropy.first().cloned() else { return Ok((first, None, first_laid)) };
    let (floor, n) = (c.chunk_rows, c.rows);
    let base = first_laid.plan.peak_bytes();
    // asked only whether the step fits: where no size can bring it within, none is searched
    if let (Some(limit), Some(least)) = (options.fit_within, least_peak(&first_laid.plan)) {
        if least > limit {
            let why = format!("{floor} rows per chunk, the floor: {}", not_searched(least, limit));
            let choice = ChunkChoice { rows: floor, floor, total_rows: n, tried: vec![(floor, base)], ruled_out: Vec::new(), why };
            return Ok((first, Some(choice), first_laid));
        }
    }
    // a rise this small is the per-row statistics' few KiB, not a larger scratch; with room
    // given (`--memory`), any peak within it (fewer, taller GEMMs: the head weight is packed
    // for the GEMM once per chunk, 20 ms of a 128-row dh product's 27 on AMX)
    let holds = |p: usize| p <= base + base / 1000;
    let keeps = |p: usize| holds(p) || options.room.is_some_and(|room| p <= room);
    let mut scratch_of = std::collections::HashMap::from([(floor, c.scratch_bytes())]);
    let mut tried = vec![(floor, base)];
    let ladder = ladder(floor, n);
    // Sizes the floor's plan already rules out are not lowered: the largest first, while their
    // least possible peak is above what keeps the floor's. Where it rules some out, the largest
    // size left is planned first.
    let bound = peak_bound(&first_laid.plan, &c);
    let mut top = ladder.len();
    let mut ruled_out = Vec::new();
    if let Some(bound) = &bound {
        while top > 1 && !keeps(bound(ladder[top - 1])) {
            top -= 1;
            ruled_out.push((ladder[top], bound(ladder[top])));
        }
    }
    ruled_out.reverse();
    // The peak grows with the rows (only the scratch does), so the largest size that keeps it is
    // found by bisection on the ladder, the top first: where the peak lies elsewhere (and where
    // the lowering walks the vocabulary in tiles, whose scratch does not grow) every row in one
    // chunk keeps it, and two lowerings decide instead of one per doubling.
    let (mut lo, mut hi) = (0, top);
    let (mut chosen, mut rows) = ((first, first_laid), floor);
    let mut next = top - 1;
    // refusals in a row from the top
    let mut descending = 0u32;
    while lo + 1 < hi {
        let r = ladder[next];
        // every row in one chunk may have been planned first (above)
        let (prog, laid) = match top_planned.take_if(|(p, _)| p.cross_entropy.first().map(|x| x.chunk_rows) == Some(r)) {
            Some((p, l)) => (p, Some(l)),
            None => (lower_reusing(g, schedule, Some(r), target, &mut memo)?, None),
        };
        // the lowering caps the chunk count: a size it does not take is not a choice (only the
        // smallest sizes are capped, so the search goes on above it)
        if prog.cross_entropy.first().map(|x| x.chunk_rows) != Some(r) {
            lo = next;
        } else {
            let laid = match laid {
                Some(l) => l,
                None => lay_out(&prog, target, options)?,
            };
            let p = laid.plan.peak_bytes();
            tried.push((r, p));
            scratch_of.extend(prog.cross_entropy.first().map(|x| (r, x.scratch_bytes())));
            let refused = !keeps(p);
            if !refused {
                (lo, rows, chosen) = (next, r, (prog, laid));
            } else {
                hi = next;
                // a refused size's plan bounds the sizes under it as the floor's does, and often
                // closer (its layout packs a larger scratch): those it rules out are not planned
                if let Some(b) = peak_bound(&laid.plan, &c) {
                    while hi > lo + 1 && !keeps(b(ladder[hi - 1])) {
                        hi -= 1;
                        ruled_out.push((ladder[hi], b(ladder[hi])));
                    }
                }
            }
            // Below the sizes a bound ruled out, the answer is mostly the largest size left or
            // one or two under it (the bound misses only how the layout packs the scratch):
            // while every size planned is refused, the one under the last is planned next, then
            // twice as far, and so on (a 1.5B bf16 step at B 256: 131072 and 65536 rows refused,
            // 32768 kept, where bisection planned 8192 and 16384 first).
            if refused && rows == floor && lo == 0 && bound.is_some() && lo + 1 < hi {
                next = hi.saturating_sub(1 << descending.saturating_sub(1)).max(lo + 1);
                descending += 1;
                continue;
            }
        }
        next = (lo + hi) / 2;
    }
    // the next size up, planned (refused) or ruled out
    tried.sort_unstable();
    ruled_out.sort_unstable();
    let up_tried = tried.iter().find(|t| t.0 > rows).map(|&(r, p)| (r, p, ""));
    let up_ruled = ruled_out.iter().find(|t| t.0 > rows).map(|&(r, p)| (r, p, "at least "));
    let refused = match (up_tried, up_ruled) {
        (Some(t), Some(u)) => Some(if u.0 < t.0 { u } else { t }),
        (t, u) => t.or(u),
    };
    let scratch = |r: usize| human(scratch_of.get(&r).copied().unwrap_or(c.elem_bytes * r * c.vocab));
    let peak_of = |r: usize| tried.iter().find(|t| t.0 == r).map_or(base, |t| t.1);
    let room = options.room.filter(|_| !holds(peak_of(rows)));
    let why = match (rows == floor, refused, room) {
        (false, Some((r, p, least)), Some(room)) => format!(
            "{rows} rows per chunk ({} scratch), up from the floor of {floor}: the largest whose plan fits the {} --memory leaves (peak {}; {r} rows would need {least}{})",
            scratch(rows),
            human(room),
            human(peak_of(rows)),
            human(p)
        ),
        (false, None, Some(room)) => format!(
            "{rows} rows per chunk ({} scratch), up from the floor of {floor}: every row in one chunk fits the {} --memory leaves (peak {})",
            scratch(rows),
            human(room),
            human(peak_of(rows))
        ),
        (rows_floor, refused, _) => why_kept(rows_floor, refused, rows, floor, base, &scratch),
    };
    let (program, laid) = chosen;
    Ok((program, Some(ChunkChoice { rows, floor, total_rows: n, tried, ruled_out, why }), laid))
}

/// Why `rows` per chunk keep the floor's peak `base`: the floor itself, or the largest size
/// that keeps it; `refused`, the next size up and what it would raise the peak to.
fn why_kept(
    rows_floor: bool,
    refused: Option<(usize, usize, &str)>,
    rows: usize,
    floor: usize,
    base: usize,
    scratch: &dyn Fn(usize) -> String,
) -> String {
    match (rows_floor, refused) {
        (true, Some((r, p, least))) => format!(
            "{rows} rows per chunk, the floor (the fusion rule's, for GEMM efficiency): the cross-entropy is at the peak, {r} rows ({} scratch) would raise it to {least}{}",
            scratch(r),
            human(p)
        ),
        (true, None) => format!("{rows} rows per chunk: every row in one chunk"),
        (false, Some((r, p, least))) => format!(
            "{rows} rows per chunk ({} scratch), up from the floor of {floor}: the largest that keeps the peak at {} ({r} rows would raise it to {least}{})",
            scratch(rows),
            human(base),
            human(p)
        ),
        (false, None) => format!(
            "{rows} rows per chunk ({} scratch), up from the floor of {floor}: every row in one chunk keeps the peak at {}",
            scratch(rows),
            human(base)
        ),
    }
}

/// Why a plan asked only whether it fits (`Options::fit_within`) searched no size: what it holds
/// whatever the rows, `least`, is already more than `limit`.
fn not_searched(least: usize, limit: usize) -> String {
    format!(
        "not searched, the step holds at least {} outside the cross-entropy whatever the rows, more than the {} it was planned against",
        human(least),
        human(limit)
    )
}

/// The sizes to choose from: the floor doubled, up to every row (`n`) in one chunk.
fn ladder(floor: usize, n: usize) -> Vec<usize> {
    let mut ladder = vec![floor.max(1)];
    while ladder[ladder.len() - 1] < n {
        ladder.push((ladder[ladder.len() - 1] * 2).min(n));
    }
    ladder
}

/// One size of [`every_size`]: its rows per chunk, its executed plan's peak, [`peak_bound`]'s
/// bound of that peak from the floor's plan (where it gives one), [`least_peak`] of its own
/// plan, and its own plan's [`peak_bound`] of every size's peak (the ladder's order).
#[derive(Clone, Debug)]
pub struct SizePlan {
    pub rows: usize,
    pub peak: usize,
    pub bound: Option<usize>,
    pub least: Option<usize>,
    pub bounds: Vec<Option<usize>>,
}

/// Every size of `g`'s ladder (the floor doubled up to every row in one chunk) planned for real,
/// the floor first. The reference `tests/chunk_choice.rs` holds the bounds and the choice against.
pub fn every_size(g: &Graph, target: &Target, options: &Options) -> Result<Vec<SizePlan>, DriverError> {
    let schedule = qatc_passes::plan::schedule(g)?;
    let mut memo = NodeMemo::default();
    let first = lower_reusing(g, &schedule, None, target, &mut memo)?;
    let first_laid = lay_out(&first, target, options)?;
    let Some(c) = first.cross_entropy.first().cloned() else { return Ok(Vec::new()) };
    let bound = peak_bound(&first_laid.plan, &c);
    let ladder = ladder(c.chunk_rows, c.rows);
    let size = |rows: usize, plan: &MemoryPlan| SizePlan {
        rows,
        peak: plan.peak_bytes(),
        bound: bound.as_ref().map(|b| b(rows)),
        least: least_peak(plan),
        bounds: match peak_bound(plan, &c) {
            Some(b) => ladder.iter().map(|&r| Some(b(r))).collect(),
            None => vec![None; ladder.len()],
        },
    };
    let mut out = vec![size(c.chunk_rows, &first_laid.plan)];
    for &r in &ladder[1..] {
        let prog = lower_reusing(g, &schedule, Some(r), target, &mut memo)?;
        if prog.cross_entropy.first().map(|x| x.chunk_rows) == Some(r) {
            out.push(size(r, &lay_out(&prog, target, options)?.plan));
        }
    }
    // the ladder's sizes the lowering took: every plan's bounds at those
    let taken: Vec<bool> = ladder.iter().map(|r| out.iter().any(|s| s.rows == *r)).collect();
    for s in &mut out {
        s.bounds = s.bounds.iter().zip(&taken).filter(|(_, &t)| t).map(|(b, _)| *b).collect();
    }
    Ok(out)
}

/// The least peak the step whose plan (at any rows per chunk) is `plan` can have with any rows per
/// chunk: what is live outside the steps of the cross-entropy's chunks (from the first to the last
/// step of the buffers its lowering makes for itself, `CE_BUFFER_PREFIX`, which only those steps
/// touch), less the chunks' first-row and the tiles' first-column buffers (as many as chunks and
/// tiles, computed once before the step), and the inputs. The steps of every other node are the
/// same, in the same order, whatever the rows, and hold the same buffers. None when the plan has
/// no such buffer.
pub fn least_peak(plan: &MemoryPlan) -> Option<usize> {
    let starts = |name: &str| {
        [CE_CHUNK_FIRST_ROW, CE_TILE_FIRST_COL].iter().any(|(prefix, suffix)| name.starts_with(prefix) && name.ends_with(suffix))
    };
    let (from, to) = plan.buffers.iter().filter(|b| b.name.starts_with(CE_BUFFER_PREFIX) && !starts(&b.name)).fold(
        None,
        |span: Option<(usize, usize)>, b| {
            Some(span.map_or((b.first_step, b.last_step), |(f, t)| (f.min(b.first_step), t.max(b.last_step))))
        },
    )?;
    // the start buffers' bytes at each step
    let n = plan.steps.iter().map(|s| s.index + 1).max().unwrap_or(0);
    let mut diff = vec![0i128; n + 1];
    for b in plan.buffers.iter().filter(|b| b.region == Region::Arena && starts(&b.name)) {
        diff[b.first_step.min(n)] += b.size as i128;
        diff[(b.last_step + 1).min(n)] -= b.size as i128;
    }
    let mut at = Vec::with_capacity(n);
    let mut acc = 0i128;
    for d in &diff[..n] {
        acc += d;
        at.push(acc.max(0) as usize);
    }
    let outside = plan
        .steps
        .iter()
        .filter(|s| s.index < from || s.index > to)
        .map(|s| s.live_bytes.saturating_sub(at.get(s.index).copied().unwrap_or(0)))
        .max()
        .unwrap_or(0);
    Some(plan.persistent_bytes + plan.data_bytes + outside)
}

/// The least peak the step whose floor plan is `floor` (its chunking `c`) can have with `rows`
/// per chunk, where the chunk scratch holds whole rows of the vocabulary (None where it walks the
/// vocabulary in tiles, whose columns shrink as the rows grow).
///
/// Only the cross-entropy's lowering depends on its rows per chunk, and in it only the scratch of
/// `rows` x vocabulary logits and each chunk's first-row buffer (`CE_CHUNK_FIRST_ROW`): every
/// other buffer, and the steps before and after the chunks, are the same whatever the rows. So
/// what is live beside the scratch when it is first written and when it is last read, less the
/// scratch and the first-row buffers, is live beside the scratch of `rows` rows too, and the
/// inputs stay: those and the scratch at `rows` are a lower bound of any layout's peak.
/// `tests/chunk_choice.rs` holds it against every size's plan.
pub fn peak_bound(floor: &MemoryPlan, c: &CeChunking) -> Option<impl Fn(usize) -> usize> {
    if c.tile_cols != c.vocab {
        return None;
    }
    let mut scratch = floor.buffers.iter().filter(|b| b.name == CE_CHUNK_SCRATCH);
    let (Some(s), None) = (scratch.next(), scratch.next()) else { return None };
    let first_row = CE_CHUNK_FIRST_ROW;
    let beside_at = |t: usize| -> usize {
        floor
            .buffers
            .iter()
            .filter(|b| b.region == Region::Arena && b.kind != "input" && b.first_step <= t && t <= b.last_step)
            .filter(|b| b.id != s.id && !(b.name.starts_with(first_row.0) && b.name.ends_with(first_row.1)))
            .map(|b| b.size)
            .sum()
    };
    let beside = beside_at(s.first_step).max(beside_at(s.last_step));
    let (fixed, row_bytes) = (floor.persistent_bytes + floor.data_bytes + beside, c.elem_bytes * c.vocab);
    Some(move |rows: usize| fixed + rows * row_bytes)
}
