//! Finite-difference checks of every gradient rule in `autodiff/rules.rs`.
//!
//! Each case builds `x (trainable inputs) -> op -> y`, then `loss = sum_to(y * w, [])` with `w`
//! a fixed random Data input of y's shape, so the loss depends on every output element with a
//! different weight (a plain sum would hide rules that are wrong by a per-element permutation or
//! that only get the row sums right, as softmax's would). `autodiff` adds the `grad:NAME`
//! outputs; the interpreter evaluates them in f64 and each element is compared with a central
//! difference of the forward loss, also in f64:
//!
//!   |analytic - numeric| <= 1e-6 * max(1, |numeric|),   numeric = (L(x + h) - L(x - h)) / 2h, h = 1e-6.
//!
//! Why this tolerance holds: the truncation error of the central difference is ~h^2 |L'''| ~ 1e-12
//! and the rounding error ~eps_f64 |L| / h ~ 1e-10 |L|, with |L| = O(10) here, so a correct rule
//! passes with three orders of magnitude to spare while a wrong one is off by O(1).
//!
//! Graph dtypes are f32: the f64 interpreter does not round f32-typed values (it is the oracle),
//! so f32 graphs are differentiated in full f64 precision. Casts to f16/bf16 are not checked:
//! those values are rounded to 8-11 significant bits, so a difference with h = 1e-6 measures the
//! rounding steps, not the derivative. The cast rule is checked on f32 -> f32, where it is exact.
//! Inputs are drawn away from the kinks and poles of the ops (log, sqrt, rsqrt, recip, div near 0).
//!
//! Dropout is linear in x for a fixed seed, so it is finite-difference checked like the rest.
//! FakeQuant and ActQuant round (derivative 0 almost everywhere) and their rule is the
//! straight-through estimator by definition, so they are checked against the same graph without
//! the op instead (see `check_straight_through`). Ops with no rule must fail with
//! `PassError::NoRule` when a trainable input reaches them. `covering_test` is an exhaustive
//! match over the op set, so an op added to the IR fails to compile here until it is placed.

use std::collections::HashMap;

use qatc_ir::{verify, BinaryOp, DType, Graph, InputKind, NodeId, Op, Shape, UnaryOp};
use qatc_passes::autodiff::{autodiff, grad_name};
use qatc_passes::PassError;
use qatc_runtime::{Interpreter, Value};

const H: f64 = 1e-6;
const TOL: f64 = 1e-6;

/// splitmix64: a tiny seeded PRNG, so every case sees the same values on every run.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [lo, hi).
    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// How an input's values are drawn.
#[derive(Clone, Copy, Debug)]
enum Dist {
    /// Uniform in [lo, hi).
    U(f64, f64),
    /// Uniform magnitude in [lo, hi), random sign: away from zero (for divisors, 1/x).
    AwayFromZero(f64, f64),
}

const ANY: Dist = Dist::U(-2.0, 2.0);
const POSITIVE: Dist = Dist::U(0.3, 2.0);

/// One gradient-check case: a forward graph under construction and the values of its inputs.
struct Case {
    name: String,
    g: Graph,
    rng: Rng,
    vals: HashMap<String, Value<f64>>,
    trainable: Vec<String>,
    /// For the harness's own test: (param, element, delta) added to one analytic gradient.
    tamper: Option<(String, usize, f64)>,
}

impl Case {
    fn new(name: &str, seed: u64) -> Case {
        Case { name: name.into(), g: Graph::new(name), rng: Rng(seed), vals: HashMap::new(), trainable: Vec::new(), tamper: None }
    }

    fn values(&mut self, n: usize, d: Dist) -> Vec<f64> {
        (0..n)
            .map(|_| match d {
                Dist::U(lo, hi) => self.rng.uniform(lo, hi),
                Dist::AwayFromZero(lo, hi) => {
                    let m = self.rng.uniform(lo, hi);
                    if self.rng.below(2) == 0 {
                        m
                    } else {
                        -m
                    }
                }
            })
            .collect()
    }

    /// A float input of `kind` with random values.
    fn float_input(&mut self, name: &str, kind: InputKind, shape: &[usize], d: Dist) -> NodeId {
        let id = self.g.input(name, kind, DType::F32, shape.to_vec()).expect("input");
        let n = shape.iter().product();
        let data = self.values(n, d);
        self.vals.insert(name.into(), Value::floats(shape.to_vec(), &data).expect("value"));
        if kind == InputKind::Trainable {
            self.trainable.push(name.into());
        }
        id
    }

    fn param(&mut self, name: &str, shape: &[usize], d: Dist) -> NodeId {
        self.float_input(name, InputKind::Trainable, shape, d)
    }

    fn frozen(&mut self, name: &str, shape: &[usize], d: Dist) -> NodeId {
        self.float_input(name, InputKind::Frozen, shape, d)
    }

