//! Hand-made programs of the causal attention kernels, every part of them (the forward, and the
//! backward's lse, delta, dq, dk/dv and dv), over operands whose values are 16-bit: what the CUDA
//! writer emits as the tensor-core attention (`qatc_attention_mma.cuh`) where hs is 32, 48 or 64.
//! q, k and v are head views into one [B, T, 3C] buffer and dout, out and dq views of [B, T, C]
//! ones, as the GPT-2 lowering has them; dk and dv are [B, NH, T, hs]. The views hold f32 (the
//! widened copies of the CPU's lowering) or, `stored`, the 16-bit values themselves (CUDA's,
//! `LowerOptions::attention_reads_stored`), the results written in 16 bits too but for the dk/dv
//! kernel's dv, f32 scratch there; lse and delta are f32 either way.

use qatc_kernels::kir::{Attention, AttentionPart, Body, Ty};

use super::*;

/// One attention's sizes.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub b: usize,
    pub nh: usize,
    pub t: usize,
    pub hs: usize,
}

// The buffers, by index.
const QKV: usize = 0;
const DOUT: usize = 1;
const OUT: usize = 2;
const LSE: usize = 3;
const LSE2: usize = 4;
const DELTA: usize = 5;
const DQ: usize = 6;
const DK: usize = 7;
const DV: usize = 8;
const DV2: usize = 9;

/// The six parts in the order a step runs them (the forward's lse and the delta feed the later
/// ones), each as (part, its params' buffers and names; where a view starts in its buffer).
fn parts() -> Vec<(AttentionPart, Vec<(usize, &'static str)>)> {
    use AttentionPart::*;
    let (q, k, v, dout) = ((QKV, "q"), (QKV, "k"), (QKV, "v"), (DOUT, "dout"));
    vec![
        (Forward, vec![q, k, v, (OUT, "out"), (LSE, "lse")]),
        (Lse, vec![q, k, (LSE2, "lse")]),
        (BackwardDelta, vec![q, k, v, dout, (LSE, "lse"), (DELTA, "delta")]),
        (BackwardQ, vec![q, k, v, dout, (LSE, "lse"), (DELTA, "delta"), (DQ, "dq")]),
        (BackwardKV, vec![q, k, v, dout, (LSE, "lse"), (DELTA, "delta"), (DK, "dk"), (DV, "dv")]),
        (BackwardV, vec![q, k, dout, (LSE, "lse"), (DV2, "dv")]),
    ]
}

/// The attention kernels of `d` over values of type `values`, each launched once: their views f32
/// buffers (as the lowering widens them) or, `stored`, buffers of `values`.
pub fn program(d: Dims, values: DType, stored: bool) -> Program {
    let Dims { b, nh, t, hs } = d;
    let c = nh * hs;
    let heads = [b, nh, t, hs];
    let buffers: Vec<Buffer> = [
        ("qkv", vec![b, t, 3 * c]),
        ("dout", vec![b, t, c]),
        ("out", vec![b, t, c]),
        ("lse", vec![b, nh, t]),
        ("lse2", vec![b, nh, t]),
        ("delta", vec![b, nh, t]),
        ("dq", vec![b, t, c]),
        ("dk", heads.to_vec()),
        ("dv", heads.to_vec()),
        ("dv2", heads.to_vec()),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (name, shape))| {
        let sixteen = stored && ![LSE, LSE2, DELTA, DV].contains(&i);
        Buffer::new(name, if sixteen { values } else { DType::F32 }, &shape, BufKind::Temp)
    })
    .collect();
    // (offset, strides of b, h, t) of a param's view; lse and delta are plain [B*NH, T] rows
    let view = |buf: usize, name: &str| -> (usize, [usize; 3]) {
        match (buf, name) {
            (QKV, "q") => (0, [t * 3 * c, hs, 3 * c]),
            (QKV, "k") => (c, [t * 3 * c, hs, 3 * c]),
            (QKV, "v") => (2 * c, [t * 3 * c, hs, 3 * c]),
            (DOUT | OUT | DQ, _) => (0, [t * c, hs, c]),
            (DK | DV | DV2, _) => (0, [nh * t * hs, t * hs, hs]),
            _ => (0, [0; 3]),
        }
    };
    let mut kernels = Vec::new();
    let mut steps = Vec::new();
    for (part, ps) in parts() {
        let roles = part.roles();
        let params: Vec<Param> = ps
            .iter()
            .enumerate()
            .map(|(i, &(buf, name))| {
                let write = roles.out.contains(&Some(i))
                    || (i == roles.lse && part.writes_lse())
                    || (Some(i) == roles.delta && part.writes_delta());
                Param { name: name.into(), dtype: buffers[buf].dtype, shape: buffers[buf].shape.clone(), write }
            })
            .collect();
        let (offsets, strides) = ps.iter().map(|&(buf, name)| view(buf, name)).unzip();
        let scale = 1.0 / (hs as f64).sqrt();
        let att = Attention { b, nh, t, hs, scale, strides, offsets, part, values };
        steps.push(Step::Launch { kernel: kernels.len(), args: ps.iter().map(|p| p.0).collect(), note: format!("{part:?}") });
        kernels.push(Kernel {
            family: "attention_flash".into(),
            params,
            index_ty: Ty::I32,
            body: Body::Attention(att),
            note: format!("hand-made causal attention {part:?}, B {b} NH {nh} T {t} hs {hs}, {values} values"),
            names: Default::default(),
        });
    }
    Program { buffers, kernels, steps, ..Default::default() }
}

