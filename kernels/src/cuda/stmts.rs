//! What the writer asks of a kernel's statements before it writes them: which params they load
//! and store, whether they reduce, and the longest loop a row's threads share. Both the choice of
//! a variant (`codegen`) and the text (`launch`, `loop_nest`, `emit`) read these.

use std::collections::BTreeSet;

use crate::kir::{visit_exprs, Expr, Stmt};

/// Whether a statement list has a top-level reduction.
pub fn has_reduce(stmts: &[Stmt]) -> bool {
    stmts.iter().any(|s| matches!(s, Stmt::Reduce { .. }))
}

/// The params a statement list loads (loop extents included).
pub fn loads(stmts: &[Stmt]) -> BTreeSet<usize> {
    let mut out = BTreeSet::new();
    visit_exprs(stmts, &mut |e| {
        if let Expr::Load { param, .. } = e {
            out.insert(*param);
        }
    });
    out
}

/// The params a statement list stores into (atomics included).
pub fn stores(stmts: &[Stmt]) -> BTreeSet<usize> {
    let mut out = BTreeSet::new();
    for s in stmts {
        match s {
            Stmt::Store { param, .. } | Stmt::AtomicAdd { param, .. } => {
                out.insert(*param);
            }
            Stmt::Reduce { body, .. } | Stmt::ForEach { body, .. } => out.extend(stores(body)),
            Stmt::Let { .. } => {}
        }
    }
    out
}

/// The longest loop a Block-mapped row shares among its threads: its top-level loops (the
/// loops nested in them run sequentially in each thread).
pub fn max_loop(stmts: &[Stmt]) -> usize {
    stmts
        .iter()
        .map(|s| match s {
            Stmt::Reduce { lp, .. } | Stmt::ForEach { lp, .. } => lp.max,
            _ => 0,
        })
        .max()
        .unwrap_or(0)
}
