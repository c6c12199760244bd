//! Scalar helpers with the semantics of `cuda/include/*.cuh` and `runtime/src/quant.rs`, written
//! as LLVM IR: exp, GELU and its gradient, NaN-propagating max/min, f16/bf16 rounding, the
//! dropout hash and NF4.

use inkwell::module::Linkage;
use inkwell::values::{FloatValue, IntValue};
use inkwell::{FloatPredicate, IntPredicate};

use qatc_ir::{DynMap, NF4};

use crate::cephes::{LN2_HI, LN2_LO, POLY};

use super::fb::{FnBuilder, R};

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const GELU_C: f64 = 0.044715;

/// e^x in f32: Cephes' range reduction (x = n ln2 + r, |r| <= ln2/2) and polynomial (`cephes`),
/// scaled by 2^n in two halves so that neither factor leaves the normal range. Within 2 ulp of
/// libm's expf, and unlike a libm call it vectorizes; its multiply-adds fused where the CPU has
/// FMA ([`FnBuilder::mul_add`]). exp(-inf) = 0, exp(+inf) = inf, NaN stays.
pub fn exp_f32<'ctx>(f: &FnBuilder<'_, 'ctx>, x: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
    let b = &f.b;
    let c = |v: f64| f.f32c(v);
    let xc = f.intrinsic("llvm.maxnum", &[x, c(-104.0)])?;
    let xc = f.intrinsic("llvm.minnum", &[xc, c(89.0)])?;
    let n = f.intrinsic("llvm.roundeven", &[b.build_float_mul(xc, c(std::f64::consts::LOG2_E), "t")?])?;
    // n * LN2_HI is exact (`cephes`), so the first step rounds once, fused or not
    let r = f.mul_add(n, c(-f64::from(LN2_HI)), xc)?;
    let r = f.mul_add(n, c(-f64::from(LN2_LO)), r)?;
    let mut p = c(f64::from(POLY[0]));
    for &k in &POLY[1..] {
        p = f.mul_add(p, r, c(f64::from(k)))?;
    }
    let z = b.build_float_mul(r, r, "z")?;
    let y = b.build_float_add(f.mul_add(p, z, r)?, c(1.0), "y")?;
    let i32t = f.cx.i32_type();
    let ni = b.build_float_to_signed_int(n, i32t, "n")?;
    let n1 = b.build_right_shift(ni, i32t.const_int(1, false), true, "n1")?;
    let n2 = b.build_int_sub(ni, n1, "n2")?;
    let pow2 = |e: IntValue<'ctx>| -> R<FloatValue<'ctx>> {
        let bits = b.build_left_shift(b.build_int_add(e, i32t.const_int(127, false), "e")?, i32t.const_int(23, false), "bits")?;
        Ok(b.build_bit_cast(bits, f.f32t(), "pow2")?.into_float_value())
    };
    let y = b.build_float_mul(b.build_float_mul(y, pow2(n1)?, "y")?, pow2(n2)?, "y")?;
    Ok(b.build_select(f.is_nan(x)?, x, y, "exp")?.into_float_value())
}

/// tanh in f32, Cephes' tanhf: an odd polynomial below |x| = 0.625, 1 - 2 / (e^2|x| + 1) above
/// (both computed, one selected, so it vectorizes; within 2 ulp of libm). NaN stays NaN.
pub fn tanh_f32<'ctx>(f: &FnBuilder<'_, 'ctx>, x: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
    let b = &f.b;
    let c = |v: f64| f.f32c(v);
    let ax = f.intrinsic("llvm.fabs", &[x])?;
    let e = exp_f32(f, b.build_float_mul(c(2.0), ax, "2x")?)?;
    let big = b.build_float_sub(c(1.0), b.build_float_div(c(2.0), b.build_float_add(e, c(1.0), "e1")?, "q")?, "t")?;
    let big = f.intrinsic("llvm.copysign", &[big, x])?;
    let z = b.build_float_mul(x, x, "z")?;
    let mut p = c(-5.704_988_727_45e-3);
    for k in [2.063_908_879_54e-2, -5.373_971_555_31e-2, 1.333_144_220_36e-1, -3.333_328_194_22e-1] {
        p = f.mul_add(p, z, c(k))?;
    }
    let small = b.build_float_add(b.build_float_mul(b.build_float_mul(p, z, "pz")?, x, "pzx")?, x, "t")?;
    let is_small = b.build_float_compare(FloatPredicate::OLT, ax, c(0.625), "small")?;
    Ok(b.build_select(is_small, small, big, "tanh")?.into_float_value())
}

