//! Shape ops and consts against naive index arithmetic, for float and int tensors.

mod common;

use common::{run_f64, try_run_op, In, Rng};
use qatc_ir::{DType, Graph, Op, Shape};
use qatc_runtime::{Interpreter, Value};
use std::collections::HashMap;

fn iota(n: usize) -> Vec<f64> {
    (0..n).map(|i| i as f64).collect()
}

#[test]
fn broadcast_trailing_aligned() {
    // [3] -> [2, 3]: rows repeat.
    let y = run_f64(Op::Broadcast { shape: Shape::new([2, 3]) }, &[In::f(&[3], &[1.0, 2.0, 3.0])]);
    assert_eq!(y, vec![1.0, 2.0, 3.0, 1.0, 2.0, 3.0]);
    // [2, 1] -> [2, 3]: columns repeat.
    let y = run_f64(Op::Broadcast { shape: Shape::new([2, 3]) }, &[In::f(&[2, 1], &[1.0, 2.0])]);
    assert_eq!(y, vec![1.0, 1.0, 1.0, 2.0, 2.0, 2.0]);
    // [] -> [2, 2] and a middle dim [2, 1, 3] -> [4, 2, 5, 3] against a naive index map.
    assert_eq!(run_f64(Op::Broadcast { shape: Shape::new([2, 2]) }, &[In::f(&[], &[7.0])]), vec![7.0; 4]);
    let x = iota(6);
    let y = run_f64(Op::Broadcast { shape: Shape::new([4, 2, 5, 3]) }, &[In::f(&[2, 1, 3], &x)]);
    let mut want = Vec::new();
    for _a in 0..4 {
        for b in 0..2 {
            for _c in 0..5 {
                for d in 0..3 {
                    want.push(x[b * 3 + d]);
                }
            }
        }
    }
    assert_eq!(y, want);
    // Ints broadcast too.
    let y = try_run_op::<f64>(Op::Broadcast { shape: Shape::new([2, 2]) }, &[In::i(&[2], &[4, 5])]).unwrap();
    assert_eq!(y.as_int().unwrap().data, vec![4, 5, 4, 5]);
}

#[test]
fn sum_to_is_broadcasts_adjoint() {
    let x = iota(24); // [2, 3, 4]
    let y = run_f64(Op::SumTo { shape: Shape::new([4]) }, &[In::f(&[2, 3, 4], &x)]);
    let want: Vec<f64> = (0..4).map(|c| (0..6).map(|r| x[r * 4 + c]).sum()).collect();
    assert_eq!(y, want);
    let y = run_f64(Op::SumTo { shape: Shape::new([3, 1]) }, &[In::f(&[2, 3, 4], &x)]);
    let want: Vec<f64> =
        (0..3).map(|b| (0..2).flat_map(|a| (0..4).map(move |c| (a, c))).map(|(a, c)| x[a * 12 + b * 4 + c]).sum()).collect();
    assert_eq!(y, want);
    let y = run_f64(Op::SumTo { shape: Shape::scalar() }, &[In::f(&[2, 3, 4], &x)]);
    assert_eq!(y, vec![276.0]);
    // Adjointness: <broadcast(u), w> == <u, sum_to(w)> on random data.
    let mut rng = Rng::new(3);
    let (u, w) = (rng.vec(6, -1.0, 1.0), rng.vec(5 * 2 * 4 * 3, -1.0, 1.0));
    let bu = run_f64(Op::Broadcast { shape: Shape::new([5, 2, 4, 3]) }, &[In::f(&[2, 1, 3], &u)]);
    let sw = run_f64(Op::SumTo { shape: Shape::new([2, 1, 3]) }, &[In::f(&[5, 2, 4, 3], &w)]);
    let lhs: f64 = bu.iter().zip(&w).map(|(a, b)| a * b).sum();
    let rhs: f64 = u.iter().zip(&sw).map(|(a, b)| a * b).sum();
    assert!((lhs - rhs).abs() < 1e-12);
}

