//! `qatc export`: a LoRA adapter trained in-process on the tiny fixture (B 2, T 16, 3 steps from
//! `tiny_qat/adapter_init`, whose B is non-zero) is merged and written; reading the export back
//! must give the trained fake-quantized model's eval loss (3 batches) within 1e-4:
//!
//! - HF safetensors after `--qat base` sym 4-bit: FQ(W) + s (BA)^T in f32, opened as a plain model;
//! - GGUF after `--qat merged --scheme q4_0`: Q4_0 codes and f16 scales bit-equal to
//!   `quant::quantize(W + s (BA)^T)`, the dequantized weights bit-equal to what training used;
//! - GGUF after 8-bit `--qat merged` sym g32: Q8_0, with qatc's codes and fp16-rounded scales;
//! - GGUF of a full-precision adapter with `--bits 4 --scheme q4_0`: merged, then quantized;
//! - bad input: one line, exit 2, nothing written.
//!
//! The GGUF container and block codecs are checked on their own at the end.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use half::f16;
use qatc::adapter::{self, Adapter};
use qatc::cli::eval::{evaluate, EvalSetup};
use qatc::cli::options::{model_options, QuantArgs};
use qatc::cli::train::Trainer;
use qatc::config::Qat;
use qatc::data::TokenFile;
use qatc::export::gguf::{self, GgmlType, Gguf, TensorData, Value, ValueType};
use qatc::export::{hf, llama, vocab};
use qatc::frontend::checkpoint::write_synthetic;
use qatc::frontend::config::Gpt2Config;
use qatc::model::Model;
use qatc::step::StepOptions;
use qatc_ir::{BinaryOp, DType, Graph, InputKind, Op, QuantScheme, QuantSpec};
use qatc_passes::linears::MODULES;
use qatc_runtime::{quant, Interpreter, Tensor, Value as RtValue};

const MODEL: &str = "tiny/f32_prefix/model.safetensors";

fn model() -> Model {
    Model::open(&common::fixture(MODEL)).unwrap()
}

fn tokens() -> TokenFile {
    TokenFile::open(&common::fixture("tiny/tokens.bin")).unwrap()
}

fn quant_args(bits: u8, group: usize, scheme: &str, qat: &str) -> QuantArgs {
    let qat = <Qat as clap::ValueEnum>::from_str(qat, false).unwrap();
    QuantArgs { bits: Some(bits), group: Some(group), scheme: QuantScheme::from_name(scheme), qat: Some(qat), ..Default::default() }
}

/// The CLI flags for `quant_args`.
fn flags(q: &QuantArgs) -> Vec<String> {
    let qat = if q.qat == Some(Qat::Merged) { "merged" } else { "base" };
    let (b, g, s) = (q.bits.unwrap().to_string(), q.group.unwrap().to_string(), q.scheme.unwrap().name());
    ["--bits", &b, "--group", &g, "--scheme", s, "--qat", qat].iter().map(|s| s.to_string()).collect()
}

/// Trains LoRA (from adapter_init, lr 1e-2 so that the merged codes move) for 3 steps under `q`
/// and writes the adapter to `dir`.
fn train(q: &QuantArgs, dir: &Path) -> Adapter {
    let init = adapter::read(&common::fixture("tiny_qat/adapter_init")).unwrap();
    let mut o = StepOptions::new(2, 16);
    o.model = model_options(q, Some(init.options()), false, true).unwrap();
    let mut tr = Trainer::new(&model(), o, Some(&init), 0).unwrap();
    let data = tokens();
    for s in 0..3 {
        tr.step(&data, s, 1e-2).unwrap();
    }
    let (cfg, st) = adapter::to_files(&init.options(), &tr.weights().unwrap(), "tiny").unwrap();
    std::fs::write(dir.join("adapter_config.json"), cfg).unwrap();
    std::fs::write(dir.join("adapter_model.safetensors"), st).unwrap();
    adapter::read(dir).unwrap()
}

/// The eval loss of the trained model: fake-quantized base + adapter, as `qatc eval --adapter`.
fn trained_loss(q: &QuantArgs, ad: &Adapter) -> f64 {
    let setup =
        EvalSetup { model: model_options(q, Some(ad.options()), false, false).unwrap(), adapter: Some(ad.clone()), ..Default::default() };
    evaluate(&model(), &tokens(), 2, 16, 3, &setup, false).unwrap().loss
}

