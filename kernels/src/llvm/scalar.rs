//! Scalar types in emitted LLVM IR: the type two operands meet in, C's implicit conversions, the
//! kernel IR's saturating float-to-integer cast, and which expressions may be evaluated on both
//! arms of a select. Shared by the loop kernels (`loops.rs`).

use inkwell::values::BasicValueEnum;
use inkwell::{FloatPredicate, IntPredicate};

use super::fb::{FnBuilder, R};
use crate::error::KernelError;
use crate::kir::{BinOp, Expr, Ty, UnOp};

pub(super) fn is_float(t: Ty) -> bool {
    matches!(t, Ty::F32 | Ty::F64)
}

/// The type two operands meet in: C's conversions, except that two bools stay a bool (an i1
/// select, not an int).
pub(super) fn join(a: Ty, b: Ty) -> Ty {
    match (a, b) {
        (Ty::Bool, Ty::Bool) => Ty::Bool,
        _ => Ty::common(a, b),
    }
}

/// Cheap and unable to fault: both arms of a select may be evaluated.
pub(super) fn speculatable(e: &Expr) -> bool {
    let mut ok = true;
    e.visit(&mut |x| {
        if matches!(x, Expr::Load { .. } | Expr::Call(..) | Expr::Bin(BinOp::Rem, ..) | Expr::Un(UnOp::Tanh | UnOp::Gelu, _)) {
            ok = false;
        }
        if let Expr::Bin(BinOp::Div | BinOp::GeluGrad | BinOp::Pow, ..) = x {
            ok = false;
        }
    });
    ok
}

/// Implicit conversion between operand types (C's usual conversions).
pub(super) fn convert<'ctx>(f: &FnBuilder<'_, 'ctx>, v: BasicValueEnum<'ctx>, from: Ty, to: Ty) -> R<BasicValueEnum<'ctx>> {
    if from == to {
        return Ok(v);
    }
    let b = &f.b;
    Ok(match (from, to) {
        (Ty::Bool, Ty::I32 | Ty::I64) => b.build_int_z_extend(v.into_int_value(), f.llty(to).into_int_type(), "z")?.into(),
        (Ty::Bool, Ty::F32 | Ty::F64) => b.build_unsigned_int_to_float(v.into_int_value(), f.llty(to).into_float_type(), "f")?.into(),
        (Ty::I32 | Ty::I64, Ty::Bool) => {
            let x = v.into_int_value();
            b.build_int_compare(IntPredicate::NE, x, x.get_type().const_int(0, false), "nz")?.into()
        }
        (Ty::F32 | Ty::F64, Ty::Bool) => {
            let x = v.into_float_value();
            b.build_float_compare(FloatPredicate::UNE, x, x.get_type().const_float(0.0), "nz")?.into()
        }
        (Ty::I32, Ty::I64) => b.build_int_s_extend(v.into_int_value(), f.cx.i64_type(), "s")?.into(),
        (Ty::I64, Ty::I32) => b.build_int_truncate(v.into_int_value(), f.cx.i32_type(), "t")?.into(),
        (Ty::I32 | Ty::I64, Ty::F32 | Ty::F64) => {
            b.build_signed_int_to_float(v.into_int_value(), f.llty(to).into_float_type(), "f")?.into()
        }
        (Ty::F32, Ty::F64) => b.build_float_ext(v.into_float_value(), f.cx.f64_type(), "d")?.into(),
        (Ty::F64, Ty::F32) => b.build_float_trunc(v.into_float_value(), f.f32t(), "f")?.into(),
        (Ty::F32 | Ty::F64, Ty::I32 | Ty::I64) => cast(f, v, from, to)?,
        _ => v,
    })
}

/// `Expr::Cast`: float to integer truncates toward zero, saturates at the target's range, and
/// maps NaN to 0, from the float's own width (the CUDA backend's `__double2ll_rz` and kin);
/// everything else as [`convert`].
pub(super) fn cast<'ctx>(f: &FnBuilder<'_, 'ctx>, v: BasicValueEnum<'ctx>, from: Ty, to: Ty) -> R<BasicValueEnum<'ctx>> {
    match (from, to) {
        (Ty::F32 | Ty::F64, Ty::I32 | Ty::I64) => {
            let x = v.into_float_value();
            let it = f.llty(to).into_int_type();
            let fty = x.get_type();
            let name =
                format!("llvm.fptosi.sat.{}.{}", if to == Ty::I64 { "i64" } else { "i32" }, if from == Ty::F64 { "f64" } else { "f32" });
            let decl = inkwell::intrinsics::Intrinsic::find("llvm.fptosi.sat")
                .and_then(|i| i.get_declaration(f.m, &[it.into(), fty.into()]))
                .ok_or_else(|| KernelError::Internal(format!("no intrinsic {name}")))?;
            f.call(decl, &[x.into()], &name)
        }
        _ => convert(f, v, from, to),
    }
}
