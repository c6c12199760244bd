//! Float buffers converted to and from f32 over contiguous runs: widening f16/bf16 (exact) and
//! rounding f32 to them (to nearest even, once). The bf16 loops are compiled for AVX-512 and for
//! AVX2 beside the baseline and picked at run time, as `vmath.rs`'s exp is: the 16-bit GEMMs
//! (`gemm_half.rs`) convert every tile and the attention (`attn_gemm.rs`) every head it stages,
//! and the baseline's 4-wide SSE2 loops cost a few percent of a bf16 step. f16 goes through the
//! `half` crate, which uses F16C where the CPU has it.

use half::f16;
use half::slice::HalfFloatSliceExt;
use qatc_ir::DType;

/// bf16 bits of `x`, rounded to nearest even, NaN kept quiet (what `half::bf16::from_f32` and the
/// CUDA header's `float_to_bf16` compute), written so a loop of it vectorizes.
#[inline(always)]
pub(crate) fn bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    let rounded = (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16;
    if u & 0x7fff_ffff > 0x7f80_0000 {
        ((u >> 16) | 0x40) as u16
    } else {
        rounded
    }
}

/// Bytes of one element of a float buffer (f16 and bf16 2, else f32's 4).
pub(crate) fn elem_bytes(d: DType) -> usize {
    d.bytes_for(1)
}

#[inline(always)]
fn widen_bf16_body(src: &[u16], dst: &mut [f32]) {
    dst.iter_mut().zip(src).for_each(|(d, &s)| *d = f32::from_bits(u32::from(s) << 16));
}

#[inline(always)]
fn narrow_bf16_body(src: &[f32], dst: &mut [u16]) {
    dst.iter_mut().zip(src).for_each(|(d, &x)| *d = bf16_bits(x));
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn widen_bf16_avx512(src: &[u16], dst: &mut [f32]) {
    widen_bf16_body(src, dst)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn widen_bf16_avx2(src: &[u16], dst: &mut [f32]) {
    widen_bf16_body(src, dst)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn narrow_bf16_avx512(src: &[f32], dst: &mut [u16]) {
    narrow_bf16_body(src, dst)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn narrow_bf16_avx2(src: &[f32], dst: &mut [u16]) {
    narrow_bf16_body(src, dst)
}

/// dst[i] = src[i] widened, over the shorter of the two.
pub(crate) fn widen_bf16(src: &[u16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512bw") {
            // SAFETY: the CPU has the features the function was compiled for.
            return unsafe { widen_bf16_avx512(src, dst) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: as above.
            return unsafe { widen_bf16_avx2(src, dst) };
        }
    }
    widen_bf16_body(src, dst)
}

/// dst[i] = src[i] rounded to bf16, over the shorter of the two.
pub(crate) fn narrow_bf16(src: &[f32], dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512bw") {
            // SAFETY: the CPU has the features the function was compiled for.
            return unsafe { narrow_bf16_avx512(src, dst) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: as above.
            return unsafe { narrow_bf16_avx2(src, dst) };
        }
    }
    narrow_bf16_body(src, dst)
}

/// `dst.len()` contiguous elements of type `d` at `src`, widened to f32 (exactly).
///
/// # Safety
/// `src` must be valid for reading that many elements of `d` and aligned for it.
pub(crate) unsafe fn widen(d: DType, src: *const u8, dst: &mut [f32]) {
    // SAFETY: the caller's guarantee.
    unsafe {
        match d {
            DType::BF16 => widen_bf16(std::slice::from_raw_parts(src.cast::<u16>(), dst.len()), dst),
            DType::F16 => std::slice::from_raw_parts(src.cast::<f16>(), dst.len()).convert_to_f32_slice(dst),
            _ => dst.copy_from_slice(std::slice::from_raw_parts(src.cast::<f32>(), dst.len())),
        }
    }
}

/// `src` stored contiguously at `dst` as type `d`, each element rounded once to nearest even.
///
/// # Safety
/// `dst` must be valid for writing `src.len()` elements of `d`, aligned for it, and overlap
/// nothing else in use.
pub(crate) unsafe fn narrow(d: DType, dst: *mut u8, src: &[f32]) {
    // SAFETY: the caller's guarantee.
    unsafe {
        match d {
            DType::BF16 => narrow_bf16(src, std::slice::from_raw_parts_mut(dst.cast::<u16>(), src.len())),
            DType::F16 => std::slice::from_raw_parts_mut(dst.cast::<f16>(), src.len()).convert_from_f32_slice(src),
            _ => std::slice::from_raw_parts_mut(dst.cast::<f32>(), src.len()).copy_from_slice(src),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every path (the one this CPU picks, and the baseline's) gives `half`'s bits, on values
    /// that round up, down, to even, overflow to infinity, and NaNs.
    #[test]
    fn bf16_conversions_agree_with_half() {
        let mut xs: Vec<f32> = (0..5000u32).map(|i| f32::from_bits(i.wrapping_mul(0x9E37_79B9))).collect();
        xs.extend([0.0, -0.0, 1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), f32::MAX, f32::INFINITY, f32::NAN, -f32::NAN]);
        let want: Vec<u16> = xs.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
        let (mut fast, mut base) = (vec![0u16; xs.len()], vec![0u16; xs.len()]);
        narrow_bf16(&xs, &mut fast);
        narrow_bf16_body(&xs, &mut base);
        assert_eq!(fast, want);
        assert_eq!(base, want);
        let (mut wide, mut wide_base) = (vec![0f32; xs.len()], vec![0f32; xs.len()]);
        widen_bf16(&want, &mut wide);
        widen_bf16_body(&want, &mut wide_base);
        for ((&w, &b), &h) in wide.iter().zip(&wide_base).zip(&want) {
            let exact = half::bf16::from_bits(h).to_f32();
            assert_eq!(w.to_bits(), exact.to_bits());
            assert_eq!(b.to_bits(), exact.to_bits());
        }
    }
}
