//! Structural tests of autodiff: what it builds, not what it computes (gradcheck.rs does that).
//! A frozen weight gets no weight-gradient matmul, a branch no trainable input feeds gets no
//! backward nodes, and on a GPT-2-shaped stack with LoRA adapters the backward has exactly the
//! matmuls that the trainable adapters need.

use std::collections::HashMap;

use qatc_ir::{parse, print, verify, BinaryOp, DType, Graph, InputKind, IrError, NodeId, Op, Shape, UnaryOp};
use qatc_passes::autodiff::{autodiff, grad_name};
use qatc_passes::{PassError, PassReport};
use qatc_runtime::{Interpreter, Value};

fn matmuls(g: &Graph) -> usize {
    g.op_counts().get("matmul").copied().unwrap_or(0)
}

fn mm(g: &mut Graph, a: NodeId, b: NodeId) -> Result<NodeId, IrError> {
    g.add(Op::MatMul { ta: false, tb: false }, &[a, b])
}

/// `sum(square(z))`, declared as the `loss` output.
fn square_sum_loss(g: &mut Graph, z: NodeId) -> Result<NodeId, IrError> {
    let s = g.add(Op::Unary(UnaryOp::Square), &[z])?;
    let l = g.add(Op::SumTo { shape: Shape::scalar() }, &[s])?;
    g.set_output("loss", l)?;
    Ok(l)
}

/// Runs autodiff and checks what every autodiff graph must satisfy: it verifies, round-trips
/// through the text format, has one `grad:NAME` output per trainable input, typed like it.
fn differentiate(g: &Graph) -> (Graph, PassReport) {
    let (ad, report) = autodiff(g.clone()).unwrap_or_else(|e| panic!("autodiff: {e}"));
    verify(&ad).unwrap_or_else(|e| panic!("autodiff output does not verify: {e}"));
    let text = print(&ad);
    let back = parse(&text).unwrap_or_else(|e| panic!("autodiff output does not parse: {e}"));
    assert_eq!(print(&back), text);
    let trainable: Vec<NodeId> = ad.inputs().into_iter().filter(|&i| ad.input_kind(i) == Some(InputKind::Trainable)).collect();
    let grads: Vec<&str> = ad.outputs().iter().filter(|o| o.name.starts_with("grad:")).map(|o| o.name.as_str()).collect();
    assert_eq!(grads.len(), trainable.len(), "one gradient per trainable input: {grads:?}");
    for p in trainable {
        let name = ad.node(p).name.clone().unwrap_or_default();
        let gr = ad.output(&grad_name(&name)).unwrap_or_else(|| panic!("no gradient output for {name}"));
        assert_eq!(ad.ty(gr), ad.ty(p), "gradient of {name} has another type");
    }
    // The forward part is untouched: every node of g is still there with the same op.
    for id in g.node_ids() {
        assert!(ad.contains(id) && ad.node(id) == g.node(id), "forward node {} changed", g.describe(id));
    }
    (ad, report)
}

/// x [4, 8] (data) -> @ W1 [8, 16] -> @ W2 [16, 10] -> sum of squares, with the given kinds.
fn two_layer(k1: InputKind, k2: InputKind) -> Graph {
    let build = || -> Result<Graph, IrError> {
        let mut g = Graph::new("linear");
        let x = g.input("x", InputKind::Data, DType::F32, [4, 8])?;
        let w1 = g.input("W1", k1, DType::F32, [8, 16])?;
        let w2 = g.input("W2", k2, DType::F32, [16, 10])?;
        let y = mm(&mut g, x, w1)?;
        let z = mm(&mut g, y, w2)?;
        square_sum_loss(&mut g, z)?;
        Ok(g)
    };
    build().expect("two_layer builds")
}

