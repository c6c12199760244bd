//! Kernels one node's lowering builds over and over, alike but for a few buffers: the chunked
//! cross-entropy's row kernel once per chunk, its online form's tile kernel once per chunk and
//! tile (a GPT-2 1.5B step at B 256 builds 6,400 of them, all one kernel), and the in-place
//! AdamW's kernel once per tensor (a 1.5B LoRA step's 384 adapters have a few shapes). Each is
//! built once per key; the later ones are the first's launch with the buffers that differ
//! (`slots`: the chunk's statistics, its first row, the tile's first column, the tensor's weight,
//! moments and gradient) swapped in, which skips building the kernel and hashing its text for its
//! identity. The two were a sixth of `qatc plan --fit`'s lowering on GPT-2 1.5B.
//!
//! The caller's promise, which makes a repeat the kernel its build would give: besides the key
//! and the slot buffers, the build reads only what stays the same for the life of the `Repeats`
//! (one node's lowering), and a slot buffer is a parameter only through its own view. The
//! cross-entropy keys by rows and columns; AdamW by [`body_key`], the text of everything the
//! builder reads. What this checks: a slot buffer of a repeat has the first's type and shape,
//! else the kernel is built again. With the node memo disabled (`NodeMemo::disabled`, the
//! reference `tests/lower_memo.rs` compares against) every kernel is built.

use std::collections::HashMap;
use std::hash::Hash;

use qatc_ir::{NodeId, Op};

use super::{Ctx, Lowerer};
use crate::error::KernelError;
use crate::kir::Kernel;
use crate::program::{BufId, BufKind, View};

/// A kernel as first built: its identity, launch arguments and note, and the slot buffers it was
/// built with.
struct Built {
    identity: u64,
    kernel: Kernel,
    args: Vec<BufId>,
    slots: Vec<BufId>,
}

/// The kernels built so far, by the caller's key.
pub struct Repeats<K> {
    built: HashMap<K, Built>,
}

impl<K> Default for Repeats<K> {
    fn default() -> Self {
        Repeats { built: HashMap::new() }
    }
}

impl<K: Hash + Eq> Repeats<K> {
    /// Launches the kernel of `key` over `slots`: `build` gives (kernel, args) the first time, and
    /// whenever the memo is disabled or a slot buffer differs in type or shape from the first's.
    /// The launch's note is `note` where given (one naming the slots' buffers), else the kernel's.
    pub fn launch(
        &mut self,
        lw: &mut Lowerer,
        key: K,
        slots: &[BufId],
        note: Option<String>,
        build: impl FnOnce(&mut Lowerer) -> Result<(Kernel, Vec<BufId>), KernelError>,
    ) -> Result<(), KernelError> {
        if let Some(b) = self.built.get(&key).filter(|b| !lw.memo.disabled && alike(lw, &b.slots, slots)) {
            let args = b.args.iter().map(|a| b.slots.iter().position(|s| s == a).map_or(*a, |i| slots[i])).collect();
            lw.push_known_kernel(b.identity, &b.kernel, args, note.unwrap_or_else(|| b.kernel.note.clone()));
            lw.memo.repeats += 1;
            return Ok(());
        }
        let (kernel, args) = build(lw)?;
        let identity = kernel.identity();
        lw.push_known_kernel(identity, &kernel, args.clone(), note.unwrap_or_else(|| kernel.note.clone()));
        if !lw.memo.disabled && !self.built.contains_key(&key) {
            self.built.insert(key, Built { identity, kernel, args, slots: slots.to_vec() });
        }
        Ok(())
    }
}

/// Whether slot buffers `b` stand where `a` stood: as many, each of the same type and shape, and
/// no two the same buffer where `a`'s were not (a kernel's params are its distinct buffers).
fn alike(lw: &Lowerer, a: &[BufId], b: &[BufId]) -> bool {
    let bufs = &lw.prog.buffers;
    a.len() == b.len()
        && a.iter().zip(b).all(|(&x, &y)| bufs[x].dtype == bufs[y].dtype && bufs[x].shape == bufs[y].shape)
        && (0..a.len()).all(|i| (0..i).all(|j| (a[i] == a[j]) == (b[i] == b[j])))
}

