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
    let mut ran_at: Vec<i64> = vec![-1; n];
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
    let mut pending: Vec<usize> = frontier.iter().map(Vec::len).collect();
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

    let mut done = vec![false; n];
    let mut order = Vec::with_capacity(n);
    let mut ready: Vec<usize> = (0..n).filter(|&i| !d.is_input(i) && !lazy[i] && pending[i] == 0).collect();
    let total = (0..n).filter(|&i| !d.is_input(i)).count();

    let mut run = |i: usize,
                   done: &mut Vec<bool>,
                   order: &mut Vec<usize>,
                   ready: &mut Vec<usize>,
                   readers: &mut Vec<usize>,
                   ran_at: &mut Vec<i64>| {
        done[i] = true;
        if !lazy[i] {
            ran_at[i] = order.len() as i64;
        }
        order.push(i);
        let mut gs: Vec<usize> = d.operands[i].iter().map(|&o| group[o]).collect();
        gs.sort_unstable();
        gs.dedup();
        for g in gs {
            readers[g] -= 1;
        }
        for &e in &rev[i] {
            pending[e] -= 1;
            if pending[e] == 0 && !lazy[e] && !done[e] {
                ready.push(e);
            }
        }
    };

    while order.len() < total {
        if ready.is_empty() {
            // only lazy nodes nobody pulled are left (outputs computed from weights alone, or a
            // reader a write-back waits for): run the earliest whose dependencies are met
            let next = (0..n).find(|&i| !done[i] && !d.is_input(i) && lazy[i] && frontier[i].iter().all(|&m| done[m]));
            let Some(i) = next else {
                return Err(PlanError::Internal("the schedule is stuck: a write-back waits for a reader that depends on it".into()));
            };
            for &q in &pulls[i] {
                if !done[q] {
                    run(q, &mut done, &mut order, &mut ready, &mut readers, &mut ran_at);
                }
            }
            run(i, &mut done, &mut order, &mut ready, &mut readers, &mut ran_at);
            continue;
        }
        // pick the best-scoring ready node
        let mut best = (i64::MIN, i64::MIN, usize::MAX, 0usize);
        for (k, &i) in ready.iter().enumerate() {
            let mut alloc = size(i);
            for &q in &pulls[i] {
                if !done[q] {
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
                if readers[g] == 1 {
                    freed += qatc_arena::aligned(d.bytes[g], align) as i64;
                }
            }
            let recent = match priority {
                Priority::NetBytes => 0,
                Priority::Recent => d.operands[i].iter().map(|&o| ran_at[o]).max().unwrap_or(-1),
            };
            let key = (recent, freed - alloc);
            if key > (best.0, best.1) || (key == (best.0, best.1) && i < best.2) {
                best = (key.0, key.1, i, k);
            }
        }
        let i = ready.swap_remove(best.3);
        for &q in &pulls[i] {
            if !done[q] {
                run(q, &mut done, &mut order, &mut ready, &mut readers, &mut ran_at);
            }
        }
        run(i, &mut done, &mut order, &mut ready, &mut readers, &mut ran_at);
    }
    Ok(order)
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
