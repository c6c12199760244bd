use std::path::{Path, PathBuf};

use qatc_ir::DType;
use serde_json::{json, Value};

use super::*;
use crate::frontend::checkpoint::write_synthetic;

fn tiny() -> Gpt2Config {
    Gpt2Config { n_embd: 64, n_layer: 2, n_head: 4, n_positions: 32, vocab_size: 97, layer_norm_epsilon: 1e-5 }
}

/// Rewrites a safetensors file's header and data through `edit`.
fn edit_file(p: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>, &mut Vec<u8>)) {
    let b = std::fs::read(p).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let mut h: Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let mut data = b[8 + n..].to_vec();
    edit(h.as_object_mut().unwrap(), &mut data);
    let h = h.to_string();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(&data);
    std::fs::write(p, out).unwrap();
}

fn edit_header(p: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    edit_file(p, |h, _| edit(h));
}

fn synthetic(dir: &Path, cfg: &Gpt2Config, prefix: bool) -> PathBuf {
    let p = dir.join("model.safetensors");
    write_synthetic(&p, cfg, DType::F32, prefix, 3).unwrap();
    p
}

fn validate_err(p: &Path) -> String {
    let c = Checkpoint::open(p).unwrap();
    let (cfg, _, _) = Gpt2Config::load(&c).unwrap();
    let e = cfg.validate(&c).unwrap_err().to_string();
    assert!(e.starts_with(&format!("{}: ", p.display())), "{e}");
    assert!(!e.contains('\n'));
    e
}

#[test]
fn presets_match_the_published_parameter_counts() {
    let counts = [("124M", 124_439_808), ("355M", 354_823_168), ("774M", 774_030_080), ("1.5B", 1_557_611_200)];
    for (name, n) in counts {
        let c = Gpt2Config::preset(name).unwrap();
        assert_eq!(c.param_count(), n, "{name}");
        assert_eq!(c.head_size(), 64);
        let listed: usize = c.expected_tensors().iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        assert_eq!(listed, n);
    }
    assert_eq!(Gpt2Config::preset("gpt2-xl"), Gpt2Config::preset("1.5B"));
    assert!(Gpt2Config::preset("7B").is_none());
}

