//! The merged model as a Hugging Face checkpoint: `model.safetensors` (F32, names without
//! `transformer.`, no `lm_head.weight`: transformers ties it to `wte`) and `config.json`
//! (`Gpt2Config::to_hf_json`, which carries `n_ctx` for llama.cpp's converter).
//! `GPT2LMHeadModel.from_pretrained(DIR)` loads it; qatc opens it as a plain f32 model.

use std::collections::HashMap;

use qatc_runtime::Tensor;

use super::{ExportError, Merged};
use crate::frontend::config::Gpt2Config;

/// F32 safetensors of `tensors` (metadata `{"format": "pt"}`, as transformers saves).
pub fn safetensors_bytes(tensors: &[(String, Tensor<f32>)]) -> Result<Vec<u8>, ExportError> {
    let bytes: Vec<(&str, Vec<u8>, &[usize])> =
        tensors.iter().map(|(n, t)| (n.as_str(), t.data.iter().flat_map(|v| v.to_le_bytes()).collect(), t.shape.as_slice())).collect();
    let views = bytes
        .iter()
        .map(|(n, b, s)| Ok((n.to_string(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.to_vec(), b)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    Ok(safetensors::serialize(views, Some(meta))?)
}

pub fn config_json(cfg: &Gpt2Config) -> Result<String, ExportError> {
    Ok(serde_json::to_string_pretty(&cfg.to_hf_json())? + "\n")
}

/// `model.safetensors` and `config.json` of a merged model.
pub fn to_files(m: &Merged) -> Result<(Vec<u8>, String), ExportError> {
    Ok((safetensors_bytes(&m.hf_tensors())?, config_json(&m.cfg)?))
}
