//! The planner: one [`Gemm`] -> a [`BlasPlan`] of legal cuBLAS(Lt) calls.
//!
//! 1. The destination picks the problem's orientation: a row-major C (unit column stride) is the
//!    column-major C^T, so the calls compute C^T = B^T A^T (m = N, n = M); a column-major C is
//!    computed as is. A C that is neither is computed into a contiguous scratch and unpacked.
//! 2. Each operand is read in place as op N or op T of a column-major matrix when one of its two
//!    strides is 1 and the other is a legal leading dimension (>= the rows as stored); else it
//!    is packed into a contiguous scratch first.
//! 3. Batch dims: inner batch dims over which B is shared and A and C continue row by row fold
//!    into M (one bigger GEMM); the innermost dims whose strides nest (each the next one's stride
//!    times its size, in all three operands) become one strided-batched call; the dims outside
//!    those are a loop of calls.
//! 4. The bias is cuBLASLt's BIAS epilogue when it runs along the rows of the column-major D (the
//!    row-major orientation, a contiguous bias), the call is one matrix, the bias has D's type and
//!    a 16-byte aligned address; else a step of its own adds it.

use qatc_ir::DType;

use super::{BlasCall, BlasPlan, BlasStep, Compute, ElemType, Matrix, Mem, Op, Strided, Vector};
use crate::error::KernelError;
use crate::program::{Buffer, Gemm, View};

/// The product's precision for fp32 operands (16-bit operands always accumulate in fp32).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum BlasMode {
    /// Strict IEEE fp32, checkable against the CPU.
    #[default]
    Strict,
    /// TF32 tensor cores (`CUBLAS_COMPUTE_32F_FAST_TF32`).
    Tf32,
}

impl BlasMode {
    /// The mode a target's settings ask for (`--tf32`).
    pub fn of(settings: &crate::target::CudaSettings) -> BlasMode {
        if settings.tf32 {
            BlasMode::Tf32
        } else {
            BlasMode::Strict
        }
    }
}

fn elem_type(d: DType) -> Option<ElemType> {
    match d {
        DType::F32 => Some(ElemType::F32),
        DType::F16 => Some(ElemType::F16),
        DType::BF16 => Some(ElemType::BF16),
        _ => None,
    }
}

/// How a column-major matrix of p x q, element (i, j) at `i * si + j * sj`, is read in place:
/// (op, ld) such that op(stored) is it, or None.
pub fn layout(p: usize, q: usize, si: usize, sj: usize) -> Option<(Op, usize)> {
    // op N: stored p x q, (i, j) at i + j * ld
    if (p <= 1 || si == 1) && (q <= 1 || sj >= p.max(1)) {
        return Some((Op::N, if q <= 1 { p.max(1) } else { sj }));
    }
    // op T: stored q x p, (j, i) at j + i * ld
    if (q <= 1 || sj == 1) && (p <= 1 || si >= q.max(1)) {
        return Some((Op::T, if p <= 1 { q.max(1) } else { si }));
    }
    None
}

/// The orientation of the column-major problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Orient {
    /// C row-major: D = C^T = B^T A^T.
    Transposed,
    /// C column-major: D = C = A B.
    Direct,
}

struct Planner {
    steps: Vec<BlasStep>,
    scratch: Vec<(ElemType, usize)>,
    notes: Vec<String>,
}

fn strided(v: &View, ty: ElemType) -> Strided {
    Strided { mem: Mem::Buf(v.buf), offset: v.offset, shape: v.shape.clone(), strides: v.strides.clone(), ty }
}

/// A contiguous window of `shape` at the start of scratch `i`.
fn contiguous(i: usize, shape: &[usize], ty: ElemType) -> Strided {
    Strided { mem: Mem::Scratch(i), offset: 0, shape: shape.to_vec(), strides: crate::index::strides(shape), ty }
}

/// The last two strides (row, column) of a matrix window.
fn mat_strides(s: &Strided) -> (usize, usize) {
    let r = s.strides.len();
    (s.strides[r - 2], s.strides[r - 1])
}

impl Planner {
    fn new_scratch(&mut self, ty: ElemType, elems: usize) -> usize {
        self.scratch.push((ty, elems));
        self.scratch.len() - 1
    }

