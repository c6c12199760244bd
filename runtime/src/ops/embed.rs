//! Embedding lookup and its adjoint.

use super::expect_len;
use crate::float::{Float, WideSum};

fn row_of(id: i32, rows: usize) -> Result<usize, String> {
    usize::try_from(id).ok().filter(|&r| r < rows).ok_or_else(|| format!("id {id} out of range [0, {rows})"))
}

/// (table [V, C], ids [..]) -> [.., C]
pub fn gather<T: Float>(table_shape: &[usize], table: &[T], ids: &[i32]) -> Result<Vec<T>, String> {
    let [v, c] = table_shape else {
        return Err(format!("gather table must be [V, C], got {table_shape:?}"));
    };
    let (v, c) = (*v, *c);
    expect_len("table", table.len(), v * c)?;
    let mut out = Vec::with_capacity(ids.len() * c);
    for &id in ids {
        let r = row_of(id, v)?;
        out.extend_from_slice(&table[r * c..(r + 1) * c]);
    }
    Ok(out)
}

/// (ids [..], dy [.., C]) -> [rows, C], rows hit several times summing their dy rows, in f64
/// ([`WideSum`]), each sum rounded once to `T`.
pub fn scatter_add<T: Float>(ids: &[i32], dy: &[T], rows: usize, c: usize) -> Result<Vec<T>, String> {
    expect_len("dy", dy.len(), ids.len() * c)?;
    let mut out = vec![WideSum::default(); rows * c];
    for (&id, d) in ids.iter().zip(dy.chunks_exact(c.max(1))) {
        let r = row_of(id, rows)?;
        for (o, &v) in out[r * c..(r + 1) * c].iter_mut().zip(d) {
            o.add(v);
        }
    }
    Ok(out.into_iter().map(WideSum::round).collect())
}
