//! Unit tests of the IR's checks: type errors at build time (naming the node), parser errors
//! (carrying the line), update targets, the verifier, `topo_order`, `remove_dead`,
//! `replace_all_uses`, and a snapshot pinning the text format itself.

use qatc_ir::{parse, print, verify, BinaryOp, DType, Graph, InputKind, IrError, NodeId, Op, Shape, UnaryOp};

fn f32_in(g: &mut Graph, name: &str, shape: &[usize]) -> NodeId {
    g.input(name, InputKind::Data, DType::F32, shape.to_vec()).expect("input")
}

fn i32_in(g: &mut Graph, name: &str, shape: &[usize]) -> NodeId {
    g.input(name, InputKind::Data, DType::I32, shape.to_vec()).expect("input")
}

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

// ---------------------------------------------------------------------------------------------
// Build-time type errors.

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

// ---------------------------------------------------------------------------------------------
// Update targets.

#[test]
fn update_targets_must_be_trainable_or_state_of_equal_type() {
    let mut g = Graph::new("t");
    let w = g.input("w", InputKind::Trainable, DType::F32, [3]).expect("input");
    let m = g.input("m", InputKind::State, DType::F32, [3]).expect("input");
    let f = g.input("f", InputKind::Frozen, DType::F32, [3]).expect("input");
    let d = g.input("d", InputKind::Data, DType::F32, [3]).expect("input");
    let h = g.input("h", InputKind::Trainable, DType::F16, [3]).expect("input");
    let v = g.add(Op::Unary(UnaryOp::Neg), &[w]).expect("neg");
    let long = g.constant(0.0, DType::F32, [4]).expect("const");
    g.set_update("w", v).expect("trainable target");
    g.set_update("m", v).expect("state target");
    assert_eq!(g.set_update("f", v), Err(IrError::BadUpdateTarget("f".into())));
    assert_eq!(g.set_update("d", v), Err(IrError::BadUpdateTarget("d".into())));
    assert_eq!(g.set_update("nope", v), Err(IrError::BadUpdateTarget("nope".into())));
    assert_eq!(g.set_update("h", v), Err(IrError::UpdateType { name: "h".into(), got: "f32[3]".into(), want: "f16[3]".into() }));
    assert_eq!(
        g.set_update("w", long).map_err(|e| e.to_string()),
        Err("update of \"w\": value type f32[4] differs from the input's f32[3]".into())
    );
    assert_eq!(g.set_update("w", v), Err(IrError::DuplicateOutput("w".into())));
    // An output may share an update's name.
    g.set_output("w", v).expect("output named like an update");
    verify(&g).expect("valid");
    // Freezing an updated weight afterwards is caught by the verifier.
    g.set_input_kind(w, InputKind::Frozen);
    assert_eq!(verify(&g), Err(IrError::BadUpdateTarget("w".into())));
    let _ = (m, f, d, h);
}

// ---------------------------------------------------------------------------------------------
// Parser errors carry the line number.

/// Asserts a parse error on `line` whose message contains `msg`.
#[track_caller]
fn parse_err(text: &str, line: usize, msg: &str) {
    match parse(text) {
        Err(IrError::Parse { line: l, msg: m }) => {
            assert_eq!(l, line, "wrong line for {m:?}");
            assert!(m.contains(msg), "message {m:?} does not contain {msg:?}");
        }
        Err(e) => panic!("expected a parse error on line {line}, got {e:?}"),
        Ok(g) => panic!("expected a parse error on line {line}, parsed:\n{}", print(&g)),
    }
}

const HEAD: &str = "graph \"p\" {\n  %0 = input[kind=data] : f32[2, 3] \"x\"\n";

