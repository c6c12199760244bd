//! Graph -> [`Program`]: every node of the step becomes kernel launches, a library GEMM or a view.
//!
//! - Inputs are buffers. Shape ops (reshape, transpose, slice, broadcast) become views of their
//!   operand's buffer when that is a strided view, else copy kernels. Constants are inlined into
//!   the kernels that read them and materialized only where a GEMM or an output needs them.
//! - A matmul is a [`Gemm`] on its operands' views (a transpose costs nothing).
//! - An `Op::Kernel` node (egg fusion's output) lowers its body as one kernel where it can:
//!   elementwise and shape ops inline into one pass, a row op takes the elementwise ops before it
//!   as its prologue and after it as its epilogue, causal attention becomes the tiled attention
//!   kernel. What cannot share a kernel is split into several, recorded in `Program::splits`.
//! - Any other node is lowered as if it were a fused node of one op, so everything runs before
//!   fusion exists.
//!
//! This file is the folder's root: it holds what the others share (`Lowerer`, `Ctx`,
//! `elementwise`) and dispatches to them. The others read in one direction, each using only files
//! to its left (`a <- b`: b uses a; `kernels/tests/module_layers.rs` checks this line against
//! their `super::` paths):
//!
//! Layers: tidy/hoist/inplace/overwrite/rounding/memo/repeats/xent_head <- builder <- inline/anchor/attention <- rows/reduce/scatter/adamw8/xent_online <- adamw/xent/fused <- node
//!
//! `builder` builds one kernel (`tidy`, `hoist` and `rounding` clean its body); `inline` computes a node's
//! value at an index; `anchor` is an op lowered into a kernel of its own, which `rows`, `reduce`
//! and `scatter` lower; `fused` splits a fused node at its anchors and routes each to its file
//! (`lower_anchor`), or to `attention`, which gets its operands' views through the function
//! `fused` passes it. `node` lowers one node of the step graph in `lower_with`'s order, handing a
//! fused node to its family's file. `inplace` and `overwrite` say where a result may be written
//! over bytes it replaces (a kernel's own operand; a value that dies at the node, or the input it
//! updates). `memo` replays a fused node's lowering for the nodes like it (the layers); `repeats`
//! launches again a kernel built for an earlier chunk, tile or tensor alike but for a few buffers.

use std::collections::HashMap;

use qatc_ir::{DType, Graph, NodeId, Op, Phase, Role, Roles};

use crate::error::KernelError;
use crate::kir::{Kernel, Space, Ty};
use crate::program::{BufId, BufKind, Buffer, Gemm, Program, Step, View};
use builder::{index_ty_for, KernelBuilder, Source};

/// The name of the scratch buffer a chunked cross-entropy computes one chunk's logits in
/// (`xent.rs`): the plan's picture marks the steps it lives over.
pub const CE_CHUNK_SCRATCH: &str = "ce_chunk_logits";
/// The prefix of every buffer the chunked cross-entropy's lowering makes for itself (`xent.rs`,
/// `xent_online.rs`; its results aside): the chunk scratch, each chunk's first row and each tile's
/// first column, the running statistics, the row losses.
pub const CE_BUFFER_PREFIX: &str = "ce_";
/// The name of each chunk's first-row buffer: `{prefix}{chunk}{suffix}` (as many as chunks).
pub const CE_CHUNK_FIRST_ROW: (&str, &str) = ("ce_chunk", "_row");
/// The name of each tile's first-column buffer (`xent_online.rs`): as many as tiles.
pub const CE_TILE_FIRST_COL: (&str, &str) = ("ce_tile", "_col");

/// Finishes a kernel builder and adds its kernel and launch to the program.
macro_rules! launch {
    ($lw:expr, $kb:expr, $family:expr, $space:expr, $note:expr) => {{
        let built = $kb.finish($family, $space, $note)?;
        $lw.push_kernel(built);
        Ok::<(), KernelError>(())
    }};
}

