//! The GPT-2 hyperparameters: read from the `config.json` Hugging Face saves beside the weights,
//! or inferred from tensor shapes when there is none, then checked against every tensor the
//! lowering needs (docs/formats.md section 1).

use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use super::checkpoint::Checkpoint;
use super::error::LoadError;

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Gpt2Config {
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_positions: usize,
    pub vocab_size: usize,
    pub layer_norm_epsilon: f64,
}

/// Where a config came from, for the CLI to report.
#[derive(Clone, Debug, PartialEq)]
pub enum ConfigSource {
    File(PathBuf),
    Inferred,
}

/// GPT-2's head dimension in all four public sizes; inference assumes it.
const HEAD_DIM: usize = 64;
/// Upper bound on any size read from a config.json, so products of sizes cannot overflow.
const MAX_SIZE: u64 = 1 << 31;

/// The `config.json` beside a checkpoint (Hugging Face's `save_pretrained` layout).
pub fn config_path(model: &Path) -> PathBuf {
    model.with_file_name("config.json")
}

/// Largest config.json read: real ones are under 2 KB, and this keeps a stray multi-gigabyte
/// file of that name from being read into memory.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

fn read_small(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?.take(MAX_CONFIG_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        let msg = format!("over {MAX_CONFIG_BYTES} bytes: not a GPT-2 config");
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, msg));
    }
    Ok(bytes)
}

fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("h.")?.split('.').next()?.parse().ok()
}

impl Gpt2Config {
    /// Reads `config.json` beside the checkpoint when present; else infers the sizes from the
    /// tensors and returns a notice saying so (the head count is a guess from head dim 64).
    pub fn load(ckpt: &Checkpoint) -> Result<(Gpt2Config, ConfigSource, Option<String>), LoadError> {
        let path = config_path(ckpt.path());
        match read_small(&path) {
            Ok(bytes) => {
                let cfg = Gpt2Config::from_json(&path, &bytes)?;
                Ok((cfg, ConfigSource::File(path), None))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let cfg = Gpt2Config::infer(ckpt)?;
                let notice = format!(
                    "no config.json beside {}: inferred {} layers, n_embd {}, {} heads (head dim {HEAD_DIM})",
                    ckpt.path().display(),
                    cfg.n_layer,
                    cfg.n_embd,
                    cfg.n_head
                );
                Ok((cfg, ConfigSource::Inferred, Some(notice)))
            }
            Err(e) => Err(LoadError::io(path, e)),
        }
    }

