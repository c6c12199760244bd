//! A host model of what a [`BlasPlan`] does, with cuBLAS' column-major semantics exactly as
//! `blas/mod.rs` states them: stored element (r, c) of a batched operand at
//! `offset + r + c * ld + batch * stride`, op N / T, `D = alpha op(A) op(B) + beta C + bias` with C
//! unread when beta is 0. Products are summed in f64 and rounded once (a reference, not cuBLAS'
//! own order); TF32 rounds the fp32 operands to 10 mantissa bits first (`cvt.rna.tf32.f32`: to
//! nearest, ties away from zero).
//!
//! [`execute`] runs a whole plan over a [`HostMemory`] (the GPU emulation's memory, a test's
//! buffers); [`value_at`] computes the value one element holds after the plan without running
//! it, so a test can check the plans of GEMMs far too large to run on the host element by element.

use super::{BlasCall, BlasPlan, BlasStep, Compute, ElemType, Matrix, Mem, Op, Strided};
use crate::error::KernelError;

/// Memory the host model reads and writes, by [`Mem`] and element index (a store rounds to the
/// element type).
pub trait HostMemory {
    fn load(&self, mem: Mem, i: usize, ty: ElemType) -> Result<f32, String>;
    fn store(&mut self, mem: Mem, i: usize, ty: ElemType, v: f32) -> Result<(), String>;
}

/// An fp32 value as TF32: 13 low mantissa bits rounded off, to nearest, ties away from zero.
pub fn tf32(x: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    let u = x.to_bits();
    f32::from_bits(u.wrapping_add(1 << 12) & !0x1fff)
}

/// Where stored element (r, c) of matrix `batch` of an operand lives.
fn stored(x: &Matrix, batch: usize, r: usize, c: usize) -> usize {
    x.offset + batch * x.stride + r + c * x.ld
}

/// Where op(X)(i, j) lives.
fn element(x: &Matrix, op: Op, batch: usize, i: usize, j: usize) -> usize {
    match op {
        Op::N => stored(x, batch, i, j),
        Op::T => stored(x, batch, j, i),
    }
}

/// The (batch, row, column) of D a call writes at element `i` of its destination, if any.
fn written_by(c: &BlasCall, mem: Mem, i: usize) -> Option<(usize, usize, usize)> {
    if mem != c.c.mem || i < c.c.offset {
        return None;
    }
    let batches = if c.c.stride == 0 { 1 } else { c.batch };
    (0..batches).find_map(|b| {
        let rel = (i - c.c.offset).checked_sub(b * c.c.stride)?;
        let (row, col) = (rel % c.c.ld, rel / c.c.ld);
        (row < c.m && col < c.n).then_some((b, row, col))
    })
}

impl Strided {
    /// The row-major element of the window stored at memory index `i`, if any (the inverse of
    /// [`Strided::at`] for a window whose elements do not overlap).
    pub fn index_of(&self, i: usize) -> Option<usize> {
        let mut rest = i.checked_sub(self.offset)?;
        let mut dims: Vec<usize> = (0..self.shape.len()).filter(|&d| self.shape[d] > 1).collect();
        dims.sort_by(|&x, &y| self.strides[y].cmp(&self.strides[x]));
        let mut coord = vec![0; self.shape.len()];
        for d in dims {
            let s = self.strides[d];
            if let Some(q) = rest.checked_div(s) {
                coord[d] = q.min(self.shape[d] - 1);
                rest -= coord[d] * s;
            }
        }
        let e = coord.iter().zip(&self.shape).fold(0, |e, (&c, &n)| e * n + c);
        (rest == 0 && self.at(e) == i && e < self.numel()).then_some(e)
    }
}

/// The operand values of a call: fp32 operands rounded to TF32 in TF32 mode.
fn operand(compute: Compute, v: f32) -> f64 {
    f64::from(if compute == Compute::Tf32 { tf32(v) } else { v })
}

/// One element of D: alpha * sum_l op(A)(i, l) op(B)(l, j) + beta * C + bias, from `read`.
fn dot(
    c: &BlasCall,
    compute: Compute,
    (b, i, j): (usize, usize, usize),
    read: &mut dyn FnMut(Mem, usize, ElemType) -> Result<f32, String>,
) -> Result<f32, String> {
    let mut acc = 0.0f64;
    for l in 0..c.k {
        let x = read(c.a.mem, element(&c.a, c.ta, b, i, l), c.a.ty)?;
        let y = read(c.b.mem, element(&c.b, c.tb, b, l, j), c.b.ty)?;
        acc += operand(compute, x) * operand(compute, y);
    }
    let mut d = f64::from(c.alpha) * acc;
    if c.beta != 0.0 {
        d += f64::from(c.beta) * f64::from(read(c.c.mem, stored(&c.c, b, i, j), c.c.ty)?);
    }
    if let Some(v) = &c.bias {
        d += f64::from(read(v.mem, v.offset + i, v.ty)?);
    }
    Ok(d as f32)
}

