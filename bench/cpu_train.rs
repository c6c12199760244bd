//! CPU training throughput of the compiled step against PyTorch eager (../shared/tools/torch_peer.py)
//! on the same config: 4 layers, n_embd 256, 4 heads, vocab 50257, B 4, T 128, 4-bit g64,
//! LoRA r 16 on all linears (weights random: speed does not depend on them).
//! Run: `cargo run --release --example bench_cpu_train -- [steps] [compiled|interpreter] [small|124m|demo] [flags]`
//! (124m: GPT-2 124M's shapes at B 1, T 256; demo: the embedded Shakespeare model's shapes, as
//! `make demo` trains it, B 4, T 128, 4-bit q4_0 g32, LoRA r 16; bench/run.sh runs qatc's engines
//! and the PyTorch peers). Flags, the CPU executor's settings (`CpuOptions`):
//!   --profile          print where one step's time goes (per kernel family and GEMM shape)
//!   --profile-kernels  ... per kernel
//!   --no-blas          the gemm crate only, no OpenBLAS
//!   --blas-lib PATH    another BLAS library
//!   --panel-kib N      dequantized weight panels of N KiB (0: whole weights)
//!   --attention-kernels  attention as the generated per-row programs, not GEMMs
//!   --vector-width N   LLVM's preferred vector width in bits
//!   --host-round-trip  copy the parameters and moments out and back in every step (the trainer
//!                      before its state stayed in the executor), to measure what that cost
//!   --full-finetune    train every weight (f32, no quantization, no LoRA) instead
//!   --precision P      fp32 (default), bf16 or fp16 (`--precision` of `qatc train`)
//!   --unchunked-xent   the logits materialized whole (the chunked linear + cross-entropy's
//!                      fusion rules off), to compare the chunked step against the step before it
//!   --batch B          the batch size instead of the config's (bench/cpu_peers.sh: 124M at B 4)
//!   --memory SIZE      `qatc train --memory`: the plan may use this much, the chunked
//!                      cross-entropy's rows grow within it

use std::time::Instant;

use qatc::cli::options::{model_options, QuantArgs};
use qatc::data::TokenFile;
use qatc::frontend::checkpoint::write_synthetic;
use qatc::frontend::config::Gpt2Config;
use qatc::model::Model;
use qatc::step::StepOptions;
use qatc::trainer::Trainer;
use qatc_ir::DType;
use qatc_passes::lora::LoraOptions;
use qatc_passes::precision::Precision;
use qatc_runtime::cpu::{CpuAttention, CpuOptions};

/// The flags after the positional arguments.
struct Flags {
    cpu: CpuOptions,
    profile: bool,
    round_trip: bool,
    full_finetune: bool,
    precision: Precision,
    unchunked_xent: bool,
    batch: Option<usize>,
    memory: Option<usize>,
}

fn flags(args: &[String]) -> anyhow::Result<Flags> {
    let mut f = Flags {
        cpu: CpuOptions::default(),
        profile: false,
        round_trip: false,
        full_finetune: false,
        precision: Precision::Fp32,
        unchunked_xent: false,
        batch: None,
        memory: None,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or_else(|| anyhow::anyhow!("{a} needs a value"));
        match a.as_str() {
            "--profile" => f.profile = true,
            "--profile-kernels" => (f.profile, f.cpu.profile_by_kernel) = (true, true),
            "--no-blas" => f.cpu.blas = None,
            "--blas-lib" => f.cpu.blas = Some(value()?.clone()),
            "--panel-kib" => f.cpu.panel_bytes = value()?.parse::<usize>()? * 1024,
            "--attention-kernels" => f.cpu.attention = CpuAttention::Kernels,
            "--vector-width" => f.cpu.vector_width = Some(value()?.parse()?),
            "--host-round-trip" => f.round_trip = true,
            "--full-finetune" => f.full_finetune = true,
            "--precision" => f.precision = <Precision as clap::ValueEnum>::from_str(value()?, true).map_err(anyhow::Error::msg)?,
            "--unchunked-xent" => f.unchunked_xent = true,
            "--batch" => f.batch = Some(value()?.parse()?),
            "--memory" => f.memory = Some(qatc_passes::plan::units::parse_memory(value()?).map_err(anyhow::Error::msg)?),
            other => anyhow::bail!("unknown flag {other}"),
        }
    }
    Ok(f)
}

