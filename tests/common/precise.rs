//! The kernel-IR evaluator's sums, made precise: a reference that tells a GPU's (or the CUDA C's)
//! summation order apart from the evaluator's. The evaluator adds an f32 sum in order, one rounding
//! per term; over a long row (a cross-entropy row of 50,257 logits) that drifts by up to ~1e-3
//! relative, while a tree of partial sums stays near 1e-6. The same kernel IR with its f32 sums
//! accumulated in f64 is the reference both must be near (`tests/cuda_c_on_cpu.rs`,
//! `tests/gpu_step.rs`).

use qatc_kernels::kir::{Body, Expr, Kernel, ReduceOp, Stmt, Ty};

/// `k` with each f32 sum accumulated in f64 and rounded to f32 once, at its end (a new f64
/// reduction, then the sum's own variable bound to it as f32), or None where it has no f32 sum
/// (or is an attention kernel). The kernel-IR evaluator adds an f32 sum in order, one rounding
/// per term: over a long row (a cross-entropy row of 50257 logits) that is off by up to ~1e-3
/// relative, while a GPU's tree of partial sums is off by ~1e-6; this is the reference that
/// tells the two apart.
pub fn promote_sums(k: &Kernel) -> Option<Kernel> {
    fn max_var(stmts: &[Stmt]) -> u32 {
        stmts
            .iter()
            .map(|s| match s {
                Stmt::Let { var, .. } => *var,
                Stmt::Reduce { var, body, .. } => (*var).max(max_var(body)),
                Stmt::ForEach { body, .. } => max_var(body),
                Stmt::Store { .. } | Stmt::AtomicAdd { .. } => 0,
            })
            .max()
            .unwrap_or(0)
    }
    fn walk(stmts: &[Stmt], next: &mut u32) -> Vec<Stmt> {
        let mut out = Vec::new();
        for s in stmts {
            match s {
                Stmt::Reduce { var, op: ReduceOp::Sum, ty: Ty::F32, lp, body, value } => {
                    let wide = *next;
                    *next += 1;
                    let body = walk(body, next);
                    out.push(Stmt::Reduce { var: wide, op: ReduceOp::Sum, ty: Ty::F64, lp: lp.clone(), body, value: value.clone() });
                    out.push(Stmt::Let { var: *var, ty: Ty::F32, value: Expr::Var(wide) });
                }
                Stmt::Reduce { var, op, ty, lp, body, value } => {
                    let body = walk(body, next);
                    out.push(Stmt::Reduce { var: *var, op: *op, ty: *ty, lp: lp.clone(), body, value: value.clone() });
                }
                Stmt::ForEach { lp, body } => out.push(Stmt::ForEach { lp: lp.clone(), body: walk(body, next) }),
                s => out.push(s.clone()),
            }
        }
        out
    }
    let Body::Loops { space, stmts } = &k.body else { return None };
    let mut next = max_var(stmts) + 1;
    let promoted = walk(stmts, &mut next);
    if next == max_var(stmts) + 1 {
        return None;
    }
    Some(Kernel { body: Body::Loops { space: space.clone(), stmts: promoted }, ..k.clone() })
}
