//! Quantization as the IR states it: the schemes (`QuantScheme`), a weight's quantization
//! (`QuantSpec`: bits, group, scheme), each scheme's grid (`grid`: codes, points, NF4's table,
//! the scale rule) and which parameter a fake-quant gradient is for (`QuantParam`). The ops that
//! use them are in `op.rs`.

use std::ops::RangeInclusive;

use crate::types::DType;

mod grid;
pub use grid::{Grid, Points, ScaleRule, NF4};

/// Which operand of FakeQuantLearned a FakeQuantLearnedGrad differentiates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantParam {
    Weight,
    Scale,
    Zero,
}

impl QuantParam {
    pub const ALL: [QuantParam; 3] = [QuantParam::Weight, QuantParam::Scale, QuantParam::Zero];
    pub fn name(self) -> &'static str {
        match self {
            QuantParam::Weight => "weight",
            QuantParam::Scale => "scale",
            QuantParam::Zero => "zero",
        }
    }
    pub fn from_name(s: &str) -> Option<QuantParam> {
        QuantParam::ALL.into_iter().find(|q| q.name() == s)
    }
}

/// How weights are quantized (see `FakeQuant`). The numbers in these formulas are each scheme's
/// `Grid` (`QuantSpec::grid`), where every site reads them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantScheme {
    /// S = absmax / qmax, qmax = 2^(b-1) - 1; q = clamp(round(w / S), -qmax, qmax); w' = q S.
    Sym,
    /// rmin = min(0, min w), rmax = max(0, max w), S = (rmax - rmin) / (2^b - 1),
    /// Z = clamp(round(-rmin / S), 0, 2^b - 1), q = clamp(round(w / S) + Z, 0, 2^b - 1), w' = S (q - Z).
    Asym,
    /// QLoRA's NormalFloat4: nearest of 16 code values times the group's absmax (4 bits only).
    Nf4,
    /// llama.cpp's Q4_0: d = m / -8 (m the signed element of largest magnitude),
    /// q = min(15, trunc(w / d + 8.5)), w' = (q - 8) fp16(d) (4 bits, group 32 only).
    Q4_0,
}

impl QuantScheme {
    pub const ALL: [QuantScheme; 4] = [QuantScheme::Sym, QuantScheme::Asym, QuantScheme::Nf4, QuantScheme::Q4_0];
    pub fn name(self) -> &'static str {
        match self {
            QuantScheme::Sym => "sym",
            QuantScheme::Asym => "asym",
            QuantScheme::Nf4 => "nf4",
            QuantScheme::Q4_0 => "q4_0",
        }
    }
    pub fn from_name(s: &str) -> Option<QuantScheme> {
        QuantScheme::ALL.into_iter().find(|q| q.name() == s)
    }
    /// Whether the scheme stores a zero-point per group.
    pub fn has_zero_point(self) -> bool {
        self == QuantScheme::Asym
    }
    /// The bit widths the scheme takes: nf4's table and llama.cpp's Q4_0 are 4-bit formats.
    pub fn widths(self) -> RangeInclusive<u8> {
        match self {
            QuantScheme::Sym | QuantScheme::Asym => 2..=8,
            QuantScheme::Nf4 | QuantScheme::Q4_0 => 4..=4,
        }
    }
}

impl std::fmt::Display for QuantScheme {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl serde::Serialize for QuantScheme {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> serde::Deserialize<'de> for QuantScheme {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        QuantScheme::from_name(&s).ok_or_else(|| {
            let names: Vec<&str> = QuantScheme::ALL.iter().map(|q| q.name()).collect();
            serde::de::Error::custom(format!("unknown scheme `{s}`; schemes: {}", names.join(", ")))
        })
    }
}

