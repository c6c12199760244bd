//! Activation-aware starts for learned scales: each group's scale (and asym's zero point) chosen
//! for the error of the layer's OUTPUT on calibration activations X, not of the weight alone
//! (AWQ, Lin et al. 2024, and OmniQuant's learnable weight clipping, Shao et al. 2024, search or
//! learn a per-group clipping of the same objective).
//!
//! Objective: ||X W - X Q(W)||_F^2 over the calibration rows, with Q the learned fake-quant at
//! the candidate scales (`point`, what training starts from). With H = X^T X (`Gram`, f64) it is
//! sum_j d_j^T H d_j, d_j = w_j - Q(w_j) the deviation of output column j: exact, and independent
//! of how many rows X has. Columns are independent; the groups of one column are not (H couples
//! them), so each column is minimized by coordinate descent over its groups, starting from the
//! weight search's scales (`init_learned_searched`) and accepting only a lower error, so the
//! result is never worse than that start on the calibration data.
//!
//! Grid, per group: the min-max scale times each of the weight search's fractions (1 down to 0.3
//! in steps of 0.02, `search_fractions`), rounded to fp16 (a clipping ratio applied to both ends
//! of the group's range); for asym, each with the min-max zero point and its two neighbours
//! (clipping one end more than the other), clamped to the codes.

use rayon::prelude::*;

use qatc_ir::QuantSpec;

use super::learned::{init_learned, init_learned_searched, point, search_fractions};
use crate::float::Float;

/// Coordinate-descent sweeps over a column's groups at most (each sweep visits every group once;
/// it stops earlier when a sweep changes nothing).
const SWEEPS: usize = 4;

/// The Gram matrix H = X^T X [n, n] of calibration activations X [rows, n], in f64, added up
/// batch by batch, each batch one GEMM (a fixed order: deterministic).
#[derive(Clone, Debug)]
pub struct Gram {
    pub n: usize,
    /// Rows of X added so far.
    pub rows: usize,
    h: Vec<f64>,
}

impl Gram {
    pub fn new(n: usize) -> Gram {
        Gram { n, rows: 0, h: vec![0.0; n * n] }
    }

    /// Adds the rows of x [rows, n] (a trailing partial row is ignored): H += X^T X, one f64 GEMM
    /// over X widened (exact products of f32 values, f64 sums in the GEMM's fixed order).
    pub fn add(&mut self, x: &[f32]) {
        let n = self.n;
        let rows = x.len().checked_div(n).unwrap_or(0);
        if rows == 0 {
            return;
        }
        let wide: Vec<f64> = x[..rows * n].iter().map(|&v| f64::from(v)).collect();
        // SAFETY: `wide` is rows x n row-major; read as X^T (n x rows) through row stride 1 and
        // column stride n, and as X (rows x n) through row stride n and column stride 1, every
        // index stays below rows * n; self.h is n x n row-major, a separate allocation from
        // `wide`; beta 1 reads and writes only its n * n elements.
        unsafe {
            matrixmultiply::dgemm(
                n,
                rows,
                n,
                1.0,
                wide.as_ptr(),
                1,
                n as isize,
                wide.as_ptr(),
                n as isize,
                1,
                1.0,
                self.h.as_mut_ptr(),
                n as isize,
                1,
            )
        };
        self.rows += rows;
    }

    /// H[i, j].
    pub fn at(&self, i: usize, j: usize) -> f64 {
        self.h[i * self.n + j]
    }

    /// The identity: with it the output error is the weight's squared error (a lookup's output).
    pub fn identity(n: usize) -> Gram {
        let mut g = Gram::new(n);
        for i in 0..n {
            g.h[i * n + i] = 1.0;
        }
        g
    }
}

/// Column j's deviation w - Q(w) over rows `rows` of w [n_in, n_out] at scale s, zero point z.
fn deviation(spec: QuantSpec, w: &[f32], n_out: usize, j: usize, rows: std::ops::Range<usize>, s: f32, z: f32) -> Vec<f64> {
    rows.map(|i| {
        let v = w[i * n_out + j];
        f64::from(v - point(spec, v, s, z).value())
    })
    .collect()
}

/// The output error ||X W - X Q(W)||_F^2 = sum_j d_j^T H d_j of w [n_in, n_out] at `scales`
/// (and `zeros`, asym), each [n_in / G, n_out].
pub fn output_error(w: &[f32], n_in: usize, n_out: usize, spec: QuantSpec, scales: &[f32], zeros: &[f32], gram: &Gram) -> f64 {
    let d = deviations(w, n_in, n_out, spec, |si| (scales[si], zeros.get(si).copied().unwrap_or(0.0)));
    let hd = times_gram(gram, &d, n_out);
    // column by column, in order
    d.chunks(n_in.max(1)).zip(hd.chunks(n_in.max(1))).map(|(dj, rj)| dot(dj, rj)).sum()
}