/// GPT-2's gelu_new, operation for operation as the interpreter: 0.5 x (1 + tanh(k (x + c x^3))).
pub fn gelu<'ctx>(f: &FnBuilder<'_, 'ctx>, x: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
    let b = &f.b;
    let t = tanh_arg(f, x)?;
    let half_x = b.build_float_mul(f.f32c(0.5), x, "hx")?;
    Ok(b.build_float_mul(half_x, b.build_float_add(f.f32c(1.0), t, "1t")?, "gelu")?)
}

/// tanh(k (x + c x x x)), the factor both GELU and its gradient share.
fn tanh_arg<'ctx>(f: &FnBuilder<'_, 'ctx>, x: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
    let b = &f.b;
    let cube = b.build_float_mul(b.build_float_mul(b.build_float_mul(f.f32c(GELU_C), x, "c")?, x, "c")?, x, "c")?;
    let u = b.build_float_mul(f.f32c(SQRT_2_OVER_PI), b.build_float_add(x, cube, "u")?, "u")?;
    tanh_f32(f, u)
}

/// dy * gelu'(x) = dy (0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 c x^2)).
pub fn gelu_grad<'ctx>(f: &FnBuilder<'_, 'ctx>, x: FloatValue<'ctx>, dy: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
    let b = &f.b;
    let c = |v: f64| f.f32c(v);
    let t = tanh_arg(f, x)?;
    let a = b.build_float_mul(c(0.5), b.build_float_add(c(1.0), t, "a")?, "a")?;
    let one_m = b.build_float_sub(c(1.0), b.build_float_mul(t, t, "tt")?, "omt")?;
    let s = b.build_float_mul(b.build_float_mul(c(0.5), x, "s")?, one_m, "s")?;
    let s = b.build_float_mul(s, c(SQRT_2_OVER_PI), "s")?;
    let poly = b.build_float_mul(b.build_float_mul(c(3.0 * GELU_C as f32 as f64), x, "q")?, x, "q")?;
    let s = b.build_float_mul(s, b.build_float_add(c(1.0), poly, "q")?, "s")?;
    Ok(b.build_float_mul(dy, b.build_float_add(a, s, "d")?, "dgelu")?)
}

/// torch.maximum / torch.minimum: NaN if either is NaN, else the larger (smaller), `a` on ties.
pub fn max_min_nan<'ctx>(f: &FnBuilder<'_, 'ctx>, a: FloatValue<'ctx>, b_: FloatValue<'ctx>, max: bool) -> R<FloatValue<'ctx>> {
    let b = &f.b;
    let pred = if max { FloatPredicate::OGE } else { FloatPredicate::OLE };
    let pick = b.build_select(b.build_float_compare(pred, a, b_, "ge")?, a, b_, "m")?.into_float_value();
    let pick = b.build_select(f.is_nan(b_)?, b_, pick, "m")?.into_float_value();
    Ok(b.build_select(f.is_nan(a)?, a, pick, "m")?.into_float_value())
}

/// x rounded to the nearest f16 (ties to even) and back.
pub fn round_f16<'ctx>(f: &FnBuilder<'_, 'ctx>, x: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
    let h = f.b.build_float_trunc(x, f.cx.f16_type(), "h")?;
    Ok(f.b.build_float_ext(h, f.f32t(), "x")?)
}

/// The bf16 bits of x, rounded to nearest even; NaN stays a quiet NaN.
pub fn f32_to_bf16_bits<'ctx>(f: &FnBuilder<'_, 'ctx>, x: FloatValue<'ctx>) -> R<IntValue<'ctx>> {
    let b = &f.b;
    let i32t = f.cx.i32_type();
    let k = |v: u64| i32t.const_int(v, false);
    let u = b.build_bit_cast(x, i32t, "u")?.into_int_value();
    let nan = b.build_int_compare(inkwell::IntPredicate::UGT, b.build_and(u, k(0x7fff_ffff), "abs")?, k(0x7f80_0000), "nan")?;
    let hi = b.build_right_shift(u, k(16), false, "hi")?;
    let lsb = b.build_and(hi, k(1), "lsb")?;
    let r = b.build_int_add(b.build_int_add(u, k(0x7fff), "r")?, lsb, "r")?;
    let r = b.build_right_shift(r, k(16), false, "r")?;
    let q = b.build_or(hi, k(0x40), "q")?;
    let v = b.build_select(nan, q, r, "bits")?.into_int_value();
    Ok(b.build_int_truncate(v, f.cx.i16_type(), "bf16")?)
}

