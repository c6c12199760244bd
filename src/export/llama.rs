//! The merged model as a GGUF file for llama.cpp's `gpt2` architecture, and back.
//!
//! Tensor names and KVs follow llama.cpp's converter (docs/formats.md section 5). Linear
//! weights are stored transposed, [out, in] row-major (GGUF ne = [in, out]), so quantization
//! blocks run along in-features, as qatc's groups do. Tensor types:
//! - Q4_0 when trained with `--scheme q4_0` (group 32): the codes and f16 scales are
//!   `quant::quantize(W + s (BA)^T)`, qatc's own Q4_0, which is llama.cpp's bit for bit; under
//!   `--qat merged` they are exactly what training rounded to.
//! - Q4_0 (up to 4 bits) or Q8_0 (5 to 8 bits) when trained with learned scales (`--scales
//!   learned`, sym, groups a multiple of 32): a learned scale is an fp16 value and sym's grid
//!   points (-qmax..qmax) are Q4_0's / Q8_0's, so each block holds the trained codes and scale;
//!   exact under `--qat merged` or when not adapted (checked on export).
//! - Q8_0 when trained at 8 bits with min-max scales (any scheme): llama.cpp's Q8_0 of the trained
//!   weights. Q8_0 is not qatc's 8-bit grid (its scale is fp16, its block 32): a close copy.
//! - F16 for every other linear (other bit widths have no GGUF type with qatc's grid).
//! - F32 for embeddings, LayerNorms and biases. No `output.weight`: the head is tied to
//!   token_embd, which llama.cpp's gpt2 loader falls back to.

use half::f16;
use qatc_ir::QuantScheme;
use qatc_runtime::{quant, Tensor};

use super::gguf::{self, GgmlType, Gguf, TensorData, Value, ValueType};
use super::{vocab, ExportError, LinearExport, Merged};
use crate::frontend::config::Gpt2Config;

/// Tensors by Hugging Face name.
pub type NamedTensors = Vec<(String, Tensor<f32>)>;

/// llama.cpp's `llama_ftype` for the file's predominant weight type.
fn file_type(types: &[GgmlType]) -> u32 {
    let has = |t| types.contains(&t);
    if has(GgmlType::Q4_0) {
        2 // MOSTLY_Q4_0
    } else if has(GgmlType::Q8_0) {
        7 // MOSTLY_Q8_0
    } else if has(GgmlType::F16) {
        1 // MOSTLY_F16
    } else {
        0 // ALL_F32
    }
}

/// The modules of a GPT-2 block: (Hugging Face name, GGUF name), the one table both directions
/// of the name mapping read.
const BLOCK_MODULES: [(&str, &str); 6] = [
    ("ln_1", "attn_norm"),
    ("attn.c_attn", "attn_qkv"),
    ("attn.c_proj", "attn_output"),
    ("ln_2", "ffn_norm"),
    ("mlp.c_fc", "ffn_up"),
    ("mlp.c_proj", "ffn_down"),
];

/// The tensors outside the blocks: (Hugging Face name, GGUF name).
const TOP_LEVEL: [(&str, &str); 2] = [("wte.weight", "token_embd.weight"), ("wpe.weight", "position_embd.weight")];

/// `ln_f.*` <-> `output_norm.*`.
const FINAL_NORM: (&str, &str) = ("ln_f.", "output_norm.");

/// The GGUF name of an HF tensor name (without `transformer.`).
pub fn gguf_name(hf: &str) -> Option<String> {
    rename(hf, false)
}

/// The HF name of a GGUF tensor name (the inverse of `gguf_name`).
pub fn hf_name(gguf: &str) -> Option<String> {
    rename(gguf, true)
}

/// Maps a name through the tables, HF -> GGUF, or back with `to_hf`.
fn rename(name: &str, to_hf: bool) -> Option<String> {
    let pick = |&(hf, gg): &(&'static str, &'static str)| if to_hf { (gg, hf) } else { (hf, gg) };
    if let Some((_, to)) = TOP_LEVEL.iter().map(pick).find(|(from, _)| *from == name) {
        return Some(to.to_string());
    }
    let (norm_from, norm_to) = pick(&FINAL_NORM);
    if let Some(rest) = name.strip_prefix(norm_from) {
        return Some(format!("{norm_to}{rest}"));
    }
    let (block_from, block_to) = if to_hf { ("blk.", "h.") } else { ("h.", "blk.") };
    let rest = name.strip_prefix(block_from)?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, kind) = rest.rsplit_once('.')?;
    let (_, to) = BLOCK_MODULES.iter().map(pick).find(|(from, _)| *from == module)?;
    Some(format!("{block_to}{layer}.{to}.{kind}"))
}

