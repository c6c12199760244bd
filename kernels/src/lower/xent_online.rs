//! The chunked cross-entropy of a frozen head on an executor that runs a row on one thread
//! (`LowerOptions::sequential_rows`: the CPU), walking the vocabulary in tiles with an online
//! softmax, so the head weight W [V, C] is read once per chunk (twice in `xent.rs`'s form: the
//! logits GEMM, then the gradient GEMM) and the scratch is one [R, Vt] tile, not [R, V]:
//!
//! ```text
//! per chunk of R rows (h_c = h[r0..r1), dh_c = dh[r0..r1)):
//!     kernel per row:  m = -inf, S = 0, x_t = 0, dh_c[row] = 0
//!     per tile of Vt columns v0 .. v1 (W_t = W[v0..v1)):
//!         GEMM   L = h_c W_t^T                                     [R, Vt] scratch
//!         kernel per row: x_t = L[target - v0] where the target is in the tile
//!                         m' = max(m, max L);  c = exp(m - m')
//!                         E = exp(L - m') over L;  S = c S + sum E;  dh_c[row] *= c;  m = m'
//!         GEMM   dh_c += E W_t                                      (W_t still in cache)
//!     kernel per row:  loss[r0 + row] = m + log S - x_t
//!                      dh_c[row] = k dh_c[row] / S - k W[target]   (k = dloss / N, or
//!                                                                   dloss w[row] weighted)
//! ```
//!
//! The same loss and gradient as the whole row's softmax (sum_v exp(x_v - m) W_v / S is
//! softmax(x) W), in another association: within 1e-6 of the unchunked step, not bit for bit.
//! A trainable head (dW) needs each logit's normalized probability, so it keeps `xent.rs`'s form.
//!
//! Without a gradient (evaluation's forward) the same walk keeps only the running max, sum and
//! target logit: no dh, no second GEMM, and the tile is read, not rewritten.

use qatc_ir::{DType, NodeId, Phase, Role};

use super::builder::Pos;
use super::repeats::Repeats;
use super::{Ctx, Lowerer};
use crate::error::KernelError;
use crate::kir::{BinOp, Expr, Ix, Kernel, ReduceOp, RowMapping, Space, Ty, UnOp};
use crate::program::{BufId, BufKind, Gemm, GemmTypes, View};

/// Scratch for one tile of logits: 8 MiB, so a tile and the head weight's tile (at C up to a
/// few hundred) stay in a CPU's last-level cache between the two GEMMs.
pub const TILE_BYTES: usize = 8 << 20;

/// Fewest columns per tile: each tile moves every row's dh (C values) once more, so a tile
/// narrower than this would spend more on that than on its exps.
pub const MIN_TILE_COLS: usize = 1024;

/// Vocabulary columns per tile for chunks of `rows` rows: `given`, else `TILE_BYTES` of f32 (at
/// least `MIN_TILE_COLS`: past 2048 rows the tile grows beyond `TILE_BYTES`, which the planner
/// weighs); at most the vocabulary.
pub fn tile_cols(rows: usize, vocab: usize, given: Option<usize>) -> usize {
    let vocab = vocab.max(1);
    match given {
        Some(t) => t.clamp(1, vocab),
        None => (TILE_BYTES / (4 * rows.max(1))).clamp(MIN_TILE_COLS.min(vocab), vocab),
    }
}

/// What the online form needs from `xent.rs`'s match.
pub struct Online<'a> {
    pub h: &'a View,
    pub w: &'a View,
    pub targets: NodeId,
    /// dloss and dh [N, C] when the gradient is taken; None for a forward alone.
    pub grad: Option<(NodeId, &'a View)>,
    /// The rows' weights of a weighted cross-entropy, else the mean's 1/N.
    pub weights: Option<NodeId>,
    /// The row losses [N].
    pub losses: &'a View,
    /// The head's input's width C.
    pub c_dim: usize,
    /// Where the per-row statistics live (the backward's phase when training).
    pub phase: Phase,
    /// The [R, Vt] scratch.
    pub scratch: &'a View,
    /// Each tile's first column, in a one-element buffer of its own (as a chunk's first row is):
    /// the tile kernel is one kernel whatever the tile.
    pub tile_starts: &'a [View],
    pub n: usize,
    pub vocab: usize,
}

