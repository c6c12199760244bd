//! The interpreter's contract: inputs, outputs and updates, run_nodes, errors, f16/bf16 rounding.

mod common;

use std::collections::HashMap;

use qatc_ir::{BinaryOp, DType, Graph, InputKind, Op, UnaryOp};
use qatc_runtime::{Interpreter, RuntimeError, Value};

fn one_input(name: &str, v: Value<f64>) -> HashMap<String, Value<f64>> {
    HashMap::from([(name.to_string(), v)])
}

fn square_graph() -> (Graph, qatc_ir::NodeId, qatc_ir::NodeId) {
    let mut g = Graph::new("sq");
    let x = g.input("x", InputKind::Data, DType::F32, [2, 2]).unwrap();
    let y = g.add(Op::Binary(BinaryOp::Mul), &[x, x]).unwrap();
    let z = g.add(Op::Unary(UnaryOp::Neg), &[y]).unwrap();
    g.set_output("z", z).unwrap();
    (g, y, z)
}

#[test]
fn missing_and_misshapen_inputs_are_named() {
    let (g, _, _) = square_graph();
    let interp = Interpreter::<f64>::new(&g).unwrap();
    assert_eq!(interp.run(&HashMap::new()).unwrap_err(), RuntimeError::MissingInput("x".into()));
    let err = interp.run(&one_input("x", Value::floats([4], &[1.0; 4]).unwrap())).unwrap_err();
    assert_eq!(err, RuntimeError::InputShape { name: "x".into(), want: vec![2, 2], got: vec![4] });
    let msg = err.to_string();
    assert!(msg.contains("\"x\"") && msg.contains("[2, 2]") && msg.contains("[4]"), "{msg}");
    let err = interp.run(&one_input("x", Value::ints([2, 2], vec![1; 4]).unwrap())).unwrap_err();
    assert!(matches!(err, RuntimeError::InputKind { .. }), "{err}");
    // Hand-built values whose data disagrees with their shape are caught too.
    let bad = Value::Float(qatc_runtime::Tensor { shape: vec![2, 2], data: vec![1.0; 3] });
    assert!(matches!(interp.run(&one_input("x", bad)).unwrap_err(), RuntimeError::BadTensor { .. }));
}

#[test]
fn run_nodes_returns_intermediates_and_run_reuses() {
    let (g, y, z) = square_graph();
    let interp = Interpreter::<f64>::new(&g).unwrap();
    for k in 1..3 {
        let x = Value::floats([2, 2], &[1.0, 2.0, 3.0, k as f64]).unwrap();
        let vals = interp.run_nodes(&one_input("x", x), &[y, z, y]).unwrap();
        let kk = (k * k) as f64;
        assert_eq!(vals[0], Value::floats([2, 2], &[1.0, 4.0, 9.0, kk]).unwrap());
        assert_eq!(vals[1], Value::floats([2, 2], &[-1.0, -4.0, -9.0, -kk]).unwrap());
        assert_eq!(vals[2], vals[0]);
    }
    // An id from a bigger graph that this one lacks.
    let mut big = Graph::new("big");
    let mut last = big.constant(0.0, DType::F32, []).unwrap();
    for _ in 0..10 {
        last = big.add(Op::Unary(UnaryOp::Neg), &[last]).unwrap();
    }
    assert_eq!(interp.run_nodes(&HashMap::new(), &[last]).unwrap_err(), RuntimeError::UnknownNode(last));
}

#[test]
fn run_returns_outputs_and_updates() {
    let mut g = Graph::new("upd");
    let w = g.input("w", InputKind::Trainable, DType::F32, [3]).unwrap();
    let lr = g.input("lr", InputKind::Data, DType::F32, []).unwrap();
    let lr3 = g.add(Op::Broadcast { shape: qatc_ir::Shape::new([3]) }, &[lr]).unwrap();
    let step = g.add(Op::Binary(BinaryOp::Mul), &[w, lr3]).unwrap();
    let w1 = g.add(Op::Binary(BinaryOp::Sub), &[w, step]).unwrap();
    let loss = g.add(Op::SumTo { shape: qatc_ir::Shape::scalar() }, &[w]).unwrap();
    g.set_output("loss", loss).unwrap();
    g.set_output("w_in", w).unwrap(); // an input as an output
    g.set_update("w", w1).unwrap();
    let interp = Interpreter::<f32>::new(&g).unwrap();
    let names: Vec<_> = interp.inputs().iter().map(|(n, k, _)| (n.to_string(), *k)).collect();
    assert!(names.contains(&("w".into(), InputKind::Trainable)) && names.len() == 2);
    let inputs = HashMap::from([("w".to_string(), Value::floats([3], &[1.0, 2.0, 4.0]).unwrap()), ("lr".to_string(), Value::scalar(0.5))]);
    let out = interp.run(&inputs).unwrap();
    assert_eq!(out.len(), 3);
    assert_eq!(out["loss"], Value::scalar(7.0));
    assert_eq!(out["w_in"], inputs["w"]);
    assert_eq!(out["w"], Value::floats([3], &[0.5, 1.0, 2.0]).unwrap());
    let split = interp.run_split(&inputs).unwrap();
    assert_eq!(split.outputs.len(), 2);
    assert_eq!(split.updates["w"], out["w"]);
}

