//! The part of Python's pickle that a PyTorch state dict uses, and nothing else: a small machine
//! that reads the opcodes `torch.save` writes (protocol 2, the higher protocols' framing and
//! short forms too) and understands exactly five callables: `collections.OrderedDict`, the
//! tensor and parameter rebuilders of `torch._utils`, and the typed storages as persistent ids.
//! Any other global, and any opcode outside this set, is refused by name before anything runs:
//! qatc executes no pickle code, so a hostile `.bin` is an error, never a program.

use std::collections::HashMap;

/// The element type of a storage (`torch.FloatStorage`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StorageType {
    F64,
    F32,
    F16,
    BF16,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
}

impl StorageType {
    fn of(name: &str) -> Option<StorageType> {
        Some(match name {
            "DoubleStorage" => StorageType::F64,
            "FloatStorage" => StorageType::F32,
            "HalfStorage" => StorageType::F16,
            "BFloat16Storage" => StorageType::BF16,
            "LongStorage" => StorageType::I64,
            "IntStorage" => StorageType::I32,
            "ShortStorage" => StorageType::I16,
            "CharStorage" => StorageType::I8,
            "ByteStorage" => StorageType::U8,
            "BoolStorage" => StorageType::Bool,
            _ => return None,
        })
    }

    pub fn bytes(self) -> usize {
        match self {
            StorageType::F64 | StorageType::I64 => 8,
            StorageType::F32 | StorageType::I32 => 4,
            StorageType::F16 | StorageType::BF16 | StorageType::I16 => 2,
            StorageType::I8 | StorageType::U8 | StorageType::Bool => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            StorageType::F64 => "float64",
            StorageType::F32 => "float32",
            StorageType::F16 => "float16",
            StorageType::BF16 => "bfloat16",
            StorageType::I64 => "int64",
            StorageType::I32 => "int32",
            StorageType::I16 => "int16",
            StorageType::I8 => "int8",
            StorageType::U8 => "uint8",
            StorageType::Bool => "bool",
        }
    }
}

/// A tensor as the pickle describes it: a view of a storage record.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorRef {
    /// The storage's key: its record is `data/KEY` in the archive.
    pub storage: String,
    pub dtype: StorageType,
    /// Elements the storage holds, as the pickle states.
    pub storage_numel: u64,
    /// The view: first element, shape and strides, in elements.
    pub offset: u64,
    pub shape: Vec<u64>,
    pub strides: Vec<u64>,
}

/// The callables a state dict may name.
#[derive(Clone, Debug, PartialEq)]
enum Global {
    OrderedDict,
    RebuildTensor,
    RebuildParameter,
    Storage(StorageType),
}

#[derive(Clone, Debug, PartialEq)]
enum V {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Tuple(Vec<V>),
    List(Vec<V>),
    Dict(Vec<(V, V)>),
    Global(Global),
    Storage { key: String, dtype: StorageType, numel: u64 },
    Tensor(TensorRef),
    Mark,
}

impl V {
    fn what(&self) -> &'static str {
        match self {
            V::None => "None",
            V::Bool(_) => "a bool",
            V::Int(_) => "an int",
            V::Float(_) => "a float",
            V::Str(_) => "a string",
            V::Tuple(_) => "a tuple",
            V::List(_) => "a list",
            V::Dict(_) => "a dict",
            V::Global(_) => "a class",
            V::Storage { .. } => "a storage",
            V::Tensor(_) => "a tensor",
            V::Mark => "a mark",
        }
    }
}

/// The most a pickle may hold before it is refused as not a state dict (GPT-2 XL's is ~60 KB).
const MAX_PICKLE_BYTES: usize = 64 << 20;
const MAX_STRING: usize = 1 << 20;

/// Reads a state dict's pickle: the name of every tensor (in the pickle's order) and its view.
/// Errors are one phrase, for the caller to prefix with the file.
pub fn state_dict(data: &[u8]) -> Result<Vec<(String, TensorRef)>, String> {
    if data.len() > MAX_PICKLE_BYTES {
        return Err(format!("its pickle is {} bytes, more than a state dict's", data.len()));
    }
    let top = Machine::default().run(data)?;
    let V::Dict(items) = top else { return Err(format!("its pickle holds {}, not a state dict (a dict of tensors)", top.what())) };
    let mut out = Vec::with_capacity(items.len());
    for (k, v) in items {
        let V::Str(name) = k else { return Err(format!("a state-dict key is {}, not a name", k.what())) };
        match v {
            V::Tensor(t) => out.push((name, t)),
            other => return Err(format!("{name:?} holds {}, not a tensor: not a state dict of tensors", other.what())),
        }
    }
    Ok(out)
}

