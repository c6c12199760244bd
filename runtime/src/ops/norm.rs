//! LayerNorm and its two backward ops. A row's statistics, sums and the result's arithmetic are
//! f64 ([`WideSum`]), each result rounded once to `T`.

use super::{expect_len, par_chunks};
use crate::float::{Float, WideSum};

/// Mean and 1/sqrt(var + eps) of one row, var biased (divided by C) as PyTorch's LayerNorm.
#[inline]
fn stats<T: Float>(row: &[T], eps: f64) -> (f64, f64) {
    let n = row.len() as f64;
    let mut sum = WideSum::default();
    for &v in row {
        sum.add(v);
    }
    let mean = sum.wide() / n;
    let mut var = WideSum::default();
    for &v in row {
        let d = v.to_f64() - mean;
        var.add(d * d);
    }
    (mean, 1.0 / (var.wide() / n + eps).sqrt())
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
    let mut out = vec![T::ZERO; x.len()];
    par_chunks(&mut out, c, |start, chunk| {
        for (r, orow) in chunk.chunks_exact_mut(c).enumerate() {
            let row = &x[start + r * c..start + (r + 1) * c];
            let (mean, rstd) = stats(row, eps);
            for j in 0..c {
                orow[j] = T::from_f64((row[j].to_f64() - mean) * rstd * gamma[j].to_f64() + beta[j].to_f64());
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
    let n = c as f64;
    let mut out = vec![T::ZERO; x.len()];
    par_chunks(&mut out, c, |start, chunk| {
        for (r, orow) in chunk.chunks_exact_mut(c).enumerate() {
            let base = start + r * c;
            let (row, drow) = (&x[base..base + c], &dy[base..base + c]);
            let (mean, rstd) = stats(row, eps);
            let (mut mg, mut mgx) = (WideSum::default(), WideSum::default());
            for j in 0..c {
                let g = drow[j].to_f64() * gamma[j].to_f64();
                mg.add(g);
                mgx.add(g * (row[j].to_f64() - mean) * rstd);
            }
            let (mg, mgx) = (mg.wide() / n, mgx.wide() / n);
            for j in 0..c {
                let xhat = (row[j].to_f64() - mean) * rstd;
                orow[j] = T::from_f64(rstd * (drow[j].to_f64() * gamma[j].to_f64() - mg - xhat * mgx));
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
    let mut out = vec![WideSum::default(); c];
    for (row, drow) in x.chunks_exact(c).zip(dy.chunks_exact(c)) {
        let (mean, rstd) = stats(row, eps);
        for j in 0..c {
            out[j].add(drow[j].to_f64() * (row[j].to_f64() - mean) * rstd);
        }
    }
    Ok(out.into_iter().map(WideSum::round).collect())
}
