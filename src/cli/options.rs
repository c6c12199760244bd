//! Command-line options shared by compile, dump, eval, export, train and prt: quantization, LoRA
//! and the bit map that `qatc prt` writes. The flags become a `config::QuantConfig` here and
//! nowhere else; with a saved `qatc.json` they are checked against it instead.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use qatc_ir::{QuantScheme, QuantSpec};
use qatc_passes::lora::LoraOptions;
use qatc_passes::quant::QuantOptions;
use serde::{Deserialize, Serialize};

use crate::adapter::Adapter;
use crate::config::{LoraConfig, ModelConfig, Qat, QuantConfig, RunConfig, Scales};
use crate::step::ModelOptions;

/// `--group` when not given: 64 elements along the input dimension.
pub const DEFAULT_GROUP: usize = 64;
/// `--bits` when only a bit map is given (the map says the rest).
pub const DEFAULT_BITS: u8 = 4;

#[derive(clap::Args, Debug, Clone, Default)]
pub struct QuantArgs {
    /// Fake-quantize the targeted weights to B bits (2..8).
    #[arg(long)]
    pub bits: Option<u8>,
    /// Group size along the input dimension (0: per output channel) [default: 64].
    #[arg(long)]
    pub group: Option<usize>,
    /// The quantization scheme (the rules: `QuantScheme` in ir/src/op.rs) [default: sym].
    #[arg(long, value_enum)]
    pub scheme: Option<QuantScheme>,
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
    /// What is fake-quantized: the frozen base weight, or W + scaling (BA)^T [default: base].
    #[arg(long, value_enum)]
    pub qat: Option<Qat>,
    /// How the quantization scales are found [default: minmax].
    #[arg(long, value_enum)]
    pub scales: Option<Scales>,
}

/// The bit map `qatc prt` writes and `--bits-map` reads: per module a quantization, or null
/// for full precision.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BitMap {
    pub version: u32,
    pub modules: BTreeMap<String, Option<QuantSpec>>,
}

/// Reads a bit map, checking it entry by entry: every error names the file and, where one is at
/// fault, the entry. Whether each entry's layer exists and its group divides the weight is
/// checked against the model by the `fake_quant` pass (which names the file too).
pub fn read_bit_map(path: &Path) -> anyhow::Result<BTreeMap<String, Option<QuantSpec>>> {
    use serde_json::Value;
    let p = path.display();
    let bytes = std::fs::read(path).with_context(|| format!("{p}"))?;
    let text = crate::input::text(&bytes).map_err(|why| anyhow::anyhow!("{p}: not a qatc bit map: {why}"))?;
    let v: Value = serde_json::from_str(text).with_context(|| format!("{p}: not a qatc bit map"))?;
    let Some(top) = v.as_object() else { bail!("{p}: not a qatc bit map: not a JSON object") };
    if let Some(k) = top.keys().find(|k| !["version", "modules"].contains(&k.as_str())) {
        bail!("{p}: unknown field `{k}` (a bit map has `version` and `modules`)");
    }
    match top.get("version") {
        Some(x) if x.as_u64() == Some(BIT_MAP_VERSION as u64) => {}
        Some(x) => bail!("{p}: version {} is not one this qatc reads (version {BIT_MAP_VERSION})", crate::input::excerpt(x)),
        None => bail!("{p}: missing field `version`"),
    }
    let Some(modules) = top.get("modules").and_then(Value::as_object) else {
        bail!("{p}: field `modules` must be an object of module names (missing or not an object)")
    };
    let mut out = BTreeMap::new();
    for (m, b) in modules {
        let bad = |why: String| anyhow::anyhow!("{p}: entry {m:?}: {why}");
        let known = m
            .strip_prefix("h.")
            .and_then(|r| r.split_once('.'))
            .is_some_and(|(l, module)| l.parse::<usize>().is_ok() && qatc_passes::linears::MODULES.contains(&module));
        if !known {
            return Err(bad(format!("not a module name (h.LAYER.MODULE, MODULE one of {})", qatc_passes::linears::MODULES.join(", "))));
        }
        let spec = match b {
            Value::Null => None,
            Value::Object(e) => {
                if let Some(k) = e.keys().find(|k| !["bits", "group", "scheme"].contains(&k.as_str())) {
                    return Err(bad(format!("unknown field `{k}` (an entry has bits, group and scheme, or is null)")));
                }
                let field = |k: &str| e.get(k).ok_or_else(|| bad(format!("missing field `{k}`")));
                let bits = field("bits")?;
                let bits = bits
                    .as_u64()
                    .filter(|b| (2..=8).contains(b))
                    .ok_or_else(|| bad(format!("`bits` must be an integer from 2 to 8, got {}", crate::input::excerpt(bits))))?;
                let group = field("group")?;
                let group = group
                    .as_u64()
                    .and_then(|g| usize::try_from(g).ok())
                    .ok_or_else(|| bad(format!("`group` must be a whole number, got {}", crate::input::excerpt(group))))?;
                let s = field("scheme")?;
                let schemes = QuantScheme::ALL.map(QuantScheme::name).join(", ");
                let scheme = match s.as_str() {
                    Some(name) => QuantScheme::from_name(name).ok_or_else(|| bad(format!("unknown scheme `{name}` (one of {schemes})")))?,
                    None => return Err(bad(format!("`scheme` must be one of {schemes}, got {}", crate::input::excerpt(s)))),
                };
                let spec = QuantSpec { bits: bits as u8, group, scheme };
                // bits and scheme together (the group against the weight: in the pass)
                spec.check(if group == 0 { 64 } else { group }).map_err(bad)?;
                Some(spec)
            }
            other => {
                return Err(bad(format!("must be null or an object with bits, group and scheme, got {}", crate::input::excerpt(other))))
            }
        };
        out.insert(m.clone(), spec);
    }
    Ok(out)
}

