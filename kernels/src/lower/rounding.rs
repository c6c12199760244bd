//! Roundings that change nothing, removed from a kernel body. The precision pass's semantics
//! round every f16/bf16 node's value inside a fused body (`builder::round_to`), so a body that
//! only moves 16-bit values (the attention backward's dq, dk and dv concatenated into one
//! [B*T, 3C] gradient) rounds each element five or six times; on the CPU those roundings were
//! most of that kernel's 1.9 ms (124M, B 1, T 256, bf16). The identities, T being f16 or bf16:
//!
//! ```text
//! round_T(round_T(x))      = round_T(x)        rounding is idempotent
//! round_T(load of a T)     = load of a T       a T load widens exactly, and T's values round to themselves
//! round_T(c)               = c                 a constant that is a T value
//! round_T(cond ? a : b)    = cond ? a : b      when a and b are both T values
//! round_T(-x), round_T(|x|) = -x, |x|          when x is a T value (sign changes are exact)
//! ```
//!
//! and a variable bound to a T value is one. Bit for bit the same results (a signalling NaN
//! loaded from a T buffer keeps its payload rather than being quieted: no kernel tells them apart).

use std::collections::HashMap;

use crate::kir::{Expr, Param, Stmt, UnOp, VarId};
use qatc_ir::DType;

/// The 16-bit type a rounding rounds to.
fn rounds_to(op: UnOp) -> Option<DType> {
    match op {
        UnOp::RoundBf16 => Some(DType::BF16),
        UnOp::RoundF16 => Some(DType::F16),
        _ => None,
    }
}

/// Whether `v` is a value of `d` (f16 or bf16), so rounding it to `d` returns it.
fn constant_is(d: DType, v: f64) -> bool {
    let x = v as f32;
    if f64::from(x) != v {
        return false;
    }
    match d {
        DType::BF16 => x.to_bits() & 0xffff == 0,
        DType::F16 => {
            // normal f16 values have 11 significant bits and exponents -14..15; subnormals are
            // multiples of 2^-24; 0 and infinities are values too
            if x == 0.0 || x.is_infinite() {
                return true;
            }
            let a = f64::from(x.abs());
            if a > 65504.0 {
                return false;
            }
            let quantum = if a < 2f64.powi(-14) { 2f64.powi(-24) } else { 2f64.powi(a.log2().floor() as i32 - 10) };
            (a / quantum).fract() == 0.0
        }
        _ => false,
    }
}

/// What is known exact in which 16-bit type: the kernel's params and the variables bound so far.
struct Exact<'a> {
    params: &'a [Param],
    vars: HashMap<VarId, DType>,
}

impl Exact<'_> {
    /// Whether `e` always holds a value of `d`.
    fn is(&self, d: DType, e: &Expr) -> bool {
        match e {
            Expr::Un(op, x) => match rounds_to(*op) {
                Some(t) => t == d,
                None => matches!(op, UnOp::Neg | UnOp::Abs) && self.is(d, x),
            },
            Expr::Load { param, .. } => self.params.get(*param).is_some_and(|p| p.dtype == d),
            Expr::Float(v, _) => constant_is(d, *v),
            Expr::Select(_, a, b) => self.is(d, a) && self.is(d, b),
            Expr::Var(v) => self.vars.get(v) == Some(&d),
            _ => false,
        }
    }

    /// `e` with its needless roundings removed, innermost first.
    fn simplify(&self, e: &mut Expr) {
        e.for_each_child_mut(|c| self.simplify(c));
        if let Expr::Un(op, x) = e {
            if let Some(d) = rounds_to(*op) {
                if self.is(d, x) {
                    let inner = std::mem::replace(&mut **x, Expr::Bool(false));
                    *e = inner;
                }
            }
        }
    }

    fn block(&mut self, stmts: &mut [Stmt]) {
        for s in stmts {
            match s {
                Stmt::Let { var, value, .. } => {
                    self.simplify(value);
                    if let Some(d) = [DType::BF16, DType::F16].into_iter().find(|&d| self.is(d, value)) {
                        self.vars.insert(*var, d);
                    }
                }
                Stmt::Store { index, value, .. } | Stmt::AtomicAdd { index, value, .. } => {
                    self.simplify(index);
                    self.simplify(value);
                }
                Stmt::Reduce { lp, body, value, .. } => {
                    self.simplify(&mut lp.extent);
                    self.block(body);
                    self.simplify(value);
                }
                Stmt::ForEach { lp, body } => {
                    self.simplify(&mut lp.extent);
                    self.block(body);
                }
            }
        }
    }
}

