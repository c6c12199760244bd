//! Kernel IR statements -> the body of a loop-nest kernel's CUDA C function (`LoopNestWriter`):
//! variables, loops shared by a row's threads, block and warp reductions, casts.

use std::collections::{BTreeSet, HashMap};
use std::slice;

use qatc_ir::DType;

use super::codegen::{SPLIT_SLICES, WARP_ROWS};
use super::stmts::{loads, stores};
use super::syntax::{float_lit, scalar};
use super::tables::dyn_table;
use super::writer::Writer;
use crate::error::KernelError;
use crate::kir::{BinOp, Expr, Intrinsic, Ix, Kernel, Loop, ReduceOp, RowMapping, Space, Stmt, Ty, TypeEnv, UnOp, VarId};

/// Every variable a statement list defines, in order, and whether a reduction defines it.
fn defined(stmts: &[Stmt], out: &mut Vec<(VarId, bool)>) {
    for s in stmts {
        match s {
            Stmt::Let { var, .. } => out.push((*var, false)),
            Stmt::Reduce { var, body, .. } => {
                out.push((*var, true));
                defined(body, out);
            }
            Stmt::ForEach { body, .. } => defined(body, out),
            Stmt::Store { .. } | Stmt::AtomicAdd { .. } => {}
        }
    }
}

/// The types of a Block-mapped kernel's block reductions (its top-level `Reduce`s), each needing
/// a shared scratch of its own type.
fn reduce_types(stmts: &[Stmt]) -> BTreeSet<Ty> {
    stmts.iter().filter_map(|s| if let Stmt::Reduce { ty, .. } = s { Some(*ty) } else { None }).collect()
}

/// The shared scratch of block reductions of type `t`.
fn scratch(t: Ty) -> &'static str {
    match t {
        Ty::F64 => "scratch_f64",
        Ty::I32 | Ty::Bool => "scratch_i32",
        Ty::I64 => "scratch_i64",
        Ty::F32 => "scratch",
    }
}

/// The shared parts of a split kernel's sums of type `t` (`split-columns`).
fn part(t: Ty) -> &'static str {
    match t {
        Ty::F64 => "part_f64",
        Ty::I32 | Ty::Bool => "part_i32",
        Ty::I64 => "part_i64",
        Ty::F32 => "part",
    }
}

/// Emission state for one loop-nest kernel.
pub(super) struct LoopNestWriter<'k> {
    k: &'k Kernel,
    env: TypeEnv,
    /// Variable -> its C name: its display name where it has a free one, else `v{n}` / `acc{n}`.
    vars: HashMap<VarId, String>,
    /// Loop variable -> its name (by nesting depth: `j`, then `jj`).
    loops: HashMap<u8, String>,
    depth: usize,
    /// Inside a loop whose iterations the block's threads share.
    parallel: bool,
    /// Inside a Block-mapped row: a group of threads shares each row.
    block_rows: bool,
    /// The group is a warp (`warp-rows`), not the block.
    warp: bool,
    /// A thread-per-row kernel whose top-level sums are split over warps
    /// (`split-columns`): top-level stores by the row's first warp (`owner`).
    split: bool,
}

impl<'k> LoopNestWriter<'k> {
    pub(super) fn new(k: &'k Kernel, stmts: &[Stmt], warp: bool, split: bool) -> LoopNestWriter<'k> {
        let mut taken: BTreeSet<String> = k.params.iter().map(|p| p.name.clone()).collect();
        taken.extend(["idx", "row", "j", "j1", "j2", "scratch", "lane", "slice", "owner", "row_", "part"].map(String::from));
        let mut vars = HashMap::new();
        let mut defs = Vec::new();
        defined(stmts, &mut defs);
        for (v, reduce) in defs {
            let name = match k.names.get(&v) {
                Some(n) if !taken.contains(n) => n.clone(),
                Some(n) => format!("{n}{v}"),
                None if reduce => format!("acc{v}"),
                None => format!("v{v}"),
            };
            taken.insert(name.clone());
            vars.insert(v, name);
        }
        LoopNestWriter {
            k,
            env: TypeEnv::of(stmts),
            vars,
            loops: HashMap::new(),
            depth: 0,
            parallel: false,
            block_rows: false,
            warp,
            split,
        }
    }

    /// What a statement that stores once per row is guarded by.
    fn guard(&self) -> String {
        if self.block_rows && !self.parallel {
            format!("if ({} == 0) ", self.member())
        } else if self.split && self.depth == 0 {
            "if (owner) ".into()
        } else {
            String::new()
        }
    }

    /// This thread's index in the group sharing a row.
    fn member(&self) -> &'static str {
        if self.warp {
            "lane"
        } else {
            "threadIdx.x"
        }
    }

