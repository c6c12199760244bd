//! Causal attention on the CPU as small GEMMs: a [`Launcher`] that runs the attention kernels
//! (`kir::Body::Attention`) itself and hands every other kernel to the launcher it wraps.
//!
//! The generated per-row programs (LLVM's `attention.rs`) reduce each q.k dot product
//! horizontally and run at 10-15 GFLOP/s; the same work as GEMMs over blocks of query rows runs
//! near the GEMM kernel's speed. One head (b, h) is one unit of work; its query rows go in blocks
//! of [`BLOCK`], and a block only meets keys 0..i1 (the causal mask cuts the rest):
//!
//! ```text
//! S  = scale Q[i0..i1] K[0..i1]^T              [bm, i1], j > i masked
//! P  = exp(S - lse)                            (forward: row max and sum give lse, P / l)
//! O  = P V                                     forward
//! dP = dO[i0..i1] V[0..i1]^T;  delta_i = sum_j P_ij dP_ij
//! dS = scale P (dP - delta)
//! dQ = dS K;   dK += dS^T Q[i0..i1];   dV += P^T dO[i0..i1]
//! ```
//!
//! The scores of a block live in a [bm, T] scratch, never the whole T x T matrix. Launch ranges
//! must cover whole heads (the executor splits attention launches on multiples of T).
//!
//! Over f16/bf16 buffers (`LowerOptions::attention_reads_stored`) a head's q, k, v and dout rows
//! are widened into an f32 [T, hs] scratch of the thread before its blocks run, and its results
//! computed into another and rounded into the buffer once, at the head's end: the math is the
//! f32 path's, on the values the kernel-IR evaluator's loads widen and its stores round, with no
//! f32 copy of a whole tensor in the plan. The scratch is a few [T, hs] per thread, like the
//! blocks of scores. On a CPU with AMX-BF16, bf16 heads are multiplied as stored instead, on the
//! tile units, with P and dS rounded to bf16 for the products that take them
//! (`attn_products.rs`): 124M's attention at B 1, T 256 took 39 ms a step instead of 66.

use std::sync::Arc;

use qatc_ir::DType;
use qatc_kernels::kir::{Attention, AttentionPart, Body, Kernel};

use super::attn_products::{gather, mm, Half, Mat, Mat16};
use super::convert::{elem_bytes, narrow, widen};
use super::onednn::Bf16Gemm;
use super::vmath::exp_shift_sum;
use super::Launcher;
use crate::error::RuntimeError;

/// Query rows per block: a [64, T] block of scores is 256 KiB at T = 1024.
const BLOCK: usize = 64;

/// A launcher that runs attention kernels as GEMMs and the rest through `inner`.
pub struct GemmAttention<L> {
    inner: L,
    /// Per kernel: its attention, family and params' element types.
    attention: Vec<Option<(Attention, String, Vec<DType>)>>,
    /// oneDNN's f32 GEMM, when loaded: the products run there instead of the gemm crate.
    onednn: Option<Arc<Bf16Gemm>>,
}

impl<L: Launcher> GemmAttention<L> {
    /// Wraps `inner` for a program's kernels (`Program::kernels`, in order). Attention over
    /// anything but float buffers, or with lse or delta not f32, stays with `inner`.
    pub fn new(inner: L, kernels: &[Kernel]) -> GemmAttention<L> {
        let attention = kernels
            .iter()
            .map(|k| match &k.body {
                Body::Attention(a) if takes(a, k) => Some((a.clone(), k.family.clone(), k.params.iter().map(|p| p.dtype).collect())),
                _ => None,
            })
            .collect();
        GemmAttention { inner, attention, onednn: None }
    }

    /// The products by oneDNN's f32 GEMM (one thread per call) instead of the gemm crate's.
    pub fn with_onednn(mut self, lib: Option<Arc<Bf16Gemm>>) -> GemmAttention<L> {
        self.onednn = lib;
        self
    }
}

