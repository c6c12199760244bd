//! `--checkpoint budget=SIZE`: what to save and what to recompute so that the recompute FLOPs
//! are minimal and the step's peak fits SIZE.
//!
//! The policy space. The forward is a chain of stages (`chain`): embedding, L blocks, head.
//! Every stage keeps its output (the boundary: the next stage's input) and chooses, value by
//! value, which of the other values its backward reads to keep (per-op choice); the rest are
//! recomputed in the backward from what it keeps and its input.
//!
//! The memory model. The backward of stage s runs while the values saved by stages 0..s-1 are
//! still held, so its peak is
//!     inputs + sum_{j<s} A_j + (all values stage s's backward reads, saved or recomputed)
//!            + T_s + W
//! where A_j is stage j's saved bytes, T_s the largest recomputed intermediate that is not
//! itself read by the backward, and W the backward's own working set (gradients in flight,
//! matmul outputs), calibrated once from the planned peak of the step without recompute.
//!
//! The method, and why it is exact for that model:
//! 1. Per stage, every subset of its candidate values (at most 2^20; GPT-2 blocks have 18) is
//!    evaluated by a bitmask closure: which nodes must be recomputed, their FLOPs, A and T.
//!    Dominated subsets (no smaller A, T and FLOPs at once) are dropped: this loses nothing,
//!    since the peak and the cost are monotone in (A, T) and FLOPs. Stages with the same
//!    structure (all blocks but the first) share one enumeration.
//! 2. A dynamic program over the chain, with the held bytes sum_{j<s} A_j as its state, finds
//!    the choice per stage with the least total FLOPs whose every stage fits. The state is
//!    counted in buckets of SIZE/2048 rounded up, so a plan it returns never exceeds the model;
//!    it can miss plans within (L+2) buckets (under 2.5% of SIZE for 48 layers) of the budget.
//! 3. The chosen plan is built and planned for real (schedule, lifetimes, arena). If the real
//!    peak exceeds SIZE (the model is approximate: T and W are estimates), the model's budget
//!    is lowered by the excess and the program solved again.
//!
//! So the result is the optimum of the model, and its fit is checked, never assumed.

use std::collections::HashMap;

use super::super::plan::region::Dense;
use super::chain::{find, Chains};

/// The most candidates per stage enumerated exhaustively.
const MAX_EXACT: usize = 20;
/// Buckets of the held-bytes state.
const BUCKETS: usize = 2048;

/// One choice for a stage: which candidates it keeps (bit j = candidate j kept).
#[derive(Clone, Copy, Debug)]
struct Opt {
    keep: u32,
    /// Saved bytes, boundary included.
    a: usize,
    /// Recompute FLOPs, and nodes as a tie-break.
    flops: u64,
    nodes: u32,
    /// Largest recomputed intermediate the backward does not read.
    t: usize,
}

/// The stage structure used by the DP.
#[derive(Clone, Debug)]
pub(crate) struct Stage {
    /// Dense ids, topological.
    nodes: Vec<usize>,
    /// Candidate values (view roots of the values the backward reads), topological.
    pub cands: Vec<usize>,
    boundary: Option<usize>,
    /// Bytes of everything the stage's backward reads (candidates + boundary).
    held: usize,
}

/// Stages of chain `c`, in order (0 = embedding .. L+1 = head).
pub(crate) fn stages(d: &Dense, ch: &Chains, c: usize) -> Vec<Stage> {
    let count = ch.layers + 2;
    let mut st: Vec<Stage> = (0..count).map(|_| Stage { nodes: Vec::new(), cands: Vec::new(), boundary: None, held: 0 }).collect();
    for i in 0..d.len() {
        let Some((ci, s)) = ch.stage[i] else { continue };
        if ci != c || s >= count {
            continue;
        }
        st[s].nodes.push(i);
        if ch.boundary_index[i].is_some() {
            st[s].boundary = Some(i);
        }
    }
    for (s, stage) in st.iter_mut().enumerate() {
        let mut cands: Vec<usize> = Vec::new();
        for &i in &stage.nodes {
            if !Chains::needed(d, i) {
                continue;
            }
            let r = d.view_root(i);
            let same_stage = ch.stage[r].is_some_and(|(ci, rs)| ci == c && rs == s);
            if ch.boundary_index[r].is_none() && same_stage && !cands.contains(&r) {
                cands.push(r);
            }
        }
        cands.sort_unstable();
        let b = stage.boundary.map(|b| d.bytes[b]).unwrap_or(0);
        stage.held = b + cands.iter().map(|&i| d.bytes[i]).sum::<usize>();
        stage.cands = cands;
    }
    st
}

