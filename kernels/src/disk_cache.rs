//! What both kernel caches on disk share (NVRTC's CUBINs, `nvrtc/cache.rs`, and the CPU
//! backend's object code, `llvm/objcache.rs`): keys that are a SHA-256 over every input that
//! decides the machine code, and entries written whole or not at all.

use std::io::Write;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::error::KernelError;

/// A cache key being built: SHA-256 over fields, each prefixed by its length, so no two
/// different lists of fields hash the same bytes.
pub(crate) struct Key(Sha256);

impl Key {
    pub(crate) fn new() -> Key {
        Key(Sha256::new())
    }

    pub(crate) fn field(&mut self, bytes: &[u8]) -> &mut Key {
        self.0.update((bytes.len() as u64).to_le_bytes());
        self.0.update(bytes);
        self
    }

    /// The key as 64 lowercase hex digits (a file name).
    pub(crate) fn hex(self) -> String {
        hex(&self.0.finalize())
    }
}

/// Lowercase hex digits of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The SHA-256 of `bytes` (an entry's checksum).
#[cfg(feature = "llvm")]
pub(crate) fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// Writes `bytes` to a temporary file beside `path`, then renames it over `path`: a reader, in
/// this process or another, sees the old file or the whole new one, never part of it.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), KernelError> {
    let io = |source| KernelError::Io { path: path.to_path_buf(), error: source };
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io)?;
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(io)?;
    tmp.write_all(bytes).map_err(io)?;
    tmp.persist(path).map_err(|e| io(e.error))?;
    Ok(())
}
