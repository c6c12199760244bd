//! Every validation case of `Checkpoint::open`, on files written byte by byte.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::*;
use crate::frontend::config::Gpt2Config;

/// A file of `header` (JSON text, written as is) and `data`.
fn raw_file(dir: &Path, header: &str, data: &[u8]) -> PathBuf {
    let p = dir.join("model.safetensors");
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.extend_from_slice(data);
    std::fs::write(&p, b).unwrap();
    p
}

fn entry(dtype: &str, shape: &[usize], begin: usize, end: usize) -> Value {
    json!({ "dtype": dtype, "shape": shape, "data_offsets": [begin, end] })
}

fn open_err(header: &str, data: &[u8]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let p = raw_file(dir.path(), header, data);
    let e = Checkpoint::open(&p).unwrap_err().to_string();
    assert!(e.contains("model.safetensors: "), "{e}");
    assert!(!e.contains('\n'), "{e}");
    e
}

fn tiny() -> Gpt2Config {
    Gpt2Config { n_embd: 64, n_layer: 2, n_head: 4, n_positions: 32, vocab_size: 97, layer_norm_epsilon: 1e-5 }
}

#[test]
fn missing_file() {
    let e = Checkpoint::open(Path::new("/nonexistent/qatc/model.safetensors")).unwrap_err();
    assert!(matches!(e, LoadError::Io { .. }));
    assert!(e.to_string().starts_with("/nonexistent/qatc/model.safetensors: "), "{e}");
}

#[test]
fn not_safetensors_text() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("model.safetensors");
    std::fs::write(&p, "This is a README, not a model.\nIt has several lines of text.\n").unwrap();
    let e = Checkpoint::open(&p).unwrap_err().to_string();
    assert!(e.contains("model.safetensors: not a safetensors file (or not a GPT-2 one): header length"), "{e}");
}

#[test]
fn shorter_than_eight_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("model.safetensors");
    std::fs::write(&p, b"abc").unwrap();
    let e = Checkpoint::open(&p).unwrap_err().to_string();
    assert!(e.contains("not a safetensors file: 3 bytes"), "{e}");
    std::fs::write(&p, b"").unwrap();
    assert!(Checkpoint::open(&p).unwrap_err().to_string().contains("0 bytes"));
}

#[test]
fn a_directory() {
    let dir = tempfile::tempdir().unwrap();
    let e = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(e.contains("a directory without a checkpoint (looked for model.safetensors"), "{e}");
}

#[test]
fn header_not_json() {
    assert!(open_err("{\"a\": ", b"").contains("not a JSON object"));
    assert!(open_err("[1, 2]", b"").contains("not a JSON object"));
    // NUL padding is not JSON whitespace.
    assert!(open_err("{}\0\0", b"").contains("not a JSON object"));
}

#[test]
fn header_not_utf8() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("model.safetensors");
    let mut b = 4u64.to_le_bytes().to_vec();
    b.extend_from_slice(&[b'{', 0xff, 0xfe, b'}']);
    std::fs::write(&p, b).unwrap();
    assert!(Checkpoint::open(&p).unwrap_err().to_string().contains("not UTF-8"));
}

#[test]
fn header_length_beyond_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("model.safetensors");
    let mut b = 500u64.to_le_bytes().to_vec();
    b.extend_from_slice(b"{}");
    std::fs::write(&p, b).unwrap();
    let e = Checkpoint::open(&p).unwrap_err().to_string();
    assert!(e.contains("header length 500 beyond the file") && e.contains("has 10"), "{e}");
}

#[test]
fn header_too_large() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("model.safetensors");
    std::fs::write(&p, (u64::MAX).to_le_bytes()).unwrap();
    assert!(matches!(Checkpoint::open(&p), Err(LoadError::HeaderTooLarge { .. })));
}

