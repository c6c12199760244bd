//! Dequantization fused into the CPU GEMM's operand feed: a 4-bit weight that `lower`
//! materializes as a whole f32 matrix for the library GEMM (what cuBLAS needs, and what the
//! fusion report prices) is instead dequantized a panel of rows at a time into one scratch of a
//! few MiB, shared by every fed GEMM, which the GEMM packs from while it is still in cache. The
//! f32 copy of the weight never exists: a 4-bit weight costs its half byte per parameter, and
//! the whole step one panel.
//!
//! ```text
//! before:  dequant(codes, scales) -> W f32[R, S]          GEMM c = a @ W   (or a @ W^T)
//! after:   for each panel p of P rows of W:
//!              dequant rows p*P .. p*P+P -> scratch f32[P, S]
//!              GEMM c += a[:, rows] @ scratch               (W's rows are the GEMM's K)
//!           or GEMM c[:, rows] = a @ scratch^T              (W's rows are the GEMM's N)
//! ```
//!
//! The panel kernel is the dequant kernel itself with one change: its store goes to element
//! `(row mod P) * S + col` of the scratch instead of `row * S + col` of W. Its loads still read
//! the whole codes and scales at the global row, so a launch over the element range of one panel
//! fills that panel. This is a CPU rewrite: the CUDA backend keeps the materialized operand,
//! since cuBLAS reads only dense f32/bf16 matrices. The program it leaves is still a plain one
//! (every GEMM reads its operands whole, as the other backends do); which GEMMs are fed, and by
//! what, is a [`PanelTable`] beside it, which the CPU executor holds.

use std::collections::{BTreeMap, HashMap};

use crate::kir::{BinOp, Body, Expr, Ix, Kernel, Space, Stmt};
use qatc_ir::DType;

use crate::program::{BufId, BufKind, Buffer, Gemm, Program, Step, View};

/// How a fed GEMM gets operand b: `kernel` writes rows `r .. r + panel` of the logical weight
/// [rows, cols] into the front of the scratch buffer (`b.buf`, shared by every fed GEMM, at
/// least [panel, cols] long, and the size of the kernel's param) when launched over elements `r * cols .. (r + panel) * cols`; the
/// GEMM then consumes that panel. `b` keeps describing the whole logical weight.
#[derive(Clone, Debug, PartialEq)]
pub struct PanelFeed {
    /// The panel kernel (an index into `Program::kernels`).
    pub kernel: usize,
    /// One buffer per kernel param; the written one is the scratch.
    pub args: Vec<BufId>,
    pub rows: usize,
    pub cols: usize,
    /// Rows per panel; the last panel may be shorter.
    pub panel: usize,
    /// W's rows are the GEMM's K dimension (b = W) rather than its N (b = W^T).
    pub rows_are_k: bool,
}

/// The GEMMs fed panel by panel, by step index in the rewritten program, and how each is fed:
/// the CPU executor's own table (the program's GEMMs stay plain, so no other backend sees a feed).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PanelTable {
    feeds: BTreeMap<usize, PanelFeed>,
}

impl PanelTable {
    /// How step `step` is fed, if it is a fed GEMM.
    pub fn get(&self, step: usize) -> Option<&PanelFeed> {
        self.feeds.get(&step)
    }

    /// The fed steps and their feeds, in step order.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &PanelFeed)> {
        self.feeds.iter().map(|(&s, f)| (s, f))
    }

    pub fn is_empty(&self) -> bool {
        self.feeds.is_empty()
    }

    pub fn len(&self) -> usize {
        self.feeds.len()
    }
}

/// What the rewrite did, one line per fed weight (for `qatc train`'s description and tests).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PanelReport {
    pub lines: Vec<String>,
    /// Bytes of f32 weight copies no longer allocated, and bytes of the one scratch panel.
    pub bytes_saved: usize,
    pub scratch_bytes: usize,
}

