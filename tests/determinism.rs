//! Kernels are deterministic: a step run twice gives the same bits, on any number of threads.
//! The one source of run-to-run variation the lowering had, float atomics in scatter_add (the
//! embedding gradient), is gone: tokens are sorted by (id, position) with integer counts and each
//! table element is summed in token order (`kernels/src/lower/scatter.rs`). These tests run the
//! steps on 8 threads (more than this machine's cores, so chunks interleave) with the LLVM
//! kernels where built and the kernel-IR evaluator.

mod common;

use std::collections::HashMap;

use qatc::data::TokenFile;
use qatc::model::Model;
use qatc::step::StepOptions;
use qatc::trainer::Trainer;
use qatc_ir::{DType, Graph, InputKind, Op, UnaryOp};
use qatc_kernels::kir::{Body, Stmt};
use qatc_kernels::Program;
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::DROPOUT_SEED;
use qatc_runtime::{CpuProgram, Interpreter, Value};

const THREADS: usize = 8;

fn pool() -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new().num_threads(THREADS).build().expect("a thread pool")
}

/// Every output as bits, sorted by name.
fn bits(out: &HashMap<String, Value<f32>>) -> Vec<(String, Vec<u32>)> {
    let mut v: Vec<(String, Vec<u32>)> = out
        .iter()
        .map(|(n, v)| {
            let b = match v {
                Value::Float(t) => t.data.iter().map(|x| x.to_bits()).collect(),
                Value::Int(t) => t.data.iter().map(|&x| x as u32).collect(),
            };
            (n.clone(), b)
        })
        .collect();
    v.sort();
    v
}

/// The programs a step runs on: LLVM-compiled kernels where built, and the kernel-IR evaluator.
fn programs(prog: &Program) -> Vec<(&'static str, CpuProgram)> {
    #[allow(unused_mut)] // pushed to only with LLVM
    let mut v = vec![("KIR evaluator", CpuProgram::with_kir_eval(prog.clone()).expect("a program"))];
    #[cfg(feature = "llvm")]
    {
        let jit = qatc_kernels::llvm::Jit::compile(&prog.kernels).expect("LLVM compiles the kernels");
        v.push(("LLVM", CpuProgram::new(prog.clone(), Box::new(jit)).expect("a program")));
    }
    v
}

/// The float atomics of a program's kernels (there must be none).
fn float_atomics(prog: &Program) -> Vec<String> {
    fn walk(stmts: &[Stmt], k: &qatc_kernels::kir::Kernel, out: &mut Vec<String>) {
        for s in stmts {
            match s {
                Stmt::AtomicAdd { param, .. } if k.params[*param].dtype != DType::I32 => out.push(format!("{} ({})", k.family, k.note)),
                Stmt::Reduce { body, .. } | Stmt::ForEach { body, .. } => walk(body, k, out),
                _ => {}
            }
        }
    }
    let mut out = Vec::new();
    for k in &prog.kernels {
        if let Body::Loops { stmts, .. } = &k.body {
            walk(stmts, k, &mut out);
        }
    }
    out
}

fn step_options(fuse: bool) -> StepOptions {
    let mut o = StepOptions::new(2, 32);
    o.fuse = fuse.then(FuseOptions::default);
    o.keep_grads = true;
    o
}