/// The first bytes of a buffer of [`program`]: q, k, v and dout pseudo-random and exactly
/// representable in `values` (as the lowering's widened copies are), in the buffer's type; the
/// rest zero. q and k in
/// [-2, 2) make scale q.k spread over a few units (a softmax neither flat nor one-hot); dout in
/// [-1, 1).
pub fn init(b: &Buffer, values: DType) -> Option<Vec<u8>> {
    let range = match b.name.as_str() {
        "qkv" => 4.0,
        "dout" => 2.0,
        _ => return Some(vec![0; b.bytes()]),
    };
    let seed: u32 = b.name.bytes().map(u32::from).sum();
    let round = |x: f32| match values {
        DType::BF16 => half::bf16::from_f32(x).to_f32(),
        DType::F16 => half::f16::from_f32(x).to_f32(),
        _ => x,
    };
    let v: Vec<f32> = (0..b.numel() as u32)
        .map(|i| {
            let h = i.wrapping_mul(2654435761).wrapping_add(seed.wrapping_mul(40503)).rotate_left(13).wrapping_mul(2246822519);
            round(((h >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * range)
        })
        .collect();
    Some(match b.dtype {
        DType::BF16 => v.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect(),
        DType::F16 => v.iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect(),
        _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    })
}

/// The attention kernels over 16-bit params (`program`'s `stored`: q, k, v strided views into one
/// [B, T, 3C] bf16 or f16 buffer, dout, out, dq, dk and the dv of the dv kernel 16-bit, the dk/dv
/// kernel's dv f32), as CUDA's lowering hands them over: the tensor-core templates (the shim's
/// sm_80 branch) and the fp32 general template (`CudaSettings::GENERAL`), every part, against the
/// evaluator (which loads them widened and rounds its stores, as the templates' element types
/// do). Tolerances as `the_tensor_core_attention`'s (norm-wise for the mma's rounded results) and,
/// for the general template, a 16-bit result's own (a rounding apart at most: the f32 sums in
/// another order). Each kernel's text is checked to read the params in their types.
#[test]
fn the_attention_over_16bit_params() {
    let Some(cxx) = Cxx::find(qatc_kernels::cuda::headers()) else { return };
    let shapes = [Dims { b: 2, nh: 2, t: 100, hs: 64 }, Dims { b: 1, nh: 3, t: 77, hs: 32 }];
    for values in [DType::BF16, DType::F16] {
        let tag = if values == DType::BF16 { "qatc::ElemBf16" } else { "qatc::ElemF16" };
        for d in shapes {
            let prog = program(d, values, true);
            for (codegen, how) in [(CudaSettings::default(), "tensor cores"), (CudaSettings::GENERAL, "general template")] {
                let mma = codegen.allows(qatc_kernels::cuda::Variant::TensorCoreAttention);
                for k in &prog.kernels {
                    let source = qatc_kernels::cuda::emit_with(k, &codegen).expect("emits").source;
                    assert_eq!(source.contains("_mma<"), mma, "{} ({how}):\n{source}", k.note);
                    assert!(source.contains(&format!("qatc::AttnElems<{tag}, {tag}")), "{} ({how}): q, k in 16 bits:\n{source}", k.note);
                }
                let what = format!("attention over {values} params ({how}), B {} NH {} T {} hs {}", d.b, d.nh, d.t, d.hs);
                let init = |b: &Buffer| init(b, values);
                let (run, _, checks) = check_program_with(&cxx, &what, &prog, &init, Instant::now(), Duration::ZERO, codegen);
                assert_eq!(run, prog.kernels.len(), "{what}: every part runs");
                for k in prog.kernels.iter().filter(|_| mma) {
                    let Body::Attention(a) = &k.body else { unreachable!("attention kernels only") };
                    let checked = checks.iter().filter(|m| m.part == a.part && m.mma > 0).count();
                    assert!(checked > 0, "{what}: {:?} was compared with its mma emulated", a.part);
                }
            }
        }
    }
}
