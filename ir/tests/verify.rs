//! Unit tests of the IR's checks: type errors at build time (naming the node), parser errors
//! (carrying the line), update targets, the verifier, `topo_order`, `remove_dead`,
//! `replace_all_uses`, and a snapshot pinning the text format itself.
//!
//! Here: the shared helpers, update targets, the verifier and the pinned format;
//! `verify/type_errors.rs`: the build-time type errors; `verify/parse_errors.rs`: the parser's;
//! `verify/graph_edits.rs`: `topo_order`, `remove_dead`, `replace_all_uses` and `op_counts`.

#[path = "verify/graph_edits.rs"]
mod graph_edits;
#[path = "verify/parse_errors.rs"]
mod parse_errors;
#[path = "verify/type_errors.rs"]
mod type_errors;

use qatc_ir::{parse, print, verify, BinaryOp, DType, Graph, InputKind, IrError, NodeId, Op, Shape, UnaryOp};

pub fn f32_in(g: &mut Graph, name: &str, shape: &[usize]) -> NodeId {
    g.input(name, InputKind::Data, DType::F32, shape.to_vec()).expect("input")
}

pub fn i32_in(g: &mut Graph, name: &str, shape: &[usize]) -> NodeId {
    g.input(name, InputKind::Data, DType::I32, shape.to_vec()).expect("input")
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
