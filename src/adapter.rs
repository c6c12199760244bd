//! LoRA adapters in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`), and the
//! initialisation of fresh ones. qatc's input names are PEFT's keys without the
//! `base_model.model.transformer.` prefix: `h.0.attn.c_attn.lora_A.weight` [r, in] and
//! `...lora_B.weight` [out, r].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use qatc_passes::linears;
use qatc_passes::lora::LoraOptions;
use qatc_passes::quant::is_learned_name;
use qatc_runtime::Tensor;
use serde_json::json;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum AdapterError {
    #[error("{}: {error}", path.display())]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{}: {why}", path.display())]
    Invalid { path: PathBuf, why: String },
    #[error(transparent)]
    NonFinite(#[from] crate::finite::NonFinite),
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

/// Reads an adapter directory, refusing non-finite tensors (see [`read_with`]).
pub fn read(dir: &Path) -> Result<Adapter, AdapterError> {
    read_with(dir, false)
}

/// A field of `adapter_config.json` of the wrong type or out of range.
fn field(path: &Path, name: &str, want: &str, got: &serde_json::Value) -> AdapterError {
    AdapterError::Invalid { path: path.to_path_buf(), why: format!("field `{name}` must be {want}, got {}", crate::input::excerpt(got)) }
}

/// `adapter_config.json`, checked field by field: the ones qatc uses must have PEFT's types and
/// sensible ranges (a string `r` or a negative `lora_alpha` is an error naming the field, never a
/// silent default), and the ones that ask for something qatc does not do (per-layer ranks, trained
/// biases, other adapter types) are refused instead of ignored.
fn read_config(path: &Path) -> Result<LoraOptions, AdapterError> {
    use serde_json::Value;
    let bad = |why: String| AdapterError::Invalid { path: path.to_path_buf(), why };
    let text = std::fs::read(path).map_err(|source| AdapterError::Io { path: path.to_path_buf(), error: source })?;
    let text = crate::input::text(&text).map_err(|why| bad(format!("not a JSON text file: {why}")))?;
    let c: Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let c = c.as_object().ok_or_else(|| bad(format!("not a JSON object: {}", crate::input::excerpt(&c))))?;
    if let Some(v) = c.get("peft_type") {
        match v.as_str() {
            Some("LORA") => {}
            Some(_) => return Err(bad(format!("peft_type is {v}, qatc reads LORA adapters"))),
            None => return Err(field(path, "peft_type", "the string \"LORA\"", v)),
        }
    }
    let r = match c.get("r") {
        None => return Err(bad("missing field `r` (the LoRA rank)".into())),
        Some(v) => match v.as_u64() {
            Some(r) if (1..=1 << 16).contains(&r) => r as usize,
            _ => return Err(field(path, "r", "an integer from 1 to 65536", v)),
        },
    };
    let mut o = LoraOptions::new(r);
    // PEFT's defaults for what is absent: lora_alpha 8, no dropout, no rsLoRA, GPT-2's c_attn
    o.alpha = match c.get("lora_alpha") {
        None | Some(Value::Null) => 8.0,
        Some(v) => v.as_f64().filter(|a| a.is_finite() && *a > 0.0).ok_or_else(|| field(path, "lora_alpha", "a positive number", v))?,
    };
    o.dropout = match c.get("lora_dropout") {
        None | Some(Value::Null) => 0.0,
        Some(v) => v.as_f64().filter(|d| (0.0..1.0).contains(d)).ok_or_else(|| field(path, "lora_dropout", "a number in [0, 1)", v))?,
    };
    o.rslora = match c.get("use_rslora") {
        None | Some(Value::Null) => false,
        Some(v) => v.as_bool().ok_or_else(|| field(path, "use_rslora", "true or false", v))?,
    };
    o.targets = match c.get("target_modules") {
        None | Some(Value::Null) => vec!["c_attn".into()],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if !a.is_empty() => a
            .iter()
            .map(|v| v.as_str().map(String::from).ok_or_else(|| field(path, "target_modules", "a list of module names", v)))
            .collect::<Result<_, _>>()?,
        Some(v) => return Err(field(path, "target_modules", "a module name or a non-empty list of them", v)),
    };
    if let Some(t) = o.targets.iter().find(|t| !linears::is_known_target(t)) {
        return Err(bad(format!("field `target_modules` names {t:?}, not a GPT-2 linear (c_attn, c_proj, c_fc; or attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj)")));
    }
    if let Some(v) = c.get("bias").filter(|v| !v.is_null()) {
        if v.as_str() != Some("none") {
            return Err(field(path, "bias", "\"none\" (qatc trains no biases)", v));
        }
    }
    for key in ["rank_pattern", "alpha_pattern"] {
        if let Some(v) = c.get(key).filter(|v| !v.is_null()) {
            if v.as_object().is_none_or(|m| !m.is_empty()) {
                return Err(field(path, key, "empty (qatc uses one rank and one alpha for every module)", v));
            }
        }
    }
    for key in ["layers_to_transform", "modules_to_save"] {
        if let Some(v) = c.get(key).filter(|v| !v.is_null()) {
            return Err(field(path, key, "null (qatc adapts every layer and saves no other modules)", v));
        }
    }
    Ok(o)
}

/// Reads an adapter directory: `adapter_config.json` (checked field by field) and
/// `adapter_model.safetensors`, whose tensors must be LoRA A/B weights of the configured targets,
/// each of the configured rank, and finite unless `allow_nonfinite`.
pub fn read_with(dir: &Path, allow_nonfinite: bool) -> Result<Adapter, AdapterError> {
    let cfg_path = dir.join("adapter_config.json");
    let bad = |p: &Path, why: String| AdapterError::Invalid { path: p.to_path_buf(), why };
    let o = read_config(&cfg_path)?;
    let st_path = dir.join("adapter_model.safetensors");
    let mut tensors = BTreeMap::new();
    for (key, t) in read_tensors(&st_path)? {
        let name =
            qatc_name(&key).ok_or_else(|| bad(&st_path, format!("unexpected key {key:?} (want base_model.model....lora_A.weight)")))?;
        let module = name.strip_suffix(".lora_A.weight").or_else(|| name.strip_suffix(".lora_B.weight"));
        let Some(module) = module.filter(|m| o.targets.iter().any(|t| linears::matches(m, t))) else {
            return Err(bad(
                &st_path,
                format!("tensor {key:?} is not the LoRA A or B weight of a module in target_modules {:?}", o.targets),
            ));
        };
        let rank_dim = if name.ends_with(".lora_A.weight") { 0 } else { 1 };
        if t.shape.len() != 2 || t.shape[rank_dim] != o.r {
            return Err(bad(
                &st_path,
                format!("tensor {key:?} has shape {:?}, but r = {} in adapter_config.json ({module})", t.shape, o.r),
            ));
        }
        if !allow_nonfinite {
            crate::finite::check(&st_path, &key, &t.shape, &t.data)?;
        }
        tensors.insert(name, t);
    }
    let quant_path = dir.join(QUANT_FILE);
    let mut quant = BTreeMap::new();
    if quant_path.exists() {
        for (name, t) in read_tensors(&quant_path)? {
            if !is_learned_name(&name) {
                return Err(bad(&quant_path, format!("unexpected tensor {name:?} (want WEIGHT.scales or WEIGHT.zeros)")));
            }
            if !allow_nonfinite {
                crate::finite::check(&quant_path, &name, &t.shape, &t.data)?;
            }
            quant.insert(name, t);
        }
    }
    Ok(Adapter { r: o.r, alpha: o.alpha, dropout: o.dropout, rslora: o.rslora, target_modules: o.targets, tensors, quant })
}

/// Every tensor of a safetensors file as f32 (from F32, F16 or BF16), by key.
fn read_tensors(path: &Path) -> Result<Vec<(String, Tensor<f32>)>, AdapterError> {
    let bad = |why: String| AdapterError::Invalid { path: path.to_path_buf(), why };
    let bytes = std::fs::read(path).map_err(|error| AdapterError::Io { path: path.to_path_buf(), error })?;
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
