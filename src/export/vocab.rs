//! GPT-2's byte-level BPE tokenizer as GGUF stores it (`tokenizer.ggml.*`), from the
//! `encoder.json` / `vocab.bpe` pair shipped in `assets/gpt2-bpe/` (see its README for origin
//! and license). They are compiled in, so an export needs no download.
//!
//! llama.cpp sizes its vocabulary from `tokenizer.ggml.tokens` and checks it against
//! token_embd's rows, so the list must have exactly the model's vocab_size entries:
//! - 50257 (every public GPT-2): the real tokenizer, `<|endoftext|>` = 50256 as BOS and EOS.
//! - more (a padded vocab, e.g. llm.c's 50304): the real tokenizer plus `[PAD{i}]` tokens of
//!   type UNUSED, as llama.cpp's own converter pads.
//! - fewer (test models such as the 97-token fixture): GPT-2's first vocab_size - 1 tokens (the
//!   single-byte ones for small sizes) and `<|endoftext|>` as the last id, BOS and EOS, the
//!   convention of GPT-2 and of the fixture's config; only merges whose two parts and result are
//!   all in that list are kept (none below id 256). Such a model has no real tokenizer; this one
//!   is well-formed, so readers load it.

use std::collections::{HashMap, HashSet};

static ENCODER_JSON: &[u8] = include_bytes!("../../assets/gpt2-bpe/encoder.json");
static VOCAB_BPE: &str = include_str!("../../assets/gpt2-bpe/vocab.bpe");

/// GPT-2's vocabulary size and its end-of-text token.
pub const GPT2_VOCAB: usize = 50257;
pub const EOT: &str = "<|endoftext|>";

/// llama.cpp's token types.
pub const TOKEN_NORMAL: i32 = 1;
pub const TOKEN_CONTROL: i32 = 3;
pub const TOKEN_UNUSED: i32 = 5;

#[derive(Clone, Debug, PartialEq)]
pub struct Vocab {
    pub tokens: Vec<String>,
    pub types: Vec<i32>,
    pub merges: Vec<String>,
    pub bos: u32,
    pub eos: u32,
}

/// The tokenizer for a model of `vocab_size` tokens (see the module docs). Errors only if the
/// compiled-in assets are malformed.
pub fn gpt2(vocab_size: usize) -> Result<Vocab, String> {
    let enc: HashMap<String, usize> = serde_json::from_slice(ENCODER_JSON).map_err(|e| format!("assets/gpt2-bpe/encoder.json: {e}"))?;
    let mut all = vec![None; enc.len()];
    for (tok, id) in enc {
        let slot = all.get_mut(id).ok_or_else(|| format!("assets/gpt2-bpe/encoder.json: id {id} out of range"))?;
        *slot = Some(tok);
    }
    let all: Vec<String> = all.into_iter().collect::<Option<_>>().ok_or("assets/gpt2-bpe/encoder.json: ids are not 0..n")?;
    if all.len() != GPT2_VOCAB || all[GPT2_VOCAB - 1] != EOT {
        return Err(format!("assets/gpt2-bpe/encoder.json: {} tokens, want {GPT2_VOCAB} ending in {EOT}", all.len()));
    }
    let (tokens, types, eot): (Vec<String>, Vec<i32>, usize) = if vocab_size >= GPT2_VOCAB {
        let mut t = all;
        t.extend((GPT2_VOCAB..vocab_size).map(|i| format!("[PAD{i}]")));
        let ty = (0..vocab_size)
            .map(|i| match i {
                i if i == GPT2_VOCAB - 1 => TOKEN_CONTROL,
                i if i >= GPT2_VOCAB => TOKEN_UNUSED,
                _ => TOKEN_NORMAL,
            })
            .collect();
        (t, ty, GPT2_VOCAB - 1)
    } else {
        let n = vocab_size.max(1);
        let mut t: Vec<String> = all.into_iter().take(n - 1).collect();
        t.push(EOT.to_string());
        let mut ty = vec![TOKEN_NORMAL; n];
        ty[n - 1] = TOKEN_CONTROL;
        (t, ty, n - 1)
    };
    let known: HashSet<&str> = tokens.iter().map(String::as_str).collect();
    let merges = VOCAB_BPE
        .lines()
        .filter(|l| !l.starts_with("#version") && !l.trim().is_empty())
        .filter(|l| match l.split_once(' ') {
            Some((a, b)) => known.contains(a) && known.contains(b) && known.contains(format!("{a}{b}").as_str()),
            None => false,
        })
        .map(String::from)
        .collect();
    Ok(Vocab { tokens, types, merges, bos: eot as u32, eos: eot as u32 })
}