mod adamw;
mod adamw8;
mod anchor;
mod attention;
pub mod builder;
mod fused;
mod hoist;
pub mod inline;
pub(crate) mod inplace;
pub mod memo;
mod node;
mod overwrite;
mod reduce;
mod repeats;
mod rounding;
mod rows;
mod scatter;
mod tidy;
pub mod xent;
mod xent_head;
mod xent_online;

/// The context of one lowering: the graph being read (the step, or a fused node's body), the nodes
/// of it already in memory, and names for the buffers as kernel parameters.
pub struct Ctx<'g> {
    pub g: &'g Graph,
    pub leaves: HashMap<NodeId, View>,
    pub names: HashMap<BufId, String>,
    /// The operand buffers in operand order (kernel parameters follow it).
    pub order: Vec<BufId>,
}

pub struct Lowerer {
    pub prog: Program,
    /// A kernel's identity (`Kernel::identity`) -> its index in `prog.kernels`: one kernel,
    /// many launches.
    ids: HashMap<u64, usize>,
    /// Each kernel's identity, by its index in `prog.kernels`.
    identities: Vec<u64>,
    /// Fused nodes' lowerings for reuse by nodes like them (`memo.rs`).
    pub memo: memo::NodeMemo,
    /// Attention statistics already computed, by the views they were computed from (buffers are
    /// written once, so equal views hold equal values): lse by [q, k], delta by [q, k, v, dout].
    pub attn_stats: HashMap<Vec<View>, View>,
    /// Attention gradients a one-pass backward (`LowerOptions::attention_one_backward`) computed
    /// before their own nodes were lowered: by [q, k, v, dout] and 0 (dq) or 1 (dk), and by
    /// [q, k, dout] and 2 (dv).
    pub attn_grads: HashMap<(Vec<View>, u8), View>,
    /// The view holding v of each forward attention, by [q, k]: a layer's dv node (which does not
    /// read v) may then launch the one-pass backward when it is the first gradient lowered.
    pub attn_v: HashMap<Vec<View>, View>,
    /// The view holding each forward attention's output, by [q, k]: the backward's delta is then
    /// rowsum(dout * out) (`attention.rs`), not a pass over the scores.
    pub attn_out: HashMap<Vec<View>, View>,
    /// Cross-entropy row statistics (max, sum of exp(x - max)) by the logits view they were
    /// computed from: the loss and its gradient share one pass over the [N, V] logits.
    pub ce_stats: HashMap<View, (View, View)>,
    /// The phase of the node being lowered: the scratch buffers its steps use are its temporaries.
    pub phase: Phase,
    /// Fused nodes whose packed results were lowered into buffers of their own (`xent.rs`,
    /// `adamw.rs`): (start, length, where) per part along the pack's axis 0. Their slices are
    /// views of those buffers; the pack itself is never allocated.
    pub packs: HashMap<NodeId, Vec<Placed>>,
    /// Nodes another node's kernels computed (`adamw8.rs`: an 8-bit moment's requantization,
    /// done by the blockwise AdamW over the state): the view holding each one's value, or None
    /// when nothing reads it.
    pub absorbed: HashMap<NodeId, Option<View>>,
    pub options: LowerOptions,
}

/// A part of a pack as lowered: (start, length, the view that holds it).
pub type Placed = (usize, usize, View);
/// A part of a fused body's packed result: (the part's value node, start, length).
pub type PackPart = (NodeId, usize, usize);

/// The parts of a pack `root` (a concat along axis 0) in order: (operand, start, length along
/// the pack).
pub fn pack_parts(body: &Graph, root: NodeId) -> Vec<PackPart> {
    let mut start = 0;
    let mut parts = Vec::new();
    for p in body.operands(root) {
        let len = body.ty(p).numel();
        parts.push((p, start, len));
        start += len;
    }
    parts
}

/// The value a pack part stands for: the node under its reshape (a reshape into the pack's
/// layout only renames the shape), else the part itself.
pub fn unreshaped(body: &Graph, p: NodeId) -> NodeId {
    match body.node(p).op {
        Op::Reshape { .. } => body.operands(p)[0],
        _ => p,
    }
}

