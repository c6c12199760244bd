//! How the kernel IR's types, literals and params are spelled in CUDA C: the pieces every
//! writer of kernel text (`tables`, `loop_nest`, `attention`, `emit`) shares.

use qatc_ir::DType;

use super::writer::Writer;
use crate::kir::{Kernel, Ty};

/// The C type of a buffer element of type `d`.
pub fn c_type(d: DType) -> &'static str {
    match d {
        DType::F32 => "float",
        DType::F16 => "qatc::f16_t",
        DType::BF16 => "qatc::bf16_t",
        DType::I32 => "int",
        DType::U8 | DType::I4 => "unsigned char",
    }
}

/// The C type of a kernel IR scalar.
pub fn scalar(t: Ty) -> &'static str {
    match t {
        Ty::F32 => "float",
        Ty::F64 => "double",
        Ty::I32 => "int",
        Ty::I64 => "long long",
        Ty::Bool => "bool",
    }
}

/// The parameter list: read-only buffers `const T* __restrict__`, shapes in comments.
pub fn params(w: &mut Writer, k: &Kernel) {
    w.indent();
    let n = k.params.len();
    for (i, p) in k.params.iter().enumerate() {
        let cst = if p.write { "" } else { "const " };
        let sep = if i + 1 < n { "," } else { ")" };
        let shape: Vec<String> = p.shape.iter().map(|d| d.to_string()).collect();
        w.line(format!("{cst}{}* __restrict__ {}{sep}  // {}[{}]", c_type(p.dtype), p.name, p.dtype, shape.join(", ")));
    }
    w.dedent();
}

/// A literal that reads back as the same value: the shortest round-trip form, with `f` for f32.
pub fn float_lit(v: f64, t: Ty) -> String {
    let single = t != Ty::F64;
    if v.is_nan() {
        return if single { "__int_as_float(0x7fffffff)".into() } else { "__longlong_as_double(0x7fffffffffffffffll)".into() };
    }
    if v.is_infinite() {
        let s = if single { "INFINITY" } else { "(double)INFINITY" };
        return if v < 0.0 { format!("-{s}") } else { s.into() };
    }
    let mut s = if single { format!("{:?}", v as f32) } else { format!("{v:?}") };
    if !s.contains(['.', 'e', 'E']) {
        s.push_str(".0");
    }
    if single {
        s.push('f');
    }
    s
}
