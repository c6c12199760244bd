//! Small graphs for the kernel tests: each a fused `Op::Kernel` node (as egg fusion makes them)
//! or a few plain ops.
#![allow(dead_code)]

use qatc_ir::{BinaryOp, DType, Epilogue, GemmFamily, GemmPrologue, Graph, InputKind, KernelFamily, NodeId, Op, UnaryOp};

/// `gemm.dequant.bias`: a 4-bit weight's GEMM with a bias epilogue.
pub fn dequant_bias() -> KernelFamily {
    KernelFamily::Gemm(GemmFamily { epilogues: vec![Epilogue::Bias], ..GemmFamily::with_prologue(GemmPrologue::Dequant) })
}

/// Wraps `build(body, inputs)` as one `Op::Kernel { family }` node over inputs of `tys`.
pub fn fused(family: KernelFamily, tys: &[(DType, Vec<usize>)], build: impl FnOnce(&mut Graph, &[NodeId]) -> NodeId) -> Graph {
    let mut body = Graph::new(family.to_string());
    let ins: Vec<NodeId> =
        tys.iter().enumerate().map(|(i, (d, s))| body.input(format!("in{i}"), InputKind::Data, *d, s.clone()).unwrap()).collect();
    let out = build(&mut body, &ins);
    body.set_output("out", out).unwrap();
    let mut g = Graph::new("step");
    let outer: Vec<NodeId> =
        tys.iter().enumerate().map(|(i, (d, s))| g.input(format!("x{i}"), InputKind::Data, *d, s.clone()).unwrap()).collect();
    let k = g.add(Op::Kernel { family, body: Box::new(body) }, &outer).unwrap();
    g.set_output("y", k).unwrap();
    g
}

pub fn f32s(shape: &[usize]) -> (DType, Vec<usize>) {
    (DType::F32, shape.to_vec())
}

/// x + broadcast(bias) -> gelu -> * 2: the MLP's elementwise chain after c_fc.
pub fn elementwise_chain() -> Graph {
    fused(KernelFamily::Pointwise, &[f32s(&[8, 512]), f32s(&[512])], |b, i| {
        let bias = b.add(Op::Broadcast { shape: [8, 512].into() }, &[i[1]]).unwrap();
        let s = b.add(Op::Binary(BinaryOp::Add), &[i[0], bias]).unwrap();
        let g = b.add(Op::Unary(UnaryOp::Gelu), &[s]).unwrap();
        b.add(Op::Affine { mul: 2.0, add: 0.0 }, &[g]).unwrap()
    })
}

/// residual add -> layernorm: the prologue is read inside the row kernel.
pub fn residual_layernorm() -> Graph {
    fused(
        KernelFamily::LayerNorm { residual: false, aux: false },
        &[f32s(&[8, 768]), f32s(&[8, 768]), f32s(&[768]), f32s(&[768])],
        |b, i| {
            let r = b.add(Op::Binary(BinaryOp::Add), &[i[0], i[1]]).unwrap();
            b.add(Op::LayerNorm { eps: 1e-5 }, &[r, i[2], i[3]]).unwrap()
        },
    )
}

/// causal softmax over [B, NH, T, T] scores.
pub fn causal_softmax() -> Graph {
    fused(KernelFamily::Softmax, &[f32s(&[1, 4, 64, 64])], |b, i| b.add(Op::Softmax { scale: 0.125, causal: true }, &[i[0]]).unwrap())
}

/// q, k, v sliced out of qkv [T, 3C] by shape ops, then softmax(q k^T) v.
pub fn attention() -> Graph {
    attention_of(DType::F32, 64, 4, 32)
}

/// `attention()` over a qkv of `dtype` (f16/bf16: `--precision`'s compute types), T `t`, `nh`
/// heads of `hs`.
pub fn attention_of(dtype: DType, t: usize, nh: usize, hs: usize) -> Graph {
    let c = nh * hs;
    fused(KernelFamily::AttentionFlash, &[(dtype, vec![t, 3 * c])], |b, i| {
        let head = |b: &mut Graph, k: usize| {
            let s = b.add(Op::Slice { axis: 1, start: k * c, end: (k + 1) * c }, &[i[0]]).unwrap();
            let r = b.add(Op::Reshape { shape: [1, t, nh, hs].into() }, &[s]).unwrap();
            b.add(Op::Transpose { perm: vec![0, 2, 1, 3] }, &[r]).unwrap()
        };
        let (q, k, v) = (head(b, 0), head(b, 1), head(b, 2));
        let s = b.add(Op::MatMul { ta: false, tb: true }, &[q, k]).unwrap();
        let p = b.add(Op::Softmax { scale: 1.0 / (hs as f64).sqrt(), causal: true }, &[s]).unwrap();
        b.add(Op::MatMul { ta: false, tb: false }, &[p, v]).unwrap()
    })
}

/// AdamW: m' and v' inline into the parameter update (p, g, m, v, lr, step).
pub fn adamw() -> Graph {
    let w = vec![384, 4];
    let tys = [f32s(&w), f32s(&w), f32s(&w), f32s(&w), (DType::F32, vec![]), (DType::F32, vec![])];
    fused(KernelFamily::AdamWMultiTensor, &tys, |b, i| {
        let m = b.add(Op::AdamM { beta1: 0.9 }, &[i[2], i[1]]).unwrap();
        let v = b.add(Op::AdamV { beta2: 0.999 }, &[i[3], i[1]]).unwrap();
        b.add(Op::AdamParam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }, &[i[0], m, v, i[4], i[5]]).unwrap()
    })
}

