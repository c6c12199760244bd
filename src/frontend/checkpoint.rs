//! A checkpoint in any of the layouts GPT-2 checkpoints come in on the Hub, validated in full
//! when opened, its tensors read from memory mappings on demand:
//!
//! - a single `model.safetensors` (`safetensors.rs`: every header entry checked);
//! - sharded safetensors or PyTorch shards, through `model.safetensors.index.json` /
//!   `pytorch_model.bin.index.json` (`sharded.rs`: each shard read whole, each tensor where the
//!   index says, no shard missing or extra);
//! - `pytorch_model.bin`, PyTorch's zip of a pickled state dict (`torch.rs`, `pickle.rs`: only
//!   the opcodes and five callables a state dict uses are understood, so no pickle code runs;
//!   views of shared storages, tied weights among them, read in place or gathered).
//!
//! `open` takes any of those files, or a directory holding one (in that order of preference).
//!
//! Names: keys are canonicalised by stripping one leading `transformer.` (Hub files have none,
//! other GPT-2-architecture checkpoints have one) and by skipping the causal-mask buffers
//! `*.attn.bias` / `*.attn.masked_bias`, which older transformers versions saved and newer ones
//! do not. `lm_head.weight` is listed only when the file has it: it is tied to `wte.weight`.

mod pickle;
mod safetensors;
mod sharded;
mod synthetic;
#[cfg(test)]
mod tests;
mod torch;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use qatc_ir::DType;

use super::error::LoadError;

pub use synthetic::write_synthetic;

/// Largest accepted header, in bytes.
pub const MAX_HEADER_BYTES: u64 = 1 << 20;
/// Most tensors one file may list (`__metadata__` not counted).
pub const MAX_TENSORS: usize = 4096;
pub const MAX_RANK: usize = 4;
pub const MAX_DIM: u64 = 1 << 31;

const PREFIX: &str = "transformer.";

/// The file names `open` looks for in a directory, in order.
pub const LAYOUTS: [&str; 4] = ["model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"];

/// A key without its `transformer.` prefix.
fn canonical_name(key: &str) -> String {
    key.strip_prefix(PREFIX).unwrap_or(key).to_string()
}

/// The causal-mask buffers older checkpoints carry: not model tensors.
fn is_buffer(canonical: &str) -> bool {
    canonical.ends_with(".attn.bias") || canonical.ends_with(".attn.masked_bias")
}

/// One tensor of the checkpoint, under its canonical name.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// F32, F16 or BF16: `open` rejects anything else for a listed tensor.
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// The key as written in the file (with its prefix, if any), for messages.
    pub key: String,
}

/// Where a tensor's bytes are in its file's mapping, checked against it when opened.
#[derive(Clone, Debug, PartialEq)]
enum Layout {
    /// Row-major, these bytes.
    Contiguous { begin: usize, end: usize },
    /// A strided view (PyTorch's): element `i` of dim `d` is `strides[d]` elements further, from
    /// element `offset` of the storage that starts at byte `storage`.
    Strided { storage: usize, offset: usize, strides: Vec<usize> },
}

/// A tensor as a reader found it, before the checkpoint merges readers' tensors.
struct Raw {
    key: String,
    canonical: String,
    /// None for a tensor that is not a model tensor: a buffer (skipped) or an unsupported dtype
    /// (refused unless it is a buffer).
    dtype: Option<DType>,
    buffer: bool,
    shape: Vec<usize>,
    layout: Layout,
}

#[derive(Debug)]
struct Entry {
    info: TensorInfo,
    /// Which file's mapping holds it.
    file: usize,
    layout: Layout,
}

/// One file of the checkpoint.
struct Source {
    path: PathBuf,
    mmap: Mmap,
}

/// An opened, validated checkpoint. Tensors are read from the mappings on demand.
pub struct Checkpoint {
    /// What was opened (a file, or the directory that holds it), for messages.
    path: PathBuf,
    files: Vec<Source>,
    tensors: BTreeMap<String, Entry>,
    prefixed: bool,
}

impl fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Checkpoint").field("path", &self.path).field("tensors", &self.tensors.len()).finish()
    }
}

impl Checkpoint {
    /// Opens a checkpoint in any layout `LAYOUTS` names: the file itself, or a directory that
    /// holds one (the first found, in `LAYOUTS`' order).
    pub fn open(path: &Path) -> Result<Checkpoint, LoadError> {
        let file = if path.is_dir() {
            LAYOUTS.iter().map(|n| path.join(n)).find(|p| p.is_file()).ok_or_else(|| LoadError::NotCheckpoint {
                path: path.into(),
                why: format!("a directory without a checkpoint (looked for {})", LAYOUTS.join(", ")),
            })?
        } else {
            path.to_path_buf()
        };
        let name = file.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        let mut c = Checkpoint { path: file.clone(), files: Vec::new(), tensors: BTreeMap::new(), prefixed: false };
        if name.ends_with(".index.json") {
            sharded::read(&mut c, &file)?;
        } else if name.ends_with(".bin") || name.ends_with(".pt") || name.ends_with(".pth") {
            c.add_bin(&file, None)?;
        } else {
            c.add_safetensors(&file, None)?;
        }
        if c.tensors.is_empty() {
            return Err(LoadError::NoTensors { path: c.path });
        }
        Ok(c)
    }

    /// Reads one safetensors file into the checkpoint; `only`: the names it must hold (a shard).
    fn add_safetensors(&mut self, path: &Path, only: Option<&[String]>) -> Result<(), LoadError> {
        let (mmap, raws) = safetensors::read(path)?;
        self.add(path, mmap, raws, only)
    }

