//! What every reader of a user's text file shares: the text check (UTF-8, no NUL byte, said
//! precisely instead of surfacing as a confusing parse error later) and how a bad value is quoted
//! in a message (JSON, cut short so a hostile file cannot flood the terminal).

/// `bytes` as text, or why they are not: the first invalid UTF-8 byte, or the first NUL byte.
pub fn text(bytes: &[u8]) -> Result<&str, String> {
    let s = std::str::from_utf8(bytes).map_err(|e| format!("invalid UTF-8 at byte {}", e.valid_up_to()))?;
    match s.find('\0') {
        Some(i) => Err(format!("a NUL byte at byte {i}")),
        None => Ok(s),
    }
}

/// A JSON value as it appears in a message, at most 60 characters.
pub fn excerpt(v: &serde_json::Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(60) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_says_what_is_wrong() {
        assert_eq!(text(b"hello").unwrap(), "hello");
        assert_eq!(text(b"ab\xffcd").unwrap_err(), "invalid UTF-8 at byte 2");
        assert_eq!(text(b"abc\0").unwrap_err(), "a NUL byte at byte 3");
        assert_eq!(excerpt(&serde_json::json!("x".repeat(100))).len(), 63);
        assert_eq!(excerpt(&serde_json::json!(-4)), "-4");
    }
}
