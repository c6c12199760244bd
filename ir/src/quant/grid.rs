//! Each scheme's grid at a bit width, the one statement of its constants: the codes, the point
//! each code stands for, the value table of a table scheme (NF4) and the rule that picks a group's
//! scale. Every site that quantizes reads them from here: the interpreter's quantizer and learned
//! scales (`qatc_runtime::quant`), the kernels' expressions (`qatc_kernels::lower`), the CUDA
//! headers' tables (written by the code generator from `NF4`), the GGUF export.
//!
//! A weight is stored as codes, unsigned integers 0 ..= `max_code`, and per group a scale S (and
//! for asym a zero point z); code c stands for the value point(c) S, its point in units of S.

use super::QuantScheme;

/// QLoRA / bitsandbytes NormalFloat4 code values, the one table every backend reads (the
/// interpreter's `quant`, the LLVM backend, and the CUDA headers' `qatc_tables.cuh`, which the
/// code generator writes from it).
#[allow(clippy::excessive_precision)]
pub const NF4: [f32; 16] = [
    -1.0,
    -0.696_192_800_998_687_7,
    -0.525_073_051_452_636_7,
    -0.394_917_488_098_144_53,
    -0.284_441_381_692_886_35,
    -0.184_773_430_228_233_34,
    -0.091_050_036_251_544_95,
    0.0,
    0.079_580_299_556_255_34,
    0.160_930_201_411_247_25,
    0.246_112_301_945_686_34,
    0.337_915_241_718_292_24,
    0.440_709_829_330_444_34,
    0.562_617_003_917_694_1,
    0.722_956_836_223_602_3,
    1.0,
];

/// The point a code stands for, in units of the group's scale.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Points {
    /// c - offset: the offset makes signed points unsigned codes (sym: qmax = 2^(b-1) - 1,
    /// points -qmax ..= qmax; q4_0: 2^(b-1) = 8, points -8 ..= 7).
    Offset(u32),
    /// c - z, z the group's zero point, an integer in 0 ..= max_code (asym).
    ZeroPoint,
    /// table[c] (nf4: `NF4`, which spans [-1, 1]); a value is coded as the nearest entry, the
    /// first on ties.
    Table(&'static [f32; 16]),
}

/// How the min-max quantizer picks a group's scale (learned scales start from it). The
/// divisor is `Grid::scale_divisor`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ScaleRule {
    /// S = absmax / divisor, the highest point: the largest magnitude lands on it (sym: qmax; nf4:
    /// 1, the table's last value). x / S is rounded half to even and clamped to the points (nf4:
    /// the nearest table value).
    AbsMax,
    /// S = (max(0, max w) - min(0, min w)) / divisor, max_code; z = clamp(round(-min(0, min w) / S),
    /// 0, max_code); the code round(x / S) + z clamped to 0 ..= max_code (asym).
    MinMax,
    /// llama.cpp's Q4_0: d = m / divisor, the lowest point (-8), m the group's first element of
    /// largest magnitude with its sign, so m lands on the lowest point exactly and the other sign
    /// saturates at the highest; the code min(max_code, trunc(x * (1/d) + `Grid::trunc_bias`)),
    /// with d's fp32 reciprocal; the stored scale is fp16(d).
    SignedMax,
}

/// A scheme's grid at one bit width (`QuantSpec::grid`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Grid {
    /// The highest code; codes are 0 ..= max_code.
    pub max_code: u32,
    pub points: Points,
    pub scale: ScaleRule,
}

impl Grid {
    /// The grid of `scheme` at `bits`, which must be a width the scheme takes
    /// (`QuantScheme::widths`).
    pub fn of(scheme: QuantScheme, bits: u8) -> Grid {
        let all = (1u32 << bits) - 1;
        let half = 1u32 << (bits - 1);
        match scheme {
            // one code fewer than the bits hold, so that the points are symmetric about 0
            QuantScheme::Sym => Grid { max_code: 2 * (half - 1), points: Points::Offset(half - 1), scale: ScaleRule::AbsMax },
            QuantScheme::Asym => Grid { max_code: all, points: Points::ZeroPoint, scale: ScaleRule::MinMax },
            QuantScheme::Nf4 => Grid { max_code: all, points: Points::Table(&NF4), scale: ScaleRule::AbsMax },
            QuantScheme::Q4_0 => Grid { max_code: all, points: Points::Offset(half), scale: ScaleRule::SignedMax },
        }
    }

    /// How many codes there are.
    pub fn levels(&self) -> u32 {
        self.max_code + 1
    }