    /// `x` as it can be read: in place, or packed into a contiguous scratch.
    fn readable(&mut self, x: Strided, p: usize, q: usize, transposed: bool, what: &str) -> Strided {
        let (sr, sc) = mat_strides(&x);
        let (si, sj) = if transposed { (sc, sr) } else { (sr, sc) };
        if layout(p, q, si, sj).is_some() {
            return x;
        }
        let i = self.new_scratch(x.ty, x.numel());
        self.notes.push(format!("{what} packed (strides {:?}: no unit stride, or a leading dimension below the rows)", x.strides));
        let packed = contiguous(i, &x.shape, x.ty);
        self.steps.push(BlasStep::Pack { from: x, scratch: i });
        packed
    }
}

/// The element types of a GEMM's a, b (the same), c and bias.
struct Types {
    a: ElemType,
    b: ElemType,
    c: ElemType,
    bias: Option<ElemType>,
}

/// The element types of `g`'s operands, its shapes checked against m, n, k.
fn checked_types(g: &Gemm, buffers: &[Buffer]) -> Result<Types, KernelError> {
    let bad = |why: String| KernelError::Unsupported { node: format!("GEMM {}", g.note), why };
    let ty = |v: &View, what: &str| -> Result<ElemType, KernelError> {
        let b = buffers.get(v.buf).ok_or_else(|| bad(format!("{what} is buffer {} of {}", v.buf, buffers.len())))?;
        elem_type(b.dtype).ok_or_else(|| bad(format!("{what} is {}, not a float type cuBLAS multiplies", b.dtype)))
    };
    let (ta, tb, tc) = (ty(&g.a, "a")?, ty(&g.b, "b")?, ty(&g.c, "c")?);
    let r = g.c.shape.len();
    let (m, n, k) = (g.m, g.n, g.k);
    let shapes_ok = r >= 2
        && g.a.shape.len() == r
        && g.b.shape.len() == r
        && g.a.shape[..r - 2] == g.c.shape[..r - 2]
        && g.b.shape[..r - 2] == g.c.shape[..r - 2]
        && g.a.shape[r - 2..] == [m, k]
        && g.b.shape[r - 2..] == [k, n]
        && g.c.shape[r - 2..] == [m, n]
        && g.bias.as_ref().is_none_or(|b| b.shape == [n]);
    if !shapes_ok {
        return Err(bad(format!(
            "shapes a {:?}, b {:?}, c {:?}, bias {:?} are not [.., {m}, {k}] x [.., {k}, {n}] -> [.., {m}, {n}] (+ [{n}])",
            g.a.shape,
            g.b.shape,
            g.c.shape,
            g.bias.as_ref().map(|b| &b.shape)
        )));
    }
    if ta != tb {
        return Err(bad(format!("operands of two types ({ta:?}, {tb:?})")));
    }
    let bias_ty = g.bias.as_ref().map(|b| ty(b, "bias")).transpose()?;
    Ok(Types { a: ta, b: tb, c: tc, bias: bias_ty })
}

/// Plans `g` over the program's `buffers` (for the element types).
pub fn plan(g: &Gemm, buffers: &[Buffer], mode: BlasMode) -> Result<BlasPlan, KernelError> {
    let Types { a: ta, b: tb, c: tc, bias: bias_ty } = checked_types(g, buffers)?;
    let (m, n, k) = (g.m, g.n, g.k);
    let compute = match (ta, mode) {
        (ElemType::F32, BlasMode::Strict) => Compute::F32,
        (ElemType::F32, BlasMode::Tf32) => Compute::Tf32,
        _ => Compute::F32Acc16,
    };
    let mut pl = Planner { steps: Vec::new(), scratch: Vec::new(), notes: Vec::new() };
    let c_view = strided(&g.c, tc);
    let bias = g.bias.as_ref().zip(bias_ty).map(|(b, t)| strided(b, t));
    if m == 0 || n == 0 {
        return Ok(BlasPlan { steps: Vec::new(), scratch: Vec::new(), compute, notes: vec!["an empty product".into()] });
    }
    if k == 0 {
        // no product to compute: C keeps its value (accumulate) or becomes 0, then the bias
        if !g.accumulate {
            pl.steps.push(BlasStep::Zero { c: c_view.clone() });
        }
        if let Some(b) = bias {
            pl.steps.push(BlasStep::AddBias { c: c_view, bias: b });
        }
        pl.notes.push("k = 0".into());
        return Ok(BlasPlan { steps: pl.steps, scratch: pl.scratch, compute, notes: pl.notes });
    }
    let (orient, c_out) = pl.orient(g, &c_view);
    // 2. the operands, read in place or packed
    let tr = orient == Orient::Transposed;
    let a = pl.readable(strided(&g.a, ta), if tr { k } else { m }, if tr { m } else { k }, tr, "a");
    let b = pl.readable(strided(&g.b, tb), if tr { n } else { k }, if tr { k } else { n }, tr, "b");
    let batches = pl.batches(g, &a, &b, &c_out)?;
    let epilogue = pl.calls(g, orient, [&a, &b, &c_out], &batches, bias.as_ref())?;
    if let Mem::Scratch(i) = c_out.mem {
        pl.steps.push(BlasStep::Unpack { scratch: i, to: c_view.clone() });
    }
    if let (Some(b), None) = (bias, epilogue) {
        pl.notes.push("bias added by a step of its own (no cuBLASLt BIAS epilogue: not along the rows of the column-major result, a batch, another type than C or an address not 16-byte aligned)".into());
        pl.steps.push(BlasStep::AddBias { c: c_view, bias: b });
    }
    Ok(BlasPlan { steps: pl.steps, scratch: pl.scratch, compute, notes: pl.notes })
}

