//! The kernel-IR evaluator: a [`Launcher`] that interprets each kernel's statements directly over
//! the raw buffers, one iteration at a time. Slow, simple and checked at every step (every load
//! and store is bounds-checked against its param, index arithmetic against overflow, loop extents
//! against their declared maximum): it runs compiled programs where LLVM is not built, and it is
//! the oracle that checks `qatc_kernels::lower` against the graph interpreter.
//!
//! Semantics are the kernel IR's (`qatc_kernels::kir`), as the CUDA backend implements them;
//! the scalar rules are in `scalar.rs`, attention in `attention.rs`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI32, AtomicU8, Ordering};

use half::{bf16, f16};
use qatc_ir::DType;
use qatc_kernels::kir::{self, Body, Expr, Ix, Kernel, Loop, ReduceOp, Space, Stmt, Ty, TypeEnv, VarId};

use super::scalar::{self, int_as, Scalar, R};
use super::Launcher;
use crate::error::RuntimeError;
use crate::exec::kernel_label;
use crate::float::WideSum;

/// A kernel prepared for evaluation.
struct Prepared {
    kernel: Kernel,
    env: TypeEnv,
    vars: usize,
    loops: usize,
    /// Row-major strides of an Elements space, for `Ix::Coord`.
    strides: Vec<usize>,
    shape: Vec<usize>,
    /// The type of each `Select` (C's common type of its branches), by the node's address in
    /// `kernel`: computing it per evaluation costs the depth of a nested chain (a multi-tensor
    /// kernel's concat is dozens deep) at every level. The addresses are those of the boxed and
    /// Vec-held nodes of `kernel`, which stay put however the Prepared moves.
    select_ty: HashMap<usize, Ty>,
}

/// Interprets kernel IR; see the module docs.
pub struct KirEval {
    kernels: Vec<Prepared>,
}

fn count_defs(stmts: &[Stmt], vars: &mut usize, loops: &mut usize) {
    for s in stmts {
        match s {
            Stmt::Let { var, .. } => *vars = (*vars).max(*var as usize + 1),
            Stmt::Reduce { var, lp, body, .. } => {
                *vars = (*vars).max(*var as usize + 1);
                *loops = (*loops).max(lp.var as usize + 1);
                count_defs(body, vars, loops);
            }
            Stmt::ForEach { lp, body } => {
                *loops = (*loops).max(lp.var as usize + 1);
                count_defs(body, vars, loops);
            }
            Stmt::Store { .. } | Stmt::AtomicAdd { .. } => {}
        }
    }
}

impl KirEval {
    /// An evaluator for a program's kernels (`Program::kernels`, in order).
    pub fn new(kernels: &[Kernel]) -> KirEval {
        let kernels = kernels
            .iter()
            .map(|k| {
                let (mut vars, mut loops) = (0, 0);
                let (env, shape) = match &k.body {
                    Body::Loops { space, stmts } => {
                        count_defs(stmts, &mut vars, &mut loops);
                        let shape = match space {
                            Space::Elements { shape } => shape.clone(),
                            Space::Rows { .. } => Vec::new(),
                        };
                        (TypeEnv::of(stmts), shape)
                    }
                    Body::Attention(_) => (TypeEnv::default(), Vec::new()),
                };
                let strides = qatc_kernels::index::strides(&shape);
                let mut p = Prepared { kernel: k.clone(), env, vars, loops, strides, shape, select_ty: HashMap::new() };
                let mut select_ty = HashMap::new();
                if let Body::Loops { stmts, .. } = &p.kernel.body {
                    kir::visit_exprs(stmts, &mut |e| {
                        if let Expr::Select(_, a, b) = e {
                            select_ty.insert(e as *const Expr as usize, Ty::common(p.env.ty(&p.kernel, a), p.env.ty(&p.kernel, b)));
                        }
                    });
                }
                p.select_ty = select_ty;
                p
            })
            .collect();
        KirEval { kernels }
    }
}

/// One kernel param's buffer: its base address, element count and dtype.
#[derive(Clone, Copy, Debug)]
pub struct Mem {
    ptr: *mut u8,
    numel: usize,
    dtype: DType,
}

impl Mem {
    fn check(&self, i: usize) -> R<()> {
        if i < self.numel {
            Ok(())
        } else {
            Err(format!("index {i} out of bounds of {} {} elements", self.numel, self.dtype))
        }
    }