/// Outputs `qs` of a call, numbered batch-major then column by column (output q is column
/// `q % n` of batch `q / n`), computed from `mem` as it is, nothing written: (index in the
/// destination's memory, value) for every row of those columns. Disjoint ranges may be computed
/// at the same time.
pub fn call_outputs<M: HostMemory + ?Sized>(
    c: &BlasCall,
    compute: Compute,
    mem: &M,
    qs: std::ops::Range<usize>,
) -> Result<Vec<(usize, f32)>, String> {
    let mut out = Vec::with_capacity(qs.len() * c.m);
    for q in qs {
        let (b, j) = (q / c.n.max(1), q % c.n.max(1));
        for i in 0..c.m {
            let mut read = |m: Mem, at: usize, ty: ElemType| mem.load(m, at, ty);
            out.push((stored(&c.c, b, i, j), dot(c, compute, (b, i, j), &mut read)?));
        }
    }
    Ok(out)
}

/// Runs every step of `plan` on `mem`.
pub fn execute(plan: &BlasPlan, mem: &mut dyn HostMemory) -> Result<(), KernelError> {
    let err = |e: String| KernelError::Internal(format!("BLAS plan on the host: {e}"));
    for step in &plan.steps {
        match step {
            BlasStep::Pack { from, scratch } => {
                let ty = from.ty;
                for e in 0..from.numel() {
                    let v = mem.load(from.mem, from.at(e), ty).map_err(err)?;
                    mem.store(Mem::Scratch(*scratch), e, ty, v).map_err(err)?;
                }
            }
            BlasStep::Unpack { scratch, to } => {
                for e in 0..to.numel() {
                    let v = mem.load(Mem::Scratch(*scratch), e, to.ty).map_err(err)?;
                    mem.store(to.mem, to.at(e), to.ty, v).map_err(err)?;
                }
            }
            BlasStep::Call(c) => {
                // every output from the operands as they were before the call
                let out = call_outputs(c, plan.compute, &*mem, 0..c.batch * c.n).map_err(err)?;
                for (at, v) in out {
                    mem.store(c.c.mem, at, c.c.ty, v).map_err(err)?;
                }
            }
            BlasStep::AddBias { c, bias } => {
                let n = c.shape.last().copied().unwrap_or(1).max(1);
                for e in 0..c.numel() {
                    let v = mem.load(c.mem, c.at(e), c.ty).map_err(err)? + mem.load(bias.mem, bias.at(e % n), bias.ty).map_err(err)?;
                    mem.store(c.mem, c.at(e), c.ty, v).map_err(err)?;
                }
            }
            BlasStep::Zero { c } => {
                for e in 0..c.numel() {
                    mem.store(c.mem, c.at(e), c.ty, 0.0).map_err(err)?;
                }
            }
        }
    }
    Ok(())
}

/// The value element `i` of `mem_id` holds after the whole plan (before rounding to a 16-bit
/// destination type), computed from `mem` as it is before the plan, without running the plan.
pub fn value_at(plan: &BlasPlan, mem: &dyn HostMemory, mem_id: Mem, i: usize, ty: ElemType) -> Result<f32, String> {
    after(plan, plan.steps.len(), mem, mem_id, i, ty)
}

/// The value at (mem_id, i) after the first `s` steps.
fn after(plan: &BlasPlan, s: usize, mem: &dyn HostMemory, mem_id: Mem, i: usize, ty: ElemType) -> Result<f32, String> {
    let Some(step) = s.checked_sub(1).and_then(|p| plan.steps.get(p)) else { return mem.load(mem_id, i, ty) };
    let before = |m: Mem, at: usize, t: ElemType| after(plan, s - 1, mem, m, at, t);
    match step {
        BlasStep::Pack { from, scratch } if mem_id == Mem::Scratch(*scratch) => before(from.mem, from.at(i), from.ty),
        BlasStep::Unpack { scratch, to } if mem_id == to.mem => match to.index_of(i) {
            Some(e) => before(Mem::Scratch(*scratch), e, to.ty),
            None => before(mem_id, i, ty),
        },
        BlasStep::Call(c) => match written_by(c, mem_id, i) {
            Some(bij) => dot(c, plan.compute, bij, &mut |m, at, t| before(m, at, t)),
            None => before(mem_id, i, ty),
        },
        BlasStep::AddBias { c, bias } if mem_id == c.mem => match c.index_of(i) {
            Some(e) => {
                let n = c.shape.last().copied().unwrap_or(1).max(1);
                Ok(before(mem_id, i, ty)? + before(bias.mem, bias.at(e % n), bias.ty)?)
            }
            None => before(mem_id, i, ty),
        },
        BlasStep::Zero { c } if mem_id == c.mem && c.index_of(i).is_some() => Ok(0.0),
        _ => before(mem_id, i, ty),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tf32_keeps_ten_mantissa_bits_rounding_to_nearest() {
        assert_eq!(tf32(1.0), 1.0);
        let ulp = 2f32.powi(-10);
        assert_eq!(tf32(1.0 + ulp), 1.0 + ulp);
        assert_eq!(tf32(1.0 + ulp * 0.49), 1.0);
        assert_eq!(tf32(1.0 + ulp * 0.5), 1.0 + ulp, "ties away from zero");
        assert_eq!(tf32(-(1.0 + ulp * 0.51)), -(1.0 + ulp));
        assert!(tf32(f32::NAN).is_nan());
    }

    #[test]
    fn windows_invert_their_addressing() {
        let w = Strided { mem: Mem::Buf(0), offset: 7, shape: vec![2, 3, 4], strides: vec![40, 1, 5], ty: ElemType::F32 };
        for e in 0..w.numel() {
            assert_eq!(w.index_of(w.at(e)), Some(e));
        }
        assert_eq!(w.index_of(6), None);
        assert_eq!(w.index_of(7 + 3), None, "a gap between columns");
    }
}