/// A value as the configuration spells it (`sym`, `merged`, `["c_attn"]`; `none` for null).
fn spelled<T: Serialize + std::fmt::Debug>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        Ok(serde_json::Value::Null) => "none".into(),
        Ok(other) => other.to_string(),
        Err(_) => format!("{v:?}"),
    }
}

/// The bit map format this qatc writes and reads.
pub const BIT_MAP_VERSION: u32 = 1;

impl QuantArgs {
    /// The quantization these flags ask for, defaults filled in; None without --bits or
    /// --bits-map.
    pub fn config(&self) -> anyhow::Result<Option<QuantConfig>> {
        let map = self.bits_map.as_deref().map(read_bit_map).transpose()?;
        if self.bits.is_none() && map.is_none() {
            // a quantization setting without a quantization would be silently ignored
            let given = [
                self.scheme.map(|_| "--scheme"),
                self.group.map(|_| "--group"),
                self.quant_targets.as_ref().map(|_| "--quant-targets"),
                self.act_bits.map(|_| "--act-bits"),
                self.scales.map(|_| "--scales"),
            ];
            if let Some(flag) = given.into_iter().flatten().next() {
                bail!("{flag} needs --bits (or --bits-map): without either nothing is quantized");
            }
            if self.qat == Some(Qat::Merged) {
                bail!("--qat merged needs --bits and --lora");
            }
            if self.scales == Some(Scales::Learned) {
                bail!("--scales learned needs --bits (or --bits-map)");
            }
            return Ok(None);
        }
        let targets = match (&self.quant_targets, &map, self.bits) {
            (Some(t), _, _) => t.clone(),
            // a bit map alone quantizes exactly the modules it lists
            (None, Some(_), None) => Vec::new(),
            _ => QuantOptions::default_targets(),
        };
        Ok(Some(QuantConfig {
            bits: self.bits.unwrap_or(DEFAULT_BITS),
            group: self.group.unwrap_or(DEFAULT_GROUP),
            scheme: self.scheme.unwrap_or(QuantScheme::Sym),
            targets,
            modules: map.unwrap_or_default(),
            act_bits: self.act_bits,
            qat: self.qat.unwrap_or_default(),
            scales: self.scales.unwrap_or_default(),
        }))
    }