    /// Element `i`, widened: floats to f32, integers to i32.
    pub fn load(&self, i: usize) -> R<Scalar> {
        self.check(i)?;
        let p = self.ptr;
        // SAFETY: i < numel, and `launch`'s contract makes `ptr` a live allocation of at least
        // numel elements of `dtype`, 4-byte aligned (so element i of a 2- or 4-byte dtype is
        // aligned too); other threads write only elements of their own iterations.
        Ok(unsafe {
            match self.dtype {
                DType::F32 => Scalar::F32(p.cast::<f32>().add(i).read()),
                DType::F16 => Scalar::F32(f16::from_bits(p.cast::<u16>().add(i).read()).to_f32()),
                DType::BF16 => Scalar::F32(bf16::from_bits(p.cast::<u16>().add(i).read()).to_f32()),
                DType::I32 => Scalar::I32(p.cast::<i32>().add(i).read()),
                DType::U8 => Scalar::I32(i32::from(p.add(i).read())),
                // the byte may be updated by another thread's store of the other nibble
                DType::I4 => Scalar::I32(i32::from((AtomicU8::from_ptr(p.add(i / 2)).load(Ordering::Relaxed) >> (4 * (i % 2))) & 15)),
            }
        })
    }

    /// Stores `v` into element `i`, converted to the dtype as C does (floats round to nearest
    /// even; u8 keeps the low 8 bits and i4 the low 4 of the integer).
    pub fn store(&self, i: usize, v: Scalar) -> R<()> {
        self.check(i)?;
        let p = self.ptr;
        let int = || -> R<i32> { Ok(scalar::cast(Ty::I32, v)?.int()? as i32) };
        // SAFETY: as `load`; this iteration is the only writer of element i (disjoint iterations
        // write disjoint elements, the kernel IR's rule), and the nibble store is an atomic update
        // of its byte, so two threads storing the two halves of one byte do not race.
        unsafe {
            match self.dtype {
                DType::F32 => p.cast::<f32>().add(i).write(v.f32()),
                DType::F16 => p.cast::<u16>().add(i).write(f16::from_f32(v.f32()).to_bits()),
                DType::BF16 => p.cast::<u16>().add(i).write(bf16::from_f32(v.f32()).to_bits()),
                DType::I32 => p.cast::<i32>().add(i).write(int()?),
                DType::U8 => p.add(i).write(int()? as u8),
                DType::I4 => {
                    let (shift, code) = (4 * (i % 2), (int()? & 15) as u8);
                    let byte = AtomicU8::from_ptr(p.add(i / 2));
                    let mask = 15u8 << shift;
                    byte.fetch_and(!mask, Ordering::Relaxed);
                    byte.fetch_or(code << shift, Ordering::Relaxed);
                }
            }
        }
        Ok(())
    }

    /// element i += v, atomically (i32 counts only: the kernel IR has no float atomics, whose
    /// sums would depend on the order threads arrive in).
    pub fn atomic_add(&self, i: usize, v: Scalar) -> R<()> {
        self.check(i)?;
        if self.dtype != DType::I32 {
            return Err(format!("atomic add into a {} buffer", self.dtype));
        }
        let add = scalar::cast(Ty::I32, v)?.int()? as i32;
        // SAFETY: as `load`; every thread touching this element does so through this atomic.
        let cell = unsafe { AtomicI32::from_ptr(self.ptr.cast::<i32>().add(i)) };
        cell.fetch_add(add, Ordering::Relaxed);
        Ok(())
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn f32_at(&self, i: usize) -> R<f32> {
        self.load(i).map(Scalar::f32)
    }
}

/// The state of one thread running iterations of a loop-nest kernel.
struct Frame<'a> {
    k: &'a Prepared,
    mem: &'a [Mem],
    vars: Vec<Option<Scalar>>,
    loops: Vec<Option<i64>>,
    /// A Rows space (`row` is the iteration), else Elements (`elem` is).
    rows: bool,
    elem: i64,
    row: i64,
}

