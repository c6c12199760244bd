//! A training step over ranks on the CUDA executor, emulated (`HostGpu`): the tiny full
//! fine-tune over 2 ranks at ZeRO 1 (its gradients reduce-scattered, the updated blocks
//! all-gathered, the loss all-reduced), each rank a thread with its own emulated GPU, two steps,
//! by both of the executor's paths (staged through the host; in the stream, captured in the
//! step's graph, the emulation standing in for NCCL): every rank holds the same loss and weights,
//! the two paths agree bit for bit (the emulation exchanges by the host rule), and both track the
//! reference interpreter's ranks (`run_ranks`) as the one-rank executor tracks the CPU.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use qatc::data::TokenFile;
use qatc::model::Model;
use qatc::step::{self, StepOptions};
use qatc_ir::Graph;
use qatc_kernels::{CudaSettings, Target};
use qatc_passes::zero::{Parallel, RANK};
use qatc_runtime::comm::threads::threads;
use qatc_runtime::comm::Communicator;
use qatc_runtime::cuda::{Collectives, CudaProgram, HostGpu};
use qatc_runtime::{Interpreter, Value};

const B: usize = 4;
const T: usize = 16;
const RANKS: usize = 2;
const STEPS: usize = 2;

fn floats(v: &Value<f32>) -> Vec<f64> {
    match v {
        Value::Float(t) => t.data.iter().map(|&x| f64::from(x)).collect(),
        Value::Int(t) => t.data.iter().map(|&x| f64::from(x)).collect(),
    }
}

/// Each rank's inputs for each step.
type RankSteps = Vec<Vec<HashMap<String, Value<f32>>>>;

/// The step graph of one rank and each rank's inputs for each step (its own rows of the
/// global batch of B rows), the weights and zeroed state included in the first.
fn setup() -> (Graph, RankSteps) {
    let m = Model::open(&common::fixture("tiny/f32_prefix/model.safetensors")).unwrap();
    let data = TokenFile::open(&common::fixture("tiny/tokens.bin")).unwrap();
    let rows = B / RANKS;
    let mut o = StepOptions::new(rows, T);
    o.adamw.eps = 1e-4;
    o.parallel = Parallel { ranks: RANKS, zero: 1 };
    let (g, _) = step::train(&m.cfg, &o, |_, _| {}).unwrap();
    let mut first = m.bind::<f32>(&g, None, 7).unwrap();
    common::zero_state(&g, &mut first);
    first.insert("lr".into(), Value::scalar(1e-2));
    let per_rank = (0..RANKS)
        .map(|r| {
            (0..STEPS)
                .map(|s| {
                    let mut v = if s == 0 { first.clone() } else { HashMap::new() };
                    let (ids, tgt) = data.batch(s % 2, B, T).unwrap();
                    let mine = |x: &[i32]| x[r * rows * T..(r + 1) * rows * T].to_vec();
                    v.insert("ids".into(), Value::ints([rows, T], mine(&ids)).unwrap());
                    v.insert("targets".into(), Value::ints([rows, T], mine(&tgt)).unwrap());
                    v.insert(RANK.into(), Value::ints([1], vec![r as i32]).unwrap());
                    v
                })
                .collect()
        })
        .collect();
    (g, per_rank)
}

/// Each rank's outputs and updates after every step, on the CUDA executor by path `how`.
fn on_emulated_gpus(g: &Graph, inputs: &RankSteps, how: Collectives) -> RankSteps {
    let prog = qatc_kernels::lower(g).expect("lowers");
    let t = Target::cuda(None, CudaSettings::default());
    let ranks: Vec<_> = threads(RANKS)
        .into_iter()
        .zip(inputs.to_vec())
        .map(|(comm, steps): (Arc<dyn Communicator>, _)| {
            let prog = prog.clone();
            std::thread::spawn(move || {
                let p = CudaProgram::new(prog, HostGpu::new(1 << 30), &t, None).expect("builds");
                let mut p = p.with_communicator(comm, how).expect("joins");
                steps.iter().map(|v| p.run(v).expect("a step")).collect::<Vec<_>>()
            })
        })
        .collect();
    ranks.into_iter().map(|r| r.join().expect("a rank")).collect()
}

#[test]
fn two_ranks_on_the_emulated_gpu_track_the_interpreters_ranks() {
    let (g, inputs) = setup();
    // the interpreter's ranks, step by step, the updates carried over
    let interp = Interpreter::<f32>::new(&g).unwrap();
    let mut state: Vec<HashMap<String, Value<f32>>> = inputs.iter().map(|s| s[0].clone()).collect();
    let mut want = Vec::new();
    for s in 0..STEPS {
        for (st, mine) in state.iter_mut().zip(&inputs) {
            st.extend(mine[s].clone());
        }
        let out = interp.run_ranks(&state).unwrap();
        for (r, o) in out.iter().enumerate() {
            state[r].extend(o.updates.clone());
        }
        want.push(out);
    }
    let host = on_emulated_gpus(&g, &inputs, Collectives::Host);
    let device = on_emulated_gpus(&g, &inputs, Collectives::Device);
    for r in 0..RANKS {
        for s in 0..STEPS {
            let (h, d) = (&host[r][s], &device[r][s]);
            for (name, v) in h {
                assert_eq!(common::bits(v), common::bits(&d[name]), "rank {r} step {s} {name}: the two paths");
            }
            let loss = floats(&h["loss"])[0];
            assert_eq!(loss, floats(&host[0][s]["loss"])[0], "rank {r}'s loss is rank 0's");
            let reference = floats(&want[s][r].outputs["loss"])[0];
            assert!((loss - reference).abs() <= 1e-5 * reference.abs(), "rank {r} step {s}: loss {loss} against {reference}");
            for (name, u) in &want[s][r].updates {
                let e = common::max_abs(&floats(&h[name]), &floats(u));
                assert!(e <= 1e-4, "rank {r} step {s}: {name} differs by {e:e}");
            }
        }
    }
}
