//! Memory figures of the executed plan (issue 17) for bench/RESULTS.md, as markdown:
//! 1. the peak before and after the chunked linear + cross-entropy (the fusion rules
//!    `xent-linear` and `xent-linear-fwd` off, then on) on the demo step and on GPT-2 124M
//!    B 8 T 1024 with `--checkpoint blocks`, for the CPU and the CUDA executor;
//! 2. `qatc plan --fit` for GPT-2 124M, 355M, 774M and 1.5B at 24 GiB and 80 GiB, 4-bit + LoRA
//!    and full fine-tune, on the CUDA executor's layout: the fastest configuration that fits,
//!    or what the smallest plan holds;
//! 3. (`replay` only) `--fit`'s search at T 1024, 4-bit + LoRA, an H100's memory, on the CPU and
//!    the CUDA executor's layout, with each configuration's fused step reused across batch sizes
//!    (`qatc::memory::replay`) and without: plans, reused, seconds, the tables compared.
//!
//! Graphs are built from each size's config (shapes only). Run:
//! `cargo run --release --example bench_memory [-- chunking|fit|replay]`.

use std::time::Instant;

use qatc::cli::options::{model_options, QuantArgs};
use qatc::frontend::config::Gpt2Config;
use qatc::memory::fit;
use qatc::step::{self, StepOptions};
use qatc_driver::{Options, Target};
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::LoraOptions;
use qatc_passes::plan::units::human;
use qatc_passes::remat::Checkpoint;

const GIB: usize = 1 << 30;

fn options(b: usize, t: usize, scheme: &str, group: usize, lora: bool) -> anyhow::Result<StepOptions> {
    let mut o = StepOptions::new(b, t);
    o.model = if lora {
        let q = QuantArgs { bits: Some(4), group: Some(group), scheme: qatc_ir::QuantScheme::from_name(scheme), ..Default::default() };
        model_options(&q, Some(LoraOptions::new(16)), false, true)?
    } else {
        model_options(&QuantArgs::default(), None, true, true)?
    };
    o.fuse = Some(FuseOptions::default());
    Ok(o)
}

fn chunking() -> anyhow::Result<()> {
    let demo = Gpt2Config { n_embd: 128, n_layer: 4, n_head: 4, n_positions: 256, vocab_size: 50257, layer_norm_epsilon: 1e-5 };
    let g124 = Gpt2Config::preset("124M").ok_or_else(|| anyhow::anyhow!("no 124M preset"))?;
    let mut big = options(8, 1024, "sym", 64, true)?;
    big.checkpoint = Checkpoint::Blocks;
    let cases = [
        ("demo (B 4 T 128, Q4_0 g32 + LoRA 16)", demo, options(4, 128, "q4_0", 32, true)?),
        ("GPT-2 124M B 8 T 1024, 4-bit g64 + LoRA 16, blocks", g124, big),
    ];
    println!("| step | device | logits (B x T x V, f32) | peak, logits whole | peak, chunked | chunking |");
    println!("|---|---|---|---|---|---|");
    for (label, cfg, o) in cases {
        for target in [Target::cpu(), Target::cuda(None, Default::default())] {
            let mut peaks = Vec::new();
            let mut chunks = String::new();
            for chunked in [false, true] {
                let mut o = o.clone();
                if !chunked {
                    o.fuse = Some(FuseOptions { disabled: vec!["xent-linear".into(), "xent-linear-fwd".into()], ..FuseOptions::default() });
                }
                let (g, _) = step::train(&cfg, &o, |_, _| {})?;
                let e = qatc_driver::plan(&g, &target, &Options::default())?;
                peaks.push(e.plan.peak_bytes());
                if chunked {
                    chunks = e.program.cross_entropy.first().map(qatc::memory::chunking_line).unwrap_or_default();
                }
            }
            let logits = 4 * o.batch * o.seq * cfg.vocab_size;
            println!("| {label} | {} | {} | {} | {} | {chunks} |", target.kind.name(), human(logits), human(peaks[0]), human(peaks[1]));
        }
    }
    Ok(())
}

