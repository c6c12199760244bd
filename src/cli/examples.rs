//! The options of instruction data (`--data FILE.jsonl`, `--val`): train and eval share them. They
//! become an `instruct::ExampleOptions` here and a `config::ExamplesConfig` (saved in a run's
//! `qatc.json`, so `--resume` reads its data as it was read); given with data that is not a
//! `.jsonl` file they are refused, as they would do nothing.

use std::path::Path;

use crate::config::ExamplesConfig;
use crate::instruct::{is_jsonl, ExampleOptions, Template, TrainOn, DEFAULT_TEMPLATE};

#[derive(clap::Args, Debug, Clone, Default)]
pub struct ExampleArgs {
    /// Instruction data (.jsonl): how a prompt and its completion are joined: alpaca
    /// ("### Instruction:\n{prompt}\n\n### Response:\n{completion}", the default), plain
    /// ("{prompt}{completion}"), or a text holding {prompt} and then {completion} (\n is a newline).
    #[arg(long)]
    pub template: Option<String>,
    /// Instruction data: which tokens the loss counts: the completions and their end-of-text
    /// (default), or all of each example. `{"text"}` records count every token either way.
    #[arg(long, value_enum)]
    pub train_on: Option<TrainOn>,
    /// Instruction data: one example per sequence, padded to T, instead of several packed into
    /// one (attention kept within each example).
    #[arg(long)]
    pub no_pack: bool,
    /// Instruction data: skip bad records (each counted, the first named) instead of stopping at
    /// the first with its file and line.
    #[arg(long)]
    pub skip_bad_records: bool,
}

impl ExampleArgs {
    /// The flags given, by name (to refuse them where they do nothing).
    fn given(&self) -> Vec<&'static str> {
        let flags = [
            (self.template.is_some(), "--template"),
            (self.train_on.is_some(), "--train-on"),
            (self.no_pack, "--no-pack"),
            (self.skip_bad_records, "--skip-bad-records"),
        ];
        flags.into_iter().filter_map(|(on, f)| on.then_some(f)).collect()
    }

    /// The configuration for data `data` (with `val`, a validation file): the flags' (defaults
    /// filled in) when either is a `.jsonl` file, else None; the flags given for data that is
    /// not instruction data are refused.
    pub fn config(&self, data: &Path, val: Option<&Path>) -> anyhow::Result<Option<ExamplesConfig>> {
        if !is_jsonl(data) && !val.is_some_and(is_jsonl) {
            if let Some(f) = self.given().first() {
                anyhow::bail!("{f} is for instruction data (a .jsonl file of records); {} is not one", data.display());
            }
            return Ok(None);
        }
        let c = ExamplesConfig {
            template: self.template.clone().unwrap_or_else(|| DEFAULT_TEMPLATE.into()),
            train_on: self.train_on.unwrap_or_default(),
            pack: !self.no_pack,
            skip_bad_records: self.skip_bad_records,
        };
        c.options().map_err(anyhow::Error::msg)?;
        Ok(Some(c))
    }
}

impl ExamplesConfig {
    /// How the records are read and packed.
    pub fn options(&self) -> Result<ExampleOptions, String> {
        Ok(ExampleOptions {
            template: Template::parse(&self.template)?,
            train_on: self.train_on,
            pack: self.pack,
            skip_bad: self.skip_bad_records,
        })
    }
}

/// The options of data without an instruction configuration (a token file): the defaults, which
/// reading a token file does not use.
pub fn options_of(c: Option<&ExamplesConfig>) -> anyhow::Result<ExampleOptions> {
    match c {
        Some(c) => c.options().map_err(anyhow::Error::msg),
        None => Ok(ExampleOptions::default()),
    }
}
