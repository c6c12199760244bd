//! The whole tiny training step (B 2, T 16), lowered to kernels and GEMMs and run by the CPU
//! executor with the kernel-IR evaluator, matches the reference interpreter, unfused and fused,
//! for a full fine-tune and for 4-bit + LoRA (with LoRA dropout; also clipped and accumulated over
//! two micro-batches): the loss, every gradient and every Adam moment within 1e-5 relative per
//! tensor (max |compiled - interpreter| / max |interpreter|); every updated weight exactly the
//! interpreter's AdamW of the compiled moments, and near the interpreter's weight (`adam_errors`
//! says why not within 1e-5). Two steps, the second from the first's state (non-zero moments,
//! step 1) through the same executor. This checks `qatc_kernels::lower` on real steps: the
//! attention kernels of the fused step, the row kernels, the dequantized 4-bit weights.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

use qatc::data::TokenFile;
use qatc::model::Model;
use qatc::step::StepOptions;
use qatc::trainer::Trainer;
use qatc_ir::{QuantScheme, QuantSpec};
use qatc_kernels::LowerOptions;
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::{LoraOptions, DROPOUT_SEED};
use qatc_passes::microbatch;
use qatc_passes::optim::AdamW;
use qatc_passes::quant::QuantOptions;
use qatc_runtime::exec::{Hoist, Region};
use qatc_runtime::ops::elementwise::{adam_param, AdamHyper};
use qatc_runtime::{BufferLayout, CpuOptions, CpuProgram, ExecOptions, ExecPlan, Interpreter, RuntimeError, Value};

const TOL: f64 = 1e-5;
const LR: f64 = 1e-2;
/// Norm-wise, for weights after AdamW (see `adam_errors`): a LoRA B that starts at zero moves by
/// about lr in every element, flipped where its gradient is below f32 noise, which reaches ~1e-3
/// after clipping; a wrong update (bias correction, decay, a gradient) is off by 1e-1 or more.
const PARAM_TOL: f64 = 1e-2;

fn floats(v: &Value<f32>) -> Vec<f64> {
    match v {
        Value::Float(t) => t.data.iter().map(|&x| f64::from(x)).collect(),
        Value::Int(t) => t.data.iter().map(|&x| f64::from(x)).collect(),
    }
}

/// A weight after AdamW amplifies f32 noise: Adam divides each moment by its own magnitude, so an
/// element whose gradient is tiny (or exactly zero in exact arithmetic: the key third of
/// `c_attn.bias`) moves by up to lr in a direction that rounding decides, in either program (see
/// tests/parity_train.rs). So a weight is checked twice: element-wise against the interpreter's
/// AdamW (`ops::elementwise::adam_param`) applied to the compiled step's own moments (which
/// are checked element-wise against the interpreter's), and norm-wise against the interpreter's
/// weight. Returns (element-wise max relative error, norm-wise relative error).
fn adam_errors(
    h: &AdamW,
    old: &Value<f32>,
    got: &Value<f32>,
    want: &Value<f32>,
    out: &HashMap<String, Value<f32>>,
    name: &str,
) -> (f64, f64) {
    let f = |v: &Value<f32>| v.as_float().map(|t| t.data.clone()).unwrap_or_default();
    let (m, v, t) = (f(&out[&format!("adam.m:{name}")]), f(&out[&format!("adam.v:{name}")]), f(&out["step"])[0]);
    let hyper = AdamHyper { beta1: h.beta1, beta2: h.beta2, eps: h.eps, weight_decay: h.weight_decay };
    let p = adam_param(&f(old), &m, &v, LR, f64::from(t), hyper).unwrap();
    let up: Vec<f64> = p.iter().map(|&x| f64::from(x)).collect();
    (common::rel_err(&floats(got), &up), common::norm_rel_err(&floats(got), &floats(want)))
}

fn qlora(o: &mut StepOptions) {
    o.model.full_finetune = false;
    o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 32, scheme: QuantScheme::Sym }));
    let mut l = LoraOptions::new(4);
    l.dropout = 0.1;
    o.model.lora = Some(l);
}