    /// `base`, or `base1`, `base2`, ...: the first that names no param or variable.
    fn fresh(&self, base: &str) -> String {
        let taken = |n: &str| self.k.params.iter().any(|p| p.name == n) || self.vars.values().any(|v| v == n);
        (0..).map(|i| if i == 0 { base.to_string() } else { format!("{base}{i}") }).find(|n| !taken(n)).unwrap_or_else(|| base.into())
    }

    fn var(&self, v: VarId) -> String {
        self.vars.get(&v).cloned().unwrap_or_else(|| format!("v{v}"))
    }

    pub(super) fn kernel(&mut self, w: &mut Writer, space: &Space, stmts: &[Stmt]) -> Result<(), KernelError> {
        let it = scalar(self.k.index_ty);
        match space {
            Space::Elements { shape } => {
                let n: usize = shape.iter().product();
                w.line(format!("const {it} idx = ({it})blockIdx.x * blockDim.x + threadIdx.x;"));
                w.line(format!("if (idx >= {n}) return;"));
                let st = crate::index::strides(shape);
                for (d, (&dim, &s)) in shape.iter().zip(&st).enumerate() {
                    if !self.k.uses_ix(Ix::Coord(d as u8)) {
                        continue;
                    }
                    let e = match (d, s) {
                        (0, 1) => "idx".to_string(),
                        (0, _) => format!("idx / {s}"),
                        (_, 1) => format!("idx % {dim}"),
                        _ => format!("idx / {s} % {dim}"),
                    };
                    w.line(format!("const {it} i{d} = {e};  // of {dim}"));
                }
            }
            Space::Rows { rows, mapping: RowMapping::Block } if self.warp => {
                self.block_rows = true;
                w.line("const int lane = threadIdx.x & 31;");
                w.line(format!("const {it} row = ({it})blockIdx.x * {WARP_ROWS} + (threadIdx.x >> 5);  // of {rows}"));
                // uniform in the warp, and nothing waits at a block barrier
                w.line(format!("if (row >= {rows}) return;"));
            }
            Space::Rows { rows, mapping: RowMapping::Block } => {
                self.block_rows = true;
                for t in reduce_types(stmts) {
                    w.line(format!("__shared__ {} {}[32];", scalar(t), scratch(t)));
                }
                w.line(format!("const {it} row = blockIdx.x;  // of {rows}"));
                // a grid has at least one block, even for no rows; the test is uniform across
                // the block, so no thread is left waiting at a barrier
                w.line(format!("if (row >= {rows}) return;"));
            }
            Space::Rows { rows, mapping: RowMapping::Thread } if self.split => {
                for t in reduce_types(stmts) {
                    w.line(format!("__shared__ {} {}[{SPLIT_SLICES}][32];", scalar(t), part(t)));
                }
                w.line("const int lane = threadIdx.x & 31, slice = threadIdx.x >> 5;");
                w.line(format!("const {it} row_ = ({it})blockIdx.x * 32 + lane;  // of {rows}"));
                // every thread reaches the barriers: one past the end does the last row's work
                // again and stores nothing
                w.line(format!("const {it} row = row_ < {rows} ? row_ : {};", rows - 1));
                w.line(format!("const bool owner = slice == 0 && row_ < {rows};"));
            }
            Space::Rows { rows, mapping: RowMapping::Thread } => {
                w.line(format!("const {it} row = ({it})blockIdx.x * blockDim.x + threadIdx.x;"));
                w.line(format!("if (row >= {rows}) return;"));
            }
        }
        self.stmts(w, stmts)
    }

