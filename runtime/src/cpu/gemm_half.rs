//! GEMMs with f16/bf16 operands or destination (`--precision bf16|fp16`) on the CPU, accumulating
//! in f32 as `GemmTypes` says. Where both operands are bf16 and oneDNN runs bf16 natively on this
//! CPU (`onednn.rs`), it reads them as stored: into c directly when c is f32 without a bias; on
//! AMX (oneDNN's matmul primitive) into a bf16 c directly too, the library rounding once and
//! adding the bias before; else into an f32 tile of c rounded as below. Otherwise the product
//! runs as f32 GEMMs (`gemm::sgemm`: OpenBLAS or the gemm crate) over blocks, each operand's
//! block widened into an f32 scratch just before the library packs it (an exact conversion),
//! partial products over K summed in an f32 tile of c, and each finished tile rounded once to
//! nearest even into c, the bias added before that rounding (cuBLASLt's epilogue does the same).
//!
//! ```text
//! for each tile of c, [MB rows, NB columns]:
//!     tile f32 = c (accumulating) or 0
//!     for each block of K, KB long:  a[rows, ks] -> f32, b[ks, cols] -> f32   (f32 operands in place)
//!                                    tile += a_block @ b_block                  f32 accumulation
//!     c[rows, cols] = round(tile + bias)
//! ```
//!
//! A block keeps its source's layout (a transposed operand is widened column by column, reading
//! memory in order), and the conversions vectorize (`convert.rs`). The scratch is a few MiB per GEMM, outside the plan. The
//! loaded OpenBLAS has no bf16 GEMM (Debian builds it without BFLOAT16), and neither library has
//! an f16 one, so f16 operands are always widened.

use half::f16;
use qatc_ir::DType;
use qatc_kernels::program::{Gemm, View};
use rayon::prelude::*;

use super::blas::Blas;
use super::convert::{bf16_bits, elem_bytes, narrow, widen};
use super::gemm::{batch_offsets, sgemm, GemmLibs};
use super::onednn::Bf16Gemm;

/// Tile sizes: rows and columns of c, and the K of one block (scratch: 1 + 2 + 2 MiB of f32).
const MB: usize = 512;
const NB: usize = 1024;
const KB: usize = 512;

/// Below this many elements a conversion runs on the calling thread.
const PAR_MIN_ELEMS: usize = 1 << 16;

/// A matrix in a buffer: base address, element type, offset and strides (elements).
#[derive(Clone, Copy)]
struct Mat {
    base: *mut u8,
    dtype: DType,
    offset: usize,
    rs: usize,
    cs: usize,
}

// SAFETY: a `Mat` is an address into a buffer the caller of `run` owns for the whole call;
// conversions read it (or write disjoint rows of it) from rayon's threads inside that call only.
unsafe impl Send for Mat {}
// SAFETY: see Send.
unsafe impl Sync for Mat {}

impl Mat {
    fn of(v: &View, dtype: DType, base: *mut u8, offset: usize) -> Mat {
        let r = v.strides.len();
        Mat { base, dtype, offset, rs: v.strides[r - 2], cs: v.strides[r - 1] }
    }

    /// The sub-matrix from (row, col) on.
    fn at(&self, row: usize, col: usize) -> Mat {
        Mat { offset: self.offset + row * self.rs + col * self.cs, ..*self }
    }

    /// The same elements read as the transpose.
    fn t(&self) -> Mat {
        Mat { rs: self.cs, cs: self.rs, ..*self }
    }

    /// Widens `len` elements from (i, 0) along the row into `dst`.
    ///
    /// # Safety
    /// Those elements must be inside the matrix's buffer.
    unsafe fn widen_row(&self, i: usize, dst: &mut [f32]) {
        let e = self.offset + i * self.rs;
        // SAFETY: the caller's guarantee; buffers are aligned for their element type.
        unsafe {
            if self.cs == 1 {
                widen(self.dtype, self.base.add(e * elem_bytes(self.dtype)), dst);
            } else {
                for (j, d) in dst.iter_mut().enumerate() {
                    let at = e + j * self.cs;
                    *d = match self.dtype {
                        DType::BF16 => f32::from_bits(u32::from(self.base.cast::<u16>().add(at).read()) << 16),
                        DType::F16 => f16::from_bits(self.base.cast::<u16>().add(at).read()).to_f32(),
                        _ => self.base.cast::<f32>().add(at).read(),
                    };
                }
            }
        }
    }