/// Per node of a stage: bytes, FLOPs, role (0 other, 1 candidate, 2 boundary), local operands.
type Signature = Vec<(usize, u64, u8, Vec<usize>)>;

/// A structural key: stages with equal keys have equal option lists.
fn signature(d: &Dense, s: &Stage) -> Signature {
    let local: HashMap<usize, usize> = s.nodes.iter().enumerate().map(|(k, &i)| (i, k)).collect();
    s.nodes
        .iter()
        .map(|&i| {
            let kind = if Some(i) == s.boundary { 2 } else { u8::from(s.cands.contains(&i)) };
            let ops = d.operands[i].iter().map(|o| local.get(o).copied().unwrap_or(usize::MAX)).collect();
            (d.bytes[i], d.flops[i], kind, ops)
        })
        .collect()
}

/// The non-dominated choices of one stage, and whether they are exhaustive.
fn options(d: &Dense, s: &Stage) -> (Vec<Opt>, bool) {
    let n = s.nodes.len();
    let m = s.cands.len();
    let bbytes = s.boundary.map(|b| d.bytes[b]).unwrap_or(0);
    if n > 128 || m > MAX_EXACT {
        // too many to enumerate: keep everything, or recompute candidates cheapest-per-byte first
        return (greedy_options(d, s, bbytes), false);
    }
    let local: HashMap<usize, usize> = s.nodes.iter().enumerate().map(|(k, &i)| (i, k)).collect();
    let opmask: Vec<u128> =
        s.nodes.iter().map(|i| d.operands[*i].iter().filter_map(|o| local.get(o)).fold(0u128, |acc, &k| acc | (1u128 << k))).collect();
    let cand_bit: Vec<u128> = s.cands.iter().map(|c| 1u128 << local[c]).collect();
    let cand_mask: u128 = cand_bit.iter().fold(0, |a, b| a | b);
    let bmask: u128 = s.boundary.map(|b| 1u128 << local[&b]).unwrap_or(0);
    // an intermediate that its users overwrite in place (scores -> softmax, matmul -> + bias)
    // never adds to the peak: its storage becomes theirs
    let absorbed: Vec<bool> = s
        .nodes
        .iter()
        .map(|&i| {
            !d.users[i].is_empty()
                && d.users[i]
                    .iter()
                    .all(|&u| d.bytes[u] == d.bytes[i] && d.in_place[u].iter().any(|&slot| d.operands[u].get(slot) == Some(&i)))
        })
        .collect();
    // Independent candidates (every operand an input or a value outside the stage, which is
    // always available: dequantized weights, the first LayerNorm) add their own bytes when kept
    // and their own FLOPs when not, whatever the rest does; enumerate the others and add these
    // afterwards, which is the same set of options for 2^|independent| times fewer closures.
    let indep: Vec<usize> = (0..m).filter(|&j| opmask[local[&s.cands[j]]] == 0).collect();
    let dep: Vec<usize> = (0..m).filter(|j| !indep.contains(j)).collect();
    let indep_mask: u128 = indep.iter().fold(0, |acc, &j| acc | cand_bit[j]);
    let mut opts = Vec::with_capacity(1 << dep.len());
    for sub in 0u32..(1u32 << dep.len()) {
        let mut keep = 0u32;
        let mut saved = bmask | indep_mask;
        let mut a = bbytes;
        for (k, &j) in dep.iter().enumerate() {
            if sub >> k & 1 == 1 {
                keep |= 1 << j;
                saved |= cand_bit[j];
                a += d.bytes[s.cands[j]];
            }
        }
        // closure from the highest node down: operands come before their users
        let mut need = cand_mask & !saved;
        let mut todo = need;
        while todo != 0 {
            let l = 127 - todo.leading_zeros() as usize;
            todo &= !(1u128 << l);
            let add = opmask[l] & !saved & !need;
            need |= add;
            todo |= add;
        }
        let (mut flops, mut nodes, mut t) = (0u64, 0u32, 0usize);
        let mut bits = need;
        while bits != 0 {
            let l = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            let i = s.nodes[l];
            flops += d.flops[i];
            nodes += 1;
            if cand_mask >> l & 1 == 0 && !d.view[i] && !absorbed[l] {
                t = t.max(d.bytes[i]);
            }
        }
        opts.push(Opt { keep, a, flops, nodes, t });
    }
    let mut opts = pareto(opts);
    for &j in &indep {
        let (b, f) = (d.bytes[s.cands[j]], d.flops[s.cands[j]]);
        let mut both = Vec::with_capacity(opts.len() * 2);
        for o in &opts {
            both.push(Opt { keep: o.keep | 1 << j, a: o.a + b, ..*o });
            both.push(Opt { flops: o.flops + f, nodes: o.nodes + 1, ..*o });
        }
        opts = pareto(both);
    }
    (opts, true)
}

