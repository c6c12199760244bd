//! The attention kernels: a specialization of the tiled templates in `qatc_attention.cuh` to one
//! shape and layout (sizes, scale and strides become constants the compiler folds). Where the
//! operands' values are 16-bit and the target's `CudaSettings` allow it, the forward, delta, dq and dk/dv
//! kernels are `qatc_attention_mma.cuh`'s tensor-core templates instead (same params, grid and
//! block), with the fp32 template kept for architectures before sm_80. Either reads and writes
//! each view in its param's element type (`qatc::AttnElems`, from the params' dtypes).

use qatc_ir::DType;

use super::codegen::Variant;
use super::launch::{attention_dims, BQ};
use super::syntax::{float_lit, params};
use super::writer::Writer;
use crate::kir::{Attention, AttentionPart, Kernel, Ty};
use crate::target::CudaSettings;

/// The 16-bit operand type (`qatc::MmaBf16` / `qatc::MmaF16`) of the tensor-core variant of
/// `a`, where `cg` allows it and it applies: every part (the forward; the backward's lse, delta,
/// dq, dk/dv and dv), f16/bf16 values, hs 32, 48 or 64 (the tiles' shared
/// memory), and 64 threads per block (the templates' two warps).
pub fn tensor_cores(a: &Attention, cg: &CudaSettings) -> Option<&'static str> {
    let part = match a.part {
        AttentionPart::Forward => cg.allows(Variant::TensorCoreAttention),
        AttentionPart::Lse
        | AttentionPart::BackwardDelta
        | AttentionPart::BackwardQ
        | AttentionPart::BackwardKV
        | AttentionPart::BackwardV => cg.allows(Variant::TensorCoreAttentionBackward),
        AttentionPart::Backward => false,
    };
    let applies = part && a.hs.is_multiple_of(16) && (32..=64).contains(&a.hs) && BQ == 64;
    match a.values {
        DType::BF16 if applies => Some("qatc::MmaBf16"),
        DType::F16 if applies => Some("qatc::MmaF16"),
        _ => None,
    }
}

/// Key rows per shared-memory tile (query rows per block, `BQ`, are the launch's).
const BK: u32 = 32;

pub fn render(w: &mut Writer, k: &Kernel, a: &Attention, name: &str, block: u32, cg: &CudaSettings) {
    let (what, func) = match a.part {
        AttentionPart::Forward => ("forward: out = softmax(scale q k^T, causal) v, and the row log-sum-exp", "attention_forward"),
        AttentionPart::BackwardDelta => ("backward, delta_i = sum_j P_ij (dout_i . v_j)", "attention_backward_delta"),
        AttentionPart::BackwardQ => ("backward, dq = dS k", "attention_backward_q"),
        AttentionPart::BackwardKV => ("backward, dk = dS^T q and dv = P^T dout", "attention_backward_kv"),
        AttentionPart::Lse => ("statistics: the row log-sum-exp of scale q k^T", "attention_lse"),
        AttentionPart::BackwardV => ("backward, dv = P^T dout", "attention_backward_v"),
        AttentionPart::Backward => ("backward, dq, dk and dv in one pass", "attention_backward"),
    };
    if a.part == AttentionPart::Backward {
        // lowered for the CPU only (`LowerOptions::attention_one_backward`): a clear compile
        // error rather than a call to a template that does not exist
        w.line(format!("#error \"{name}: the one-pass attention backward is lowered for the CPU only\""));
        return;
    }
    let dims = attention_dims(a);
    w.line(format!("// causal attention {what}"));
    w.line(format!(
        "// B {}, NH {}, T {}, hs {}: grid ({}, {}), {} threads per block",
        a.b, a.nh, a.t, a.hs, dims.grid[0], dims.grid[1], block
    ));
    w.line(format!("extern \"C\" __global__ void __launch_bounds__({block}) {name}("));
    params(w, k);
    w.open("");
    if a.b * a.nh * a.t == 0 {
        // the grid still has a block (CUDA launches none with zero), which must touch nothing
        w.line("// no rows: nothing to compute");
        w.close();
        return;
    }
    w.line(format!("const qatc::AttnShape shape = {{{}, {}, {}}};  // NH, T, scale", a.nh, a.t, float_lit(a.scale, Ty::F32)));
    // first the element types (`E`, below), as a tag the templates deduce them from
    let mut args = vec!["E()".to_string(), "shape".to_string()];
    let views = a.part.roles().views();
    for (i, p) in k.params.iter().enumerate() {
        args.push(p.name.clone());
        if views.contains(&i) {
            let [sb, sh, st] = a.strides.get(i).copied().unwrap_or([0, 0, 0]);
            let off = a.offsets.get(i).copied().unwrap_or(0);
            w.line(format!("const qatc::AttnView {}_at = {{{off}, {sb}, {sh}, {st}}};  // offset, strides of b, h, t", p.name));
            args.push(format!("{}_at", p.name));
        }
    }
    w.line(format!("typedef {} E;  // element types: q, k, v, dout, out | dq | dk, dv", elems(k, a)));
    // <hs, rows per block, rows per shared tile>
    let tiles = format!("{}, {BQ}, {BK}", a.hs);
    let general = format!("qatc::{func}<{tiles}>({});", args.join(", "));
    match tensor_cores(a, cg) {
        Some(h) => {
            // the mma needs sm_80; NVRTC defines __CUDA_ARCH__ for the architecture it compiles for
            w.line("#if __CUDA_ARCH__ >= 800");
            w.line(format!("qatc::{func}_mma<{}, {h}>({});  // tensor cores, 16-bit operands", a.hs, args.join(", ")));
            w.line("#else");
            w.line(general);
            w.line("#endif");
        }
        None => w.line(general),
    }
    w.close();
}

/// The `qatc::Elem*` tag of a view param's element type. Only float types reach here (an attention
/// kernel's views hold f32 or the 16-bit compute type); any other would be declared as its own C
/// type and rejected by the compiler against the tag's `float`.
fn elem(d: DType) -> &'static str {
    match d {
        DType::F16 => "qatc::ElemF16",
        DType::BF16 => "qatc::ElemBf16",
        _ => "qatc::ElemF32",
    }
}

/// `qatc::AttnElems<...>` of kernel `k`: its views' element types by role (q, k, v, dout, the
/// first output, the second), `ElemF32` for a role its part lacks.
fn elems(k: &Kernel, a: &Attention) -> String {
    let r = a.part.roles();
    let of = |p: Option<usize>| p.and_then(|i| k.params.get(i)).map_or("qatc::ElemF32", |p| elem(p.dtype));
    let tags = [of(Some(r.q)), of(Some(r.k)), of(r.v), of(r.dout), of(r.out[0]), of(r.out[1])];
    format!("qatc::AttnElems<{}>", tags.join(", "))
}
