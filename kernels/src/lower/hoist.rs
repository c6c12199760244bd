//! Uniform values computed once per program instead of once per use: a subexpression that reads
//! no index, no variable and no per-element value (only constants and scalar params at a
//! constant index) is the same for every iteration. When it costs something (a power, a
//! square root, a division...) it is bound once at the top of the body and used by name.
//!
//! AdamW's multi-tensor kernel is the case that matters: its bias corrections
//! `1 - pow(beta, step)` sat inside every branch of the select tree that picks the tensor, so
//! every element paid two `pow` calls (7 ns per element on the CPU). Bound at the top, a backend
//! evaluates them once per thread (CUDA) or hoists them out of the loop (LLVM).
//!
//! Only floating-point expressions move: an integer division hoisted out of the branch that
//! guards it could trap, while a float one gives inf and is then never selected.

use std::collections::HashMap;

use crate::kir::{BinOp, Body, Expr, ExprKey, Kernel, Stmt, Ty, TypeEnv, UnOp, VarId};

struct Hoist<'k> {
    k: &'k Kernel,
    env: TypeEnv,
    /// Hoisted expressions by structure (`ExprKey`), and the Lets that bind them, in order.
    seen: HashMap<ExprKey, VarId>,
    lets: Vec<Stmt>,
    next: VarId,
}

impl Hoist<'_> {
    fn is_uniform(&self, e: &Expr) -> bool {
        match e {
            Expr::Float(..) | Expr::Int(_) | Expr::Bool(_) => true,
            Expr::Ix(_) => false,
            // a name may be bound below the top of the body, where the hoisted Let goes
            Expr::Var(_) => false,
            Expr::Load { param, index } => match (**index).clone() {
                Expr::Int(i) => self.k.params.get(*param).is_some_and(|p| !p.write && i >= 0 && (i as usize) < p.numel()),
                _ => false,
            },
            Expr::Un(_, a) | Expr::Cast(_, a) => self.is_uniform(a),
            Expr::Bin(op, a, b) => {
                let int_div = matches!(op, BinOp::Div | BinOp::Rem) && !matches!(self.env.ty(self.k, e), Ty::F32 | Ty::F64);
                !int_div && self.is_uniform(a) && self.is_uniform(b)
            }
            Expr::Select(c, a, b) => self.is_uniform(c) && self.is_uniform(a) && self.is_uniform(b),
            Expr::Call(..) => false,
        }
    }

    /// Worth a name: it does some costly arithmetic on a loaded value (constant arithmetic is
    /// folded by every compiler).
    fn costly(e: &Expr) -> bool {
        let (mut op, mut load) = (false, false);
        e.visit(&mut |x| {
            op |= matches!(
                x,
                Expr::Bin(BinOp::Pow | BinOp::Div, ..)
                    | Expr::Un(UnOp::Sqrt | UnOp::Rsqrt | UnOp::Recip | UnOp::Exp | UnOp::Log | UnOp::Tanh, _)
            );
            load |= matches!(x, Expr::Load { .. });
        });
        op && load
    }

    fn rewrite(&mut self, e: &mut Expr) {
        let ty = self.env.ty(self.k, e);
        if matches!(ty, Ty::F32 | Ty::F64) && Self::costly(e) && self.is_uniform(e) {
            let key = ExprKey(e.clone());
            let var = match self.seen.get(&key) {
                Some(&v) => v,
                None => {
                    let v = self.next;
                    self.next += 1;
                    self.lets.push(Stmt::Let { var: v, ty, value: e.clone() });
                    self.seen.insert(key, v);
                    v
                }
            };
            *e = Expr::Var(var);
            return;
        }
        self.rewrite_inside(e);
    }

    /// The children of `e`, not `e` itself.
    fn rewrite_inside(&mut self, e: &mut Expr) {
        e.for_each_child_mut(|c| self.rewrite(c));
    }

    fn stmts(&mut self, stmts: &mut [Stmt], top: bool) {
        for s in stmts {
            match s {
                // a top-level name is bound once per program already
                Stmt::Let { value, .. } if top => self.rewrite_inside(value),
                Stmt::Let { value, .. } => self.rewrite(value),
                Stmt::Store { index, value, .. } | Stmt::AtomicAdd { index, value, .. } => {
                    self.rewrite(index);
                    self.rewrite(value);
                }
                Stmt::Reduce { lp, body, value, .. } => {
                    self.rewrite(&mut lp.extent);
                    self.stmts(body, false);
                    self.rewrite(value);
                }
                Stmt::ForEach { lp, body } => {
                    self.rewrite(&mut lp.extent);
                    self.stmts(body, false);
                }
            }
        }
    }
}