    /// An i32 Data input with the given values.
    fn ids(&mut self, name: &str, shape: &[usize], data: &[i32]) -> NodeId {
        let id = self.g.input(name, InputKind::Data, DType::I32, shape.to_vec()).expect("input");
        self.vals.insert(name.into(), Value::ints(shape.to_vec(), data.to_vec()).expect("value"));
        id
    }

    fn op(&mut self, op: Op, args: &[NodeId]) -> NodeId {
        let what = format!("{op:?}");
        self.g.add(op, args).unwrap_or_else(|e| panic!("{}: building {what}: {e}", self.name))
    }

    fn un(&mut self, u: UnaryOp, x: NodeId) -> NodeId {
        self.op(Op::Unary(u), &[x])
    }

    fn bin(&mut self, b: BinaryOp, x: NodeId, y: NodeId) -> NodeId {
        self.op(Op::Binary(b), &[x, y])
    }

    fn mm(&mut self, ta: bool, tb: bool, a: NodeId, b: NodeId) -> NodeId {
        self.op(Op::MatMul { ta, tb }, &[a, b])
    }

    /// Closes the graph with `loss = sum_to(y * w, [])` and declares the `loss` output.
    fn finish(&mut self, y: NodeId) {
        let shape = self.g.ty(y).shape.clone();
        let w = self.float_input("w", InputKind::Data, shape.dims(), Dist::U(-1.5, 1.5));
        let yw = self.bin(BinaryOp::Mul, y, w);
        let loss = self.op(Op::SumTo { shape: Shape::scalar() }, &[yw]);
        self.g.set_output("loss", loss).expect("loss output");
    }

    /// Differentiates the finished graph and evaluates it (loss and gradients) in f64.
    fn analytic(&self) -> (Graph, HashMap<String, Value<f64>>) {
        let name = &self.name;
        let (ad, _report) = autodiff(self.g.clone()).unwrap_or_else(|e| panic!("{name}: autodiff failed: {e}"));
        verify(&ad).unwrap_or_else(|e| panic!("{name}: the autodiff graph does not verify: {e}"));
        let out = Interpreter::<f64>::new(&ad)
            .and_then(|i| i.run(&self.vals))
            .unwrap_or_else(|e| panic!("{name}: running the gradient graph: {e}"));
        (ad, out)
    }

    /// Closes the graph on `y`, differentiates it and compares every gradient element with
    /// central differences. Returns the autodiff graph for further structural checks.
    fn check(self, y: NodeId) -> Graph {
        self.check_values(y).0
    }

    /// `check`, also returning the autodiff graph's outputs.
    fn check_values(mut self, y: NodeId) -> (Graph, HashMap<String, Value<f64>>) {
        self.finish(y);
        self.check_finished()
    }

    fn check_finished(self) -> (Graph, HashMap<String, Value<f64>>) {
        let name = self.name.clone();
        let (ad, analytic) = self.analytic();
        let forward = Interpreter::<f64>::new(&self.g).unwrap_or_else(|e| panic!("{name}: {e}"));
        let loss_at = |vals: &HashMap<String, Value<f64>>| -> f64 {
            let out = forward.run(vals).unwrap_or_else(|e| panic!("{name}: forward run: {e}"));
            out.get("loss").and_then(Value::item).unwrap_or_else(|| panic!("{name}: no scalar loss"))
        };
        // The autodiff graph computes the same loss as the forward graph.
        let l0 = loss_at(&self.vals);
        let l_ad = analytic.get("loss").and_then(Value::item).expect("loss output");
        assert!((l0 - l_ad).abs() <= 1e-12 * l0.abs().max(1.0), "{name}: loss {l0} vs {l_ad} after autodiff");
        assert!(!self.trainable.is_empty(), "{name}: no trainable input");

        for p in &self.trainable {
            let gname = grad_name(p);
            let grad = analytic.get(&gname).and_then(Value::as_float).unwrap_or_else(|| panic!("{name}: no float output {gname:?}"));
            let x = self.vals[p].as_float().expect("float param").clone();
            assert_eq!(grad.shape, x.shape, "{name}: {gname} has the wrong shape");
            let mut vals = self.vals.clone();
            for i in 0..x.data.len() {
                let mut at = |v: f64| {
                    let mut t = x.clone();
                    t.data[i] = v;
                    vals.insert(p.clone(), Value::Float(t));
                    loss_at(&vals)
                };
                let numeric = (at(x.data[i] + H) - at(x.data[i] - H)) / (2.0 * H);
                let mut a = grad.data[i];
                if let Some((tp, ti, delta)) = &self.tamper {
                    if tp == p && *ti == i {
                        a += delta;
                    }
                }
                let tol = TOL * numeric.abs().max(1.0);
                assert!(
                    (a - numeric).abs() <= tol,
                    "{name}: d loss / d {p}[{i}]: autodiff {a:e}, finite difference {numeric:e} (|diff| {:e} > tol {tol:e})",
                    (a - numeric).abs()
                );
            }
        }
        (ad, analytic)
    }
}

