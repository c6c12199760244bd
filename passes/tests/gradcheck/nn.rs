//! MatMul, the neural-network ops (gather, layernorm, softmax, cross-entropy), and a chain of them:
//! a 1-layer transformer block.

use qatc_ir::{BinaryOp, Op, Shape, UnaryOp};

use crate::harness::{count, Case, Dist, ANY};

// ---------------------------------------------------------------------------------------------
// MatMul.

#[test]
fn matmul_all_transpose_combinations_with_batch_dims() {
    let (m, k, n) = (3, 4, 5);
    for batch in [vec![], vec![2], vec![2, 3]] {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            for which in ["both", "a", "b"] {
                let name = format!("matmul batch {batch:?} ta={ta} tb={tb} trainable {which}");
                let mut c = Case::new(&name, 1100 + 7 * batch.len() as u64 + 2 * u64::from(ta) + u64::from(tb));
                let mut ash = batch.clone();
                ash.extend(if ta { [k, m] } else { [m, k] });
                let mut bsh = batch.clone();
                bsh.extend(if tb { [n, k] } else { [k, n] });
                let a = if which == "b" { c.frozen("a", &ash, ANY) } else { c.param("a", &ash, ANY) };
                let b = if which == "a" { c.frozen("b", &bsh, ANY) } else { c.param("b", &bsh, ANY) };
                let y = c.mm(ta, tb, a, b);
                let ad = c.check(y);
                // One backward matmul per wanted gradient, none for a frozen side.
                let want = if which == "both" { 3 } else { 2 };
                assert_eq!(count(&ad, "matmul"), want, "{name}");
            }
        }
    }
}

#[test]
fn matmul_with_itself() {
    // x @ x^T and x^T @ x: both operands are the same node.
    for (k, (ta, tb)) in [(false, true), (true, false)].into_iter().enumerate() {
        let mut c = Case::new(&format!("x x ta={ta} tb={tb}"), 1200 + k as u64);
        let x = c.param("x", &[3, 4], ANY);
        let y = c.mm(ta, tb, x, x);
        c.check(y);
    }
}

// ---------------------------------------------------------------------------------------------
// Neural-network ops.

#[test]
fn gather_with_repeated_ids() {
    let mut c = Case::new("gather", 1300);
    let table = c.param("wte", &[7, 4], ANY);
    // Rows 1, 3 and 6 are hit several times; rows 4 and 5 never (their gradient is 0).
    let ids = c.ids("ids", &[2, 5], &[1, 3, 1, 6, 0, 3, 3, 2, 1, 6]);
    let y = c.op(Op::Gather, &[table, ids]);
    let ad = c.check(y);
    assert_eq!(count(&ad, "scatter_add"), 1);

    // Scalar-shaped ids and a gather used twice.
    let mut c = Case::new("gather twice", 1301);
    let table = c.param("wte", &[5, 3], ANY);
    let i0 = c.ids("i0", &[], &[2]);
    let i1 = c.ids("i1", &[4], &[2, 2, 0, 4]);
    let e0 = c.op(Op::Gather, &[table, i0]);
    let e0 = c.op(Op::Broadcast { shape: Shape::new([4, 3]) }, &[e0]);
    let e1 = c.op(Op::Gather, &[table, i1]);
    let y = c.bin(BinaryOp::Mul, e0, e1);
    c.check(y);
}

#[test]
fn layernorm_each_operand() {
    for (k, which) in ["all", "x", "gamma", "beta"].into_iter().enumerate() {
        for shape in [vec![3, 5], vec![2, 3, 7]] {
            let cdim = shape[shape.len() - 1];
            let mut c = Case::new(&format!("layernorm {shape:?} trainable {which}"), 1400 + k as u64);
            let mk = |c: &mut Case, name: &str, sh: &[usize], d: Dist, me: bool| {
                if which == "all" || me {
                    c.param(name, sh, d)
                } else {
                    c.frozen(name, sh, d)
                }
            };
            let x = mk(&mut c, "x", &shape, Dist::U(-2.0, 2.0), which == "x");
            let gamma = mk(&mut c, "gamma", &[cdim], Dist::U(0.5, 1.5), which == "gamma");
            let beta = mk(&mut c, "beta", &[cdim], ANY, which == "beta");
            let y = c.op(Op::LayerNorm { eps: 1e-5 }, &[x, gamma, beta]);
            let ad = c.check(y);
            let has = |op: &str| count(&ad, op) > 0;
            assert_eq!(has("layernorm_grad_x"), which == "all" || which == "x");
            assert_eq!(has("layernorm_grad_gamma"), which == "all" || which == "gamma");
        }
    }
}

