//! The CUDA writer's kernel variants: faster forms of a kernel that the writer picks where they
//! apply, each with the general form as its fallback, and the switches that allow them.
//!
//! A variant computes what the kernel IR says (the same semantics, a different fixed order of
//! float sums at most), under the kernel's own name and params. Attention's tensor-core form
//! keeps the general launch dims; the row variants do not, so launch dims come from
//! `emit::launch_dims_with(kernel, codegen)` and an executor launches a kernel with the dims of
//! the text it loaded (`CudaKernel::launch`).

use crate::kir::{Body, Kernel, ReduceOp, RowMapping, Space, Stmt, Ty};

use super::launch::{max_loop, MAX_GRID};
use super::loop_nest::stores;

/// Which of the writer's kernel variants it may pick (a value passed in: the CUDA executor's
/// `CudaOptions::codegen`; `qatc train --general-kernels` is `GENERAL`). Each switch only allows
/// a variant where it applies; off forces the general kernel, so a GPU session can turn off a
/// variant that fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaCodegen {
    /// The causal attention forward on 16-bit tensor cores (`qatc_attention_mma.cuh`) where the
    /// operands' values are f16/bf16 (`kir::Attention::values`) and hs is 32, 48 or 64 (at 16
    /// ptxas spills), on sm_80 and later; else the fp32 template (`qatc_attention.cuh`).
    pub tensor_core_attention: bool,
    /// The same for the backward's kernels: lse (where the forward's is not kept), delta, dq,
    /// dk/dv and dv.
    pub tensor_core_attention_backward: bool,
    /// A `RowMapping::Block` row kernel whose loops are at most `WARP_ROW_MAX` long (layernorm
    /// and its gradient over C, softmax over T, ...) as one warp per row instead of one block.
    pub warp_rows: bool,
    /// A `RowMapping::Thread` kernel that sums over a loop of at least `SPLIT_MIN` (bias and
    /// gamma gradients: a column of [B*T, C] per thread, C threads in all, a few SMs busy) with
    /// each row's loop split over `SPLIT_SLICES` warps, 32 rows per block, the slices' parts
    /// summed in slice order: `SPLIT_SLICES` times the threads, and a fixed order.
    pub split_columns: bool,
}

impl Default for CudaCodegen {
    fn default() -> CudaCodegen {
        CudaCodegen { tensor_core_attention: true, tensor_core_attention_backward: true, warp_rows: true, split_columns: true }
    }
}

impl CudaCodegen {
    /// Every variant off: the general kernels only.
    pub const GENERAL: CudaCodegen =
        CudaCodegen { tensor_core_attention: false, tensor_core_attention_backward: false, warp_rows: false, split_columns: false };
}

/// The longest row loop a warp takes on (`CudaCodegen::warp_rows`): 32 elements per lane, GPT-2
/// XL's C = 1600 not (a block's threads share it better), 124M's 768 yes.
pub const WARP_ROW_MAX: usize = 1024;
/// Rows (warps) per block of a warp-per-row kernel.
pub const WARP_ROWS: u32 = 4;

/// The shortest summed loop that `CudaCodegen::split_columns` splits (the tiny test model's
/// B*T = 32 is split, so the GPU tests see the variant).
pub const SPLIT_MIN: usize = 32;
/// Warps (slices of the loop) per block of a split kernel; each block takes 32 rows.
pub const SPLIT_SLICES: u32 = 8;

/// Whether `cg` writes `k` one warp per row.
pub fn warp_rows(k: &Kernel, cg: &CudaCodegen) -> bool {
    match &k.body {
        Body::Loops { space: Space::Rows { mapping: RowMapping::Block, .. }, stmts } => cg.warp_rows && max_loop(stmts) <= WARP_ROW_MAX,
        _ => false,
    }
}

/// Whether `cg` writes `k` with its sums split over slices: a thread-per-row kernel with at least
/// one row, a top-level sum over a loop of at least `SPLIT_MIN`, every top-level reduction a sum
/// of a number (a sequential one, such as `FirstAbsMax`, cannot be split) that stores nothing.
pub fn split_columns(k: &Kernel, cg: &CudaCodegen) -> bool {
    let Body::Loops { space: Space::Rows { rows, mapping: RowMapping::Thread }, stmts } = &k.body else { return false };
    let long = stmts.iter().any(|s| matches!(s, Stmt::Reduce { lp, .. } if lp.max >= SPLIT_MIN));
    let splittable = stmts.iter().all(|s| match s {
        Stmt::Reduce { op, ty, body, .. } => *op == ReduceOp::Sum && *ty != Ty::Bool && stores(body).is_empty(),
        _ => true,
    });
    cg.split_columns && *rows > 0 && (*rows as u64).div_ceil(32) <= MAX_GRID[0] && long && splittable
}