fn main() -> anyhow::Result<()> {
    // as `qatc`'s main: the GEMM libraries' settings made before any thread starts
    for (name, value) in qatc_runtime::cpu::library_env() {
        if std::env::var_os(name).is_none() {
            std::env::set_var(name, value);
        }
    }
    let args: Vec<String> = std::env::args().collect();
    let positional = args.iter().skip(1).take_while(|a| !a.starts_with("--")).count();
    let f = flags(&args[1 + positional..])?;
    let steps: usize = args.get(1).filter(|_| positional >= 1).and_then(|s| s.parse().ok()).unwrap_or(10);
    let interpreter = match args.get(2).filter(|_| positional >= 2).map(String::as_str) {
        None | Some("compiled") => false,
        Some("interpreter") => true,
        Some(other) => anyhow::bail!("engine must be compiled or interpreter, got {other}"),
    };
    let small = Gpt2Config { n_embd: 256, n_layer: 4, n_head: 4, n_positions: 1024, vocab_size: 50257, layer_norm_epsilon: 1e-5 };
    let demo = Gpt2Config { n_embd: 128, n_layer: 4, n_head: 4, n_positions: 256, vocab_size: 50257, layer_norm_epsilon: 1e-5 };
    // the two CPU configs: the small model at B 4 T 128, GPT-2 124M at B 1 T 256; and
    // the demo's model (examples/gpt2-shakespeare-small's shapes) as `make demo` trains it
    let (cfg, b, t, label, scheme, group) = match args.get(3).filter(|_| positional >= 3).map(String::as_str) {
        None | Some("small") => (small, 4, 128, "small", "sym", 64),
        Some("124m") => (Gpt2Config::preset("124M").ok_or_else(|| anyhow::anyhow!("no 124M preset"))?, 1, 256, "124m", "sym", 64),
        Some("demo") => (demo, 4, 128, "demo", "q4_0", 32),
        Some(other) => anyhow::bail!("model must be small, 124m or demo, got {other}"),
    };
    let b = f.batch.unwrap_or(b);
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("model.safetensors");
    write_synthetic(&path, &cfg, DType::F32, false, 7)?;
    let m = Model::open(&path)?;
    let tokens: Vec<u16> = (0..(steps + 1) * b * t + 1).map(|i| ((i * 7919) % 50257) as u16).collect();
    let data = TokenFile::from_tokens(&path, tokens);
    let q = QuantArgs { bits: Some(4), group: Some(group), scheme: qatc_ir::QuantScheme::from_name(scheme), ..Default::default() };
    let mut o = StepOptions::new(b, t);
    o.model = if f.full_finetune {
        model_options(&QuantArgs::default(), None, true, true)?
    } else {
        model_options(&q, Some(LoraOptions::new(16)), false, true)?
    };
    // as `qatc train` builds it: fused by egg
    let mut fuse = qatc_passes::fusion::FuseOptions::default();
    if f.unchunked_xent {
        fuse.disabled = vec!["xent-linear".into(), "xent-linear-fwd".into()];
    }
    o.fuse = Some(fuse);
    o.precision = f.precision;
    let t0 = Instant::now();
    let target = qatc_driver::Target::cpu();
    let room = f.memory.map(|m| target.step_budget(m));
    let options = qatc_driver::Options { interpreter, cpu: f.cpu.clone(), room, ..Default::default() };
    let mut tr = Trainer::with_target(&m, o, None, 0, &target, &options)?;
    let build_s = t0.elapsed().as_secs_f64();
    tr.step(&data, 0, 1e-3)?; // warm-up step, not timed
    eprintln!("{}", tr.describe());
    tr.set_profile(f.profile);
    let mut times = Vec::new();
    for s in 1..=steps {
        let t0 = Instant::now();
        if f.round_trip {
            // what every step cost before the state stayed in the executor: the parameters and
            // moments out, and in again
            for (name, t) in tr.persistent()? {
                tr.set_input(&name, qatc_runtime::Value::Float(t))?;
            }
        }
        tr.step(&data, s, 1e-3)?;
        times.push(t0.elapsed().as_secs_f64());
    }
    times.sort_by(|a, b| a.total_cmp(b));
    if let Some(table) = tr.profile().and_then(|p| p.table("step", 25)) {
        eprint!("{table}");
    }
    let med = times[times.len() / 2];
    println!(
        "{{\"peer\": \"qatc-{}{}\", \"model\": \"{label}{}\", \"batch\": {b}, \"seq\": {t}, \"precision\": \"{}\", \"steps\": {steps}, \"step_s_median\": {med:.4}, \"step_s_min\": {:.4}, \"tokens_per_s\": {:.1}, \"build_s\": {build_s:.2}, \"memory\": {}}}",
        if interpreter { "interpreter" } else { "compiled" },
        match (f.round_trip, f.unchunked_xent) {
            (true, _) => "-host-round-trip",
            (false, true) => "-unchunked-xent",
            (false, false) => "",
        },
        if f.full_finetune { "-full-finetune" } else { "" },
        f.precision,
        times[0],
        (b * t) as f64 / med,
        f.memory.map_or("null".to_string(), |m| m.to_string())
    );
    Ok(())
}
