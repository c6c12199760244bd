//! `qatc export` of a model trained with learned scales (`--scales learned`): LoRA and the scales
//! trained in-process on the tiny fixture (B 2, T 16, 3 steps from `tiny_qat/adapter_init`, whose
//! B is non-zero), written as an adapter with its `quant_scales.safetensors`, then exported.
//!
//! - GGUF after `--qat merged`, sym 3-bit g32: every linear is Q4_0 whose blocks hold the learned
//!   scales (fp16) and grid points, so the dequantized GGUF weight is bit for bit
//!   `fake_quant_learned(W + s (BA)^T, scales)`, computed here independently of the export code;
//!   sym 8-bit g32: Q8_0, the same bit for bit.
//! - HF safetensors after `--qat base` sym 2-bit: the export's loss is the trained model's.
//! - eval and export refuse a mismatch between `--scales` and the adapter.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

use qatc::adapter::{self, Adapter};
use qatc::cli::eval::{evaluate, EvalSetup};
use qatc::cli::options::{model_options, QuantArgs};
use qatc::cli::train::{weights_safetensors, Trainer};
use qatc::config::{Qat, Scales};
use qatc::data::TokenFile;
use qatc::export::gguf::{self, GgmlType};
use qatc::export::{hf, llama};
use qatc::model::Model;
use qatc::step::StepOptions;
use qatc_ir::{BinaryOp, DType, Graph, InputKind, Op, QuantScheme, QuantSpec};
use qatc_passes::quant::is_learned_name;
use qatc_runtime::{quant, Interpreter, Value};

const MODEL: &str = "tiny/f32_prefix/model.safetensors";
const MODULES: [&str; 4] = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"];

fn model() -> Model {
    Model::open(&common::fixture(MODEL)).unwrap()
}

fn tokens() -> TokenFile {
    TokenFile::open(&common::fixture("tiny/tokens.bin")).unwrap()
}

fn learned(bits: u8, group: usize, qat: &str) -> QuantArgs {
    let qat = <Qat as clap::ValueEnum>::from_str(qat, false).unwrap();
    QuantArgs {
        bits: Some(bits),
        group: Some(group),
        scheme: Some(QuantScheme::Sym),
        qat: Some(qat),
        scales: Some(Scales::Learned),
        ..Default::default()
    }
}

fn flags(q: &QuantArgs) -> Vec<String> {
    let (b, g) = (q.bits.unwrap().to_string(), q.group.unwrap().to_string());
    let qat = if q.qat == Some(Qat::Merged) { "merged" } else { "base" };
    ["--bits", &b, "--group", &g, "--scheme", "sym", "--qat", qat, "--scales", "learned"].iter().map(|s| s.to_string()).collect()
}

/// Trains LoRA and the scales for 3 steps (lr 1e-2, scales at a tenth of it) and writes the
/// adapter and its learned scales to `dir`, as `qatc train` does.
fn train(q: &QuantArgs, dir: &Path) -> Adapter {
    let init = adapter::read(&common::fixture("tiny_qat/adapter_init")).unwrap();
    let mut o = StepOptions::new(2, 16);
    o.model = model_options(q, Some(init.options()), false, true).unwrap();
    o.adamw.scale_lr_mul = 0.1;
    let mut tr = Trainer::new(&model(), o, Some(&init), 0).unwrap();
    for s in 0..3 {
        tr.step(&tokens(), s, 1e-2).unwrap();
    }
    let (scales, lora): (Vec<_>, Vec<_>) = tr.weights().unwrap().into_iter().partition(|(n, _)| is_learned_name(n));
    assert_eq!(scales.len(), 8, "one learned scale tensor per linear");
    let (cfg, st) = adapter::to_files(&init.options(), &lora, "tiny").unwrap();
    std::fs::write(dir.join("adapter_config.json"), cfg).unwrap();
    std::fs::write(dir.join("adapter_model.safetensors"), st).unwrap();
    std::fs::write(dir.join(adapter::QUANT_FILE), weights_safetensors(&scales).unwrap()).unwrap();
    adapter::read(dir).unwrap()
}

