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
/// batch by batch in row order (deterministic).
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

    /// Adds the rows of x [rows, n] (a trailing partial row is ignored).
    pub fn add(&mut self, x: &[f32]) {
        let n = self.n;
        let rows = x.len() / n;
        // row i of H is its own sum: rows of H in parallel, each over X's rows in order
        self.h.par_chunks_mut(n).enumerate().for_each(|(i, hi)| {
            for r in 0..rows {
                let xr = &x[r * n..(r + 1) * n];
                let xi = f64::from(xr[i]);
                if xi == 0.0 {
                    continue;
                }
                for (h, &v) in hi.iter_mut().zip(xr) {
                    *h += xi * f64::from(v);
                }
            }
        });
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
    let gsz = spec.group_for(n_in);
    let cols: Vec<f64> = (0..n_out)
        .into_par_iter()
        .map(|j| {
            let mut d = Vec::with_capacity(n_in);
            for g in 0..n_in / gsz {
                let si = g * n_out + j;
                d.extend(deviation(spec, w, n_out, j, g * gsz..(g + 1) * gsz, scales[si], zeros.get(si).copied().unwrap_or(0.0)));
            }
            (0..n_in).map(|a| d[a] * (0..n_in).map(|b| gram.at(a, b) * d[b]).sum::<f64>()).sum()
        })
        .collect();
    cols.iter().sum()
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
    let (mm_s, mm_z) = init_learned(w, n_in, n_out, spec);
    let (mut scales, mut zeros) = init_learned_searched(w, n_in, n_out, spec);
    let asym = spec.scheme.has_zero_point();
    let gsz = spec.group_for(n_in);
    let groups = n_in / gsz;
    let at = |v: &[f32], si: usize| v.get(si).copied().unwrap_or(0.0);
    let chosen: Vec<Vec<(f32, f32)>> = (0..n_out)
        .into_par_iter()
        .map(|j| {
            let mut cur: Vec<(f32, f32)> = (0..groups).map(|g| (scales[g * n_out + j], at(&zeros, g * n_out + j))).collect();
            let mut d: Vec<f64> = Vec::with_capacity(n_in);
            for (g, &(s, z)) in cur.iter().enumerate() {
                d.extend(deviation(spec, w, n_out, j, g * gsz..(g + 1) * gsz, s, z));
            }
            // r = H d, kept up to date as groups change
            let mut r: Vec<f64> = (0..n_in).map(|a| (0..n_in).map(|b| gram.at(a, b) * d[b]).sum()).collect();
            for _ in 0..SWEEPS {
                let mut changed = false;
                for (g, now) in cur.iter_mut().enumerate() {
                    let si = g * n_out + j;
                    let base = g * gsz;
                    // the change of d^T H d when d's group g moves by delta: delta^T H_gg delta + 2 delta . r_g
                    let mut best: Option<(f64, Vec<f64>, (f32, f32))> = None; // (change, new deviation, candidate)
                    for c in candidates(spec, mm_s[si], at(&mm_z, si)) {
                        if c == *now {
                            continue;
                        }
                        let nd = deviation(spec, w, n_out, j, base..base + gsz, c.0, c.1);
                        let delta: Vec<f64> = nd.iter().zip(&d[base..base + gsz]).map(|(a, b)| a - b).collect();
                        let mut change = 0.0;
                        for (a, &da) in delta.iter().enumerate() {
                            if da == 0.0 {
                                continue;
                            }
                            let hd: f64 = delta.iter().enumerate().map(|(b, &db)| gram.at(base + a, base + b) * db).sum();
                            change += da * (hd + 2.0 * r[base + a]);
                        }
                        if change < best.as_ref().map_or(0.0, |b| b.0) {
                            best = Some((change, nd, c));
                        }
                    }
                    let Some((_, nd, c)) = best else { continue };
                    let delta: Vec<f64> = nd.iter().zip(&d[base..base + gsz]).map(|(a, b)| a - b).collect();
                    for (a, ra) in r.iter_mut().enumerate() {
                        *ra += delta.iter().enumerate().map(|(b, &db)| gram.at(a, base + b) * db).sum::<f64>();
                    }
                    d[base..base + gsz].copy_from_slice(&nd);
                    *now = c;
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
