//! Each rule family fires on a small hand-built graph, builds the kernel it promises, keeps the
//! results, and does not fire when the shapes do not fit. Plus the runner's bounds.

mod fusion_util;

use fusion_util::{families, fired, fuse, fuse_with, inputs, max_rel_diff};
use qatc_ir::{BinaryOp, DType, Graph, InputKind, NodeId, Op, QuantScheme, QuantSpec, Shape, UnaryOp};
use qatc_passes::fusion::FuseOptions;

const TOL: f64 = 1e-12;

fn inp(g: &mut Graph, name: &str, dims: &[usize]) -> NodeId {
    g.input(name, InputKind::Data, DType::F32, dims).unwrap()
}

fn op(g: &mut Graph, op: Op, args: &[NodeId]) -> NodeId {
    g.add(op, args).unwrap()
}

fn bin(g: &mut Graph, b: BinaryOp, x: NodeId, y: NodeId) -> NodeId {
    op(g, Op::Binary(b), &[x, y])
}

fn mm(g: &mut Graph, a: NodeId, b: NodeId, tb: bool) -> NodeId {
    op(g, Op::MatMul { ta: false, tb }, &[a, b])
}

/// Fuses and checks the results against the unfused graph.
fn check(g: &Graph) -> (Graph, qatc_passes::fusion::FusionReport) {
    let (f, r) = fuse(g);
    for seed in 1..3 {
        let d = max_rel_diff(g, &f, &inputs(g, seed, 5));
        assert!(d <= TOL, "fused results differ by {d:e}");
    }
    (f, r)
}

// ---- elementwise ----

#[test]
fn a_pointwise_chain_is_one_kernel() {
    let mut g = Graph::new("t");
    let (x, y) = (inp(&mut g, "x", &[4, 6]), inp(&mut g, "y", &[6]));
    let e = op(&mut g, Op::Unary(UnaryOp::Exp), &[x]);
    let b = op(&mut g, Op::Broadcast { shape: Shape::new([4, 6]) }, &[y]);
    let m = bin(&mut g, BinaryOp::Mul, e, b);
    let n = op(&mut g, Op::Affine { mul: 2.0, add: 1.0 }, &[m]);
    let t = op(&mut g, Op::Unary(UnaryOp::Tanh), &[n]);
    g.set_output("out", t).unwrap();
    let (f, r) = check(&g);
    assert_eq!(families(&f), ["pointwise"]);
    assert_eq!(r.kernels_after, 1);
    assert!(fired(&r, "pointwise-chain") > 0);
}

#[test]
fn a_value_with_another_consumer_is_not_inlined() {
    let mut g = Graph::new("t");
    let x = inp(&mut g, "x", &[4, 6]);
    let e = op(&mut g, Op::Unary(UnaryOp::Exp), &[x]);
    let t = op(&mut g, Op::Unary(UnaryOp::Tanh), &[e]);
    g.set_output("out", t).unwrap();
    g.set_output("e", e).unwrap(); // e is also a result: it must be written
    let (f, r) = check(&g);
    assert!(families(&f).is_empty(), "nothing to fuse: {:?}", families(&f));
    assert_eq!(r.kernels_after, 2);
}

#[test]
fn a_sum_of_squares_is_one_reduction() {
    let mut g = Graph::new("t");
    let x = inp(&mut g, "x", &[4, 6]);
    let sq = op(&mut g, Op::Unary(UnaryOp::Square), &[x]);
    let s = op(&mut g, Op::SumTo { shape: Shape::scalar() }, &[sq]);
    g.set_output("s", s).unwrap();
    let (f, r) = check(&g);
    assert_eq!(families(&f), ["reduce.sum"]);
    assert!(fired(&r, "reduce-prologue") > 0);
}

// ---- dequantization prologue ----

fn quantized_linear(g: &mut Graph, k: usize, n: usize) -> (NodeId, NodeId) {
    let spec = QuantSpec { bits: 4, group: 4, scheme: QuantScheme::Sym };
    let x = inp(g, "x", &[3, k]);
    let c = g.input("w.qcodes", InputKind::Frozen, DType::I4, [k, n]).unwrap();
    let s = g.input("w.qscales", InputKind::Frozen, DType::F32, [k / 4, n]).unwrap();
    let w = op(g, Op::Dequantize { spec, to: qatc_ir::DType::F32 }, &[c, s]);
    (x, w)
}

