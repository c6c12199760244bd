//! The cross-entropy gradient written over the logits it reads (`lower/inplace.rs`): when the
//! logits die there, and only then.

mod common;

use qatc_ir::{DType, Graph, InputKind, Op};
use qatc_kernels::kir::{Body, Expr};
use qatc_kernels::{lower, Program, Step};

/// The buffers each launch both loads and writes (in place), by kernel family.
fn in_place(prog: &Program) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for s in &prog.steps {
        let Step::Launch { kernel, args, .. } = s else { continue };
        let k = &prog.kernels[*kernel];
        let Body::Loops { stmts, .. } = &k.body else { continue };
        let mut loaded = Vec::new();
        qatc_kernels::kir::visit_exprs(stmts, &mut |e| {
            if let Expr::Load { param, .. } = e {
                loaded.push(*param);
            }
        });
        for (i, p) in k.params.iter().enumerate() {
            if p.write && loaded.contains(&i) {
                out.push((k.family.clone(), prog.buffers[args[i]].name.clone()));
            }
        }
    }
    out
}

/// x @ w^T -> logits; loss = cross_entropy(logits); dx = cross_entropy_grad(logits) @ w, fused as
/// qatc's fusion makes the chunked linear + cross-entropy (the loss first, then the gradient).
fn linear_ce(loss_first: bool, logits_out: bool) -> Graph {
    common::fused(qatc_ir::KernelFamily::CrossEntropy, &[common::f32s(&[6, 8]), common::f32s(&[50, 8]), (DType::I32, vec![6])], |b, i| {
        let logits = b.add(Op::MatMul { ta: false, tb: true }, &[i[0], i[1]]).unwrap();
        let one = b.add(Op::Const { value: 1.0, dtype: DType::F32, shape: qatc_ir::Shape(vec![]) }, &[]).unwrap();
        let grad = |b: &mut Graph| {
            let d = b.add(Op::CrossEntropyGrad, &[logits, i[2], one]).unwrap();
            let dx = b.add(Op::MatMul { ta: false, tb: false }, &[d, i[1]]).unwrap();
            b.add(Op::Reshape { shape: [48].into() }, &[dx]).unwrap()
        };
        let loss = |b: &mut Graph| {
            let l = b.add(Op::CrossEntropy, &[logits, i[2]]).unwrap();
            b.add(Op::Reshape { shape: [1].into() }, &[l]).unwrap()
        };
        let mut parts = if loss_first { vec![loss(b), grad(b)] } else { vec![grad(b), loss(b)] };
        if logits_out {
            parts.push(b.add(Op::Reshape { shape: [300].into() }, &[logits]).unwrap());
        }
        b.add(Op::Concat { axis: 0 }, &parts).unwrap()
    })
}

#[test]
fn the_gradient_goes_over_the_logits_when_they_die_there() {
    let prog = lower(&linear_ce(true, false)).unwrap();
    let ip = in_place(&prog);
    assert_eq!(ip.len(), 1, "{ip:?}\n{prog}");
    // the loss kernel read the logits before; the gradient GEMM reads the same buffer after
    let logits = prog.gemms().next().map(|g| g.c.buf).unwrap();
    assert_eq!(ip[0].1, prog.buffers[logits].name);
    assert!(prog.gemms().any(|g| g.a.buf == logits), "dx = grad @ w reads the rewritten buffer");
}

#[test]
fn logits_read_later_keep_their_buffer() {
    // the logits are also a result of the kernel: they must survive
    let prog = lower(&linear_ce(true, true)).unwrap();
    assert!(in_place(&prog).is_empty(), "{prog}");
}

#[test]
fn a_gradient_lowered_before_the_loss_keeps_the_logits() {
    // the gradient part comes first: the loss kernel reads the logits after it
    let g = linear_ce(false, false);
    let prog = lower(&g).unwrap();
    let fams: Vec<String> = prog
        .steps
        .iter()
        .filter_map(|s| if let Step::Launch { kernel, .. } = s { Some(prog.kernels[*kernel].family.clone()) } else { None })
        .collect();
    eprintln!("{fams:?}");
    assert!(in_place(&prog).is_empty(), "{prog}");
}

#[test]
fn an_unfused_gradient_goes_over_the_logits_too() {
    let mut g = Graph::new("step");
    let x = g.input("x", InputKind::Data, DType::F32, [6, 8]).unwrap();
    let w = g.input("w", InputKind::Frozen, DType::F32, [50, 8]).unwrap();
    let t = g.input("targets", InputKind::Data, DType::I32, [6]).unwrap();
    let logits = g.add(Op::MatMul { ta: false, tb: true }, &[x, w]).unwrap();
    let loss = g.add(Op::CrossEntropy, &[logits, t]).unwrap();
    let one = g.add(Op::Const { value: 1.0, dtype: DType::F32, shape: qatc_ir::Shape(vec![]) }, &[]).unwrap();
    let d = g.add(Op::CrossEntropyGrad, &[logits, t, one]).unwrap();
    let dx = g.add(Op::MatMul { ta: false, tb: false }, &[d, w]).unwrap();
    g.set_output("loss", loss).unwrap();
    g.set_output("dx", dx).unwrap();
    let prog = lower(&g).unwrap();
    assert_eq!(in_place(&prog).len(), 1, "{prog}");
}
