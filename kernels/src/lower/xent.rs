//! The chunked linear + cross-entropy: a fused `cross_entropy.linear` node (egg fusion's
//! `xent-linear` and `xent-linear-fwd` rules, `passes/src/fusion/rules/cross_entropy.rs`) runs
//! chunk by chunk of rows, so no [B*T, V] buffer ever exists (Liger Kernel, Cut Cross-Entropy):
//!
//! ```text
//! bases: chunk c's first row r0 into a one-element buffer of its own (one kernel, run once)
//! for each chunk of R rows r0 .. r1:
//!     GEMM   logits[0..R) = h[r0..r1) @ W^T                   into one [R, V] scratch
//!     kernel per row: max, sum of exp, loss[r0 + i] = max + log(sum) - logits[i, target]
//!                     and (training) dlogits = dloss/N (softmax - onehot), over the logits
//!     GEMM   dh[r0..r1) = dlogits @ W                          (training)
//!     GEMM   dW (+)= dlogits^T @ h[r0..r1)                     (training, when W trains)
//! kernel: loss = (sum of the N row losses in row order) / N
//! ```
//!
//! A weighted cross-entropy (instruction data's per-token weights w) is the same with dloss w[row]
//! for dloss / N and the sum of w[row] times the row losses for their mean.
//!
//! A frozen head (dh the only product) on an executor that runs a row on one thread walks the
//! vocabulary in tiles with an online softmax instead (`xent_online.rs`: the head weight read
//! once per chunk, an [R, Vt] scratch).
//!
//! Where the executor runs a row on one thread in order (`LowerOptions::sequential_rows`: the
//! CPU), the sum pass also writes exp(x - max) over the row and the gradient pass reads it back:
//! one exp per logit instead of two (the row kernels' time -20% on the demo step). Threads that
//! share a row (CUDA) compute it again instead: there a row is rewritten only in its last pass
//! (`inplace::in_place_ok`).
//!
//! Every row is computed exactly as the unchunked kernels compute it (`rows.rs`: the same
//! reductions, the same association), and the loss's row sum runs in one fixed order after the
//! loop, so the loss and dh equal the unchunked step's wherever the logits GEMM gives the same
//! bits on a chunk of rows as on all of them; dW sums its chunks in chunk order (deterministic,
//! but a different association than one GEMM over every row).
//!
//! The row kernel is the same kernel for every chunk: a chunk's first row is not a constant in it
//! but the one element of a buffer the chunk's launch passes (`bases`), so the kernel is compiled
//! once whatever the chunk count (the last chunk, when shorter, is a second kernel).
//!
//! Rows per chunk are the lowering options' (`ce_chunk_rows`: the memory planner's choice,
//! `src/memory/chunk.rs`), else the fusion rule's (the family's `chunk_rows`, printed `chunk=R`:
//! the largest power of two whose [R, V] f32 scratch fits 32 MiB, 128 rows for GPT-2's
//! vocabulary: a GEMM of that many rows runs at full speed on either device; the planner's
//! floor); at most [`MAX_CHUNKS`] chunks.

use std::collections::HashMap;

use qatc_ir::{DType, Graph, NodeId, Op, Phase, Role};

use super::builder::Pos;
use super::repeats::Repeats;
use super::xent_head::{find, online, packed, rows_per_chunk, Head};
pub use super::xent_head::{planned, Planned, MAX_CHUNKS};
use super::{Ctx, Lowerer, CE_CHUNK_FIRST_ROW, CE_CHUNK_SCRATCH, CE_TILE_FIRST_COL};
use crate::error::KernelError;
use crate::kir::{BinOp, Expr, Ix, Kernel, ReduceOp, RowMapping, Space, Ty, UnOp};
use crate::program::{BufId, BufKind, CeChunking, Gemm, GemmTypes, View};

/// `g` with its operands' and destination's element types, read off their buffers.
fn typed(lw: &Lowerer, mut g: Gemm) -> Gemm {
    let dtype = |v: &View| lw.prog.buffers[v.buf].dtype;
    g.types = GemmTypes { a: dtype(&g.a), b: dtype(&g.b), c: dtype(&g.c), bias: g.bias.as_ref().map(dtype) };
    g
}

