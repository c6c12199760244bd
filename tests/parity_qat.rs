//! Parity of qatc's quantization-aware training with PyTorch + PEFT (fixtures from
//! tests/fixtures/gen_qat_fixtures.py): fake-quantized weights bit for bit, eval loss under each
//! scheme within 1e-4, and a 3-step AdamW run of LoRA on a 4-bit base from an adapter with
//! non-zero B: per-step losses within 1e-4, LoRA gradients and the final adapter within 1e-4
//! relative (per tensor: max |ours - torch| / max |torch|).

mod common;

use qatc::adapter;
use qatc::cli::eval::{evaluate, EvalSetup};
use qatc::cli::options::{model_options, QuantArgs};
use qatc::cli::train::Trainer;
use qatc::data::TokenFile;
use qatc::model::Model;
use qatc::step::StepOptions;
use qatc_ir::{QuantScheme, QuantSpec};
use qatc_runtime::quant;

fn model() -> Model {
    Model::open(&common::fixture("tiny/f32_prefix/model.safetensors")).unwrap()
}

fn tokens() -> TokenFile {
    TokenFile::open(&common::fixture("tiny/tokens.bin")).unwrap()
}

fn fixture_json(rel: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(common::fixture(rel)).unwrap()).unwrap()
}

fn quant_args(bits: u8, group: usize, scheme: &str) -> QuantArgs {
    QuantArgs { bits: Some(bits), group: Some(group), scheme: QuantScheme::from_name(scheme), ..Default::default() }
}

#[test]
fn fake_quantized_weights_are_bit_identical_to_torch() {
    let m = model();
    let fq = common::read_safetensors("tiny_qat/fq_weights.safetensors");
    let mut n = 0;
    for (key, want) in &fq {
        let (cfg, w) = key.split_once('/').unwrap();
        let parts: Vec<&str> = cfg.split('_').collect(); // e.g. q4_0_b4_g32 / sym_b4_g32
        let group: usize = parts[parts.len() - 1][1..].parse().unwrap();
        let bits: u8 = parts[parts.len() - 2][1..].parse().unwrap();
        let scheme = QuantScheme::from_name(&parts[..parts.len() - 2].join("_")).unwrap();
        let info = m.ckpt.info(w).unwrap();
        let ours = quant::fake_quant(&m.ckpt.to_f32(w).unwrap(), info.shape[0], info.shape[1], QuantSpec { bits, group, scheme });
        let want: Vec<f32> = want.data.iter().map(|&v| v as f32).collect();
        // IEEE equality: torch's q * S keeps the sign of a negative zero (round(-0.3) = -0.0),
        // qatc's codes cannot carry one; -0.0 == 0.0, every other value must be bit-identical
        let diff = ours.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert_eq!(diff, 0, "{key}: {diff} elements differ from torch's fake-quant");
        n += 1;
    }
    assert_eq!(n, 16);
}

#[test]
fn eval_loss_under_every_scheme_matches_torch() {
    let m = model();
    let want = fixture_json("tiny_qat/quant_eval.json");
    for c in want["configs"].as_array().unwrap() {
        let q = quant_args(c["bits"].as_u64().unwrap() as u8, c["group"].as_u64().unwrap() as usize, c["scheme"].as_str().unwrap());
        let setup = EvalSetup { model: model_options(&q, None, false, false).unwrap(), adapter: None, ..Default::default() };
        let r = evaluate(&m, &tokens(), 2, 16, 3, &setup, false).unwrap();
        let w = c["loss"].as_f64().unwrap();
        assert!((r.loss - w).abs() <= 1e-4, "{}: loss {} vs torch {w}", c["name"], r.loss);
        // tighter than the issue asks, to show schemes are told apart (they differ by ~1e-4 here)
        assert!((r.loss - w).abs() <= 2e-6, "{}: loss {} vs torch {w}", c["name"], r.loss);
    }
}

