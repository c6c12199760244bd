//! matmul in all four ta/tb combinations, with batch dims and odd sizes, against a triple loop.

mod common;

use common::{assert_close, run_op, In, Rng};
use qatc_ir::Op;

/// C[b, i, j] = sum_p A(b, i, p) B(b, p, j), reading A as [K, M] when ta and B as [N, K] when tb.
#[allow(clippy::too_many_arguments)]
fn naive(a: &[f64], b: &[f64], batch: usize, m: usize, k: usize, n: usize, ta: bool, tb: bool) -> Vec<f64> {
    let mut c = vec![0.0; batch * m * n];
    for bt in 0..batch {
        let (a, b) = (&a[bt * m * k..], &b[bt * k * n..]);
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0;
                for p in 0..k {
                    let av = if ta { a[p * m + i] } else { a[i * k + p] };
                    let bv = if tb { b[j * k + p] } else { b[p * n + j] };
                    s += av * bv;
                }
                c[bt * m * n + i * n + j] = s;
            }
        }
    }
    c
}

fn check(batch_dims: &[usize], m: usize, k: usize, n: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let batch: usize = batch_dims.iter().product();
    for ta in [false, true] {
        for tb in [false, true] {
            let a = rng.vec(batch * m * k, -1.0, 1.0);
            let b = rng.vec(batch * k * n, -1.0, 1.0);
            let mut sa = batch_dims.to_vec();
            sa.extend(if ta { [k, m] } else { [m, k] });
            let mut sb = batch_dims.to_vec();
            sb.extend(if tb { [n, k] } else { [k, n] });
            let ins = [In::f(&sa, &a), In::f(&sb, &b)];
            let want = naive(&a, &b, batch, m, k, n, ta, tb);
            let got = run_op::<f64>(Op::MatMul { ta, tb }, &ins);
            assert_close(&got, &want, 1e-12, 1e-13);
            // f32 mode: k terms of magnitude <= 1, each rounded to 2^-24 relative.
            let got32 = run_op::<f32>(Op::MatMul { ta, tb }, &ins);
            assert_close(&got32, &want, 1e-5, 1e-6 * k as f64);
        }
    }
}

#[test]
fn matmul_plain_odd_sizes() {
    check(&[], 3, 50, 7, 1);
    check(&[], 50, 7, 3, 2);
    check(&[], 7, 3, 50, 3);
    check(&[], 1, 1, 1, 4);
}

#[test]
fn matmul_batched_odd_sizes() {
    check(&[2], 3, 50, 7, 5);
    check(&[2, 3], 7, 3, 50, 6);
    check(&[3, 1, 2], 50, 7, 3, 7);
}

#[test]
fn matmul_large_enough_to_thread() {
    // Sizes past matrixmultiply's blocking (and its threading threshold), odd on purpose.
    check(&[], 129, 257, 65, 8);
}

#[test]
fn matmul_hand_checked() {
    // [[1, 2], [3, 4]] x [[5, 6], [7, 8]] = [[19, 22], [43, 50]]
    let ins = [In::f(&[2, 2], &[1.0, 2.0, 3.0, 4.0]), In::f(&[2, 2], &[5.0, 6.0, 7.0, 8.0])];
    assert_eq!(run_op::<f32>(Op::MatMul { ta: false, tb: false }, &ins), vec![19.0, 22.0, 43.0, 50.0]);
    // A^T B = [[1, 3], [2, 4]] x B = [[26, 30], [38, 44]]
    assert_eq!(run_op::<f64>(Op::MatMul { ta: true, tb: false }, &ins), vec![26.0, 30.0, 38.0, 44.0]);
    // A B^T = [[17, 23], [39, 53]]
    assert_eq!(run_op::<f64>(Op::MatMul { ta: false, tb: true }, &ins), vec![17.0, 23.0, 39.0, 53.0]);
}