impl Frame<'_> {
    fn ix(&self, i: i64) -> R<Scalar> {
        int_as(i, self.k.kernel.index_ty)
    }

    fn ty(&self, e: &Expr) -> Ty {
        self.k.env.ty(&self.k.kernel, e)
    }

    fn mem(&self, p: usize) -> R<&Mem> {
        self.mem.get(p).ok_or_else(|| format!("no param {p}"))
    }

    fn eval(&mut self, e: &Expr) -> R<Scalar> {
        Ok(match e {
            Expr::Float(v, Ty::F64) => Scalar::F64(*v),
            Expr::Float(v, _) => Scalar::F32(*v as f32),
            Expr::Int(i) => self.ix(*i)?,
            Expr::Bool(b) => Scalar::Bool(*b),
            Expr::Ix(ix) => match *ix {
                Ix::Elem | Ix::Coord(_) if self.rows => return Err(format!("{ix:?} in a Rows space")),
                Ix::Row if !self.rows => return Err("Ix::Row in an Elements space".into()),
                Ix::Elem => self.ix(self.elem)?,
                Ix::Row => self.ix(self.row)?,
                Ix::Coord(d) => {
                    let (s, n) = (self.k.strides.get(d as usize), self.k.shape.get(d as usize));
                    let (s, n) = s.zip(n).ok_or_else(|| format!("coordinate {d} of a space of rank {}", self.k.shape.len()))?;
                    self.ix((self.elem as usize / s % n) as i64)?
                }
                Ix::Loop(l) => {
                    let v = self.loops.get(l as usize).copied().flatten();
                    self.ix(v.ok_or_else(|| format!("loop {l} used outside it"))?)?
                }
            },
            Expr::Var(v) => {
                self.vars.get(*v as usize).copied().flatten().ok_or_else(|| format!("variable {v} used before it is defined"))?
            }
            Expr::Load { param, index } => {
                let i = self.eval(index)?.index()?;
                self.mem(*param)?.load(i)?
            }
            Expr::Un(op, a) => scalar::unary(*op, self.eval(a)?)?,
            Expr::Bin(op, a, b) => {
                let (x, y) = (self.eval(a)?, self.eval(b)?);
                // an integer constant takes the type of the other operand
                let x = if let Expr::Int(i) = **a { int_as(i, y.ty())? } else { x };
                let y = if let Expr::Int(i) = **b { int_as(i, x.ty())? } else { y };
                let t = Ty::common(x.ty(), y.ty());
                scalar::binary(*op, scalar::cast(t, x)?, scalar::cast(t, y)?)?
            }
            Expr::Select(c, a, b) => {
                // lazy: the branch not taken may read out of bounds; the result has C's common
                // type of the two branches
                let t = match self.k.select_ty.get(&(e as *const Expr as usize)) {
                    Some(&t) => t,
                    None => Ty::common(self.ty(a), self.ty(b)),
                };
                let v = if self.eval(c)?.bool()? { self.eval(a)? } else { self.eval(b)? };
                if v.ty() == Ty::Bool {
                    v
                } else {
                    scalar::cast(t, v)?
                }
            }
            Expr::Cast(t, a) => scalar::cast(*t, self.eval(a)?)?,
            Expr::Call(i, args) => {
                let mut vs = [Scalar::Bool(false); 3];
                for (slot, a) in vs.iter_mut().zip(args) {
                    *slot = self.eval(a)?;
                }
                scalar::call(*i, &vs[..args.len().min(3)])?
            }
        })
    }

    fn extent(&mut self, lp: &Loop) -> R<i64> {
        let n = self.eval(&lp.extent)?.int()?;
        if n < 0 || n as usize > lp.max {
            return Err(format!("loop {} runs {n} times, its declared maximum is {}", lp.var, lp.max));
        }
        Ok(n)
    }

    fn set_loop(&mut self, lp: &Loop, j: Option<i64>) -> R<()> {
        *self.loops.get_mut(lp.var as usize).ok_or("loop variable out of range")? = j;
        Ok(())
    }

    fn stmts(&mut self, stmts: &[Stmt]) -> R<()> {
        for s in stmts {
            match s {
                Stmt::Let { var, ty, value } => {
                    let v = scalar::cast(*ty, self.eval(value)?)?;
                    self.def(*var, v)?;
                }
                Stmt::Store { param, index, value } => {
                    let i = self.eval(index)?.index()?;
                    let v = self.eval(value)?;
                    self.mem(*param)?.store(i, v)?;
                }
                Stmt::AtomicAdd { param, index, value } => {
                    let i = self.eval(index)?.index()?;
                    let v = self.eval(value)?;
                    self.mem(*param)?.atomic_add(i, v)?;
                }
                Stmt::ForEach { lp, body } => {
                    for j in 0..self.extent(lp)? {
                        self.set_loop(lp, Some(j))?;
                        self.stmts(body)?;
                    }
                    self.set_loop(lp, None)?;
                }
                Stmt::Reduce { var, op, ty, lp, body, value } => {
                    let mut acc = match (op, ty) {
                        (ReduceOp::Max, Ty::F32) => Scalar::F32(f32::NEG_INFINITY),
                        (ReduceOp::Max, Ty::F64) => Scalar::F64(f64::NEG_INFINITY),
                        (_, Ty::F32 | Ty::F64) => scalar::cast(*ty, Scalar::F32(0.0))?,
                        (ReduceOp::Sum, Ty::I32 | Ty::I64) => int_as(0, *ty)?,
                        _ => return Err(format!("{op:?} reduction of type {ty:?}")),
                    };
                    // An f32 sum is the reference's ([`WideSum`]: f64, rounded once at its end);
                    // the IR lets a sum fold in any order, and the evaluator judges the orders
                    // the devices choose.
                    let mut wide = (*op == ReduceOp::Sum && *ty == Ty::F32).then(WideSum::default);
                    for j in 0..self.extent(lp)? {
                        self.set_loop(lp, Some(j))?;
                        self.stmts(body)?;
                        let x = scalar::cast(*ty, self.eval(value)?)?;
                        if let (Some(w), Scalar::F32(x)) = (wide.as_mut(), x) {
                            w.add(x);
                            continue;
                        }
                        acc = match (op, acc, x) {
                            (ReduceOp::Sum, Scalar::F32(a), Scalar::F32(x)) => Scalar::F32(a + x),
                            (ReduceOp::Sum, Scalar::F64(a), Scalar::F64(x)) => Scalar::F64(a + x),
                            (ReduceOp::Sum, Scalar::I32(a), Scalar::I32(x)) => Scalar::I32(a.checked_add(x).ok_or("i32 sum overflows")?),
                            (ReduceOp::Sum, Scalar::I64(a), Scalar::I64(x)) => Scalar::I64(a.checked_add(x).ok_or("i64 sum overflows")?),
                            // fmaxf: a NaN operand loses
                            (ReduceOp::Max, Scalar::F32(a), Scalar::F32(x)) => Scalar::F32(a.max(x)),
                            (ReduceOp::Max, Scalar::F64(a), Scalar::F64(x)) => Scalar::F64(a.max(x)),
                            (ReduceOp::FirstAbsMax, a, x) if x.f64().abs() > a.f64().abs() => x,
                            (_, a, _) => a,
                        };
                    }
                    self.set_loop(lp, None)?;
                    if let Some(w) = wide {
                        acc = Scalar::F32(w.round());
                    }
                    self.def(*var, acc)?;
                }
            }
        }
        Ok(())
    }

    fn def(&mut self, var: VarId, v: Scalar) -> R<()> {
        *self.vars.get_mut(var as usize).ok_or("variable out of range")? = Some(v);
        Ok(())
    }
}

