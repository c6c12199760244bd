//! The causal attention lowered to read and write the stored 16-bit type
//! (`LowerOptions::attention_reads_stored`, every target's) against the attention on f32 copies
//! (the reference): under `--precision bf16` and `fp16`, 4-bit + LoRA and full fine-tune, the tiny step
//! (fused, B 4 T 32) run twice on the kernel-IR evaluator gives every output bit for bit (the
//! copies widen exactly and the copy-out rounds once, as the kernels' own loads and stores do);
//! and the flagged program launches no copy for its attention kernels and holds no f32
//! [B, NH, T, hs] buffer, its attention kernels taking the 16-bit views themselves. Both with a
//! kernel per gradient (CUDA's) and with one backward per layer (the CPU's), whose two gradients
//! kept for later nodes are then 16-bit too, each copied once into its node's buffer.

mod common;

use std::collections::HashMap;

use qatc::cli::train::Trainer;
use qatc::data::TokenFile;
use qatc::model::Model;
use qatc::step::StepOptions;
use qatc_ir::{DType, QuantScheme, QuantSpec};
use qatc_kernels::kir::{AttentionPart, Body};
use qatc_kernels::program::BufKind;
use qatc_kernels::{LowerOptions, Program, Step};
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::LoraOptions;
use qatc_passes::precision::Precision;
use qatc_passes::quant::QuantOptions;
use qatc_runtime::{CpuProgram, Value};

const B: usize = 4;
const T: usize = 32;
/// The tiny model's heads and head size.
const NH: usize = 4;
const HS: usize = 16;

fn trainer(lora: bool, precision: Precision) -> Trainer {
    let m = Model::open(&common::fixture("tiny/f32_prefix/model.safetensors")).expect("the model");
    let mut o = StepOptions::new(B, T);
    o.precision = precision;
    o.keep_grads = true;
    o.fuse = Some(FuseOptions::default());
    if lora {
        o.model.full_finetune = false;
        o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 16, scheme: QuantScheme::Sym }));
        o.model.lora = Some(LoraOptions::new(4));
    }
    Trainer::new(&m, o, None, 3).expect("a trainer")
}

/// Every output of two steps of `prog` on the evaluator, from `tr`'s state, the second from the
/// first's updates, on the fixture's one batch.
fn run(prog: Program, tr: &Trainer) -> Vec<HashMap<String, Value<f32>>> {
    let mut cp = CpuProgram::with_kir_eval(prog).expect("a CPU program");
    let data = TokenFile::open(&common::fixture("tiny/tokens.bin")).expect("tokens");
    let mut state = tr.state().expect("the state");
    let (ids, targets) = data.batch(0, B, T).expect("a batch");
    state.insert("ids".into(), Value::ints([B, T], ids).expect("ids"));
    state.insert("targets".into(), Value::ints([B, T], targets).expect("targets"));
    state.insert("lr".into(), Value::scalar(1e-3));
    (0..2)
        .map(|_| {
            let out = cp.run(&state).expect("runs");
            // the updates come back under their inputs' names
            for (name, v) in &out {
                if let Some(s) = state.get_mut(name) {
                    *s = v.clone();
                }
            }
            out
        })
        .collect()
}

/// Launches of the copy kernels (`lower/attention.rs`'s widening and rounding copies, and any
/// other copy of the program).
fn copies(p: &Program) -> usize {
    p.steps.iter().filter(|s| matches!(s, Step::Launch { kernel, .. } if p.kernels[*kernel].family.contains("copy"))).count()
}

/// Temporaries of f32 [B, NH, T, hs]: the widened operands and the f32 results (not the dk/dv
/// kernel's dv, `attn_dv`, scratch that no node reads, f32 either way).
fn f32_heads(p: &Program) -> usize {
    p.buffers
        .iter()
        .filter(|b| b.kind == BufKind::Temp && b.dtype == DType::F32 && b.shape == [B, NH, T, HS] && b.name != "attn_dv")
        .count()
}

#[test]
fn attention_on_stored_16bit_values_gives_the_same_bits() {
    for precision in [Precision::Bf16, Precision::Fp16] {
        let half = if precision == Precision::Bf16 { DType::BF16 } else { DType::F16 };
        for lora in [true, false] {
            let what = format!("{precision}, {}", if lora { "4-bit + LoRA" } else { "full fine-tune" });
            let tr = trainer(lora, precision);
            // CUDA's kernel per gradient, then the CPU's one backward per layer
            for one_backward in [false, true] {
                let what = format!("{what}{}", if one_backward { ", one backward" } else { "" });
                check(&tr, &what, half, one_backward);
            }
        }
    }
}

/// The lowering on stored values against the one on f32 copies, with a kernel per gradient or
/// one backward per layer (`LowerOptions::attention_one_backward`, the CPU's).
fn check(tr: &Trainer, what: &str, half: DType, one_backward: bool) {
    let plain = LowerOptions { attention_one_backward: one_backward, ..Default::default() };
    let stored = LowerOptions { attention_reads_stored: true, ..plain.clone() };
    let plain = qatc_kernels::lower_with(&tr.graph, &plain).expect("lowers");
    let flagged = qatc_kernels::lower_with(&tr.graph, &stored).expect("lowers");
    let attention: Vec<_> = flagged
        .kernels
        .iter()
        .filter_map(|k| match &k.body {
            Body::Attention(a) => Some((k, a)),
            _ => None,
        })
        .collect();
    assert!(!attention.is_empty(), "{what}: attention kernels");
    for (k, a) in &attention {
        let r = a.part.roles();
        for i in [Some(r.q), Some(r.k), r.v, r.dout].into_iter().flatten() {
            assert_eq!(k.params[i].dtype, half, "{what}: {:?} reads param {} stored", a.part, k.params[i].name);
        }
        assert_eq!(k.params[r.lse].dtype, DType::F32, "{what}: lse stays f32");
    }
    let (copies_before, copies_after) = (copies(&plain), copies(&flagged));
    let (heads_before, heads_after) = (f32_heads(&plain), f32_heads(&flagged));
    let (launches_before, launches_after) = (plain.launches(), flagged.launches());
    eprintln!(
        "{what}: {launches_before} -> {launches_after} launches, copy launches {copies_before} -> {copies_after}, \
         f32 [B, NH, T, hs] temporaries {heads_before} -> {heads_after}"
    );
    assert!(copies_before > 0 && heads_before > 0, "{what}: the f32 lowering copies (else this test checks nothing)");
    // one backward per layer leaves the copies of the (at most) two gradients its later
    // nodes take
    let layers = flagged
        .steps
        .iter()
        .filter(|s| {
            matches!(s, Step::Launch { kernel, .. }
            if matches!(&flagged.kernels[*kernel].body, Body::Attention(a) if a.part == AttentionPart::Backward))
        })
        .count();
    assert_eq!(layers > 0, one_backward, "{what}: one backward per layer where asked");
    let kept = copies_after;
    assert!(kept <= 2 * layers, "{what}: {kept} copy launches, at most two a layer");
    assert_eq!(heads_after, 0, "{what}: no f32 [B, NH, T, hs] temporaries");
    assert_eq!(launches_before - launches_after, copies_before - kept, "{what}: the copies are the only launches gone");
    let (want, got) = (run(plain, tr), run(flagged, tr));
    for (s, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}: the same outputs");
        for (name, wv) in w {
            assert!(common::bits(&g[name]) == common::bits(wv), "{what}, step {s}: {name} differs");
        }
    }
    eprintln!("{what}: {} outputs of 2 steps bit for bit", want[0].len());
}
