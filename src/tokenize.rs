//! GPT-2's byte-level BPE (r50k_base, the same ranks as Hugging Face's GPT2Tokenizer), through
//! tiktoken-rs, which carries the ranks in the crate. `<|endoftext|>` in text becomes token 50256,
//! as transformers does.

use std::sync::OnceLock;

use tiktoken_rs::CoreBPE;

fn bpe() -> Result<&'static CoreBPE, String> {
    static BPE: OnceLock<Result<CoreBPE, String>> = OnceLock::new();
    BPE.get_or_init(|| tiktoken_rs::r50k_base().map_err(|e| e.to_string())).as_ref().map_err(Clone::clone)
}

/// Token ids of `text`.
pub fn encode(text: &str) -> Result<Vec<u16>, String> {
    let ids = bpe()?.encode_with_special_tokens(text);
    ids.into_iter().map(|t| u16::try_from(t).map_err(|_| format!("token id {t} does not fit u16"))).collect()
}

/// Text of `ids`, lossy where their bytes are not UTF-8 (a character cut by the end of a
/// generation, or split oddly by a model's choices: U+FFFD, as transformers' `decode` gives).
pub fn decode(ids: &[u16]) -> Result<String, String> {
    let ids: Vec<u32> = ids.iter().map(|&t| t as u32).collect();
    let bytes = bpe()?.decode_bytes(&ids).map_err(|e| e.to_string())?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}