    /// Stores `src` (plus `bias[j]`) into the row from (i, 0), rounded to nearest even.
    ///
    /// # Safety
    /// Those elements must be inside the matrix's buffer, distinct, and touched by nothing else.
    unsafe fn narrow_row(&self, i: usize, src: &mut [f32], bias: Option<&[f32]>) {
        if let Some(b) = bias {
            src.iter_mut().zip(b).for_each(|(x, &b)| *x += b);
        }
        let e = self.offset + i * self.rs;
        // SAFETY: the caller's guarantee.
        unsafe {
            if self.cs == 1 {
                narrow(self.dtype, self.base.add(e * elem_bytes(self.dtype)), src);
            } else {
                for (j, &x) in src.iter().enumerate() {
                    let at = e + j * self.cs;
                    match self.dtype {
                        DType::BF16 => self.base.cast::<u16>().add(at).write(bf16_bits(x)),
                        DType::F16 => self.base.cast::<u16>().add(at).write(f16::from_f32(x).to_bits()),
                        _ => self.base.cast::<f32>().add(at).write(x),
                    }
                }
            }
        }
    }
}

/// An f32 view of a [rows, cols] block of `m`: the block itself when it is f32, else a copy in
/// `scratch` laid out as the source is (row-major unless its columns are the contiguous ones),
/// as (pointer, row stride, column stride).
///
/// # Safety
/// Every element of the block must be inside its buffer.
unsafe fn block(m: Mat, rows: usize, cols: usize, scratch: &mut [f32]) -> (*const f32, usize, usize) {
    if m.dtype == DType::F32 {
        // SAFETY: the caller's guarantee.
        return (unsafe { m.base.cast::<f32>().add(m.offset) }.cast_const(), m.rs, m.cs);
    }
    // a column-contiguous source is widened as its transpose: memory is read in order
    let by_columns = m.rs == 1 && m.cs != 1;
    let (src, outer, inner) = if by_columns { (m.t(), cols, rows) } else { (m, rows, cols) };
    let dst = &mut scratch[..rows * cols];
    let line = |(i, d): (usize, &mut [f32])| {
        // SAFETY: line i of the block is inside the buffer, the caller's guarantee.
        unsafe { src.widen_row(i, d) }
    };
    if rows * cols < PAR_MIN_ELEMS {
        dst.chunks_mut(inner.max(1)).enumerate().for_each(line);
    } else {
        dst.par_chunks_mut(inner.max(1)).enumerate().for_each(line);
    }
    debug_assert_eq!(dst.len(), outer * inner);
    if by_columns {
        (scratch.as_ptr(), 1, rows)
    } else {
        (scratch.as_ptr(), cols, 1)
    }
}

/// Runs a GEMM whose operands or destination are f16/bf16 (see the module docs): bf16 operands
/// by `libs.bf16` when loaded, the rest through f32 tiles whose large products go to `libs.blas`.
///
/// # Safety
/// As `gemm::run`: `g` checked against the buffers `ptr` points to, live and otherwise untouched.
pub unsafe fn run(g: &Gemm, libs: &GemmLibs, ptr: impl Fn(usize) -> *mut u8) {
    if let Some(native) = libs.bf16.as_deref().filter(|_| g.types.a == DType::BF16 && g.types.b == DType::BF16) {
        // SAFETY: the caller's contract, passed on.
        if unsafe { run_native(g, native, &ptr, [MB, NB]) } {
            return;
        }
    }
    // SAFETY: the caller's contract, passed on.
    unsafe { run_tiled(g, libs.blas.as_deref(), ptr, [MB, NB, KB]) }
}

/// The GEMM's bias row widened to f32 ([n]; empty without a bias).
///
/// # Safety
/// As `run`: the bias view checked against its buffer, which `ptr` points to.
unsafe fn widened_bias(g: &Gemm, ptr: &impl Fn(usize) -> *mut u8) -> Vec<f32> {
    let Some(bv) = &g.bias else { return Vec::new() };
    let mut bias = vec![0f32; g.n];
    let bm = Mat { base: ptr(bv.buf), dtype: g.types.bias.unwrap_or(DType::F32), offset: bv.offset, rs: 0, cs: bv.strides[0] };
    // SAFETY: `check` proved the bias view [n] inside its buffer.
    unsafe { bm.widen_row(0, &mut bias) };
    bias
}

