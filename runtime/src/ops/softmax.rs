//! Softmax (attention) and cross-entropy (the loss), each with its backward. Exponentials, sums,
//! log-sum-exp and each result's arithmetic are f64 ([`WideSum`]), each result rounded once to
//! `T`.

use super::{expect_len, par_chunks};
use crate::float::{Float, WideSum};

/// Row-wise softmax of `scale * x` over the last dim S, with max subtraction. With `causal`, row
/// i of each trailing [T, S] matrix keeps only columns j <= i; the others are exactly 0.
pub fn softmax<T: Float>(shape: &[usize], x: &[T], scale: f64, causal: bool) -> Result<Vec<T>, String> {
    let r = shape.len();
    let Some(&s) = shape.last() else {
        return Err("softmax of a scalar".into());
    };
    expect_len("x", x.len(), shape.iter().product())?;
    let t = if causal {
        match shape.get(r.wrapping_sub(2)) {
            Some(&t) if r >= 2 && t == s => t,
            _ => return Err(format!("causal softmax needs square trailing dims, got {shape:?}")),
        }
    } else {
        1
    };
    let mut out = vec![T::ZERO; x.len()];
    if s == 0 {
        return Ok(out);
    }
    par_chunks(&mut out, s, |start, chunk| {
        // a row's exponentials, unrounded until divided by their sum
        let mut e = vec![0f64; s];
        for (k, orow) in chunk.chunks_exact_mut(s).enumerate() {
            let row_idx = start / s + k;
            let row = &x[row_idx * s..(row_idx + 1) * s];
            let valid = if causal { row_idx % t + 1 } else { s };
            let mut max = f64::NEG_INFINITY;
            for &v in &row[..valid] {
                let z = scale * v.to_f64();
                if z > max {
                    max = z;
                }
            }
            let mut sum = WideSum::default();
            for j in 0..valid {
                e[j] = (scale * row[j].to_f64() - max).exp();
                sum.add(e[j]);
            }
            for (o, &e) in orow[..valid].iter_mut().zip(&e) {
                *o = T::from_f64(e / sum.wide());
            }
            // orow[valid..] stays exactly 0.
        }
    });
    Ok(out)
}

/// The causal softmax of packed sequences: x [B, NH, T, T], row i of batch b over the keys
/// i - positions[b, i] ..= i (clamped to 0 ..= i: its own example's tokens so far), exactly 0
/// elsewhere; each row as `softmax` computes one.
pub fn packed_softmax<T: Float>(shape: &[usize], x: &[T], positions: &[i32], scale: f64) -> Result<Vec<T>, String> {
    let &[b, nh, t, s] = shape else {
        return Err(format!("packed_softmax needs x [B, NH, T, T], got {shape:?}"));
    };
    if t != s {
        return Err(format!("packed_softmax needs square trailing dims, got {shape:?}"));
    }
    expect_len("x", x.len(), shape.iter().product())?;
    expect_len("positions", positions.len(), b * t)?;
    let mut out = vec![T::ZERO; x.len()];
    if t == 0 {
        return Ok(out);
    }
    par_chunks(&mut out, t, |start, chunk| {
        let mut e = vec![0f64; t];
        for (k, orow) in chunk.chunks_exact_mut(t).enumerate() {
            let r = start / t + k;
            let (bi, i) = (r / (nh * t), r % t);
            let back = i64::from(positions[bi * t + i]).clamp(0, i as i64) as usize;
            let lo = i - back;
            let row = &x[r * t..(r + 1) * t];
            let mut max = f64::NEG_INFINITY;
            for &v in &row[lo..=i] {
                max = max.max(scale * v.to_f64());
            }
            let mut sum = WideSum::default();
            for j in lo..=i {
                e[j] = (scale * row[j].to_f64() - max).exp();
                sum.add(e[j]);
            }
            for j in lo..=i {
                orow[j] = T::from_f64(e[j] / sum.wide());
            }
        }
    });
    Ok(out)
}

/// dx = scale * y * (dy - sum_j dy_j y_j), row-wise over the last dim.
pub fn softmax_grad<T: Float>(s: usize, y: &[T], dy: &[T], scale: f64) -> Result<Vec<T>, String> {
    expect_len("dy", dy.len(), y.len())?;
    let mut out = vec![T::ZERO; y.len()];
    if s == 0 {
        return Ok(out);
    }
    par_chunks(&mut out, s, |start, chunk| {
        for (k, orow) in chunk.chunks_exact_mut(s).enumerate() {
            let base = start + k * s;
            let (yr, dr) = (&y[base..base + s], &dy[base..base + s]);
            let mut dot = WideSum::default();
            for j in 0..s {
                dot.add_product(dr[j], yr[j]);
            }
            for j in 0..s {
                orow[j] = T::from_f64(scale * yr[j].to_f64() * (dr[j].to_f64() - dot.wide()));
            }
        }
    });
    Ok(out)
}

fn target_of(t: i32, v: usize) -> Result<usize, String> {
    usize::try_from(t).ok().filter(|&c| c < v).ok_or_else(|| format!("target {t} out of range [0, {v})"))
}

