//! Pointwise chains: elementwise ops, layout ops (broadcast, reshape, transpose, slice, concat),
//! constants and gathers all compute each output element from a fixed set of input elements, so
//! any chain of them is one loop over the last op's output: one launch, intermediates in registers.

use std::sync::OnceLock;

use egg::Id;
use qatc_ir::{KernelFamily, OpKind};

use super::{consumers_inside, first_time, Custom, Family, Fuse, Rule, Take};
use crate::fusion::body::{self, add_kernel, Builder};
use crate::fusion::lang::{skip_settled, Entry, Kind, EG};

/// The kinds a pointwise chain is rooted at: every op the op table calls pointwise
/// (`OpKind::is_pointwise`) that has operands.
pub fn pointwise_roots() -> &'static [Kind] {
    static ROOTS: OnceLock<Vec<Kind>> = OnceLock::new();
    ROOTS.get_or_init(|| OpKind::ALL.iter().filter(|k| k.is_pointwise() && !k.is_leaf()).map(|&k| Kind::Op(k)).collect())
}

pub fn rules() -> Vec<Rule> {
    vec![
        // f(.., g(..), ..)  =>  pointwise[f . g](.., ..)      f, g pointwise; g's value has no
        //   consumer but f (or g is a layout op or a constant, cheap to recompute): g is computed
        //   in f's loop instead of being written and read back
        Rule::Custom(Custom { name: "pointwise-chain", roots: pointwise_roots(), global: false, apply: chain }),
        // sum_to(pointwise(..))  =>  reduce.sum(..)      the reduction reads the chain's inputs
        //   (gradient clipping's sum of squares, a bias gradient's sum over rows)
        Rule::Fuse(Fuse {
            name: "reduce-prologue",
            lhs: "(sum_to ?x)",
            absorb: &[("x", Take::Pointwise)],
            family: Family::New(KernelFamily::ReduceSum),
            check: |_| true,
            aux: false,
        }),
    ]
}

fn chain(eg: &mut EG, class: Id, index: usize) -> Vec<Id> {
    let root = eg.find(class);
    let mut changed = Vec::new();
    let nodes: Vec<_> = eg[root]
        .nodes
        .iter()
        .filter(|n| pointwise_roots().contains(&n.kind) && matches!(eg.analysis.table.get(n.op), Some(Entry::Prim { .. })))
        .cloned()
        .collect();
    for n in nodes {
        // what this reads is settled: the last iteration fused it
        if skip_settled(eg, root, &n.args) {
            continue;
        }
        // each operand's largest pointwise fragment that may be inlined, else the operand read
        let parts: Vec<(Id, Option<body::Frag>)> = n
            .args
            .iter()
            .map(|&a| {
                let c = eg.find(a);
                let frag = body::best(eg, c, |f| f.family == KernelFamily::Pointwise)
                    .filter(|f| f.recomputable(eg) || consumers_inside(eg, c, &[root]));
                (c, frag)
            })
            .collect();
        // the memo before any body is built: the same op over the same fragments was fused in an
        // earlier iteration
        let mut key = vec![usize::from(root), n.op as usize];
        key.extend(parts.iter().map(|(c, f)| f.as_ref().map_or(usize::MAX - usize::from(*c), |f| f.op as usize)));
        if parts.iter().all(|(_, f)| f.is_none()) || !first_time(eg, index, key) {
            continue;
        }
        let mut b = Builder::new();
        let args = parts
            .iter()
            .map(|(c, f)| match f {
                Some(f) => b.splice(eg, f, &[]),
                None => b.input(eg, *c),
            })
            .collect();
        let out = b.node(eg, n.op, args, Some(root));
        if let Some((k, args)) = b.finish(eg, out, KernelFamily::Pointwise, "pointwise-chain") {
            changed.extend(add_kernel(eg, root, k, args));
        }
    }
    changed
}