#[test]
fn unreachable_nodes_are_not_run_and_need_no_inputs() {
    let mut g = Graph::new("dead");
    let x = g.input("x", InputKind::Data, DType::F32, [2]).unwrap();
    let table = g.input("table", InputKind::Frozen, DType::F32, [2, 2]).unwrap();
    let ids = g.input("ids", InputKind::Data, DType::I32, [1]).unwrap();
    g.add(Op::Gather, &[table, ids]).unwrap(); // would fail on ids = [5]
    let y = g.add(Op::Unary(UnaryOp::Exp), &[x]).unwrap();
    g.set_output("y", y).unwrap();
    let interp = Interpreter::<f64>::new(&g).unwrap();
    let out = interp.run(&one_input("x", Value::floats([2], &[0.0, 0.0]).unwrap())).unwrap();
    assert_eq!(out["y"], Value::floats([2], &[1.0, 1.0]).unwrap());
}

#[test]
fn node_errors_name_the_node() {
    let mut g = Graph::new("named");
    let table = g.input("wte", InputKind::Frozen, DType::F32, [3, 2]).unwrap();
    let ids = g.input("ids", InputKind::Data, DType::I32, [2]).unwrap();
    let e = g.add_named(Op::Gather, &[table, ids], "tok_emb").unwrap();
    g.set_output("e", e).unwrap();
    let interp = Interpreter::<f32>::new(&g).unwrap();
    let inputs = HashMap::from([
        ("wte".to_string(), Value::floats([3, 2], &[0.0; 6]).unwrap()),
        ("ids".to_string(), Value::ints([2], vec![1, 3]).unwrap()),
    ]);
    let err = interp.run(&inputs).unwrap_err();
    assert_eq!(err.to_string(), "node \"tok_emb\" (gather): id 3 out of range [0, 3)");
}

#[test]
fn half_precision_values_round_after_every_op() {
    for dt in [DType::F16, DType::BF16] {
        let round = |v: f64| match dt {
            DType::F16 => half::f16::from_f64(v).to_f64(),
            _ => half::bf16::from_f64(v).to_f64(),
        };
        let mut g = Graph::new("half");
        let a = g.input("a", InputKind::Data, dt, [3]).unwrap();
        let b = g.input("b", InputKind::Data, dt, [3]).unwrap();
        let s = g.add(Op::Binary(BinaryOp::Add), &[a, b]).unwrap();
        let wide = g.add(Op::Cast { to: DType::F32 }, &[s]).unwrap();
        let x = g.add(Op::Affine { mul: 1.0, add: 1e-4 }, &[wide]).unwrap();
        g.set_output("a", a).unwrap();
        g.set_output("s", s).unwrap();
        g.set_output("x", x).unwrap();
        let interp = Interpreter::<f64>::new(&g).unwrap();
        let av = [0.1, 1.0, 300.3];
        let bv = [0.2, 1e-4, 0.01];
        let inputs =
            HashMap::from([("a".to_string(), Value::floats([3], &av).unwrap()), ("b".to_string(), Value::floats([3], &bv).unwrap())]);
        let out = interp.run(&inputs).unwrap();
        let ar: Vec<f64> = av.iter().map(|&v| round(v)).collect();
        let sr: Vec<f64> = (0..3).map(|i| round(ar[i] + round(bv[i]))).collect();
        assert_eq!(out["a"].as_float().unwrap().data, ar, "{dt}");
        assert_eq!(out["s"].as_float().unwrap().data, sr, "{dt}");
        // 1 + 1e-4 is not representable in either half type: the sum stays 1.
        assert_eq!(sr[1], 1.0);
        // After the cast to f32 the f64 interpreter keeps full precision.
        let xr: Vec<f64> = sr.iter().map(|v| v + 1e-4).collect();
        assert_eq!(out["x"].as_float().unwrap().data, xr, "{dt}");
    }
}