#[test]
fn empty_header() {
    assert!(open_err("{}", b"").contains("lists no tensors"));
    assert!(open_err(r#"{"__metadata__": {"format": "pt"}}"#, b"").contains("lists no tensors"));
    // Only buffers: nothing a model could use.
    let h = json!({ "h.0.attn.bias": entry("BOOL", &[1, 1, 2, 2], 0, 4) });
    assert!(open_err(&h.to_string(), &[1; 4]).contains("lists no tensors"));
}

#[test]
fn bad_metadata() {
    let h = json!({ "__metadata__": { "n": 3 }, "a": entry("F32", &[1], 0, 4) });
    assert!(open_err(&h.to_string(), &[0; 4]).contains("__metadata__ must map strings to strings"));
}

#[test]
fn too_many_tensors() {
    let mut m = serde_json::Map::new();
    for i in 0..=MAX_TENSORS {
        m.insert(format!("t{i}"), entry("F32", &[1], 4 * i, 4 * i + 4));
    }
    let data = vec![0u8; 4 * (MAX_TENSORS + 1)];
    assert!(open_err(&Value::Object(m).to_string(), &data).contains("4097 tensors, over the limit of 4096"));
}

#[test]
fn truncated_data() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("model.safetensors");
    write_synthetic(&p, &tiny(), DType::F32, false, 1).unwrap();
    let len = std::fs::metadata(&p).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(len - 10).unwrap();
    let e = Checkpoint::open(&p).unwrap_err().to_string();
    // Sorted keys put wte.weight last in the data section.
    assert!(e.contains("tensor \"wte.weight\": byte range") && e.contains("is cut by the end of the data section"), "{e}");
}

#[test]
fn overlapping_offsets() {
    let h = json!({ "a": entry("F32", &[4], 0, 16), "b": entry("F32", &[4], 8, 24) });
    let e = open_err(&h.to_string(), &[0; 24]);
    assert!(e.contains("tensor \"b\": byte range [8, 24) overlaps \"a\""), "{e}");
    // Two names over one range: aliasing, which the format does not allow.
    let h = json!({ "a": entry("F32", &[4], 0, 16), "b": entry("F32", &[2, 2], 0, 16) });
    assert!(open_err(&h.to_string(), &[0; 16]).contains("overlaps"));
}

#[test]
fn out_of_range_offsets() {
    let h = json!({ "a": entry("F32", &[4], 0, 16), "b": entry("F32", &[4], 100, 116) });
    let e = open_err(&h.to_string(), &[0; 20]);
    assert!(e.contains("tensor \"b\": byte range [100, 116) lies beyond the end of the data section (20 bytes)"), "{e}");
    let h = json!({ "a": entry("F32", &[1], 8, 4) });
    assert!(open_err(&h.to_string(), &[0; 8]).contains("end before they begin"));
    let h = r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}"#;
    assert!(open_err(h, &[0; 4]).contains("not two non-negative integers"));
    let h = r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 18446744073709551620]}}"#;
    assert!(open_err(h, &[0; 4]).contains("tensor \"a\""));
}

#[test]
fn size_mismatch() {
    let h = json!({ "h.0.attn.c_attn.weight": entry("F32", &[64, 191], 0, 48000) });
    let e = open_err(&h.to_string(), &vec![0; 48000]);
    assert!(
        e.ends_with(
            "model.safetensors: tensor \"h.0.attn.c_attn.weight\": shape [64, 191] x f32 needs 48896 bytes but its range holds 48000"
        ),
        "{e}"
    );
}

#[test]
fn huge_shapes_do_not_overflow() {
    let h = json!({ "a": entry("F32", &[1 << 31, 1 << 31, 1 << 31, 1 << 31], 0, 4) });
    assert!(open_err(&h.to_string(), &[0; 4]).contains("needs 85070591730234615865843651857942052864 bytes"));
    let h = json!({ "a": entry("F32", &[(1 << 31) + 1], 0, 4) });
    assert!(open_err(&h.to_string(), &[0; 4]).contains("over the limit of 2^31"));
    let h = json!({ "a": entry("F32", &[1, 1, 1, 1, 1], 0, 4) });
    assert!(open_err(&h.to_string(), &[0; 4]).contains("rank 5 is over the limit of 4"));
    // Zero elements are fine for the size rule however large the other dims are.
    let h = json!({ "a": entry("F32", &[0, 1 << 31], 0, 0), "b": entry("F32", &[1], 0, 4) });
    assert!(open_err(&h.to_string(), &[0; 4]).contains("aliases"));
}