/// w [rows, cols] row-major -> [cols, rows].
pub fn transpose(w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0f32; w.len()];
    for i in 0..rows {
        for j in 0..cols {
            t[j * rows + i] = w[i * cols + j];
        }
    }
    t
}

/// The GGUF type a linear is written as (see the module docs).
pub fn linear_type(l: &LinearExport) -> GgmlType {
    match l.spec {
        Some(s) if s.scheme == QuantScheme::Q4_0 => GgmlType::Q4_0,
        Some(s) if learned_blocks(l) => {
            if s.bits <= 4 {
                GgmlType::Q4_0
            } else {
                GgmlType::Q8_0
            }
        }
        Some(s) if s.bits == 8 => GgmlType::Q8_0,
        _ => GgmlType::F16,
    }
}

/// Learned sym scales over groups that are whole GGUF blocks: the trained grid is a Q4_0 / Q8_0 one.
fn learned_blocks(l: &LinearExport) -> bool {
    l.learned.is_some() && l.spec.is_some_and(|s| s.scheme == QuantScheme::Sym && s.group_for(l.n_in).is_multiple_of(32))
}

/// A learned weight's GGUF blocks: per output row j and block k of 32 inputs, the fp16 scale of
/// the group the block lies in and the grid points of its elements (-qmax..qmax, q4_0: -8..7),
/// stored as Q4_0 (point + 8) or Q8_0 (int8).
fn learned_tensor(l: &LinearExport, ty: GgmlType, qat_merged: bool) -> Result<Vec<u8>, ExportError> {
    let (Some(spec), Some(pre), Some((scales, zeros))) = (l.spec, l.pre_quant.as_ref(), l.learned.as_ref()) else {
        return Err(ExportError::Internal(format!("{}: learned scales without their weight", l.module)));
    };
    let (n_in, n_out) = (l.n_in, l.n_out);
    let q = quant::quantize_learned(pre, n_in, n_out, spec, scales, zeros);
    if l.on_grid(qat_merged) && quant::dequantize(&q) != l.trained {
        return Err(ExportError::Internal(format!("{}: the learned codes do not reproduce the trained weight", l.module)));
    }
    // the trained codes' grid (sym or q4_0) has a fixed point 0; Q4_0 blocks store points + 8
    let (Some(offset), Some(q4_0_offset)) = (spec.grid().offset(), gguf::q4_0_grid().offset()) else {
        return Err(ExportError::Internal(format!("{}: learned {} scales have no GGUF block type", l.module, spec.scheme)));
    };
    let (offset, q4_0_offset) = (offset as i32, q4_0_offset as i32);
    let gsz = spec.group_for(n_in);
    let mut out = Vec::with_capacity(n_in / 32 * n_out * ty.block().1);
    for j in 0..n_out {
        for k in 0..n_in / 32 {
            // the scale already is an f16 value held in f32: the conversion is exact
            let d = f16::from_f32(q.scales[(32 * k / gsz) * n_out + j]);
            let point = |r: usize| q.codes[(32 * k + r) * n_out + j] as i32 - offset;
            if ty == GgmlType::Q4_0 {
                let codes: [u8; 32] = std::array::from_fn(|r| (point(r) + q4_0_offset) as u8);
                out.extend(gguf::q4_0_block(d, &codes));
            } else {
                out.extend(d.to_le_bytes());
                out.extend((0..32).map(|r| point(r) as i8 as u8));
            }
        }
    }
    Ok(out)
}

