//! A memory-aware topological order of the step (list scheduling).
//!
//! Among the nodes whose operands are all computed, the scheduler runs the one that frees the
//! most bytes net of what it allocates (ties: the earlier node in the graph's structural order).
//! That single rule orders the backward of a training step well: a weight-gradient matmul that
//! is the last reader of a saved activation runs as soon as it can, and so does the optimizer
//! update that consumes the gradient, so neither activations nor gradients wait for the end.
//!
//! Lazy nodes (`Dense::lazy`: constants, values computed from weights alone, and recomputed
//! values) are never candidates of their own: they run just before the first node that needs
//! them. Without that, a greedy scheduler would dequantize every layer's weights at the start
//! (each allocation is smaller than the next activation), and a recomputed activation would be
//! made during the forward, which is exactly what recomputation is there to avoid.
//!
//! A write-back (an update output stored over its input) also waits for every other reader of
//! that input (`Dense::after`).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::region::Dense;
use super::PlanError;

/// Storage groups known before scheduling: a reshape shares its operand's bytes, and a
/// write-back shares its input's. `group[i]` is the representative of i's group.
pub(crate) fn static_groups(d: &Dense) -> Vec<usize> {
    let n = d.len();
    let mut group: Vec<usize> = (0..n).collect();
    for i in 0..n {
        if d.view[i] {
            if let Some(&o) = d.operands[i].first() {
                group[i] = group[o];
            }
        }
        if let Some(x) = d.write_back[i] {
            group[i] = group[x];
        }
    }
    group
}

/// How the scheduler ranks the ready nodes, before the net bytes they free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Priority {
    /// Net bytes freed alone.
    NetBytes,
    /// Continue from the most recently computed value first (depth first): with gradient
    /// accumulation, independent micro-batches are then run one after the other, forward and
    /// backward, instead of their forwards being interleaved (each forward op allocates little,
    /// so net bytes alone would start the next micro-batch long before this one's backward).
    Recent,
}

/// What the scheduler knows of the step before it picks anything: each node's dependencies and
/// the lazy nodes it pulls in, and each storage group's readers.
struct Deps {
    /// The non-lazy nodes (and lazy `after` readers) that must run before each node; a lazy
    /// operand contributes its own such dependencies, since it is pulled in with the node.
    frontier: Vec<Vec<usize>>,
    /// The nodes each node is in the frontier of.
    rev: Vec<Vec<usize>>,
    /// The lazy nodes each node pulls in, in topological order.
    pulls: Vec<Vec<usize>>,
    /// The nodes that pull each lazy node.
    pulled_by: Vec<Vec<usize>>,
    /// The distinct readers of each storage group.
    group_readers: Vec<Vec<usize>>,
    /// The groups read after the step (outputs, copy-backs, persistent inputs): never freed.
    keep: Vec<bool>,
}

impl Deps {
    fn of(d: &Dense, lazy: &[bool], group: &[usize]) -> Deps {
        let n = d.len();
        let frontier = frontiers(d, lazy);
        let pulls = lazy_pulls(d, lazy);
        let mut keep = vec![false; n];
        let mut group_readers: Vec<Vec<usize>> = vec![Vec::new(); n];
        for i in 0..n {
            if d.output[i] || d.copy_back[i] || d.is_input(group[i]) {
                keep[group[i]] = true;
            }
            for g in operand_groups(d, group, i) {
                group_readers[g].push(i);
            }
        }
        Deps { rev: inverse(&frontier), pulled_by: inverse(&pulls), frontier, pulls, group_readers, keep }
    }
}

/// Each node's frontier (see [`Deps::frontier`]).
fn frontiers(d: &Dense, lazy: &[bool]) -> Vec<Vec<usize>> {
    let n = d.len();
    let mut frontier: Vec<Vec<usize>> = vec![Vec::new(); n];
    for i in 0..n {
        if d.is_input(i) {
            continue;
        }
        let mut f = Vec::new();
        for &o in &d.operands[i] {
            if d.is_input(o) {
                continue;
            }
            if lazy[o] {
                f.extend(frontier[o].iter().copied());
            } else {
                f.push(o);
            }
        }
        f.extend(d.after[i].iter().copied());
        f.sort_unstable();
        f.dedup();
        frontier[i] = f;
    }
    frontier
}