    /// Parses a Hugging Face GPT-2 `config.json`. Missing sizes take transformers' defaults (the
    /// 124M model), as `GPT2Config` does; `validate` then catches any disagreement with the file.
    /// Options that change the math qatc lowers are rejected rather than ignored.
    pub fn from_json(path: &Path, bytes: &[u8]) -> Result<Gpt2Config, LoadError> {
        let bad = |why: String| LoadError::BadConfig { path: path.into(), why };
        let text = crate::input::text(bytes).map_err(|why| bad(format!("not a JSON text file: {why}")))?;
        let v: Value = serde_json::from_str(text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let m = v.as_object().ok_or_else(|| bad("not a JSON object".into()))?;
        let size = |keys: &[&str], default: usize| -> Result<usize, LoadError> {
            // The first key present wins: n_positions is the truth, n_ctx a legacy copy.
            let Some((k, v)) = keys.iter().find_map(|k| m.get(*k).map(|v| (k, v))) else { return Ok(default) };
            match v.as_u64() {
                Some(x) if (1..=MAX_SIZE).contains(&x) => Ok(x as usize),
                _ => Err(bad(format!("{k} is {v}, expected an integer in 1..=2^31"))),
            }
        };
        let cfg = Gpt2Config {
            n_embd: size(&["n_embd", "hidden_size"], 768)?,
            n_layer: size(&["n_layer", "num_hidden_layers"], 12)?,
            n_head: size(&["n_head", "num_attention_heads"], 12)?,
            n_positions: size(&["n_positions", "max_position_embeddings", "n_ctx"], 1024)?,
            vocab_size: size(&["vocab_size"], 50257)?,
            layer_norm_epsilon: match m.get("layer_norm_epsilon") {
                None => 1e-5,
                Some(v) => match v.as_f64() {
                    Some(x) if x.is_finite() && x > 0.0 => x,
                    _ => return Err(bad(format!("layer_norm_epsilon is {v}, expected a positive number"))),
                },
            },
        };
        check_options(m, &cfg).map_err(bad)?;
        if !cfg.n_embd.is_multiple_of(cfg.n_head) {
            return Err(bad(format!("n_embd {} is not divisible by n_head {}", cfg.n_embd, cfg.n_head)));
        }
        Ok(cfg)
    }

    /// Sizes from the tensors: vocab and width from `wte`, positions from `wpe`, layers from the
    /// highest `h.{i}` (a hole shows up later as a missing tensor), heads from head dim 64.
    pub fn infer(ckpt: &Checkpoint) -> Result<Gpt2Config, LoadError> {
        let path = ckpt.path();
        let bad = |why: String| LoadError::BadConfig { path: path.into(), why };
        let matrix = |name: &str| -> Result<(usize, usize), LoadError> {
            let info = ckpt.info(name).ok_or_else(|| LoadError::MissingTensor { path: path.into(), tensor: ckpt.key_of(name) })?;
            match info.shape[..] {
                [r, c] if r > 0 && c > 0 => Ok((r, c)),
                _ => Err(bad(format!(
                    "cannot infer the config: tensor {:?} has shape {}, expected a non-empty matrix",
                    info.key,
                    super::error::dims(&info.shape)
                ))),
            }
        };
        let (vocab_size, n_embd) = matrix("wte.weight")?;
        let (n_positions, c) = matrix("wpe.weight")?;
        if c != n_embd {
            return Err(LoadError::ShapeMismatch {
                path: path.into(),
                tensor: ckpt.key_of("wpe.weight"),
                expected: vec![n_positions, n_embd],
                got: vec![n_positions, c],
            });
        }
        let n_layer = ckpt.names().iter().filter_map(|n| layer_of(n)).max().map_or(0, |m| m.saturating_add(1));
        if n_layer == 0 {
            return Err(bad("cannot infer the config: no transformer blocks (h.0.*) in the file".into()));
        }
        if !n_embd.is_multiple_of(HEAD_DIM) {
            return Err(bad(format!(
                "cannot infer n_head: n_embd {n_embd} is not a multiple of {HEAD_DIM}; put a config.json beside the model"
            )));
        }
        Ok(Gpt2Config { n_embd, n_layer, n_head: n_embd / HEAD_DIM, n_positions, vocab_size, layer_norm_epsilon: 1e-5 })
    }

    /// Every tensor the lowering reads, canonical name and shape, in lowering order. Conv1D
    /// weights are [in, out]. `lm_head.weight` is not listed: it is optional and tied to `wte`.
    pub fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let mut t = self.outer_tensors();
        let tail = t.split_off(2);
        (0..self.n_layer).for_each(|i| t.extend(self.block_tensors(i)));
        t.extend(tail);
        t
    }