#[test]
fn dequantization_is_a_gemm_prologue() {
    let mut g = Graph::new("t");
    let (x, w) = quantized_linear(&mut g, 8, 5);
    let y = mm(&mut g, x, w, false);
    g.set_output("y", y).unwrap();
    let (f, r) = check(&g);
    assert_eq!(families(&f), ["gemm.dequant"]);
    assert!(fired(&r, "dequant-prologue") > 0);
    assert!(r.bytes_after < r.bytes_before, "the f32 weight is never written");
}

#[test]
fn dequantization_as_the_left_operand_is_left_alone() {
    let mut g = Graph::new("t");
    let (x, w) = quantized_linear(&mut g, 8, 3); // w [8, 3], x [3, 8]
    let y = mm(&mut g, w, x, false); // [8, 8]: the dequantized weight is the lhs
    g.set_output("y", y).unwrap();
    let (_, r) = check(&g);
    assert_eq!(fired(&r, "dequant-prologue"), 0);
}

// ---- epilogues ----

fn linear(g: &mut Graph, bias_dims: &[usize]) -> NodeId {
    let (x, w) = (inp(g, "x", &[3, 8]), inp(g, "w", &[8, 5]));
    let b = inp(g, "b", bias_dims);
    let y = mm(g, x, w, false);
    let bb = op(g, Op::Broadcast { shape: Shape::new([3, 5]) }, &[b]);
    bin(g, BinaryOp::Add, y, bb)
}

#[test]
fn bias_and_gelu_are_gemm_epilogues() {
    let mut g = Graph::new("t");
    let y = linear(&mut g, &[5]);
    let a = op(&mut g, Op::Unary(UnaryOp::Gelu), &[y]);
    g.set_output("a", a).unwrap();
    let (f, r) = check(&g);
    assert_eq!(families(&f), ["gemm.bias.gelu"]);
    assert!(fired(&r, "epilogue-bias") > 0 && fired(&r, "epilogue-gelu") > 0);
}

#[test]
fn gelu_writes_the_preactivation_too_when_it_is_needed() {
    let mut g = Graph::new("t");
    let y = linear(&mut g, &[5]);
    let a = op(&mut g, Op::Unary(UnaryOp::Gelu), &[y]);
    g.set_output("a", a).unwrap();
    g.set_output("y", y).unwrap();
    let (f, _) = check(&g);
    assert_eq!(families(&f), ["gemm.bias.gelu.aux"], "one kernel writes gelu(y) and y");
}

#[test]
fn a_per_row_vector_is_not_a_bias() {
    let mut g = Graph::new("t");
    let y = linear(&mut g, &[3, 1]); // broadcast along columns: not a per-column bias
    g.set_output("y", y).unwrap();
    let (_, r) = check(&g);
    assert_eq!(fired(&r, "epilogue-bias"), 0);
}

#[test]
fn residual_add_and_scaling_are_epilogues() {
    let mut g = Graph::new("t");
    let (x, w, r) = (inp(&mut g, "x", &[3, 8]), inp(&mut g, "w", &[8, 5]), inp(&mut g, "r", &[3, 5]));
    let y = mm(&mut g, x, w, false);
    let s = op(&mut g, Op::Affine { mul: 0.5, add: 0.0 }, &[y]);
    let o = bin(&mut g, BinaryOp::Add, r, s);
    g.set_output("o", o).unwrap();
    let (f, rep) = check(&g);
    assert_eq!(families(&f), ["gemm.scale.residual"]);
    assert!(fired(&rep, "epilogue-residual-lhs") > 0);
}

#[test]
fn a_residual_of_another_shape_is_not_an_epilogue() {
    let mut g = Graph::new("t");
    let (x, w, r) = (inp(&mut g, "x", &[3, 8]), inp(&mut g, "w", &[8, 5]), inp(&mut g, "r", &[5]));
    let y = mm(&mut g, x, w, false);
    let rb = op(&mut g, Op::Broadcast { shape: Shape::new([3, 5]) }, &[r]);
    let rr = op(&mut g, Op::Unary(UnaryOp::Exp), &[rb]); // [3, 5] but made by a broadcast chain
    let o = bin(&mut g, BinaryOp::Add, y, rr);
    g.set_output("o", o).unwrap();
    let (_, rep) = check(&g);
    assert!(fired(&rep, "epilogue-residual") > 0, "same type: fires");
    let mut g2 = Graph::new("t");
    let (x, w, r) = (inp(&mut g2, "x", &[3, 8]), inp(&mut g2, "w", &[8, 1]), inp(&mut g2, "r", &[3, 1]));
    let y = mm(&mut g2, x, w, false);
    let yb = op(&mut g2, Op::Broadcast { shape: Shape::new([3, 4]) }, &[y]);
    let rb = op(&mut g2, Op::Broadcast { shape: Shape::new([3, 4]) }, &[r]);
    let o = bin(&mut g2, BinaryOp::Add, yb, rb);
    g2.set_output("o", o).unwrap();
    let (_, rep2) = check(&g2);
    assert_eq!(fired(&rep2, "epilogue-residual") + fired(&rep2, "epilogue-residual-lhs"), 0);
}