/// x @ dequantize(codes, scales) + bias: a dequant prologue and a bias epilogue.
pub fn dequant_gemm() -> Graph {
    use qatc_ir::{QuantScheme, QuantSpec};
    let spec = QuantSpec { bits: 4, group: 64, scheme: QuantScheme::Sym };
    let tys = [f32s(&[8, 128]), (DType::I4, vec![128, 384]), f32s(&[2, 384]), f32s(&[384])];
    fused(dequant_bias(), &tys, |b, i| {
        let w = b.add(Op::Dequantize { spec, to: qatc_ir::DType::F32 }, &[i[1], i[2]]).unwrap();
        let y = b.add(Op::MatMul { ta: false, tb: false }, &[i[0], w]).unwrap();
        let bias = b.add(Op::Broadcast { shape: [8, 384].into() }, &[i[3]]).unwrap();
        b.add(Op::Binary(BinaryOp::Add), &[y, bias]).unwrap()
    })
}

/// The attention backward as egg fusion makes it: dk and dq of one head-split qkv, concatenated
/// into one flat result (P and dS are recomputed inside, never stored).
pub fn attention_backward() -> Graph {
    attention_backward_of(DType::F32, 64, 4, 32)
}

/// `attention_backward()` over a qkv and dout of `dtype`, T `t`, `nh` heads of `hs`.
pub fn attention_backward_of(dtype: DType, t: usize, nh: usize, hs: usize) -> Graph {
    let c = nh * hs;
    let scale = 1.0 / (hs as f64).sqrt();
    fused(KernelFamily::AttentionBwdFlash, &[(dtype, vec![t, 3 * c]), (dtype, vec![1, t, nh, hs])], |b, i| {
        let head = |b: &mut Graph, k: usize| {
            let s = b.add(Op::Slice { axis: 1, start: k * c, end: (k + 1) * c }, &[i[0]]).unwrap();
            let r = b.add(Op::Reshape { shape: [1, t, nh, hs].into() }, &[s]).unwrap();
            b.add(Op::Transpose { perm: vec![0, 2, 1, 3] }, &[r]).unwrap()
        };
        let (q, k, v) = (head(b, 0), head(b, 1), head(b, 2));
        let s = b.add(Op::MatMul { ta: false, tb: true }, &[q, k]).unwrap();
        let p = b.add(Op::Softmax { scale, causal: true }, &[s]).unwrap();
        let dout = b.add(Op::Transpose { perm: vec![0, 2, 1, 3] }, &[i[1]]).unwrap();
        let dp = b.add(Op::MatMul { ta: false, tb: true }, &[dout, v]).unwrap();
        let ds = b.add(Op::SoftmaxGrad { scale }, &[p, dp]).unwrap();
        let dk = b.add(Op::MatMul { ta: true, tb: false }, &[ds, q]).unwrap();
        let dq = b.add(Op::MatMul { ta: false, tb: false }, &[ds, k]).unwrap();
        let n = t * c;
        let dk = b.add(Op::Reshape { shape: [n].into() }, &[dk]).unwrap();
        let dq = b.add(Op::Reshape { shape: [n].into() }, &[dq]).unwrap();
        b.add(Op::Concat { axis: 0 }, &[dk, dq]).unwrap()
    })
}

/// dv = P^T dout alone (as the step's fusion leaves it beside dq and dk): the row log-sum-exp,
/// then dv.
pub fn attention_dv_of(dtype: DType, t: usize, nh: usize, hs: usize) -> Graph {
    let c = nh * hs;
    fused(KernelFamily::AttentionFlash, &[(dtype, vec![t, 3 * c]), (dtype, vec![1, t, nh, hs])], |b, i| {
        let head = |b: &mut Graph, k: usize| {
            let s = b.add(Op::Slice { axis: 1, start: k * c, end: (k + 1) * c }, &[i[0]]).unwrap();
            let r = b.add(Op::Reshape { shape: [1, t, nh, hs].into() }, &[s]).unwrap();
            b.add(Op::Transpose { perm: vec![0, 2, 1, 3] }, &[r]).unwrap()
        };
        let (q, k) = (head(b, 0), head(b, 1));
        let s = b.add(Op::MatMul { ta: false, tb: true }, &[q, k]).unwrap();
        let p = b.add(Op::Softmax { scale: 1.0 / (hs as f64).sqrt(), causal: true }, &[s]).unwrap();
        let dout = b.add(Op::Transpose { perm: vec![0, 2, 1, 3] }, &[i[1]]).unwrap();
        b.add(Op::MatMul { ta: true, tb: false }, &[p, dout]).unwrap()
    })
}

/// 8-bit AdamW's first moment, unfused: dequantize the codes (5000 elements: blocks of 2048,
/// 2048 and 904), update it, take each block's new absmax, requantize.
pub fn adamw8bit_moment() -> Graph {
    use qatc_ir::DynMap;
    let mut g = Graph::new("adamw8bit");
    let codes = g.input("adam.m8:w", InputKind::State, DType::U8, qatc_ir::Shape::new([5000])).unwrap();
    let absmax = g.input("adam.m8.absmax:w", InputKind::State, DType::F32, qatc_ir::Shape::new([3])).unwrap();
    let grad = g.input("grad", InputKind::Data, DType::F32, qatc_ir::Shape::new([5000])).unwrap();
    let m = g.add(Op::BlockDequant { map: DynMap::Signed }, &[codes, absmax]).unwrap();
    let m1 = g.add(Op::AdamM { beta1: 0.9 }, &[m, grad]).unwrap();
    let a = g.add(Op::BlockAbsMax, &[m1]).unwrap();
    let c = g.add(Op::BlockQuant { map: DynMap::Signed }, &[m1, a]).unwrap();
    g.set_update("adam.m8:w", c).unwrap();
    g.set_update("adam.m8.absmax:w", a).unwrap();
    g
}
