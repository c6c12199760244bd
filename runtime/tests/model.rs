//! A tiny GPT-2 block (embeddings, causal attention, GELU MLP, tied LM head, loss and dlogits)
//! run in f32 and f64: the two modes agree on a realistic composition of ops.

mod common;

use std::collections::HashMap;

use common::{assert_close, Rng};
use qatc_ir::{BinaryOp, DType, Graph, InputKind, NodeId, Op, Shape, UnaryOp};
use qatc_runtime::{Float, Interpreter, Value};

const B: usize = 2;
const T: usize = 5;
const C: usize = 8;
const NH: usize = 2;
const HD: usize = C / NH;
const V: usize = 11;

struct Block {
    g: Graph,
    params: Vec<(&'static str, Vec<usize>)>,
}

fn op(g: &mut Graph, op: Op, args: &[NodeId]) -> NodeId {
    g.add(op, args).unwrap()
}

fn linear(g: &mut Graph, x: NodeId, w: NodeId, b: NodeId, n: usize) -> NodeId {
    let y = op(g, Op::MatMul { ta: false, tb: false }, &[x, w]);
    let bb = op(g, Op::Broadcast { shape: Shape::new([B * T, n]) }, &[b]);
    op(g, Op::Binary(BinaryOp::Add), &[y, bb])
}

/// [B*T, C] slice `which` of qkv -> [B, NH, T, HD]
fn heads(g: &mut Graph, qkv: NodeId, which: usize) -> NodeId {
    let s = op(g, Op::Slice { axis: 1, start: which * C, end: (which + 1) * C }, &[qkv]);
    let r = op(g, Op::Reshape { shape: Shape::new([B, T, NH, HD]) }, &[s]);
    op(g, Op::Transpose { perm: vec![0, 2, 1, 3] }, &[r])
}

fn block() -> Block {
    let mut g = Graph::new("tiny_gpt");
    let params: Vec<(&'static str, Vec<usize>)> = vec![
        ("wte", vec![V, C]),
        ("wpe", vec![T, C]),
        ("ln.g", vec![C]),
        ("ln.b", vec![C]),
        ("qkv.w", vec![C, 3 * C]),
        ("qkv.b", vec![3 * C]),
        ("proj.w", vec![C, C]),
        ("proj.b", vec![C]),
        ("fc.w", vec![C, 4 * C]),
        ("fc.b", vec![4 * C]),
        ("fc2.w", vec![4 * C, C]),
        ("fc2.b", vec![C]),
    ];
    let p: HashMap<&str, NodeId> =
        params.iter().map(|(n, s)| (*n, g.input(*n, InputKind::Trainable, DType::F32, s.clone()).unwrap())).collect();
    let ids = g.input("ids", InputKind::Data, DType::I32, [B, T]).unwrap();
    let targets = g.input("targets", InputKind::Data, DType::I32, [B * T]).unwrap();

    let tok = op(&mut g, Op::Gather, &[p["wte"], ids]);
    let pos = op(&mut g, Op::Broadcast { shape: Shape::new([B, T, C]) }, &[p["wpe"]]);
    let x = op(&mut g, Op::Binary(BinaryOp::Add), &[tok, pos]);
    let x = op(&mut g, Op::Reshape { shape: Shape::new([B * T, C]) }, &[x]);
    let h = op(&mut g, Op::LayerNorm { eps: 1e-5 }, &[x, p["ln.g"], p["ln.b"]]);
    let qkv = linear(&mut g, h, p["qkv.w"], p["qkv.b"], 3 * C);
    let (q, k, v) = (heads(&mut g, qkv, 0), heads(&mut g, qkv, 1), heads(&mut g, qkv, 2));
    let att = op(&mut g, Op::MatMul { ta: false, tb: true }, &[q, k]);
    let att = op(&mut g, Op::Softmax { scale: 1.0 / (HD as f64).sqrt(), causal: true }, &[att]);
    let y = op(&mut g, Op::MatMul { ta: false, tb: false }, &[att, v]);
    let y = op(&mut g, Op::Transpose { perm: vec![0, 2, 1, 3] }, &[y]);
    let y = op(&mut g, Op::Reshape { shape: Shape::new([B * T, C]) }, &[y]);
    let y = linear(&mut g, y, p["proj.w"], p["proj.b"], C);
    let x = op(&mut g, Op::Binary(BinaryOp::Add), &[x, y]);
    let m = linear(&mut g, x, p["fc.w"], p["fc.b"], 4 * C);
    let m = op(&mut g, Op::Unary(UnaryOp::Gelu), &[m]);
    let m = linear(&mut g, m, p["fc2.w"], p["fc2.b"], C);
    let x = op(&mut g, Op::Binary(BinaryOp::Add), &[x, m]);
    let logits = op(&mut g, Op::MatMul { ta: false, tb: true }, &[x, p["wte"]]);
    let loss = op(&mut g, Op::CrossEntropy, &[logits, targets]);
    let one = g.constant(1.0, DType::F32, []).unwrap();
    let dlogits = op(&mut g, Op::CrossEntropyGrad, &[logits, targets, one]);
    // The tied head's weight gradient: dlogits^T x, [V, C].
    let dwte = op(&mut g, Op::MatMul { ta: true, tb: false }, &[dlogits, x]);
    g.set_output("loss", loss).unwrap();
    g.set_output("logits", logits).unwrap();
    g.set_output("dwte", dwte).unwrap();
    Block { g, params }
}

fn inputs<F: Float>(params: &[(&'static str, Vec<usize>)]) -> HashMap<String, Value<F>> {
    let mut rng = Rng::new(1);
    let mut m: HashMap<String, Value<F>> = params
        .iter()
        .map(|(n, s)| {
            let numel = s.iter().product();
            let data: Vec<f64> =
                if n.ends_with(".g") { vec![1.0; numel] } else { rng.vec(numel, -0.5, 0.5).into_iter().map(|v| v as f32 as f64).collect() };
            (n.to_string(), Value::floats(s.clone(), &data).unwrap())
        })
        .collect();
    let mut rng = Rng::new(2);
    m.insert("ids".into(), Value::ints([B, T], rng.ints(B * T, V as i32)).unwrap());
    m.insert("targets".into(), Value::ints([B * T], rng.ints(B * T, V as i32)).unwrap());
    m
}

#[test]
fn tiny_gpt_block_agrees_between_f32_and_f64() {
    let Block { g, params } = block();
    let o64 = Interpreter::<f64>::new(&g).unwrap().run(&inputs::<f64>(&params)).unwrap();
    let o32 = Interpreter::<f32>::new(&g).unwrap().run(&inputs::<f32>(&params)).unwrap();
    let get = |o: &HashMap<String, Value<f64>>, k: &str| o[k].as_float().unwrap().to_f64_vec();
    let get32 = |o: &HashMap<String, Value<f32>>, k: &str| o[k].as_float().unwrap().to_f64_vec();
    let loss = get(&o64, "loss")[0];
    assert!(loss.is_finite() && loss > 0.5 && loss < 10.0, "loss {loss}");
    for k in ["loss", "logits", "dwte"] {
        assert_close(&get32(&o32, k), &get(&o64, k), 1e-4, 1e-6);
    }
    // dlogits rows sum to zero, so dwte's columns do too (sum over V of dlogits^T x).
    let dwte = get(&o64, "dwte");
    for c in 0..C {
        let s: f64 = (0..V).map(|v| dwte[v * C + c]).sum();
        assert!(s.abs() < 1e-12, "column {c} sums to {s}");
    }
}
