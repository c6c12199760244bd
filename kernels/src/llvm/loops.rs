//! `Body::Loops` kernels' statements and scalar expressions, following the kernel IR's semantics
//! (module docs of `kir`); the outer space around them is `space.rs`'s. Row mappings are GPU
//! hints: on the CPU every row is a plain loop nest.

use std::collections::HashMap;

use inkwell::values::{BasicValue, BasicValueEnum, FloatValue, IntValue};
use inkwell::{FloatPredicate, IntPredicate};

use super::fb::{FnBuilder, R};
use super::math;
use super::scalar::{cast, convert, is_float, join, speculatable};
use crate::error::KernelError;
use crate::kir::{BinOp, Expr, Intrinsic, Ix, ReduceOp, Stmt, Ty, TypeEnv, UnOp, VarId};

/// `reassoc` and `nsz`: a `Reduce` `Sum` may fold in any order (`kir`), so LLVM may vectorize it.
const REDUCE_FMF: u32 = 1 | 8;

/// Independent accumulators of a long Max reduction (one AVX2 vector of f32).
const MAX_LANES: usize = 8;

/// The terms of an f32 `Sum` added in f32 before their partial sum joins the f64 total
/// (`Scope::wide_sum`).
const WIDE_CHUNK: u64 = 64;

/// Emission state: index variables and let-bound values in scope.
pub(super) struct Scope<'ctx> {
    pub(super) env: TypeEnv,
    pub(super) ix: HashMap<Ix, IntValue<'ctx>>,
    pub(super) vars: HashMap<VarId, BasicValueEnum<'ctx>>,
    /// Codes of packed 4-bit params at the current element, already unpacked
    /// (`space.rs`'s `elements`).
    pub(super) nibbles: HashMap<usize, IntValue<'ctx>>,
    /// C of a flat space run as rows of C (`space.rs`'s `row_modulus`): `Elem % C` is
    /// `Coord(1)`, `Elem / C` is `Coord(0)`.
    pub(super) modulus: Option<i64>,
}

impl<'ctx> Scope<'ctx> {
    pub(super) fn stmts(&mut self, f: &mut FnBuilder<'_, 'ctx>, stmts: &[Stmt]) -> R<()> {
        for s in stmts {
            self.stmt(f, s)?;
        }
        Ok(())
    }

