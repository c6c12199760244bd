//! Extraction is DAG-aware: a value read by several kernels is materialized and paid for once.
//! egg's `AstSize`/`AstDepth` are tree costs (a residual read twice is counted twice, and costs
//! saturate on a 12-layer graph, see pitfalls.md), so qatc extracts in two steps: a greedy pass
//! where each e-class takes its cheapest e-node, counting the cost of an operand only when this
//! class is its sole consumer, then a local search that switches single e-classes to another
//! e-node while the whole graph's cost (each materialized class once, kept by reference counts)
//! goes down. An ILP was not needed: the report gives the greedy and final costs.

use std::collections::BTreeMap;
use std::time::Instant;

use egg::Id;
use qatc_ir::OpKind;

use super::cost::{enode_traffic, Cost, INF};
use super::lang::{ENode, EG, FUSED};

/// What extraction chose and what it cost.
pub struct Extraction {
    /// The chosen e-node of every materialized class (by canonical id).
    pub choice: BTreeMap<Id, ENode>,
    pub greedy_cost: Cost,
    pub final_cost: Cost,
    pub switches: usize,
    pub time_s: f64,
}

struct ClassInfo {
    id: Id,
    nodes: Vec<ENode>,
    cost: Vec<Cost>,
    kids: Vec<Vec<usize>>,
    shared: bool,
}

/// Extracts a DAG for `roots` (greedy, then local search bounded by `budget_s` seconds).
pub fn extract(eg: &EG, roots: &[Id], launch_bytes: u64, budget_s: f64) -> Extraction {
    let t0 = Instant::now();
    let mut ids: Vec<Id> = eg.classes().map(|c| c.id).collect();
    ids.sort();
    let index: BTreeMap<Id, usize> = ids.iter().enumerate().map(|(i, &c)| (c, i)).collect();
    let mut parents: Vec<Vec<usize>> = vec![Vec::new(); ids.len()];
    let mut cls: Vec<ClassInfo> = Vec::with_capacity(ids.len());
    for (ci, &c) in ids.iter().enumerate() {
        let class = &eg[c];
        let out = class.data.ty.clone();
        // primitive e-nodes first: on a tie the op stays unfused
        let mut nodes: Vec<ENode> = class.nodes.clone();
        nodes.sort_by(|a, b| (a.kind == FUSED, a).cmp(&(b.kind == FUSED, b)));
        let mut cost = Vec::new();
        let mut kids = Vec::new();
        for n in &nodes {
            cost.push(match &out {
                Some(t) => enode_traffic(eg, n, t).cost(launch_bytes),
                None => INF,
            });
            let mut k: Vec<usize> = n.args.iter().filter_map(|a| index.get(&eg.find(*a)).copied()).collect();
            k.sort_unstable();
            k.dedup();
            for &p in &k {
                if !parents[p].contains(&ci) {
                    parents[p].push(ci);
                }
            }
            kids.push(k);
        }
        cls.push(ClassInfo { id: c, nodes, cost, kids, shared: false });
    }
    for (i, c) in cls.iter_mut().enumerate() {
        let d = &eg[c.id].data;
        c.shared = d.output || if d.original { d.users.len() != 1 } else { parents[i].len() != 1 };
    }
    // Greedy: fixpoint of best[c] = min over nodes of own + cost of private (unshared) operands.
    let mut best = vec![INF; cls.len()];
    let mut pick = vec![usize::MAX; cls.len()];
    loop {
        let mut changed = false;
        for i in 0..cls.len() {
            for (j, k) in cls[i].kids.iter().enumerate() {
                let mut v = cls[i].cost[j];
                for &kk in k {
                    v += if best[kk] >= INF {
                        INF
                    } else if cls[kk].shared {
                        0
                    } else {
                        best[kk]
                    };
                }
                let v = v.min(INF);
                if v < best[i] {
                    best[i] = v;
                    pick[i] = j;
                    changed = true;
                }
            }
        }
        if !changed {
            break;
        }
    }
    let root_idx: Vec<usize> = roots.iter().filter_map(|r| index.get(&eg.find(*r)).copied()).collect();
    let packs = pack_views(eg, &cls, &index);
    let mut s = Search { cls: &cls, sel: Selection::new(&cls, &pick, &root_idx), parents, packs, roots: root_idx, switches: 0 };
    let greedy_cost = s.sel.total;
    s.improve(t0, budget_s);
    let sel = &s.sel;
    let choice = (0..cls.len())
        .filter(|&i| sel.refs[i] > 0 && sel.pick[i] != usize::MAX)
        .map(|i| (cls[i].id, cls[i].nodes[sel.pick[i]].clone()))
        .collect();
    Extraction { choice, greedy_cost, final_cost: sel.total, switches: s.switches, time_s: t0.elapsed().as_secs_f64() }
}

