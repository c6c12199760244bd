//! Build-time type errors: each names the node (by name and op, or as a new op) and says what
//! does not fit; the fitting combinations build.

use qatc_ir::{BinaryOp, DType, Graph, InputKind, IrError, NodeId, Op, Shape, UnaryOp};

use crate::{f32_in, i32_in};

/// Asserts a build-time type error whose node label contains `node` and message contains `msg`.
#[track_caller]
fn type_err(r: Result<NodeId, IrError>, node: &str, msg: &str) {
    match r {
        Err(IrError::Type { node: n, msg: m }) => {
            assert!(n.contains(node), "node label {n:?} does not name {node:?} (msg {m:?})");
            assert!(m.contains(msg), "message {m:?} does not contain {msg:?}");
        }
        other => panic!("expected a type error naming {node:?} with {msg:?}, got {other:?}"),
    }
}

#[test]
fn matmul_inner_dim_mismatch_names_the_node() {
    let mut g = Graph::new("t");
    let a = f32_in(&mut g, "a", &[2, 3]);
    let b = f32_in(&mut g, "b", &[4, 5]);
    type_err(
        g.add_named(Op::MatMul { ta: false, tb: false }, &[a, b], "h.0.attn.qk"),
        "\"h.0.attn.qk\" (matmul)",
        "inner dims differ (3 vs 4)",
    );
    // Unnamed nodes are named by their op.
    type_err(g.add(Op::MatMul { ta: false, tb: false }, &[a, b]), "new matmul", "inner dims differ");
    // Transposed reads change which dims must agree: a^T [3, 2] x b^T [5, 4]: 2 vs 5.
    type_err(g.add(Op::MatMul { ta: true, tb: true }, &[a, b]), "matmul", "(2 vs 5)");
    // Batch dims must be equal, ranks >= 2, dtypes equal.
    let c = f32_in(&mut g, "c", &[2, 3, 4]);
    let d = f32_in(&mut g, "d", &[3, 4, 5]);
    type_err(g.add(Op::MatMul { ta: false, tb: false }, &[c, d]), "matmul", "equal batch dims");
    let v = f32_in(&mut g, "v", &[3]);
    type_err(g.add(Op::MatMul { ta: false, tb: false }, &[v, v]), "matmul", "rank");
    let h = g.input("h", InputKind::Data, DType::F16, [3, 5]).expect("input");
    type_err(g.add(Op::MatMul { ta: false, tb: false }, &[a, h]), "matmul", "dtypes differ");
    // And the fitting combinations build.
    for (ta, tb, bs) in [(false, false, [3, 5]), (false, true, [5, 3]), (true, false, [2, 5]), (true, true, [5, 2])] {
        let b = g.constant(0.0, DType::F32, bs).expect("const");
        let y = g.add(Op::MatMul { ta, tb }, &[a, b]).expect("matmul");
        let m = if ta { 3 } else { 2 };
        assert_eq!(g.ty(y).shape, Shape::new([m, 5]));
    }
}

#[test]
fn elementwise_type_errors() {
    let mut g = Graph::new("t");
    let a = f32_in(&mut g, "a", &[2, 3]);
    let b = f32_in(&mut g, "b", &[3, 2]);
    let i = i32_in(&mut g, "i", &[2, 3]);
    let h = g.input("h", InputKind::Data, DType::BF16, [2, 3]).expect("input");
    type_err(g.add_named(Op::Binary(BinaryOp::Add), &[a, b], "resid"), "\"resid\" (add)", "operand types differ");
    type_err(g.add(Op::Binary(BinaryOp::Mul), &[a, h]), "new mul", "operand types differ");
    type_err(g.add(Op::Unary(UnaryOp::Exp), &[i]), "new exp", "must be a float tensor");
    type_err(g.add(Op::Binary(BinaryOp::Add), &[i, i]), "add", "must be a float tensor");
    type_err(g.add(Op::Affine { mul: 2.0, add: 0.0 }, &[i]), "affine", "float");
    type_err(g.add(Op::AdamM { beta1: 0.9 }, &[a, b]), "adam_m", "operand types differ");
    // Arity.
    type_err(g.add(Op::Unary(UnaryOp::Neg), &[a, a]), "neg", "takes 1 operand(s), got 2");
    type_err(g.add(Op::Binary(BinaryOp::Sub), &[a]), "sub", "takes 2 operand(s), got 1");
    type_err(g.add(Op::Concat { axis: 0 }, &[]), "concat", "at least one operand");
    // Casts accept anything.
    let c = g.add(Op::Cast { to: DType::I4 }, &[a]).expect("cast");
    assert_eq!(g.ty(c).dtype, DType::I4);
}

