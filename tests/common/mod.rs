//! Helpers shared by the integration tests: fixture paths and a safetensors reader.
#![allow(dead_code)]

pub mod bytes;
pub mod cli;
pub mod gpu;
pub mod nvrtc;
pub mod steps;

use std::collections::HashMap;
use std::path::PathBuf;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn fixture(rel: &str) -> PathBuf {
    root().join("tests/fixtures").join(rel)
}

/// A tensor from a fixture file, as f64 (whatever its stored float type) plus its shape.
#[derive(Clone, Debug)]
pub struct T {
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
    pub ints: Vec<i32>,
}

pub fn read_safetensors(rel: &str) -> HashMap<String, T> {
    let bytes = std::fs::read(fixture(rel)).expect("fixture");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut m = HashMap::new();
    for (name, v) in st.tensors() {
        let b = v.data();
        let (data, ints) = match v.dtype() {
            safetensors::Dtype::F32 => (b.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64).collect(), vec![]),
            safetensors::Dtype::F64 => (b.chunks(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect(), vec![]),
            safetensors::Dtype::I32 => (vec![], b.chunks(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()),
            safetensors::Dtype::U8 => (vec![], b.iter().map(|&c| i32::from(c)).collect()),
            d => panic!("fixture dtype {d:?}"),
        };
        m.insert(name, T { shape: v.shape().to_vec(), data, ints });
    }
    m
}

/// The largest |a - b| over the pairs, NaN in the same places (both NaN) counting as equal and
/// NaN on one side only as infinitely far: `f64::max` drops a NaN, so without this a kernel
/// that wrote NaN would compare as exact.
fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0.0f64, |m, (x, y)| match (x.is_nan(), y.is_nan()) {
        (true, true) => m,
        // equal infinities are equal (their difference is NaN)
        (false, false) if x == y => m,
        (false, false) => m.max((x - y).abs()),
        _ => f64::INFINITY,
    })
}

/// max |a - b| / max |b|: a tensor-wise relative error that does not blow up on elements near 0.
/// NaN anywhere but in the same places of both is an infinite error ([`max_diff`]).
pub fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    let scale = b.iter().filter(|v| v.is_finite()).fold(0.0f64, |m, v| m.max(v.abs())).max(1e-30);
    max_diff(a, b) / scale
}

/// max |a - b|, NaN as in [`rel_err`].
pub fn max_abs(a: &[f64], b: &[f64]) -> f64 {
    max_diff(a, b)
}

/// ||a - b||_2 / ||b||_2; NaN anywhere but in the same places of both is an infinite error.
pub fn norm_rel_err(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    if a.iter().zip(b).any(|(x, y)| x.is_nan() != y.is_nan()) {
        return f64::INFINITY;
    }
    let (a, b): (Vec<f64>, Vec<f64>) = a.iter().zip(b).filter(|(x, _)| !x.is_nan()).map(|(x, y)| (*x, *y)).unzip();
    let (a, b) = (&a[..], &b[..]);
    let d: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt();
    let n: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt().max(1e-30);
    d / n
}

/// A value's elements as bits (floats by their IEEE bits, integers as they are), to compare two
/// runs bit for bit.
pub fn bits(v: &qatc_runtime::Value<f32>) -> Vec<u32> {
    match v {
        qatc_runtime::Value::Float(t) => t.data.iter().map(|x| x.to_bits()).collect(),
        qatc_runtime::Value::Int(t) => t.data.iter().map(|&x| x as u32).collect(),
    }
}

/// Zero for every state input of `g` (the moments, the step count, gradient sums): a fresh run.
pub fn zero_state(g: &qatc_ir::Graph, v: &mut HashMap<String, qatc_runtime::Value<f32>>) {
    use qatc_runtime::{IntTensor, Tensor, Value};
    for id in g.inputs() {
        if g.input_kind(id) == Some(qatc_ir::InputKind::State) {
            let ty = g.ty(id);
            let shape = ty.shape.dims().to_vec();
            let zero = if ty.dtype.is_float() {
                Value::Float(Tensor { shape, data: vec![0.0; ty.numel()] })
            } else {
                Value::Int(IntTensor { shape, data: vec![0; ty.numel()] })
            };
            v.insert(g.node(id).name.clone().expect("a state input has a name"), zero);
        }
    }
}