/// Checks one compiled run's outputs against the interpreter's; returns a line on the worst
/// errors.
fn check(
    what: &str,
    h: &AdamW,
    before: &HashMap<String, Value<f32>>,
    got: &HashMap<String, Value<f32>>,
    want: &HashMap<String, Value<f32>>,
    applied: bool,
) -> String {
    assert_eq!(got.len(), want.len(), "{what}: the same outputs");
    let mut names: Vec<&String> = want.keys().collect();
    names.sort();
    let mut worst = [(0.0f64, ""); 3];
    for name in names {
        let (g, w) = (got.get(name).unwrap_or_else(|| panic!("{what}: no output {name}")), &want[name]);
        // a micro-batch that is not a step's last keeps every weight as it was
        if applied && got.contains_key(&format!("adam.m:{name}")) {
            let (e, n) = adam_errors(h, &before[name], g, w, got, name);
            assert!(e <= TOL, "{what}: {name} is not AdamW of the compiled moments: {e:e} relative");
            assert!(n <= PARAM_TOL, "{what}: {name} differs by {n:e} norm-wise");
            if e > worst[1].0 {
                worst[1] = (e, name.as_str());
            }
            if n > worst[2].0 {
                worst[2] = (n, name.as_str());
            }
        } else {
            let e = common::rel_err(&floats(g), &floats(w));
            assert!(e <= TOL, "{what}: {name} differs by {e:e} relative");
            if e > worst[0].0 {
                worst[0] = (e, name.as_str());
            }
        }
    }
    let [a, b, c] = worst;
    format!("worst {:.1e} ({}); weights {:.1e} from the moments, {:.1e} norm-wise ({})", a.0, a.1, b.0, c.0, c.1)
}

/// Runs two steps of `o` on the interpreter and compiled (kernels by the kernel-IR evaluator,
/// and with the `llvm` feature also by LLVM), comparing every output after each; returns the
/// attention kernel parts of the program.
fn compare(what: &str, o: StepOptions) -> BTreeSet<String> {
    compare_with(what, o, 0, &LowerOptions::default())
}