/// One linear's GGUF tensor: ne = [in, out], rows are output channels.
fn linear_tensor(l: &LinearExport, name: String, qat_merged: bool) -> Result<TensorData, ExportError> {
    let ty = linear_type(l);
    let (n_in, n_out) = (l.n_in, l.n_out);
    if ty.row_bytes(n_in).is_none() {
        return Err(ExportError::Unsupported(format!(
            "{}: in-features {n_in} is not a multiple of 32, which {} blocks need",
            l.module,
            ty.name()
        )));
    }
    let data = match ty {
        GgmlType::Q4_0 | GgmlType::Q8_0 if l.learned.is_some() => learned_tensor(l, ty, qat_merged)?,
        GgmlType::Q4_0 => {
            let (Some(spec), Some(pre)) = (l.spec, l.pre_quant.as_ref()) else {
                return Err(ExportError::Internal(format!("{}: Q4_0 without its pre-quantization weight", l.module)));
            };
            let q = quant::quantize(pre, n_in, n_out, spec);
            if l.on_grid(qat_merged) && quant::dequantize(&q) != l.trained {
                return Err(ExportError::Internal(format!("{}: Q4_0 codes do not reproduce the trained weight", l.module)));
            }
            // qatc: codes [in, out], scales [in/32, out]; GGUF block k of row j = in 32k..32k+32
            let mut out = Vec::with_capacity(n_in / 32 * n_out * 18);
            let mut codes = [0u8; 32];
            for j in 0..n_out {
                for k in 0..n_in / 32 {
                    for (r, c) in codes.iter_mut().enumerate() {
                        *c = q.codes[(32 * k + r) * n_out + j];
                    }
                    // the scale already is an f16 value held in f32: the conversion is exact
                    out.extend(gguf::q4_0_block(f16::from_f32(q.scales[k * n_out + j]), &codes));
                }
            }
            out
        }
        GgmlType::Q8_0 => gguf::quantize_q8_0(&transpose(&l.trained, n_in, n_out)),
        GgmlType::F16 => gguf::encode_f16(&transpose(&l.trained, n_in, n_out)),
        GgmlType::F32 => gguf::encode_f32(&transpose(&l.trained, n_in, n_out)),
    };
    Ok(TensorData { name, dims: vec![n_in as u64, n_out as u64], ty, data })
}

