//! The one arena placer of qatc: every buffer that lives for an interval of steps gets a byte
//! offset in one allocation such that buffers live at the same time never share a byte. The
//! memory plan (`qatc_passes::plan`, `qatc plan`) and the executors (`qatc_runtime::exec`, which
//! lays out the CPU's and the GPU's memory) all place through [`place`].
//!
//! Greedy by size with best fit (Pisarchyk & Lee 2020, TFLite's GPU delegate): buffers are
//! placed largest first; each goes into the smallest gap, among the buffers already placed whose
//! lifetimes overlap it, that holds it (the lowest such gap on ties), or above all of them.
//! Placing the large, long-lived buffers first leaves the small ones to fill the holes between
//! them. A second order (by size x lifetime, "area") is also tried and the smaller arena kept:
//! neither dominates on every program, and both are cheap. Exact placement is NP-hard; the most
//! bytes live at one step ([`max_live`]) bounds every placement from below, and the gap to it is
//! reported with every plan.
//!
//! Sizes are rounded up to the alignment given (the device's: 64 bytes on the CPU, 256 on CUDA),
//! so every offset is a multiple of it and a buffer keeps the padding an allocation of its own
//! would have (a vector access past its last element stays inside its bytes).

use std::collections::BTreeMap;

use thiserror::Error;

/// A buffer to place: its inclusive lifetime in steps and its size in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Interval {
    pub first: usize,
    pub last: usize,
    pub size: usize,
}

impl Interval {
    /// Whether both are live at some step.
    pub fn overlaps(&self, o: &Interval) -> bool {
        self.first <= o.last && o.first <= self.last
    }
}

/// Where the buffers went: one offset per interval (in the input's order) and the arena's size.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    pub offsets: Vec<usize>,
    pub size: usize,
}

/// Two buffers live at the same step that share bytes (what [`check`] finds).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("buffers {a} [{a_at}, {a_end}) and {b} [{b_at}, {b_end}) overlap in time and bytes")]
pub struct Overlap {
    pub a: usize,
    pub a_at: usize,
    pub a_end: usize,
    pub b: usize,
    pub b_at: usize,
    pub b_end: usize,
}

/// `bytes` rounded up to a multiple of `align` (0 and 1: unchanged).
pub fn aligned(bytes: usize, align: usize) -> usize {
    if align <= 1 {
        bytes
    } else {
        bytes.next_multiple_of(align)
    }
}

/// A placed buffer, as the placer scans them: its bytes `[lo, hi)` and its lifetime.
#[derive(Clone, Copy)]
struct Placed {
    lo: usize,
    hi: usize,
    first: usize,
    last: usize,
}

/// Places `bufs` (sizes already aligned) in the given order. The buffers already placed are kept
/// sorted by offset, so those that overlap a new one in time come out of one pass over them in
/// the order the best-fit scan needs: no per-buffer sort, and a buffer that lives long is seen
/// once (an index by time buckets saw it once per bucket and sorted the result, a quarter of a
/// `--fit` search on GPT-2 1.5B). Buffers with the same offset may come in any order: the scan
/// takes a gap only below the first of them and then the highest end, so the placement is the
/// same as with any tie order.
fn place_in_order(bufs: &[Interval], order: &[usize]) -> Placement {
    let mut offsets = vec![0usize; bufs.len()];
    let mut top = 0usize;
    let mut placed: Vec<Placed> = Vec::with_capacity(bufs.len());
    for &b in order {
        let me = &bufs[b];
        if me.size == 0 {
            continue;
        }
        // best fit: the smallest gap between overlapping buffers that holds `me`; a near-miss
        // gap left by a larger buffer is what the smaller ones fill
        let mut best: Option<(usize, usize)> = None; // (gap size, offset)
        let mut cursor = 0usize;
        for p in &placed {
            if p.first <= me.last && me.first <= p.last {
                if p.lo > cursor {
                    let gap = p.lo - cursor;
                    if gap >= me.size && best.is_none_or(|(g, _)| gap < g) {
                        best = Some((gap, cursor));
                    }
                }
                cursor = cursor.max(p.hi);
            }
        }
        let at = best.map_or(cursor, |(_, o)| o);
        offsets[b] = at;
        top = top.max(at + me.size);
        let entry = Placed { lo: at, hi: at + me.size, first: me.first, last: me.last };
        let i = placed.partition_point(|p| (p.lo, p.hi) <= (entry.lo, entry.hi));
        placed.insert(i, entry);
    }
    Placement { offsets, size: top }
}