/// Choices the lowering leaves to its caller (the planner).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LowerOptions {
    /// Rows per chunk of a chunked cross-entropy (`xent.rs`); None: the fusion rule's choice.
    pub ce_chunk_rows: Option<usize>,
    /// The order to lower the nodes in, which is the order the program runs them: a
    /// memory-aware schedule (`qatc_passes::plan`'s, which runs a recomputed value just before
    /// the backward step that reads it, not as soon as its operands exist). Nodes it leaves out
    /// are lowered before it (inputs, constants, views) in the graph's topological order.
    /// None: the topological order.
    pub order: Option<Vec<NodeId>>,
    /// Lower a multi-tensor AdamW into its packed buffer, copied over the inputs after the step,
    /// instead of in place (`adamw.rs`): only to compare the two.
    pub adamw_packed: bool,
    /// The executor runs each row of a `Rows` kernel on one thread, its statements in order (the
    /// CPU's, `Device::sequential_rows`), so a row kernel may rewrite its row between passes: the
    /// chunked cross-entropy keeps exp(x - max) from its sum pass for the gradient (`xent.rs`).
    /// False: kernels safe for threads sharing a row (CUDA's block and warp per row).
    pub sequential_rows: bool,
    /// Vocabulary columns per tile of the online cross-entropy (`xent.rs`); None: what
    /// `xent::TILE_BYTES` of scratch holds (tests set a few, to cross many tiles).
    pub ce_tile_cols: Option<usize>,
    /// The attention kernels read q, k, v and dout in the type their buffers hold (f16/bf16
    /// under `--precision`) and write their result into the node's buffer, rounded once at the
    /// store (`attention.rs`): what every target's kernels do (`Target::attention_reads_stored`).
    /// False: f32 kernels on widened copies, the result rounded into the buffer by a copy (the
    /// reference the tests hold the first to). Both give the same bits.
    pub attention_reads_stored: bool,
    /// A layer's attention gradients dq, dk and dv come from one kernel (`AttentionPart::Backward`)
    /// at the first of their nodes, the others' values kept until theirs: where the kernel
    /// computes them blockwise from one pass over the probabilities (the CPU's attention GEMMs,
    /// `Target::attention_one_backward`). False: a kernel per gradient (CUDA's templates).
    pub attention_one_backward: bool,
}

impl Default for Lowerer {
    fn default() -> Lowerer {
        Lowerer {
            prog: Program::default(),
            ids: HashMap::new(),
            identities: Vec::new(),
            memo: memo::NodeMemo::default(),
            attn_stats: HashMap::new(),
            attn_grads: HashMap::new(),
            attn_v: HashMap::new(),
            attn_out: HashMap::new(),
            ce_stats: HashMap::new(),
            phase: Phase::Forward,
            packs: HashMap::new(),
            absorbed: HashMap::new(),
            options: LowerOptions::default(),
        }
    }
}

impl Lowerer {
    pub fn buffer(&mut self, name: String, dtype: DType, shape: &[usize], kind: BufKind, role: Role) -> View {
        self.prog.buffers.push(Buffer { name, dtype, shape: shape.to_vec(), kind, role });
        View::contiguous(self.prog.buffers.len() - 1, shape)
    }

    /// Scratch for the node being lowered: a temporary of its phase.
    pub fn temp(&mut self, name: &str, dtype: DType, shape: &[usize]) -> View {
        let role = Role::temporary(self.phase);
        self.buffer(name.to_string(), dtype, shape, BufKind::Temp, role)
    }

    fn index_ty(&self, cx: &Ctx, touched: &[&View], iterations: usize) -> Ty {
        let leaves = cx.leaves.values().map(|v| self.prog.buffers[v.buf].numel());
        let touched = touched.iter().map(|v| self.prog.buffers[v.buf].numel());
        index_ty_for(leaves.chain(touched).chain([iterations]))
    }

    fn source<'a>(&'a self, cx: &'a Ctx) -> Source<'a> {
        Source { g: cx.g, leaves: &cx.leaves, buffers: &self.prog.buffers, names: &cx.names, order: &cx.order }
    }