/// The metadata of a GPT-2 GGUF (llama.cpp's converter writes the same keys).
fn metadata(cfg: &Gpt2Config, name: &str, ftype: u32, quantized: bool) -> Result<Vec<(String, Value)>, ExportError> {
    let u = |v: usize| {
        u32::try_from(v).map(Value::U32).map_err(|_| ExportError::Unsupported(format!("size {v} does not fit GGUF's u32 field")))
    };
    let voc = vocab::gpt2(cfg.vocab_size).map_err(ExportError::Internal)?;
    let mut kv: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::Str("gpt2".into())),
        ("general.type".into(), Value::Str("model".into())),
        ("general.name".into(), Value::Str(name.into())),
        ("general.alignment".into(), Value::U32(gguf::DEFAULT_ALIGNMENT as u32)),
        ("general.file_type".into(), Value::U32(ftype)),
        ("gpt2.context_length".into(), u(cfg.n_positions)?),
        ("gpt2.embedding_length".into(), u(cfg.n_embd)?),
        ("gpt2.block_count".into(), u(cfg.n_layer)?),
        ("gpt2.feed_forward_length".into(), u(4 * cfg.n_embd)?),
        ("gpt2.attention.head_count".into(), u(cfg.n_head)?),
        ("gpt2.attention.layer_norm_epsilon".into(), Value::F32(cfg.layer_norm_epsilon as f32)),
    ];
    if quantized {
        kv.push(("general.quantization_version".into(), Value::U32(2)));
    }
    kv.extend([
        ("tokenizer.ggml.model".into(), Value::Str("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::Str("gpt-2".into())),
        ("tokenizer.ggml.tokens".into(), Value::strings(voc.tokens)),
        ("tokenizer.ggml.token_type".into(), Value::Array(ValueType::I32, voc.types.into_iter().map(Value::I32).collect())),
        ("tokenizer.ggml.merges".into(), Value::strings(voc.merges)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(voc.bos)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(voc.eos)),
    ]);
    Ok(kv)
}

/// The GGUF of a merged model. `name` goes to `general.name`.
pub fn to_gguf(m: &Merged, name: &str) -> Result<Gguf, ExportError> {
    let lin: std::collections::HashMap<String, &LinearExport> = m.linears.iter().map(|l| (format!("{}.weight", l.module), l)).collect();
    let mut tensors = Vec::new();
    for (hf, _) in m.cfg.expected_tensors() {
        let gname = gguf_name(&hf).ok_or_else(|| ExportError::Internal(format!("no GGUF name for {hf}")))?;
        if let Some(l) = lin.get(&hf) {
            tensors.push(linear_tensor(l, gname, m.qat_merged)?);
            continue;
        }
        let t = m.others.get(&hf).ok_or_else(|| ExportError::Internal(format!("missing tensor {hf}")))?;
        // GGUF dims are PyTorch's reversed: wte [V, C] is ne [C, V]; the bytes are the same
        let dims = t.shape.iter().rev().map(|&d| d as u64).collect();
        tensors.push(TensorData { name: gname, dims, ty: GgmlType::F32, data: gguf::encode_f32(&t.data) });
    }
    let types: Vec<GgmlType> = m.linears.iter().map(linear_type).collect();
    let quantized = types.iter().any(|t| matches!(t, GgmlType::Q4_0 | GgmlType::Q8_0));
    let kvs = metadata(&m.cfg, name, file_type(&types), quantized)?;
    Ok(Gguf { kvs, tensors })
}

/// Reads a GPT-2 GGUF back into HF tensors (f32, linears [in, out]) and its config: what a test
/// evaluates to check an export.
pub fn from_gguf(f: &Gguf) -> Result<(Gpt2Config, NamedTensors), ExportError> {
    let bad = |m: String| ExportError::Unsupported(format!("not a qatc GPT-2 GGUF: {m}"));
    if f.get("general.architecture").and_then(Value::as_str) != Some("gpt2") {
        return Err(bad("general.architecture is not \"gpt2\"".into()));
    }
    let size = |k: &str| f.get(k).and_then(Value::as_u32).map(|v| v as usize).ok_or_else(|| bad(format!("no u32 {k}")));
    let eps = match f.get("gpt2.attention.layer_norm_epsilon") {
        Some(Value::F32(e)) => *e as f64,
        _ => return Err(bad("no f32 gpt2.attention.layer_norm_epsilon".into())),
    };
    let wte = f.tensor("token_embd.weight").ok_or_else(|| bad("no token_embd.weight".into()))?;
    let cfg = Gpt2Config {
        n_embd: size("gpt2.embedding_length")?,
        n_layer: size("gpt2.block_count")?,
        n_head: size("gpt2.attention.head_count")?,
        n_positions: size("gpt2.context_length")?,
        vocab_size: wte.dims.get(1).copied().unwrap_or(0) as usize,
        layer_norm_epsilon: eps,
    };
    let mut out = Vec::new();
    for t in &f.tensors {
        let hf = hf_name(&t.name).ok_or_else(|| bad(format!("unexpected tensor {:?}", t.name)))?;
        let data = t.to_f32()?;
        let shape: Vec<usize> = t.dims.iter().rev().map(|&d| d as usize).collect();
        let is_linear = t.dims.len() == 2 && hf.starts_with("h.") && hf.ends_with(".weight");
        let tensor = if is_linear {
            // stored [out, in]; HF Conv1D is [in, out]
            Tensor { shape: vec![shape[1], shape[0]], data: transpose(&data, shape[0], shape[1]) }
        } else {
            Tensor { shape, data }
        };
        out.push((hf, tensor));
    }
    Ok((cfg, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_names_map_both_ways() {
        for (hf, gg) in [
            ("wte.weight", "token_embd.weight"),
            ("wpe.weight", "position_embd.weight"),
            ("ln_f.bias", "output_norm.bias"),
            ("h.0.ln_1.weight", "blk.0.attn_norm.weight"),
            ("h.11.attn.c_attn.bias", "blk.11.attn_qkv.bias"),
            ("h.3.attn.c_proj.weight", "blk.3.attn_output.weight"),
            ("h.2.ln_2.bias", "blk.2.ffn_norm.bias"),
            ("h.1.mlp.c_fc.weight", "blk.1.ffn_up.weight"),
            ("h.1.mlp.c_proj.weight", "blk.1.ffn_down.weight"),
        ] {
            assert_eq!(gguf_name(hf).as_deref(), Some(gg));
            assert_eq!(hf_name(gg).as_deref(), Some(hf));
        }
        assert_eq!(gguf_name("h.0.attn.bias"), None);
        assert_eq!(hf_name("blk.0.attn_q.weight"), None);
        assert_eq!(gguf_name("blk.0.attn_qkv.weight"), None, "one direction at a time");
    }
}