// ---- LoRA ----

/// y = x W + b + 2 (x A^T) B^T, A [r, 16], B [16, r]; u = x A^T is also an output when `save_u`.
fn lora_linear(r: usize, save_u: bool) -> Graph {
    let mut g = Graph::new("t");
    let (x, w, b) = (inp(&mut g, "x", &[6, 16]), inp(&mut g, "w", &[16, 16]), inp(&mut g, "b", &[16]));
    let (a, bw) = (inp(&mut g, "A", &[r, 16]), inp(&mut g, "B", &[16, r]));
    let y = mm(&mut g, x, w, false);
    let bb = op(&mut g, Op::Broadcast { shape: Shape::new([6, 16]) }, &[b]);
    let lin = bin(&mut g, BinaryOp::Add, y, bb);
    let u = mm(&mut g, x, a, true);
    let v = mm(&mut g, u, bw, true);
    let sv = op(&mut g, Op::Affine { mul: 2.0, add: 0.0 }, &[v]);
    let out = bin(&mut g, BinaryOp::Add, lin, sv);
    g.set_output("y", out).unwrap();
    if save_u {
        g.set_output("u", u).unwrap();
    }
    g
}

#[test]
fn the_lora_up_projection_is_an_epilogue_and_x_is_read_once() {
    let (f, r) = check(&lora_linear(2, false));
    assert!(fired(&r, "lora-up-epilogue") > 0);
    assert_eq!(families(&f), ["gemm.bias.lora"], "x A^T is recomputed from the x tiles in the same kernel");
    let (f, r) = check(&lora_linear(2, true));
    assert!(fired(&r, "lora-shared-input") > 0);
    assert_eq!(families(&f), ["gemm.bias.lora.lora_down"], "one kernel writes y and the rank-r u");
}

#[test]
fn a_full_rank_side_branch_is_not_lora() {
    let (_, r) = check(&lora_linear(8, false)); // r = 8 > 16 / 4
    assert_eq!(fired(&r, "lora-up-epilogue"), 0);
}

// ---- layernorm ----

fn ln_inputs(g: &mut Graph) -> (NodeId, NodeId) {
    (inp(g, "gamma", &[8]), inp(g, "beta", &[8]))
}

#[test]
fn the_residual_add_is_a_layernorm_prologue() {
    let mut g = Graph::new("t");
    let (x, r) = (inp(&mut g, "x", &[4, 8]), inp(&mut g, "r", &[4, 8]));
    let (ga, be) = ln_inputs(&mut g);
    let s = bin(&mut g, BinaryOp::Add, x, r);
    let l = op(&mut g, Op::LayerNorm { eps: 1e-5 }, &[s, ga, be]);
    g.set_output("l", l).unwrap();
    let (f, rep) = check(&g);
    assert_eq!(families(&f), ["layernorm.residual"]);
    g.set_output("s", s).unwrap();
    let (f, _) = check(&g);
    assert_eq!(families(&f), ["layernorm.residual.aux"], "the sum, needed again, is written by the same kernel");
    assert!(fired(&rep, "layernorm-residual") > 0);
}

#[test]
fn a_broadcast_addend_is_not_a_residual() {
    let mut g = Graph::new("t");
    let (x, r) = (inp(&mut g, "x", &[4, 8]), inp(&mut g, "r", &[8]));
    let (ga, be) = ln_inputs(&mut g);
    let rb = op(&mut g, Op::Broadcast { shape: Shape::new([4, 8]) }, &[r]);
    let s = bin(&mut g, BinaryOp::Add, x, rb);
    let l = op(&mut g, Op::LayerNorm { eps: 1e-5 }, &[s, ga, be]);
    g.set_output("l", l).unwrap();
    let (_, rep) = check(&g);
    assert_eq!(fired(&rep, "layernorm-residual"), 0);
}

