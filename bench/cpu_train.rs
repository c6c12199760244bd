//! CPU training throughput of the compiled step against PyTorch eager (../shared/tools/torch_peer.py)
//! on the same config: 4 layers, n_embd 256, 4 heads, vocab 50257, B 4, T 128, 4-bit g64,
//! LoRA r 16 on all linears (weights random: speed does not depend on them).
//! Run: `cargo run --release --example bench_cpu_train -- [steps] [compiled|interpreter] [small|124m]`
//! (124m: GPT-2 124M's shapes at B 1, T 256; `QATC_PROFILE=1` prints where one step's time goes)
//! (bench/run.sh runs qatc's engines and the PyTorch peers).

use std::time::Instant;

use qatc::cli::options::{model_options, QuantArgs};
use qatc::data::TokenFile;
use qatc::frontend::checkpoint::write_synthetic;
use qatc::frontend::config::Gpt2Config;
use qatc::model::Model;
use qatc::runner::Engine;
use qatc::step::StepOptions;
use qatc::trainer::Trainer;
use qatc_ir::DType;
use qatc_passes::lora::LoraOptions;

fn main() -> anyhow::Result<()> {
    let steps: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(10);
    let engine = match std::env::args().nth(2).as_deref() {
        None | Some("compiled") => Engine::Compiled,
        Some("interpreter") => Engine::Interpreter,
        Some(other) => anyhow::bail!("engine must be compiled or interpreter, got {other}"),
    };
    // the two CPU configs: the small model at B 4 T 128, GPT-2 124M at B 1 T 256
    let (cfg, b, t, label) = match std::env::args().nth(3).as_deref() {
        None | Some("small") => (
            Gpt2Config { n_embd: 256, n_layer: 4, n_head: 4, n_positions: 1024, vocab_size: 50257, layer_norm_epsilon: 1e-5 },
            4,
            128,
            "small",
        ),
        Some("124m") => (Gpt2Config::preset("124M").ok_or_else(|| anyhow::anyhow!("no 124M preset"))?, 1, 256, "124m"),
        Some(other) => anyhow::bail!("model must be small or 124m, got {other}"),
    };
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("model.safetensors");
    write_synthetic(&path, &cfg, DType::F32, false, 7)?;
    let m = Model::open(&path)?;
    let tokens: Vec<u16> = (0..(steps + 1) * b * t + 1).map(|i| ((i * 7919) % 50257) as u16).collect();
    let data = TokenFile::from_tokens(&path, tokens);
    let q = QuantArgs { bits: Some(4), group: 64, scheme: "sym".into(), qat: "base".into(), ..Default::default() };
    let mut o = StepOptions::new(b, t);
    o.model = model_options(&q, Some(LoraOptions::new(16)), false, true)?;
    // as `qatc train` builds it: fused by egg
    o.fuse = Some(qatc_passes::fusion::FuseOptions::default());
    let t0 = Instant::now();
    let mut tr = Trainer::with_engine(&m, o, None, 0, engine)?;
    let build_s = t0.elapsed().as_secs_f64();
    tr.step(&data, 0, 1e-3)?; // warm-up step, not timed
    eprintln!("{}", tr.describe());
    let mut times = Vec::new();
    for s in 1..=steps {
        let t0 = Instant::now();
        tr.step(&data, s, 1e-3)?;
        times.push(t0.elapsed().as_secs_f64());
    }
    times.sort_by(|a, b| a.total_cmp(b));
    if std::env::var_os("QATC_PROFILE").is_some() {
        if let Some(p) = tr.profile()? {
            let total: f64 = p.iter().map(|x| x.2).sum();
            eprintln!("one step, {total:.3} s:");
            for (what, n, s) in p.iter().take(25) {
                eprintln!("  {:>7.1} ms {:>5.1}%  x{n:<4} {what}", s * 1e3, 100.0 * s / total);
            }
        }
    }
    let med = times[times.len() / 2];
    println!(
        "{{\"peer\": \"qatc-{}\", \"model\": \"{label}\", \"steps\": {steps}, \"step_s_median\": {med:.4}, \"step_s_min\": {:.4}, \"tokens_per_s\": {:.1}, \"build_s\": {build_s:.2}}}",
        if engine == Engine::Compiled { "compiled" } else { "interpreter" },
        times[0],
        (b * t) as f64 / med
    );
    Ok(())
}