pub fn round_bf16<'ctx>(f: &FnBuilder<'_, 'ctx>, x: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
    let b = &f.b;
    let i32t = f.cx.i32_type();
    let bits = b.build_int_z_extend(f32_to_bf16_bits(f, x)?, i32t, "w")?;
    let bits = b.build_left_shift(bits, i32t.const_int(16, false), "w")?;
    Ok(b.build_bit_cast(bits, f.f32t(), "x")?.into_float_value())
}

/// `quant::dropout_keep`: splitmix64's finalizer of (seed, stream, i); keep when the top 24 bits
/// as a uniform in [0, 1) are >= p (in f64).
pub fn dropout_keep<'ctx>(
    f: &FnBuilder<'_, 'ctx>,
    seed: IntValue<'ctx>,
    stream: u64,
    i: IntValue<'ctx>,
    p: FloatValue<'ctx>,
) -> R<IntValue<'ctx>> {
    let b = &f.b;
    let i64t = f.cx.i64_type();
    let k = |v: u64| i64t.const_int(v, false);
    let seed = b.build_int_z_extend_or_bit_cast(b.build_int_truncate_or_bit_cast(seed, f.cx.i32_type(), "s")?, i64t, "s")?;
    let i = b.build_int_z_extend_or_bit_cast(i, i64t, "i")?;
    let z = b.build_xor(seed, k(stream.wrapping_mul(0x9E37_79B9_7F4A_7C15)), "z")?;
    let z = b.build_xor(z, b.build_int_mul(i, k(0xD1B5_4A32_D192_ED03), "zi")?, "z")?;
    let mix = |z: IntValue<'ctx>, sh: u64, m: u64| -> R<IntValue<'ctx>> {
        Ok(b.build_int_mul(b.build_xor(z, b.build_right_shift(z, k(sh), false, "z")?, "z")?, k(m), "z")?)
    };
    let z = mix(z, 30, 0xBF58_476D_1CE4_E5B9)?;
    let z = mix(z, 27, 0x94D0_49BB_1331_11EB)?;
    let z = b.build_xor(z, b.build_right_shift(z, k(31), false, "z")?, "z")?;
    let top = b.build_right_shift(z, k(40), false, "top")?;
    let u = b.build_unsigned_int_to_float(top, f.cx.f64_type(), "u")?;
    let u = b.build_float_div(u, f.cx.f64_type().const_float(16_777_216.0), "u")?;
    let p = if p.get_type() == f.cx.f64_type() { p } else { b.build_float_ext(p, f.cx.f64_type(), "p")? };
    Ok(b.build_float_compare(FloatPredicate::OGE, u, p, "keep")?)
}

/// NF4[code & 15], from a constant table in the module.
pub fn nf4_value<'ctx>(f: &FnBuilder<'_, 'ctx>, code: IntValue<'ctx>) -> R<FloatValue<'ctx>> {
    let g = match f.m.get_global("qatc.nf4") {
        Some(g) => g,
        None => {
            let ty = f.f32t().array_type(16);
            let g = f.m.add_global(ty, None, "qatc.nf4");
            let vals: Vec<FloatValue> = NF4.iter().map(|&v| f.f32c(v as f64)).collect();
            g.set_initializer(&f.f32t().const_array(&vals));
            g.set_constant(true);
            g.set_linkage(Linkage::Private);
            g
        }
    };
    let i = f.b.build_and(code, code.get_type().const_int(15, false), "c")?;
    f.load_f32(g.as_pointer_value(), i)
}

/// The map's table as a private constant global of the module (made once).
fn dyn_table<'ctx>(f: &FnBuilder<'_, 'ctx>, map: DynMap) -> inkwell::values::PointerValue<'ctx> {
    let name = format!("qatc.dyn.{}", map.name());
    let g = match f.m.get_global(&name) {
        Some(g) => g,
        None => {
            let g = f.m.add_global(f.f32t().array_type(256), None, &name);
            let vals: Vec<FloatValue> = map.values().iter().map(|&v| f.f32c(f64::from(v))).collect();
            g.set_initializer(&f.f32t().const_array(&vals));
            g.set_constant(true);
            g.set_linkage(Linkage::Private);
            g
        }
    };
    g.as_pointer_value()
}