/// What a kernel reads besides the body from its roots (for [`body_key`]): views of buffers that
/// are no leaf of the body, body inputs it computes from them rather than reads (their names then
/// do not count), and anything else that decides it, in words.
#[derive(Default)]
pub struct More<'a> {
    pub views: Vec<&'a View>,
    pub inputs: Vec<NodeId>,
    pub what: String,
}

/// The first place of each buffer in `cx`'s operand order (the kernel builder lists params in
/// it), for [`body_key`]: a multi-tensor AdamW's order has thousands of buffers.
pub fn order_places(cx: &Ctx) -> HashMap<BufId, usize> {
    let mut at = HashMap::with_capacity(cx.order.len());
    for (i, &b) in cx.order.iter().enumerate() {
        at.entry(b).or_insert(i);
    }
    at
}

/// What decides a kernel the builder makes by inlining `cx`'s body from `roots` down to its leaves
/// (`Lowerer::note` reads the same), as text, and its slots: each node reached, numbered in the
/// order reached, with its op, type and operands; each leaf's view without its buffer, and its
/// buffer's number among the leaves' buffers, type, shape, kind and the name its parameter takes
/// (`KernelBuilder::param`); and the leaves' buffers' order in `places` (the params' order).
/// Equal texts build the same kernel over the slots in the same places.
pub fn body_key(lw: &Lowerer, cx: &Ctx, places: &HashMap<BufId, usize>, roots: &[NodeId], more: &More) -> (String, Vec<BufId>) {
    use std::fmt::Write;
    let mut text = String::new();
    let mut number: HashMap<NodeId, usize> = HashMap::new();
    let mut slots: Vec<BufId> = Vec::new();
    let mut leaf = |text: &mut String, v: &View, at: usize| {
        let slot = slots.iter().position(|&b| b == v.buf).unwrap_or_else(|| {
            slots.push(v.buf);
            slots.len() - 1
        });
        let b = &lw.prog.buffers[v.buf];
        let named = cx.names.get(&v.buf).map(String::as_str).or_else(|| matches!(b.kind, BufKind::Temp).then_some(b.name.as_str()));
        let kind = match b.kind {
            BufKind::Input(..) => 0,
            BufKind::Value => 1,
            BufKind::Temp => 2,
        };
        let _ =
            writeln!(text, "{at} leaf {slot} {:?} {:?} {:?} {:?} {:?} {kind} {named:?}", v.offset, v.shape, v.strides, b.dtype, b.shape);
    };
    // the views the kernel reads besides the body's leaves, and the body inputs it reads through
    // them (an 8-bit moment's codes): numbered first
    for (i, v) in more.views.iter().enumerate() {
        leaf(&mut text, v, i);
    }
    let _ = writeln!(text, "{}", more.what);
    for (i, &n) in more.inputs.iter().enumerate() {
        let _ = writeln!(text, "input {i} {:?}", cx.g.ty(n));
        number.insert(n, more.views.len() + i);
    }
    let at = |number: &HashMap<NodeId, usize>| more.views.len() + number.len();
    // depth first, operands before the node: a node's operands are numbered when it is written
    let mut stack: Vec<(NodeId, bool)> = roots.iter().rev().map(|&r| (r, false)).collect();
    while let Some((n, ready)) = stack.pop() {
        if number.contains_key(&n) {
            continue;
        }
        if let Some(v) = cx.leaves.get(&n) {
            let k = at(&number);
            leaf(&mut text, v, k);
            number.insert(n, k);
            continue;
        }
        let ops = cx.g.operands(n);
        if !ready {
            stack.push((n, true));
            stack.extend(ops.iter().rev().filter(|o| !number.contains_key(o)).map(|&o| (o, false)));
            continue;
        }
        let node = cx.g.node(n);
        let operands: Vec<usize> = ops.iter().map(|o| number[o]).collect();
        let name = if matches!(node.op, Op::Input { .. }) { node.name.as_deref() } else { None };
        let k = at(&number);
        let _ = writeln!(text, "{k} {:?} {:?} {operands:?} {name:?}", node.op, node.ty);
        number.insert(n, k);
    }
    let mut by_place: Vec<usize> = (0..slots.len()).collect();
    by_place.sort_by_key(|&i| (places.get(&slots[i]).copied().unwrap_or(usize::MAX), i));
    let _ = writeln!(text, "places {by_place:?} {:?}", slots.iter().map(|b| places.contains_key(b)).collect::<Vec<_>>());
    (text, slots)
}