/// Counts of a mnemonic in a graph.
fn count(g: &Graph, mnemonic: &str) -> usize {
    g.op_counts().get(mnemonic).copied().unwrap_or(0)
}

/// Where each op's rule is checked. Exhaustive on purpose (no wildcard).
fn covering_test(op: &Op) -> &'static str {
    match op {
        Op::Input { .. } | Op::Const { .. } => "every test (leaves)",
        Op::Unary(_) => "unary_ops",
        Op::Binary(BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::Div) => "binary_ops",
        Op::Binary(BinaryOp::Max | BinaryOp::Min | BinaryOp::GeluGrad) => "ops_without_a_rule_report_no_rule",
        Op::Affine { .. } => "affine",
        Op::Cast { .. } => "cast_f32_to_f32",
        Op::Broadcast { .. } => "broadcast",
        Op::SumTo { .. } => "sum_to",
        Op::Reshape { .. } => "reshape",
        Op::Transpose { .. } => "transpose",
        Op::Slice { .. } => "slice_with_padding_at_start_middle_and_end",
        Op::Concat { .. } => "concat",
        Op::MatMul { .. } => "matmul_all_transpose_combinations_with_batch_dims",
        Op::Gather => "gather_with_repeated_ids",
        Op::LayerNorm { .. } => "layernorm_each_operand",
        Op::Softmax { .. } => "softmax_plain_causal_and_scaled",
        Op::CrossEntropy => "cross_entropy_wrt_logits",
        Op::Dropout { .. } => "dropout_applies_the_same_mask_backward",
        Op::FakeQuant { .. } => "fake_quant_is_straight_through",
        Op::ActQuant { .. } => "act_quant_is_straight_through",
        Op::FakeQuantLearned { .. } => "gradcheck_lsq.rs (LSQ against its straight-through surrogate)",
        Op::Dequantize { .. }
        | Op::Kernel { .. }
        | Op::ScatterAdd { .. }
        | Op::FakeQuantLearnedGrad { .. }
        | Op::LayerNormGradX { .. }
        | Op::LayerNormGradGamma { .. }
        | Op::SoftmaxGrad { .. }
        | Op::CrossEntropyGrad
        | Op::AdamM { .. }
        | Op::AdamV { .. }
        | Op::AdamParam { .. }
        | Op::AllFinite
        | Op::Select
        | Op::LossScale { .. }
        | Op::BlockDequant { .. }
        | Op::BlockAbsMax => "ops_without_a_rule_report_no_rule",
        Op::BlockQuant { .. } => "none: its u8 result is never on a path to a float loss",
    }
}

#[test]
fn every_op_has_a_covering_test() {
    // The real check is that `covering_test` compiles; this keeps it from being dead code.
    assert_eq!(covering_test(&Op::Gather), "gather_with_repeated_ids");
}

// ---------------------------------------------------------------------------------------------
// The harness itself.

#[test]
#[should_panic(expected = "d loss / d x[4]")]
fn harness_catches_an_error_of_ten_times_the_tolerance() {
    // An analytic gradient off by 1e-5 in one element must fail the check: the comparison is
    // per element and the tolerance is as tight as the module comment says.
    let mut c = Case::new("tampered", 1);
    let x = c.param("x", &[2, 3], ANY);
    let y = c.un(UnaryOp::Tanh, x);
    c.tamper = Some(("x".into(), 4, 1e-5));
    c.check(y);
}

#[test]
fn harness_passes_an_error_of_a_tenth_of_the_tolerance() {
    let mut c = Case::new("tampered slightly", 1);
    let x = c.param("x", &[2, 3], ANY);
    let y = c.un(UnaryOp::Tanh, x);
    c.tamper = Some(("x".into(), 4, 1e-7));
    c.check(y);
}

// ---------------------------------------------------------------------------------------------
// Elementwise.

#[test]
fn unary_ops() {
    let cases = [
        (UnaryOp::Neg, ANY),
        (UnaryOp::Exp, ANY),
        (UnaryOp::Log, POSITIVE),
        (UnaryOp::Sqrt, POSITIVE),
        (UnaryOp::Rsqrt, POSITIVE),
        (UnaryOp::Recip, Dist::AwayFromZero(0.4, 2.0)),
        (UnaryOp::Tanh, ANY),
        (UnaryOp::Square, ANY),
        (UnaryOp::Gelu, Dist::U(-3.0, 3.0)),
    ];
    for (k, (u, d)) in cases.into_iter().enumerate() {
        let mut c = Case::new(&format!("{u:?}"), 100 + k as u64);
        let x = c.param("x", &[2, 3, 5], d);
        let y = c.un(u, x);
        c.check(y);
    }
}

