//! GGUF v3, the file llama.cpp loads (docs/formats.md section 5): a writer, a
//! bounds-checked reader, and the block formats qatc exports (F32, F16, Q4_0, Q8_0).
//!
//! Layout: "GGUF", u32 version 3, u64 tensor_count, u64 kv_count, the key-values, the tensor
//! infos (name, u32 n_dims, u64 ne[n_dims] with ne[0] the innermost = PyTorch's last dim, u32
//! type, u64 offset into the data section), zero padding to `general.alignment`, then the data,
//! each tensor padded to the alignment (ggml's reader requires offset i to be exactly the padded
//! sum of the sizes before it, and reads the padded size of the last tensor too).

use half::f16;
use qatc_ir::{Grid, QuantScheme};

pub const MAGIC: [u8; 4] = *b"GGUF";
pub const VERSION: u32 = 3;
/// ggml's default, and what qatc writes.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// GGML_MAX_DIMS and GGML_MAX_NAME - 1 (the name buffer holds a terminating NUL).
const MAX_DIMS: usize = 4;
const MAX_NAME: usize = 63;
/// Nesting bound for arrays of arrays, so a hostile file cannot recurse without end.
const MAX_DEPTH: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("not a GGUF file (magic {0:02x?}, want \"GGUF\")")]
    Magic([u8; 4]),
    #[error("GGUF version {0}; qatc reads version 3")]
    Version(u32),
    #[error("truncated GGUF at byte {at}: {what}")]
    Truncated { at: usize, what: String },
    #[error("invalid GGUF: {0}")]
    Invalid(String),
}

fn invalid(msg: impl Into<String>) -> GgufError {
    GgufError::Invalid(msg.into())
}

/// The ggml tensor types qatc writes and reads (ids from ggml.h).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q8_0,
}

impl GgmlType {
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q8_0 => 8,
        }
    }
    pub fn from_id(id: u32) -> Option<GgmlType> {
        [GgmlType::F32, GgmlType::F16, GgmlType::Q4_0, GgmlType::Q8_0].into_iter().find(|t| t.id() == id)
    }
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q8_0 => "Q8_0",
        }
    }
    /// (elements, bytes) per block.
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q8_0 => (32, 34),
        }
    }
    /// Bytes of a row of `ne0` elements; None when `ne0` is not a whole number of blocks.
    pub fn row_bytes(self, ne0: usize) -> Option<usize> {
        let (e, b) = self.block();
        ne0.is_multiple_of(e).then(|| ne0 / e * b)
    }
}

/// GGUF value type ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    Str = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        [U8, I8, U16, I16, U32, I32, F32, Bool, Str, Array, U64, I64, F64].into_iter().find(|t| *t as u32 == id)
    }
}

