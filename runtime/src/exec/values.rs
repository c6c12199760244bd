//! The conversions between a buffer's bytes (host memory: the CPU's buffers, or what is copied
//! to and from a device) and the interpreter's [`Value`]s: graph inputs in, outputs out.
//!
//! Element layouts are the kernel IR's: f32/i32 little-endian 4 bytes, f16/bf16 as raw 16-bit
//! patterns, u8 one byte, i4 packed two per byte (element 2k in the low nibble of byte k).

use half::{bf16, f16};
use qatc_ir::DType;
use qatc_kernels::program::{Buffer, View};

use super::check::check_view;
use crate::error::RuntimeError;
use crate::value::{IntTensor, Tensor, Value};

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
    use qatc_ir::InputKind;
    use qatc_kernels::program::BufKind;

    fn buffer(dtype: DType, shape: &[usize]) -> Buffer {
        Buffer::new("b", dtype, shape, BufKind::Input("b".into(), InputKind::Data))
    }

    #[test]
    fn i4_codes_pack_low_nibble_first_and_read_back() {
        let buf = buffer(DType::I4, &[5]);
        let mut mem = vec![0u8; buf.bytes()];
        let v = Value::ints([5], vec![1, 2, 15, 0, 7]).unwrap();
        write_input(&buf, &mut mem, &v).unwrap();
        assert_eq!(&mem[..3], &[0x21, 0x0f, 0x07]);
        assert_eq!(read_view(&buf, &mem, &View::contiguous(0, &[5])).unwrap(), v);
        let bad = Value::ints([5], vec![1, 2, 16, 0, 7]).unwrap();
        assert!(matches!(write_input(&buf, &mut mem, &bad), Err(RuntimeError::Buffer { .. })));
    }

    #[test]
    fn f16_inputs_round_and_views_read_strided() {
        let buf = buffer(DType::F16, &[2, 3]);
        let mut mem = vec![0u8; buf.bytes()];
        write_input(&buf, &mut mem, &Value::floats([2, 3], &[0.1, 1.0, 2.0, 3.0, 4.0, 2049.0]).unwrap()).unwrap();
        let t = View::contiguous(0, &[2, 3]).transpose(&[1, 0]);
        let got = read_view(&buf, &mem, &t).unwrap().into_float().unwrap();
        assert_eq!(got.shape, [3, 2]);
        assert_eq!(got.data, [f16::from_f32(0.1).to_f32(), 3.0, 1.0, 4.0, 2.0, 2048.0]);
        let wrong = Value::<f32>::ints([2, 3], vec![0; 6]).unwrap();
        assert!(matches!(write_input(&buf, &mut mem, &wrong), Err(RuntimeError::InputKind { .. })));
    }
}