#[test]
fn binary_ops() {
    for (k, b) in [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div].into_iter().enumerate() {
        let mut c = Case::new(&format!("{b:?}"), 200 + k as u64);
        let x = c.param("a", &[3, 1, 5], ANY);
        let y = c.param("b", &[3, 1, 5], Dist::AwayFromZero(0.5, 2.0));
        let z = c.bin(b, x, y);
        c.check(z);
    }
}

#[test]
fn binary_ops_with_one_side_frozen() {
    // Only the trainable side wants a gradient; the rule must still be right for it.
    for (k, b) in [BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div].into_iter().enumerate() {
        for trainable_lhs in [true, false] {
            let mut c = Case::new(&format!("{b:?} lhs-trainable={trainable_lhs}"), 250 + 2 * k as u64 + u64::from(trainable_lhs));
            let (x, y) = if trainable_lhs {
                (c.param("a", &[7], ANY), c.frozen("b", &[7], Dist::AwayFromZero(0.5, 2.0)))
            } else {
                (c.frozen("a", &[7], ANY), c.param("b", &[7], Dist::AwayFromZero(0.5, 2.0)))
            };
            let z = c.bin(b, x, y);
            c.check(z);
        }
    }
}

#[test]
fn same_operand_twice() {
    // mul(x, x), div(x, x), sub(x, x), add(x, x): both slots' contributions must be summed.
    for (k, b) in [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div].into_iter().enumerate() {
        let mut c = Case::new(&format!("{b:?}(x, x)"), 300 + k as u64);
        let x = c.param("x", &[4, 3], Dist::AwayFromZero(0.5, 2.0));
        let y = c.bin(b, x, x);
        c.check(y);
    }
}

#[test]
fn affine() {
    let mut c = Case::new("affine", 400);
    let x = c.param("x", &[5, 3], ANY);
    let y = c.op(Op::Affine { mul: -1.7, add: 0.3 }, &[x]);
    c.check(y);
}

#[test]
fn cast_f32_to_f32() {
    // Only the float-to-same-precision cast: see the module comment on f16/bf16.
    let mut c = Case::new("cast", 401);
    let x = c.param("x", &[3, 5], ANY);
    let y = c.op(Op::Cast { to: DType::F32 }, &[x]);
    let z = c.un(UnaryOp::Tanh, y);
    c.check(z);
}

// ---------------------------------------------------------------------------------------------
// Shape ops.

#[test]
fn broadcast() {
    for (k, (from, to)) in [
        (vec![3, 1], vec![2, 3, 4]),
        (vec![], vec![2, 3]),
        (vec![5], vec![2, 3, 5]),
        (vec![1, 3, 1], vec![2, 3, 5]),
        (vec![2, 3], vec![2, 3]),
    ]
    .into_iter()
    .enumerate()
    {
        let mut c = Case::new(&format!("broadcast {from:?} -> {to:?}"), 500 + k as u64);
        let x = c.param("x", &from, ANY);
        let y = c.op(Op::Broadcast { shape: Shape(to) }, &[x]);
        c.check(y);
    }
}

#[test]
fn sum_to() {
    for (k, (from, to)) in [
        (vec![2, 3, 4], vec![3, 1]),
        (vec![2, 3, 4], vec![]),
        (vec![2, 3, 5], vec![5]),
        (vec![2, 3, 5], vec![2, 1, 5]),
        (vec![3, 5], vec![3, 5]),
    ]
    .into_iter()
    .enumerate()
    {
        let mut c = Case::new(&format!("sum_to {from:?} -> {to:?}"), 600 + k as u64);
        let x = c.param("x", &from, ANY);
        // Square first so the loss is not linear in x (a linear loss would pass a rule that
        // returned the right sum in the wrong places only by luck less often).
        let x2 = c.un(UnaryOp::Square, x);
        let y = c.op(Op::SumTo { shape: Shape(to) }, &[x2]);
        c.check(y);
    }
}

#[test]
fn reshape() {
    for (k, to) in [vec![5, 6], vec![30], vec![3, 1, 10], vec![1, 2, 15]].into_iter().enumerate() {
        let mut c = Case::new(&format!("reshape -> {to:?}"), 700 + k as u64);
        let x = c.param("x", &[2, 3, 5], ANY);
        let y = c.op(Op::Reshape { shape: Shape(to) }, &[x]);
        c.check(y);
    }
}

#[test]
fn transpose() {
    // Non-involutive permutations, so perm and its inverse differ.
    for (k, perm) in [vec![2, 0, 1], vec![1, 2, 0], vec![1, 0, 2], vec![0, 1, 2], vec![3, 1, 0, 2]].into_iter().enumerate() {
        let shape: &[usize] = if perm.len() == 4 { &[2, 3, 1, 5] } else { &[2, 3, 5] };
        let mut c = Case::new(&format!("transpose {perm:?}"), 800 + k as u64);
        let x = c.param("x", shape, ANY);
        let y = c.op(Op::Transpose { perm }, &[x]);
        c.check(y);
    }
}