    pub fn kb_rows<'a>(&'a self, cx: &'a Ctx, rows: usize, touched: &[&View]) -> KernelBuilder<'a> {
        let ty = self.index_ty(cx, touched, rows.saturating_mul(1024));
        KernelBuilder::rows(self.source(cx), ty, rows)
    }

    pub fn kb_elements<'a>(&'a self, cx: &'a Ctx, shape: &[usize], touched: &[&View]) -> KernelBuilder<'a> {
        let ty = self.index_ty(cx, touched, shape.iter().product());
        KernelBuilder::elements(self.source(cx), ty, shape)
    }

    pub fn push_kernel(&mut self, (kernel, args): (Kernel, Vec<BufId>)) {
        let note = kernel.note.clone();
        let id = self.intern(kernel.identity(), || kernel);
        self.prog.steps.push(Step::Launch { kernel: id, args, note });
    }

    /// [`Lowerer::push_kernel`] for a kernel whose identity is known (`memo.rs`'s replay).
    pub fn push_known_kernel(&mut self, identity: u64, kernel: &Kernel, args: Vec<BufId>, note: String) {
        let id = self.intern(identity, || kernel.clone());
        self.prog.steps.push(Step::Launch { kernel: id, args, note });
    }

    /// The index of the kernel of `identity` in `prog.kernels`, added (`kernel()`) if new.
    fn intern(&mut self, identity: u64, kernel: impl FnOnce() -> Kernel) -> usize {
        let next = self.prog.kernels.len();
        let id = *self.ids.entry(identity).or_insert(next);
        if id == next {
            self.prog.kernels.push(kernel());
            self.identities.push(identity);
        }
        id
    }

    pub fn push_gemm(&mut self, gemm: Gemm) {
        self.prog.steps.push(Step::Gemm(Box::new(gemm)));
    }

    /// What a kernel computes, as an expression over its operands (no node names, so the note
    /// is the same for every layer that shares the kernel).
    pub fn note(&self, cx: &Ctx, node: NodeId, epilogue: Option<NodeId>) -> String {
        let root = epilogue.unwrap_or(node);
        let mut budget = 12;
        format!("{} = {}", cx.g.ty(root), self.expr_note(cx, root, &mut budget))
    }

    fn expr_note(&self, cx: &Ctx, n: NodeId, budget: &mut i32) -> String {
        if let Some(v) = cx.leaves.get(&n) {
            return cx.names.get(&v.buf).cloned().unwrap_or_else(|| self.prog.buffers[v.buf].name.clone());
        }
        let node = cx.g.node(n);
        match &node.op {
            Op::Const { value, .. } => return format!("{value}"),
            Op::Input { .. } => return node.name.clone().unwrap_or_default(),
            _ => {}
        }
        if *budget <= 0 {
            return "..".into();
        }
        *budget -= 1;
        let args: Vec<String> = cx.g.operands(n).into_iter().map(|o| self.expr_note(cx, o, budget)).collect();
        format!("{}({})", node.op.mnemonic(), args.join(", "))
    }
}

/// Parameter names by operand role, so a kernel of one op reads `layernorm(x, gamma, beta, out)`.
fn role_names(op: &Op) -> &'static [&'static str] {
    match op {
        Op::LayerNorm { .. } => &["x", "gamma", "beta"],
        Op::LayerNormGradX { .. } => &["x", "gamma", "dy"],
        Op::LayerNormGradGamma { .. } => &["x", "dy"],
        Op::SoftmaxGrad { .. } => &["y", "dy"],
        Op::PackedSoftmax { .. } => &["x", "positions"],
        Op::CrossEntropy => &["logits", "targets"],
        Op::CrossEntropyGrad => &["logits", "targets", "dloss"],
        Op::WeightedCrossEntropy => &["logits", "targets", "weights"],
        Op::WeightedCrossEntropyGrad => &["logits", "targets", "weights", "dloss"],
        Op::Dequantize { .. } => &["codes", "scales", "zeros"],
        Op::FakeQuantLearned { .. } => &["w", "scales", "zeros"],
        Op::FakeQuantLearnedGrad { spec, .. } if spec.scheme.has_zero_point() => &["w", "scales", "zeros", "dy"],
        Op::FakeQuantLearnedGrad { .. } => &["w", "scales", "dy"],
        Op::Gather => &["table", "ids"],
        Op::ScatterAdd { .. } => &["ids", "dy"],
        Op::Dropout { .. } => &["x", "seed"],
        Op::AdamM { .. } => &["m", "g"],
        Op::AdamV { .. } => &["v", "g"],
        Op::AdamParam { .. } => &["p", "m", "v", "lr", "step"],
        Op::BlockDequant { .. } => &["codes", "absmax"],
        Op::BlockQuant { .. } => &["x", "absmax"],
        Op::Binary(_) => &["a", "b"],
        _ => &["x"],
    }
}