#[test]
fn frozen_weight_gets_no_weight_gradient_matmul() {
    use InputKind::{Frozen, Trainable};
    // (kind of W1, kind of W2, backward matmuls)
    let cases = [
        // dW2 = y^T dz only: y depends on nothing trainable, so no dy = dz W2^T either.
        (Frozen, Trainable, 1),
        // dy = dz W2^T and dW1 = x^T dy; no dW2 (frozen), no dx (data).
        (Trainable, Frozen, 2),
        // dW2, dy, dW1.
        (Trainable, Trainable, 3),
    ];
    for (k1, k2, backward) in cases {
        let g = two_layer(k1, k2);
        assert_eq!(matmuls(&g), 2);
        let (ad, report) = differentiate(&g);
        assert_eq!(matmuls(&ad), 2 + backward, "W1 {k1:?}, W2 {k2:?}");
        assert_eq!(report.counters.get("trainable").copied(), Some(i64::from(k1 == Trainable) + i64::from(k2 == Trainable)));
        // The backward never reads W1: dW1 = x^T dy needs x, and nothing upstream of W1 wants a
        // gradient through it. (W2 is read when W1 is trainable: dy = dz W2^T.)
        let w1 = ad.find_input("W1").expect("W1");
        assert_eq!(ad.users(w1).len(), 1, "only the forward matmul reads W1");
    }
}

#[test]
fn data_inputs_get_no_gradient_outputs() {
    let g = two_layer(InputKind::Frozen, InputKind::Trainable);
    let (ad, _) = differentiate(&g);
    let names: Vec<&str> = ad.outputs().iter().map(|o| o.name.as_str()).collect();
    assert_eq!(names, vec!["loss", "grad:W2"]);
}

/// loss = sum(square(x @ W2)) + sum(gelu(x @ W3)) where W3 is frozen: the second branch has
/// no trainable input, so it gets no backward nodes at all.
#[test]
fn frozen_branch_gets_no_backward_nodes() {
    let build = |with_branch: bool| -> Result<Graph, IrError> {
        let mut g = Graph::new("branches");
        let x = g.input("x", InputKind::Data, DType::F32, [4, 8])?;
        let w2 = g.input("W2", InputKind::Trainable, DType::F32, [8, 10])?;
        let z = mm(&mut g, x, w2)?;
        let s = g.add(Op::Unary(UnaryOp::Square), &[z])?;
        let l1 = g.add(Op::SumTo { shape: Shape::scalar() }, &[s])?;
        let loss = if with_branch {
            let w3 = g.input("W3", InputKind::Frozen, DType::F32, [8, 6])?;
            let b = g.add_named(Op::MatMul { ta: false, tb: false }, &[x, w3], "branch.matmul")?;
            let b = g.add_named(Op::Unary(UnaryOp::Gelu), &[b], "branch.gelu")?;
            let b = g.add_named(Op::SumTo { shape: Shape::scalar() }, &[b], "branch.sum")?;
            g.add(Op::Binary(BinaryOp::Add), &[l1, b])?
        } else {
            l1
        };
        g.set_output("loss", loss)?;
        Ok(g)
    };
    let plain = build(false).expect("build");
    let branched = build(true).expect("build");
    let (ad_plain, r_plain) = differentiate(&plain);
    let (ad, r) = differentiate(&branched);
    // One more forward matmul, no more backward matmuls.
    assert_eq!(matmuls(&branched), matmuls(&plain) + 1);
    assert_eq!(matmuls(&ad) - matmuls(&branched), matmuls(&ad_plain) - matmuls(&plain));
    // The whole backward is the same size: add's rule passes dy through without new nodes.
    assert_eq!(r.counters.get("backward_nodes"), r_plain.counters.get("backward_nodes"));
    // And no backward node reads any node of the branch (no gelu_grad, nothing).
    let branch: Vec<NodeId> =
        branched.node_ids().into_iter().filter(|&n| branched.node(n).name.as_deref().is_some_and(|s| s.starts_with("branch."))).collect();
    assert_eq!(branch.len(), 3);
    for n in branch {
        assert_eq!(ad.users(n), branched.users(n), "backward reads {}", ad.describe(n));
    }
    assert_eq!(ad.op_counts().get("gelu_grad"), None);
}

