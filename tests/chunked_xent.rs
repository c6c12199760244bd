//! The chunked linear + cross-entropy (`kernels/src/lower/xent.rs`): no buffer of B x T x V
//! exists, one row kernel serves every full chunk, and the step equals the unchunked one (the
//! logits materialized, the fusion rule turned off): the loss and every gradient and update bit
//! for bit where the weight is frozen, within 1e-6 where it trains (its gradient sums the chunks
//! in order); the kernel-IR evaluator agrees with LLVM on the chunked program.

mod common;

use std::collections::HashMap;

use qatc::cli::train::Trainer;
use qatc::data::TokenFile;
use qatc::model::Model;
use qatc::step::StepOptions;
use qatc_ir::{QuantScheme, QuantSpec};
use qatc_kernels::{LowerOptions, Program};
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::LoraOptions;
use qatc_passes::precision::Precision;
use qatc_passes::quant::QuantOptions;
use qatc_runtime::{CpuProgram, Value};

const LR: f64 = 1e-3;

fn floats(v: &Value<f32>) -> Vec<f64> {
    match v {
        Value::Float(t) => t.data.iter().map(|&x| f64::from(x)).collect(),
        Value::Int(t) => t.data.iter().map(|&x| f64::from(x)).collect(),
    }
}

/// Sequences and positions: 128 rows of logits, more than the model's width (64), so that fusion
/// prefers never writing the logits even when the head trains (its gradient, V x C, is then
/// smaller than the logits it replaces).
const B: usize = 4;
const T: usize = 32;

/// The tiny step (B 4, T 32), fused; with the chunked rules or without.
fn step(lora: bool, chunked: bool) -> (Trainer, StepOptions) {
    step_in(lora, chunked, Precision::Fp32)
}

fn step_in(lora: bool, chunked: bool, precision: Precision) -> (Trainer, StepOptions) {
    let m = Model::open(&common::fixture("tiny/f32_prefix/model.safetensors")).unwrap();
    let mut o = StepOptions::new(B, T);
    o.precision = precision;
    o.keep_grads = true;
    if lora {
        o.model.full_finetune = false;
        o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 16, scheme: QuantScheme::Sym }));
        o.model.lora = Some(LoraOptions::new(4));
    }
    let mut f = FuseOptions::default();
    if !chunked {
        f.disabled = vec!["xent-linear".into(), "xent-linear-fwd".into()];
    }
    o.fuse = Some(f);
    (Trainer::new(&m, o.clone(), None, 3).unwrap(), o)
}

/// Runs two steps of `prog` from `tr`'s state on the one batch of the fixture (the second from the first's updates); every output of each.
fn run(mut cp: CpuProgram, tr: &Trainer) -> Vec<HashMap<String, Value<f32>>> {
    let data = TokenFile::open(&common::fixture("tiny/tokens.bin")).unwrap();
    let mut state = tr.state().unwrap();
    (0..2)
        .map(|_| {
            let (ids, targets) = data.batch(0, B, T).unwrap();
            state.insert("ids".into(), Value::ints([B, T], ids).unwrap());
            state.insert("targets".into(), Value::ints([B, T], targets).unwrap());
            state.insert("lr".into(), Value::scalar(LR));
            cp.run(&state).unwrap()
        })
        .collect()
}

fn cpu(prog: Program) -> CpuProgram {
    #[cfg(feature = "llvm")]
    {
        let jit = qatc_kernels::llvm::Jit::compile(&prog.kernels).unwrap();
        CpuProgram::new(prog, Box::new(jit)).unwrap()
    }
    #[cfg(not(feature = "llvm"))]
    CpuProgram::with_kir_eval(prog).unwrap()
}

/// How many exp the kernel's text computes (each once per element of the loop it is in).
fn exps_in(k: &qatc_kernels::kir::Kernel) -> usize {
    use qatc_kernels::kir::{Body, Expr, UnOp};
    let Body::Loops { stmts, .. } = &k.body else { panic!("{}: not a loop kernel", k.family) };
    let mut n = 0;
    qatc_kernels::kir::visit_exprs(stmts, &mut |e| n += usize::from(matches!(e, Expr::Un(UnOp::Exp, _))));
    n
}

