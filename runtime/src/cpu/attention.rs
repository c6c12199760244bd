//! The seven causal-attention kernel parts (`kir::AttentionPart`), evaluated one row at a time with
//! the math of `qatc_attention.cuh` written out plainly: the scores of a row are computed in full
//! (no online softmax, no tiles), in f32, every sum in index order.
//!
//! Iteration `it` is (b, h, r) with it = (b * nh + h) * t + r, r a query row (forward, delta, dq,
//! lse) or a key row (dk and dv, dv), or both (`Backward`: dq of query row r, dk and dv of key
//! row r). [B, NH, T, hs] operands are views: row (b, h, r) starts at `offset + b*sb + h*sh +
//! r*st`, its hs elements contiguous; lse and delta are [B*NH, T] rows.
//!
//! P_ij = exp(scale q_i.k_j - lse_i) for j <= i; dS_ij = scale P_ij (dout_i.v_j - delta_i).
//! Views of any float type are read widened to f32 and written rounded to their type, once per
//! element.

use qatc_kernels::kir::{Attention, AttentionPart};

use super::kir_eval::Mem;
use super::scalar::{Scalar, R};

struct Ctx<'a> {
    a: &'a Attention,
    mem: &'a [Mem],
    scale: f32,
    b: usize,
    h: usize,
    bh: usize,
}

impl Ctx<'_> {
    fn buf(&self, p: usize) -> R<&Mem> {
        self.mem.get(p).ok_or_else(|| format!("attention {:?} has no param {p}", self.a.part))
    }

    /// Element index of (b, h, r, 0) in param p's view.
    fn row(&self, p: usize, r: usize) -> R<usize> {
        let [sb, sh, st] = *self.a.strides.get(p).ok_or_else(|| format!("no strides for param {p}"))?;
        let off = *self.a.offsets.get(p).ok_or_else(|| format!("no offset for param {p}"))?;
        Ok(off + self.b * sb + self.h * sh + r * st)
    }

    fn read_row(&self, p: usize, r: usize, out: &mut [f32]) -> R<()> {
        let (m, at) = (self.buf(p)?, self.row(p, r)?);
        for (d, o) in out.iter_mut().enumerate() {
            *o = m.f32_at(at + d)?;
        }
        Ok(())
    }

    fn write_row(&self, p: usize, r: usize, x: &[f32]) -> R<()> {
        let (m, at) = (self.buf(p)?, self.row(p, r)?);
        x.iter().enumerate().try_for_each(|(d, &v)| m.store(at + d, Scalar::F32(v)))
    }

    /// Element r of this (b, h)'s [T] row of lse or delta.
    fn stat(&self, r: usize) -> usize {
        self.bh * self.a.t + r
    }

    /// scale * (x . y), summed in order.
    fn score(&self, x: &[f32], y: &[f32]) -> f32 {
        self.scale * dot(x, y)
    }
}

fn dot(x: &[f32], y: &[f32]) -> f32 {
    x.iter().zip(y).fold(0.0f32, |s, (a, b)| s + a * b)
}

/// Scratch rows of hs floats, allocated once per launched range.
struct Rows {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    d: Vec<f32>,
    acc: Vec<f32>,
    acc2: Vec<f32>,
}