/// The tiny model's step (B 2, T 32: the embedding gradient's kernels split over threads) run
/// twice on each program, and on a second program of the same kind: every output the same bits.
fn same_bits_twice(what: &str, o: StepOptions) {
    let m = Model::open(&common::fixture("tiny/f32_prefix/model.safetensors")).expect("the tiny model");
    let data = TokenFile::open(&common::fixture("tiny/tokens.bin")).expect("tokens");
    let (b, t) = (o.batch, o.seq);
    let tr = Trainer::new(&m, o, None, 3).expect("a trainer");
    let prog = qatc_kernels::lower(&tr.graph).expect("lowers");
    assert_eq!(float_atomics(&prog), Vec::<String>::new(), "{what}: no kernel adds floats atomically");
    let mut state = tr.state().expect("the state");
    let (ids, targets) = data.batch(0, b, t).expect("a batch");
    state.insert("ids".into(), Value::ints([b, t], ids).expect("ids"));
    state.insert("targets".into(), Value::ints([b, t], targets).expect("targets"));
    state.insert(DROPOUT_SEED.into(), Value::ints([], vec![7]).expect("a seed"));
    state.insert("lr".into(), Value::scalar(1e-2));
    let pool = pool();
    let first: Vec<(&str, HashMap<String, Value<f32>>)> = pool.install(|| {
        programs(&prog)
            .into_iter()
            .map(|(label, mut cp)| (label, cp.run(&state).unwrap_or_else(|e| panic!("{what}, {label}: {e}"))))
            .collect()
    });
    for (label, mut cp) in programs(&prog) {
        let want = &first.iter().find(|(l, _)| *l == label).expect("the same kinds").1;
        for run in 0..2 {
            let got = pool.install(|| cp.run(&state)).unwrap_or_else(|e| panic!("{what}, {label}: {e}"));
            assert!(got.keys().any(|k| k.starts_with("grad:")), "{what}: gradients are outputs: {:?}", got.keys().collect::<Vec<_>>());
            for ((name, a), (_, b)) in bits(&got).iter().zip(bits(want).iter()) {
                assert!(a == b, "{what}, {label}, run {run}: {name} differs from the first run's");
            }
        }
    }
}

#[test]
fn the_full_finetune_step_gives_the_same_bits_every_run() {
    same_bits_twice("full fine-tune, unfused", step_options(false));
    same_bits_twice("full fine-tune, fused", step_options(true));
}

/// scatter_add alone, with ids repeated hundreds of times and out of order: the kernel-IR
/// evaluator sums each row in token order from zero (in f64, rounded once: `kir_eval.rs`), so the
/// table is the same bits on every run, and the interpreter's (in order, in f32) within its
/// rounding.
#[test]
fn scatter_add_sums_each_row_in_token_order() {
    let (n, c, rows) = (1024, 24, 37);
    let mut g = Graph::new("scatter");
    let ids = g.input("ids", InputKind::Data, DType::I32, vec![n]).expect("an input");
    let dy = g.input("dy", InputKind::Data, DType::F32, vec![n, c]).expect("an input");
    let sq = g.add(Op::Unary(UnaryOp::Square), &[dy]).expect("a node");
    let d = g.add(Op::ScatterAdd { rows }, &[ids, sq]).expect("a node");
    g.set_output("table", d).expect("an output");
    // ids: a few rows hit hundreds of times, some never; values of mixed magnitude, so the order
    // of additions shows in the last bits
    let id: Vec<i32> = (0..n).map(|i| ((i * 7919 + i / 3) % 11 + (i % 3) * (i % 13)) as i32 % rows as i32).collect();
    let mut state = 42u64;
    let mut uniform = move || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    let v: Vec<f64> = (0..n * c).map(|_| (uniform() * 2.0 - 1.0) * if uniform() < 0.1 { 1e3 } else { 1.0 }).collect();
    let inputs = HashMap::from([
        ("ids".to_string(), Value::ints([n], id).expect("ids")),
        ("dy".to_string(), Value::floats(vec![n, c], &v).expect("dy")),
    ]);
    let want = Interpreter::<f32>::new(&g).expect("an interpreter").run(&inputs).expect("runs");
    let prog = qatc_kernels::lower(&g).expect("lowers");
    assert!(float_atomics(&prog).is_empty());
    let pool = pool();
    let mut cp = CpuProgram::with_kir_eval(prog.clone()).expect("a program");
    let first = pool.install(|| cp.run(&inputs)).expect("runs");
    let near = |got: &HashMap<String, Value<f32>>| {
        let (a, b) = (got["table"].as_float().expect("floats"), want["table"].as_float().expect("floats"));
        a.data.iter().zip(&b.data).fold(0.0f64, |m, (x, y)| m.max(f64::from((x - y).abs()) / f64::from(y.abs()).max(1.0)))
    };
    assert!(near(&first) < 1e-5, "the evaluator's table is the interpreter's within its rounding: {}", near(&first));
    for run in 1..3 {
        let got = pool.install(|| cp.run(&inputs)).expect("runs");
        assert!(bits(&got) == bits(&first), "run {run}: the evaluator's table differs from its first run's");
    }
    // LLVM may fold each sum in another (fixed) order: the same bits on every run, near the
    // interpreter's
    for (label, mut cp) in programs(&prog) {
        let first = pool.install(|| cp.run(&inputs)).expect("runs");
        let again = pool.install(|| cp.run(&inputs)).expect("runs");
        assert!(bits(&first) == bits(&again), "{label}: two runs differ");
        let (a, b) = (first["table"].as_float().expect("floats"), want["table"].as_float().expect("floats"));
        let err = a.data.iter().zip(&b.data).fold(0.0f64, |m, (x, y)| m.max(f64::from((x - y).abs()) / f64::from(y.abs()).max(1.0)));
        assert!(err < 1e-5, "{label}: {err}");
    }
}

