//! Batched matmul on matrixmultiply's dgemm ([`Float::gemm`]: f32 operands widened, each result
//! rounded once). A transposed operand is the same buffer read with its row and column strides
//! swapped, so `ta`/`tb` cost no copy.

use crate::float::Float;

/// (a [.., M, K], b [.., K, N]) -> [.., M, N], a read as [.., K, M] when `ta`, b as [.., N, K]
/// when `tb`. `out_shape` is the node's type; the batch dims are equal on all three.
pub fn matmul<T: Float>(
    a_shape: &[usize],
    a: &[T],
    b_shape: &[usize],
    b: &[T],
    ta: bool,
    tb: bool,
    out_shape: &[usize],
) -> Result<Vec<T>, String> {
    let r = out_shape.len();
    if r < 2 || a_shape.len() != r || b_shape.len() != r {
        return Err(format!("matmul of {a_shape:?} x {b_shape:?} to {out_shape:?}: ranks differ or are below 2"));
    }
    let (m, n) = (out_shape[r - 2], out_shape[r - 1]);
    let (am, ak) = if ta { (a_shape[r - 1], a_shape[r - 2]) } else { (a_shape[r - 2], a_shape[r - 1]) };
    let (bk, bn) = if tb { (b_shape[r - 1], b_shape[r - 2]) } else { (b_shape[r - 2], b_shape[r - 1]) };
    let batch_ok = a_shape[..r - 2] == out_shape[..r - 2] && b_shape[..r - 2] == out_shape[..r - 2];
    if am != m || bn != n || ak != bk || !batch_ok {
        return Err(format!("matmul of {a_shape:?} x {b_shape:?} (ta={ta}, tb={tb}) cannot give {out_shape:?}"));
    }
    let k = ak;
    let batch: usize = out_shape[..r - 2].iter().product();
    let (a_mat, b_mat, c_mat) = (m * k, k * n, m * n);
    if a.len() != batch * a_mat || b.len() != batch * b_mat {
        return Err(format!(
            "matmul operands hold {} and {} elements, their types need {} and {}",
            a.len(),
            b.len(),
            batch * a_mat,
            batch * b_mat
        ));
    }
    let mut c = vec![T::ZERO; batch * c_mat];
    if c_mat == 0 || k == 0 {
        // Empty products: C is all zeros (already), and gemm would get dangling pointers.
        return Ok(c);
    }
    // Row-major [M, K] has strides (K, 1); stored transposed ([K, M]) it reads as (1, M).
    let (rsa, csa) = if ta { (1, m) } else { (k, 1) };
    let (rsb, csb) = if tb { (1, k) } else { (n, 1) };
    for ((ab, bb), cb) in a.chunks_exact(a_mat).zip(b.chunks_exact(b_mat)).zip(c.chunks_exact_mut(c_mat)) {
        // SAFETY: `ab` holds m*k elements and (rsa, csa) address exactly its row-major [M, K] or
        // [K, M] layout, so every A element read is in bounds; likewise `bb` with k*n elements.
        // `cb` holds m*n elements addressed row-major with strides (n, 1): in bounds and
        // non-aliasing; it is a unique borrow, disjoint from `a` and `b`.
        unsafe {
            T::gemm(
                m,
                k,
                n,
                ab.as_ptr(),
                rsa as isize,
                csa as isize,
                bb.as_ptr(),
                rsb as isize,
                csb as isize,
                cb.as_mut_ptr(),
                n as isize,
                1,
            );
        }
    }
    Ok(c)
}
