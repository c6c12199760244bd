//! Kernel IR -> CUDA C. One `extern "C" __global__` function per kernel, named by
//! `Kernel::name` (`fused_{family}_{hash8}`, from the kernel's identity): identical kernels get
//! identical names.
//!
//! Mapping: an Elements space is one thread per element (`idx`, coordinates `i0, i1, ..` where
//! used); a Rows space with `RowMapping::Block` is one block per row whose threads stride over the
//! row, reductions ending in `qatc::block_sum` / `block_max` (or, for rows of up to
//! `WARP_ROW_MAX` where the `warp-rows` variant is allowed, one warp per row, `WARP_ROWS` rows per
//! block, reductions by `qatc::warp_sum` / `warp_max`: no shared memory, no block barrier);
//! `RowMapping::Thread` is one thread per row with plain loops.
//!
//! `launch.rs` says how each space is launched; `loop_nest.rs` writes a loop nest's body.

use std::collections::BTreeSet;
use std::sync::OnceLock;

use super::attention;
use super::codegen::{split_columns, warp_rows, SPLIT_SLICES, WARP_ROWS};
use super::launch::check_grid;
use super::loop_nest::LoopNestWriter;
use super::stmts::has_reduce;
use super::syntax::params;
use super::tables::{tables_header, TABLES_HEADER};
use super::writer::Writer;
use crate::error::KernelError;
use crate::kir::{visit_exprs, BinOp, Body, Expr, Intrinsic, Kernel, RowMapping, Space, UnOp};
use crate::target::CudaSettings;

// where callers find a kernel's launch, beside its text (`launch.rs` computes it)
pub use super::launch::{launch_dims, launch_dims_with, LaunchDims, BLOCK};

/// A kernel as CUDA C, ready for NVRTC.
#[derive(Clone, Debug, PartialEq)]
pub struct CudaKernel {
    pub name: String,
    pub family: String,
    pub source: String,
    pub launch: LaunchDims,
}

/// The helper headers: (file name, text). Generated sources include them by name. All are
/// files embedded from `include/` but `qatc_tables.cuh`, which `tables.rs` writes from the IR's
/// constants (`qatc_quant.cuh` includes it).
pub fn headers() -> &'static [(&'static str, &'static str)] {
    static HEADERS: OnceLock<[(&str, &str); 7]> = OnceLock::new();
    HEADERS.get_or_init(|| {
        [
            ("qatc_common.cuh", include_str!("include/qatc_common.cuh")),
            ("qatc_math.cuh", include_str!("include/qatc_math.cuh")),
            ("qatc_reduce.cuh", include_str!("include/qatc_reduce.cuh")),
            (TABLES_HEADER, tables_header()),
            ("qatc_quant.cuh", include_str!("include/qatc_quant.cuh")),
            ("qatc_attention.cuh", include_str!("include/qatc_attention.cuh")),
            ("qatc_attention_mma.cuh", include_str!("include/qatc_attention_mma.cuh")),
        ]
    })
}

/// `k` as CUDA C, with the default variants (`CudaSettings::default`).
pub fn emit(k: &Kernel) -> Result<CudaKernel, KernelError> {
    emit_with(k, &CudaSettings::default())
}

/// `k` as CUDA C, with the variants `cg` allows where they apply.
pub fn emit_with(k: &Kernel, cg: &CudaSettings) -> Result<CudaKernel, KernelError> {
    let name = k.name();
    let launch = launch_dims_with(k, cg);
    check_grid(k, &launch)?;
    let source = render(k, &name, cg)?;
    Ok(CudaKernel { name, family: k.family.clone(), source, launch })
}

fn render(k: &Kernel, name: &str, cg: &CudaSettings) -> Result<String, KernelError> {
    let mut w = Writer::new();
    let dims = launch_dims_with(k, cg);
    let warp = warp_rows(k, cg);
    let split = split_columns(k, cg);
    w.line(format!("// {}: {}", k.family, k.note));
    match &k.body {
        Body::Loops { space, .. } => match space {
            Space::Elements { shape } => w.line(format!("// one thread per element of {shape:?}")),
            Space::Rows { rows, mapping: RowMapping::Block } if warp => {
                w.line(format!("// {rows} rows, one warp per row, {WARP_ROWS} rows per block"))
            }
            Space::Rows { rows, mapping: RowMapping::Block } => {
                w.line(format!("// {rows} rows, one block of {} threads per row", dims.block))
            }
            Space::Rows { rows, mapping: RowMapping::Thread } if split => w.line(format!(
                "// {rows} rows, 32 per block, each row's sums split over {SPLIT_SLICES} warps, the parts added in warp order"
            )),
            Space::Rows { rows, mapping: RowMapping::Thread } => w.line(format!("// {rows} rows, one thread per row")),
        },
        Body::Attention(_) => {}
    }
    w.line("#include \"qatc_common.cuh\"");
    let needs = headers_needed(k, cg);
    for h in needs {
        w.line(format!("#include \"{h}\""));
    }
    w.blank();
    match &k.body {
        Body::Loops { space, stmts } => {
            w.line(format!("extern \"C\" __global__ void __launch_bounds__({}) {name}(", dims.block));
            params(&mut w, k);
            w.open("");
            LoopNestWriter::new(k, stmts, warp, split).kernel(&mut w, space, stmts)?;
            w.close();
        }
        Body::Attention(a) => attention::render(&mut w, k, a, name, dims.block, cg),
    }
    let text = w.finish();
    if text.contains('\0') {
        return Err(KernelError::Internal(format!("{name}: generated source contains a NUL byte")));
    }
    Ok(text)
}

fn headers_needed(k: &Kernel, cg: &CudaSettings) -> BTreeSet<&'static str> {
    let mut h = BTreeSet::new();
    match &k.body {
        Body::Attention(a) => {
            h.insert("qatc_attention.cuh");
            if attention::tensor_cores(a, cg).is_some() {
                h.insert("qatc_attention_mma.cuh");
            }
        }
        Body::Loops { stmts, space } => {
            visit_exprs(stmts, &mut |e| match e {
                Expr::Un(UnOp::Gelu, _) | Expr::Bin(BinOp::GeluGrad, ..) => {
                    h.insert("qatc_math.cuh");
                }
                Expr::Call(
                    Intrinsic::DropoutKeep { .. }
                    | Intrinsic::Nf4Value
                    | Intrinsic::Nf4Nearest
                    | Intrinsic::DynValue(_)
                    | Intrinsic::DynNearest(_),
                    _,
                ) => {
                    h.insert("qatc_quant.cuh");
                }
                _ => {}
            });
            if matches!(space, Space::Rows { mapping: RowMapping::Block, .. }) && has_reduce(stmts) {
                h.insert("qatc_reduce.cuh");
            }
        }
    }
    h
}