#[test]
fn softmax_plain_causal_and_scaled() {
    let cases: [(&[usize], f64, bool); 6] = [
        (&[3, 5], 1.0, false),
        (&[3, 5], -1.3, false),
        (&[2, 4, 4], 1.0, true),
        (&[2, 4, 4], 0.37, true),
        (&[2, 2, 3, 3], 2.5, true),
        (&[7], 0.8, false),
    ];
    for (k, (shape, scale, causal)) in cases.into_iter().enumerate() {
        let mut c = Case::new(&format!("softmax {shape:?} scale={scale} causal={causal}"), 1500 + k as u64);
        let x = c.param("x", shape, ANY);
        let y = c.op(Op::Softmax { scale, causal }, &[x]);
        c.check(y);
    }
}

#[test]
fn cross_entropy_wrt_logits() {
    let mut c = Case::new("cross_entropy", 1600);
    let logits = c.param("logits", &[5, 7], Dist::U(-3.0, 3.0));
    let t = c.ids("targets", &[5], &[3, 0, 6, 3, 1]);
    let y = c.op(Op::CrossEntropy, &[logits, t]);
    c.check(y);

    // A cross-entropy of a computed logit tensor, single row.
    let mut c = Case::new("cross_entropy of matmul", 1601);
    let h = c.frozen("h", &[1, 4], ANY);
    let w = c.param("w_out", &[4, 9], ANY);
    let t = c.ids("targets", &[1], &[8]);
    let logits = c.mm(false, false, h, w);
    let y = c.op(Op::CrossEntropy, &[logits, t]);
    c.check(y);
}

#[test]
fn weighted_cross_entropy_wrt_logits() {
    // rows of weight 0 (a prompt's tokens, padding) get no gradient; the others theirs scaled
    let mut c = Case::new("weighted_cross_entropy", 1610);
    let logits = c.param("logits", &[5, 7], Dist::U(-3.0, 3.0));
    let t = c.ids("targets", &[5], &[3, 0, 6, 3, 1]);
    let w = c.g.input("weights", qatc_ir::InputKind::Data, qatc_ir::DType::F32, [5]).expect("input");
    c.vals.insert("weights".into(), qatc_runtime::Value::floats(vec![5], &[0.0, 0.4, 0.0, 0.35, 0.25]).expect("value"));
    let y = c.op(Op::WeightedCrossEntropy, &[logits, t, w]);
    let ad = c.check(y);
    assert_eq!(count(&ad, "weighted_cross_entropy_grad"), 1);
}

#[test]
fn packed_softmax_within_each_example() {
    // two sequences of 4: examples of 1 and 3 tokens, and of 2 and 2; the masked entries are 0
    // and get no gradient
    let mut c = Case::new("packed_softmax", 1620);
    let x = c.param("x", &[2, 2, 4, 4], ANY);
    let pos = c.ids("positions", &[2, 4], &[0, 0, 1, 2, 0, 1, 0, 1]);
    let y = c.op(Op::PackedSoftmax { scale: 0.6 }, &[x, pos]);
    let ad = c.check(y);
    assert_eq!(count(&ad, "softmax_grad"), 1);
}

// ---------------------------------------------------------------------------------------------
// A chain: a 1-layer transformer block, where several tensors have several uses (the residual
// stream, the layernorm output feeding q/k/v, the embedding table), so gradient contributions
// must be accumulated.