/// The worst relative difference over every output (the loss bit for bit when `exact_loss`).
fn compare(what: &str, got: &[HashMap<String, Value<f32>>], want: &[HashMap<String, Value<f32>>], exact_loss: bool) -> f64 {
    let mut worst = 0.0f64;
    for (s, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}: the same outputs");
        if exact_loss {
            assert_eq!(floats(&g["loss"]), floats(&w["loss"]), "{what}, step {s}: the loss bit for bit");
        }
        for (name, wv) in w {
            if w.contains_key(&format!("adam.m:{name}")) {
                let e = common::norm_rel_err(&floats(&g[name]), &floats(wv));
                assert!(e <= 1e-3, "{what}, step {s}: weight {name} differs by {e:e} norm-wise");
                continue;
            }
            let e = common::rel_err(&floats(&g[name]), &floats(wv));
            assert!(e <= 1e-6, "{what}, step {s}: {name} differs by {e:e}");
            worst = worst.max(e);
        }
    }
    worst
}

#[test]
fn chunked_steps_equal_the_unchunked_step() {
    for lora in [true, false] {
        let what = if lora { "4-bit + LoRA (head frozen)" } else { "full fine-tune (head trains)" };
        let (plain, _) = step(lora, false);
        let (tr, _) = step(lora, true);
        let unchunked = qatc_kernels::lower(&plain.graph).unwrap();
        assert!(unchunked.cross_entropy.is_empty(), "{what}: the rule off, the logits are materialized");
        let (rows, vocab) = (B * T, 97);
        let logits_like = |b: &&qatc_kernels::program::Buffer| b.shape.last() == Some(&vocab) && b.numel() >= rows * vocab;
        assert!(unchunked.buffers.iter().any(|b| logits_like(&b)), "{what}: the unchunked step holds the logits");
        let want = run(cpu(unchunked), &plain);
        // threads sharing a row (CUDA's kernels), and a row on one thread (the CPU's, which keep
        // exp(x - max) between the row kernel's passes)
        for sequential_rows in [false, true] {
            let what = &format!("{what}, sequential rows {sequential_rows}");
            // chunks of 5 rows: 25 full chunks and a last one of 3
            // the frozen head on one thread per row walks the vocabulary in tiles of 16 (7 tiles,
            // the last of one column) with an online softmax
            let online = lora && sequential_rows;
            let options = LowerOptions { ce_chunk_rows: Some(5), sequential_rows, ce_tile_cols: Some(16), ..Default::default() };
            let prog = qatc_kernels::lower_with(&tr.graph, &options).unwrap();
            let ce = &prog.cross_entropy;
            assert_eq!(ce.len(), 1, "{what}");
            let tile = if online { 16 } else { vocab };
            assert_eq!(
                (ce[0].rows, ce[0].vocab, ce[0].chunk_rows, ce[0].tile_cols, ce[0].chunks(), ce[0].with_grad),
                (rows, vocab, 5, tile, 26, true)
            );
            let big: Vec<&str> = prog.buffers.iter().filter(logits_like).map(|b| b.name.as_str()).collect();
            assert!(big.is_empty(), "{what}: no buffer of B x T x V: {big:?}");
            let family = if online { "cross_entropy.online_tile" } else { "cross_entropy.chunk" };
            let row_kernels: Vec<&qatc_kernels::kir::Kernel> = prog.kernels.iter().filter(|k| k.family == family).collect();
            // one row kernel for the full chunks (tiles), one for the last
            assert_eq!(row_kernels.len(), if online { 4 } else { 2 }, "{what}: row kernels");
            // one exp per logit on one thread per row, two where threads share a row (the online
            // form's second is the running max's correction, once per row)
            let exps = exps_in(row_kernels[0]);
            assert_eq!(exps, if sequential_rows && !online { 1 } else { 2 }, "{what}: exps in the row kernel");
            let tiles_read = prog.gemms().filter(|g| g.note.starts_with("logits of rows 0..5")).count();
            assert_eq!(tiles_read, if online { 7 } else { 1 }, "{what}: the first chunk's logits GEMMs");
            let got = run(cpu(prog.clone()), &tr);
            // the loss bit for bit where the row kernel's sum is the unchunked kernel's; with the
            // exp kept, the sum's loop also stores, which LLVM may vectorize differently: within
            // 1e-6, the bound (bit for bit on this model today, but not promised)
            let worst = compare(what, &got, &want, !sequential_rows);
            eprintln!("{what}: chunked against unchunked, worst {worst:.1e}");
            // the kernel-IR evaluator runs the same program to the same results
            let eval = run(CpuProgram::with_kir_eval(prog).unwrap(), &tr);
            // (its reductions associate differently from LLVM's vectorized ones)
            let worst = compare(&format!("{what}, KIR evaluator"), &eval, &got, false);
            eprintln!("{what}: kernel-IR evaluator against LLVM, worst {worst:.1e}");
        }
    }
}

