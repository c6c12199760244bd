//! Non-finite values, caught where they enter. A checkpoint, an adapter or a resume state holding
//! a NaN or an infinity would make every loss, gradient and export after it NaN (or, through
//! quantization's absmax, silently wrong), so every reader refuses one, naming the file, the tensor
//! and the first bad element; `--allow-nonfinite` reads it anyway. The scans work on the stored
//! bits (an exponent of all ones), so a 500 MB checkpoint costs one pass over its bytes.

use std::path::{Path, PathBuf};

use qatc_ir::DType;

/// A NaN or an infinity where only finite numbers belong.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error(
    "{}: tensor {tensor:?} holds {value} at index {index} (element {}); qatc refuses non-finite values, which make every result NaN (--allow-nonfinite reads them anyway)",
    path.display(),
    qatc_ir::Shape(coords.clone())
)]
pub struct NonFinite {
    pub path: PathBuf,
    pub tensor: String,
    /// Flat (row-major) index of the first non-finite element.
    pub index: usize,
    /// The same position as coordinates in the tensor's shape.
    pub coords: Vec<usize>,
    pub value: f32,
}

/// Row-major coordinates of flat index `i` in `shape`.
pub fn coords(shape: &[usize], mut i: usize) -> Vec<usize> {
    let mut c = vec![0; shape.len()];
    for (k, &d) in shape.iter().enumerate().rev() {
        if d > 0 {
            c[k] = i % d;
            i /= d;
        }
    }
    c
}

/// The first element of little-endian `bytes` of `dtype` whose exponent bits are all ones (a NaN
/// or an infinity), with its value. Only float dtypes can hold one.
pub fn first_in_bytes(bytes: &[u8], dtype: DType) -> Option<(usize, f32)> {
    match dtype {
        DType::F32 => bytes.chunks_exact(4).position(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & 0x7f80_0000 == 0x7f80_0000),
        DType::F16 => bytes.chunks_exact(2).position(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7c00 == 0x7c00),
        DType::BF16 => bytes.chunks_exact(2).position(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7f80 == 0x7f80),
        _ => None,
    }
    .map(|i| {
        let w = dtype.bytes_for(1);
        let b = &bytes[i * w..(i + 1) * w];
        let v = match dtype {
            DType::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
            DType::BF16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
            _ => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        };
        (i, v)
    })
}

/// `Err` naming `path`, `tensor` and the first non-finite element of `data` (shape `shape`).
pub fn check(path: &Path, tensor: &str, shape: &[usize], data: &[f32]) -> Result<(), NonFinite> {
    match data.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(index) => {
            Err(NonFinite { path: path.to_path_buf(), tensor: tensor.to_string(), index, coords: coords(shape, index), value: data[index] })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_bad_element_is_found_in_every_dtype() {
        let f32s: Vec<u8> = [1.0f32, -2.0, f32::INFINITY, f32::NAN].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(first_in_bytes(&f32s, DType::F32), Some((2, f32::INFINITY)));
        let f16s: Vec<u8> = [1.0f32, 65504.0, f32::NAN].iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
        let (i, v) = first_in_bytes(&f16s, DType::F16).unwrap();
        assert!(i == 2 && v.is_nan());
        let bf16s: Vec<u8> = [3.0f32, f32::NEG_INFINITY].iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect();
        assert_eq!(first_in_bytes(&bf16s, DType::BF16), Some((1, f32::NEG_INFINITY)));
        let finite: Vec<u8> = [f32::MAX, f32::MIN_POSITIVE, 0.0, -0.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(first_in_bytes(&finite, DType::F32), None);
    }

    #[test]
    fn the_message_names_file_tensor_and_element() {
        let e = check(Path::new("m.safetensors"), "h.0.attn.c_attn.weight", &[2, 3], &[0.0, 1.0, 2.0, 3.0, f32::NAN, 5.0]).unwrap_err();
        assert_eq!((e.index, e.coords.clone()), (4, vec![1, 1]));
        let s = e.to_string();
        assert!(s.starts_with("m.safetensors: tensor \"h.0.attn.c_attn.weight\" holds NaN at index 4 (element [1, 1])"), "{s}");
        assert!(s.contains("--allow-nonfinite"));
        assert!(check(Path::new("x"), "t", &[2], &[1.0, -1.0]).is_ok());
    }
}
