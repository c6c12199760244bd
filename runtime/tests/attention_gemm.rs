//! `GemmAttention` (attention kernels as GEMMs over blocks of query rows) against the kernel-IR
//! evaluator's plain per-row attention, part by part, at sizes that do not fit the 64-row blocks
//! (T 70 and 131: a short last block) and on head views strided the way GPT-2's qkv slices are;
//! with the products by the gemm crate, and by oneDNN's f32 GEMM where it loads; and over bf16 and
//! f16 buffers (`LowerOptions::attention_reads_stored`), whose heads it stages through f32 rows.

use qatc_ir::DType;
use qatc_kernels::kir::{Attention, AttentionPart, Body, Kernel, Param, Ty};
use qatc_runtime::cpu::{GemmAttention, KirEval, Launcher};

const TOL: f64 = 1e-5;

#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    nh: usize,
    t: usize,
    hs: usize,
}

/// Deterministic values in [-1, 1).
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Buffers: 0 qkv [B, T, 3C] (q, k, v are column slices), 1 dout [B, NH, T, hs], 2 lse, 3 delta,
/// 4 o, 5 dq, 6 dk, 7 dv (the last four [B, NH, T, hs]).
fn buffers(d: &Dims) -> Vec<Vec<f32>> {
    let c = d.nh * d.hs;
    let head = d.b * d.nh * d.t * d.hs;
    vec![
        noise(d.b * d.t * 3 * c, 1),
        noise(head, 2),
        vec![0.0; d.b * d.nh * d.t],
        vec![0.0; d.b * d.nh * d.t],
        vec![0.0; head],
        vec![0.0; head],
        vec![0.0; head],
        vec![0.0; head],
    ]
}

/// The kernel of `part` and the buffers its params are, in param order; q, k, v, dout and the
/// results of type `half` (lse and delta f32).
fn kernel(d: &Dims, part: AttentionPart, half: DType) -> (Kernel, Vec<usize>) {
    let c = d.nh * d.hs;
    let qkv = [d.t * 3 * c, d.hs, 3 * c]; // (b, h, t) strides of a head slice of qkv
    let heads = [d.nh * d.t * d.hs, d.t * d.hs, d.hs];
    let bufs: &[usize] = match part {
        AttentionPart::Forward => &[0, 0, 0, 4, 2],
        AttentionPart::BackwardDelta => &[0, 0, 0, 1, 2, 3],
        AttentionPart::BackwardQ => &[0, 0, 0, 1, 2, 3, 5],
        AttentionPart::BackwardKV => &[0, 0, 0, 1, 2, 3, 6, 7],
        AttentionPart::Lse => &[0, 0, 2],
        AttentionPart::BackwardV => &[0, 0, 1, 2, 7],
        AttentionPart::Backward => &[0, 0, 0, 1, 2, 3, 5, 6, 7],
    };
    let writes: &[usize] = match part {
        AttentionPart::Forward => &[3, 4],
        AttentionPart::BackwardDelta => &[5],
        AttentionPart::BackwardQ => &[6],
        AttentionPart::BackwardKV => &[6, 7],
        AttentionPart::Lse => &[2],
        AttentionPart::BackwardV => &[4],
        AttentionPart::Backward => &[6, 7, 8],
    };
    let shapes = buffers(d).iter().map(Vec::len).collect::<Vec<_>>();
    let mut qkv_seen = 0;
    let (mut strides, mut offsets, mut params) = (Vec::new(), Vec::new(), Vec::new());
    for (i, &b) in bufs.iter().enumerate() {
        let (s, o) = match b {
            0 => {
                qkv_seen += 1;
                (qkv, (qkv_seen - 1) * c)
            }
            2 | 3 => ([0; 3], 0),
            _ => (heads, 0),
        };
        strides.push(s);
        offsets.push(o);
        let dtype = if matches!(b, 2 | 3) { DType::F32 } else { half };
        params.push(Param { name: format!("p{i}"), dtype, shape: vec![shapes[b]], write: writes.contains(&i) });
    }
    let a = Attention { b: d.b, nh: d.nh, t: d.t, hs: d.hs, scale: 1.0 / (d.hs as f64).sqrt(), strides, offsets, part, values: half };
    (
        Kernel {
            family: "attention".into(),
            params,
            index_ty: Ty::I32,
            body: Body::Attention(a),
            note: String::new(),
            names: Default::default(),
        },
        bufs.to_vec(),
    )
}

