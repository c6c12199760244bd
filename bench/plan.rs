//! Memory-plan benchmarks (issue: rematerialization and memory planning). Prints markdown
//! tables for bench/RESULTS.md:
//! 1. GPT-2 124M, B 8, T 1024, 4-bit + LoRA r=16 under every policy: peak, arena vs lower bound,
//!    activation bytes (to compare with PyTorch's saved-for-backward bytes), recompute FLOPs;
//! 2. the recompute-FLOPs vs memory curve of `budget=` against `blocks` and `sqrt`;
//! 3. planning time (pipeline + remat + plan) for the four GPT-2 sizes;
//! 4. what fits where: the smallest plan and what `auto` picks for a few memory sizes.
//!
//! Graphs are built from each size's config (shapes only). Run:
//! `cargo run --release --example bench_plan [-- --quick]`.

use std::time::Instant;

use qatc::frontend::config::Gpt2Config;
use qatc::step::{self, StepOptions};
use qatc_ir::{QuantScheme, QuantSpec};
use qatc_passes::lora::LoraOptions;
use qatc_passes::plan::units::human;
use qatc_passes::plan::{self, Category, Plan};
use qatc_passes::quant::QuantOptions;
use qatc_passes::remat::Checkpoint;

const GIB: usize = 1 << 30;

fn options(b: usize, t: usize, c: Checkpoint) -> StepOptions {
    let mut o = StepOptions::new(b, t);
    o.model.full_finetune = false;
    o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 64, scheme: QuantScheme::Sym }));
    o.model.lora = Some(LoraOptions::new(16));
    o.checkpoint = c;
    o
}

/// Pipeline (with remat) + plan, and the seconds it took; None when the budget cannot fit.
fn planned(cfg: &Gpt2Config, b: usize, t: usize, c: Checkpoint) -> Option<(Plan, f64)> {
    let t0 = Instant::now();
    let (g, _) = step::train(cfg, &options(b, t, c), |_, _| {}).ok()?;
    let p = plan::plan(&g, &Default::default()).expect("plan");
    let s = t0.elapsed().as_secs_f64();
    p.verify().expect("a sound plan");
    Some((p, s))
}

fn activations_max(p: &Plan) -> usize {
    let k = Category::ALL.iter().position(|&c| c == Category::Activations).unwrap_or(0);
    p.profile.iter().map(|r| r[k]).max().unwrap_or(0)
}

fn gf(f: u64) -> String {
    format!("{:.0}", f as f64 / 1e9)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let c124 = Gpt2Config::preset("124M").expect("preset");
    let (b, t) = (8, 1024);

    println!("### 1. GPT-2 124M, B {b}, T {t}, 4-bit sym g64 + LoRA r=16\n");
    println!("| --checkpoint | peak | inputs | arena | lower bound | ratio | activations (max live) | recompute GFLOP | of the step |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let none = planned(&c124, b, t, Checkpoint::None).expect("none").0;
    let blocks = planned(&c124, b, t, Checkpoint::Blocks).expect("blocks").0;
    let policies = [
        ("none", Checkpoint::None),
        ("blocks", Checkpoint::Blocks),
        ("sqrt", Checkpoint::Sqrt),
        ("budget=4GiB", Checkpoint::Budget(4 * GIB)),
        ("budget=8GiB", Checkpoint::Budget(8 * GIB)),
    ];
    for (name, c) in policies {
        let Some((p, _)) = planned(&c124, b, t, c) else { continue };
        println!(
            "| {name} | {} | {} | {} | {} | {:.4} | {} | {} | {:.1}% |",
            human(p.peak_bytes()),
            human(p.persistent_bytes()),
            human(p.arena_bytes),
            human(p.lower_bound),
            p.ratio(),
            human(activations_max(&p)),
            gf(p.recompute_flops),
            100.0 * p.recompute_flops as f64 / p.total_flops as f64
        );
    }

    println!("\n### 2. Recompute FLOPs against memory (124M, B {b}, T {t})\n");
    println!("| plan | budget | planned peak | recompute GFLOP |");
    println!("|---|---|---|---|");
    let sqrt = planned(&c124, b, t, Checkpoint::Sqrt).expect("sqrt").0;
    println!("| blocks | | {} | {} |", human(blocks.peak_bytes()), gf(blocks.recompute_flops));
    println!("| sqrt | | {} | {} |", human(sqrt.peak_bytes()), gf(sqrt.recompute_flops));
    let (lo, hi) = (blocks.peak_bytes(), none.peak_bytes());
    let n = if quick { 4 } else { 10 };
    for k in 0..=n {
        let m = lo + (hi - lo) * k / n;
        match planned(&c124, b, t, Checkpoint::Budget(m)) {
            Some((p, _)) => println!("| budget | {} | {} | {} |", human(m), human(p.peak_bytes()), gf(p.recompute_flops)),
            None => println!("| budget | {} | does not fit | |", human(m)),
        }
    }

    println!("\n### 3. Planning time (pipeline + remat + plan, seconds, best of 3), B {b}, T {t}, 4-bit + LoRA r=16\n");
    println!("| model | steps (none) | none | blocks | budget=16GiB | auto, --memory 8GiB |");
    println!("|---|---|---|---|---|---|");
    for name in ["124M", "355M", "774M", "1.5B"] {
        let cfg = Gpt2Config::preset(name).expect("preset");
        let mut row = format!("| GPT-2 {name} | {} |", planned(&cfg, b, t, Checkpoint::None).map(|(p, _)| p.steps.len()).unwrap_or(0));
        for c in [Checkpoint::None, Checkpoint::Blocks, Checkpoint::Budget(16 * GIB), Checkpoint::Auto(8 * GIB)] {
            let best = (0..if quick { 1 } else { 3 }).filter_map(|_| planned(&cfg, b, t, c).map(|(_, s)| s)).fold(f64::INFINITY, f64::min);
            row += &if best.is_finite() { format!(" {best:.3} |") } else { " does not fit |".to_string() };
        }
        println!("{row}");
    }

    println!("\n### 4. What fits (B {b}, T {t}, 4-bit + LoRA r=16): peak without recompute, the smallest plan, and `auto`'s recompute share per memory size\n");
    println!("| model | none | smallest (blocks) | 8 GiB | 16 GiB | 24 GiB | 40 GiB | 80 GiB |");
    println!("|---|---|---|---|---|---|---|---|");
    for name in ["124M", "355M", "774M", "1.5B"] {
        let cfg = Gpt2Config::preset(name).expect("preset");
        let none = planned(&cfg, b, t, Checkpoint::None).expect("none").0;
        let small = planned(&cfg, b, t, Checkpoint::Blocks).expect("blocks").0;
        let mut row = format!("| GPT-2 {name} | {} | {} |", human(none.peak_bytes()), human(small.peak_bytes()));
        for m in [8, 16, 24, 40, 80] {
            row += &match planned(&cfg, b, t, Checkpoint::Auto(m * GIB)) {
                Some((p, _)) => format!(" {:.1}% |", 100.0 * p.recompute_flops as f64 / p.total_flops as f64),
                None => " no |".to_string(),
            };
        }
        println!("{row}");
    }
}
