//! The LLVM backend against the reference interpreter, kernel by kernel: the whole training step
//! runs as a compiled program (LLVM kernels + GEMMs), then every value a kernel or GEMM wrote is
//! compared with the interpreter's value of that node (f32 both sides), within 1e-5 relative
//! (max |a - b| over the tensor / max |b|). Sizes are odd on purpose: B*T = 783 rows, vocab 50,
//! T 3 and 29, head size 8, so nothing fits a tile or a vector width.

#![cfg(feature = "llvm")]

use std::collections::{BTreeMap, HashMap};

use qatc::frontend::checkpoint::write_synthetic;
use qatc::frontend::config::Gpt2Config;
use qatc::model::Model;
use qatc::step::{self, StepOptions};
use qatc_ir::{DType, Graph, InputKind, NodeId, Op, QuantScheme, QuantSpec};
use qatc_kernels::program::{BufKind, Step};
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::{LoraOptions, DROPOUT_SEED};
use qatc_passes::precision::{LossScaling, Precision, LOSS_SCALE};
use qatc_passes::quant::QuantOptions;
use qatc_runtime::KirEval;
use qatc_runtime::{BufferLayout, CpuOptions, CpuProgram, ExecOptions, Launcher};
use qatc_runtime::{IntTensor, Interpreter, Tensor, Value};

const TOL: f64 = 1e-5;

/// The tolerance of a value of type `d`, relative to the tensor's largest magnitude: f32 values
/// 1e-5; f16/bf16 values carry one rounding per node, and a rounding that falls the other way
/// (f32 sums in another order) moves later values by that type's ulps: six of them (the
/// worst seen on the tiny steps is three); kernel by kernel (`isolate`) the check is 1e-5.
fn tol(d: DType) -> f64 {
    match d {
        DType::BF16 => 6.0 * 2f64.powi(-8),
        DType::F16 => 6.0 * 2f64.powi(-11),
        _ => TOL,
    }
}

fn inputs(g: &Graph, cfg: &Gpt2Config, b: usize, t: usize) -> HashMap<String, Value<f32>> {
    let dir = tempfile::tempdir().expect("a temp dir");
    let path = dir.path().join("model.safetensors");
    write_synthetic(&path, cfg, DType::F32, false, 11).expect("a synthetic checkpoint");
    let m = Model::open(&path).expect("it opens");
    let mut v = m.bind::<f32>(g, None, 3).expect("weights bind");
    for (name, val) in v.iter_mut() {
        if let (true, Value::Float(t)) = (name.ends_with(".scales"), val) {
            // learned scales below and above their min-max start: some weights clip
            t.data.iter_mut().enumerate().for_each(|(i, s)| *s *= 0.7 + 0.07 * (i % 6) as f32);
        }
    }
    for id in g.inputs() {
        let name = g.node(id).name.clone().unwrap_or_default();
        let ty = g.ty(id);
        if g.input_kind(id) == Some(InputKind::State) {
            // non-zero moments and step count, so AdamW's every term is exercised
            let data = (0..ty.numel())
                .map(|i| if name.starts_with("adam.v") { 1e-4 * (1 + i % 7) as f32 } else { 1e-3 * ((i % 5) as f32 - 2.0) })
                .collect();
            v.insert(name, Value::Float(Tensor { shape: ty.shape.dims().to_vec(), data }));
        }
    }
    let ids: Vec<i32> = (0..b * t).map(|i| ((i * 37 + 5) % cfg.vocab_size) as i32).collect();
    let tgt: Vec<i32> = (0..b * t).map(|i| ((i * 11 + 3) % cfg.vocab_size) as i32).collect();
    v.insert("ids".into(), Value::Int(IntTensor { shape: vec![b, t], data: ids }));
    v.insert("targets".into(), Value::Int(IntTensor { shape: vec![b, t], data: tgt }));
    v.insert("lr".into(), Value::scalar(1e-2));
    v.insert(DROPOUT_SEED.into(), Value::Int(IntTensor { shape: vec![], data: vec![77] }));
    v.insert(LOSS_SCALE.into(), Value::Float(Tensor { shape: vec![2], data: LossScaling::default().initial_state().to_vec() }));
    v
}

/// `prog` run by `launcher` with every buffer in memory of its own, kept after the run.
fn distinct(prog: qatc_kernels::Program, launcher: Box<dyn Launcher>) -> Result<CpuProgram, qatc_runtime::RuntimeError> {
    let exec = ExecOptions { layout: BufferLayout::Distinct, ..ExecOptions::new(qatc_runtime::cpu::ALIGN) };
    CpuProgram::with_options(prog, launcher, exec, &CpuOptions::default())
}