#[test]
fn folded_storage_gives_bit_identical_results() {
    // training=true with a full fine-tune keeps FakeQuant on trainable weights (no fold);
    // evaluation folds every frozen FakeQuant into packed codes + Dequantize
    let m = model();
    for (bits, group, scheme) in [(4, 32, "sym"), (3, 16, "asym"), (4, 64, "nf4"), (4, 32, "q4_0"), (8, 0, "sym")] {
        let q = quant_args(bits, group, scheme);
        let unfolded = EvalSetup { model: model_options(&q, None, true, true).unwrap(), adapter: None, ..Default::default() };
        let folded = EvalSetup { model: model_options(&q, None, false, false).unwrap(), adapter: None, ..Default::default() };
        let a = evaluate(&m, &tokens(), 2, 16, 2, &unfolded, false).unwrap().loss;
        let b = evaluate(&m, &tokens(), 2, 16, 2, &folded, false).unwrap().loss;
        assert_eq!(a.to_bits(), b.to_bits(), "{scheme} b{bits} g{group}: folded {b} vs fake-quant {a}");
    }
}

#[test]
fn adapter_eval_matches_peft() {
    let m = model();
    let ad = adapter::read(&common::fixture("tiny_qat/adapter_init")).unwrap();
    assert_eq!((ad.r, ad.alpha), (4, 8.0));
    assert_eq!(ad.tensors.len(), 16);
    let setup =
        EvalSetup::new(&quant_args(4, 32, "sym"), Some(&common::fixture("tiny_qat/adapter_init")), Default::default(), false).unwrap();
    let r = evaluate(&m, &tokens(), 2, 16, 3, &setup, false).unwrap();
    let want = fixture_json("tiny_qat/qat_lora_3steps.json")["eval_loss_init"].as_f64().unwrap();
    assert!((r.loss - want).abs() <= 1e-5, "eval with adapter_init: {} vs PEFT {want}", r.loss);
}

fn lora_trainer(keep_grads: bool) -> (Trainer, adapter::Adapter) {
    let ad = adapter::read(&common::fixture("tiny_qat/adapter_init")).unwrap();
    let mut o = StepOptions::new(2, 16);
    o.keep_grads = keep_grads;
    o.model = model_options(&quant_args(4, 32, "sym"), Some(ad.options()), false, true).unwrap();
    (Trainer::new(&model(), o, Some(&ad), 0).unwrap(), ad)
}

#[test]
fn lora_gradients_on_a_4bit_base_match_peft() {
    let (mut tr, _) = lora_trainer(true);
    let out = tr.step(&tokens(), 0, 1e-3).unwrap();
    let want = common::read_safetensors("tiny_qat/lora_grads_step0.safetensors");
    let mut n = 0;
    for (key, w) in &want {
        if key == "loss" {
            continue;
        }
        let name = key.strip_prefix("base_model.model.transformer.").unwrap();
        let g = out[&format!("grad:{name}")].as_float().unwrap();
        let ours: Vec<f64> = g.data.iter().map(|&v| v as f64).collect();
        let e = common::rel_err(&ours, &w.data);
        assert!(e <= 1e-4, "grad of {name}: {e:e} relative to PEFT");
        n += 1;
    }
    assert_eq!(n, 16);
}

