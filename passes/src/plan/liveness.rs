//! Lifetimes over a schedule: which values share storage (views, write-backs, in-place ops),
//! each storage buffer's first and last step, and the bytes live at every step, whose maximum
//! is the lower bound no offset assignment can beat.

use qatc_arena::aligned;

use super::region::Dense;
use super::schedule::static_groups;

/// One storage buffer: the values it holds over the step, and when it is live.
#[derive(Clone, Debug)]
pub(crate) struct Buf {
    /// Dense ids of the values stored here, in production order.
    pub members: Vec<usize>,
    /// Input whose storage this is (weights, parameters, optimizer state, data).
    pub persistent: Option<usize>,
    pub bytes: usize,
    pub size: usize,
    pub first: usize,
    pub last: usize,
}

pub(crate) struct Liveness {
    /// Step of each dense node (`usize::MAX` for inputs).
    pub pos: Vec<usize>,
    /// Buffer of each dense node.
    pub buf_of: Vec<usize>,
    pub bufs: Vec<Buf>,
    /// Last step that reads each value (the end for values read after the step).
    pub last_use: Vec<usize>,
    /// (value, operand) pairs where the value overwrote its dying operand.
    pub in_place: Vec<(usize, usize)>,
    /// Arena bytes live at each step (aligned sizes) and its maximum.
    pub live: Vec<usize>,
    pub lower_bound: usize,
    pub lower_bound_step: usize,
}

fn find(parent: &mut [usize], mut i: usize) -> usize {
    while parent[i] != i {
        parent[i] = parent[parent[i]];
        i = parent[i];
    }
    i
}

/// Lifetimes of `order` (a checked schedule). In place: a node takes over operand `slot`'s
/// buffer when the op allows it (`in_place_slots`), the buffer is in the arena, no value in it
/// is read after this step, and the byte sizes are equal.
pub(crate) fn analyze(d: &Dense, order: &[usize], align: usize) -> Liveness {
    let n = d.len();
    let steps = order.len();
    let end = steps.saturating_sub(1);
    let mut pos = vec![usize::MAX; n];
    for (s, &i) in order.iter().enumerate() {
        pos[i] = s;
    }
    let mut last_use = vec![0usize; n];
    for i in 0..n {
        let mut l = if pos[i] == usize::MAX { 0 } else { pos[i] };
        for &u in &d.users[i] {
            l = l.max(pos[u]);
        }
        if d.output[i] || d.copy_back[i] {
            l = end;
        }
        last_use[i] = l;
    }
    // union-find over the static groups (views, write-backs), then in-place merges in order
    let mut parent: Vec<usize> = static_groups(d);
    let mut root_input: Vec<Option<usize>> = vec![None; n];
    let mut keep = vec![false; n];
    let mut group_last = vec![0usize; n];
    for (i, &last) in last_use.iter().enumerate() {
        let r = find(&mut parent, i);
        if d.is_input(i) {
            root_input[r] = Some(i);
            group_last[r] = group_last[r].max(last);
        }
        if d.output[i] || d.copy_back[i] {
            keep[r] = true;
        }
    }
    // In schedule order, every member of a group that exists at step s has been produced by
    // then (views and operands come first), so `group_last` is final for the question "is the
    // buffer read after s?".
    let mut in_place = Vec::new();
    for (s, &i) in order.iter().enumerate() {
        let r = find(&mut parent, i);
        if r == i && !d.view[i] && d.write_back[i].is_none() {
            for &slot in &d.in_place[i] {
                let Some(&o) = d.operands[i].get(slot) else { continue };
                let ro = find(&mut parent, o);
                if root_input[ro].is_some() || keep[ro] || ro == r || group_last[ro] != s || d.bytes[ro] != d.bytes[i] {
                    continue;
                }
                // the operand's buffer dies here: the result takes it over
                parent[i] = ro;
                keep[ro] |= keep[i];
                in_place.push((i, o));
                break;
            }
        }
        let r = find(&mut parent, i);
        group_last[r] = group_last[r].max(last_use[i]);
    }
    // buffers, members in production order: inputs first (they exist before step 0)
    let mut buf_index = vec![usize::MAX; n];
    let mut bufs: Vec<Buf> = Vec::new();
    let mut buf_of = vec![usize::MAX; n];
    let inputs: Vec<usize> = (0..n).filter(|&i| d.is_input(i)).collect();
    for i in inputs.into_iter().chain(order.iter().copied()) {
        let r = find(&mut parent, i);
        if buf_index[r] == usize::MAX {
            buf_index[r] = bufs.len();
            let p = root_input[r];
            let start = if p.is_some() { 0 } else { pos[i] };
            bufs.push(Buf {
                members: Vec::new(),
                persistent: p,
                bytes: d.bytes[i],
                size: aligned(d.bytes[i], align),
                first: start,
                last: start,
            });
        }
        let b = buf_index[r];
        buf_of[i] = b;
        let buf = &mut bufs[b];
        buf.members.push(i);
        buf.last = buf.last.max(last_use[i]);
        if buf.persistent.is_some() {
            buf.last = end;
        }
    }
    // live bytes per step (arena only): qatc_arena's profile, whose maximum bounds the placement
    let arena: Vec<qatc_arena::Interval> = bufs
        .iter()
        .filter(|b| b.persistent.is_none())
        .map(|b| qatc_arena::Interval { first: b.first, last: b.last, size: b.size })
        .collect();
    let mut live = qatc_arena::live_profile(&arena, align);
    live.resize(steps, 0);
    let (mut lb, mut lb_step) = (0usize, 0usize);
    for (s, &v) in live.iter().enumerate() {
        if v > lb {
            lb = v;
            lb_step = s;
        }
    }
    Liveness { pos, buf_of, bufs, last_use, in_place, live, lower_bound: lb, lower_bound_step: lb_step }
}