#[test]
fn transformer_block_chain() {
    let (t, c_, nh, v) = (4, 6, 2, 9);
    let hd = c_ / nh;
    let mut c = Case::new("block", 1700);
    let wte = c.param("wte", &[v, c_], Dist::U(-1.0, 1.0));
    let wpe = c.param("wpe", &[t, c_], Dist::U(-0.5, 0.5));
    let ids = c.ids("ids", &[t], &[3, 7, 3, 0]);
    let targets = c.ids("targets", &[t], &[7, 3, 0, 8]);
    let g1 = c.param("ln_1.weight", &[c_], Dist::U(0.5, 1.5));
    let b1 = c.param("ln_1.bias", &[c_], Dist::U(-0.2, 0.2));
    let wqkv = c.param("attn.c_attn.weight", &[c_, 3 * c_], Dist::U(-0.5, 0.5));
    let bqkv = c.frozen("attn.c_attn.bias", &[3 * c_], Dist::U(-0.2, 0.2));
    let wo = c.param("attn.c_proj.weight", &[c_, c_], Dist::U(-0.5, 0.5));
    let g2 = c.param("ln_2.weight", &[c_], Dist::U(0.5, 1.5));
    let b2 = c.frozen("ln_2.bias", &[c_], Dist::U(-0.2, 0.2));
    let w1 = c.param("mlp.c_fc.weight", &[c_, 8], Dist::U(-0.5, 0.5));
    let bfc = c.param("mlp.c_fc.bias", &[8], Dist::U(-0.2, 0.2));
    let w2 = c.param("mlp.c_proj.weight", &[8, c_], Dist::U(-0.5, 0.5));
    let gf = c.param("ln_f.weight", &[c_], Dist::U(0.5, 1.5));
    let bf = c.param("ln_f.bias", &[c_], Dist::U(-0.2, 0.2));

    let tok = c.op(Op::Gather, &[wte, ids]);
    let x = c.bin(BinaryOp::Add, tok, wpe);
    // Attention.
    let h = c.op(Op::LayerNorm { eps: 1e-5 }, &[x, g1, b1]);
    let qkv = c.mm(false, false, h, wqkv);
    let bq = c.op(Op::Broadcast { shape: Shape::new([t, 3 * c_]) }, &[bqkv]);
    let qkv = c.bin(BinaryOp::Add, qkv, bq);
    let heads = |c: &mut Case, i: usize| {
        let s = c.op(Op::Slice { axis: 1, start: i * c_, end: (i + 1) * c_ }, &[qkv]);
        let r = c.op(Op::Reshape { shape: Shape::new([t, nh, hd]) }, &[s]);
        c.op(Op::Transpose { perm: vec![1, 0, 2] }, &[r])
    };
    let (q, k, vv) = (heads(&mut c, 0), heads(&mut c, 1), heads(&mut c, 2));
    let att = c.mm(false, true, q, k);
    let p = c.op(Op::Softmax { scale: 1.0 / (hd as f64).sqrt(), causal: true }, &[att]);
    let o = c.mm(false, false, p, vv);
    let o = c.op(Op::Transpose { perm: vec![1, 0, 2] }, &[o]);
    let o = c.op(Op::Reshape { shape: Shape::new([t, c_]) }, &[o]);
    let o = c.mm(false, false, o, wo);
    let x = c.bin(BinaryOp::Add, x, o);
    // MLP.
    let h = c.op(Op::LayerNorm { eps: 1e-5 }, &[x, g2, b2]);
    let f = c.mm(false, false, h, w1);
    let bb = c.op(Op::Broadcast { shape: Shape::new([t, 8]) }, &[bfc]);
    let f = c.bin(BinaryOp::Add, f, bb);
    let f = c.un(UnaryOp::Gelu, f);
    let f = c.mm(false, false, f, w2);
    let x = c.bin(BinaryOp::Add, x, f);
    // Tied unembedding: wte is used twice.
    let h = c.op(Op::LayerNorm { eps: 1e-5 }, &[x, gf, bf]);
    let logits = c.mm(false, true, h, wte);
    let loss = c.op(Op::CrossEntropy, &[logits, targets]);
    let ad = c.check(loss);
    assert_eq!(count(&ad, "scatter_add"), 1);
}
