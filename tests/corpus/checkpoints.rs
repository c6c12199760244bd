//! Malformed checkpoints and configs: header, layout, dtype, shape and value faults, each in a
//! copy of the valid model, and the non-finite checkpoint under every command that reads one.

use serde_json::{json, Map, Value};

use super::fixtures::{element, join, split, Base};
use crate::{s, Case};

/// A case whose model (`m/model.safetensors`, with the valid config.json beside it) is `bytes`,
/// evaluated (or run with `cmd`'s arguments: `M` stands for the model, `D` for the tokens).
fn with_model(base: &Base, name: &str, bytes: Vec<u8>, culprit: &[&str]) -> Case {
    run_model(base, name, bytes, &["eval", "M", "--data", "D", "--batch", "2", "--seq", "8"], culprit)
}

fn run_model(base: &Base, name: &str, bytes: Vec<u8>, cmd: &[&str], culprit: &[&str]) -> Case {
    let tokens = s(&base.tokens());
    let args: Vec<String> = cmd
        .iter()
        .map(|a| match *a {
            "M" => "m/model.safetensors".to_string(),
            "D" => tokens.clone(),
            a => a.to_string(),
        })
        .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let config = std::fs::read(base.model().with_file_name("config.json")).unwrap();
    Case::refused(name, &args, culprit).file("m/model.safetensors", bytes).file("m/config.json", config)
}

/// The valid model with its header and data edited.
fn edited(base: &Base, f: impl FnOnce(&mut Map<String, Value>, &mut Vec<u8>)) -> Vec<u8> {
    let (mut h, mut data) = split(&std::fs::read(base.model()).unwrap());
    f(&mut h, &mut data);
    join(&h, &data)
}

/// The valid model with one f32 element set to `v`.
fn poked(base: &Base, key: &str, i: usize, v: f32) -> Vec<u8> {
    edited(base, |h, data| {
        let at = element(h, key, i);
        data[at..at + 4].copy_from_slice(&v.to_le_bytes());
    })
}

