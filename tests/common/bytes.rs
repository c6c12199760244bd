//! A buffer's bytes as a device holds them, and back: what the GPU tests upload and read.

use half::{bf16, f16};
use qatc_ir::DType;
use qatc_kernels::program::Buffer;
use qatc_runtime::exec::values::write_input;
use qatc_runtime::Value;

/// A value as a buffer's bytes, as an executor uploads it (`write_input`, the one encoding).
pub fn to_bytes(buf: &Buffer, v: &Value<f32>) -> Vec<u8> {
    let mut out = vec![0u8; buf.device_bytes()];
    write_input(buf, &mut out, v).unwrap_or_else(|e| panic!("{}: {e}", buf.name));
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