/// A metadata value. Arrays are homogeneous: `elem` is their element type (needed to write an
/// empty array).
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Array(ValueType, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn ty(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::Str(_) => ValueType::Str,
            Value::Array(..) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }
    pub fn strings(items: impl IntoIterator<Item = String>) -> Value {
        Value::Array(ValueType::Str, items.into_iter().map(Value::Str).collect())
    }
    pub fn as_u32(&self) -> Option<u32> {
        match self {
            Value::U32(v) => Some(*v),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// One tensor: `dims` in GGUF order (ne[0] innermost), raw bytes in its ggml type.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorData {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub data: Vec<u8>,
}

impl TensorData {
    pub fn numel(&self) -> u64 {
        self.dims.iter().product()
    }
    /// The elements as f32 (dequantized).
    pub fn to_f32(&self) -> Result<Vec<f32>, GgufError> {
        decode(self.ty, &self.data).ok_or_else(|| invalid(format!("tensor {:?}: data is not whole {} blocks", self.name, self.ty.name())))
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Gguf {
    pub kvs: Vec<(String, Value)>,
    pub tensors: Vec<TensorData>,
}

impl Gguf {
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.kvs.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
    pub fn tensor(&self, name: &str) -> Option<&TensorData> {
        self.tensors.iter().find(|t| t.name == name)
    }
    /// `general.alignment` when present (checked by `write`/`read`), else 32.
    fn alignment(&self) -> Result<usize, GgufError> {
        match self.get("general.alignment") {
            None => Ok(DEFAULT_ALIGNMENT),
            Some(Value::U32(a)) if *a > 0 && a % 8 == 0 => Ok(*a as usize),
            Some(v) => Err(invalid(format!("general.alignment must be a u32 multiple of 8, got {v:?}"))),
        }
    }
}

fn pad_to(n: usize, align: usize) -> usize {
    n.div_ceil(align) * align
}

// ---------------------------------------------------------------------------------------------
// writer

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) -> Result<(), GgufError> {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend(x.to_le_bytes()),
        Value::U16(x) => out.extend(x.to_le_bytes()),
        Value::I16(x) => out.extend(x.to_le_bytes()),
        Value::U32(x) => out.extend(x.to_le_bytes()),
        Value::I32(x) => out.extend(x.to_le_bytes()),
        Value::F32(x) => out.extend(x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::Str(s) => put_str(out, s),
        Value::Array(elem, items) => {
            out.extend((*elem as u32).to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for it in items {
                if it.ty() != *elem {
                    return Err(invalid(format!("array of {elem:?} holds a {:?}", it.ty())));
                }
                put_value(out, it)?;
            }
        }
        Value::U64(x) => out.extend(x.to_le_bytes()),
        Value::I64(x) => out.extend(x.to_le_bytes()),
        Value::F64(x) => out.extend(x.to_le_bytes()),
    }
    Ok(())
}

/// Serializes `f`, checking what ggml's reader checks: unique names of at most 63 bytes, 1..=4
/// dims, whole blocks along ne[0], and data of exactly the size the dims and type imply.
pub fn write(f: &Gguf) -> Result<Vec<u8>, GgufError> {
    let align = f.alignment()?;
    let mut out = Vec::new();
    out.extend(MAGIC);
    out.extend(VERSION.to_le_bytes());
    out.extend((f.tensors.len() as u64).to_le_bytes());
    out.extend((f.kvs.len() as u64).to_le_bytes());
    let mut keys = std::collections::HashSet::new();
    for (k, v) in &f.kvs {
        if !keys.insert(k.as_str()) {
            return Err(invalid(format!("duplicate key {k:?}")));
        }
        put_str(&mut out, k);
        out.extend((v.ty() as u32).to_le_bytes());
        put_value(&mut out, v)?;
    }
    let mut names = std::collections::HashSet::new();
    let mut offset = 0usize;
    for t in &f.tensors {
        if t.name.len() > MAX_NAME || !names.insert(t.name.as_str()) {
            return Err(invalid(format!("tensor name {:?} is longer than {MAX_NAME} bytes or repeated", t.name)));
        }
        check_size(t)?;
        put_str(&mut out, &t.name);
        out.extend((t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend(d.to_le_bytes());
        }
        out.extend(t.ty.id().to_le_bytes());
        out.extend((offset as u64).to_le_bytes());
        offset += pad_to(t.data.len(), align);
    }
    out.resize(pad_to(out.len(), align), 0);
    for t in &f.tensors {
        out.extend(&t.data);
        out.resize(pad_to(out.len(), align), 0);
    }
    Ok(out)
}

/// The byte size a tensor's dims and type imply: 1..=4 dims, whole blocks along ne[0], no
/// overflow.
fn implied_size(name: &str, dims: &[u64], ty: GgmlType) -> Result<usize, GgufError> {
    if dims.is_empty() || dims.len() > MAX_DIMS {
        return Err(invalid(format!("tensor {name:?} has {} dims (1..=4)", dims.len())));
    }
    let ne0 = usize::try_from(dims[0]).map_err(|_| invalid(format!("tensor {name:?}: ne[0] too large")))?;
    let row = ty.row_bytes(ne0).ok_or_else(|| {
        invalid(format!("tensor {name:?}: ne[0] = {ne0} is not a multiple of the {} block ({})", ty.name(), ty.block().0))
    })?;
    dims[1..]
        .iter()
        .try_fold(row as u64, |acc, &d| acc.checked_mul(d))
        .and_then(|s| usize::try_from(s).ok())
        .ok_or_else(|| invalid(format!("tensor {name:?}: dims {dims:?} overflow")))
}

/// `implied_size`, checked against the data the tensor holds.
fn check_size(t: &TensorData) -> Result<usize, GgufError> {
    let size = implied_size(&t.name, &t.dims, t.ty)?;
    if size != t.data.len() {
        return Err(invalid(format!(
            "tensor {:?}: {} bytes of data, dims {:?} of {} need {size}",
            t.name,
            t.data.len(),
            t.dims,
            t.ty.name()
        )));
    }
    Ok(size)
}

// ---------------------------------------------------------------------------------------------
// reader

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], GgufError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.b.len());
        let Some(end) = end else { return Err(GgufError::Truncated { at: self.pos, what: what.to_string() }) };
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }
    /// A count that must fit in what is left of the file at `min_bytes` per item, so a hostile
    /// count cannot make the reader allocate more than the file could describe.
    fn count(&mut self, min_bytes: usize, what: &str) -> Result<usize, GgufError> {
        let at = self.pos;
        let n = self.u64(what)?;
        let left = (self.b.len() - self.pos) as u64;
        if n.saturating_mul(min_bytes.max(1) as u64) > left {
            return Err(GgufError::Truncated { at, what: format!("{what}: {n} items cannot fit in the {left} bytes left") });
        }
        Ok(n as usize)
    }
    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let n = self.count(1, what)?;
        let at = self.pos;
        let s = self.take(n, what)?;
        String::from_utf8(s.to_vec()).map_err(|_| invalid(format!("{what} at byte {at} is not UTF-8")))
    }
    fn value(&mut self, ty: ValueType, depth: usize) -> Result<Value, GgufError> {
        let w = "a metadata value";
        Ok(match ty {
            ValueType::U8 => Value::U8(self.arr::<1>(w)?[0]),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.arr(w)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.arr(w)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.arr(w)?)),
            ValueType::U32 => Value::U32(self.u32(w)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.arr(w)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.arr(w)?)),
            ValueType::Bool => match self.arr::<1>(w)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(invalid(format!("bool value {b} at byte {}", self.pos - 1))),
            },
            ValueType::Str => Value::Str(self.string("a string value")?),
            ValueType::Array => {
                if depth >= MAX_DEPTH {
                    return Err(invalid("arrays nested too deeply"));
                }
                let id = self.u32("an array's element type")?;
                let elem = ValueType::from_id(id).ok_or_else(|| invalid(format!("unknown array element type {id}")))?;
                let min = match elem {
                    ValueType::U8 | ValueType::I8 | ValueType::Bool => 1,
                    ValueType::U16 | ValueType::I16 => 2,
                    ValueType::U32 | ValueType::I32 | ValueType::F32 => 4,
                    ValueType::Array => 12,
                    _ => 8,
                };
                let n = self.count(min, "an array's length")?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem, depth + 1)?);
                }
                Value::Array(elem, items)
            }
            ValueType::U64 => Value::U64(self.u64(w)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.arr(w)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.arr(w)?)),
        })
    }
}