/// `compare`, with the 4-bit weights fed to their GEMMs in panels of at most `panel_bytes`
/// (`qatc_kernels::panels`) when that is not 0: the rewrite must find every dequantized weight
/// and change no output beyond f32 reassociation of the split GEMMs.
fn compare_with(what: &str, mut o: StepOptions, panel_bytes: usize, options: &LowerOptions) -> BTreeSet<String> {
    let m = Model::open(&common::fixture("tiny/f32_prefix/model.safetensors")).unwrap();
    let data = TokenFile::open(&common::fixture("tiny/tokens.bin")).unwrap();
    o.keep_grads = true;
    let (b, t, k) = (o.batch, o.seq, o.grad_accum);
    let tr = Trainer::new(&m, o.clone(), None, 3).unwrap();
    let interp = Interpreter::<f32>::new(&tr.graph).unwrap();
    let mut prog = qatc_kernels::lower_with(&tr.graph, options).unwrap_or_else(|e| panic!("{what}: lower: {e}"));
    let mut panels = qatc_kernels::panels::PanelTable::default();
    if panel_bytes > 0 {
        // unfused, one dequantized value per 4-bit weight, read by its forward and backward
        // GEMMs; fused, one materialized per GEMM (the report counts them)
        let dequants = if o.fuse.is_some() {
            prog.materialized.len()
        } else {
            prog.buffers
                .iter()
                .filter(|b| b.dtype == qatc_ir::DType::I4 && matches!(b.kind, qatc_kernels::program::BufKind::Input(..)))
                .count()
        };
        let before: usize = prog.buffers.iter().map(|b| b.bytes()).sum();
        let r;
        (panels, r) = qatc_kernels::panels::feed_panels(&mut prog, panel_bytes);
        let after: usize = prog.buffers.iter().map(|b| b.bytes()).sum();
        eprintln!("{what}: {}", r.lines.join("; "));
        assert!(dequants > 0 && r.lines.len() == dequants, "{what}: {} of {dequants} dequantized weights fed in panels", r.lines.len());
        assert_eq!(before - after, r.bytes_saved - r.scratch_bytes, "{what}: the buffers shrank by what the report says");
        let fed: Vec<_> = panels.iter().map(|(_, f)| f).collect();
        assert!(fed.iter().any(|f| f.rows_are_k) && fed.iter().any(|f| !f.rows_are_k), "{what}: both b = W and b = W^T are fed");
        assert!(fed.iter().any(|f| f.rows % f.panel != 0 && f.rows > f.panel), "{what}: some weight ends in a short panel");
    }
    eprintln!("{what}: {} kernels, {} launches, {} GEMMs", prog.kernels.len(), prog.launches(), prog.gemms().count());
    let parts: BTreeSet<String> = prog
        .kernels
        .iter()
        .filter_map(|k| match &k.body {
            qatc_kernels::kir::Body::Attention(a) => Some(format!("{:?}", a.part)),
            qatc_kernels::kir::Body::Loops { .. } => None,
        })
        .collect();
    let mut runners = Vec::new();
    // each as `CpuProgram::new` makes it, with the GEMMs the rewrite feeds
    let fed = |launcher: Box<dyn qatc_runtime::Launcher>| {
        let exec = ExecOptions::new(qatc_runtime::cpu::ALIGN);
        CpuProgram::with_panels(prog.clone(), panels.clone(), launcher, exec, &CpuOptions::default())
            .unwrap_or_else(|e| panic!("{what}: {e}"))
    };
    #[cfg(feature = "llvm")]
    {
        let jit = qatc_kernels::llvm::Jit::compile(&prog.kernels).unwrap_or_else(|e| panic!("{what}: {e}"));
        runners.push(("LLVM", fed(Box::new(jit))));
        // as `qatc train` runs it: attention as GEMMs, the rest by LLVM
        let jit = qatc_kernels::llvm::Jit::compile(&prog.kernels).unwrap_or_else(|e| panic!("{what}: {e}"));
        let gemm_attention = qatc_runtime::cpu::GemmAttention::new(jit, &prog.kernels);
        runners.push(("LLVM + GEMM attention", fed(Box::new(gemm_attention))));
    }
    runners.push(("KIR evaluator", fed(Box::new(qatc_runtime::KirEval::new(&prog.kernels)))));
    let mut state = tr.state().unwrap();
    let updates: Vec<String> = tr.graph.outputs().iter().filter(|o| o.update).map(|o| o.name.clone()).collect();
    assert!(!updates.is_empty());
    // a step is K runs of one micro-batch's program, the last applying the update
    for step in 0..2 {
        for i in 0..k {
            let (ids, targets) = data.batch(step * k + i, b, t).unwrap();
            state.insert("ids".into(), Value::ints([b, t], ids).unwrap());
            state.insert("targets".into(), Value::ints([b, t], targets).unwrap());
            state.insert(DROPOUT_SEED.into(), Value::ints([], vec![1234 + (step * k + i) as i32]).unwrap());
            if k > 1 {
                state.insert(microbatch::APPLY.into(), Value::scalar(if i + 1 == k { 1.0 } else { 0.0 }));
            }
            state.insert("lr".into(), Value::scalar(LR));
            let t0 = Instant::now();
            let want = interp.run(&state).unwrap();
            eprintln!("{what}, step {step}.{i}: interpreter {:.1} ms", t0.elapsed().as_secs_f64() * 1e3);
            assert!(want.contains_key("loss") && want.keys().any(|n| n.starts_with("grad:")));
            for (label, cp) in &mut runners {
                let t0 = Instant::now();
                let got = cp.run(&state).unwrap_or_else(|e| panic!("{what}, step {step}.{i}, {label}: {e}"));
                let ms = t0.elapsed().as_secs_f64() * 1e3;
                let worst = check(&format!("{what}, step {step}.{i}, {label}"), &o.adamw, &state, &got, &want, i + 1 == k);
                eprintln!("  {label}: {ms:.1} ms; {worst}");
            }
            // the next run starts from the interpreter's state: Adam-amplified noise in the
            // weights (see `adam_errors`) would otherwise grow into the next step's gradients
            for u in &updates {
                state.insert(u.clone(), want[u].clone());
            }
        }
    }
    parts
}

#[test]
fn full_finetune_step_unfused() {
    compare("full fine-tune, unfused", StepOptions::new(2, 16));
}

