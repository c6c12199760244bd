//! Lowering: what becomes a view, a GEMM, one kernel or several.

mod common;

use qatc_ir::{BinaryOp, DType, Graph, InputKind, Op};
use qatc_kernels::kir::{Body, Space};
use qatc_kernels::{cuda_kernels, lower, Step};

#[test]
fn shape_ops_are_views_and_matmuls_are_gemms() {
    // q k^T on heads sliced out of qkv: no copy kernel, one GEMM reading strided views
    let mut g = Graph::new("heads");
    let qkv = g.input("qkv", InputKind::Data, DType::F32, [8, 384]).unwrap();
    let head = |g: &mut Graph, k: usize| {
        let s = g.add(Op::Slice { axis: 1, start: k * 128, end: (k + 1) * 128 }, &[qkv]).unwrap();
        let r = g.add(Op::Reshape { shape: [1, 8, 4, 32].into() }, &[s]).unwrap();
        g.add(Op::Transpose { perm: vec![0, 2, 1, 3] }, &[r]).unwrap()
    };
    let (q, k) = (head(&mut g, 0), head(&mut g, 1));
    let s = g.add(Op::MatMul { ta: false, tb: true }, &[q, k]).unwrap();
    g.set_output("s", s).unwrap();
    let prog = lower(&g).unwrap();
    assert_eq!(prog.steps.len(), 1);
    let Step::Gemm(gm) = &prog.steps[0] else { panic!("{prog}") };
    assert_eq!((gm.m, gm.n, gm.k), (8, 8, 32));
    assert_eq!((gm.a.offset, gm.a.strides.clone()), (0, vec![0, 32, 384, 1]));
    // k^T: the transpose is the view's swapped strides
    assert_eq!((gm.b.offset, gm.b.strides.clone()), (128, vec![0, 32, 1, 384]));
}

#[test]
fn a_concat_of_gemms_writes_each_into_its_slice() {
    let g =
        common::fused(qatc_ir::KernelFamily::GEMM, &[common::f32s(&[8, 16]), common::f32s(&[16, 4]), common::f32s(&[16, 4])], |b, i| {
            let y0 = b.add(Op::MatMul { ta: false, tb: false }, &[i[0], i[1]]).unwrap();
            let y1 = b.add(Op::MatMul { ta: false, tb: false }, &[i[0], i[2]]).unwrap();
            let y0 = b.add(Op::Reshape { shape: [32].into() }, &[y0]).unwrap();
            let y1 = b.add(Op::Reshape { shape: [32].into() }, &[y1]).unwrap();
            b.add(Op::Concat { axis: 0 }, &[y0, y1]).unwrap()
        });
    let prog = lower(&g).unwrap();
    let gemms: Vec<_> = prog.gemms().collect();
    assert_eq!((prog.steps.len(), gemms.len()), (2, 2), "{prog}");
    assert_eq!((gemms[0].c.offset, gemms[1].c.offset), (0, 32));
    assert_eq!(gemms[0].c.buf, gemms[1].c.buf);
}

#[test]
fn an_epilogue_after_a_row_op_shares_its_kernel() {
    // gelu(layernorm(x)) + y: one row kernel, the epilogue applied before the store
    let tys = [common::f32s(&[4, 64]), common::f32s(&[64]), common::f32s(&[64]), common::f32s(&[4, 64])];
    let g = common::fused(qatc_ir::KernelFamily::LayerNorm { residual: false, aux: false }, &tys, |b, i| {
        let ln = b.add(Op::LayerNorm { eps: 1e-5 }, &[i[0], i[1], i[2]]).unwrap();
        let ge = b.add(Op::Unary(qatc_ir::UnaryOp::Gelu), &[ln]).unwrap();
        b.add(Op::Binary(BinaryOp::Add), &[ge, i[3]]).unwrap()
    });
    let prog = lower(&g).unwrap();
    assert_eq!(prog.steps.len(), 1, "{prog}");
    assert!(matches!(&prog.kernels[0].body, Body::Loops { space: Space::Rows { rows: 4, .. }, .. }));
    assert!(prog.splits.is_empty());
}

#[test]
fn layers_share_kernels_and_names_are_stable() {
    let (_, a) = cuda_kernels(&common::residual_layernorm(), &qatc_kernels::Target::of(qatc_kernels::TargetKind::Cuda)).unwrap();
    let (_, b) = cuda_kernels(&common::residual_layernorm(), &qatc_kernels::Target::of(qatc_kernels::TargetKind::Cuda)).unwrap();
    assert_eq!(a, b, "deterministic");
    let name = &a[0].name;
    let hash = name.strip_prefix("fused_layernorm_").expect("fused_{family}_{hash8}");
    assert!(hash.len() == 8 && hash.chars().all(|c| c.is_ascii_hexdigit()), "{name}");
    // one identity: the name carries the hash that deduplicates the launches
    let (prog, _) = cuda_kernels(&common::residual_layernorm(), &qatc_kernels::Target::of(qatc_kernels::TargetKind::Cuda)).unwrap();
    assert_eq!(format!("{:08x}", prog.kernels[0].identity() >> 32), hash);
    assert_eq!(prog.kernels[0].name(), *name);
    let ids: std::collections::HashSet<u64> = prog.kernels.iter().map(|k| k.identity()).collect();
    assert_eq!(ids.len(), prog.kernels.len(), "distinct kernels have distinct identities");
}

#[test]
fn an_unfused_step_lowers_every_node() {
    // the 1-layer tiny GPT-2 step, one op per node: every node is a launch, a GEMM or a view
    let text = include_str!("../../tests/snapshots/snapshots_ir__adamw.snap");
    let body = text.splitn(3, "---").nth(2).expect("insta header");
    let g = qatc_ir::parse(body.trim_start()).unwrap();
    let prog = lower(&g).unwrap();
    assert!(prog.launches() > 50 && prog.gemms().count() > 10, "{prog}");
    assert_eq!(prog.outputs.len() + prog.updates.len(), g.outputs().len());
    assert_eq!(prog.updates.len(), g.outputs().iter().filter(|o| o.update).count());
}

#[test]
fn the_fused_qlora_step_lowers() {
    // egg fusion's output for the tiny step: attention runs as the tiled kernels
    let text = include_str!("../../tests/snapshots/snapshots_fusion__fused_qlora.snap");
    let body = text.splitn(3, "---").nth(2).expect("insta header");
    let g = qatc_ir::parse(body.trim_start()).unwrap();
    let (prog, kernels) = cuda_kernels(&g, &qatc_kernels::Target::of(qatc_kernels::TargetKind::Cuda)).unwrap();
    assert!(kernels.iter().any(|k| k.source.contains("qatc::attention_forward<")), "{prog}");
    assert!(kernels.iter().any(|k| k.source.contains("qatc::attention_backward_q<")), "{prog}");
}
