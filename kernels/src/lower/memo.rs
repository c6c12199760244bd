//! A fused node's lowering, recorded once and replayed for every node like it.
//!
//! The layers of a GPT-2 step are the same kernels on other buffers: the 124M bf16 step is 529
//! launches of 84 distinct kernels, and the lowering built every launch's kernel afresh before
//! the kernel hash merged them (a third of `qatc plan 1.5B --fit`, which lowers each plan twice).
//! A fused node whose body, operand views, buffers' types and shapes and phase equal an earlier
//! node's lowers to the same steps on its own buffers, so the earlier steps are replayed with
//! the buffers renamed: the operands' and destination's for the earlier ones, fresh scratch for
//! the earlier scratch.
//!
//! What makes the replay the lowering's own result, not a likeness of it:
//! - the key holds everything the lowering of a body reads: the body's ops, types and operand
//!   positions (not its node names, which say the layer and reach the program only through a
//!   dequantization's description, rewritten on replay), the input names, the operand and
//!   destination views, each buffer's type, shape and kind (a scratch buffer's name too, a
//!   parameter's name when unnamed), which operands share a buffer, and the phase; the options
//!   are the memo's own (`NodeMemo::start` clears it when they change);
//! - bodies whose lowering reads the lowering's running state are never recorded: attention
//!   (statistics shared between a layer's kernels) and cross-entropy (row statistics, logits
//!   overwritten in place), found by their ops;
//! - a recording is kept only when the lowering touched nothing but new steps, new scratch
//!   buffers and the dequantization list, and every buffer its steps name is an operand, the
//!   destination or its own scratch.
//!
//! `tests/lower_memo.rs` holds programs lowered with the memo to those lowered without it,
//! field for field, across precisions, optimizers, checkpointing and executors.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;

use qatc_ir::{DType, Graph, NodeId, Op, Phase};

use crate::error::KernelError;
use crate::kir::Kernel;
use crate::program::{BufId, BufKind, Buffer, Materialized, Step, View};

use super::{LowerOptions, Lowerer};

/// Recorded lowerings of fused nodes, by what decides them (module docs). One lives through a
/// whole lowering, or several of one graph (the planner's chunk-size choice lowers it twice).
#[derive(Default)]
pub struct NodeMemo {
    entries: HashMap<Key, Arc<Recorded>>,
    /// The options the recordings were made under (`order` and `ce_chunk_rows` cleared: they
    /// decide which nodes are lowered when, not how one node lowers).
    options: Option<LowerOptions>,
    /// Nodes replayed from a recording, and nodes lowered and recorded.
    pub hits: usize,
    pub recorded: usize,
    /// Kernels launched again from an earlier chunk's or tile's build (`repeats.rs`).
    pub repeats: usize,
    /// Off: every node lowered afresh (the tests' reference).
    pub disabled: bool,
}

impl NodeMemo {
    /// A memo that records and replays nothing.
    pub fn disabled() -> NodeMemo {
        NodeMemo { disabled: true, ..NodeMemo::default() }
    }

    /// Ready for a lowering under `options`: recordings made under others are dropped.
    pub(super) fn start(&mut self, options: &LowerOptions) {
        let own = LowerOptions { order: None, ce_chunk_rows: None, ..options.clone() };
        if self.options.as_ref() != Some(&own) {
            self.entries.clear();
            self.options = Some(own);
        }
    }
}

#[derive(PartialEq, Eq, Hash)]
struct Key {
    family: String,
    /// The body's structure: per node its op, type and operands, an input's name (module docs).
    body: String,
    phase: Phase,
    /// The buffers the node reads and writes, first use first: type, shape, kind and, for a
    /// scratch buffer, its name (a kernel parameter on a scratch buffer is named after it).
    bufs: Vec<(DType, Vec<usize>, u8, Option<String>)>,
    /// The operands' views, then the destinations': (index into `bufs`, offset, shape, strides).
    views: Vec<(usize, usize, Vec<usize>, Vec<usize>)>,
}

/// One lowering as recorded: buffer ids are slots, the key's buffers first, then the scratch
/// buffers it made in order.
struct Recorded {
    buffers: Vec<Buffer>,
    steps: Vec<Step>,
    /// Per launch among `steps`, its kernel and identity (indices differ between programs).
    kernels: Vec<(u64, Kernel)>,
    /// The dequantizations materialized for GEMMs, by the body node they describe.
    materialized: Vec<(NodeId, usize, usize)>,
}

