//! LayerNorm forward and backward, with the residual adds around them (llm.c's
//! `fused_residual_forward` and `layernorm_backward`).

use egg::Id;
use qatc_ir::{Anchor, Epilogue, KernelFamily, OpKind};

use super::{first_time, Custom, Family, Fuse, Match, Rule, Take};
use crate::fusion::body::{add_pack, Builder};
use crate::fusion::lang::{Entry, Kind, EG};

fn same_types(m: &Match, a: &str, b: &str) -> bool {
    matches!((m.ty(a), m.ty(b)), (Some(x), Some(y)) if x == y)
}

pub fn rules() -> Vec<Rule> {
    vec![
        // layernorm(add(x, r), g, b)  =>  layernorm.residual(x, r, g, b)
        //   x, r: full [.., C] tensors (a broadcast addend is a bias, left to the pointwise rules)
        //   aux: the residual sum, which the next block and the backward read, is written by the
        //   same kernel instead of a separate add
        Rule::Fuse(Fuse {
            name: "layernorm-residual",
            lhs: "(layernorm (add ?x ?r) ?g ?b)",
            absorb: &[],
            family: Family::New(KernelFamily::LayerNorm { residual: true, aux: false }),
            check: |m| same_types(m, "x", "r") && !m.has("x", OpKind::Broadcast) && !m.has("r", OpKind::Broadcast),
            aux: true,
        }),
        // layernorm_grad_x(x, g, pointwise(..))  =>  layernorm_bwd(x, g, ..)
        //   the incoming gradient's sum (two branches meeting) is formed in the prologue
        Rule::Fuse(Fuse {
            name: "layernorm-bwd-prologue",
            lhs: "(layernorm_grad_x ?x ?g ?dy)",
            absorb: &[("dy", Take::Pointwise)],
            family: Family::New(KernelFamily::LayerNormBwd { residual: false }),
            check: |m| same_types(m, "x", "dy"),
            aux: false,
        }),
        // add(d, layernorm_grad_x(..))  =>  layernorm_bwd[+residual](.., d)
        //   the residual stream's gradient is accumulated in the epilogue
        Rule::Fuse(Fuse {
            name: "layernorm-bwd-residual",
            lhs: "(add ?d ?l)",
            absorb: &[("l", Take::Must(&[Anchor::LayerNormBwd]))],
            family: Family::Extend { var: "l", tag: Epilogue::Residual },
            check: |m| matches!((m.ty("d"), m.root()), (Some(a), Some(b)) if a == b),
            aux: false,
        }),
        // add(layernorm_grad_x(..), d)  =>  layernorm_bwd[+residual](.., d)
        Rule::Fuse(Fuse {
            name: "layernorm-bwd-residual-lhs",
            lhs: "(add ?l ?d)",
            absorb: &[("l", Take::Must(&[Anchor::LayerNormBwd]))],
            family: Family::Extend { var: "l", tag: Epilogue::Residual },
            check: |m| matches!((m.ty("d"), m.root()), (Some(a), Some(b)) if a == b),
            aux: false,
        }),
        // { layernorm_grad_x(x, g, dy), layernorm_grad_gamma(x, dy), sum_to[C](dy) }
        //   =>  pack[dx, dgamma, dbeta](x, g, dy)        one pass over x and dy (full fine-tune)
        Rule::Custom(Custom { name: "layernorm-bwd-all", roots: &[Kind::Op(OpKind::LayerNormGradX)], global: false, apply: bwd_all }),
    ]
}

fn bwd_all(eg: &mut EG, class: Id, index: usize) -> Vec<Id> {
    let root = eg.find(class);
    let Some(n) = eg[root].nodes.iter().find(|n| n.is(OpKind::LayerNormGradX)).cloned() else { return vec![] };
    let (x, g, dy) = (eg.find(n.args[0]), eg.find(n.args[1]), eg.find(n.args[2]));
    let Some(c) = eg[x].data.ty.as_ref().map(|t| t.shape.last()) else { return vec![] };
    let mut siblings = Vec::new();
    for &u in &eg[x].data.users.clone() {
        let u = eg.find(u);
        if let Some(s) =
            eg[u].nodes.iter().find(|s| s.is(OpKind::LayerNormGradGamma) && eg.find(s.args[0]) == x && eg.find(s.args[1]) == dy)
        {
            siblings.push((u, s.clone()));
        }
    }
    for &u in &eg[dy].data.users.clone() {
        let u = eg.find(u);
        let is_dbeta =
            eg[u].nodes.iter().find(|s| s.is(OpKind::SumTo)).filter(|_| eg[u].data.ty.as_ref().is_some_and(|t| t.shape.dims() == [c]));
        if let Some(s) = is_dbeta.cloned() {
            siblings.push((u, s));
        }
    }
    if siblings.is_empty() || !first_time(eg, index, vec![usize::from(root)]) {
        return vec![];
    }
    let mut b = Builder::new();
    let (xr, gr, dyr) = (b.input(eg, x), b.input(eg, g), b.input(eg, dy));
    let mut outs = vec![(root, b.node(eg, n.op, vec![xr, gr, dyr], Some(root)))];
    for (u, s) in siblings {
        let args = s.args.iter().map(|&a| if eg.find(a) == x { xr } else { dyr }).collect();
        if matches!(eg.analysis.table.get(s.op), Some(Entry::Prim { .. })) {
            outs.push((u, b.node(eg, s.op, args, Some(u))));
        }
    }
    let name = eg[root].data.name.clone().unwrap_or_else(|| "layernorm_bwd".into());
    match b.finish_pack(eg, &outs, KernelFamily::LayerNormBwdAll, "layernorm-bwd-all") {
        Some((k, args)) => add_pack(eg, k, args, &name),
        None => vec![],
    }
}
