//! Weight quantization, exactly as `Op::FakeQuant` defines it (see `qatc_ir::QuantScheme`), with
//! each scheme's constants from its grid (`qatc_ir::Grid`).
//!
//! A weight is a Conv1D matrix w [in, out], row-major. Group g of output column j is the `G`
//! consecutive rows g*G .. (g+1)*G of that column; scales (and zero points) are [in/G, out].
//! All arithmetic is f32, the precision the fake-quant nodes run at in PyTorch, so the fixture
//! generator reproduces it bit for bit. Rounding is half to even (`torch.round`), except Q4_0,
//! which is llama.cpp's reference quantizer verbatim (trunc(x * (1/d) + 8.5)).
//!
//! `dequantize(quantize(w))` IS the fake-quant: there is one code path, so the folded graph
//! (packed codes + Dequantize) equals the unfolded one (FakeQuant) bit for bit by construction.

use half::f16;
use qatc_ir::{qmap, DynMap, Grid, Points, QuantScheme, QuantSpec};

pub use qatc_ir::NF4;

use crate::float::Float;

mod calibrated;
mod learned;
pub use calibrated::{candidates, init_learned_activation, init_learned_activation_from, output_error, Gram};
pub use learned::{
    fake_quant_learned, fake_quant_learned_grad, init_learned, init_learned_searched, point, quantize_learned, zero_point, Point,
};

/// The code of a table grid's entry nearest to x (a value already divided by the group's scale),
/// the first one on ties; codes saturate at the table's ends.
pub fn table_nearest<T: Float>(table: &[f32; 16], x: T) -> u8 {
    let code = |k: usize| T::from_f64(table[k] as f64);
    let mut best = 0usize;
    for k in 1..table.len() {
        if (x - code(k)).abs() < (x - code(best)).abs() {
            best = k;
        }
    }
    best as u8
}

/// The nearest NF4 code to x (`table_nearest` of `NF4`).
pub fn nf4_nearest<T: Float>(x: T) -> u8 {
    table_nearest(&NF4, x)
}

/// A quantized weight: one code per element (unpacked; see `pack_i4` for storage), scales and,
/// for asym, zero points, each [groups, out] row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Quantized {
    pub spec: QuantSpec,
    pub n_in: usize,
    pub n_out: usize,
    pub codes: Vec<u8>,
    pub scales: Vec<f32>,
    pub zeros: Vec<f32>,
}

impl Quantized {
    pub fn group(&self) -> usize {
        self.spec.group_for(self.n_in)
    }
    pub fn groups(&self) -> usize {
        self.n_in / self.group()
    }
    /// Bytes as stored: packed codes plus scales (f16 for Q4_0) plus zero points.
    pub fn stored_bytes(&self) -> usize {
        self.spec.stored_bytes(self.n_in, self.n_out)
    }
}

/// Quantizes w [n_in, n_out]. The spec must have been checked (`QuantSpec::check`). A group
/// holding a NaN or an infinity gets a NaN scale: all its values dequantize to NaN.
pub fn quantize(w: &[f32], n_in: usize, n_out: usize, spec: QuantSpec) -> Quantized {
    let gsz = spec.group_for(n_in);
    let groups = n_in / gsz;
    let mut q = Quantized {
        spec,
        n_in,
        n_out,
        codes: vec![0; n_in * n_out],
        scales: vec![0.0; groups * n_out],
        zeros: if spec.scheme.has_zero_point() { vec![0.0; groups * n_out] } else { Vec::new() },
    };
    let grid = spec.grid();
    // the grid's constants as the f32 operands of the arithmetic below
    let (lo, hi) = grid.range(0.0);
    let (lo, hi, divisor, max_code) = (lo as f32, hi as f32, grid.scale_divisor() as f32, grid.max_code as f32);
    let offset = grid.offset().unwrap_or(0) as f32;
    if matches!(spec.scheme, QuantScheme::Sym | QuantScheme::Asym) {
        let asym = spec.scheme == QuantScheme::Asym;
        quantize_rows(w, &mut q, gsz, RowGrid { asym, lo, hi, divisor, offset, max_code });
        return q;
    }
    let mut col = vec![0f32; gsz];
    for g in 0..groups {
        for j in 0..n_out {
            for (r, c) in col.iter_mut().enumerate() {
                *c = w[(g * gsz + r) * n_out + j];
            }
            let si = g * n_out + j;
            if col.iter().any(|v| !v.is_finite()) {
                // no grid holds a NaN or an infinity: the group's scale is NaN, so every value of
                // the group dequantizes to NaN instead of to a finite number that hides it
                q.scales[si] = f32::NAN;
                continue;
            }
            let mut put = |r: usize, code: u8| q.codes[(g * gsz + r) * n_out + j] = code;
            match spec.scheme {
                QuantScheme::Sym | QuantScheme::Asym => unreachable!("sym and asym are quantized row by row above"),
                QuantScheme::Nf4 => {
                    let absmax = col.iter().fold(0f32, |m, v| m.max(v.abs()));
                    for (r, &v) in col.iter().enumerate() {
                        let x = if absmax == 0.0 { 0.0 } else { v / absmax };
                        put(r, nf4_nearest(x));
                    }
                    q.scales[si] = absmax;
                }
                QuantScheme::Q4_0 => {
                    // llama.cpp quantize_row_q4_0_ref: m keeps its sign; the first wins ties.
                    let (mut amax, mut m) = (0f32, 0f32);
                    for &v in &col {
                        if amax < v.abs() {
                            amax = v.abs();
                            m = v;
                        }
                    }
                    let d = m / divisor;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    let bias = grid.trunc_bias() as f32;
                    for (r, &v) in col.iter().enumerate() {
                        // (int8_t) truncates toward zero; x * id + 8.5 is >= 0.5 here
                        let k = ((v * id + bias) as i8).min(grid.max_code as i8);
                        put(r, k as u8);
                    }
                    q.scales[si] = f16::from_f32(d).to_f32();
                }
            }
        }
    }
    q
}

