//! Reductions that are not along the last dim: sum_to (bias gradients), LayerNorm's gamma
//! gradient, fake-quant (per group of a weight column) and the all-finite test; scatter_add is
//! `scatter.rs`. A "row" here is the set of input elements one output element reduces, addressed
//! through index expressions; where those elements are far apart in memory (a column), one thread
//! takes a row and neighbouring threads take neighbouring columns, so loads stay coalesced.

use qatc_ir::{DType, Op, QuantScheme, QuantSpec};

use super::anchor::{emit_out, Anchor};
use super::builder::{clamp, KernelBuilder, Pos};
use super::{Ctx, Lowerer};
use crate::error::KernelError;
use crate::index::delinearize;
use crate::kir::{BinOp, Expr, Intrinsic, Ix, ReduceOp, RowMapping, Space, Ty, UnOp};

fn f(v: f64) -> Expr {
    Expr::f32(v)
}

pub fn lower(lw: &mut Lowerer, cx: &Ctx, a: &Anchor) -> Result<(), KernelError> {
    let g = cx.g;
    let node = g.node(a.node);
    let ops = g.operands(a.node);
    let shape = node.ty.shape.0.clone();
    let note = lw.note(cx, a.node, a.epilogue);
    match node.op.clone() {
        Op::SumTo { .. } => {
            // out coords come from the row; the summed dims (new leading dims and size-1 dims)
            // from the loop index, in the input's row-major order (the interpreter's order)
            let x = ops[0];
            let in_shape = g.ty(x).shape.0.clone();
            let off = in_shape.len() - shape.len();
            let summed: Vec<usize> = (0..in_shape.len()).filter(|&d| d < off || shape[d - off] != in_shape[d]).collect();
            let sum_shape: Vec<usize> = summed.iter().map(|&d| in_shape[d]).collect();
            let len: usize = sum_shape.iter().product();
            let rows = node.ty.numel();
            let inner_summed = summed.last() == Some(&(in_shape.len() - 1));
            let mapping = if inner_summed { RowMapping::Block } else { RowMapping::Thread };
            let mut kb = lw.kb_rows(cx, rows, &[&a.dest]);
            let out_cs = delinearize(&kb.bounds, &Expr::Ix(Ix::Row), &shape);
            let (lp, j) = kb.open_loop(Expr::Int(len as i64), len);
            let sum_cs = delinearize(&kb.bounds, &j, &sum_shape);
            let cs: Vec<Expr> = (0..in_shape.len())
                .map(|d| match summed.iter().position(|&s| s == d) {
                    Some(k) => sum_cs[k].clone(),
                    None => out_cs[d - off].clone(),
                })
                .collect();
            let v = kb.value(x, &Pos::Coords(cs))?;
            let total = kb.close_reduce(lp, ReduceOp::Sum, Ty::F32, v);
            emit_out(&mut kb, a, Pos::Lin(Expr::Ix(Ix::Row)), total)?;
            launch!(lw, kb, &a.family, Space::Rows { rows, mapping }, note)
        }
        Op::LayerNormGradGamma { eps } => {
            // pass 1: mean and rstd of every row of x; pass 2: dgamma[c] = sum over rows of
            // dy * (x - mean) * rstd, one thread per column, rows in order
            let (x, dy) = (ops[0], ops[1]);
            let c = shape[0];
            let rows = g.ty(x).numel() / c.max(1);
            let mean = lw.temp("ln_mean", DType::F32, &[rows]);
            let rstd = lw.temp("ln_rstd", DType::F32, &[rows]);
            let mut kb = lw.kb_rows(cx, rows, &[&mean, &rstd]);
            let row_at = |kb: &KernelBuilder, j: &Expr| Pos::Lin(kb.bounds.add(kb.bounds.mul(Expr::Ix(Ix::Row), c as i64), j.clone()));
            let (lp, j) = kb.open_loop(Expr::Int(c as i64), c);
            let p = row_at(&kb, &j);
            let xv = kb.value(x, &p)?;
            let sum = kb.close_reduce(lp, ReduceOp::Sum, Ty::F32, xv);
            let m = kb.bind(Ty::F32, Expr::bin(BinOp::Div, sum, f(c as f64)));
            let (lp, j) = kb.open_loop(Expr::Int(c as i64), c);
            let p = row_at(&kb, &j);
            let xv = kb.value(x, &p)?;
            let d = kb.bind(Ty::F32, Expr::bin(BinOp::Sub, xv, m.clone()));
            let var = kb.close_reduce(lp, ReduceOp::Sum, Ty::F32, Expr::bin(BinOp::Mul, d.clone(), d));
            let r =
                Expr::bin(BinOp::Div, f(1.0), Expr::un(UnOp::Sqrt, Expr::bin(BinOp::Add, Expr::bin(BinOp::Div, var, f(c as f64)), f(eps))));
            kb.store_view(&mean, &Pos::Lin(Expr::Ix(Ix::Row)), m);
            kb.store_view(&rstd, &Pos::Lin(Expr::Ix(Ix::Row)), r);
            launch!(lw, kb, "layernorm_stats", Space::Rows { rows, mapping: RowMapping::Block }, format!("{note}: row statistics"))?;

            let mut kb = lw.kb_rows(cx, c, &[&a.dest]);
            let (lp, r) = kb.open_loop(Expr::Int(rows as i64), rows);
            let p = Pos::Lin(kb.bounds.add(kb.bounds.mul(r.clone(), c as i64), Expr::Ix(Ix::Row)));
            let dyv = kb.value(dy, &p)?;
            let xv = kb.value(x, &p)?;
            let mv = kb.load_view(&mean, &Pos::Lin(r.clone()));
            let rv = kb.load_view(&rstd, &Pos::Lin(r));
            let term = Expr::bin(BinOp::Mul, Expr::bin(BinOp::Mul, dyv, Expr::bin(BinOp::Sub, xv, mv)), rv);
            let total = kb.close_reduce(lp, ReduceOp::Sum, Ty::F32, term);
            emit_out(&mut kb, a, Pos::Lin(Expr::Ix(Ix::Row)), total)?;
            launch!(lw, kb, &a.family, Space::Rows { rows: c, mapping: RowMapping::Thread }, note)
        }
        Op::FakeQuant { spec } => fake_quant(lw, cx, a, spec, &shape, note),
        Op::AllFinite => {
            // one row over every element: the largest "not finite" indicator, 0 or 1 (an element
            // is finite when v - v == 0, false for infinities and NaN), then 1 - it
            let x = ops[0];
            let n = g.ty(x).numel();
            let mut kb = lw.kb_rows(cx, 1, &[&a.dest]);
            let (lp, j) = kb.open_loop(Expr::Int(n as i64), n);
            let v = kb.value(x, &Pos::Lin(j))?;
            let finite = Expr::bin(BinOp::Eq, Expr::bin(BinOp::Sub, v.clone(), v), f(0.0));
            let bad = kb.close_reduce(lp, ReduceOp::Max, Ty::F32, Expr::select(finite, f(0.0), f(1.0)));
            emit_out(&mut kb, a, Pos::Coords(vec![]), Expr::bin(BinOp::Sub, f(1.0), bad))?;
            launch!(lw, kb, &a.family, Space::Rows { rows: 1, mapping: RowMapping::Block }, note)
        }
        other => Err(KernelError::Unsupported { node: g.describe(a.node), why: format!("no kernel lowering for {}", other.mnemonic()) }),
    }
}