#[test]
fn parser_errors_carry_the_line() {
    // A valid baseline, so the errors below come from the one bad line.
    let ok = format!("{HEAD}  %1 = neg(%0) : f32[2, 3]\n  output \"y\" = %1\n}}\n");
    parse(&ok).expect("baseline parses");

    parse_err(&format!("{HEAD}  %1 = frobnicate(%0) : f32[2, 3]\n}}\n"), 3, "unknown op `frobnicate`");
    parse_err(&format!("{HEAD}  %1 = neg(%0) : f64[2, 3]\n}}\n"), 3, "unknown dtype `f64`");
    parse_err(&format!("{HEAD}  %1 = input[kind=data] : q8[2] \"q\"\n}}\n"), 3, "unknown dtype `q8`");
    parse_err(&format!("{HEAD}  %1 = cast[to=f8](%0) : f32[2, 3]\n}}\n"), 3, "unknown dtype `f8`");
    parse_err(&format!("{HEAD}  %1 = neg(%2) : f32[2, 3]\n  %2 = neg(%0) : f32[2, 3]\n}}\n"), 3, "%2 is used before it is defined");
    parse_err(&format!("{HEAD}  output \"y\" = %7\n}}\n"), 3, "%7 is used before it is defined");
    parse_err(&format!("{HEAD}  %1 = neg(%0) : f32[3, 2]\n}}\n"), 3, "written type f32[3, 2] but the op computes f32[2, 3]");
    parse_err(&format!("{HEAD}  %1 = neg(%0) : f16[2, 3]\n}}\n"), 3, "written type f16[2, 3]");
    parse_err(&format!("{HEAD}  %1 = input[kind=frozen] : f32[4] \"x\"\n}}\n"), 3, "input \"x\" is declared twice");
    parse_err(&format!("{HEAD}  %1 = neg(%0) : f32[2, 3]\n"), 3, "missing closing `}`");
    parse_err(&format!("{HEAD}  %1 = neg(%0) : f32[2, 3]\n  output \"y\" = %1"), 4, "missing closing `}`");
    parse_err(&format!("{HEAD}}}\n  %1 = neg(%0) : f32[2, 3]\n"), 4, "after the closing");
    parse_err(&format!("{HEAD}  %0 = neg(%0) : f32[2, 3]\n}}\n"), 3, "%0 is defined twice");
    parse_err(&format!("{HEAD}  %1 = matmul[ta=false, tb=false](%0, %0) : f32[2, 3]\n}}\n"), 3, "inner dims differ");
    parse_err(&format!("{HEAD}  %1 = input[kind=weird] : f32[2] \"w\"\n}}\n"), 3, "unknown input kind `weird`");
    parse_err(&format!("{HEAD}  %1 = affine[mul=2.0](%0) : f32[2, 3]\n}}\n"), 3, "missing attribute `add`");
    parse_err(&format!("{HEAD}  %1 = affine[mul=two, add=0.0](%0) : f32[2, 3]\n}}\n"), 3, "`two` is not a number");
    parse_err(&format!("{HEAD}  %1 = softmax[scale=1.0, causal=yes](%0) : f32[2, 3]\n}}\n"), 3, "`yes` is not a bool");
    parse_err(&format!("{HEAD}  %1 = neg(%0) : f32[2, 3] \"bad \\q escape\"\n}}\n"), 3, "unknown escape");
    parse_err(&format!("{HEAD}  %1 = neg(%0) : f32[2, 3] \"open\n}}\n"), 3, "unterminated string");
    parse_err(&format!("{HEAD}  %1 = neg(%0) : f32[2, 3] trailing\n}}\n"), 3, "unexpected `trailing`");
    parse_err(&format!("{HEAD}  update \"x\" = %0\n}}\n"), 3, "not a trainable or state input");
    parse_err(&format!("{HEAD}  output \"y\" = %0\n  output \"y\" = %0\n}}\n"), 4, "declared twice");
    let w = "  %1 = input[kind=frozen] : f32[64, 8] \"w\"\n";
    parse_err(
        &format!("{HEAD}{w}  %2 = fake_quant[bits=4, group=0, scheme=int4](%1) : f32[64, 8]\n}}\n"),
        4,
        "unknown quant scheme `int4`",
    );
    parse_err(&format!("{HEAD}{w}  %2 = fake_quant[bits=300, group=0, scheme=sym](%1) : f32[64, 8]\n}}\n"), 4, "bits 300 out of range");
    parse_err(&format!("{HEAD}{w}  %2 = fake_quant[bits=4, group=7, scheme=sym](%1) : f32[64, 8]\n}}\n"), 4, "group 7 does not divide");
    parse(&format!("{HEAD}{w}  %2 = fake_quant[bits=4, group=32, scheme=q4_0](%1) : f32[64, 8]\n}}\n")).expect("valid fake_quant");
    parse_err("", 1, "empty input");
    parse_err("grph \"p\" {\n}\n", 1, "expected `graph`");
    // Blank and comment lines are skipped but still counted.
    parse_err(&format!("{HEAD}\n  // a comment\n\n  %1 = nope(%0) : f32[2, 3]\n}}\n"), 6, "unknown op `nope`");
}