#[derive(Default)]
struct Machine {
    stack: Vec<V>,
    memo: HashMap<u32, V>,
}

/// A cursor over the pickle's bytes.
struct Bytes<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Bytes<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.data.len()).ok_or("the pickle ends in the middle of an opcode")?;
        let s = &self.data[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn line(&mut self) -> Result<&'a str, String> {
        let rest = &self.data[self.at..];
        let n = rest.iter().position(|&c| c == b'\n').ok_or("the pickle ends in the middle of a name")?;
        let s = std::str::from_utf8(&rest[..n]).map_err(|_| "a name in the pickle is not UTF-8")?;
        self.at += n + 1;
        Ok(s)
    }
    fn string(&mut self, n: usize) -> Result<String, String> {
        if n > MAX_STRING {
            return Err(format!("a string of {n} bytes in the pickle"));
        }
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| "a string in the pickle is not UTF-8".into())
    }
}

fn global(module: &str, name: &str) -> Result<Global, String> {
    match (module, name) {
        ("collections", "OrderedDict") => Ok(Global::OrderedDict),
        ("torch._utils", "_rebuild_tensor_v2") => Ok(Global::RebuildTensor),
        ("torch._utils", "_rebuild_parameter") => Ok(Global::RebuildParameter),
        ("torch", s) if StorageType::of(s).is_some() => StorageType::of(s).map(Global::Storage).ok_or_else(String::new),
        _ => Err(format!("its pickle calls {module}.{name}, which a state dict of tensors never does: refused (qatc runs no pickle code)")),
    }
}

fn int(v: &V, what: &str) -> Result<u64, String> {
    match v {
        V::Int(i) if *i >= 0 => Ok(*i as u64),
        other => Err(format!("a tensor's {what} is {}, not a count", other.what())),
    }
}

fn ints(v: &V, what: &str) -> Result<Vec<u64>, String> {
    match v {
        V::Tuple(xs) | V::List(xs) => xs.iter().map(|x| int(x, what)).collect(),
        other => Err(format!("a tensor's {what} is {}, not a tuple", other.what())),
    }
}

impl Machine {
    fn pop(&mut self) -> Result<V, String> {
        self.stack.pop().ok_or_else(|| "the pickle pops an empty stack".to_string())
    }

    /// Everything above the topmost mark, which is removed.
    fn pop_mark(&mut self) -> Result<Vec<V>, String> {
        let at = self.stack.iter().rposition(|v| *v == V::Mark).ok_or("the pickle closes a mark it never opened")?;
        let items = self.stack.split_off(at + 1);
        self.stack.pop();
        Ok(items)
    }

    fn top(&mut self) -> Result<&mut V, String> {
        self.stack.last_mut().ok_or_else(|| "the pickle reads an empty stack".to_string())
    }