/// `quant::quantize` then `dequantize` for one group of one column: thread per (group, column),
/// the group's elements in order (Q4_0's "first of largest magnitude" needs that order).
fn fake_quant(lw: &mut Lowerer, cx: &Ctx, a: &Anchor, spec: QuantSpec, shape: &[usize], note: String) -> Result<(), KernelError> {
    let w = cx.g.operands(a.node)[0];
    let (n_in, n_out) = (shape[0], shape[1]);
    let gsz = spec.group_for(n_in);
    let rows = (n_in / gsz) * n_out;
    let mut kb = lw.kb_rows(cx, rows, &[&a.dest]);
    let b = kb.bounds.clone();
    let (grp, col) = (b.div(Expr::Ix(Ix::Row), n_out as i64), b.rem(Expr::Ix(Ix::Row), n_out as i64));
    let elem = |kb: &KernelBuilder, r: &Expr| {
        let i = kb.bounds.add(kb.bounds.mul(grp.clone(), gsz as i64), r.clone());
        Pos::Coords(vec![i, col.clone()])
    };
    let fold = |kb: &mut KernelBuilder, op: ReduceOp, map: &dyn Fn(Expr) -> Expr| -> Result<Expr, KernelError> {
        let (lp, r) = kb.open_loop(Expr::Int(gsz as i64), gsz);
        let p = elem(kb, &r);
        let v = kb.value(w, &p)?;
        Ok(kb.close_reduce(lp, op, Ty::F32, map(v)))
    };
    let div = |x: Expr, y: Expr| Expr::bin(BinOp::Div, x, y);
    let mul = |x: Expr, y: Expr| Expr::bin(BinOp::Mul, x, y);
    let is_zero = |x: Expr| Expr::bin(BinOp::Eq, x, f(0.0));
    let abs = |v: Expr| Expr::un(UnOp::Abs, v);
    // as `quant::quantize`: a group holding a NaN or an infinity (v - v is NaN only for those)
    // comes out NaN, never as finite values that hide it
    let nonfinite =
        fold(&mut kb, ReduceOp::Max, &|v| Expr::select(Expr::bin(BinOp::Ne, Expr::bin(BinOp::Sub, v.clone(), v), f(0.0)), f(1.0), f(0.0)))?;
    let nonfinite = kb.bind(Ty::F32, nonfinite);
    let out = |kb: &mut KernelBuilder, val: &dyn Fn(&mut KernelBuilder, Expr) -> Expr| -> Result<(), KernelError> {
        let (lp, r) = kb.open_loop(Expr::Int(gsz as i64), gsz);
        let p = elem(kb, &r);
        let v = kb.value(w, &p)?;
        let y = val(kb, v);
        let y = Expr::select(Expr::bin(BinOp::Ne, nonfinite.clone(), f(0.0)), f(f64::NAN), y);
        emit_out(kb, a, p, y)?;
        kb.close_foreach(lp);
        Ok(())
    };
    // the grid's constants (`qatc_ir::Grid`), as `quant::quantize` reads them
    let grid = spec.grid();
    let (lo, hi) = grid.range(0.0);
    let (divisor, top, offset) = (grid.scale_divisor(), f64::from(grid.max_code), f64::from(grid.offset().unwrap_or(0)));
    match spec.scheme {
        QuantScheme::Sym => {
            let absmax = fold(&mut kb, ReduceOp::Max, &abs)?;
            let s = kb.bind(Ty::F32, div(absmax, f(divisor)));
            out(&mut kb, &|_, v| {
                let k = clamp(Expr::un(UnOp::RoundEven, div(v, s.clone())), lo, hi);
                Expr::select(is_zero(s.clone()), f(0.0), mul(k, s.clone()))
            })?;
        }
        QuantScheme::Asym => {
            let rmin = fold(&mut kb, ReduceOp::Max, &|v| Expr::un(UnOp::Neg, v))?;
            let rmin = kb.bind(Ty::F32, Expr::bin(BinOp::Min, f(0.0), Expr::un(UnOp::Neg, rmin)));
            let rmax = fold(&mut kb, ReduceOp::Max, &|v| v)?;
            let rmax = kb.bind(Ty::F32, Expr::bin(BinOp::Max, f(0.0), rmax));
            let s = kb.bind(Ty::F32, div(Expr::bin(BinOp::Sub, rmax, rmin.clone()), f(divisor)));
            let z = clamp(Expr::un(UnOp::RoundEven, div(Expr::un(UnOp::Neg, rmin), s.clone())), 0.0, top);
            let z = kb.bind(Ty::F32, Expr::select(is_zero(s.clone()), f(0.0), z));
            out(&mut kb, &|_, v| {
                let k = clamp(Expr::bin(BinOp::Add, Expr::un(UnOp::RoundEven, div(v, s.clone())), z.clone()), 0.0, top);
                let k = Expr::select(is_zero(s.clone()), z.clone(), k);
                mul(s.clone(), Expr::bin(BinOp::Sub, k, z.clone()))
            })?;
        }
        QuantScheme::Nf4 => {
            let absmax = fold(&mut kb, ReduceOp::Max, &abs)?;
            out(&mut kb, &|_, v| {
                let x = Expr::select(is_zero(absmax.clone()), f(0.0), div(v, absmax.clone()));
                let code = Expr::Call(Intrinsic::Nf4Nearest, vec![x]);
                mul(Expr::Call(Intrinsic::Nf4Value, vec![code]), absmax.clone())
            })?;
        }
        QuantScheme::Q4_0 => {
            // llama.cpp quantize_row_q4_0_ref: d = m / -8, q = min(15, trunc(x / d + 8.5))
            let m = fold(&mut kb, ReduceOp::FirstAbsMax, &|v| v)?;
            let d = kb.bind(Ty::F32, div(m, f(divisor)));
            let id = kb.bind(Ty::F32, Expr::select(Expr::bin(BinOp::Ne, d.clone(), f(0.0)), div(f(1.0), d.clone()), f(0.0)));
            let d16 = kb.bind(Ty::F32, Expr::Call(Intrinsic::F16Round, vec![d]));
            out(&mut kb, &|_, v| {
                let q = Expr::un(UnOp::Trunc, Expr::bin(BinOp::Add, mul(v, id.clone()), f(grid.trunc_bias())));
                let q = Expr::bin(BinOp::Min, q, f(top));
                mul(Expr::bin(BinOp::Sub, q, f(offset)), d16.clone())
            })?;
        }
    }
    launch!(lw, kb, &a.family, Space::Rows { rows, mapping: RowMapping::Thread }, note)
}
