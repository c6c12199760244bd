//! `qatc train --resume DIR`: the saved run's configuration (`DIR/qatc.json`) is the run's. An
//! option given on the command line must say what the saved run says: a difference is one error
//! naming the field and both values. Options not given take the saved values, so
//! `qatc train --out DIR --resume DIR` alone continues the run.

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::Context;

use crate::config::{self, RunConfig};

/// Where the resume state lies in a training output, beside `qatc.json`.
pub const STATE: &str = "checkpoint/state.safetensors";
pub const PROGRESS: &str = "checkpoint/resume.json";

/// Where rank `rank` of `ranks` saves its blocks of a ZeRO-sharded state, beside `STATE`
/// (`Trainer::save_shard`).
pub fn shard_file(rank: usize, ranks: usize) -> String {
    format!("checkpoint/state.rank-{rank}-of-{ranks}.safetensors")
}

/// Where a saved run stands (`checkpoint/resume.json`); what it was run with is `qatc.json`.
#[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Progress {
    /// Steps completed.
    pub step: usize,
    /// Steps skipped by fp16 loss scaling so far (a non-finite gradient; the update not applied).
    #[serde(default)]
    pub skipped: usize,
    /// How many tokens the training data held: the run's position in it (micro-batch
    /// step x K, wrapping) continues the run only in the same data. Absent in older saves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_tokens: Option<usize>,
    /// With `--keep-best`: the step and validation loss of the weights in `best/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best: Option<super::train::best::BestAt>,
}

/// Which of `qatc train`'s options the command line gave, by clap id (the field's name).
#[derive(Clone, Debug)]
pub struct Given(Option<BTreeSet<String>>);

impl Given {
    /// Every option counts as given (a caller that built its `Args` itself).
    pub fn all() -> Given {
        Given(None)
    }

    /// The options a parsed command line gave explicitly (not by default).
    pub fn from_matches(m: &clap::ArgMatches) -> Given {
        let given = m
            .ids()
            .map(|id| id.as_str())
            .filter(|id| m.value_source(id) == Some(clap::parser::ValueSource::CommandLine))
            .map(String::from)
            .collect();
        Given(Some(given))
    }

    pub fn has(&self, id: &str) -> bool {
        self.0.as_ref().is_none_or(|ids| ids.contains(id))
    }
}

/// The options that set each field of the configuration (by dotted path). A field not listed
/// (AdamW's eps) no option sets: it is always the saved run's.
const FIELD_OPTIONS: [(&str, &[&str]); 44] = [
    ("model.path", &["model"]),
    ("model.quant.bits", &["bits"]),
    ("model.quant.group", &["group"]),
    ("model.quant.scheme", &["scheme"]),
    ("model.quant.targets", &["quant_targets"]),
    ("model.quant.modules", &["bits_map"]),
    ("model.quant.act_bits", &["act_bits"]),
    ("model.quant.qat", &["qat"]),
    ("model.quant.scales", &["scales"]),
    ("model.lora", &["lora"]),
    ("model.full_finetune", &["full_finetune"]),
    ("step.batch", &["batch"]),
    ("step.seq", &["seq"]),
    ("step.grad_accum", &["grad_accum"]),
    ("step.precision", &["precision"]),
    ("step.optim.beta1", &["betas"]),
    ("step.optim.beta2", &["betas"]),
    ("step.optim.weight_decay", &["weight_decay"]),
    ("step.optim.clip", &["clip"]),
    ("step.checkpoint", &["checkpoint", "memory"]),
    ("step.fuse", &["no_fuse"]),
    ("step.device", &["device"]),
    ("step.interpreter", &["interpreter"]),
    ("step.cuda.tf32", &["tf32"]),
    ("step.cuda.no_graph", &["no_cuda_graph"]),
    ("step.cuda.general_kernels", &["general_kernels"]),
    ("step.cuda.no_variants", &["no_variant"]),
    ("step.ranks", &["ranks"]),
    ("step.zero", &["zero"]),
    ("train.data", &["data"]),
    ("train.steps", &["steps"]),
    ("train.lr", &["lr"]),
    ("train.schedule", &["schedule"]),
    ("train.warmup", &["warmup"]),
    ("train.min_lr", &["min_lr"]),
    ("train.shuffle", &["shuffle"]),
    ("train.seed", &["seed"]),
    ("train.init_adapter", &["init_adapter"]),
    ("train.scale_lr", &["scale_lr"]),
    ("train.scale_init", &["scale_init"]),
    ("train.examples.template", &["template"]),
    ("train.examples.train_on", &["train_on"]),
    ("train.examples.pack", &["no_pack"]),
    ("train.examples.skip_bad_records", &["skip_bad_records"]),
];

/// The options that set `field` or anything inside it.
fn options_of(field: &str) -> impl Iterator<Item = &'static str> + '_ {
    let within = move |key: &str| {
        field == key
            || field.strip_prefix(key).is_some_and(|r| r.starts_with('.'))
            || key.strip_prefix(field).is_some_and(|r| r.starts_with('.'))
    };
    FIELD_OPTIONS.into_iter().filter(move |(key, _)| within(key)).flat_map(|(_, ids)| ids.iter().copied())
}

/// The configuration of the resumed run: `saved`, where `now` (the command line's, defaults
/// filled in) agrees with it on every field that an option given sets.
pub fn reconcile(saved: RunConfig, now: &RunConfig, given: &Given, dir: &Path) -> anyhow::Result<RunConfig> {
    for (field, was, is) in config::differences(&saved, now) {
        if let Some(flag) = options_of(&field).find(|id| given.has(id)) {
            let flag = if flag == "model" { "MODEL".to_string() } else { format!("--{}", flag.replace('_', "-")) };
            anyhow::bail!(
                "--resume {}: the run was started with {field} {was}, not {is} ({flag}); resume with the options it was started with, or without them",
                dir.display()
            );
        }
    }
    Ok(saved)
}

/// The steps a saved run has done.
pub fn read_progress(dir: &Path) -> anyhow::Result<Progress> {
    let p = dir.join(PROGRESS);
    let bytes = std::fs::read(&p).with_context(|| format!("{}: no resume state", p.display()))?;
    let text = crate::input::text(&bytes).map_err(|why| anyhow::anyhow!("{}: not a qatc resume state: {why}", p.display()))?;
    let progress: Progress = serde_json::from_str(text).with_context(|| format!("{}: not a qatc resume state", p.display()))?;
    Ok(progress)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_field_names_the_options_that_set_it() {
        let of = |f: &str| options_of(f).collect::<Vec<_>>();
        assert_eq!(of("train.lr"), ["lr"]);
        assert_eq!(of("model.quant.modules.h.0.mlp.c_fc.bits"), ["bits_map"]);
        assert_eq!(of("model.lora.r"), ["lora"]);
        assert_eq!(of("model.quant").len(), 8, "a quantization added or removed: any quantization option");
        assert_eq!(of("step.optim.beta1"), ["betas"]);
        assert!(of("step.optim.eps").is_empty(), "no option sets eps: always the saved run's");
        assert!(of("model.quant.bitsx").is_empty(), "a prefix of a word is not a parent");
    }
}