fn greedy_options(d: &Dense, s: &Stage, bbytes: usize) -> Vec<Opt> {
    // rough: a candidate alone costs its own FLOPs; recompute in order of FLOPs per byte saved
    let mut idx: Vec<usize> = (0..s.cands.len().min(32)).collect();
    idx.sort_by(|&x, &y| {
        let fx = d.flops[s.cands[x]] as f64 / d.bytes[s.cands[x]].max(1) as f64;
        let fy = d.flops[s.cands[y]] as f64 / d.bytes[s.cands[y]].max(1) as f64;
        fx.total_cmp(&fy)
    });
    let all: u32 = if idx.len() >= 32 { u32::MAX } else { (1u32 << idx.len()) - 1 };
    let mut keep = all;
    let mut opts = Vec::new();
    let total: usize = idx.iter().map(|&j| d.bytes[s.cands[j]]).sum();
    let mut a = bbytes + total;
    let mut flops = 0;
    opts.push(Opt { keep, a, flops, nodes: 0, t: 0 });
    for (k, &j) in idx.iter().enumerate() {
        keep &= !(1u32 << j);
        a -= d.bytes[s.cands[j]];
        flops += d.flops[s.cands[j]];
        opts.push(Opt { keep, a, flops, nodes: k as u32 + 1, t: 0 });
    }
    opts
}

/// Drops options that another beats on saved bytes, transient bytes and cost at once.
fn pareto(mut opts: Vec<Opt>) -> Vec<Opt> {
    opts.sort_by_key(|o| (o.a, o.flops, o.nodes, o.t));
    let mut best_by_t: Vec<(usize, u64, u32)> = Vec::new(); // (t, flops, nodes), the cheapest so far per t
    let mut out = Vec::new();
    for o in opts {
        let dominated = best_by_t.iter().any(|&(t, f, k)| t <= o.t && (f, k) <= (o.flops, o.nodes));
        if dominated {
            continue;
        }
        match best_by_t.iter_mut().find(|(t, _, _)| *t == o.t) {
            Some(e) => {
                e.1 = o.flops;
                e.2 = o.nodes;
            }
            None => best_by_t.push((o.t, o.flops, o.nodes)),
        }
        out.push(o);
    }
    out
}

/// The model's answer: a keep mask per stage of chain 0, its cost and modeled peak.
#[derive(Clone, Debug)]
pub(crate) struct Solution {
    pub keep: Vec<u32>,
    pub modeled_peak: usize,
}

/// Everything the DP needs that does not depend on the budget.
pub(crate) struct Model {
    pub stages: Vec<Stage>,
    opts: Vec<std::rc::Rc<Vec<Opt>>>,
    pub exact: bool,
    /// Inputs' storage plus the calibrated working set W.
    pub fixed: usize,
    pub chains: Chains,
}

impl Model {
    /// `persistent`: the inputs' bytes; `peak_all_saved`: the planned peak of the step with
    /// nothing recomputed, which calibrates W.
    pub fn new(d: &Dense, persistent: usize, peak_all_saved: usize) -> Result<Model, String> {
        let chains = find(d)?;
        let stages = stages(d, &chains, 0);
        let mut cache: HashMap<Signature, std::rc::Rc<Vec<Opt>>> = HashMap::new();
        let mut exact = true;
        let mut opts = Vec::with_capacity(stages.len());
        for s in &stages {
            let key = signature(d, s);
            let o = match cache.get(&key) {
                Some(o) => o.clone(),
                None => {
                    let (o, ex) = options(d, s);
                    exact &= ex;
                    let o = std::rc::Rc::new(o);
                    cache.insert(key, o.clone());
                    o
                }
            };
            opts.push(o);
        }
        // W: what the all-saved model misses of the real all-saved peak
        let mut held = 0usize;
        let mut model = 0usize;
        for s in &stages {
            model = model.max(held + s.held);
            held += s.held;
        }
        let fixed = persistent + peak_all_saved.saturating_sub(persistent + model);
        Ok(Model { stages, opts, exact, fixed, chains })
    }

