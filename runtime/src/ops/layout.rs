//! Shape ops: broadcast, sum_to, transpose, slice, concat. All but sum_to are element copies and
//! generic over the element, so they serve float and integer tensors alike.

use super::expect_len;
use crate::float::{Float, WideSum};

/// Row-major strides in elements.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Calls `f(out_index, src_offset)` for every element of an `out_shape` tensor read from a source
/// at `base + sum(idx[d] * src_strides[d])`, in row-major output order. The innermost dim runs
/// as a tight loop because it is where nearly all the elements are.
fn for_each_strided(out_shape: &[usize], src_strides: &[usize], base: usize, mut f: impl FnMut(usize, usize)) {
    let n: usize = out_shape.iter().product();
    if n == 0 {
        return;
    }
    let Some((&inner, outer_dims)) = out_shape.split_last() else {
        f(0, base);
        return;
    };
    let inner_stride = src_strides[outer_dims.len()];
    let mut idx = vec![0usize; outer_dims.len()];
    let mut off = base;
    let mut o = 0;
    loop {
        for i in 0..inner {
            f(o + i, off + i * inner_stride);
        }
        o += inner;
        // Odometer over the outer dims, keeping `off` in step.
        let mut d = outer_dims.len();
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            off += src_strides[d];
            if idx[d] < outer_dims[d] {
                break;
            }
            off -= idx[d] * src_strides[d];
            idx[d] = 0;
        }
    }
}

fn strided_copy<E: Copy>(src: &[E], out_shape: &[usize], src_strides: &[usize], base: usize) -> Vec<E> {
    let mut out = Vec::with_capacity(out_shape.iter().product());
    for_each_strided(out_shape, src_strides, base, |_, s| out.push(src[s]));
    out
}

/// Source strides for reading `in_shape` as if it had `out_shape` (numpy trailing alignment): a
/// broadcast (size-1 or missing) dim gets stride 0.
fn broadcast_strides(in_shape: &[usize], out_shape: &[usize]) -> Result<Vec<usize>, String> {
    if in_shape.len() > out_shape.len() {
        return Err(format!("cannot broadcast {in_shape:?} to {out_shape:?}"));
    }
    let off = out_shape.len() - in_shape.len();
    let is = strides(in_shape);
    let mut s = vec![0; out_shape.len()];
    for (i, &d) in in_shape.iter().enumerate() {
        if d == out_shape[i + off] {
            s[i + off] = is[i];
        } else if d != 1 {
            return Err(format!("cannot broadcast {in_shape:?} to {out_shape:?}"));
        }
    }
    Ok(s)
}

pub fn broadcast<E: Copy>(in_shape: &[usize], x: &[E], out_shape: &[usize]) -> Result<Vec<E>, String> {
    expect_len("operand", x.len(), in_shape.iter().product())?;
    let s = broadcast_strides(in_shape, out_shape)?;
    Ok(strided_copy(x, out_shape, &s, 0))
}

/// Broadcast's adjoint: every input element is added into the output element it was broadcast
/// from, in input order, in f64 ([`WideSum`]), each sum rounded once to `T`.
pub fn sum_to<T: Float>(in_shape: &[usize], x: &[T], out_shape: &[usize]) -> Result<Vec<T>, String> {
    expect_len("operand", x.len(), in_shape.iter().product())?;
    // Walking the input in order with the output's broadcast strides maps each input element to
    // the output element it sums into.
    let s = broadcast_strides(out_shape, in_shape)?;
    let mut out = vec![WideSum::default(); out_shape.iter().product()];
    for_each_strided(in_shape, &s, 0, |i, o| out[o].add(x[i]));
    Ok(out.into_iter().map(WideSum::round).collect())
}

/// `out.dims[i] = in.dims[perm[i]]`
pub fn transpose<E: Copy>(in_shape: &[usize], x: &[E], perm: &[usize]) -> Result<Vec<E>, String> {
    expect_len("operand", x.len(), in_shape.iter().product())?;
    if perm.len() != in_shape.len() || perm.iter().any(|&p| p >= in_shape.len()) {
        return Err(format!("perm {perm:?} does not fit shape {in_shape:?}"));
    }
    let is = strides(in_shape);
    let out_shape: Vec<usize> = perm.iter().map(|&p| in_shape[p]).collect();
    let s: Vec<usize> = perm.iter().map(|&p| is[p]).collect();
    Ok(strided_copy(x, &out_shape, &s, 0))
}

/// Elements [start, end) along `axis`.
pub fn slice<E: Copy>(in_shape: &[usize], x: &[E], axis: usize, start: usize, end: usize) -> Result<Vec<E>, String> {
    expect_len("operand", x.len(), in_shape.iter().product())?;
    if axis >= in_shape.len() || start > end || end > in_shape[axis] {
        return Err(format!("slice axis {axis} [{start}, {end}) out of range for {in_shape:?}"));
    }
    let is = strides(in_shape);
    let mut out_shape = in_shape.to_vec();
    out_shape[axis] = end - start;
    Ok(strided_copy(x, &out_shape, &is, start * is[axis]))
}

/// Joins parts along `axis`: for each index of the dims before `axis`, each part contributes its
/// contiguous block of `dims[axis] * inner` elements in turn.
pub fn concat<E: Copy>(parts: &[(&[usize], &[E])], axis: usize) -> Result<Vec<E>, String> {
    let Some(&(first, _)) = parts.first() else {
        return Err("concat of nothing".into());
    };
    if axis >= first.len() {
        return Err(format!("concat axis {axis} out of range for {first:?}"));
    }
    let outer: usize = first[..axis].iter().product();
    let inner: usize = first[axis + 1..].iter().product();
    let mut total = 0;
    for (i, (shape, data)) in parts.iter().enumerate() {
        expect_len(&format!("operand {i}"), data.len(), shape.iter().product())?;
        if shape.len() != first.len() || (0..first.len()).any(|d| d != axis && shape[d] != first[d]) {
            return Err(format!("concat along {axis}: {shape:?} does not fit {first:?}"));
        }
        total += data.len();
    }
    let mut out = Vec::with_capacity(total);
    for o in 0..outer {
        for (shape, data) in parts {
            let block = shape[axis] * inner;
            out.extend_from_slice(&data[o * block..(o + 1) * block]);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_walk_handles_scalars_and_empty() {
        assert_eq!(broadcast::<i32>(&[], &[7], &[2, 2]).unwrap(), vec![7; 4]);
        assert_eq!(broadcast::<i32>(&[], &[7], &[]).unwrap(), vec![7]);
        assert!(broadcast::<i32>(&[0], &[], &[3, 0]).unwrap().is_empty());
        assert!(broadcast::<i32>(&[2], &[1, 2], &[3]).is_err());
    }
}