/// The rows of a launch's single written buffer, if the kernel is a plain elementwise map over a
/// rank-2 space that stores element `Elem` (or `Coord(0) * S + Coord(1)`) of it and nothing else.
fn dequant_like(k: &Kernel) -> Option<(usize, usize, usize)> {
    let Body::Loops { space: Space::Elements { shape }, stmts } = &k.body else { return None };
    let [rows, cols] = shape[..] else { return None };
    let out: Vec<usize> = k.params.iter().enumerate().filter(|(_, p)| p.write).map(|(i, _)| i).collect();
    let [out] = out[..] else { return None };
    if k.params[out].shape.iter().product::<usize>() != rows * cols {
        return None;
    }
    let mut stores = 0;
    for s in stmts {
        match s {
            Stmt::Let { .. } => {}
            Stmt::Store { param, index, .. } if *param == out && *index == Expr::Ix(Ix::Elem) => stores += 1,
            _ => return None,
        }
    }
    // the output is written, never read back (a load of it would see the scratch layout)
    let mut reads_out = false;
    crate::kir::visit_exprs(stmts, &mut |e| {
        if let Expr::Load { param, .. } = e {
            reads_out |= *param == out;
        }
    });
    (stores == 1 && !reads_out).then_some((out, rows, cols))
}

/// `k` storing into the shared scratch of `scratch` elements (at least [panel, cols]): element
/// (r, c) goes to (r mod panel) * cols + c. The param is the scratch's size, so the launch's
/// buffers match its params exactly, as every launch's do.
fn panel_kernel(k: &Kernel, out: usize, cols: usize, panel: usize, scratch: usize) -> Kernel {
    let mut pk = k.clone();
    pk.family = format!("{}.panel", k.family);
    pk.params[out].shape = vec![scratch];
    pk.note = format!("{} (rows mod {panel}: one panel of the weight at a time)", k.note);
    if let Body::Loops { stmts, .. } = &mut pk.body {
        for s in stmts.iter_mut() {
            if let Stmt::Store { index, .. } = s {
                let row = Expr::bin(BinOp::Rem, Expr::Ix(Ix::Coord(0)), Expr::Int(panel as i64));
                *index = Expr::bin(BinOp::Add, Expr::bin(BinOp::Mul, row, Expr::Int(cols as i64)), Expr::Ix(Ix::Coord(1)));
            }
        }
    }
    pk
}

/// Whether `v` reads the whole of W [rows, cols] as b = W (Some(true)) or b = W^T (Some(false)).
fn weight_view(v: &View, rows: usize, cols: usize) -> Option<bool> {
    if v.offset != 0 || v.shape.len() != 2 {
        return None;
    }
    if v.shape == [rows, cols] && v.strides == [cols, 1] {
        Some(true)
    } else if v.shape == [cols, rows] && v.strides == [1, cols] {
        Some(false)
    } else {
        None
    }
}

/// A dequant launch whose GEMM users can be fed in panels.
struct Found {
    step: usize,
    kernel: usize,
    /// Its written param, and the buffer W behind it ([rows, cols]).
    out: usize,
    w: BufId,
    rows: usize,
    cols: usize,
    panel: usize,
    /// The GEMM steps reading W as b, and whether W's rows are their K.
    users: Vec<(usize, bool)>,
}

/// Rows per panel: as many rows of `dtype` as fit in `max_bytes`, at least one.
fn panel_rows(rows: usize, cols: usize, dtype: DType, max_bytes: usize) -> usize {
    (max_bytes / dtype.bytes_for(cols.max(1))).clamp(1, rows)
}

