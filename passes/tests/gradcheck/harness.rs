//! The gradient-check harness: seeded input values, a case under construction, and the check
//! of every gradient element against a central difference (tolerance: the module comment of
//! `gradcheck.rs`).

use std::collections::HashMap;

use qatc_ir::{verify, BinaryOp, DType, Graph, InputKind, NodeId, Op, Shape, UnaryOp};
use qatc_passes::autodiff::{autodiff, grad_name};
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
pub enum Dist {
    /// Uniform in [lo, hi).
    U(f64, f64),
    /// Uniform magnitude in [lo, hi), random sign: away from zero (for divisors, 1/x).
    AwayFromZero(f64, f64),
}

pub const ANY: Dist = Dist::U(-2.0, 2.0);
pub const POSITIVE: Dist = Dist::U(0.3, 2.0);

/// One gradient-check case: a forward graph under construction and the values of its inputs.
pub struct Case {
    name: String,
    pub g: Graph,
    rng: Rng,
    pub vals: HashMap<String, Value<f64>>,
    pub trainable: Vec<String>,
    /// For the harness's own test: (param, element, delta) added to one analytic gradient.
    pub tamper: Option<(String, usize, f64)>,
}

impl Case {
    pub fn new(name: &str, seed: u64) -> Case {
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

    pub fn param(&mut self, name: &str, shape: &[usize], d: Dist) -> NodeId {
        self.float_input(name, InputKind::Trainable, shape, d)
    }

    pub fn frozen(&mut self, name: &str, shape: &[usize], d: Dist) -> NodeId {
        self.float_input(name, InputKind::Frozen, shape, d)
    }

    /// An i32 Data input with the given values.
    pub fn ids(&mut self, name: &str, shape: &[usize], data: &[i32]) -> NodeId {
        let id = self.g.input(name, InputKind::Data, DType::I32, shape.to_vec()).expect("input");
        self.vals.insert(name.into(), Value::ints(shape.to_vec(), data.to_vec()).expect("value"));
        id
    }

    pub fn op(&mut self, op: Op, args: &[NodeId]) -> NodeId {
        let what = format!("{op:?}");
        self.g.add(op, args).unwrap_or_else(|e| panic!("{}: building {what}: {e}", self.name))
    }

    pub fn un(&mut self, u: UnaryOp, x: NodeId) -> NodeId {
        self.op(Op::Unary(u), &[x])
    }

    pub fn bin(&mut self, b: BinaryOp, x: NodeId, y: NodeId) -> NodeId {
        self.op(Op::Binary(b), &[x, y])
    }

    pub fn mm(&mut self, ta: bool, tb: bool, a: NodeId, b: NodeId) -> NodeId {
        self.op(Op::MatMul { ta, tb }, &[a, b])
    }

    /// Closes the graph with `loss = sum_to(y * w, [])` and declares the `loss` output.
    pub fn finish(&mut self, y: NodeId) {
        let shape = self.g.ty(y).shape.clone();
        let w = self.float_input("w", InputKind::Data, shape.dims(), Dist::U(-1.5, 1.5));
        let yw = self.bin(BinaryOp::Mul, y, w);
        let loss = self.op(Op::SumTo { shape: Shape::scalar() }, &[yw]);
        self.g.set_output("loss", loss).expect("loss output");
    }

    /// Differentiates the finished graph and evaluates it (loss and gradients) in f64.
    pub fn analytic(&self) -> (Graph, HashMap<String, Value<f64>>) {
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
    pub fn check(self, y: NodeId) -> Graph {
        self.check_values(y).0
    }

    /// `check`, also returning the autodiff graph's outputs.
    pub fn check_values(mut self, y: NodeId) -> (Graph, HashMap<String, Value<f64>>) {
        self.finish(y);
        self.check_finished()
    }

    pub fn check_finished(self) -> (Graph, HashMap<String, Value<f64>>) {
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
pub fn count(g: &Graph, mnemonic: &str) -> usize {
    g.op_counts().get(mnemonic).copied().unwrap_or(0)
}
