//! The data moves of a plan (pack, unpack, bias, zero) as kernel-IR kernels: one elementwise
//! kernel per step, compiled and launched like the program's own kernels (CUDA writer, LLVM,
//! kernel-IR evaluator), so a plan needs nothing but kernels and library calls. Each param is
//! sized to the elements the step touches; the args say which memory each param is.

use std::collections::BTreeMap;

use qatc_ir::DType;

use super::{BlasPlan, BlasStep, ElemType, Mem, Strided};
use crate::index::{self, Bounds};
use crate::kir::{BinOp, Body, Expr, Ix, Kernel, Param, Space, Stmt};
use crate::lower::builder::index_ty_for;

/// One data-move step of a plan as a kernel.
#[derive(Clone, Debug, PartialEq)]
pub struct MoveKernel {
    /// Its index in `BlasPlan::steps`.
    pub step: usize,
    pub kernel: Kernel,
    /// The memory of each param, in order.
    pub args: Vec<Mem>,
}

fn dtype(t: ElemType) -> DType {
    match t {
        ElemType::F32 => DType::F32,
        ElemType::F16 => DType::F16,
        ElemType::BF16 => DType::BF16,
    }
}

/// Elements a param must span to hold every element of the window.
fn span(w: &Strided) -> usize {
    if w.numel() == 0 {
        return 0;
    }
    w.offset + w.shape.iter().zip(&w.strides).map(|(&d, &s)| (d - 1) * s).sum::<usize>() + 1
}

fn param(name: &str, w: &Strided, elems: usize, write: bool) -> Param {
    Param { name: name.into(), dtype: dtype(w.ty), shape: vec![elems], write }
}

/// The index of the current element (of an Elements space over `w.shape`) in `w`'s memory.
fn at(b: &Bounds, w: &Strided) -> Expr {
    let coords: Vec<Expr> = (0..w.shape.len()).map(|d| if w.shape[d] == 1 { Expr::Int(0) } else { Expr::Ix(Ix::Coord(d as u8)) }).collect();
    index::linearize(b, w.offset, &coords, &w.strides)
}

fn kernel(family: &str, note: String, shape: &[usize], params: Vec<Param>, stmts: Vec<Stmt>) -> Kernel {
    let n: usize = shape.iter().product();
    let index_ty = index_ty_for(params.iter().map(|p| p.numel()).chain([n]));
    Kernel {
        family: family.into(),
        params,
        index_ty,
        body: Body::Loops { space: Space::Elements { shape: shape.to_vec() }, stmts },
        note,
        names: BTreeMap::new(),
    }
}

fn bounds(shape: &[usize]) -> Bounds {
    Bounds { elem: shape.iter().product::<usize>() as i64, coords: shape.iter().map(|&d| d as i64).collect(), ..Bounds::default() }
}

/// The kernels of every data-move step of `plan`, in step order.
pub fn move_kernels(plan: &BlasPlan) -> Vec<MoveKernel> {
    let scratch_len = |i: usize| plan.scratch.get(i).map_or(0, |s| s.1);
    plan.steps
        .iter()
        .enumerate()
        .filter_map(|(step, s)| {
            let (kernel, args) = match s {
                BlasStep::Call(_) => return None,
                BlasStep::Pack { from, scratch } => {
                    let b = bounds(&from.shape);
                    let load = Expr::load(0, at(&b, from));
                    let params = vec![param("from", from, span(from), false), param("packed", from, scratch_len(*scratch), true)];
                    let k = kernel(
                        "blas_pack",
                        format!("pack {:?} strides {:?}", from.shape, from.strides),
                        &from.shape,
                        params,
                        vec![Stmt::Store { param: 1, index: Expr::Ix(Ix::Elem), value: load }],
                    );
                    (k, vec![from.mem, Mem::Scratch(*scratch)])
                }
                BlasStep::Unpack { scratch, to } => {
                    let b = bounds(&to.shape);
                    let params = vec![param("packed", to, scratch_len(*scratch), false), param("to", to, span(to), true)];
                    let k = kernel(
                        "blas_unpack",
                        format!("unpack into {:?} strides {:?}", to.shape, to.strides),
                        &to.shape,
                        params,
                        vec![Stmt::Store { param: 1, index: at(&b, to), value: Expr::load(0, Expr::Ix(Ix::Elem)) }],
                    );
                    (k, vec![Mem::Scratch(*scratch), to.mem])
                }
                BlasStep::AddBias { c, bias } => {
                    let b = bounds(&c.shape);
                    let last = c.shape.len().saturating_sub(1) as u8;
                    let j = if c.shape.last().copied().unwrap_or(1) == 1 { Expr::Int(0) } else { Expr::Ix(Ix::Coord(last)) };
                    let bias_at = index::linearize(&b, bias.offset, &[j], &bias.strides);
                    let sum = Expr::bin(BinOp::Add, Expr::load(0, at(&b, c)), Expr::load(1, bias_at));
                    let params = vec![param("c", c, span(c), true), param("bias", bias, span(bias), false)];
                    let k = kernel(
                        "blas_bias",
                        format!("c {:?} += bias", c.shape),
                        &c.shape,
                        params,
                        vec![Stmt::Store { param: 0, index: at(&b, c), value: sum }],
                    );
                    (k, vec![c.mem, bias.mem])
                }
                BlasStep::Zero { c } => {
                    let b = bounds(&c.shape);
                    let params = vec![param("c", c, span(c), true)];
                    let k = kernel(
                        "blas_zero",
                        format!("c {:?} = 0", c.shape),
                        &c.shape,
                        params,
                        vec![Stmt::Store { param: 0, index: at(&b, c), value: Expr::f32(0.0) }],
                    );
                    (k, vec![c.mem])
                }
            };
            Some(MoveKernel { step, kernel, args })
        })
        .collect()
}
