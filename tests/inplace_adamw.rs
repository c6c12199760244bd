//! AdamW written in place (`kernels/src/lower/adamw.rs`): the fused multi-tensor AdamW runs as
//! one kernel per tensor writing p, m and v over themselves, so the packed buffer of every new
//! weight and moment is never allocated and no update is copied back. The step equals the packed
//! lowering's bit for bit (the same expression per element), over two steps (the second reads
//! the first's updated state); the arena never grows, and shrinks where the pack was held at
//! the peak (a full fine-tune).

mod common;

use std::collections::HashMap;

use qatc::cli::train::Trainer;
use qatc::data::TokenFile;
use qatc::model::Model;
use qatc::step::StepOptions;
use qatc_ir::{QuantScheme, QuantSpec};
use qatc_kernels::program::BufKind;
use qatc_kernels::{LowerOptions, Program};
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::LoraOptions;
use qatc_passes::quant::QuantOptions;
use qatc_runtime::exec::{ExecOptions, Region};
use qatc_runtime::{CpuProgram, ExecPlan, Value};

const B: usize = 2;
const T: usize = 16;

fn trainer(lora: bool) -> Trainer {
    trainer_with(lora, qatc_passes::optim::Moments::F32)
}

fn trainer_with(lora: bool, moments: qatc_passes::optim::Moments) -> Trainer {
    let m = Model::open(&common::fixture("tiny/f32_prefix/model.safetensors")).unwrap();
    let mut o = StepOptions::new(B, T);
    o.adamw.moments = moments;
    if lora {
        o.model.full_finetune = false;
        o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 16, scheme: QuantScheme::Sym }));
        o.model.lora = Some(LoraOptions::new(4));
    }
    o.fuse = Some(FuseOptions::default());
    Trainer::new(&m, o, None, 3).unwrap()
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

/// Two steps from `tr`'s state, the second from the first's updates: every output of each.
fn run(mut cp: CpuProgram, tr: &Trainer) -> Vec<HashMap<String, Value<f32>>> {
    let data = TokenFile::open(&common::fixture("tiny/tokens.bin")).unwrap();
    let mut state = tr.state().unwrap();
    (0..2)
        .map(|s| {
            let (ids, targets) = data.batch(s, B, T).unwrap();
            state.insert("ids".into(), Value::ints([B, T], ids).unwrap());
            state.insert("targets".into(), Value::ints([B, T], targets).unwrap());
            state.insert("lr".into(), Value::scalar(1e-3));
            let out = cp.run(&state).unwrap();
            for (k, v) in &out {
                if state.contains_key(k) {
                    state.insert(k.clone(), v.clone());
                }
            }
            out
        })
        .collect()
}

fn arena(prog: &Program) -> usize {
    ExecPlan::new(prog, ExecOptions::for_target(&qatc_kernels::Target::cpu())).unwrap().layout.region_bytes(Region::Arena)
}

#[test]
fn adamw_in_place_equals_the_packed_step_and_holds_no_pack() {
    for lora in [true, false] {
        let what = if lora { "4-bit + LoRA" } else { "full fine-tune" };
        let tr = trainer(lora);
        let inplace = qatc_kernels::lower(&tr.graph).unwrap();
        let packed = qatc_kernels::lower_with(&tr.graph, &LowerOptions { adamw_packed: true, ..Default::default() }).unwrap();
        // the pack: the buffer the packed lowering's updates are views of (the step count aside)
        let of_weight = |n: &str| !n.starts_with("adam.") && n != "step";
        let pack: Vec<usize> = packed.updates.iter().filter(|(n, _)| n != "step").map(|(_, v)| v.buf).collect();
        let first = packed.updates.iter().find(|(n, _)| of_weight(n)).map(|(_, v)| v.buf);
        assert!(first.is_some_and(|f| pack.iter().all(|&b| b == f)), "{what}: one pack holds every new weight and moment");
        let pack_bytes = first.map_or(0, |b| packed.buffers[b].bytes());
        assert!(pack_bytes > 0 && !matches!(packed.buffers[first.unwrap_or(0)].kind, BufKind::Input(..)), "{what}: a pack");
        // in place: every update but the step count is its input itself, never copied back
        let exec = ExecPlan::new(&inplace, ExecOptions::for_target(&qatc_kernels::Target::cpu())).unwrap();
        assert_eq!(inplace.updates.len(), packed.updates.len(), "{what}: the same updates");
        let copied: Vec<&str> = exec.write_backs.iter().map(|w| w.name.as_str()).collect();
        assert_eq!(copied, ["step"], "{what}: only the step count is copied back");
        let big: Vec<&str> = inplace
            .buffers
            .iter()
            .filter(|b| !matches!(b.kind, BufKind::Input(..)) && b.bytes() >= pack_bytes)
            .map(|b| b.name.as_str())
            .collect();
        assert!(big.is_empty(), "{what}: no buffer the pack's size: {big:?}");
        let (a_in, a_packed) = (arena(&inplace), arena(&packed));
        eprintln!("{what}: arena {a_in} B in place, {a_packed} B packed (the pack: {pack_bytes} B)");
        // (a LoRA step's pack is small and held after the activations die: its arena may not move)
        assert!(a_in <= a_packed, "{what}: the arena never grows ({a_in} B in place, {a_packed} B packed)");
        if !lora {
            assert!(a_in < a_packed, "{what}: the arena shrinks ({a_in} B in place, {a_packed} B packed)");
        }
        let want = run(cpu(packed), &tr);
        let got = run(cpu(inplace), &tr);
        for (s, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.len(), w.len(), "{what}: the same outputs");
            for (name, wv) in w {
                assert!(common::bits(&g[name]) == common::bits(wv), "{what}, step {s}: {name} differs from the packed step");
            }
        }
    }
}