    fn stmts(&mut self, w: &mut Writer, stmts: &[Stmt]) -> Result<(), KernelError> {
        // In a Block-mapped row, a top-level statement's threads may read what other threads of
        // the block wrote in an earlier one (a shared loop's stores, thread 0's stores): a
        // barrier orders them.
        let top = (self.block_rows || self.split) && self.depth == 0;
        let mut written = BTreeSet::new();
        for s in stmts {
            let one = slice::from_ref(s);
            if top && !written.is_empty() && loads(one).intersection(&written).next().is_some() {
                if self.warp {
                    w.line("__syncwarp();  // what the warp stored above is read below");
                } else if self.split {
                    w.line("__syncthreads();  // what the row's owner stored above is read below");
                } else {
                    w.line("__syncthreads();  // what the block stored above is read below");
                }
                written.clear();
            }
            if top {
                written.extend(stores(one));
            }
            self.stmt(w, s)?;
        }
        Ok(())
    }

    /// Opens a loop over `extent`; returns whether the group sharing the row shares its
    /// iterations. A split kernel's top-level sum takes every `SPLIT_SLICES`th from `slice`.
    fn loop_head(&mut self, w: &mut Writer, var: u8, extent: &Expr) -> Result<bool, KernelError> {
        let name = if self.depth == 0 { "j".to_string() } else { format!("j{}", self.depth) };
        self.loops.insert(var, name.clone());
        let it = scalar(self.k.index_ty);
        // the bound is the right operand of `<` (precedence 60): a `?:` or a comparison there
        // must be parenthesized (`j < rank == 0 ? 1 : 0` is `((j < rank) == 0) ? 1 : 0`, a loop
        // that never ends)
        let ext = self.expr(extent, 61)?;
        let shared = self.block_rows && !self.parallel;
        if shared {
            let (from, step) = if self.warp { ("lane", "32") } else { ("threadIdx.x", "blockDim.x") };
            w.open(format!("for ({it} {name} = {from}; {name} < {ext}; {name} += {step})"));
        } else if self.split && self.depth == 0 {
            w.open(format!("for ({it} {name} = slice; {name} < {ext}; {name} += {SPLIT_SLICES})"));
        } else {
            w.open(format!("for ({it} {name} = 0; {name} < {ext}; ++{name})"));
        }
        self.depth += 1;
        Ok(shared)
    }

    fn stmt(&mut self, w: &mut Writer, s: &Stmt) -> Result<(), KernelError> {
        match s {
            Stmt::Let { var, ty, value } => {
                let v = self.expr(value, 0)?;
                w.line(format!("const {} {} = {v};", scalar(*ty), self.var(*var)));
                Ok(())
            }
            Stmt::Store { param, index, value } => self.store(w, *param, index, value),
            Stmt::AtomicAdd { param, index, value } => self.atomic_add(w, *param, index, value),
            Stmt::ForEach { lp, body } => self.for_each(w, lp, body),
            Stmt::Reduce { var, op, ty, lp, body, value } => self.reduce(w, (*var, *op, *ty), lp, body, value),
        }
    }

    /// `param[index] = value`, converted to the param's element type.
    fn store(&mut self, w: &mut Writer, param: usize, index: &Expr, value: &Expr) -> Result<(), KernelError> {
        let p = &self.k.params[param];
        let (i, v) = (self.expr(index, 0)?, self.expr(value, 0)?);
        let guard = self.guard();
        // a float stored into an integer param converts as a Cast to I32 does (C's
        // implicit conversion is undefined out of range)
        let v = if !p.dtype.is_float() && matches!(self.ty(value), Ty::F32 | Ty::F64) {
            f2i(self.ty(value), Ty::I32, &self.expr(value, 0)?)
        } else {
            v
        };
        let line = match p.dtype {
            DType::F32 | DType::I32 => format!("{}[{i}] = {v};", p.name),
            DType::F16 => format!("{}[{i}] = qatc::float_to_f16({v});", p.name),
            DType::BF16 => format!("{}[{i}] = qatc::float_to_bf16({v});", p.name),
            DType::U8 => format!("{}[{i}] = (unsigned char)({v});", p.name),
            DType::I4 => format!("qatc::store_i4({}, {i}, {v});", p.name),
        };
        w.line(format!("{guard}{line}"));
        Ok(())
    }

    /// `param[index] += value`: integer counts only (kernels stay deterministic).
    fn atomic_add(&mut self, w: &mut Writer, param: usize, index: &Expr, value: &Expr) -> Result<(), KernelError> {
        let p = &self.k.params[param];
        if p.dtype != DType::I32 || !matches!(self.ty(value), Ty::I32 | Ty::I64 | Ty::Bool) {
            return Err(KernelError::Internal(format!(
                "atomic add of a {:?} into {} {}: atomics are for integer counts only (kir)",
                self.ty(value),
                p.dtype,
                p.name
            )));
        }
        // as a store: once per row in a Block-mapped row, not once per thread
        let guard = self.guard();
        w.line(format!("{guard}atomicAdd(&{}[{}], (int)({}));", p.name, self.expr(index, 0)?, self.expr(value, 0)?));
        Ok(())
    }

