//! `qatc export MODEL --adapter DIR --out DIR [--format safetensors|gguf]`: merges a trained
//! LoRA adapter into the model and writes the weights the trained model computed with, as a
//! Hugging Face checkpoint or a GGUF for llama.cpp. Which grid the weights lie on is what the
//! adapter was trained with: its `qatc.json` says so when qatc trained it (flags given must
//! agree with it); for an adapter from elsewhere, pass the quantization flags
//! (`--bits --group --scheme --qat ...`). An adapter trained at full precision may be quantized
//! here (`--bits`, `--group`, `--scheme`): the merged weights are, after training, as users chain
//! a LoRA run into llama.cpp. The export gets the same `qatc.json`; `export.json` records the
//! post-training quantization it added.

use std::path::PathBuf;

use anyhow::Context;
use serde_json::json;

use super::options;
use crate::artifacts::OutDir;
use crate::config::{Qat, QuantConfig, RunConfig, Scales};
use crate::export::{self, gguf, hf, llama, Format};

#[derive(clap::Args, Debug)]
pub struct Args {
    pub model: PathBuf,
    /// The PEFT LoRA adapter to merge (what `qatc train --lora` writes).
    #[arg(long)]
    pub adapter: PathBuf,
    /// The output directory.
    #[arg(long)]
    pub out: PathBuf,
    /// The output format.
    #[arg(long, value_enum, default_value_t = Format::Safetensors)]
    pub format: Format,
    // quantization (read from the adapter's qatc.json when it has one)
    #[command(flatten)]
    pub quant: options::QuantArgs,
    #[command(flatten)]
    pub read: super::ReadArgs,
}

/// The marker `OutDir` looks for before replacing an existing output directory.
const MARKER: &str = "export.json";

pub fn run(a: &Args) -> anyhow::Result<()> {
    let format = a.format;
    let inputs: [&std::path::Path; 2] = [&a.model, &a.adapter];
    crate::artifacts::check_target(&a.out, &[MARKER], &inputs).with_context(|| format!("--out {}", a.out.display()))?;
    let m = super::open_model(&a.model, &a.read)?;
    let ptq = post_training(&a.quant, &a.adapter)?;
    // with post-training quantization the adapter is read as the full-precision one it is
    let flags = if ptq.is_some() { options::QuantArgs::default() } else { a.quant.clone() };
    let (cfg, adapter) = options::adapter_config(&flags, &a.adapter, &a.model, a.read.allow_nonfinite)?;
    let mut model = cfg.model.clone();
    if let Some(q) = &ptq {
        model.quant = Some(q.clone());
        eprintln!(
            "note: {} records a full-precision adapter: the merged weights W + s(BA)^T are quantized after training ({}-bit {} g{}), not what was trained",
            a.adapter.join(crate::config::FILE).display(),
            q.bits,
            q.scheme.name(),
            q.group
        );
    }
    let mut mo = model.options(false);
    options::name_bit_map(&mut mo, &a.quant);
    let merged = export::merge(&m, &mo, &adapter).with_context(|| format!("export of {} + {}", a.model.display(), a.adapter.display()))?;
    let out = OutDir::create(&a.out, &[MARKER], &inputs).with_context(|| format!("{}", a.out.display()))?;
    let mut tensors = serde_json::Map::new();
    let file = match format {
        Format::Safetensors => {
            let (st, hf_config) = hf::to_files(&merged)?;
            out.write("model.safetensors", st)?;
            out.write("config.json", hf_config)?;
            for (name, _) in merged.hf_tensors() {
                tensors.insert(name, json!("F32"));
            }
            "model.safetensors"
        }
        Format::Gguf => {
            // blocks of trained codes (Q4_0, or Q8_0 with learned scales) from W + s(BA)^T
            let requantized = merged.linears.iter().find(|l| {
                let ty = llama::linear_type(l);
                l.adapted && (ty == gguf::GgmlType::Q4_0 || (ty == gguf::GgmlType::Q8_0 && l.learned.is_some()))
            });
            if let (Some(l), false) = (requantized, merged.qat_merged) {
                eprintln!(
                    "note: --qat base trained FQ(W) + s(BA)^T; the GGUF requantizes W + s(BA)^T to {}, which is not exactly what was trained (train with --qat merged for an exact export)",
                    llama::linear_type(l).name()
                );
            }
            let f = llama::to_gguf(&merged, &model_name(&a.model))?;
            for t in &f.tensors {
                tensors.insert(t.name.clone(), json!(t.ty.name()));
            }
            out.write("model.gguf", gguf::write(&f)?)?;
            "model.gguf"
        }
    };
    // the quantization and LoRA settings are qatc.json's, beside it
    let summary = json!({
        "format": format.name(),
        "file": file,
        "model": a.model.display().to_string(),
        "adapter": a.adapter.display().to_string(),
        "tensors": tensors,
        // qatc.json beside it says how the adapter was trained; this, what the export added
        "post_training_quantization": ptq.as_ref().map(|q| json!({ "bits": q.bits, "group": q.group, "scheme": q.scheme.name() })),
    });
    out.write(MARKER, serde_json::to_string_pretty(&summary)? + "\n")?;
    out.write(crate::config::FILE, cfg.to_json())?;
    let dir = out.commit()?;
    println!("exported {} ({}) to {}", file, format.name(), dir.display());
    Ok(())
}

/// The quantization to apply at export to a full-precision adapter: its `qatc.json` records
/// none and the flags ask for one. Merging first and quantizing after is how users chain a LoRA
/// run into llama.cpp, so it is allowed (and said); the quantized tensor is W + s(BA)^T, as with
/// `--qat merged`. None when the adapter records a quantization (the flags must then agree with
/// it: `adapter_config`) or has no `qatc.json` (the flags then say how it was trained).
fn post_training(q: &options::QuantArgs, adapter: &std::path::Path) -> anyhow::Result<Option<QuantConfig>> {
    let Some(saved) = RunConfig::read_if_any(adapter)? else { return Ok(None) };
    if saved.model.quant.is_some() {
        return Ok(None);
    }
    let Some(mut quant) = q.config()? else { return Ok(None) };
    let file = adapter.join(crate::config::FILE);
    let trained_only = [
        (q.qat == Some(Qat::Base)).then_some("--qat base"),
        (q.scales == Some(Scales::Learned)).then_some("--scales learned"),
        q.act_bits.map(|_| "--act-bits"),
    ];
    if let Some(flag) = trained_only.into_iter().flatten().next() {
        anyhow::bail!(
            "{flag} describes quantization-aware training, but {} records a full-precision adapter: at export only --bits, --group, --scheme, --quant-targets and --bits-map apply (post-training quantization of the merged weights)",
            file.display()
        );
    }
    if saved.model.lora.is_none() {
        anyhow::bail!("{} records no LoRA adapter", file.display());
    }
    quant.qat = Qat::Merged;
    Ok(Some(quant))
}

/// `general.name`: the model's directory name (`model.safetensors` says nothing), else its stem.
fn model_name(p: &std::path::Path) -> String {
    let stem = p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let dir = p.parent().and_then(|d| d.file_name()).map(|s| s.to_string_lossy().into_owned());
    match dir {
        Some(d) if stem == "model" || stem.is_empty() => d,
        _ if !stem.is_empty() => stem,
        _ => "gpt2".into(),
    }
}
