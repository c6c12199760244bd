//! The outer space of a `Body::Loops` kernel on the CPU: the counted loop over `start..end`
//! (elements or rows), laid out so that LLVM vectorizes the body. Elements with coordinates go
//! row by row; a flat space indexed `i % C` goes as rows of C; packed 4-bit codes loaded at the
//! element index are unpacked a block at a time. The statements inside are `loops.rs`'s.

use std::collections::HashMap;

use inkwell::values::IntValue;
use inkwell::IntPredicate;

use super::fb::{FnBuilder, R};
use super::loops::Scope;
use crate::kir::{BinOp, Expr, Ix, Space, Stmt, TypeEnv};

pub fn emit(f: &mut FnBuilder, space: &Space, stmts: &[Stmt]) -> R<()> {
    let it = f.index_ty();
    let start = f.b.build_int_truncate_or_bit_cast(f.start, it, "start")?;
    let end = f.b.build_int_truncate_or_bit_cast(f.end, it, "end")?;
    let mut em = Scope { env: TypeEnv::of(stmts), ix: HashMap::new(), vars: HashMap::new(), nibbles: HashMap::new(), modulus: None };
    // a flat space indexed `i % C` (a broadcast over rows of C: a bias read by a kernel whose
    // result is reshaped flat) runs as rows of C, `i % C` and `i / C` read off the row loop
    let modulus = match space {
        Space::Elements { shape } => row_modulus(shape, stmts),
        Space::Rows { .. } => None,
    };
    let shape_of_rows;
    let space = match (space, modulus) {
        (Space::Elements { shape }, Some(m)) => {
            em.modulus = Some(m);
            shape_of_rows = Space::Elements { shape: vec![shape[0] / m as usize, m as usize] };
            &shape_of_rows
        }
        _ => space,
    };
    match space {
        Space::Elements { shape } if modulus.is_some() || (0..shape.len()).any(|d| f.k.uses_ix(Ix::Coord(d as u8))) => {
            // Coordinates by division are not affine in the element index, and LLVM vectorizes
            // such a loop only within one row. So: a loop over the rows the range touches, the
            // leading coordinates computed once per row, and inside it a loop over the row's
            // elements where the last coordinate is the element index minus the row's start.
            let last = shape.len() - 1;
            let d_len = shape[last].max(1) as u64;
            let strides = crate::index::strides(shape);
            let c = |v: u64| it.const_int(v, false);
            let r0 = f.b.build_int_unsigned_div(start, c(d_len), "r0")?;
            let end_m1 = f.b.build_int_sub(end, c(1), "e1")?;
            let r1 = f.b.build_int_add(f.b.build_int_unsigned_div(end_m1, c(d_len), "r1")?, c(1), "r1")?;
            // an empty range (end - 1 would wrap) visits no row
            let r1 = f.b.build_select(f.b.build_int_compare(IntPredicate::SLT, start, end, "any")?, r1, r0, "r1")?.into_int_value();
            f.for_range(r0, r1, &mut |f, r| {
                let base = f.b.build_int_mul(r, c(d_len), "row0")?;
                let lo =
                    f.b.build_select(f.b.build_int_compare(IntPredicate::SGT, start, base, "gt")?, start, base, "lo")?.into_int_value();
                let next = f.b.build_int_add(base, c(d_len), "row1")?;
                let hi = f.b.build_select(f.b.build_int_compare(IntPredicate::SLT, end, next, "lt")?, end, next, "hi")?.into_int_value();
                for (d, (&dim, &st)) in shape.iter().zip(&strides).enumerate().take(last) {
                    if modulus.is_some() || f.k.uses_ix(Ix::Coord(d as u8)) {
                        // element stride st = row stride (st / d_len) rows
                        let mut cd = f.b.build_int_unsigned_div(r, c((st as u64 / d_len).max(1)), "c")?;
                        if d != 0 {
                            cd = f.b.build_int_unsigned_rem(cd, c(dim as u64), "c")?;
                        }
                        em.ix.insert(Ix::Coord(d as u8), cd);
                    }
                }
                em.elements(f, lo, hi, Some((base, last)), stmts)
            })
        }
        Space::Elements { .. } => em.elements(f, start, end, None, stmts),
        Space::Rows { .. } => f.for_range(start, end, &mut |f, idx| {
            em.ix.insert(Ix::Row, idx);
            em.stmts(f, stmts)
        }),
    }
}