#[test]
fn slice_with_padding_at_start_middle_and_end() {
    // x [4, 5, 3]: slices whose backward pads at the end only, both sides, the start only, and
    // none; along each axis.
    let cases = [(1, 0, 2), (1, 1, 3), (1, 3, 5), (1, 0, 5), (0, 1, 4), (0, 3, 4), (2, 0, 1), (2, 1, 2), (2, 2, 3)];
    for (k, (axis, start, end)) in cases.into_iter().enumerate() {
        let mut c = Case::new(&format!("slice axis {axis} [{start}, {end})"), 900 + k as u64);
        let x = c.param("x", &[4, 5, 3], ANY);
        let y = c.op(Op::Slice { axis, start, end }, &[x]);
        let ad = c.check(y);
        // The padding constants are built only where there is something to pad.
        let pads = usize::from(start > 0) + usize::from(end < [4, 5, 3][axis]);
        assert_eq!(count(&ad, "concat"), usize::from(pads > 0), "slice ({axis}, {start}, {end})");
    }
}

#[test]
fn concat() {
    let mut c = Case::new("concat axis 1", 1000);
    let a = c.param("a", &[2, 3], ANY);
    let b = c.param("b", &[2, 4], ANY);
    let d = c.param("d", &[2, 1], ANY);
    let y = c.op(Op::Concat { axis: 1 }, &[a, b, d]);
    c.check(y);

    let mut c = Case::new("concat axis 0", 1001);
    let a = c.param("a", &[1, 3, 2], ANY);
    let b = c.param("b", &[2, 3, 2], ANY);
    let y = c.op(Op::Concat { axis: 0 }, &[a, b]);
    c.check(y);

    // The same operand in several slots, mixed with a frozen one.
    let mut c = Case::new("concat (x, f, x)", 1002);
    let x = c.param("x", &[3, 2], ANY);
    let f = c.frozen("f", &[3, 5], ANY);
    let y = c.op(Op::Concat { axis: 1 }, &[x, f, x]);
    c.check(y);
}

// ---------------------------------------------------------------------------------------------
// MatMul.

#[test]
fn matmul_all_transpose_combinations_with_batch_dims() {
    let (m, k, n) = (3, 4, 5);
    for batch in [vec![], vec![2], vec![2, 3]] {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            for which in ["both", "a", "b"] {
                let name = format!("matmul batch {batch:?} ta={ta} tb={tb} trainable {which}");
                let mut c = Case::new(&name, 1100 + 7 * batch.len() as u64 + 2 * u64::from(ta) + u64::from(tb));
                let mut ash = batch.clone();
                ash.extend(if ta { [k, m] } else { [m, k] });
                let mut bsh = batch.clone();
                bsh.extend(if tb { [n, k] } else { [k, n] });
                let a = if which == "b" { c.frozen("a", &ash, ANY) } else { c.param("a", &ash, ANY) };
                let b = if which == "a" { c.frozen("b", &bsh, ANY) } else { c.param("b", &bsh, ANY) };
                let y = c.mm(ta, tb, a, b);
                let ad = c.check(y);
                // One backward matmul per wanted gradient, none for a frozen side.
                let want = if which == "both" { 3 } else { 2 };
                assert_eq!(count(&ad, "matmul"), want, "{name}");
            }
        }
    }
}

#[test]
fn matmul_with_itself() {
    // x @ x^T and x^T @ x: both operands are the same node.
    for (k, (ta, tb)) in [(false, true), (true, false)].into_iter().enumerate() {
        let mut c = Case::new(&format!("x x ta={ta} tb={tb}"), 1200 + k as u64);
        let x = c.param("x", &[3, 4], ANY);
        let y = c.mm(ta, tb, x, x);
        c.check(y);
    }
}

// ---------------------------------------------------------------------------------------------
// Neural-network ops.

#[test]
fn gather_with_repeated_ids() {
    let mut c = Case::new("gather", 1300);
    let table = c.param("wte", &[7, 4], ANY);
    // Rows 1, 3 and 6 are hit several times; rows 4 and 5 never (their gradient is 0).
    let ids = c.ids("ids", &[2, 5], &[1, 3, 1, 6, 0, 3, 3, 2, 1, 6]);
    let y = c.op(Op::Gather, &[table, ids]);
    let ad = c.check(y);
    assert_eq!(count(&ad, "scatter_add"), 1);

    // Scalar-shaped ids and a gather used twice.
    let mut c = Case::new("gather twice", 1301);
    let table = c.param("wte", &[5, 3], ANY);
    let i0 = c.ids("i0", &[], &[2]);
    let i1 = c.ids("i1", &[4], &[2, 2, 0, 4]);
    let e0 = c.op(Op::Gather, &[table, i0]);
    let e0 = c.op(Op::Broadcast { shape: Shape::new([4, 3]) }, &[e0]);
    let e1 = c.op(Op::Gather, &[table, i1]);
    let y = c.bin(BinaryOp::Mul, e0, e1);
    c.check(y);
}