/// LoRA on a frozen linear: y = x W + (x A) B with W frozen, A and B trainable.
#[test]
fn lora_adapter_gets_exactly_its_matmuls() {
    let build = || -> Result<Graph, IrError> {
        let mut g = Graph::new("lora");
        let x = g.input("x", InputKind::Data, DType::F32, [5, 8])?;
        let w = g.input("W", InputKind::Frozen, DType::F32, [8, 12])?;
        let a = g.input("lora_A", InputKind::Trainable, DType::F32, [8, 2])?;
        let b = g.input("lora_B", InputKind::Trainable, DType::F32, [2, 12])?;
        let base = mm(&mut g, x, w)?;
        let u = mm(&mut g, x, a)?;
        let r = mm(&mut g, u, b)?;
        let r = g.add(Op::Affine { mul: 0.5, add: 0.0 }, &[r])?;
        let y = g.add(Op::Binary(BinaryOp::Add), &[base, r])?;
        square_sum_loss(&mut g, y)?;
        Ok(g)
    };
    let g = build().expect("build");
    let (ad, _) = differentiate(&g);
    // Forward 3; backward dB = u^T dr, du = dr B^T, dA = x^T du. No dW, no dx.
    assert_eq!(matmuls(&g), 3);
    assert_eq!(matmuls(&ad), 6);
    let w = ad.find_input("W").expect("W");
    assert_eq!(ad.users(w).len(), 1);
}

#[test]
fn unused_trainable_gets_a_zero_gradient_and_a_note() {
    let build = || -> Result<Graph, IrError> {
        let mut g = Graph::new("unused");
        let x = g.input("x", InputKind::Trainable, DType::F32, [3])?;
        g.input("idle", InputKind::Trainable, DType::F32, [2, 2])?;
        square_sum_loss(&mut g, x)?;
        Ok(g)
    };
    let g = build().expect("build");
    let (ad, report) = differentiate(&g);
    let gi = ad.output("grad:idle").expect("grad:idle");
    assert_eq!(ad.node(gi).op, Op::Const { value: 0.0, dtype: DType::F32, shape: Shape::new([2, 2]) });
    assert!(report.notes.iter().any(|n| n.contains("idle")), "{:?}", report.notes);
    let out = Interpreter::<f64>::new(&ad)
        .and_then(|i| i.run(&HashMap::from([("x".to_string(), Value::floats([3], &[1.0, -2.0, 0.5]).expect("value"))])))
        .expect("run");
    assert_eq!(out["grad:x"].as_float().expect("float").data, vec![2.0, -4.0, 1.0]);
    assert_eq!(out["grad:idle"].as_float().expect("float").data, vec![0.0; 4]);
}

#[test]
fn autodiff_rejects_graphs_it_cannot_differentiate() {
    let invalid = |g: Graph, what: &str| match autodiff(g) {
        Err(PassError::Invalid { pass, msg }) => {
            assert_eq!(pass, qatc_passes::Stage::Autodiff);
            assert!(msg.contains(what), "{msg}");
        }
        Err(e) => panic!("expected Invalid({what}), got {e}"),
        Ok(_) => panic!("expected Invalid({what}), autodiff succeeded"),
    };
    // No loss output.
    let mut g = Graph::new("t");
    let x = g.input("x", InputKind::Trainable, DType::F32, [3]).expect("input");
    g.set_output("y", x).expect("output");
    invalid(g, "no `loss` output");
    // A non-scalar loss.
    let mut g = Graph::new("t");
    let x = g.input("x", InputKind::Trainable, DType::F32, [3]).expect("input");
    g.set_output("loss", x).expect("output");
    invalid(g, "loss must be a scalar");
    // Nothing trainable.
    let mut g = Graph::new("t");
    let x = g.input("x", InputKind::Frozen, DType::F32, [3]).expect("input");
    square_sum_loss(&mut g, x).expect("loss");
    invalid(g, "no trainable inputs");
}