/// The lazy nodes each node pulls in (see [`Deps::pulls`]).
fn lazy_pulls(d: &Dense, lazy: &[bool]) -> Vec<Vec<usize>> {
    let n = d.len();
    let mut pulls: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut stamp = vec![usize::MAX; n];
    for i in 0..n {
        if d.is_input(i) {
            continue;
        }
        let mut p: Vec<usize> = Vec::new();
        for &o in &d.operands[i] {
            if lazy[o] {
                for &q in pulls[o].iter().chain(std::iter::once(&o)) {
                    if stamp[q] != i {
                        stamp[q] = i;
                        p.push(q);
                    }
                }
            }
        }
        p.sort_unstable();
        pulls[i] = p;
    }
    pulls
}

/// For each node, the nodes whose list in `lists` holds it, in node order.
fn inverse(lists: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let mut inv: Vec<Vec<usize>> = vec![Vec::new(); lists.len()];
    for (i, l) in lists.iter().enumerate() {
        for &m in l {
            inv[m].push(i);
        }
    }
    inv
}

/// The distinct storage groups node `i` reads, in ascending order.
fn operand_groups(d: &Dense, group: &[usize], i: usize) -> Vec<usize> {
    let mut gs: Vec<usize> = d.operands[i].iter().map(|&o| group[o]).collect();
    gs.sort_unstable();
    gs.dedup();
    gs
}

/// How the scheduler ranks a ready node. The ready nodes wait in a max-heap by key. A key only
/// grows while its node waits (its operands' groups lose readers, its lazy pulls are run by
/// others; `recent` is fixed once it is ready), and every growth pushes a fresh entry, so an
/// entry whose key is no longer current is stale and skipped. Each pick costs a logarithm
/// instead of a scan of every ready node (with K micro-batches, K of them are ready from the
/// start).
struct Rank<'a> {
    d: &'a Dense,
    pulls: &'a [Vec<usize>],
    keep: &'a [bool],
    group: &'a [usize],
    align: usize,
    priority: Priority,
}

impl Rank<'_> {
    /// The bytes node `i` allocates: none for a view or a write-back.
    fn size(&self, i: usize) -> i64 {
        let d = self.d;
        if d.view[i] || d.write_back[i].is_some() {
            0
        } else {
            qatc_arena::aligned(d.bytes[i], self.align) as i64
        }
    }

    /// (how recently its operands ran, under `Recent`; the bytes running it frees net of what
    /// it and the lazy nodes it pulls in allocate).
    fn key(&self, i: usize, st: &State) -> (i64, i64) {
        let (d, group) = (self.d, self.group);
        let mut alloc = self.size(i);
        for &q in &self.pulls[i] {
            if !st.done[q] {
                alloc += self.size(q);
            }
        }
        let mut freed = 0i64;
        let mut seen: Vec<usize> = Vec::new();
        for &o in &d.operands[i] {
            let g = group[o];
            if g == group[i] || self.keep[g] || seen.contains(&g) {
                continue;
            }
            seen.push(g);
            if st.readers[g] == 1 {
                freed += qatc_arena::aligned(d.bytes[g], self.align) as i64;
            }
        }
        let recent = match self.priority {
            Priority::NetBytes => 0,
            Priority::Recent => d.operands[i].iter().map(|&o| st.ran_at[o]).max().unwrap_or(-1),
        };
        (recent, freed - alloc)
    }
}