/// The constants of `quantize_rows`'s arithmetic, as `quantize` computes them from the grid.
#[derive(Clone, Copy)]
struct RowGrid {
    asym: bool,
    lo: f32,
    hi: f32,
    divisor: f32,
    offset: f32,
    max_code: f32,
}

/// `quantize` for `QuantScheme::Sym` and `Asym`, a group's rows at a time across every column:
/// the same arithmetic per element as the column loop the other schemes keep (sym: scale =
/// absmax / divisor, code = clamp(round_half_even(v / scale)) + offset; asym: scale = (max - min)
/// / divisor with min <= 0 <= max, zero point clamp(round_half_even(-min / scale)), code =
/// clamp(round_half_even(v / scale) + zero); a group with a NaN or an infinity gets a NaN scale,
/// a zero point of 0 and codes 0), in loops over contiguous rows that vectorize. Column by column it
/// read w strided and rounded through libm's `rintf`, a call per element: about 1.7 s of the
/// 124M step's build.
fn quantize_rows(w: &[f32], q: &mut Quantized, gsz: usize, grid: RowGrid) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has the features the function was compiled for.
        return unsafe { quantize_rows_avx2(w, q, gsz, grid) };
    }
    quantize_rows_body(w, q, gsz, grid)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn quantize_rows_avx2(w: &[f32], q: &mut Quantized, gsz: usize, grid: RowGrid) {
    quantize_rows_body(w, q, gsz, grid)
}

#[inline(always)]
fn quantize_rows_body(w: &[f32], q: &mut Quantized, gsz: usize, grid: RowGrid) {
    let RowGrid { asym, lo, hi, divisor, offset, max_code } = grid;
    let n = q.n_out;
    // per column of the group: its min and max (sym: -absmax and absmax), and whether finite
    let (mut low, mut high, mut finite) = (vec![0f32; n], vec![0f32; n], vec![true; n]);
    for g in 0..q.n_in / gsz {
        let rows = g * gsz * n..(g + 1) * gsz * n;
        low.fill(0.0);
        high.fill(0.0);
        finite.fill(true);
        for row in w[rows.clone()].chunks_exact(n) {
            for (((l, h), ok), &v) in low.iter_mut().zip(high.iter_mut()).zip(finite.iter_mut()).zip(row) {
                if asym {
                    *l = l.min(v);
                    *h = h.max(v);
                } else {
                    *h = h.max(v.abs());
                }
                *ok &= v.is_finite();
            }
        }
        let at = g * n..(g + 1) * n;
        for (j, s) in q.scales[at.clone()].iter_mut().enumerate() {
            // no grid holds a NaN or an infinity: the group's scale is NaN, so every value of the
            // group dequantizes to NaN instead of to a finite number that hides it
            *s = match (finite[j], asym) {
                (false, _) => f32::NAN,
                (true, false) => high[j] / divisor,
                (true, true) => (high[j] - low[j]) / divisor,
            };
        }
        if asym {
            for ((z, &s), (&l, &ok)) in q.zeros[at.clone()].iter_mut().zip(&q.scales[at.clone()]).zip(low.iter().zip(&finite)) {
                *z = if !ok || s == 0.0 { 0.0 } else { (-l / s).round_ties_even().clamp(0.0, max_code) };
            }
        }
        let (scales, zeros) = (&q.scales[at.clone()], if asym { &q.zeros[at] } else { &high[..0] });
        for (row, codes) in w[rows.clone()].chunks_exact(n).zip(q.codes[rows].chunks_exact_mut(n)) {
            if asym {
                for ((((c, &v), &s), &z), &ok) in codes.iter_mut().zip(row).zip(scales).zip(zeros).zip(&finite) {
                    let k = if s == 0.0 { z } else { ((v / s).round_ties_even() + z).clamp(0.0, max_code) };
                    *c = if ok { k as u8 } else { 0 };
                }
            } else {
                for (((c, &v), &s), &ok) in codes.iter_mut().zip(row).zip(scales).zip(&finite) {
                    let k = if s == 0.0 { 0.0 } else { (v / s).round_ties_even().clamp(lo, hi) };
                    *c = if ok { (k + offset) as u8 } else { 0 };
                }
            }
        }
    }
}