// ---------------------------------------------------------------------------------------------
// A GPT-2-shaped stack (hand-built: the lowering lives in the root crate, which passes does not
// depend on): token + position embeddings, L blocks of pre-LN causal multi-head attention and a
// GELU MLP, a final layernorm and the tied unembedding, cross-entropy over B*T rows. All weights
// are frozen; the qkv projection of the layers in `lora_layers` gets a trainable LoRA adapter.

struct Dims {
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    v: usize,
    layers: usize,
}

fn gpt2_like(d: &Dims, lora_layers: &[usize]) -> Result<Graph, IrError> {
    let (b, t, c, nh, v) = (d.b, d.t, d.c, d.nh, d.v);
    let (n, hs, r) = (b * t, c / nh, 2);
    let f32_in = |g: &mut Graph, name: &str, kind: InputKind, shape: &[usize]| g.input(name, kind, DType::F32, shape.to_vec());
    let mut g = Graph::new("gpt2-like");
    let wte = f32_in(&mut g, "wte.weight", InputKind::Frozen, &[v, c])?;
    let wpe = f32_in(&mut g, "wpe.weight", InputKind::Frozen, &[t, c])?;
    let ids = g.input("ids", InputKind::Data, DType::I32, [b, t])?;
    let targets = g.input("targets", InputKind::Data, DType::I32, [n])?;
    let tok = g.add(Op::Gather, &[wte, ids])?;
    let pos = g.add(Op::Broadcast { shape: Shape::new([b, t, c]) }, &[wpe])?;
    let x = g.add(Op::Binary(BinaryOp::Add), &[tok, pos])?;
    let mut x = g.add(Op::Reshape { shape: Shape::new([n, c]) }, &[x])?;
    let linear = |g: &mut Graph, h: NodeId, w: NodeId, bias: NodeId, out: usize| -> Result<NodeId, IrError> {
        let y = mm(g, h, w)?;
        let bb = g.add(Op::Broadcast { shape: Shape::new([n, out]) }, &[bias])?;
        g.add(Op::Binary(BinaryOp::Add), &[y, bb])
    };
    for l in 0..d.layers {
        let p = |s: &str| format!("h.{l}.{s}");
        let ln1g = f32_in(&mut g, &p("ln_1.weight"), InputKind::Frozen, &[c])?;
        let ln1b = f32_in(&mut g, &p("ln_1.bias"), InputKind::Frozen, &[c])?;
        let wqkv = f32_in(&mut g, &p("attn.c_attn.weight"), InputKind::Frozen, &[c, 3 * c])?;
        let bqkv = f32_in(&mut g, &p("attn.c_attn.bias"), InputKind::Frozen, &[3 * c])?;
        let wo = f32_in(&mut g, &p("attn.c_proj.weight"), InputKind::Frozen, &[c, c])?;
        let bo = f32_in(&mut g, &p("attn.c_proj.bias"), InputKind::Frozen, &[c])?;
        let ln2g = f32_in(&mut g, &p("ln_2.weight"), InputKind::Frozen, &[c])?;
        let ln2b = f32_in(&mut g, &p("ln_2.bias"), InputKind::Frozen, &[c])?;
        let wfc = f32_in(&mut g, &p("mlp.c_fc.weight"), InputKind::Frozen, &[c, 4 * c])?;
        let bfc = f32_in(&mut g, &p("mlp.c_fc.bias"), InputKind::Frozen, &[4 * c])?;
        let wpr = f32_in(&mut g, &p("mlp.c_proj.weight"), InputKind::Frozen, &[4 * c, c])?;
        let bpr = f32_in(&mut g, &p("mlp.c_proj.bias"), InputKind::Frozen, &[c])?;

        let h = g.add(Op::LayerNorm { eps: 1e-5 }, &[x, ln1g, ln1b])?;
        let mut qkv = linear(&mut g, h, wqkv, bqkv, 3 * c)?;
        if lora_layers.contains(&l) {
            let a = f32_in(&mut g, &p("attn.c_attn.lora_A"), InputKind::Trainable, &[c, r])?;
            let bm = f32_in(&mut g, &p("attn.c_attn.lora_B"), InputKind::Trainable, &[r, 3 * c])?;
            let u = mm(&mut g, h, a)?;
            let delta = mm(&mut g, u, bm)?;
            let delta = g.add(Op::Affine { mul: 2.0, add: 0.0 }, &[delta])?;
            qkv = g.add(Op::Binary(BinaryOp::Add), &[qkv, delta])?;
        }
        let mut heads = Vec::new();
        for i in 0..3 {
            let s = g.add(Op::Slice { axis: 1, start: i * c, end: (i + 1) * c }, &[qkv])?;
            let s = g.add(Op::Reshape { shape: Shape::new([b, t, nh, hs]) }, &[s])?;
            heads.push(g.add(Op::Transpose { perm: vec![0, 2, 1, 3] }, &[s])?);
        }
        let att = g.add(Op::MatMul { ta: false, tb: true }, &[heads[0], heads[1]])?;
        let att = g.add(Op::Softmax { scale: 1.0 / (hs as f64).sqrt(), causal: true }, &[att])?;
        let o = mm(&mut g, att, heads[2])?;
        let o = g.add(Op::Transpose { perm: vec![0, 2, 1, 3] }, &[o])?;
        let o = g.add(Op::Reshape { shape: Shape::new([n, c]) }, &[o])?;
        let o = linear(&mut g, o, wo, bo, c)?;
        x = g.add(Op::Binary(BinaryOp::Add), &[x, o])?;
        let h = g.add(Op::LayerNorm { eps: 1e-5 }, &[x, ln2g, ln2b])?;
        let f = linear(&mut g, h, wfc, bfc, 4 * c)?;
        let f = g.add(Op::Unary(UnaryOp::Gelu), &[f])?;
        let f = linear(&mut g, f, wpr, bpr, c)?;
        x = g.add(Op::Binary(BinaryOp::Add), &[x, f])?;
    }
    let lnfg = f32_in(&mut g, "ln_f.weight", InputKind::Frozen, &[c])?;
    let lnfb = f32_in(&mut g, "ln_f.bias", InputKind::Frozen, &[c])?;
    let h = g.add(Op::LayerNorm { eps: 1e-5 }, &[x, lnfg, lnfb])?;
    let logits = g.add(Op::MatMul { ta: false, tb: true }, &[h, wte])?;
    let loss = g.add(Op::CrossEntropy, &[logits, targets])?;
    g.set_output("loss", loss)?;
    Ok(g)
}

