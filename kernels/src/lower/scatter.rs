//! scatter_add (the embedding gradient) without float atomics, so a step gives the same bits on
//! every run and any thread count. Adding the dy rows of repeated ids into one table row with
//! float atomics (fast) sums them in whatever order the threads arrive, and float addition does
//! not associate. Instead, as llm.c's bucketed encoder backward does, the rows of each id are
//! summed by one thread in token order:
//!
//! ```text
//! count[r] = 0                                   fill
//! count[id(n)] += 1            (integer atomics: the same total in any order)
//! sorted[less(n) + rank(n)] = n, start[id(n)] = less(n) where rank(n) == 0
//!     less(n) = #{m : id(m) < id(n)},  rank(n) = #{m < n : id(m) == id(n)}
//! table = 0                                      fill
//! table[r, c] = sum over k < count[r] of dy[sorted[start[r] + k], c]     in k order, rows hit
//! ```
//!
//! `sorted` lists the tokens by (id, position): a stable counting sort whose positions come from
//! integer counts, so it too is the same on every run. The sums run in token order from zero,
//! as the interpreter's, so the table matches it bit for bit where a backend adds in order.
//! Ids out of range are clamped into the table (the interpreter reports them).

use qatc_ir::DType;

use super::anchor::{emit_out, Anchor};
use super::builder::Pos;
use super::{Ctx, Lowerer};
use crate::error::KernelError;
use crate::kir::{BinOp, Expr, Ix, ReduceOp, RowMapping, Space, Stmt, Ty};

pub fn lower(lw: &mut Lowerer, cx: &Ctx, a: &Anchor, rows: usize) -> Result<(), KernelError> {
    let g = cx.g;
    let note = lw.note(cx, a.node, a.epilogue);
    let ops = g.operands(a.node);
    let (ids, dy) = (ops[0], ops[1]);
    let c = g.ty(a.node).shape.0.last().copied().unwrap_or(1);
    let n = g.ty(ids).numel();
    if rows == 0 || c == 0 {
        return Ok(()); // an empty table: nothing to write
    }
    let count = lw.temp("embed_count", DType::I32, &[rows]);
    let start = lw.temp("embed_start", DType::I32, &[rows]);
    let sorted = lw.temp("embed_sorted", DType::I32, &[n]);
    // clamps a loaded id into the table
    let clamp = |id: Expr| Expr::bin(BinOp::Min, Expr::bin(BinOp::Max, id, Expr::Int(0)), Expr::Int(rows as i64 - 1));

    // count[r] = 0
    let mut kb = lw.kb_elements(cx, &[rows], &[&count]);
    kb.store_view(&count, &Pos::Lin(Expr::Ix(Ix::Elem)), Expr::Int(0));
    launch!(lw, kb, "fill", Space::Elements { shape: vec![rows] }, format!("{note}: zero the id counts"))?;

    // count[id(n)] += 1
    let mut kb = lw.kb_elements(cx, &[n], &[&count]);
    let id = kb.value(ids, &Pos::Lin(Expr::Ix(Ix::Elem)))?;
    let id = kb.bind(Ty::I32, clamp(id));
    let id = kb.to_index(id);
    let p = kb.param(count.buf, true);
    kb.push(Stmt::AtomicAdd { param: p, index: kb.bounds.add(Expr::Int(count.offset as i64), id), value: Expr::Int(1) });
    launch!(lw, kb, "embedding_count", Space::Elements { shape: vec![n] }, format!("{note}: tokens per id"))?;

    // sorted[less + rank] = n; start[id] = less for the first token of each id
    let mut kb = lw.kb_rows(cx, n, &[&sorted, &start]);
    let it = kb.index_ty;
    let id = kb.value(ids, &Pos::Lin(Expr::Ix(Ix::Row)))?;
    let id = kb.bind(Ty::I32, clamp(id));
    let count_where = |kb: &mut super::builder::KernelBuilder, extent: Expr, pred: BinOp| -> Result<Expr, KernelError> {
        let (lp, m) = kb.open_loop(extent, n);
        let other = kb.value(ids, &Pos::Lin(m))?;
        let hit = Expr::bin(pred, clamp(other), id.clone());
        Ok(kb.close_reduce(lp, ReduceOp::Sum, it, Expr::select(hit, Expr::Int(1), Expr::Int(0))))
    };
    let less = count_where(&mut kb, Expr::Int(n as i64), BinOp::Lt)?;
    let rank = count_where(&mut kb, Expr::Ix(Ix::Row), BinOp::Eq)?;
    kb.name(&less, "less");
    kb.name(&rank, "rank");
    kb.store_view(&sorted, &Pos::Lin(Expr::bin(BinOp::Add, less.clone(), rank.clone())), Expr::Ix(Ix::Row));
    // the first token of its id (rank 0) records where the id's run starts: a loop of one
    // iteration or none, the kernel IR's conditional
    let first = Expr::select(Expr::bin(BinOp::Eq, rank, Expr::Int(0)), Expr::Int(1), Expr::Int(0));
    let (lp, _) = kb.open_loop(first, 1);
    let at = kb.to_index(id.clone());
    kb.store_view(&start, &Pos::Lin(at), less);
    kb.close_foreach(lp);
    let space = Space::Rows { rows: n, mapping: RowMapping::Thread };
    launch!(lw, kb, "embedding_sort", space, format!("{note}: tokens sorted by (id, position)"))?;

    // every row of the table zero (through the epilogue, if any), then the rows tokens hit:
    // table[r, col] = sum of dy[sorted[start[r] + k], col] over k < count[r], in order, a row per
    // program (on a GPU a block, its threads over the columns, each summing its column's tokens
    // in order); a row no token hits costs one load
    let mut kb = lw.kb_elements(cx, &[rows, c], &[&a.dest]);
    emit_out(&mut kb, a, Pos::Lin(Expr::Ix(Ix::Elem)), Expr::f32(0.0))?;
    launch!(lw, kb, "fill", Space::Elements { shape: vec![rows, c] }, format!("{note}: zero"))?;
    let mut kb = lw.kb_rows(cx, rows, &[&a.dest, &sorted]);
    let len = kb.load_view(&count, &Pos::Lin(Expr::Ix(Ix::Row)));
    let len = kb.bind(kb.index_ty, kb.to_index(len));
    let hit = Expr::select(Expr::bin(BinOp::Lt, Expr::Int(0), len.clone()), Expr::Int(c as i64), Expr::Int(0));
    let (cols, col) = kb.open_loop(hit, c);
    let (lp, k) = kb.open_loop(len, n);
    let s = kb.load_view(&start, &Pos::Lin(Expr::Ix(Ix::Row)));
    let s = kb.to_index(s);
    let token = kb.load_view(&sorted, &Pos::Lin(kb.bounds.add(s, k)));
    let token = kb.to_index(token);
    let at = kb.bounds.add(kb.bounds.mul(token, c as i64), col.clone());
    let v = kb.value(dy, &Pos::Lin(at))?;
    let total = kb.close_reduce(lp, ReduceOp::Sum, Ty::F32, v);
    let out = Pos::Lin(kb.bounds.add(kb.bounds.mul(Expr::Ix(Ix::Row), c as i64), col));
    emit_out(&mut kb, a, out, total)?;
    kb.close_foreach(cols);
    launch!(lw, kb, &a.family, Space::Rows { rows, mapping: RowMapping::Block }, note)
}