fn launch(l: &dyn Launcher, k: usize, mem: &mut [Vec<f32>], bufs: &[usize], d: &Dims, heads_per_call: usize) {
    let ptrs: Vec<*mut u8> = bufs.iter().map(|&b| mem[b].as_mut_ptr().cast::<u8>()).collect();
    let n = d.b * d.nh;
    let mut h = 0;
    while h < n {
        let e = (h + heads_per_call).min(n);
        // SAFETY: one pointer per param, each to a live Vec of the param's element count, not
        // touched by anything else during the call.
        unsafe { l.launch(k, &ptrs, h * d.t, e * d.t) }.expect("launch");
        h = e;
    }
}

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let m = b.iter().fold(0.0f64, |m, &x| m.max(f64::from(x).abs()));
    let e = a.iter().zip(b).fold(0.0f64, |e, (&x, &y)| e.max((f64::from(x) - f64::from(y)).abs()));
    e / m.max(1e-30)
}

/// Backward parts read the reference's lse and delta (buffers 2 and 3), so each part is checked
/// alone: `got` takes `want`'s, but for those `part` writes itself, zeroed.
fn reference_stats(part: AttentionPart, got: &mut [Vec<f32>], want: &[Vec<f32>]) {
    got[2] = want[2].clone();
    got[3] = want[3].clone();
    if matches!(part, AttentionPart::Forward | AttentionPart::Lse) {
        got[2].fill(0.0);
    }
    if part == AttentionPart::BackwardDelta {
        got[3].fill(0.0);
    }
}

fn check(d: Dims) {
    check_with(&d, None);
    match qatc_runtime::cpu::onednn::load(qatc_runtime::cpu::onednn::ONEDNN) {
        Some(lib) => check_with(&d, Some(lib)),
        None => eprintln!("SKIPPED the oneDNN products: the library or the CPU's bf16 units are missing"),
    }
}

fn check_with(d: &Dims, onednn: Option<std::sync::Arc<qatc_runtime::cpu::onednn::Bf16Gemm>>) {
    use AttentionPart::*;
    let d = *d;
    // the one-pass backward last: the parts before it leave dq, dk and dv to compare it with
    let parts = [Forward, Lse, BackwardDelta, BackwardQ, BackwardKV, BackwardV, Backward];
    let kernels: Vec<(Kernel, Vec<usize>)> = parts.iter().map(|&p| kernel(&d, p, DType::F32)).collect();
    let ks: Vec<Kernel> = kernels.iter().map(|k| k.0.clone()).collect();
    let (slow, fast) = (KirEval::new(&ks), GemmAttention::new(KirEval::new(&ks), &ks).with_onednn(onednn));
    let (mut want, mut got) = (buffers(&d), buffers(&d));
    for (i, part) in parts.iter().enumerate() {
        let separate = want[5..8].to_vec();
        launch(&slow, i, &mut want, &kernels[i].1, &d, 1);
        if *part == Backward {
            // the evaluator's one-pass backward is its dq, and its dk and dv, to the bit
            assert_eq!(&want[5..7], &separate[..2], "Backward's dq and dk are BackwardQ's and BackwardKV's");
            assert_eq!(want[7], separate[2], "Backward's dv is BackwardKV's");
        }
        reference_stats(*part, &mut got, &want);
        launch(&fast, i, &mut got, &kernels[i].1, &d, 2);
        for (p, &b) in kernels[i].1.iter().enumerate() {
            if kernels[i].0.params[p].write {
                let e = rel_err(&got[b], &want[b]);
                eprintln!("T {} {part:?}: param {p} within {e:.1e}", d.t);
                assert!(e <= TOL, "T {} {part:?}: param {p} differs by {e:e}", d.t);
                assert!(want[b].iter().any(|&x| x != 0.0), "{part:?} wrote something");
            }
        }
    }
}

