//! The lock step of `tests/cuda_exec.rs`: an executor driven as the trainer drives one
//! (`TrainStep`: state set once, per step the data in and the outputs out), and two executors
//! stepped side by side from the same state, their outputs and state compared.

use std::collections::HashMap;

use qatc::data::TokenFile;
use qatc::step::StepOptions;
use qatc_ir::InputKind;
use qatc_kernels::program::BufKind;
use qatc_kernels::Program;
use qatc_passes::lora::DROPOUT_SEED;
use qatc_passes::precision::Precision;
use qatc_runtime::{CpuProgram, RuntimeError, TrainStep, Value};

/// What a run of `n` steps gave: each step's outputs, and every trainable and state input read
/// back at the end.
pub struct Run {
    pub steps: Vec<HashMap<String, Value<f32>>>,
    pub state: HashMap<String, Value<f32>>,
}

pub fn set(step: &mut dyn TrainStep, name: &str, v: Value<f32>) {
    match step.set_input(name, &v) {
        // a per-step input the step does not have (a dropout seed without dropout)
        Err(RuntimeError::UnknownInput(_)) => {}
        r => r.unwrap_or_else(|e| panic!("{name}: {e}")),
    }
}

/// Step `s`'s data inputs: its batch, a learning rate, a dropout seed.
pub fn give_batch(step: &mut dyn TrainStep, data: &TokenFile, o: &StepOptions, s: usize) {
    let (ids, targets) = data.batch(s, o.batch, o.seq).expect("a batch");
    set(step, "ids", Value::ints([o.batch, o.seq], ids).expect("ids"));
    set(step, "targets", Value::ints([o.batch, o.seq], targets).expect("targets"));
    set(step, DROPOUT_SEED, Value::ints([], vec![5 + s as i32]).expect("a seed"));
    set(step, "lr", Value::scalar(LR));
}

/// Every trainable and state input, read back.
pub fn read_state(step: &dyn TrainStep, prog: &Program) -> HashMap<String, Value<f32>> {
    let mut back = HashMap::new();
    for b in &prog.buffers {
        if let BufKind::Input(name, InputKind::Trainable | InputKind::State) = &b.kind {
            back.insert(name.clone(), step.read_input(name).unwrap_or_else(|e| panic!("{name}: {e}")));
        }
    }
    back
}

/// Drives `step` as the trainer does: the state once, then per step the data in and the outputs
/// out; the state read back at the end.
pub fn drive(
    step: &mut dyn TrainStep,
    prog: &Program,
    state: &HashMap<String, Value<f32>>,
    data: &TokenFile,
    o: &StepOptions,
    n: usize,
) -> Run {
    for (name, v) in state {
        set(step, name, v.clone());
    }
    let mut steps = Vec::new();
    for s in 0..n {
        give_batch(step, data, o, s);
        step.run().unwrap_or_else(|e| panic!("step {s}: {e}"));
        steps.push(step.outputs().expect("the outputs"));
    }
    Run { steps, state: read_state(step, prog) }
}

pub fn floats(v: &Value<f32>) -> Vec<f64> {
    match v {
        Value::Float(t) => t.data.iter().map(|&x| f64::from(x)).collect(),
        Value::Int(t) => t.data.iter().map(|&x| f64::from(x)).collect(),
    }
}

/// The largest errors of one step against the reference's from the same state: (over its
/// outputs, element-wise relative to each tensor's largest element; over the state it updated,
/// norm-wise, since AdamW divides by sqrt(v), which amplifies the last bits of a gradient near
/// zero: tests/compiled_cpu.rs), each with where.
#[derive(Default)]
pub struct Worst {
    pub outputs: (f64, String),
    pub state: (f64, String),
    /// 16-bit steps: the bound of [`ulps16`], and (parameter elements whose AdamW step went
    /// another way, parameter elements compared).
    pub sixteen: Option<f64>,
    pub turned: (usize, usize),
}

/// The learning rate [`give_batch`] gives every step.
const LR: f64 = 1e-3;

impl Worst {
    /// `grads`: the reference's outputs, where a parameter's gradient is (`grad:NAME`).
    fn add(
        &mut self,
        s: usize,
        got: &HashMap<String, Value<f32>>,
        want: &HashMap<String, Value<f32>>,
        grads: Option<&HashMap<String, Value<f32>>>,
    ) {
        assert_eq!(got.len(), want.len(), "step {s}: the same values");
        for (name, w) in want {
            let g = floats(got.get(name).unwrap_or_else(|| panic!("step {s}: no {name}")));
            assert!(g.iter().all(|x| x.is_finite()), "step {s}: {name} is not finite");
            let w = floats(w);
            let grad = grads.and_then(|o| o.get(&format!("grad:{name}")));
            let (e, slot) = match (grads, self.sixteen.zip(grad)) {
                (None, _) => (crate::common::rel_err(&g, &w), &mut self.outputs),
                (Some(_), None) => (crate::common::norm_rel_err(&g, &w), &mut self.state),
                (Some(_), Some((tol, grad))) => {
                    // a parameter after AdamW: its step lr m/(sqrt(v) + eps) turns on the sign and
                    // size of a gradient near zero, which the gradient's bound (relative to its
                    // largest element) leaves open; where the gradient is that close to zero the
                    // two steps may differ by up to about 2 lr (opposite directions); everywhere
                    // else the parameter is within the bound
                    let grad = floats(grad);
                    let (gmax, pmax) = (grad.iter().fold(0.0f64, |m, x| m.max(x.abs())), w.iter().fold(0.0f64, |m, x| m.max(x.abs())));
                    let (mut d2, mut n2) = (0.0f64, 0.0f64);
                    for ((x, y), d) in g.iter().zip(&w).zip(&grad) {
                        let off = (x - y).abs();
                        if off > tol * pmax {
                            assert!(d.abs() <= tol * gmax && off <= 2.5 * LR, "step {s}: {name}: {x} vs {y} (gradient {d:e} of {gmax:e})");
                            self.turned.0 += 1;
                        } else {
                            d2 += off * off;
                        }
                        n2 += y * y;
                    }
                    self.turned.1 += g.len();
                    // the rest norm-wise, as the other state
                    (d2.sqrt() / n2.sqrt().max(1e-30), &mut self.state)
                }
            };
            if e >= slot.0 {
                *slot = (e, format!("step {s} {name}"));
            }
        }
    }
}

