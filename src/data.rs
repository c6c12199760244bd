//! llm.c token files (`dev/data/data_common.py`, `llmc/dataloader.h`): a header of 256
//! little-endian i32 (magic 20240520, version 1, token count), then `count` u16 GPT-2 token ids.
//! Batches are read the way llm.c's loader reads them: B*T+1 consecutive tokens, inputs the
//! first B*T, targets the same window shifted by one.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use thiserror::Error;

pub const MAGIC: i32 = 20240520;
pub const VERSION: i32 = 1;
pub const HEADER_BYTES: usize = 1024;

#[derive(Debug, Error)]
pub enum DataError {
    #[error("{}: {error}", path.display())]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{}: empty file (an llm.c token file starts with a 1024-byte header)", path.display())]
    Empty { path: PathBuf },
    #[error("{}: {len} bytes, shorter than the 1024-byte llm.c token-file header", path.display())]
    ShortHeader { path: PathBuf, len: u64 },
    #[error("{}: not an llm.c token file: magic {got}, expected {MAGIC}", path.display())]
    BadMagic { path: PathBuf, got: i32 },
    #[error("{}: unsupported token-file version {got} (qatc reads version {VERSION}: u16 tokens)", path.display())]
    BadVersion { path: PathBuf, got: i32 },
    #[error("{}: the header says {header} tokens but the file holds {bytes} bytes after the header ({} tokens)", path.display(), bytes / 2)]
    CountMismatch { path: PathBuf, header: i64, bytes: u64 },
    #[error("{}: {have} tokens, too few for one batch of B x T + 1 = {b} x {t} + 1 = {need} tokens", path.display())]
    TooShort { path: PathBuf, have: usize, need: u128, b: usize, t: usize },
    #[error("{}: batch {s} is out of range: the file holds {n} batches of {b} x {t} tokens", path.display())]
    BatchOutOfRange { path: PathBuf, s: usize, n: usize, b: usize, t: usize },
    /// No magic and no text: `magic` is what its first 4 bytes say (none in a shorter file).
    #[error("{}: neither an llm.c token file ({}) nor UTF-8 text ({why})", path.display(), match magic {
        Some(m) => format!("magic {m}, expected {MAGIC}"),
        None => "shorter than its 1024-byte header".into(),
    })]
    Neither { path: PathBuf, magic: Option<i32>, why: String },
    #[error("{}: tokenizer: {why}", path.display())]
    Tokenizer { path: PathBuf, why: String },
    #[error("{}: token {token} at position {pos} is not below the vocabulary size {vocab}", path.display())]
    TokenOutOfRange { path: PathBuf, pos: usize, token: u16, vocab: usize },
    /// Instruction data (a `.jsonl` file): its records' errors.
    #[error(transparent)]
    Examples(#[from] crate::instruct::ExampleError),
    #[error("{}: its examples are in sequences of T {packed}, not {t}", path.display())]
    SeqMismatch { path: PathBuf, packed: usize, t: usize },
}

/// A token file, read into memory (Shakespeare's train split is 2.7 MB).
#[derive(Debug)]
pub struct TokenFile {
    path: PathBuf,
    tokens: Vec<u16>,
}

fn le_i32(b: &[u8], i: usize) -> i32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[4 * i..4 * i + 4]);
    i32::from_le_bytes(w)
}

impl TokenFile {
    /// Tokens that did not come from an llm.c file (tokenized text, tests).
    pub fn from_tokens(path: &Path, tokens: Vec<u16>) -> TokenFile {
        TokenFile { path: path.to_path_buf(), tokens }
    }