#[test]
fn parse_errors_display_the_line() {
    let e = parse(&format!("{HEAD}  %1 = frobnicate(%0) : f32[2, 3]\n}}\n")).expect_err("bad op");
    assert_eq!(e.to_string(), "line 3: unknown op `frobnicate`");
}

// ---------------------------------------------------------------------------------------------
// The verifier.

#[test]
fn verify_names_the_node_as_printed() {
    // replace_all_uses does not check types, so it can leave an ill-typed user behind; the
    // verifier must then name it by its printed number, name and op.
    let mut g = Graph::new("t");
    let a = f32_in(&mut g, "a", &[2, 3]);
    let b = f32_in(&mut g, "b", &[3, 4]);
    let y = g.add_named(Op::MatMul { ta: false, tb: false }, &[a, b], "proj").expect("matmul");
    g.set_output("y", y).expect("output");
    let wrong = f32_in(&mut g, "wrong", &[5, 4]);
    g.replace_all_uses(b, wrong);
    match verify(&g) {
        Err(IrError::Type { node, msg }) => {
            assert_eq!(node, "%2 \"proj\" (matmul)");
            assert!(msg.contains("inner dims differ (3 vs 5)"), "{msg}");
        }
        other => panic!("expected a type error, got {other:?}"),
    }
    // A same-shape replacement of another dtype is "recorded type ... but the op computes".
    let mut g = Graph::new("t");
    let a = f32_in(&mut g, "a", &[2]);
    let n = g.add(Op::Unary(UnaryOp::Neg), &[a]).expect("neg");
    g.set_output("n", n).expect("output");
    let h = g.input("h", InputKind::Data, DType::F16, [2]).expect("input");
    g.replace_all_uses(a, h);
    match verify(&g) {
        Err(IrError::Type { node, msg }) => {
            assert_eq!(node, "%1 (neg)");
            assert_eq!(msg, "recorded type f32[2] but the op computes f16[2]");
        }
        other => panic!("expected a type error, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// topo_order.

/// Checks that `order` lists every live node once, each after all its operands.
#[track_caller]
fn assert_topological(g: &Graph, order: &[NodeId]) {
    assert_eq!(order.len(), g.len(), "every node once");
    let pos: std::collections::HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    assert_eq!(pos.len(), g.len(), "no node twice");
    for &n in order {
        for o in g.operands(n) {
            assert!(pos[&o] < pos[&n], "{} comes before its operand {}", g.describe(n), g.describe(o));
        }
    }
}

#[test]
fn topo_order_has_no_false_cycles() {
    let mut g = Graph::new("t");
    let x = f32_in(&mut g, "x", &[4]);
    // The same operand in several slots of one node.
    let sq = g.add(Op::Binary(BinaryOp::Mul), &[x, x]).expect("mul");
    let cat = g.add(Op::Concat { axis: 0 }, &[sq, x, sq, x]).expect("concat");
    // A diamond, and a second diamond on top sharing the first.
    let l = g.add(Op::Unary(UnaryOp::Exp), &[sq]).expect("exp");
    let r = g.add(Op::Unary(UnaryOp::Tanh), &[sq]).expect("tanh");
    let j = g.add(Op::Binary(BinaryOp::Add), &[l, r]).expect("add");
    let k = g.add(Op::Binary(BinaryOp::Sub), &[j, l]).expect("sub");
    // Operands created after users of other operands: ids out of order relative to use.
    let late = f32_in(&mut g, "late", &[4]);
    let m = g.add(Op::Binary(BinaryOp::Div), &[late, k]).expect("div");
    // A node that is nobody's output (dead), and outputs in an order unrelated to ids.
    g.add(Op::Unary(UnaryOp::Neg), &[m]).expect("neg");
    g.set_output("m", m).expect("output");
    g.set_output("cat", cat).expect("output");
    g.set_output("x", x).expect("output");
    g.set_output("m again", m).expect("output");
    let order = g.topo_order().expect("acyclic");
    assert_topological(&g, &order);
    verify(&g).expect("valid");

    // A deep chain: the DFS is iterative, so depth does not overflow the stack.
    let mut g = Graph::new("deep");
    let mut v = f32_in(&mut g, "x", &[1]);
    for _ in 0..100_000 {
        v = g.add(Op::Unary(UnaryOp::Neg), &[v]).expect("neg");
    }
    g.set_output("y", v).expect("output");
    let order = g.topo_order().expect("acyclic");
    assert_topological(&g, &order);
    assert_eq!(order.first(), g.find_input("x").as_ref());
    assert_eq!(order.last(), Some(&v));
}

#[test]
fn topo_order_follows_outputs_then_insertion_order() {
    let mut g = Graph::new("t");
    let dead = g.constant(1.0, DType::F32, [1]).expect("const");
    let a = f32_in(&mut g, "a", &[1]);
    let b = f32_in(&mut g, "b", &[1]);
    let s = g.add(Op::Binary(BinaryOp::Add), &[b, a]).expect("add");
    g.set_output("s", s).expect("output");
    assert_eq!(g.topo_order().expect("acyclic"), vec![b, a, s, dead]);
}

#[test]
fn a_real_cycle_is_reported() {
    // x -> e -> z, then every use of x (e's operand) pointed at z: e and z use each other.
    let mut g = Graph::new("t");
    let x = f32_in(&mut g, "x", &[2]);
    let e = g.add_named(Op::Unary(UnaryOp::Exp), &[x], "e").expect("exp");
    let z = g.add(Op::Unary(UnaryOp::Neg), &[e]).expect("neg");
    g.set_output("z", z).expect("output");
    g.replace_all_uses(x, z);
    assert_eq!(g.operands(e), vec![z]);
    match g.topo_order() {
        Err(IrError::Cycle(node)) => assert!(node.contains("(exp)") || node.contains("(neg)"), "{node}"),
        other => panic!("expected a cycle, got {other:?}"),
    }
    assert!(matches!(verify(&g), Err(IrError::Cycle(_))));
    // The printer still prints, in insertion order, with a note.
    assert!(print(&g).contains("// not ordered: the graph has a cycle"), "{}", print(&g));
}

#[test]
fn replace_all_uses_can_wrap_a_node() {
    // q = f(w) then replace_all_uses(w, q): every other use of w now reads q, q still reads w
    // (how quantization wraps a weight without a self-loop).
    let mut g = Graph::new("t");
    let w = g.input("w", InputKind::Frozen, DType::F32, [4, 2]).expect("input");
    let x = f32_in(&mut g, "x", &[3, 4]);
    let y = g.add(Op::MatMul { ta: false, tb: false }, &[x, w]).expect("matmul");
    g.set_output("y", y).expect("output");
    g.set_output("w", w).expect("output");
    let q = g.add(Op::Affine { mul: 0.5, add: 0.0 }, &[w]).expect("affine");
    g.replace_all_uses(w, q);
    assert_eq!(g.operands(q), vec![w]);
    assert_eq!(g.operands(y), vec![x, q]);
    assert_eq!(g.users(w), vec![q]);
    assert_eq!(g.output("w"), Some(q));
    verify(&g).expect("no cycle");
}

// ---------------------------------------------------------------------------------------------
// remove_dead and replace_all_uses.

#[test]
fn remove_dead_removes_exactly_the_unused() {
    let mut g = Graph::new("t");
    let x = f32_in(&mut g, "x", &[3]);
    let unused = f32_in(&mut g, "unused", &[3]);
    let e = g.add(Op::Unary(UnaryOp::Exp), &[x]).expect("exp");
    // A dead chain hanging off a live node, and a dead chain off the unused input.
    let d1 = g.add(Op::Unary(UnaryOp::Neg), &[e]).expect("neg");
    let d2 = g.add(Op::Binary(BinaryOp::Mul), &[d1, e]).expect("mul");
    let d3 = g.add(Op::Unary(UnaryOp::Tanh), &[unused]).expect("tanh");
    let l = g.add(Op::Unary(UnaryOp::Log), &[e]).expect("log");
    g.set_output("l", l).expect("output");
    assert_eq!(g.len(), 7);

    let mut keep_inputs = g.clone();
    assert_eq!(keep_inputs.remove_dead(false), 3);
    for n in [d1, d2, d3] {
        assert!(!keep_inputs.contains(n));
    }
    // Survivors keep their ids and the unused input stays (it is part of the signature).
    for n in [x, unused, e, l] {
        assert!(keep_inputs.contains(n));
    }
    assert_eq!(keep_inputs.find_input("unused"), Some(unused));
    assert_eq!(keep_inputs.users(e), vec![l]);
    verify(&keep_inputs).expect("valid");
    assert_eq!(keep_inputs.remove_dead(false), 0, "idempotent");

    let mut drop_inputs = g.clone();
    assert_eq!(drop_inputs.remove_dead(true), 4);
    assert_eq!(drop_inputs.find_input("unused"), None);
    assert!(!drop_inputs.contains(unused));
    assert_eq!(drop_inputs.inputs(), vec![x]);
    verify(&drop_inputs).expect("valid");
    // Removing and re-adding a name works (the input table forgot it).
    drop_inputs.input("unused", InputKind::Data, DType::F32, [1]).expect("name is free again");
}

#[test]
fn remove_dead_keeps_update_targets() {
    // The state "step" is written by an update but read by nothing; its input is still the
    // update's target, so dropping it leaves an update that no longer verifies.
    let mut g = Graph::new("t");
    let step = g.input("step", InputKind::State, DType::F32, []).expect("input");
    let next = g.input("next_step", InputKind::Data, DType::F32, []).expect("input");
    g.set_update("step", next).expect("update");
    g.remove_dead(true);
    assert_eq!(g.find_input("step"), Some(step));
    verify(&g).expect("an update target survives remove_dead");
}

#[test]
fn replace_all_uses_rewires_operands_and_outputs() {
    let mut g = Graph::new("t");
    let a = f32_in(&mut g, "a", &[3]);
    let b = f32_in(&mut g, "b", &[3]);
    let c = f32_in(&mut g, "c", &[3]);
    let w = g.input("w", InputKind::Trainable, DType::F32, [3]).expect("input");
    let s = g.add(Op::Binary(BinaryOp::Sub), &[a, b]).expect("sub");
    let sq = g.add(Op::Binary(BinaryOp::Mul), &[b, b]).expect("mul");
    let cat = g.add(Op::Concat { axis: 0 }, &[b, a, b]).expect("concat");
    g.set_output("b", b).expect("output");
    g.set_output("s", s).expect("output");
    g.set_output("sq", sq).expect("output");
    g.set_output("cat", cat).expect("output");
    g.set_update("w", b).expect("update");
    g.replace_all_uses(b, c);
    // Every slot that held b now holds c, others untouched, order preserved.
    assert_eq!(g.operands(s), vec![a, c]);
    assert_eq!(g.operands(sq), vec![c, c]);
    assert_eq!(g.operands(cat), vec![c, a, c]);
    assert!(g.users(b).is_empty());
    assert_eq!(g.users(c), vec![s, sq, cat]);
    // Outputs and updates follow.
    assert_eq!(g.output("b"), Some(c));
    assert!(g.outputs().iter().all(|o| o.node != b));
    assert_eq!(g.outputs().iter().find(|o| o.update).map(|o| o.node), Some(c));
    verify(&g).expect("valid");
    // b is now unused but an input, so remove_dead(false) keeps it; nothing else is dead.
    assert_eq!(g.remove_dead(false), 0);
    assert!(g.contains(b) && g.contains(w));
    verify(&g).expect("valid");
    // Replacing a node by itself is a no-op.
    let before = print(&g);
    g.replace_all_uses(c, c);
    assert_eq!(print(&g), before);
}

#[test]
fn op_counts_count_live_nodes() {
    let mut g = Graph::new("t");
    let a = f32_in(&mut g, "a", &[2, 2]);
    let m1 = g.add(Op::MatMul { ta: false, tb: false }, &[a, a]).expect("matmul");
    let m2 = g.add(Op::MatMul { ta: true, tb: false }, &[m1, a]).expect("matmul");
    g.add(Op::MatMul { ta: false, tb: true }, &[a, a]).expect("dead matmul");
    g.set_output("y", m2).expect("output");
    assert_eq!(g.op_counts()["matmul"], 3);
    g.remove_dead(false);
    assert_eq!(g.op_counts()["matmul"], 2);
    assert_eq!(g.op_counts()["input"], 1);
}

// ---------------------------------------------------------------------------------------------
// The format, pinned.

/// A 2-layer MLP with a cross-entropy loss, hand-built with names as the GPT-2 lowering gives
/// them, in an insertion order unlike the printed one.
fn mlp() -> Result<Graph, IrError> {
    let mut g = Graph::new("mlp2");
    let b2 = g.input("fc2.bias", InputKind::Trainable, DType::F32, [10])?;
    let w2 = g.input("fc2.weight", InputKind::Trainable, DType::F32, [16, 10])?;
    let x = g.input("x", InputKind::Data, DType::F32, [4, 8])?;
    let w1 = g.input("fc1.weight", InputKind::Frozen, DType::F32, [8, 16])?;
    let b1 = g.input("fc1.bias", InputKind::Frozen, DType::F32, [16])?;
    let t = g.input("targets", InputKind::Data, DType::I32, [4])?;
    let lr = g.input("lr", InputKind::Data, DType::F32, [])?;
    let h = g.add_named(Op::MatMul { ta: false, tb: false }, &[x, w1], "fc1")?;
    let bb1 = g.add(Op::Broadcast { shape: Shape::new([4, 16]) }, &[b1])?;
    let h = g.add(Op::Binary(BinaryOp::Add), &[h, bb1])?;
    let a = g.add_named(Op::Unary(UnaryOp::Gelu), &[h], "act")?;
    let o = g.add_named(Op::MatMul { ta: false, tb: false }, &[a, w2], "fc2")?;
    let bb2 = g.add(Op::Broadcast { shape: Shape::new([4, 10]) }, &[b2])?;
    let logits = g.add_named(Op::Binary(BinaryOp::Add), &[o, bb2], "logits")?;
    let loss = g.add(Op::CrossEntropy, &[logits, t])?;
    let scale = g.constant(-0.5, DType::F32, [])?;
    let step = g.add(Op::Binary(BinaryOp::Mul), &[lr, scale])?;
    let stepb = g.add(Op::Broadcast { shape: Shape::new([10]) }, &[step])?;
    let nb2 = g.add(Op::Binary(BinaryOp::Add), &[b2, stepb])?;
    g.set_output("loss", loss)?;
    g.set_output("logits", logits)?;
    g.set_update("fc2.bias", nb2)?;
    Ok(g)
}

#[test]
fn mlp_text_snapshot() {
    let g = mlp().expect("mlp builds");
    verify(&g).expect("valid");
    let text = print(&g);
    insta::assert_snapshot!("mlp2", text);
    // The pinned text parses back to itself.
    let h = parse(&text).expect("parse");
    assert_eq!(print(&h), text);
}