impl Launcher for KirEval {
    unsafe fn launch(&self, kernel: usize, args: &[*mut u8], start: usize, end: usize) -> Result<(), RuntimeError> {
        let k = self.kernels.get(kernel).ok_or_else(|| RuntimeError::Kernel {
            kernel: format!("#{kernel}"),
            msg: format!("the program has {} kernels", self.kernels.len()),
        })?;
        let err = |msg: String| RuntimeError::Kernel { kernel: kernel_label(&k.kernel), msg };
        let params = &k.kernel.params;
        if args.len() != params.len() {
            return Err(err(format!("launched with {} buffers for {} params", args.len(), params.len())));
        }
        let n = kir::iterations(&k.kernel);
        if start > end || end > n {
            return Err(err(format!("iterations {start}..{end} of {n}")));
        }
        let mem: Vec<Mem> = params.iter().zip(args).map(|(p, &ptr)| Mem { ptr, numel: p.numel(), dtype: p.dtype }).collect();
        match &k.kernel.body {
            Body::Attention(a) => super::attention::run(a, &mem, start, end).map_err(err),
            Body::Loops { space, stmts } => {
                let rows = matches!(space, Space::Rows { .. });
                let mut f = Frame { k, mem: &mem, vars: vec![None; k.vars], loops: vec![None; k.loops], rows, elem: 0, row: 0 };
                for it in start..end {
                    // a fresh scope per iteration: a variable read before its definition is an error
                    f.vars.iter_mut().for_each(|v| *v = None);
                    if rows {
                        f.row = it as i64;
                    } else {
                        f.elem = it as i64;
                    }
                    f.stmts(stmts).map_err(|m| err(format!("iteration {it}: {m}")))?;
                }
                Ok(())
            }
        }
    }
}
