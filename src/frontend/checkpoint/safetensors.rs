//! One safetensors file, validated in full when opened.
//!
//! The reference reader (`SafeTensors::deserialize`) is strict about layout but lets through
//! duplicate keys, aliased zero-size tensors, unknown entry fields and absurd shapes, and its
//! size error does not name the tensor (37 malformed files tried against safetensors 0.8). So
//! `read` parses the header itself and checks every entry before any tensor is read, with errors
//! that name the file and the tensor. The limits are about 19x the largest GPT-2 header (gpt2-xl,
//! 54 KB, 580 tensors), so a hostile header is rejected in milliseconds instead of allocating
//! gigabytes.

use std::collections::HashSet;
use std::fmt;
use std::fs::File;
use std::path::Path;

use memmap2::Mmap;
use qatc_ir::DType;
use serde::de::{MapAccess, Visitor};
use serde_json::Value;

use super::{canonical_name, is_buffer, Layout, Raw, MAX_DIM, MAX_HEADER_BYTES, MAX_RANK, MAX_TENSORS};
use crate::frontend::error::LoadError;

/// The header as written: keys in file order, duplicates kept (a map would silently keep one).
struct RawHeader(Vec<(String, Value)>);

impl<'de> serde::Deserialize<'de> for RawHeader {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<RawHeader, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawHeader;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object mapping tensor names to entries")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<RawHeader, A::Error> {
                let mut v = Vec::new();
                while let Some(kv) = m.next_entry::<String, Value>()? {
                    v.push(kv);
                }
                Ok(RawHeader(v))
            }
        }
        d.deserialize_map(V)
    }
}

/// One entry after the schema checks, before the range checks.
struct Parsed {
    key: String,
    canonical: String,
    buffer: bool,
    dtype: Option<DType>,
    st_dtype: String,
    shape: Vec<usize>,
    begin: u64,
    end: u64,
}

/// Bits per element of a safetensors dtype name; `None` for names the format does not define.
fn st_bits(dtype: &str) -> Option<u32> {
    Some(match dtype {
        "F4" => 4,
        "F6_E2M3" | "F6_E3M2" => 6,
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" | "F8_E4M3FNUZ" | "F8_E5M2FNUZ" => 8,
        "I16" | "U16" | "F16" | "BF16" => 16,
        "I32" | "U32" | "F32" => 32,
        "C64" | "F64" | "I64" | "U64" => 64,
        _ => return None,
    })
}

fn model_dtype(dtype: &str) -> Option<DType> {
    match dtype {
        "F32" => Some(DType::F32),
        "F16" => Some(DType::F16),
        "BF16" => Some(DType::BF16),
        _ => None,
    }
}

fn parse_entry(path: &Path, key: &str, v: &Value) -> Result<Parsed, LoadError> {
    let bad = |why: String| LoadError::BadEntry { path: path.into(), tensor: key.into(), why };
    if key.is_empty() {
        return Err(bad("a tensor has an empty name".into()));
    }
    let obj = v.as_object().ok_or_else(|| bad(format!("entry is {v}, not an object")))?;
    for k in obj.keys() {
        if !matches!(k.as_str(), "dtype" | "shape" | "data_offsets") {
            return Err(bad(format!("unknown field {k:?} (expected dtype, shape, data_offsets)")));
        }
    }
    let field = |name: &str| obj.get(name).ok_or_else(|| bad(format!("missing field {name:?}")));
    let st_dtype = field("dtype")?.as_str().ok_or_else(|| bad("dtype is not a string".into()))?.to_string();
    let shape_v = field("shape")?.as_array().ok_or_else(|| bad("shape is not an array".into()))?;
    if shape_v.len() > MAX_RANK {
        return Err(bad(format!("rank {} is over the limit of {MAX_RANK}", shape_v.len())));
    }
    let mut shape = Vec::with_capacity(shape_v.len());
    for d in shape_v {
        match d.as_u64() {
            Some(x) if x <= MAX_DIM => shape.push(x as usize),
            Some(x) => return Err(bad(format!("dimension {x} is over the limit of 2^31"))),
            None => return Err(bad(format!("shape holds {d}, not a non-negative integer"))),
        }
    }
    let offs = field("data_offsets")?.as_array().ok_or_else(|| bad("data_offsets is not an array".into()))?;
    let (begin, end) = match offs.as_slice() {
        [b, e] => match (b.as_u64(), e.as_u64()) {
            (Some(b), Some(e)) => (b, e),
            _ => return Err(bad(format!("data_offsets {} are not two non-negative integers", Value::Array(offs.clone())))),
        },
        _ => return Err(bad(format!("data_offsets has {} values, expected [begin, end]", offs.len()))),
    };
    let canonical = canonical_name(key);
    let buffer = is_buffer(&canonical);
    Ok(Parsed { key: key.into(), canonical, buffer, dtype: model_dtype(&st_dtype), st_dtype, shape, begin, end })
}