#[test]
fn unsupported_dtype() {
    let h = json!({ "wte.weight": entry("I64", &[2], 0, 16) });
    let e = open_err(&h.to_string(), &[0; 16]);
    assert!(e.contains("tensor \"wte.weight\": dtype I64 is not supported"), "{e}");
    let h = json!({ "wte.weight": entry("F64", &[2], 0, 16) });
    assert!(open_err(&h.to_string(), &[0; 16]).contains("dtype F64"));
    let h = json!({ "h.0.attn.bias": entry("Q4_K", &[2], 0, 16) });
    assert!(open_err(&h.to_string(), &[0; 16]).contains("dtype Q4_K"));
}

#[test]
fn schema_errors_name_the_tensor() {
    let h = r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "extra": 1}}"#;
    assert!(open_err(h, &[0; 4]).contains("tensor \"a\": unknown field \"extra\""));
    let h = r#"{"a": {"dtype": "F32", "data_offsets": [0, 4]}}"#;
    assert!(open_err(h, &[0; 4]).contains("tensor \"a\": missing field \"shape\""));
    let h = r#"{"": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}"#;
    assert!(open_err(h, &[0; 4]).contains("empty name"));
    let h = r#"{"a": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}"#;
    assert!(open_err(h, &[0; 4]).contains("not a non-negative integer"));
    let h = r#"{"a": 3}"#;
    assert!(open_err(h, &[0; 4]).contains("not an object"));
}

#[test]
fn duplicate_key() {
    let h = r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}"#;
    assert!(open_err(h, &[0; 4]).contains("tensor \"a\" is listed twice"));
    // The same tensor with and without the prefix.
    let h = json!({ "wte.weight": entry("F32", &[1], 0, 4), "transformer.wte.weight": entry("F32", &[1], 4, 8) });
    assert!(open_err(&h.to_string(), &[0; 8]).contains("is listed twice"));
}

#[test]
fn trailing_bytes() {
    let h = json!({ "a": entry("F32", &[1], 0, 4) });
    assert!(open_err(&h.to_string(), &[0; 6]).contains("2 bytes after the last tensor"));
}

#[test]
fn gaps_are_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let h = json!({ "a": entry("F32", &[1], 0, 4), "b": entry("F32", &[1], 8, 12) });
    let p = raw_file(dir.path(), &h.to_string(), &[0; 12]);
    assert_eq!(Checkpoint::open(&p).unwrap().names(), ["a", "b"]);
}

#[test]
fn buffers_are_skipped() {
    let dir = tempfile::tempdir().unwrap();
    // Leading spaces and space padding are both JSON whitespace.
    let h = format!(
        "  {}    ",
        json!({
            "__metadata__": { "format": "pt" },
            "transformer.h.0.attn.bias": entry("BOOL", &[1, 1, 2, 2], 0, 4),
            "transformer.h.1.attn.bias": entry("U8", &[1, 1, 2, 2], 4, 8),
            "transformer.h.0.attn.masked_bias": entry("F32", &[], 8, 12),
            "transformer.h.0.attn.c_attn.bias": entry("F32", &[1], 12, 16),
            // A zero-size buffer may share an offset with a real tensor.
            "transformer.h.2.attn.bias": entry("I64", &[0], 12, 12),
        })
    );
    let p = raw_file(dir.path(), &h, &[0; 16]);
    let c = Checkpoint::open(&p).unwrap();
    assert_eq!(c.names(), ["h.0.attn.c_attn.bias"]);
    assert!(c.has_prefix());
    assert_eq!(c.info("h.0.attn.c_attn.bias").unwrap().key, "transformer.h.0.attn.c_attn.bias");
    assert_eq!(c.stored_bytes(), 4);
    assert!(c.info("h.0.attn.bias").is_none());
}

#[test]
fn prefixed_and_unprefixed_names() {
    let dir = tempfile::tempdir().unwrap();
    for prefix in [false, true] {
        let p = dir.path().join(format!("m{prefix}.safetensors"));
        write_synthetic(&p, &tiny(), DType::F32, prefix, 7).unwrap();
        let c = Checkpoint::open(&p).unwrap();
        assert_eq!(c.has_prefix(), prefix);
        assert_eq!(c.names().len(), 4 + 12 * 2);
        assert!(c.names().windows(2).all(|w| w[0] < w[1]));
        assert!(c.names().contains(&"h.1.mlp.c_fc.weight"));
        assert!(!c.names().contains(&"lm_head.weight"));
        let key = &c.info("wte.weight").unwrap().key;
        assert_eq!(key, if prefix { "transformer.wte.weight" } else { "wte.weight" });
        // Only one `transformer.` is stripped.
        assert_eq!(c.key_of("nope"), if prefix { "transformer.nope" } else { "nope" });
    }
    let h = json!({ "transformer.transformer.wte.weight": entry("F32", &[1], 0, 4) });
    let p = raw_file(dir.path(), &h.to_string(), &[0; 4]);
    assert_eq!(Checkpoint::open(&p).unwrap().names(), ["transformer.wte.weight"]);
}