#[test]
fn layernorm_backward_accumulates_the_residual_gradient() {
    let mut g = Graph::new("t");
    let (x, dy, d) = (inp(&mut g, "x", &[4, 8]), inp(&mut g, "dy", &[4, 8]), inp(&mut g, "d", &[4, 8]));
    let (ga, _) = ln_inputs(&mut g);
    let dx = op(&mut g, Op::LayerNormGradX { eps: 1e-5 }, &[x, ga, dy]);
    let o = bin(&mut g, BinaryOp::Add, d, dx);
    g.set_output("o", o).unwrap();
    let (f, rep) = check(&g);
    assert_eq!(families(&f), ["layernorm_bwd.residual"]);
    assert!(fired(&rep, "layernorm-bwd-residual") > 0);
}

#[test]
fn layernorm_backward_computes_all_three_gradients_in_one_pass() {
    let mut g = Graph::new("t");
    let (x, dy) = (inp(&mut g, "x", &[4, 8]), inp(&mut g, "dy", &[4, 8]));
    let (ga, _) = ln_inputs(&mut g);
    let dx = op(&mut g, Op::LayerNormGradX { eps: 1e-5 }, &[x, ga, dy]);
    let dg = op(&mut g, Op::LayerNormGradGamma { eps: 1e-5 }, &[x, dy]);
    let db = op(&mut g, Op::SumTo { shape: Shape::new([8]) }, &[dy]);
    for (n, v) in [("dx", dx), ("dg", dg), ("db", db)] {
        g.set_output(n, v).unwrap();
    }
    let (f, _) = check(&g);
    assert_eq!(families(&f), ["layernorm_bwd.all"]);
}

// ---- attention ----

fn scores(g: &mut Graph, dims: &[usize], causal: bool) -> NodeId {
    let (q, k) = (inp(g, "q", dims), inp(g, "k", dims));
    let s = mm(g, q, k, true);
    op(g, Op::Softmax { scale: 0.25, causal }, &[s])
}

#[test]
fn scores_scale_mask_and_softmax_are_one_kernel() {
    let mut g = Graph::new("t");
    let p = scores(&mut g, &[1, 2, 4, 8], true);
    let v = inp(&mut g, "v", &[1, 2, 4, 8]);
    let o = mm(&mut g, p, v, false);
    g.set_output("o", o).unwrap();
    let (f, rep) = check(&g);
    assert!(fired(&rep, "attention-scores") > 0);
    assert_eq!(families(&f), ["attention.flash"], "probabilities no one else reads: flash attention");
    g.set_output("p", p).unwrap();
    let (f, _) = check(&g);
    assert!(families(&f).contains(&"attention.scores".to_string()), "{:?}", families(&f));
}

#[test]
fn attention_backward_forms_dp_in_registers() {
    let mut g = Graph::new("t");
    let dims = [1, 2, 4, 8];
    let (p, dout, v) = (inp(&mut g, "p", &[1, 2, 4, 4]), inp(&mut g, "do", &dims), inp(&mut g, "v", &dims));
    let dp = mm(&mut g, dout, v, true);
    let ds = op(&mut g, Op::SoftmaxGrad { scale: 0.25 }, &[p, dp]);
    g.set_output("ds", ds).unwrap();
    let (f, _) = check(&g);
    assert_eq!(families(&f), ["attention_bwd.scores"]);
}

#[test]
fn a_plain_softmax_over_rows_is_not_attention() {
    let mut g = Graph::new("t");
    let p = scores(&mut g, &[4, 8], false); // rank 2: no heads
    g.set_output("p", p).unwrap();
    let (_, rep) = check(&g);
    assert_eq!(fired(&rep, "attention-scores"), 0);
}

// ---- cross-entropy ----

/// loss = CE(h W^T, t) and dh = CEgrad(h W^T, t, 1) W, V = 11.
fn head(g: &mut Graph, logits_out: bool) {
    let (h, w) = (inp(g, "h", &[6, 4]), inp(g, "w", &[11, 4]));
    let t = g.input("t", InputKind::Data, DType::I32, [6]).unwrap();
    let l = mm(g, h, w, true);
    let loss = op(g, Op::CrossEntropy, &[l, t]);
    let one = g.constant(1.0, DType::F32, Shape::scalar()).unwrap();
    g.set_name(one, "loss.grad");
    let dl = op(g, Op::CrossEntropyGrad, &[l, t, one]);
    let dh = op(g, Op::MatMul { ta: false, tb: false }, &[dl, w]);
    g.set_output("loss", loss).unwrap();
    g.set_output("dh", dh).unwrap();
    if logits_out {
        g.set_output("logits", l).unwrap();
    }
}