#[test]
fn full_finetune_step_fused() {
    let mut o = StepOptions::new(2, 16);
    o.fuse = Some(FuseOptions::default());
    let parts = compare("full fine-tune, fused", o);
    assert!(parts.len() >= 4, "the fused step's attention runs as attention kernels: {parts:?}");
}

#[test]
fn qlora_step_unfused() {
    let mut o = StepOptions::new(2, 16);
    qlora(&mut o);
    compare("4-bit + LoRA, unfused", o);
}

#[test]
fn qlora_step_fused() {
    let mut o = StepOptions::new(2, 16);
    qlora(&mut o);
    o.fuse = Some(FuseOptions::default());
    let parts = compare("4-bit + LoRA, fused", o);
    assert!(parts.contains("Forward") && parts.contains("BackwardV"), "{parts:?}");
}

/// The step as `qatc train` lowers it on the CPU (`Target::cpu`'s options): rows run in order, the
/// cross-entropy walks the vocabulary in tiles, and each layer's dq, dk and dv come from one
/// attention backward whose delta is rowsum(dout * out) (`kernels/src/lower/attention.rs`).
#[test]
fn steps_fused_as_the_cpu_target_lowers_them() {
    let cpu = qatc_kernels::Target::cpu().lower_options();
    let mut o = StepOptions::new(2, 16);
    o.fuse = Some(FuseOptions::default());
    let parts = compare_with("full fine-tune, fused, the CPU target's lowering", o.clone(), 0, &cpu);
    assert!(parts.contains("Backward"), "one attention backward per layer: {parts:?}");
    qlora(&mut o);
    let parts = compare_with("4-bit + LoRA, fused, the CPU target's lowering", o, 0, &cpu);
    assert!(parts.contains("Backward"), "one attention backward per layer: {parts:?}");
}

/// The dequantized weights fed to the GEMMs a few rows at a time (panels of 5000 bytes: 6 rows
/// of a [64, 192] weight, 19 of a [.., 64] one, so most weights end in a short panel), unfused
/// and fused.
#[test]
fn qlora_step_panels() {
    let mut o = StepOptions::new(2, 16);
    qlora(&mut o);
    compare_with("4-bit + LoRA, unfused, in panels", o.clone(), 5000, &LowerOptions::default());
    o.fuse = Some(FuseOptions::default());
    compare_with("4-bit + LoRA, fused, in panels", o, 5000, &LowerOptions::default());
}

/// Gradient clipping (a global norm: a reduction over every gradient) and accumulation over two
/// micro-batches, fused.
#[test]
fn clipped_accumulated_qlora_step_fused() {
    let mut o = StepOptions::new(2, 16);
    qlora(&mut o);
    o.clip = Some(0.5);
    o.grad_accum = 2;
    o.fuse = Some(FuseOptions::default());
    compare("4-bit + LoRA, clipped, 2 micro-batches, fused", o);
}

/// The outputs as bits: equal means bit for bit (NaNs included).
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