/// Checks the entry's own dtype, range direction and byte count (not yet its place in the file).
fn check_entry(path: &Path, p: &Parsed) -> Result<(), LoadError> {
    let tensor = || p.key.clone();
    let bits = match (p.buffer, p.dtype, st_bits(&p.st_dtype)) {
        (false, None, _) | (true, _, None) => {
            return Err(LoadError::UnsupportedDtype { path: path.into(), tensor: tensor(), dtype: p.st_dtype.clone() })
        }
        (_, _, Some(bits)) => bits,
        // A listed tensor has a model dtype, which `st_bits` knows.
        (false, Some(d), None) => 8 * d.bytes_for(1) as u32,
    };
    if p.end < p.begin {
        return Err(LoadError::BadOffsets {
            path: path.into(),
            tensor: tensor(),
            why: format!("data_offsets [{}, {}) end before they begin", p.begin, p.end),
        });
    }
    // rank <= 4 and dims <= 2^31 keep numel under 2^124, so bytes (at most 8 per element) and
    // bits of sub-byte types (at most 6 per element) stay under 2^127: no overflow in u128.
    let numel = p.shape.iter().fold(1u128, |a, &d| a.saturating_mul(d as u128));
    let (needed, whole) = if bits % 8 == 0 {
        (numel.saturating_mul((bits / 8) as u128), true)
    } else {
        let total = numel.saturating_mul(bits as u128);
        (total.div_ceil(8), total % 8 == 0)
    };
    let holds = p.end - p.begin;
    if !whole || needed != holds as u128 {
        return Err(LoadError::SizeMismatch {
            path: path.into(),
            tensor: tensor(),
            what: format!(
                "{} x {}",
                crate::frontend::error::dims(&p.shape),
                p.dtype.map(|d| d.name().to_string()).unwrap_or_else(|| p.st_dtype.to_lowercase())
            ),
            needed,
            holds,
        });
    }
    Ok(())
}

/// Range checks over all entries in offset order: within the data section, no overlap, no
/// zero-size model tensor aliasing another's offset, and no bytes after the last tensor. Gaps are
/// accepted (the reference reader rejects them; they are harmless to a reader that seeks).
fn check_ranges(path: &Path, entries: &[Parsed], data_len: u64) -> Result<(), LoadError> {
    let mut order: Vec<&Parsed> = entries.iter().collect();
    order.sort_by(|a, b| (a.begin, a.end, &a.key).cmp(&(b.begin, b.end, &b.key)));
    let bad = |p: &Parsed, why: String| LoadError::BadOffsets { path: path.into(), tensor: p.key.clone(), why };
    let mut covered: Option<(&Parsed, u64)> = None; // the tensor that reaches furthest so far
    for (i, p) in order.iter().enumerate() {
        if p.end > data_len {
            let what = if p.begin >= data_len { "lies beyond" } else { "is cut by" };
            return Err(bad(
                p,
                format!(
                    "byte range [{}, {}) {what} the end of the data section ({data_len} bytes): truncated or bad offsets",
                    p.begin, p.end
                ),
            ));
        }
        if p.begin == p.end {
            if !p.buffer {
                let prev_shares = i > 0 && order[i - 1].begin == p.begin;
                let next_shares = order.get(i + 1).is_some_and(|n| n.begin == p.begin);
                let inside = covered.is_some_and(|(_, e)| p.begin < e);
                if prev_shares || next_shares || inside {
                    return Err(bad(p, format!("zero-size tensor at offset {} aliases another tensor's bytes", p.begin)));
                }
            }
            continue;
        }
        if let Some((owner, e)) = covered {
            if p.begin < e {
                return Err(bad(p, format!("byte range [{}, {}) overlaps {:?} (which ends at {e})", p.begin, p.end, owner.key)));
            }
        }
        if covered.is_none_or(|(_, e)| p.end > e) {
            covered = Some((p, p.end));
        }
    }
    let end = covered.map_or(0, |(_, e)| e);
    if end < data_len {
        return Err(LoadError::TrailingBytes { path: path.into(), extra: data_len - end });
    }
    Ok(())
}