#[test]
fn reshape_keeps_row_major_order() {
    let y = try_run_op::<f64>(Op::Reshape { shape: Shape::new([3, 2]) }, &[In::f(&[2, 3], &iota(6))]).unwrap();
    assert_eq!(y.shape(), &[3, 2]);
    assert_eq!(y.as_float().unwrap().to_f64_vec(), iota(6));
    let y = try_run_op::<f64>(Op::Reshape { shape: Shape::new([4]) }, &[In::i(&[2, 2], &[1, 2, 3, 4])]).unwrap();
    assert_eq!(y, Value::ints([4], vec![1, 2, 3, 4]).unwrap());
}

#[test]
fn transpose_against_naive_index_map() {
    let (d0, d1, d2, d3) = (2, 3, 4, 5);
    let x = iota(d0 * d1 * d2 * d3);
    let perm = vec![2, 0, 3, 1];
    let y = run_f64(Op::Transpose { perm: perm.clone() }, &[In::f(&[d0, d1, d2, d3], &x)]);
    let mut want = Vec::new();
    for c in 0..d2 {
        for a in 0..d0 {
            for d in 0..d3 {
                for b in 0..d1 {
                    want.push(x[((a * d1 + b) * d2 + c) * d3 + d]);
                }
            }
        }
    }
    assert_eq!(y, want);
    let y = run_f64(Op::Transpose { perm: vec![1, 0] }, &[In::f(&[2, 3], &iota(6))]);
    assert_eq!(y, vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
}

#[test]
fn slice_each_axis() {
    let x = iota(24); // [2, 3, 4]
    let y = run_f64(Op::Slice { axis: 1, start: 1, end: 3 }, &[In::f(&[2, 3, 4], &x)]);
    let want: Vec<f64> = (0..2).flat_map(|a| (1..3).flat_map(move |b| (0..4).map(move |c| (a * 12 + b * 4 + c) as f64))).collect();
    assert_eq!(y, want);
    let y = run_f64(Op::Slice { axis: 2, start: 3, end: 4 }, &[In::f(&[2, 3, 4], &x)]);
    assert_eq!(y, vec![3.0, 7.0, 11.0, 15.0, 19.0, 23.0]);
    let y = run_f64(Op::Slice { axis: 0, start: 1, end: 2 }, &[In::f(&[2, 3, 4], &x)]);
    assert_eq!(y, iota(24)[12..].to_vec());
}

#[test]
fn concat_each_axis() {
    let a = iota(6); // [2, 3]
    let b: Vec<f64> = (10..14).map(f64::from).collect(); // [2, 2]
    let y = run_f64(Op::Concat { axis: 1 }, &[In::f(&[2, 3], &a), In::f(&[2, 2], &b)]);
    assert_eq!(y, vec![0.0, 1.0, 2.0, 10.0, 11.0, 3.0, 4.0, 5.0, 12.0, 13.0]);
    let y = run_f64(Op::Concat { axis: 0 }, &[In::f(&[2, 3], &a), In::f(&[1, 3], &[7.0, 8.0, 9.0]), In::f(&[2, 3], &a)]);
    assert_eq!(y.len(), 15);
    assert_eq!(&y[6..9], &[7.0, 8.0, 9.0]);
    let y = try_run_op::<f32>(Op::Concat { axis: 0 }, &[In::i(&[2], &[1, 2]), In::i(&[1], &[3])]).unwrap();
    assert_eq!(y.as_int().unwrap().data, vec![1, 2, 3]);
}

#[test]
fn consts_fill_and_int_consts_truncate() {
    let mut g = Graph::new("c");
    let a = g.constant(1.5, DType::F32, [2, 2]).unwrap();
    let b = g.constant(-3.9, DType::I32, [3]).unwrap();
    let c = g.constant(0.1, DType::F16, []).unwrap();
    g.set_output("a", a).unwrap();
    g.set_output("b", b).unwrap();
    g.set_output("c", c).unwrap();
    let out = Interpreter::<f64>::new(&g).unwrap().run(&HashMap::new()).unwrap();
    assert_eq!(out["a"], Value::floats([2, 2], &[1.5; 4]).unwrap());
    assert_eq!(out["b"], Value::ints([3], vec![-3; 3]).unwrap());
    assert_eq!(out["c"], Value::scalar(half::f16::from_f64(0.1).to_f64()));
}