#[test]
fn gpt2_shaped_lora_backward_has_exactly_the_needed_matmuls() {
    let d = Dims { b: 2, t: 4, c: 8, nh: 2, v: 11, layers: 3 };
    // Forward: per layer qkv, c_proj, c_fc, mlp c_proj (4 linears) + q k^T and att v (2), plus
    // 2 per LoRA adapter; then the unembedding.
    let forward = |lora: usize| 6 * d.layers + 2 * lora + 1;
    // Backward, counted by hand from the rules (frozen weights never get a weight gradient):
    // - the unembedding: dh only (wte is frozen);
    // - a layer downstream of a trainable adapter: dh through mlp c_proj, c_fc, attn c_proj (3),
    //   both operands of att v and of q k^T (4), and dh through the frozen qkv weight (1);
    // - a layer with an adapter adds dB, du, dA (3), and dh = du A^T (1) unless nothing
    //   upstream of it is trainable, in which case neither dh through qkv nor through A exists;
    // - layers upstream of every adapter: nothing.
    let cases: [(&[usize], usize); 4] = [
        // Adapter in the last layer only: unembed 1, last layer 3 + 4 + 3.
        (&[2], 1 + 10),
        // Adapter in the first layer: unembed 1; layers 2 and 1: 3 + 4 + 1 each; layer 0: 3 + 4 + 3.
        (&[0], 1 + 8 + 8 + 10),
        // Adapters in layers 0 and 2: layer 2: 3 + 4 + 1 + 3 + 1; layer 1: 8; layer 0: 10.
        (&[0, 2], 1 + 12 + 8 + 10),
        // Every layer: layers 2 and 1: 12 each; layer 0: 10.
        (&[0, 1, 2], 1 + 12 + 12 + 10),
    ];
    for (lora, backward) in cases {
        let g = gpt2_like(&d, lora).expect("gpt2_like builds");
        verify(&g).expect("valid");
        assert_eq!(matmuls(&g), forward(lora.len()), "forward, lora in {lora:?}");
        let (ad, report) = differentiate(&g);
        assert_eq!(matmuls(&ad) - matmuls(&g), backward, "backward matmuls, lora in {lora:?}\n{report}");
        // Only the adapters have gradients.
        let grads: Vec<&str> = ad.outputs().iter().filter(|o| o.name.starts_with("grad:")).map(|o| o.name.as_str()).collect();
        assert_eq!(grads.len(), 2 * lora.len());
        assert!(grads.iter().all(|n| n.contains("lora_")), "{grads:?}");
        // Frozen embeddings: no scatter_add (the gather's table gradient is never built).
        assert_eq!(ad.op_counts().get("scatter_add"), None);
        // Layers upstream of the first adapter have no backward: their layernorms get no
        // layernorm_grad_x. Each layer from the first adapter on has 2 (ln_1 only when a
        // trainable tensor is upstream of it), plus ln_f.
        let first = lora.iter().copied().min().unwrap_or(d.layers);
        let ln_grads = ad.op_counts().get("layernorm_grad_x").copied().unwrap_or(0);
        assert_eq!(ln_grads, 1 + (d.layers - first) + (d.layers - first).saturating_sub(1), "layernorm_grad_x, lora in {lora:?}");
        assert_eq!(ad.op_counts().get("layernorm_grad_gamma"), None, "all gammas are frozen");
    }
}

