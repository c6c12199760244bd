//! Softmax (attention) and cross-entropy (the loss), each with its backward.

use super::{expect_len, par_chunks};
use crate::float::Float;

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
    let scale = T::from_f64(scale);
    let mut out = vec![T::ZERO; x.len()];
    if s == 0 {
        return Ok(out);
    }
    par_chunks(&mut out, s, |start, chunk| {
        for (k, orow) in chunk.chunks_exact_mut(s).enumerate() {
            let row_idx = start / s + k;
            let row = &x[row_idx * s..(row_idx + 1) * s];
            let valid = if causal { row_idx % t + 1 } else { s };
            let mut max = T::NEG_INFINITY;
            for &v in &row[..valid] {
                let z = scale * v;
                if z > max {
                    max = z;
                }
            }
            let mut sum = T::ZERO;
            for j in 0..valid {
                let e = (scale * row[j] - max).exp();
                orow[j] = e;
                sum += e;
            }
            for o in &mut orow[..valid] {
                *o /= sum;
            }
            // orow[valid..] stays exactly 0.
        }
    });
    Ok(out)
}

/// dx = scale * y * (dy - sum_j dy_j y_j), row-wise over the last dim.
pub fn softmax_grad<T: Float>(s: usize, y: &[T], dy: &[T], scale: f64) -> Result<Vec<T>, String> {
    expect_len("dy", dy.len(), y.len())?;
    let scale = T::from_f64(scale);
    let mut out = vec![T::ZERO; y.len()];
    if s == 0 {
        return Ok(out);
    }
    par_chunks(&mut out, s, |start, chunk| {
        for (k, orow) in chunk.chunks_exact_mut(s).enumerate() {
            let base = start + k * s;
            let (yr, dr) = (&y[base..base + s], &dy[base..base + s]);
            let mut dot = T::ZERO;
            for j in 0..s {
                dot += dr[j] * yr[j];
            }
            for j in 0..s {
                orow[j] = scale * yr[j] * (dr[j] - dot);
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
fn max_sumexp<T: Float>(row: &[T]) -> (T, T) {
    let mut max = T::NEG_INFINITY;
    for &v in row {
        if v > max {
            max = v;
        }
    }
    let mut sum = T::ZERO;
    for &v in row {
        sum += (v - max).exp();
    }
    (max, sum)
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
    let mut total = T::ZERO;
    for (row, &t) in logits.chunks_exact(v).zip(targets) {
        let c = target_of(t, v)?;
        let (max, sum) = max_sumexp(row);
        total += max + sum.ln() - row[c];
    }
    Ok(total / T::from_f64(targets.len() as f64))
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
    let k = dloss / T::from_f64(targets.len() as f64);
    let mut out = vec![T::ZERO; logits.len()];
    par_chunks(&mut out, v, |start, chunk| {
        for (r, orow) in chunk.chunks_exact_mut(v).enumerate() {
            let n = start / v + r;
            let row = &logits[n * v..(n + 1) * v];
            let (max, sum) = max_sumexp(row);
            for j in 0..v {
                orow[j] = k * ((row[j] - max).exp() / sum);
            }
            // In range: checked above.
            if let Ok(c) = usize::try_from(targets[n]) {
                orow[c] -= k;
            }
        }
    });
    Ok(out)
}
