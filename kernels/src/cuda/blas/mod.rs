//! GEMMs through cuBLAS / cuBLASLt: a [`Gemm`](crate::program::Gemm) (row-major views with any
//! strides, batch dims, accumulate, bias) planned as legal column-major library calls
//! ([`plan::plan`]), and a host executor with cuBLAS' exact semantics ([`host`]) that the tests
//! and the GPU emulation (`qatc_runtime::cuda::HostGpu`) run plans on.
//!
//! cuBLAS is column-major: a call computes, for each of `batch` matrices,
//!
//! ```text
//! D (m x n, ldc) = alpha * op(A) (m x k) * op(B) (k x n) + beta * C + bias (length m, every column)
//! ```
//!
//! with stored element (r, c) of A at `offset + r + c * lda + batch_index * stride`, op N or T,
//! `lda >= rows as stored`; beta = 0 means C is not read (NaN there does not propagate); the bias
//! is cuBLASLt's BIAS epilogue. A row-major C [M, N] with unit column stride is the column-major
//! C^T [N, M] with ldc = its row stride, so the row-major product is planned as C^T = B^T A^T
//! (the usual transpose trick). What no call expresses is planned as data moves the plan names:
//! an operand with no unit stride is packed into a contiguous scratch, batch dims whose strides do
//! not nest become a loop of calls, a bias the epilogue cannot take is added by a step of its own.

pub mod host;
pub mod moves;
pub mod plan;

use crate::program::BufId;

pub use moves::{move_kernels, MoveKernel};
pub use plan::{plan, BlasMode};

/// The workspace a CUDA executor gives cuBLAS and cuBLASLt, one allocation for both (cuBLAS
/// recommends 32 MiB on Hopper), so a GEMM captured into a graph allocates nothing.
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// Element types of GEMM operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElemType {
    F32,
    F16,
    BF16,
}

impl ElemType {
    pub fn bytes(self) -> usize {
        match self {
            ElemType::F32 => 4,
            ElemType::F16 | ElemType::BF16 => 2,
        }
    }
}

/// How products are computed: `cublasComputeType_t` and what it means for checking.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Compute {
    /// `CUBLAS_COMPUTE_32F` on fp32 operands: strict IEEE fp32 (no TF32), comparable with the CPU.
    F32,
    /// `CUBLAS_COMPUTE_32F_FAST_TF32`: fp32 operands rounded to TF32 (10-bit mantissa) on the
    /// tensor cores, fp32 accumulate.
    Tf32,
    /// `CUBLAS_COMPUTE_32F` on 16-bit operands (bf16 or f16): tensor cores, fp32 accumulate.
    F32Acc16,
}

/// Where an operand lives: a buffer of the program, or a scratch the plan asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mem {
    Buf(BufId),
    Scratch(usize),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    N,
    T,
}

/// A column-major matrix operand, possibly batched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Matrix {
    pub mem: Mem,
    /// Element offset of matrix 0's element (0, 0).
    pub offset: usize,
    pub ld: usize,
    /// Elements from one batch's matrix to the next (0: the same matrix for every batch).
    pub stride: usize,
    pub ty: ElemType,
}

/// A contiguous bias vector (cuBLASLt's BIAS epilogue).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Vector {
    pub mem: Mem,
    pub offset: usize,
    pub ty: ElemType,
}

/// One library call: `batch` GEMMs (strided-batched when more than one).
#[derive(Clone, Debug, PartialEq)]
pub struct BlasCall {
    pub ta: Op,
    pub tb: Op,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub batch: usize,
    pub alpha: f32,
    /// 0 or 1: whether C is read (accumulate).
    pub beta: f32,
    pub a: Matrix,
    pub b: Matrix,
    pub c: Matrix,
    /// Added to every column of D (length m): needs cuBLASLt.
    pub bias: Option<Vector>,
}

impl BlasCall {
    /// Rows as stored of each operand: A is m x k under op N, k x m under T.
    pub fn stored_rows(&self) -> [usize; 3] {
        let a = if self.ta == Op::N { self.m } else { self.k };
        let b = if self.tb == Op::N { self.k } else { self.n };
        [a, b, self.m]
    }

    pub fn flops(&self) -> usize {
        2 * self.batch * self.m * self.n * self.k
    }
}

/// A strided window on memory, row-major coordinates (as `program::View`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Strided {
    pub mem: Mem,
    pub offset: usize,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
    pub ty: ElemType,
}

impl Strided {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The memory index of row-major element `e` of the window.
    pub fn at(&self, e: usize) -> usize {
        let mut rest = e;
        let mut i = self.offset;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d > 0 {
                i += (rest % d) * s;
                rest /= d;
            }
        }
        i
    }
}

/// One step of a plan, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum BlasStep {
    /// scratch = the window's elements, contiguous in row-major order (an operand no call can
    /// read in place, or a destination's old values).
    Pack {
        from: Strided,
        scratch: usize,
    },
    /// The window's elements = scratch (a destination no call can write in place).
    Unpack {
        scratch: usize,
        to: Strided,
    },
    Call(BlasCall),
    /// `c[.., i, j] += bias[j]` over the whole destination (a bias the epilogue cannot add).
    AddBias {
        c: Strided,
        bias: Strided,
    },
    /// `c = 0` (a GEMM with k = 0 that does not accumulate).
    Zero {
        c: Strided,
    },
}

/// How one [`Gemm`](crate::program::Gemm) runs as library calls and data moves.
#[derive(Clone, Debug, PartialEq)]
pub struct BlasPlan {
    pub steps: Vec<BlasStep>,
    /// Scratch the steps use: (element type, elements), by index.
    pub scratch: Vec<(ElemType, usize)>,
    pub compute: Compute,
    /// What was not a single call, and why (empty for one plain call).
    pub notes: Vec<String>,
}

impl BlasPlan {
    pub fn calls(&self) -> impl Iterator<Item = &BlasCall> {
        self.steps.iter().filter_map(|s| if let BlasStep::Call(c) = s { Some(c) } else { None })
    }

    pub fn scratch_bytes(&self) -> usize {
        self.scratch.iter().map(|(t, n)| t.bytes() * n).sum()
    }

    /// Whether a call needs cuBLASLt (a bias epilogue, a 16-bit or TF32 product).
    pub fn needs_lt(&self) -> bool {
        self.calls().any(|c| c.bias.is_some())
    }

    /// One line: the calls and any data moves.
    pub fn summary(&self) -> String {
        let calls: Vec<&BlasCall> = self.calls().collect();
        let mut s = match calls.as_slice() {
            [] => "no call".to_string(),
            [c] => format!(
                "{:?}{:?} m {} n {} k {}{}{}",
                c.ta,
                c.tb,
                c.m,
                c.n,
                c.k,
                if c.batch > 1 { format!(" x{} strided-batched", c.batch) } else { String::new() },
                if c.bias.is_some() { " + bias epilogue" } else { "" }
            ),
            cs => format!("{} calls of {:?}{:?} m {} n {} k {} x{}", cs.len(), cs[0].ta, cs[0].tb, cs[0].m, cs[0].n, cs[0].k, cs[0].batch),
        };
        for n in &self.notes {
            s.push_str("; ");
            s.push_str(n);
        }
        s
    }
}