/// (max, sum of exp(x - max)) of one row: logsumexp = max + ln(sum).
#[inline]
fn max_sumexp<T: Float>(row: &[T]) -> (f64, f64) {
    let mut max = f64::NEG_INFINITY;
    for &v in row {
        if v.to_f64() > max {
            max = v.to_f64();
        }
    }
    let mut sum = WideSum::default();
    for &v in row {
        sum.add((v.to_f64() - max).exp());
    }
    (max, sum.wide())
}

fn check_nv<T>(logits: &[T], targets: &[i32], v: usize) -> Result<(), String> {
    expect_len("logits", logits.len(), targets.len() * v)
}

/// `(logits [N, V], targets [N]) -> mean over rows of logsumexp(row) - row[target]`.
pub fn cross_entropy<T: Float>(logits: &[T], targets: &[i32], v: usize) -> Result<T, String> {
    check_nv(logits, targets, v)?;
    if v == 0 || targets.is_empty() {
        return Err(format!("cross_entropy over {} rows of {v} classes", targets.len()));
    }
    let mut total = WideSum::default();
    for (row, &t) in logits.chunks_exact(v).zip(targets) {
        let c = target_of(t, v)?;
        let (max, sum) = max_sumexp(row);
        total.add(max + sum.ln() - row[c].to_f64());
    }
    Ok(T::from_f64(total.wide() / targets.len() as f64))
}

/// dlogits = dloss / N * (softmax(row) - onehot(target)).
pub fn cross_entropy_grad<T: Float>(logits: &[T], targets: &[i32], v: usize, dloss: T) -> Result<Vec<T>, String> {
    check_nv(logits, targets, v)?;
    if v == 0 || targets.is_empty() {
        return Err(format!("cross_entropy over {} rows of {v} classes", targets.len()));
    }
    // Validate up front so the parallel part cannot fail.
    for &t in targets {
        target_of(t, v)?;
    }
    let k = dloss.to_f64() / targets.len() as f64;
    let mut out = vec![T::ZERO; logits.len()];
    par_chunks(&mut out, v, |start, chunk| {
        for (r, orow) in chunk.chunks_exact_mut(v).enumerate() {
            let n = start / v + r;
            let row = &logits[n * v..(n + 1) * v];
            let (max, sum) = max_sumexp(row);
            let p = |j: usize| k * ((row[j].to_f64() - max).exp() / sum);
            for (j, o) in orow.iter_mut().enumerate() {
                *o = T::from_f64(p(j));
            }
            // In range: checked above.
            if let Ok(c) = usize::try_from(targets[n]) {
                orow[c] = T::from_f64(p(c) - k);
            }
        }
    });
    Ok(out)
}

fn check_weights<T: Float>(weights: &[T], targets: &[i32]) -> Result<(), String> {
    expect_len("weights", weights.len(), targets.len())
}

/// `(logits [N, V], targets [N], weights [N]) -> sum over rows of weights[i] (logsumexp(row) -
/// row[target])`: the loss of instruction data, whose host-given weights are 0 where a token does
/// not count and sum to 1 over the step.
pub fn weighted_cross_entropy<T: Float>(logits: &[T], targets: &[i32], weights: &[T], v: usize) -> Result<T, String> {
    check_nv(logits, targets, v)?;
    check_weights(weights, targets)?;
    if v == 0 || targets.is_empty() {
        return Err(format!("weighted_cross_entropy over {} rows of {v} classes", targets.len()));
    }
    let mut total = WideSum::default();
    for ((row, &t), &w) in logits.chunks_exact(v).zip(targets).zip(weights) {
        let c = target_of(t, v)?;
        let (max, sum) = max_sumexp(row);
        total.add(w.to_f64() * (max + sum.ln() - row[c].to_f64()));
    }
    Ok(T::from_f64(total.wide()))
}

/// dlogits = dloss * weights[i] * (softmax(row) - onehot(target)), row by row.
pub fn weighted_cross_entropy_grad<T: Float>(logits: &[T], targets: &[i32], weights: &[T], v: usize, dloss: T) -> Result<Vec<T>, String> {
    check_nv(logits, targets, v)?;
    check_weights(weights, targets)?;
    if v == 0 || targets.is_empty() {
        return Err(format!("weighted_cross_entropy over {} rows of {v} classes", targets.len()));
    }
    for &t in targets {
        target_of(t, v)?;
    }
    let mut out = vec![T::ZERO; logits.len()];
    par_chunks(&mut out, v, |start, chunk| {
        for (r, orow) in chunk.chunks_exact_mut(v).enumerate() {
            let n = start / v + r;
            let k = dloss.to_f64() * weights[n].to_f64();
            let row = &logits[n * v..(n + 1) * v];
            let (max, sum) = max_sumexp(row);
            let p = |j: usize| k * ((row[j].to_f64() - max).exp() / sum);
            for (j, o) in orow.iter_mut().enumerate() {
                *o = T::from_f64(p(j));
            }
            if let Ok(c) = usize::try_from(targets[n]) {
                orow[c] = T::from_f64(p(c) - k);
            }
        }
    });
    Ok(out)
}