fn buffer_name(g: &Graph, id: NodeId) -> String {
    g.node(id).name.clone().unwrap_or_else(|| format!("t{}", id.index()))
}

/// Lowers a whole graph (a verified one: types are trusted).
pub fn lower(g: &Graph) -> Result<Program, KernelError> {
    lower_with(g, &LowerOptions::default())
}

/// `order` completed to every node of `g`, checked to be topological: the inputs and constants
/// it leaves out first, then `order`, then any other node it leaves out, each in topological
/// order.
fn lowering_order(g: &Graph, order: Option<&[NodeId]>) -> Result<Vec<NodeId>, KernelError> {
    let topo = g.topo_order()?;
    let Some(order) = order else { return Ok(topo) };
    let listed: std::collections::HashSet<NodeId> = order.iter().copied().collect();
    let leaf = |n: &NodeId| matches!(g.node(*n).op, Op::Input { .. } | Op::Const { .. });
    let mut out: Vec<NodeId> = topo.iter().copied().filter(|n| !listed.contains(n) && leaf(n)).collect();
    out.extend_from_slice(order);
    out.extend(topo.iter().copied().filter(|n| !listed.contains(n) && !leaf(n)));
    let mut seen = std::collections::HashSet::with_capacity(out.len());
    for &n in &out {
        if !g.contains(n) || !g.operands(n).iter().all(|o| seen.contains(o)) || !seen.insert(n) {
            return Err(KernelError::Internal(format!("the lowering order is not a topological order of the graph at {}", g.describe(n))));
        }
    }
    Ok(out)
}

/// Whether every reader of the pack `id` takes one whole part of it (a slice along axis 0), so
/// the pack itself need not exist.
fn read_by_parts(g: &Graph, id: NodeId, parts: &[(NodeId, usize, usize)]) -> bool {
    !g.outputs().iter().any(|o| o.node == id)
        && g.users(id).into_iter().all(|u| match g.node(u).op {
            Op::Slice { axis: 0, start, end } => g.operands(u) == [id] && parts.iter().any(|&(_, s, l)| s == start && s + l == end),
            _ => false,
        })
}

/// The part of a pack lowered part by part that `start..end` along its axis 0 is, as a flat view.
fn pack_part(lw: &Lowerer, pack: NodeId, start: usize, end: usize) -> Option<View> {
    let parts = lw.packs.get(&pack)?;
    let (_, len, v) = parts.iter().find(|(s, l, _)| *s == start && s + l == end)?;
    v.reshape(&[*len])
}

/// [`lower`] with the planner's choices.
pub fn lower_with(g: &Graph, options: &LowerOptions) -> Result<Program, KernelError> {
    lower_with_memo(g, options, &mut memo::NodeMemo::default())
}

/// [`lower_with`] reusing (and adding to) `memo`'s recorded node lowerings: several lowerings of
/// one graph (the planner's chunk sizes) lower each kind of node once.
pub fn lower_with_memo(g: &Graph, options: &LowerOptions, memo: &mut memo::NodeMemo) -> Result<Program, KernelError> {
    memo.start(options);
    let mut lw = Lowerer { options: options.clone(), memo: std::mem::take(memo), ..Lowerer::default() };
    let lowered = lower_into(&mut lw, g);
    *memo = std::mem::take(&mut lw.memo);
    lowered.map(|()| lw.prog)
}

