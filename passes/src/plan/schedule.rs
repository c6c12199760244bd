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

/// The memory-aware order: every non-input node once, operands first.
pub(crate) fn greedy(d: &Dense, align: usize, priority: Priority) -> Result<Vec<usize>, PlanError> {
    let n = d.len();
    let lazy = d.lazy();
    // when each node ran (inputs and lazy nodes: never, for the `Recent` rank)
    let ran_at: Vec<i64> = vec![-1; n];
    let group = static_groups(d);
    let persistent: Vec<bool> = (0..n).map(|i| d.is_input(group[i])).collect();

    // deps[i]: the non-lazy nodes (and lazy `after` readers) that must run before i; a lazy
    // operand contributes its own such dependencies, since it is pulled in with i.
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
    let pending: Vec<usize> = frontier.iter().map(Vec::len).collect();
    let mut rev: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, f) in frontier.iter().enumerate() {
        for &m in f {
            rev[m].push(i);
        }
    }
    // the lazy nodes each node pulls in, in topological order
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
    // remaining distinct readers of each storage group; groups read after the step never free
    let mut readers: Vec<usize> = vec![0; n];
    let mut keep = vec![false; n];
    for i in 0..n {
        if d.output[i] || d.copy_back[i] || persistent[i] {
            keep[group[i]] = true;
        }
        let mut gs: Vec<usize> = d.operands[i].iter().map(|&o| group[o]).collect();
        gs.sort_unstable();
        gs.dedup();
        for g in gs {
            readers[g] += 1;
        }
    }
    let size = |i: usize| if d.view[i] || d.write_back[i].is_some() { 0 } else { qatc_arena::aligned(d.bytes[i], align) as i64 };
    // the distinct readers of each storage group, and the nodes that pull each lazy node: when
    // a group is down to its last reader, or a pulled node has run, those readers' keys change
    let mut group_readers: Vec<Vec<usize>> = vec![Vec::new(); n];
    for i in 0..n {
        let mut gs: Vec<usize> = d.operands[i].iter().map(|&o| group[o]).collect();
        gs.sort_unstable();
        gs.dedup();
        for g in gs {
            group_readers[g].push(i);
        }
    }
    let mut pulled_by: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, p) in pulls.iter().enumerate() {
        for &q in p {
            pulled_by[q].push(i);
        }
    }
    let mut st = State { done: vec![false; n], readers, ran_at, pending, order: Vec::with_capacity(n), touched: Vec::new() };
    let total = (0..n).filter(|&i| !d.is_input(i)).count();

    // The ready nodes wait in a max-heap by key. A key only grows while its node waits (its
    // operands' groups lose readers, its lazy pulls are run by others; `recent` is fixed once
    // it is ready), and every growth pushes a fresh entry, so an entry whose key is no longer
    // current is stale and skipped. Each pick costs a logarithm instead of a scan of every
    // ready node (with K micro-batches, K of them are ready from the start).
    let key = |i: usize, st: &State| -> (i64, i64) {
        let mut alloc = size(i);
        for &q in &pulls[i] {
            if !st.done[q] {
                alloc += size(q);
            }
        }
        let mut freed = 0i64;
        let mut seen: Vec<usize> = Vec::new();
        for &o in &d.operands[i] {
            let g = group[o];
            if g == group[i] || keep[g] || seen.contains(&g) {
                continue;
            }
            seen.push(g);
            if st.readers[g] == 1 {
                freed += qatc_arena::aligned(d.bytes[g], align) as i64;
            }
        }
        let recent = match priority {
            Priority::NetBytes => 0,
            Priority::Recent => d.operands[i].iter().map(|&o| st.ran_at[o]).max().unwrap_or(-1),
        };
        (recent, freed - alloc)
    };
    let mut heap: BinaryHeap<(i64, i64, Reverse<usize>)> = BinaryHeap::new();
    st.touched = (0..n).filter(|&i| !d.is_input(i) && !lazy[i] && st.pending[i] == 0).collect();
    let run = |i: usize, st: &mut State| {
        st.done[i] = true;
        if !lazy[i] {
            st.ran_at[i] = st.order.len() as i64;
        }
        st.order.push(i);
        let mut gs: Vec<usize> = d.operands[i].iter().map(|&o| group[o]).collect();
        gs.sort_unstable();
        gs.dedup();
        for g in gs {
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
