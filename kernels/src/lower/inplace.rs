//! The cross-entropy gradient written over the logits it is computed from.
//!
//! The logits of a GPT-2 step are the largest tensor in it ([B*T, V], 98 MiB at B 4, T 128), and
//! their gradient is the same size. The gradient kernel is the logits' last reader: each row
//! program reads its row (max and sum of exponentials, or the shared statistics), then visits
//! every element once, reading it and writing its gradient at the same index. Written over the
//! logits, the step holds one such tensor instead of two, as the memory plan assumes
//! (`passes/src/plan`: in place where the op allows it).
//!
//! [`over_logits`] picks the logits when nothing else reads them afterwards; [`verify`] checks
//! what was generated, so a kernel shape this reasoning does not cover fails loudly instead of
//! reading overwritten values.

use qatc_ir::{Graph, NodeId, Op};

use crate::error::KernelError;
use crate::kir::{BinOp, Body, Expr, Ix, Kernel, ParamId, Space, Stmt};
use crate::program::{BufKind, Program, Step, View};

/// Users of `id`, seen through shape ops (which are views of the same bytes).
fn readers(g: &Graph, id: NodeId, out: &mut Vec<NodeId>) {
    for u in g.users(id) {
        match g.node(u).op {
            Op::Reshape { .. } | Op::Transpose { .. } | Op::Slice { .. } | Op::Broadcast { .. } => readers(g, u, out),
            _ => out.push(u),
        }
    }
}

/// The view a `CrossEntropyGrad` (or weighted) node may write its result into: its logits' (`logits`, their
/// view), when that is a whole Temp or Value buffer of the same type, not an output of `g`, read
/// by nothing but cross-entropy nodes and this one, and the cross-entropy forward was lowered
/// already (its row statistics are in `ce_stats`), so no reader comes after.
pub fn over_logits(lw: &super::Lowerer, g: &Graph, node: NodeId, logits: Option<&View>) -> Option<View> {
    if !matches!(g.node(node).op, Op::CrossEntropyGrad | Op::WeightedCrossEntropyGrad) {
        return None;
    }
    let (l, v) = (*g.operands(node).first()?, logits?);
    let buf = lw.prog.buffers.get(v.buf)?;
    let ty = g.ty(node);
    let whole = v.offset == 0 && v.is_contiguous() && v.numel() == buf.numel() && buf.dtype == ty.dtype && g.ty(l) == ty;
    if !whole || matches!(buf.kind, BufKind::Input(..)) || g.outputs().iter().any(|o| o.node == l) || !lw.ce_stats.contains_key(v) {
        return None;
    }
    let mut rs = Vec::new();
    readers(g, l, &mut rs);
    rs.iter().all(|&r| r == node || matches!(g.node(r).op, Op::CrossEntropy | Op::WeightedCrossEntropy)).then(|| v.clone())
}

/// `Row * V + Loop(l)`: element l of the row's own V elements (`loose`: `Row * V + e` for any
/// column e, which the lowering keeps within the row: a target clamped to [0, V), read before
/// the row is rewritten).
fn row_local(e: &Expr, v: usize, loose: bool) -> bool {
    match e {
        Expr::Bin(BinOp::Add, a, b) => {
            matches!(&**a, Expr::Bin(BinOp::Mul, r, n) if **r == Expr::Ix(Ix::Row) && **n == Expr::Int(v as i64))
                && (loose || matches!(**b, Expr::Ix(Ix::Loop(_))))
        }
        _ => false,
    }
}