    fn set_items(&mut self, items: Vec<V>) -> Result<(), String> {
        if !items.len().is_multiple_of(2) {
            return Err("the pickle sets a key without a value".into());
        }
        let V::Dict(d) = self.top()? else { return Err("the pickle sets items on something that is not a dict".into()) };
        let mut it = items.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            d.push((k, v));
        }
        Ok(())
    }

    fn reduce(&mut self, f: V, args: V) -> Result<V, String> {
        let V::Tuple(args) = args else { return Err(format!("the pickle calls with {} for arguments", args.what())) };
        match f {
            V::Global(Global::OrderedDict) if args.is_empty() => Ok(V::Dict(Vec::new())),
            V::Global(Global::RebuildTensor) if (6..=7).contains(&args.len()) => {
                let V::Storage { key, dtype, numel } = &args[0] else {
                    return Err(format!("a tensor is rebuilt from {}, not a storage", args[0].what()));
                };
                let (shape, strides) = (ints(&args[2], "shape")?, ints(&args[3], "strides")?);
                if shape.len() != strides.len() {
                    return Err(format!("a tensor has {} dimensions and {} strides", shape.len(), strides.len()));
                }
                Ok(V::Tensor(TensorRef {
                    storage: key.clone(),
                    dtype: *dtype,
                    storage_numel: *numel,
                    offset: int(&args[1], "storage offset")?,
                    shape,
                    strides,
                }))
            }
            V::Global(Global::RebuildParameter) if (2..=3).contains(&args.len()) => Ok(args.into_iter().next().unwrap_or(V::None)),
            V::Global(g) => Err(format!("the pickle calls {g:?} with {} arguments, as torch.save never does", args.len())),
            other => Err(format!("the pickle calls {}", other.what())),
        }
    }

    fn run(mut self, data: &[u8]) -> Result<V, String> {
        let mut b = Bytes { data, at: 0 };
        loop {
            let op = b.u8()?;
            match op {
                0x80 => {
                    b.u8()?; // PROTO n
                }
                0x95 => {
                    b.take(8)?; // FRAME (its length only helps buffering)
                }
                b'.' => return self.pop(),
                b'(' => self.stack.push(V::Mark),
                b')' => self.stack.push(V::Tuple(Vec::new())),
                b']' => self.stack.push(V::List(Vec::new())),
                b'}' => self.stack.push(V::Dict(Vec::new())),
                b'N' => self.stack.push(V::None),
                0x88 => self.stack.push(V::Bool(true)),
                0x89 => self.stack.push(V::Bool(false)),
                b'K' => {
                    let v = b.u8()?;
                    self.stack.push(V::Int(v.into()))
                }
                b'M' => {
                    let v = b.u16()?;
                    self.stack.push(V::Int(v.into()))
                }
                b'J' => {
                    let v = b.u32()? as i32;
                    self.stack.push(V::Int(v.into()))
                }
                0x8a => {
                    // LONG1: a little-endian two's-complement integer of n bytes
                    let n = b.u8()? as usize;
                    let bytes = b.take(n)?;
                    if n > 8 {
                        return Err(format!("an integer of {n} bytes in the pickle"));
                    }
                    let mut v = [if bytes.last().is_some_and(|&x| x & 0x80 != 0) { 0xff } else { 0 }; 8];
                    v[..n].copy_from_slice(bytes);
                    self.stack.push(V::Int(i64::from_le_bytes(v)))
                }
                b'G' => {
                    let x = b.take(8)?;
                    self.stack.push(V::Float(f64::from_be_bytes([x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]])))
                }
                b'X' => {
                    let n = b.u32()? as usize;
                    let s = b.string(n)?;
                    self.stack.push(V::Str(s))
                }
                0x8c => {
                    let n = b.u8()? as usize;
                    let s = b.string(n)?;
                    self.stack.push(V::Str(s))
                }
                b'c' => {
                    let module = b.line()?.to_string();
                    let name = b.line()?;
                    self.stack.push(V::Global(global(&module, name)?))
                }
                0x93 => {
                    // STACK_GLOBAL: module and name from the stack
                    let (name, module) = (self.pop()?, self.pop()?);
                    match (module, name) {
                        (V::Str(m), V::Str(n)) => self.stack.push(V::Global(global(&m, &n)?)),
                        _ => return Err("the pickle names a class with something other than strings".into()),
                    }
                }
                b'q' => {
                    let k = b.u8()?.into();
                    let v = self.top()?.clone();
                    self.memo.insert(k, v);
                }
                b'r' => {
                    let k = b.u32()?;
                    let v = self.top()?.clone();
                    self.memo.insert(k, v);
                }
                0x94 => {
                    let k = self.memo.len() as u32;
                    let v = self.top()?.clone();
                    self.memo.insert(k, v);
                }
                b'h' | b'j' => {
                    let k = if op == b'h' { b.u8()?.into() } else { b.u32()? };
                    let v = self.memo.get(&k).cloned().ok_or_else(|| format!("the pickle reads memo {k}, which it never wrote"))?;
                    self.stack.push(v)
                }
                b't' => {
                    let items = self.pop_mark()?;
                    self.stack.push(V::Tuple(items))
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    if self.stack.len() < n {
                        return Err("the pickle makes a tuple of more items than it has".into());
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    self.stack.push(V::Tuple(items))
                }
                b'Q' => {
                    // BINPERSID: torch's storages, ('storage', class, key, location, numel)
                    let pid = self.pop()?;
                    let V::Tuple(p) = pid else { return Err(format!("a persistent id is {}", pid.what())) };
                    match p.as_slice() {
                        [V::Str(tag), V::Global(Global::Storage(dtype)), V::Str(key), V::Str(_location), V::Int(n)]
                            if tag == "storage" && *n >= 0 =>
                        {
                            self.stack.push(V::Storage { key: key.clone(), dtype: *dtype, numel: *n as u64 })
                        }
                        _ => return Err("a persistent id that is not a torch storage".into()),
                    }
                }
                b'R' => {
                    let args = self.pop()?;
                    let f = self.pop()?;
                    let v = self.reduce(f, args)?;
                    self.stack.push(v)
                }
                b'b' => {
                    // BUILD: an OrderedDict's state (the state dict's `_metadata`) is not needed
                    let _state = self.pop()?;
                    if !matches!(self.top()?, V::Dict(_)) {
                        return Err("the pickle builds an object that is not a dict".into());
                    }
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.set_items(vec![k, v])?
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    self.set_items(items)?
                }
                b'a' => {
                    let v = self.pop()?;
                    let V::List(l) = self.top()? else { return Err("the pickle appends to something that is not a list".into()) };
                    l.push(v)
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    let V::List(l) = self.top()? else { return Err("the pickle appends to something that is not a list".into()) };
                    l.extend(items)
                }
                other => return Err(format!("its pickle uses opcode 0x{other:02x}, which a state dict never does: refused")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A protocol-2 pickle of {"w": tensor of 2 x 3 floats over storage "0"}, as torch.save writes it.
    fn tiny() -> Vec<u8> {
        let mut p = vec![0x80, 2];
        p.extend(b"ccollections\nOrderedDict\n)R(");
        p.push(b'X');
        p.extend(1u32.to_le_bytes());
        p.extend(b"w");
        p.extend(b"ctorch._utils\n_rebuild_tensor_v2\n((");
        p.push(b'X');
        p.extend(7u32.to_le_bytes());
        p.extend(b"storage");
        p.extend(b"ctorch\nFloatStorage\n");
        for s in ["0", "cpu"] {
            p.push(b'X');
            p.extend((s.len() as u32).to_le_bytes());
            p.extend(s.as_bytes());
        }
        p.extend([b'K', 6, b't', b'Q', b'K', 0, b'K', 2, b'K', 3, 0x86, b'K', 3, b'K', 1, 0x86, 0x89]);
        p.extend(b"ccollections\nOrderedDict\n)R");
        p.extend([b't', b'R', b'u', b'.']);
        p
    }

    #[test]
    fn reads_a_state_dict_and_refuses_any_other_call() {
        let sd = state_dict(&tiny()).expect("a state dict");
        assert_eq!(sd.len(), 1);
        let (name, t) = &sd[0];
        assert_eq!(name, "w");
        assert_eq!((t.storage.as_str(), t.dtype, t.storage_numel, t.offset), ("0", StorageType::F32, 6, 0));
        assert_eq!((t.shape.as_slice(), t.strides.as_slice()), (&[2u64, 3][..], &[3u64, 1][..]));
        // the same bytes with the tensor rebuilder swapped for posix.system
        let (from, to): (&[u8], &[u8]) = (b"torch._utils\n_rebuild_tensor_v2", b"posix\nsystem");
        let good = tiny();
        let at = good.windows(from.len()).position(|w| w == from).expect("the rebuilder");
        let evil = [&good[..at], to, &good[at + from.len()..]].concat();
        let e = state_dict(&evil).unwrap_err();
        assert!(e.contains("posix.system") && e.contains("refused"), "{e}");
        assert!(state_dict(&tiny()[..40]).unwrap_err().contains("ends in the middle"));
        assert!(state_dict(&[0x80, 2, b'i', b'.']).unwrap_err().contains("opcode 0x69"));
    }
}