fn f(v: f64) -> Expr {
    Expr::f32(v)
}

/// One chunk, rows r0 .. r1, whose first row is `base`'s one element.
pub fn chunk(
    lw: &mut Lowerer,
    cx: &Ctx,
    o: &Online,
    rep: &mut Repeats<Repeat>,
    base: &View,
    (r0, r1): (usize, usize),
) -> Result<(), KernelError> {
    let rc = r1 - r0;
    let tile = o.scratch.shape[1];
    let c_dim = o.c_dim;
    let stats = |lw: &mut Lowerer, name: &str| lw.buffer(name.into(), DType::F32, &[rc], BufKind::Temp, Role::temporary(o.phase));
    let (m, s, xt) = (stats(lw, "ce_run_max"), stats(lw, "ce_run_sum"), stats(lw, "ce_target_logit"));
    let h_c = o.h.slice(0, r0, r1);
    let at_row = Pos::Lin(Expr::Ix(Ix::Row));

    // m = -inf, S = 0, x_t = 0, dh_c = 0
    rep.launch(lw, Repeat::Init(rc), &[m.buf, s.buf, xt.buf, base.buf], None, |lw| {
        let mut touched = vec![&m, &s, &xt, base];
        touched.extend(o.grad.map(|(_, dh)| dh));
        let mut kb = lw.kb_rows(cx, rc, &touched);
        let row_n = global_row(&mut kb, base);
        kb.store_view(&m, &at_row, f(f64::NEG_INFINITY));
        kb.store_view(&s, &at_row, f(0.0));
        kb.store_view(&xt, &at_row, f(0.0));
        if let Some((_, dh)) = o.grad {
            let (lp, j) = kb.open_loop(Expr::Int(c_dim as i64), c_dim);
            kb.store_view(dh, &Pos::Coords(vec![row_n, j]), f(0.0));
            kb.close_foreach(lp);
        }
        let what = if o.grad.is_some() { "the running max, sum and dh" } else { "the running max and sum" };
        kb.finish("cross_entropy.online_init", Space::Rows { rows: rc, mapping: RowMapping::Block }, format!("{what} of {rc} rows"))
    })?;
    for (t, start) in o.tile_starts.iter().enumerate() {
        let v0 = t * tile;
        let v1 = (v0 + tile).min(o.vocab);
        let vt = v1 - v0;
        let l = o.scratch.slice(0, 0, rc).slice(1, 0, vt);
        let w_t = o.w.slice(0, v0, v1);
        lw.push_gemm(typed(
            lw,
            Gemm {
                a: h_c.clone(),
                b: w_t.transpose(&[1, 0]),
                c: l.clone(),
                m: rc,
                n: vt,
                k: c_dim,
                alpha: 1.0,
                accumulate: false,
                bias: None,
                note: format!("logits of rows {r0}..{r1}, vocabulary {v0}..{v1}"),
                types: GemmTypes::F32,
            },
        ));
        rep.launch(lw, Repeat::Tile(rc, vt), &[m.buf, s.buf, xt.buf, base.buf, start.buf], None, |lw| {
            tile_kernel(lw, cx, o, [base, start], [&l, &m, &s, &xt], (rc, vt))
        })?;
        let Some((_, dh)) = o.grad else { continue };
        let dh_c = dh.slice(0, r0, r1);
        lw.push_gemm(typed(
            lw,
            Gemm {
                a: l,
                b: w_t,
                c: dh_c,
                m: rc,
                n: c_dim,
                k: vt,
                alpha: 1.0,
                accumulate: true,
                bias: None,
                note: format!("dh += exp(logits - max) W, rows {r0}..{r1}, vocabulary {v0}..{v1}"),
                types: GemmTypes::F32,
            },
        ));
    }
    rep.launch(lw, Repeat::Finish(rc), &[m.buf, s.buf, xt.buf, base.buf], None, |lw| finish_kernel(lw, cx, o, base, [&m, &s, &xt], rc))
}

/// The kernels [`chunk`] launches again for every chunk (and tile), by their rows (and columns):
/// all else they read is the node's, the same for every chunk (`repeats.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Repeat {
    Init(usize),
    Tile(usize, usize),
    Finish(usize),
}