/// Whether `k` may read and write param `p` in place: a row kernel touching only its own row of
/// `p` whose writes are all in its last statement, a loop reading each element of `p` only at
/// the index it writes, any element of the row read before that loop (or an elementwise kernel
/// reading and writing `p` at its own element).
pub fn in_place_ok(k: &Kernel, p: ParamId) -> bool {
    let Body::Loops { space, stmts } = &k.body else { return false };
    let mut touches = Vec::new(); // (is store, index)
    /// Every store to and load of `p` in `stmts`, at any depth.
    fn walk(stmts: &[Stmt], p: ParamId, out: &mut Vec<(bool, Expr)>) {
        fn stores(stmts: &[Stmt], p: ParamId, out: &mut Vec<(bool, Expr)>) {
            for s in stmts {
                match s {
                    Stmt::Store { param, index, .. } | Stmt::AtomicAdd { param, index, .. } if *param == p => {
                        out.push((true, index.clone()))
                    }
                    Stmt::Reduce { body, .. } | Stmt::ForEach { body, .. } => stores(body, p, out),
                    _ => {}
                }
            }
        }
        stores(stmts, p, out);
        crate::kir::visit_exprs(stmts, &mut |e| {
            if let Expr::Load { param, index } = e {
                if *param == p {
                    out.push((false, (**index).clone()));
                }
            }
        });
    }
    walk(stmts, p, &mut touches);
    match space {
        Space::Elements { .. } => {
            touches.iter().all(|(_, i)| *i == Expr::Ix(Ix::Elem))
                && stmts.iter().all(|s| matches!(s, Stmt::Let { .. } | Stmt::Store { .. }))
        }
        Space::Rows { .. } => {
            let v = k.params[p].shape.last().copied().unwrap_or(0);
            let Some((Stmt::ForEach { body, .. }, before)) = stmts.split_last() else { return false };
            let mut stores_before = Vec::new();
            walk(before, p, &mut stores_before);
            let mut last = Vec::new();
            walk(body, p, &mut last);
            let writes: Vec<&Expr> = last.iter().filter(|t| t.0).map(|t| &t.1).collect();
            let [w] = writes[..] else { return false };
            stores_before.iter().all(|(st, i)| !st && row_local(i, v, true))
                && last.iter().all(|(_, i)| row_local(i, v, false))
                && last.iter().all(|(_, i)| i == w)
                && body.iter().all(|s| matches!(s, Stmt::Let { .. } | Stmt::Store { .. }))
        }
    }
}

/// Whether `k`, run with each row on one thread and its statements in order
/// (`LowerOptions::sequential_rows`), may read and write param `p` in place: every load and
/// store of `p` is in the row's own elements, so a row's reads see exactly what its earlier
/// statements wrote (as the kernel-IR evaluator runs it), whatever the order of the rows.
pub fn row_private(k: &Kernel, p: ParamId) -> bool {
    let Body::Loops { space: Space::Rows { .. }, stmts } = &k.body else { return false };
    let v = k.params[p].shape.last().copied().unwrap_or(0);
    let mut ok = true;
    fn stores(stmts: &[Stmt], p: ParamId, v: usize, ok: &mut bool) {
        for s in stmts {
            match s {
                Stmt::Store { param, index, .. } | Stmt::AtomicAdd { param, index, .. } if *param == p => *ok &= row_local(index, v, true),
                Stmt::Reduce { body, .. } | Stmt::ForEach { body, .. } => stores(body, p, v, ok),
                _ => {}
            }
        }
    }
    stores(stmts, p, v, &mut ok);
    crate::kir::visit_exprs(stmts, &mut |e| {
        if let Expr::Load { param, index } = e {
            if *param == p {
                ok &= row_local(index, v, true);
            }
        }
    });
    ok
}