    /// Reads one PyTorch zip into the checkpoint; `only` as in `add_safetensors`.
    fn add_bin(&mut self, path: &Path, only: Option<&[String]>) -> Result<(), LoadError> {
        let (mmap, raws) = torch::read(path)?;
        self.add(path, mmap, raws, only)
    }

    fn add(&mut self, path: &Path, mmap: Mmap, raws: Vec<Raw>, only: Option<&[String]>) -> Result<(), LoadError> {
        let file = self.files.len();
        if let Some(names) = only {
            // a shard holds exactly what its index places in it
            let held: std::collections::HashSet<&str> = raws.iter().map(|r| r.key.as_str()).collect();
            if let Some(r) = raws.iter().find(|r| !names.contains(&r.key)) {
                let why = "the shard holds a tensor its index does not place there".into();
                return Err(LoadError::BadEntry { path: path.into(), tensor: r.key.clone(), why });
            }
            if let Some(n) = names.iter().find(|n| !held.contains(n.as_str())) {
                return Err(LoadError::MissingTensor { path: path.into(), tensor: n.clone() });
            }
        }
        for r in raws {
            self.prefixed |= r.canonical.len() != r.key.len();
            if r.buffer {
                continue;
            }
            // the readers refuse a non-buffer without a model dtype
            let Some(dtype) = r.dtype else { continue };
            if self.tensors.contains_key(&r.canonical) {
                // Both `x` and `transformer.x`, or one tensor in two shards: which one the model
                // means is anyone's guess.
                return Err(LoadError::DuplicateTensor { path: path.into(), tensor: r.key });
            }
            let info = TensorInfo { dtype, shape: r.shape, key: r.key };
            self.tensors.insert(r.canonical, Entry { info, file, layout: r.layout });
        }
        self.files.push(Source { path: path.into(), mmap });
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Canonical names, sorted; buffers skipped, `lm_head.weight` only when the file has it.
    pub fn names(&self) -> Vec<&str> {
        self.tensors.keys().map(String::as_str).collect()
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name).map(|e| &e.info)
    }

    /// Whether the file's keys carried the `transformer.` prefix.
    pub fn has_prefix(&self) -> bool {
        self.prefixed
    }

    /// The key a canonical name has (or would have) in this file: for messages about tensors.
    pub fn key_of(&self, name: &str) -> String {
        match self.tensors.get(name) {
            Some(e) => e.info.key.clone(),
            None if self.prefixed => format!("{PREFIX}{name}"),
            None => name.to_string(),
        }
    }

    fn entry(&self, name: &str) -> Result<&Entry, LoadError> {
        self.tensors.get(name).ok_or_else(|| LoadError::MissingTensor { path: self.path.clone(), tensor: self.key_of(name) })
    }

    /// The tensor's bytes, row-major and little-endian: borrowed from the mapping where the file
    /// stores it so, gathered from a strided view otherwise.
    pub fn raw_bytes(&self, name: &str) -> Result<Cow<'_, [u8]>, LoadError> {
        let e = self.entry(name)?;
        let src = &self.files[e.file];
        // `open` checked every range against this mapping; `get` keeps a bug here from panicking.
        let outside = || LoadError::BadOffsets {
            path: src.path.clone(),
            tensor: e.info.key.clone(),
            why: "byte range outside the mapped file".into(),
        };
        match &e.layout {
            Layout::Contiguous { begin, end } => src.mmap.get(*begin..*end).map(Cow::Borrowed).ok_or_else(outside),
            Layout::Strided { storage, offset, strides } => {
                let size = e.info.dtype.bytes_for(1);
                let numel: usize = e.info.shape.iter().product();
                let mut out = Vec::with_capacity(numel * size);
                for i in 0..numel {
                    // element i's multi-index, last dim fastest, against the view's strides
                    let (mut rest, mut at) = (i, *offset);
                    for (d, s) in e.info.shape.iter().zip(strides).rev() {
                        at += (rest % d) * s;
                        rest /= d;
                    }
                    let b = storage + at * size;
                    out.extend_from_slice(src.mmap.get(b..b + size).ok_or_else(outside)?);
                }
                Ok(Cow::Owned(out))
            }
        }
    }

    /// The tensor converted to f32 (F16 and BF16 widen exactly).
    pub fn to_f32(&self, name: &str) -> Result<Vec<f32>, LoadError> {
        let dtype = self.entry(name)?.info.dtype;
        let b = self.raw_bytes(name)?;
        Ok(match dtype {
            DType::F16 => b.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            DType::BF16 => b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            // `open` admits only F32, F16 and BF16 for listed tensors.
            _ => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        })
    }

    /// The tensor converted to f64, for reference computations.
    pub fn to_f64(&self, name: &str) -> Result<Vec<f64>, LoadError> {
        Ok(self.to_f32(name)?.into_iter().map(f64::from).collect())
    }

    /// Refuses a checkpoint with a NaN or an infinity in any listed tensor, naming the first (in
    /// name order) and its first bad element. One pass over the stored bits, nothing converted.
    pub fn check_finite(&self) -> Result<(), LoadError> {
        for (name, e) in &self.tensors {
            if let Some((index, value)) = crate::finite::first_in_bytes(&self.raw_bytes(name)?, e.info.dtype) {
                let coords = crate::finite::coords(&e.info.shape, index);
                return Err(crate::finite::NonFinite { path: self.path.clone(), tensor: e.info.key.clone(), index, coords, value }.into());
            }
        }
        Ok(())
    }

    /// Bytes of the listed tensors (buffers not counted; a tensor sharing another's storage, as a
    /// tied head does in a PyTorch file, counted apart).
    pub fn stored_bytes(&self) -> usize {
        self.tensors.values().map(|e| e.info.dtype.bytes_for(e.info.shape.iter().product())).sum()
    }
}
