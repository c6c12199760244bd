//! Learned quantization scales (LSQ, Esser et al., "Learned Step Size Quantization", 2020):
//! `Op::FakeQuantLearned` and its gradient `Op::FakeQuantLearnedGrad`, the one implementation. The
//! kernels' lowering (`kernels/src/lower/inline.rs`) writes the same arithmetic, and
//! `quantize_learned` stores the result as codes that `dequantize` turns back into it bit for bit.
//!
//! Per element, with the group's scale and zero point (asym only):
//!
//!   s = fp16(scale)                     the scale as deployment formats store it
//!   z = clamp(round(zero), 0, max_code) an integer zero point (0 unless asym)
//!   x = w / s;  [lo, hi] = Grid::range(z)
//!   q = clamp(round(x), lo, hi)         (nf4: the nearest NF4 code of x, which saturates at +-1)
//!   w' = q s
//!
//! The gradient is LSQ's (the paper's clamp-then-round form): rounding passes gradients straight
//! through and the clamp stops them, so with `inside` = lo <= x <= hi,
//!
//!   dw = dy inside,   ds = dy (q - x) inside or dy q outside,   dz = -s dy outside (asym).
//!
//! The fp16 rounding of the scale and of the zero point pass gradients straight through. The
//! autodiff rule sums ds and dz over each group and scales them by 1/sqrt(G Q_P). A scale whose
//! fp16 value is 0 (an all-zero group) gives 0 and no gradient. Arithmetic is in the interpreter's
//! float type: f32 as device code, f64 for the gradient checks.

use half::f16;
use qatc_ir::{Points, QuantParam, QuantSpec, ScaleRule};

use super::{table_nearest, Quantized};
use crate::float::Float;

/// One element of a learned fake-quant.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Point<T> {
    /// The scale as used: its fp16 value.
    pub s: T,
    /// w / s (0 when s is 0).
    pub x: T,
    /// The grid point in units of s (q - z for asym): w' = q s.
    pub q: T,
    /// x lies within the grid's range.
    pub inside: bool,
    /// The stored code (`quant::dequant_one` reads it back).
    pub code: u8,
}

impl<T: Float> Point<T> {
    /// The fake-quantized value, q s.
    pub fn value(&self) -> T {
        self.q * self.s
    }
}

fn clamp<T: Float>(x: T, lo: T, hi: T) -> T {
    if x < lo {
        lo
    } else if x > hi {
        hi
    } else {
        x
    }
}

/// The zero point as used: rounded half to even into [0, max_code]; 0 for the schemes without one.
pub fn zero_point<T: Float>(spec: QuantSpec, zero: T) -> T {
    if spec.scheme.has_zero_point() {
        clamp(zero.round_ties_even(), T::ZERO, T::from_f64(f64::from(spec.grid().max_code)))
    } else {
        T::ZERO
    }
}

/// The code of grid point `q` (in units of the scale) for zero point `z`.
fn code_of(spec: QuantSpec, q: f64, z: f64) -> u8 {
    let c = match spec.grid().points {
        Points::Offset(o) => q + f64::from(o),
        Points::ZeroPoint => q + z,
        Points::Table(t) => return table_nearest(t, q as f32),
    };
    c as u8
}

/// Element `w` of a group with scale `scale` and zero point `zero` (ignored unless asym).
pub fn point<T: Float>(spec: QuantSpec, w: T, scale: T, zero: T) -> Point<T> {
    let s = scale.round_f16();
    let z = zero_point(spec, zero);
    if s == T::ZERO {
        return Point { s, x: T::ZERO, q: T::ZERO, inside: false, code: code_of(spec, 0.0, z.to_f64()) };
    }
    let grid = spec.grid();
    let (lo, hi) = grid.range(z.to_f64());
    let (lo, hi) = (T::from_f64(lo), T::from_f64(hi));
    let x = w / s;
    let inside = lo <= x && x <= hi;
    if let Points::Table(t) = grid.points {
        let code = table_nearest(t, x);
        return Point { s, x, q: T::from_f64(t[code as usize] as f64), inside, code };
    }
    let q = clamp(x.round_ties_even(), lo, hi);
    Point { s, x, q, inside, code: code_of(spec, q.to_f64(), z.to_f64()) }
}

