//! A compiled program's memory: zeroed, 64-byte aligned allocations (where buffers go in them:
//! layout.rs), and the conversions between a buffer's bytes and the interpreter's [`Value`]s
//! (graph inputs in, outputs out).
//!
//! Element layouts are the kernel IR's: f32/i32 little-endian 4 bytes, f16/bf16 as raw 16-bit
//! patterns, u8 one byte, i4 packed two per byte (element 2k in the low nibble of byte k).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use half::{bf16, f16};
use qatc_ir::DType;
use qatc_kernels::program::{Buffer, View};

use crate::error::RuntimeError;
use crate::value::{IntTensor, Tensor, Value};

/// Cache-line alignment: no two buffers share a line, and vector loads of any width are aligned.
pub const ALIGN: usize = 64;

/// What `zeroed` asks the allocator for: std's `alloc_zeroed` of a larger alignment is
/// `posix_memalign` plus a memset that touches every page at once, while at this one it is
/// `calloc`, which leaves the fresh pages of a large allocation untouched (and not resident)
/// until used. The arena made by `CpuProgram::new` and replaced by `hoist` is never used: with
/// the memset both arenas were resident at once.
const ALLOC_ALIGN: usize = 16;

/// Memory for buffers (one input, or the arena of all others), owned like a `Box<[u8]>` but
/// aligned to [`ALIGN`].
pub struct Allocation {
    /// What the allocator returned, with `layout`.
    base: NonNull<u8>,
    layout: Layout,
    /// From `base` to the first [`ALIGN`]-aligned byte.
    offset: usize,
    len: usize,
}

// SAFETY: an Allocation uniquely owns its memory (as Box<[u8]> does, which is Send and Sync); it
// hands out `&[u8]` through `&self` and `&mut [u8]` through `&mut self` only, and raw pointers
// that the executor dereferences only while it holds `&mut` of the whole program.
unsafe impl Send for Allocation {}
// SAFETY: see Send: shared access only reads.
unsafe impl Sync for Allocation {}

impl Allocation {
    /// `bytes` zeroed bytes for `name` (a buffer, or the arena).
    pub fn zeroed(name: &str, bytes: usize) -> Result<Allocation, RuntimeError> {
        let err = |msg: String| RuntimeError::Buffer { name: name.to_string(), msg };
        // empty buffers get one line (never read): a zero-size layout may not be allocated
        let len = bytes.max(1).next_multiple_of(ALIGN);
        // aligned by hand: room for the slack up to the next ALIGN boundary (see ALLOC_ALIGN)
        let size = len.checked_add(ALIGN - ALLOC_ALIGN).ok_or_else(|| err(format!("{bytes} bytes: too many")))?;
        let layout = Layout::from_size_align(size, ALLOC_ALIGN).map_err(|e| err(format!("{bytes} bytes: {e}")))?;
        // SAFETY: the layout's size is at least ALIGN, so non-zero.
        let p = unsafe { alloc_zeroed(layout) };
        let base = NonNull::new(p).ok_or_else(|| err(format!("cannot allocate {bytes} bytes")))?;
        let offset = p.align_offset(ALIGN);
        if offset > ALIGN - ALLOC_ALIGN {
            // SAFETY: allocated just above with this layout, and not handed out.
            unsafe { dealloc(p, layout) };
            return Err(err(format!("the allocator returned {p:?}, not {ALLOC_ALIGN}-byte aligned")));
        }
        Ok(Allocation { base, layout, offset, len })
    }

