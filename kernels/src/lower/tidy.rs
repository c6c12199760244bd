//! Clean-ups on a finished kernel body, so generated code reads like code a person writes:
//! a value used once is written where it is used (`out[idx] = gelu(x[idx] + b[i1])`), not bound
//! to a name first; and parameters are listed in operand order, outputs last.

use std::collections::HashMap;

use crate::kir::{Expr, ParamId, Stmt, VarId};

/// Uses of each variable, and whether some use sits in a deeper loop than its definition.
fn count(stmts: &[Stmt], depth: usize, defs: &mut HashMap<VarId, usize>, uses: &mut HashMap<VarId, (usize, bool)>) {
    fn expr(e: &Expr, depth: usize, defs: &HashMap<VarId, usize>, uses: &mut HashMap<VarId, (usize, bool)>) {
        e.visit(&mut |x| {
            if let Expr::Var(v) = x {
                let u = uses.entry(*v).or_insert((0, false));
                u.0 += 1;
                u.1 |= defs.get(v).is_some_and(|&d| d != depth);
            }
        });
    }
    for s in stmts {
        match s {
            Stmt::Let { var, value, .. } => {
                expr(value, depth, defs, uses);
                defs.insert(*var, depth);
            }
            Stmt::Store { index, value, .. } | Stmt::AtomicAdd { index, value, .. } => {
                expr(index, depth, defs, uses);
                expr(value, depth, defs, uses);
            }
            Stmt::Reduce { var, lp, body, value, .. } => {
                expr(&lp.extent, depth, defs, uses);
                count(body, depth + 1, defs, uses);
                expr(value, depth + 1, defs, uses);
                defs.insert(*var, depth);
            }
            Stmt::ForEach { lp, body } => {
                expr(&lp.extent, depth, defs, uses);
                count(body, depth + 1, defs, uses);
            }
        }
    }
}

fn substitute(e: &mut Expr, inline: &HashMap<VarId, Expr>) {
    if let Expr::Var(v) = e {
        if let Some(x) = inline.get(v) {
            *e = x.clone();
            substitute(e, inline);
        }
        return;
    }
    e.for_each_child_mut(|c| substitute(c, inline));
}

fn rewrite(stmts: Vec<Stmt>, inline: &mut HashMap<VarId, Expr>, single: &dyn Fn(VarId) -> bool) -> Vec<Stmt> {
    let mut out = Vec::with_capacity(stmts.len());
    for s in stmts {
        match s {
            Stmt::Let { var, ty, mut value } => {
                substitute(&mut value, inline);
                if single(var) {
                    inline.insert(var, value);
                } else {
                    out.push(Stmt::Let { var, ty, value });
                }
            }
            Stmt::Store { param, mut index, mut value } => {
                substitute(&mut index, inline);
                substitute(&mut value, inline);
                out.push(Stmt::Store { param, index, value });
            }
            Stmt::AtomicAdd { param, mut index, mut value } => {
                substitute(&mut index, inline);
                substitute(&mut value, inline);
                out.push(Stmt::AtomicAdd { param, index, value });
            }
            Stmt::Reduce { var, op, ty, mut lp, body, mut value } => {
                substitute(&mut lp.extent, inline);
                let body = rewrite(body, inline, single);
                substitute(&mut value, inline);
                out.push(Stmt::Reduce { var, op, ty, lp, body, value });
            }
            Stmt::ForEach { mut lp, body } => {
                substitute(&mut lp.extent, inline);
                let body = rewrite(body, inline, single);
                out.push(Stmt::ForEach { lp, body });
            }
        }
    }
    out
}

/// Writes each variable used exactly once, at the same loop depth, into its use. Variables with
/// a display name stay bound: the name documents them.
pub fn inline_single_use(stmts: Vec<Stmt>, named: &dyn Fn(VarId) -> bool) -> Vec<Stmt> {
    let (mut defs, mut uses) = (HashMap::new(), HashMap::new());
    count(&stmts, 0, &mut defs, &mut uses);
    let single = |v: VarId| !named(v) && uses.get(&v).is_some_and(|&(n, deeper)| n == 1 && !deeper);
    rewrite(stmts, &mut HashMap::new(), &single)
}

fn remap_expr(e: &mut Expr, map: &[ParamId]) {
    match e {
        Expr::Load { param, index } => {
            *param = map[*param];
            remap_expr(index, map);
        }
        Expr::Float(..) | Expr::Int(_) | Expr::Bool(_) | Expr::Ix(_) | Expr::Var(_) => {}
        Expr::Un(_, a) | Expr::Cast(_, a) => remap_expr(a, map),
        Expr::Bin(_, a, b) => {
            remap_expr(a, map);
            remap_expr(b, map);
        }
        Expr::Select(c, a, b) => {
            remap_expr(c, map);
            remap_expr(a, map);
            remap_expr(b, map);
        }
        Expr::Call(_, args) => args.iter_mut().for_each(|a| remap_expr(a, map)),
    }
}

/// Renumbers params: `map[old] = new`.
pub fn remap_params(stmts: &mut [Stmt], map: &[ParamId]) {
    for s in stmts {
        match s {
            Stmt::Let { value, .. } => remap_expr(value, map),
            Stmt::Store { param, index, value } | Stmt::AtomicAdd { param, index, value } => {
                *param = map[*param];
                remap_expr(index, map);
                remap_expr(value, map);
            }
            Stmt::Reduce { lp, body, value, .. } => {
                remap_expr(&mut lp.extent, map);
                remap_params(body, map);
                remap_expr(value, map);
            }
            Stmt::ForEach { lp, body } => {
                remap_expr(&mut lp.extent, map);
                remap_params(body, map);
            }
        }
    }
}
