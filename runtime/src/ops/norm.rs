//! LayerNorm and its two backward ops. Statistics accumulate in `T`, so f32 mode rounds like f32
//! device code and f64 mode is the accurate reference.

use super::{expect_len, par_chunks};
use crate::float::Float;

/// Mean and 1/sqrt(var + eps) of one row, var biased (divided by C) as PyTorch's LayerNorm.
#[inline]
fn stats<T: Float>(row: &[T], eps: T) -> (T, T) {
    let n = T::from_f64(row.len() as f64);
    let mut sum = T::ZERO;
    for &v in row {
        sum += v;
    }
    let mean = sum / n;
    let mut var = T::ZERO;
    for &v in row {
        let d = v - mean;
        var += d * d;
    }
    (mean, T::ONE / (var / n + eps).sqrt())
}

fn check<T>(x: &[T], c: usize, gamma: &[T]) -> Result<(), String> {
    expect_len("gamma", gamma.len(), c)?;
    if c == 0 || !x.len().is_multiple_of(c) {
        return Err(format!("x holds {} elements, not whole rows of {c}", x.len()));
    }
    Ok(())
}

/// `(x [.., C], gamma [C], beta [C]) -> xhat * gamma + beta`, row-wise over C.
pub fn layernorm<T: Float>(x: &[T], gamma: &[T], beta: &[T], eps: f64) -> Result<Vec<T>, String> {
    let c = gamma.len();
    check(x, c, gamma)?;
    expect_len("beta", beta.len(), c)?;
    let eps = T::from_f64(eps);
    let mut out = vec![T::ZERO; x.len()];
    par_chunks(&mut out, c, |start, chunk| {
        for (r, orow) in chunk.chunks_exact_mut(c).enumerate() {
            let row = &x[start + r * c..start + (r + 1) * c];
            let (mean, rstd) = stats(row, eps);
            for j in 0..c {
                orow[j] = (row[j] - mean) * rstd * gamma[j] + beta[j];
            }
        }
    });
    Ok(out)
}

/// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma.
pub fn layernorm_grad_x<T: Float>(x: &[T], gamma: &[T], dy: &[T], eps: f64) -> Result<Vec<T>, String> {
    let c = gamma.len();
    check(x, c, gamma)?;
    expect_len("dy", dy.len(), x.len())?;
    let eps = T::from_f64(eps);
    let n = T::from_f64(c as f64);
    let mut out = vec![T::ZERO; x.len()];
    par_chunks(&mut out, c, |start, chunk| {
        for (r, orow) in chunk.chunks_exact_mut(c).enumerate() {
            let base = start + r * c;
            let (row, drow) = (&x[base..base + c], &dy[base..base + c]);
            let (mean, rstd) = stats(row, eps);
            let (mut mg, mut mgx) = (T::ZERO, T::ZERO);
            for j in 0..c {
                let g = drow[j] * gamma[j];
                mg += g;
                mgx += g * (row[j] - mean) * rstd;
            }
            let (mg, mgx) = (mg / n, mgx / n);
            for j in 0..c {
                let xhat = (row[j] - mean) * rstd;
                orow[j] = rstd * (drow[j] * gamma[j] - mg - xhat * mgx);
            }
        }
    });
    Ok(out)
}

/// `dgamma [C]` = sum over rows of dy * xhat.
pub fn layernorm_grad_gamma<T: Float>(x: &[T], dy: &[T], c: usize, eps: f64) -> Result<Vec<T>, String> {
    if c == 0 || !x.len().is_multiple_of(c) {
        return Err(format!("x holds {} elements, not whole rows of {c}", x.len()));
    }
    expect_len("dy", dy.len(), x.len())?;
    let eps = T::from_f64(eps);
    let mut out = vec![T::ZERO; c];
    for (row, drow) in x.chunks_exact(c).zip(dy.chunks_exact(c)) {
        let (mean, rstd) = stats(row, eps);
        for j in 0..c {
            out[j] += drow[j] * (row[j] - mean) * rstd;
        }
    }
    Ok(out)
}