/// Feeds every qualifying GEMM operand from a panel kernel instead of a materialized weight:
/// the Launch step that writes a buffer W (no graph input or output) by a dequant-like kernel,
/// from graph inputs only, with W read by nothing but later GEMMs as their whole operand b, is
/// removed; W is left empty; each of those GEMMs reads one scratch buffer, `dequant_panel`, which
/// all of them share, and gets a [`PanelFeed`] writing into it, in the table returned. Anything
/// else is left as it was, and everything when `max_panel_bytes` is 0.
pub fn feed_panels(prog: &mut Program, max_panel_bytes: usize) -> (PanelTable, PanelReport) {
    if max_panel_bytes == 0 {
        return (PanelTable::default(), PanelReport::default());
    }
    let found = find(prog, max_panel_bytes);
    let mut report = PanelReport::default();
    let scratches = add_scratches(prog, &found, &mut report);
    let mut panel_ids: HashMap<(usize, usize), usize> = HashMap::new();
    let mut drop_step = vec![false; prog.steps.len()];
    // by step index before the dequant launches are dropped
    let mut feeds: BTreeMap<usize, PanelFeed> = BTreeMap::new();
    for Found { step: si, kernel, out, w, rows, cols, panel, users } in found {
        let Some(&(scratch, scratch_elems)) = scratches.get(&prog.buffers[w].dtype) else { continue };
        let next = prog.kernels.len();
        let pid = *panel_ids.entry((kernel, panel)).or_insert(next);
        if pid == next {
            let pk = panel_kernel(&prog.kernels[kernel], out, cols, panel, scratch_elems);
            prog.kernels.push(pk);
        }
        let Step::Launch { args, .. } = &prog.steps[si] else { continue };
        let mut args = args.clone();
        args[out] = scratch;
        let name = prog.buffers[w].name.clone();
        report.bytes_saved += prog.buffers[w].bytes();
        // nothing refers to W any more: it keeps its number, holding nothing
        prog.buffers[w].shape = vec![0];
        for &(j, rows_are_k) in &users {
            if let Step::Gemm(g) = &mut prog.steps[j] {
                g.b.buf = scratch;
                feeds.insert(j, PanelFeed { kernel: pid, args: args.clone(), rows, cols, panel, rows_are_k });
            }
        }
        drop_step[si] = true;
        report.lines.push(format!("{name}: {rows}x{cols} computed {panel} rows at a time for {} GEMMs", users.len()));
    }
    (drop_steps(prog, &drop_step, feeds), report)
}

/// Per buffer: how many steps write it, and whether anything else uses it (a launch reads it, a
/// GEMM reads it as a, c or bias, or it is an output or an update).
fn writers_and_other_uses(prog: &Program) -> (Vec<usize>, Vec<bool>) {
    let nb = prog.buffers.len();
    let mut writers = vec![0usize; nb];
    let mut other_use = vec![false; nb]; // read by a launch, or as a GEMM's a / c / bias
    for s in &prog.steps {
        match s {
            Step::Launch { kernel, args, .. } => {
                for (p, &b) in prog.kernels[*kernel].params.iter().zip(args) {
                    if p.write {
                        writers[b] += 1;
                    } else {
                        other_use[b] = true;
                    }
                }
            }
            Step::Gemm(g) => {
                writers[g.c.buf] += 1;
                for v in [Some(&g.a), Some(&g.c), g.bias.as_ref()].into_iter().flatten() {
                    other_use[v.buf] = true;
                }
            }
            Step::Collective(c) => {
                writers[c.dst.buf] += 1;
                other_use[c.src.buf] = true;
            }
        }
    }
    for (_, v) in prog.outputs.iter().chain(&prog.updates) {
        other_use[v.buf] = true;
    }
    (writers, other_use)
}

/// The dequant launches whose weight W can be fed in panels (see [`feed_panels`]), with their
/// GEMM users and the rows per panel.
fn find(prog: &Program, max_panel_bytes: usize) -> Vec<Found> {
    let (writers, other_use) = writers_and_other_uses(prog);
    let mut found: Vec<Found> = Vec::new();
    for si in 0..prog.steps.len() {
        let Step::Launch { kernel, args, .. } = &prog.steps[si] else { continue };
        let k = &prog.kernels[*kernel];
        let Some((out, rows, cols)) = dequant_like(k).filter(|&(_, r, c)| r > 0 && c > 0) else { continue };
        let w = args[out];
        let from_inputs = k.params.iter().zip(args).all(|(p, &b)| p.write || matches!(prog.buffers[b].kind, BufKind::Input(..)));
        if !from_inputs || writers[w] != 1 || other_use[w] || matches!(prog.buffers[w].kind, BufKind::Input(..)) {
            continue;
        }
        let users: Vec<(usize, bool)> = (0..prog.steps.len())
            .filter_map(|j| match &prog.steps[j] {
                Step::Gemm(g) if g.b.buf == w => Some((j, if g.batch() == 1 && j > si { weight_view(&g.b, rows, cols) } else { None })),
                _ => None,
            })
            .map(|(j, form)| form.map(|f| (j, f)).ok_or(()))
            .collect::<Result<_, ()>>()
            .unwrap_or_default();
        let dtype = prog.buffers[w].dtype;
        // partial products over K accumulate in c: a f16/bf16 c would round between them, so
        // those GEMMs take the whole weight as one panel (f32 accumulation stays whole)
        let half_k = users.iter().any(|&(j, rows_are_k)| match &prog.steps[j] {
            Step::Gemm(g) => rows_are_k && g.types.c != DType::F32,
            Step::Launch { .. } | Step::Collective(_) => false,
        });
        let panel = if half_k { rows } else { panel_rows(rows, cols, dtype, max_panel_bytes) };
        if !users.is_empty() {
            found.push(Found { step: si, kernel: *kernel, out, w, rows, cols, panel, users });
        }
    }
    found
}