#[test]
fn gpt2_shaped_backward_runs() {
    // The structure test above counts nodes; this one runs the step on the interpreter so the
    // graph it counted is also executable, and its gradients are finite and not all zero.
    let d = Dims { b: 2, t: 4, c: 8, nh: 2, v: 11, layers: 2 };
    let g = gpt2_like(&d, &[0, 1]).expect("builds");
    let (ad, _) = differentiate(&g);
    let interp = Interpreter::<f64>::new(&ad).expect("interpreter");
    let mut seed = 0x1234_5678_9abc_def0_u64;
    let mut next = move || {
        // splitmix64
        seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut inputs = HashMap::new();
    for (name, _kind, ty) in interp.inputs() {
        let shape = ty.shape.dims().to_vec();
        let n = ty.numel();
        let v = if ty.dtype == DType::I32 {
            let hi = if name == "ids" || name == "targets" { d.v as u64 } else { 1 };
            Value::ints(shape, (0..n).map(|_| (next() % hi) as i32).collect()).expect("ints")
        } else {
            let data: Vec<f64> = (0..n).map(|_| ((next() >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 0.4).collect();
            let data = if name.ends_with("ln_1.weight") || name.ends_with("ln_2.weight") || name == "ln_f.weight" {
                data.iter().map(|x| 1.0 + x).collect()
            } else {
                data
            };
            Value::floats(shape, &data).expect("floats")
        };
        inputs.insert(name.to_string(), v);
    }
    let out = interp.run(&inputs).expect("run");
    let loss = out["loss"].item().expect("scalar loss");
    assert!(loss.is_finite() && loss > 0.0, "loss {loss}");
    for l in 0..d.layers {
        for m in ["lora_A", "lora_B"] {
            let gname = grad_name(&format!("h.{l}.attn.c_attn.{m}"));
            let gr = out[&gname].as_float().expect("float");
            assert!(gr.data.iter().all(|x| x.is_finite()), "{gname}");
            assert!(gr.data.iter().any(|&x| x != 0.0), "{gname} is all zero");
        }
    }
}
