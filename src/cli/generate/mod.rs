//! `qatc generate MODEL --prompt TEXT`: text from the model as deployed. With `--adapter` the
//! quantization comes from the adapter's `qatc.json` (as eval and export read it), so what is
//! sampled is the quantized, adapted model the run trained; without one, `--bits` etc. sample a
//! post-training-quantized model, and no flag the checkpoint itself. The passes are compiled like
//! eval's forward (LLVM kernels on the CPU, the CUDA executor on a GPU; `--interpreter` for the
//! reference interpreter) over a KV cache (`decoder.rs`); greedy by default, or sampled
//! (`--temperature`, `--top-k`, `--top-p`, `--seed`); stops at EOS or `--max-new-tokens`.

pub mod decoder;

use std::path::PathBuf;
use std::time::Instant;

use qatc_passes::precision::Precision;

pub use decoder::Decoder;

use super::eval::{engine_name, placement, EvalSetup};
use super::options;
use crate::config::DeviceFlag as Device;
use crate::frontend::config::eos_tokens;
use crate::sample::{Sampler, Sampling};

#[derive(clap::Args, Debug)]
pub struct Args {
    pub model: PathBuf,
    /// The text to continue (GPT-2's BPE; `<|endoftext|>` is token 50256).
    #[arg(long)]
    pub prompt: String,
    /// Generate at most this many tokens (fewer when the model ends the text with EOS).
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// 0: greedy, the likeliest token each time; above 0: sample from the softmax at this
    /// temperature.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Sample only among the K likeliest tokens.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Sample only among the likeliest tokens whose probabilities add up to P (nucleus sampling).
    #[arg(long)]
    pub top_p: Option<f64>,
    /// The sampler's seed: the same seed gives the same text.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Go on past EOS to --max-new-tokens (to time a fixed number of tokens).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON object: the prompt's and the new tokens, the text, why it stopped, the
    /// engine and the timings.
    #[arg(long)]
    pub json: bool,
    // quantization (with --adapter: read from the adapter's qatc.json when it has one)
    #[command(flatten)]
    pub quant: options::QuantArgs,
    /// A PEFT LoRA adapter directory (with the quantization it was trained with, when qatc
    /// trained it).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Where the model runs: auto (a CUDA GPU when qatc can use one, else the CPU), cpu, cuda.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
    /// Run the reference interpreter instead of the compiled passes.
    #[arg(long)]
    pub interpreter: bool,
    /// Print where a decode step's time goes, by kernel family and GEMM shape.
    #[arg(long)]
    pub profile: bool,
    #[command(flatten)]
    pub read: super::ReadArgs,
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Stop {
    /// The model chose an end-of-text token (the last of `tokens`).
    Eos,
    /// `--max-new-tokens` were generated.
    Length,
}

/// What a generation produced, and how long it took.
#[derive(Clone, Debug)]
pub struct Generated {
    /// The new tokens (an EOS that stopped it included, as transformers returns it).
    pub tokens: Vec<u32>,
    pub stop: Stop,
    /// Seconds of the prompt's pass, and of the whole generation (the prompt's pass, every step
    /// and the sampling; not building or compiling the passes).
    pub prompt_secs: f64,
    pub secs: f64,
}

/// Generates up to `max_new` tokens after `prompt`, choosing each with `sampler`, stopping after
/// one of `eos`.
pub fn generate(dec: &mut Decoder, prompt: &[u32], max_new: usize, sampler: &mut Sampler, eos: &[usize]) -> anyhow::Result<Generated> {
    let start = Instant::now();
    let compiled = dec.compile_secs;
    let mut logits = dec.prefill(prompt)?;
    let prompt_secs = start.elapsed().as_secs_f64() - (dec.compile_secs - compiled);
    let mut tokens = Vec::new();
    let stop = loop {
        if let Some(bad) = logits.iter().find(|x| !x.is_finite()) {
            anyhow::bail!(
                "position {} gives a logit of {bad}: the model overflows on this text (finite but huge weights, or non-finite ones let in by --allow-nonfinite); no text",
                dec.filled() - 1
            );
        }
        let next = sampler.next(&logits);
        tokens.push(u32::try_from(next)?);
        if eos.contains(&next) {
            break Stop::Eos;
        }
        if tokens.len() == max_new {
            break Stop::Length;
        }
        logits = dec.step(u32::try_from(next)?)?;
    };
    let secs = start.elapsed().as_secs_f64() - (dec.compile_secs - compiled);
    Ok(Generated { tokens, stop, prompt_secs, secs })
}

/// GPT-2's token ids of `prompt`, checked against the model: at least one, each in its vocabulary.
pub fn prompt_tokens(prompt: &str, vocab_size: usize) -> anyhow::Result<Vec<u32>> {
    let ids = crate::tokenize::encode(prompt).map_err(|e| anyhow::anyhow!("--prompt: GPT-2's tokenizer: {e}"))?;
    if ids.is_empty() {
        anyhow::bail!("--prompt is empty: generation continues a text of at least one token");
    }
    if let Some(&t) = ids.iter().find(|&&t| t as usize >= vocab_size) {
        anyhow::bail!(
            "--prompt: token {t} is beyond the model's vocabulary of {vocab_size}: the model was not trained on GPT-2's tokenizer"
        );
    }
    Ok(ids.into_iter().map(u32::from).collect())
}

/// The text of `tokens`, without a final end-of-text token.
fn text_of(tokens: &[u32], eos: &[usize]) -> anyhow::Result<String> {
    let shown = match tokens.split_last() {
        Some((&last, rest)) if eos.contains(&(last as usize)) => rest,
        _ => tokens,
    };
    let ids: Vec<u16> = shown.iter().map(|&t| u16::try_from(t)).collect::<Result<_, _>>()?;
    crate::tokenize::decode(&ids).map_err(|e| anyhow::anyhow!("decoding the new tokens: {e}"))
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let sampling = Sampling { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p };
    let mut sampler = Sampler::new(sampling, a.seed).map_err(anyhow::Error::msg)?;
    if a.max_new_tokens == 0 {
        anyhow::bail!("--max-new-tokens must be at least 1");
    }
    let m = super::open_model(&a.model, &a.read)?;
    let prompt = prompt_tokens(&a.prompt, m.cfg.vocab_size)?;
    let p = m.cfg.n_positions;
    if prompt.len().saturating_add(a.max_new_tokens) > p {
        anyhow::bail!(
            "--max-new-tokens {}: the prompt's {} tokens and {} new ones are {} positions, beyond the model's context of {p} (n_positions)",
            a.max_new_tokens,
            prompt.len(),
            a.max_new_tokens,
            prompt.len() + a.max_new_tokens
        );
    }
    let eos = if a.ignore_eos { Vec::new() } else { eos_tokens(&m.ckpt, m.cfg.vocab_size)? };
    let mut setup = EvalSetup::new(&a.quant, a.adapter.as_deref(), Precision::Fp32, a.read.allow_nonfinite)?;
    (setup.target, setup.interpreter) = placement(a.device, a.interpreter)?;
    // the last new token is never fed back: the caches hold the prompt and the others
    let mut dec = Decoder::new(&m, &setup, prompt.len() + a.max_new_tokens - 1)?;
    if a.profile {
        dec.profile = Some(Default::default());
    }
    let g = generate(&mut dec, &prompt, a.max_new_tokens, &mut sampler, &eos)?;
    let text = text_of(&g.tokens, &eos)?;
    let rate = g.tokens.len() as f64 / g.secs.max(1e-9);
    if a.json {
        let v = serde_json::json!({
            "prompt_tokens": prompt,
            "tokens": g.tokens,
            "text": text,
            "stop": g.stop,
            "engine": engine_name(&setup),
            "seconds": g.secs,
            "prompt_seconds": g.prompt_secs,
            "compile_seconds": dec.compile_secs,
            "tokens_per_s": rate,
        });
        println!("{}", serde_json::to_string(&v)?);
    } else {
        println!("{}{text}", a.prompt);
    }
    eprintln!("qatc: generate ran {}", dec.description);
    let why = match g.stop {
        Stop::Eos => "stopped at EOS",
        Stop::Length => "stopped at --max-new-tokens",
    };
    eprintln!(
        "qatc: {} tokens in {:.3} s: {rate:.1} tokens/s (the prompt's {} tokens in {:.3} s; {why}; compiled in {:.1} s)",
        g.tokens.len(),
        g.secs,
        prompt.len(),
        g.prompt_secs,
        dec.compile_secs
    );
    if let Some(table) = dec.profile.as_ref().and_then(|p| p.table("token", 12)) {
        eprint!("{table}");
    }
    Ok(())
}