/// Runs the step both ways; returns (family -> values compared) and panics on the first value
/// off by more than TOL, naming the kernel that wrote it.
fn compare(what: &str, cfg: &Gpt2Config, o: &StepOptions) -> BTreeMap<String, usize> {
    compare_lowered(what, cfg, o, &qatc_kernels::LowerOptions::default())
}

/// [`compare`] with the step lowered under `options` (a target's).
fn compare_lowered(what: &str, cfg: &Gpt2Config, o: &StepOptions, options: &qatc_kernels::LowerOptions) -> BTreeMap<String, usize> {
    let (g, _) = step::train(cfg, o, |_, _| {}).expect("the step builds");
    let ins = inputs(&g, cfg, o.batch, o.seq);
    let prog = qatc_kernels::lower_with(&g, options).expect("it lowers");
    // who writes each buffer: the kernel's family, or "gemm"; and the buffers a kernel rewrites
    // in place (the cross-entropy gradient over its logits): they end up holding another node's
    // value than the one they are named after, which the whole-step tests check instead
    let mut writer: HashMap<usize, String> = HashMap::new();
    let mut rewritten: std::collections::HashSet<usize> = Default::default();
    for s in &prog.steps {
        match s {
            Step::Launch { kernel, args, .. } => {
                let k = &prog.kernels[*kernel];
                let mut loaded = std::collections::HashSet::new();
                if let qatc_kernels::kir::Body::Loops { stmts, .. } = &k.body {
                    qatc_kernels::kir::visit_exprs(stmts, &mut |e| {
                        if let qatc_kernels::kir::Expr::Load { param, .. } = e {
                            loaded.insert(*param);
                        }
                    });
                }
                for (i, (p, &buf)) in k.params.iter().zip(args).enumerate() {
                    if p.write {
                        writer.insert(buf, format!("{} ({})", k.family, k.name()));
                        if loaded.contains(&i) {
                            rewritten.insert(buf);
                        }
                    }
                }
            }
            Step::Gemm(gm) => {
                writer.entry(gm.c.buf).or_insert_with(|| format!("gemm ({})", gm.note));
            }
            Step::Collective(c) => {
                writer.entry(c.dst.buf).or_insert_with(|| format!("{} ({})", c.exchange.mnemonic(), c.note));
            }
        }
    }
    let jit = qatc_kernels::llvm::Jit::compile(&prog.kernels).expect("the kernels compile");
    // every buffer is read after the run: none may share memory
    let mut cp = distinct(prog, Box::new(jit)).expect("the program loads");
    cp.run(&ins).expect("the compiled step runs");
    // buffer -> node: lowering names a node's buffer after the node (else t{index}) and creates
    // buffers in topological order, so the i-th buffer of a name holds the i-th node of that name
    // (names repeat across layers: `attention_bwd`)
    let mut nodes_by_name: HashMap<String, Vec<NodeId>> = HashMap::new();
    for id in g.topo_order().expect("a DAG") {
        if !matches!(g.node(id).op, Op::Input { .. } | Op::Const { .. }) {
            nodes_by_name.entry(g.node(id).name.clone().unwrap_or_else(|| format!("t{}", id.index()))).or_default().push(id);
        }
    }
    let mut bufs_by_name: HashMap<String, Vec<usize>> = HashMap::new();
    for (bi, b) in cp.program().buffers.iter().enumerate() {
        if b.kind == BufKind::Value {
            bufs_by_name.entry(b.name.clone()).or_default().push(bi);
        }
    }
    let mut targets = Vec::new();
    for (name, bufs) in &bufs_by_name {
        // shape ops are usually views (no buffer of their own): drop them when that makes the counts agree
        let all = nodes_by_name.get(name).cloned().unwrap_or_default();
        let computed: Vec<NodeId> = all
            .iter()
            .copied()
            .filter(|&i| !matches!(g.node(i).op, Op::Reshape { .. } | Op::Transpose { .. } | Op::Slice { .. } | Op::Broadcast { .. }))
            .collect();
        let nodes = if all.len() == bufs.len() { Some(all) } else { Some(computed).filter(|c| c.len() == bufs.len()) };
        let Some(nodes) = nodes else {
            if std::env::var_os("QATC_EQ_DEBUG").is_some() {
                eprintln!(
                    "skip {name}: {} buffers, {:?} nodes",
                    bufs.len(),
                    nodes_by_name.get(name).map(|n| n.iter().map(|&i| g.describe(i)).collect::<Vec<_>>())
                );
            }
            continue;
        };
        for (&bi, &id) in bufs.iter().zip(&nodes) {
            let b = &cp.program().buffers[bi];
            if writer.contains_key(&bi)
                && !rewritten.contains(&bi)
                && g.ty(id).shape.dims() == b.shape.as_slice()
                && g.ty(id).dtype == b.dtype
            {
                targets.push((bi, id));
            }
        }
    }
    targets.sort();
    let interp = Interpreter::<f32>::new(&g).expect("the interpreter takes the step");
    let want: Vec<NodeId> = targets.iter().map(|&(_, id)| id).collect();
    let refs = interp.run_nodes(&ins, &want).expect("the interpreter runs");
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut worst = 0.0f64;
    for ((bi, id), r) in targets.iter().zip(&refs) {
        let got = cp.buffer(*bi).expect("the buffer reads back");
        let who = &writer[bi];
        let (a, b) = match (&got, r) {
            (Value::Float(a), Value::Float(b)) => {
                (a.data.iter().map(|&x| x as f64).collect::<Vec<_>>(), b.data.iter().map(|&x| x as f64).collect::<Vec<_>>())
            }
            (Value::Int(a), Value::Int(b)) => {
                assert_eq!(a.data, b.data, "{what}: {} written by {who} differs", g.describe(*id));
                *seen.entry(who.split(' ').next().unwrap_or("").to_string()).or_default() += 1;
                continue;
            }
            _ => panic!("{what}: {} written by {who}: float vs int", g.describe(*id)),
        };
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let err = a.iter().zip(&b).fold(0.0f64, |m, (x, y)| if x.is_nan() && y.is_nan() { m } else { m.max((x - y).abs()) });
        worst = worst.max(err / scale.max(1e-30));
        assert!(
            err <= tol(o.precision.compute()) * scale.max(1e-30) || err == 0.0,
            "{what}: {} written by {who}: max |llvm - interpreter| = {err:.3e}, {:.3e} of max |interpreter| {scale:.3e}",
            g.describe(*id),
            err / scale.max(1e-30)
        );
        *seen.entry(who.split(' ').next().unwrap_or("").to_string()).or_default() += 1;
    }
    eprintln!("{what}: {} values compared (worst {worst:.2e} of max), by kernel family: {seen:?}", targets.len());
    let compared: std::collections::HashSet<usize> = targets.iter().map(|t| t.0).collect();
    let mut direct = vec![false; cp.program().kernels.len()];
    for st in &cp.program().steps {
        if let Step::Launch { kernel, args, .. } = st {
            let k = &cp.program().kernels[*kernel];
            if k.params.iter().zip(args).any(|(p, b)| p.write && compared.contains(b)) {
                direct[*kernel] = true;
            }
        }
    }
    let missed: Vec<String> = cp
        .program()
        .kernels
        .iter()
        .zip(&direct)
        .filter(|(_, d)| !**d)
        .map(|(k, _)| {
            format!(
                "{} [{}]",
                k.family,
                cp.program()
                    .steps
                    .iter()
                    .find_map(|s| match s {
                        Step::Launch { kernel, args, .. } if cp.program().kernels[*kernel] == *k => Some(
                            args.iter()
                                .map(|&b| format!("{}:{:?}", cp.program().buffers[b].name, cp.program().buffers[b].kind))
                                .collect::<Vec<_>>()
                                .join(",")
                        ),
                        _ => None,
                    })
                    .unwrap_or_default()
            )
        })
        .collect();
    eprintln!("{what}: {} of {} kernels not compared directly: {missed:#?}", missed.len(), direct.len());
    seen
}