#[test]
fn three_qat_lora_steps_match_peft() {
    let (mut tr, ad) = lora_trainer(false);
    let want = fixture_json("tiny_qat/qat_lora_3steps.json");
    let data = tokens();
    for s in 0..3 {
        let out = tr.step(&data, s, 1e-3).unwrap();
        let loss = out["loss"].as_float().unwrap().data[0] as f64;
        let w = want["losses"][s].as_f64().unwrap();
        assert!((loss - w).abs() <= 1e-4, "step {s}: loss {loss} vs PEFT {w}");
    }
    let fin = adapter::read(&common::fixture("tiny_qat/adapter_3steps")).unwrap();
    let ws = tr.weights().unwrap();
    assert_eq!(ws.len(), 16, "only the LoRA tensors train");
    for (name, t) in ws {
        let ours: Vec<f64> = t.data.iter().map(|&v| v as f64).collect();
        let theirs: Vec<f64> = fin.tensors[&name].data.iter().map(|&v| v as f64).collect();
        let e = common::rel_err(&ours, &theirs);
        assert!(e <= 1e-4, "{name} after 3 steps: {e:e} relative to PEFT");
    }
    // and the adapter qatc writes reads back as the same tensors under PEFT's keys
    let (cfg, st) = adapter::to_files(&ad.options(), &tr.weights().unwrap(), "tiny").unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("adapter_config.json"), cfg).unwrap();
    std::fs::write(dir.path().join("adapter_model.safetensors"), &st).unwrap();
    let back = adapter::read(dir.path()).unwrap();
    assert_eq!(back.tensors.keys().collect::<Vec<_>>(), fin.tensors.keys().collect::<Vec<_>>());
    let theirs_bytes = std::fs::read(common::fixture("tiny_qat/adapter_3steps/adapter_model.safetensors")).unwrap();
    let theirs = safetensors::SafeTensors::deserialize(&theirs_bytes).unwrap();
    let ours = safetensors::SafeTensors::deserialize(&st).unwrap();
    let mut a: Vec<String> = theirs.names().into_iter().map(String::from).collect();
    let mut b: Vec<String> = ours.names().into_iter().map(String::from).collect();
    a.sort();
    b.sort();
    assert_eq!(a, b, "qatc writes PEFT's exact keys");
}

#[test]
fn merged_qat_starts_on_the_base_grid_and_trains_a_and_b() {
    // with B = 0 the merged weight is W, so the first loss equals the 4-bit base's
    let m = model();
    let q = QuantArgs { qat: Some(qatc::config::Qat::Merged), ..quant_args(4, 32, "sym") };
    let mut o = StepOptions::new(2, 16);
    o.keep_grads = true;
    let mut lo = qatc_passes::lora::LoraOptions::new(4);
    lo.targets = vec!["c_attn".into()];
    o.model = model_options(&q, Some(lo), false, true).unwrap();
    let mut tr = Trainer::new(&m, o, None, 7).unwrap();
    let out = tr.step(&tokens(), 0, 1e-3).unwrap();
    let base = fixture_json("tiny_qat/quant_eval.json")["configs"][0]["batch_losses"][0].as_f64().unwrap();
    let loss = out["loss"].as_float().unwrap().data[0] as f64;
    assert!((loss - base).abs() <= 1e-6, "merged with B=0: {loss} vs the 4-bit base {base}");
    let gb = out["grad:h.0.attn.c_attn.lora_B.weight"].as_float().unwrap();
    assert!(gb.data.iter().any(|&v| v != 0.0), "the STE carries a gradient into B");
    let counts = tr.graph.op_counts();
    assert_eq!(counts.get("fake_quant"), Some(&2), "c_attn of both layers stays fake-quantized (merged, not constant)");
    assert_eq!(counts.get("dequantize"), Some(&6), "the other six frozen linears fold");
}