/// Parses a GGUF v3 file held in memory. Every offset and size is checked against the file, and
/// tensors must lie where ggml's reader expects them (aligned, in order, no overlap).
pub fn read(bytes: &[u8]) -> Result<Gguf, GgufError> {
    let mut c = Cursor { b: bytes, pos: 0 };
    let magic = c.arr::<4>("the magic")?;
    if magic != MAGIC {
        return Err(GgufError::Magic(magic));
    }
    let version = c.u32("the version")?;
    if version != VERSION {
        return Err(GgufError::Version(version));
    }
    // a tensor info is at least 8 (name length) + 4 + 8 + 4 + 8 bytes; a KV at least 8 + 4 + 1
    let n_tensors = c.count(32, "the tensor count")?;
    let n_kv = c.count(13, "the key-value count")?;
    let mut f = Gguf::default();
    for _ in 0..n_kv {
        let key = c.string("a key")?;
        let id = c.u32("a value type")?;
        let ty = ValueType::from_id(id).ok_or_else(|| invalid(format!("key {key:?} has unknown value type {id}")))?;
        let v = c.value(ty, 0)?;
        if f.get(&key).is_some() {
            return Err(invalid(format!("duplicate key {key:?}")));
        }
        f.kvs.push((key, v));
    }
    let align = f.alignment()?;
    let mut infos = Vec::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = c.string("a tensor name")?;
        let nd = c.u32("a tensor's n_dims")? as usize;
        if nd == 0 || nd > MAX_DIMS {
            return Err(invalid(format!("tensor {name:?} has {nd} dims (1..=4)")));
        }
        let mut dims = Vec::with_capacity(nd);
        for _ in 0..nd {
            dims.push(c.u64("a tensor dim")?);
        }
        let id = c.u32("a tensor type")?;
        let ty = GgmlType::from_id(id).ok_or_else(|| invalid(format!("tensor {name:?} has ggml type {id}, which qatc does not read")))?;
        let offset = c.u64("a tensor offset")?;
        infos.push((name, dims, ty, offset));
    }
    let data_start = pad_to(c.pos, align);
    let mut expect = 0u64;
    for (name, dims, ty, offset) in infos {
        if offset != expect {
            return Err(invalid(format!("tensor {name:?} at data offset {offset}, expected {expect} (aligned, in order)")));
        }
        let size = implied_size(&name, &dims, ty)?;
        let mut t = TensorData { name, dims, ty, data: Vec::new() };
        let start = data_start as u64 + offset;
        let end = start.checked_add(size as u64).filter(|&e| e <= bytes.len() as u64);
        let Some(end) = end else {
            return Err(GgufError::Truncated { at: bytes.len(), what: format!("data of tensor {:?} ({size} bytes at {start})", t.name) });
        };
        t.data = bytes[start as usize..end as usize].to_vec();
        expect = offset + pad_to(size, align) as u64;
        if f.tensor(&t.name).is_some() {
            return Err(invalid(format!("duplicate tensor {:?}", t.name)));
        }
        f.tensors.push(t);
    }
    Ok(f)
}