/// The chunk's row `Row` as a row of the whole step: its first row (`base`'s one element) + Row.
/// (Through a buffer, not a constant, so one kernel serves every chunk.)
fn global_row(kb: &mut super::builder::KernelBuilder, base: &View) -> Expr {
    let b = kb.load_view(base, &Pos::Lin(Expr::Int(0)));
    let b = kb.to_index(b);
    let row_n = kb.bind(kb.index_ty, kb.bounds.add(b, Expr::Ix(Ix::Row)));
    kb.name(&row_n, "row_n");
    row_n
}

fn typed(lw: &Lowerer, mut g: Gemm) -> Gemm {
    let dtype = |v: &View| lw.prog.buffers[v.buf].dtype;
    g.types = GemmTypes { a: dtype(&g.a), b: dtype(&g.b), c: dtype(&g.c), bias: None };
    g
}

/// One tile's row kernel (see the module doc).
fn tile_kernel(
    lw: &Lowerer,
    cx: &Ctx,
    o: &Online,
    [base, start]: [&View; 2],
    [l, m, s, xt]: [&View; 4],
    (rc, vt): (usize, usize),
) -> Result<(Kernel, Vec<BufId>), KernelError> {
    let c_dim = o.c_dim;
    let mut touched = vec![l, m, s, xt, base, start];
    touched.extend(o.grad.map(|(_, dh)| dh));
    let mut kb = lw.kb_rows(cx, rc, &touched);
    let row2 = |j: Expr| Pos::Coords(vec![Expr::Ix(Ix::Row), j]);
    let at_row = Pos::Lin(Expr::Ix(Ix::Row));
    let row_n = global_row(&mut kb, base);
    let target = kb.value(o.targets, &Pos::Lin(row_n.clone()))?;
    // the target's logit, where it is in this tile (read before the tile is rewritten)
    let v0 = kb.load_view(start, &Pos::Lin(Expr::Int(0)));
    let local = kb.bind(Ty::I32, Expr::bin(BinOp::Sub, target, v0));
    let inside =
        Expr::bin(BinOp::And, Expr::bin(BinOp::Le, Expr::Int(0), local.clone()), Expr::bin(BinOp::Lt, local.clone(), Expr::Int(vt as i64)));
    let clamped = kb.bind(Ty::I32, Expr::bin(BinOp::Min, Expr::bin(BinOp::Max, local, Expr::Int(0)), Expr::Int(vt as i64 - 1)));
    let clamped = kb.to_index(clamped);
    let x_here = kb.load_view(l, &row2(clamped));
    let x_before = kb.load_view(xt, &at_row);
    let x_new = kb.bind(Ty::F32, Expr::select(inside, x_here, x_before));
    kb.name(&x_new, "target_logit");
    // the running max, and the factor that moves what was summed under the old one
    let (lp, j) = kb.open_loop(Expr::Int(vt as i64), vt);
    let x = kb.load_view(l, &row2(j));
    let tile_max = kb.close_reduce(lp, ReduceOp::Max, Ty::F32, x);
    let m_old = kb.load_view(m, &at_row);
    let m_old = kb.bind(Ty::F32, m_old);
    let m_new = kb.bind(Ty::F32, Expr::bin(BinOp::Max, m_old.clone(), tile_max));
    kb.name(&m_new, "row_max");
    let moved = kb.bind(Ty::F32, Expr::un(UnOp::Exp, Expr::bin(BinOp::Sub, m_old, m_new.clone())));
    kb.name(&moved, "moved");
    // exp(x - max) over the tile (kept for the gradient's GEMM), and its sum
    let (lp, j) = kb.open_loop(Expr::Int(vt as i64), vt);
    let p = row2(j);
    let x = kb.load_view(l, &p);
    let e = kb.bind(Ty::F32, Expr::un(UnOp::Exp, Expr::bin(BinOp::Sub, x, m_new.clone())));
    if o.grad.is_some() {
        kb.store_view(l, &p, e.clone());
    }
    let tile_sum = kb.close_reduce(lp, ReduceOp::Sum, Ty::F32, e);
    let s_old = kb.load_view(s, &at_row);
    kb.store_view(s, &at_row, Expr::bin(BinOp::Add, Expr::bin(BinOp::Mul, s_old, moved.clone()), tile_sum));
    kb.store_view(m, &at_row, m_new);
    kb.store_view(xt, &at_row, x_new);
    // what dh summed under the old max, moved to the new one
    if let Some((_, dh)) = o.grad {
        let (lp, j) = kb.open_loop(Expr::Int(c_dim as i64), c_dim);
        let p = Pos::Coords(vec![row_n, j]);
        let d = kb.load_view(dh, &p);
        kb.store_view(dh, &p, Expr::bin(BinOp::Mul, d, moved));
        kb.close_foreach(lp);
    }
    let (kernel, args) = kb.finish(
        "cross_entropy.online_tile",
        Space::Rows { rows: rc, mapping: RowMapping::Block },
        format!("online softmax of {rc} rows over {vt} columns of the vocabulary"),
    )?;
    check_rows(&kernel, &args, l.buf)?;
    Ok((kernel, args))
}

