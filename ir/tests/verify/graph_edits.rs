//! The graph's orderings and edits: `topo_order` (no false cycles, a real one reported),
//! `replace_all_uses`, `remove_dead` and `op_counts`.

use qatc_ir::{print, verify, BinaryOp, DType, Graph, InputKind, IrError, NodeId, Op, UnaryOp};

use crate::f32_in;

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