    /// The code of point 0 where it is fixed (sym's qmax, q4_0's 8); asym's is the group's zero
    /// point, a table's codes index it.
    pub fn offset(&self) -> Option<u32> {
        match self.points {
            Points::Offset(o) => Some(o),
            Points::ZeroPoint | Points::Table(_) => None,
        }
    }

    /// The lowest and the highest point for zero point `z` (an integer in 0 ..= max_code; only
    /// asym reads it): a value's point is its x / S rounded and clamped to them (a table's: the
    /// nearest entry, which stays within them).
    pub fn range(&self, z: f64) -> (f64, f64) {
        match self.points {
            Points::Offset(o) => (-f64::from(o), f64::from(self.max_code - o)),
            Points::ZeroPoint => (-z, f64::from(self.max_code) - z),
            Points::Table(t) => (f64::from(t[0]), f64::from(t[t.len() - 1])),
        }
    }

    /// The divisor of the scale rule (see `ScaleRule`): sym's qmax, nf4's 1, asym's max_code,
    /// q4_0's -8.
    pub fn scale_divisor(&self) -> f64 {
        match self.scale {
            ScaleRule::AbsMax => self.range(0.0).1,
            ScaleRule::MinMax => f64::from(self.max_code),
            ScaleRule::SignedMax => self.range(0.0).0,
        }
    }

    /// What Q4_0 adds to x / d before truncating it to a code, 8.5: the offset, and 0.5 so that
    /// truncating rounds half up (x / d is at least the lowest point, -8, so the sum is positive
    /// and truncation is the floor).
    pub fn trunc_bias(&self) -> f64 {
        f64::from(self.offset().unwrap_or(0)) + 0.5
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::QuantSpec;

    fn grid(scheme: QuantScheme, bits: u8) -> Grid {
        QuantSpec { bits, group: 32, scheme }.grid()
    }

    /// The constants docs/formats.md and the schemes' docs state, for the widths each scheme takes.
    #[test]
    fn each_scheme_states_its_published_constants() {
        // sym: qmax = 2^(b-1) - 1, codes 0 ..= 2 qmax offset by qmax, S = absmax / qmax
        for (bits, qmax) in [(2u8, 1u32), (3, 3), (4, 7), (8, 127)] {
            let g = grid(QuantScheme::Sym, bits);
            assert_eq!((g.max_code, g.offset(), g.levels()), (2 * qmax, Some(qmax), 2 * qmax + 1), "sym {bits}");
            assert_eq!(g.range(0.0), (-f64::from(qmax), f64::from(qmax)));
            assert_eq!(g.scale_divisor(), f64::from(qmax));
        }
        // asym: codes 0 ..= 2^b - 1, points shifted by the zero point, S = (max - min) / (2^b - 1)
        for (bits, top) in [(2u8, 3u32), (4, 15), (8, 255)] {
            let g = grid(QuantScheme::Asym, bits);
            assert_eq!((g.max_code, g.offset(), g.levels()), (top, None, top + 1), "asym {bits}");
            assert_eq!(g.range(3.0), (-3.0, f64::from(top) - 3.0));
            assert_eq!(g.scale_divisor(), f64::from(top));
        }
        // llama.cpp's Q4_0: d = m / -8, q = min(15, trunc(x / d + 8.5)), w' = (q - 8) d
        let q = grid(QuantScheme::Q4_0, 4);
        assert_eq!((q.max_code, q.offset(), q.range(0.0)), (15, Some(8), (-8.0, 7.0)));
        assert_eq!((q.scale_divisor(), q.trunc_bias()), (-8.0, 8.5));
        // NF4: 16 table values spanning [-1, 1], S = absmax
        let n = grid(QuantScheme::Nf4, 4);
        assert_eq!((n.max_code, n.offset(), n.range(0.0), n.scale_divisor()), (15, None, (-1.0, 1.0), 1.0));
        assert_eq!(n.points, Points::Table(&NF4));
        assert_eq!(NF4[7], 0.0, "code 7 is zero");
    }

    /// LSQ's Q_P is the grid's highest point at zero point 0.
    #[test]
    fn lsq_qp_is_the_highest_point() {
        for scheme in QuantScheme::ALL {
            for bits in scheme.widths() {
                let spec = QuantSpec { bits, group: 32, scheme };
                assert_eq!(spec.lsq_qp(), spec.grid().range(0.0).1, "{scheme} {bits}");
                assert!(spec.grid().levels() <= 1 << bits, "{scheme} {bits}: more codes than the bits hold");
            }
        }
    }
}