/// 8-bit AdamW inside the in-place AdamW (`kernels/src/lower/adamw8.rs`): each 8-bit tensor's
/// moments are dequantized, updated in f32 and requantized by one blockwise kernel written over
/// the weight, the codes and the absmax, so no f32 copy of an 8-bit moment exists (neither the
/// dequantized one nor the pack's new one) and nothing but the step count is copied back; the
/// step equals the packed lowering's (dequantize, pack, absmax, requantize) bit for bit, over two
/// steps, and the arena shrinks.
#[test]
fn adamw8bit_in_place_equals_the_packed_step_and_holds_no_f32_moments() {
    let tr = trainer_with(false, qatc_passes::optim::Moments::Blockwise8);
    let inplace = qatc_kernels::lower(&tr.graph).unwrap();
    let packed = qatc_kernels::lower_with(&tr.graph, &LowerOptions { adamw_packed: true, ..Default::default() }).unwrap();
    let exec = ExecPlan::new(&inplace, ExecOptions::for_target(&qatc_kernels::Target::cpu())).unwrap();
    let copied: Vec<&str> = exec.write_backs.iter().map(|w| w.name.as_str()).collect();
    assert_eq!(copied, ["step"], "only the step count is copied back");
    let blockwise: Vec<&str> = inplace
        .kernels
        .iter()
        .filter(|k| k.params.iter().any(|p| p.write && p.dtype == qatc_ir::DType::U8))
        .map(|k| k.family.as_str())
        .collect();
    assert!(!blockwise.is_empty() && blockwise.iter().all(|f| f.starts_with("adamw")), "the codes are written by AdamW: {blockwise:?}");
    // no buffer but the inputs and the gradients has an 8-bit tensor's shape in f32 (the moments
    // never whole in f32)
    let eight: Vec<Vec<usize>> = inplace
        .buffers
        .iter()
        .filter(|b| b.name.starts_with("adam.m8:") && matches!(b.kind, BufKind::Input(..)))
        .map(|b| b.shape.clone())
        .collect();
    assert!(eight.len() > 5, "{} 8-bit tensors", eight.len());
    let f32_moments: Vec<&str> = inplace
        .buffers
        .iter()
        .filter(|b| !matches!(b.kind, BufKind::Input(..)) && !b.name.starts_with("grad:"))
        .filter(|b| b.dtype == qatc_ir::DType::F32 && eight.contains(&b.shape))
        .map(|b| b.name.as_str())
        .collect();
    assert!(f32_moments.is_empty(), "f32 buffers of an 8-bit tensor's shape: {f32_moments:?}");
    let (a_in, a_packed) = (arena(&inplace), arena(&packed));
    eprintln!("8-bit full fine-tune: arena {a_in} B in place, {a_packed} B packed");
    assert!(a_in < a_packed, "the arena shrinks ({a_in} B in place, {a_packed} B packed)");
    let want = run(cpu(packed), &tr);
    let got = run(cpu(inplace), &tr);
    for (s, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.len(), w.len(), "the same outputs");
        for (name, wv) in w {
            assert!(common::bits(&g[name]) == common::bits(wv), "step {s}: {name} differs from the packed step");
        }
    }
}
