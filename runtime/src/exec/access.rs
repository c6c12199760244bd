//! What each step of a program reads and writes: the one place that knows how each kind of step
//! uses its buffers. Lifetimes (and so the memory layout), hoisting and the inputs a run needs
//! are all derived from it.

use qatc_kernels::kir::{self, Body, Expr, Kernel, Stmt};
use qatc_kernels::panels::PanelFeed;
use qatc_kernels::program::{BufId, Program, Step};
use serde::Serialize;

/// The buffers one step reads and those it writes. A buffer read and written by the same step
/// is in both lists: a kernel's written param that it also reads, the destination of an
/// accumulating GEMM.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Access {
    pub reads: Vec<BufId>,
    pub writes: Vec<BufId>,
}

/// Which params of `k` it reads as well as writes (a load of a written param, or an atomic add
/// into one): such a param may read what the buffer held before the launch.
pub fn written_params_read(k: &Kernel) -> Vec<bool> {
    fn atomics(stmts: &[Stmt], read: &mut [bool]) {
        for s in stmts {
            match s {
                Stmt::AtomicAdd { param, .. } => {
                    if let Some(r) = read.get_mut(*param) {
                        *r = true;
                    }
                }
                Stmt::Reduce { body, .. } | Stmt::ForEach { body, .. } => atomics(body, read),
                Stmt::Let { .. } | Stmt::Store { .. } => {}
            }
        }
    }
    let mut read = vec![false; k.params.len()];
    // attention kernels read their inputs and only write their outputs
    if let Body::Loops { stmts, .. } = &k.body {
        kir::visit_exprs(stmts, &mut |e| {
            if let Expr::Load { param, .. } = e {
                if let Some(r) = read.get_mut(*param) {
                    *r = true;
                }
            }
        });
        atomics(stmts, &mut read);
    }
    read.iter_mut().zip(&k.params).for_each(|(r, p)| *r &= p.write);
    read
}

/// What a launch of `k` on `args` reads and writes.
fn launch(k: &Kernel, args: &[BufId]) -> Access {
    let mut a = Access::default();
    for ((p, &b), read) in k.params.iter().zip(args).zip(written_params_read(k)) {
        if p.write {
            a.writes.push(b);
        }
        if !p.write || read {
            a.reads.push(b);
        }
    }
    a
}

/// What step `step` of `prog` reads and writes (its kernels and buffers checked already:
/// `ExecPlan::new`). A GEMM fed panel by panel (`feed`, from the CPU's `qatc_kernels::panels`)
/// writes its scratch operand b (the feed kernel fills it) and reads what the feed reads.
pub fn of_step(prog: &Program, step: &Step, feed: Option<&PanelFeed>) -> Access {
    match step {
        Step::Launch { kernel, args, .. } => prog.kernels.get(*kernel).map(|k| launch(k, args)).unwrap_or_default(),
        Step::Collective(c) => Access { reads: vec![c.src.buf], writes: vec![c.dst.buf] },
        Step::Gemm(g) => {
            let mut a = Access { reads: vec![g.a.buf], writes: vec![g.c.buf] };
            match feed {
                Some(f) => {
                    if let Some(k) = prog.kernels.get(f.kernel) {
                        let fed = launch(k, &f.args);
                        // the scratch is written before the GEMM reads it: not read before written
                        a.reads.extend(fed.reads.into_iter().filter(|b| !fed.writes.contains(b)));
                        a.writes.extend(fed.writes);
                    }
                    if !a.writes.contains(&g.b.buf) {
                        a.writes.push(g.b.buf);
                    }
                }
                None => a.reads.push(g.b.buf),
            }
            a.reads.extend(g.bias.as_ref().map(|b| b.buf));
            if g.accumulate {
                a.reads.push(g.c.buf);
            }
            a
        }
    }
}
