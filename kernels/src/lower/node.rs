//! One node of the step graph lowered, in `lower_with`'s order: kept out (absorbed by a kernel,
//! or left for the blockwise AdamW), a view of its operand (an input's own buffer, a shape op, a
//! part of a pack), a fused node lowered whole by its family (the chunked cross-entropy, AdamW
//! over its inputs), a pack whose parts get buffers of their own, or else a kernel or GEMM into a
//! buffer of its own.

use std::collections::{HashMap, HashSet};

use qatc_ir::{Graph, KernelFamily, NodeId, Op, Role, Roles};

use super::{
    adamw, adamw8, buffer_name, fused, inplace, lower_op, materialize, memo, overwrite, pack_part, read_by_parts, unreshaped, xent,
};
use super::{Lowerer, PackPart};
use crate::error::KernelError;
use crate::program::{BufKind, Collective, Exchange, Step, View};

/// Lowers node `id` of `g`, its value's view recorded in `values` (or its parts in `lw.packs`).
pub fn lower(lw: &mut Lowerer, g: &Graph, id: NodeId, values: &mut HashMap<NodeId, View>, roles: &Roles) -> Result<(), KernelError> {
    let role = roles.role(g, id);
    lw.phase = role.phase;
    if let Some(v) = lw.absorbed.get(&id) {
        if let Some(v) = v {
            values.insert(id, v.clone());
        }
        return Ok(());
    }
    // left for the blockwise AdamW, lowered on demand (`materialize`) when it is not
    if !lw.options.adamw_packed && adamw8::deferred(g, id) {
        return Ok(());
    }
    if viewed(lw, g, id, values, role) || lowered_whole(lw, g, id, values, roles)? || lowered_in_parts(lw, g, id, values, roles, role)? {
        return Ok(());
    }
    let n = g.node(id);
    let ops = g.operands(id);
    // the cross-entropy gradient over its logits, when they die here (inplace.rs)
    let over = inplace::over_logits(lw, g, id, ops.first().and_then(|o| values.get(o)));
    if matches!(n.op, Op::AllReduce { .. } | Op::ReduceScatter { .. } | Op::AllGather { .. }) {
        let src = materialize(lw, g, ops[0], values, roles)?;
        let lowered = |u: NodeId| values.contains_key(&u) || lw.packs.contains_key(&u);
        let input_view = |u: NodeId| values.get(&u).cloned();
        let dest = match overwrite::collective_over(lw, g, id, &src, &lowered, &input_view) {
            Some(v) => v,
            None => lw.buffer(buffer_name(g, id), n.ty.dtype, &n.ty.shape.0, BufKind::Value, role),
        };
        collective(lw, g, id, src, dest.clone())?;
        values.insert(id, dest);
        return Ok(());
    }
    let first_step = lw.prog.steps.len();
    let dest = match &over {
        Some(v) => v.clone(),
        None => lw.buffer(buffer_name(g, id), n.ty.dtype, &n.ty.shape.0, BufKind::Value, role),
    };
    match &n.op {
        Op::Kernel { family, body } => {
            let mut operand_views = Vec::new();
            for &o in &ops {
                operand_views.push(materialize(lw, g, o, values, roles)?);
            }
            fused::lower_kernel_node(lw, g, id, family, body, &operand_views, dest.clone())?;
        }
        _ => lower_op(lw, g, id, dest.clone(), values, roles)?,
    }
    if let Some(v) = &over {
        inplace::verify(&lw.prog, first_step, v.buf)?;
    }
    values.insert(id, dest);
    Ok(())
}

