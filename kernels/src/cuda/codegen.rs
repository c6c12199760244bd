//! The CUDA writer's kernel variants: faster forms of a kernel that the writer picks where they
//! apply, each with the general form as its fallback, and the switches that allow them.
//!
//! A variant computes what the kernel IR says (the same semantics, a different fixed order of
//! float sums at most), under the kernel's own name and params. Attention's tensor-core form
//! keeps the general launch dims; the row variants do not, so launch dims come from
//! `emit::launch_dims_with(kernel, settings)` and an executor launches a kernel with the dims of
//! the text it loaded (`CudaKernel::launch`). Which variants the writer may pick is a target's
//! setting (`crate::target::CudaSettings::allows`): each only where it applies; off forces the
//! general kernel, so a GPU session can turn off a variant that fails.
//!
//! The variants:
//! - `tensor-core-attention`: the causal attention forward on 16-bit tensor cores
//!   (`qatc_attention_mma.cuh`) where the operands' values are f16/bf16
//!   (`kir::Attention::values`) and hs is 32, 48 or 64 (at 16 ptxas spills), on sm_80 and later;
//!   else the fp32 template (`qatc_attention.cuh`).
//! - `tensor-core-attention-backward`: the same for the backward's kernels: lse (where the
//!   forward's is not kept), delta, dq, dk/dv and dv.
//! - `warp-rows`: a `RowMapping::Block` row kernel whose loops are at most `WARP_ROW_MAX` long
//!   (layernorm and its gradient over C, softmax over T, ...) as one warp per row instead of one
//!   block.
//! - `split-columns`: a `RowMapping::Thread` kernel that sums over a loop of at least
//!   `SPLIT_MIN` (bias and gamma gradients: a column of [B*T, C] per thread, C threads in all, a
//!   few SMs busy) with each row's loop split over `SPLIT_SLICES` warps, 32 rows per block, the
//!   slices' parts summed in slice order: `SPLIT_SLICES` times the threads, and a fixed order.

use crate::kir::{Body, Kernel, ReduceOp, RowMapping, Space, Stmt, Ty};

use super::stmts::{max_loop, stores};
use crate::target::CudaSettings;

/// A set of variants, a value (`Copy`) that a run's `qatc.json` saves as their names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(from = "Vec<Variant>", into = "Vec<Variant>")]
pub struct Variants(u8);

impl Variants {
    pub const EMPTY: Variants = Variants(0);

    pub fn is_empty(&self) -> bool {
        self.0 == 0
    }

    pub fn contains(&self, v: Variant) -> bool {
        self.0 & v.bit() != 0
    }

    /// The variants in the set, in `Variant::ALL`'s order.
    pub fn iter(self) -> impl Iterator<Item = Variant> {
        Variant::ALL.into_iter().filter(move |v| self.0 & v.bit() != 0)
    }
}

impl FromIterator<Variant> for Variants {
    fn from_iter<I: IntoIterator<Item = Variant>>(vs: I) -> Variants {
        Variants(vs.into_iter().fold(0, |bits, v| bits | v.bit()))
    }
}

impl From<Vec<Variant>> for Variants {
    fn from(vs: Vec<Variant>) -> Variants {
        vs.into_iter().collect()
    }
}

impl From<Variants> for Vec<Variant> {
    fn from(set: Variants) -> Vec<Variant> {
        set.iter().collect()
    }
}

/// A variant by the name `qatc train --no-variant NAME` takes and a run's `qatc.json` saves, so
/// that a GPU session can time the step without each one (bench/gpu.sh `ablate`: issue 20's
/// before and after for each change) or rule out one that fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Variant {
    TensorCoreAttention,
    TensorCoreAttentionBackward,
    WarpRows,
    SplitColumns,
}

impl Variant {
    pub const ALL: [Variant; 4] =
        [Variant::TensorCoreAttention, Variant::TensorCoreAttentionBackward, Variant::WarpRows, Variant::SplitColumns];

