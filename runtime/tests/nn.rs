//! The neural-network ops on small cases against naive loops written out in the test.

mod common;

use common::{assert_close, run_f64, run_op, try_run_op, In, Rng};
use qatc_ir::Op;
use qatc_runtime::RuntimeError;

#[test]
fn gather_rows() {
    let table: Vec<f64> = (0..8).map(f64::from).collect(); // [4, 2]
    let y = try_run_op::<f64>(Op::Gather, &[In::f(&[4, 2], &table), In::i(&[2, 2], &[3, 0, 3, 1])]).unwrap();
    assert_eq!(y.shape(), &[2, 2, 2]);
    assert_eq!(y.as_float().unwrap().data, vec![6.0, 7.0, 0.0, 1.0, 6.0, 7.0, 2.0, 3.0]);
}

#[test]
fn gather_rejects_ids_out_of_range() {
    let table = vec![0.0; 8];
    for bad in [4, -1] {
        let err = try_run_op::<f64>(Op::Gather, &[In::f(&[4, 2], &table), In::i(&[2], &[0, bad])]).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, RuntimeError::Node { .. }), "{msg}");
        assert!(msg.contains("gather") && msg.contains(&format!("id {bad}")), "{msg}");
    }
}

#[test]
fn scatter_add_sums_repeated_rows() {
    let dy = [1.0, 2.0, 10.0, 20.0, 100.0, 200.0];
    let y = run_f64(Op::ScatterAdd { rows: 4 }, &[In::i(&[3], &[2, 0, 2]), In::f(&[3, 2], &dy)]);
    assert_eq!(y, vec![10.0, 20.0, 0.0, 0.0, 101.0, 202.0, 0.0, 0.0]);
    let err = try_run_op::<f64>(Op::ScatterAdd { rows: 2 }, &[In::i(&[3], &[2, 0, 2]), In::f(&[3, 2], &dy)]).unwrap_err();
    assert!(err.to_string().contains("scatter_add") && err.to_string().contains("id 2"), "{err}");
}

/// Naive LayerNorm over rows of length c: returns (y, xhat, rstd).
fn naive_layernorm(x: &[f64], gamma: &[f64], beta: &[f64], eps: f64) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let c = gamma.len();
    let (mut y, mut xhat, mut rstds) = (vec![], vec![], vec![]);
    for row in x.chunks(c) {
        let mean = row.iter().sum::<f64>() / c as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / c as f64;
        let rstd = 1.0 / (var + eps).sqrt();
        for j in 0..c {
            let h = (row[j] - mean) * rstd;
            xhat.push(h);
            y.push(h * gamma[j] + beta[j]);
        }
        rstds.push(rstd);
    }
    (y, xhat, rstds)
}

#[test]
fn layernorm_hand_checked() {
    // Row [1, 2, 3, 4]: mean 2.5, biased var 1.25.
    let x = [1.0, 2.0, 3.0, 4.0];
    let y = run_f64(Op::LayerNorm { eps: 0.0 }, &[In::f(&[1, 4], &x), In::f(&[4], &[1.0; 4]), In::f(&[4], &[0.0; 4])]);
    let s = 1.25_f64.sqrt();
    assert_close(&y, &[-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s], 1e-15, 0.0);
}

#[test]
fn layernorm_and_grads_against_naive_loops() {
    let mut rng = Rng::new(11);
    let (rows, c, eps) = (6, 5, 1e-5);
    let x = rng.vec(rows * c, -2.0, 2.0);
    let gamma = rng.vec(c, 0.5, 1.5);
    let beta = rng.vec(c, -0.5, 0.5);
    let dy = rng.vec(rows * c, -1.0, 1.0);
    let (want_y, xhat, rstd) = naive_layernorm(&x, &gamma, &beta, eps);
    let shape = [2, 3, c];
    let y = run_f64(Op::LayerNorm { eps }, &[In::f(&shape, &x), In::f(&[c], &gamma), In::f(&[c], &beta)]);
    assert_close(&y, &want_y, 1e-13, 1e-14);

    let mut want_dx = vec![];
    let mut want_dg = vec![0.0; c];
    for r in 0..rows {
        let g: Vec<f64> = (0..c).map(|j| dy[r * c + j] * gamma[j]).collect();
        let mg = g.iter().sum::<f64>() / c as f64;
        let mgx = (0..c).map(|j| g[j] * xhat[r * c + j]).sum::<f64>() / c as f64;
        for j in 0..c {
            want_dx.push(rstd[r] * (g[j] - mg - xhat[r * c + j] * mgx));
            want_dg[j] += dy[r * c + j] * xhat[r * c + j];
        }
    }
    let dx = run_f64(Op::LayerNormGradX { eps }, &[In::f(&shape, &x), In::f(&[c], &gamma), In::f(&shape, &dy)]);
    assert_close(&dx, &want_dx, 1e-12, 1e-14);
    let dg = run_f64(Op::LayerNormGradGamma { eps }, &[In::f(&shape, &x), In::f(&shape, &dy)]);
    assert_close(&dg, &want_dg, 1e-12, 1e-14);
}