struct Head<'a> {
    a: &'a Attention,
    lib: Option<&'a Bf16Gemm>,
    t: usize,
    hs: usize,
    scale: f32,
    q: Mat,
    k: Mat,
    v: Option<Mat>,
    dout: Option<Mat>,
    /// This head's T entries of lse and delta.
    lse: *mut f32,
    delta: Option<*mut f32>,
    /// out | dq | dk, then dv (`BackwardKV`); dq, dk, dv (`Backward`).
    out: [Option<Mat>; 3],
    /// On AMX over bf16 heads: the products' operands as stored (`Half`).
    half: Option<Half<'a>>,
}

impl Head<'_> {
    /// Runs this head's part. `s` and `dp` are [BLOCK, T] scratch.
    ///
    /// # Safety
    /// Every pointer must address this head's rows (T of hs, at its row stride) or T stats;
    /// outputs must overlap nothing else this call reads or writes.
    unsafe fn run(&self, s: &mut [f32], dp: &mut [f32]) -> Result<(), String> {
        let (t, hs, part) = (self.t, self.hs, self.a.part);
        // dK and dV accumulate over query blocks: start from zero (dQ is written block by block)
        let sums = match part {
            AttentionPart::BackwardKV | AttentionPart::BackwardV => &self.out[..],
            AttentionPart::Backward => &self.out[1..],
            _ => &[],
        };
        for o in sums.iter().flatten() {
            for r in 0..t {
                // SAFETY: row r of an output head, hs elements.
                unsafe { std::ptr::write_bytes(o.row(r), 0, hs) };
            }
        }
        let mut i0 = 0;
        while i0 < t {
            let i1 = (i0 + BLOCK).min(t);
            let len = (i1 - i0) * i1;
            let (s, dp) = (&mut s[..len], &mut dp[..len]);
            // SAFETY: the caller's guarantee, and the query rows i0..i1 lie within the head.
            unsafe {
                self.scores(i0, i1, s)?;
                match part {
                    AttentionPart::Forward | AttentionPart::Lse => self.forward_block(i0, i1, s)?,
                    _ => self.backward_block(i0, i1, s, dp)?,
                }
            }
            i0 = i1;
        }
        Ok(())
    }

    /// S = scale Q K^T for query rows `i0..i1` against keys `0..i1`, into `s` ([i1 - i0, i1]).
    ///
    /// # Safety
    /// As [`Head::run`]'s, with `i0..i1` rows of the head.
    unsafe fn scores(&self, i0: usize, i1: usize, s: &mut [f32]) -> Result<(), String> {
        let (bm, n) = (i1 - i0, i1);
        if let Some(h) = &self.half {
            // SAFETY: as below, on the stored rows.
            return unsafe { h.mm((bm, n, self.hs), (s.as_mut_ptr(), n), false, h.q.rows(i0), h.k.t(), self.scale) };
        }
        // SAFETY: the rows are within the head by the caller's guarantee, `s` is [bm, n] row-major.
        unsafe {
            mm(
                self.lib,
                bm,
                n,
                self.hs,
                (s.as_mut_ptr(), n as isize, 1),
                false,
                (self.q.row(i0) as *const f32, self.q.rs as isize, 1),
                (self.k.ptr as *const f32, 1, self.k.rs as isize),
                self.scale,
            );
        }
        Ok(())
    }

    /// The forward's block: P = causal softmax of the scores in `s` (rows `i0..i1`), their
    /// log-sum-exp stored, and for `Forward` O = P V.
    ///
    /// # Safety
    /// As [`Head::scores`]'s, `s` holding the block's scores.
    unsafe fn forward_block(&self, i0: usize, i1: usize, s: &mut [f32]) -> Result<(), String> {
        let (bm, n, part) = (i1 - i0, i1, self.a.part);
        let need = |m: Option<Mat>| m.ok_or_else(|| format!("attention {part:?} lacks an operand"));
        for i in 0..bm {
            let row = &mut s[i * n..(i + 1) * n];
            let live = i0 + i + 1;
            let m = row[..live].iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let l = exp_shift_sum(&mut row[..live], m);
            row[live..].fill(0.0);
            // SAFETY: lse holds this head's T stats, and i0 + i < T.
            unsafe { *self.lse.add(i0 + i) = m + l.ln() };
            let inv = 1.0 / l;
            row[..live].iter_mut().for_each(|x| *x *= inv);
        }
        if part == AttentionPart::Forward {
            let (v, o) = (need(self.v)?, need(self.out[0])?);
            if let Some(h) = &self.half {
                // O = P V with P rounded to bf16, as the tensor cores' attention takes it
                let (p, _) = h.round(s, bm, n);
                // SAFETY: as below, on the stored rows and this thread's bf16 block.
                return unsafe { h.mm((bm, self.hs, n), (o.row(i0), o.rs), false, p, h.v()?.rows(0), 1.0) };
            }
            // SAFETY: as `scores`; the output is no operand of the product.
            unsafe {
                mm(
                    self.lib,
                    bm,
                    self.hs,
                    n,
                    (o.row(i0), o.rs as isize, 1),
                    false,
                    (s.as_ptr(), n as isize, 1),
                    (v.ptr as *const f32, v.rs as isize, 1),
                    1.0,
                );
            }
        }
        Ok(())
    }

    /// A backward part's block: P from the forward's log-sum-exp over the scores in `s`, then dV
    /// (`BackwardV`), delta (`BackwardDelta`), or dS = scale P (dP - delta) and dQ or dK (with
    /// dV first for `BackwardKV`), or all three from the one P and dS (`Backward`).
    ///
    /// # Safety
    /// As [`Head::scores`]'s, `s` holding the block's scores and `dp` of its size.
    unsafe fn backward_block(&self, i0: usize, i1: usize, s: &mut [f32], dp: &mut [f32]) -> Result<(), String> {
        use AttentionPart::*;
        let (bm, n, hs, part) = (i1 - i0, i1, self.hs, self.a.part);
        let need = |m: Option<Mat>| m.ok_or_else(|| format!("attention {part:?} lacks an operand"));
        let f = |p: *mut f32| p as *const f32;
        // SAFETY (every product and row access below): the rows are within the head by the
        // caller's guarantee, scratch blocks are [bm, n] row-major, and no output is an operand
        // of the same product.
        unsafe {
            // P from the forward's log-sum-exp
            for i in 0..bm {
                let row = &mut s[i * n..(i + 1) * n];
                let (live, li) = (i0 + i + 1, *self.lse.add(i0 + i));
                exp_shift_sum(&mut row[..live], li);
                row[live..].fill(0.0);
            }
            let dout = need(self.dout)?;
            // dV += P^T dO[i0..i1]
            let dv_at = match part {
                BackwardV => Some(0),
                BackwardKV => Some(1),
                Backward => Some(2),
                _ => None,
            };
            if let Some(at) = dv_at {
                let dv = need(self.out[at])?;
                match &self.half {
                    Some(h) => {
                        let (_, pt) = h.round(s, bm, n);
                        h.mm((n, hs, bm), (dv.ptr, dv.rs), true, pt, h.dout()?.rows(i0), 1.0)?;
                    }
                    None => mm(
                        self.lib,
                        n,
                        hs,
                        bm,
                        (dv.ptr, dv.rs as isize, 1),
                        true,
                        (s.as_ptr(), 1, n as isize),
                        (f(dout.row(i0)), dout.rs as isize, 1),
                        1.0,
                    ),
                }
            }
            if part == BackwardV {
                return Ok(());
            }
            // dP = dO[i0..i1] V^T
            let v = need(self.v)?;
            match &self.half {
                Some(h) => h.mm((bm, n, hs), (dp.as_mut_ptr(), n), false, h.dout()?.rows(i0), h.v()?.t(), 1.0)?,
                None => mm(
                    self.lib,
                    bm,
                    n,
                    hs,
                    (dp.as_mut_ptr(), n as isize, 1),
                    false,
                    (f(dout.row(i0)), dout.rs as isize, 1),
                    (f(v.ptr), 1, v.rs as isize),
                    1.0,
                ),
            }
            let delta = self.delta.ok_or("attention backward without delta")?;
            if part == BackwardDelta {
                for i in 0..bm {
                    let (p, d) = (&s[i * n..(i + 1) * n], &dp[i * n..(i + 1) * n]);
                    *delta.add(i0 + i) = p.iter().zip(d).map(|(a, b)| a * b).sum();
                }
                return Ok(());
            }
            // dS = scale P (dP - delta), over P's storage once dV has used P
            for i in 0..bm {
                let di = *delta.add(i0 + i);
                let (p, d) = (&mut s[i * n..(i + 1) * n], &dp[i * n..(i + 1) * n]);
                p.iter_mut().zip(d).for_each(|(p, &d)| *p = self.scale * *p * (d - di));
            }
            // dQ = dS K and dK += dS^T Q[i0..i1], from dS rounded to bf16 once for both
            let ds16 = self.half.as_ref().map(|h| h.round(s, bm, n));
            if matches!(part, BackwardQ | Backward) {
                let dq = need(self.out[0])?;
                match (&self.half, ds16) {
                    (Some(h), Some((ds, _))) => h.mm((bm, hs, n), (dq.row(i0), dq.rs), false, ds, h.k.rows(0), 1.0)?,
                    _ => mm(
                        self.lib,
                        bm,
                        hs,
                        n,
                        (dq.row(i0), dq.rs as isize, 1),
                        false,
                        (s.as_ptr(), n as isize, 1),
                        (f(self.k.ptr), self.k.rs as isize, 1),
                        1.0,
                    ),
                }
            }
            if part != BackwardQ {
                let dk = need(self.out[if part == Backward { 1 } else { 0 }])?;
                match (&self.half, ds16) {
                    (Some(h), Some((_, dst))) => h.mm((n, hs, bm), (dk.ptr, dk.rs), true, dst, h.q.rows(i0), 1.0)?,
                    _ => mm(
                        self.lib,
                        n,
                        hs,
                        bm,
                        (dk.ptr, dk.rs as isize, 1),
                        true,
                        (s.as_ptr(), 1, n as isize),
                        (f(self.q.row(i0)), self.q.rs as isize, 1),
                        1.0,
                    ),
                }
            }
        }
        Ok(())
    }
}

