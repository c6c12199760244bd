//! The kernel IR: a backend-neutral description of one generated kernel, and of the program a
//! graph lowers to (kernel launches, library GEMMs, views).
//!
//! A generic kernel is an index space plus a body of statements over scalar expressions:
//!
//! - [`Space::Elements`]: one logical iteration per element of a shape (row-major). `Ix::Elem`
//!   is the linear element index, `Ix::Coord(d)` its coordinate along dim d.
//! - [`Space::Rows`]: one logical program per row. Inside, [`Stmt::ForEach`] visits every
//!   position of the row (iterations independent) and [`Stmt::Reduce`] folds over it; `Ix::Row`
//!   is the row, `Ix::Loop(l)` the position of loop `l`. [`RowMapping`] is a tiling hint: CUDA
//!   maps `Block` to one thread block per row (threads stride over the row, reductions are tree
//!   reductions in shared memory) and `Thread` to one thread per row (sequential loops: strided
//!   "rows" such as weight columns stay coalesced across threads). A CPU backend may ignore it.
//!
//! Semantics every backend must keep (they are what the interpreter computes):
//! - Float arithmetic is f32 unless an expression is typed `F64`; loads of f16/bf16 widen to f32
//!   and stores round to the buffer's type (round to nearest even); loads of i4/u8/i32 give i32
//!   (i4 is packed: element e is the low nibble of byte e/2 when e is even, else the high nibble).
//! - Integer index arithmetic is in the kernel's `index_ty` (I32 or I64); operands are
//!   non-negative and `Div`/`Rem` truncate.
//! - `Select` is lazy: only the chosen operand is evaluated (the other may load out of bounds).
//! - `Reduce` folds in any association order the backend likes, except `FirstAbsMax`, which needs
//!   the sequential order and therefore only appears in `RowMapping::Thread` kernels. A `Sum` may
//!   be integer (I32/I64: counts), any op may be float; the order a backend picks must be fixed
//!   by the kernel and its sizes alone, so a kernel gives the same bits on every run.
//! - Nothing is nondeterministic: `AtomicAdd` exists for integer params only (integer addition
//!   associates, so the total is the same in any order); float sums over data-dependent sets
//!   are sorted into a fixed order instead (`lower/scatter.rs`).
//! - No FMA contraction is required or forbidden: NVRTC contracts by default (`--fmad=true`).

use qatc_ir::{DType, DynMap};

mod fnv;
pub mod key;
pub use fnv::{fnv1a64, Fnv1a64};
pub use key::{ExprKey, MemoKey, PosKey};

/// The type of a scalar expression.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Ty {
    F32,
    F64,
    I32,
    I64,
    Bool,
}

impl Ty {
    /// C's usual arithmetic conversions, which the backends follow for mixed operands:
    /// double > float > long long > int (bool counts as int).
    pub fn common(a: Ty, b: Ty) -> Ty {
        match (a, b) {
            (Ty::F64, _) | (_, Ty::F64) => Ty::F64,
            (Ty::F32, _) | (_, Ty::F32) => Ty::F32,
            (Ty::I64, _) | (_, Ty::I64) => Ty::I64,
            _ => Ty::I32,
        }
    }
}

/// A kernel parameter: a device buffer of `dtype` elements (its graph shape, for comments and
/// bounds; the kernel addresses it by linear element index).
#[derive(Clone, Debug, PartialEq)]
pub struct Param {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// The kernel writes it (else it only reads it).
    pub write: bool,
}