/// The dynamic map's value of an 8-bit code.
pub fn dyn_value<'ctx>(f: &FnBuilder<'_, 'ctx>, map: DynMap, code: IntValue<'ctx>) -> R<FloatValue<'ctx>> {
    let i = f.b.build_and(code, code.get_type().const_int(255, false), "c")?;
    f.load_f32(dyn_table(f, map), i)
}

/// `DynMap::nearest`: pos = how many map values are below y (a branchless binary search over the
/// 256 sorted values: 8 halvings, then the last one), then the closer of pos - 1 and pos.
pub fn dyn_nearest<'ctx>(f: &FnBuilder<'_, 'ctx>, map: DynMap, y: FloatValue<'ctx>) -> R<IntValue<'ctx>> {
    let b = &f.b;
    let t = dyn_table(f, map);
    let i32t = f.cx.i32_type();
    let c = |v: u64| i32t.const_int(v, false);
    let mut pos = c(0);
    for s in [128u64, 64, 32, 16, 8, 4, 2, 1] {
        let v = f.load_f32(t, b.build_int_add(pos, c(s - 1), "i")?)?;
        let below = b.build_float_compare(FloatPredicate::OLT, v, y, "below")?;
        pos = b.build_select(below, b.build_int_add(pos, c(s), "p")?, pos, "pos")?.into_int_value();
    }
    let below = b.build_float_compare(FloatPredicate::OLT, f.load_f32(t, pos)?, y, "below")?;
    pos = b.build_int_add(pos, b.build_int_z_extend(below, i32t, "b")?, "pos")?;
    // hi = clamp(pos, 1, 255), lo = hi - 1: both loads stay in the table
    let lt1 = b.build_int_compare(IntPredicate::ULT, pos, c(1), "lt1")?;
    let hi = b.build_select(lt1, c(1), pos, "hi")?.into_int_value();
    let gt = b.build_int_compare(IntPredicate::UGT, hi, c(255), "gt")?;
    let hi = b.build_select(gt, c(255), hi, "hi")?.into_int_value();
    let lo = b.build_int_sub(hi, c(1), "lo")?;
    let d_hi = f.intrinsic("llvm.fabs", &[b.build_float_sub(f.load_f32(t, hi)?, y, "d")?])?;
    let d_lo = f.intrinsic("llvm.fabs", &[b.build_float_sub(y, f.load_f32(t, lo)?, "d")?])?;
    let closer = b.build_float_compare(FloatPredicate::OLT, d_hi, d_lo, "closer")?;
    let code = b.build_select(closer, hi, lo, "code")?.into_int_value();
    let none_below = b.build_int_compare(IntPredicate::EQ, pos, c(0), "none")?;
    let code = b.build_select(none_below, c(0), code, "code")?.into_int_value();
    let all_below = b.build_int_compare(IntPredicate::EQ, pos, c(256), "all")?;
    Ok(b.build_select(all_below, c(255), code, "code")?.into_int_value())
}

/// The nearest NF4 code to x, the first on ties (a chain of 15 compares, as `quant`'s scan).
pub fn nf4_nearest<'ctx>(f: &FnBuilder<'_, 'ctx>, x: FloatValue<'ctx>) -> R<IntValue<'ctx>> {
    let b = &f.b;
    let i32t = f.cx.i32_type();
    let dist = |v: FloatValue<'ctx>| -> R<FloatValue<'ctx>> { f.intrinsic("llvm.fabs", &[b.build_float_sub(x, v, "d")?]) };
    let mut best = i32t.const_int(0, false);
    let mut best_v = f.f32c(NF4[0] as f64);
    for (k, &v) in NF4.iter().enumerate().skip(1) {
        let vk = f.f32c(v as f64);
        let closer = b.build_float_compare(FloatPredicate::OLT, dist(vk)?, dist(best_v)?, "closer")?;
        best = b.build_select(closer, i32t.const_int(k as u64, false), best, "best")?.into_int_value();
        best_v = b.build_select(closer, vk, best_v, "bv")?.into_float_value();
    }
    Ok(best)
}