    /// An llm.c token file (it starts with the magic), or a UTF-8 text file tokenized with
    /// GPT-2's BPE. A file that is neither (no magic, and invalid UTF-8 or a NUL byte) is refused
    /// saying both; a file with the magic gets the token file's precise errors.
    pub fn load(path: &Path) -> Result<TokenFile, DataError> {
        let io = |e| DataError::Io { path: path.into(), error: e };
        if !std::fs::metadata(path).map_err(io)?.is_file() {
            return TokenFile::open(path);
        }
        let bytes = std::fs::read(path).map_err(io)?;
        let magic = (bytes.len() >= 4).then(|| i32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]));
        if bytes.is_empty() || magic == Some(MAGIC) {
            return TokenFile::open(path);
        }
        match crate::input::text(&bytes) {
            Ok(text) => {
                let tokens = crate::tokenize::encode(text).map_err(|why| DataError::Tokenizer { path: path.into(), why })?;
                Ok(TokenFile { path: path.to_path_buf(), tokens })
            }
            // binary without the magic: say both what it is not, not just "wrong magic"
            Err(why) => Err(DataError::Neither { path: path.into(), magic: magic.filter(|_| bytes.len() >= HEADER_BYTES), why }),
        }
    }

    pub fn open(path: &Path) -> Result<TokenFile, DataError> {
        let io = |e| DataError::Io { path: path.into(), error: e };
        // Checked before opening: opening a FIFO for reading would block until a writer came.
        if !std::fs::metadata(path).map_err(io)?.is_file() {
            return Err(io(std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file")));
        }
        let mut f = File::open(path).map_err(io)?;
        let len = f.metadata().map_err(io)?.len();
        if len == 0 {
            return Err(DataError::Empty { path: path.into() });
        }
        if len < HEADER_BYTES as u64 {
            return Err(DataError::ShortHeader { path: path.into(), len });
        }
        let mut header = [0u8; HEADER_BYTES];
        f.read_exact(&mut header).map_err(io)?;
        let (magic, version, count) = (le_i32(&header, 0), le_i32(&header, 1), le_i32(&header, 2));
        if magic != MAGIC {
            return Err(DataError::BadMagic { path: path.into(), got: magic });
        }
        if version != VERSION {
            return Err(DataError::BadVersion { path: path.into(), got: version });
        }
        let bytes = len - HEADER_BYTES as u64;
        if count < 0 || bytes != 2 * count as u64 {
            return Err(DataError::CountMismatch { path: path.into(), header: count as i64, bytes });
        }
        let mut raw = Vec::with_capacity(bytes as usize);
        f.read_to_end(&mut raw).map_err(io)?;
        // The file may have changed since the metadata call; trust only what was read.
        if raw.len() as u64 != bytes {
            return Err(DataError::CountMismatch { path: path.into(), header: count as i64, bytes: raw.len() as u64 });
        }
        let tokens = raw.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        Ok(TokenFile { path: path.into(), tokens })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn tokens(&self) -> &[u16] {
        &self.tokens
    }

    /// Whole batches of B x T: batch `s` reads tokens[s*B*T .. s*B*T + B*T + 1].
    pub fn num_batches(&self, b: usize, t: usize) -> usize {
        match b.checked_mul(t) {
            Some(bt) if bt > 0 => self.tokens.len().saturating_sub(1) / bt,
            _ => 0,
        }
    }

    /// Like `num_batches`, but an error naming the file when not even one batch fits.
    pub fn require_batches(&self, b: usize, t: usize) -> Result<usize, DataError> {
        match self.num_batches(b, t) {
            0 => Err(DataError::TooShort { path: self.path.clone(), have: self.tokens.len(), need: (b as u128) * (t as u128) + 1, b, t }),
            n => Ok(n),
        }
    }

    /// (inputs, targets) of batch `s`, each [B*T] row-major as [B, T]: targets are the inputs
    /// shifted by one token.
    pub fn batch(&self, s: usize, b: usize, t: usize) -> Result<(Vec<i32>, Vec<i32>), DataError> {
        let n = self.require_batches(b, t)?;
        if s >= n {
            return Err(DataError::BatchOutOfRange { path: self.path.clone(), s, n, b, t });
        }
        // s < n keeps s*B*T + B*T + 1 <= len, so neither product overflows nor the slice panics.
        let bt = b * t;
        let w = &self.tokens[s * bt..s * bt + bt + 1];
        let inputs = w[..bt].iter().map(|&x| i32::from(x)).collect();
        let targets = w[1..].iter().map(|&x| i32::from(x)).collect();
        Ok((inputs, targets))
    }

    /// Every token must index the model's embedding table.
    pub fn check_vocab(&self, vocab: usize) -> Result<(), DataError> {
        match self.tokens.iter().position(|&x| x as usize >= vocab) {
            Some(pos) => Err(DataError::TokenOutOfRange { path: self.path.clone(), pos, token: self.tokens[pos], vocab }),
            None => Ok(()),
        }
    }

    /// Writes a token file atomically.
    pub fn write(path: &Path, tokens: &[u16]) -> Result<(), DataError> {
        let io = |e| DataError::Io { path: path.into(), error: e };
        let count =
            i32::try_from(tokens.len()).map_err(|_| io(std::io::Error::new(std::io::ErrorKind::InvalidInput, "over 2^31 tokens")))?;
        let mut header = [0u8; HEADER_BYTES];
        for (i, v) in [MAGIC, VERSION, count].into_iter().enumerate() {
            header[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
        }
        write_atomic(path, |w| {
            w.write_all(&header)?;
            tokens.iter().try_for_each(|x| w.write_all(&x.to_le_bytes()))
        })
        .map_err(io)
    }
}

/// Writes `path` by filling a temp file in the same directory, syncing it and renaming it over
/// the target, so a reader (or a crash) never sees a half-written file, and a file that is still
/// memory-mapped somewhere is replaced rather than overwritten (safetensors #764). A temp file
/// elsewhere could not be renamed across mounts. On error the temp file is removed.
pub fn write_atomic(path: &Path, fill: impl FnOnce(&mut BufWriter<&File>) -> std::io::Result<()>) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let tmp = tempfile::NamedTempFile::new_in(dir)?;
    {
        let mut w = BufWriter::new(tmp.as_file());
        fill(&mut w)?;
        w.flush()?;
    }
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(magic: i32, version: i32, count: i32) -> Vec<u8> {
        let mut h = vec![0u8; HEADER_BYTES];
        for (i, v) in [magic, version, count].into_iter().enumerate() {
            h[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
        }
        h
    }

    fn file(dir: &tempfile::TempDir, bytes: &[u8]) -> PathBuf {
        let p = dir.path().join("tokens.bin");
        std::fs::write(&p, bytes).unwrap();
        p
    }

    fn err(bytes: &[u8]) -> String {
        let dir = tempfile::tempdir().unwrap();
        let p = file(&dir, bytes);
        let e = TokenFile::open(&p).unwrap_err().to_string();
        assert!(e.contains("tokens.bin"), "{e}");
        assert!(!e.contains('\n'), "{e}");
        e
    }

    #[test]
    fn roundtrip_and_batches() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.bin");
        let toks: Vec<u16> = (0..50).collect();
        TokenFile::write(&p, &toks).unwrap();
        let f = TokenFile::open(&p).unwrap();
        assert_eq!(f.tokens(), &toks[..]);
        assert_eq!(f.len(), 50);
        // B*T = 8: batches need 9, 17, ..., 49 tokens -> 6 batches.
        assert_eq!(f.num_batches(2, 4), 6);
        let (x, y) = f.batch(5, 2, 4).unwrap();
        assert_eq!(x, (40..48).collect::<Vec<i32>>());
        assert_eq!(y, (41..49).collect::<Vec<i32>>());
        assert!(matches!(f.batch(6, 2, 4), Err(DataError::BatchOutOfRange { n: 6, .. })));
        assert_eq!(f.num_batches(0, 4), 0);
        assert_eq!(f.num_batches(usize::MAX, 2), 0);
        f.check_vocab(50).unwrap();
        let e = f.check_vocab(49).unwrap_err().to_string();
        assert!(e.contains("token 49 at position 49"), "{e}");
        // No temp file is left beside the target.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn batch_exactly_fits() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.bin");
        TokenFile::write(&p, &[1; 9]).unwrap();
        let f = TokenFile::open(&p).unwrap();
        assert_eq!(f.num_batches(2, 4), 1);
        assert!(f.batch(0, 2, 4).is_ok());
        let e = f.batch(0, 2, 8).unwrap_err().to_string();
        assert!(e.contains("9 tokens, too few for one batch of B x T + 1 = 2 x 8 + 1 = 17 tokens"), "{e}");
    }

    #[test]
    fn missing_file() {
        let e = TokenFile::open(Path::new("/nonexistent/qatc/tokens.bin")).unwrap_err().to_string();
        assert!(e.starts_with("/nonexistent/qatc/tokens.bin: "), "{e}");
    }

    #[test]
    fn a_directory() {
        let dir = tempfile::tempdir().unwrap();
        let e = TokenFile::open(dir.path()).unwrap_err().to_string();
        assert!(e.ends_with("not a regular file"), "{e}");
    }

    #[test]
    fn empty_file() {
        assert!(err(&[]).contains("empty file"));
    }

    #[test]
    fn short_header() {
        assert!(err(&header(MAGIC, 1, 0)[..100]).contains("100 bytes, shorter than the 1024-byte"));
    }

    #[test]
    fn wrong_magic() {
        let e = err(&header(20240326, 1, 0));
        assert!(e.contains("magic 20240326, expected 20240520"), "{e}");
    }

    #[test]
    fn wrong_version() {
        assert!(err(&header(MAGIC, 2, 0)).contains("unsupported token-file version 2"));
    }

    #[test]
    fn count_mismatch() {
        let mut b = header(MAGIC, 1, 10);
        b.extend_from_slice(&[0u8; 18]);
        let e = err(&b);
        assert!(e.contains("says 10 tokens but the file holds 18 bytes"), "{e}");
        let mut b = header(MAGIC, 1, -1);
        b.extend_from_slice(&[0u8; 2]);
        assert!(err(&b).contains("says -1 tokens"));
        let mut b = header(MAGIC, 1, 1);
        b.extend_from_slice(&[0u8; 3]);
        assert!(err(&b).contains("holds 3 bytes"));
    }

    #[test]
    fn too_short_for_a_batch() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.bin");
        TokenFile::write(&p, &[]).unwrap();
        let f = TokenFile::open(&p).unwrap();
        assert!(f.is_empty());
        let e = f.batch(0, 4, 64).unwrap_err().to_string();
        assert!(e.contains("0 tokens, too few") && e.contains("= 257 tokens"), "{e}");
    }

    #[test]
    fn shakespeare_val() {
        let p = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/shakespeare_val.bin"));
        let f = TokenFile::open(p).unwrap();
        assert_eq!(f.len(), 123_091);
        f.check_vocab(50257).unwrap();
        assert_eq!(f.num_batches(4, 64), (123_091 - 1) / 256);
    }
}