/// A value of the lowered node: the whole (an evaluation's loss) or its packed parts.
pub enum Lowered {
    Value(View),
    /// (start, length) along the pack's axis 0 -> where that part lives.
    Parts(Vec<(usize, usize, View)>),
}

fn f(v: f64) -> Expr {
    Expr::f32(v)
}

/// Lowers a `cross_entropy.linear` node chunk by chunk, `chunk_rows` rows at a time (the
/// planner's choice, or the family's); None when its body is not the pattern (it is then lowered
/// as any fused node, with its logits materialized).
pub fn lower(
    lw: &mut Lowerer,
    g: &Graph,
    id: NodeId,
    body: &Graph,
    operands: &[View],
    chunk_rows: usize,
) -> Result<Option<Lowered>, KernelError> {
    let Some(mut cx) = bound(body, operands) else { return Ok(None) };
    let Some(head) = find(body, |n| cx.leaves.contains_key(&n)) else { return Ok(None) };
    let root =
        body.output("out").ok_or_else(|| KernelError::Unsupported { node: g.describe(id), why: "body has no output `out`".into() })?;
    let Some(parts) = packed(body, root, &head) else { return Ok(None) };
    // the pack's type: a 16-bit product widened into an f32 pack is written as f32 (the GEMM's
    // f32 sums rounded once, to f32; the graph's cast of the part rounds them to its type)
    let pack_dtype = body.ty(root).dtype;
    let ch = Chunking::new(lw, body, &head, chunk_rows);
    let (n, v, r) = (ch.n, ch.v, ch.r);

    // buffers: the chunk scratch, the row losses, each chunk's first row, and the results
    // the chunk's logits as the graph types them (16-bit under --precision: rounded as the
    // unchunked GEMM rounds them), the row kernel's sums in f32 either way
    let scratch_dtype = if ch.online { DType::F32 } else { ch.logits_dtype };
    let scratch = lw.buffer(CE_CHUNK_SCRATCH.into(), scratch_dtype, &[r, ch.tile], BufKind::Temp, Role::temporary(ch.phase));
    let losses = lw.buffer("ce_rows".into(), DType::F32, &[n], BufKind::Temp, Role::temporary(Phase::Forward));
    let bases = starts(
        lw,
        &mut cx,
        Starts {
            buffer: CE_CHUNK_FIRST_ROW,
            param: "first_row",
            family: "cross_entropy.chunk_rows",
            what: ("row", "chunks"),
            count: ch.chunks,
            step: r,
            phase: Phase::Forward,
        },
    )?;
    let (loss_buf, results) = result_buffers(lw, g, id, body, &head, &parts, pack_dtype);
    lw.prog.cross_entropy.push(CeChunking {
        rows: n,
        vocab: v,
        chunk_rows: r,
        tile_cols: ch.tile,
        with_grad: ch.with_grad,
        elem_bytes: scratch_dtype.bytes_for(1),
    });

    let (hv, wv) = (cx.leaves[&head.h].clone(), cx.leaves[&head.w].clone());
    if ch.online {
        let grad = match (head.dloss, &head.products[..]) {
            (Some(dloss), [(dh, _)]) => Some((dloss, &results[dh])),
            _ => None,
        };
        let count = v.div_ceil(ch.tile);
        let tile_starts = starts(
            lw,
            &mut cx,
            Starts {
                buffer: CE_TILE_FIRST_COL,
                param: "first_col",
                family: "cross_entropy.tile_cols",
                what: ("column", "tiles"),
                count,
                step: ch.tile,
                phase: ch.phase,
            },
        )?;
        let o = super::xent_online::Online {
            tile_starts: &tile_starts,
            h: &hv,
            w: &wv,
            targets: head.targets,
            grad,
            weights: head.weights,
            losses: &losses,
            c_dim: hv.shape[1],
            phase: ch.phase,
            scratch: &scratch,
            n,
            vocab: v,
        };
        let mut rep = Repeats::default();
        for (c, base) in bases.iter().enumerate() {
            super::xent_online::chunk(lw, &cx, &o, &mut rep, base, (c * r, ((c + 1) * r).min(n)))?;
        }
    }
    let mut rep = Repeats::default();
    for (c, base) in bases.iter().enumerate().filter(|_| !ch.online) {
        let rows = (c * r, ((c + 1) * r).min(n));
        let whole = Whole { head: &head, scratch: &scratch, losses: &losses, results: &results, h: &hv, w: &wv };
        whole_rows_chunk(lw, &cx, &ch, &whole, &mut rep, c, base, rows)?;
    }
    mean_loss(lw, &cx, &losses, &loss_buf, n, head.weights)?;
    if root == head.loss {
        return Ok(Some(Lowered::Value(loss_buf)));
    }
    let out = parts.iter().map(|&(p, start, len)| (start, len, results[&p].clone())).collect();
    Ok(Some(Lowered::Parts(out)))
}