/// Removes the roundings in `stmts` (a body over `params`) that change nothing (module docs).
pub fn drop_exact_roundings(stmts: &mut [Stmt], params: &[Param]) {
    Exact { params, vars: HashMap::new() }.block(stmts);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param(d: DType) -> Param {
        Param { name: "p".into(), dtype: d, shape: vec![8], write: false }
    }

    /// What `builder::round_to` writes for a 16-bit node.
    fn round(d: DType, e: Expr) -> Expr {
        Expr::un(if d == DType::F16 { UnOp::RoundF16 } else { UnOp::RoundBf16 }, e)
    }

    #[test]
    fn roundings_of_values_already_rounded_go_and_the_others_stay() {
        let params = [param(DType::BF16), param(DType::F32), param(DType::F16)];
        let load = |p| Expr::load(p, Expr::Int(0));
        let bf = DType::BF16;
        let sum = Expr::bin(crate::kir::BinOp::Add, load(0), load(0));
        let cases = [
            (round(bf, round(bf, sum.clone())), round(bf, sum.clone())),
            (round(bf, load(0)), load(0)),
            (round(bf, load(1)), round(bf, load(1))),
            (round(bf, load(2)), round(bf, load(2))),
            (round(bf, Expr::f32(0.0)), Expr::f32(0.0)),
            (round(bf, Expr::f32(0.1)), round(bf, Expr::f32(0.1))),
            (round(bf, Expr::select(Expr::Bool(true), load(0), Expr::f32(1.5))), Expr::select(Expr::Bool(true), load(0), Expr::f32(1.5))),
            (round(bf, Expr::select(Expr::Bool(true), load(0), load(1))), round(bf, Expr::select(Expr::Bool(true), load(0), load(1)))),
            (round(bf, Expr::un(UnOp::Neg, load(0))), Expr::un(UnOp::Neg, load(0))),
            (round(bf, sum.clone()), round(bf, sum.clone())),
            (round(DType::F16, load(2)), load(2)),
            (round(DType::F16, Expr::f32(65504.0)), Expr::f32(65504.0)),
            (round(DType::F16, Expr::f32(2049.0)), round(DType::F16, Expr::f32(2049.0))),
            (round(DType::F16, Expr::f32(2f64.powi(-24))), Expr::f32(2f64.powi(-24))),
        ];
        for (before, after) in cases {
            let mut stmts = vec![Stmt::Store { param: 1, index: Expr::Int(0), value: before.clone() }];
            drop_exact_roundings(&mut stmts, &params);
            let Stmt::Store { value, .. } = &stmts[0] else { unreachable!() };
            assert_eq!(value, &after, "{before:?}");
        }
    }

    #[test]
    fn a_variable_bound_to_a_rounded_value_is_one() {
        let params = [param(DType::BF16)];
        let mut stmts = vec![
            Stmt::Let { var: 0, ty: crate::kir::Ty::F32, value: round(DType::BF16, Expr::load(0, Expr::Int(0))) },
            Stmt::Store { param: 0, index: Expr::Int(1), value: round(DType::BF16, Expr::Var(0)) },
        ];
        drop_exact_roundings(&mut stmts, &params);
        assert_eq!(stmts[0], Stmt::Let { var: 0, ty: crate::kir::Ty::F32, value: Expr::load(0, Expr::Int(0)) });
        assert_eq!(stmts[1], Stmt::Store { param: 0, index: Expr::Int(1), value: Expr::Var(0) });
    }

    /// The f16 test of constants against `half`'s own rounding, over every f16 value and the
    /// midpoints between them.
    #[test]
    fn f16_constants_are_values_exactly_when_half_says_so() {
        for bits in 0..=0xffffu16 {
            let v = half::f16::from_bits(bits);
            if v.is_nan() {
                continue;
            }
            let x = v.to_f32();
            assert!(constant_is(DType::F16, f64::from(x)), "{x}");
            let mid = f64::from(x) + f64::from(half::f16::from_bits(bits.wrapping_add(1)).to_f32() - x) / 2.0;
            if mid.is_finite() && half::f16::from_bits(bits.wrapping_add(1)).is_finite() && bits & 0x7fff != 0x7bff {
                let rounds_to_itself = f64::from(half::f16::from_f64(mid).to_f32()) == mid;
                assert_eq!(constant_is(DType::F16, mid), rounds_to_itself, "{mid}");
            }
        }
    }
}