/// The rows per chunk the planner chooses (`qatc_driver::chunk`, what `qatc train` compiles):
/// the step at that size equals the unchunked one, as at any size.
#[test]
fn the_planners_chunk_size_equals_the_unchunked_step() {
    use qatc_driver::{Options, Target};
    for lora in [true, false] {
        let what = if lora { "4-bit + LoRA" } else { "full fine-tune" };
        let (tr, _) = step(lora, true);
        let (plain, _) = step(lora, false);
        let qatc_driver::Lowered { program: prog, chunk: choice } =
            qatc_driver::lower(&tr.graph, &Target::cpu(), &Options::default()).unwrap();
        let choice = choice.unwrap_or_else(|| panic!("{what}: no chunk choice"));
        assert_eq!(prog.cross_entropy[0].chunk_rows, choice.rows, "{what}: the program runs the choice");
        eprintln!("{what}: {}", choice.why);
        let want = run(cpu(qatc_kernels::lower(&plain.graph).unwrap()), &plain);
        let got = run(cpu(prog), &tr);
        // the CPU's row kernel keeps exp(x - max) between its passes: within 1e-6, not bit for bit
        let worst = compare(what, &got, &want, false);
        eprintln!("{what}: the planner's chunks against unchunked, worst {worst:.1e}");
    }
}

