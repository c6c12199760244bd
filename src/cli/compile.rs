//! `qatc compile MODEL -o OUT`: lowers the checkpoint, builds the training step, and writes
//! `forward.qir`, `train.qir` and `manifest.json` into OUT (all or nothing).

use std::path::PathBuf;

use anyhow::Context;
use qatc_ir::print;

use crate::artifacts::OutDir;
use crate::manifest::{sizes, Manifest};
use crate::step;
use super::StepArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The GPT-2 checkpoint (`model.safetensors`; `config.json` beside it is read when present).
    pub model: PathBuf,
    /// Output directory.
    #[arg(short, long, default_value = "out")]
    pub out: PathBuf,
    #[command(flatten)]
    pub step: StepArgs,
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let m = super::open_model(&a.model)?;
    super::check_seq(&m, a.step.batch, a.step.seq)?;
    let opts = a.step.options()?;
    let mut fwd_text = String::new();
    let (train, reports) = step::train(&m.cfg, &opts, |stage, g| {
        if stage == "lower" {
            fwd_text = print(g);
        }
    })?;
    let fwd_nodes = fwd_text.lines().filter(|l| l.trim_start().starts_with('%')).count();
    let (groups, trainable, frozen) = sizes(&m, &train);
    let artifacts = vec!["forward.qir", "train.qir", "manifest.json"];
    let manifest = Manifest {
        qatc_version: env!("CARGO_PKG_VERSION"),
        model: a.model.display().to_string(),
        config: &m.cfg,
        config_source: match &m.config_source {
            crate::frontend::config::ConfigSource::File(p) => p.display().to_string(),
            crate::frontend::config::ConfigSource::Inferred => "inferred from tensor shapes".into(),
        },
        batch: opts.batch,
        seq: opts.seq,
        params_total: groups.values().map(|g| g.params).sum(),
        params_by_group: groups.clone(),
        trainable: trainable.clone(),
        frozen: frozen.clone(),
        passes: reports.iter().collect(),
        artifacts: artifacts.clone(),
    };
    let out = OutDir::create(&a.out, "manifest.json").with_context(|| format!("{}", a.out.display()))?;
    out.write("forward.qir", &fwd_text)?;
    out.write("train.qir", print(&train))?;
    out.write("manifest.json", serde_json::to_string_pretty(&manifest)? + "\n")?;
    let dir = out.commit().with_context(|| format!("{}", a.out.display()))?;

    let c = &m.cfg;
    println!(
        "qatc: GPT-2 {} layers, n_embd {}, {} heads, vocab {}, context {}; B {} T {}",
        c.n_layer, c.n_embd, c.n_head, c.vocab_size, c.n_positions, opts.batch, opts.seq
    );
    println!("  parameters  {:>12}  ({})", manifest.params_total, human_bytes(groups.values().map(|g| g.stored_bytes).sum()));
    println!("  trainable   {:>12}  ({})", trainable.params, human_bytes(trainable.stored_bytes));
    println!("  frozen      {:>12}  ({})", frozen.params, human_bytes(frozen.stored_bytes));
    println!("  forward graph {fwd_nodes} nodes; training step {} nodes", train.len());
    for r in &reports {
        println!("  pass {r}");
    }
    println!("  wrote {}/{{{}}}", dir.display(), artifacts.join(", "));
    Ok(())
}

pub fn human_bytes(b: usize) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", units[u])
    }
}