fn lower_into(lw: &mut Lowerer, g: &Graph) -> Result<(), KernelError> {
    let mut values: HashMap<NodeId, View> = HashMap::new();
    let node_roles = Roles::of(g);
    for id in lowering_order(g, lw.options.order.as_deref())? {
        node::lower(lw, g, id, &mut values, &node_roles)?;
    }
    for o in g.outputs() {
        lw.phase = node_roles.phase(g, o.node);
        let v = materialize(lw, g, o.node, &mut values, &node_roles)?;
        if !o.update {
            lw.prog.buffers[v.buf].kind = match &lw.prog.buffers[v.buf].kind {
                BufKind::Temp => BufKind::Value,
                k => k.clone(),
            };
        }
        if o.update {
            lw.prog.updates.push((o.name.clone(), v));
        } else {
            lw.prog.outputs.push((o.name.clone(), v));
        }
    }
    Ok(())
}

/// An op that is not a fused kernel, lowered into `dest`.
fn lower_op(
    lw: &mut Lowerer,
    g: &Graph,
    id: NodeId,
    dest: View,
    values: &mut HashMap<NodeId, View>,
    roles: &Roles,
) -> Result<(), KernelError> {
    let n = g.node(id);
    let mut cx = Ctx { g, leaves: HashMap::new(), names: HashMap::new(), order: Vec::new() };
    let names = role_names(&n.op);
    for (i, &o) in g.operands(id).iter().enumerate() {
        let needs_view = matches!(n.op, Op::MatMul { .. }) || !matches!(g.node(o).op, Op::Const { .. });
        if needs_view {
            let v = materialize(lw, g, o, values, roles)?;
            cx.names.entry(v.buf).or_insert_with(|| names.get(i).copied().unwrap_or("x").to_string());
            cx.order.push(v.buf);
            cx.leaves.insert(o, v);
        }
    }
    let family = n.op.mnemonic().to_string();
    fused::lower_root(lw, &mut cx, id, dest, &family)
}

/// The view a node's value lives in, materializing constants (a fill kernel) and dequantized
/// 8-bit moments left for a blockwise AdamW that did not take them (`adamw8::deferred`) on
/// first need.
fn materialize(lw: &mut Lowerer, g: &Graph, id: NodeId, values: &mut HashMap<NodeId, View>, roles: &Roles) -> Result<View, KernelError> {
    if let Some(v) = values.get(&id) {
        return Ok(v.clone());
    }
    let n = g.node(id);
    if adamw8::deferred(g, id) {
        let dest = lw.buffer(buffer_name(g, id), n.ty.dtype, &n.ty.shape.0, BufKind::Value, roles.role(g, id));
        lower_op(lw, g, id, dest.clone(), values, roles)?;
        values.insert(id, dest.clone());
        return Ok(dest);
    }
    if !matches!(n.op, Op::Const { .. }) {
        return Err(KernelError::Internal(format!("{} is read before it is computed", g.describe(id))));
    }
    let dest = lw.buffer(buffer_name(g, id), n.ty.dtype, &n.ty.shape.0, BufKind::Value, roles.role(g, id));
    let mut cx = Ctx { g, leaves: HashMap::new(), names: HashMap::new(), order: Vec::new() };
    fused::lower_root(lw, &mut cx, id, dest.clone(), "fill")?;
    values.insert(id, dest.clone());
    Ok(dest)
}

/// An Elements kernel computing `root` (inlinable down to the leaves) into `dest`.
fn elementwise(lw: &mut Lowerer, cx: &Ctx, root: NodeId, dest: &View, family: &str) -> Result<(), KernelError> {
    let shape = cx.g.ty(root).shape.0.clone();
    let note = lw.note(cx, root, None);
    let mut kb = lw.kb_elements(cx, &shape, &[dest]);
    let pos = builder::Pos::Lin(crate::kir::Expr::Ix(crate::kir::Ix::Elem));
    let v = kb.value(root, &pos)?;
    kb.store_view(dest, &pos, v);
    launch!(lw, kb, family, Space::Elements { shape }, note)
}