/// A head's T rows of hs elements, at row stride `rs`, as (first row, elements) runs: one run
/// where the rows are contiguous, else one a row.
fn runs(a: &Attention, rs: usize) -> impl Iterator<Item = (usize, usize)> {
    let (t, hs) = (a.t, a.hs);
    let rows = if rs == hs { t.max(1) } else { 1 };
    (0..t).step_by(rows).map(move |r| (r, rows * hs))
}

/// Whether `GemmAttention` runs kernel `k` of attention `a`: every param a float, lse and delta
/// f32 (the views of 16-bit q, k, v, dout and results are staged through f32 rows).
fn takes(a: &Attention, k: &Kernel) -> bool {
    let ro = a.part.roles();
    let stat = |p: Option<usize>| p.is_none_or(|p| k.params.get(p).is_some_and(|p| p.dtype == DType::F32));
    k.params.iter().all(|p| p.dtype.is_float()) && stat(Some(ro.lse)) && stat(ro.delta)
}

impl<L: Launcher> Launcher for GemmAttention<L> {
    unsafe fn launch(&self, kernel: usize, args: &[*mut u8], start: usize, end: usize) -> Result<(), RuntimeError> {
        let Some(Some((a, family, dtypes))) = self.attention.get(kernel) else {
            // SAFETY: passed on under the caller's guarantee.
            return unsafe { self.inner.launch(kernel, args, start, end) };
        };
        let err = |msg: String| RuntimeError::Kernel { kernel: family.clone(), msg };
        let t = a.t.max(1);
        if !start.is_multiple_of(t) || !end.is_multiple_of(t) || end > a.b * a.nh * a.t || start > end {
            return Err(err(format!("iterations {start}..{end} are not whole heads of {t} rows")));
        }
        if dtypes.len() != args.len() {
            return Err(err(format!("{} pointers for {} params", args.len(), dtypes.len())));
        }
        let ro = a.part.roles();
        let staged = dtypes.iter().filter(|&&d| d != DType::F32).count();
        let half = self.half(dtypes, &ro);
        let blocks = 2 * BLOCK * a.t;
        // on AMX, a [BLOCK, T] block of bf16 (P or dS): half as many f32 slots
        let half_len = if half.is_some() { (BLOCK * a.t).div_ceil(2) } else { 0 };
        SCRATCH.with_borrow_mut(|scratch| {
            let need = blocks + half_len + staged * a.t * a.hs;
            if scratch.len() < need {
                scratch.resize(need, 0.0);
            }
            let (s, rest) = scratch[..need].split_at_mut(blocks);
            let (s, dp) = s.split_at_mut(BLOCK * a.t);
            let (p16, rest) = rest.split_at_mut(half_len);
            let p16 = half.map(|lib| (lib, p16));
            // SAFETY: the caller's guarantee, passed on.
            unsafe { self.heads(a, dtypes, &ro, args, start / t..end / t, [s, dp, rest], p16) }.map_err(err)
        })
    }
}