    /// The base address, for kernels and GEMMs: [`ALIGN`]-aligned.
    pub fn ptr(&self) -> *mut u8 {
        // in bounds: `zeroed` checked that offset + len fits in the allocation
        self.base.as_ptr().wrapping_add(self.offset)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr()..ptr() + len` lies inside the live allocation (`zeroed` reserved the
        // slack before it) and is initialized (zeroed at allocation); `&self` excludes writers
        // (the executor writes only through `&mut`).
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len) }
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this very layout at `base`, and freed only here.
        unsafe { dealloc(self.base.as_ptr(), self.layout) }
    }
}

/// The last element a view reaches, plus one (0 for an empty view).
pub fn view_extent(v: &View) -> usize {
    if v.shape.contains(&0) {
        return 0;
    }
    v.offset + v.shape.iter().zip(&v.strides).map(|(&d, &s)| (d - 1) * s).sum::<usize>() + 1
}

/// Checks that `v` stays inside `buf` and has one stride per dim.
pub fn check_view(buf: &Buffer, v: &View, what: &str) -> Result<(), RuntimeError> {
    let err = |msg: String| RuntimeError::Buffer { name: buf.name.clone(), msg };
    if v.shape.len() != v.strides.len() {
        return Err(err(format!("{what}: view of shape {:?} has strides {:?}", v.shape, v.strides)));
    }
    let end = view_extent(v);
    if end > buf.numel() {
        return Err(err(format!("{what}: view {v:?} reaches element {} of {}", end - 1, buf.numel())));
    }
    Ok(())
}

/// Calls `f(element index in the buffer)` for every element of `v`, in row-major order of the
/// view's shape.
pub fn for_each_index(v: &View, mut f: impl FnMut(usize)) {
    let n = v.numel();
    let r = v.shape.len();
    let mut coords = vec![0usize; r];
    let mut at = v.offset;
    for _ in 0..n {
        f(at);
        // odometer: bump the last dim, carrying into earlier ones
        for d in (0..r).rev() {
            coords[d] += 1;
            at += v.strides[d];
            if coords[d] < v.shape[d] {
                break;
            }
            at -= coords[d] * v.strides[d];
            coords[d] = 0;
        }
    }
}

fn kind_err(buf: &Buffer, want: &str, v: &Value<f32>) -> RuntimeError {
    let got = if v.as_float().is_some() { "float" } else { "int" };
    RuntimeError::InputKind { name: buf.name.clone(), want: format!("{want} ({}{:?})", buf.dtype, buf.shape), got: got.to_string() }
}

/// Copies a graph input's value into its buffer: floats into f32 (f16/bf16 rounded to nearest
/// even, as the interpreter rounds such inputs), ints into i32, u8 or packed i4. The same checks
/// as the interpreter's inputs (kind, shape, element count); codes out of their dtype's range are
/// an error rather than silently wrapped.
pub fn write_input(buf: &Buffer, out: &mut [u8], v: &Value<f32>) -> Result<(), RuntimeError> {
    if v.shape() != buf.shape.as_slice() {
        return Err(RuntimeError::InputShape { name: buf.name.clone(), want: buf.shape.clone(), got: v.shape().to_vec() });
    }
    if v.len() != buf.numel() {
        return Err(RuntimeError::BadTensor { shape: buf.shape.clone(), want: buf.numel(), got: v.len() });
    }
    if out.len() < buf.bytes() {
        return Err(RuntimeError::Buffer {
            name: buf.name.clone(),
            msg: format!("{} bytes of memory for {} bytes", out.len(), buf.bytes()),
        });
    }
    match (buf.dtype, v) {
        (DType::F32, Value::Float(t)) => out.chunks_exact_mut(4).zip(&t.data).for_each(|(o, x)| o.copy_from_slice(&x.to_le_bytes())),
        (DType::F16, Value::Float(t)) => {
            out.chunks_exact_mut(2).zip(&t.data).for_each(|(o, &x)| o.copy_from_slice(&f16::from_f32(x).to_le_bytes()))
        }
        (DType::BF16, Value::Float(t)) => {
            out.chunks_exact_mut(2).zip(&t.data).for_each(|(o, &x)| o.copy_from_slice(&bf16::from_f32(x).to_le_bytes()))
        }
        (DType::F32 | DType::F16 | DType::BF16, Value::Int(_)) => return Err(kind_err(buf, "float", v)),
        (DType::I32, Value::Int(t)) => out.chunks_exact_mut(4).zip(&t.data).for_each(|(o, x)| o.copy_from_slice(&x.to_le_bytes())),
        (DType::U8 | DType::I4, Value::Int(t)) => {
            let top = if buf.dtype == DType::U8 { 255 } else { 15 };
            if let Some((i, c)) = t.data.iter().enumerate().find(|(_, &c)| !(0..=top).contains(&c)) {
                return Err(RuntimeError::Buffer {
                    name: buf.name.clone(),
                    msg: format!("element {i} is {c}, outside {}'s 0..={top}", buf.dtype),
                });
            }
            if buf.dtype == DType::U8 {
                out.iter_mut().zip(&t.data).for_each(|(o, &c)| *o = c as u8);
            } else {
                out.iter_mut().zip(t.data.chunks(2)).for_each(|(o, p)| *o = (p[0] as u8) | (p.get(1).copied().unwrap_or(0) as u8) << 4);
            }
        }
        (DType::I32 | DType::U8 | DType::I4, Value::Float(_)) => return Err(kind_err(buf, "int", v)),
    }
    Ok(())
}

/// Reads element `i` of a float buffer as f32.
fn float_at(d: DType, b: &[u8], i: usize) -> f32 {
    match d {
        DType::F16 => f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32(),
        DType::BF16 => bf16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32(),
        _ => f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]),
    }
}

fn int_at(d: DType, b: &[u8], i: usize) -> i32 {
    match d {
        DType::U8 => i32::from(b[i]),
        DType::I4 => i32::from((b[i / 2] >> (4 * (i % 2))) & 15),
        _ => i32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]),
    }
}

/// The value a view of `buf` holds, as the interpreter would return it: a float tensor (f16/bf16
/// widened) or an int tensor (i4/u8 one code per element), of the view's shape. `b` is the
/// buffer's memory.
pub fn read_view(buf: &Buffer, b: &[u8], v: &View) -> Result<Value<f32>, RuntimeError> {
    check_view(buf, v, "output")?;
    if b.len() < buf.bytes() {
        return Err(RuntimeError::Buffer { name: buf.name.clone(), msg: format!("{} bytes of memory for {} bytes", b.len(), buf.bytes()) });
    }
    let mut idx = Vec::with_capacity(v.numel());
    for_each_index(v, |i| idx.push(i));
    let shape = v.shape.clone();
    Ok(if buf.dtype.is_float() {
        Value::Float(Tensor { shape, data: idx.iter().map(|&i| float_at(buf.dtype, b, i)).collect() })
    } else {
        Value::Int(IntTensor { shape, data: idx.iter().map(|&i| int_at(buf.dtype, b, i)).collect() })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use qatc_kernels::program::BufKind;

    fn buffer(dtype: DType, shape: &[usize]) -> Buffer {
        Buffer { name: "b".into(), dtype, shape: shape.to_vec(), kind: BufKind::Input("b".into()) }
    }

    #[test]
    fn i4_codes_pack_low_nibble_first_and_read_back() {
        let buf = buffer(DType::I4, &[5]);
        let mut mem = Allocation::zeroed("b", buf.bytes()).unwrap();
        assert_eq!(mem.ptr() as usize % ALIGN, 0);
        let v = Value::ints([5], vec![1, 2, 15, 0, 7]).unwrap();
        write_input(&buf, mem.bytes_mut(), &v).unwrap();
        assert_eq!(&mem.bytes()[..3], &[0x21, 0x0f, 0x07]);
        assert_eq!(read_view(&buf, mem.bytes(), &View::contiguous(0, &[5])).unwrap(), v);
        let bad = Value::ints([5], vec![1, 2, 16, 0, 7]).unwrap();
        assert!(matches!(write_input(&buf, mem.bytes_mut(), &bad), Err(RuntimeError::Buffer { .. })));
    }

    #[test]
    fn f16_inputs_round_and_views_read_strided() {
        let buf = buffer(DType::F16, &[2, 3]);
        let mut mem = Allocation::zeroed("b", buf.bytes()).unwrap();
        write_input(&buf, mem.bytes_mut(), &Value::floats([2, 3], &[0.1, 1.0, 2.0, 3.0, 4.0, 2049.0]).unwrap()).unwrap();
        let t = View::contiguous(0, &[2, 3]).transpose(&[1, 0]);
        let got = read_view(&buf, mem.bytes(), &t).unwrap().into_float().unwrap();
        assert_eq!(got.shape, [3, 2]);
        assert_eq!(got.data, [f16::from_f32(0.1).to_f32(), 3.0, 1.0, 4.0, 2.0, 2048.0]);
        let wrong = Value::<f32>::ints([2, 3], vec![0; 6]).unwrap();
        assert!(matches!(write_input(&buf, mem.bytes_mut(), &wrong), Err(RuntimeError::InputKind { .. })));
    }
}
