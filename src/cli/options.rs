//! Command-line options shared by compile, dump, eval, train and prt: quantization, LoRA and the
//! bit map that `qatc prt` writes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use qatc_ir::{QuantScheme, QuantSpec};
use qatc_passes::lora::LoraOptions;
use qatc_passes::quant::QuantOptions;
use serde::{Deserialize, Serialize};

use crate::step::ModelOptions;

#[derive(clap::Args, Debug, Clone, Default)]
pub struct QuantArgs {
    /// Fake-quantize the targeted weights to B bits (2..8).
    #[arg(long)]
    pub bits: Option<u8>,
    /// Group size along the input dimension (0: per output channel).
    #[arg(long, default_value_t = 64)]
    pub group: usize,
    /// sym | asym | nf4 | q4_0
    #[arg(long, default_value = "sym")]
    pub scheme: String,
    /// Comma-separated modules to quantize (default: attn.c_attn,attn.c_proj,mlp.c_fc,mlp.c_proj;
    /// lm_head and wte only when named).
    #[arg(long, value_delimiter = ',')]
    pub quant_targets: Option<Vec<String>>,
    /// Also fake-quantize the targeted linears' inputs: dynamic per-token symmetric, B bits.
    #[arg(long)]
    pub act_bits: Option<u8>,
    /// Per-module bits from `qatc prt --bits-map` (JSON).
    #[arg(long)]
    pub bits_map: Option<PathBuf>,
    /// base: fake-quantize the frozen base weight; merged: fake-quantize W + scaling (BA)^T.
    #[arg(long, default_value = "base")]
    pub qat: String,
}

/// One module's entry in a bit map: a quantization, or null for full precision.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ModuleBits {
    pub bits: u8,
    pub group: usize,
    pub scheme: String,
}

/// The bit map `qatc prt` writes and `--bits-map` reads.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct BitMap {
    pub version: u32,
    pub modules: BTreeMap<String, Option<ModuleBits>>,
}

pub fn scheme(s: &str) -> anyhow::Result<QuantScheme> {
    QuantScheme::from_name(s).with_context(|| format!("unknown --scheme `{s}`; schemes: sym, asym, nf4, q4_0"))
}

pub fn read_bit_map(path: &Path) -> anyhow::Result<BTreeMap<String, Option<QuantSpec>>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    let bm: BitMap = serde_json::from_str(&text).with_context(|| format!("{}: not a qatc bit map", path.display()))?;
    let mut out = BTreeMap::new();
    for (m, b) in bm.modules {
        let spec = match b {
            Some(b) => Some(QuantSpec { bits: b.bits, group: b.group, scheme: scheme(&b.scheme)? }),
            None => None,
        };
        out.insert(m, spec);
    }
    Ok(out)
}

impl QuantArgs {
    pub fn options(&self) -> anyhow::Result<Option<QuantOptions>> {
        let map = match &self.bits_map {
            Some(p) => Some(read_bit_map(p)?),
            None => None,
        };
        if self.bits.is_none() && map.is_none() {
            if self.act_bits.is_some() {
                bail!("--act-bits needs --bits (or --bits-map)");
            }
            return Ok(None);
        }
        let spec = QuantSpec { bits: self.bits.unwrap_or(4), group: self.group, scheme: scheme(&self.scheme)? };
        if !(2..=8).contains(&spec.bits) {
            bail!("--bits must be 2..8, got {}", spec.bits);
        }
        if let Some(a) = self.act_bits {
            if !(2..=8).contains(&a) {
                bail!("--act-bits must be 2..8, got {a}");
            }
        }
        let targets = match (&self.quant_targets, &map, self.bits) {
            (Some(t), _, _) => t.clone(),
            // a bit map alone quantizes exactly the modules it lists
            (None, Some(_), None) => Vec::new(),
            _ => QuantOptions::default_targets(),
        };
        Ok(Some(QuantOptions { spec, targets, per_module: map.unwrap_or_default(), act_bits: self.act_bits }))
    }
}

/// Parses `--lora r=16[,alpha=32][,dropout=0.05][,targets=c_attn,c_proj,c_fc][,rslora]`.
pub fn parse_lora(s: &str) -> anyhow::Result<LoraOptions> {
    let mut r = None;
    let (mut alpha, mut dropout, mut targets, mut rslora) = (None, 0.0, None::<Vec<String>>, false);
    let mut in_targets = false;
    for tok in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        match tok.split_once('=') {
            Some(("r", v)) => r = Some(v.parse::<usize>().with_context(|| format!("--lora r={v}: not an integer"))?),
            Some(("alpha", v)) => alpha = Some(v.parse::<f64>().with_context(|| format!("--lora alpha={v}: not a number"))?),
            Some(("dropout", v)) => dropout = v.parse::<f64>().with_context(|| format!("--lora dropout={v}: not a number"))?,
            Some(("targets", v)) => targets = Some(vec![v.to_string()]),
            Some((k, _)) => bail!("--lora: unknown key `{k}` (keys: r, alpha, dropout, targets, rslora)"),
            None if tok == "rslora" => rslora = true,
            None if in_targets => targets.get_or_insert_with(Vec::new).push(tok.to_string()),
            None => bail!("--lora: `{tok}` is not key=value"),
        }
        in_targets = tok.starts_with("targets=") || (in_targets && !tok.contains('='));
    }
    let r = r.context("--lora needs r=N")?;
    let mut o = LoraOptions::new(r);
    if let Some(a) = alpha {
        o.alpha = a;
    }
    o.dropout = dropout;
    if let Some(t) = targets {
        o.targets = t;
    }
    o.rslora = rslora;
    if r == 0 {
        bail!("--lora r must be at least 1");
    }
    Ok(o)
}

/// The model options for these flags.
pub fn model_options(q: &QuantArgs, lora: Option<LoraOptions>, full_finetune: bool, training: bool) -> anyhow::Result<ModelOptions> {
    let quant = q.options()?;
    let mut lora = lora;
    match q.qat.as_str() {
        "base" => {}
        "merged" => match lora.as_mut() {
            Some(l) if quant.is_some() => l.merged = true,
            _ => bail!("--qat merged needs --bits and --lora"),
        },
        other => bail!("--qat must be base or merged, got `{other}`"),
    }
    Ok(ModelOptions { quant, lora, full_finetune, training })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lora_spec_parses_targets_with_commas() {
        let o = parse_lora("r=8,alpha=16,dropout=0.05,targets=c_attn,c_proj,rslora").unwrap();
        assert_eq!((o.r, o.alpha, o.dropout, o.rslora), (8, 16.0, 0.05, true));
        assert_eq!(o.targets, vec!["c_attn", "c_proj"]);
        assert_eq!(parse_lora("r=4").unwrap().alpha, 8.0);
        assert!(parse_lora("r=0").is_err());
        assert!(parse_lora("alpha=3").is_err());
        assert!(parse_lora("r=4,bogus=1").is_err());
    }
}