/// Whether node `id` is a view (recorded in `values`): a part of a pack, an input's buffer, a
/// shape op over a view; a constant has none (read inline by its users, materialized on demand).
fn viewed(lw: &mut Lowerer, g: &Graph, id: NodeId, values: &mut HashMap<NodeId, View>, role: Role) -> bool {
    let n = g.node(id);
    let ops = g.operands(id);
    if let Op::Slice { axis: 0, start, end } = &n.op {
        if let Some(v) = ops.first().and_then(|&p| pack_part(lw, p, *start, *end)) {
            values.insert(id, v);
            return true;
        }
    }
    let view_of = |i: usize| ops.get(i).and_then(|o| values.get(o));
    let as_view = match &n.op {
        Op::Input { kind, .. } => {
            let v = lw.buffer(buffer_name(g, id), n.ty.dtype, &n.ty.shape.0, BufKind::Input(buffer_name(g, id), *kind), role);
            values.insert(id, v);
            return true;
        }
        // read inline by their users; materialized on demand below
        Op::Const { .. } => return true,
        Op::Reshape { shape } => view_of(0).and_then(|v| v.reshape(&shape.0)),
        Op::Transpose { perm } => view_of(0).map(|v| v.transpose(perm)),
        Op::Slice { axis, start, end } => view_of(0).map(|v| v.slice(*axis, *start, *end)),
        Op::Broadcast { shape } => view_of(0).map(|v| v.broadcast(&shape.0)),
        _ => None,
    };
    match as_view {
        Some(v) => {
            values.insert(id, v);
            true
        }
        None => false,
    }
}

/// Whether node `id` is a fused node whose results get buffers of their own, lowered whole: the
/// chunked cross-entropy, and AdamW written over its inputs, tensor by tensor. Where their bodies
/// are not the pattern these lowerings know, they fall through to the general lowering.
fn lowered_whole(lw: &mut Lowerer, g: &Graph, id: NodeId, values: &mut HashMap<NodeId, View>, roles: &Roles) -> Result<bool, KernelError> {
    let ops = g.operands(id);
    match &g.node(id).op {
        Op::Kernel { family: KernelFamily::CrossEntropyLinear { chunk_rows: rule_rows }, body } => {
            let mut operand_views = Vec::new();
            for &o in &ops {
                operand_views.push(materialize(lw, g, o, values, roles)?);
            }
            // the planner's rows per chunk, else the fusion rule's
            let chunk_rows = lw.options.ce_chunk_rows.unwrap_or(*rule_rows);
            match xent::lower(lw, g, id, body, &operand_views, chunk_rows)? {
                Some(xent::Lowered::Value(v)) => {
                    values.insert(id, v);
                    Ok(true)
                }
                Some(xent::Lowered::Parts(parts)) => {
                    lw.packs.insert(id, parts);
                    Ok(true)
                }
                None => Ok(false),
            }
        }
        Op::Kernel { family: family @ KernelFamily::AdamWMultiTensor, body } if !lw.options.adamw_packed => {
            let mut operand_views = Vec::new();
            for &o in &ops {
                let deferred = !values.contains_key(&o) && adamw8::deferred(g, o);
                operand_views.push(if deferred { None } else { Some(materialize(lw, g, o, values, roles)?) });
            }
            let done: HashSet<NodeId> = values.keys().chain(lw.packs.keys()).copied().collect();
            let lowered = |u: NodeId| done.contains(&u);
            let known = values.clone();
            let view_of = |u: NodeId| known.get(&u).cloned();
            match adamw::lower(lw, g, id, &family.to_string(), body, &operand_views, &view_of, &lowered)? {
                Some(placed) => {
                    lw.packs.insert(id, placed);
                    Ok(true)
                }
                None => Ok(false),
            }
        }
        _ => Ok(false),
    }
}