#[test]
fn layernorm_each_operand() {
    for (k, which) in ["all", "x", "gamma", "beta"].into_iter().enumerate() {
        for shape in [vec![3, 5], vec![2, 3, 7]] {
            let cdim = shape[shape.len() - 1];
            let mut c = Case::new(&format!("layernorm {shape:?} trainable {which}"), 1400 + k as u64);
            let mk = |c: &mut Case, name: &str, sh: &[usize], d: Dist, me: bool| {
                if which == "all" || me {
                    c.param(name, sh, d)
                } else {
                    c.frozen(name, sh, d)
                }
            };
            let x = mk(&mut c, "x", &shape, Dist::U(-2.0, 2.0), which == "x");
            let gamma = mk(&mut c, "gamma", &[cdim], Dist::U(0.5, 1.5), which == "gamma");
            let beta = mk(&mut c, "beta", &[cdim], ANY, which == "beta");
            let y = c.op(Op::LayerNorm { eps: 1e-5 }, &[x, gamma, beta]);
            let ad = c.check(y);
            let has = |op: &str| count(&ad, op) > 0;
            assert_eq!(has("layernorm_grad_x"), which == "all" || which == "x");
            assert_eq!(has("layernorm_grad_gamma"), which == "all" || which == "gamma");
        }
    }
}

#[test]
fn softmax_plain_causal_and_scaled() {
    let cases: [(&[usize], f64, bool); 6] = [
        (&[3, 5], 1.0, false),
        (&[3, 5], -1.3, false),
        (&[2, 4, 4], 1.0, true),
        (&[2, 4, 4], 0.37, true),
        (&[2, 2, 3, 3], 2.5, true),
        (&[7], 0.8, false),
    ];
    for (k, (shape, scale, causal)) in cases.into_iter().enumerate() {
        let mut c = Case::new(&format!("softmax {shape:?} scale={scale} causal={causal}"), 1500 + k as u64);
        let x = c.param("x", shape, ANY);
        let y = c.op(Op::Softmax { scale, causal }, &[x]);
        c.check(y);
    }
}

#[test]
fn cross_entropy_wrt_logits() {
    let mut c = Case::new("cross_entropy", 1600);
    let logits = c.param("logits", &[5, 7], Dist::U(-3.0, 3.0));
    let t = c.ids("targets", &[5], &[3, 0, 6, 3, 1]);
    let y = c.op(Op::CrossEntropy, &[logits, t]);
    c.check(y);

    // A cross-entropy of a computed logit tensor, single row.
    let mut c = Case::new("cross_entropy of matmul", 1601);
    let h = c.frozen("h", &[1, 4], ANY);
    let w = c.param("w_out", &[4, 9], ANY);
    let t = c.ids("targets", &[1], &[8]);
    let logits = c.mm(false, false, h, w);
    let y = c.op(Op::CrossEntropy, &[logits, t]);
    c.check(y);
}

// ---------------------------------------------------------------------------------------------
// A chain: a 1-layer transformer block, where several tensors have several uses (the residual
// stream, the layernorm output feeding q/k/v, the embedding table), so gradient contributions
// must be accumulated.