pub fn cases(base: &Base) -> Vec<Case> {
    let model = std::fs::read(base.model()).unwrap();
    let mut v = Vec::new();
    let fc = "transformer.h.0.mlp.c_fc.weight";
    // non-finite values: every float class, in several tensors, first index reported
    for (tag, key, i, x) in [
        ("nan", fc, 7, f32::NAN),
        ("inf", fc, 300, f32::INFINITY),
        ("neg-inf", "transformer.h.1.attn.c_proj.weight", 0, f32::NEG_INFINITY),
        ("nan-wte", "transformer.wte.weight", 96 * 64 + 63, f32::NAN),
        ("nan-ln-bias", "transformer.h.1.ln_2.bias", 5, f32::NAN),
        ("nan-wpe", "transformer.wpe.weight", 0, f32::NAN),
    ] {
        let ix = format!("index {i}");
        v.push(with_model(
            base,
            &format!("checkpoint/{tag}"),
            poked(base, key, i, x),
            &["m/model.safetensors", key, &ix, "--allow-nonfinite"],
        ));
    }
    // two bad values: the first is named
    let two = {
        let b = poked(base, fc, 9, f32::NAN);
        let (mut h, mut d) = split(&b);
        let at = element(&h, fc, 3);
        d[at..at + 4].copy_from_slice(&f32::INFINITY.to_le_bytes());
        h.remove("__metadata__");
        join(&h, &d)
    };
    v.push(with_model(base, "checkpoint/first-of-two", two, &[fc, "index 3", "inf"]));
    // the non-finite checkpoint under every command that reads one
    let nan = poked(base, fc, 7, f32::NAN);
    let out = |o: &str| o.to_string();
    for (cmd, args) in [
        ("eval", vec!["eval", "M", "--data", "D", "--batch", "2", "--seq", "8"]),
        ("train", vec!["train", "M", "--data", "D", "--batch", "2", "--seq", "8", "--lora", "r=2", "--steps", "1", "--out", "o"]),
        ("export", vec!["export", "M", "--adapter", "AD", "--out", "o"]),
        ("prt", vec!["prt", "M", "--data", "D", "--batch", "2", "--seq", "8", "--bits-map", "b.json"]),
        ("plan", vec!["plan", "M", "--batch", "2", "--seq", "8"]),
        ("compile", vec!["compile", "M", "--batch", "2", "--seq", "8", "-o", "o"]),
        ("dump", vec!["dump", "M", "--batch", "2", "--seq", "8"]),
    ] {
        let ad = s(&base.adapter());
        let args: Vec<String> = args.iter().map(|a| if *a == "AD" { ad.clone() } else { out(a) }).collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        v.push(run_model(base, &format!("checkpoint/nan-under-{cmd}"), nan.clone(), &args, &[fc, "index 7"]));
    }
    // let in on purpose: eval still never prints NaN; training stops before saving anything
    v.push(run_model(
        base,
        "checkpoint/nan-allowed-eval",
        nan.clone(),
        &["eval", "M", "--data", "D", "--batch", "2", "--seq", "8", "--allow-nonfinite"],
        &["batch 0", "loss of NaN", "no result"],
    ));
    // layout faults
    let len = model.len();
    v.push(with_model(base, "checkpoint/empty", vec![], &["m/model.safetensors", "shorter than the 8-byte"]));
    v.push(with_model(base, "checkpoint/seven-bytes", vec![1; 7], &["m/model.safetensors"]));
    v.push(with_model(base, "checkpoint/text", b"GPT-2 weights on request\n".to_vec(), &["m/model.safetensors", "not a safetensors file"]));
    let mut beyond = model.clone();
    beyond[..8].copy_from_slice(&(len as u64).to_le_bytes());
    v.push(with_model(base, "checkpoint/header-beyond-file", beyond, &["beyond the file"]));
    let mut huge = model.clone();
    huge[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    v.push(with_model(base, "checkpoint/header-too-large", huge, &["over the 1048576-byte limit"]));
    let mut not_utf8 = model.clone();
    not_utf8[9] = 0xff;
    v.push(with_model(base, "checkpoint/header-not-utf8", not_utf8, &["header is not UTF-8"]));
    let hdr = |text: &str| {
        let mut b = (text.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(text.as_bytes());
        b
    };
    v.push(with_model(base, "checkpoint/header-not-json", hdr("{not json"), &["not a JSON object"]));
    v.push(with_model(base, "checkpoint/header-array", hdr("[1, 2]"), &["not a JSON object"]));
    v.push(with_model(base, "checkpoint/no-tensors", hdr("{}"), &["lists no tensors"]));
    v.push(with_model(base, "checkpoint/metadata-only", hdr(r#"{"__metadata__":{"format":"pt"}}"#), &["lists no tensors"]));
    v.push(with_model(base, "checkpoint/metadata-not-strings", hdr(r#"{"__metadata__":{"a":1}}"#), &["__metadata__"]));
    let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
    v.push(with_model(base, "checkpoint/deep-nesting", hdr(&format!("{{\"a\": {deep}}}")), &["m/model.safetensors"]));
    let mut truncated = model.clone();
    truncated.truncate(len - 100);
    v.push(with_model(base, "checkpoint/truncated", truncated, &["transformer.wte.weight", "end of the data section"]));
    let mut trailing = model.clone();
    trailing.extend_from_slice(&[0; 16]);
    v.push(with_model(base, "checkpoint/trailing-bytes", trailing, &["16 bytes after the last tensor"]));
    let entry = |k: &'static str, f: fn(&mut Value)| {
        edited(base, |h, _| {
            f(h.get_mut(k).unwrap());
        })
    };
    let ln1 = "transformer.h.0.ln_1.bias";
    v.push(with_model(
        base,
        "checkpoint/overlap",
        edited(base, |h, _| {
            let b = h["transformer.h.0.ln_1.weight"]["data_offsets"][0].as_u64().unwrap();
            h.get_mut(ln1).unwrap()["data_offsets"] = json!([b + 4, b + 260]);
        }),
        &[ln1],
    ));
    v.push(with_model(base, "checkpoint/reversed-range", entry(ln1, |e| e["data_offsets"] = json!([256, 0])), &[ln1]));
    v.push(with_model(
        base,
        "checkpoint/range-beyond",
        entry(ln1, |e| e["data_offsets"] = json!([1u64 << 40, (1u64 << 40) + 256])),
        &[ln1],
    ));
    v.push(with_model(base, "checkpoint/negative-offset", entry(ln1, |e| e["data_offsets"] = json!([-4, 252])), &[ln1]));
    v.push(with_model(base, "checkpoint/size-mismatch", entry(ln1, |e| e["shape"] = json!([63])), &[ln1, "needs 252 bytes"]));
    v.push(with_model(
        base,
        "checkpoint/dtype-i64",
        entry(ln1, |e| {
            e["dtype"] = json!("I64");
            e["shape"] = json!([32]);
        }),
        &[ln1, "I64"],
    ));
    v.push(with_model(base, "checkpoint/dtype-unknown", entry(ln1, |e| e["dtype"] = json!("F12")), &[ln1, "F12"]));
    v.push(with_model(base, "checkpoint/dtype-number", entry(ln1, |e| e["dtype"] = json!(4)), &[ln1]));
    v.push(with_model(base, "checkpoint/shape-string", entry(ln1, |e| e["shape"] = json!("64")), &[ln1]));
    v.push(with_model(base, "checkpoint/rank-5", entry(ln1, |e| e["shape"] = json!([1, 1, 1, 1, 64])), &[ln1]));
    v.push(with_model(base, "checkpoint/dim-overflow", entry(ln1, |e| e["shape"] = json!([u64::MAX, 2])), &[ln1]));
    v.push(with_model(base, "checkpoint/unknown-field", entry(ln1, |e| e["extra"] = json!(1)), &[ln1, "extra"]));
    v.push(with_model(
        base,
        "checkpoint/missing-offsets",
        entry(ln1, |e| {
            e.as_object_mut().unwrap().remove("data_offsets");
        }),
        &[ln1],
    ));
    v.push(with_model(
        base,
        "checkpoint/missing-tensor",
        edited(base, |h, _| {
            let e = h.remove("transformer.h.1.ln_2.bias").unwrap();
            h.insert("transformer.h.1.attn.bias".into(), e);
        }),
        &["transformer.h.1.ln_2.bias", "missing"],
    ));
    v.push(with_model(
        base,
        "checkpoint/wrong-layer-shape",
        entry("transformer.h.1.mlp.c_fc.weight", |e| e["shape"] = json!([128, 128])),
        &["transformer.h.1.mlp.c_fc.weight", "[128, 128]"],
    ));
    v.push(with_model(
        base,
        "checkpoint/duplicate-prefixed",
        edited(base, |h, _| {
            let e = h["transformer.h.0.ln_1.bias"].clone();
            h.insert("h.0.ln_1.bias".into(), e);
        }),
        &["ln_1.bias"],
    ));
    // configs beside the model
    let cfg = |f: fn(&mut Value)| {
        let mut c: Value = serde_json::from_slice(&std::fs::read(base.model().with_file_name("config.json")).unwrap()).unwrap();
        f(&mut c);
        c.to_string().into_bytes()
    };
    let with_config = |name: &str, bytes: Vec<u8>, culprit: &[&str]| {
        let tokens = s(&base.tokens());
        Case::refused(name, &["eval", "m/model.safetensors", "--data", &tokens, "--batch", "2", "--seq", "8"], culprit)
            .file("m/model.safetensors", model.clone())
            .file("m/config.json", bytes)
    };
    v.push(with_config("config/not-json", b"{n_layer: 2".to_vec(), &["m/config.json"]));
    v.push(with_config("config/not-utf8", vec![b'{', 0xff, b'}'], &["m/config.json", "invalid UTF-8 at byte 1"]));
    v.push(with_config("config/array", b"[]".to_vec(), &["m/config.json"]));
    v.push(with_config("config/n-head-not-dividing", cfg(|c| c["n_head"] = json!(5)), &["m/config.json", "n_head"]));
    v.push(with_config(
        "config/n-embd-disagrees",
        cfg(|c| c["n_embd"] = json!(32)),
        &["transformer.wte.weight", "the model config needs [97, 32]"],
    ));
    v.push(with_config("config/n-layer-too-many", cfg(|c| c["n_layer"] = json!(3)), &["h.2"]));
    v.push(with_config("config/n-layer-string", cfg(|c| c["n_layer"] = json!("2")), &["m/config.json", "n_layer"]));
    v.push(with_config("config/vocab-disagrees", cfg(|c| c["vocab_size"] = json!(50257)), &["wte"]));
    v.push(with_config("config/n-positions-zero", cfg(|c| c["n_positions"] = json!(0)), &["m/config.json"]));
    v.push(with_config("config/eps-negative", cfg(|c| c["layer_norm_epsilon"] = json!(-1.0)), &["m/config.json", "layer_norm_epsilon"]));
    // paths that are no checkpoint
    let tokens = s(&base.tokens());
    v.push(Case::refused(
        "checkpoint/missing-file",
        &["eval", "nope.safetensors", "--data", &tokens],
        &["nope.safetensors", "No such file"],
    ));
    v.push(Case::refused("checkpoint/directory", &["eval", "d", "--data", &tokens], &["d: "]).dir("d"));
    v
}
