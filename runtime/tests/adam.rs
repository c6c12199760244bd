//! AdamW through adam_m / adam_v / adam_param against a hand-written PyTorch-style update loop.

mod common;

use std::collections::HashMap;

use common::{assert_close, Rng};
use qatc_ir::{DType, Graph, InputKind, Op};
use qatc_runtime::{Interpreter, Value};

const B1: f64 = 0.9;
const B2: f64 = 0.999;
const EPS: f64 = 1e-8;
const WD: f64 = 0.01;

/// The optimizer step as a graph: t' = t + 1, m' = adam_m(m, g), v' = adam_v(v, g),
/// p' = adam_param(p, m', v', lr, t'), with p, m, v, t updated in place.
fn adam_graph(n: usize) -> Graph {
    let mut g = Graph::new("adamw");
    let p = g.input("p", InputKind::Trainable, DType::F32, [n]).unwrap();
    let m = g.input("m", InputKind::State, DType::F32, [n]).unwrap();
    let v = g.input("v", InputKind::State, DType::F32, [n]).unwrap();
    let t = g.input("t", InputKind::State, DType::F32, []).unwrap();
    let grad = g.input("g", InputKind::Data, DType::F32, [n]).unwrap();
    let lr = g.input("lr", InputKind::Data, DType::F32, []).unwrap();
    let t1 = g.add(Op::Affine { mul: 1.0, add: 1.0 }, &[t]).unwrap();
    let m1 = g.add(Op::AdamM { beta1: B1 }, &[m, grad]).unwrap();
    let v1 = g.add(Op::AdamV { beta2: B2 }, &[v, grad]).unwrap();
    let p1 = g.add(Op::AdamParam { beta1: B1, beta2: B2, eps: EPS, weight_decay: WD }, &[p, m1, v1, lr, t1]).unwrap();
    for (name, id) in [("p", p1), ("m", m1), ("v", v1), ("t", t1)] {
        g.set_update(name, id).unwrap();
    }
    g
}

/// torch.optim.AdamW's single-tensor step, transcribed.
fn torch_adamw(p: &mut [f64], m: &mut [f64], v: &mut [f64], g: &[f64], lr: f64, step: f64) {
    for i in 0..p.len() {
        p[i] *= 1.0 - lr * WD;
        m[i] = m[i] * B1 + (1.0 - B1) * g[i]; // exp_avg.lerp_(grad, 1 - beta1)
        v[i] = v[i] * B2 + (1.0 - B2) * g[i] * g[i];
        let bias_correction1 = 1.0 - B1.powf(step);
        let bias_correction2 = 1.0 - B2.powf(step);
        let step_size = lr / bias_correction1;
        let denom = v[i].sqrt() / bias_correction2.sqrt() + EPS;
        p[i] -= step_size * m[i] / denom;
    }
}

fn f64s(v: &Value<f64>) -> Vec<f64> {
    v.as_float().unwrap().to_f64_vec()
}

#[test]
fn first_step_hand_checked() {
    // p = 1, g = 0.5, lr = 0.1: m = 0.05, v = 0.00025, m_hat = 0.5, sqrt(v_hat) = 0.5,
    // p = 1 * (1 - 0.001) - 0.1 * 0.5 / (0.5 + 1e-8).
    let interp = Interpreter::<f64>::new(&adam_graph(1)).unwrap();
    let inputs: HashMap<String, Value<f64>> = [
        ("p", Value::floats([1], &[1.0]).unwrap()),
        ("m", Value::floats([1], &[0.0]).unwrap()),
        ("v", Value::floats([1], &[0.0]).unwrap()),
        ("t", Value::scalar(0.0)),
        ("g", Value::floats([1], &[0.5]).unwrap()),
        ("lr", Value::scalar(0.1)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let out = interp.run(&inputs).unwrap();
    assert_close(&f64s(&out["m"]), &[0.05], 1e-15, 0.0);
    assert_close(&f64s(&out["v"]), &[0.00025], 1e-12, 0.0);
    assert_eq!(out["t"], Value::scalar(1.0));
    assert_close(&f64s(&out["p"]), &[0.999 - 0.1 * 0.5 / (0.5 + 1e-8)], 1e-15, 0.0);
}

#[test]
fn several_steps_match_torch_adamw() {
    let n = 17;
    let mut rng = Rng::new(31);
    let mut p = rng.vec(n, -1.0, 1.0);
    let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
    let g = adam_graph(n);
    let i64_ = Interpreter::<f64>::new(&g).unwrap();
    let i32_ = Interpreter::<f32>::new(&g).unwrap();
    let mut state64: HashMap<String, Value<f64>> = HashMap::new();
    let mut state32: HashMap<String, Value<f32>> = HashMap::new();
    for (name, data) in [("p", &p), ("m", &m), ("v", &v)] {
        state64.insert(name.into(), Value::floats([n], data).unwrap());
        state32.insert(name.into(), Value::floats([n], data).unwrap());
    }
    state64.insert("t".into(), Value::scalar(0.0));
    state32.insert("t".into(), Value::scalar(0.0));
    for step in 1..=5 {
        let grad = rng.vec(n, -2.0, 2.0);
        let lr = 1e-2 * step as f64;
        torch_adamw(&mut p, &mut m, &mut v, &grad, lr, step as f64);
        for (k, x) in [("g", Value::floats([n], &grad).unwrap()), ("lr", Value::scalar(lr))] {
            state64.insert(k.into(), x);
        }
        state32.insert("g".into(), Value::floats([n], &grad).unwrap());
        state32.insert("lr".into(), Value::scalar(lr));
        // The caller writes update outputs back into the inputs.
        let ups = i64_.run_split(&state64).unwrap().updates;
        assert_eq!(ups.len(), 4);
        state64.extend(ups);
        state32.extend(i32_.run_split(&state32).unwrap().updates);
        assert_close(&f64s(&state64["p"]), &p, 1e-14, 1e-15);
        assert_close(&f64s(&state64["m"]), &m, 1e-14, 1e-15);
        assert_close(&f64s(&state64["v"]), &v, 1e-14, 1e-15);
        assert_eq!(state64["t"], Value::scalar(step as f64));
        let p32 = state32["p"].as_float().unwrap().to_f64_vec();
        assert_close(&p32, &p, 1e-5, 1e-6);
    }
}