/// Assigns every buffer an offset (a multiple of `align`) such that buffers live at the same
/// step never share a byte; the arena's size is the highest byte any buffer reaches. Empty
/// buffers go at 0. Deterministic: the same intervals always give the same placement.
pub fn place(bufs: &[Interval], align: usize) -> Placement {
    let bufs: Vec<Interval> = bufs.iter().map(|b| Interval { size: aligned(b.size, align), ..*b }).collect();
    let mut by_size: Vec<usize> = (0..bufs.len()).collect();
    by_size.sort_by_key(|&i| (std::cmp::Reverse(bufs[i].size), std::cmp::Reverse(bufs[i].last - bufs[i].first), bufs[i].first, i));
    let a = place_in_order(&bufs, &by_size);
    if a.size <= max_live(&bufs, 1) {
        return a; // already optimal
    }
    let mut by_area: Vec<usize> = (0..bufs.len()).collect();
    by_area.sort_by_key(|&i| (std::cmp::Reverse(bufs[i].size as u128 * (bufs[i].last - bufs[i].first + 1) as u128), bufs[i].first, i));
    let b = place_in_order(&bufs, &by_area);
    if b.size < a.size {
        b
    } else {
        a
    }
}

/// The bytes live at each step (sizes rounded up to `align`), from step 0 to the last step any
/// buffer lives.
pub fn live_profile(bufs: &[Interval], align: usize) -> Vec<usize> {
    let steps = bufs.iter().map(|b| b.last + 1).max().unwrap_or(0);
    let mut diff = vec![0i128; steps + 1];
    for b in bufs {
        let n = aligned(b.size, align) as i128;
        diff[b.first] += n;
        diff[b.last + 1] -= n;
    }
    let mut acc = 0i128;
    diff[..steps]
        .iter()
        .map(|d| {
            acc += d;
            acc.max(0) as usize
        })
        .collect()
}

/// The most bytes live at one step (sizes rounded up to `align`): no placement's arena can be
/// smaller.
pub fn max_live(bufs: &[Interval], align: usize) -> usize {
    live_profile(bufs, align).into_iter().max().unwrap_or(0)
}