/// For every packed kernel's class: its results' classes and, in each, the e-node that is the
/// view `reshape(slice(buffer))`.
fn pack_views(eg: &EG, cls: &[ClassInfo], index: &BTreeMap<Id, usize>) -> Vec<Vec<(usize, usize)>> {
    // packed buffers, then the slices of each, then the reshapes of those slices
    let mut pack_of: BTreeMap<usize, usize> = BTreeMap::new();
    for (pi, p) in cls.iter().enumerate() {
        if p.nodes.iter().any(|n| eg.analysis.table.kernel(n.op).is_some_and(|k| !k.pack.is_empty())) {
            let k = pack_of.len();
            pack_of.insert(pi, k);
        }
    }
    let mut slice_of: BTreeMap<usize, usize> = BTreeMap::new();
    for (si, c) in cls.iter().enumerate() {
        for n in c.nodes.iter().filter(|n| n.is(OpKind::Slice)) {
            if let Some(&k) = index.get(&eg.find(n.args[0])).and_then(|pi| pack_of.get(pi)) {
                slice_of.insert(si, k);
            }
        }
    }
    let mut out = vec![Vec::new(); pack_of.len()];
    for (ci, c) in cls.iter().enumerate() {
        for (j, n) in c.nodes.iter().enumerate().filter(|(_, n)| n.is(OpKind::Reshape)) {
            if let Some(&k) = index.get(&eg.find(n.args[0])).and_then(|si| slice_of.get(si)) {
                out[k].push((ci, j));
            }
        }
    }
    out
}

/// The local search over a [`Selection`].
struct Search<'a> {
    cls: &'a [ClassInfo],
    sel: Selection,
    /// Classes any of whose e-nodes reads the class.
    parents: Vec<Vec<usize>>,
    packs: Vec<Vec<(usize, usize)>>,
    roots: Vec<usize>,
    switches: usize,
}