    /// wte, wpe, then ln_f.
    fn outer_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (c, v, p) = (self.n_embd, self.vocab_size, self.n_positions);
        let t = [("wte.weight", vec![v, c]), ("wpe.weight", vec![p, c]), ("ln_f.weight", vec![c]), ("ln_f.bias", vec![c])];
        t.into_iter().map(|(n, s)| (n.to_string(), s)).collect()
    }

    /// The twelve tensors of block `i`.
    fn block_tensors(&self, i: usize) -> Vec<(String, Vec<usize>)> {
        let c = self.n_embd;
        let blk: [(&str, Vec<usize>); 12] = [
            ("ln_1.weight", vec![c]),
            ("ln_1.bias", vec![c]),
            ("attn.c_attn.weight", vec![c, 3 * c]),
            ("attn.c_attn.bias", vec![3 * c]),
            ("attn.c_proj.weight", vec![c, c]),
            ("attn.c_proj.bias", vec![c]),
            ("ln_2.weight", vec![c]),
            ("ln_2.bias", vec![c]),
            ("mlp.c_fc.weight", vec![c, 4 * c]),
            ("mlp.c_fc.bias", vec![4 * c]),
            ("mlp.c_proj.weight", vec![4 * c, c]),
            ("mlp.c_proj.bias", vec![c]),
        ];
        blk.into_iter().map(|(n, s)| (format!("h.{i}.{n}"), s)).collect()
    }

    /// Checks that every tensor the lowering needs is present with the shape this config implies,
    /// and that the file has no blocks beyond `n_layer`.
    pub fn validate(&self, ckpt: &Checkpoint) -> Result<(), LoadError> {
        let path = ckpt.path();
        let bad = |why: String| LoadError::BadConfig { path: path.into(), why };
        if self.n_head == 0 || !self.n_embd.is_multiple_of(self.n_head) {
            return Err(bad(format!("n_embd {} is not divisible by n_head {}", self.n_embd, self.n_head)));
        }
        let check = |name: &str, shape: &[usize]| -> Result<(), LoadError> {
            let info = ckpt.info(name).ok_or_else(|| LoadError::MissingTensor { path: path.into(), tensor: ckpt.key_of(name) })?;
            if info.shape != shape {
                return Err(LoadError::ShapeMismatch {
                    path: path.into(),
                    tensor: info.key.clone(),
                    expected: shape.to_vec(),
                    got: info.shape.clone(),
                });
            }
            Ok(())
        };
        // Block by block rather than `expected_tensors`: an absurd n_layer from a hostile file
        // then fails at its first missing block instead of allocating a list for every block.
        let mut outer = self.outer_tensors();
        let tail = outer.split_off(2);
        for (name, shape) in outer.into_iter().chain((0..self.n_layer).flat_map(|i| self.block_tensors(i))).chain(tail) {
            check(&name, &shape)?;
        }
        if ckpt.info("lm_head.weight").is_some() {
            check("lm_head.weight", &[self.vocab_size, self.n_embd])?;
        }
        for name in ckpt.names() {
            if layer_of(name).is_some_and(|i| i >= self.n_layer) {
                return Err(bad(format!("tensor {:?} belongs to a block beyond the config's n_layer {}", ckpt.key_of(name), self.n_layer)));
            }
        }
        Ok(())
    }

    pub fn head_size(&self) -> usize {
        self.n_embd.checked_div(self.n_head).unwrap_or(0)
    }

    /// Parameters with the LM head tied: V C + P C + L (12 C^2 + 13 C) + 2 C.
    pub fn param_count(&self) -> usize {
        let c = self.n_embd;
        let block = c.saturating_mul(c).saturating_mul(12).saturating_add(c.saturating_mul(13));
        self.vocab_size
            .saturating_mul(c)
            .saturating_add(self.n_positions.saturating_mul(c))
            .saturating_add(self.n_layer.saturating_mul(block))
            .saturating_add(c.saturating_mul(2))
    }

    /// The four public GPT-2 sizes, by parameter count ("124M") or Hub name ("gpt2").
    pub fn preset(name: &str) -> Option<Gpt2Config> {
        let (n_embd, n_layer, n_head) = match name {
            "124M" | "gpt2" => (768, 12, 12),
            "355M" | "gpt2-medium" => (1024, 24, 16),
            "774M" | "gpt2-large" => (1280, 36, 20),
            "1.5B" | "gpt2-xl" => (1600, 48, 25),
            _ => return None,
        };
        Some(Gpt2Config { n_embd, n_layer, n_head, n_positions: 1024, vocab_size: 50257, layer_norm_epsilon: 1e-5 })
    }

    /// A Hugging Face `config.json` for this model. It carries `n_ctx` and `architectures`
    /// because llama.cpp's converter reads them, and the dropout rates of what qatc trained:
    /// none in the blocks (its step has LoRA's dropout only), where transformers would assume
    /// 0.1 for a key left out and so train the saved model further with dropout it never had.
    pub fn to_hf_json(&self) -> Value {
        json!({
            "activation_function": "gelu_new",
            "architectures": ["GPT2LMHeadModel"],
            "attn_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "model_type": "gpt2",
            "n_ctx": self.n_positions,
            "n_embd": self.n_embd,
            "n_head": self.n_head,
            "n_inner": null,
            "n_layer": self.n_layer,
            "n_positions": self.n_positions,
            "resid_pdrop": 0.0,
            "tie_word_embeddings": true,
            "vocab_size": self.vocab_size,
        })
    }
}