#[test]
fn the_logits_are_never_written() {
    let mut g = Graph::new("t");
    head(&mut g, false);
    let (f, rep) = check(&g);
    assert!(fired(&rep, "xent-linear") > 0);
    assert_eq!(families(&f), ["cross_entropy.linear.chunk=6"]);
}

#[test]
fn materialized_logits_are_read_once_for_loss_and_gradient() {
    let mut g = Graph::new("t");
    head(&mut g, true);
    let (f, rep) = check(&g);
    assert!(fired(&rep, "xent-softmax-fused") > 0);
    assert!(families(&f).contains(&"cross_entropy.softmax.inplace".to_string()), "{:?}", families(&f));
    assert!(!families(&f).iter().any(|k| k.starts_with("cross_entropy.linear")), "the logits are an output");
}

// ---- AdamW ----

#[test]
fn adamw_updates_every_tensor_in_one_kernel() {
    let mut g = Graph::new("t");
    let lr = inp(&mut g, "lr", &[]);
    let t = g.input("step", InputKind::State, DType::F32, Shape::scalar()).unwrap();
    for (name, dims) in [("p1", vec![3, 4]), ("p2", vec![5])] {
        let p = g.input(name, InputKind::Trainable, DType::F32, dims.clone()).unwrap();
        let m = g.input(format!("adam.m:{name}"), InputKind::State, DType::F32, dims.clone()).unwrap();
        let v = g.input(format!("adam.v:{name}"), InputKind::State, DType::F32, dims.clone()).unwrap();
        let gr = inp(&mut g, &format!("g:{name}"), &dims);
        let m1 = op(&mut g, Op::AdamM { beta1: 0.9 }, &[m, gr]);
        let v1 = op(&mut g, Op::AdamV { beta2: 0.999 }, &[v, gr]);
        let p1 = op(&mut g, Op::AdamParam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }, &[p, m1, v1, lr, t]);
        g.set_update(name, p1).unwrap();
        g.set_update(format!("adam.m:{name}"), m1).unwrap();
        g.set_update(format!("adam.v:{name}"), v1).unwrap();
    }
    let (f, rep) = check(&g);
    assert_eq!(families(&f), ["adamw.multi_tensor"]);
    assert_eq!(rep.kernels_after, 1);
}

// ---- the runner's bounds ----

#[test]
fn the_runner_reports_why_it_stopped() {
    let g = lora_linear(2, true);
    let (_, r) = fuse(&g);
    assert_eq!(r.saturation.stop_reason, "saturated");
    assert!(r.saturation.complete);
    let tiny = FuseOptions { min_node_limit: 1, node_factor: 1, ..Default::default() };
    let (f, r) = fuse_with(&g, &tiny);
    assert!(r.saturation.stop_reason.starts_with("node_limit"), "{}", r.saturation.stop_reason);
    assert!(!r.saturation.complete);
    assert!(max_rel_diff(&g, &f, &inputs(&g, 1, 5)) <= TOL, "a partial e-graph still extracts a correct graph");
    let one = FuseOptions { iter_limit: 1, ..Default::default() };
    let (_, r) = fuse_with(&g, &one);
    assert!(r.saturation.stop_reason.starts_with("iteration_limit"), "{}", r.saturation.stop_reason);
    let none = FuseOptions { time_limit_s: 0.0, ..Default::default() };
    let (_, r) = fuse_with(&g, &none);
    assert!(r.saturation.stop_reason.starts_with("time_limit"), "{}", r.saturation.stop_reason);
}

/// Fusion within a spent compile budget stops with the budget's error, naming the stage.
#[test]
fn fusion_stops_when_the_compile_budget_is_spent() {
    let mut g = Graph::new("chain");
    let x = inp(&mut g, "x", &[4, 8]);
    let e = op(&mut g, Op::Unary(UnaryOp::Exp), &[x]);
    let y = op(&mut g, Op::Unary(UnaryOp::Tanh), &[e]);
    g.set_output("y", y).unwrap();
    let spent = qatc_ir::Deadline::within(std::time::Duration::ZERO);
    match qatc_passes::fusion::fuse_graph_within(&g, &FuseOptions::default(), &spent) {
        Err(qatc_passes::fusion::FusionError::Expired(e)) => assert!(e.stage.starts_with("fuse"), "{e}"),
        Err(e) => panic!("another error: {e}"),
        Ok(_) => panic!("fused past the deadline"),
    }
    assert!(qatc_passes::fusion::fuse_graph_within(&g, &FuseOptions::default(), &qatc_ir::Deadline::unlimited()).is_ok());
}