/// The batch dims of a planned product (step 3): M after folding, the dims looped over (size,
/// strides of a, b, c) and the strided batch inside them (its count and strides).
struct Batches {
    mm: usize,
    outer: Vec<(usize, [usize; 3])>,
    batch: usize,
    bstride: [usize; 3],
}

impl Planner {
    /// 1. The orientation, from the destination, and where C is computed (in place, or in a
    ///    scratch unpacked after).
    fn orient(&mut self, g: &Gemm, c_view: &Strided) -> (Orient, Strided) {
        let (m, n) = (g.m, g.n);
        let (csr, csc) = mat_strides(c_view);
        if layout(n, m, csc, csr).is_some_and(|(op, _)| op == Op::N) {
            return (Orient::Transposed, c_view.clone());
        }
        if layout(m, n, csr, csc).is_some_and(|(op, _)| op == Op::N) {
            return (Orient::Direct, c_view.clone());
        }
        let i = self.new_scratch(c_view.ty, c_view.numel());
        self.notes.push(format!("c computed in a scratch and unpacked (strides {:?})", c_view.strides));
        if g.accumulate {
            self.steps.push(BlasStep::Pack { from: c_view.clone(), scratch: i });
        }
        (Orient::Transposed, contiguous(i, &c_view.shape, c_view.ty))
    }

    /// 3. Batch dims: fold, nest, loop.
    fn batches(&mut self, g: &Gemm, a: &Strided, b: &Strided, c_out: &Strided) -> Result<Batches, KernelError> {
        let (m, r) = (g.m, g.c.shape.len());
        let mut dims: Vec<(usize, [usize; 3])> =
            (0..r - 2).filter(|&d| c_out.shape[d] != 1).map(|d| (c_out.shape[d], [a.strides[d], b.strides[d], c_out.strides[d]])).collect();
        if dims.iter().any(|d| d.1[2] == 0) {
            let why = format!("its destination repeats along a batch dim (strides {:?})", g.c.strides);
            return Err(KernelError::Unsupported { node: format!("GEMM {}", g.note), why });
        }
        let (asr, _) = mat_strides(a);
        let (osr, _) = mat_strides(c_out);
        let mut mm = m;
        while let Some(&(size, [sa, sb, sc])) = dims.last() {
            if m > 1 && sb == 0 && sa == mm * asr && sc == mm * osr {
                mm *= size;
                dims.pop();
            } else {
                break;
            }
        }
        if mm != m {
            self.notes.push(format!("batch folded into M ({m} -> {mm}): b is shared"));
        }
        // the innermost dims whose strides nest are one strided batch: dims[nested..]
        let mut nested = dims.len().saturating_sub(1);
        while nested > 0 {
            let ((size, s), (_, t)) = (dims[nested], dims[nested - 1]);
            if (0..3).all(|x| t[x] == s[x] * size) {
                nested -= 1;
            } else {
                break;
            }
        }
        let outer: Vec<(usize, [usize; 3])> = dims[..nested].to_vec();
        let inner: Vec<(usize, [usize; 3])> = dims[nested..].to_vec();
        let batch: usize = inner.iter().map(|d| d.0).product();
        let bstride = inner.last().map_or([0; 3], |d| d.1);
        if !outer.is_empty() {
            let loops: usize = outer.iter().map(|d| d.0).product();
            self.notes.push(format!("a loop of {loops} calls: batch dims {:?} do not nest", outer.iter().map(|d| d.0).collect::<Vec<_>>()));
        }
        Ok(Batches { mm, outer, batch, bstride })
    }

