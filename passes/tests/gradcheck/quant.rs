//! Quantization and dropout: dropout is finite-difference checked (linear in x for a fixed seed);
//! FakeQuant and ActQuant are checked as straight-through estimators (`check_straight_through`).

use qatc_ir::{NodeId, Op, UnaryOp};
use qatc_passes::autodiff::grad_name;

use crate::harness::{count, Case, ANY};

#[test]
fn dropout_applies_the_same_mask_backward() {
    // For a fixed seed dropout is linear in x, so finite differences apply exactly. tanh around
    // it makes the gradient depend on where the mask sits.
    for (k, (p, stream, seed)) in [(0.3, 2, 42), (0.5, 0, -7), (0.0, 1, 3)].into_iter().enumerate() {
        let mut c = Case::new(&format!("dropout p={p} stream={stream} seed={seed}"), 2000 + k as u64);
        let x = c.param("x", &[4, 7], ANY);
        let s = c.ids("seed", &[], &[seed]);
        let t = c.un(UnaryOp::Tanh, x);
        let d = c.op(Op::Dropout { p, stream }, &[t, s]);
        let y = c.un(UnaryOp::Square, d);
        let (ad, out) = c.check_values(y);
        assert_eq!(count(&ad, "dropout"), 2, "forward and backward");
        let gx = &out["grad:x"].as_float().expect("float").data;
        let zeros = gx.iter().filter(|&&v| v == 0.0).count();
        if p == 0.0 {
            assert_eq!(zeros, 0);
        } else {
            // 28 elements: a mask that keeps all or none would mean the check tested nothing.
            assert!(zeros > 0 && zeros < gx.len(), "p={p}: {zeros} of {} dropped", gx.len());
        }
    }
}

/// A straight-through op: the gradient passes through unchanged, so (with the op applied where
/// the incoming gradient does not depend on its output value) autodiff must give exactly the
/// gradient of the same graph without the op, which is itself finite-difference checked. The
/// op's own derivative is 0 almost everywhere (it rounds), so finite differences of the graph
/// with the op would say nothing about the estimator.
fn check_straight_through(name: &str, seed: u64, build: impl Fn(&mut Case, bool) -> NodeId) {
    let mut with = Case::new(name, seed);
    let y = build(&mut with, true);
    with.finish(y);
    let mut without = Case::new(name, seed);
    let y = build(&mut without, false);
    without.finish(y);
    assert_eq!(with.vals, without.vals, "{name}: both graphs see the same values");
    let (_, a) = with.analytic();
    let (_, b) = without.analytic();
    // The op does something: the forward losses differ.
    let (la, lb) = (a["loss"].item().expect("loss"), b["loss"].item().expect("loss"));
    assert!(la != lb, "{name}: the straight-through op did not change the loss ({la})");
    for p in &with.trainable {
        let gname = grad_name(p);
        let (ga, gb) = (a[&gname].as_float().expect("float"), b[&gname].as_float().expect("float"));
        assert_eq!(ga.shape, gb.shape);
        for (i, (x, y)) in ga.data.iter().zip(&gb.data).enumerate() {
            assert!((x - y).abs() <= 1e-12 * y.abs().max(1.0), "{name}: {gname}[{i}]: {x} with the op, {y} without");
        }
    }
    without.check_finished();
}

#[test]
fn fake_quant_is_straight_through() {
    use qatc_ir::{QuantScheme, QuantSpec};
    let specs = [
        (QuantSpec { bits: 4, group: 8, scheme: QuantScheme::Sym }, 16),
        (QuantSpec { bits: 3, group: 0, scheme: QuantScheme::Asym }, 16),
        (QuantSpec { bits: 4, group: 16, scheme: QuantScheme::Nf4 }, 16),
        (QuantSpec { bits: 4, group: 32, scheme: QuantScheme::Q4_0 }, 32),
    ];
    for (k, (spec, n_in)) in specs.into_iter().enumerate() {
        // As the last op before the weighting: d loss / d fq(t) = w whatever fq(t) is.
        check_straight_through(&format!("fake_quant {spec:?} last"), 2100 + k as u64, |c, ste| {
            let w = c.param("W", &[n_in, 3], ANY);
            let t = c.un(UnaryOp::Tanh, w);
            if ste {
                c.op(Op::FakeQuant { spec }, &[t])
            } else {
                t
            }
        });
        // As a LoRA base weight is used: x @ fq(W), linear in the quantized weight.
        check_straight_through(&format!("fake_quant {spec:?} in matmul"), 2200 + k as u64, |c, ste| {
            let x = c.frozen("x", &[5, n_in], ANY);
            let w = c.param("W", &[n_in, 3], ANY);
            let w = if ste { c.op(Op::FakeQuant { spec }, &[w]) } else { w };
            c.mm(false, false, x, w)
        });
    }
}

#[test]
fn act_quant_is_straight_through() {
    for (k, bits) in [2u8, 4, 8].into_iter().enumerate() {
        check_straight_through(&format!("act_quant {bits} bits"), 2300 + k as u64, |c, ste| {
            let x = c.param("x", &[3, 8], ANY);
            let t = c.un(UnaryOp::Tanh, x);
            if ste {
                c.op(Op::ActQuant { bits }, &[t])
            } else {
                t
            }
        });
    }
}