/// Buffers that are never live at the same step share memory, and that changes nothing: the tiny
/// 4-bit + LoRA step, as the trainer runs it (the dequantization of frozen weights hoisted, the
/// frozen weights set on the first run only, the updates written back over their inputs by the
/// executor), gives the same outputs and state bit for bit over three steps whether its buffers
/// share or not, from an arena smaller than the buffers it holds.
#[test]
fn shared_buffers_change_no_bit_of_three_steps() {
    for fuse in [false, true] {
        let mut o = StepOptions::new(2, 16);
        qlora(&mut o);
        o.fuse = fuse.then(FuseOptions::default);
        let what = format!("4-bit + LoRA, fuse {fuse}");
        let m = Model::open(&common::fixture("tiny/f32_prefix/model.safetensors")).unwrap();
        let data = TokenFile::open(&common::fixture("tiny/tokens.bin")).unwrap();
        let (b, t) = (o.batch, o.seq);
        let tr = Trainer::new(&m, o, None, 3).unwrap();
        let prog = qatc_kernels::lower(&tr.graph).unwrap();
        let program = |layout: BufferLayout| -> CpuProgram {
            #[cfg(feature = "llvm")]
            let launcher: Box<dyn qatc_runtime::Launcher> = Box::new(qatc_kernels::llvm::Jit::compile(&prog.kernels).unwrap());
            #[cfg(not(feature = "llvm"))]
            let launcher: Box<dyn qatc_runtime::Launcher> = Box::new(qatc_runtime::KirEval::new(&prog.kernels));
            let exec = ExecOptions { layout, hoist: Hoist::Everything, ..ExecOptions::new(qatc_runtime::cpu::ALIGN) };
            let cp = CpuProgram::with_options(prog.clone(), launcher, exec, &CpuOptions::default()).unwrap();
            assert!(cp.plan().hoisted_steps() > 0, "{what}: the 4-bit weights' dequantization is hoisted");
            cp
        };
        let (mut shared, mut distinct) = (program(BufferLayout::Shared), program(BufferLayout::Distinct));
        let state = tr.state().unwrap();
        for step in 0..3 {
            let (ids, targets) = data.batch(step, b, t).unwrap();
            let mut given = HashMap::from([
                ("ids".to_string(), Value::ints([b, t], ids).unwrap()),
                ("targets".to_string(), Value::ints([b, t], targets).unwrap()),
                (DROPOUT_SEED.to_string(), Value::ints([], vec![1234 + step as i32]).unwrap()),
                ("lr".to_string(), Value::scalar(LR)),
            ]);
            if step == 0 {
                // the weights, moments and step count once: the executor keeps them, updated
                given.extend(state.clone());
            }
            let mut outs = Vec::new();
            for cp in [&mut shared, &mut distinct] {
                for (name, v) in &given {
                    match cp.set_input(name, v) {
                        Ok(()) | Err(RuntimeError::UnknownInput(_)) => {}
                        Err(e) => panic!("{what}: {e}"),
                    }
                }
                cp.execute().unwrap();
                outs.push(cp.results().unwrap());
            }
            assert!(bits(&outs[0]) == bits(&outs[1]), "{what}, step {step}: the shared layout's outputs differ from the distinct one's");
        }
        let (s, d) = (shared.layout(), distinct.layout());
        eprintln!(
            "{what}: shared {} bytes (arena {} for {} of buffers, {} live at most; inputs {}), distinct {} bytes",
            s.total_bytes(),
            s.arena_bytes,
            s.placed_bytes,
            s.lower_bound,
            s.input_bytes(),
            d.total_bytes()
        );
        assert!(s.total_bytes() < d.total_bytes(), "{what}: {s:?} against {d:?}");
        assert!(s.arena_bytes >= s.lower_bound && s.placed_bytes == d.placed_bytes && d.arena_bytes == d.placed_bytes, "{what}");
    }
}

/// The CPU executor puts every buffer exactly where the executor core's plan says: for the tiny
/// 4-bit + LoRA step as `qatc train` compiles it (panels, hoisting), the addresses its steps are
/// given, measured from each region's start, are the layout's offsets, and the plan is the one
/// `ExecPlan::new` makes on its own from the same program and options.
#[test]
fn the_cpu_executor_lays_buffers_out_as_the_plan_says() {
    let mut o = StepOptions::new(2, 16);
    qlora(&mut o);
    o.fuse = Some(FuseOptions::default());
    let m = Model::open(&common::fixture("tiny/f32_prefix/model.safetensors")).unwrap();
    let tr = Trainer::new(&m, o, None, 3).unwrap();
    let mut prog = qatc_kernels::lower(&tr.graph).unwrap();
    let (panels, _) = qatc_kernels::panels::feed_panels(&mut prog, 5000);
    let exec = ExecOptions { hoist: Hoist::Everything, ..ExecOptions::new(qatc_runtime::cpu::ALIGN) };
    let eval = Box::new(qatc_runtime::KirEval::new(&prog.kernels));
    let cp = CpuProgram::with_panels(prog.clone(), panels.clone(), eval, exec, &CpuOptions::default()).unwrap();
    let plan = ExecPlan::with_panels(&prog, &panels, exec).unwrap();
    assert!(plan == *cp.plan(), "the executor's plan is the core's");
    let (mut regions, mut shared) = (std::collections::HashSet::new(), 0);
    for (b, place) in plan.layout.places.iter().enumerate() {
        assert_eq!(cp.address_of(b), Some((place.region, place.offset)), "buffer {b} ({})", prog.buffers[b].name);
        assert_eq!(place.offset % 64, 0);
        regions.insert(place.region);
        shared += plan.layout.places.iter().filter(|p| p.region == Region::Arena && p.offset == place.offset).count().min(2) - 1;
    }
    assert_eq!(regions.len(), 3, "arena, persistent and data regions all used");
    assert!(shared > 0, "some arena buffers share an offset");
    assert!(!plan.write_backs.is_empty(), "the LoRA weights, their moments and the step count are written back");
    eprintln!("{} write-backs, {} steps hoisted", plan.write_backs.len(), plan.hoisted_steps());
}