/// C where a flat Elements space of n elements is indexed `Elem % C` (and maybe `Elem / C`) for
/// one C that divides n, at least 8 (a row LLVM vectorizes), and no coordinates: the kernel
/// then runs as n / C rows of C. Element by element, `i % C` makes every load it indexes a
/// gather (a bias broadcast over a flattened GELU: 16 scalar loads per vector).
fn row_modulus(shape: &[usize], stmts: &[Stmt]) -> Option<i64> {
    let [n] = *shape else { return None };
    let (mut found, mut other) = (None::<i64>, false);
    crate::kir::visit_exprs(stmts, &mut |e| match e {
        Expr::Ix(Ix::Coord(_)) => other = true,
        Expr::Bin(BinOp::Rem | BinOp::Div, a, b) if **a == Expr::Ix(Ix::Elem) => match **b {
            Expr::Int(c) if found.is_none_or(|m| m == c) => found = Some(c),
            _ => other = true,
        },
        _ => {}
    });
    found.filter(|&c| !other && c >= 8 && n % c as usize == 0)
}

/// The packed 4-bit params the kernel loads at its own element index (`Ix::Elem`).
fn i4_at_elem(f: &FnBuilder, stmts: &[Stmt]) -> Vec<usize> {
    let mut ps = Vec::new();
    crate::kir::visit_exprs(stmts, &mut |e| {
        if let Expr::Load { param, index } = e {
            if **index == Expr::Ix(Ix::Elem) && f.k.params.get(*param).is_some_and(|p| p.dtype == qatc_ir::DType::I4) && !ps.contains(param)
            {
                ps.push(*param);
            }
        }
    });
    ps
}

/// Elements per block of unpacked 4-bit codes (`Scope::elements`): a stack buffer of this many
/// bytes per packed param, small enough to stay in L1 between its writes and reads.
const UNPACK: u64 = 512;

