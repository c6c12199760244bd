//! AdamW written in place: a fused `adamw.multi_tensor` node (egg fusion's `adamw-multi-tensor`
//! rule) computes every trainable tensor's new weight and moments, packed into one buffer that
//! the executor would copy over the inputs after the step: three times the trainable bytes held
//! in the arena at the end of the step (a full fine-tune's weights, again, twice over). Instead,
//! each tensor's update runs as a kernel of its own that reads p, m, v and g at an element and
//! writes p', m', v' over p, m, v at the same element, so the optimizer holds nothing beyond its
//! state: the pack is never allocated, and the updates' write-backs are the inputs themselves.
//!
//! This is done only where it cannot change a result: every part of the pack is written over the
//! operand it replaces, either the input it is the update of or a value computed for this kernel
//! alone (under ZeRO 1 and 2, this rank's block of a replicated weight: its update is
//! all-gathered next, `overwrite::collective_over`), nothing else reads that operand after the
//! kernel (every other reader is already lowered: the program runs in lowering order), and the
//! kernel reads each written param at its own element before it writes it (`check_in_place`).
//! Otherwise the pack is lowered as any fused node.

use std::collections::{HashMap, HashSet};

use qatc_ir::{Graph, NodeId, Op};

use super::adamw8::{self, Moment8};
use super::builder::Pos;
use super::repeats::{self, Repeats};
use super::{overwrite, pack_parts, unreshaped, Ctx, Lowerer, PackPart, Placed};
use crate::error::KernelError;
use crate::kir::{Body, Expr, Ix, Kernel, Space, Stmt};
use crate::program::{BufId, BufKind, View};

/// One tensor's update in the body: the new weight's node and the (input, new value) pairs it
/// writes (the weight and its moments).
struct Tensor {
    param: NodeId,
    writes: Vec<(NodeId, NodeId)>,
}

/// The body input a body node reads in `slot`.
fn input_at(body: &Graph, n: NodeId, slot: usize) -> Option<NodeId> {
    let o = *body.operands(n).get(slot)?;
    matches!(body.node(o).op, Op::Input { .. }).then_some(o)
}

/// The tensors of an AdamW body, and the pack's parts: (part's value node, start, length).
fn tensors(body: &Graph) -> Option<(Vec<Tensor>, Vec<PackPart>)> {
    let root = body.output("out")?;
    let Op::Concat { axis: 0 } = body.node(root).op else { return None };
    let parts: Vec<PackPart> = pack_parts(body, root).into_iter().map(|(p, start, len)| (unreshaped(body, p), start, len)).collect();
    let mut out = Vec::new();
    for &(n, _, _) in &parts {
        let Op::AdamParam { .. } = body.node(n).op else { continue };
        let (m1, v1) = (body.operands(n)[1], body.operands(n)[2]);
        let (Op::AdamM { .. }, Op::AdamV { .. }) = (&body.node(m1).op, &body.node(v1).op) else { return None };
        let writes = vec![(input_at(body, n, 0)?, n), (input_at(body, m1, 0)?, m1), (input_at(body, v1, 0)?, v1)];
        out.push(Tensor { param: n, writes });
    }
    // every part is one of the tensors' new values
    let written: HashSet<NodeId> = out.iter().flat_map(|t| t.writes.iter().map(|w| w.1)).collect();
    (parts.iter().all(|p| written.contains(&p.0)) && written.len() == parts.len()).then_some((out, parts))
}

/// The update output each part of pack `id` is (followed through reshapes), by part start.
fn updates_of(g: &Graph, id: NodeId) -> HashMap<usize, String> {
    let mut out = HashMap::new();
    for o in g.outputs().iter().filter(|o| o.update) {
        let mut n = o.node;
        while let Op::Reshape { .. } = g.node(n).op {
            n = g.operands(n)[0];
        }
        if let (Op::Slice { axis: 0, start, .. }, [p]) = (&g.node(n).op, &g.operands(n)[..]) {
            if *p == id {
                out.insert(*start, o.name.clone());
            }
        }
    }
    out
}

/// Checks that `k` reads each param it writes only at the element it writes, and before it
/// writes it: an elementwise kernel of lets and stores whose loads of a written param all come
/// before the first store to it.
pub fn check_in_place(k: &Kernel) -> Result<(), KernelError> {
    let err = |msg: &str| Err(KernelError::Internal(format!("{}: not an in-place update: {msg}", k.family)));
    let Body::Loops { space: Space::Elements { .. }, stmts } = &k.body else { return err("not an elementwise kernel") };
    let mut stored: HashSet<usize> = HashSet::new();
    for s in stmts {
        let mut bad = None;
        let mut check = |e: &Expr| {
            e.visit(&mut |x| {
                if let Expr::Load { param, index } = x {
                    if k.params[*param].write && (stored.contains(param) || **index != Expr::Ix(Ix::Elem)) {
                        bad = Some(*param);
                    }
                }
            })
        };
        match s {
            Stmt::Let { value, .. } => check(value),
            Stmt::Store { param, index, value } => {
                check(value);
                if *index != Expr::Ix(Ix::Elem) {
                    return err("a store off its element");
                }
                stored.insert(*param);
            }
            _ => return err("a loop or an atomic"),
        }
        if let Some(p) = bad {
            return err(&format!("{} is read after it is written, or off its element", k.params[p].name));
        }
    }
    Ok(())
}