    /// Checks the flags given against the quantization a saved configuration (`file`) records:
    /// each must say what the file says. The error names the flag and both values.
    pub fn check_against(&self, saved: Option<&QuantConfig>, file: &Path) -> anyhow::Result<()> {
        let f = file.display();
        let Some(q) = saved else {
            let given = [
                self.bits.map(|b| format!("--bits {b}")),
                self.bits_map.as_ref().map(|p| format!("--bits-map {}", p.display())),
                self.act_bits.map(|b| format!("--act-bits {b}")),
                (self.qat == Some(Qat::Merged)).then(|| "--qat merged".to_string()),
            ];
            if let Some(flag) = given.into_iter().flatten().next() {
                bail!("{flag} contradicts {f}, which records no quantization (full precision)");
            }
            return Ok(());
        };
        fn same<T: PartialEq + Serialize + std::fmt::Debug>(
            flag: &str,
            given: Option<&T>,
            saved: &T,
            f: &dyn std::fmt::Display,
        ) -> anyhow::Result<()> {
            match given {
                Some(g) if g != saved => bail!("{flag} {} contradicts {f}, which has {}", spelled(g), spelled(saved)),
                _ => Ok(()),
            }
        }
        same("--bits", self.bits.as_ref(), &q.bits, &f)?;
        same("--group", self.group.as_ref(), &q.group, &f)?;
        same("--scheme", self.scheme.as_ref(), &q.scheme, &f)?;
        same("--quant-targets", self.quant_targets.as_ref(), &q.targets, &f)?;
        same("--act-bits", self.act_bits.map(Some).as_ref(), &q.act_bits, &f)?;
        same("--qat", self.qat.as_ref(), &q.qat, &f)?;
        same("--scales", self.scales.as_ref(), &q.scales, &f)?;
        if let Some(p) = &self.bits_map {
            let map = read_bit_map(p)?;
            if map != q.modules {
                let differs = map.keys().chain(q.modules.keys()).find(|k| map.get(*k) != q.modules.get(*k)).cloned().unwrap_or_default();
                bail!(
                    "--bits-map {} contradicts {f}: module {differs} is {} there, {} in the file",
                    p.display(),
                    spelled(&map.get(&differs)),
                    spelled(&q.modules.get(&differs))
                );
            }
        }
        Ok(())
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
    o.check().map_err(|e| anyhow::anyhow!("--lora {s}: {e}"))?;
    Ok(o)
}

/// An adapter's learned scales go with a configuration of learned scales (`--scales learned`,
/// or the adapter's `qatc.json`), and only with it.
pub fn check_learned(quant: Option<&QuantConfig>, a: &Adapter) -> anyhow::Result<()> {
    let learned = quant.is_some_and(|q| q.scales == Scales::Learned);
    match (learned, a.quant.is_empty()) {
        (false, false) => bail!(
            "the adapter holds learned quantization scales ({}): pass --scales learned (and the quantization it was trained with)",
            crate::adapter::QUANT_FILE
        ),
        (true, true) => {
            bail!(
                "--scales learned: the adapter has no learned scales ({}); it was trained with --scales minmax",
                crate::adapter::QUANT_FILE
            )
        }
        _ => Ok(()),
    }
}

/// The model section for these flags (`model` the checkpoint's path).
pub fn model_config(q: &QuantArgs, lora: Option<&LoraOptions>, full_finetune: bool, model: &Path) -> anyhow::Result<ModelConfig> {
    let c =
        ModelConfig { path: crate::config::absolute(model), quant: q.config()?, lora: lora.map(LoraConfig::from_options), full_finetune };
    c.check().map_err(anyhow::Error::msg)?;
    Ok(c)
}

/// An adapter directory and the configuration it was trained with: its `qatc.json` when it has
/// one (the flags given must agree with it), else one made from the flags (`model` the base
/// checkpoint; no step or train section). Learned scales in the adapter need a configuration
/// with learned scales (`check_learned`). Its tensors must be finite unless `allow_nonfinite`.
pub fn adapter_config(q: &QuantArgs, dir: &Path, model: &Path, allow_nonfinite: bool) -> anyhow::Result<(RunConfig, Adapter)> {
    let ad = crate::adapter::read_with(dir, allow_nonfinite)?;
    let lora = ad.options();
    let Some(saved) = RunConfig::read_if_any(dir)? else {
        let model = model_config(q, Some(&lora), false, model)?;
        check_learned(model.quant.as_ref(), &ad)?;
        return Ok((RunConfig { version: crate::config::VERSION, model, step: None, train: None }, ad));
    };
    let file = dir.join(crate::config::FILE);
    q.check_against(saved.model.quant.as_ref(), &file)?;
    let peft = LoraConfig::from_options(&lora);
    if saved.model.lora.as_ref() != Some(&peft) {
        bail!(
            "{}: the LoRA settings ({}) differ from {} ({}); the directory was changed by hand?",
            dir.join("adapter_config.json").display(),
            spelled(&peft),
            file.display(),
            spelled(&saved.model.lora)
        );
    }
    check_learned(saved.model.quant.as_ref(), &ad)?;
    Ok((saved, ad))
}

/// The model options for these flags (what `model_config` says, as the passes take it).
pub fn model_options(q: &QuantArgs, lora: Option<LoraOptions>, full_finetune: bool, training: bool) -> anyhow::Result<ModelOptions> {
    let mut mo = model_config(q, lora.as_ref(), full_finetune && lora.is_none(), Path::new(""))?.options(training);
    name_bit_map(&mut mo, q);
    Ok(mo)
}

/// Tells the quantization pass which file `--bits-map` read, so that its errors about an entry
/// (a layer the model lacks, a group that does not divide the weight) name the file.
pub fn name_bit_map(mo: &mut ModelOptions, q: &QuantArgs) {
    if let (Some(quant), Some(p)) = (mo.quant.as_mut(), &q.bits_map) {
        quant.per_module_source = Some(p.display().to_string());
    }
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

    #[test]
    fn flags_that_contradict_a_saved_configuration_name_both_values() {
        let saved = QuantArgs { bits: Some(3), group: Some(32), ..Default::default() }.config().unwrap();
        let file = Path::new("ad/qatc.json");
        assert!(QuantArgs::default().check_against(saved.as_ref(), file).is_ok());
        assert!(QuantArgs { bits: Some(3), group: Some(32), ..Default::default() }.check_against(saved.as_ref(), file).is_ok());
        let e = QuantArgs { group: Some(64), ..Default::default() }.check_against(saved.as_ref(), file).unwrap_err().to_string();
        assert_eq!(e, "--group 64 contradicts ad/qatc.json, which has 32");
        let e = QuantArgs { scheme: Some(QuantScheme::Nf4), ..Default::default() }.check_against(saved.as_ref(), file).unwrap_err();
        assert_eq!(e.to_string(), "--scheme nf4 contradicts ad/qatc.json, which has sym");
        let e = QuantArgs { bits: Some(4), ..Default::default() }.check_against(None, file).unwrap_err();
        assert!(e.to_string().contains("--bits 4 contradicts ad/qatc.json, which records no quantization"), "{e}");
    }
}
