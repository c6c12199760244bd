//! Random-weight GPT-2 checkpoints for tests and benchmarks: a valid safetensors file in the Hugging
//! Face layout plus its `config.json`, so they go through the same loader as real models.

use std::io::Write;
use std::path::Path;

use qatc_ir::DType;
use serde_json::{json, Map, Value};

use crate::data::write_atomic;
use crate::frontend::config::{config_path, Gpt2Config};
use crate::frontend::error::LoadError;

/// splitmix64: tiny, fast, and good enough for weights that only need to look like weights.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Approximately standard normal: the sum of four uniforms has variance 1/3, so scale by
    /// sqrt(3). Bounded at +-3.5, which keeps F16 far from overflow.
    fn normalish(&mut self) -> f64 {
        let s: f64 = (0..4).map(|_| self.uniform()).sum::<f64>() - 2.0;
        s * 3f64.sqrt()
    }
}

/// FNV-1a, to give every tensor its own stream from (seed, name): the values of a tensor then do
/// not depend on which other tensors the file holds or in what order they are written.
fn stream(seed: u64, name: &str) -> SplitMix {
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
    SplitMix(seed ^ h)
}

fn encode(dtype: DType, v: f32, out: &mut Vec<u8>) {
    match dtype {
        DType::F16 => out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
        DType::BF16 => out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
        _ => out.extend_from_slice(&v.to_le_bytes()),
    }
}

/// Writes a random-weight GPT-2 checkpoint (std 0.02, LayerNorm weights near 1) and its
/// `config.json` beside it, each atomically. `prefix` adds `transformer.` to every key, as
/// non-Hub GPT-2 checkpoints have.
pub fn write_synthetic(path: &Path, cfg: &Gpt2Config, dtype: DType, prefix: bool, seed: u64) -> Result<(), LoadError> {
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Err(LoadError::UnsupportedDtype { path: path.into(), tensor: "(all)".into(), dtype: dtype.name().into() });
    }
    if cfg.n_head == 0 || !cfg.n_embd.is_multiple_of(cfg.n_head) {
        return Err(LoadError::BadConfig {
            path: path.into(),
            why: format!("n_embd {} is not divisible by n_head {}", cfg.n_embd, cfg.n_head),
        });
    }
    let st_dtype = match dtype {
        DType::F16 => "F16",
        DType::BF16 => "BF16",
        _ => "F32",
    };
    let mut tensors = cfg.expected_tensors();
    // Sorted keys, like the files `save_file` writes.
    tensors.sort();
    let pre = if prefix { "transformer." } else { "" };
    let mut header = Map::new();
    header.insert("__metadata__".into(), json!({ "format": "pt" }));
    let mut offset = 0usize;
    for (name, shape) in &tensors {
        let bytes = dtype.bytes_for(shape.iter().product());
        header.insert(format!("{pre}{name}"), json!({ "dtype": st_dtype, "shape": shape, "data_offsets": [offset, offset + bytes] }));
        offset += bytes;
    }
    let mut header = Value::Object(header).to_string().into_bytes();
    // Pad with spaces to 8 bytes so the data section is aligned, as the reference writer does.
    header.resize(header.len().div_ceil(8) * 8, b' ');

    let io = |e| LoadError::io(path, e);
    write_atomic(path, |w| {
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        let mut buf = Vec::new();
        for (name, shape) in &tensors {
            let mut rng = stream(seed, name);
            let is_ln_weight = name.ends_with(".weight") && (name.contains("ln_"));
            let n: usize = shape.iter().product();
            // Chunks keep a 124M model's 38M-element wte from needing a second full-size buffer.
            let mut left = n;
            while left > 0 {
                let k = left.min(1 << 16);
                buf.clear();
                for _ in 0..k {
                    let x = 0.02 * rng.normalish();
                    encode(dtype, if is_ln_weight { 1.0 + x } else { x } as f32, &mut buf);
                }
                w.write_all(&buf)?;
                left -= k;
            }
        }
        Ok(())
    })
    .map_err(io)?;

    let cfg_path = config_path(path);
    let text = serde_json::to_string_pretty(&cfg.to_hf_json()).map_err(|e| LoadError::io(&cfg_path, e.into()))?;
    write_atomic(&cfg_path, |w| w.write_all(text.as_bytes())).map_err(|e| LoadError::io(&cfg_path, e))
}
