//! Property: fusion never changes what a graph computes and never produces a graph that fails
//! verification. Random small graphs (4 x 4 values: elementwise, layout, GEMM with and without a
//! dequantized weight, layernorm, softmax, reductions) with random extra outputs (so some
//! intermediates have consumers outside any kernel) are fused and run on the interpreter against
//! the unfused graph: every output within 1e-5 relative (max |fused - unfused| / max |unfused|).

mod fusion_util;

use fusion_util::{fuse, inputs, max_rel_diff};
use proptest::prelude::*;
use qatc_ir::{BinaryOp, DType, Graph, InputKind, NodeId, Op, QuantScheme, QuantSpec, Shape, UnaryOp};

const N: usize = 4;

fn build(steps: &[(u8, usize, usize)], extra_outputs: &[usize]) -> Graph {
    let mut g = Graph::new("random");
    let mut vals: Vec<NodeId> = (0..3).map(|i| g.input(format!("x{i}"), InputKind::Data, DType::F32, [N, N]).unwrap()).collect();
    let vec = g.input("v", InputKind::Data, DType::F32, [N]).unwrap();
    let gamma = g.input("gamma", InputKind::Data, DType::F32, [N]).unwrap();
    let spec = QuantSpec { bits: 4, group: N, scheme: QuantScheme::Sym };
    let codes = g.input("w.qcodes", InputKind::Frozen, DType::I4, [N, N]).unwrap();
    let scales = g.input("w.qscales", InputKind::Frozen, DType::F32, [1, N]).unwrap();
    let sq = Shape::new([N, N]);
    for &(kind, a, b) in steps {
        let (x, y) = (vals[a % vals.len()], vals[b % vals.len()]);
        let add = |g: &mut Graph, op: Op, args: &[NodeId]| g.add(op, args).unwrap();
        let v = match kind % 16 {
            0 => add(&mut g, Op::Unary(UnaryOp::Tanh), &[x]),
            1 => add(&mut g, Op::Unary(UnaryOp::Gelu), &[x]),
            2 => add(&mut g, Op::Binary(BinaryOp::Add), &[x, y]),
            3 => add(&mut g, Op::Binary(BinaryOp::Mul), &[x, y]),
            4 => add(&mut g, Op::Binary(BinaryOp::Sub), &[x, y]),
            5 => add(&mut g, Op::Affine { mul: 0.5, add: 0.25 }, &[x]),
            6 => {
                let bb = add(&mut g, Op::Broadcast { shape: sq.clone() }, &[vec]);
                add(&mut g, Op::Binary(BinaryOp::Add), &[x, bb])
            }
            7 => add(&mut g, Op::MatMul { ta: false, tb: b % 2 == 0 }, &[x, y]),
            8 => {
                let w = add(&mut g, Op::Dequantize { spec, to: qatc_ir::DType::F32 }, &[codes, scales]);
                add(&mut g, Op::MatMul { ta: false, tb: false }, &[x, w])
            }
            9 => add(&mut g, Op::LayerNorm { eps: 1e-5 }, &[x, gamma, vec]),
            10 => add(&mut g, Op::Softmax { scale: 0.5, causal: b % 2 == 1 }, &[x]),
            11 => add(&mut g, Op::Transpose { perm: vec![1, 0] }, &[x]),
            12 => {
                let s = add(&mut g, Op::SumTo { shape: Shape::new([N]) }, &[x]);
                add(&mut g, Op::Broadcast { shape: sq.clone() }, &[s])
            }
            13 => add(&mut g, Op::Binary(BinaryOp::GeluGrad), &[x, y]),
            14 => add(&mut g, Op::LayerNormGradX { eps: 1e-5 }, &[x, gamma, y]),
            _ => add(&mut g, Op::Binary(BinaryOp::Max), &[x, y]),
        };
        vals.push(v);
    }
    let last = *vals.last().unwrap();
    g.set_output("out", last).unwrap();
    for (i, &e) in extra_outputs.iter().enumerate() {
        let v = vals[3 + e % (vals.len() - 3).max(1)];
        if v != last {
            let _ = g.set_output(format!("extra{i}"), v);
        }
    }
    g
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn fusion_preserves_results(
        steps in prop::collection::vec((0u8..16, 0usize..64, 0usize..64), 1..14),
        extra in prop::collection::vec(0usize..64, 0..3),
        seed in 1u64..1000,
    ) {
        let g = build(&steps, &extra);
        prop_assume!(qatc_ir::verify(&g).is_ok());
        let (f, r) = fuse(&g); // verifies and round-trips the fused graph
        prop_assert!(r.kernels_after <= r.kernels_before, "{} -> {} kernels", r.kernels_before, r.kernels_after);
        let d = max_rel_diff(&g, &f, &inputs(&g, seed, 16));
        prop_assert!(d <= 1e-5, "fused results differ by {:e}\n{}", d, qatc_ir::print(&f));
    }
}