/// `step` and the CPU executor in lock step over `n` steps: `step` keeps its own state on its
/// device throughout; before each step the CPU is given the state `step` read back, so every
/// step is compared from the same state (two f32 runs that differ in the last bits drift apart
/// through AdamW, which would say nothing of the executor).
pub fn lockstep(
    step: &mut dyn TrainStep,
    cpu: &mut CpuProgram,
    prog: &Program,
    state: &HashMap<String, Value<f32>>,
    data: &TokenFile,
    o: &StepOptions,
    n: usize,
) -> (Worst, Vec<f64>) {
    for (name, v) in state {
        set(step, name, v.clone());
        set(cpu, name, v.clone());
    }
    let mut worst = Worst { sixteen: (o.precision != Precision::Fp32).then(|| ulps16(o.precision)), ..Worst::default() };
    let mut losses = Vec::new();
    for s in 0..n {
        give_batch(step, data, o, s);
        give_batch(cpu, data, o, s);
        step.run().unwrap_or_else(|e| panic!("step {s}: {e}"));
        cpu.execute().unwrap_or_else(|e| panic!("CPU step {s}: {e}"));
        let (got, want) = (step.outputs().expect("outputs"), TrainStep::outputs(cpu).expect("outputs"));
        worst.add(s, &got, &want, None);
        losses.push((floats(&got["loss"])[0], floats(&want["loss"])[0]));
        let got_state = read_state(step, prog);
        worst.add(s, &got_state, &read_state(cpu, prog), Some(&want));
        for (name, v) in got_state {
            set(cpu, &name, v);
        }
    }
    (worst, losses.into_iter().flat_map(|(a, b)| [a, b]).collect())
}

pub fn bits_equal(a: &Run, b: &Run) -> bool {
    let same = |x: &HashMap<String, Value<f32>>, y: &HashMap<String, Value<f32>>| {
        x.len() == y.len()
            && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| floats(v).iter().zip(floats(w)).all(|(p, q)| p.to_bits() == q.to_bits())))
    };
    a.steps.len() == b.steps.len() && a.steps.iter().zip(&b.steps).all(|(x, y)| same(x, y)) && same(&a.state, &b.state)
}

/// The bound of a bf16/fp16 step against the CPU executor, relative to each tensor's largest
/// element (outputs) or norm-wise (the state it updated): six ulps of the compute type, the
/// bound the compiled CPU path holds against the interpreter (tests/llvm_equivalence.rs). The
/// kernels are the same evaluator on both sides; the GEMMs are not: cuBLAS' model sums in f64
/// and rounds its 16-bit result once, the CPU's f32 tiles in another order, so a product that
/// lands near a rounding boundary of the 16-bit output rounds the other way (one ulp), and later
/// values carry that ulp on.
pub fn ulps16(p: Precision) -> f64 {
    match p {
        Precision::Bf16 => 6.0 * 2f64.powi(-8),
        _ => 6.0 * 2f64.powi(-11),
    }
}

/// A 16-bit lock step judged: the worst loss, output and state errors within [`ulps16`] of the
/// precision, and at most 1% of the parameter elements stepped another way; printed first.
pub fn judge16(what: &str, p: Precision, worst: &Worst, losses: &[f64]) {
    let loss_err = losses.chunks(2).map(|l| (l[0] - l[1]).abs() / l[1].abs().max(1e-30)).fold(0.0f64, f64::max);
    eprintln!(
        "{what}: losses {:?}; worst loss error {loss_err:.1e}, output {:.1e} ({}), state {:.1e} ({}); bound {:.1e}; {} of {} parameter elements stepped another way",
        losses.chunks(2).map(|l| l[0] as f32).collect::<Vec<_>>(),
        worst.outputs.0,
        worst.outputs.1,
        worst.state.0,
        worst.state.1,
        ulps16(p),
        worst.turned.0,
        worst.turned.1
    );
    assert!(worst.turned.0 * 100 <= worst.turned.1, "{what}: more than 1% of the parameters stepped another way");
    assert!(loss_err <= ulps16(p), "{what}: a loss off by {loss_err:e}");
    assert!(worst.outputs.0 <= ulps16(p), "{what}: {} off by {:e}", worst.outputs.1, worst.outputs.0);
    assert!(worst.state.0 <= ulps16(p), "{what}: {} off by {:e}", worst.state.1, worst.state.0);
}