impl Param {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

pub type ParamId = usize;
pub type VarId = u32;

/// Index variables, defined by the space and the loops around an expression.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Ix {
    Elem,
    Coord(u8),
    Row,
    Loop(u8),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnOp {
    Neg,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Recip,
    Tanh,
    Abs,
    /// GPT-2's gelu_new (tanh form).
    Gelu,
    /// Round half to even (`torch.round`, CUDA `rintf`).
    RoundEven,
    /// Toward zero (C casts, Q4_0's quantizer).
    Trunc,
    Not,
    /// Round an f32 to the nearest f16 / bf16 value and back (an f16 node inside a fused body).
    RoundF16,
    RoundBf16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinOp {
    Add,
    Sub,
    Mul,
    Div,
    /// Integer remainder (index arithmetic only).
    Rem,
    /// NaN-propagating, as torch.maximum and the interpreter.
    Max,
    Min,
    /// (x, dy) -> dy * gelu'(x).
    GeluGrad,
    /// f64 power (AdamW's bias corrections).
    Pow,
    Lt,
    Le,
    Eq,
    Ne,
    And,
}

impl BinOp {
    pub fn is_compare(self) -> bool {
        matches!(self, BinOp::Lt | BinOp::Le | BinOp::Eq | BinOp::Ne)
    }
}

/// Calls with semantics defined once in `runtime/src/quant.rs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Intrinsic {
    /// (seed i32, element index, p f64) -> bool: `quant::dropout_keep` with this stream.
    DropoutKeep { stream: u64 },
    /// (code i32) -> f32: the NF4 code value.
    Nf4Value,
    /// (x f32) -> i32: the nearest NF4 code, the first on ties.
    Nf4Nearest,
    /// (x f32) -> f32: x rounded to f16 and back (Q4_0 stores its scale as f16).
    F16Round,
    /// (code i32) -> f32: the dynamic map's value of an 8-bit code (`qatc_ir::qmap`).
    DynValue(DynMap),
    /// (y f32) -> i32: `DynMap::nearest`, the code of the map value nearest to y (the lower on a
    /// tie; 0 for NaN): a binary search of the sorted map, then the closer neighbour.
    DynNearest(DynMap),
}

#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    /// A float constant, typed F32 or F64.
    Float(f64, Ty),
    /// An integer constant; it takes the type of the integer it is combined with (the index type
    /// on its own).
    Int(i64),
    Bool(bool),
    Ix(Ix),
    Var(VarId),
    /// Element `index` of a parameter (see the module docs for the widening rules).
    Load {
        param: ParamId,
        index: Box<Expr>,
    },
    Un(UnOp, Box<Expr>),
    Bin(BinOp, Box<Expr>, Box<Expr>),
    /// cond ? a : b, lazily.
    Select(Box<Expr>, Box<Expr>, Box<Expr>),
    /// Conversion. Float to integer truncates toward zero, saturates at the type's range and
    /// maps NaN to 0 (the interpreter's `to_code`); i32 to i64 sign-extends.
    Cast(Ty, Box<Expr>),
    Call(Intrinsic, Vec<Expr>),
}

impl Expr {
    pub fn f32(v: f64) -> Expr {
        Expr::Float(v, Ty::F32)
    }
    pub fn un(op: UnOp, a: Expr) -> Expr {
        Expr::Un(op, Box::new(a))
    }
    pub fn bin(op: BinOp, a: Expr, b: Expr) -> Expr {
        Expr::Bin(op, Box::new(a), Box::new(b))
    }
    pub fn select(c: Expr, a: Expr, b: Expr) -> Expr {
        Expr::Select(Box::new(c), Box::new(a), Box::new(b))
    }
    pub fn cast(ty: Ty, a: Expr) -> Expr {
        Expr::Cast(ty, Box::new(a))
    }
    pub fn load(param: ParamId, index: Expr) -> Expr {
        Expr::Load { param, index: Box::new(index) }
    }

    /// Calls `f` on each direct operand of this expression, in order (rewrites recurse with it).
    pub fn for_each_child_mut(&mut self, mut f: impl FnMut(&mut Expr)) {
        match self {
            Expr::Float(..) | Expr::Int(_) | Expr::Bool(_) | Expr::Ix(_) | Expr::Var(_) => {}
            Expr::Load { index, .. } => f(index),
            Expr::Un(_, a) | Expr::Cast(_, a) => f(a),
            Expr::Bin(_, a, b) => {
                f(a);
                f(b);
            }
            Expr::Select(c, a, b) => {
                f(c);
                f(a);
                f(b);
            }
            Expr::Call(_, args) => args.iter_mut().for_each(f),
        }
    }