#[test]
fn transformer_block_chain() {
    let (t, c_, nh, v) = (4, 6, 2, 9);
    let hd = c_ / nh;
    let mut c = Case::new("block", 1700);
    let wte = c.param("wte", &[v, c_], Dist::U(-1.0, 1.0));
    let wpe = c.param("wpe", &[t, c_], Dist::U(-0.5, 0.5));
    let ids = c.ids("ids", &[t], &[3, 7, 3, 0]);
    let targets = c.ids("targets", &[t], &[7, 3, 0, 8]);
    let g1 = c.param("ln_1.weight", &[c_], Dist::U(0.5, 1.5));
    let b1 = c.param("ln_1.bias", &[c_], Dist::U(-0.2, 0.2));
    let wqkv = c.param("attn.c_attn.weight", &[c_, 3 * c_], Dist::U(-0.5, 0.5));
    let bqkv = c.frozen("attn.c_attn.bias", &[3 * c_], Dist::U(-0.2, 0.2));
    let wo = c.param("attn.c_proj.weight", &[c_, c_], Dist::U(-0.5, 0.5));
    let g2 = c.param("ln_2.weight", &[c_], Dist::U(0.5, 1.5));
    let b2 = c.frozen("ln_2.bias", &[c_], Dist::U(-0.2, 0.2));
    let w1 = c.param("mlp.c_fc.weight", &[c_, 8], Dist::U(-0.5, 0.5));
    let bfc = c.param("mlp.c_fc.bias", &[8], Dist::U(-0.2, 0.2));
    let w2 = c.param("mlp.c_proj.weight", &[8, c_], Dist::U(-0.5, 0.5));
    let gf = c.param("ln_f.weight", &[c_], Dist::U(0.5, 1.5));
    let bf = c.param("ln_f.bias", &[c_], Dist::U(-0.2, 0.2));

    let tok = c.op(Op::Gather, &[wte, ids]);
    let x = c.bin(BinaryOp::Add, tok, wpe);
    // Attention.
    let h = c.op(Op::LayerNorm { eps: 1e-5 }, &[x, g1, b1]);
    let qkv = c.mm(false, false, h, wqkv);
    let bq = c.op(Op::Broadcast { shape: Shape::new([t, 3 * c_]) }, &[bqkv]);
    let qkv = c.bin(BinaryOp::Add, qkv, bq);
    let heads = |c: &mut Case, i: usize| {
        let s = c.op(Op::Slice { axis: 1, start: i * c_, end: (i + 1) * c_ }, &[qkv]);
        let r = c.op(Op::Reshape { shape: Shape::new([t, nh, hd]) }, &[s]);
        c.op(Op::Transpose { perm: vec![1, 0, 2] }, &[r])
    };
    let (q, k, vv) = (heads(&mut c, 0), heads(&mut c, 1), heads(&mut c, 2));
    let att = c.mm(false, true, q, k);
    let p = c.op(Op::Softmax { scale: 1.0 / (hd as f64).sqrt(), causal: true }, &[att]);
    let o = c.mm(false, false, p, vv);
    let o = c.op(Op::Transpose { perm: vec![1, 0, 2] }, &[o]);
    let o = c.op(Op::Reshape { shape: Shape::new([t, c_]) }, &[o]);
    let o = c.mm(false, false, o, wo);
    let x = c.bin(BinaryOp::Add, x, o);
    // MLP.
    let h = c.op(Op::LayerNorm { eps: 1e-5 }, &[x, g2, b2]);
    let f = c.mm(false, false, h, w1);
    let bb = c.op(Op::Broadcast { shape: Shape::new([t, 8]) }, &[bfc]);
    let f = c.bin(BinaryOp::Add, f, bb);
    let f = c.un(UnaryOp::Gelu, f);
    let f = c.mm(false, false, f, w2);
    let x = c.bin(BinaryOp::Add, x, f);
    // Tied unembedding: wte is used twice.
    let h = c.op(Op::LayerNorm { eps: 1e-5 }, &[x, gf, bf]);
    let logits = c.mm(false, true, h, wte);
    let loss = c.op(Op::CrossEntropy, &[logits, targets]);
    let ad = c.check(loss);
    assert_eq!(count(&ad, "scatter_add"), 1);
}

// ---------------------------------------------------------------------------------------------
// Quantization and dropout.

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

// ---------------------------------------------------------------------------------------------
// Ops without a rule.

/// A graph where trainable `x` reaches `op`: autodiff must fail with NoRule naming the op.
fn assert_no_rule(mnemonic: &str, build: impl FnOnce(&mut Case, NodeId) -> NodeId) {
    let mut c = Case::new(mnemonic, 1800);
    let x = c.param("x", &[3, 4], ANY);
    let y = build(&mut c, x);
    assert_eq!(c.g.node(y).op.mnemonic(), mnemonic);
    c.finish(y);
    match autodiff(c.g) {
        Err(PassError::NoRule { op, node }) => {
            assert_eq!(op, mnemonic);
            assert!(node.contains(mnemonic), "{node}");
        }
        Err(e) => panic!("{mnemonic}: expected NoRule, got {e}"),
        Ok(_) => panic!("{mnemonic}: expected NoRule, autodiff succeeded"),
    }
}