#[test]
fn shape_op_type_errors() {
    let mut g = Graph::new("t");
    let x = f32_in(&mut g, "x", &[2, 3, 4]);
    let i = i32_in(&mut g, "i", &[2, 3]);
    type_err(g.add_named(Op::Broadcast { shape: Shape::new([2, 5, 4]) }, &[x], "bc"), "\"bc\"", "cannot broadcast");
    type_err(g.add(Op::Broadcast { shape: Shape::new([3, 4]) }, &[x]), "broadcast", "cannot broadcast");
    type_err(g.add(Op::SumTo { shape: Shape::new([2, 4]) }, &[x]), "sum_to", "cannot sum");
    type_err(g.add(Op::SumTo { shape: Shape::new([2, 3]) }, &[i]), "sum_to", "float");
    type_err(g.add(Op::Reshape { shape: Shape::new([5, 5]) }, &[x]), "reshape", "changes the element count");
    type_err(g.add(Op::Transpose { perm: vec![0, 0, 1] }, &[x]), "transpose", "not a permutation");
    type_err(g.add(Op::Transpose { perm: vec![0, 1] }, &[x]), "transpose", "not a permutation");
    type_err(g.add(Op::Transpose { perm: vec![0, 1, 3] }, &[x]), "transpose", "not a permutation");
    type_err(g.add(Op::Slice { axis: 1, start: 2, end: 4 }, &[x]), "slice", "out of range");
    type_err(g.add(Op::Slice { axis: 1, start: 2, end: 2 }, &[x]), "slice", "out of range");
    type_err(g.add(Op::Slice { axis: 3, start: 0, end: 1 }, &[x]), "slice", "out of range");
    let y = f32_in(&mut g, "y", &[2, 5, 3]);
    type_err(g.add(Op::Concat { axis: 1 }, &[x, y]), "concat", "does not fit");
    let z = g.input("z", InputKind::Data, DType::F16, [2, 1, 4]).expect("input");
    type_err(g.add(Op::Concat { axis: 1 }, &[x, z]), "concat", "does not fit");
    type_err(g.add(Op::Concat { axis: 3 }, &[x]), "concat", "out of range");
    // The valid ones compute the documented shapes.
    let t = g.add(Op::Transpose { perm: vec![2, 0, 1] }, &[x]).expect("transpose");
    assert_eq!(g.ty(t).shape, Shape::new([4, 2, 3]));
    let w = f32_in(&mut g, "w", &[2, 1, 4]);
    let c = g.add(Op::Concat { axis: 1 }, &[x, w, x]).expect("concat");
    assert_eq!(g.ty(c).shape, Shape::new([2, 7, 4]));
    let s = g.add(Op::SumTo { shape: Shape::new([3, 1]) }, &[x]).expect("sum_to");
    assert_eq!(g.ty(s).shape, Shape::new([3, 1]));
}