    /// Visits this expression and every sub-expression, parents first.
    pub fn visit(&self, f: &mut impl FnMut(&Expr)) {
        f(self);
        match self {
            Expr::Float(..) | Expr::Int(_) | Expr::Bool(_) | Expr::Ix(_) | Expr::Var(_) => {}
            Expr::Load { index, .. } => index.visit(f),
            Expr::Un(_, a) | Expr::Cast(_, a) => a.visit(f),
            Expr::Bin(_, a, b) => {
                a.visit(f);
                b.visit(f);
            }
            Expr::Select(c, a, b) => {
                c.visit(f);
                a.visit(f);
                b.visit(f);
            }
            Expr::Call(_, args) => args.iter().for_each(|a| a.visit(f)),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    /// Maximum that ignores NaN (`fmaxf`, and the interpreter's `if x > max` scans).
    Max,
    /// The signed value of the first element of largest magnitude (Q4_0's `m`).
    FirstAbsMax,
}

/// A loop over a row: `Ix::Loop(var)` runs over `0..extent`; `extent` may depend on `Ix::Row`
/// (a causal row) and is at most `max`.
#[derive(Clone, Debug, PartialEq)]
pub struct Loop {
    pub var: u8,
    pub extent: Expr,
    pub max: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Stmt {
    /// An immutable scalar, visible to the statements after it in the same block.
    Let { var: VarId, ty: Ty, value: Expr },
    /// param[index] = value (rounded to the param's dtype).
    Store { param: ParamId, index: Expr, value: Expr },
    /// param[index] += value, atomically, into an I32 param: counts whose total does not depend
    /// on the order the iterations arrive in (scatter_add's tokens per id). In a Block-mapped
    /// row outside a shared loop, one thread of the block adds (as one thread stores).
    AtomicAdd { param: ParamId, index: Expr, value: Expr },
    /// var = fold(op, value for every position of the loop); `body` binds what `value` uses.
    Reduce { var: VarId, op: ReduceOp, ty: Ty, lp: Loop, body: Vec<Stmt>, value: Expr },
    /// Runs `body` for every position of the loop, in any order.
    ForEach { lp: Loop, body: Vec<Stmt> },
}

/// How the rows of a `Rows` space map to hardware: a hint, not semantics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowMapping {
    Block,
    Thread,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Space {
    Elements { shape: Vec<usize> },
    Rows { rows: usize, mapping: RowMapping },
}

/// Causal attention over [B, NH, T, hs] operands given as strided views (hs contiguous), softmax
/// scale `scale`. Never materialises the T x T scores: the forward keeps a running max and sum per
/// query row (online softmax), the backward recomputes the probabilities from the saved
/// log-sum-exp.
#[derive(Clone, Debug, PartialEq)]
pub struct Attention {
    pub b: usize,
    pub nh: usize,
    pub t: usize,
    pub hs: usize,
    pub scale: f64,
    /// Element strides of (b, h, t) for q, k, v, and the output / gradient views, in param order.
    pub strides: Vec<[usize; 3]>,
    /// Element offsets of each view into its buffer, in param order.
    pub offsets: Vec<usize>,
    pub part: AttentionPart,
    /// The type of the graph values the operands hold: `F32`, or the f16/bf16 compute type
    /// (`--precision`), held in their buffers either as that type
    /// (`LowerOptions::attention_reads_stored`, every target's: the kernel widens at the load) or
    /// widened exactly into f32 copies by the lowering (the option off). The semantics are the f32 ones either way; a
    /// 16-bit type tells a backend that rounding the operands to it loses nothing, so it may
    /// multiply them on 16-bit tensor cores (`cuda/attention.rs`).
    pub values: DType,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttentionPart {
    /// (q, k, v) -> out, lse: out = softmax(scale q k^T, causal) v, lse the per-row log-sum-exp.
    Forward,
    /// (q, k, v, dout, lse) -> delta: delta_i = sum_j P_ij (dout_i . v_j) = dout_i . out_i.
    BackwardDelta,
    /// (q, k, v, dout, lse, delta) -> dq.
    BackwardQ,
    /// (q, k, v, dout, lse, delta) -> dk, dv (one key block per program: no atomics).
    BackwardKV,
    /// (q, k) -> lse, for a backward whose forward output was not kept.
    Lse,
    /// (q, k, dout, lse) -> dv = P^T dout.
    BackwardV,
    /// (q, k, v, dout, lse, delta) -> dq, dk, dv: the three gradients from one pass over the
    /// probabilities, where a backend computes them blockwise (the CPU's attention GEMMs:
    /// `LowerOptions::attention_one_backward`). A row program computes query row r's dq and key
    /// row r's dk and dv, as `BackwardQ` and `BackwardKV` do.
    Backward,
}

/// Which param of an attention kernel plays which part: the order every backend and the
/// lowering agree on (`lower/attention.rs` launches them so; `cuda/attention.rs` names them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionRoles {
    pub q: usize,
    pub k: usize,
    pub v: Option<usize>,
    pub dout: Option<usize>,
    pub lse: usize,
    pub delta: Option<usize>,
    /// out | dq | dk, then dv for `BackwardKV`; dq, dk, dv for `Backward`.
    pub out: [Option<usize>; 3],
}

impl AttentionRoles {
    /// The params that are [B, NH, T, hs] views, in param order (the others are the
    /// [B*NH, T] rows of lse and delta).
    pub fn views(&self) -> Vec<usize> {
        let mut v = vec![self.q, self.k];
        v.extend(self.v.into_iter().chain(self.dout).chain(self.out.into_iter().flatten()));
        v.sort_unstable();
        v
    }

    /// How many params the kernel takes.
    pub fn count(&self) -> usize {
        let all = [Some(self.q), Some(self.k), self.v, self.dout, Some(self.lse), self.delta, self.out[0], self.out[1], self.out[2]];
        all.into_iter().flatten().max().map_or(0, |m| m + 1)
    }
}

impl AttentionPart {
    /// Whether the kernel writes the row log-sum-exp (the forward, and `Lse`) rather than
    /// reading it.
    pub fn writes_lse(self) -> bool {
        matches!(self, AttentionPart::Forward | AttentionPart::Lse)
    }

    /// Whether the kernel writes delta (`BackwardDelta`) rather than reading it.
    pub fn writes_delta(self) -> bool {
        self == AttentionPart::BackwardDelta
    }

    pub fn roles(self) -> AttentionRoles {
        let r = |v, dout, lse, delta, out| AttentionRoles { q: 0, k: 1, v, dout, lse, delta, out };
        match self {
            AttentionPart::Forward => r(Some(2), None, 4, None, [Some(3), None, None]),
            AttentionPart::BackwardDelta => r(Some(2), Some(3), 4, Some(5), [None, None, None]),
            AttentionPart::BackwardQ => r(Some(2), Some(3), 4, Some(5), [Some(6), None, None]),
            AttentionPart::BackwardKV => r(Some(2), Some(3), 4, Some(5), [Some(6), Some(7), None]),
            AttentionPart::Lse => r(None, None, 2, None, [None, None, None]),
            AttentionPart::BackwardV => r(None, Some(2), 3, None, [Some(4), None, None]),
            AttentionPart::Backward => r(Some(2), Some(3), 4, Some(5), [Some(6), Some(7), Some(8)]),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Body {
    Loops { space: Space, stmts: Vec<Stmt> },
    Attention(Attention),
}

/// One generated kernel.
#[derive(Clone, Debug, PartialEq)]
pub struct Kernel {
    /// What the kernel is, as text: part of its name. A fused node's family as printed
    /// (`qatc_ir::KernelFamily`: `gemm.dequant.bias`), an unfused op's mnemonic (`layernorm`), or
    /// a lowering's own helper (`cross_entropy.chunk_rows`, `dequant.panel`).
    pub family: String,
    pub params: Vec<Param>,
    /// I32 when every extent and buffer fits, else I64.
    pub index_ty: Ty,
    pub body: Body,
    /// What it computes, in graph terms (a comment above the kernel).
    pub note: String,
    /// Display names of some variables (`mean`, `rstd`); the others are numbered.
    pub names: std::collections::BTreeMap<VarId, String>,
}

impl Kernel {
    /// The kernel's identity: the FNV-1a 64 hash of what it computes (family, params, index type
    /// and body; not its note, nor the display names of its values). Launches share one kernel
    /// exactly when their identities are equal (`lower`), and the name carries the hash.
    pub fn identity(&self) -> u64 {
        // the hash of the Debug text as it is written, not of a String of it (a large kernel's
        // text was a few percent of `qatc plan --fit`): the same value
        let mut h = Fnv1a64::default();
        // Writing into the hasher cannot fail.
        let _ = std::fmt::write(&mut h, format_args!("{:?}", (&self.family, &self.params, &self.index_ty, &self.body)));
        h.0
    }

    /// `fused_{family}_{hash8}`, hash8 the identity's first 8 hex digits: the kernel's name in
    /// CUDA C, in LLVM IR and in messages.
    pub fn name(&self) -> String {
        let family: String = self.family.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' }).collect();
        format!("fused_{family}_{:08x}", self.identity() >> 32)
    }

    /// Every variable a loop body or the space defines, for backends that declare them up front.
    pub fn uses_ix(&self, ix: Ix) -> bool {
        let mut found = false;
        if let Body::Loops { stmts, .. } = &self.body {
            visit_exprs(stmts, &mut |e| {
                if *e == Expr::Ix(ix) {
                    found = true;
                }
            });
        }
        found
    }
}

/// Visits every expression of a statement list (loop extents included), parents first.
pub fn visit_exprs(stmts: &[Stmt], f: &mut impl FnMut(&Expr)) {
    for s in stmts {
        match s {
            Stmt::Let { value, .. } => value.visit(f),
            Stmt::Store { index, value, .. } | Stmt::AtomicAdd { index, value, .. } => {
                index.visit(f);
                value.visit(f);
            }
            Stmt::Reduce { lp, body, value, .. } => {
                lp.extent.visit(f);
                visit_exprs(body, f);
                value.visit(f);
            }
            Stmt::ForEach { lp, body } => {
                lp.extent.visit(f);
                visit_exprs(body, f);
            }
        }
    }
}

/// The types of expressions: let-bound variables and reductions carry theirs, the rest follows
/// from operands. Backends that need explicit types (LLVM) use this.
#[derive(Clone, Debug, Default)]
pub struct TypeEnv {
    pub vars: std::collections::HashMap<VarId, Ty>,
}

impl TypeEnv {
    /// Records the types of every variable a statement list defines.
    pub fn of(stmts: &[Stmt]) -> TypeEnv {
        let mut env = TypeEnv::default();
        env.add(stmts);
        env
    }

    fn add(&mut self, stmts: &[Stmt]) {
        for s in stmts {
            match s {
                Stmt::Let { var, ty, .. } => {
                    self.vars.insert(*var, *ty);
                }
                Stmt::Reduce { var, ty, body, .. } => {
                    self.vars.insert(*var, *ty);
                    self.add(body);
                }
                Stmt::ForEach { body, .. } => self.add(body),
                Stmt::Store { .. } | Stmt::AtomicAdd { .. } => {}
            }
        }
    }

    /// The type of `e` in `k`. An integer constant takes the type of the integer it meets (the
    /// index type on its own).
    pub fn ty(&self, k: &Kernel, e: &Expr) -> Ty {
        match e {
            Expr::Float(_, t) => *t,
            Expr::Int(_) | Expr::Ix(_) => k.index_ty,
            Expr::Bool(_) => Ty::Bool,
            Expr::Var(v) => self.vars.get(v).copied().unwrap_or(Ty::F32),
            Expr::Load { param, .. } => match k.params.get(*param).map(|p| p.dtype.is_float()) {
                Some(false) => Ty::I32,
                _ => Ty::F32,
            },
            Expr::Un(UnOp::Not, _) => Ty::Bool,
            Expr::Un(_, a) => self.ty(k, a),
            Expr::Bin(op, a, b) => {
                if op.is_compare() || *op == BinOp::And {
                    Ty::Bool
                } else {
                    let (ta, tb) = (self.ty(k, a), self.ty(k, b));
                    match (ta, tb) {
                        (Ty::F64, _) | (_, Ty::F64) => Ty::F64,
                        (Ty::F32, _) | (_, Ty::F32) => Ty::F32,
                        (Ty::I64, _) | (_, Ty::I64) => Ty::I64,
                        _ if matches!(**a, Expr::Int(_)) => tb,
                        _ => ta,
                    }
                }
            }
            Expr::Select(_, a, _) => self.ty(k, a),
            Expr::Cast(t, _) => *t,
            Expr::Call(i, _) => match i {
                Intrinsic::DropoutKeep { .. } => Ty::Bool,
                Intrinsic::Nf4Nearest | Intrinsic::DynNearest(_) => Ty::I32,
                Intrinsic::Nf4Value | Intrinsic::F16Round | Intrinsic::DynValue(_) => Ty::F32,
            },
        }
    }
}

/// How many independent programs a kernel runs: elements of an `Elements` space, rows of a
/// `Rows` space, and for attention one per (b, h, row) where the row is a query row (forward,
/// statistics, dq) or a key row (dk, dv). CPU backends split `0..iterations` across threads;
/// disjoint ranges write disjoint memory, except `AtomicAdd`, which is atomic (and integer).
pub fn iterations(k: &Kernel) -> usize {
    match &k.body {
        Body::Loops { space: Space::Elements { shape }, .. } => shape.iter().product(),
        Body::Loops { space: Space::Rows { rows, .. }, .. } => *rows,
        Body::Attention(a) => a.b * a.nh * a.t,
    }
}