/// transformers' GPT2Config default for `eos_token_id`: `<|endoftext|>`.
const GPT2_EOS: u64 = 50256;

/// The tokens that end a text (`qatc generate` stops at one), as transformers' `generate` finds
/// them: `eos_token_id` of the `generation_config.json` beside the checkpoint, else of its
/// `config.json` (a number, a list, or null for none), else GPT-2's default 50256. Ids outside
/// the vocabulary can never be generated and are dropped.
pub fn eos_tokens(ckpt: &Checkpoint, vocab_size: usize) -> Result<Vec<usize>, LoadError> {
    let generation = ckpt.path().with_file_name("generation_config.json");
    let ids = match eos_in(&generation)? {
        Some(ids) => ids,
        None => eos_in(&config_path(ckpt.path()))?.unwrap_or(vec![GPT2_EOS]),
    };
    Ok(ids.into_iter().filter(|&t| t < vocab_size as u64).map(|t| t as usize).collect())
}

/// `eos_token_id` of a JSON file; None when there is no such file or no such key.
fn eos_in(path: &Path) -> Result<Option<Vec<u64>>, LoadError> {
    let bad = |why: String| LoadError::BadConfig { path: path.into(), why };
    let bytes = match read_small(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(LoadError::io(path, e)),
    };
    let text = crate::input::text(&bytes).map_err(|why| bad(format!("not a JSON text file: {why}")))?;
    let v: Value = serde_json::from_str(text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    let id = |x: &Value| x.as_u64().ok_or_else(|| bad(format!("eos_token_id holds {x}, not a token id")));
    Ok(match v.get("eos_token_id") {
        None => None,
        Some(Value::Null) => Some(vec![]),
        Some(Value::Array(a)) => Some(a.iter().map(id).collect::<Result<_, _>>()?),
        Some(x) => Some(vec![id(x)?]),
    })
}

/// Rejects config options under which HF's GPT-2 computes something other than what qatc lowers.
fn check_options(m: &Map<String, Value>, cfg: &Gpt2Config) -> Result<(), String> {
    if let Some(t) = m.get("model_type").filter(|t| t.as_str() != Some("gpt2")) {
        return Err(format!("model_type is {t}, not \"gpt2\""));
    }
    if let Some(a) = m.get("activation_function") {
        if !matches!(a.as_str(), Some("gelu_new" | "gelu_pytorch_tanh")) {
            return Err(format!("activation_function {a} is not supported (qatc lowers gelu_new)"));
        }
    }
    if let Some(n) = m.get("n_inner").filter(|n| !n.is_null()) {
        if n.as_u64() != Some(4 * cfg.n_embd as u64) {
            return Err(format!("n_inner {n} is not supported (qatc lowers an MLP of width 4 * n_embd)"));
        }
    }
    if m.get("scale_attn_weights").and_then(Value::as_bool) == Some(false) {
        return Err("scale_attn_weights false is not supported".into());
    }
    if m.get("scale_attn_by_inverse_layer_idx").and_then(Value::as_bool) == Some(true) {
        return Err("scale_attn_by_inverse_layer_idx true is not supported".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests;