/// The eval loss of a plain f32 checkpoint (no quantization, no adapter).
fn plain_loss(model: &Path) -> f64 {
    let m = Model::open(model).unwrap();
    evaluate(&m, &tokens(), 2, 16, 3, &EvalSetup::default(), false).unwrap().loss
}

/// Runs `qatc export` and returns stderr; panics unless it succeeds.
fn export(ad: &Path, out: &Path, format: &str, extra: &[String]) -> String {
    let model = common::fixture(MODEL);
    let mut args: Vec<String> = vec!["export".into(), model.display().to_string(), "--adapter".into(), ad.display().to_string()];
    args.extend(["--out".into(), out.display().to_string(), "--format".into(), format.into()]);
    args.extend(extra.iter().cloned());
    let o = Command::new(env!("CARGO_BIN_EXE_qatc")).args(&args).output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "qatc {args:?} failed: {stderr}");
    stderr
}

/// W + s (BA)^T [in, out], computed with the LoRA pass's ops on the interpreter, independently
/// of the export code: bit for bit the tensor `--qat merged` fake-quantizes in training.
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
        ("w".to_string(), RtValue::Float(w.clone())),
        ("a".to_string(), RtValue::Float(a.clone())),
        ("b".to_string(), RtValue::Float(b.clone())),
    ]);
    let out = Interpreter::<f32>::new(&g).unwrap().run(&inputs).unwrap();
    (out["w_eff"].as_float().unwrap().data.clone(), n_in, n_out)
}

/// Writes the GGUF's tensors back as an HF checkpoint (f32 + config.json) in `dir`.
fn gguf_as_checkpoint(f: &Gguf, dir: &Path) -> PathBuf {
    let (cfg, tensors) = llama::from_gguf(f).unwrap();
    let path = dir.join("model.safetensors");
    std::fs::write(&path, hf::safetensors_bytes(&tensors).unwrap()).unwrap();
    std::fs::write(dir.join("config.json"), hf::config_json(&cfg).unwrap()).unwrap();
    path
}

#[test]
fn safetensors_export_after_base_qat_has_the_trained_loss() {
    let q = quant_args(4, 32, "sym", "base");
    let tmp = tempfile::tempdir().unwrap();
    let ad_dir = tmp.path().join("adapter");
    std::fs::create_dir(&ad_dir).unwrap();
    let ad = train(&q, &ad_dir);
    let want = trained_loss(&q, &ad);
    let out = tmp.path().join("hf");
    export(&ad_dir, &out, "safetensors", &flags(&q));
    let got = plain_loss(&out.join("model.safetensors"));
    eprintln!("safetensors (base sym4): export {got:.9} trained {want:.9} diff {:.3e}", got - want);
    assert!((got - want).abs() <= 1e-4, "export {got} vs trained {want}");
    // the export is not the base model: without the adapter the loss is another one
    let base = trained_loss(&q, &adapter::read(&common::fixture("tiny_qat/adapter_init")).unwrap());
    assert!((base - want).abs() > 1e-3, "training moved the loss ({base} -> {want})");
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!((cfg["n_ctx"].as_u64(), cfg["n_positions"].as_u64()), (Some(32), Some(32)));
    // qatc's step has no dropout in the blocks: said, not left to transformers' default 0.1
    for k in ["attn_pdrop", "embd_pdrop", "resid_pdrop"] {
        assert_eq!(cfg[k].as_f64(), Some(0.0), "{k}");
    }
    assert_eq!(cfg["architectures"][0], "GPT2LMHeadModel");
    // a non-linear tensor is copied unchanged, and the keys carry no `transformer.` prefix
    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let back = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(back.len(), 4 + 12 * 2, "every tensor once, no lm_head (tied)");
    let ln = model().weight::<f32>("h.1.ln_2.bias").unwrap();
    let got: Vec<f32> =
        back.tensor("h.1.ln_2.bias").unwrap().data().chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    assert_eq!(got, ln.data);
    let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("export.json")).unwrap()).unwrap();
    assert_eq!(summary["format"].as_str(), Some("safetensors"));
    let run = qatc::config::RunConfig::read(&out).unwrap();
    assert_eq!(run.model.quant.map(|q| (q.bits, q.group, q.scheme, q.qat)), Some((4, 32, QuantScheme::Sym, Qat::Base)));
}

