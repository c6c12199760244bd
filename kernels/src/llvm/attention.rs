//! Causal attention on the CPU: one program per (b, h, row), the same math as
//! `cuda/include/qatc_attention.cuh` but laid out for one core instead of a thread block. A
//! query row's scores live in a T-long stack buffer (the T x T matrix never exists), the softmax
//! is two-pass (max, then exp and sum) instead of online, and the backward recomputes P from the
//! forward's log-sum-exp. Key-row programs (dk, dv) stream the query rows i >= j: every output
//! row has one owner, so no atomics. q, k, v, dout and the results may be f16/bf16
//! (`LowerOptions::attention_reads_stored`): each element widened where it is loaded and each
//! result rounded once where it is stored, the math in f32.

use inkwell::values::{BasicValue, FloatValue, IntValue, PointerValue};

use super::fb::{FnBuilder, R};
use super::math::exp_f32;
use crate::error::KernelError;
use crate::kir::{Attention, AttentionPart};

/// `reassoc` + `nsz` on the dot products' and the softmax sum's adds (folded in any order).
const FMF: u32 = 1 | 8;

struct AttentionScope<'ctx> {
    a: Attention,
    hs: IntValue<'ctx>,
    b: IntValue<'ctx>,
    h: IntValue<'ctx>,
    /// bh * T: where this (b, h)'s lse / delta rows start.
    stat0: IntValue<'ctx>,
}