/// The chunk's loss and dh from the running max, sum and target logit.
fn finish_kernel(
    lw: &Lowerer,
    cx: &Ctx,
    o: &Online,
    base: &View,
    [m, s, xt]: [&View; 3],
    rc: usize,
) -> Result<(Kernel, Vec<BufId>), KernelError> {
    let c_dim = o.c_dim;
    let mut touched = vec![m, s, xt, o.losses, base];
    if let Some((_, dh)) = o.grad {
        touched.extend([dh, o.w]);
    }
    let mut kb = lw.kb_rows(cx, rc, &touched);
    let at_row = Pos::Lin(Expr::Ix(Ix::Row));
    let row_n = global_row(&mut kb, base);
    let target = kb.value(o.targets, &Pos::Lin(row_n.clone()))?;
    let t = kb.bind(Ty::I32, Expr::bin(BinOp::Min, Expr::bin(BinOp::Max, target, Expr::Int(0)), Expr::Int(o.vocab as i64 - 1)));
    let t = kb.to_index(t);
    let mx = kb.load_view(m, &at_row);
    let sum = kb.load_view(s, &at_row);
    let sum = kb.bind(Ty::F32, sum);
    kb.name(&sum, "row_sum");
    let x_t = kb.load_view(xt, &at_row);
    let loss = Expr::bin(BinOp::Sub, Expr::bin(BinOp::Add, mx, Expr::un(UnOp::Log, sum.clone())), x_t);
    kb.store_view(o.losses, &Pos::Lin(row_n.clone()), loss);
    let Some((dloss, dh)) = o.grad else {
        return kb.finish(
            "cross_entropy.online_finish",
            Space::Rows { rows: rc, mapping: RowMapping::Block },
            format!("loss of {rc} rows from the running softmax"),
        );
    };
    let dl = kb.value(dloss, &Pos::Coords(vec![]))?;
    let k = match o.weights {
        Some(w) => Expr::bin(BinOp::Mul, dl, kb.value(w, &Pos::Lin(row_n.clone()))?),
        None => Expr::bin(BinOp::Div, dl, f(o.n as f64)),
    };
    let k = kb.bind(Ty::F32, k);
    kb.name(&k, "k");
    let (lp, j) = kb.open_loop(Expr::Int(c_dim as i64), c_dim);
    let p = Pos::Coords(vec![row_n, j.clone()]);
    let a = kb.load_view(dh, &p);
    let w_t = kb.load_view(o.w, &Pos::Coords(vec![t, j]));
    let g = Expr::bin(BinOp::Sub, Expr::bin(BinOp::Mul, k.clone(), Expr::bin(BinOp::Div, a, sum)), Expr::bin(BinOp::Mul, k, w_t));
    kb.store_view(dh, &p, g);
    kb.close_foreach(lp);
    kb.finish(
        "cross_entropy.online_finish",
        Space::Rows { rows: rc, mapping: RowMapping::Block },
        format!("loss and dh of {rc} rows from the running softmax"),
    )
}

/// The tile, rewritten in place, stays within each row (the kernel runs a row on one thread, in
/// order: `inplace::row_private`); the per-row statistics and dh are read and written at the
/// row's own elements only.
fn check_rows(kernel: &crate::kir::Kernel, args: &[usize], tile: usize) -> Result<(), KernelError> {
    for (pi, &a) in args.iter().enumerate() {
        if a == tile && kernel.params[pi].write && !super::inplace::row_private(kernel, pi) {
            return Err(KernelError::Internal(format!("{}: a row rewrites another row's elements", kernel.family)));
        }
    }
    Ok(())
}
