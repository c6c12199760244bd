//! A buffer's bytes as a device holds them, and back: what the GPU tests upload and read.

use half::{bf16, f16};
use qatc_ir::DType;
use qatc_kernels::program::Buffer;
use qatc_runtime::Value;

/// A value as a buffer's bytes.
pub fn to_bytes(buf: &Buffer, v: &Value<f32>) -> Vec<u8> {
    let mut out = vec![0u8; buf.device_bytes()];
    match (buf.dtype, v) {
        (DType::F32, Value::Float(t)) => out.chunks_exact_mut(4).zip(&t.data).for_each(|(o, x)| o.copy_from_slice(&x.to_le_bytes())),
        (DType::F16, Value::Float(t)) => {
            out.chunks_exact_mut(2).zip(&t.data).for_each(|(o, &x)| o.copy_from_slice(&f16::from_f32(x).to_le_bytes()))
        }
        (DType::BF16, Value::Float(t)) => {
            out.chunks_exact_mut(2).zip(&t.data).for_each(|(o, &x)| o.copy_from_slice(&bf16::from_f32(x).to_le_bytes()))
        }
        (DType::I32, Value::Int(t)) => out.chunks_exact_mut(4).zip(&t.data).for_each(|(o, x)| o.copy_from_slice(&x.to_le_bytes())),
        (DType::U8, Value::Int(t)) => out.iter_mut().zip(&t.data).for_each(|(o, &c)| *o = c as u8),
        (DType::I4, Value::Int(t)) => {
            out.iter_mut().zip(t.data.chunks(2)).for_each(|(o, p)| *o = (p[0] as u8) | (p.get(1).copied().unwrap_or(0) as u8) << 4)
        }
        (d, _) => panic!("{}: a {d} buffer given {v:?}", buf.name),
    }
    out
}

/// Element `i` of a buffer's bytes, as f64.
pub fn element(d: DType, b: &[u8], i: usize) -> f64 {
    match d {
        DType::F32 => f64::from(f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])),
        DType::I32 => f64::from(i32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])),
        DType::F16 => f64::from(f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32()),
        DType::BF16 => f64::from(bf16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32()),
        DType::U8 => f64::from(b[i]),
        DType::I4 => f64::from((b[i / 2] >> (4 * (i % 2))) & 15),
    }
}