/// Visits every element (i, j) of w [n_in, n_out] with its group's scale and zero point.
fn each<T: Float, R>(
    spec: QuantSpec,
    n_in: usize,
    n_out: usize,
    w: &[T],
    scales: &[T],
    zeros: &[T],
    mut f: impl FnMut(usize, Point<T>) -> R,
) -> Vec<R> {
    let gsz = spec.group_for(n_in);
    let mut out = Vec::with_capacity(n_in * n_out);
    for i in 0..n_in {
        for j in 0..n_out {
            let si = (i / gsz) * n_out + j;
            let z = zeros.get(si).copied().unwrap_or(T::ZERO);
            let e = i * n_out + j;
            out.push(f(e, point(spec, w[e], scales[si], z)));
        }
    }
    out
}

/// FakeQuantLearned's forward: w [n_in, n_out] on the grid of `scales` (and `zeros`, asym),
/// each [n_in / G, n_out].
pub fn fake_quant_learned<T: Float>(spec: QuantSpec, n_in: usize, n_out: usize, w: &[T], scales: &[T], zeros: &[T]) -> Vec<T> {
    each(spec, n_in, n_out, w, scales, zeros, |_, p| p.value())
}

/// FakeQuantLearnedGrad: the per-element part of the gradient with respect to `wrt`.
#[allow(clippy::too_many_arguments)]
pub fn fake_quant_learned_grad<T: Float>(
    spec: QuantSpec,
    wrt: QuantParam,
    n_in: usize,
    n_out: usize,
    w: &[T],
    scales: &[T],
    zeros: &[T],
    dy: &[T],
) -> Vec<T> {
    each(spec, n_in, n_out, w, scales, zeros, |e, p| {
        let d = dy[e];
        match wrt {
            QuantParam::Weight if p.inside => d,
            QuantParam::Weight => T::ZERO,
            QuantParam::Scale => d * if p.inside { p.q - p.x } else { p.q },
            QuantParam::Zero if p.inside => T::ZERO,
            QuantParam::Zero => -(p.s * d),
        }
    })
}

/// The learned fake-quant as storage: codes, the fp16 scales (held in f32) and the rounded zero
/// points, so that `quant::dequantize` gives `fake_quant_learned` bit for bit.
pub fn quantize_learned(w: &[f32], n_in: usize, n_out: usize, spec: QuantSpec, scales: &[f32], zeros: &[f32]) -> Quantized {
    let codes = each(spec, n_in, n_out, w, scales, zeros, |_, p| p.code);
    Quantized {
        spec,
        n_in,
        n_out,
        codes,
        scales: scales.iter().map(|s| s.round_f16()).collect(),
        zeros: if spec.scheme.has_zero_point() { zeros.iter().map(|&z| zero_point(spec, z)).collect() } else { Vec::new() },
    }
}

/// The nearest fp16 value of `v` at least as far from zero, so that a min-max scale rounded to
/// fp16 still covers its group (nothing is clipped at the start of training).
fn f16_away_from_zero(v: f32) -> f32 {
    let h = f16::from_f32(v);
    if h.is_finite() && h.to_f32().abs() < v.abs() {
        f16::from_bits(h.to_bits() + 1).to_f32()
    } else {
        h.to_f32()
    }
}

/// The initial scales (and zero points) of a weight: its min-max quantization (`QuantScheme`),
/// each scale rounded to fp16 away from zero, the zero points recomputed for the rounded scales.
pub fn init_learned(w: &[f32], n_in: usize, n_out: usize, spec: QuantSpec) -> (Vec<f32>, Vec<f32>) {
    let gsz = spec.group_for(n_in);
    let groups = n_in / gsz;
    let grid = spec.grid();
    let (divisor, top) = (grid.scale_divisor() as f32, grid.max_code as f32);
    let (mut scales, mut zeros) = (vec![0f32; groups * n_out], Vec::new());
    if spec.scheme.has_zero_point() {
        zeros = vec![0f32; groups * n_out];
    }
    for g in 0..groups {
        for j in 0..n_out {
            let col = (0..gsz).map(|r| w[(g * gsz + r) * n_out + j]);
            let si = g * n_out + j;
            scales[si] = f16_away_from_zero(match grid.scale {
                ScaleRule::AbsMax => col.fold(0f32, |m, v| m.max(v.abs())) / divisor,
                // llama.cpp's d = m / -8, m the first element of largest magnitude, sign kept
                ScaleRule::SignedMax => col.fold(0f32, |m, v| if v.abs() > m.abs() { v } else { m }) / divisor,
                ScaleRule::MinMax => {
                    let (lo, hi) = col.fold((0f32, 0f32), |(lo, hi), v| (lo.min(v), hi.max(v)));
                    let s = f16_away_from_zero((hi - lo) / divisor);
                    zeros[si] = if s == 0.0 { 0.0 } else { (-lo / s).round_ties_even().clamp(0.0, top) };
                    s
                }
            });
        }
    }
    (scales, zeros)
}

