//! Helpers shared by the integration tests: a deterministic RNG, single-op graphs, comparisons.
#![allow(dead_code)]

use std::collections::HashMap;

pub mod ops;

use qatc_ir::{DType, Graph, InputKind, NodeId, Op};
use qatc_runtime::{Float, Interpreter, RuntimeError, Value};

/// xorshift64*: deterministic, dependency-free test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
    }
    pub fn vec(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }
    pub fn ints(&mut self, n: usize, hi: i32) -> Vec<i32> {
        (0..n).map(|_| (self.next_u64() % hi as u64) as i32).collect()
    }
}

/// A test operand: float (f32 dtype in the graph) or i32, or either with an explicit dtype.
#[derive(Clone, Debug)]
pub enum In {
    F(Vec<usize>, Vec<f64>),
    I(Vec<usize>, Vec<i32>),
    FD(DType, Vec<usize>, Vec<f64>),
    ID(DType, Vec<usize>, Vec<i32>),
}

impl In {
    pub fn f(shape: &[usize], data: &[f64]) -> In {
        In::F(shape.to_vec(), data.to_vec())
    }
    pub fn i(shape: &[usize], data: &[i32]) -> In {
        In::I(shape.to_vec(), data.to_vec())
    }
    pub fn value<T: Float>(&self) -> Value<T> {
        match self {
            In::F(s, d) | In::FD(_, s, d) => Value::floats(s.clone(), d).unwrap(),
            In::I(s, d) | In::ID(_, s, d) => Value::ints(s.clone(), d.clone()).unwrap(),
        }
    }
}

/// A graph applying `op` to inputs "a0", "a1", ... with output "y".
pub fn op_graph(op: Op, ins: &[In]) -> (Graph, NodeId) {
    let mut g = Graph::new("test");
    let ids: Vec<NodeId> = ins
        .iter()
        .enumerate()
        .map(|(i, a)| match a {
            In::F(s, _) => g.input(format!("a{i}"), InputKind::Data, DType::F32, s.clone()).unwrap(),
            In::I(s, _) => g.input(format!("a{i}"), InputKind::Data, DType::I32, s.clone()).unwrap(),
            In::FD(d, s, _) | In::ID(d, s, _) => g.input(format!("a{i}"), InputKind::Data, *d, s.clone()).unwrap(),
        })
        .collect();
    let y = g.add(op, &ids).unwrap();
    g.set_output("y", y).unwrap();
    (g, y)
}

pub fn input_map<T: Float>(ins: &[In]) -> HashMap<String, Value<T>> {
    ins.iter().enumerate().map(|(i, a)| (format!("a{i}"), a.value())).collect()
}

pub fn try_run_op<T: Float>(op: Op, ins: &[In]) -> Result<Value<T>, RuntimeError> {
    let (g, _) = op_graph(op, ins);
    let interp = Interpreter::<T>::new(&g)?;
    let mut out = interp.run(&input_map(ins))?;
    Ok(out.remove("y").unwrap())
}

/// Runs `op` in `T` and returns the float output as f64.
pub fn run_op<T: Float>(op: Op, ins: &[In]) -> Vec<f64> {
    try_run_op::<T>(op, ins).unwrap().as_float().unwrap().to_f64_vec()
}

pub fn run_f64(op: Op, ins: &[In]) -> Vec<f64> {
    run_op::<f64>(op, ins)
}

/// |got - want| <= rel * max(|got|, |want|) + abs, elementwise.
pub fn assert_close(got: &[f64], want: &[f64], rel: f64, abs: f64) {
    assert_eq!(got.len(), want.len(), "lengths differ");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let tol = rel * g.abs().max(w.abs()) + abs;
        assert!((g - w).abs() <= tol, "element {i}: got {g}, want {w} (tol {tol})\n got {got:?}\nwant {want:?}");
    }
}