#[test]
fn half_conversions_are_exact() {
    let dir = tempfile::tempdir().unwrap();
    let vals = [0.0f32, -0.0, 1.0, -2.5, 0.1, 65504.0, 6.1e-5, 1e-7, f32::INFINITY];
    let mut data = Vec::new();
    for v in vals {
        data.extend_from_slice(&half::f16::from_f32(v).to_le_bytes());
    }
    for v in vals {
        data.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes());
    }
    for v in vals {
        data.extend_from_slice(&v.to_le_bytes());
    }
    let n = vals.len();
    let h = json!({
        "a": entry("F16", &[n], 0, 2 * n),
        "b": entry("BF16", &[n], 2 * n, 4 * n),
        "c": entry("F32", &[n], 4 * n, 8 * n),
    });
    let p = raw_file(dir.path(), &h.to_string(), &data);
    let c = Checkpoint::open(&p).unwrap();
    let want_h: Vec<f32> = vals.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
    let want_b: Vec<f32> = vals.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
    assert_eq!(c.to_f32("a").unwrap(), want_h);
    assert_eq!(c.to_f32("b").unwrap(), want_b);
    assert_eq!(c.to_f32("c").unwrap(), vals);
    assert_eq!(c.to_f64("a").unwrap(), want_h.iter().map(|&v| v as f64).collect::<Vec<_>>());
    assert_eq!(c.raw_bytes("b").unwrap(), &data[2 * n..4 * n]);
    assert_eq!(c.info("b").unwrap().dtype, DType::BF16);
    let e = c.to_f32("d").unwrap_err().to_string();
    assert!(e.ends_with("tensor \"d\" is missing"), "{e}");
}

#[test]
fn synthetic_roundtrip() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let p = dir.path().join(format!("{dtype}.safetensors"));
        write_synthetic(&p, &cfg, dtype, true, 42).unwrap();
        let c = Checkpoint::open(&p).unwrap();
        cfg.validate(&c).unwrap();
        assert_eq!(c.stored_bytes(), dtype.bytes_for(cfg.param_count()));
        let ln = c.to_f32("h.1.ln_2.weight").unwrap();
        assert!(ln.iter().all(|&x| (x - 1.0).abs() < 0.1), "{ln:?}");
        let w = c.to_f32("h.0.mlp.c_fc.weight").unwrap();
        let std = (w.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / w.len() as f64).sqrt();
        assert!((0.015..0.025).contains(&std), "{std}");
        // Deterministic in the seed.
        let q = dir.path().join("again.safetensors");
        write_synthetic(&q, &cfg, dtype, true, 42).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), std::fs::read(&q).unwrap());
    }
    // Only the models and one config.json: no temp files left behind.
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 5, "{names:?}");
    assert!(write_synthetic(&dir.path().join("x"), &cfg, DType::I32, false, 0).is_err());
}

#[test]
fn shakespeare_fixture() {
    let p = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/gpt2-shakespeare-small/model.safetensors"));
    let c = Checkpoint::open(p).unwrap();
    assert!(c.has_prefix());
    assert_eq!(c.names().len(), 4 + 12 * 4);
    assert!(c.names().iter().all(|n| c.info(n).unwrap().dtype == DType::F16));
    assert_eq!(c.stored_bytes(), 2 * 7_259_008);
    let (cfg, src, notice) = Gpt2Config::load(&c).unwrap();
    assert!(matches!(src, crate::frontend::config::ConfigSource::File(_)));
    assert!(notice.is_none());
    assert_eq!((cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_positions, cfg.vocab_size), (4, 128, 4, 256, 50257));
    cfg.validate(&c).unwrap();
    assert_eq!(cfg.param_count(), 7_259_008);
    assert!(c.to_f32("wte.weight").unwrap().iter().all(|x| x.is_finite()));
}