fn naive_softmax(row: &[f64], scale: f64) -> Vec<f64> {
    let max = row.iter().map(|v| v * scale).fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = row.iter().map(|v| (v * scale - max).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

#[test]
fn softmax_hand_checked() {
    let y = run_f64(Op::Softmax { scale: 1.0, causal: false }, &[In::f(&[2], &[0.0, 2.0_f64.ln()])]);
    assert_close(&y, &[1.0 / 3.0, 2.0 / 3.0], 1e-15, 0.0);
    // Max subtraction keeps huge logits finite.
    let y = run_f64(Op::Softmax { scale: 0.5, causal: false }, &[In::f(&[1, 2], &[2000.0, 2000.0])]);
    assert_eq!(y, vec![0.5, 0.5]);
}

#[test]
fn causal_softmax_rows_sum_to_one_and_masked_entries_are_zero() {
    let mut rng = Rng::new(5);
    let (b, nh, t, scale) = (2, 3, 7, 0.37);
    let x = rng.vec(b * nh * t * t, -4.0, 4.0);
    for got in [
        run_op::<f64>(Op::Softmax { scale, causal: true }, &[In::f(&[b, nh, t, t], &x)]),
        run_op::<f32>(Op::Softmax { scale, causal: true }, &[In::f(&[b, nh, t, t], &x)]),
    ] {
        for (r, row) in got.chunks(t).enumerate() {
            let i = r % t;
            let sum: f64 = row.iter().sum();
            assert!((sum - 1.0).abs() < 1e-6, "row {r} sums to {sum}");
            assert!(row[i + 1..].iter().all(|&v| v == 0.0), "row {r}: {row:?}");
            let want = naive_softmax(&x[r * t..r * t + i + 1], scale);
            assert_close(&row[..=i], &want, 1e-6, 1e-7);
        }
    }
}

#[test]
fn softmax_grad_against_naive_loop() {
    let mut rng = Rng::new(6);
    let (rows, s, scale) = (4, 6, 0.8);
    let y: Vec<f64> = rng.vec(rows * s, -1.0, 1.0).chunks(s).flat_map(|r| naive_softmax(r, 1.0)).collect();
    let dy = rng.vec(rows * s, -1.0, 1.0);
    let mut want = vec![];
    for r in 0..rows {
        let dot: f64 = (0..s).map(|j| dy[r * s + j] * y[r * s + j]).sum();
        want.extend((0..s).map(|j| scale * y[r * s + j] * (dy[r * s + j] - dot)));
    }
    let got = run_f64(Op::SoftmaxGrad { scale }, &[In::f(&[rows, s], &y), In::f(&[rows, s], &dy)]);
    assert_close(&got, &want, 1e-13, 1e-15);
}

#[test]
fn cross_entropy_against_naive_computation() {
    let mut rng = Rng::new(7);
    let (n, v) = (5, 9);
    let logits = rng.vec(n * v, -3.0, 3.0);
    let targets = rng.ints(n, v as i32);
    let mut loss = 0.0;
    let mut want_grad = vec![];
    let dloss = 1.7;
    for r in 0..n {
        let row = &logits[r * v..(r + 1) * v];
        let lse = row.iter().map(|x| x.exp()).sum::<f64>().ln();
        loss += lse - row[targets[r] as usize];
        for (j, x) in row.iter().enumerate() {
            let onehot = if j == targets[r] as usize { 1.0 } else { 0.0 };
            want_grad.push(dloss / n as f64 * ((x - lse).exp() - onehot));
        }
    }
    loss /= n as f64;
    let ins = [In::f(&[n, v], &logits), In::i(&[n], &targets)];
    let got = run_f64(Op::CrossEntropy, &ins);
    assert_eq!(got.len(), 1);
    assert_close(&got, &[loss], 1e-14, 0.0);
    assert_close(&run_op::<f32>(Op::CrossEntropy, &ins), &[loss], 1e-6, 0.0);
    let ins = [ins[0].clone(), ins[1].clone(), In::f(&[], &[dloss])];
    assert_close(&run_f64(Op::CrossEntropyGrad, &ins), &want_grad, 1e-13, 1e-15);
}

#[test]
fn cross_entropy_hand_checked_and_rejects_bad_targets() {
    // Uniform logits over 4 classes: loss ln 4 whatever the target.
    let ins = [In::f(&[2, 4], &[0.5; 8]), In::i(&[2], &[0, 3])];
    assert_close(&run_f64(Op::CrossEntropy, &ins), &[4.0_f64.ln()], 1e-15, 0.0);
    for bad in [4, -100] {
        let ins = [In::f(&[2, 4], &[0.5; 8]), In::i(&[2], &[0, bad])];
        let err = try_run_op::<f64>(Op::CrossEntropy, &ins).unwrap_err().to_string();
        assert!(err.contains("cross_entropy") && err.contains(&format!("target {bad}")), "{err}");
        let ins = [ins[0].clone(), ins[1].clone(), In::f(&[], &[1.0])];
        let err = try_run_op::<f64>(Op::CrossEntropyGrad, &ins).unwrap_err().to_string();
        assert!(err.contains("cross_entropy_grad") && err.contains(&format!("target {bad}")), "{err}");
    }
}