/// Whether node `id` is a packed kernel whose parts are computed one by one, each into a buffer of
/// its own (recorded in `lw.packs`).
fn lowered_in_parts(
    lw: &mut Lowerer,
    g: &Graph,
    id: NodeId,
    values: &mut HashMap<NodeId, View>,
    roles: &Roles,
    role: Role,
) -> Result<bool, KernelError> {
    let Op::Kernel { body, .. } = &g.node(id).op else { return Ok(false) };
    let ops = g.operands(id);
    let Some(parts) = fused::separate_parts(body, ops.len()).filter(|p| read_by_parts(g, id, p)) else { return Ok(false) };
    let mut operand_views = Vec::new();
    for &o in &ops {
        operand_views.push(materialize(lw, g, o, values, roles)?);
    }
    let mut dests = Vec::new();
    let mut placed = Vec::new();
    for &(part, start, len) in &parts {
        let inner = match body.node(part).op {
            Op::Reshape { .. } => body.operands(part)[0],
            _ => part,
        };
        // the role of what reads this part: the pack's slice
        let reader = g.users(id).into_iter().find(|&u| matches!(g.node(u).op, Op::Slice { start: s, .. } if s == start));
        let part_role = reader.map_or(role, |u| roles.role(g, u));
        let name = body.node(inner).name.clone().unwrap_or_else(|| format!("{}.part{}", buffer_name(g, id), dests.len()));
        let t = body.ty(inner);
        let buf = lw.buffer(name, t.dtype, &t.shape.0, BufKind::Value, part_role);
        let flat = buf.reshape(&[len]).ok_or_else(|| KernelError::Internal("a part's buffer is not contiguous".into()))?;
        dests.push(flat.clone());
        placed.push((start, len, flat));
    }
    lower_kernel_parts(lw, g, id, &operand_views, &parts, &dests)?;
    lw.packs.insert(id, placed);
    Ok(true)
}

/// A collective (never fused): a step the executor's communicator runs, from its operand's
/// buffer into its own. Its operand must be contiguous (a flattened, padded gradient or a weight's
/// block, as the passes that insert collectives give it), possibly part of a larger buffer.
fn collective(lw: &mut Lowerer, g: &Graph, id: NodeId, src: View, dst: View) -> Result<(), KernelError> {
    let (exchange, world) = match g.node(id).op {
        Op::AllReduce { reduce, world } => (Exchange::AllReduce(reduce), world),
        Op::ReduceScatter { reduce, world } => (Exchange::ReduceScatter(reduce), world),
        Op::AllGather { world } => (Exchange::AllGather, world),
        _ => return Err(KernelError::Internal(format!("{} is not a collective", g.describe(id)))),
    };
    if !src.is_contiguous() {
        return Err(KernelError::Unsupported { node: g.describe(id), why: "a collective's operand must be contiguous".into() });
    }
    let note = g.node(id).name.clone().unwrap_or_else(|| g.describe(id));
    lw.prog.steps.push(Step::Collective(Box::new(Collective { exchange, world, src, dst, note })));
    Ok(())
}

/// Lowers the packed kernel `id` part by part, each part into its own buffer (`dests`, one per
/// [`separate_parts`] entry, of the part's shape): a part lives only as long as it is read, not
/// as long as the pack's longest-lived part.
pub fn lower_kernel_parts(
    lw: &mut Lowerer,
    g: &Graph,
    id: NodeId,
    operands: &[View],
    parts: &[PackPart],
    dests: &[View],
) -> Result<(), KernelError> {
    let Op::Kernel { family, body } = &g.node(id).op else {
        return Err(KernelError::Internal(format!("node {id:?} is not a fused kernel")));
    };
    let mut cx = fused::body_ctx(g, id, body, operands)?;
    let family = family.to_string();
    // a pack like one lowered before (another layer's) replays its steps on its own buffers
    // (keyed apart from the node lowered whole, which the same body may be elsewhere)
    let keyed = format!("{family} in parts");
    memo::lower_or_replay(lw, &keyed, body, operands, &dests.iter().collect::<Vec<_>>(), |lw| {
        // a part that other parts are computed from goes first, so they read it (a LoRA
        // linear's pre-activation before its GELU)
        let inner = |p: NodeId| unreshaped(body, p);
        let under = |p: NodeId, q: NodeId| p != q && nodes_under(body, inner(q)).contains(&inner(p));
        let mut order: Vec<usize> = (0..parts.len()).collect();
        order.sort_by_key(|&i| !parts.iter().any(|q| under(parts[i].0, q.0)));
        for i in order {
            fused::lower_part(lw, &mut cx, parts[i].0, dests[i].clone(), &family)?;
        }
        Ok(())
    })
}

/// Every node under `root` (itself included).
fn nodes_under(g: &Graph, root: NodeId) -> HashSet<NodeId> {
    let mut seen = HashSet::new();
    let mut stack = vec![root];
    while let Some(n) = stack.pop() {
        if seen.insert(n) {
            stack.extend(g.operands(n));
        }
    }
    seen
}
