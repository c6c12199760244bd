//! `qatc plan --fit` (in progress).
use qatc_runtime::exec::Device;
use qatc_runtime::CpuOptions;

use crate::frontend::config::Gpt2Config;
use crate::step::StepOptions;

#[allow(clippy::too_many_arguments)]
pub fn run(
    _a: &crate::cli::plan::Args,
    _cfg: &Gpt2Config,
    _name: &str,
    _opts: &StepOptions,
    _memory: Option<usize>,
    _device: Device,
    _cpu: &CpuOptions,
) -> anyhow::Result<()> {
    anyhow::bail!("--fit: TODO")
}