fn not_st(path: &Path, why: String) -> LoadError {
    LoadError::NotSafetensors { path: path.into(), why }
}

pub(super) fn read(path: &Path) -> Result<(Mmap, Vec<Raw>), LoadError> {
    // Checked before opening: opening a FIFO for reading would block until a writer came.
    let meta = std::fs::metadata(path).map_err(|e| LoadError::io(path, e))?;
    if !meta.is_file() {
        return Err(not_st(path, "not a regular file".into()));
    }
    let file = File::open(path).map_err(|e| LoadError::io(path, e))?;
    let meta = file.metadata().map_err(|e| LoadError::io(path, e))?;
    let file_len = meta.len();
    if file_len < 8 {
        return Err(not_st(path, format!("{file_len} bytes, shorter than the 8-byte header length")));
    }
    // SAFETY: the mapping is read-only and private to this process. Another process could
    // still truncate or rewrite the file underneath it (the same caveat as every mmap-based
    // loader); qatc never writes a checkpoint in place (its writers rename a temp file over
    // the target), and every range we read was checked against the length we mapped.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))?;
    let file_len = mmap.len() as u64;
    let mut len8 = [0u8; 8];
    len8.copy_from_slice(mmap.get(..8).ok_or_else(|| not_st(path, "file shrank while opening".into()))?);
    let n = u64::from_le_bytes(len8);
    if n > MAX_HEADER_BYTES {
        return Err(LoadError::HeaderTooLarge { path: path.into(), len: n, max: MAX_HEADER_BYTES });
    }
    if n.checked_add(8).is_none_or(|e| e > file_len) {
        return Err(LoadError::HeaderBeyondFile { path: path.into(), len: n, file_len });
    }
    let data_start = 8 + n as usize;
    let header = std::str::from_utf8(&mmap[8..data_start]).map_err(|e| not_st(path, format!("header is not UTF-8: {e}")))?;
    let RawHeader(raw) =
        serde_json::from_str(header).map_err(|e| not_st(path, format!("header is not a JSON object of tensor entries: {e}")))?;
    let data_len = file_len - data_start as u64;

    let mut seen = HashSet::new();
    let mut entries = Vec::new();
    for (key, v) in &raw {
        if !seen.insert(key.as_str()) {
            return Err(LoadError::DuplicateTensor { path: path.into(), tensor: key.clone() });
        }
        if key == "__metadata__" {
            let ok = v.as_object().is_some_and(|m| m.values().all(Value::is_string));
            if !ok {
                return Err(not_st(path, "__metadata__ must map strings to strings".into()));
            }
            continue;
        }
        entries.push((key, v));
    }
    if entries.is_empty() {
        return Err(LoadError::NoTensors { path: path.into() });
    }
    if entries.len() > MAX_TENSORS {
        return Err(LoadError::TooManyTensors { path: path.into(), count: entries.len(), max: MAX_TENSORS });
    }
    let parsed = entries.into_iter().map(|(k, v)| parse_entry(path, k, v)).collect::<Result<Vec<_>, _>>()?;
    for p in &parsed {
        check_entry(path, p)?;
    }
    check_ranges(path, &parsed, data_len)?;

    let raws = parsed
        .into_iter()
        .map(|p| Raw {
            key: p.key,
            canonical: p.canonical,
            // a buffer's dtype need not be a model dtype: it is skipped
            dtype: p.dtype.filter(|_| !p.buffer),
            buffer: p.buffer,
            shape: p.shape,
            // within the mapping: `check_ranges` held them to the data section
            layout: Layout::Contiguous { begin: data_start + p.begin as usize, end: data_start + p.end as usize },
        })
        .collect();
    Ok((mmap, raws))
}