    /// 4. The calls, one per outer batch index; returns the bias where cuBLASLt's epilogue adds
    ///    it.
    fn calls(
        &mut self,
        g: &Gemm,
        orient: Orient,
        [a, b, c_out]: [&Strided; 3],
        bt: &Batches,
        bias: Option<&Strided>,
    ) -> Result<Option<Vector>, KernelError> {
        let (n, k) = (g.n, g.k);
        let tr = orient == Orient::Transposed;
        let (asr, asc) = mat_strides(a);
        let (bsr, bsc) = mat_strides(b);
        let (osr, osc) = mat_strides(c_out);
        let (pm, pn) = if tr { (n, bt.mm) } else { (bt.mm, n) };
        let internal = |what: &str| KernelError::Internal(format!("GEMM {}: {what} has no layout after planning", g.note));
        // column-major (row, column) strides of the call's A, B and C
        let (sa, sb, so) = if tr { ((bsc, bsr), (asc, asr), (osc, osr)) } else { ((asr, asc), (bsr, bsc), (osr, osc)) };
        let (opa, lda) = layout(pm, k, sa.0, sa.1).ok_or_else(|| internal("operand A"))?;
        let (opb, ldb) = layout(k, pn, sb.0, sb.1).ok_or_else(|| internal("operand B"))?;
        let (opc, ldc) = layout(pm, pn, so.0, so.1).ok_or_else(|| internal("the destination"))?;
        if opc != Op::N {
            return Err(internal("the destination (transposed)"));
        }
        let (xa, xb) = if tr { (b, a) } else { (a, b) };
        let (sxa, sxb) = if tr { (bt.bstride[1], bt.bstride[0]) } else { (bt.bstride[0], bt.bstride[1]) };
        // cuBLASLt's BIAS epilogue only where every algorithm takes it: one matrix (no batch), the
        // bias of C's type, its pointer 16-byte aligned (buffers start 256-aligned); else the step
        // of its own, which costs a launch, never a failed call
        let epilogue = match (bias, orient) {
            (Some(v), Orient::Transposed)
                if v.strides.first().is_none_or(|&s| s == 1 || n == 1)
                    && bt.batch == 1
                    && v.ty == c_out.ty
                    && (v.offset * v.ty.bytes()) % 16 == 0 =>
            {
                Some(Vector { mem: v.mem, offset: v.offset, ty: v.ty })
            }
            _ => None,
        };
        let loops: usize = bt.outer.iter().map(|d| d.0).product();
        for l in 0..loops {
            // the outer batch index l, row-major over the outer dims
            let mut rest = l;
            let mut off = [0usize; 3];
            for &(size, s) in bt.outer.iter().rev() {
                let i = rest % size;
                rest /= size;
                for x in 0..3 {
                    off[x] += i * s[x];
                }
            }
            let (oxa, oxb) = if tr { (off[1], off[0]) } else { (off[0], off[1]) };
            self.steps.push(BlasStep::Call(BlasCall {
                ta: opa,
                tb: opb,
                m: pm,
                n: pn,
                k,
                batch: bt.batch,
                alpha: g.alpha as f32,
                beta: if g.accumulate { 1.0 } else { 0.0 },
                a: Matrix { mem: xa.mem, offset: xa.offset + oxa, ld: lda, stride: sxa, ty: xa.ty },
                b: Matrix { mem: xb.mem, offset: xb.offset + oxb, ld: ldb, stride: sxb, ty: xb.ty },
                c: Matrix { mem: c_out.mem, offset: c_out.offset + off[2], ld: ldc, stride: bt.bstride[2], ty: c_out.ty },
                bias: epilogue,
            }));
        }
        Ok(epilogue)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_of_row_and_column_major_matrices() {
        // a 3 x 4 column-major matrix with ld 5
        assert_eq!(layout(3, 4, 1, 5), Some((Op::N, 5)));
        // its transpose stored row-major: (i, j) at i * 5 + j
        assert_eq!(layout(3, 4, 5, 1), Some((Op::T, 5)));
        // a leading dimension below the rows is illegal, a broadcast (stride 0) too
        assert_eq!(layout(3, 4, 1, 2), None);
        assert_eq!(layout(3, 4, 0, 1), None);
        // neither stride 1
        assert_eq!(layout(3, 4, 2, 8), None);
        // vectors: the other stride does not matter, ld is at least 1
        assert_eq!(layout(1, 4, 7, 1), Some((Op::N, 1)));
        assert_eq!(layout(3, 1, 1, 0), Some((Op::N, 3)));
        assert_eq!(layout(1, 1, 0, 0), Some((Op::N, 1)));
    }
}