/// Every column's deviation w - Q(w) at the scale and zero point `at(group * n_out + column)`
/// gives, one column after another: D^T [n_out, n_in].
fn deviations(w: &[f32], n_in: usize, n_out: usize, spec: QuantSpec, at: impl Fn(usize) -> (f32, f32) + Sync) -> Vec<f64> {
    let gsz = spec.group_for(n_in);
    let at = &at;
    (0..n_out)
        .into_par_iter()
        .flat_map_iter(move |j| {
            (0..n_in / gsz).flat_map(move |g| {
                let (s, z) = at(g * n_out + j);
                deviation(spec, w, n_out, j, g * gsz..(g + 1) * gsz, s, z)
            })
        })
        .collect()
}

/// H d_j for every column deviation d_j of `d` (D^T [m, n], one column after another), as D^T H
/// (H is symmetric): one f64 GEMM instead of m matrix-vector products.
fn times_gram(gram: &Gram, d: &[f64], m: usize) -> Vec<f64> {
    times_block(gram, 0, gram.n, d, m)
}

/// `d` [m, len] times the diagonal block H[at..at + len, at..at + len]: for rows d_c, H_block d_c
/// (the block is symmetric). Zeros where the shapes do not match (never, from this module).
fn times_block(gram: &Gram, at: usize, len: usize, d: &[f64], m: usize) -> Vec<f64> {
    let n = gram.n;
    let mut out = vec![0.0; m * len];
    if m == 0 || len == 0 || d.len() != m * len || at + len > n {
        return out;
    }
    // SAFETY: d is m x len and out m x len, row-major (row stride len, column stride 1); the
    // block starts at H[at, at] and is read with row stride n and column stride 1, so its last
    // element is at (at + len - 1) * n + at + len - 1 < n * n; out is a fresh allocation that
    // aliases neither input; beta 0 only writes out.
    unsafe {
        matrixmultiply::dgemm(
            m,
            len,
            len,
            1.0,
            d.as_ptr(),
            len as isize,
            1,
            gram.h.as_ptr().add(at * n + at),
            n as isize,
            1,
            0.0,
            out.as_mut_ptr(),
            len as isize,
            1,
        )
    };
    out
}

/// sum a_i b_i over the shorter of the two, in eight interleaved partial sums added in a fixed
/// order: the same result every run, and a loop the compiler turns into vector FMAs (a single
/// running sum is a serial chain it may not reorder).
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut s = [0.0f64; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f64 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ac.zip(bc) {
        for k in 0..8 {
            s[k] += x[k] * y[k];
        }
    }
    ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])) + tail
}

/// One group's candidates (`candidates`), the column's deviation at each (`nd`, [candidates,
/// G]) and the group's diagonal block of H times each (`hnd`, the same shape).
struct Candidates {
    list: Vec<(f32, f32)>,
    nd: Vec<f64>,
    hnd: Vec<f64>,
}

/// The candidate (scale, zero point) pairs of a group whose min-max start is (s, z): the grid of
/// the module doc.
pub fn candidates(spec: QuantSpec, s: f32, z: f32) -> Vec<(f32, f32)> {
    let top = spec.grid().max_code as f32;
    let mut out = Vec::new();
    for f in search_fractions() {
        let sf = (s * f).round_f16();
        if spec.scheme.has_zero_point() {
            for dz in [0.0, -1.0, 1.0] {
                let c = (sf, (z + dz).clamp(0.0, top));
                if !out.contains(&c) {
                    out.push(c);
                }
            }
        } else if !out.contains(&(sf, 0.0)) {
            out.push((sf, 0.0));
        }
    }
    out
}

/// Initial scales (and zero points) with the least output error on the activations whose Gram
/// matrix is `gram` (the module doc's objective, grid and search). Deterministic: each column is
/// searched on its own, in a fixed order.
pub fn init_learned_activation(w: &[f32], n_in: usize, n_out: usize, spec: QuantSpec, gram: &Gram) -> (Vec<f32>, Vec<f32>) {
    init_learned_activation_from(w, n_in, n_out, spec, gram, init_learned_searched(w, n_in, n_out, spec))
}