    /// A loop over `lp` running `body`: shared by the group that shares the row where it can be,
    /// a split kernel's top-level loop run by the row's owner.
    fn for_each(&mut self, w: &mut Writer, lp: &Loop, body: &[Stmt]) -> Result<(), KernelError> {
        // a split kernel's row owner runs its top-level loops (they store)
        let owned = self.split && self.depth == 0;
        let was = self.parallel;
        if owned {
            w.open("if (owner)");
            w.open(format!("for ({} j = 0; j < {}; ++j)", scalar(self.k.index_ty), self.expr(&lp.extent, 61)?));
            self.loops.insert(lp.var, "j".into());
            self.depth += 1;
        } else {
            let shared = self.loop_head(w, lp.var, &lp.extent)?;
            self.parallel |= shared;
        }
        self.stmts(w, body)?;
        self.parallel = was;
        self.depth -= 1;
        w.close();
        if owned {
            w.close();
        }
        Ok(())
    }

    /// `var = op over lp of value`: a loop, then the sum or max across the group sharing the
    /// row, or the split kernel's slices added in slice order.
    fn reduce(
        &mut self,
        w: &mut Writer,
        (var, op, ty): (VarId, ReduceOp, Ty),
        lp: &Loop,
        body: &[Stmt],
        value: &Expr,
    ) -> Result<(), KernelError> {
        let t = scalar(ty);
        let float = matches!(ty, Ty::F32 | Ty::F64);
        if !float && op != ReduceOp::Sum {
            return Err(KernelError::Internal(format!("a {op:?} reduction of {ty:?}: integer reductions are sums")));
        }
        let init = match (op, ty) {
            (ReduceOp::Sum | ReduceOp::FirstAbsMax, Ty::F32) => "0.0f",
            (ReduceOp::Sum | ReduceOp::FirstAbsMax, Ty::F64) => "0.0",
            (ReduceOp::Sum, _) => "0",
            (_, _) => "-INFINITY",
        };
        let (fmax, fabs) = if ty == Ty::F64 { ("fmax", "fabs") } else { ("fmaxf", "fabsf") };
        let acc = self.var(var);
        w.line(format!("{t} {acc} = {init};"));
        let sliced = self.split && self.depth == 0;
        let shared = self.loop_head(w, lp.var, &lp.extent)?;
        if shared && op == ReduceOp::FirstAbsMax {
            return Err(KernelError::Internal("FirstAbsMax needs a sequential (thread-per-row) reduction".into()));
        }
        let was = self.parallel;
        self.parallel |= shared;
        self.stmts(w, body)?;
        let v = self.expr(value, 0)?;
        match op {
            ReduceOp::Sum => w.line(format!("{acc} += {v};")),
            ReduceOp::Max => w.line(format!("{acc} = {fmax}({acc}, {v});")),
            ReduceOp::FirstAbsMax => {
                // a local name no param or variable of the kernel has (a param may be `x`)
                let x = self.fresh("x");
                w.line(format!("const {t} {x} = {v};"));
                w.line(format!("if ({fabs}({x}) > {fabs}({acc})) {acc} = {x};  // the first of largest magnitude"));
            }
        }
        self.parallel = was;
        self.depth -= 1;
        w.close();
        let sc = scratch(ty);
        match (shared, op) {
            (true, ReduceOp::Sum) if self.warp => w.line(format!("{acc} = qatc::warp_sum({acc});")),
            (true, _) if self.warp => w.line(format!("{acc} = qatc::warp_max({acc});")),
            (true, ReduceOp::Sum) => w.line(format!("{acc} = qatc::block_sum({acc}, {sc});")),
            (true, _) => w.line(format!("{acc} = qatc::block_max({acc}, {sc});")),
            (false, _) => {}
        }
        if sliced {
            // `split_columns` admits sums only: the slices' parts, added in slice order
            let p = part(ty);
            w.line(format!("{p}[slice][lane] = {acc};"));
            w.line("__syncthreads();");
            let parts: Vec<String> = (0..SPLIT_SLICES).map(|i| format!("{p}[{i}][lane]")).collect();
            w.line(format!("{acc} = {};", parts.join(" + ")));
            w.line(format!("__syncthreads();  // every slice has read {p} before it is written again"));
        }
        Ok(())
    }