/// `f(r, row r)` for every row of a tile `cols` wide, on rayon's threads when the tile is large.
fn each_row(tile: &mut [f32], cols: usize, f: &(dyn Fn(usize, &mut [f32]) + Sync)) {
    if tile.len() < PAR_MIN_ELEMS {
        tile.chunks_mut(cols).enumerate().for_each(|(r, t)| f(r, t));
    } else {
        tile.par_chunks_mut(cols).enumerate().for_each(|(r, t)| f(r, t));
    }
}

/// The bf16 operands of a batch element as oneDNN reads them.
fn bf16_mat(m: Mat) -> super::onednn::MatBf16 {
    // SAFETY: only an address computation; the matrix is read by the library under `run`'s contract.
    (unsafe { m.base.cast::<u16>().add(m.offset) }.cast_const(), m.rs, m.cs)
}

/// A bf16 x bf16 GEMM by oneDNN: straight into c when c is f32 without a bias, else through f32
/// tiles of [rows, cols] of c, each product over the whole K, rounded once into c. False, with
/// nothing written, when the library does not take the operands' layout. (It refuses nothing
/// else: its status is an argument check, which `takes` makes first.)
///
/// # Safety
/// As `run`.
unsafe fn run_native(g: &Gemm, lib: &Bf16Gemm, ptr: &impl Fn(usize) -> *mut u8, [mb, nb]: [usize; 2]) -> bool {
    let (m, n, k) = (g.m, g.n, g.k);
    if m == 0 || n == 0 || k == 0 {
        return false;
    }
    let direct = g.types.c == DType::F32 && g.bias.is_none();
    let (mb, nb) = if direct { (m, n) } else { (mb.min(m), nb.min(n)) };
    // every call has these strides (a tile's are [nb, 1]) and at most these sizes: one check
    // for all of them
    let [oa, ob, _] = batch_offsets(g, 0);
    let (a0, b0) = (Mat::of(&g.a, g.types.a, ptr(g.a.buf), oa), Mat::of(&g.b, g.types.b, ptr(g.b.buf), ob));
    let c_strides = if direct { (g.c.strides[g.c.strides.len() - 2], g.c.strides[g.c.strides.len() - 1]) } else { (nb, 1) };
    if !lib.takes((mb, nb, k), bf16_mat(a0), bf16_mat(b0), c_strides) {
        return false;
    }
    let mut ct = vec![0f32; if direct { 0 } else { mb * nb }];
    // SAFETY: the caller's contract.
    let bias = unsafe { widened_bias(g, ptr) };
    let bias_row = g.bias.as_ref().map(|_| bias.as_ptr());
    for i in 0..g.batch() {
        let [oa, ob, oc] = batch_offsets(g, i);
        let (a, b) = (Mat::of(&g.a, g.types.a, ptr(g.a.buf), oa), Mat::of(&g.b, g.types.b, ptr(g.b.buf), ob));
        let c = Mat::of(&g.c, g.types.c, ptr(g.c.buf), oc);
        if g.types.c == DType::BF16 {
            // the whole product into bf16 c by the matmul primitive, where there is one (AMX):
            // rounded (bias added) by the library, no f32 tile
            // SAFETY: as for the calls below; c is bf16 and the bias row [n] f32.
            let cp = unsafe { c.base.cast::<u16>().add(c.offset) };
            // SAFETY: as above.
            if unsafe { lib.gemm_bf16_out((m, n, k), g.alpha as f32, g.accumulate, bf16_mat(a), bf16_mat(b), bias_row, (cp, c.rs, c.cs)) } {
                continue;
            }
        }
        for m0 in (0..m).step_by(mb) {
            let mm = mb.min(m - m0);
            for n0 in (0..n).step_by(nb) {
                let nn = nb.min(n - n0);
                let (a, b, cm) = (bf16_mat(a.at(m0, 0)), bf16_mat(b.at(0, n0)), c.at(m0, n0));
                if direct {
                    // SAFETY: `check` proved a, b and c (every batch element) inside their
                    // buffers, c's elements distinct and apart from the operands'.
                    let cp = unsafe { cm.base.cast::<f32>().add(cm.offset) };
                    // SAFETY: as above.
                    let done = unsafe { lib.gemm((mm, nn, k), g.alpha as f32, g.accumulate, a, b, (cp, cm.rs, cm.cs)) };
                    // `takes` passed: the library checks nothing else of these arguments
                    debug_assert!(done, "oneDNN refused a layout it takes");
                    continue;
                }
                let tile = &mut ct[..mm * nn];
                let rows = |tile: &mut [f32], f: &(dyn Fn(usize, &mut [f32]) + Sync)| each_row(tile, nn, f);
                if g.accumulate {
                    // SAFETY: row r of the tile is inside c (`check`).
                    rows(tile, &|r, t| unsafe { cm.widen_row(r, t) });
                }
                // SAFETY: a and b as above; the tile is our own, [mm, nn] row-major.
                let done = unsafe { lib.gemm((mm, nn, k), g.alpha as f32, g.accumulate, a, b, (tile.as_mut_ptr(), nn, 1)) };
                debug_assert!(done, "oneDNN refused a layout it takes");
                let bias = g.bias.as_ref().map(|_| &bias[n0..n0 + nn]);
                // SAFETY: row r of the tile is inside c, written by this row's thread only.
                rows(tile, &|r, t| unsafe { cm.narrow_row(r, t, bias) });
            }
        }
    }
    true
}

