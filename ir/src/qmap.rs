//! 8-bit blockwise dynamic quantization (Dettmers et al., "8-bit Optimizers via Block-wise
//! Quantization", bitsandbytes' `create_dynamic_map` / `quantize_blockwise`): a tensor is cut into
//! blocks of [`BLOCK`] elements; each block stores its absolute maximum as f32 and each element
//! the u8 index of the nearest value of a 256-entry map to `x / absmax`. The maps are the "dynamic
//! tree" code: a decimal exponent 10^-6 .. 10^0 and a linear fraction whose resolution grows as
//! the exponent does, so small values keep relative precision. AdamW's first moment uses the
//! signed map, its second (never negative) the unsigned one, which spends the sign bit on
//! fraction.
//!
//! This module is the one home of the maps and of the block size; the interpreter's
//! quantizer (`qatc_runtime::quant`) and the code generators read them from here (the CUDA
//! header's copy is written from them, `qatc_kernels::cuda::tables`), and
//! `tests/fixtures/gen_adamw8bit_fixtures.py` writes the same values from NumPy (tested equal).

use std::sync::OnceLock;

/// Elements per quantization block (bitsandbytes' 8-bit optimizers' block size).
pub const BLOCK: usize = 2048;

/// Which dynamic map a tensor's codes index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DynMap {
    /// Values in [-1, 1]: the first moment.
    Signed,
    /// Values in [0, 1]: the second moment.
    Unsigned,
}

impl DynMap {
    pub const ALL: [DynMap; 2] = [DynMap::Signed, DynMap::Unsigned];

    pub fn name(self) -> &'static str {
        match self {
            DynMap::Signed => "signed",
            DynMap::Unsigned => "unsigned",
        }
    }

    pub fn from_name(s: &str) -> Option<DynMap> {
        DynMap::ALL.into_iter().find(|m| m.name() == s)
    }

    /// The map's 256 values, ascending (built once).
    pub fn values(self) -> &'static [f32; 256] {
        static SIGNED: OnceLock<[f32; 256]> = OnceLock::new();
        static UNSIGNED: OnceLock<[f32; 256]> = OnceLock::new();
        match self {
            DynMap::Signed => SIGNED.get_or_init(|| dynamic_map(true)),
            DynMap::Unsigned => UNSIGNED.get_or_init(|| dynamic_map(false)),
        }
    }

    /// The code whose value is nearest to `y` (the lower one on a tie); `y` is x / absmax, in
    /// [-1, 1] (NaN gives code 0's neighbour search a defined answer: the first code).
    pub fn nearest(self, y: f32) -> u8 {
        let map = self.values();
        // first index whose value is >= y
        let hi = map.partition_point(|&v| v < y);
        if hi == 0 {
            return 0;
        }
        if hi == map.len() {
            return 255;
        }
        let lo = hi - 1;
        if (map[hi] - y).abs() < (y - map[lo]).abs() {
            hi as u8
        } else {
            lo as u8
        }
    }
}

/// Blocks of a tensor of `n` elements (the last one may be partial).
pub fn blocks(n: usize) -> usize {
    n.div_ceil(BLOCK)
}

/// numpy.linspace(start, stop, n) in f64, computed as NumPy does (i * step + start, the last value
/// exactly `stop`), so the maps agree with the fixture generator's bit for bit.
fn linspace(start: f64, stop: f64, n: usize) -> Vec<f64> {
    let step = (stop - start) / (n - 1) as f64;
    let mut v: Vec<f64> = (0..n).map(|i| i as f64 * step + start).collect();
    v[n - 1] = stop;
    v
}

/// The dynamic tree map with 7 exponent bits over 8 bits: for exponent i in 0..7, the midpoints
/// of linspace(0.1, 1, k + 1) scaled by 10^(i - 6), where k = 2^i fraction values per sign for
/// the signed map and 2^(i+1) for the unsigned one; then 0 and 1. Computed in f64, rounded to
/// f32 once, sorted.
fn dynamic_map(signed: bool) -> [f32; 256] {
    const EXPONENT_BITS: i32 = 7;
    let mut data: Vec<f64> = Vec::with_capacity(256);
    for i in 0..EXPONENT_BITS {
        let items = if signed { 1usize << i } else { 1usize << (i + 1) };
        let bounds = linspace(0.1, 1.0, items + 1);
        let scale = 10f64.powf(f64::from(i - (EXPONENT_BITS - 1)));
        for w in bounds.windows(2) {
            let mean = (w[0] + w[1]) / 2.0;
            data.push(scale * mean);
            if signed {
                data.push(-scale * mean);
            }
        }
    }
    data.push(0.0);
    data.push(1.0);
    let mut out: Vec<f32> = data.iter().map(|&v| v as f32).collect();
    out.sort_by(f32::total_cmp);
    let mut map = [0f32; 256];
    map.copy_from_slice(&out);
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_are_256_ascending_distinct_values_with_zero_and_one() {
        for m in DynMap::ALL {
            let v = m.values();
            assert!(v.windows(2).all(|w| w[0] < w[1]), "{m:?} not strictly ascending");
            assert!(v.contains(&0.0) && v[255] == 1.0, "{m:?}");
        }
        assert_eq!(DynMap::Unsigned.values()[0], 0.0);
        assert!(DynMap::Signed.values()[0] < -0.99);
        // the smallest magnitudes are 10^-6 times the first midpoint (0.55 signed, 0.325 unsigned)
        assert!((DynMap::Signed.values()[128] - 0.55e-6).abs() < 1e-12);
        assert!((DynMap::Unsigned.values()[1] - 0.325e-6).abs() < 1e-12);
    }

    #[test]
    fn nearest_picks_the_closest_code_and_the_lower_on_ties() {
        for m in DynMap::ALL {
            let v = m.values();
            for (i, &x) in v.iter().enumerate() {
                assert_eq!(m.nearest(x) as usize, i);
            }
            for i in 0..255 {
                let mid = (v[i] + v[i + 1]) / 2.0;
                let want = if (v[i + 1] - mid).abs() < (mid - v[i]).abs() { i + 1 } else { i };
                assert_eq!(m.nearest(mid) as usize, want);
            }
        }
        assert_eq!(DynMap::Unsigned.nearest(-0.5), 0);
        assert_eq!(DynMap::Signed.nearest(2.0), 255);
    }
}