/// The body's inputs `in0, in1, ..` bound to the node's operands; None when one is missing.
fn bound<'g>(body: &'g Graph, operands: &[View]) -> Option<Ctx<'g>> {
    let mut cx = Ctx { g: body, leaves: HashMap::new(), names: HashMap::new(), order: operands.iter().map(|v| v.buf).collect() };
    for (i, v) in operands.iter().enumerate() {
        let inp = body.find_input(&format!("in{i}"))?;
        cx.names.entry(v.buf).or_insert(format!("in{i}"));
        cx.leaves.insert(inp, v.clone());
    }
    Some(cx)
}

/// How a head's N rows of V logits are taken: `r` rows per chunk, and where `online` the
/// vocabulary in tiles of `tile` columns.
struct Chunking {
    n: usize,
    v: usize,
    r: usize,
    chunks: usize,
    with_grad: bool,
    /// The phase the chunk scratch lives in (the backward's when training).
    phase: Phase,
    logits_dtype: DType,
    online: bool,
    tile: usize,
}

impl Chunking {
    fn new(lw: &Lowerer, body: &Graph, head: &Head, chunk_rows: usize) -> Chunking {
        let (n, v) = (body.ty(head.logits).shape.0[0], body.ty(head.logits).shape.0[1]);
        let r = rows_per_chunk(n, chunk_rows);
        let with_grad = head.grad.is_some();
        let phase = if with_grad { Phase::Backward } else { Phase::Forward };
        // a frozen head (dh the one product, W its operand as stored) or a forward alone
        // (evaluation) on one thread per row: the vocabulary in tiles with an online softmax
        // (`xent_online.rs`) (f32 logits only: the tiles hold f32 logits, which 16-bit logits are not)
        let logits_dtype = body.ty(head.logits).dtype;
        let online = online(body, head, &lw.options);
        let tile = if online { super::xent_online::tile_cols(r, v, lw.options.ce_tile_cols) } else { v };
        Chunking { n, v, r, chunks: n.div_ceil(r), with_grad, phase, logits_dtype, online, tile }
    }
}

/// The buffers of the results: the loss, and each gradient product (in the pack's type where a
/// 16-bit product is widened into an f32 pack).
fn result_buffers(
    lw: &mut Lowerer,
    g: &Graph,
    id: NodeId,
    body: &Graph,
    head: &Head,
    parts: &[(NodeId, usize, usize)],
    pack_dtype: DType,
) -> (View, HashMap<NodeId, View>) {
    let name = g.node(id).name.clone().unwrap_or_else(|| "loss".into());
    let loss_shape = body.ty(head.loss).shape.0.clone();
    let loss_buf = lw.buffer(name, DType::F32, &loss_shape, BufKind::Value, Role::temporary(Phase::Forward));
    let mut results: HashMap<NodeId, View> = HashMap::from([(head.loss, loss_buf.clone())]);
    for &(p, acc) in &head.products {
        let ty = body.ty(p).clone();
        let pname = body
            .node(p)
            .name
            .clone()
            .unwrap_or_else(|| format!("{}.{}", g.node(id).name.as_deref().unwrap_or("xent"), if acc { "dW" } else { "dh" }));
        let category = if acc { qatc_ir::Category::Gradients } else { qatc_ir::Category::Temporaries };
        let dtype = if pack_dtype != ty.dtype && parts.iter().any(|q| q.0 == p) { pack_dtype } else { ty.dtype };
        let buf = lw.buffer(pname, dtype, &ty.shape.0, BufKind::Value, Role { category, phase: Phase::Backward });
        results.insert(p, buf);
    }
    (loss_buf, results)
}