#[test]
fn nn_op_type_errors() {
    let mut g = Graph::new("t");
    let table = f32_in(&mut g, "wte", &[10, 4]);
    let ids = i32_in(&mut g, "ids", &[2, 3]);
    let fids = f32_in(&mut g, "fids", &[2, 3]);
    let x = f32_in(&mut g, "x", &[2, 3, 4]);
    type_err(g.add_named(Op::Gather, &[table, fids], "tok_emb"), "\"tok_emb\" (gather)", "ids must be i32");
    type_err(g.add(Op::Gather, &[x, ids]), "gather", "must be [V, C]");
    let dy = f32_in(&mut g, "dy", &[2, 4, 4]);
    type_err(g.add(Op::ScatterAdd { rows: 10 }, &[ids, dy]), "scatter_add", "plus a channel dim");
    let c3 = f32_in(&mut g, "c3", &[3]);
    let c4 = f32_in(&mut g, "c4", &[4]);
    type_err(g.add_named(Op::LayerNorm { eps: 1e-5 }, &[x, c3, c4], "ln_1"), "\"ln_1\" (layernorm)", "gamma must be [4]");
    type_err(g.add(Op::LayerNorm { eps: 1e-5 }, &[x, c4, c3]), "layernorm", "beta must be [4]");
    let s = f32_in(&mut g, "s", &[]);
    type_err(g.add(Op::LayerNorm { eps: 1e-5 }, &[s, s, s]), "layernorm", "scalar");
    type_err(g.add(Op::LayerNormGradX { eps: 1e-5 }, &[x, c4, dy]), "layernorm_grad_x", "x and dy");
    type_err(g.add(Op::Softmax { scale: 1.0, causal: true }, &[x]), "softmax", "square");
    type_err(g.add(Op::Softmax { scale: 1.0, causal: false }, &[s]), "softmax", "rank >= 1");
    type_err(g.add(Op::SoftmaxGrad { scale: 1.0 }, &[x, dy]), "softmax_grad", "y and dy");
    let logits = f32_in(&mut g, "logits", &[6, 10]);
    let t6 = i32_in(&mut g, "t6", &[6]);
    let t5 = i32_in(&mut g, "t5", &[5]);
    type_err(g.add(Op::CrossEntropy, &[logits, t5]), "cross_entropy", "targets [N]");
    type_err(g.add(Op::CrossEntropy, &[x, t6]), "cross_entropy", "logits [N, V]");
    type_err(g.add(Op::CrossEntropy, &[logits, logits]), "cross_entropy", "targets must be i32");
    type_err(g.add(Op::CrossEntropyGrad, &[logits, t6, c4]), "cross_entropy_grad", "dloss must be a scalar");
    let p = f32_in(&mut g, "p", &[4]);
    type_err(
        g.add(Op::AdamParam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }, &[p, p, p, c4, s]),
        "adam_param",
        "lr must be a float scalar",
    );
    let si = i32_in(&mut g, "si", &[]);
    type_err(
        g.add(Op::AdamParam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }, &[p, p, p, s, si]),
        "adam_param",
        "step must be a float scalar",
    );
    // Valid ones.
    let e = g.add(Op::Gather, &[table, ids]).expect("gather");
    assert_eq!(g.ty(e).shape, Shape::new([2, 3, 4]));
    let sq = f32_in(&mut g, "sq", &[2, 5, 5]);
    g.add(Op::Softmax { scale: 0.5, causal: true }, &[sq]).expect("causal softmax on square dims");
    let l = g.add(Op::CrossEntropy, &[logits, t6]).expect("cross_entropy");
    assert_eq!(g.ty(l).shape, Shape::scalar());
}