#[test]
fn gguf_q4_0_export_after_merged_qat_holds_exactly_the_trained_codes() {
    let q = quant_args(4, 32, "q4_0", "merged");
    let tmp = tempfile::tempdir().unwrap();
    let ad_dir = tmp.path().join("adapter");
    std::fs::create_dir(&ad_dir).unwrap();
    let ad = train(&q, &ad_dir);
    let want = trained_loss(&q, &ad);
    let out = tmp.path().join("gguf");
    let stderr = export(&ad_dir, &out, "gguf", &flags(&q));
    assert!(!stderr.contains("note:"), "merged Q4_0 is exact: no note ({stderr})");
    let f = gguf::read(&std::fs::read(out.join("model.gguf")).unwrap()).unwrap();
    let m = model();
    let spec = QuantSpec { bits: 4, group: 32, scheme: QuantScheme::Q4_0 };
    let mut moved = 0;
    for l in 0..2 {
        for module in MODULES {
            let hf_mod = format!("h.{l}.{module}");
            let t = f.tensor(&llama::gguf_name(&format!("{hf_mod}.weight")).unwrap()).unwrap();
            assert_eq!(t.ty, GgmlType::Q4_0, "{hf_mod}");
            let (w, n_in, n_out) = w_eff(&m, &ad, &hf_mod);
            assert_eq!(t.dims, vec![n_in as u64, n_out as u64], "{hf_mod}: ne = [in, out]");
            let ours = quant::quantize(&w, n_in, n_out, spec);
            let (ds, codes) = gguf::q4_0_unpack(&t.data).unwrap();
            for j in 0..n_out {
                for k in 0..n_in / 32 {
                    let d = ds[j * (n_in / 32) + k];
                    assert_eq!(d, f16::from_f32(ours.scales[k * n_out + j]).to_bits(), "{hf_mod}: scale of row {j} block {k}");
                    for r in 0..32 {
                        let c = codes[(j * (n_in / 32) + k) * 32 + r];
                        assert_eq!(c, ours.codes[(32 * k + r) * n_out + j], "{hf_mod}: code ({}, {j})", 32 * k + r);
                    }
                }
            }
            let base = quant::quantize(&m.weight::<f32>(&format!("{hf_mod}.weight")).unwrap().data, n_in, n_out, spec);
            moved += base.codes.iter().zip(&ours.codes).filter(|(a, b)| a != b).count();
        }
    }
    assert!(moved > 0, "the adapter changed some codes: the export is not the base model's Q4_0");
    let dir = tempfile::tempdir().unwrap();
    let got = plain_loss(&gguf_as_checkpoint(&f, dir.path()));
    eprintln!("gguf (merged q4_0): export {got:.9} trained {want:.9} diff {:.3e}", got - want);
    assert!((got - want).abs() <= 1e-4, "GGUF {got} vs trained {want}");
    // the same weights, so in fact the same loss to the last bits of f32 accumulation
    assert!((got - want).abs() <= 1e-6, "GGUF {got} vs trained {want}");
    check_gguf_metadata(&f, 2);
}