fn qlora(b: usize, t: usize, group: usize, scheme: QuantScheme) -> StepOptions {
    let mut o = StepOptions::new(b, t);
    o.model.full_finetune = false;
    o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group, scheme }));
    let mut l = LoraOptions::new(4);
    l.dropout = 0.1;
    o.model.lora = Some(l);
    o
}

fn odd() -> Gpt2Config {
    Gpt2Config { n_embd: 24, n_layer: 2, n_head: 3, n_positions: 32, vocab_size: 50, layer_norm_epsilon: 1e-5 }
}

#[test]
fn full_finetune_step_unfused_b27_t29() {
    let o = StepOptions::new(27, 29);
    let seen = compare("full fine-tune, unfused, B 27 T 29", &odd(), &o);
    assert!(seen.len() > 10, "{seen:?}");
}

#[test]
fn qlora_step_fused_b27_t29() {
    let mut o = qlora(27, 29, 8, QuantScheme::Sym);
    o.fuse = Some(FuseOptions::default());
    let seen = compare("4-bit sym + LoRA, fused, B 27 T 29", &odd(), &o);
    assert!(seen.keys().any(|k| k.starts_with("attention")), "{seen:?}");
}

#[test]
fn qlora_step_t3_every_scheme() {
    for scheme in QuantScheme::ALL {
        // Q4_0 has groups of 32 only
        let (cfg, group) = if scheme == QuantScheme::Q4_0 { (Gpt2Config { n_embd: 32, n_head: 4, ..odd() }, 32) } else { (odd(), 8) };
        for fuse in [false, true] {
            let mut o = qlora(2, 3, group, scheme);
            o.fuse = fuse.then(FuseOptions::default);
            compare(&format!("{scheme:?} + LoRA, fuse {fuse}, B 2 T 3"), &cfg, &o);
        }
    }
}

