//! Offset assignment: every arena buffer gets a byte offset in one allocation such that buffers
//! live at the same time never share a byte.
//!
//! Greedy by size with best fit (Pisarchyk & Lee 2020, TFLite's GPU delegate): buffers are
//! placed largest first; each goes into the smallest gap, among the buffers already placed whose
//! lifetimes overlap it, that holds it (the lowest such gap on ties), or above all of them.
//! Placing the large, long-lived buffers first leaves the small ones to fill the holes between
//! them. A second order (by size x lifetime, "area") is also tried and the smaller arena kept:
//! neither dominates on every graph, and both are cheap. Exact placement is NP-hard; the gap to
//! the lower bound (`Liveness::lower_bound`) is reported with every plan.

/// A buffer to place: inclusive lifetime in steps and size in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Interval {
    pub first: usize,
    pub last: usize,
    pub size: usize,
}

fn overlaps(a: &Interval, b: &Interval) -> bool {
    a.first <= b.last && b.first <= a.last
}

/// Steps per bucket of the time index.
const BUCKET: usize = 64;

/// Places `bufs` in the given order; returns offsets (in the input's indexing) and the arena size.
/// The buffers already placed are indexed by time buckets, so finding those that overlap a new
/// one looks at the buffers live around its lifetime, not at all of them.
fn place(bufs: &[Interval], order: &[usize]) -> (Vec<usize>, usize) {
    let steps = bufs.iter().map(|b| b.last + 1).max().unwrap_or(0);
    let mut index: Vec<Vec<usize>> = vec![Vec::new(); steps / BUCKET + 1];
    let mut stamp = vec![usize::MAX; bufs.len()];
    let mut offset = vec![0usize; bufs.len()];
    let mut top = 0usize;
    let mut ranges: Vec<(usize, usize)> = Vec::new();
    for (k, &b) in order.iter().enumerate() {
        let me = &bufs[b];
        if me.size == 0 {
            continue;
        }
        ranges.clear();
        for bucket in &index[me.first / BUCKET..=me.last / BUCKET] {
            for &p in bucket {
                if stamp[p] != k && overlaps(&bufs[p], me) {
                    stamp[p] = k;
                    ranges.push((offset[p], offset[p] + bufs[p].size));
                }
            }
        }
        ranges.sort_unstable();
        // best fit: the smallest gap between overlapping buffers that holds `me`
        let mut best: Option<(usize, usize)> = None; // (gap size, offset)
        let mut cursor = 0usize;
        for &(lo, hi) in &ranges {
            if lo > cursor {
                let gap = lo - cursor;
                if gap >= me.size && best.is_none_or(|(g, _)| gap < g) {
                    best = Some((gap, cursor));
                }
            }
            cursor = cursor.max(hi);
        }
        let at = best.map(|(_, o)| o).unwrap_or(cursor);
        offset[b] = at;
        top = top.max(at + me.size);
        for bucket in &mut index[me.first / BUCKET..=me.last / BUCKET] {
            bucket.push(b);
        }
    }
    (offset, top)
}

/// Assigns offsets to `bufs`; returns them and the arena size (the planned peak).
pub fn assign(bufs: &[Interval]) -> (Vec<usize>, usize) {
    let mut by_size: Vec<usize> = (0..bufs.len()).collect();
    by_size.sort_by_key(|&i| (std::cmp::Reverse(bufs[i].size), std::cmp::Reverse(bufs[i].last - bufs[i].first), bufs[i].first, i));
    let a = place(bufs, &by_size);
    if a.1 <= max_live(bufs) {
        return a; // already optimal
    }
    let mut by_area: Vec<usize> = (0..bufs.len()).collect();
    by_area.sort_by_key(|&i| (std::cmp::Reverse(bufs[i].size as u128 * (bufs[i].last - bufs[i].first + 1) as u128), bufs[i].first, i));
    let b = place(bufs, &by_area);
    if b.1 < a.1 {
        b
    } else {
        a
    }
}

/// The most bytes live at one step (the lower bound on any assignment's size).
pub fn max_live(bufs: &[Interval]) -> usize {
    let steps = bufs.iter().map(|b| b.last + 1).max().unwrap_or(0);
    let mut diff = vec![0i64; steps + 1];
    for b in bufs {
        diff[b.first] += b.size as i64;
        diff[b.last + 1] -= b.size as i64;
    }
    let (mut acc, mut best) = (0i64, 0i64);
    for v in diff {
        acc += v;
        best = best.max(acc);
    }
    best as usize
}

/// Checks that no two buffers with overlapping lifetimes share a byte (a sweep over steps with
/// the live buffers ordered by offset: a new buffer only needs checking against its neighbours).
pub fn check(bufs: &[Interval], offsets: &[usize]) -> Result<(), String> {
    use std::collections::BTreeMap;
    let mut starts: Vec<usize> = (0..bufs.len()).filter(|&i| bufs[i].size > 0).collect();
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
        let (lo, hi) = (offsets[i], offsets[i] + bufs[i].size);
        if let Some((&(po, pid), &pend)) = live.range(..(lo, usize::MAX)).next_back() {
            if pend > lo {
                return Err(format!("buffers {pid} [{po}, {pend}) and {i} [{lo}, {hi}) overlap in time and bytes"));
            }
        }
        if let Some((&(no, nid), _)) = live.range((lo, 0)..).next() {
            if no < hi {
                return Err(format!("buffers {i} [{lo}, {hi}) and {nid} [{no}, ..) overlap in time and bytes"));
            }
        }
        live.insert((lo, i), hi);
    }
    Ok(())
}