/// A LoRA adapter trained at full precision, then `--format gguf --bits 4 --scheme q4_0`: merged
/// first and quantized after (post-training quantization, said in one note), the Q4_0 codes are
/// those of W + s (BA)^T; flags that only describe training are refused, and a quantization that
/// contradicts a QAT adapter's stays refused.
#[test]
fn a_full_precision_adapter_is_quantized_after_merging() {
    use qatc::cli::options::model_config;
    use qatc::config::{RunConfig, VERSION};
    let tmp = tempfile::tempdir().unwrap();
    let ad_dir = tmp.path().join("adapter");
    std::fs::create_dir(&ad_dir).unwrap();
    let ad = train(&QuantArgs::default(), &ad_dir);
    let fp = model_config(&QuantArgs::default(), Some(&ad.options()), false, &common::fixture(MODEL)).unwrap();
    std::fs::write(ad_dir.join("qatc.json"), RunConfig { version: VERSION, model: fp, step: None, train: None }.to_json()).unwrap();
    let q = ["--bits", "4", "--group", "32", "--scheme", "q4_0"].map(String::from);
    let out = tmp.path().join("gguf");
    let stderr = export(&ad_dir, &out, "gguf", &q);
    let notes: Vec<&str> = stderr.lines().filter(|l| l.starts_with("note:")).collect();
    assert_eq!(notes.len(), 1, "{stderr}");
    assert!(notes[0].contains("full-precision adapter") && notes[0].contains("4-bit q4_0 g32"), "{}", notes[0]);
    let summary: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("export.json")).unwrap()).unwrap();
    assert_eq!(summary["post_training_quantization"], serde_json::json!({ "bits": 4, "group": 32, "scheme": "q4_0" }));
    let f = gguf::read(&std::fs::read(out.join("model.gguf")).unwrap()).unwrap();
    let spec = QuantSpec { bits: 4, group: 32, scheme: QuantScheme::Q4_0 };
    let m = model();
    for l in 0..2 {
        for module in MODULES {
            let hf_mod = format!("h.{l}.{module}");
            let t = f.tensor(&llama::gguf_name(&format!("{hf_mod}.weight")).unwrap()).unwrap();
            assert_eq!(t.ty, GgmlType::Q4_0, "{hf_mod}");
            let (w, n_in, n_out) = w_eff(&m, &ad, &hf_mod);
            let ours = quant::quantize(&w, n_in, n_out, spec);
            let (_, codes) = gguf::q4_0_unpack(&t.data).unwrap();
            for j in 0..n_out {
                for k in 0..n_in {
                    let c = codes[(j * (n_in / 32) + k / 32) * 32 + k % 32];
                    assert_eq!(c, ours.codes[k * n_out + j], "{hf_mod}: code ({k}, {j})");
                }
            }
        }
    }
    let model_arg = common::fixture(MODEL).display().to_string();
    let ad_arg = ad_dir.display().to_string();
    let base = ["--adapter", &ad_arg, "--format", "gguf", "--bits", "4", "--group", "32", "--scheme", "q4_0"];
    for (extra, name) in
        [(["--scales", "learned"], "--scales learned"), (["--qat", "base"], "--qat base"), (["--act-bits", "8"], "--act-bits")]
    {
        let fresh = tmp.path().join("refused");
        let mut args = vec![model_arg.as_str()];
        args.extend(base);
        args.extend(["--out", fresh.to_str().unwrap()]);
        args.extend(extra);
        fails(tmp.path(), &args, &[name, "full-precision adapter"]);
    }
    // a QAT adapter's recorded quantization still wins over the flags
    let qat = quant_args(4, 32, "q4_0", "merged");
    let trained = model_config(&qat, Some(&ad.options()), false, &common::fixture(MODEL)).unwrap();
    std::fs::write(ad_dir.join("qatc.json"), RunConfig { version: VERSION, model: trained, step: None, train: None }.to_json()).unwrap();
    let fresh = tmp.path().join("refused");
    let args = vec![model_arg.as_str(), "--adapter", &ad_arg, "--format", "gguf", "--bits", "8", "--out", fresh.to_str().unwrap()];
    fails(tmp.path(), &args, &["--bits 8 contradicts", "which has 4"]);
}