#[test]
fn learned_scales_step_every_scheme_base_and_merged() {
    for scheme in QuantScheme::ALL {
        let (cfg, group) = if scheme == QuantScheme::Q4_0 { (Gpt2Config { n_embd: 32, n_head: 4, ..odd() }, 32) } else { (odd(), 8) };
        for merged in [false, true] {
            let mut o = qlora(2, 3, group, scheme);
            if let Some(q) = o.model.quant.as_mut() {
                q.learned_scales = true;
                q.spec.bits = if scheme == QuantScheme::Sym { 3 } else { 4 };
            }
            if let Some(l) = o.model.lora.as_mut() {
                l.merged = merged;
                l.dropout = 0.0;
            }
            o.adamw.scale_lr_mul = 0.1;
            o.fuse = Some(FuseOptions::default());
            let seen = compare(&format!("{scheme:?} learned scales, merged {merged}, fused, B 2 T 3"), &cfg, &o);
            assert!(seen.len() > 3, "{seen:?}");
        }
    }
    let mut o = qlora(27, 29, 8, QuantScheme::Sym);
    if let Some(q) = o.model.quant.as_mut() {
        q.learned_scales = true;
    }
    isolate("4-bit sym learned scales + LoRA, unfused, B 27 T 29", &odd(), &o);
    o.fuse = Some(FuseOptions::default());
    isolate("4-bit sym learned scales + LoRA, fused, B 27 T 29", &odd(), &o);
}

/// Kernel by kernel, in isolation: before each launch, the kernel-IR evaluator's program gets
/// the LLVM program's buffers; both run the launch; whatever it wrote must agree within TOL.
/// This reaches the kernels whose results are scratch (attention statistics, dequantized
/// operands, cross-entropy chunks), which the comparison with graph values sees only through
/// their consumers; the evaluator itself is checked against the interpreter in compiled_cpu.rs.
fn isolate(what: &str, cfg: &Gpt2Config, o: &StepOptions) -> usize {
    let (g, _) = step::train(cfg, o, |_, _| {}).expect("the step builds");
    let ins = inputs(&g, cfg, o.batch, o.seq);
    let prog = qatc_kernels::lower(&g).expect("it lowers");
    let jit = qatc_kernels::llvm::Jit::compile(&prog.kernels).expect("the kernels compile");
    // every buffer is copied from one program to the other before each launch: none may share
    let mut fast = distinct(prog.clone(), Box::new(jit)).expect("the program loads");
    let mut slow = distinct(prog.clone(), Box::new(KirEval::new(&prog.kernels))).expect("the program loads");
    for (name, v) in &ins {
        let _ = fast.set_input(name, v);
    }
    let mut checked = vec![false; prog.kernels.len()];
    for (i, st) in prog.steps.iter().enumerate() {
        let Step::Launch { kernel, args, .. } = st else {
            fast.execute_step(i).expect("a GEMM runs");
            continue;
        };
        for b in 0..prog.buffers.len() {
            let bytes = fast.buffer_bytes(b).expect("a buffer").to_vec();
            slow.set_buffer_bytes(b, &bytes).expect("same sizes");
        }
        fast.execute_step(i).expect("the LLVM kernel runs");
        slow.execute_step(i).expect("the evaluator runs");
        let k = &prog.kernels[*kernel];
        for (p, &b) in k.params.iter().zip(args) {
            if !p.write {
                continue;
            }
            let (a, r) = (fast.buffer(b).expect("reads"), slow.buffer(b).expect("reads"));
            match (&a, &r) {
                (Value::Float(a), Value::Float(r)) => {
                    let scale = r.data.iter().fold(0.0f32, |m, x| m.max(x.abs())) as f64;
                    let err =
                        a.data
                            .iter()
                            .zip(&r.data)
                            .fold(0.0f64, |m, (x, y)| if x.is_nan() && y.is_nan() { m } else { m.max((x - y).abs() as f64) });
                    assert!(
                        err <= tol(prog.buffers[b].dtype) * scale || err == 0.0,
                        "{what}: step {i}, {} ({}) writing {}: max |llvm - kir| = {err:.3e} of max {scale:.3e}",
                        k.family,
                        k.name(),
                        prog.buffers[b].name
                    );
                }
                _ => assert_eq!(a, r, "{what}: step {i}, {} writing {}", k.family, prog.buffers[b].name),
            }
        }
        checked[*kernel] = true;
    }
    assert!(checked.iter().all(|c| *c), "{what}: a kernel was never launched");
    eprintln!("{what}: all {} kernels agree with the kernel-IR evaluator in isolation", checked.len());
    checked.len()
}