fn fits() -> anyhow::Result<()> {
    println!(
        "| model | training | memory | fastest that fits (B, checkpoint) | precision | optim | tokens/step | recompute | peak | largest B fp32 + adamw | fitting configurations | plans | s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for size in ["124M", "355M", "774M", "1.5B"] {
        let cfg = Gpt2Config::preset(size).ok_or_else(|| anyhow::anyhow!("no {size} preset"))?;
        for lora in [true, false] {
            for memory in [24 * GIB, 80 * GIB] {
                let t0 = Instant::now();
                let o = options(1, 1024, "sym", 64, lora)?;
                // precision and optimizer searched, as `qatc plan --fit` without --precision/--optim
                let cuda = Target::cuda(None, Default::default());
                let f = fit::search(&cfg, &o, fit::Pinned::default(), memory, 64, &cuda, &Options::default())?;
                let plain = f.fits.iter().filter(|c| c.precision == "fp32" && c.optim == "adamw").map(|c| c.batch).max();
                let plain = plain.map_or("-".to_string(), |b| b.to_string());
                let what = if lora { "4-bit g64 + LoRA 16" } else { "full fine-tune (f32)" };
                let secs = t0.elapsed().as_secs_f64();
                match (f.fits.first(), &f.smallest) {
                    (Some(c), _) => println!(
                        "| {size} | {what} | {} | B {}, {} | {} | {} | {} | {:.1}% | {} | {plain} | {} | {} | {secs:.0} |",
                        human(memory),
                        c.batch,
                        c.checkpoint,
                        c.precision,
                        c.optim,
                        c.tokens,
                        100.0 * c.recompute_share,
                        human(c.peak_bytes),
                        f.fits.len(),
                        f.tried
                    ),
                    (None, Some((c, e))) => {
                        println!(
                            "| {size} | {what} | {} | {} | | | | | | - | 0 | {} | {secs:.0} |",
                            human(memory),
                            fit::why_not(c, e, cuda.step_budget(memory)),
                            f.tried
                        )
                    }
                    (None, None) => {
                        println!("| {size} | {what} | {} | no plan | | | | | | - | 0 | {} | {secs:.0} |", human(memory), f.tried)
                    }
                }
            }
        }
    }
    Ok(())
}

fn replay() -> anyhow::Result<()> {
    println!("| model | executor | plans | reused | s without reuse | s with | ratio | same table |");
    println!("|---|---|---|---|---|---|---|---|");
    let memory = 80 * GIB;
    for size in ["124M", "355M", "774M", "1.5B"] {
        let cfg = Gpt2Config::preset(size).ok_or_else(|| anyhow::anyhow!("no {size} preset"))?;
        let o = options(1, 1024, "sym", 64, true)?;
        for target in [Target::cpu(), Target::cuda(None, Default::default())] {
            let run = |replay: bool| -> anyhow::Result<(fit::Fit, f64)> {
                let t0 = Instant::now();
                let s = fit::Shortcuts { prune: true, replay };
                let f = fit::search_with(&cfg, &o, fit::Pinned::default(), memory, 256, &target, &Options::default(), s, &|_| {})?;
                Ok((f, t0.elapsed().as_secs_f64()))
            };
            let (plain, s0) = run(false)?;
            let (reused, s1) = run(true)?;
            let same = fit::table(&plain, size, memory, &target) == fit::table(&reused, size, memory, &target);
            println!(
                "| {size} | {} | {} | {} | {s0:.1} | {s1:.1} | {:.2} | {} |",
                target.kind.name(),
                reused.tried,
                reused.reused,
                s1 / s0,
                if same { "yes" } else { "NO" }
            );
        }
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let which = std::env::args().nth(1);
    if which.as_deref() == Some("replay") {
        return replay();
    }
    if which.as_deref() != Some("fit") {
        chunking()?;
    }
    if which.as_deref() != Some("chunking") {
        fits()?;
    }
    Ok(())
}