impl<'ctx> Scope<'ctx> {
    /// Elements lo..hi of an Elements space (`row`: the row's first element and the last dim,
    /// when coordinates are in use). A kernel that loads packed 4-bit codes at its own element
    /// index unpacks them a block at a time (`UNPACK`). Element by element, LLVM sees the byte
    /// index i / 2 as a gather and loads bytes one at a time (a 4-bit weight dequantized at 2-3
    /// ns per element). Two elements an iteration (one byte load for both, as this did before)
    /// made every other access of the body an interleaved one, split and merged by shuffles
    /// (about 0.35 ns per element on a 2-vCPU Zen 5, a tenth of a bf16 step).
    fn elements(
        &mut self,
        f: &mut FnBuilder<'_, 'ctx>,
        lo: IntValue<'ctx>,
        hi: IntValue<'ctx>,
        row: Option<(IntValue<'ctx>, usize)>,
        stmts: &[Stmt],
    ) -> R<()> {
        let one = |em: &mut Self, f: &mut FnBuilder<'_, 'ctx>, idx: IntValue<'ctx>| -> R<()> {
            em.ix.insert(Ix::Elem, idx);
            if let Some((base, last)) = row {
                em.ix.insert(Ix::Coord(last as u8), f.b.build_int_sub(idx, base, "cl")?);
            }
            em.stmts(f, stmts)
        };
        let packed = i4_at_elem(f, stmts);
        if packed.is_empty() {
            return f.for_range(lo, hi, &mut |f, idx| one(self, f, idx));
        }
        let it = lo.get_type();
        let c = |v: u64| it.const_int(v, false);
        // [lo, lo2) one element when lo is odd; pairs [lo2, hi2); [max(lo2, hi2), hi) the last
        let lo2 = f.b.build_and(f.b.build_int_add(lo, c(1), "lo1")?, c(!1u64), "lo2")?;
        let hi2 = f.b.build_and(hi, c(!1u64), "hi2")?;
        let head_end = f.b.build_select(f.b.build_int_compare(IntPredicate::SLT, lo2, hi, "lt")?, lo2, hi, "he")?.into_int_value();
        f.for_range(lo, head_end, &mut |f, idx| one(self, f, idx))?;
        // blocks of UNPACK elements: every code of the block unpacked into a stack buffer per
        // packed param first (one byte load for two codes), then the block's elements one by
        // one, each reading its code from the buffer: a contiguous i8 load, so the element loop
        // vectorizes like any other (see UNPACK)
        let i8t = f.cx.i8_type();
        let bufs = packed.iter().map(|_| f.alloca(i8t.into(), UNPACK as u32, "codes")).collect::<R<Vec<_>>>()?;
        let span = f.b.build_int_sub(hi2, lo2, "span")?;
        let span = f.b.build_select(f.b.build_int_compare(IntPredicate::SGT, span, c(0), "pos")?, span, c(0), "span")?.into_int_value();
        let blocks = f.b.build_int_unsigned_div(f.b.build_int_add(span, c(UNPACK - 1), "sp")?, c(UNPACK), "blocks")?;
        f.for_range(c(0), blocks, &mut |f, blk| {
            let e0 = f.b.build_int_add(lo2, f.b.build_int_mul(blk, c(UNPACK), "off")?, "e0")?;
            let e1 = f.b.build_int_add(e0, c(UNPACK), "e1")?;
            let e1 = f.b.build_select(f.b.build_int_compare(IntPredicate::SLT, e1, hi2, "lt")?, e1, hi2, "e1")?.into_int_value();
            let (p0, p1) = (f.b.build_right_shift(e0, c(1), false, "p0")?, f.b.build_right_shift(e1, c(1), false, "p1")?);
            f.for_range(p0, p1, &mut |f, p| {
                let j = f.b.build_int_sub(p, p0, "j")?;
                let j = f.b.build_int_add(j, j, "j2")?;
                for (&q, &buf) in packed.iter().zip(&bufs) {
                    let byte = f.b.build_load(i8t, f.gep(i8t, f.param(q)?, p)?, "pair")?.into_int_value();
                    let low = f.b.build_and(byte, i8t.const_int(15, false), "lo")?;
                    let high = f.b.build_right_shift(byte, i8t.const_int(4, false), false, "hi")?;
                    f.b.build_store(f.gep(i8t, buf, j)?, low)?;
                    f.b.build_store(f.gep(i8t, buf, f.b.build_int_add(j, c(1), "j1")?)?, high)?;
                }
                Ok(())
            })?;
            f.for_range(e0, e1, &mut |f, idx| {
                let j = f.b.build_int_sub(idx, e0, "j")?;
                for (&q, &buf) in packed.iter().zip(&bufs) {
                    let code = f.b.build_load(i8t, f.gep(i8t, buf, j)?, "code")?.into_int_value();
                    self.nibbles.insert(q, f.b.build_int_z_extend(code, f.cx.i32_type(), "code")?);
                }
                one(self, f, idx)
            })?;
            self.nibbles.clear();
            Ok(())
        })?;
        let tail = f.b.build_select(f.b.build_int_compare(IntPredicate::SGT, hi2, lo2, "gt")?, hi2, lo2, "tl")?.into_int_value();
        let tail = f.b.build_select(f.b.build_int_compare(IntPredicate::SGT, tail, lo, "gt")?, tail, lo, "tl")?.into_int_value();
        f.for_range(tail, hi, &mut |f, idx| one(self, f, idx))
    }
}
