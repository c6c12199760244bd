//! Kernel fusion on the GPT-2 training step: 4-bit (group 64, sym) + LoRA r=16 on all four
//! linears, B 8, T 1024. Prints kernel launches and bytes moved before and after fusion, their
//! ratio to the bytes an ideal step moves, and the time of saturation + extraction (issue: under
//! 2 s for 124M; 1.5B must complete within the runner's limits).
//! The graphs are built from each size's config (no checkpoint needed).
//! Run: `cargo run --release --example bench_fusion [-- 124M 1.5B]`; with QATC_BENCH_DUMP=DIR the
//! fused steps are written there as `fused_SIZE.qir`.

use std::time::Instant;

use qatc::frontend::config::Gpt2Config;
use qatc::step::{self, StepOptions};
use qatc_ir::{QuantScheme, QuantSpec};
use qatc_passes::fusion::{fuse_graph, FuseOptions};
use qatc_passes::lora::LoraOptions;
use qatc_passes::quant::QuantOptions;

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn main() {
    let mut sizes: Vec<String> = std::env::args().skip(1).collect();
    if sizes.is_empty() {
        sizes = vec!["124M".into(), "1.5B".into()];
    }
    println!("| model | step nodes | kernels before -> after | GiB moved before -> after | ideal GiB | x ideal before -> after | e-nodes | iterations, stop | saturation s | extraction s | fuse total s (median of 3) |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for name in &sizes {
        let Some(cfg) = Gpt2Config::preset(name) else {
            eprintln!("unknown size {name}");
            continue;
        };
        let mut o = StepOptions::new(8, 1024);
        o.model.full_finetune = false;
        o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 64, scheme: QuantScheme::Sym }));
        o.model.lora = Some(LoraOptions::new(16));
        let (g, _) = step::train(&cfg, &o, |_, _| {}).expect("pipeline");
        let mut times = Vec::new();
        let mut last = None;
        for _ in 0..3 {
            let t0 = Instant::now();
            let f = fuse_graph(&g, &FuseOptions::default()).expect("fusion");
            times.push(t0.elapsed().as_secs_f64());
            last = Some(f);
        }
        times.sort_by(|a, b| a.total_cmp(b));
        let Some(f) = last else { continue };
        let r = &f.report;
        let s = &r.saturation;
        println!(
            "| GPT-2 {name} | {} | {} -> {} | {:.2} -> {:.2} | {:.2} | {:.2} -> {:.2} | {} -> {} | {}, {} | {:.2} | {:.2} | {:.2} |",
            g.len(),
            r.kernels_before,
            r.kernels_after,
            gib(r.bytes_before),
            gib(r.bytes_after),
            gib(r.ideal_bytes),
            r.ratio_before_to_ideal(),
            r.ratio_to_ideal(),
            s.start_enodes,
            s.enodes,
            s.iterations,
            s.stop_reason,
            s.time_s,
            r.extraction.time_s,
            times[1]
        );
        if let Ok(dir) = std::env::var("QATC_BENCH_DUMP") {
            // the fused step, for reading what each kernel is
            let path = std::path::Path::new(&dir).join(format!("fused_{name}.qir"));
            if let Err(e) = std::fs::write(&path, qatc_ir::print(&f.graph)) {
                eprintln!("{}: {e}", path.display());
            }
        }
        if name == &sizes[0] {
            let mut fams: Vec<_> = r.families.iter().collect();
            fams.sort_by_key(|f| std::cmp::Reverse(f.1.bytes));
            eprintln!("{name}: traffic by family after fusion (GiB, kernels):");
            for (k, t) in fams.iter().take(25) {
                eprintln!("  {k:<50} {:>8.3} {:>5}", gib(t.bytes), t.kernels);
            }
        }
    }
}