    /// `e` as C, parenthesized where its precedence is below `min`.
    fn expr(&self, e: &Expr, min: u8) -> Result<String, KernelError> {
        let (s, prec) = self.expr_p(e)?;
        Ok(if prec < min { format!("({s})") } else { s })
    }

    fn ty(&self, e: &Expr) -> Ty {
        self.env.ty(self.k, e)
    }

    fn expr_p(&self, e: &Expr) -> Result<(String, u8), KernelError> {
        const TOP: u8 = 100;
        Ok(match e {
            Expr::Float(v, t) => (float_lit(*v, *t), TOP),
            Expr::Int(i) => (if *i < 0 { format!("({i})") } else { i.to_string() }, TOP),
            Expr::Bool(b) => (b.to_string(), TOP),
            Expr::Ix(ix) => (
                match ix {
                    Ix::Elem => "idx".to_string(),
                    Ix::Coord(d) => format!("i{d}"),
                    Ix::Row => "row".to_string(),
                    Ix::Loop(l) => self.loops.get(l).cloned().ok_or_else(|| KernelError::Internal(format!("loop {l} used outside it")))?,
                },
                TOP,
            ),
            Expr::Var(v) => (self.var(*v), TOP),
            Expr::Load { param, index } => {
                let p = self.k.params.get(*param).ok_or_else(|| KernelError::Internal(format!("no param {param}")))?;
                let i = self.expr(index, 0)?;
                let s = match p.dtype {
                    DType::F32 | DType::I32 => format!("{}[{i}]", p.name),
                    DType::F16 => format!("qatc::f16_to_float({}[{i}])", p.name),
                    DType::BF16 => format!("qatc::bf16_to_float({}[{i}])", p.name),
                    DType::U8 => format!("(int){}[{i}]", p.name),
                    DType::I4 => format!("qatc::load_i4({}, {i})", p.name),
                };
                (s, TOP)
            }
            Expr::Un(op, a) => {
                let d = self.ty(a) == Ty::F64;
                let call = |f32: &str, f64: &str| -> Result<(String, u8), KernelError> {
                    Ok((format!("{}({})", if d { f64 } else { f32 }, self.expr(a, 0)?), TOP))
                };
                match op {
                    UnOp::Neg => (format!("-{}", self.expr(a, 90)?), 90),
                    UnOp::Not => (format!("!{}", self.expr(a, 90)?), 90),
                    UnOp::Exp => call("expf", "exp")?,
                    UnOp::Log => call("logf", "log")?,
                    UnOp::Sqrt => call("sqrtf", "sqrt")?,
                    UnOp::Rsqrt if d => (format!("1.0 / sqrt({})", self.expr(a, 0)?), 80),
                    UnOp::Rsqrt => (format!("1.0f / sqrtf({})", self.expr(a, 0)?), 80),
                    UnOp::Recip if d => (format!("1.0 / {}", self.expr(a, 81)?), 80),
                    UnOp::Recip => (format!("1.0f / {}", self.expr(a, 81)?), 80),
                    UnOp::Tanh => call("tanhf", "tanh")?,
                    UnOp::Abs => call("fabsf", "fabs")?,
                    UnOp::Gelu => call("qatc::gelu", "qatc::gelu")?,
                    UnOp::RoundEven => call("rintf", "rint")?,
                    UnOp::Trunc => call("truncf", "trunc")?,
                    UnOp::RoundF16 => call("qatc::round_f16", "qatc::round_f16")?,
                    UnOp::RoundBf16 => call("qatc::round_bf16", "qatc::round_bf16")?,
                }
            }
            Expr::Bin(op, a, b) => self.binary(*op, a, b)?,
            Expr::Select(c, a, b) => (format!("{} ? {} : {}", self.expr(c, 21)?, self.expr(a, 21)?, self.expr(b, 20)?), 20),
            Expr::Cast(t, a) => {
                let from = self.ty(a);
                let inner = self.expr(a, 0)?;
                let s = match (t, from) {
                    (Ty::I32 | Ty::I64, Ty::F32 | Ty::F64) => f2i(from, *t, &inner),
                    _ if *t == from => return self.expr_p(a),
                    _ => format!("({}){}", scalar(*t), self.expr(a, 90)?),
                };
                let prec = if s.starts_with('(') { 90 } else { TOP };
                (s, prec)
            }
            Expr::Call(i, args) => {
                let a: Vec<String> = args.iter().map(|x| self.expr(x, 0)).collect::<Result<_, _>>()?;
                let s = match i {
                    Intrinsic::DropoutKeep { stream } => format!(
                        "qatc::dropout_keep({}, {stream}ull, {}, {})",
                        a.first().cloned().unwrap_or_default(),
                        a.get(1).cloned().unwrap_or_default(),
                        a.get(2).cloned().unwrap_or_default()
                    ),
                    Intrinsic::Nf4Value => format!("qatc::nf4_value({})", a.join(", ")),
                    Intrinsic::Nf4Nearest => format!("qatc::nf4_nearest({})", a.join(", ")),
                    Intrinsic::F16Round => format!("qatc::round_f16({})", a.join(", ")),
                    Intrinsic::DynValue(m) => format!("qatc::dyn_value(qatc::{}, {})", dyn_table(*m), a.join(", ")),
                    Intrinsic::DynNearest(m) => format!("qatc::dyn_nearest(qatc::{}, {})", dyn_table(*m), a.join(", ")),
                };
                (s, TOP)
            }
        })
    }

