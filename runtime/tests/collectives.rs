//! Collectives over ranks simulated in one process (`Interpreter::run_ranks`): what each rank
//! gets, against sums written out by hand; reduce-scatter then all-gather is an all-reduce (the
//! identity ZeRO's stage 1 rests on); one rank is the identity in a plain run; types and worlds
//! the ops refuse.

use std::collections::HashMap;

use qatc_ir::{DType, Graph, InputKind, Op, Reduce};
use qatc_runtime::{Interpreter, Value};

/// x f32 [4, 2] on each of `world` ranks through `ops` (applied in turn), output `y`.
fn graph(ops: &[Op]) -> Graph {
    let mut g = Graph::new("collective");
    let mut y = g.input("x", InputKind::Data, DType::F32, [4, 2]).unwrap();
    for op in ops {
        y = g.add(op.clone(), &[y]).unwrap();
    }
    g.set_output("y", y).unwrap();
    g
}

/// Rank r's x: 8 values r * 10 + i.
fn rank_inputs(world: usize) -> Vec<HashMap<String, Value<f32>>> {
    (0..world)
        .map(|r| {
            let data: Vec<f64> = (0..8).map(|i| (r * 10 + i) as f64).collect();
            HashMap::from([("x".to_string(), Value::floats([4, 2], &data).unwrap())])
        })
        .collect()
}

fn run(g: &Graph, world: usize) -> Vec<Vec<f32>> {
    let out = Interpreter::<f32>::new(g).unwrap().run_ranks(&rank_inputs(world)).unwrap();
    out.into_iter().map(|o| o.outputs["y"].as_float().unwrap().data.clone()).collect()
}

#[test]
fn each_rank_gets_what_the_collective_says() {
    // sum over 3 ranks of r * 10 + i: 30 + 3 i
    let sum: Vec<f32> = (0..8).map(|i| (30 + 3 * i) as f32).collect();
    let mean: Vec<f32> = sum.iter().map(|s| s / 3.0).collect();
    assert_eq!(run(&graph(&[Op::AllReduce { reduce: Reduce::Sum, world: 3 }]), 3), vec![sum.clone(); 3]);
    assert_eq!(run(&graph(&[Op::AllReduce { reduce: Reduce::Mean, world: 3 }]), 3), vec![mean; 3]);
    // 2 ranks: rows 0-1 to rank 0, rows 2-3 to rank 1, of the sum 10 + 2 i
    let rs = run(&graph(&[Op::ReduceScatter { reduce: Reduce::Sum, world: 2 }]), 2);
    assert_eq!(rs, vec![vec![10.0, 12.0, 14.0, 16.0], vec![18.0, 20.0, 22.0, 24.0]]);
    let ag = run(&graph(&[Op::AllGather { world: 2 }]), 2);
    let both: Vec<f32> = (0..8).map(|i| i as f32).chain((0..8).map(|i| (10 + i) as f32)).collect();
    assert_eq!(ag, vec![both; 2]);
}

#[test]
fn reduce_scatter_then_all_gather_is_all_reduce() {
    for reduce in Reduce::ALL {
        let two_steps = graph(&[Op::ReduceScatter { reduce, world: 4 }, Op::AllGather { world: 4 }]);
        let one = graph(&[Op::AllReduce { reduce, world: 4 }]);
        assert_eq!(run(&two_steps, 4), run(&one, 4), "{reduce:?}");
    }
}

#[test]
fn one_rank_is_the_identity_and_more_need_run_ranks() {
    let x = rank_inputs(1).remove(0);
    for op in
        [Op::AllReduce { reduce: Reduce::Mean, world: 1 }, Op::ReduceScatter { reduce: Reduce::Sum, world: 1 }, Op::AllGather { world: 1 }]
    {
        let out = Interpreter::<f32>::new(&graph(&[op])).unwrap().run(&x).unwrap();
        assert_eq!(out["y"], x["x"]);
    }
    let e = Interpreter::<f32>::new(&graph(&[Op::AllGather { world: 2 }])).unwrap().run(&x).unwrap_err().to_string();
    assert!(e.contains("over 2 ranks") && e.contains("run_ranks"), "{e}");
    // a world of 3 given 2 ranks' values
    let g = graph(&[Op::AllReduce { reduce: Reduce::Sum, world: 3 }]);
    let e = Interpreter::<f32>::new(&g).unwrap().run_ranks(&rank_inputs(2)).unwrap_err().to_string();
    assert!(e.contains("over 3 ranks given 2"), "{e}");
}

#[test]
fn the_ops_refuse_what_they_cannot_split() {
    let mut g = Graph::new("bad");
    let x = g.input("x", InputKind::Data, DType::F32, [5, 2]).unwrap();
    let e = g.add(Op::ReduceScatter { reduce: Reduce::Sum, world: 2 }, &[x]).unwrap_err().to_string();
    assert!(e.contains("first dimension they divide (pad it)"), "{e}");
    let e = g.add(Op::AllReduce { reduce: Reduce::Sum, world: 0 }, &[x]).unwrap_err().to_string();
    assert!(e.contains("at least 1 rank"), "{e}");
    let ids = g.input("ids", InputKind::Data, DType::I32, [4]).unwrap();
    let e = g.add(Op::AllReduce { reduce: Reduce::Sum, world: 2 }, &[ids]).unwrap_err().to_string();
    assert!(e.contains("must be a float tensor"), "{e}");
    let s = g.input("s", InputKind::Data, DType::F32, qatc_ir::Shape::scalar()).unwrap();
    assert!(g.add(Op::AllGather { world: 2 }, &[s]).is_err());
    // printed and parsed back
    let y = g.add(Op::ReduceScatter { reduce: Reduce::Mean, world: 5 }, &[x]).unwrap();
    g.set_output("y", y).unwrap();
    let text = qatc_ir::print(&g);
    assert!(text.contains("reduce_scatter[reduce=mean, world=5]"), "{text}");
    assert_eq!(qatc_ir::print(&qatc_ir::parse(&text).unwrap()), text);
}

/// The lowering makes a collective a step of its own, which the executor's communicator runs (as
/// a GEMM is a library call), not a kernel that computes something else.
#[test]
fn a_collective_lowers_to_a_step_of_its_own() {
    let g = graph(&[Op::AllReduce { reduce: Reduce::Sum, world: 2 }]);
    let prog = qatc_kernels::lower(&g).expect("a collective lowers");
    let c: Vec<_> = prog.collectives().collect();
    assert_eq!(c.len(), 1, "{}", prog.listing());
    assert_eq!((c[0].exchange.mnemonic(), c[0].world), ("all_reduce", 2));
    assert!(prog.listing().contains("all_reduce[reduce=sum, world=2]"), "{}", prog.listing());
}