/// Checks the steps from `first` on that write `buf` (the logits' buffer, reused): kernels that
/// satisfy [`in_place_ok`], no GEMM.
pub fn verify(prog: &Program, first: usize, buf: usize) -> Result<(), KernelError> {
    for s in &prog.steps[first..] {
        match s {
            Step::Launch { kernel, args, .. } => {
                let k = &prog.kernels[*kernel];
                for (i, (&b, p)) in args.iter().zip(&k.params).enumerate() {
                    if b == buf && p.write && !in_place_ok(k, i) {
                        return Err(KernelError::Internal(format!(
                            "{}: the cross-entropy gradient cannot be written over its logits ({})",
                            k.family, prog.buffers[buf].name
                        )));
                    }
                }
            }
            Step::Gemm(g) if g.c.buf == buf => {
                return Err(KernelError::Internal(format!("a GEMM writes over the logits in place ({})", g.note)))
            }
            Step::Collective(c) if c.dst.buf == buf => {
                return Err(KernelError::Internal(format!("a collective writes over the logits in place ({})", c.note)))
            }
            Step::Gemm(_) | Step::Collective(_) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kir::{Loop, Param, ReduceOp, RowMapping, Ty};
    use qatc_ir::DType;

    fn kernel(stmts: Vec<Stmt>) -> Kernel {
        let p = Param { name: "t".into(), dtype: DType::F32, shape: vec![4, 10], write: true };
        Kernel {
            family: "t".into(),
            params: vec![p],
            index_ty: Ty::I32,
            body: Body::Loops { space: Space::Rows { rows: 4, mapping: RowMapping::Block }, stmts },
            note: String::new(),
            names: Default::default(),
        }
    }
    fn at(l: u8) -> Expr {
        Expr::bin(BinOp::Add, Expr::bin(BinOp::Mul, Expr::Ix(Ix::Row), Expr::Int(10)), Expr::Ix(Ix::Loop(l)))
    }
    fn load(i: Expr) -> Expr {
        Expr::Load { param: 0, index: Box::new(i) }
    }
    fn lp(var: u8) -> Loop {
        Loop { var, extent: Expr::Int(10), max: 10 }
    }
    fn max_of_row() -> Stmt {
        Stmt::Reduce { var: 0, op: ReduceOp::Max, ty: Ty::F32, lp: lp(0), body: vec![], value: load(at(0)) }
    }
    fn rewrite_row() -> Stmt {
        Stmt::ForEach {
            lp: lp(1),
            body: vec![Stmt::Store { param: 0, index: at(1), value: Expr::bin(BinOp::Sub, load(at(1)), Expr::Var(0)) }],
        }
    }

    #[test]
    fn read_the_row_then_rewrite_each_element_once() {
        assert!(in_place_ok(&kernel(vec![max_of_row(), rewrite_row()]), 0));
    }

    #[test]
    fn a_read_after_the_rewrite_or_of_another_element_is_refused() {
        // the row read again after it was rewritten
        assert!(!in_place_ok(&kernel(vec![rewrite_row(), max_of_row()]), 0));
        // element j written from element j + 1 (another iteration's element)
        let shifted = Expr::bin(BinOp::Add, at(1), Expr::Int(1));
        let bad = Stmt::ForEach { lp: lp(1), body: vec![Stmt::Store { param: 0, index: at(1), value: load(shifted) }] };
        assert!(!in_place_ok(&kernel(vec![bad]), 0));
        // the next row's elements
        let next_row = Expr::bin(
            BinOp::Add,
            Expr::bin(BinOp::Mul, Expr::bin(BinOp::Add, Expr::Ix(Ix::Row), Expr::Int(1)), Expr::Int(10)),
            Expr::Ix(Ix::Loop(0)),
        );
        let other = Stmt::Reduce { var: 0, op: ReduceOp::Max, ty: Ty::F32, lp: lp(0), body: vec![], value: load(next_row.clone()) };
        assert!(!in_place_ok(&kernel(vec![other.clone(), rewrite_row()]), 0));
        assert!(!row_private(&kernel(vec![other, rewrite_row()]), 0));
        let store_next = Stmt::ForEach { lp: lp(0), body: vec![Stmt::Store { param: 0, index: next_row, value: Expr::f32(0.0) }] };
        assert!(!row_private(&kernel(vec![max_of_row(), store_next]), 0));
    }

    /// The CPU's cross-entropy row: a sum pass that rewrites the row, then a pass reading it back.
    #[test]
    fn a_row_on_one_thread_may_rewrite_its_row_between_passes() {
        let keep = Stmt::Reduce {
            var: 1,
            op: ReduceOp::Sum,
            ty: Ty::F32,
            lp: lp(0),
            body: vec![Stmt::Store { param: 0, index: at(0), value: load(at(0)) }],
            value: load(at(0)),
        };
        let stmts = vec![max_of_row(), keep, rewrite_row()];
        assert!(row_private(&kernel(stmts.clone()), 0));
        // threads sharing the row could not: the sum pass is not the last
        assert!(!in_place_ok(&kernel(stmts), 0));
    }
}