/// Checks a placement: no two buffers live at the same step share a byte (sizes rounded up to
/// `align`). A sweep over steps with the live buffers ordered by offset: a new buffer only needs
/// checking against its neighbours.
pub fn check(bufs: &[Interval], offsets: &[usize], align: usize) -> Result<(), Overlap> {
    let size = |i: usize| aligned(bufs[i].size, align);
    let mut starts: Vec<usize> = (0..bufs.len()).filter(|&i| size(i) > 0).collect();
    starts.sort_by_key(|&i| (bufs[i].first, i));
    let mut ends: Vec<usize> = starts.clone();
    ends.sort_by_key(|&i| (bufs[i].last, i));
    let mut live: BTreeMap<(usize, usize), usize> = BTreeMap::new(); // (offset, id) -> end
    let mut e = 0;
    for &i in &starts {
        let s = bufs[i].first;
        while e < ends.len() && bufs[ends[e]].last < s {
            live.remove(&(offsets[ends[e]], ends[e]));
            e += 1;
        }
        let (lo, hi) = (offsets[i], offsets[i] + size(i));
        if let Some((&(po, pid), &pend)) = live.range(..(lo, usize::MAX)).next_back() {
            if pend > lo {
                return Err(Overlap { a: pid, a_at: po, a_end: pend, b: i, b_at: lo, b_end: hi });
            }
        }
        if let Some((&(no, nid), &nend)) = live.range((lo, 0)..).next() {
            if no < hi {
                return Err(Overlap { a: i, a_at: lo, a_end: hi, b: nid, b_at: no, b_end: nend });
            }
        }
        live.insert((lo, i), hi);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const ALIGN: usize = 64;

    /// Every pair of intervals live at once is apart in memory (checked pair by pair, not by
    /// [`check`], which is under test too); every offset is aligned; the arena holds every
    /// buffer and is no smaller than the most bytes live at once.
    fn brute_force(bufs: &[Interval], p: &Placement, align: usize) -> Result<(), String> {
        for (i, a) in bufs.iter().enumerate() {
            let ea = p.offsets[i] + aligned(a.size, align);
            if !p.offsets[i].is_multiple_of(align) || ea > p.size {
                return Err(format!("buffer {i} at {} ({} bytes) in an arena of {}", p.offsets[i], a.size, p.size));
            }
            for (j, b) in bufs.iter().enumerate().skip(i + 1) {
                let eb = p.offsets[j] + aligned(b.size, align);
                if a.overlaps(b) && a.size > 0 && b.size > 0 && p.offsets[i] < eb && p.offsets[j] < ea {
                    return Err(format!("buffers {i} {a:?} at {} and {j} {b:?} at {} share bytes", p.offsets[i], p.offsets[j]));
                }
            }
        }
        if p.size < max_live(bufs, align) {
            return Err(format!("arena {} below the live peak {}", p.size, max_live(bufs, align)));
        }
        Ok(())
    }

    fn interval() -> impl Strategy<Value = Interval> {
        // mostly short lives among a few long ones, sizes from empty to a few lines
        (0usize..5000, 0usize..200, prop_oneof![4 => 0usize..6, 1 => 0usize..150]).prop_map(|(size, first, len)| Interval {
            first,
            last: first + len,
            size,
        })
    }

    /// Best fit as its definition states it, with nothing indexed or kept sorted: for each
    /// buffer in order, the placed buffers live with it, sorted by offset, and the smallest gap
    /// between them that holds it (the lowest on ties), else above them all.
    fn best_fit_by_definition(bufs: &[Interval], order: &[usize]) -> Placement {
        let mut offsets = vec![0usize; bufs.len()];
        let (mut top, mut done) = (0usize, Vec::new());
        for &b in order {
            let me = bufs[b];
            if me.size == 0 {
                continue;
            }
            let mut ranges: Vec<(usize, usize)> =
                done.iter().filter(|&&p: &&usize| bufs[p].overlaps(&me)).map(|&p| (offsets[p], offsets[p] + bufs[p].size)).collect();
            ranges.sort_unstable();
            let (mut best, mut cursor) = (None::<(usize, usize)>, 0usize);
            for (lo, hi) in ranges {
                if lo >= cursor + me.size && best.is_none_or(|(g, _)| lo - cursor < g) {
                    best = Some((lo - cursor, cursor));
                }
                cursor = cursor.max(hi);
            }
            offsets[b] = best.map_or(cursor, |(_, o)| o);
            top = top.max(offsets[b] + me.size);
            done.push(b);
        }
        Placement { offsets, size: top }
    }

    proptest! {
        /// The placer is best fit as defined, in both of its orders, on programs with many
        /// buffers at one offset (tied offsets are where a scan order could differ).
        #[test]
        fn placer_is_best_fit_by_definition(bufs in proptest::collection::vec(interval(), 0..200), small in any::<bool>()) {
            let bufs: Vec<Interval> = bufs.into_iter().map(|b| Interval { size: if small { b.size % 4 * 64 } else { aligned(b.size, 64) }, ..b }).collect();
            let mut order: Vec<usize> = (0..bufs.len()).collect();
            order.sort_by_key(|&i| (std::cmp::Reverse(bufs[i].size), bufs[i].first, i));
            prop_assert_eq!(place_in_order(&bufs, &order), best_fit_by_definition(&bufs, &order));
            order.reverse();
            prop_assert_eq!(place_in_order(&bufs, &order), best_fit_by_definition(&bufs, &order));
        }

        #[test]
        fn live_buffers_never_share_bytes(bufs in proptest::collection::vec(interval(), 0..150), align in prop_oneof![Just(1usize), Just(64), Just(256)]) {
            let p = place(&bufs, align);
            prop_assert_eq!(p.offsets.len(), bufs.len());
            if let Err(e) = brute_force(&bufs, &p, align) {
                prop_assert!(false, "{}", e);
            }
            prop_assert!(check(&bufs, &p.offsets, align).is_ok());
            let total: usize = bufs.iter().map(|b| aligned(b.size, align)).sum();
            prop_assert!(p.size <= total, "arena {} above the sum of the buffers {}", p.size, total);
            prop_assert_eq!(place(&bufs, align), p, "the same intervals, the same placement");
        }

        /// `check` finds every overlap the pairwise test finds: stacking two live buffers at one
        /// offset is caught.
        #[test]
        fn check_finds_a_forced_overlap(bufs in proptest::collection::vec(interval(), 2..60), pick in any::<(usize, usize)>()) {
            let mut p = place(&bufs, ALIGN);
            let i = pick.0 % bufs.len();
            let js: Vec<usize> = (0..bufs.len()).filter(|&j| j != i && bufs[i].overlaps(&bufs[j]) && bufs[i].size > 0 && bufs[j].size > 0).collect();
            if js.is_empty() {
                return Ok(());
            }
            p.offsets[js[pick.1 % js.len()]] = p.offsets[i];
            prop_assert!(check(&bufs, &p.offsets, ALIGN).is_err());
            prop_assert!(brute_force(&bufs, &p, ALIGN).is_err());
        }
    }

    /// A small deterministic generator (xorshift), so the report below is the same every run.
    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % n as u64) as usize
        }
    }

    /// How close the heuristic gets to the lower bound on step-like lifetimes (most buffers die a
    /// few steps after they are made, a few live long): printed, and held to a loose bound that a
    /// broken placement (everything stacked, or gaps never reused) exceeds.
    #[test]
    fn arena_is_near_the_live_peak() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let (mut worst, mut sum, runs) = (1.0f64, 0.0f64, 200);
        for _ in 0..runs {
            let n = 50 + rng.below(250);
            let bufs: Vec<Interval> = (0..n)
                .map(|_| {
                    let first = rng.below(200);
                    let len = if rng.below(10) == 0 { rng.below(200) } else { rng.below(8) };
                    let scale = 1 << rng.below(12);
                    Interval { first, last: first + len, size: 64 * (1 + rng.below(scale)) }
                })
                .collect();
            let p = place(&bufs, ALIGN);
            brute_force(&bufs, &p, ALIGN).unwrap();
            let ratio = p.size as f64 / max_live(&bufs, ALIGN) as f64;
            worst = worst.max(ratio);
            sum += ratio;
        }
        eprintln!("arena / live peak over {runs} random programs: mean {:.3}, worst {worst:.3}", sum / runs as f64);
        assert!(worst < 1.5, "worst arena {worst:.3}x the live peak");
    }

    /// Buffers that never live at once share bytes; a chain of them takes one buffer's room, and
    /// best fit puts a small buffer into the gap a large one left rather than on top.
    #[test]
    fn disjoint_lifetimes_share_and_small_buffers_fill_gaps() {
        let chain: Vec<Interval> = (0..5).map(|s| Interval { first: s, last: s, size: 100 }).collect();
        let p = place(&chain, 64);
        assert_eq!((p.offsets, p.size), (vec![0; 5], 128));
        let bufs = [
            Interval { first: 0, last: 9, size: 256 }, // the largest: at 0
            Interval { first: 0, last: 1, size: 128 }, // above the two long ones
            Interval { first: 0, last: 9, size: 192 }, // above the first
            Interval { first: 3, last: 4, size: 64 },  // where the 128 was, dead by then
        ];
        let p = place(&bufs, 64);
        assert_eq!(p.offsets, [0, 448, 256, 448]);
        assert_eq!(p.size, 576);
        assert_eq!(max_live(&bufs, 64), 576);
        assert_eq!(live_profile(&bufs, 64), [576, 576, 448, 512, 512, 448, 448, 448, 448, 448]);
    }

    #[test]
    fn alignment_rounds_sizes_and_offsets() {
        let bufs =
            [Interval { first: 0, last: 2, size: 1 }, Interval { first: 1, last: 1, size: 300 }, Interval { first: 2, last: 3, size: 0 }];
        let p = place(&bufs, 256);
        assert!(p.offsets.iter().all(|o| o % 256 == 0), "{p:?}");
        assert_eq!(p.size, 768);
        assert_eq!(place(&bufs, 1).size, 301);
        assert_eq!(aligned(0, 256), 0);
        assert_eq!(aligned(257, 256), 512);
        assert_eq!(aligned(7, 0), 7);
    }
}