/// The fused step and its lowered program are the same on every build, not only their results:
/// with 8-bit AdamW in bf16 the blockwise moments' kernels took their parameters in a hash map's
/// order, so whether tensors of one shape shared a kernel changed from run to run (the demo's step
/// lowered to 77 or 78 kernels; a different program every time defeats the kernel cache and the
/// snapshots). Every precision and optimizer `--fit` searches, with and without recompute, for
/// both executors.
#[test]
fn the_lowered_program_is_the_same_every_time() {
    use qatc::frontend::config::Gpt2Config;
    use qatc::step;
    use qatc_passes::optim::Moments;
    use qatc_passes::precision::Precision;
    use qatc_passes::remat::Checkpoint;
    let cfg = Gpt2Config { n_embd: 128, n_layer: 4, n_head: 4, n_positions: 256, vocab_size: 50257, layer_norm_epsilon: 1e-5 };
    for precision in [Precision::Fp32, Precision::Bf16] {
        for moments in [Moments::F32, Moments::Blockwise8] {
            for checkpoint in [Checkpoint::None, Checkpoint::Blocks] {
                let mut o = StepOptions::new(2, 64);
                o.model.quant = Some(qatc_passes::quant::QuantOptions::all_linears(qatc_ir::QuantSpec {
                    bits: 2,
                    group: 64,
                    scheme: qatc_ir::QuantScheme::Sym,
                }));
                o.model.lora = Some(qatc_passes::lora::LoraOptions::new(16));
                o.model.full_finetune = false;
                (o.adamw.moments, o.precision, o.checkpoint) = (moments, precision, checkpoint);
                o.fuse = Some(FuseOptions::default());
                let what = format!("{precision:?}, {moments:?}, {}", checkpoint.describe());
                let built = || step::train(&cfg, &o, |_, _| {}).expect("the step").0;
                let g = built();
                for _ in 0..2 {
                    assert_eq!(qatc_ir::print(&built()), qatc_ir::print(&g), "{what}: the fused step changed between two builds");
                }
                for target in [qatc_driver::Target::cpu(), qatc_driver::Target::cuda(None, Default::default())] {
                    let lowered = || qatc_driver::plan(&g, &target, &Default::default()).expect("a plan").program;
                    let first: Program = lowered();
                    for _ in 0..3 {
                        let again = lowered();
                        assert_eq!(again.kernels.len(), first.kernels.len(), "{what}, {}", target.kind.name());
                        assert!(again == first, "{what}, {}: the program changed between two lowerings of one step", target.kind.name());
                    }
                }
            }
        }
    }
}
