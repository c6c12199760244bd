//! The `qatc` binary on bad input: one line on stderr starting with `error: ` that names the file
//! (and the tensor where one is at fault), exit code 2, no panic, and nothing left on disk: no
//! output directory and no temp directory beside it.
//!
//! Each malformed model starts as a valid tiny synthetic GPT-2 (2 layers, n_embd 64, 4 heads,
//! n_positions 32, vocab 97, `transformer.` prefix) and is then corrupted in one way.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use qatc::data::TokenFile;
use qatc::frontend::checkpoint::write_synthetic;
use qatc::frontend::config::Gpt2Config;
use qatc_ir::DType;
use serde_json::{json, Map, Value};

fn tiny() -> Gpt2Config {
    Gpt2Config { n_embd: 64, n_layer: 2, n_head: 4, n_positions: 32, vocab_size: 97, layer_norm_epsilon: 1e-5 }
}

/// A temp dir holding a valid tiny model (`model.safetensors` + `config.json`).
fn model_dir() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model.safetensors");
    write_synthetic(&model, &tiny(), DType::F32, true, 5).unwrap();
    (dir, model)
}

/// Rewrites the model's header (and, if wanted, data) in place.
fn edit(model: &Path, f: impl FnOnce(&mut Map<String, Value>, &mut Vec<u8>)) {
    let b = std::fs::read(model).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let mut h: Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let mut data = b[8 + n..].to_vec();
    f(h.as_object_mut().unwrap(), &mut data);
    let h = h.to_string();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(&data);
    std::fs::write(model, out).unwrap();
}

fn listing(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect()
}

/// Runs qatc in `dir`'s context and checks the bad-input contract; returns the error line.
fn fails(dir: &Path, args: &[&str], names: &[&str]) -> String {
    let before = listing(dir);
    let out = Command::new(env!("CARGO_BIN_EXE_qatc")).args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    assert_eq!(out.status.code(), Some(2), "exit status {:?}, stderr: {stderr}", out.status);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "stderr is not one line: {stderr:?}");
    let line = lines[0];
    assert!(line.starts_with("error: "), "{line}");
    for n in names {
        assert!(line.contains(n), "{line:?} does not name {n:?}");
    }
    assert_eq!(listing(dir), before, "files were left behind");
    line.to_string()
}

fn compile_fails(dir: &Path, model: &Path, names: &[&str]) -> String {
    compile_seq_fails(dir, model, "8", names)
}

fn compile_seq_fails(dir: &Path, model: &Path, seq: &str, names: &[&str]) -> String {
    let out = dir.join("out");
    let (m, o) = (model.to_str().unwrap(), out.to_str().unwrap());
    let line = fails(dir, &["compile", m, "--batch", "2", "--seq", seq, "-o", o], names);
    assert!(!out.exists());
    line
}

fn eval_fails(dir: &Path, model: &Path, data: &Path, names: &[&str]) -> String {
    let (m, d) = (model.to_str().unwrap(), data.to_str().unwrap());
    fails(dir, &["eval", m, "--data", d, "--batch", "2", "--seq", "8"], names)
}

fn entry_mut<'a>(h: &'a mut Map<String, Value>, k: &str) -> &'a mut Value {
    h.get_mut(k).unwrap()
}

fn offsets(h: &Map<String, Value>, k: &str) -> (u64, u64) {
    let o = &h[k]["data_offsets"];
    (o[0].as_u64().unwrap(), o[1].as_u64().unwrap())
}

#[test]
fn control_valid_model_compiles() {
    let (dir, model) = model_dir();
    let out = dir.path().join("out");
    let r = Command::new(env!("CARGO_BIN_EXE_qatc"))
        .args(["compile", model.to_str().unwrap(), "--batch", "2", "--seq", "8", "-o", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(out.join("manifest.json").exists());
}

#[test]
fn missing_model_file() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("nope.safetensors");
    compile_fails(dir.path(), &model, &[model.to_str().unwrap()]);
}

#[test]
fn not_safetensors() {
    let (dir, model) = model_dir();
    std::fs::write(&model, "GPT-2 weights are available on request.\nThank you!\n").unwrap();
    compile_fails(dir.path(), &model, &[model.to_str().unwrap()]);
}

#[test]
fn truncated_data() {
    let (dir, model) = model_dir();
    let len = std::fs::metadata(&model).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&model).unwrap().set_len(len - 100).unwrap();
    // Sorted keys put wte last in the data section: it is the tensor cut short.
    compile_fails(dir.path(), &model, &[model.to_str().unwrap(), "transformer.wte.weight", "end of the data section"]);
}

#[test]
fn header_length_beyond_the_file() {
    let (dir, model) = model_dir();
    let mut b = std::fs::read(&model).unwrap();
    let len = b.len() as u64;
    b[..8].copy_from_slice(&len.to_le_bytes());
    std::fs::write(&model, b).unwrap();
    compile_fails(dir.path(), &model, &[model.to_str().unwrap(), "beyond the file"]);
}