/// `--precision bf16|fp16`: the step retyped by the precision pass (f16/bf16 storage, f32
/// masters, fp16 loss scaling) runs compiled as the interpreter runs it, unfused and fused.
#[test]
fn qlora_step_in_bf16_and_fp16_b27_t29() {
    for p in [Precision::Bf16, Precision::Fp16] {
        for fuse in [false, true] {
            let mut o = qlora(27, 29, 8, QuantScheme::Sym);
            o.precision = p;
            o.clip = Some(1.0);
            o.fuse = fuse.then(FuseOptions::default);
            compare(&format!("4-bit sym + LoRA, {p}, fuse {fuse}, B 27 T 29"), &odd(), &o);
            if fuse {
                // attention runs as the f32 flash kernels on widened copies, not as GEMMs
                let (g, _) = step::train(&odd(), &o, |_, _| {}).expect("the step builds");
                let prog = qatc_kernels::lower(&g).expect("it lowers");
                let flash = prog.kernels.iter().filter(|k| matches!(k.body, qatc_kernels::kir::Body::Attention(_))).count();
                assert!(flash >= 4, "{p}: {flash} attention kernels");
            }
        }
    }
    let mut f = StepOptions::new(3, 29);
    f.precision = Precision::Bf16;
    f.fuse = Some(FuseOptions::default());
    compare("full fine-tune, bf16, fused, B 3 T 29", &odd(), &f);
}

/// The bf16 step as `qatc train` lowers it on the CPU (`Target::cpu`'s options): each layer's
/// attention gradients from one backward whose delta reads the stored (bf16) forward output,
/// rowsum(dout * out), where the flash kernels' delta sums P * dP in f32; the values stay within
/// the same bf16 bounds.
#[test]
fn qlora_step_in_bf16_as_the_cpu_target_lowers_it() {
    let cpu = qatc_kernels::Target::cpu().lower_options();
    let mut o = qlora(27, 29, 8, QuantScheme::Sym);
    o.precision = Precision::Bf16;
    o.clip = Some(1.0);
    o.fuse = Some(FuseOptions::default());
    compare_lowered("4-bit sym + LoRA, bf16, fused, the CPU target's lowering, B 27 T 29", &odd(), &o, &cpu);
    let (g, _) = step::train(&odd(), &o, |_, _| {}).expect("the step builds");
    let prog = qatc_kernels::lower_with(&g, &cpu).expect("it lowers");
    assert!(prog.kernels.iter().any(|k| k.family == "attention.delta"), "delta from dout and out");
}

#[test]
fn every_kernel_of_the_bf16_and_fp16_steps_in_isolation() {
    for p in [Precision::Bf16, Precision::Fp16] {
        let mut o = qlora(27, 29, 8, QuantScheme::Sym);
        o.precision = p;
        o.fuse = Some(FuseOptions::default());
        isolate(&format!("4-bit sym + LoRA, {p}, fused, B 27 T 29"), &odd(), &o);
    }
}

#[test]
fn every_kernel_of_the_tiny_step_in_isolation() {
    let mut o = qlora(27, 29, 8, QuantScheme::Sym);
    isolate("4-bit sym + LoRA, unfused, B 27 T 29", &odd(), &o);
    o.fuse = Some(FuseOptions::default());
    isolate("4-bit sym + LoRA, fused, B 27 T 29", &odd(), &o);
    let mut f = StepOptions::new(3, 29);
    f.fuse = Some(FuseOptions::default());
    isolate("full fine-tune, fused, B 3 T 29", &odd(), &f);
}
