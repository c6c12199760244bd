//! Lowering + verification time for the four GPT-2 sizes (issue: under 50 ms for 124M and 300 ms
//! for 1.5B on a 2-core machine), plus the whole QAT + LoRA training-step pipeline.
//! The graphs are built from each size's config: lowering reads shapes, never weight bytes, so no
//! checkpoint is needed. Run: `cargo run --release --example bench_lower`.

use std::time::Instant;

use qatc::frontend::config::Gpt2Config;
use qatc::step::{self, StepOptions};
use qatc_ir::{QuantScheme, QuantSpec};
use qatc_passes::lora::LoraOptions;
use qatc_passes::quant::QuantOptions;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    println!("| model | forward nodes | lower + verify (ms, median of 7) | QAT+LoRA train nodes | full pipeline (ms, median of 3) |");
    println!("|---|---|---|---|---|");
    for name in ["124M", "355M", "774M", "1.5B"] {
        let Some(cfg) = Gpt2Config::preset(name) else { continue };
        let (b, t) = (8, 1024);
        let mut times = Vec::new();
        let mut nodes = 0;
        for _ in 0..7 {
            let t0 = Instant::now();
            let g = step::forward(&cfg, b, t, false).expect("lower");
            qatc_ir::verify(&g).expect("verify");
            times.push(t0.elapsed().as_secs_f64() * 1e3);
            nodes = g.len();
        }
        let mut o = StepOptions::new(b, t);
        o.model.full_finetune = false;
        o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 64, scheme: QuantScheme::Sym }));
        o.model.lora = Some(LoraOptions::new(16));
        let mut ptimes = Vec::new();
        let mut tnodes = 0;
        for _ in 0..3 {
            let t0 = Instant::now();
            let (g, _) = step::train(&cfg, &o, |_, _| {}).expect("pipeline");
            ptimes.push(t0.elapsed().as_secs_f64() * 1e3);
            tnodes = g.len();
        }
        println!("| GPT-2 {name} | {nodes} | {:.1} | {tnodes} | {:.1} |", median(times), median(ptimes));
    }
}
