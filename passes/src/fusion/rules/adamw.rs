//! AdamW over every trainable tensor in one kernel (PyTorch's `foreach`/fused AdamW, apex's
//! multi-tensor apply): per tensor, m' = adam_m(m, g), v' = adam_v(v, g) and
//! p' = adam_param(p, m', v', lr, t) are computed in registers from one read of p, m, v and g, and
//! p', m', v' are written once, all tensors in one launch. The kernel's results are packed into
//! one flat buffer and each update is a view of it (see `body::add_pack`).
//!
//! Memory: the memory planner writes an update in place only when it is the node computing it,
//! so today it keeps the packed buffer (3 x the trainable bytes) to the end of the step and copies
//! the updates back. Negligible for LoRA; for a full fine-tune it costs arena bytes, until the
//! planner lays parameters and moments out contiguously in pack order (llm.c's single parameter
//! allocation) or the rule is disabled (`FuseOptions::disabled`).

use egg::Id;
use qatc_ir::{KernelFamily, OpKind};

use super::{consumers_inside, first_time, Custom, Rule};
use crate::fusion::body::{self, add_pack, BRef, Builder};
use crate::fusion::lang::{ENode, Kind, EG};

pub fn rules() -> Vec<Rule> {
    vec![
        // { adam_m(m_i, g_i), adam_v(v_i, g_i), adam_param(p_i, m_i', v_i', lr, t) }  for all i
        //   =>  adamw.multi_tensor(p.., m.., v.., g.., lr, t)   one launch; a gradient's pointwise
        //   producer (clipping's scale) is inlined when the optimizer is its only consumer
        Rule::Custom(Custom { name: "adamw-multi-tensor", roots: &[Kind::Op(OpKind::AdamParam)], global: true, apply: multi_tensor }),
    ]
}

fn node(eg: &EG, c: Id, kind: OpKind) -> Option<ENode> {
    eg[c].nodes.iter().find(|n| n.is(kind)).cloned()
}

fn multi_tensor(eg: &mut EG, _class: Id, index: usize) -> Vec<Id> {
    let mut params: Vec<Id> =
        eg.classes_for_op(&Kind::Op(OpKind::AdamParam)).map(|cs| cs.map(|c| eg.find(c)).collect()).unwrap_or_default();
    params.sort();
    params.dedup();
    if params.is_empty() || !first_time(eg, index, params.iter().map(|&c| usize::from(c)).collect()) {
        return vec![];
    }
    let mut b = Builder::new();
    let mut outs: Vec<(Id, BRef)> = Vec::new();
    for &p1 in &params {
        let Some(ap) = node(eg, p1, OpKind::AdamParam) else { continue };
        let (m1, v1) = (eg.find(ap.args[1]), eg.find(ap.args[2]));
        let (Some(am), Some(av)) = (node(eg, m1, OpKind::AdamM), node(eg, v1, OpKind::AdamV)) else { continue };
        let g = eg.find(am.args[1]);
        if eg.find(av.args[1]) != g {
            continue;
        }
        let gr = match body::best(eg, g, |f| f.family == KernelFamily::Pointwise) {
            Some(f) if consumers_inside(eg, g, &[m1, v1]) => b.splice(eg, &f, &[]),
            _ => b.input(eg, g),
        };
        let (m, v) = (b.input(eg, am.args[0]), b.input(eg, av.args[0]));
        let mr = b.node(eg, am.op, vec![m, gr], Some(m1));
        let vr = b.node(eg, av.op, vec![v, gr], Some(v1));
        let p = b.input(eg, ap.args[0]);
        let (lr, t) = (b.input(eg, ap.args[3]), b.input(eg, ap.args[4]));
        let pr = b.node(eg, ap.op, vec![p, mr, vr, lr, t], Some(p1));
        outs.extend([(p1, pr), (m1, mr), (v1, vr)]);
    }
    match b.finish_pack(eg, &outs, KernelFamily::AdamWMultiTensor, "adamw-multi-tensor") {
        Some((k, args)) => add_pack(eg, k, args, "adamw"),
        None => vec![],
    }
}