/// The memory-aware order: every non-input node once, operands first.
pub(crate) fn greedy(d: &Dense, align: usize, priority: Priority) -> Result<Vec<usize>, PlanError> {
    let n = d.len();
    let lazy = d.lazy();
    let group = static_groups(d);
    let deps = Deps::of(d, &lazy, &group);
    let Deps { frontier, rev, pulls, pulled_by, group_readers, keep } = &deps;
    // remaining distinct readers of each storage group; when a group is down to its last reader,
    // or a pulled node has run, those readers' keys change
    let readers: Vec<usize> = group_readers.iter().map(Vec::len).collect();
    // when each node ran (inputs and lazy nodes: never, for the `Recent` rank)
    let ran_at: Vec<i64> = vec![-1; n];
    let pending: Vec<usize> = frontier.iter().map(Vec::len).collect();
    let mut st = State { done: vec![false; n], readers, ran_at, pending, order: Vec::with_capacity(n), touched: Vec::new() };
    let total = (0..n).filter(|&i| !d.is_input(i)).count();
    let rank = Rank { d, pulls, keep, group: &group, align, priority };
    let key = |i: usize, st: &State| rank.key(i, st);
    let mut heap: BinaryHeap<(i64, i64, Reverse<usize>)> = BinaryHeap::new();
    st.touched = (0..n).filter(|&i| !d.is_input(i) && !lazy[i] && st.pending[i] == 0).collect();
    let run = |i: usize, st: &mut State| {
        st.done[i] = true;
        if !lazy[i] {
            st.ran_at[i] = st.order.len() as i64;
        }
        st.order.push(i);
        for g in operand_groups(d, &group, i) {
            st.readers[g] -= 1;
            if st.readers[g] == 1 {
                st.touched.extend(group_readers[g].iter().copied());
            }
        }
        if lazy[i] {
            st.touched.extend(pulled_by[i].iter().copied());
        }
        for &e in &rev[i] {
            st.pending[e] -= 1;
            st.touched.push(e);
        }
    };
    // a fresh heap entry for every ready node whose key may have changed
    let refresh = |st: &mut State, heap: &mut BinaryHeap<(i64, i64, Reverse<usize>)>| {
        let touched = std::mem::take(&mut st.touched);
        for &i in &touched {
            if !st.done[i] && !lazy[i] && !d.is_input(i) && st.pending[i] == 0 {
                let (r, net) = key(i, st);
                heap.push((r, net, Reverse(i)));
            }
        }
        st.touched = touched;
        st.touched.clear();
    };
    refresh(&mut st, &mut heap);

    while st.order.len() < total {
        let mut pick = None;
        while let Some((r, net, Reverse(i))) = heap.pop() {
            if !st.done[i] && key(i, &st) == (r, net) {
                pick = Some(i);
                break;
            }
        }
        let i = match pick {
            Some(i) => i,
            None => {
                // only lazy nodes nobody pulled are left (outputs computed from weights alone, or
                // a reader a write-back waits for): run the earliest whose dependencies are met
                let next = (0..n).find(|&i| !st.done[i] && !d.is_input(i) && lazy[i] && frontier[i].iter().all(|&m| st.done[m]));
                next.ok_or_else(|| PlanError::Internal("the schedule is stuck: a write-back waits for a reader that depends on it".into()))?
            }
        };
        for &q in &pulls[i] {
            if !st.done[q] {
                run(q, &mut st);
            }
        }
        run(i, &mut st);
        refresh(&mut st, &mut heap);
    }
    Ok(st.order)
}

/// The scheduler's running state.
struct State {
    done: Vec<bool>,
    /// Remaining distinct readers of each storage group.
    readers: Vec<usize>,
    /// When each node ran (inputs and lazy nodes: never, for the `Recent` rank).
    ran_at: Vec<i64>,
    /// Dependencies not yet run.
    pending: Vec<usize>,
    order: Vec<usize>,
    /// Nodes whose key may have changed since the last refresh.
    touched: Vec<usize>,
}

/// Checks that `order` is a valid schedule: every non-input node once, operands first, and
/// every write-back after the other readers of its input.
pub(crate) fn check(d: &Dense, order: &[usize]) -> Result<(), PlanError> {
    let n = d.len();
    let mut pos = vec![usize::MAX; n];
    for (s, &i) in order.iter().enumerate() {
        if d.is_input(i) || pos[i] != usize::MAX {
            return Err(PlanError::Internal(format!("{} is scheduled twice or is an input", d.name(i))));
        }
        pos[i] = s;
    }
    for i in 0..n {
        if d.is_input(i) {
            continue;
        }
        if pos[i] == usize::MAX {
            return Err(PlanError::Internal(format!("{} is not scheduled", d.name(i))));
        }
        for &o in d.operands[i].iter().chain(&d.after[i]) {
            if !d.is_input(o) && pos[o] >= pos[i] {
                return Err(PlanError::Internal(format!("{} runs before {}", d.name(i), d.name(o))));
            }
        }
    }
    Ok(())
}