/// Under `--precision bf16|fp16` the loss is f32 and the gradients 16-bit: the rule packs them
/// widened to f32 (`finish_pack_widened`), so the chunked cross-entropy applies there too (before,
/// a pack of two types was refused and the 16-bit step held its whole logits and their
/// gradient). The chunk's logits are 16-bit, as the unchunked GEMM rounds them; dh is written as
/// f32 and rounded by the graph's cast. The step equals the unchunked 16-bit one within what a
/// GEMM over fewer rows may round differently (the loss within 1e-6, the rest within 1e-3 of
/// the largest element; a 16-bit ulp is 4e-3 for bf16, 5e-4 for fp16). Measured: bit for bit
/// but the fp16 full fine-tune's head gradient (2.4e-5: dW summed over chunks in f32).
#[test]
fn chunked_16_bit_steps_equal_the_unchunked_step() {
    for precision in [Precision::Bf16, Precision::Fp16] {
        for lora in [true, false] {
            let what = &format!("{precision:?}, {}", if lora { "4-bit + LoRA (head frozen)" } else { "full fine-tune (head trains)" });
            let (plain, _) = step_in(lora, false, precision);
            let (tr, _) = step_in(lora, true, precision);
            let unchunked = qatc_kernels::lower(&plain.graph).unwrap();
            assert!(unchunked.cross_entropy.is_empty(), "{what}: the rule off, the logits are materialized");
            let want = run(cpu(unchunked), &plain);
            for sequential_rows in [false, true] {
                let what = &format!("{what}, sequential rows {sequential_rows}");
                let options = LowerOptions { ce_chunk_rows: Some(5), sequential_rows, ce_tile_cols: Some(16), ..Default::default() };
                let prog = qatc_kernels::lower_with(&tr.graph, &options).unwrap();
                let ce = &prog.cross_entropy;
                assert_eq!(ce.len(), 1, "{what}: the chunked cross-entropy applies");
                // 16-bit logits: no online tiles (they hold f32 logits), a 2-byte chunk scratch
                assert_eq!((ce[0].chunk_rows, ce[0].tile_cols, ce[0].elem_bytes, ce[0].chunks()), (5, 97, 2, 26), "{what}");
                let (rows, vocab) = (B * T, 97);
                let big: Vec<&str> = prog
                    .buffers
                    .iter()
                    .filter(|b| b.shape.last() == Some(&vocab) && b.numel() >= rows * vocab)
                    .map(|b| b.name.as_str())
                    .collect();
                assert!(big.is_empty(), "{what}: no buffer of B x T x V: {big:?}");
                // dh, widened into the f32 pack: written by its GEMMs as f32
                let dh: Vec<_> =
                    prog.gemms().filter(|g| g.note.starts_with("dh = dlogits W")).map(|g| prog.buffers[g.c.buf].dtype).collect();
                assert!(!dh.is_empty() && dh.iter().all(|&d| d == qatc_ir::DType::F32), "{what}: dh's GEMMs write f32: {dh:?}");
                let got = run(cpu(prog.clone()), &tr);
                let worst = compare_16(what, &got, &want, true, 1e-3);
                eprintln!("{what}: chunked against unchunked, worst {worst:.1e} of the largest element");
                let eval = run(CpuProgram::with_kir_eval(prog).unwrap(), &tr);
                // the evaluator's f32 sums are rounded once from f64, LLVM's vectorized: the loss
                // and gradients agree, but an fp16 step's LoRA B weights after Adam do not (5.5e-2
                // norm-wise on the unchunked program as well: B starts at 0, so its first update
                // is about lr * sign(g) wherever g is tiny), nor its moments to 1e-3: the
                // gradients only, each within one ulp of the type of its largest element: the two
                // sums may round a 16-bit result differently (bf16: 1.1e-3 seen on an AMD EPYC
                // with AVX2, where LLVM's vectors are 8 wide)
                let ulp = if precision == Precision::Bf16 { 2f64.powi(-8) } else { 1e-3 };
                let worst = compare_16(&format!("{what}, KIR evaluator"), &eval, &got, false, ulp);
                eprintln!("{what}: kernel-IR evaluator against LLVM, worst {worst:.1e}");
            }
        }
    }
}

/// The worst difference over every output relative to the output's largest element
/// (`common::rel_err`, at most `tol`), the loss within 1e-6; the updated weights norm-wise
/// (1e-3); with `weights` false only the loss and the gradients.
fn compare_16(what: &str, got: &[HashMap<String, Value<f32>>], want: &[HashMap<String, Value<f32>>], weights: bool, tol: f64) -> f64 {
    let mut worst = 0.0f64;
    for (s, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}: the same outputs");
        let (gl, wl) = (floats(&g["loss"])[0], floats(&w["loss"])[0]);
        assert!((gl - wl).abs() <= 1e-6 * wl.abs(), "{what}, step {s}: loss {gl} against {wl}");
        for (name, wv) in w {
            // an updated weight, as `compare`: Adam's step divides by the gradient's size, so a
            // near-zero gradient's last bit moves its element by up to lr
            if !weights && !name.starts_with("grad:") {
                continue;
            }
            if w.contains_key(&format!("adam.m:{name}")) {
                let e = common::norm_rel_err(&floats(&g[name]), &floats(wv));
                assert!(e <= 1e-3, "{what}, step {s}: weight {name} differs by {e:e} norm-wise");
                continue;
            }
            let e = common::rel_err(&floats(&g[name]), &floats(wv));
            assert!(e <= tol, "{what}, step {s}: {name} differs by {e:e} of its largest element");
            worst = worst.max(e);
        }
    }
    worst
}