    /// The cheapest choice whose modeled peak is at most `budget`, if any.
    pub fn solve(&self, budget: usize) -> Option<Solution> {
        let avail = budget.checked_sub(self.fixed)?;
        let q = (avail / BUCKETS).max(1);
        let nb = avail / q + 1;
        const INF: (u64, u32) = (u64::MAX, u32::MAX);
        let mut dp: Vec<(u64, u32)> = vec![INF; nb];
        dp[0] = (0, 0);
        let mut back: Vec<Vec<(u32, u16)>> = Vec::with_capacity(self.stages.len()); // (prev bucket, option)
        for (s, st) in self.stages.iter().enumerate() {
            let mut next = vec![INF; nb];
            let mut choice = vec![(u32::MAX, 0u16); nb];
            for (k, o) in self.opts[s].iter().enumerate() {
                // the states this option fits from: p q + held + t <= avail
                let Some(room) = avail.checked_sub(st.held + o.t) else { continue };
                let da = o.a.div_ceil(q);
                if da >= nb {
                    continue;
                }
                let last = (room / q).min(nb - 1 - da);
                for p in 0..=last {
                    let cur = dp[p];
                    if cur == INF {
                        continue;
                    }
                    let c = (cur.0 + o.flops, cur.1 + o.nodes);
                    if c < next[p + da] {
                        next[p + da] = c;
                        choice[p + da] = (p as u32, k as u16);
                    }
                }
            }
            back.push(choice);
            dp = next;
        }
        let (mut p, _best) = dp.iter().enumerate().filter(|(_, c)| **c != INF).min_by_key(|(p, c)| (**c, *p)).map(|(p, c)| (p, *c))?;
        let mut keep = vec![0u32; self.stages.len()];
        let mut picked = vec![0usize; self.stages.len()];
        for s in (0..self.stages.len()).rev() {
            let (prev, k) = back[s][p];
            keep[s] = self.opts[s][k as usize].keep;
            picked[s] = k as usize;
            p = prev as usize;
        }
        Some(Solution { keep, modeled_peak: self.modeled_peak(&picked) })
    }

    /// The smallest budget the model can solve: every stage at its least-held choice.
    pub fn solve_floor(&self) -> usize {
        let picked: Vec<usize> = self.opts.iter().map(|o| (0..o.len()).min_by_key(|&k| (o[k].a, o[k].t)).unwrap_or(0)).collect();
        self.modeled_peak(&picked)
    }

    fn modeled_peak(&self, picked: &[usize]) -> usize {
        let mut held = 0usize;
        let mut peak = 0usize;
        for (s, st) in self.stages.iter().enumerate() {
            let o = &self.opts[s][picked[s]];
            peak = peak.max(held + st.held + o.t);
            held += o.a;
        }
        self.fixed + peak
    }

    /// The keep vector of a per-stage choice, applied to every micro-batch chain alike.
    pub fn keep_vector(&self, d: &Dense, masks: &[u32]) -> Vec<bool> {
        let mut keep = vec![true; d.len()];
        for c in 0..self.chains.chains() {
            let st = if c == 0 { self.stages.clone() } else { stages(d, &self.chains, c) };
            for (s, stage) in st.iter().enumerate() {
                for &i in &stage.nodes {
                    keep[i] = Some(i) == stage.boundary;
                }
                for (j, &cand) in stage.cands.iter().enumerate() {
                    keep[cand] = masks.get(s).is_some_and(|m| j < 32 && m >> j & 1 == 1);
                }
            }
        }
        keep
    }

    /// The choice that keeps nothing but the boundaries (the least the model can hold).
    pub fn minimal(&self) -> Vec<u32> {
        vec![0; self.stages.len()]
    }
}