#[test]
fn overlapping_offsets() {
    let (dir, model) = model_dir();
    edit(&model, |h, _| {
        let (b, e) = offsets(h, "transformer.h.0.ln_1.weight");
        entry_mut(h, "transformer.h.0.ln_1.bias")["data_offsets"] = json!([b + 4, e + 4]);
    });
    compile_fails(dir.path(), &model, &[model.to_str().unwrap(), "transformer.h.0.ln_1", "overlaps"]);
}

#[test]
fn out_of_range_offsets() {
    let (dir, model) = model_dir();
    edit(&model, |h, data| {
        let far = data.len() as u64 + 4096;
        entry_mut(h, "transformer.h.0.ln_1.bias")["data_offsets"] = json!([far, far + 256]);
    });
    compile_fails(dir.path(), &model, &[model.to_str().unwrap(), "\"transformer.h.0.ln_1.bias\"", "beyond"]);
}

#[test]
fn size_mismatch() {
    let (dir, model) = model_dir();
    edit(&model, |h, _| entry_mut(h, "transformer.h.0.attn.c_attn.weight")["shape"] = json!([64, 191]));
    let line = compile_fails(dir.path(), &model, &[model.to_str().unwrap(), "\"transformer.h.0.attn.c_attn.weight\""]);
    assert!(line.contains("shape [64, 191] x f32 needs 48896 bytes but its range holds 49152"), "{line}");
}

#[test]
fn missing_tensor() {
    let (dir, model) = model_dir();
    edit(&model, |h, _| {
        // Renamed to a mask buffer, which the loader skips: the layout stays valid.
        let e = h.remove("transformer.h.1.ln_2.bias").unwrap();
        h.insert("transformer.h.1.attn.bias".into(), e);
    });
    compile_fails(dir.path(), &model, &[model.to_str().unwrap(), "\"transformer.h.1.ln_2.bias\"", "missing"]);
}

#[test]
fn inconsistent_layer_shapes() {
    let (dir, model) = model_dir();
    // Same byte count, other width than h.0's [64, 256].
    edit(&model, |h, _| entry_mut(h, "transformer.h.1.mlp.c_fc.weight")["shape"] = json!([128, 128]));
    let line = compile_fails(dir.path(), &model, &[model.to_str().unwrap(), "\"transformer.h.1.mlp.c_fc.weight\""]);
    assert!(line.contains("[128, 128]") && line.contains("[64, 256]"), "{line}");
}

#[test]
fn unsupported_dtype() {
    let (dir, model) = model_dir();
    // 64 F32 = 32 I64: the byte count still matches, only the dtype is wrong.
    edit(&model, |h, _| {
        let e = entry_mut(h, "transformer.h.0.ln_1.bias");
        e["dtype"] = json!("I64");
        e["shape"] = json!([32]);
    });
    compile_fails(dir.path(), &model, &[model.to_str().unwrap(), "\"transformer.h.0.ln_1.bias\"", "I64"]);
}

#[test]
fn seq_greater_than_n_positions() {
    let (dir, model) = model_dir();
    let line = compile_seq_fails(dir.path(), &model, "64", &[model.to_str().unwrap(), "64", "32"]);
    assert!(line.contains("n_positions"), "{line}");
}

#[test]
fn empty_token_file() {
    let (dir, model) = model_dir();
    let data = dir.path().join("tokens.bin");
    std::fs::write(&data, b"").unwrap();
    eval_fails(dir.path(), &model, &data, &[data.to_str().unwrap(), "empty"]);
}

#[test]
fn too_short_token_file() {
    let (dir, model) = model_dir();
    let data = dir.path().join("tokens.bin");
    // B x T + 1 = 17 tokens needed, 10 present.
    TokenFile::write(&data, &[1; 10]).unwrap();
    let line = eval_fails(dir.path(), &model, &data, &[data.to_str().unwrap()]);
    assert!(line.contains("10 tokens") && line.contains("17"), "{line}");
}

#[test]
fn token_file_with_wrong_magic() {
    let (dir, model) = model_dir();
    let data = dir.path().join("tokens.bin");
    TokenFile::write(&data, &[1; 40]).unwrap();
    let mut b = std::fs::read(&data).unwrap();
    b[..4].copy_from_slice(&20240326i32.to_le_bytes());
    std::fs::write(&data, b).unwrap();
    eval_fails(dir.path(), &model, &data, &[data.to_str().unwrap(), "20240326", "20240520"]);
}

#[test]
fn token_out_of_vocab() {
    let (dir, model) = model_dir();
    let data = dir.path().join("tokens.bin");
    let mut toks = vec![1u16; 40];
    toks[5] = 97;
    TokenFile::write(&data, &toks).unwrap();
    let line = eval_fails(dir.path(), &model, &data, &[data.to_str().unwrap()]);
    assert!(line.contains("97") && line.contains("position 5"), "{line}");
}