/// The fractions of the min-max scale `init_learned_searched` tries: 1 down to 0.3 in steps of
/// 0.02.
pub(super) fn search_fractions() -> impl Iterator<Item = f32> {
    (0..36).map(|k| 1.0 - 0.02 * k as f32)
}

/// Initial scales by search: each group's min-max scale (`init_learned`) times the fraction that
/// minimizes the group's squared quantization error, rounded to the nearest fp16 value (clipping
/// the largest weights is the point); zero points as `init_learned`'s. At 2 bits the min-max
/// scale of a Gaussian-like group is about twice the error-minimizing one, a distance learned
/// scales would otherwise have to travel.
pub fn init_learned_searched(w: &[f32], n_in: usize, n_out: usize, spec: QuantSpec) -> (Vec<f32>, Vec<f32>) {
    let (mut scales, zeros) = init_learned(w, n_in, n_out, spec);
    let gsz = spec.group_for(n_in);
    for g in 0..n_in / gsz {
        for j in 0..n_out {
            let si = g * n_out + j;
            let z = zeros.get(si).copied().unwrap_or(0.0);
            let err = |s: f32| -> f32 {
                (0..gsz)
                    .map(|r| {
                        let v = w[(g * gsz + r) * n_out + j];
                        let d = v - point(spec, v, s, z).value();
                        d * d
                    })
                    .sum()
            };
            let mut best = (err(scales[si]), scales[si]);
            for f in search_fractions().skip(1) {
                let s = (scales[si] * f).round_f16();
                let e = err(s);
                if e < best.0 {
                    best = (e, s);
                }
            }
            scales[si] = best.1;
        }
    }
    (scales, zeros)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize, fake_quant};
    use qatc_ir::QuantScheme;

    fn spec(bits: u8, group: usize, scheme: QuantScheme) -> QuantSpec {
        QuantSpec { bits, group, scheme }
    }

    /// A weight [32, 3] with varied magnitudes (no exact ties: a scale rounded to fp16 would round
    /// them the other way) and an all-zero group.
    fn weight() -> Vec<f32> {
        let mut w: Vec<f32> = (0..96).map(|i| (i as f32 * 0.7543).sin() * 0.05 * (1.0 + (i % 5) as f32)).collect();
        for i in 0..16 {
            w[i * 3 + 2] = 0.0; // column 2, first group: all zero
        }
        w
    }

    #[test]
    fn at_its_initial_scales_it_is_the_min_max_grid_up_to_the_fp16_scale() {
        let w = weight();
        for sp in
            [spec(4, 16, QuantScheme::Sym), spec(3, 16, QuantScheme::Sym), spec(4, 16, QuantScheme::Asym), spec(4, 16, QuantScheme::Nf4)]
        {
            let (s, z) = init_learned(&w, 32, 3, sp);
            let learned = fake_quant_learned(sp, 32, 3, &w, &s, &z);
            let minmax = fake_quant(&w, 32, 3, sp);
            // same codes, scale within fp16's relative step of the min-max one, nothing clipped
            for (a, b) in learned.iter().zip(&minmax) {
                assert!((a - b).abs() <= 1e-3 * b.abs() + 1e-7, "{sp:?}: {a} vs {b}");
            }
            // asym's zero point is rounded, so its range may end up to half a step inside the group's
            let slack = if sp.scheme.has_zero_point() { 0.5 } else { 0.0 };
            let inside = each(sp, 32, 3, &w, &s, &z, |_, p| {
                p.inside || p.s == 0.0 || (sp.scheme == QuantScheme::Asym && (p.x - p.q).abs() <= slack)
            });
            assert!(inside.iter().all(|&i| i), "{sp:?}: a weight is clipped at the initial scales");
        }
    }

    #[test]
    fn stored_codes_dequantize_to_the_learned_fake_quant_bit_for_bit() {
        let w = weight();
        for sp in [
            spec(4, 16, QuantScheme::Sym),
            spec(2, 8, QuantScheme::Sym),
            spec(4, 32, QuantScheme::Q4_0),
            spec(3, 16, QuantScheme::Asym),
            spec(4, 16, QuantScheme::Nf4),
        ] {
            let (mut s, mut z) = init_learned(&w, 32, 3, sp);
            // trained scales are not fp16 values and clip some weights; zero points are not integers
            s.iter_mut().enumerate().for_each(|(i, v)| *v *= 0.71 + 0.013 * i as f32);
            z.iter_mut().for_each(|v| *v += 0.37);
            let q = quantize_learned(&w, 32, 3, sp, &s, &z);
            let fq = fake_quant_learned(sp, 32, 3, &w, &s, &z);
            assert_eq!(dequantize(&q), fq, "{sp:?}");
            assert!(each(sp, 32, 3, &w, &s, &z, |_, p| !p.inside && p.s != 0.0).contains(&true), "{sp:?}: nothing clipped");
        }
    }

    #[test]
    fn gradient_parts_follow_lsq() {
        let sp = spec(3, 4, QuantScheme::Sym); // qmax 3
        let w = [0.35f32, -0.1, 0.8, 0.0];
        let s = [0.125f32]; // an fp16 value: x = 2.8, -0.8, 6.4 (clipped), 0
        let dy = [1.0f32, 2.0, 3.0, 4.0];
        let g = |wrt| fake_quant_learned_grad(sp, wrt, 4, 1, &w, &s, &[], &dy);
        assert_eq!(fake_quant_learned(sp, 4, 1, &w, &s, &[]), vec![0.375, -0.125, 0.375, 0.0]);
        assert_eq!(g(QuantParam::Weight), vec![1.0, 2.0, 0.0, 4.0]);
        let ds = g(QuantParam::Scale);
        let want = [3.0 - 2.8, 2.0 * (-1.0 + 0.8), 3.0 * 3.0, 0.0];
        for (a, b) in ds.iter().zip(want) {
            assert!((a - b).abs() < 1e-5, "{ds:?}");
        }
        // asym: 2 bits, zero point 1.4 -> 1, range [-1, 2]; x = -3 is clipped low
        let sa = spec(2, 2, QuantScheme::Asym);
        let dz = fake_quant_learned_grad(sa, QuantParam::Zero, 2, 1, &[-0.375, 0.125], &[0.125], &[1.4], &[1.0, 1.0]);
        assert_eq!(dz, vec![-0.125, 0.0]);
    }

    #[test]
    fn searched_scales_never_quantize_worse_than_min_max_and_shrink_at_two_bits() {
        let w = weight();
        for sp in
            [spec(2, 16, QuantScheme::Sym), spec(3, 16, QuantScheme::Sym), spec(4, 16, QuantScheme::Nf4), spec(4, 16, QuantScheme::Asym)]
        {
            let (s0, z0) = init_learned(&w, 32, 3, sp);
            let (s1, z1) = init_learned_searched(&w, 32, 3, sp);
            assert_eq!(z0, z1, "{sp:?}: the zero points stay");
            let err = |s: &[f32]| -> f32 { fake_quant_learned(sp, 32, 3, &w, s, &z0).iter().zip(&w).map(|(a, b)| (a - b) * (a - b)).sum() };
            assert!(err(&s1) <= err(&s0), "{sp:?}: {} > {}", err(&s1), err(&s0));
            assert!(s1.iter().zip(&s0).all(|(a, b)| a.abs() <= b.abs()), "{sp:?}: a scale grew");
            if sp.bits == 2 {
                assert!(err(&s1) < 0.8 * err(&s0), "{sp:?}: 2-bit min-max scales are far from the best ones");
            }
        }
    }

    #[test]
    fn a_zero_scale_gives_zero_and_no_gradient() {
        let sp = spec(4, 2, QuantScheme::Sym);
        assert_eq!(fake_quant_learned(sp, 2, 1, &[0.5f32, -1.0], &[1e-9], &[]), vec![0.0, 0.0]);
        for wrt in [QuantParam::Weight, QuantParam::Scale] {
            assert_eq!(fake_quant_learned_grad(sp, wrt, 2, 1, &[0.5f32, -1.0], &[0.0], &[], &[1.0, 1.0]), vec![0.0, 0.0]);
        }
    }
}
