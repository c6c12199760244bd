//! Expressions as map keys, for the lowering's memo tables (a value already computed at a
//! position, a uniform subexpression already bound). Compared by structure, a float constant by
//! its bits: the same keys the memo tables had when they were `{:?}` strings (Rust prints every
//! f64 other than NaN distinctly, -0.0 included), at none of the formatting's cost, which was a
//! tenth of `qatc plan --fit` (bench/RESULTS.md). NaNs now differ by payload: never a merge the
//! strings did not make.

use std::hash::{Hash, Hasher};

use super::{Expr, ParamId};
use qatc_ir::NodeId;

/// An expression compared by structure and float bits (module docs).
#[derive(Clone, Debug)]
pub struct ExprKey(pub Expr);

impl PartialEq for ExprKey {
    fn eq(&self, other: &Self) -> bool {
        same(&self.0, &other.0)
    }
}

impl Eq for ExprKey {}

impl Hash for ExprKey {
    fn hash<H: Hasher>(&self, h: &mut H) {
        hash_expr(&self.0, h);
    }
}

fn same(a: &Expr, b: &Expr) -> bool {
    match (a, b) {
        (Expr::Float(x, s), Expr::Float(y, t)) => x.to_bits() == y.to_bits() && s == t,
        (Expr::Int(x), Expr::Int(y)) => x == y,
        (Expr::Bool(x), Expr::Bool(y)) => x == y,
        (Expr::Ix(x), Expr::Ix(y)) => x == y,
        (Expr::Var(x), Expr::Var(y)) => x == y,
        (Expr::Load { param: p, index: i }, Expr::Load { param: q, index: j }) => p == q && same(i, j),
        (Expr::Un(o, x), Expr::Un(p, y)) => o == p && same(x, y),
        (Expr::Bin(o, x1, x2), Expr::Bin(p, y1, y2)) => o == p && same(x1, y1) && same(x2, y2),
        (Expr::Select(a1, a2, a3), Expr::Select(b1, b2, b3)) => same(a1, b1) && same(a2, b2) && same(a3, b3),
        (Expr::Cast(s, x), Expr::Cast(t, y)) => s == t && same(x, y),
        (Expr::Call(f, xs), Expr::Call(g, ys)) => f == g && xs.len() == ys.len() && xs.iter().zip(ys).all(|(x, y)| same(x, y)),
        _ => false,
    }
}

fn hash_expr<H: Hasher>(e: &Expr, h: &mut H) {
    std::mem::discriminant(e).hash(h);
    match e {
        Expr::Float(v, t) => {
            v.to_bits().hash(h);
            t.hash(h);
        }
        Expr::Int(v) => v.hash(h),
        Expr::Bool(v) => v.hash(h),
        Expr::Ix(v) => v.hash(h),
        Expr::Var(v) => v.hash(h),
        Expr::Load { param, index } => {
            param.hash(h);
            hash_expr(index, h);
        }
        Expr::Un(o, x) => {
            o.hash(h);
            hash_expr(x, h);
        }
        Expr::Bin(o, x, y) => {
            o.hash(h);
            hash_expr(x, h);
            hash_expr(y, h);
        }
        Expr::Select(c, x, y) => {
            hash_expr(c, h);
            hash_expr(x, h);
            hash_expr(y, h);
        }
        Expr::Cast(t, x) => {
            t.hash(h);
            hash_expr(x, h);
        }
        Expr::Call(f, xs) => {
            f.hash(h);
            xs.len().hash(h);
            for x in xs {
                hash_expr(x, h);
            }
        }
    }
}

/// A position in a tensor as a key: a linear index or one coordinate per dim.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PosKey {
    Lin(ExprKey),
    Coords(Vec<ExprKey>),
}

/// What the lowering's memo table holds a value under: a parameter's element, or a graph node's
/// value at a position.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum MemoKey {
    Load(ParamId, ExprKey),
    Value(NodeId, PosKey),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kir::{BinOp, Ty};
    use std::collections::HashSet;

    #[test]
    fn keys_are_equal_exactly_when_their_printed_forms_are() {
        let x = || Expr::Var(3);
        let exprs = [
            Expr::Float(0.0, Ty::F32),
            Expr::Float(-0.0, Ty::F32),
            Expr::Float(0.0, Ty::F64),
            Expr::Float(0.1, Ty::F32),
            Expr::Int(0),
            Expr::Bin(BinOp::Add, Box::new(x()), Box::new(Expr::Int(1))),
            Expr::Bin(BinOp::Add, Box::new(Expr::Int(1)), Box::new(x())),
            Expr::Bin(BinOp::Mul, Box::new(x()), Box::new(Expr::Int(1))),
            Expr::load(2, Expr::Int(1)),
            Expr::load(1, Expr::Int(1)),
        ];
        for a in &exprs {
            for b in &exprs {
                assert_eq!(ExprKey(a.clone()) == ExprKey(b.clone()), format!("{a:?}") == format!("{b:?}"), "{a:?} vs {b:?}");
            }
        }
        let set: HashSet<ExprKey> = exprs.iter().chain(&exprs).cloned().map(ExprKey).collect();
        assert_eq!(set.len(), exprs.len());
    }
}