pub fn run(a: &Attention, mem: &[Mem], start: usize, end: usize) -> R<()> {
    // f16/bf16 views (`LowerOptions::attention_reads_stored`) load widened and store rounded to
    // nearest even (`Mem`), as the CUDA templates' element types do; lse and delta are f32
    if let Some(m) = mem.iter().find(|m| !m.dtype().is_float()) {
        return Err(format!("attention over a {} buffer", m.dtype()));
    }
    let z = || vec![0.0f32; a.hs];
    let mut s = Rows { q: z(), k: z(), v: z(), d: z(), acc: z(), acc2: z() };
    let mut scores = vec![0.0f32; a.t];
    let ro = a.part.roles();
    let t = a.t;
    for it in start..end {
        let (bh, r) = (it / t, it % t);
        let cx = Ctx { a, mem, scale: a.scale as f32, b: bh / a.nh, h: bh % a.nh, bh };
        let stat = |r| cx.stat(r);
        match a.part {
            AttentionPart::Forward | AttentionPart::Lse => {
                // query row r: scores over keys 0..=r, max-subtracted softmax
                cx.read_row(ro.q, r, &mut s.q)?;
                for (j, x) in scores[..=r].iter_mut().enumerate() {
                    cx.read_row(ro.k, j, &mut s.k)?;
                    *x = cx.score(&s.q, &s.k);
                }
                let m = scores[..=r].iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                let mut l = 0.0f32;
                s.acc.fill(0.0);
                for (j, &x) in scores[..=r].iter().enumerate() {
                    let p = (x - m).exp();
                    l += p;
                    if let (AttentionPart::Forward, Some(v)) = (a.part, ro.v) {
                        cx.read_row(v, j, &mut s.v)?;
                        s.acc.iter_mut().zip(&s.v).for_each(|(o, &x)| *o += p * x);
                    }
                }
                if a.part == AttentionPart::Forward {
                    s.acc.iter_mut().for_each(|o| *o /= l);
                    cx.write_row(need(ro.out[0])?, r, &s.acc)?;
                }
                cx.buf(ro.lse)?.store(stat(r), Scalar::F32(m + l.ln()))?;
            }
            part => {
                // `Backward` is `BackwardQ` for query row r and `BackwardKV` for key row r
                let (query, key) = match part {
                    AttentionPart::BackwardDelta | AttentionPart::BackwardQ => (true, false),
                    AttentionPart::BackwardKV | AttentionPart::BackwardV => (false, true),
                    _ => (true, true),
                };
                if query {
                    let (v, dout, delta) = (need(ro.v)?, need(ro.dout)?, need(ro.delta)?);
                    cx.read_row(ro.q, r, &mut s.q)?;
                    cx.read_row(dout, r, &mut s.d)?;
                    let li = cx.buf(ro.lse)?.f32_at(stat(r))?;
                    let di = if part == AttentionPart::BackwardDelta { 0.0 } else { cx.buf(delta)?.f32_at(stat(r))? };
                    let mut total = 0.0f32;
                    s.acc.fill(0.0);
                    for j in 0..=r {
                        cx.read_row(ro.k, j, &mut s.k)?;
                        cx.read_row(v, j, &mut s.v)?;
                        let p = (cx.score(&s.q, &s.k) - li).exp();
                        let dp = dot(&s.d, &s.v);
                        total += p * dp;
                        let ds = cx.scale * p * (dp - di);
                        s.acc.iter_mut().zip(&s.k).for_each(|(o, &x)| *o += ds * x);
                    }
                    if part == AttentionPart::BackwardDelta {
                        cx.buf(delta)?.store(stat(r), Scalar::F32(total))?;
                    } else {
                        cx.write_row(need(ro.out[0])?, r, &s.acc)?;
                    }
                }
                if key {
                    // key row r: every query row i >= r sees it
                    let dout = need(ro.dout)?;
                    let with_dk = part != AttentionPart::BackwardV;
                    cx.read_row(ro.k, r, &mut s.k)?;
                    if let Some(v) = ro.v {
                        cx.read_row(v, r, &mut s.v)?;
                    }
                    s.acc.fill(0.0); // dk
                    s.acc2.fill(0.0); // dv
                    for i in r..t {
                        cx.read_row(ro.q, i, &mut s.q)?;
                        cx.read_row(dout, i, &mut s.d)?;
                        let p = (cx.score(&s.q, &s.k) - cx.buf(ro.lse)?.f32_at(stat(i))?).exp();
                        s.acc2.iter_mut().zip(&s.d).for_each(|(o, &x)| *o += p * x);
                        if with_dk {
                            let di = cx.buf(need(ro.delta)?)?.f32_at(stat(i))?;
                            let ds = cx.scale * p * (dot(&s.d, &s.v) - di);
                            s.acc.iter_mut().zip(&s.q).for_each(|(o, &x)| *o += ds * x);
                        }
                    }
                    // (dk, dv) at out[0..2] (`BackwardKV`) or out[1..3] (`Backward`); dv at out[0]
                    match part {
                        AttentionPart::BackwardV => cx.write_row(need(ro.out[0])?, r, &s.acc2)?,
                        AttentionPart::BackwardKV => {
                            cx.write_row(need(ro.out[0])?, r, &s.acc)?;
                            cx.write_row(need(ro.out[1])?, r, &s.acc2)?;
                        }
                        _ => {
                            cx.write_row(need(ro.out[1])?, r, &s.acc)?;
                            cx.write_row(need(ro.out[2])?, r, &s.acc2)?;
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

fn need(p: Option<usize>) -> R<usize> {
    p.ok_or_else(|| "attention part lacks an operand".to_string())
}