/// The value code `c` stands for in a group with this scale (and zero point, asym).
#[inline]
pub fn dequant_one(spec: QuantSpec, c: u8, scale: f32, zero: f32) -> f32 {
    match spec.grid().points {
        Points::Offset(o) => (c as f32 - o as f32) * scale,
        Points::ZeroPoint => scale * (c as f32 - zero),
        Points::Table(t) => t[usize::from(c) % t.len()] * scale,
    }
}

/// w' [n_in, n_out] from codes, scales and zero points.
pub fn dequantize_parts(spec: QuantSpec, n_in: usize, n_out: usize, codes: &[u8], scales: &[f32], zeros: &[f32]) -> Vec<f32> {
    let gsz = spec.group_for(n_in);
    let mut w = vec![0f32; n_in * n_out];
    for i in 0..n_in {
        let g = i / gsz;
        for j in 0..n_out {
            let si = g * n_out + j;
            let z = zeros.get(si).copied().unwrap_or(0.0);
            w[i * n_out + j] = dequant_one(spec, codes[i * n_out + j], scales[si], z);
        }
    }
    w
}

pub fn dequantize(q: &Quantized) -> Vec<f32> {
    dequantize_parts(q.spec, q.n_in, q.n_out, &q.codes, &q.scales, &q.zeros)
}

/// FakeQuant's forward: the weight rounded to its quantization grid.
pub fn fake_quant(w: &[f32], n_in: usize, n_out: usize, spec: QuantSpec) -> Vec<f32> {
    dequantize(&quantize(w, n_in, n_out, spec))
}

/// Dynamic per-row symmetric fake-quant of activations x [rows, c].
pub fn act_quant(x: &[f32], c: usize, bits: u8) -> Vec<f32> {
    let qmax = Grid::of(QuantScheme::Sym, bits).range(0.0).1 as f32;
    let mut out = vec![0f32; x.len()];
    for (row, o) in x.chunks(c.max(1)).zip(out.chunks_mut(c.max(1))) {
        let absmax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = absmax / qmax;
        for (v, y) in row.iter().zip(o.iter_mut()) {
            *y = if s == 0.0 { 0.0 } else { (v / s).round_ties_even().clamp(-qmax, qmax) * s };
        }
    }
    out
}

/// Packs 4-bit codes two per byte: element 2k in the low nibble, 2k+1 in the high nibble.
pub fn pack_i4(codes: &[u8]) -> Vec<u8> {
    codes.chunks(2).map(|p| (p[0] & 15) | (p.get(1).copied().unwrap_or(0) & 15) << 4).collect()
}

pub fn unpack_i4(bytes: &[u8], n: usize) -> Vec<u8> {
    (0..n).map(|i| (bytes[i / 2] >> (4 * (i % 2))) & 15).collect()
}

