//! Which bytes a node may write its result over, instead of a buffer of its own: a value that
//! dies at the node, or the input its result replaces at the end of the step.
//!
//! The program runs in lowering order, so when every other reader of a value is lowered already,
//! nothing reads its bytes after the node being lowered. Three places use that:
//!
//! - AdamW's update over its operands (`adamw.rs`): each moment over its input, each weight over
//!   its input, or, under ZeRO 1 and 2, over this rank's block of the replicated weight (a value
//!   computed for the update alone);
//! - an all-reduce over its operand (DDP's in-place bucket reduction): the averaged gradient takes
//!   the bytes of the rank's own, which nothing reads afterwards;
//! - an all-gather of a weight's updated blocks straight into the weight's input (ZeRO 1 and 2):
//!   the weight's readers in this step are all behind it, and the write-back at the end of the
//!   step, a copy of the whole weight kept until then, is not needed.
//!
//! Without these, a data-parallel step holds a second copy of every gradient (the averaged one)
//! and a ZeRO 1 step a second copy of every weight and of its moments at its end: for GPT-2 1.5B
//! on 4 ranks, 5.8 GiB and 10.2 GiB of a rank's peak.

use std::collections::HashSet;

use qatc_ir::{Graph, NodeId, Op};

use crate::program::{BufKind, View};

use super::Lowerer;

fn is_view(op: &Op) -> bool {
    matches!(op, Op::Reshape { .. } | Op::Transpose { .. } | Op::Slice { .. } | Op::Broadcast { .. })
}

/// Whether every reader of `n` but `id`, through views, is lowered already, and no graph output
/// is `n` or a view of it.
pub fn read_before(g: &Graph, n: NodeId, id: NodeId, lowered: &dyn Fn(NodeId) -> bool) -> bool {
    // a scan, not a set: this runs once per AdamW operand, and a set of every output built each
    // time was 4.5% of `qatc plan 1.5B --fit` (its 1,200 outputs, once per operand)
    let is_output = |m: NodeId| g.outputs().iter().any(|o| o.node == m);
    if is_output(n) {
        return false;
    }
    let mut stack = vec![n];
    let mut seen = HashSet::new();
    while let Some(m) = stack.pop() {
        for u in g.users(m) {
            if u == id || !seen.insert(u) {
                continue;
            }
            match g.node(u).op {
                ref op if is_view(op) => {
                    if is_output(u) {
                        return false;
                    }
                    stack.push(u)
                }
                _ if lowered(u) => {}
                _ => return false,
            }
        }
    }
    true
}

/// Whether `n`'s bytes may be overwritten by `id` (the caller checks that `n` is a whole buffer):
/// `n` is, up through reshapes, a value computed into a buffer of its own, or one part of a
/// packed kernel's result read only part by part (a layernorm's gamma and beta gradients), and
/// nothing but `id` reads those bytes afterwards. Not an input, a constant, or a transpose or
/// broadcast of another value, whose bytes other nodes reach.
pub fn dies_at(g: &Graph, n: NodeId, id: NodeId, lowered: &dyn Fn(NodeId) -> bool) -> bool {
    let mut owner = n;
    while let Op::Reshape { .. } = g.node(owner).op {
        owner = g.operands(owner)[0];
    }
    match g.node(owner).op {
        // every slice of the pack taking these elements reads these bytes
        Op::Slice { axis: 0, start, end } => {
            let pack = g.operands(owner)[0];
            let users = g.users(pack);
            let by_parts = users.iter().all(|&u| matches!(g.node(u).op, Op::Slice { axis: 0, .. }));
            let outputs = g.outputs().iter().any(|o| o.node == pack);
            let same = |u: &NodeId| matches!(g.node(*u).op, Op::Slice { axis: 0, start: s, end: e } if s == start && e == end);
            let pack_op = &g.node(pack).op;
            by_parts
                && !outputs
                && !matches!(pack_op, Op::Input { .. } | Op::Const { .. })
                && !is_view(pack_op)
                && users.iter().filter(|u| same(u)).all(|&u| read_before(g, u, id, lowered))
        }
        ref op => !matches!(op, Op::Input { .. } | Op::Const { .. }) && !is_view(op) && read_before(g, owner, id, lowered),
    }
}

/// Where collective `id` may write its result instead of a buffer of its own (see the module's
/// documentation): over its operand `src` (an all-reduce whose operand dies here), or into the
/// input it replaces (an all-gather whose result, through reshapes only, is that input's update,
/// the same type and size, every other reader of the input lowered). `input_view` gives an
/// input's view by name.
pub fn collective_over(
    lw: &Lowerer,
    g: &Graph,
    id: NodeId,
    src: &View,
    lowered: &dyn Fn(NodeId) -> bool,
    input_view: &dyn Fn(NodeId) -> Option<View>,
) -> Option<View> {
    let ty = g.ty(id);
    match g.node(id).op {
        Op::AllReduce { .. } => {
            let buf = lw.prog.buffers.get(src.buf)?;
            let whole = src.offset == 0 && src.is_contiguous() && src.numel() == buf.numel() && buf.dtype == ty.dtype;
            let own = !matches!(buf.kind, BufKind::Input(..));
            (whole && own && dies_at(g, g.operands(id)[0], id, lowered)).then(|| View::contiguous(src.buf, &ty.shape.0))
        }
        Op::AllGather { .. } => {
            // the update this result is, through reshapes read by nothing else
            let mut n = id;
            let name = loop {
                if let Some(o) = g.outputs().iter().find(|o| o.node == n) {
                    break o.update.then(|| o.name.clone())?;
                }
                match g.users(n)[..] {
                    [u] if matches!(g.node(u).op, Op::Reshape { .. }) => n = u,
                    _ => return None,
                }
            };
            if g.outputs().iter().filter(|o| o.node == n).count() != 1 {
                return None;
            }
            let input = g.find_input(&name)?;
            let view = input_view(input)?;
            let buf = lw.prog.buffers.get(view.buf)?;
            let whole = view.offset == 0 && view.is_contiguous() && buf.numel() == ty.numel() && buf.dtype == ty.dtype;
            let is_it = matches!(&buf.kind, BufKind::Input(b, _) if *b == name);
            (whole && is_it && read_before(g, input, id, lowered)).then(|| View::contiguous(view.buf, &ty.shape.0))
        }
        _ => None,
    }
}