/// Lowers a fused node (`body` on `operands` into `dests`: its destination, or its parts') with
/// `lower`, or replays the recording of a node like it; records a lowering it may replay later.
pub(super) fn lower_or_replay(
    lw: &mut Lowerer,
    family: &str,
    body: &Graph,
    operands: &[View],
    dests: &[&View],
    lower: impl FnOnce(&mut Lowerer) -> Result<(), KernelError>,
) -> Result<(), KernelError> {
    let key = key(lw, family, body, operands, dests);
    if key.as_ref().is_some_and(|(k, ext)| replay(lw, k, ext, body)) {
        return Ok(());
    }
    let mark = Mark::now(lw);
    lower(lw)?;
    if let Some((k, ext)) = key {
        record(lw, k, &ext, &mark, body);
    }
    Ok(())
}

/// Where a lowering stood before a node: what a recording may add to, and what it must not touch.
struct Mark {
    steps: usize,
    buffers: usize,
    materialized: usize,
    state: [usize; 11],
}

fn state(lw: &Lowerer) -> [usize; 11] {
    [
        lw.attn_stats.len(),
        lw.attn_grads.len(),
        lw.attn_v.len(),
        lw.attn_out.len(),
        lw.ce_stats.len(),
        lw.packs.len(),
        lw.absorbed.len(),
        lw.prog.outputs.len(),
        lw.prog.updates.len(),
        lw.prog.splits.len(),
        lw.prog.cross_entropy.len(),
    ]
}

impl Mark {
    fn now(lw: &Lowerer) -> Mark {
        Mark { steps: lw.prog.steps.len(), buffers: lw.prog.buffers.len(), materialized: lw.prog.materialized.len(), state: state(lw) }
    }
}

/// Ops whose lowering reads or writes the lowering's running state (module docs).
fn stateful(op: &Op) -> bool {
    matches!(
        op,
        Op::Softmax { .. }
            | Op::SoftmaxGrad { .. }
            | Op::PackedSoftmax { .. }
            | Op::CrossEntropy
            | Op::CrossEntropyGrad
            | Op::WeightedCrossEntropy
            | Op::WeightedCrossEntropyGrad
    )
}

/// The key of fused node `body` on `operands` into `dests` (its destination, or its parts'), and
/// the buffers it names in the key's order; None when it is not to be recorded.
fn key(lw: &Lowerer, family: &str, body: &Graph, operands: &[View], dests: &[&View]) -> Option<(Key, Vec<BufId>)> {
    if lw.memo.disabled {
        return None;
    }
    let mut text = String::new();
    for id in body.node_ids() {
        let n = body.node(id);
        if stateful(&n.op) {
            return None;
        }
        let ops: Vec<usize> = body.operands(id).iter().map(|o| o.index()).collect();
        let name = if matches!(n.op, Op::Input { .. }) { n.name.as_deref() } else { None };
        // Debug prints every f64 distinctly (-0.0 included), so equal text is equal ops
        let _ = writeln!(text, "{} {:?} {:?} {:?} {:?}", id.index(), n.op, n.ty, ops, name);
    }
    let _ = writeln!(text, "out {:?}", body.output("out").map(|o| o.index()));
    let mut ext: Vec<BufId> = Vec::new();
    let mut bufs = Vec::new();
    let mut views = Vec::new();
    for v in operands.iter().chain(dests.iter().copied()) {
        let slot = match ext.iter().position(|&b| b == v.buf) {
            Some(s) => s,
            None => {
                let b = lw.prog.buffers.get(v.buf)?;
                let (kind, name) = match &b.kind {
                    BufKind::Input(..) => (0, None),
                    BufKind::Value => (1, None),
                    BufKind::Temp => (2, Some(b.name.clone())),
                };
                ext.push(v.buf);
                bufs.push((b.dtype, b.shape.clone(), kind, name));
                ext.len() - 1
            }
        };
        views.push((slot, v.offset, v.shape.clone(), v.strides.clone()));
    }
    Some((Key { family: family.to_string(), body: text, phase: lw.phase, bufs, views }, ext))
}

