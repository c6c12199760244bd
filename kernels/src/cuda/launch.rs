//! A kernel's launch: the grid and block each kernel IR space maps to (see `emit`'s module doc
//! for the mapping), the attention kernels' too, and the limits a grid must keep.

use super::codegen::{split_columns, warp_rows, MAX_GRID, SPLIT_SLICES, WARP_ROWS};
use super::stmts::max_loop;
use crate::error::KernelError;
use crate::kir::{Attention, Body, Kernel, RowMapping, Space};
use crate::target::CudaSettings;

/// Threads per block of elementwise and thread-per-row kernels.
pub const BLOCK: u32 = 256;

/// Query rows per block of an attention kernel (one thread each).
pub const BQ: u32 = 64;

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LaunchDims {
    pub grid: [u32; 3],
    pub block: u32,
}

/// A kernel whose grid the hardware cannot launch is an error here, not a silently clamped
/// launch that skips work.
pub(super) fn check_grid(k: &Kernel, d: &LaunchDims) -> Result<(), KernelError> {
    let want = grid_wanted(k);
    for (axis, (&w, &max)) in want.iter().zip(&MAX_GRID).enumerate() {
        if w > max {
            return Err(KernelError::Unsupported {
                node: format!("kernel {} ({})", k.family, k.note),
                why: format!("its grid needs {w} blocks along axis {axis}, more than CUDA's {max} (launch {d:?})"),
            });
        }
    }
    Ok(())
}

/// Blocks along each axis before clamping to at least one.
fn grid_wanted(k: &Kernel) -> [u64; 3] {
    let n = |x: usize| x as u64;
    match &k.body {
        Body::Loops { space: Space::Elements { shape }, .. } => [n(shape.iter().product::<usize>()).div_ceil(u64::from(BLOCK)), 1, 1],
        Body::Loops { space: Space::Rows { rows, mapping: RowMapping::Thread }, .. } => [n(*rows).div_ceil(u64::from(BLOCK)), 1, 1],
        Body::Loops { space: Space::Rows { rows, mapping: RowMapping::Block }, .. } => [n(*rows), 1, 1],
        Body::Attention(a) => [n(a.t).div_ceil(u64::from(BQ)), n(a.b * a.nh), 1],
    }
}

/// Threads per block for a Block-mapped row of up to `len` elements: about four per thread.
fn row_block(len: usize) -> u32 {
    (len.div_ceil(4)).next_power_of_two().clamp(32, 1024) as u32
}

/// The grid and block of a kernel. Every grid has at least one block (CUDA launches none with
/// zero): a kernel with nothing to do returns at once (its guards see every index out of range).
/// Grids past CUDA's limits are rejected by `emit`, so the clamp here never drops work. With the
/// default variants (`CudaSettings::default`), as `emit` writes the kernel.
pub fn launch_dims(k: &Kernel) -> LaunchDims {
    launch_dims_with(k, &CudaSettings::default())
}

/// The grid and block of `k` as `emit_with(k, cg)` writes it.
pub fn launch_dims_with(k: &Kernel, cg: &CudaSettings) -> LaunchDims {
    let blocks = |n: usize, per: u32| n.div_ceil(per as usize).clamp(1, MAX_GRID[0] as usize) as u32;
    if let Body::Loops { space: Space::Rows { rows, .. }, .. } = &k.body {
        if warp_rows(k, cg) {
            return LaunchDims { grid: [blocks(*rows, WARP_ROWS), 1, 1], block: 32 * WARP_ROWS };
        }
        if split_columns(k, cg) {
            return LaunchDims { grid: [blocks(*rows, 32), 1, 1], block: 32 * SPLIT_SLICES };
        }
    }
    match &k.body {
        Body::Loops { space: Space::Elements { shape }, .. } => {
            LaunchDims { grid: [blocks(shape.iter().product(), BLOCK), 1, 1], block: BLOCK }
        }
        Body::Loops { space: Space::Rows { rows, mapping: RowMapping::Thread }, .. } => {
            LaunchDims { grid: [blocks(*rows, BLOCK), 1, 1], block: BLOCK }
        }
        Body::Loops { space: Space::Rows { rows, mapping: RowMapping::Block }, stmts } => {
            LaunchDims { grid: [blocks(*rows, 1), 1, 1], block: row_block(max_loop(stmts)) }
        }
        Body::Attention(a) => attention_dims(a),
    }
}

/// The grid and block of an attention kernel: every part puts 64 rows (query rows, or key rows for
/// the key/value gradients) in a block, one block row per (batch, head).
pub fn attention_dims(a: &Attention) -> LaunchDims {
    let rows = |per: u32| (a.t as u32).div_ceil(per).max(1);
    let bh = (a.b * a.nh).max(1) as u32;
    LaunchDims { grid: [rows(BQ), bh, 1], block: BQ }
}