/// What a chunk of whole rows reads and writes: the head, the chunk's scratch, the row losses,
/// the results' buffers, and h and W.
struct Whole<'a> {
    head: &'a Head,
    scratch: &'a View,
    losses: &'a View,
    results: &'a HashMap<NodeId, View>,
    h: &'a View,
    w: &'a View,
}

/// Chunk `c`, rows `r0..r1` (its first row in `base`), of whole rows: its logits by a GEMM into
/// the scratch, the row kernel (the row losses, and the gradient over the logits), then its part
/// of each gradient product.
#[allow(clippy::too_many_arguments)]
fn whole_rows_chunk(
    lw: &mut Lowerer,
    cx: &Ctx,
    ch: &Chunking,
    x: &Whole,
    rep: &mut Repeats<usize>,
    c: usize,
    base: &View,
    (r0, r1): (usize, usize),
) -> Result<(), KernelError> {
    let (body, v) = (cx.g, ch.v);
    let swap = |x: &View| x.transpose(&[1, 0]);
    let rc = r1 - r0;
    let chunk = x.scratch.slice(0, 0, rc);
    let h_rows = x.h.slice(0, r0, r1);
    let k = x.h.shape[1];
    lw.push_gemm(typed(
        lw,
        Gemm {
            a: h_rows.clone(),
            b: swap(x.w),
            c: chunk.clone(),
            m: rc,
            n: v,
            k,
            alpha: 1.0,
            accumulate: false,
            bias: None,
            note: format!("logits of rows {r0}..{r1} (chunk {c} of {})", ch.chunks),
            types: GemmTypes::F32,
        },
    ));
    // by the chunk's rows: the first row comes from `base`, all else is the node's
    rep.launch(lw, rc, &[base.buf], None, |lw| row_kernel(lw, cx, x.head, x.scratch, x.losses, base, (rc, ch.n, v)))?;
    for &(p, acc) in &x.head.products {
        let dest = &x.results[&p];
        let ops = body.operands(p);
        let Op::MatMul { tb, .. } = body.node(p).op else { continue };
        let gemm = if acc {
            // dW [V, C] += dlogits^T [V, rc] @ h[r0..r1) [rc, C]
            Gemm {
                a: swap(&chunk),
                b: h_rows.clone(),
                c: dest.clone(),
                m: v,
                n: h_rows.shape[1],
                k: rc,
                alpha: 1.0,
                accumulate: c > 0,
                bias: None,
                note: format!("dW += dlogits^T h, rows {r0}..{r1}"),
                types: GemmTypes::F32,
            }
        } else {
            // dh[r0..r1) = dlogits [rc, V] @ X [V, C]
            let xv = cx.leaves[&ops[1]].clone();
            let b = if tb { swap(&xv) } else { xv };
            let cols = b.shape[1];
            Gemm {
                a: chunk.clone(),
                b,
                c: dest.slice(0, r0, r1),
                m: rc,
                n: cols,
                k: v,
                alpha: 1.0,
                accumulate: false,
                bias: None,
                note: format!("dh = dlogits W, rows {r0}..{r1}"),
                types: GemmTypes::F32,
            }
        };
        lw.push_gemm(typed(lw, gemm));
    }
    Ok(())
}