#[test]
fn every_part_matches_the_evaluator_with_a_short_last_block() {
    check(Dims { b: 2, nh: 3, t: 70, hs: 8 });
}

#[test]
fn longer_rows_and_wider_heads() {
    check(Dims { b: 1, nh: 2, t: 131, hs: 32 });
}

#[test]
fn a_launch_that_is_not_whole_heads_is_an_error() {
    let d = Dims { b: 1, nh: 1, t: 10, hs: 4 };
    let (k, bufs) = kernel(&d, AttentionPart::Forward, DType::F32);
    let ks = [k];
    let fast = GemmAttention::new(KirEval::new(&ks), &ks);
    let mut mem = buffers(&d);
    let ptrs: Vec<*mut u8> = bufs.iter().map(|&b| mem[b].as_mut_ptr().cast::<u8>()).collect();
    // SAFETY: as in `launch`.
    let r = unsafe { fast.launch(0, &ptrs, 3, 10) };
    assert!(r.is_err_and(|e| e.to_string().contains("whole heads")));
}

/// A launcher that runs nothing: what `GemmAttention` passes on fails the test.
struct Refuse;

impl Launcher for Refuse {
    unsafe fn launch(&self, kernel: usize, _: &[*mut u8], _: usize, _: usize) -> Result<(), qatc_runtime::RuntimeError> {
        Err(qatc_runtime::RuntimeError::Kernel { kernel: format!("kernel {kernel}"), msg: "passed on, not run as GEMMs".into() })
    }
}

/// Buffers of `half` (bf16 or f16) as bits, two to an f32 slot, so that `launch` passes them as it
/// does f32 ones; lse and delta (2, 3) stay f32.
fn pack(mem: &[Vec<f32>], half: DType) -> Vec<Vec<f32>> {
    mem.iter()
        .enumerate()
        .map(|(i, v)| {
            if matches!(i, 2 | 3) {
                return v.clone();
            }
            let bits: Vec<u16> = v
                .iter()
                .map(|&x| if half == DType::BF16 { half::bf16::from_f32(x).to_bits() } else { half::f16::from_f32(x).to_bits() })
                .collect();
            bits.chunks(2).map(|c| f32::from_bits(u32::from(c[0]) | (u32::from(*c.get(1).unwrap_or(&0)) << 16))).collect()
        })
        .collect()
}

/// The first `n` elements of a packed buffer, widened.
fn unpack(v: &[f32], n: usize, half: DType) -> Vec<f32> {
    let bits = v.iter().flat_map(|x| {
        let u = x.to_bits();
        [u as u16, (u >> 16) as u16]
    });
    bits.take(n).map(|b| if half == DType::BF16 { half::bf16::from_bits(b).to_f32() } else { half::f16::from_bits(b).to_f32() }).collect()
}

/// Every part over 16-bit buffers: `GemmAttention`'s staged heads against the evaluator's loads
/// widened and stores rounded. The two sum in different orders, so a result may round to the
/// neighbouring 16-bit value: within one unit in the last place of the largest (bf16's 2^-8,
/// f16's 2^-11, of the buffer's largest magnitude).
fn check_16bit(d: Dims, half: DType) {
    check_16bit_with(d, half, None, 1.0);
}

