//! Attention, FlashAttention-style. The [B, NH, T, T] scores and probabilities are the largest
//! activations of a GPT-2 block (B 8, NH 12, T 1024: 384 MiB per layer in f32), so:
//! - scores, scale, causal mask and softmax are one kernel (the scores are never written);
//! - the probabilities P may be recomputed from q and k by every kernel that reads them (the
//!   P V product, its backward dV = P^T dO, and softmax's backward), so they need not be saved:
//!   `Take::Recompute` offers both, and extraction keeps P only where that moves fewer bytes;
//! - dP = dO V^T is formed in registers inside softmax's backward, and dS = softmax_grad(P, dP)
//!   feeds dQ = dS K and dK = dS^T Q from one kernel that writes both (FlashAttention-2's
//!   backward), so dS is never written either.
//!
//! FLOPs are not in the cost (see `cost`): recomputing P costs one extra Q K^T per use, as in
//! FlashAttention.

use egg::Id;
use qatc_ir::{Anchor, KernelFamily, OpKind};

use super::{consumers_inside, first_time, Custom, Family, Fuse, Rule, Take};
use crate::fusion::body::{self, add_pack, BRef, Builder};
use crate::fusion::lang::{ENode, Kind, EG};

/// The forward's score kernels (softmax of a GEMM): the fragments attention rules recompute.
const SCORES: &[Anchor] = &[Anchor::Attention];

pub fn rules() -> Vec<Rule> {
    vec![
        // softmax[scale, causal](matmul(q, k^T))  =>  attention.scores(q, k)
        //   scale and mask applied to the score tile in registers; q, k read strided from qkv
        Rule::Fuse(Fuse {
            name: "attention-scores",
            lhs: "(softmax ?s)",
            absorb: &[("s", Take::Must(&[Anchor::Gemm]))],
            family: Family::New(KernelFamily::AttentionScores),
            check: |m| m.root().is_some_and(|t| t.shape.rank() >= 3),
            aux: false,
        }),
        // matmul(attention.scores(q, k), v)  =>  attention.flash(q, k, v)
        //   O = softmax(q k^T) v without P in memory; also dV = P^T dO in the backward
        Rule::Fuse(Fuse {
            name: "attention-flash",
            lhs: "(matmul ?p ?v)",
            absorb: &[("p", Take::Recompute(SCORES)), ("v", Take::Cheap)],
            family: Family::New(KernelFamily::AttentionFlash),
            check: |m| m.root().is_some_and(|t| t.shape.rank() >= 3),
            aux: false,
        }),
        // softmax_grad(P, matmul(dO, v^T))  =>  attention_bwd.scores(P | q, k, dO, v)
        //   dP = dO V^T is formed tile by tile and never written; P is read or recomputed
        Rule::Fuse(Fuse {
            name: "attention-scores-bwd",
            lhs: "(softmax_grad ?p ?dp)",
            absorb: &[("dp", Take::Must(&[Anchor::Gemm])), ("p", Take::Recompute(SCORES))],
            family: Family::New(KernelFamily::AttentionBwdScores),
            check: |m| matches!((m.ty("p"), m.root()), (Some(a), Some(b)) if a == b && a.shape.rank() >= 3),
            aux: false,
        }),
        // { matmul(dS, k), matmul(dS^T, q) } with dS = attention_bwd.scores(..)
        //   =>  attention_bwd.flash(..)       one kernel writes dQ and dK; dS stays in registers
        Rule::Custom(Custom { name: "attention-bwd-dqdk", roots: &[Kind::Op(OpKind::SoftmaxGrad)], global: false, apply: dq_dk }),
    ]
}

fn dq_dk(eg: &mut EG, class: Id, index: usize) -> Vec<Id> {
    let ds = eg.find(class);
    // every consumer is a GEMM reading dS
    let mut consumers: Vec<(Id, ENode)> = Vec::new();
    for &u in &eg[ds].data.users {
        let u = eg.find(u);
        match eg[u].nodes.iter().find(|n| n.is(OpKind::MatMul)).cloned() {
            Some(m) => consumers.push((u, m)),
            None => return vec![],
        }
    }
    if consumers.len() < 2 || eg[ds].data.output {
        return vec![];
    }
    let cands = body::ranked(eg, ds, |f| f.family.anchor() == Anchor::AttentionBwd);
    let mut changed = Vec::new();
    for f in cands.into_iter().take(3) {
        if !first_time(eg, index, vec![usize::from(ds), f.op as usize]) {
            continue;
        }
        let mut b = Builder::new();
        let dsr = b.splice(eg, &f, &[]);
        let mut outs: Vec<(Id, BRef)> = Vec::new();
        for (u, m) in &consumers {
            let args = m.args.iter().map(|&a| if eg.find(a) == ds { dsr } else { cheap(eg, &mut b, a) }).collect();
            outs.push((*u, b.node(eg, m.op, args, Some(*u))));
        }
        let mut inside: Vec<Id> = b.origins().collect();
        inside.push(ds);
        if !consumers_inside(eg, ds, &inside) {
            continue;
        }
        let name = eg[ds].data.name.clone().unwrap_or_else(|| "attention_bwd".into());
        if let Some((k, args)) = b.finish_pack(eg, &outs, KernelFamily::AttentionBwdFlash, "attention-bwd-dqdk") {
            changed.extend(add_pack(eg, k, args, &name));
        }
    }
    changed
}

/// Inlines `c` when it is a layout op (q, k read strided from qkv), else reads it.
fn cheap(eg: &EG, b: &mut Builder, c: Id) -> BRef {
    match body::best(eg, c, |f| f.layout_only(eg)) {
        Some(f) => b.splice(eg, &f, &[]),
        None => b.input(eg, c),
    }
}
