//! The CUDA C of every configuration the CLI accepts compiles to machine code: the four schemes
//! x (LoRA, full fine-tune, `--qat merged`) x (as is, `--no-fuse`, `--act-bits 8`,
//! `--grad-accum 2`, `--checkpoint blocks`, `--scales learned`, `--precision bf16`, `--precision
//! fp16`, `--optim adamw8bit`), on the tiny model fixture, each step built from the
//! command line exactly as `qatc compile` parses it. Kernels are deduplicated by name (a hash of
//! their source) across configurations and compiled once each for sm_90, in parallel, through
//! the tests' kernel cache; the test prints how long building the steps and compiling took.

mod common;

use std::collections::BTreeMap;
use std::time::Instant;

use clap::Parser;
use qatc::cli::StepArgs;
use qatc::model::Model;
use qatc::step;
use qatc_kernels::nvrtc::{Arch, KernelCache};
use qatc_kernels::CudaKernel;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    step: StepArgs,
}

const SCHEMES: [&str; 4] = ["sym", "asym", "nf4", "q4_0"];
const MODES: [(&str, &[&str]); 3] =
    [("lora", &["--lora", "r=4"]), ("full", &["--full-finetune"]), ("merged", &["--lora", "r=4", "--qat", "merged"])];
const VARIANTS: [(&str, &[&str]); 9] = [
    ("fused", &[]),
    ("no-fuse", &["--no-fuse"]),
    ("act-bits", &["--act-bits", "8"]),
    ("grad-accum", &["--grad-accum", "2"]),
    ("checkpoint", &["--checkpoint", "blocks"]),
    ("learned-scales", &["--scales", "learned"]),
    ("bf16", &["--precision", "bf16"]),
    ("fp16", &["--precision", "fp16"]),
    ("adamw8bit", &["--optim", "adamw8bit"]),
];

#[test]
fn every_configuration_the_cli_accepts_compiles_for_sm_90() {
    let m = Model::open(&common::fixture("tiny/f32_prefix/model.safetensors")).expect("the tiny model");
    let t0 = Instant::now();
    let mut kernels: BTreeMap<String, CudaKernel> = BTreeMap::new();
    let mut configs = 0;
    let mut launches = 0;
    for scheme in SCHEMES {
        for (mode, mode_args) in MODES {
            for (variant, variant_args) in VARIANTS {
                let what = format!("{scheme}/{mode}/{variant}");
                let mut argv = vec!["qatc", "--batch", "2", "--seq", "16", "--bits", "4", "--group", "32", "--scheme", scheme];
                argv.extend_from_slice(mode_args);
                argv.extend_from_slice(variant_args);
                let cli = Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("{what}: the CLI refuses {argv:?}: {e}"));
                let o = cli.step.options(m.ckpt.path()).unwrap_or_else(|e| panic!("{what}: {e}"));
                let (g, _) = step::train(&m.cfg, &o, |_, _| {}).unwrap_or_else(|e| panic!("{what}: the step: {e}"));
                let (prog, ks) = qatc_kernels::cuda_kernels(&g, &qatc_kernels::Target::of(qatc_kernels::TargetKind::Cuda))
                    .unwrap_or_else(|e| panic!("{what}: code generation: {e}"));
                launches += prog.launches();
                configs += 1;
                for k in ks {
                    kernels.entry(k.name.clone()).or_insert(k);
                }
            }
        }
    }
    let built_s = t0.elapsed().as_secs_f64();
    eprintln!(
        "{configs} configurations, {launches} launches, {} distinct kernels; steps built and lowered in {built_s:.1} s",
        kernels.len()
    );
    assert_eq!(configs, SCHEMES.len() * MODES.len() * VARIANTS.len());
    let Some(nv) = common::nvrtc::nvrtc() else { return };
    let all: Vec<CudaKernel> = kernels.into_values().collect();
    let (_, report) = common::nvrtc::build(&nv, "cli-matrix", &all, Arch::SM90, Some(&common::nvrtc::test_cache()));
    eprintln!("{}", report.summary());
    let spilling: Vec<&str> = report.entries.iter().filter(|e| e.resources.is_some_and(|r| r.spills())).map(|e| e.name.as_str()).collect();
    eprintln!("spilling: {spilling:?}");
    // the cache key is the kernel's full input: two configurations sharing a kernel share its entry
    let keys: std::collections::HashSet<String> = all
        .iter()
        .map(|k| KernelCache::key(nv.version, Arch::SM90, &qatc_kernels::nvrtc::Nvrtc::options(Arch::SM90, true), &k.source))
        .collect();
    assert_eq!(keys.len(), all.len(), "distinct sources, distinct keys");
}