#[test]
fn quantization_op_type_errors() {
    use qatc_ir::{QuantScheme, QuantSpec};
    let spec = |bits, group, scheme| QuantSpec { bits, group, scheme };
    let mut g = Graph::new("t");
    let w = f32_in(&mut g, "w", &[64, 8]);
    let v = f32_in(&mut g, "v", &[64]);
    let fq = |s| Op::FakeQuant { spec: s };
    type_err(
        g.add_named(fq(spec(4, 24, QuantScheme::Sym)), &[w], "c_attn.fq"),
        "\"c_attn.fq\" (fake_quant)",
        "group 24 does not divide the input dimension 64",
    );
    type_err(g.add(fq(spec(9, 0, QuantScheme::Sym)), &[w]), "fake_quant", "bits must be 2..8");
    type_err(g.add(fq(spec(1, 0, QuantScheme::Asym)), &[w]), "fake_quant", "bits must be 2..8");
    type_err(g.add(fq(spec(3, 0, QuantScheme::Nf4)), &[w]), "fake_quant", "nf4 needs 4 bits");
    type_err(g.add(fq(spec(4, 16, QuantScheme::Q4_0)), &[w]), "fake_quant", "q4_0 needs 4 bits and group 32");
    type_err(g.add(fq(spec(4, 0, QuantScheme::Sym)), &[v]), "fake_quant", "weight [in, out]");
    for (bits, group, scheme) in
        [(4, 0, QuantScheme::Sym), (8, 16, QuantScheme::Asym), (4, 64, QuantScheme::Nf4), (4, 32, QuantScheme::Q4_0)]
    {
        g.add(fq(spec(bits, group, scheme)), &[w]).expect("valid fake_quant");
    }
    // Dequantize: operand count by scheme, code and scale dtypes and shapes.
    let codes4 = g.input("codes4", InputKind::Frozen, DType::I4, [64, 8]).expect("input");
    let codes8 = g.input("codes8", InputKind::Frozen, DType::U8, [64, 8]).expect("input");
    let s2 = f32_in(&mut g, "s2", &[2, 8]);
    let s4 = f32_in(&mut g, "s4", &[4, 8]);
    let h2 = g.input("h2", InputKind::Frozen, DType::F16, [2, 8]).expect("input");
    let dq = |s| Op::Dequantize { spec: s, to: qatc_ir::DType::F32 };
    g.add(dq(spec(4, 32, QuantScheme::Sym)), &[codes4, s2]).expect("sym");
    g.add(dq(spec(8, 32, QuantScheme::Asym)), &[codes8, s2, s2]).expect("asym");
    g.add(dq(spec(4, 32, QuantScheme::Q4_0)), &[codes4, h2]).expect("q4_0");
    type_err(g.add(dq(spec(8, 32, QuantScheme::Asym)), &[codes8, s2]), "dequantize", "takes 3 operands");
    type_err(g.add(dq(spec(4, 32, QuantScheme::Sym)), &[codes4, s2, s2]), "dequantize", "takes 2 operands");
    type_err(g.add(dq(spec(8, 32, QuantScheme::Sym)), &[codes4, s2]), "dequantize", "codes must be u8[in, out]");
    type_err(g.add(dq(spec(4, 16, QuantScheme::Sym)), &[codes4, s2]), "dequantize", "scales must be f32[4, 8]");
    type_err(g.add(dq(spec(4, 32, QuantScheme::Q4_0)), &[codes4, s2]), "dequantize", "scales must be f16[2, 8]");
    type_err(g.add(dq(spec(8, 16, QuantScheme::Asym)), &[codes8, s4, s2]), "dequantize", "zero points must be f32[4, 8]");
    // ActQuant and Dropout.
    type_err(g.add(Op::ActQuant { bits: 9 }, &[w]), "act_quant", "bits 2..8");
    let sc = f32_in(&mut g, "sc", &[]);
    type_err(g.add(Op::ActQuant { bits: 8 }, &[sc]), "act_quant", "rank >= 1");
    let seed = i32_in(&mut g, "seed", &[]);
    let fseed = f32_in(&mut g, "fseed", &[]);
    type_err(g.add(Op::Dropout { p: 1.0, stream: 0 }, &[w, seed]), "dropout", "p must be in [0, 1)");
    type_err(g.add(Op::Dropout { p: f64::NAN, stream: 0 }, &[w, seed]), "dropout", "p must be in [0, 1)");
    type_err(g.add(Op::Dropout { p: 0.1, stream: 0 }, &[w, fseed]), "dropout", "seed must be i32[]");
    g.add(Op::Dropout { p: 0.1, stream: 3 }, &[w, seed]).expect("dropout");
}

#[test]
fn leaves_and_ids_are_checked() {
    let mut g = Graph::new("t");
    type_err(g.add(Op::Input { kind: InputKind::Data, dtype: DType::F32, shape: Shape::new([2]) }, &[]), "new input", "must be named");
    g.input("x", InputKind::Frozen, DType::F32, [2]).expect("input");
    assert_eq!(g.input("x", InputKind::Data, DType::I32, [3]), Err(IrError::DuplicateInput("x".into())));
    // An operand id this graph never handed out.
    let mut big = Graph::new("big");
    let mut last = None;
    for k in 0..5 {
        last = Some(big.constant(k as f64, DType::F32, [2]).expect("const"));
    }
    let foreign = last.expect("built five");
    assert_eq!(g.add(Op::Unary(UnaryOp::Neg), &[foreign]), Err(IrError::UnknownNode(foreign.index() as u32)));
    assert_eq!(g.set_output("y", foreign), Err(IrError::UnknownNode(foreign.index() as u32)));
    // Duplicate output names.
    let x = g.find_input("x").expect("x");
    g.set_output("y", x).expect("first output");
    assert_eq!(g.set_output("y", x), Err(IrError::DuplicateOutput("y".into())));
    // A failed add leaves the graph unchanged.
    assert_eq!(g.len(), 1);
}