/// Replays the recording of `key`, if there is one, on the buffers `ext`: whether it did.
fn replay(lw: &mut Lowerer, key: &Key, ext: &[BufId], body: &Graph) -> bool {
    let Some(rec) = lw.memo.entries.get(key).cloned() else { return false };
    let base = lw.prog.buffers.len();
    let slot = |b: BufId| if b < ext.len() { ext[b] } else { base + (b - ext.len()) };
    lw.prog.buffers.extend(rec.buffers.iter().cloned());
    let mut kernels = rec.kernels.iter();
    for s in &rec.steps {
        match s {
            Step::Launch { args, note, .. } => {
                let Some((identity, kernel)) = kernels.next() else { continue };
                let args = args.iter().map(|&b| slot(b)).collect();
                lw.push_known_kernel(*identity, kernel, args, note.clone());
            }
            Step::Gemm(g) => {
                let mut g = g.as_ref().clone();
                g.views_mut().for_each(|v| v.buf = slot(v.buf));
                lw.push_gemm(g);
            }
            // never recorded
            Step::Collective(_) => {}
        }
    }
    for &(node, bytes_read, bytes_written) in &rec.materialized {
        lw.prog.materialized.push(Materialized { what: dequantized(body, node), bytes_read, bytes_written });
    }
    lw.memo.hits += 1;
    true
}

/// How the lowering describes a dequantization it materializes (`fused::operand_view`).
pub(super) fn dequantized(body: &Graph, node: NodeId) -> String {
    format!("dequantize {} -> {}", body.describe(node), body.ty(node))
}

/// Records what the lowering since `mark` did for `key` on the buffers `ext`, if it did nothing
/// a replay could not repeat (module docs).
fn record(lw: &mut Lowerer, key: Key, ext: &[BufId], mark: &Mark, body: &Graph) {
    if state(lw) != mark.state {
        return;
    }
    let slot = |b: BufId| -> Option<BufId> {
        match ext.iter().position(|&e| e == b) {
            Some(s) => Some(s),
            None if b >= mark.buffers => Some(ext.len() + (b - mark.buffers)),
            None => None,
        }
    };
    // A note names a buffer the body reads without a name of its own (the destination, read back
    // as a GEMM sum's epilogue operand): that note is this node's alone. Names only ever flow into
    // text, so a name that appears in no note was put into none.
    let names: Vec<&str> = ext.iter().filter_map(|&b| lw.prog.buffers.get(b)).map(|b| b.name.as_str()).collect();
    let own = |note: &str| names.iter().any(|n| n.is_empty() || note.contains(n));
    if lw.prog.buffers[mark.buffers..].iter().any(|b| b.kind != BufKind::Temp) {
        return;
    }
    let mut steps = Vec::new();
    let mut kernels = Vec::new();
    for s in &lw.prog.steps[mark.steps..] {
        match s {
            Step::Launch { kernel, args, note } => {
                let (Some(k), Some(&identity)) = (lw.prog.kernels.get(*kernel), lw.identities.get(*kernel)) else { return };
                let Some(args) = args.iter().map(|&b| slot(b)).collect::<Option<Vec<_>>>() else { return };
                if own(note) || own(&k.note) {
                    return;
                }
                kernels.push((identity, k.clone()));
                steps.push(Step::Launch { kernel: 0, args, note: note.clone() });
            }
            Step::Gemm(g) => {
                if own(&g.note) {
                    return;
                }
                let mut g = g.as_ref().clone();
                for v in g.views_mut() {
                    let Some(b) = slot(v.buf) else { return };
                    v.buf = b;
                }
                steps.push(Step::Gemm(Box::new(g)));
            }
            Step::Collective(_) => return,
        }
    }
    let mut materialized = Vec::new();
    for m in &lw.prog.materialized[mark.materialized..] {
        let dequant = |n: &NodeId| matches!(body.node(*n).op, Op::Dequantize { .. }) && dequantized(body, *n) == m.what;
        let Some(node) = body.node_ids().into_iter().find(dequant) else { return };
        materialized.push((node, m.bytes_read, m.bytes_written));
    }
    let buffers = lw.prog.buffers[mark.buffers..].to_vec();
    lw.memo.entries.insert(key, Arc::new(Recorded { buffers, steps, kernels, materialized }));
    lw.memo.recorded += 1;
}