/// Dropout's keep decision for element `i`: a counter-based hash (splitmix64's finalizer) of
/// (seed, stream, i), so the same mask is reproduced in the backward pass and on any backend.
#[inline]
pub fn dropout_keep(seed: i32, stream: usize, i: usize, p: f64) -> bool {
    let mut z = (seed as u32 as u64) ^ (stream as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    let u = (z >> 40) as f64 / (1u64 << 24) as f64;
    u >= p
}

/// Blockwise dynamic dequantization (`Op::BlockDequant`): map[code] * absmax of the code's block,
/// in f32.
pub fn block_dequant(map: DynMap, codes: &[u8], absmax: &[f32]) -> Vec<f32> {
    let table = map.values();
    codes.iter().enumerate().map(|(i, &c)| table[c as usize] * absmax[i / qmap::BLOCK]).collect()
}

/// Each block's absolute maximum (`Op::BlockAbsMax`), ignoring NaN as the kernels' max
/// reduction does (`fmaxf`).
pub fn block_absmax(x: &[f32]) -> Vec<f32> {
    x.chunks(qmap::BLOCK).map(|b| b.iter().fold(0f32, |m, v| m.max(v.abs()))).collect()
}

/// Blockwise dynamic quantization (`Op::BlockQuant`): the code nearest to x / absmax of its
/// block; a block whose absmax is 0 (all zeros) gets the code of 0.
pub fn block_quant(map: DynMap, x: &[f32], absmax: &[f32]) -> Vec<u8> {
    x.iter()
        .enumerate()
        .map(|(i, &v)| {
            let a = absmax[i / qmap::BLOCK];
            map.nearest(if a > 0.0 { v / a } else { 0.0 })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The row-wise sym and asym quantizer against the column-by-column arithmetic it replaced,
    /// on values with ties (multiples of half a step), zero groups, all-positive groups (asym's
    /// min stays 0), and groups holding a NaN or an infinity.
    #[test]
    fn sym_and_asym_by_rows_are_the_column_arithmetic() {
        for scheme in [QuantScheme::Sym, QuantScheme::Asym] {
            by_rows_is_the_column_arithmetic(scheme);
        }
    }

    fn by_rows_is_the_column_arithmetic(scheme: QuantScheme) {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for (bits, group, n_in, n_out) in
            [(4u8, 64usize, 128usize, 37usize), (2, 32, 64, 70), (3, 16, 48, 9), (8, 128, 256, 5), (4, 0, 96, 33)]
        {
            let s = spec(bits, group, scheme);
            let mut w: Vec<f32> = (0..n_in * n_out)
                .map(|_| match next() % 4 {
                    0 => (next() % 17) as f32 * 0.5 - 4.0,
                    _ => ((next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0,
                })
                .collect();
            // a zero group, a NaN and an infinity in column 1, 2 of the first group, an
            // all-positive group in column 3
            for r in 0..s.group_for(n_in) {
                w[r * n_out] = 0.0;
                w[r * n_out + 3] = 0.25 + r as f32 * 0.125;
            }
            w[3 * n_out + 1] = f32::NAN;
            w[5 * n_out + 2] = f32::INFINITY;
            let got = quantize(&w, n_in, n_out, s);
            let gsz = s.group_for(n_in);
            let grid = s.grid();
            let (lo, hi) = grid.range(0.0);
            let (lo, hi, divisor, offset) = (lo as f32, hi as f32, grid.scale_divisor() as f32, grid.offset().unwrap_or(0) as f32);
            for g in 0..n_in / gsz {
                for j in 0..n_out {
                    let col: Vec<f32> = (0..gsz).map(|r| w[(g * gsz + r) * n_out + j]).collect();
                    let si = g * n_out + j;
                    let code = |r: usize| got.codes[(g * gsz + r) * n_out + j];
                    if col.iter().any(|v| !v.is_finite()) {
                        assert!(got.scales[si].is_nan(), "group {g} column {j}: a NaN scale");
                        assert!((0..gsz).all(|r| code(r) == 0));
                        assert!(got.zeros.get(si).is_none_or(|&z| z == 0.0));
                        continue;
                    }
                    let what = format!("{scheme:?} bits {bits} group {g} column {j}");
                    if scheme == QuantScheme::Asym {
                        let max_code = grid.max_code as f32;
                        let rmin = col.iter().fold(0f32, |m, &v| m.min(v));
                        let rmax = col.iter().fold(0f32, |m, &v| m.max(v));
                        let sc = (rmax - rmin) / divisor;
                        let z = if sc == 0.0 { 0.0 } else { (-rmin / sc).round_ties_even().clamp(0.0, max_code) };
                        assert_eq!((got.scales[si].to_bits(), got.zeros[si].to_bits()), (sc.to_bits(), z.to_bits()), "{what}");
                        for (r, &v) in col.iter().enumerate() {
                            let k = if sc == 0.0 { z } else { ((v / sc).round_ties_even() + z).clamp(0.0, max_code) };
                            assert_eq!(code(r), k as u8, "{what} row {r}");
                        }
                        continue;
                    }
                    let sc = col.iter().fold(0f32, |m, v| m.max(v.abs())) / divisor;
                    assert_eq!(got.scales[si].to_bits(), sc.to_bits(), "{what}: scale");
                    for (r, &v) in col.iter().enumerate() {
                        let k = if sc == 0.0 { 0.0 } else { (v / sc).round_ties_even().clamp(lo, hi) };
                        assert_eq!(code(r), (k + offset) as u8, "{what} row {r}");
                    }
                }
            }
        }
    }

    fn spec(bits: u8, group: usize, scheme: QuantScheme) -> QuantSpec {
        QuantSpec { bits, group, scheme }
    }

    #[test]
    fn sym_rounds_half_to_even_and_hits_absmax() {
        // one column, group 4: absmax 7 -> S = 1 (4 bits, qmax 7); 2.5 -> 2, 3.5 -> 4, -0.5 -> -0
        let w = [2.5f32, 3.5, -0.5, 7.0];
        let out = fake_quant(&w, 4, 1, spec(4, 4, QuantScheme::Sym));
        assert_eq!(out, vec![2.0, 4.0, -0.0, 7.0]);
    }

    #[test]
    fn zero_groups_dequantize_to_zero() {
        for s in QuantScheme::ALL {
            let sp = spec(4, 32, s);
            let out = fake_quant(&[0.0; 64], 32, 2, sp);
            assert!(out.iter().all(|&v| v == 0.0), "{s:?}");
        }
    }

    #[test]
    fn asym_keeps_zero_exact() {
        let w = [-1.0f32, 0.0, 0.3, 2.0];
        let out = fake_quant(&w, 4, 1, spec(4, 4, QuantScheme::Asym));
        assert_eq!(out[1], 0.0);
        assert!((out[3] - 2.0).abs() < 0.1 && (out[0] + 1.0).abs() < 0.1);
    }

    #[test]
    fn q4_0_matches_llama_cpp_reference() {
        // m = -4 (largest magnitude, sign kept) -> d = 0.5, id = 2: x = -4 -> q = trunc(0.5) = 0
        // -> -8 * 0.5 = -4 exactly; x = 4 -> trunc(16.5) = 16 -> min 15 -> 3.5 (saturates at 0.875 m)
        let mut w = vec![0f32; 32];
        w[0] = -4.0;
        w[1] = 4.0;
        w[2] = 0.25; // 0.5 + 8.5 = 9 -> 0.5
        w[3] = -0.26; // -0.52 + 8.5 = 7.98 -> 7 -> -0.5
        let q = quantize(&w, 32, 1, spec(4, 32, QuantScheme::Q4_0));
        assert_eq!(q.scales[0], 0.5);
        let out = dequantize(&q);
        assert_eq!(&out[..4], &[-4.0, 3.5, 0.5, -0.5]);
        // the first element of largest magnitude wins the sign on ties: m = -4 here
        let mut w2 = vec![0f32; 32];
        w2[0] = -4.0;
        w2[5] = 4.0;
        assert_eq!(quantize(&w2, 32, 1, spec(4, 32, QuantScheme::Q4_0)).scales[0], 0.5);
    }

    #[test]
    fn nf4_picks_the_nearest_code() {
        let w = [1.0f32, -1.0, 0.0, 0.5];
        let out = fake_quant(&w, 4, 1, spec(4, 4, QuantScheme::Nf4));
        assert_eq!(out[0], 1.0);
        assert_eq!(out[1], -1.0);
        assert_eq!(out[2], 0.0);
        assert_eq!(out[3], NF4[12]); // 0.4407 is nearer to 0.5 than 0.5626
    }

    #[test]
    fn a_non_finite_value_makes_its_group_nan_never_finite() {
        for s in QuantScheme::ALL {
            let sp = spec(4, 32, s);
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                // two columns, two groups of 32: only column 1's first group holds the bad value
                let mut w: Vec<f32> = (0..128).map(|i| (i as f32 * 0.37).sin()).collect();
                w[5 * 2 + 1] = bad;
                let out = fake_quant(&w, 64, 2, sp);
                for (i, v) in out.iter().enumerate() {
                    let (row, col) = (i / 2, i % 2);
                    assert_eq!(v.is_nan(), col == 1 && row < 32, "{s:?} {bad}: element [{row}, {col}] = {v}");
                }
            }
        }
    }

    /// Each scheme's grid (`qatc_ir::Grid`) is what the quantizer does at the edges: the largest
    /// magnitude on the end point the scale rule puts it on, the other end saturating, zero on the
    /// code of point 0, ties rounded as the scheme rounds them; and learned scales clamp to the
    /// grid's range at both ends.
    #[test]
    fn each_grid_is_what_the_quantizer_does_at_the_edges() {
        for scheme in QuantScheme::ALL {
            for bits in scheme.widths() {
                let sp = spec(bits, 32, scheme);
                let grid = sp.grid();
                // (value, expected code) in a group whose scale comes out as 1
                let cases: Vec<(f32, u32)> = match scheme {
                    QuantScheme::Sym => {
                        let (o, hi) = (grid.offset().unwrap_or(0), grid.range(0.0).1 as f32);
                        let mut c = vec![(hi, grid.max_code), (-hi, 0), (0.0, o), (0.5, o), (-0.5, o)];
                        if hi >= 2.0 {
                            c.push((1.5, o + 2)); // half to even
                        }
                        c
                    }
                    // rmin -1, rmax max_code - 1: S = 1, z = 1
                    QuantScheme::Asym => {
                        let top = grid.max_code as f32;
                        vec![(-1.0, 0), (top - 1.0, grid.max_code), (0.0, 1), (0.5, 1), (1.5, 3)]
                    }
                    // NF4[6] / 2 lies exactly halfway between codes 6 and 7: the first wins
                    QuantScheme::Nf4 => vec![(1.0, grid.max_code), (-1.0, 0), (0.0, 7), (NF4[6] / 2.0, 6)],
                    // m = -8 (the first of largest magnitude): d = 1; +8 saturates at 7; half up
                    QuantScheme::Q4_0 => {
                        let o = grid.offset().unwrap_or(0);
                        vec![(-8.0, 0), (8.0, grid.max_code), (0.0, o), (0.5, o + 1), (-0.5, o), (-1.5, o - 1), (7.4, grid.max_code)]
                    }
                };
                let mut w = vec![0f32; 32];
                for (i, &(v, _)) in cases.iter().enumerate() {
                    w[i] = v;
                }
                let q = quantize(&w, 32, 1, sp);
                assert_eq!(q.scales[0], 1.0, "{scheme} {bits}: the scale rule");
                for (i, &(v, want)) in cases.iter().enumerate() {
                    assert_eq!(u32::from(q.codes[i]), want, "{scheme} {bits}: the code of {v}");
                }
                assert!(q.codes.iter().all(|&c| u32::from(c) <= grid.max_code), "{scheme} {bits}");
                let z = q.zeros.first().copied().unwrap_or(0.0);
                let (zlo, zhi) = grid.range(f64::from(z));
                let out = dequantize(&q);
                assert_eq!(out.iter().fold(f32::INFINITY, |m, &v| m.min(v)), zlo as f32, "{scheme} {bits}: the lowest point");
                assert_eq!(out.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)), zhi as f32, "{scheme} {bits}: the highest point");
                // a learned scale of 1 clamps far values to the range's ends, codes 0 and max_code
                let z = if scheme.has_zero_point() { 2.0 } else { 0.0 };
                let (lo_z, hi_z) = grid.range(z);
                for (v, end, code) in [(-1000.0, lo_z, 0), (1000.0, hi_z, grid.max_code)] {
                    let p = point(sp, v, 1.0, z as f32);
                    assert_eq!((p.q, u32::from(p.code), p.inside), (end as f32, code, false), "{scheme} {bits}: learned {v}");
                }
            }
        }
    }

    #[test]
    fn pack_roundtrip() {
        let codes: Vec<u8> = (0..33).map(|i| (i * 7 % 16) as u8).collect();
        assert_eq!(unpack_i4(&pack_i4(&codes), 33), codes);
        assert_eq!(pack_i4(&[1, 2])[0], 0x21);
    }

    #[test]
    fn dropout_is_deterministic_and_near_p() {
        let kept = (0..100_000).filter(|&i| dropout_keep(7, 3, i, 0.25)).count();
        assert!((kept as f64 / 1e5 - 0.75).abs() < 0.01, "{kept}");
        assert_eq!(dropout_keep(7, 3, 11, 0.25), dropout_keep(7, 3, 11, 0.25));
    }
}