    fn stmt(&mut self, f: &mut FnBuilder<'_, 'ctx>, s: &Stmt) -> R<()> {
        match s {
            Stmt::Let { var, ty, value } => {
                let v = self.typed(f, value, *ty)?;
                self.vars.insert(*var, v);
            }
            Stmt::Store { param, index, value } => {
                let i = self.index(f, index)?;
                let want = if f.k.params.get(*param).is_some_and(|p| p.dtype.is_float()) { Ty::F32 } else { Ty::I32 };
                let v = self.typed(f, value, want)?;
                f.store(*param, i, v)?;
            }
            Stmt::AtomicAdd { param, index, value } => {
                if f.k.params.get(*param).map(|p| p.dtype) != Some(qatc_ir::DType::I32) {
                    return Err(KernelError::Internal(format!("{}: atomic add into a non-i32 param (kir: counts only)", f.name)));
                }
                let i = self.index(f, index)?;
                let v = self.typed(f, value, Ty::I32)?.into_int_value();
                f.atomic_add(*param, i, v)?;
            }
            Stmt::ForEach { lp, body } => {
                let n = self.index(f, &lp.extent)?;
                let zero = n.get_type().const_int(0, false);
                f.for_range(zero, n, &mut |f, j| {
                    self.ix.insert(Ix::Loop(lp.var), j);
                    self.stmts(f, body)
                })?;
            }
            Stmt::Reduce { var, op, ty, lp, body, value } if !is_float(*ty) => {
                // an integer count: a plain sum (LLVM vectorizes integer adds freely)
                if *op != ReduceOp::Sum || !matches!(ty, Ty::I32 | Ty::I64) {
                    return Err(KernelError::Internal(format!("{}: a {op:?} reduction over {ty:?}", f.name)));
                }
                let ity = f.llty(*ty).into_int_type();
                let acc = f.alloca(ity.into(), 1, "acc")?;
                f.b.build_store(acc, ity.const_int(0, false))?;
                let n = self.index(f, &lp.extent)?;
                let zero = n.get_type().const_int(0, false);
                f.for_range(zero, n, &mut |f, j| {
                    self.ix.insert(Ix::Loop(lp.var), j);
                    self.stmts(f, body)?;
                    let x = self.typed(f, value, *ty)?.into_int_value();
                    let a = f.b.build_load(ity, acc, "a")?.into_int_value();
                    f.b.build_store(acc, f.b.build_int_add(a, x, "sum")?)?;
                    Ok(())
                })?;
                let v = f.b.build_load(ity, acc, "reduced")?;
                self.vars.insert(*var, v);
            }
            Stmt::Reduce { var, op: ReduceOp::Sum, ty: Ty::F32, lp, body, value } => {
                let n = self.index(f, &lp.extent)?;
                let v = self.wide_sum(f, lp, body, value, n)?;
                self.vars.insert(*var, v.into());
            }
            Stmt::Reduce { var, op, ty, lp, body, value } => {
                let fty = f.llty(*ty).into_float_type();
                let acc = f.alloca(fty.into(), 1, "acc")?;
                let init = match op {
                    ReduceOp::Sum | ReduceOp::FirstAbsMax => 0.0,
                    ReduceOp::Max => f64::NEG_INFINITY,
                };
                f.b.build_store(acc, fty.const_float(init))?;
                let n = self.index(f, &lp.extent)?;
                let zero = n.get_type().const_int(0, false);
                let mut tail_from = zero;
                if *op == ReduceOp::Max && lp.max >= 2 * MAX_LANES {
                    // max is exactly associative and commutative (NaN-ignoring), but LLVM will
                    // not vectorize a maxnum reduction without `nnan`: fold MAX_LANES independent
                    // lanes (the SLP vectorizer makes them one vector), then the rest
                    tail_from = self.max_lanes(f, acc, fty, lp, body, value, *ty, n)?;
                }
                f.for_range(tail_from, n, &mut |f, j| {
                    self.ix.insert(Ix::Loop(lp.var), j);
                    self.stmts(f, body)?;
                    let x = self.typed(f, value, *ty)?.into_float_value();
                    let a = f.b.build_load(fty, acc, "a")?.into_float_value();
                    let next = match op {
                        ReduceOp::Sum => {
                            let s = f.b.build_float_add(a, x, "sum")?;
                            if let Some(ins) = s.as_instruction_value() {
                                ins.set_fast_math_flags(REDUCE_FMF);
                            }
                            s
                        }
                        // NaN-ignoring, as `if x > max` scans and fmaxf
                        ReduceOp::Max => f.intrinsic("llvm.maxnum", &[a, x])?,
                        ReduceOp::FirstAbsMax => {
                            let (ax, aa) = (f.intrinsic("llvm.fabs", &[x])?, f.intrinsic("llvm.fabs", &[a])?);
                            let bigger = f.b.build_float_compare(FloatPredicate::OGT, ax, aa, "bigger")?;
                            f.b.build_select(bigger, x, a, "fam")?.into_float_value()
                        }
                    };
                    f.b.build_store(acc, next)?;
                    Ok(())
                })?;
                let v = f.b.build_load(fty, acc, "reduced")?;
                self.vars.insert(*var, v);
            }
        }
        Ok(())
    }

