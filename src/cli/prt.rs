//! `qatc prt MODEL --data FILE`: the precision range test. For each targeted module, quantize it
//! alone (the rest of the model at full precision) at increasing bit widths and keep the lowest
//! whose eval loss stays within `--threshold` (relative) of full precision. Writes a bit map that
//! `--bits-map` accepts in compile, eval and train.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Context;
use qatc_ir::{QuantScheme, QuantSpec};
use qatc_passes::linears::{self, MODULES};
use qatc_passes::quant::QuantOptions;

use super::eval::{evaluate, EvalSetup};
use super::options::{BitMap, DEFAULT_GROUP};
use crate::artifacts::write_atomic;
use crate::data::TokenFile;

#[derive(clap::Args, Debug)]
pub struct Args {
    pub model: PathBuf,
    #[arg(long)]
    pub data: PathBuf,
    /// Allowed relative loss increase over full precision.
    #[arg(long, default_value_t = 0.02)]
    pub threshold: f64,
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    #[arg(long, default_value_t = 128)]
    pub seq: usize,
    /// Batches per evaluation.
    #[arg(long, default_value_t = 4)]
    pub batches: usize,
    /// Group size along the input dimension (0: per output channel).
    #[arg(long, default_value_t = DEFAULT_GROUP)]
    pub group: usize,
    /// The quantization scheme tried (nf4 and q4_0: 4 bits only).
    #[arg(long, value_enum, default_value_t = QuantScheme::Sym)]
    pub scheme: QuantScheme,
    /// Modules to test (suffixes, as --quant-targets).
    #[arg(long, value_delimiter = ',')]
    pub targets: Option<Vec<String>>,
    /// Where to write the bit map.
    #[arg(long, default_value = "bits_map.json")]
    pub bits_map: PathBuf,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
    /// Where the evaluations run: auto (a CUDA GPU when qatc can use one, else the CPU's
    /// reference interpreter), cpu, cuda.
    #[arg(long, value_enum, default_value_t = crate::runner::Device::Auto)]
    pub device: crate::runner::Device,
    #[command(flatten)]
    pub read: super::ReadArgs,
}

#[derive(serde::Serialize, Debug)]
struct ModuleResult {
    module: String,
    bits: Option<u8>,
    loss: f64,
    tried: Vec<(u8, f64)>,
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let m = super::open_model(&a.model, &a.read)?;
    super::check_seq(&m, a.batch, a.seq)?;
    let data = TokenFile::load(&a.data)?;
    data.check_vocab(m.cfg.vocab_size)?;
    if !(a.threshold >= 0.0 && a.threshold.is_finite()) {
        anyhow::bail!("--threshold must be a number >= 0, got {}", a.threshold);
    }
    if a.batches == 0 {
        anyhow::bail!("--batches must be at least 1");
    }
    let n = a.batches.min(data.num_batches(a.batch, a.seq));
    if n == 0 {
        data.batch(0, a.batch, a.seq)?;
    }
    let sch = a.scheme;
    let widths: Vec<u8> = match sch {
        QuantScheme::Nf4 | QuantScheme::Q4_0 => vec![4],
        _ => (2..=8).collect(),
    };
    let targets = a.targets.clone().unwrap_or_else(QuantOptions::default_targets);
    let mut modules = Vec::new();
    for l in 0..m.cfg.n_layer {
        for mm in MODULES {
            let name = format!("h.{l}.{mm}");
            if targets.iter().any(|t| linears::matches(&name, t)) {
                modules.push(name);
            }
        }
    }
    if modules.is_empty() {
        anyhow::bail!("no module matches --targets {}", targets.join(","));
    }
    let cuda = super::eval::on_cuda(a.device)?;
    let base = evaluate(&m, &data, a.batch, a.seq, n, &EvalSetup { cuda, ..EvalSetup::default() }, false)?.loss;
    let limit = base * (1.0 + a.threshold);
    let pb = super::progress(modules.len() as u64, "prt {bar:30} {pos}/{len} modules  {msg}  eta {eta}");
    let mut results = Vec::new();
    for module in &modules {
        let mut tried = Vec::new();
        let mut found = None;
        for &bits in &widths {
            let spec = QuantSpec { bits, group: a.group, scheme: sch };
            let per_module = BTreeMap::from([(module.clone(), Some(spec))]);
            let mut setup = EvalSetup { cuda, ..EvalSetup::default() };
            setup.model.quant = Some(QuantOptions { spec, targets: vec![], per_module, act_bits: None, per_module_source: None });
            let loss = evaluate(&m, &data, a.batch, a.seq, n, &setup, false).with_context(|| module.clone())?.loss;
            tried.push((bits, loss));
            pb.set_message(format!("{module} {bits}-bit loss {loss:.4}"));
            if loss <= limit {
                found = Some((bits, loss));
                break;
            }
        }
        pb.inc(1);
        results.push(ModuleResult { module: module.clone(), bits: found.map(|f| f.0), loss: found.map(|f| f.1).unwrap_or(base), tried });
    }
    pb.finish_and_clear();

    let map = BitMap {
        version: super::options::BIT_MAP_VERSION,
        modules: results.iter().map(|r| (r.module.clone(), r.bits.map(|bits| QuantSpec { bits, group: a.group, scheme: sch }))).collect(),
    };
    write_atomic(&a.bits_map, (serde_json::to_string_pretty(&map)? + "\n").as_bytes())
        .with_context(|| format!("{}", a.bits_map.display()))?;

    // summary: average bits over the tested weights' elements, bytes against the checkpoint
    let (mut elems, mut bit_elems, mut stored, mut quant_bytes) = (0usize, 0usize, 0usize, 0usize);
    for r in &results {
        let Some(info) = m.ckpt.info(&format!("{}.weight", r.module)) else { continue };
        let (n_in, n_out) = (info.shape[0], info.shape[1]);
        let e = n_in * n_out;
        elems += e;
        stored += info.dtype.bytes_for(e);
        match r.bits {
            Some(bits) => {
                bit_elems += e * bits as usize;
                quant_bytes += QuantSpec { bits, group: a.group, scheme: sch }.stored_bytes(n_in, n_out);
            }
            None => {
                bit_elems += e * info.dtype.bytes_for(1) * 8;
                quant_bytes += info.dtype.bytes_for(e);
            }
        }
    }
    let avg_bits = bit_elems as f64 / elems.max(1) as f64;
    if a.json {
        let j = serde_json::json!({
            "full_precision_loss": base, "threshold": a.threshold, "modules": results,
            "average_bits": avg_bits, "stored_bytes": stored, "quantized_bytes": quant_bytes,
            "bits_map": a.bits_map.display().to_string(),
        });
        println!("{}", serde_json::to_string(&j)?);
    } else {
        println!("full precision loss {base:.5}; limit {limit:.5} (+{:.1}%)", a.threshold * 100.0);
        println!("{:<22} {:>5} {:>10}", "module", "bits", "loss");
        for r in &results {
            let b = r.bits.map(|b| b.to_string()).unwrap_or_else(|| "full".into());
            println!("{:<22} {:>5} {:>10.5}", r.module, b, r.loss);
        }
        println!(
            "average {avg_bits:.2} bits per weight; {} -> {} ({:.1}% saved); bit map in {}",
            super::compile::human_bytes(stored),
            super::compile::human_bytes(quant_bytes),
            100.0 * (1.0 - quant_bytes as f64 / stored.max(1) as f64),
            a.bits_map.display()
        );
    }
    Ok(())
}