/// `run` with tiles of [rows, cols] of c and blocks of K as given.
///
/// # Safety
/// As `run`.
unsafe fn run_tiled(g: &Gemm, blas: Option<&Blas>, ptr: impl Fn(usize) -> *mut u8, [mb, nb, kb]: [usize; 3]) {
    let (m, n, k) = (g.m, g.n, g.k);
    let (mb, nb, kb) = (mb.min(m).max(1), nb.min(n).max(1), kb.min(k).max(1));
    let mut at = vec![0f32; if g.types.a == DType::F32 { 0 } else { mb * kb }];
    let mut bt = vec![0f32; if g.types.b == DType::F32 { 0 } else { kb * nb }];
    let mut ct = vec![0f32; mb * nb];
    // SAFETY: the caller's contract.
    let bias = unsafe { widened_bias(g, &ptr) };
    for i in 0..g.batch() {
        let [oa, ob, oc] = batch_offsets(g, i);
        let (a, b) = (Mat::of(&g.a, g.types.a, ptr(g.a.buf), oa), Mat::of(&g.b, g.types.b, ptr(g.b.buf), ob));
        let c = Mat::of(&g.c, g.types.c, ptr(g.c.buf), oc);
        for m0 in (0..m).step_by(mb) {
            let mm = mb.min(m - m0);
            for n0 in (0..n).step_by(nb) {
                let nn = nb.min(n - n0);
                let tile = &mut ct[..mm * nn];
                let cm = c.at(m0, n0);
                let rows = |tile: &mut [f32], f: &(dyn Fn(usize, &mut [f32]) + Sync)| each_row(tile, nn, f);
                if g.accumulate {
                    // SAFETY: row r of the tile is inside c (`check`).
                    rows(tile, &|r, t| unsafe { cm.widen_row(r, t) });
                }
                // SAFETY (this block): `check` proved every element of a, b and c (all batch
                // elements) inside their buffers and c's elements distinct and apart from a's and
                // b's; the blocks are sub-matrices of them; the tile and scratch are our own.
                unsafe {
                    if k == 0 && !g.accumulate {
                        tile.fill(0.0);
                    }
                    for k0 in (0..k).step_by(kb) {
                        let kk = kb.min(k - k0);
                        let ablk = block(a.at(m0, k0), mm, kk, &mut at);
                        let bblk = block(b.at(k0, n0), kk, nn, &mut bt);
                        let acc = g.accumulate || k0 > 0;
                        sgemm(blas, (mm, nn, kk), g.alpha as f32, acc, ablk, bblk, (tile.as_mut_ptr(), nn, 1));
                    }
                }
                let bias = g.bias.as_ref().map(|_| &bias[n0..n0 + nn]);
                // SAFETY: row r of the tile is inside c, written by this row's thread only.
                rows(tile, &|r, t| unsafe { cm.narrow_row(r, t, bias) });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;
    use qatc_kernels::program::GemmTypes;

    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// The fast rounding is `half`'s, bit for bit, on ties, carries, infinities and NaNs.
    #[test]
    fn bf16_rounding_is_round_to_nearest_even() {
        let mut seed = 1;
        let specials = [0.0f32, -0.0, 1.0, f32::MAX, f32::MIN_POSITIVE, 1e-40, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN];
        let ties = [0x3f80_8000u32, 0x3f81_8000, 0x3f80_8001, 0x3f80_7fff, 0x7f7f_ffff, 0x7f7f_8000, 0xff80_0001];
        let mut xs: Vec<f32> = specials.to_vec();
        xs.extend(ties.iter().map(|&u| f32::from_bits(u)));
        xs.extend((0..100_000).map(|_| lcg(&mut seed) * 1e3));
        xs.extend((0..100_000).map(|_| f32::from_bits((lcg(&mut seed).to_bits()).rotate_left(7))));
        for x in xs {
            assert_eq!(bf16_bits(x), bf16::from_f32(x).to_bits(), "{x:e} ({:#x})", x.to_bits());
        }
    }

    /// Bytes of a matrix of `d` from f32 values (rounded to nearest even).
    fn store(d: DType, v: &[f32]) -> Vec<u8> {
        match d {
            DType::BF16 => v.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect(),
            DType::F16 => v.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect(),
            _ => v.iter().flat_map(|&x| x.to_le_bytes()).collect(),
        }
    }

    fn load(d: DType, b: &[u8]) -> Vec<f32> {
        match d {
            DType::BF16 => b.chunks(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            DType::F16 => b.chunks(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            _ => b.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        }
    }

    /// Tiles of 64 x 48 over a 150 x 130 product, K 70 in blocks of 32 (`check_half_gemm`).
    #[test]
    fn tiled_half_gemm_rounds_the_f32_sum_once() {
        let kinds = [(DType::BF16, DType::BF16), (DType::F16, DType::F16), (DType::BF16, DType::F32), (DType::F32, DType::BF16)];
        // SAFETY: `check_half_gemm` passes views inside the buffers it points to.
        check_half_gemm(&kinds, &|g, ptrs| unsafe { run_tiled(g, None, |i| ptrs[i], [64, 48, 32]) });
    }

    /// The same sums through oneDNN's bf16 GEMM, on tiles of c (bf16 c, or a bias) and straight
    /// into an f32 c, wherever the CPU has bf16 units; where Rust sees AVX512-BF16 and the
    /// library is installed, it must load.
    #[test]
    fn native_bf16_gemm_rounds_the_f32_sum_once() {
        let Some(lib) = crate::cpu::onednn::load(crate::cpu::onednn::ONEDNN) else {
            let units = is_x86_feature_detected!("avx512bf16");
            let installed = std::path::Path::new("/usr/lib/x86_64-linux-gnu/libdnnl.so.2").exists();
            assert!(!(units && installed), "the CPU has AVX512-BF16 and oneDNN is installed, but it did not load");
            eprintln!("SKIPPED: no bf16 units (AVX512-BF16: {units}) or no oneDNN (installed: {installed})");
            return;
        };
        let kinds = [(DType::BF16, DType::BF16), (DType::BF16, DType::F32)];
        let runs = lib.primitive_runs_into_bf16();
        // SAFETY: as above.
        check_half_gemm(&kinds, &|g, ptrs| assert!(unsafe { run_native(g, &lib, &|i| ptrs[i], [64, 48]) }, "oneDNN did not take {g:?}"));
        // on AMX the bf16 results (bias, accumulation) were the matmul primitive's, rounded by
        // it: once per transposition of a
        let want = if lib.units == "AMX-BF16" { 2 } else { 0 };
        assert_eq!(lib.primitive_runs_into_bf16() - runs, want, "products into bf16 c by the matmul primitive ({})", lib.units);
        // straight into an f32 c: no bias
        // SAFETY: as above.
        check_half_gemm(&kinds[1..], &|g, ptrs| {
            let g = Gemm { bias: None, ..g.clone() };
            assert!(unsafe { run_native(&g, &lib, &|i| ptrs[i], [64, 48]) });
            // the bias the checker expects, added here (c is f32)
            let c = ptrs[2].cast::<f32>();
            let b = ptrs[3].cast::<f32>();
            for i in 0..g.m * g.n {
                // SAFETY: c holds m x n f32 and the bias n.
                unsafe { *c.add(i) += *b.add(i % g.n) };
            }
        });
    }

    /// Products of 150 x 130 over K 70, for each (operand type, c's type) of `kinds`, a read
    /// transposed or not, b transposed, a bias and accumulation into c, run by `run` on the four
    /// buffers (a, b, c, bias): every element is the f64 sum of the operands plus c and the bias,
    /// rounded once to c's type (within one of its ulps: the f32 sum's own error may cross a
    /// rounding boundary).
    fn check_half_gemm(kinds: &[(DType, DType)], run: &dyn Fn(&Gemm, &[*mut u8])) {
        let (m, n, k) = (150, 130, 70);
        for ((ab, c_ty), ta) in kinds.iter().copied().flat_map(|t| [(t, false), (t, true)]) {
            let mut seed = 7;
            let mut vals = |len: usize| (0..len).map(|_| lcg(&mut seed)).collect::<Vec<f32>>();
            // a stored [m, k], or [k, m] when read transposed
            let (a_stored, bt, c0, bias) = (vals(m * k), vals(n * k), vals(m * n), vals(n));
            // 8-byte aligned copies of the bytes, as buffers are
            let mut bufs: Vec<Vec<u64>> = [store(ab, &a_stored), store(ab, &bt), store(c_ty, &c0), store(DType::F32, &bias)]
                .iter()
                .map(|b| {
                    let mut w = vec![0u64; b.len().div_ceil(8)];
                    // SAFETY: w has at least b.len() bytes.
                    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), w.as_mut_ptr().cast::<u8>(), b.len()) };
                    w
                })
                .collect();
            let a_view = if ta { View::contiguous(0, &[k, m]).transpose(&[1, 0]) } else { View::contiguous(0, &[m, k]) };
            let g = Gemm {
                a: a_view,
                b: View::contiguous(1, &[n, k]).transpose(&[1, 0]),
                c: View::contiguous(2, &[m, n]),
                m,
                n,
                k,
                alpha: 1.0,
                accumulate: true,
                bias: Some(View::contiguous(3, &[n])),
                types: GemmTypes { a: ab, b: ab, c: c_ty, bias: Some(DType::F32) },
                note: "test".into(),
            };
            let ptrs: Vec<*mut u8> = bufs.iter_mut().map(|b| b.as_mut_ptr().cast::<u8>()).collect();
            run(&g, &ptrs);
            // SAFETY: buffer 2 has c's bytes.
            let got = load(c_ty, unsafe { std::slice::from_raw_parts(ptrs[2].cast_const(), c_ty.bytes_for(m * n)) });
            let w = |d: DType, v: &[f32]| load(d, &store(d, v));
            let (a_stored, bt, c0) = (w(ab, &a_stored), w(ab, &bt), w(c_ty, &c0));
            let a_at = |i: usize, p: usize| if ta { a_stored[p * m + i] } else { a_stored[i * k + p] };
            for i in 0..m {
                for j in 0..n {
                    let terms = (0..k).map(|p| f64::from(a_at(i, p)) * f64::from(bt[j * k + p]));
                    let exact = terms.clone().sum::<f64>() + f64::from(c0[i * n + j]) + f64::from(bias[j]);
                    let magnitude = terms.map(f64::abs).sum::<f64>() + f64::from(c0[i * n + j].abs()) + f64::from(bias[j].abs());
                    // one ulp of c's type at the result, plus the f32 sum's own error
                    let ulp = match c_ty {
                        DType::BF16 => 2f64.powi(-7),
                        DType::F16 => 2f64.powi(-10),
                        _ => 0.0,
                    };
                    let e = (f64::from(got[i * n + j]) - exact).abs();
                    assert!(
                        e <= ulp * exact.abs() + 1e-6 * magnitude,
                        "{ab}/{c_ty} ta {ta} ({i}, {j}): {} vs {exact} ({e:e})",
                        got[i * n + j]
                    );
                }
            }
        }
    }
}