    /// An f32 `Sum` as the reference sums (`qatc_runtime::WideSum`: f64, rounded once at the end),
    /// at f32's vector width: partial sums of WIDE_CHUNK terms in f32 (their adds `reassoc`, so
    /// LLVM vectorizes them 8 lanes wide), each added to an f64 total, the total rounded once.
    /// A long row summed in f32 lanes drops the terms that are small against its running sum: a
    /// cross-entropy row's 50,257 exponentials put the loss ~1e-6 low, a column of 512
    /// gradients ~1e-4 off; widened element by element, the exponentials ran at half the width.
    #[allow(clippy::too_many_arguments)]
    fn wide_sum(
        &mut self,
        f: &mut FnBuilder<'_, 'ctx>,
        lp: &crate::kir::Loop,
        body: &[Stmt],
        value: &Expr,
        n: IntValue<'ctx>,
    ) -> R<FloatValue<'ctx>> {
        let (it, f32t, f64t) = (n.get_type(), f.f32t(), f.cx.f64_type());
        let total = f.alloca(f64t.into(), 1, "total")?;
        f.b.build_store(total, f64t.const_float(0.0))?;
        let part = f.alloca(f32t.into(), 1, "part")?;
        let chunk = it.const_int(WIDE_CHUNK, false);
        let n1 = f.b.build_int_add(n, it.const_int(WIDE_CHUNK - 1, false), "n1")?;
        let chunks = f.b.build_int_unsigned_div(n1, chunk, "chunks")?;
        f.for_range(it.const_int(0, false), chunks, &mut |f, c| {
            let lo = f.b.build_int_mul(c, chunk, "lo")?;
            let hi = f.b.build_int_add(lo, chunk, "hi")?;
            let last = f.b.build_int_compare(IntPredicate::SLT, n, hi, "last")?;
            let hi = f.b.build_select(last, n, hi, "hi")?.into_int_value();
            f.b.build_store(part, f32t.const_float(0.0))?;
            f.for_range(lo, hi, &mut |f, j| {
                self.ix.insert(Ix::Loop(lp.var), j);
                self.stmts(f, body)?;
                let x = self.typed(f, value, Ty::F32)?.into_float_value();
                let a = f.b.build_load(f32t, part, "a")?.into_float_value();
                let s = f.b.build_float_add(a, x, "sum")?;
                if let Some(ins) = s.as_instruction_value() {
                    ins.set_fast_math_flags(REDUCE_FMF);
                }
                f.b.build_store(part, s)?;
                Ok(())
            })?;
            let p = f.b.build_load(f32t, part, "p")?.into_float_value();
            let p = f.b.build_float_ext(p, f64t, "wide")?;
            let t = f.b.build_load(f64t, total, "t")?.into_float_value();
            f.b.build_store(total, f.b.build_float_add(t, p, "t")?)?;
            Ok(())
        })?;
        let t = f.b.build_load(f64t, total, "t")?.into_float_value();
        Ok(f.b.build_float_trunc(t, f32t, "rounded")?)
    }

    /// Folds positions 0 .. n - n % MAX_LANES of a Max reduction into `acc` with MAX_LANES
    /// independent accumulators; returns where the remainder starts.
    #[allow(clippy::too_many_arguments)]
    fn max_lanes(
        &mut self,
        f: &mut FnBuilder<'_, 'ctx>,
        acc: inkwell::values::PointerValue<'ctx>,
        fty: inkwell::types::FloatType<'ctx>,
        lp: &crate::kir::Loop,
        body: &[Stmt],
        value: &Expr,
        ty: Ty,
        n: IntValue<'ctx>,
    ) -> R<IntValue<'ctx>> {
        let it = n.get_type();
        let lanes = f.alloca(fty.into(), MAX_LANES as u32, "lanes")?;
        for l in 0..MAX_LANES {
            let at = f.gep(fty, lanes, it.const_int(l as u64, false))?;
            f.b.build_store(at, fty.const_float(f64::NEG_INFINITY))?;
        }
        let blocks = f.b.build_int_unsigned_div(n, it.const_int(MAX_LANES as u64, false), "blocks")?;
        let zero = it.const_int(0, false);
        f.for_range(zero, blocks, &mut |f, jb| {
            let base = f.b.build_int_mul(jb, it.const_int(MAX_LANES as u64, false), "j0")?;
            let mut xs = Vec::with_capacity(MAX_LANES);
            for l in 0..MAX_LANES {
                let j = f.b.build_int_add(base, it.const_int(l as u64, false), "j")?;
                self.ix.insert(Ix::Loop(lp.var), j);
                self.stmts(f, body)?;
                xs.push(self.typed(f, value, ty)?.into_float_value());
            }
            for (l, x) in xs.into_iter().enumerate() {
                let at = f.gep(fty, lanes, it.const_int(l as u64, false))?;
                let a = f.b.build_load(fty, at, "lane")?.into_float_value();
                f.b.build_store(at, f.intrinsic("llvm.maxnum", &[a, x])?)?;
            }
            Ok(())
        })?;
        let mut m = f.b.build_load(fty, acc, "a")?.into_float_value();
        for l in 0..MAX_LANES {
            let at = f.gep(fty, lanes, it.const_int(l as u64, false))?;
            let x = f.b.build_load(fty, at, "lane")?.into_float_value();
            m = f.intrinsic("llvm.maxnum", &[m, x])?;
        }
        f.b.build_store(acc, m)?;
        Ok(f.b.build_int_mul(blocks, it.const_int(MAX_LANES as u64, false), "tail")?)
    }

    fn ty(&self, f: &FnBuilder, e: &Expr) -> Ty {
        self.env.ty(f.k, e)
    }

    /// `e` converted to the index type.
    fn index(&mut self, f: &mut FnBuilder<'_, 'ctx>, e: &Expr) -> R<IntValue<'ctx>> {
        let t = f.k.index_ty;
        Ok(self.typed(f, e, t)?.into_int_value())
    }

    /// `e` evaluated and converted to `want`.
    fn typed(&mut self, f: &mut FnBuilder<'_, 'ctx>, e: &Expr, want: Ty) -> R<BasicValueEnum<'ctx>> {
        let (v, t) = self.expr(f, e, Some(want))?;
        convert(f, v, t, want)
    }

    /// The value of `e` and its type; `hint` types integer literals.
    fn expr(&mut self, f: &mut FnBuilder<'_, 'ctx>, e: &Expr, hint: Option<Ty>) -> R<(BasicValueEnum<'ctx>, Ty)> {
        Ok(match e {
            Expr::Float(v, t) => (f.llty(*t).into_float_type().const_float(*v).into(), *t),
            Expr::Int(i) => {
                let t = hint.unwrap_or(f.k.index_ty);
                let v: BasicValueEnum = match t {
                    Ty::F32 | Ty::F64 => f.llty(t).into_float_type().const_float(*i as f64).into(),
                    Ty::Bool => f.cx.bool_type().const_int(u64::from(*i != 0), false).into(),
                    _ => f.llty(t).into_int_type().const_int(*i as u64, true).into(),
                };
                (v, t)
            }
            Expr::Bool(b) => (f.cx.bool_type().const_int(u64::from(*b), false).into(), Ty::Bool),
            Expr::Bin(op @ (BinOp::Rem | BinOp::Div), a, b)
                if **a == Expr::Ix(Ix::Elem) && self.modulus.is_some_and(|m| **b == Expr::Int(m)) =>
            {
                let ix = Ix::Coord(if *op == BinOp::Rem { 1 } else { 0 });
                let v = self.ix.get(&ix).copied().ok_or_else(|| KernelError::Internal(format!("{}: {ix:?} outside its row", f.name)))?;
                (v.into(), f.k.index_ty)
            }
            Expr::Ix(ix) => {
                let v =
                    self.ix.get(ix).copied().ok_or_else(|| KernelError::Internal(format!("{}: {ix:?} used outside its loop", f.name)))?;
                (v.into(), f.k.index_ty)
            }
            Expr::Var(v) => {
                let val = self
                    .vars
                    .get(v)
                    .copied()
                    .ok_or_else(|| KernelError::Internal(format!("{}: v{v} used before its definition", f.name)))?;
                (val, self.ty(f, e))
            }
            Expr::Load { param, index } if **index == Expr::Ix(Ix::Elem) && self.nibbles.contains_key(param) => {
                let v = self
                    .nibbles
                    .get(param)
                    .copied()
                    .ok_or_else(|| KernelError::Internal(format!("{}: no codes for param {param}", f.name)))?;
                (v.into(), self.ty(f, e))
            }
            Expr::Load { param, index } => {
                let i = self.index(f, index)?;
                (f.load(*param, i)?, self.ty(f, e))
            }
            Expr::Un(op, a) => self.unary(f, *op, a, hint)?,
            Expr::Bin(op, a, b) => self.binary(f, *op, a, b, hint)?,
            Expr::Select(c, a, b) => {
                let t = self.meet(f, a, b, hint);
                let cond = self.typed(f, c, Ty::Bool)?.into_int_value();
                if speculatable(a) && speculatable(b) {
                    let (va, vb) = (self.typed(f, a, t)?, self.typed(f, b, t)?);
                    (f.b.build_select(cond, va, vb, "sel")?, t)
                } else {
                    let (yes, no, join_bb) =
                        (f.cx.append_basic_block(f.f, "sel.a"), f.cx.append_basic_block(f.f, "sel.b"), f.cx.append_basic_block(f.f, "sel"));
                    f.b.build_conditional_branch(cond, yes, no)?;
                    f.b.position_at_end(yes);
                    let va = self.typed(f, a, t)?;
                    let end_a = f.b.get_insert_block().ok_or_else(|| KernelError::Internal("no block".into()))?;
                    f.b.build_unconditional_branch(join_bb)?;
                    f.b.position_at_end(no);
                    let vb = self.typed(f, b, t)?;
                    let end_b = f.b.get_insert_block().ok_or_else(|| KernelError::Internal("no block".into()))?;
                    f.b.build_unconditional_branch(join_bb)?;
                    f.b.position_at_end(join_bb);
                    let phi = f.b.build_phi(f.llty(t), "sel")?;
                    phi.add_incoming(&[(&va as &dyn BasicValue, end_a), (&vb as &dyn BasicValue, end_b)]);
                    (phi.as_basic_value(), t)
                }
            }
            Expr::Cast(t, a) => {
                let from = if matches!(**a, Expr::Int(_)) { *t } else { self.ty(f, a) };
                let (v, from) = self.expr(f, a, Some(from))?;
                (cast(f, v, from, *t)?, *t)
            }
            Expr::Call(i, args) => self.call(f, *i, args)?,
        })
    }

    /// The type both operands are computed in.
    fn meet(&self, f: &FnBuilder, a: &Expr, b: &Expr, hint: Option<Ty>) -> Ty {
        match (matches!(a, Expr::Int(_)), matches!(b, Expr::Int(_))) {
            (true, true) => hint.unwrap_or(f.k.index_ty),
            (true, false) => self.ty(f, b),
            (false, true) => self.ty(f, a),
            (false, false) => join(self.ty(f, a), self.ty(f, b)),
        }
    }

    fn unary(&mut self, f: &mut FnBuilder<'_, 'ctx>, op: UnOp, a: &Expr, hint: Option<Ty>) -> R<(BasicValueEnum<'ctx>, Ty)> {
        if op == UnOp::Not {
            let v = self.typed(f, a, Ty::Bool)?.into_int_value();
            return Ok((f.b.build_not(v, "not")?.into(), Ty::Bool));
        }
        let t = if matches!(a, Expr::Int(_)) { hint.unwrap_or(Ty::F32) } else { self.ty(f, a) };
        if !is_float(t) {
            let v = self.typed(f, a, t)?.into_int_value();
            return match op {
                UnOp::Neg => Ok((f.b.build_int_neg(v, "neg")?.into(), t)),
                UnOp::Abs => {
                    let neg = f.b.build_int_neg(v, "neg")?;
                    let lt = f.b.build_int_compare(IntPredicate::SLT, v, v.get_type().const_int(0, false), "lt")?;
                    Ok((f.b.build_select(lt, neg, v, "abs")?, t))
                }
                _ => Err(KernelError::Internal(format!("{}: {op:?} of an integer", f.name))),
            };
        }
        let x = self.typed(f, a, t)?.into_float_value();
        let single = t == Ty::F32;
        let one = x.get_type().const_float(1.0);
        let v: FloatValue = match op {
            UnOp::Neg => f.b.build_float_neg(x, "neg")?,
            UnOp::Exp if single => math::exp_f32(f, x)?,
            UnOp::Exp => f.libm("exp", &[x])?,
            UnOp::Log => f.libm(if single { "logf" } else { "log" }, &[x])?,
            UnOp::Sqrt => f.intrinsic("llvm.sqrt", &[x])?,
            UnOp::Rsqrt => f.b.build_float_div(one, f.intrinsic("llvm.sqrt", &[x])?, "rsqrt")?,
            UnOp::Recip => f.b.build_float_div(one, x, "recip")?,
            UnOp::Tanh if single => math::tanh_f32(f, x)?,
            UnOp::Tanh => f.libm("tanh", &[x])?,
            UnOp::Abs => f.intrinsic("llvm.fabs", &[x])?,
            UnOp::Gelu => math::gelu(f, self.to_f32(f, x)?)?,
            UnOp::RoundEven => f.intrinsic("llvm.roundeven", &[x])?,
            UnOp::Trunc => f.intrinsic("llvm.trunc", &[x])?,
            UnOp::RoundF16 => math::round_f16(f, self.to_f32(f, x)?)?,
            UnOp::RoundBf16 => math::round_bf16(f, self.to_f32(f, x)?)?,
            UnOp::Not => return Err(KernelError::Internal("unreachable".into())),
        };
        let t = if matches!(op, UnOp::Gelu | UnOp::RoundF16 | UnOp::RoundBf16) { Ty::F32 } else { t };
        Ok((v.into(), t))
    }

    fn to_f32(&self, f: &FnBuilder<'_, 'ctx>, x: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
        Ok(if x.get_type() == f.f32t() { x } else { f.b.build_float_trunc(x, f.f32t(), "f")? })
    }

    fn binary(&mut self, f: &mut FnBuilder<'_, 'ctx>, op: BinOp, a: &Expr, b: &Expr, hint: Option<Ty>) -> R<(BasicValueEnum<'ctx>, Ty)> {
        if op == BinOp::And {
            let (x, y) = (self.typed(f, a, Ty::Bool)?.into_int_value(), self.typed(f, b, Ty::Bool)?.into_int_value());
            return Ok((f.b.build_and(x, y, "and")?.into(), Ty::Bool));
        }
        let t = self.meet(f, a, b, if op.is_compare() { None } else { hint });
        let t = if matches!(op, BinOp::GeluGrad) { Ty::F32 } else { t };
        let (x, y) = (self.typed(f, a, t)?, self.typed(f, b, t)?);
        let bld = &f.b;
        if is_float(t) {
            let (x, y) = (x.into_float_value(), y.into_float_value());
            let cmp = |p| -> R<(BasicValueEnum<'ctx>, Ty)> { Ok((bld.build_float_compare(p, x, y, "cmp")?.into(), Ty::Bool)) };
            let v: FloatValue = match op {
                BinOp::Add => bld.build_float_add(x, y, "add")?,
                BinOp::Sub => bld.build_float_sub(x, y, "sub")?,
                BinOp::Mul => bld.build_float_mul(x, y, "mul")?,
                BinOp::Div => bld.build_float_div(x, y, "div")?,
                BinOp::Rem => bld.build_float_rem(x, y, "rem")?,
                BinOp::Max => math::max_min_nan(f, x, y, true)?,
                BinOp::Min => math::max_min_nan(f, x, y, false)?,
                BinOp::GeluGrad => math::gelu_grad(f, x, y)?,
                BinOp::Pow => f.libm(if t == Ty::F32 { "powf" } else { "pow" }, &[x, y])?,
                BinOp::Lt => return cmp(FloatPredicate::OLT),
                BinOp::Le => return cmp(FloatPredicate::OLE),
                BinOp::Eq => return cmp(FloatPredicate::OEQ),
                // C's != is true for NaN
                BinOp::Ne => return cmp(FloatPredicate::UNE),
                BinOp::And => return Err(KernelError::Internal("unreachable".into())),
            };
            Ok((v.into(), t))
        } else {
            let (x, y) = (x.into_int_value(), y.into_int_value());
            let cmp = |p| -> R<(BasicValueEnum<'ctx>, Ty)> { Ok((bld.build_int_compare(p, x, y, "cmp")?.into(), Ty::Bool)) };
            let v: IntValue = match op {
                BinOp::Add => bld.build_int_add(x, y, "add")?,
                BinOp::Sub => bld.build_int_sub(x, y, "sub")?,
                BinOp::Mul => bld.build_int_mul(x, y, "mul")?,
                BinOp::Div => bld.build_int_signed_div(x, y, "div")?,
                BinOp::Rem => bld.build_int_signed_rem(x, y, "rem")?,
                BinOp::Max => bld.build_select(bld.build_int_compare(IntPredicate::SGE, x, y, "ge")?, x, y, "max")?.into_int_value(),
                BinOp::Min => bld.build_select(bld.build_int_compare(IntPredicate::SLE, x, y, "le")?, x, y, "min")?.into_int_value(),
                BinOp::Lt => return cmp(IntPredicate::SLT),
                BinOp::Le => return cmp(IntPredicate::SLE),
                BinOp::Eq => return cmp(IntPredicate::EQ),
                BinOp::Ne => return cmp(IntPredicate::NE),
                BinOp::GeluGrad | BinOp::Pow | BinOp::And => return Err(KernelError::Internal(format!("{}: {op:?} on integers", f.name))),
            };
            Ok((v.into(), t))
        }
    }

    fn call(&mut self, f: &mut FnBuilder<'_, 'ctx>, i: Intrinsic, args: &[Expr]) -> R<(BasicValueEnum<'ctx>, Ty)> {
        let name = f.name.clone();
        let arg = |n: usize| args.get(n).ok_or_else(|| KernelError::Internal(format!("{name}: {i:?} is missing operand {n}")));
        Ok(match i {
            Intrinsic::DropoutKeep { stream } => {
                let seed = self.typed(f, arg(0)?, Ty::I32)?.into_int_value();
                let idx = self.typed(f, arg(1)?, Ty::I64)?.into_int_value();
                let p = self.typed(f, arg(2)?, Ty::F64)?.into_float_value();
                (math::dropout_keep(f, seed, stream, idx, p)?.into(), Ty::Bool)
            }
            Intrinsic::Nf4Value => {
                let c = self.typed(f, arg(0)?, Ty::I32)?.into_int_value();
                (math::nf4_value(f, c)?.into(), Ty::F32)
            }
            Intrinsic::Nf4Nearest => {
                let x = self.typed(f, arg(0)?, Ty::F32)?.into_float_value();
                (math::nf4_nearest(f, x)?.into(), Ty::I32)
            }
            Intrinsic::F16Round => {
                let x = self.typed(f, arg(0)?, Ty::F32)?.into_float_value();
                (math::round_f16(f, x)?.into(), Ty::F32)
            }
            Intrinsic::DynValue(map) => {
                let c = self.typed(f, arg(0)?, Ty::I32)?.into_int_value();
                (math::dyn_value(f, map, c)?.into(), Ty::F32)
            }
            Intrinsic::DynNearest(map) => {
                let y = self.typed(f, arg(0)?, Ty::F32)?.into_float_value();
                (math::dyn_nearest(f, map, y)?.into(), Ty::I32)
            }
        })
    }
}