/// The PEFT round trip. `tiny_qat/qatc_adapter/` is what `qatc train` wrote (3 steps, 4-bit sym
/// g32 base, r 4, alpha 8, seed 0); `gen_qat_fixtures.py --check-adapter` loaded it with
/// `PeftModel.from_pretrained` (no missing or unexpected keys) and recorded PEFT's eval loss in
/// `qatc_adapter_peft_check.json`. This test regenerates the adapter: it must be byte-identical
/// to the one PEFT loaded, and qatc's eval of it must equal PEFT's. A change of the interpreter's
/// rounding changes the bytes: `QATC_UPDATE_FIXTURES=1` rewrites the adapter, and then
/// `gen_qat_fixtures.py --check-adapter tests/fixtures/tiny_qat/qatc_adapter` must be rerun into
/// `qatc_adapter_peft_check.json`.
#[test]
fn the_adapter_qatc_writes_is_the_one_peft_loaded() {
    let m = model();
    let mut o = StepOptions::new(2, 16);
    let mut lo = qatc_passes::lora::LoraOptions::new(4);
    lo.alpha = 8.0;
    o.model = model_options(&quant_args(4, 32, "sym"), Some(lo.clone()), false, true).unwrap();
    let mut tr = Trainer::new(&m, o, None, 0).unwrap();
    for s in 0..3 {
        tr.step(&tokens(), s, 1e-3).unwrap();
    }
    let (cfg, st) = adapter::to_files(&lo, &tr.weights().unwrap(), "tests/fixtures/tiny/f32_prefix/model.safetensors").unwrap();
    let dir = common::fixture("tiny_qat/qatc_adapter");
    if std::env::var_os("QATC_UPDATE_FIXTURES").is_some_and(|v| v == "1") {
        std::fs::write(dir.join("adapter_config.json"), &cfg).unwrap();
        std::fs::write(dir.join("adapter_model.safetensors"), &st).unwrap();
    }
    assert_eq!(cfg, std::fs::read_to_string(dir.join("adapter_config.json")).unwrap());
    assert!(st == std::fs::read(dir.join("adapter_model.safetensors")).unwrap(), "adapter bytes changed: rerun the PEFT check");
    let peft = fixture_json("tiny_qat/qatc_adapter_peft_check.json");
    assert_eq!(peft["loaded"], true);
    assert_eq!(peft["warnings"].as_array().unwrap().len(), 0);
    let setup = EvalSetup::new(&quant_args(4, 32, "sym"), Some(&dir), Default::default(), false).unwrap();
    let ours = evaluate(&m, &tokens(), 2, 16, 3, &setup, false).unwrap().loss;
    let theirs = peft["eval_loss"].as_f64().unwrap();
    assert!((ours - theirs).abs() <= 1e-5, "qatc eval {ours} vs PEFT {theirs}");
}

/// --act-bits 8: per-token fake-quant of the linears' inputs changes the loss a little, and the
/// straight-through estimator still carries gradients to every LoRA tensor.
#[test]
fn activation_fake_quant_is_straight_through() {
    let m = model();
    let q = QuantArgs { act_bits: Some(8), ..quant_args(4, 32, "sym") };
    let mut o = StepOptions::new(2, 16);
    o.keep_grads = true;
    o.model = model_options(&q, Some(qatc_passes::lora::LoraOptions::new(4)), false, true).unwrap();
    let mut tr = Trainer::new(&m, o, None, 1).unwrap();
    assert_eq!(tr.graph.op_counts().get("act_quant"), Some(&8));
    let out = tr.step(&tokens(), 0, 1e-3).unwrap();
    let loss = out["loss"].as_float().unwrap().data[0] as f64;
    let w4 = fixture_json("tiny_qat/quant_eval.json")["configs"][0]["batch_losses"][0].as_f64().unwrap();
    assert!(loss != w4 && (loss - w4).abs() < 1e-2, "8-bit activations move the loss slightly: {loss} vs {w4}");
    for (k, v) in &out {
        if k.starts_with("grad:") && k.contains("lora_A") {
            assert!(v.as_float().unwrap().data.iter().all(|x| x.is_finite()), "{k}");
        }
    }
    let ga = out["grad:h.0.attn.c_attn.lora_A.weight"].as_float().unwrap();
    assert!(ga.data.iter().all(|&x| x == 0.0), "B starts at zero, so A's gradient is zero");
    let gb = out["grad:h.0.attn.c_attn.lora_B.weight"].as_float().unwrap();
    assert!(gb.data.iter().any(|&x| x != 0.0), "B's gradient flows through the quantized input");
}