/// `--scheme`: the values are `ALL` by `name`, so the command line, the text format and the
/// JSON files spell a scheme the same way.
#[cfg(feature = "clap")]
impl clap::ValueEnum for QuantScheme {
    fn value_variants<'a>() -> &'a [Self] {
        &QuantScheme::ALL
    }
    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(clap::builder::PossibleValue::new(self.name()))
    }
}

/// The quantization of one weight: `bits` per element in groups of `group` consecutive elements
/// along the input dimension (dim 0 of a Conv1D weight [in, out]) for each output channel;
/// `group` 0 means one group per output channel (per-channel).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuantSpec {
    pub bits: u8,
    pub group: usize,
    pub scheme: QuantScheme,
}

impl QuantSpec {
    /// The group size for an input dimension of `n_in` (per-channel resolves to `n_in`).
    pub fn group_for(&self, n_in: usize) -> usize {
        if self.group == 0 {
            n_in
        } else {
            self.group
        }
    }
    /// The storage type of the codes: packed 4-bit up to 4 bits, bytes above.
    pub fn code_dtype(&self) -> DType {
        if self.bits <= 4 {
            DType::I4
        } else {
            DType::U8
        }
    }
    /// The storage type of the scales: Q4_0 stores d as fp16, the others f32.
    pub fn scale_dtype(&self) -> DType {
        if self.scheme == QuantScheme::Q4_0 {
            DType::F16
        } else {
            DType::F32
        }
    }
    /// The storage type of the zero points (asym only).
    pub fn zero_dtype(&self) -> Option<DType> {
        self.scheme.has_zero_point().then_some(DType::F32)
    }
    /// Bytes as stored for a weight [n_in, n_out]: packed codes, the scales and zero points.
    pub fn stored_bytes(&self, n_in: usize, n_out: usize) -> usize {
        let groups = n_in / self.group_for(n_in).max(1) * n_out;
        self.code_dtype().bytes_for(n_in * n_out)
            + self.scale_dtype().bytes_for(groups)
            + self.zero_dtype().map_or(0, |d| d.bytes_for(groups))
    }
    /// The grid of the scheme at these bits (the spec must have been checked).
    pub fn grid(&self) -> Grid {
        Grid::of(self.scheme, self.bits)
    }
    /// LSQ's Q_P: the grid's highest point in units of the scale (at zero point 0: asym's codes
    /// q - z reach 2^b - 1 when z = 0; nf4's table spans [-1, 1], so 1).
    pub fn lsq_qp(&self) -> f64 {
        self.grid().range(0.0).1
    }
    /// LSQ's gradient scale 1 / sqrt(n Q_P) for a weight with `n_in` input features, n the
    /// elements that share a scale (the group).
    pub fn lsq_grad_scale(&self, n_in: usize) -> f64 {
        1.0 / ((self.group_for(n_in) as f64) * self.lsq_qp()).sqrt()
    }
    /// Checks the combination for a weight with `n_in` input features.
    pub fn check(&self, n_in: usize) -> Result<(), String> {
        if !(2..=8).contains(&self.bits) {
            return Err(format!("bits must be 2..8, got {}", self.bits));
        }
        match self.scheme {
            QuantScheme::Nf4 if !self.scheme.widths().contains(&self.bits) => return Err("scheme nf4 needs 4 bits".into()),
            QuantScheme::Q4_0 if !self.scheme.widths().contains(&self.bits) || self.group != 32 => {
                return Err("scheme q4_0 needs 4 bits and group 32 (llama.cpp's block)".into())
            }
            _ => {}
        }
        let g = self.group_for(n_in);
        if g == 0 || !n_in.is_multiple_of(g) {
            let ok: Vec<String> = (1..=n_in).filter(|&d| n_in.is_multiple_of(d) && d >= 8).map(|d| d.to_string()).collect();
            return Err(format!(
                "group {} does not divide the input dimension {n_in}; sizes that do: {} (or 0 for per-channel)",
                self.group,
                ok.join(", ")
            ));
        }
        Ok(())
    }
}
