//! LoRA: y = x W + b + s (x A^T) B^T with A [r, in], B [out, r], r small.
//!
//! - The up-projection u B^T [N, out] is an epilogue of the base GEMM: only the rank-r u [N, r]
//!   is ever in memory, never the [N, out] product (forward), and likewise t A [N, in] in the
//!   backward, where t = dy' B [N, r].
//! - The down-projection u = x A^T reads the same x as the base GEMM (Tensat's multi-pattern
//!   rule): one kernel computes both and writes y and u (u is kept for the backward), reading x
//!   once.

use egg::Id;
use qatc_ir::{Anchor, Epilogue, OpKind};

use super::{first_time, Custom, Family, Fuse, Match, Rule, Take};
use crate::fusion::body::{add_pack, Builder, Frag};
use crate::fusion::lang::{skip_settled, ENode, EG, FUSED};

/// The largest rank treated as LoRA's (PEFT's common ranks are 4..64).
pub const MAX_RANK: usize = 64;

const GEMM: &[Anchor] = &[Anchor::Gemm];

/// `v` is [N, r] with r at most [`MAX_RANK`] and at most a quarter of the result's width.
fn low_rank(m: &Match, v: &str) -> bool {
    match (m.ty(v), m.root()) {
        (Some(u), Some(y)) => {
            let r = u.shape.last();
            u.shape.rank() == y.shape.rank() && r <= MAX_RANK && 4 * r <= y.shape.last()
        }
        _ => false,
    }
}

pub fn rules() -> Vec<Rule> {
    vec![
        // add(gemm(..), affine[s](matmul(u, B^T)))  =>  gemm[+lora](.., u, B)
        //   u [N, r]: the [N, out] up-projection stays in registers (forward); u = x A^T itself
        //   is computed in the kernel too when nothing else reads it (evaluation)
        Rule::Fuse(Fuse {
            name: "lora-up-epilogue",
            lhs: "(add ?y (affine (matmul ?u ?b)))",
            absorb: &[("y", Take::Must(GEMM)), ("u", Take::May(GEMM))],
            family: Family::Extend { var: "y", tag: Epilogue::Lora },
            check: |m| low_rank(m, "u"),
            aux: false,
        }),
        // add(matmul(t, A), gemm(..))  =>  gemm[+lora](.., t, A)
        //   t [N, r]: dx = t A + dy W^T, the [N, in] product stays in registers (backward)
        Rule::Fuse(Fuse {
            name: "lora-dx-epilogue",
            lhs: "(add (matmul ?t ?a) ?y)",
            absorb: &[("y", Take::Must(GEMM))],
            family: Family::Extend { var: "y", tag: Epilogue::Lora },
            check: |m| low_rank(m, "t"),
            aux: false,
        }),
        // add(gemm(..), matmul(t, A))  =>  gemm[+lora](.., t, A)
        Rule::Fuse(Fuse {
            name: "lora-dx-epilogue-rhs",
            lhs: "(add ?y (matmul ?t ?a))",
            absorb: &[("y", Take::Must(GEMM))],
            family: Family::Extend { var: "y", tag: Epilogue::Lora },
            check: |m| low_rank(m, "t"),
            aux: false,
        }),
        // { y = gemm[..](x, .., u, ..),  u = matmul(x, A^T) }  =>  pack[y, u](x, A, ..)
        //   multi-pattern: a kernel reading x and u where u is x's own rank-r projection computes
        //   u from the x tiles it already has, and writes u as a second result
        Rule::Custom(Custom { name: "lora-shared-input", roots: &[FUSED], global: false, apply: shared_input }),
    ]
}

fn shared_input(eg: &mut EG, class: Id, index: usize) -> Vec<Id> {
    let root = eg.find(class);
    let fused: Vec<ENode> = eg[root].nodes.iter().filter(|n| n.kind == FUSED).cloned().collect();
    let mut changed = Vec::new();
    for n in fused {
        // what this reads is settled (the kernel, its operands' classes): the last iteration fused it
        if skip_settled(eg, root, &n.args) {
            continue;
        }
        let Some(k) = eg.analysis.table.kernel(n.op).cloned() else { continue };
        let Some(family) = k.family.with_lora_down() else { continue };
        let args: Vec<Id> = n.args.iter().map(|&a| eg.find(a)).collect();
        for &u in &args {
            // u's class computes matmul(x, A) with x also read by the kernel and u of low rank
            let Some(mm) = eg[u].nodes.iter().find(|m| m.is(OpKind::MatMul)).cloned() else { continue };
            let (x, a) = (eg.find(mm.args[0]), eg.find(mm.args[1]));
            let rank_ok = eg[u].data.ty.as_ref().is_some_and(|t| t.shape.last() <= MAX_RANK);
            if !rank_ok || !args.contains(&x) {
                continue;
            }
            if !first_time(eg, index, vec![usize::from(root), n.op as usize, usize::from(u)]) {
                continue;
            }
            let mut b = Builder::new();
            let (xr, ar) = (b.input(eg, x), b.input(eg, a));
            let ur = b.node(eg, mm.op, vec![xr, ar], Some(u));
            let frag = Frag { class: root, family: k.family.clone(), body: k.body.clone(), args: args.clone(), op: n.op, fused: true };
            let map = b.splice_all(eg, &frag, &[(u, ur)]);
            let mut outs: Vec<(Id, crate::fusion::body::BRef)> = if k.pack.is_empty() {
                match map.last() {
                    Some(&r) => vec![(root, r)],
                    None => continue,
                }
            } else {
                k.pack.iter().map(|&(c, i)| (c, map[i as usize])).collect()
            };
            outs.push((u, ur));
            let name = eg[root].data.name.clone().unwrap_or_else(|| k.family.to_string());
            if let Some((kk, kargs)) = b.finish_pack(eg, &outs, family.clone(), "lora-shared-input") {
                changed.extend(add_pack(eg, kk, kargs, &name));
            }
        }
    }
    changed
}