/// KVs llama.cpp's gpt2 loader reads, for the tiny model; `ftype` is general.file_type.
fn check_gguf_metadata(f: &Gguf, ftype: u32) {
    let s = |k: &str| f.get(k).and_then(Value::as_str).map(String::from);
    let u = |k: &str| f.get(k).and_then(Value::as_u32);
    assert_eq!(f.kvs[0].0, "general.architecture");
    assert_eq!(s("general.architecture").as_deref(), Some("gpt2"));
    assert_eq!(s("general.name").as_deref(), Some("f32_prefix"));
    assert_eq!(s("tokenizer.ggml.model").as_deref(), Some("gpt2"));
    assert_eq!(s("tokenizer.ggml.pre").as_deref(), Some("gpt-2"));
    let sizes =
        ["gpt2.context_length", "gpt2.embedding_length", "gpt2.block_count", "gpt2.feed_forward_length", "gpt2.attention.head_count"];
    assert_eq!(sizes.map(u), [Some(32), Some(64), Some(2), Some(256), Some(4)]);
    assert_eq!(f.get("gpt2.attention.layer_norm_epsilon"), Some(&Value::F32(1e-5)));
    assert_eq!((u("general.file_type"), u("general.quantization_version"), u("general.alignment")), (Some(ftype), Some(2), Some(32)));
    assert_eq!((u("tokenizer.ggml.bos_token_id"), u("tokenizer.ggml.eos_token_id")), (Some(96), Some(96)));
    let Some(Value::Array(ValueType::Str, toks)) = f.get("tokenizer.ggml.tokens") else { panic!("no token list") };
    assert_eq!(toks.len(), 97);
    assert_eq!(toks[96], Value::Str(vocab::EOT.into()));
    let names: Vec<&str> = f.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names.len(), 28);
    for n in ["token_embd.weight", "position_embd.weight", "blk.1.ffn_down.bias", "output_norm.weight"] {
        assert!(names.contains(&n), "{n}");
    }
    assert!(!names.contains(&"output.weight"), "the head is tied to token_embd");
    let wte = f.tensor("token_embd.weight").unwrap();
    assert_eq!((wte.ty, wte.dims.clone()), (GgmlType::F32, vec![64, 97]));
}

