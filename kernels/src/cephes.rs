//! Cephes' expf, the constants: the one definition that the LLVM backend's vectorizable exp
//! (`llvm/math.rs`) and the CPU runtime's vectorized softmax exp (`qatc_runtime`'s `vmath`)
//! both compute with. e^x = 2^n e^r with n = round(x log2 e) and r = x - n ln 2, |r| <= ln2/2;
//! e^r = 1 + r + r^2 P(r).

/// ln 2 split in two: `LN2_HI` (355/512, written out exactly) has few enough significant bits
/// that n * LN2_HI is exact for every n the range reduction takes, and LN2_HI + LN2_LO is ln 2
/// to about 2^-32.
#[allow(clippy::excessive_precision)]
pub const LN2_HI: f32 = 0.693_359_375;
pub const LN2_LO: f32 = -2.121_944_4e-4;

/// P(r), highest degree first (Horner): e^r ~ 1 + r + r^2 P(r) within 2 ulp for |r| <= ln2/2.
pub const POLY: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5];