/// One scratch buffer per element type of the weights found, as long as their longest panel
/// (only one panel is live at a time): type -> (buffer, elements). Counted in the report.
fn add_scratches(prog: &mut Program, found: &[Found], report: &mut PanelReport) -> HashMap<DType, (usize, usize)> {
    let mut scratches: HashMap<DType, (usize, usize)> = HashMap::new();
    for f in found {
        let e = scratches.entry(prog.buffers[f.w].dtype).or_insert((0, 0));
        e.1 = e.1.max(f.panel * f.cols);
    }
    let mut types: Vec<DType> = scratches.keys().copied().collect();
    types.sort();
    for d in types {
        let Some(s) = scratches.get_mut(&d) else { continue };
        let name = if d == DType::F32 { "dequant_panel".to_string() } else { format!("dequant_panel_{d}") };
        s.0 = prog.buffers.len();
        prog.buffers.push(Buffer::new(&name, d, &[s.1], BufKind::Temp));
        report.scratch_bytes += prog.buffers[s.0].bytes();
    }
    scratches
}

/// Drops the steps marked in `drop_step` and returns the feeds by the steps' new indices (a
/// step's index less the dropped steps before it).
fn drop_steps(prog: &mut Program, drop_step: &[bool], feeds: BTreeMap<usize, PanelFeed>) -> PanelTable {
    let mut dropped_before = Vec::with_capacity(drop_step.len());
    let mut dropped = 0;
    for &d in drop_step {
        dropped_before.push(dropped);
        dropped += usize::from(d);
    }
    let mut i = 0;
    prog.steps.retain(|_| {
        i += 1;
        !drop_step[i - 1]
    });
    PanelTable { feeds: feeds.into_iter().map(|(j, f)| (j - dropped_before[j], f)).collect() }
}

impl PanelFeed {
    /// The GEMMs that together compute `g` (a GEMM this feeds: operand b the scratch), each with
    /// the element range of the feed launch that must run before it: over K, partial products
    /// accumulate into c (the bias is added by the last); over N, each writes its own columns of c
    /// (and of the bias).
    pub fn panels(&self, g: &Gemm) -> Vec<((usize, usize), Gemm)> {
        let mut out = Vec::new();
        let mut r = 0;
        while r < self.rows {
            let e = (r + self.panel).min(self.rows);
            let scratch = View { buf: g.b.buf, offset: 0, shape: vec![e - r, self.cols], strides: vec![self.cols, 1] };
            let mut part = g.clone();
            if self.rows_are_k {
                part.a = g.a.slice(1, r, e);
                part.b = scratch;
                part.k = e - r;
                part.accumulate = g.accumulate || r > 0;
                if e < self.rows {
                    part.bias = None;
                }
            } else {
                part.b = scratch.transpose(&[1, 0]);
                part.c = g.c.slice(1, r, e);
                part.n = e - r;
                part.bias = g.bias.as_ref().map(|b| b.slice(0, r, e));
            }
            out.push(((r * self.cols, e * self.cols), part));
            r = e;
        }
        out
    }
}