#[test]
fn ops_without_a_rule_report_no_rule() {
    for b in [BinaryOp::Max, BinaryOp::Min, BinaryOp::GeluGrad] {
        let mn = Op::Binary(b).mnemonic();
        assert_no_rule(mn, |c, x| {
            let f = c.frozen("f", &[3, 4], ANY);
            c.bin(b, x, f)
        });
        // Also when the trainable input is the second operand.
        assert_no_rule(mn, |c, x| {
            let f = c.frozen("f", &[3, 4], ANY);
            c.bin(b, f, x)
        });
    }
    assert_no_rule("scatter_add", |c, x| {
        let ids = c.ids("ids", &[3], &[0, 2, 0]);
        c.op(Op::ScatterAdd { rows: 4 }, &[ids, x])
    });
    assert_no_rule("layernorm_grad_x", |c, x| {
        let g = c.frozen("g", &[4], ANY);
        let dy = c.frozen("dy", &[3, 4], ANY);
        c.op(Op::LayerNormGradX { eps: 1e-5 }, &[x, g, dy])
    });
    assert_no_rule("layernorm_grad_gamma", |c, x| {
        let dy = c.frozen("dy", &[3, 4], ANY);
        c.op(Op::LayerNormGradGamma { eps: 1e-5 }, &[dy, x])
    });
    assert_no_rule("softmax_grad", |c, x| {
        let dy = c.frozen("dy", &[3, 4], ANY);
        c.op(Op::SoftmaxGrad { scale: 1.0 }, &[x, dy])
    });
    assert_no_rule("cross_entropy_grad", |c, x| {
        let t = c.ids("t", &[3], &[0, 1, 3]);
        let dl = c.frozen("dl", &[], ANY);
        c.op(Op::CrossEntropyGrad, &[x, t, dl])
    });
    assert_no_rule("dequantize", |c, x| {
        // Trainable scales [3, 4] of a sym 4-bit weight [6, 4] in groups of 2.
        let codes = c.g.input("codes", InputKind::Data, DType::I4, [6, 4]).expect("input");
        let spec = qatc_ir::QuantSpec { bits: 4, group: 2, scheme: qatc_ir::QuantScheme::Sym };
        c.op(Op::Dequantize { spec, to: qatc_ir::DType::F32 }, &[codes, x])
    });
    assert_no_rule("fake_quant_learned_grad", |c, x| {
        // x [3, 4] as the gradient of a sym 4-bit weight [3, 4] in one group per column
        let w = c.frozen("wq", &[3, 4], ANY);
        let s = c.frozen("s", &[1, 4], POSITIVE);
        let spec = qatc_ir::QuantSpec { bits: 4, group: 0, scheme: qatc_ir::QuantScheme::Sym };
        c.op(Op::FakeQuantLearnedGrad { spec, wrt: qatc_ir::QuantParam::Scale }, &[w, s, x])
    });
    assert_no_rule("adam_m", |c, x| {
        let m = c.frozen("m", &[3, 4], ANY);
        c.op(Op::AdamM { beta1: 0.9 }, &[m, x])
    });
    assert_no_rule("adam_v", |c, x| {
        let v = c.frozen("v", &[3, 4], ANY);
        c.op(Op::AdamV { beta2: 0.999 }, &[v, x])
    });
    assert_no_rule("adam_param", |c, x| {
        let m = c.frozen("m", &[3, 4], ANY);
        let v = c.frozen("v", &[3, 4], POSITIVE);
        let lr = c.frozen("lr", &[], POSITIVE);
        let t = c.frozen("t", &[], POSITIVE);
        c.op(Op::AdamParam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }, &[x, m, v, lr, t])
    });
    assert_no_rule("all_finite", |c, x| c.op(Op::AllFinite, &[x]));
    assert_no_rule("select", |c, x| {
        let cond = c.frozen("cond", &[3, 4], ANY);
        let b = c.frozen("b", &[3, 4], ANY);
        c.op(Op::Select, &[cond, x, b])
    });
    assert_no_rule("loss_scale", |c, x| {
        let state = c.op(Op::Reshape { shape: Shape::new([12]) }, &[x]);
        let state = c.op(Op::Slice { axis: 0, start: 0, end: 2 }, &[state]);
        let finite = c.frozen("finite", &[], ANY);
        c.op(Op::LossScale { interval: 2000, growth: 2.0, backoff: 0.5 }, &[state, finite])
    });
    // 8-bit moments' quantization: optimizer ops, never differentiated
    assert_no_rule("block_absmax", |c, x| c.op(Op::BlockAbsMax, &[x]));
    assert_no_rule("block_dequant", |c, x| {
        let codes = c.g.input("codes", InputKind::Data, DType::U8, [3, 4]).expect("input");
        let a = c.op(Op::SumTo { shape: [1].into() }, &[x]);
        c.op(Op::BlockDequant { map: qatc_ir::DynMap::Signed }, &[codes, a])
    });
}

#[test]
fn ops_without_a_rule_are_fine_off_the_trainable_path() {
    // max of two frozen tensors feeds the loss, but no trainable input reaches it: no rule is
    // needed, and the gradient of the trainable branch is still right.
    let mut c = Case::new("max off path", 1900);
    let a = c.frozen("a", &[3, 4], ANY);
    let b = c.frozen("b", &[3, 4], ANY);
    let m = c.bin(BinaryOp::Max, a, b);
    let x = c.param("x", &[3, 4], ANY);
    let y = c.bin(BinaryOp::Mul, m, x);
    let y = c.un(UnaryOp::Tanh, y);
    c.check(y);
}