fn trained_loss(q: &QuantArgs, ad: &Adapter) -> f64 {
    let setup =
        EvalSetup { model: model_options(q, Some(ad.options()), false, false).unwrap(), adapter: Some(ad.clone()), ..Default::default() };
    evaluate(&model(), &tokens(), 2, 16, 3, &setup, false).unwrap().loss
}

fn plain_loss(model: &Path) -> f64 {
    evaluate(&Model::open(model).unwrap(), &tokens(), 2, 16, 3, &EvalSetup::default(), false).unwrap().loss
}

/// `qatc export`; returns (success, stderr).
fn export(ad: &Path, out: &Path, format: &str, extra: &[String]) -> (bool, String) {
    let mut args: Vec<String> = vec!["export".into(), common::fixture(MODEL).display().to_string(), "--adapter".into()];
    args.extend([ad.display().to_string(), "--out".into(), out.display().to_string(), "--format".into(), format.into()]);
    args.extend(extra.iter().cloned());
    let o = Command::new(env!("CARGO_BIN_EXE_qatc")).args(&args).output().unwrap();
    (o.status.success(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// W + s (BA)^T [in, out] with the LoRA pass's ops, on the interpreter.
fn w_eff(m: &Model, ad: &Adapter, module: &str) -> (Vec<f32>, usize, usize) {
    let w = m.weight::<f32>(&format!("{module}.weight")).unwrap();
    let (a, b) = (&ad.tensors[&format!("{module}.lora_A.weight")], &ad.tensors[&format!("{module}.lora_B.weight")]);
    let (n_in, n_out, r) = (w.shape[0], w.shape[1], a.shape[0]);
    let mut g = Graph::new("merge");
    let wi = g.input("w", InputKind::Frozen, DType::F32, [n_in, n_out]).unwrap();
    let ai = g.input("a", InputKind::Frozen, DType::F32, [r, n_in]).unwrap();
    let bi = g.input("b", InputKind::Frozen, DType::F32, [n_out, r]).unwrap();
    let ba = g.add(Op::MatMul { ta: true, tb: true }, &[ai, bi]).unwrap();
    let d = g.add(Op::Affine { mul: ad.options().scaling(), add: 0.0 }, &[ba]).unwrap();
    let e = g.add(Op::Binary(BinaryOp::Add), &[wi, d]).unwrap();
    g.set_output("w_eff", e).unwrap();
    let inputs = HashMap::from([
        ("w".to_string(), Value::Float(w.clone())),
        ("a".to_string(), Value::Float(a.clone())),
        ("b".to_string(), Value::Float(b.clone())),
    ]);
    let out = Interpreter::<f32>::new(&g).unwrap().run(&inputs).unwrap();
    (out["w_eff"].as_float().unwrap().data.clone(), n_in, n_out)
}

/// Exports a merged learned-scale model to GGUF and checks every linear bit for bit.
fn gguf_holds_the_trained_weights(bits: u8, ty: GgmlType) {
    let q = learned(bits, 32, "merged");
    let tmp = tempfile::tempdir().unwrap();
    let ad_dir = tmp.path().join("adapter");
    std::fs::create_dir(&ad_dir).unwrap();
    let ad = train(&q, &ad_dir);
    let out = tmp.path().join("gguf");
    let (ok, stderr) = export(&ad_dir, &out, "gguf", &flags(&q));
    assert!(ok, "{stderr}");
    assert!(!stderr.contains("note:"), "a merged export is exact: no note ({stderr})");
    let f = gguf::read(&std::fs::read(out.join("model.gguf")).unwrap()).unwrap();
    let (cfg, tensors) = llama::from_gguf(&f).unwrap();
    let by_name: HashMap<&str, &qatc_runtime::Tensor<f32>> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let m = model();
    let spec = QuantSpec { bits, group: 32, scheme: QuantScheme::Sym };
    let mut moved = 0;
    for l in 0..2 {
        for module in MODULES {
            let hf_mod = format!("h.{l}.{module}");
            let t = f.tensor(&llama::gguf_name(&format!("{hf_mod}.weight")).unwrap()).unwrap();
            assert_eq!(t.ty, ty, "{hf_mod}");
            let (w, n_in, n_out) = w_eff(&m, &ad, &hf_mod);
            let scales = &ad.quant[&format!("{hf_mod}.weight.scales")].data;
            let want = quant::fake_quant_learned(spec, n_in, n_out, &w, scales, &[]);
            let got = &by_name[format!("{hf_mod}.weight").as_str()].data;
            let diff = got.iter().zip(&want).filter(|(a, b)| a != b).count();
            assert_eq!(diff, 0, "{hf_mod}: {diff} GGUF weights differ from the trained learned fake-quant");
            let (init, _) = quant::init_learned(&m.weight::<f32>(&format!("{hf_mod}.weight")).unwrap().data, n_in, n_out, spec);
            moved += init.iter().zip(scales).filter(|(a, b)| a != b).count();
        }
    }
    assert!(moved > 0, "training moved the scales");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    std::fs::write(&path, hf::safetensors_bytes(&tensors).unwrap()).unwrap();
    std::fs::write(dir.path().join("config.json"), hf::config_json(&cfg).unwrap()).unwrap();
    let (got, want) = (plain_loss(&path), trained_loss(&q, &ad));
    assert!((got - want).abs() <= 1e-6, "GGUF loss {got} vs trained {want}");
}

#[test]
fn gguf_q4_0_after_merged_3bit_learned_scales_is_the_trained_model_bit_for_bit() {
    gguf_holds_the_trained_weights(3, GgmlType::Q4_0);
}

#[test]
fn gguf_q8_0_after_merged_8bit_learned_scales_is_the_trained_model_bit_for_bit() {
    gguf_holds_the_trained_weights(8, GgmlType::Q8_0);
}

#[test]
fn safetensors_after_base_2bit_learned_scales_has_the_trained_loss() {
    let q = learned(2, 32, "base");
    let tmp = tempfile::tempdir().unwrap();
    let ad_dir = tmp.path().join("adapter");
    std::fs::create_dir(&ad_dir).unwrap();
    let ad = train(&q, &ad_dir);
    let out = tmp.path().join("hf");
    let (ok, stderr) = export(&ad_dir, &out, "safetensors", &flags(&q));
    assert!(ok, "{stderr}");
    let (got, want) = (plain_loss(&out.join("model.safetensors")), trained_loss(&q, &ad));
    assert!((got - want).abs() <= 1e-4, "export {got} vs trained {want}");
    // the learned scales matter: the same adapter on min-max scales is another model
    let mut minmax = ad.clone();
    minmax.quant.clear();
    let q_mm = QuantArgs { scales: Some(Scales::Minmax), ..q.clone() };
    let other = trained_loss(&q_mm, &minmax);
    assert!((other - want).abs() > 1e-4, "learned {want} vs min-max {other}");
}

#[test]
fn scales_that_do_not_match_the_adapter_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ad_dir = tmp.path().join("adapter");
    std::fs::create_dir(&ad_dir).unwrap();
    train(&learned(4, 32, "base"), &ad_dir);
    let mut minmax = flags(&learned(4, 32, "base"));
    minmax.truncate(minmax.len() - 2);
    let (ok, stderr) = export(&ad_dir, &tmp.path().join("x"), "safetensors", &minmax);
    assert!(!ok && stderr.contains("pass --scales learned"), "{stderr}");
    assert!(!tmp.path().join("x").exists(), "nothing written");
    // and the other way: learned scales asked of an adapter without them
    let plain = common::fixture("tiny_qat/adapter_init");
    let (ok, stderr) = export(&plain, &tmp.path().join("y"), "safetensors", &flags(&learned(4, 32, "base")));
    assert!(!ok && stderr.contains("has no learned scales"), "{stderr}");
}