// ---------------------------------------------------------------------------------------------
// block formats

pub fn encode_f32(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// IEEE half, round to nearest even (ggml's GGML_FP32_TO_FP16).
pub fn encode_f16(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect()
}

/// Q4_0's grid: llama.cpp's block format is qatc's `q4_0` scheme, codes 0..=15 standing for the
/// points code - 8.
pub fn q4_0_grid() -> Grid {
    Grid::of(QuantScheme::Q4_0, 4)
}

/// Q8_0's grid: int8 points -127..=127 with d = amax / 127, the points and scale rule of qatc's
/// 8-bit `sym` grid (Q8_0 rounds ties away from zero and stores d as fp16).
fn q8_0_grid() -> Grid {
    Grid::of(QuantScheme::Sym, 8)
}

/// One Q4_0 block: the f16 scale, then byte l = element l (low nibble) | element l + 16 (high).
pub fn q4_0_block(d: f16, codes: &[u8; 32]) -> [u8; 18] {
    let mut b = [0u8; 18];
    b[..2].copy_from_slice(&d.to_le_bytes());
    for l in 0..16 {
        b[2 + l] = (codes[l] & 15) | (codes[l + 16] & 15) << 4;
    }
    b
}

/// llama.cpp's `quantize_row_q8_0_ref`: per 32 elements d = amax / 127, id = 1/d (0 when d is
/// 0), q = roundf(x * id) (ties away from zero, as Rust's `round`), stored scale fp16(d).
/// `x.len()` must be a multiple of 32 (the caller checks the row length).
pub fn quantize_q8_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / 32 * 34);
    for blk in x.chunks_exact(32) {
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / q8_0_grid().scale_divisor() as f32;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend(f16::from_f32(d).to_le_bytes());
        out.extend(blk.iter().map(|v| ((v * id).round() as i8) as u8));
    }
    out
}

/// The f16 scale bits and the 32 codes (0..15) of every Q4_0 block, in order.
pub fn q4_0_unpack(data: &[u8]) -> Option<(Vec<u16>, Vec<u8>)> {
    if !data.len().is_multiple_of(18) {
        return None;
    }
    let (mut d, mut q) = (Vec::new(), Vec::new());
    for b in data.chunks_exact(18) {
        d.push(u16::from_le_bytes([b[0], b[1]]));
        q.extend(b[2..].iter().map(|x| x & 15));
        q.extend(b[2..].iter().map(|x| x >> 4));
    }
    Some((d, q))
}

/// Dequantizes raw tensor bytes as ggml does; None when the bytes are not whole blocks.
pub fn decode(ty: GgmlType, data: &[u8]) -> Option<Vec<f32>> {
    let (_, bytes) = ty.block();
    if !data.len().is_multiple_of(bytes) {
        return None;
    }
    let h = |b: &[u8]| f16::from_le_bytes([b[0], b[1]]).to_f32();
    Some(match ty {
        GgmlType::F32 => data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        GgmlType::F16 => data.chunks_exact(2).map(h).collect(),
        GgmlType::Q4_0 => {
            let (ds, qs) = q4_0_unpack(data)?;
            let offset = q4_0_grid().offset().unwrap_or(0) as f32;
            qs.chunks_exact(32)
                .zip(ds)
                .flat_map(|(q, d)| {
                    let d = f16::from_bits(d).to_f32();
                    q.iter().map(move |&c| (c as f32 - offset) * d).collect::<Vec<_>>()
                })
                .collect()
        }
        GgmlType::Q8_0 => data
            .chunks_exact(34)
            .flat_map(|b| {
                let d = h(b);
                b[2..].iter().map(move |&q| q as i8 as f32 * d).collect::<Vec<_>>()
            })
            .collect(),
    })
}