/// The loss: the row losses summed in row order, over N (as the unchunked kernel).
fn mean_loss(lw: &mut Lowerer, cx: &Ctx, losses: &View, loss_buf: &View, n: usize, weights: Option<NodeId>) -> Result<(), KernelError> {
    let mut kb = lw.kb_rows(cx, 1, &[losses, loss_buf]);
    let (lp, j) = kb.open_loop(Expr::Int(n as i64), n);
    let x = kb.load_view(losses, &Pos::Lin(j.clone()));
    let x = match weights {
        Some(w) => Expr::bin(BinOp::Mul, kb.value(w, &Pos::Lin(j))?, x),
        None => x,
    };
    let total = kb.close_reduce(lp, ReduceOp::Sum, Ty::F32, x);
    kb.name(&total, "total");
    let (loss, note) = match weights {
        Some(_) => (total, "loss = weighted sum of the row losses"),
        None => (Expr::bin(BinOp::Div, total, f(n as f64)), "loss = mean of the row losses"),
    };
    kb.store_view(loss_buf, &Pos::Lin(Expr::Int(0)), loss);
    launch!(lw, kb, "cross_entropy", Space::Rows { rows: 1, mapping: RowMapping::Block }, note.into())
}

/// Where each of `count` parts begins (`step` apart: a chunk's first row, a tile's first column).
struct Starts<'a> {
    /// Buffer names: prefix, part number, suffix.
    buffer: (&'a str, &'a str),
    /// The one parameter name a kernel takes any of them as.
    param: &'a str,
    /// The filling kernel's family, and what a start is of what, in its note ("row", "chunks").
    family: &'a str,
    what: (&'a str, &'a str),
    count: usize,
    step: usize,
    phase: Phase,
}

/// Each part's start in a one-element i32 buffer of its own, all filled by one kernel (run once):
/// a kernel that takes one of them (under one parameter name) is one kernel for every part,
/// where a constant start would make a kernel per part.
fn starts(lw: &mut Lowerer, cx: &mut Ctx, s: Starts) -> Result<Vec<View>, KernelError> {
    let (prefix, suffix) = s.buffer;
    let bufs: Vec<View> = (0..s.count)
        .map(|i| lw.buffer(format!("{prefix}{i}{suffix}"), DType::I32, &[1], BufKind::Temp, Role::temporary(s.phase)))
        .collect();
    for b in &bufs {
        cx.names.insert(b.buf, s.param.into());
    }
    let touched: Vec<&View> = bufs.iter().collect();
    let mut kb = lw.kb_elements(cx, &[1], &touched);
    for (i, b) in bufs.iter().enumerate() {
        kb.store_view(b, &Pos::Lin(Expr::Int(0)), Expr::Int((i * s.step) as i64));
    }
    let note = format!("the first {} of each of {} {}", s.what.0, s.count, s.what.1);
    launch!(lw, kb, s.family, Space::Elements { shape: vec![1] }, note)?;
    Ok(bufs)
}

