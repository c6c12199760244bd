//! Errors of the checkpoint and config loaders. Every message is one line that starts with the
//! file it is about and, where a tensor is involved, names it as written in the file, so a user
//! can open the header and find the entry. `qatc` prints them as `error: <message>`.

use std::path::PathBuf;

use thiserror::Error;

/// Formats a shape the way the rest of qatc prints shapes: `[64, 191]`.
pub(crate) fn dims(shape: &[usize]) -> String {
    qatc_ir::Shape(shape.to_vec()).to_string()
}

#[derive(Debug, Error)]
pub enum LoadError {
    #[error("{}: {error}", path.display())]
    Io { path: PathBuf, error: std::io::Error },

    #[error("{}: not a safetensors file: {why}", path.display())]
    NotSafetensors { path: PathBuf, why: String },

    /// A PyTorch file or a shard index qatc does not read (a pickle that calls anything but a
    /// state dict's constructors among them), or a layout it cannot place.
    #[error("{}: {why}", path.display())]
    NotCheckpoint { path: PathBuf, why: String },

    #[error("{}: not a safetensors file (or not a GPT-2 one): header length {len} is over the {max}-byte limit", path.display())]
    HeaderTooLarge { path: PathBuf, len: u64, max: u64 },

    #[error("{}: header length {len} beyond the file: 8 + {len} bytes needed but the file has {file_len}", path.display())]
    HeaderBeyondFile { path: PathBuf, len: u64, file_len: u64 },

    #[error("{}: the header lists no tensors", path.display())]
    NoTensors { path: PathBuf },

    #[error("{}: the header lists {count} tensors, over the limit of {max}", path.display())]
    TooManyTensors { path: PathBuf, count: usize, max: usize },

    /// An entry that does not follow the schema (missing or unknown field, bad number, rank or
    /// dimension over the limits).
    #[error("{}: tensor {tensor:?}: {why}", path.display())]
    BadEntry { path: PathBuf, tensor: String, why: String },

    /// Overlapping, aliased, reversed or out-of-range byte ranges (truncation included).
    #[error("{}: tensor {tensor:?}: {why}", path.display())]
    BadOffsets { path: PathBuf, tensor: String, why: String },

    /// `what` is the shape and dtype as written in the header (`[2, 3] x f32`).
    #[error("{}: tensor {tensor:?}: shape {what} needs {needed} bytes but its range holds {holds}", path.display())]
    SizeMismatch { path: PathBuf, tensor: String, what: String, needed: u128, holds: u64 },

    #[error("{}: {extra} bytes after the last tensor's data: the data section must end at the end of the file", path.display())]
    TrailingBytes { path: PathBuf, extra: u64 },

    #[error("{}: tensor {tensor:?}: dtype {dtype} is not supported (model tensors must be F32, F16 or BF16)", path.display())]
    UnsupportedDtype { path: PathBuf, tensor: String, dtype: String },

    #[error("{}: tensor {tensor:?} is listed twice", path.display())]
    DuplicateTensor { path: PathBuf, tensor: String },

    #[error("{}: tensor {tensor:?} is missing", path.display())]
    MissingTensor { path: PathBuf, tensor: String },

    /// A shape that disagrees with the config (given or inferred from `wte`/`wpe`), which is also
    /// how a layer whose shapes differ from the other layers' shows up.
    #[error("{}: tensor {tensor:?}: shape {} but the model config needs {}", path.display(), dims(got), dims(expected))]
    ShapeMismatch { path: PathBuf, tensor: String, expected: Vec<usize>, got: Vec<usize> },

    #[error("{}: {why}", path.display())]
    BadConfig { path: PathBuf, why: String },

    #[error("sequence length {seq} exceeds the model's n_positions {n_positions}")]
    SeqTooLong { seq: usize, n_positions: usize },

    #[error(transparent)]
    NonFinite(#[from] crate::finite::NonFinite),
}

impl LoadError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> LoadError {
        LoadError::Io { path: path.into(), error: source }
    }
}