fn max_var(stmts: &[Stmt]) -> VarId {
    let mut m = 0;
    for s in stmts {
        match s {
            Stmt::Let { var, .. } => m = m.max(*var + 1),
            Stmt::Reduce { var, body, .. } => m = m.max(*var + 1).max(max_var(body)),
            Stmt::ForEach { body, .. } => m = m.max(max_var(body)),
            Stmt::Store { .. } | Stmt::AtomicAdd { .. } => {}
        }
    }
    m
}

/// Binds every costly uniform subexpression of `k`'s body once, at the top (see the module docs).
pub fn hoist_uniform(k: &mut Kernel) {
    let Body::Loops { stmts, .. } = &k.body else { return };
    let mut stmts = stmts.clone();
    let mut h = Hoist { k, env: TypeEnv::of(&stmts), seen: HashMap::new(), lets: Vec::new(), next: max_var(&stmts) };
    h.stmts(&mut stmts, true);
    if h.lets.is_empty() {
        return;
    }
    let mut out = std::mem::take(&mut h.lets);
    out.extend(stmts);
    if let Body::Loops { stmts, .. } = &mut k.body {
        *stmts = out;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kir::{Ix, Param, Space};
    use qatc_ir::DType;

    fn param(name: &str, shape: &[usize], write: bool) -> Param {
        Param { name: name.into(), dtype: DType::F32, shape: shape.to_vec(), write }
    }

    #[test]
    fn a_bias_correction_in_every_branch_is_bound_once() {
        // out[i] = i < 4 ? x[i] / (1 - pow(0.9, step)) : x[i] * (1 - pow(0.9, step)) + 1 / 3
        let load = |p: usize, i: Expr| Expr::Load { param: p, index: Box::new(i) };
        let step = Expr::Cast(Ty::F64, Box::new(load(1, Expr::Int(0))));
        let bc = Expr::bin(BinOp::Sub, Expr::Float(1.0, Ty::F64), Expr::bin(BinOp::Pow, Expr::Float(0.9, Ty::F64), step));
        let bc32 = Expr::Cast(Ty::F32, Box::new(bc));
        let x = load(0, Expr::Ix(Ix::Elem));
        let third = Expr::bin(BinOp::Div, Expr::f32(1.0), Expr::f32(3.0));
        let value = Expr::Select(
            Box::new(Expr::bin(BinOp::Lt, Expr::Ix(Ix::Elem), Expr::Int(4))),
            Box::new(Expr::bin(BinOp::Div, x.clone(), bc32.clone())),
            Box::new(Expr::bin(BinOp::Add, Expr::bin(BinOp::Mul, x, bc32.clone()), third.clone())),
        );
        let body = Body::Loops {
            space: Space::Elements { shape: vec![8] },
            stmts: vec![Stmt::Store { param: 2, index: Expr::Ix(Ix::Elem), value }],
        };
        let mut k = Kernel {
            family: "t".into(),
            params: vec![param("x", &[8], false), param("step", &[], false), param("out", &[8], true)],
            index_ty: Ty::I32,
            body,
            note: String::new(),
            names: Default::default(),
        };
        hoist_uniform(&mut k);
        let Body::Loops { stmts, .. } = &k.body else { panic!() };
        assert_eq!(stmts.len(), 2, "{stmts:?}");
        assert_eq!(stmts[0], Stmt::Let { var: 0, ty: Ty::F32, value: bc32 });
        let mut uses = 0;
        let mut thirds = 0;
        crate::kir::visit_exprs(&stmts[1..], &mut |e| {
            uses += usize::from(*e == Expr::Var(0));
            thirds += usize::from(*e == third);
        });
        assert_eq!((uses, thirds), (2, 1), "both branches use the name; constant arithmetic stays");
    }

    #[test]
    fn integer_division_and_per_element_values_stay() {
        let load = |p: usize, i: Expr| Expr::Load { param: p, index: Box::new(i) };
        // out[i] = n != 0 ? float(10 / n) : 0, n an i32 scalar: the division must stay guarded
        let n = load(1, Expr::Int(0));
        let value = Expr::Select(
            Box::new(Expr::bin(BinOp::Ne, n.clone(), Expr::Int(0))),
            Box::new(Expr::Cast(Ty::F32, Box::new(Expr::bin(BinOp::Div, Expr::Int(10), n)))),
            Box::new(Expr::bin(BinOp::Div, load(0, Expr::Ix(Ix::Elem)), Expr::f32(2.0))),
        );
        let mut params = vec![param("x", &[8], false), param("n", &[], false), param("out", &[8], true)];
        params[1].dtype = DType::I32;
        let stmts = vec![Stmt::Store { param: 2, index: Expr::Ix(Ix::Elem), value }];
        let mut k = Kernel {
            family: "t".into(),
            params,
            index_ty: Ty::I32,
            body: Body::Loops { space: Space::Elements { shape: vec![8] }, stmts: stmts.clone() },
            note: String::new(),
            names: Default::default(),
        };
        hoist_uniform(&mut k);
        assert_eq!(k.body, Body::Loops { space: Space::Elements { shape: vec![8] }, stmts });
    }
}