#[test]
fn gguf_8bit_export_is_q8_0_with_the_trained_codes() {
    // Q8_0 is not qatc's 8-bit grid: its scale is stored as fp16 and its block is 32. Trained
    // with sym 8 bits in groups of 32, the trained weights are k S (|k| <= 127, S = amax/127), so
    // Q8_0 picks the same k and only rounds S to fp16: every weight moves by at most 2^-11 of
    // itself. The loss tolerance follows (1e-4, as for the exact exports; measured ~1e-6).
    let q = quant_args(8, 32, "sym", "merged");
    let tmp = tempfile::tempdir().unwrap();
    let ad_dir = tmp.path().join("adapter");
    std::fs::create_dir(&ad_dir).unwrap();
    let ad = train(&q, &ad_dir);
    let want = trained_loss(&q, &ad);
    let out = tmp.path().join("gguf");
    export(&ad_dir, &out, "gguf", &flags(&q));
    let f = gguf::read(&std::fs::read(out.join("model.gguf")).unwrap()).unwrap();
    let m = model();
    let spec = QuantSpec { bits: 8, group: 32, scheme: QuantScheme::Sym };
    for l in 0..2 {
        for module in MODULES {
            let hf_mod = format!("h.{l}.{module}");
            let t = f.tensor(&llama::gguf_name(&format!("{hf_mod}.weight")).unwrap()).unwrap();
            assert_eq!(t.ty, GgmlType::Q8_0, "{hf_mod}");
            let (w, n_in, n_out) = w_eff(&m, &ad, &hf_mod);
            let ours = quant::quantize(&w, n_in, n_out, spec);
            for j in 0..n_out {
                for k in 0..n_in / 32 {
                    let blk = &t.data[(j * (n_in / 32) + k) * 34..][..34];
                    let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                    let s = ours.scales[k * n_out + j];
                    assert!((d - s).abs() <= s.abs() * 2f32.powi(-11), "{hf_mod}: scale {d} vs {s}");
                    for r in 0..32 {
                        let code = ours.codes[(32 * k + r) * n_out + j] as i32 - 127;
                        assert_eq!(blk[2 + r] as i8 as i32, code, "{hf_mod}: code ({}, {j})", 32 * k + r);
                    }
                }
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let got = plain_loss(&gguf_as_checkpoint(&f, dir.path()));
    eprintln!("gguf (merged sym8 -> Q8_0): export {got:.9} trained {want:.9} diff {:.3e}", got - want);
    assert!((got - want).abs() <= 1e-4, "Q8_0 GGUF {got} vs trained {want}");
    check_gguf_metadata(&f, 7);
}

#[test]
fn gguf_after_base_qat_says_it_requantizes_and_f16_otherwise() {
    let ad = common::fixture("tiny_qat/adapter_init");
    let tmp = tempfile::tempdir().unwrap();
    let stderr = export(&ad, &tmp.path().join("q4"), "gguf", &flags(&quant_args(4, 32, "q4_0", "base")));
    assert_eq!(stderr.lines().filter(|l| l.starts_with("note: --qat base")).count(), 1, "{stderr}");
    // sym 4-bit has no GGUF type: the trained weights go out as f16, no quantization_version
    export(&ad, &tmp.path().join("f16"), "gguf", &flags(&quant_args(4, 32, "sym", "base")));
    let f = gguf::read(&std::fs::read(tmp.path().join("f16/model.gguf")).unwrap()).unwrap();
    assert_eq!(f.tensor("blk.0.attn_qkv.weight").unwrap().ty, GgmlType::F16);
    assert_eq!(f.get("general.file_type"), Some(&Value::U32(1)));
    assert!(f.get("general.quantization_version").is_none());
}

// ---------------------------------------------------------------------------------------------
// bad input

fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

/// `qatc export` with `args` must fail with one `error:` line naming `names`, exit 2, and
/// leave `dir` as it was.
fn fails(dir: &Path, args: &[&str], names: &[&str]) {
    let before = listing(dir);
    let o = Command::new(env!("CARGO_BIN_EXE_qatc")).arg("export").args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    assert_eq!(o.status.code(), Some(2), "{args:?}: status {:?}, stderr {stderr}", o.status);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{args:?}: stderr is not one line: {stderr:?}");
    assert!(lines[0].starts_with("error: "), "{}", lines[0]);
    for n in names {
        assert!(lines[0].contains(n), "{:?} does not name {n:?}", lines[0]);
    }
    assert_eq!(listing(dir), before, "{args:?} left files behind");
}

/// A synthetic model of width `n_embd` (head dim 16) and a fresh r=4 adapter for it.
fn synthetic(dir: &Path, n_embd: usize, n_layer: usize) -> (PathBuf, PathBuf) {
    let cfg = Gpt2Config { n_embd, n_layer, n_head: n_embd / 16, n_positions: 32, vocab_size: 97, layer_norm_epsilon: 1e-5 };
    let model = dir.join(format!("m{n_embd}_{n_layer}/model.safetensors"));
    std::fs::create_dir_all(model.parent().unwrap()).unwrap();
    write_synthetic(&model, &cfg, DType::F32, false, 3).unwrap();
    let o = qatc_passes::lora::LoraOptions::new(4);
    let mut ts = Vec::new();
    let dims = [(n_embd, 3 * n_embd), (n_embd, n_embd), (n_embd, 4 * n_embd), (4 * n_embd, n_embd)];
    for l in 0..n_layer {
        for (m, (i, out)) in MODULES.iter().zip(dims) {
            let (an, bn) = qatc_passes::lora::lora_names(&format!("h.{l}.{m}"));
            ts.push((an.clone(), adapter::init_tensor(&an, &[4, i], 1)));
            ts.push((bn.clone(), Tensor { shape: vec![out, 4], data: vec![0.01; out * 4] }));
        }
    }
    let (c, st) = adapter::to_files(&o, &ts, "synthetic").unwrap();
    let ad = dir.join(format!("a{n_embd}_{n_layer}"));
    std::fs::create_dir_all(&ad).unwrap();
    std::fs::write(ad.join("adapter_config.json"), c).unwrap();
    std::fs::write(ad.join("adapter_model.safetensors"), st).unwrap();
    (model, ad)
}

#[test]
fn bad_input_fails_with_one_line_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let model = common::fixture(MODEL);
    let m = model.to_str().unwrap();
    let ad_path = common::fixture("tiny_qat/adapter_init");
    let ad = ad_path.to_str().unwrap();
    let out = d.join("out");
    let o = out.to_str().unwrap();
    let missing = d.join("nope");
    fails(d, &[m, "--adapter", missing.to_str().unwrap(), "--out", o], &["nope", "adapter_config.json"]);
    fails(d, &[m, "--adapter", ad, "--out", o, "--format", "onnx"], &["--format", "onnx", "gguf"]);
    fails(
        d,
        &[m, "--adapter", ad, "--out", o, "--format", "gguf", "--bits", "4", "--scheme", "q4_0", "--group", "64"],
        &["q4_0", "group 32"],
    );
    fails(d, &[m, "--adapter", ad, "--out", o, "--bits", "4", "--group", "32", "--act-bits", "8"], &["--act-bits"]);
    fails(d, &[m, "--adapter", ad, "--out", o, "--bits", "4", "--group", "32", "--quant-targets", "c_attn,lm_head"], &["lm_head"]);
    // the adapter is for n_embd 64, 2 layers
    let (m48_2, _) = synthetic(d, 48, 2);
    fails(d, &[m48_2.to_str().unwrap(), "--adapter", ad, "--out", o], &["lora_A.weight", "[4, 64]", "[4, 48]"]);
    let (m64, _) = synthetic(d, 64, 1);
    fails(d, &[m64.to_str().unwrap(), "--adapter", ad, "--out", o], &["h.1.", "matches no linear"]);
    // in-features 48: Q8_0 blocks of 32 do not fit, though 8-bit groups of 16 trained fine
    let (m48, ad48) = synthetic(d, 48, 1);
    let (m48s, ad48s) = (m48.to_str().unwrap().to_string(), ad48.to_str().unwrap().to_string());
    let g16 = ["--bits", "8", "--group", "16"];
    fails(d, &[&[m48s.as_str(), "--adapter", &ad48s, "--out", o, "--format", "gguf"][..], &g16].concat(), &["in-features 48", "Q8_0"]);
    let ok = Command::new(env!("CARGO_BIN_EXE_qatc"))
        .args([&["export", &m48s, "--adapter", &ad48s, "--out", o][..], &g16].concat())
        .output()
        .unwrap();
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    assert!(out.join("model.safetensors").exists() && out.join("config.json").exists());
}

// ---------------------------------------------------------------------------------------------
// the container and the blocks

#[test]
fn q8_0_is_llama_cpp_reference_quantizer() {
    let mut x = vec![0f32; 64];
    x[0] = -2.54; // amax: d = 0.02, q = -127
    x[1] = 0.01; // 0.5 -> 1: roundf rounds ties away from zero
    x[2] = -0.03; // -1.5 -> -2
    x[3] = 0.0149; // 0.745 -> 1
    let b = gguf::quantize_q8_0(&x);
    assert_eq!(b.len(), 68);
    let d = 2.54f32 / 127.0;
    assert_eq!(&b[..2], &f16::from_f32(d).to_le_bytes());
    let id = 1.0 / d;
    let want: Vec<i8> = x[..32].iter().map(|v| (v * id).round() as i8).collect();
    assert_eq!(&b[2..34].iter().map(|&c| c as i8).collect::<Vec<_>>(), &want);
    assert_eq!(&want[..4], &[-127, 1, -2, 1]);
    // an all-zero block: d = 0, codes 0
    assert!(b[34..].iter().all(|&c| c == 0));
    let back = gguf::decode(GgmlType::Q8_0, &b).unwrap();
    assert_eq!(back[0], -127.0 * f16::from_f32(d).to_f32());
}

#[test]
fn q4_0_blocks_put_element_j_low_and_j_plus_16_high() {
    let codes: [u8; 32] = std::array::from_fn(|i| (i % 16) as u8);
    let b = gguf::q4_0_block(f16::from_f32(0.5), &codes);
    assert_eq!(b[2], codes[0] | codes[16] << 4);
    assert_eq!(b[17], codes[15] | codes[31] << 4);
    let (d, q) = gguf::q4_0_unpack(&b).unwrap();
    assert_eq!((d, q), (vec![f16::from_f32(0.5).to_bits()], codes.to_vec()));
    let v = gguf::decode(GgmlType::Q4_0, &b).unwrap();
    assert_eq!((v[0], v[9], v[31]), (-4.0, 0.5, 3.5));
}

fn sample_file() -> Gguf {
    Gguf {
        kvs: vec![
            ("general.architecture".into(), Value::Str("gpt2".into())),
            ("a.u8".into(), Value::U8(7)),
            ("a.i8".into(), Value::I8(-7)),
            ("a.u16".into(), Value::U16(65535)),
            ("a.i16".into(), Value::I16(-300)),
            ("a.i32".into(), Value::I32(-5)),
            ("a.f32".into(), Value::F32(1.5)),
            ("a.bool".into(), Value::Bool(true)),
            ("a.u64".into(), Value::U64(1 << 40)),
            ("a.i64".into(), Value::I64(-(1 << 40))),
            ("a.f64".into(), Value::F64(0.1)),
            ("a.empty".into(), Value::Array(ValueType::I32, vec![])),
            ("a.nested".into(), Value::Array(ValueType::Array, vec![Value::strings(["x".to_string(), "ü".to_string()])])),
        ],
        tensors: vec![
            TensorData { name: "v".into(), dims: vec![3], ty: GgmlType::F32, data: gguf::encode_f32(&[1.0, 2.0, 3.0]) },
            TensorData { name: "m".into(), dims: vec![32, 2], ty: GgmlType::Q8_0, data: gguf::quantize_q8_0(&[0.25; 64]) },
            TensorData { name: "h".into(), dims: vec![5], ty: GgmlType::F16, data: gguf::encode_f16(&[0.5; 5]) },
        ],
    }
}

#[test]
fn gguf_round_trips_and_aligns_every_tensor() {
    let f = sample_file();
    let bytes = gguf::write(&f).unwrap();
    assert_eq!(&bytes[..8], b"GGUF\x03\x00\x00\x00");
    assert_eq!(bytes.len() % 32, 0, "the last tensor is padded too");
    assert_eq!(gguf::read(&bytes).unwrap(), f);
    // data: v 12 bytes padded to 32, m 68 to 96, h 10 to 32: h is the last 32 bytes
    let h = &bytes[bytes.len() - 32..];
    assert_eq!(&h[..2], &f16::from_f32(0.5).to_le_bytes());
    assert!(h[10..].iter().all(|&b| b == 0));
}

#[test]
fn gguf_reader_rejects_malformed_files() {
    let good = gguf::write(&sample_file()).unwrap();
    let err = |b: &[u8]| gguf::read(b).unwrap_err().to_string();
    assert!(err(b"GGML\x03\0\0\0").contains("magic"));
    let mut v2 = good.clone();
    v2[4] = 2;
    assert!(err(&v2).contains("version 2"));
    // (the last 25 bytes are the F16 tensor's last 3 values and its padding)
    for cut in [5, 20, 100, good.len() - 25] {
        assert!(err(&good[..cut]).contains("truncated"), "cut at {cut}: {}", err(&good[..cut]));
    }
    // a hostile tensor count is refused before anything is allocated
    let mut huge = good.clone();
    huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(err(&huge).contains("tensor count"));
    // writer-side checks: ragged blocks, wrong sizes, long names
    let mut f = sample_file();
    f.tensors[1].dims = vec![16, 4];
    assert!(gguf::write(&f).unwrap_err().to_string().contains("multiple of the Q8_0 block"));
    let mut f = sample_file();
    f.tensors[0].dims = vec![4];
    assert!(gguf::write(&f).unwrap_err().to_string().contains("need 16"));
    let mut f = sample_file();
    f.tensors[0].name = "x".repeat(64);
    assert!(gguf::write(&f).is_err());
}

#[test]
fn tokenizer_fits_every_vocab_size() {
    let full = vocab::gpt2(50257).unwrap();
    assert_eq!((full.tokens.len(), full.merges.len(), full.eos), (50257, 50000, 50256));
    assert_eq!((full.tokens[198].as_str(), full.merges[0].as_str()), ("\u{10a}", "\u{120} t"));
    assert_eq!(full.types[50256], vocab::TOKEN_CONTROL);
    let padded = vocab::gpt2(50304).unwrap();
    assert_eq!((padded.tokens[50303].as_str(), padded.types[50303], padded.eos), ("[PAD50303]", vocab::TOKEN_UNUSED, 50256));
    let tiny = vocab::gpt2(97).unwrap();
    assert_eq!((tiny.tokens.len(), tiny.tokens[96].as_str(), tiny.bos, tiny.merges.len()), (97, vocab::EOT, 96, 0));
    let mid = vocab::gpt2(300).unwrap();
    assert!(!mid.merges.is_empty() && mid.merges.len() < 50, "only merges inside the first 299 tokens: {}", mid.merges.len());
}