impl<'ctx> AttentionScope<'ctx> {
    /// Element index of (b, h, t, 0) in param p's buffer.
    fn row(&self, f: &FnBuilder<'_, 'ctx>, p: usize, t: IntValue<'ctx>) -> R<IntValue<'ctx>> {
        let i64t = f.cx.i64_type();
        let [sb, sh, st] =
            self.a.strides.get(p).copied().ok_or_else(|| KernelError::Internal(format!("{}: no strides for param {p}", f.name)))?;
        let off = self.a.offsets.get(p).copied().unwrap_or(0);
        let c = |v: usize| i64t.const_int(v as u64, false);
        let x = f.b.build_int_add(f.b.build_int_mul(self.b, c(sb), "sb")?, f.b.build_int_mul(self.h, c(sh), "sh")?, "x")?;
        let x = f.b.build_int_add(x, f.b.build_int_mul(t, c(st), "st")?, "x")?;
        Ok(f.b.build_int_add(x, c(off), "row")?)
    }

    fn stat(&self, f: &FnBuilder<'_, 'ctx>, p: usize, t: IntValue<'ctx>) -> R<FloatValue<'ctx>> {
        f.load_f32(f.param(p)?, f.b.build_int_add(self.stat0, t, "r")?)
    }

    /// sum_d x[xr + d] * y[yr + d]
    fn dot(&self, f: &mut FnBuilder<'_, 'ctx>, x: (usize, IntValue<'ctx>), y: (usize, IntValue<'ctx>)) -> R<FloatValue<'ctx>> {
        let acc = f.alloca(f.f32t().into(), 1, "dot")?;
        f.b.build_store(acc, f.f32c(0.0))?;
        let zero = f.cx.i64_type().const_int(0, false);
        f.for_range(zero, self.hs, &mut |f, d| {
            let a = f.load(x.0, f.b.build_int_add(x.1, d, "i")?)?.into_float_value();
            let b = f.load(y.0, f.b.build_int_add(y.1, d, "i")?)?.into_float_value();
            let s = f.b.build_float_add(f.b.build_load(f.f32t(), acc, "s")?.into_float_value(), f.b.build_float_mul(a, b, "ab")?, "s")?;
            if let Some(i) = s.as_instruction_value() {
                i.set_fast_math_flags(FMF);
            }
            f.b.build_store(acc, s)?;
            Ok(())
        })?;
        Ok(f.b.build_load(f.f32t(), acc, "dot")?.into_float_value())
    }

    /// acc[d] += w * x[xr + d]
    fn axpy(&self, f: &mut FnBuilder<'_, 'ctx>, acc: PointerValue<'ctx>, w: FloatValue<'ctx>, x: (usize, IntValue<'ctx>)) -> R<()> {
        let zero = f.cx.i64_type().const_int(0, false);
        f.for_range(zero, self.hs, &mut |f, d| {
            let xv = f.load(x.0, f.b.build_int_add(x.1, d, "i")?)?.into_float_value();
            let a = f.load_f32(acc, d)?;
            f.store_f32(acc, d, f.b.build_float_add(a, f.b.build_float_mul(w, xv, "wx")?, "a")?)
        })
    }

    fn fill(&self, f: &mut FnBuilder<'_, 'ctx>, acc: PointerValue<'ctx>) -> R<()> {
        let zero = f.cx.i64_type().const_int(0, false);
        f.for_range(zero, self.hs, &mut |f, d| f.store_f32(acc, d, f.f32c(0.0)))
    }

    /// out[or + d] = acc[d] * scale
    fn write(
        &self,
        f: &mut FnBuilder<'_, 'ctx>,
        p: usize,
        t: IntValue<'ctx>,
        acc: PointerValue<'ctx>,
        div: Option<FloatValue<'ctx>>,
    ) -> R<()> {
        let base = self.row(f, p, t)?;
        let zero = f.cx.i64_type().const_int(0, false);
        f.for_range(zero, self.hs, &mut |f, d| {
            let mut v = f.load_f32(acc, d)?;
            if let Some(l) = div {
                v = f.b.build_float_div(v, l, "o")?;
            }
            f.store(p, f.b.build_int_add(base, d, "i")?, v.into())
        })
    }
}

pub fn emit(f: &mut FnBuilder, a: &Attention) -> R<()> {
    let s = a.part.roles();
    // q, k, v, dout and the results in any float type (widened at the load, rounded at the
    // store); lse and delta f32
    let stats = [Some(s.lse), s.delta];
    let bad = |(i, p): &(usize, &crate::kir::Param)| !p.dtype.is_float() || (stats.contains(&Some(*i)) && p.dtype != qatc_ir::DType::F32);
    if let Some((_, p)) = f.k.params.iter().enumerate().find(bad) {
        return Err(KernelError::Internal(format!("{}: attention on {} {}", f.name, p.dtype, p.name)));
    }
    let i64t = f.cx.i64_type();
    let c = |v: usize| i64t.const_int(v as u64, false);
    let t_len = a.t as u32;
    let scores = f.alloca(f.f32t().into(), t_len.max(1), "scores")?;
    let acc = f.alloca(f.f32t().into(), a.hs.max(1) as u32, "acc")?;
    let acc2 = f.alloca(f.f32t().into(), a.hs.max(1) as u32, "acc2")?;
    let m_slot = f.alloca(f.f32t().into(), 1, "m")?;
    let l_slot = f.alloca(f.f32t().into(), 1, "l")?;
    let scale = f.f32c(a.scale);
    let (start, end) = (f.start, f.end);
    f.for_range(start, end, &mut |f, it| {
        let bh = f.b.build_int_unsigned_div(it, c(a.t), "bh")?;
        let r = f.b.build_int_unsigned_rem(it, c(a.t), "r")?;
        let at = AttentionScope {
            a: a.clone(),
            hs: c(a.hs),
            b: f.b.build_int_unsigned_div(bh, c(a.nh), "b")?,
            h: f.b.build_int_unsigned_rem(bh, c(a.nh), "h")?,
            stat0: f.b.build_int_mul(bh, c(a.t), "s0")?,
        };
        let zero = c(0);
        let upto = f.b.build_int_add(r, c(1), "upto")?;
        match a.part {
            AttentionPart::Forward | AttentionPart::Lse => {
                // scores[j] = scale q_i . k_j and their max, for j <= i
                let qi = at.row(f, s.q, r)?;
                f.b.build_store(m_slot, f.f32c(f64::NEG_INFINITY))?;
                f.for_range(zero, upto, &mut |f, j| {
                    let kj = at.row(f, s.k, j)?;
                    let qk = at.dot(f, (s.q, qi), (s.k, kj))?;
                    let x = f.b.build_float_mul(scale, qk, "x")?;
                    f.store_f32(scores, j, x)?;
                    let m = f.b.build_load(f.f32t(), m_slot, "m")?.into_float_value();
                    f.b.build_store(m_slot, f.intrinsic("llvm.maxnum", &[m, x])?)?;
                    Ok(())
                })?;
                let m = f.b.build_load(f.f32t(), m_slot, "m")?.into_float_value();
                f.b.build_store(l_slot, f.f32c(0.0))?;
                f.for_range(zero, upto, &mut |f, j| {
                    let p = exp_f32(f, f.b.build_float_sub(f.load_f32(scores, j)?, m, "x")?)?;
                    f.store_f32(scores, j, p)?;
                    let l = f.b.build_float_add(f.b.build_load(f.f32t(), l_slot, "l")?.into_float_value(), p, "l")?;
                    if let Some(i) = l.as_instruction_value() {
                        i.set_fast_math_flags(FMF);
                    }
                    f.b.build_store(l_slot, l)?;
                    Ok(())
                })?;
                let l = f.b.build_load(f.f32t(), l_slot, "l")?.into_float_value();
                if let (AttentionPart::Forward, Some(v), Some(out)) = (a.part, s.v, s.out[0]) {
                    at.fill(f, acc)?;
                    f.for_range(zero, upto, &mut |f, j| {
                        let vj = at.row(f, v, j)?;
                        at.axpy(f, acc, f.load_f32(scores, j)?, (v, vj))
                    })?;
                    at.write(f, out, r, acc, Some(l))?;
                }
                let lse = f.b.build_float_add(m, f.libm("logf", &[l])?, "lse")?;
                f.store_f32(f.param(s.lse)?, f.b.build_int_add(at.stat0, r, "i")?, lse)?;
            }
            part => {
                // `Backward` is `BackwardQ` for query row r and `BackwardKV` for key row r
                let query = !matches!(part, AttentionPart::BackwardKV | AttentionPart::BackwardV);
                let key = !matches!(part, AttentionPart::BackwardDelta | AttentionPart::BackwardQ);
                if query {
                    let (v, dout, delta) = (s.v.ok_or_else(missing)?, s.dout.ok_or_else(missing)?, s.delta.ok_or_else(missing)?);
                    let (qi, di_row) = (at.row(f, s.q, r)?, at.row(f, dout, r)?);
                    let li = at.stat(f, s.lse, r)?;
                    let dq = a.part != AttentionPart::BackwardDelta;
                    let di = if dq { at.stat(f, delta, r)? } else { f.f32c(0.0) };
                    f.b.build_store(l_slot, f.f32c(0.0))?;
                    at.fill(f, acc)?;
                    f.for_range(zero, upto, &mut |f, j| {
                        let (kj, vj) = (at.row(f, s.k, j)?, at.row(f, v, j)?);
                        let qk = at.dot(f, (s.q, qi), (s.k, kj))?;
                        let x = f.b.build_float_mul(scale, qk, "x")?;
                        let p = exp_f32(f, f.b.build_float_sub(x, li, "x")?)?;
                        let dp = at.dot(f, (dout, di_row), (v, vj))?;
                        if dq {
                            let ds = f.b.build_float_mul(f.b.build_float_mul(scale, p, "sp")?, f.b.build_float_sub(dp, di, "d")?, "ds")?;
                            at.axpy(f, acc, ds, (s.k, kj))
                        } else {
                            let sum = f.b.build_load(f.f32t(), l_slot, "d")?.into_float_value();
                            f.b.build_store(l_slot, f.b.build_float_add(sum, f.b.build_float_mul(p, dp, "pd")?, "d")?)?;
                            Ok(())
                        }
                    })?;
                    if dq {
                        at.write(f, s.out[0].ok_or_else(missing)?, r, acc, None)?;
                    } else {
                        let d = f.b.build_load(f.f32t(), l_slot, "delta")?.into_float_value();
                        f.store_f32(f.param(delta)?, f.b.build_int_add(at.stat0, r, "i")?, d)?;
                    }
                }
                if key {
                    // key row j = r: query rows i in j..T
                    let dout = s.dout.ok_or_else(missing)?;
                    let kv = a.part != AttentionPart::BackwardV;
                    let kj = at.row(f, s.k, r)?;
                    let vj = match s.v {
                        Some(v) if kv => Some(at.row(f, v, r)?),
                        _ => None,
                    };
                    at.fill(f, acc)?;
                    at.fill(f, acc2)?;
                    f.for_range(r, c(a.t), &mut |f, i| {
                        let qi = at.row(f, s.q, i)?;
                        let doi = at.row(f, dout, i)?;
                        let qk = at.dot(f, (s.q, qi), (s.k, kj))?;
                        let x = f.b.build_float_mul(scale, qk, "x")?;
                        let p = exp_f32(f, f.b.build_float_sub(x, at.stat(f, s.lse, i)?, "x")?)?;
                        at.axpy(f, acc2, p, (dout, doi))?;
                        if let (Some(v), Some(vj), Some(delta)) = (s.v, vj, s.delta) {
                            let dp = at.dot(f, (dout, doi), (v, vj))?;
                            let d = f.b.build_float_sub(dp, at.stat(f, delta, i)?, "d")?;
                            let ds = f.b.build_float_mul(f.b.build_float_mul(scale, p, "sp")?, d, "ds")?;
                            at.axpy(f, acc, ds, (s.q, qi))?;
                        }
                        Ok(())
                    })?;
                    // (dk, dv) at out[0..2] (`BackwardKV`) or out[1..3] (`Backward`); dv at out[0]
                    if kv {
                        let first = usize::from(a.part == AttentionPart::Backward);
                        at.write(f, s.out[first].ok_or_else(missing)?, r, acc, None)?;
                        at.write(f, s.out[first + 1].ok_or_else(missing)?, r, acc2, None)?;
                    } else {
                        at.write(f, s.out[0].ok_or_else(missing)?, r, acc2, None)?;
                    }
                }
            }
        }
        Ok(())
    })
}

fn missing() -> KernelError {
    KernelError::Internal("attention: a part without its operands".into())
}