/// [`init_learned_activation`] from `searched`, the weight search's scales and zero points
/// (`init_learned_searched` of the same weight), for a caller that has them already: the search
/// quantizes every weight at every fraction, a third of the whole calibration's work.
pub fn init_learned_activation_from(
    w: &[f32],
    n_in: usize,
    n_out: usize,
    spec: QuantSpec,
    gram: &Gram,
    searched: (Vec<f32>, Vec<f32>),
) -> (Vec<f32>, Vec<f32>) {
    let (mm_s, mm_z) = init_learned(w, n_in, n_out, spec);
    let (mut scales, mut zeros) = searched;
    let asym = spec.scheme.has_zero_point();
    let gsz = spec.group_for(n_in);
    let groups = n_in / gsz;
    let at = |v: &[f32], si: usize| v.get(si).copied().unwrap_or(0.0);
    // every column's deviation at the start and r = H d, kept up to date as its groups change
    let d0 = deviations(w, n_in, n_out, spec, |si| (scales[si], at(&zeros, si)));
    let r0 = times_gram(gram, &d0, n_out);
    let n = gram.n;
    let chosen: Vec<Vec<(f32, f32)>> = (0..n_out)
        .into_par_iter()
        .map(|j| {
            let mut cur: Vec<(f32, f32)> = (0..groups).map(|g| (scales[g * n_out + j], at(&zeros, g * n_out + j))).collect();
            let mut d: Vec<f64> = d0[j * n_in..(j + 1) * n_in].to_vec();
            let mut r: Vec<f64> = r0[j * n_in..(j + 1) * n_in].to_vec();
            // each group's candidates, their deviations nd_c and H_gg nd_c: the same in every
            // sweep, so made once (a GEMM per group); and H_gg d_g of the current deviation
            let grid: Vec<Candidates> = (0..groups)
                .map(|g| {
                    let (si, base) = (g * n_out + j, g * gsz);
                    let list = candidates(spec, mm_s[si], at(&mm_z, si));
                    let nd: Vec<f64> = list.iter().flat_map(|c| deviation(spec, w, n_out, j, base..base + gsz, c.0, c.1)).collect();
                    let hnd = times_block(gram, base, gsz, &nd, list.len());
                    Candidates { list, nd, hnd }
                })
                .collect();
            // H_gg d_g of every group g, kept as d_g changes
            let mut hd: Vec<f64> = (0..groups).flat_map(|g| times_block(gram, g * gsz, gsz, &d[g * gsz..(g + 1) * gsz], 1)).collect();
            for _ in 0..SWEEPS {
                let mut changed = false;
                for (g, now) in cur.iter_mut().enumerate() {
                    let base = g * gsz;
                    let cands = &grid[g];
                    let (dg, hdg) = (&d[base..base + gsz], &hd[base..base + gsz]);
                    // the change of d^T H d when d's group g moves by delta = nd_c - d_g:
                    // delta^T H_gg delta + 2 delta . r_g, with H_gg delta = H_gg nd_c - H_gg d_g
                    let mut best: Option<(f64, usize)> = None; // (change, candidate)
                    for (k, &c) in cands.list.iter().enumerate() {
                        if c == *now {
                            continue;
                        }
                        let (nd, hnd) = (&cands.nd[k * gsz..(k + 1) * gsz], &cands.hnd[k * gsz..(k + 1) * gsz]);
                        let mut change = 0.0;
                        for a in 0..gsz {
                            let da = nd[a] - dg[a];
                            change += da * ((hnd[a] - hdg[a]) + 2.0 * r[base + a]);
                        }
                        if change < best.map_or(0.0, |b| b.0) {
                            best = Some((change, k));
                        }
                    }
                    let Some((_, k)) = best else { continue };
                    let nd = &cands.nd[k * gsz..(k + 1) * gsz];
                    // r += H[:, group] delta, as the sum of the group's rows of H (H is symmetric)
                    // scaled by delta: contiguous rows, not a strided column block
                    for (b, (x, y)) in nd.iter().zip(dg).enumerate() {
                        let db = x - y;
                        if db != 0.0 {
                            for (ra, h) in r.iter_mut().zip(&gram.h[(base + b) * n..(base + b + 1) * n]) {
                                *ra += db * h;
                            }
                        }
                    }
                    hd[base..base + gsz].copy_from_slice(&cands.hnd[k * gsz..(k + 1) * gsz]);
                    d[base..base + gsz].copy_from_slice(nd);
                    *now = cands.list[k];
                    changed = true;
                }
                if !changed {
                    break;
                }
            }
            cur
        })
        .collect();
    for (j, col) in chosen.into_iter().enumerate() {
        for (g, (s, z)) in col.into_iter().enumerate() {
            scales[g * n_out + j] = s;
            if asym {
                zeros[g * n_out + j] = z;
            }
        }
    }
    (scales, zeros)
}

#[cfg(test)]
mod tests {
    use super::*;
    use qatc_ir::QuantScheme;