#[test]
fn loads_config_json() {
    let dir = tempfile::tempdir().unwrap();
    let p = synthetic(dir.path(), &tiny(), true);
    let c = Checkpoint::open(&p).unwrap();
    let (cfg, src, notice) = Gpt2Config::load(&c).unwrap();
    assert_eq!(cfg, tiny());
    assert_eq!(src, ConfigSource::File(dir.path().join("config.json")));
    assert!(notice.is_none());
    cfg.validate(&c).unwrap();
    // The written config carries the keys llama.cpp's converter needs.
    let v: Value = serde_json::from_slice(&std::fs::read(dir.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(v["n_ctx"], 32);
    assert_eq!(v["architectures"][0], "GPT2LMHeadModel");
}

#[test]
fn infers_without_config_json() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = Gpt2Config { n_embd: 128, n_head: 2, ..tiny() };
    let p = synthetic(dir.path(), &cfg, false);
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    let c = Checkpoint::open(&p).unwrap();
    let (got, src, notice) = Gpt2Config::load(&c).unwrap();
    assert_eq!(got, cfg);
    assert_eq!(src, ConfigSource::Inferred);
    let notice = notice.unwrap();
    assert!(notice.ends_with("model.safetensors: inferred 2 layers, n_embd 128, 2 heads (head dim 64)"), "{notice}");
    got.validate(&c).unwrap();

    // n_embd 64 x 1 head is inferable too; 96 is not a multiple of 64.
    let cfg = Gpt2Config { n_embd: 96, n_head: 3, ..tiny() };
    let p = synthetic(dir.path(), &cfg, false);
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    let e = Gpt2Config::load(&Checkpoint::open(&p).unwrap()).unwrap_err().to_string();
    assert!(e.contains("cannot infer n_head: n_embd 96"), "{e}");
}

#[test]
fn config_json_aliases_and_defaults() {
    let p = Path::new("config.json");
    let text = json!({ "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "max_position_embeddings": 32, "n_ctx": 999, "vocab_size": 97 });
    assert_eq!(Gpt2Config::from_json(p, text.to_string().as_bytes()).unwrap(), tiny());
    let d = Gpt2Config::from_json(p, b"{}").unwrap();
    assert_eq!(d, Gpt2Config::preset("124M").unwrap());
    let c = Gpt2Config::from_json(p, br#"{"layer_norm_epsilon": 1e-6, "n_ctx": 64}"#).unwrap();
    assert_eq!((c.layer_norm_epsilon, c.n_positions), (1e-6, 64));
}

#[test]
fn bad_config_json() {
    let p = Path::new("dir/config.json");
    let err = |s: &str| {
        let e = Gpt2Config::from_json(p, s.as_bytes()).unwrap_err().to_string();
        assert!(e.starts_with("dir/config.json: "), "{e}");
        e
    };
    assert!(err("{").contains("not valid JSON"));
    assert!(err("[]").contains("not a JSON object"));
    assert!(err(r#"{"n_embd": 0}"#).contains("n_embd is 0"));
    assert!(err(r#"{"n_layer": -1}"#).contains("n_layer is -1"));
    assert!(err(r#"{"n_head": "12"}"#).contains("n_head is \"12\""));
    assert!(err(r#"{"n_embd": 100, "n_head": 12}"#).contains("not divisible"));
    assert!(err(r#"{"layer_norm_epsilon": 0}"#).contains("layer_norm_epsilon"));
    assert!(err(r#"{"model_type": "llama"}"#).contains("model_type"));
    assert!(err(r#"{"activation_function": "relu"}"#).contains("relu"));
    assert!(err(r#"{"n_inner": 100}"#).contains("n_inner"));
    assert!(err(r#"{"scale_attn_by_inverse_layer_idx": true}"#).contains("inverse_layer_idx"));
    assert!(Gpt2Config::from_json(p, br#"{"n_inner": null, "activation_function": "gelu_pytorch_tanh"}"#).is_ok());
}

#[test]
fn missing_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let p = synthetic(dir.path(), &tiny(), true);
    edit_header(&p, |h| {
        // Turn it into a skipped buffer so the layout stays valid.
        let e = h.remove("transformer.h.1.ln_2.bias").unwrap();
        h.insert("transformer.h.9.attn.bias".into(), e);
    });
    let e = validate_err(&p);
    assert!(e.ends_with("tensor \"transformer.h.1.ln_2.bias\" is missing"), "{e}");
}

#[test]
fn shapes_inconsistent_across_layers() {
    let dir = tempfile::tempdir().unwrap();
    let p = synthetic(dir.path(), &tiny(), false);
    // Same bytes, other shape: h.1's MLP now claims to be 128 wide where h.0's is 256.
    edit_header(&p, |h| h["h.1.mlp.c_fc.weight"]["shape"] = json!([128, 128]));
    let e = validate_err(&p);
    assert!(e.ends_with("tensor \"h.1.mlp.c_fc.weight\": shape [128, 128] but the model config needs [64, 256]"), "{e}");
}

#[test]
fn config_disagrees_with_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = synthetic(dir.path(), &tiny(), false);
    let c = Checkpoint::open(&p).unwrap();
    let e = Gpt2Config { n_positions: 64, ..tiny() }.validate(&c).unwrap_err().to_string();
    assert!(e.contains("\"wpe.weight\": shape [32, 64] but the model config needs [64, 64]"), "{e}");
    let e = Gpt2Config { n_layer: 1, ..tiny() }.validate(&c).unwrap_err().to_string();
    assert!(e.contains("beyond the config's n_layer 1"), "{e}");
    let e = Gpt2Config { n_layer: 1 << 31, ..tiny() }.validate(&c).unwrap_err().to_string();
    assert!(e.contains("\"h.2.ln_1.weight\" is missing"), "{e}");
    let e = Gpt2Config { n_head: 3, ..tiny() }.validate(&c).unwrap_err().to_string();
    assert!(e.contains("not divisible by n_head 3"), "{e}");
}

#[test]
fn lm_head_is_optional_but_checked() {
    let dir = tempfile::tempdir().unwrap();
    for (rows, ok) in [(97, true), (96, false)] {
        let p = synthetic(dir.path(), &tiny(), false);
        edit_file(&p, |h, data| {
            let at = data.len();
            data.extend(std::iter::repeat_n(0u8, rows * 64 * 4));
            h.insert("lm_head.weight".into(), json!({"dtype": "F32", "shape": [rows, 64], "data_offsets": [at, data.len()]}));
        });
        let c = Checkpoint::open(&p).unwrap();
        assert!(c.names().contains(&"lm_head.weight"));
        let r = tiny().validate(&c);
        if ok {
            r.unwrap();
        } else {
            let e = r.unwrap_err().to_string();
            assert!(e.ends_with("tensor \"lm_head.weight\": shape [96, 64] but the model config needs [97, 64]"), "{e}");
        }
    }
}

#[test]
fn inferred_layer_count_from_a_hostile_name_does_not_allocate() {
    let dir = tempfile::tempdir().unwrap();
    let p = synthetic(dir.path(), &tiny(), false);
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    edit_header(&p, |h| {
        let e = h.remove("h.1.ln_2.bias").unwrap();
        h.insert("h.999999999999.ln_2.bias".into(), e);
    });
    let c = Checkpoint::open(&p).unwrap();
    let (cfg, _, _) = Gpt2Config::load(&c).unwrap();
    assert_eq!(cfg.n_layer, 1_000_000_000_000);
    assert!(cfg.validate(&c).unwrap_err().to_string().contains("\"h.1.ln_2.bias\" is missing"));
}

/// The end-of-text tokens as transformers' `generate` finds them: generation_config.json over
/// config.json over GPT-2's 50256; null for none, lists kept, ids past the vocabulary dropped.
#[test]
fn eos_tokens_as_transformers_finds_them() {
    let dir = tempfile::tempdir().unwrap();
    let p = synthetic(dir.path(), &tiny(), false);
    let c = Checkpoint::open(&p).unwrap();
    let write = |name: &str, v: Value| std::fs::write(dir.path().join(name), v.to_string()).unwrap();
    assert_eq!(eos_tokens(&c, 50257).unwrap(), [50256], "the config written has no eos_token_id");
    assert!(eos_tokens(&c, 97).unwrap().is_empty(), "50256 is past a vocabulary of 97");
    write("config.json", json!({"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 32, "vocab_size": 97, "eos_token_id": 96}));
    assert_eq!(eos_tokens(&c, 97).unwrap(), [96]);
    write("generation_config.json", json!({"eos_token_id": [3, 7, 500]}));
    assert_eq!(eos_tokens(&c, 97).unwrap(), [3, 7]);
    write("generation_config.json", json!({"eos_token_id": null}));
    assert!(eos_tokens(&c, 97).unwrap().is_empty());
    write("generation_config.json", json!({"eos_token_id": "end"}));
    let e = eos_tokens(&c, 97).unwrap_err().to_string();
    assert!(e.contains("generation_config.json") && e.contains("eos_token_id"), "{e}");
}
