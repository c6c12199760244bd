//! The CPU rewrite that feeds a 4-bit weight to its GEMM a panel at a time
//! (`qatc_kernels::panels`): what it changes, and what it must leave alone.

mod common;

use qatc_ir::{DType, Graph, InputKind, Op, QuantScheme, QuantSpec};
use qatc_kernels::kir::{Body, Expr, Ix, Space, Stmt};
use qatc_kernels::panels::feed_panels;
use qatc_kernels::{lower, Step};

#[test]
fn a_dequantized_weight_becomes_panels_of_its_rows() {
    // x [8, 128] @ dequant(w [128, 384]) + bias: W's rows are the GEMM's K
    let mut prog = lower(&common::dequant_gemm()).unwrap();
    assert_eq!(prog.steps.len(), 2, "{prog}");
    // 50 rows of 384 f32 are 76800 bytes: panels of 50, 50 and 28 rows
    let (table, r) = feed_panels(&mut prog, 76_800);
    assert_eq!(r.lines.len(), 1, "{r:?}");
    assert_eq!((r.bytes_saved, r.scratch_bytes), (128 * 384 * 4, 50 * 384 * 4));
    assert_eq!(prog.steps.len(), 1, "the dequant launch is gone: {prog}");
    let Step::Gemm(g) = &prog.steps[0] else { panic!("{prog}") };
    let f = table.get(0).expect("fed");
    assert_eq!(table.len(), 1, "{table:?}");
    assert_eq!((f.rows, f.cols, f.panel, f.rows_are_k), (128, 384, 50, true));
    assert_eq!(
        (prog.buffers[g.b.buf].name.as_str(), &prog.buffers[g.b.buf].shape[..]),
        ("dequant_panel", &[50 * 384][..]),
        "one panel of scratch"
    );
    assert!(prog.buffers.iter().any(|b| b.shape == [0] && b.dtype == DType::F32), "W holds nothing");
    // the panel kernel: the dequant over the whole weight, storing row mod 50
    let k = &prog.kernels[f.kernel];
    assert_eq!(k.family, "dequant.panel");
    let Body::Loops { space: Space::Elements { shape }, stmts } = &k.body else { panic!("{k:?}") };
    assert_eq!(shape, &[128, 384]);
    let store = stmts.iter().find_map(|s| if let Stmt::Store { index, .. } = s { Some(index) } else { None }).expect("a store");
    let mut uses = Vec::new();
    qatc_kernels::kir::visit_exprs(std::slice::from_ref(&Stmt::Store { param: 0, index: store.clone(), value: Expr::Int(0) }), &mut |e| {
        uses.push(e.clone())
    });
    assert!(uses.contains(&Expr::Ix(Ix::Coord(0))) && uses.contains(&Expr::Int(50)) && !uses.contains(&Expr::Ix(Ix::Elem)), "{store:?}");
    // the partial GEMMs cover K once, accumulate after the first, and add the bias once, last
    let parts = f.panels(g);
    let ks: Vec<usize> = parts.iter().map(|(_, p)| p.k).collect();
    assert_eq!(ks, [50, 50, 28]);
    let ranges: Vec<(usize, usize)> = parts.iter().map(|(r, _)| *r).collect();
    assert_eq!(ranges, [(0, 50 * 384), (50 * 384, 100 * 384), (100 * 384, 128 * 384)]);
    assert_eq!(parts.iter().map(|(_, p)| p.accumulate).collect::<Vec<_>>(), [false, true, true]);
    assert_eq!(parts.iter().map(|(_, p)| p.bias.is_some()).collect::<Vec<_>>(), [false, false, true]);
    assert_eq!(parts[1].1.a.offset, 50, "the second panel reads columns 50.. of x");
}

/// y = x @ dequant(w)^T: W's rows are the GEMM's N, so each panel writes its own columns of y.
#[test]
fn a_transposed_weight_is_fed_by_output_columns() {
    let spec = QuantSpec { bits: 4, group: 64, scheme: QuantScheme::Sym };
    let g =
        common::fused(common::dequant_bias(), &[common::f32s(&[8, 128]), (DType::I4, vec![384, 128]), common::f32s(&[6, 128])], |b, i| {
            let w = b.add(Op::Dequantize { spec, to: qatc_ir::DType::F32 }, &[i[1], i[2]]).unwrap();
            b.add(Op::MatMul { ta: false, tb: true }, &[i[0], w]).unwrap()
        });
    let mut prog = lower(&g).unwrap();
    let (table, _) = feed_panels(&mut prog, 100 * 128 * 4);
    let Some((i, gm)) = prog.steps.iter().enumerate().find_map(|(i, s)| if let Step::Gemm(g) = s { Some((i, g)) } else { None }) else {
        panic!("{prog}")
    };
    let f = table.get(i).unwrap_or_else(|| panic!("not fed: {prog}"));
    assert!(!f.rows_are_k);
    let parts = f.panels(gm);
    assert_eq!(
        parts.iter().map(|(_, p)| (p.n, p.c.offset, p.k)).collect::<Vec<_>>(),
        [(100, 0, 128), (100, 100, 128), (100, 200, 128), (84, 300, 128)]
    );
    assert!(parts.iter().all(|(_, p)| !p.accumulate && p.b.strides == [1, 128]));
}

/// A dequantized weight that is also a graph output, or that no GEMM reads, stays whole; a zero
/// budget changes nothing.
#[test]
fn weights_read_otherwise_stay_materialized() {
    let spec = QuantSpec { bits: 4, group: 64, scheme: QuantScheme::Sym };
    let mut g = Graph::new("kept");
    let x = g.input("x", InputKind::Data, DType::F32, [8, 128]).unwrap();
    let codes = g.input("w.codes", InputKind::Frozen, DType::I4, [128, 384]).unwrap();
    let scales = g.input("w.scales", InputKind::Frozen, DType::F32, [2, 384]).unwrap();
    let w = g.add(Op::Dequantize { spec, to: qatc_ir::DType::F32 }, &[codes, scales]).unwrap();
    let y = g.add(Op::MatMul { ta: false, tb: false }, &[x, w]).unwrap();
    g.set_output("y", y).unwrap();
    g.set_output("w", w).unwrap();
    let mut prog = lower(&g).unwrap();
    let before = prog.clone();
    let (table, r) = feed_panels(&mut prog, 4096);
    assert!(r.lines.is_empty() && table.is_empty());
    assert_eq!(prog, before);
    let mut prog = lower(&common::dequant_gemm()).unwrap();
    let before = prog.clone();
    let (table, r) = feed_panels(&mut prog, 0);
    assert!(r.lines.is_empty() && table.is_empty());
    assert_eq!(prog, before);
}