    pub fn name(self) -> &'static str {
        match self {
            Variant::TensorCoreAttention => "tensor-core-attention",
            Variant::TensorCoreAttentionBackward => "tensor-core-attention-backward",
            Variant::WarpRows => "warp-rows",
            Variant::SplitColumns => "split-columns",
        }
    }

    pub fn from_name(name: &str) -> Option<Variant> {
        Variant::ALL.into_iter().find(|v| v.name() == name)
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// The most blocks a grid may have along x (2^31 - 1) and along y or z (65535). Here, the lowest
/// file that reads it: a variant applies only where its grid fits (`split_columns`), and
/// `launch::check_grid` rejects a kernel whose grid does not.
pub const MAX_GRID: [u64; 3] = [(1 << 31) - 1, 65535, 65535];

/// The longest row loop a warp takes on (`warp-rows`): 32 elements per lane, GPT-2
/// XL's C = 1600 not (a block's threads share it better), 124M's 768 yes.
pub const WARP_ROW_MAX: usize = 1024;
/// Rows (warps) per block of a warp-per-row kernel.
pub const WARP_ROWS: u32 = 4;

/// The shortest summed loop that `split-columns` splits (the tiny test model's
/// B*T = 32 is split, so the GPU tests see the variant).
pub const SPLIT_MIN: usize = 32;
/// Warps (slices of the loop) per block of a split kernel; each block takes 32 rows.
pub const SPLIT_SLICES: u32 = 8;

/// Whether the writer writes `k` one warp per row under `cg`.
pub fn warp_rows(k: &Kernel, cg: &CudaSettings) -> bool {
    match &k.body {
        Body::Loops { space: Space::Rows { mapping: RowMapping::Block, .. }, stmts } => {
            cg.allows(Variant::WarpRows) && max_loop(stmts) <= WARP_ROW_MAX
        }
        _ => false,
    }
}

/// Whether the writer writes `k` under `cg` with its sums split over slices: a thread-per-row kernel with at least
/// one row, a top-level sum over a loop of at least `SPLIT_MIN`, every top-level reduction a sum
/// of a number (a sequential one, such as `FirstAbsMax`, cannot be split) that stores nothing.
pub fn split_columns(k: &Kernel, cg: &CudaSettings) -> bool {
    let Body::Loops { space: Space::Rows { rows, mapping: RowMapping::Thread }, stmts } = &k.body else { return false };
    let long = stmts.iter().any(|s| matches!(s, Stmt::Reduce { lp, .. } if lp.max >= SPLIT_MIN));
    let splittable = stmts.iter().all(|s| match s {
        Stmt::Reduce { op, ty, body, .. } => *op == ReduceOp::Sum && *ty != Ty::Bool && stores(body).is_empty(),
        _ => true,
    });
    cg.allows(Variant::SplitColumns) && *rows > 0 && (*rows as u64).div_ceil(32) <= MAX_GRID[0] && long && splittable
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_variant_turns_off_its_own_switch_and_its_name_round_trips() {
        for v in Variant::ALL {
            assert_eq!(Variant::from_name(v.name()), Some(v));
            // the serde name (a run's qatc.json) is the command line's
            assert_eq!(serde_json::to_string(&v).expect("serializes"), format!("\"{}\"", v.name()));
            let off = CudaSettings::default().without(v);
            assert!(Variant::ALL.iter().all(|&w| off.allows(w) == (w != v)), "{v:?} turns off exactly its own variant");
        }
        let all: Variants = Variant::ALL.into_iter().collect();
        assert!(Variant::ALL.iter().all(|&v| !CudaSettings { no_variants: all, ..CudaSettings::default() }.allows(v)));
        assert_eq!(all.iter().collect::<Vec<_>>(), Variant::ALL);
        // a set saves as its names, in a fixed order, and reads back
        let two: Variants = [Variant::SplitColumns, Variant::WarpRows, Variant::WarpRows].into_iter().collect();
        let json = serde_json::to_string(&two).expect("serializes");
        assert_eq!(json, r#"["warp-rows","split-columns"]"#);
        assert_eq!(serde_json::from_str::<Variants>(&json).expect("reads"), two);
        assert_eq!(Variant::from_name("fast"), None);
    }
}
