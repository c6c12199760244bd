//! exp over a slice, vectorized: the attention softmax (`attn_gemm.rs`) takes one exp per score,
//! and libm's scalar `expf` (2.7 ns here) cost as much as the score GEMMs. This is Cephes' expf
//! (as `kernels/src/llvm/math.rs` emits it for generated kernels), written so that the compiler
//! vectorizes it, compiled once for AVX2 + FMA (picked at run time) and once for the baseline.
//! Relative error about 2 ulp; arguments below -87.3 give exp(-87.3) (~1e-38), not 0.

use qatc_kernels::cephes::{LN2_HI as C1, LN2_LO as C2, POLY as P};

const LOG2E: f32 = std::f32::consts::LOG2_E;

#[inline(always)]
#[allow(clippy::manual_clamp)] // on purpose: see below
fn exp1(x: f32) -> f32 {
    // max and min, not `clamp`, and the conversion below unchecked: `clamp`'s NaN rule and the
    // saturating `as` kept the loop scalar (compares, cmov and inserts per element: a fifth of
    // the attention's time on AMX went here); a NaN argument is given back at the end instead
    let xc = x.max(-87.3).min(88.7);
    let fx = (xc * LOG2E + 0.5).floor();
    let r = xc - fx * C1 - fx * C2;
    let mut y = P[0];
    for &c in &P[1..] {
        y = y * r + c;
    }
    let y = y * r * r + r + 1.0;
    // 2^fx through the exponent bits: fx is an integer in [-126, 128] after the clamp
    // SAFETY: fx is finite and within i32's range.
    let n = unsafe { fx.to_int_unchecked::<i32>() };
    let y = y * f32::from_bits(((n + 127) << 23) as u32);
    if x.is_nan() {
        x
    } else {
        y
    }
}

#[inline(always)]
fn exp_shift_sum_body(x: &mut [f32], shift: f32) -> f32 {
    for v in x.iter_mut() {
        *v = exp1(*v - shift);
    }
    // eight running sums: a single one is a chain of dependent adds the compiler may not reorder
    let mut acc = [0.0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    chunks.remainder().iter().sum::<f32>() + acc.iter().sum::<f32>()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn exp_shift_sum_avx2(x: &mut [f32], shift: f32) -> f32 {
    exp_shift_sum_body(x, shift)
}

/// x[i] = exp(x[i] - shift) for every i; returns their sum.
pub fn exp_shift_sum(x: &mut [f32], shift: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has the features the function was compiled for.
        return unsafe { exp_shift_sum_avx2(x, shift) };
    }
    exp_shift_sum_body(x, shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agrees_with_libm_within_a_few_ulp() {
        let xs: Vec<f32> = (0..20_000).map(|i| -87.0 + i as f32 * 0.00485).collect();
        let mut got = xs.clone();
        let sum = exp_shift_sum(&mut got, 0.0);
        let mut want_sum = 0.0f32;
        for (&x, &g) in xs.iter().zip(&got) {
            let w = x.exp();
            want_sum += w;
            assert!(((g - w) / w).abs() < 3e-7, "exp({x}) = {g}, libm {w}");
        }
        assert!(((sum - want_sum) / want_sum).abs() < 1e-5);
        let mut tiny = [-1000.0f32, 0.0, f32::NEG_INFINITY];
        exp_shift_sum(&mut tiny, 0.0);
        assert!(tiny[0] < 1e-37 && tiny[0] >= 0.0 && tiny[1] == 1.0 && tiny[2] < 1e-37 && tiny[2] >= 0.0);
        let mut nan = [f32::NAN, 0.0];
        assert!(exp_shift_sum(&mut nan, 0.0).is_nan() && nan[0].is_nan() && nan[1] == 1.0, "NaN stays NaN");
    }
}
