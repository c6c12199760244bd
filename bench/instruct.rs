//! The training step on instruction data against plain text (issue 32, 6): one step, three data
//! arms, timed in turn in one process (text, packed, padded, text, ...), so that the load of a
//! shared machine falls on all three alike:
//!   text     the train split's tokens (llm.c windows: the plain cross-entropy, causal attention)
//!   packed   a JSONL file's examples packed (the weighted cross-entropy, position ids, the packed
//!            softmax: attention kept within each example, its scores materialized)
//!   padded   the same file with --no-pack (the weighted cross-entropy, causal attention)
//! The step is the embedded Shakespeare GPT-2's, 4-bit sym g64 + LoRA r=16, B 4 x T 128, fused
//! and compiled for this CPU as `qatc train` runs it.
//! Run: `cargo run --release --example bench_instruct -- FILE.jsonl [rounds] [--profile]`
//! (bench/instruct.sh makes FILE.jsonl from the train split's speeches and runs it).

use std::time::Instant;

use qatc::batches::{Batches, Dataset};
use qatc::instruct::ExampleOptions;
use qatc::model::Model;
use qatc::step::StepOptions;
use qatc::trainer::Trainer;
use qatc_driver::{Options, Target};
use qatc_ir::{QuantScheme, QuantSpec};
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::LoraOptions;
use qatc_passes::quant::QuantOptions;

const B: usize = 4;
const T: usize = 128;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let jsonl = args.first().ok_or_else(|| anyhow::anyhow!("usage: bench_instruct FILE.jsonl [rounds] [--profile]"))?;
    let rounds: usize = args.get(1).and_then(|r| r.parse().ok()).unwrap_or(30);
    let profile = args.iter().any(|a| a == "--profile");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let m = Model::open(&root.join("examples/gpt2-shakespeare-small/model.safetensors"))?;
    let skip = ExampleOptions { skip_bad: true, ..ExampleOptions::default() };
    let arms = [
        ("text", Dataset::load(&root.join("examples/shakespeare_train.bin"), T, &skip)?),
        ("packed", Dataset::load(std::path::Path::new(jsonl), T, &skip)?),
        ("padded", Dataset::load(std::path::Path::new(jsonl), T, &ExampleOptions { pack: false, ..skip.clone() })?),
    ];
    let mut trainers = Vec::new();
    for (name, d) in &arms {
        if let Some(s) = d.summary(B) {
            eprintln!("{name}: {s}");
        }
        let mut o = StepOptions::new(B, T);
        o.model.full_finetune = false;
        o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 64, scheme: QuantScheme::Sym }));
        o.model.lora = Some(LoraOptions::new(16));
        o.model.inputs = d.inputs();
        o.fuse = Some(FuseOptions::default());
        let tr = Trainer::with_target(&m, o, None, 1, &Target::cpu(), &Options::default())?;
        eprintln!("{name}: the step runs {}", tr.describe());
        trainers.push(tr);
    }
    // the first steps compute what later ones hoist, and warm the caches
    for (tr, (_, d)) in trainers.iter_mut().zip(&arms) {
        for s in 0..3 {
            tr.step(d, s, 1e-3)?;
        }
        tr.set_profile(profile);
    }
    let mut times = vec![Vec::new(); arms.len()];
    for r in 0..rounds {
        for (i, (tr, (_, d))) in trainers.iter_mut().zip(&arms).enumerate() {
            let t0 = Instant::now();
            tr.step(d, 3 + r, 1e-3)?;
            times[i].push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    let base = median(&mut times[0].clone());
    println!("{:8} {:>10} {:>10} {:>12} {:>10}", "arm", "median ms", "min ms", "positions/s", "vs text");
    for (i, (name, _)) in arms.iter().enumerate() {
        let med = median(&mut times[i].clone());
        let min = times[i].iter().copied().fold(f64::INFINITY, f64::min);
        println!("{name:8} {med:10.1} {min:10.1} {:12.0} {:>9.2}x", (B * T) as f64 * 1e3 / med, med / base);
    }
    if profile {
        for (tr, (name, _)) in trainers.iter().zip(&arms) {
            if let Some(table) = tr.profile().and_then(|p| p.table("step", 12)) {
                println!("\n{name}:\n{table}");
            }
        }
    }
    Ok(())
}