/// One chunk's row kernel: row i of the scratch is global row base + i.
#[allow(clippy::too_many_arguments)]
fn row_kernel(
    lw: &Lowerer,
    cx: &Ctx,
    head: &Head,
    scratch: &View,
    losses: &View,
    base: &View,
    (rc, n, v): (usize, usize, usize),
) -> Result<(Kernel, Vec<BufId>), KernelError> {
    // a row on one thread, in order: the sum pass keeps exp(x - max) for the gradient pass (in
    // f32 logits only: 16-bit ones would round it)
    let exp_once = lw.options.sequential_rows && head.grad.is_some() && lw.prog.buffers[scratch.buf].dtype == DType::F32;
    let mut kb = lw.kb_rows(cx, rc, &[scratch, losses, base]);
    let b = kb.load_view(base, &Pos::Lin(Expr::Int(0)));
    let b = kb.to_index(b);
    let row = kb.bind(kb.index_ty, kb.bounds.add(b, Expr::Ix(Ix::Row)));
    kb.name(&row, "row_n");
    let at = |kb: &super::builder::KernelBuilder, j: Expr| Pos::Lin(kb.bounds.add(kb.bounds.mul(Expr::Ix(Ix::Row), v as i64), j));
    let target = kb.value(head.targets, &Pos::Lin(row.clone()))?;
    let clamped = Expr::bin(BinOp::Min, Expr::bin(BinOp::Max, target.clone(), Expr::Int(0)), Expr::Int(v as i64 - 1));
    let t = kb.bind(Ty::I32, clamped);
    let t = kb.to_index(t);
    let p = at(&kb, t);
    // the target's logit, read before the row is rewritten (named, so it stays a value read
    // here, not a load inlined where the loss is stored)
    let xt = kb.load_view(scratch, &p);
    let xt = kb.bind(Ty::F32, xt);
    kb.name(&xt, "target_logit");
    // the row's max and sum of exp(x - max), as rows.rs computes them
    let (lp, j) = kb.open_loop(Expr::Int(v as i64), v);
    let p = at(&kb, j);
    let x = kb.load_view(scratch, &p);
    let max = kb.close_reduce(lp, ReduceOp::Max, Ty::F32, x);
    let (lp, j) = kb.open_loop(Expr::Int(v as i64), v);
    let p = at(&kb, j);
    let x = kb.load_view(scratch, &p);
    let e = kb.bind(Ty::F32, Expr::un(UnOp::Exp, Expr::bin(BinOp::Sub, x, max.clone())));
    if exp_once {
        kb.store_view(scratch, &p, e.clone());
    }
    let sum = kb.close_reduce(lp, ReduceOp::Sum, Ty::F32, e);
    kb.name(&max, "row_max");
    kb.name(&sum, "row_sum");
    let loss = Expr::bin(BinOp::Sub, Expr::bin(BinOp::Add, max.clone(), Expr::un(UnOp::Log, sum.clone())), xt);
    kb.store_view(losses, &Pos::Lin(row.clone()), loss);
    let family = match (head.grad, head.dloss) {
        (Some(_), Some(dloss)) => {
            // dlogits = dloss / N * (softmax(row) - onehot(target)), over the row (dloss times
            // the row's weight for a weighted cross-entropy)
            let dl = kb.value(dloss, &Pos::Coords(vec![]))?;
            let k = match head.weights {
                Some(w) => Expr::bin(BinOp::Mul, dl, kb.value(w, &Pos::Lin(row.clone()))?),
                None => Expr::bin(BinOp::Div, dl, f(n as f64)),
            };
            let k = kb.bind(Ty::F32, k);
            kb.name(&k, "k");
            let (lp, j) = kb.open_loop(Expr::Int(v as i64), v);
            let p = at(&kb, j.clone());
            let x = kb.load_view(scratch, &p);
            // exp(x - max): kept by the sum pass on one thread per row, else computed again
            let e = if exp_once { x } else { Expr::un(UnOp::Exp, Expr::bin(BinOp::Sub, x, max)) };
            let prob = Expr::bin(BinOp::Div, e, sum);
            let hit = Expr::select(Expr::bin(BinOp::Eq, j, target), k.clone(), f(0.0));
            kb.store_view(scratch, &p, Expr::bin(BinOp::Sub, Expr::bin(BinOp::Mul, k, prob), hit));
            kb.close_foreach(lp);
            "cross_entropy.chunk"
        }
        _ => "cross_entropy.chunk_loss",
    };
    let (kernel, args) =
        kb.finish(family, Space::Rows { rows: rc, mapping: RowMapping::Block }, format!("loss (and gradient) of {rc} rows of logits"))?;
    // the gradient overwrites the logits it is computed from: each row read before it is written
    // (by threads sharing the row), or only its own row touched (a row on one thread, in order)
    if let Some(pi) = args.iter().position(|&a| a == scratch.buf) {
        let ok = if exp_once { super::inplace::row_private(&kernel, pi) } else { super::inplace::in_place_ok(&kernel, pi) };
        if kernel.params[pi].write && !ok {
            return Err(KernelError::Internal(format!("{family}: the gradient cannot be written over the chunk's logits")));
        }
    }
    Ok((kernel, args))
}
