//! `pytorch_model.bin`: what `torch.save` writes since PyTorch 1.6, a zip archive (stored, not
//! compressed) of `PREFIX/data.pkl`, the state dict pickled with its tensors as persistent ids,
//! and `PREFIX/data/KEY`, one record per storage. The pickle is read by `pickle.rs`, which runs
//! nothing; the storages are read in place from the mapping. A tensor is a view of a storage
//! (several may share one: a tied head), checked to lie inside it; a contiguous view is read in
//! place, a strided one gathered.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Cursor, Read};
use std::path::Path;

use memmap2::Mmap;
use qatc_ir::DType;

use super::pickle::{self, StorageType, TensorRef};
use super::{canonical_name, is_buffer, Layout, Raw, MAX_DIM, MAX_RANK, MAX_TENSORS};
use crate::frontend::error::LoadError;

fn bad(path: &Path, why: impl Into<String>) -> LoadError {
    LoadError::NotCheckpoint { path: path.into(), why: why.into() }
}

fn model_dtype(t: StorageType) -> Option<DType> {
    match t {
        StorageType::F32 => Some(DType::F32),
        StorageType::F16 => Some(DType::F16),
        StorageType::BF16 => Some(DType::BF16),
        _ => None,
    }
}

/// Where a storage record's bytes are in the file.
struct Record {
    begin: usize,
    len: usize,
}

/// Every storage record of the archive, by key, and the pickle's bytes.
fn records(path: &Path, mmap: &Mmap) -> Result<(Vec<u8>, HashMap<String, Record>), LoadError> {
    let mut zip = zip::ZipArchive::new(Cursor::new(&mmap[..]))
        .map_err(|e| bad(path, format!("not a PyTorch zip archive ({e}): truncated, or not written by torch.save")))?;
    let pkl = (0..zip.len())
        .filter_map(|i| zip.name_for_index(i).and_then(|n| n.ok()).map(|n| n.into_owned()))
        .find(|n| n.ends_with("/data.pkl") || n == "data.pkl")
        .ok_or_else(|| bad(path, "a zip archive without data.pkl: not a PyTorch checkpoint"))?;
    let prefix = pkl.trim_end_matches("data.pkl").to_string();
    let mut data = Vec::new();
    {
        let mut f = zip.by_name(&pkl).map_err(|e| bad(path, format!("{pkl}: {e}")))?;
        f.read_to_end(&mut data).map_err(|e| bad(path, format!("{pkl}: {e}")))?;
    }
    let mut recs = HashMap::new();
    for i in 0..zip.len() {
        let f = zip.by_index_raw(i).map_err(|e| bad(path, format!("archive entry {i}: {e}")))?;
        let name = f.name().map_err(|e| bad(path, format!("archive entry {i}: {e}")))?.into_owned();
        let Some(key) = name.strip_prefix(&prefix).and_then(|n| n.strip_prefix("data/")) else { continue };
        if f.compression() != zip::CompressionMethod::Stored {
            return Err(bad(path, format!("storage {key} is compressed ({}); torch.save stores them uncompressed", f.compression())));
        }
        let begin = f.data_start().ok_or_else(|| bad(path, format!("storage {key}: no data offset")))?;
        let (begin, len) = (begin as usize, f.size() as usize);
        if begin.checked_add(len).is_none_or(|e| e > mmap.len()) {
            return Err(bad(path, format!("storage {key} lies beyond the end of the file: truncated")));
        }
        recs.insert(key.to_string(), Record { begin, len });
    }
    Ok((data, recs))
}

/// The layout of `t` over its record, checked to lie inside it.
fn layout(path: &Path, name: &str, t: &TensorRef, rec: &Record) -> Result<Layout, LoadError> {
    let err = |why: String| LoadError::BadOffsets { path: path.into(), tensor: name.into(), why };
    let size = t.dtype.bytes() as u64;
    if t.storage_numel.checked_mul(size) != Some(rec.len as u64) {
        return Err(err(format!(
            "storage {} holds {} bytes but the pickle says {} elements of {}: truncated or altered",
            t.storage,
            rec.len,
            t.storage_numel,
            t.dtype.name()
        )));
    }
    if t.shape.len() > MAX_RANK || t.shape.iter().any(|&d| d > MAX_DIM) || t.strides.iter().any(|&s| s > MAX_DIM * MAX_DIM) {
        return Err(err(format!("shape {:?} and strides {:?} are over the limits", t.shape, t.strides)));
    }
    let numel: u64 = t.shape.iter().product();
    if numel > 0 {
        // the last element the view reaches, plus one, within the storage
        let reach = t.offset + t.shape.iter().zip(&t.strides).map(|(&d, &s)| (d - 1) * s).sum::<u64>() + 1;
        if reach > t.storage_numel {
            return Err(err(format!(
                "shape {:?} with strides {:?} from element {} reaches element {} of storage {}, which holds {}",
                t.shape,
                t.strides,
                t.offset,
                reach - 1,
                t.storage,
                t.storage_numel
            )));
        }
    }
    let begin = rec.begin + (t.offset * size) as usize;
    // row-major strides (a dimension of 1 may have any stride)
    let mut want = 1u64;
    let mut contiguous = true;
    for (&d, &s) in t.shape.iter().zip(&t.strides).rev() {
        contiguous &= d == 1 || s == want;
        want *= d;
    }
    Ok(if contiguous {
        Layout::Contiguous { begin, end: begin + (numel * size) as usize }
    } else {
        Layout::Strided { storage: rec.begin, offset: t.offset as usize, strides: t.strides.iter().map(|&s| s as usize).collect() }
    })
}

pub(super) fn read(path: &Path) -> Result<(Mmap, Vec<Raw>), LoadError> {
    let meta = std::fs::metadata(path).map_err(|e| LoadError::io(path, e))?;
    if !meta.is_file() {
        return Err(bad(path, "not a regular file"));
    }
    let file = File::open(path).map_err(|e| LoadError::io(path, e))?;
    // SAFETY: read-only and private to this process; as for safetensors files, another process
    // could rewrite the file underneath (every range read is checked against the mapping's
    // length first), and qatc never writes a checkpoint in place.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))?;
    if !mmap.starts_with(b"PK\x03\x04") {
        let why = if mmap.first() == Some(&0x80) {
            "PyTorch's legacy format (before 1.6), which qatc does not read: re-save it with a current torch.save, or as safetensors"
        } else {
            "not a PyTorch checkpoint (torch.save's zip archive) nor safetensors"
        };
        return Err(bad(path, why));
    }
    let (pkl, recs) = records(path, &mmap)?;
    let tensors = pickle::state_dict(&pkl).map_err(|why| bad(path, why))?;
    if tensors.len() > MAX_TENSORS {
        return Err(LoadError::TooManyTensors { path: path.into(), count: tensors.len(), max: MAX_TENSORS });
    }
    let mut raws = Vec::with_capacity(tensors.len());
    for (key, t) in tensors {
        let canonical = canonical_name(&key);
        let buffer = is_buffer(&canonical);
        let dtype = model_dtype(t.dtype);
        if dtype.is_none() && !buffer {
            return Err(LoadError::UnsupportedDtype { path: path.into(), tensor: key, dtype: t.dtype.name().into() });
        }
        let rec = recs.get(&t.storage).ok_or_else(|| bad(path, format!("{key:?}: its storage {} is not in the archive", t.storage)))?;
        let layout = layout(path, &key, &t, rec)?;
        raws.push(Raw { key, canonical, dtype, buffer, shape: t.shape.iter().map(|&d| d as usize).collect(), layout });
    }
    Ok((mmap, raws))
}