impl<L> GemmAttention<L> {
    /// Whether kernel `kernel` (an attention this launcher runs) multiplies on AMX over its
    /// stored bf16 operands (`attn_half.rs`) rather than on f32 copies.
    pub fn on_amx(&self, kernel: usize) -> bool {
        match self.attention.get(kernel) {
            Some(Some((a, _, dtypes))) => self.half(dtypes, &a.part.roles()).is_some(),
            _ => false,
        }
    }

    /// oneDNN, where it runs this kernel's products on AMX over its stored operands: q, k, v
    /// and dout all bf16 (`attn_half.rs`).
    fn half(&self, dtypes: &[DType], ro: &qatc_kernels::kir::AttentionRoles) -> Option<&Bf16Gemm> {
        let lib = self.onednn.as_deref().filter(|l| l.on_amx())?;
        let operands = [Some(0), Some(1), ro.v, ro.dout];
        operands.iter().flatten().all(|&p| dtypes.get(p) == Some(&DType::BF16)).then_some(lib)
    }
}

thread_local! {
    /// Per thread, kept between launches (a launch, every attention kernel of every step, would
    /// otherwise allocate them again): two [BLOCK, T] blocks of scores, then a [T, hs] row block
    /// for each 16-bit param. Each block of scores is written whole by a GEMM before it is read,
    /// and each staged operand widened (or result zeroed or written whole) before it is read, so
    /// what a previous launch left there never matters.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl<L> GemmAttention<L> {
    /// Runs heads `heads` (b * NH + h) of part `a` with the launch's `args` (params of types
    /// `dtypes`); `scratch` is two [BLOCK, T] blocks of scores and a [T, hs] block per 16-bit
    /// param.
    ///
    /// # Safety
    /// As [`Launcher::launch`]: one pointer per param, each to its param's buffer, which nothing
    /// else touches but other heads of the same launch. With `half`, oneDNN on AMX and the f32
    /// slots that hold a [BLOCK, T] bf16 block.
    #[allow(clippy::too_many_arguments)]
    unsafe fn heads(
        &self,
        a: &Attention,
        dtypes: &[DType],
        ro: &qatc_kernels::kir::AttentionRoles,
        args: &[*mut u8],
        heads: std::ops::Range<usize>,
        scratch: [&mut [f32]; 3],
        half: Option<(&Bf16Gemm, &mut [f32])>,
    ) -> Result<(), String> {
        let [s, dp, stage] = scratch;
        let th = a.t * a.hs;
        // the 16-bit params, in order, each with the [T, hs] block of `stage` at its position
        let staged: Vec<usize> = (0..dtypes.len()).filter(|&p| dtypes[p] != DType::F32).collect();
        let stage_at = |p: usize| staged.iter().position(|&q| q == p);
        let written = |p: usize| ro.out.contains(&Some(p));
        // the staged blocks are reached through this pointer only (the heads' `Mat`s hold it too)
        let stage_ptr = stage.as_mut_ptr();
        // on AMX: the bf16 block, likewise reached through its pointer alone
        let half = half.map(|(lib, blocks)| (lib, blocks.as_mut_ptr().cast::<u16>()));
        for bh in heads {
            let (b, h) = (bh / a.nh, bh % a.nh);
            // (address of the head's first element, row stride in elements) of param p's view
            let view = |p: usize| -> Result<(*mut u8, usize), String> {
                let (Some(&[sb, sh, st]), Some(&off), Some(&base), Some(&d)) =
                    (a.strides.get(p), a.offsets.get(p), args.get(p), dtypes.get(p))
                else {
                    return Err(format!("no view for param {p}"));
                };
                // SAFETY: the view's head start lies inside param p's buffer (the kernel's views
                // were checked against the buffers when the program was lowered).
                Ok((unsafe { base.add((off + b * sb + h * sh) * elem_bytes(d)) }, st))
            };
            let mat = |p: usize| -> Result<Mat, String> {
                Ok(match stage_at(p) {
                    // SAFETY: `stage` holds a [T, hs] block per staged param.
                    Some(i) => Mat { ptr: unsafe { stage_ptr.add(i * th) }, rs: a.hs },
                    None => {
                        let (ptr, rs) = view(p)?;
                        Mat { ptr: ptr.cast(), rs }
                    }
                })
            };
            let stat = |p: usize| -> Result<*mut f32, String> {
                let base = args.get(p).ok_or_else(|| format!("no param {p}"))?;
                // SAFETY: lse and delta hold B*NH*T floats; this head's T start at bh * T.
                Ok(unsafe { base.cast::<f32>().add(bh * a.t) })
            };
            // on AMX, the operands' rows copied as stored into their blocks (bf16 [T, hs])
            let gathered = |p: usize| -> Result<Option<Mat16>, String> {
                let Some(i) = stage_at(p).filter(|_| half.is_some()) else { return Ok(None) };
                let (ptr, rs) = view(p)?;
                let dst = stage_ptr.wrapping_add(i * th).cast::<u16>();
                // SAFETY: the view addresses the head's T rows; block i is this thread's, T * hs
                // f32, reached through `stage_ptr` alone while the heads run.
                unsafe { gather(ptr.cast_const().cast(), rs, a.t, a.hs, dst) };
                Ok(Some(Mat16 { ptr: dst.cast_const(), rs: a.hs }))
            };
            // the 16-bit operands' rows, widened (on AMX, gathered instead)
            for (i, &p) in staged.iter().enumerate().filter(|&(_, &p)| !written(p) && half.is_none()) {
                let (ptr, rs) = view(p)?;
                for (r, run) in runs(a, rs) {
                    // SAFETY: rows r.. of the head lie in the buffer; block i of `stage` is T rows
                    // of hs, reached through `stage_ptr` alone while the heads run.
                    unsafe {
                        let dst = std::slice::from_raw_parts_mut(stage_ptr.add(i * th + r * a.hs), run);
                        widen(dtypes[p], ptr.add(r * rs * elem_bytes(dtypes[p])), dst)
                    };
                }
            }
            let opt = |p: Option<usize>| p.map(mat).transpose();
            let head = Head {
                a,
                lib: self.onednn.as_deref(),
                t: a.t,
                hs: a.hs,
                scale: a.scale as f32,
                q: mat(0)?,
                k: mat(1)?,
                v: opt(ro.v)?,
                dout: opt(ro.dout)?,
                lse: stat(ro.lse)?,
                delta: ro.delta.map(stat).transpose()?,
                out: [opt(ro.out[0])?, opt(ro.out[1])?, opt(ro.out[2])?],
                half: match half {
                    Some((lib, blocks)) => {
                        let need = |m: Option<Mat16>| m.ok_or_else(|| "a bf16 operand was not staged".to_string());
                        let (q, k) = (need(gathered(0)?)?, need(gathered(1)?)?);
                        let v = ro.v.map(|p| gathered(p).and_then(need)).transpose()?;
                        Some(Half { lib, q, k, v, dout: ro.dout.map(|p| gathered(p).and_then(need)).transpose()?, p: blocks })
                    }
                    None => None,
                },
            };
            // SAFETY: the launch's caller guarantees each pointer addresses its param's buffer,
            // which this launch alone touches (other ranges of it are other heads); staged
            // params point into this thread's scratch.
            unsafe { head.run(s, dp) }?;
            // the 16-bit results, rounded once into their buffers
            for (i, &p) in staged.iter().enumerate().filter(|&(_, &p)| written(p)) {
                let (ptr, rs) = view(p)?;
                for (r, run) in runs(a, rs) {
                    // SAFETY: as the widening's; results overlap nothing else this launch touches.
                    unsafe {
                        let src = std::slice::from_raw_parts(stage_ptr.add(i * th + r * a.hs), run);
                        narrow(dtypes[p], ptr.add(r * rs * elem_bytes(dtypes[p])), src)
                    };
                }
            }
        }
        Ok(())
    }
}