    /// Calibration rows X [rows, n] with one channel ten times the others (the outlier that makes
    /// the output error differ from the weight error), and a weight [n, n_out].
    fn case(rows: usize, n: usize, n_out: usize) -> (Vec<f32>, Vec<f32>) {
        let x = (0..rows * n).map(|k| (k as f32 * 0.377).sin() * if k % n == 1 { 10.0 } else { 1.0 }).collect();
        let w = (0..n * n_out).map(|k| (k as f32 * 0.7543).cos() * 0.05 * (1.0 + (k % 7) as f32)).collect();
        (x, w)
    }

    fn gram(x: &[f32], n: usize) -> Gram {
        let mut g = Gram::new(n);
        g.add(x);
        g
    }

    /// ||X W - X Q(W)||^2 straight from X, no Gram matrix: the brute force's measure.
    fn direct(x: &[f32], n: usize, w: &[f32], n_out: usize, spec: QuantSpec, s: &[f32], z: &[f32]) -> f64 {
        let q = super::super::fake_quant_learned(spec, n, n_out, w, s, z);
        let mut e = 0.0;
        for r in 0..x.len() / n {
            for j in 0..n_out {
                let y: f64 = (0..n).map(|i| f64::from(x[r * n + i]) * f64::from(w[i * n_out + j] - q[i * n_out + j])).sum();
                e += y * y;
            }
        }
        e
    }

    #[test]
    fn one_group_a_column_is_the_brute_force_minimum_of_the_grid() {
        let (n, n_out, rows) = (8, 3, 20);
        let (x, w) = case(rows, n, n_out);
        let h = gram(&x, n);
        for spec in [
            QuantSpec { bits: 2, group: 8, scheme: QuantScheme::Sym },
            QuantSpec { bits: 3, group: 8, scheme: QuantScheme::Sym },
            QuantSpec { bits: 3, group: 8, scheme: QuantScheme::Asym },
        ] {
            let (s, z) = init_learned_activation(&w, n, n_out, spec, &h);
            let (mm_s, mm_z) = init_learned(&w, n, n_out, spec);
            for j in 0..n_out {
                // every candidate of column j alone, the other columns' deviations are not counted
                let only = |sj: f32, zj: f32| {
                    let mut ss = mm_s.clone();
                    let mut zz = mm_z.clone();
                    let wj: Vec<f32> = (0..n * n_out).map(|k| if k % n_out == j { w[k] } else { 0.0 }).collect();
                    ss[j] = sj;
                    if !zz.is_empty() {
                        zz[j] = zj;
                    }
                    direct(&x, n, &wj, n_out, spec, &ss, &zz)
                };
                let brute = candidates(spec, mm_s[j], mm_z.get(j).copied().unwrap_or(0.0))
                    .into_iter()
                    .map(|(sj, zj)| only(sj, zj))
                    .fold(f64::INFINITY, f64::min);
                let got = only(s[j], z.get(j).copied().unwrap_or(0.0));
                assert!((got - brute).abs() <= 1e-9 * brute.max(1e-30), "{spec:?} column {j}: {got} against the brute force's {brute}");
            }
        }
    }

    #[test]
    fn never_worse_than_the_weight_search_on_the_output_and_the_gram_form_is_exact() {
        let (n, n_out, rows) = (32, 5, 64);
        let (x, w) = case(rows, n, n_out);
        let h = gram(&x, n);
        for spec in [
            QuantSpec { bits: 2, group: 8, scheme: QuantScheme::Sym },
            QuantSpec { bits: 3, group: 16, scheme: QuantScheme::Sym },
            QuantSpec { bits: 2, group: 8, scheme: QuantScheme::Asym },
            QuantSpec { bits: 4, group: 8, scheme: QuantScheme::Nf4 },
        ] {
            let (s, z) = init_learned_activation(&w, n, n_out, spec, &h);
            let (ss, sz) = init_learned_searched(&w, n, n_out, spec);
            let ours = output_error(&w, n, n_out, spec, &s, &z, &h);
            let search = output_error(&w, n, n_out, spec, &ss, &sz, &h);
            assert!(ours <= search * (1.0 + 1e-12), "{spec:?}: {ours} > the weight search's {search}");
            let d = direct(&x, n, &w, n_out, spec, &s, &z);
            assert!((ours - d).abs() <= 1e-9 * d, "{spec:?}: d^T H d {ours} against ||X dW||^2 {d}");
            // the outlier channel makes the two objectives part ways
            if spec.bits == 2 && spec.scheme == QuantScheme::Sym {
                assert!(ours < search, "{spec:?}: no better than the weight search");
            }
            // deterministic: the same bits again
            let again = init_learned_activation(&w, n, n_out, spec, &h);
            assert_eq!(
                (s.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), z.len()),
                (again.0.iter().map(|v| v.to_bits()).collect(), again.1.len())
            );
            assert_eq!(z.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), again.1.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
    }
}