impl Search<'_> {
    /// Applies `moves` (class, e-node) together; keeps them if the total went down.
    fn try_moves(&mut self, moves: &[(usize, usize)]) -> bool {
        let before = self.sel.total;
        let mut undo = Vec::with_capacity(moves.len());
        for &(i, j) in moves {
            if self.sel.pick[i] != j {
                undo.push((i, self.sel.pick[i]));
                self.sel.switch(self.cls, i, j);
            }
        }
        if !undo.is_empty() && self.sel.total < before {
            self.switches += undo.len();
            return true;
        }
        for &(i, j) in undo.iter().rev() {
            self.sel.switch(self.cls, i, j);
        }
        false
    }

    /// Three moves, repeated while they pay: adopt a packed kernel for all its results at once;
    /// stop materializing a class by switching every reader to its cheapest e-node that does not
    /// read it; switch one class to another e-node.
    fn improve(&mut self, t0: Instant, budget_s: f64) {
        let cls = self.cls;
        let out_of_time = |t0: Instant| t0.elapsed().as_secs_f64() > budget_s;
        for _pass in 0..4 {
            let mut improved = false;
            for p in 0..self.packs.len() {
                let moves = self.packs[p].clone();
                improved |= self.try_moves(&moves);
            }
            for k in 0..cls.len() {
                if out_of_time(t0) {
                    return;
                }
                if self.sel.refs[k] == 0 || self.roots.contains(&k) {
                    continue;
                }
                let mut moves = Vec::new();
                let mut ok = true;
                for &r in &self.parents[k] {
                    if self.sel.refs[r] == 0 || !cls[r].kids.get(self.sel.pick[r]).is_some_and(|ks| ks.contains(&k)) {
                        continue;
                    }
                    let alt = (0..cls[r].nodes.len())
                        .filter(|&j| cls[r].cost[j] < INF && !cls[r].kids[j].contains(&k) && !cls[r].kids[j].contains(&r))
                        .min_by_key(|&j| cls[r].cost[j]);
                    match alt {
                        Some(j) => moves.push((r, j)),
                        None => {
                            ok = false;
                            break;
                        }
                    }
                }
                if ok && !moves.is_empty() {
                    improved |= self.try_moves(&moves);
                }
            }
            for (i, c) in cls.iter().enumerate() {
                if out_of_time(t0) {
                    return;
                }
                if self.sel.refs[i] == 0 || c.nodes.len() < 2 {
                    continue;
                }
                for j in 0..c.nodes.len() {
                    if j != self.sel.pick[i] && c.cost[j] < INF {
                        improved |= self.try_moves(&[(i, j)]);
                    }
                }
            }
            if !improved {
                return;
            }
        }
    }
}

/// A choice of e-node per class with reference counts: a class is materialized while a chosen
/// e-node of a materialized class (or a root) refers to it, and the total counts each once.
struct Selection {
    pick: Vec<usize>,
    refs: Vec<u32>,
    total: Cost,
}

impl Selection {
    fn new(cls: &[ClassInfo], pick: &[usize], roots: &[usize]) -> Selection {
        let mut s = Selection { pick: pick.to_vec(), refs: vec![0; cls.len()], total: 0 };
        for &r in roots {
            s.inc(cls, r);
        }
        s
    }

    fn own(&self, cls: &[ClassInfo], i: usize) -> Cost {
        match self.pick[i] {
            usize::MAX => INF,
            j => cls[i].cost[j],
        }
    }

    fn inc(&mut self, cls: &[ClassInfo], i: usize) {
        let mut stack = vec![i];
        while let Some(c) = stack.pop() {
            self.refs[c] += 1;
            if self.refs[c] == 1 {
                self.total += self.own(cls, c);
                if let Some(k) = cls[c].kids.get(self.pick[c]) {
                    stack.extend(k.iter().copied());
                }
            }
        }
    }

    fn dec(&mut self, cls: &[ClassInfo], i: usize) {
        let mut stack = vec![i];
        while let Some(c) = stack.pop() {
            self.refs[c] -= 1;
            if self.refs[c] == 0 {
                self.total -= self.own(cls, c);
                if let Some(k) = cls[c].kids.get(self.pick[c]) {
                    stack.extend(k.iter().copied());
                }
            }
        }
    }

    /// Makes class `i` use its e-node `j` (only a materialized class changes the total).
    fn switch(&mut self, cls: &[ClassInfo], i: usize, j: usize) {
        let old = self.pick[i];
        if self.refs[i] == 0 {
            self.pick[i] = j;
            return;
        }
        let own_old = self.own(cls, i);
        let new_kids = cls[i].kids[j].clone();
        for &k in &new_kids {
            self.inc(cls, k);
        }
        self.pick[i] = j;
        self.total += self.own(cls, i) - own_old;
        if let Some(k) = cls[i].kids.get(old) {
            for &kk in &k.clone() {
                self.dec(cls, kk);
            }
        }
    }
}
