//! `qatc dump MODEL --after STAGE`: prints the IR after a named stage of the pipeline.

use std::path::PathBuf;

use qatc_ir::{print, Graph};

use super::StepArgs;
use crate::step::{self, Stage};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The checkpoint (not needed with --list).
    #[arg(required_unless_present = "list")]
    pub model: Option<PathBuf>,
    /// The stage after which to print.
    #[arg(long, value_enum, default_value_t = Stage::Lower)]
    pub after: Stage,
    /// List the stages and exit.
    #[arg(long)]
    pub list: bool,
    #[command(flatten)]
    pub step: StepArgs,
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    if a.list {
        for st in Stage::ALL {
            println!("{:<12} {}", st.name(), st.about());
        }
        // a step of the trainer's setup: it reads data and weights and gives the scale inputs'
        // values, so it has no graph to print after it
        println!("{:<12} {}", crate::calibrate::NAME, crate::calibrate::ABOUT);
        return Ok(());
    }
    let Some(model) = &a.model else { anyhow::bail!("qatc dump needs MODEL (or --list)") };
    let m = super::open_model(model, &a.step.read)?;
    super::check_seq(&m, a.step.batch, a.step.seq)?;
    let opts = a.step.options(model)?;
    let mut found: Option<Graph> = None;
    step::train(&m.cfg, &opts, |name, g| {
        if name == a.after {
            found = Some(g.clone());
        }
    })?;
    match found {
        Some(g) => print!("{}", print(&g)),
        None => anyhow::bail!("stage `{}` did not run with these options (fake_quant needs --bits, lora --lora, clip --clip, data_parallel --ranks 2 or more, zero --zero 3 with them)", a.after),
    }
    Ok(())
}