/// [`check_16bit`] with the products by `lib` (oneDNN; on AMX, bf16 heads multiplied as stored)
/// within `ulps` units in the last place; lse and delta within 1e-5 either way.
fn check_16bit_with(d: Dims, half: DType, lib: Option<std::sync::Arc<qatc_runtime::cpu::onednn::Bf16Gemm>>, ulps: f64) {
    use AttentionPart::*;
    let parts = [Forward, Lse, BackwardDelta, BackwardQ, BackwardKV, BackwardV, Backward];
    let kernels: Vec<(Kernel, Vec<usize>)> = parts.iter().map(|&p| kernel(&d, p, half)).collect();
    let ks: Vec<Kernel> = kernels.iter().map(|k| k.0.clone()).collect();
    // nothing passed on: every part must run as GEMMs over the staged rows
    let on_amx = half == DType::BF16 && lib.as_ref().is_some_and(|l| l.on_amx());
    let (slow, fast) = (KirEval::new(&ks), GemmAttention::new(Refuse, &ks).with_onednn(lib));
    let lens: Vec<usize> = buffers(&d).iter().map(Vec::len).collect();
    let (mut want, mut got) = (pack(&buffers(&d), half), pack(&buffers(&d), half));
    let ulp = if half == DType::BF16 { 2f64.powi(-8) } else { 2f64.powi(-11) };
    let what = if on_amx { "on AMX" } else { "staged" };
    for (i, part) in parts.iter().enumerate() {
        assert_eq!(fast.on_amx(i), on_amx, "{half} {part:?}: multiplied on AMX");
        launch(&slow, i, &mut want, &kernels[i].1, &d, 1);
        reference_stats(*part, &mut got, &want);
        launch(&fast, i, &mut got, &kernels[i].1, &d, 2);
        for (p, &b) in kernels[i].1.iter().enumerate() {
            if kernels[i].0.params[p].write {
                let stat = matches!(b, 2 | 3);
                let (g, w) = if stat {
                    (got[b].clone(), want[b].clone())
                } else {
                    (unpack(&got[b], lens[b], half), unpack(&want[b], lens[b], half))
                };
                let e = rel_err(&g, &w);
                let tol = if stat { TOL } else { ulps * ulp };
                eprintln!("{half} {what} T {} hs {} {part:?}: param {p} within {e:.1e}", d.t, d.hs);
                assert!(e <= tol, "{half} {what} T {} {part:?}: param {p} differs by {e:e}", d.t);
                assert!(w.iter().any(|&x| x != 0.0), "{part:?} wrote something");
            }
        }
    }
}

#[test]
fn sixteen_bit_buffers_are_staged_through_f32_rows() {
    for half in [DType::BF16, DType::F16] {
        check_16bit(Dims { b: 2, nh: 3, t: 70, hs: 8 }, half);
        check_16bit(Dims { b: 1, nh: 2, t: 131, hs: 32 }, half);
    }
}

/// On a CPU with AMX-BF16, attention over bf16 buffers multiplies on the tile units over the
/// stored operands (`attn_products.rs`), P and dS rounded to bf16 for the products that take
/// them: every part within two bf16 units in the last place of the result's largest magnitude
/// of the evaluator's f32 math (the f32-staged path keeps one), lse and delta within 1e-5 (they
/// come from f32 scores); f16 buffers keep the f32-staged path. Elsewhere there is nothing to
/// check.
#[test]
fn bf16_heads_multiply_on_amx_within_two_ulp() {
    let Some(lib) = qatc_runtime::cpu::onednn::load(qatc_runtime::cpu::onednn::ONEDNN).filter(|l| l.on_amx()) else {
        eprintln!("SKIPPED: no AMX-BF16 (or no oneDNN)");
        return;
    };
    for d in [Dims { b: 2, nh: 3, t: 70, hs: 8 }, Dims { b: 1, nh: 2, t: 131, hs: 32 }, Dims { b: 1, nh: 2, t: 256, hs: 64 }] {
        check_16bit_with(d, DType::BF16, Some(lib.clone()), 2.0);
        check_16bit_with(d, DType::F16, Some(lib.clone()), 1.0);
    }
}