/// Lowers an `adamw.multi_tensor` node in place, tensor by tensor; None when it cannot be
/// (the node is then lowered as any fused node). Returns the pack's parts, each the input it
/// was written over. `operands` are the node's operands' views, None for an 8-bit moment's
/// dequantization not lowered yet (`adamw8::deferred`): those tensors are updated blockwise
/// over their codes and absmax (`adamw8.rs`); `view_of` gives a lowered node's view.
#[allow(clippy::too_many_arguments)]
pub fn lower(
    lw: &mut Lowerer,
    g: &Graph,
    id: NodeId,
    family: &str,
    body: &Graph,
    operands: &[Option<View>],
    view_of: &dyn Fn(NodeId) -> Option<View>,
    lowered: &dyn Fn(NodeId) -> bool,
) -> Result<Option<Vec<Placed>>, KernelError> {
    let Some((tensors, parts)) = tensors(body) else { return Ok(None) };
    let mut cx = Ctx { g: body, leaves: HashMap::new(), names: HashMap::new(), order: Vec::new() };
    let mut body_input: HashMap<NodeId, usize> = HashMap::new();
    for (i, v) in operands.iter().enumerate() {
        let Some(inp) = body.find_input(&format!("in{i}")) else { return Ok(None) };
        if let Some(v) = v {
            cx.leaves.insert(inp, v.clone());
            cx.order.push(v.buf);
        }
        body_input.insert(inp, i);
    }
    // each part must be the update of the graph input it overwrites, whole, or an 8-bit moment
    // whose requantization is the update of its codes and absmax
    let updates = updates_of(g, id);
    let ops = g.operands(id);
    let mut placed = Vec::new();
    // in the pack's order: the kernels' parameter order follows it (a hash map's order made the
    // program differ from run to run: tensors of one shape sharing a kernel or not)
    let mut blockwise: Vec<(NodeId, Moment8)> = Vec::new();
    let mut pack_index = None;
    for &(n, start, len) in &parts {
        let Some(t) = tensors.iter().find(|t| t.writes.iter().any(|w| w.1 == n)) else { return Ok(None) };
        let Some(inp) = t.writes.iter().find(|w| w.1 == n).map(|w| w.0) else { return Ok(None) };
        let Some(&k) = body_input.get(&inp) else { return Ok(None) };
        let Some(view) = &operands[k] else {
            let index = pack_index.get_or_insert_with(|| adamw8::PackIndex::of(g, id));
            let Some(m) = adamw8::moment(g, (id, index), ops[k], start, view_of) else { return Ok(None) };
            blockwise.push((inp, m));
            continue;
        };
        let buf = &lw.prog.buffers[view.buf];
        let whole = view.offset == 0 && view.is_contiguous() && view.numel() == len;
        let over = match &buf.kind {
            // the input this part updates
            BufKind::Input(name, _) => updates.get(&start) == Some(name) && overwrite::read_before(g, ops[k], id, lowered),
            // a value computed for this kernel alone (ZeRO 1 and 2: this rank's block of the
            // replicated weight, whose update is all-gathered next)
            _ => buf.numel() == len && buf.dtype == body.ty(n).dtype && overwrite::dies_at(g, ops[k], id, lowered),
        };
        if !whole || !over {
            return Ok(None);
        }
        placed.push((start, len, View::contiguous(view.buf, &[len])));
    }
    for (_, m) in &blockwise {
        cx.order.extend([m.codes.buf, m.absmax.buf]);
    }
    // one kernel per tensor, its params named by role so tensors of one shape share a kernel;
    // built once for tensors alike but for their buffers (`repeats.rs`)
    let places = repeats::order_places(&cx);
    let mut rep = Repeats::default();
    for t in &tensors {
        let eight: Vec<Option<&Moment8>> =
            t.writes.iter().map(|(inp, _)| blockwise.iter().find(|(b, _)| b == inp).map(|(_, m)| m)).collect();
        if eight.iter().any(Option::is_some) {
            adamw8::lower_tensor(lw, &mut cx, (&places, &mut rep), family, t.param, &t.writes, &eight)?;
            continue;
        }
        for (role, &(inp, _)) in ["p", "m", "v"].iter().zip(&t.writes) {
            cx.names.insert(cx.leaves[&inp].buf, (*role).to_string());
        }
        let roots: Vec<NodeId> = t.writes.iter().flat_map(|&(inp, new)| [inp, new]).collect();
        let (key, slots) = repeats::body_key(lw, &cx, &places, &roots, &repeats::More::default());
        // the launch's note names the tensor's gradient
        let note = format!("{}, written over p, m and v", lw.note(&cx, t.param, None));
        rep.launch(lw, key, &slots, Some(note.clone()), |lw| tensor_kernel(lw, &cx, family, t, note))?;
    }
    // what the blockwise kernels computed: the requantization's nodes are their inputs now
    for (_, m) in blockwise {
        lw.absorbed.extend(m.absorbed);
    }
    Ok(Some(placed))
}

/// Tensor `t`'s update as one elementwise kernel written over its weight and moments.
fn tensor_kernel(lw: &Lowerer, cx: &Ctx, family: &str, t: &Tensor, note: String) -> Result<(Kernel, Vec<BufId>), KernelError> {
    let shape = cx.g.ty(t.param).shape.0.clone();
    let dests: Vec<View> = t.writes.iter().map(|(inp, _)| cx.leaves[inp].clone()).collect();
    let touched: Vec<&View> = dests.iter().collect();
    let mut kb = lw.kb_elements(cx, &shape, &touched);
    let pos = Pos::Lin(Expr::Ix(Ix::Elem));
    let mut values = Vec::new();
    for &(_, n) in &t.writes {
        values.push(kb.value(n, &pos)?);
    }
    for (d, v) in dests.iter().zip(values) {
        kb.store_view(d, &pos, v);
    }
    let (kernel, args) = kb.finish(family, Space::Elements { shape }, note)?;
    check_in_place(&kernel)?;
    Ok((kernel, args))
}