/// The trainer keeps the step's state in the executor: three compiled 4-bit + LoRA steps (with
/// dropout) give bit for bit the losses, weights, Adam moments and step count of the same
/// compiled program driven the old way, every input copied in and every update output copied
/// out to the host at every step.
#[cfg(feature = "llvm")]
#[test]
fn resident_state_equals_the_host_round_trip_bit_for_bit() {
    for fuse in [false, true] {
        let mut o = StepOptions::new(2, 16);
        qlora(&mut o);
        o.fuse = fuse.then(FuseOptions::default);
        let what = format!("4-bit + LoRA, fuse {fuse}");
        let m = Model::open(&common::fixture("tiny/f32_prefix/model.safetensors")).unwrap();
        let data = TokenFile::open(&common::fixture("tiny/tokens.bin")).unwrap();
        let seed = 3;
        let mut resident = Trainer::with_target(&m, o.clone(), None, seed, &qatc_driver::Target::cpu(), &Default::default()).unwrap();
        // the old way: the host holds the state, binds everything every step, reads the updates
        // out of their buffers
        let g = &resident.graph;
        // the program the trainer runs (`qatc_driver::lower`: the planner's schedule and chunks)
        let prog = qatc_driver::lower(g, &qatc_driver::Target::cpu(), &Default::default()).unwrap().program;
        let (mut cp, _) = CpuProgram::compile(prog, &CpuOptions::default()).unwrap();
        let mut host = m.bind::<f32>(g, None, seed).unwrap();
        for id in g.inputs() {
            if g.input_kind(id) == Some(qatc_ir::InputKind::State) {
                host.insert(
                    g.node(id).name.clone().unwrap(),
                    Value::floats(g.ty(id).shape.dims().to_vec(), &vec![0.0; g.ty(id).numel()]).unwrap(),
                );
            }
        }
        let (b, t) = (o.batch, o.seq);
        for s in 0..3 {
            let (ids, targets) = data.batch(s, b, t).unwrap();
            host.insert("ids".into(), Value::ints([b, t], ids).unwrap());
            host.insert("targets".into(), Value::ints([b, t], targets).unwrap());
            host.insert("lr".into(), Value::scalar(LR));
            // the trainer's dropout seed for step s (its first batch is s)
            host.insert(DROPOUT_SEED.into(), Value::ints([], vec![(seed as i64 * 1_000_003 + s as i64) as i32]).unwrap());
            let old = cp.run(&host).unwrap();
            for (name, v) in &cp.program().updates.clone() {
                let buf = &cp.program().buffers[v.buf];
                let value = qatc_runtime::exec::values::read_view(buf, cp.buffer_bytes(v.buf).unwrap(), v).unwrap();
                host.insert(name.clone(), value);
            }
            let new = resident.step(&data, s, LR).unwrap();
            let loss = |out: &HashMap<String, Value<f32>>| out["loss"].as_float().unwrap().data[0].to_bits();
            assert_eq!(loss(&old), loss(&new), "{what}, step {s}: the loss");
        }
        let state = resident.persistent().unwrap();
        assert!(state.len() > 10);
        for (name, t) in state {
            let want = host[&name].as_float().unwrap();
            assert!(t.data.iter().map(|x| x.to_bits()).eq(want.data.iter().map(|x| x.to_bits())), "{what}: {name} after three steps");
        }
    }
}