    fn binary(&self, op: BinOp, a: &Expr, b: &Expr) -> Result<(String, u8), KernelError> {
        let float = matches!(self.ty(a), Ty::F32 | Ty::F64) || matches!(self.ty(b), Ty::F32 | Ty::F64);
        let infix = |sym: &str, p: u8| -> Result<(String, u8), KernelError> {
            Ok((format!("{} {sym} {}", self.expr(a, p)?, self.expr(b, p + 1)?), p))
        };
        let call = |f: &str| -> Result<(String, u8), KernelError> { Ok((format!("{f}({}, {})", self.expr(a, 0)?, self.expr(b, 0)?), 100)) };
        match op {
            BinOp::Add => infix("+", 70),
            BinOp::Sub => infix("-", 70),
            BinOp::Mul => infix("*", 80),
            BinOp::Div => infix("/", 80),
            BinOp::Rem => infix("%", 80),
            BinOp::Lt => infix("<", 60),
            BinOp::Le => infix("<=", 60),
            BinOp::Eq => infix("==", 50),
            BinOp::Ne => infix("!=", 50),
            BinOp::And => infix("&&", 30),
            BinOp::Max | BinOp::Min if float => {
                let f = if op == BinOp::Max { "qatc::max_nan" } else { "qatc::min_nan" };
                // both operands in their common type: the helpers' overloads are (float, float)
                // and (double, double)
                let wide = self.ty(a) == Ty::F64 || self.ty(b) == Ty::F64;
                let arg = |e: &Expr| -> Result<String, KernelError> {
                    let s = self.expr(e, 0)?;
                    Ok(if wide && self.ty(e) != Ty::F64 { format!("(double)({s})") } else { s })
                };
                Ok((format!("{f}({}, {})", arg(a)?, arg(b)?), 100))
            }
            // CUDA's integer max/min overloads take two operands of one type
            BinOp::Max | BinOp::Min if self.ty(a) == Ty::I64 || self.ty(b) == Ty::I64 => {
                let f = if op == BinOp::Max { "max" } else { "min" };
                Ok((format!("{f}((long long)({}), (long long)({}))", self.expr(a, 0)?, self.expr(b, 0)?), 100))
            }
            BinOp::Max => call("max"),
            BinOp::Min => call("min"),
            BinOp::GeluGrad => call("qatc::gelu_grad"),
            BinOp::Pow => call("pow"),
        }
    }
}

/// Float to integer as `Expr::Cast` defines it: toward zero, saturating at the target's range,
/// NaN to 0 (PTX `cvt.rzi` with the float's own width: going through f32 would round a double
/// first).
fn f2i(from: Ty, to: Ty, inner: &str) -> String {
    let f = match (from, to) {
        (Ty::F64, Ty::I64) => "__double2ll_rz",
        (Ty::F64, _) => "__double2int_rz",
        (_, Ty::I64) => "__float2ll_rz",
        _ => "__float2int_rz",
    };
    format!("{f}({inner})")
}
