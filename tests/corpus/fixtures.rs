//! The valid inputs every case starts from, made once per run in a shared directory (`base`):
//! a tiny synthetic GPT-2 (2 layers, n_embd 64, 4 heads, n_positions 32, vocab 97) with its
//! config.json, a token file, a PEFT adapter for it, a bit map, and a finished training run
//! (adapter, resume state) made by the real binary. Cases copy what they corrupt.

use std::path::{Path, PathBuf};
use std::process::Command;

use qatc::data::TokenFile;
use qatc::frontend::checkpoint::write_synthetic;
use qatc::frontend::config::Gpt2Config;
use qatc_ir::DType;
use qatc_passes::lora::LoraOptions;
use serde_json::{json, Map, Value};

pub fn tiny() -> Gpt2Config {
    Gpt2Config { n_embd: 64, n_layer: 2, n_head: 4, n_positions: 32, vocab_size: 97, layer_norm_epsilon: 1e-5 }
}

/// Paths of the shared valid inputs.
pub struct Base {
    pub dir: PathBuf,
}

impl Base {
    pub fn model(&self) -> PathBuf {
        self.dir.join("model/model.safetensors")
    }
    pub fn tokens(&self) -> PathBuf {
        self.dir.join("tokens.bin")
    }
    pub fn adapter(&self) -> PathBuf {
        self.dir.join("adapter")
    }
    pub fn bits(&self) -> PathBuf {
        self.dir.join("bits.json")
    }
    /// A finished `qatc train` output: adapter, configuration and resume state.
    pub fn run(&self) -> PathBuf {
        self.dir.join("run")
    }
    pub fn s(p: &Path) -> String {
        p.display().to_string()
    }
}

/// The arguments of the training run `Base::run` holds (a resume must repeat them).
pub fn train_args(model: &str, tokens: &str, out: &str) -> Vec<String> {
    let v = [
        "train",
        model,
        "--data",
        tokens,
        "--batch",
        "2",
        "--seq",
        "8",
        "--lora",
        "r=2",
        "--steps",
        "2",
        "--save-every",
        "1",
        "--interpreter",
        "--out",
        out,
    ];
    v.iter().map(|s| s.to_string()).collect()
}

pub fn make(dir: &Path) -> Base {
    let base = Base { dir: dir.to_path_buf() };
    std::fs::create_dir_all(dir.join("model")).unwrap();
    write_synthetic(&base.model(), &tiny(), DType::F32, true, 5).unwrap();
    let tokens: Vec<u16> = (0..400u16).map(|i| (i * 7 + 3) % 97).collect();
    TokenFile::write(&base.tokens(), &tokens).unwrap();
    write_adapter(&base.adapter(), &adapter_config(), &adapter_tensors());
    std::fs::write(base.bits(), bit_map(json!({"h.0.attn.c_attn": {"bits": 4, "group": 32, "scheme": "sym"}, "h.1.mlp.c_fc": null})))
        .unwrap();
    let args = train_args(&Base::s(&base.model()), &Base::s(&base.tokens()), &Base::s(&base.run()));
    let r = Command::new(env!("CARGO_BIN_EXE_qatc")).args(&args).output().unwrap();
    assert!(r.status.success(), "the base training run failed: {}", String::from_utf8_lossy(&r.stderr));
    base
}

/// The adapter's settings: PEFT's keys, r = 2 on c_attn.
pub fn adapter_config() -> Map<String, Value> {
    let mut o = LoraOptions::new(2);
    o.targets = vec!["c_attn".into()];
    let (cfg, _) = qatc::adapter::to_files(&o, &[], "model").unwrap();
    serde_json::from_str::<Value>(&cfg).unwrap().as_object().unwrap().clone()
}

/// The adapter's tensors: (PEFT key, shape, values) for both layers' c_attn.
pub fn adapter_tensors() -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut v = Vec::new();
    for l in 0..2 {
        let m = format!("base_model.model.transformer.h.{l}.attn.c_attn");
        v.push((format!("{m}.lora_A.weight"), vec![2, 64], (0..128).map(|i| (i as f32 * 0.01).sin() * 0.1).collect()));
        v.push((format!("{m}.lora_B.weight"), vec![192, 2], (0..384).map(|i| (i as f32 * 0.02).cos() * 0.01).collect()));
    }
    v
}

pub fn safetensors(tensors: &[(String, Vec<usize>, Vec<f32>)]) -> Vec<u8> {
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> =
        tensors.iter().map(|(n, s, d)| (n.clone(), d.iter().flat_map(|v| v.to_le_bytes()).collect(), s.clone())).collect();
    let views =
        bytes.iter().map(|(n, b, s)| (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap()));
    safetensors::serialize(views, None).unwrap()
}

pub fn write_adapter(dir: &Path, cfg: &Map<String, Value>, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("adapter_config.json"), serde_json::to_string_pretty(cfg).unwrap()).unwrap();
    std::fs::write(dir.join("adapter_model.safetensors"), safetensors(tensors)).unwrap();
}

/// The adapter's two files, with the config edited and the tensors given.
pub fn adapter_files(edit: impl FnOnce(&mut Map<String, Value>), tensors: &[(String, Vec<usize>, Vec<f32>)]) -> Vec<(String, Vec<u8>)> {
    let mut cfg = adapter_config();
    edit(&mut cfg);
    vec![
        ("ad/adapter_config.json".into(), serde_json::to_string_pretty(&cfg).unwrap().into_bytes()),
        ("ad/adapter_model.safetensors".into(), safetensors(tensors)),
    ]
}

pub fn bit_map(modules: Value) -> String {
    json!({"version": 1, "modules": modules}).to_string()
}

/// A safetensors file's header and data, to edit and put back together.
pub fn split(b: &[u8]) -> (Map<String, Value>, Vec<u8>) {
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let h: Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    (h.as_object().unwrap().clone(), b[8 + n..].to_vec())
}

pub fn join(h: &Map<String, Value>, data: &[u8]) -> Vec<u8> {
    let h = serde_json::to_string(h).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(data);
    out
}

/// The byte offset in the data section of element `i` of tensor `key` (f32).
pub fn element(h: &Map<String, Value>, key: &str, i: usize) -> usize {
    h[key]["data_offsets"][0].as_u64().unwrap() as usize + 4 * i
}
