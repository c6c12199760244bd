//! LoRA adapters in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`), and the
//! initialisation of fresh ones. qatc's input names are PEFT's keys without the
//! `base_model.model.transformer.` prefix: `h.0.attn.c_attn.lora_A.weight` [r, in] and
//! `...lora_B.weight` [out, r].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use qatc_passes::lora::LoraOptions;
use qatc_passes::quant::is_learned_name;
use qatc_runtime::Tensor;
use serde_json::json;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum AdapterError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {why}")]
    Invalid { path: PathBuf, why: String },
}

const KEY_PREFIX: &str = "base_model.model.transformer.";

/// The file beside a PEFT adapter that holds learned quantization scales and zero points
/// (`--scales learned`), by qatc input name (`h.0.attn.c_attn.weight.scales`), f32: the values
/// training ended with, which the fake-quant rounds to fp16 where it uses them.
pub const QUANT_FILE: &str = "quant_scales.safetensors";

/// An adapter: its settings and tensors by qatc name.
#[derive(Clone, Debug)]
pub struct Adapter {
    pub r: usize,
    pub alpha: f64,
    pub dropout: f64,
    pub rslora: bool,
    pub target_modules: Vec<String>,
    pub tensors: BTreeMap<String, Tensor<f32>>,
    /// Learned quantization scales and zero points (`QUANT_FILE`), empty when there are none.
    pub quant: BTreeMap<String, Tensor<f32>>,
}

impl Adapter {
    /// LoRA options equivalent to this adapter's config.
    pub fn options(&self) -> LoraOptions {
        let mut o = LoraOptions::new(self.r);
        o.alpha = self.alpha;
        o.dropout = self.dropout;
        o.rslora = self.rslora;
        o.targets = self.target_modules.clone();
        o
    }
}

/// The qatc name of a PEFT key (`base_model.model.[transformer.]h.0...lora_A[.default].weight`).
fn qatc_name(key: &str) -> Option<String> {
    let k = key.strip_prefix("base_model.model.").or_else(|| key.strip_prefix("base_model."))?;
    let k = k.strip_prefix("transformer.").unwrap_or(k);
    Some(k.replace(".lora_A.default.weight", ".lora_A.weight").replace(".lora_B.default.weight", ".lora_B.weight"))
}

pub fn read(dir: &Path) -> Result<Adapter, AdapterError> {
    let cfg_path = dir.join("adapter_config.json");
    let bad = |p: &Path, why: String| AdapterError::Invalid { path: p.to_path_buf(), why };
    let text = std::fs::read_to_string(&cfg_path).map_err(|source| AdapterError::Io { path: cfg_path.clone(), source })?;
    let c: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(&cfg_path, format!("not JSON: {e}")))?;
    if c.get("peft_type").and_then(|v| v.as_str()).is_some_and(|t| t != "LORA") {
        return Err(bad(&cfg_path, format!("peft_type is {}, qatc reads LORA adapters", c["peft_type"])));
    }
    let r = c.get("r").and_then(|v| v.as_u64()).ok_or_else(|| bad(&cfg_path, "missing integer `r`".into()))? as usize;
    let alpha = c.get("lora_alpha").and_then(|v| v.as_f64()).unwrap_or(8.0);
    let dropout = c.get("lora_dropout").and_then(|v| v.as_f64()).unwrap_or(0.0);
    let rslora = c.get("use_rslora").and_then(|v| v.as_bool()).unwrap_or(false);
    let target_modules: Vec<String> = match c.get("target_modules") {
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|v| v.as_str().map(String::from)).collect(),
        Some(serde_json::Value::String(s)) => vec![s.clone()],
        _ => vec!["c_attn".into()],
    };
    let st_path = dir.join("adapter_model.safetensors");
    let mut tensors = BTreeMap::new();
    for (key, t) in read_tensors(&st_path)? {
        let name =
            qatc_name(&key).ok_or_else(|| bad(&st_path, format!("unexpected key {key:?} (want base_model.model....lora_A.weight)")))?;
        tensors.insert(name, t);
    }
    let quant_path = dir.join(QUANT_FILE);
    let mut quant = BTreeMap::new();
    if quant_path.exists() {
        for (name, t) in read_tensors(&quant_path)? {
            if !is_learned_name(&name) {
                return Err(bad(&quant_path, format!("unexpected tensor {name:?} (want WEIGHT.scales or WEIGHT.zeros)")));
            }
            if t.data.iter().any(|v| !v.is_finite()) {
                return Err(bad(&quant_path, format!("{name:?} holds a non-finite value")));
            }
            quant.insert(name, t);
        }
    }
    Ok(Adapter { r, alpha, dropout, rslora, target_modules, tensors, quant })
}

/// Every tensor of a safetensors file as f32 (from F32, F16 or BF16), by key.
fn read_tensors(path: &Path) -> Result<Vec<(String, Tensor<f32>)>, AdapterError> {
    let bad = |why: String| AdapterError::Invalid { path: path.to_path_buf(), why };
    let bytes = std::fs::read(path).map_err(|source| AdapterError::Io { path: path.to_path_buf(), source })?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(format!("not a safetensors file: {e}")))?;
    let mut out = Vec::new();
    for (key, v) in st.tensors() {
        let data: Vec<f32> = match v.dtype() {
            safetensors::Dtype::F32 => v.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            safetensors::Dtype::F16 => v.data().chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            safetensors::Dtype::BF16 => v.data().chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            d => return Err(bad(format!("tensor {key:?} has unsupported dtype {d:?}"))),
        };
        out.push((key, Tensor { shape: v.shape().to_vec(), data }));
    }
    Ok(out)
}

/// adapter_config.json and adapter_model.safetensors, as PEFT writes them for GPT-2.
pub fn to_files(o: &LoraOptions, tensors: &[(String, Tensor<f32>)], base: &str) -> anyhow::Result<(String, Vec<u8>)> {
    let cfg = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": o.r,
        "lora_alpha": o.alpha,
        "lora_dropout": o.dropout,
        "target_modules": o.targets,
        "fan_in_fan_out": true,
        "bias": "none",
        "use_rslora": o.rslora,
        "init_lora_weights": true,
        "inference_mode": true,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
    });
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(n, t)| (format!("{KEY_PREFIX}{n}"), t.data.iter().flat_map(|v| v.to_le_bytes()).collect(), t.shape.clone()))
        .collect();
    let views = bytes
        .iter()
        .map(|(n, b, s)| Ok((n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    Ok((serde_json::to_string_pretty(&cfg)? + "\n", safetensors::serialize(views, Some(meta))?))
}

/// PEFT's default init: A ~ kaiming-uniform(a = sqrt 5) = U(-1/sqrt(in), 1/sqrt(in)), B = 0.
/// Deterministic in `seed` and the tensor's name.
pub fn init_tensor(name: &str, shape: &[usize], seed: u64) -> Tensor<f32> {
    let n: usize = shape.iter().product();
    if name.ends_with(".lora_B.weight") {
        return Tensor { shape: shape.to_vec(), data: vec![0.0; n] };
    }
    let fan_in = shape.get(1).copied().unwrap_or(1) as f64;
    let bound = 1.0 / fan_in.sqrt();
    let mut state = seed ^ name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
    let data = (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let u = (z >> 11) as f64 / (1u64 << 53) as f64;
            ((2.0 * u - 1.0) * bound) as f32
        })
        .collect();
    Tensor { shape: shape.to_vec(), data }
}
