//! Builds one kernel: its params (one per buffer it touches), its statements, and the values of
//! graph nodes at positions, inlined (see `inline.rs`).

use std::collections::{BTreeMap, HashMap};

use qatc_ir::{DType, Graph, NodeId};

use crate::error::KernelError;
use crate::index::{self, Bounds};
use crate::kir::{
    BinOp, Body, Expr, ExprKey, Ix, Kernel, Loop, MemoKey, Param, ParamId, PosKey, ReduceOp, RowMapping, Space, Stmt, Ty, UnOp, VarId,
};
use crate::program::{BufId, Buffer, View};

/// A position in a tensor: a linear index or one coordinate per dim.
#[derive(Clone, Debug, PartialEq)]
pub enum Pos {
    Lin(Expr),
    Coords(Vec<Expr>),
}

/// What the inliner reads: the graph, the nodes already in memory (views), and values computed by
/// the kernel itself at a position (the epilogue of a row op reads the row op's result).
pub struct Source<'g> {
    pub g: &'g Graph,
    pub leaves: &'g HashMap<NodeId, View>,
    pub buffers: &'g [Buffer],
    /// Suggested parameter names per buffer (operand roles, or the fused body's `in0..`).
    pub names: &'g HashMap<BufId, String>,
    /// Operand buffers in operand order: parameters are listed in this order, outputs last.
    pub order: &'g [BufId],
}

pub struct KernelBuilder<'g> {
    pub src: Source<'g>,
    pub params: Vec<Param>,
    pub args: Vec<BufId>,
    pub bounds: Bounds,
    /// The shape of an Elements space (its coordinates are `Ix::Coord`).
    pub space_shape: Option<Vec<usize>>,
    pub index_ty: Ty,
    blocks: Vec<Vec<Stmt>>,
    memo: Vec<HashMap<MemoKey, Expr>>,
    next_var: VarId,
    next_loop: u8,
    /// Inside a lazy `Select` branch: build expressions without hoisting them into lets.
    lazy: usize,
    /// (node, position) -> a value the kernel already holds.
    pub subst: HashMap<(NodeId, PosKey), Expr>,
    names: BTreeMap<VarId, String>,
}

pub fn pos_key(node: NodeId, pos: &Pos) -> (NodeId, PosKey) {
    let key = match pos {
        Pos::Lin(e) => PosKey::Lin(ExprKey(e.clone())),
        Pos::Coords(cs) => PosKey::Coords(cs.iter().cloned().map(ExprKey).collect()),
    };
    (node, key)
}

impl<'g> KernelBuilder<'g> {
    pub fn new(src: Source<'g>, index_ty: Ty) -> KernelBuilder<'g> {
        KernelBuilder {
            src,
            params: Vec::new(),
            args: Vec::new(),
            bounds: Bounds::default(),
            space_shape: None,
            index_ty,
            blocks: vec![Vec::new()],
            memo: vec![HashMap::new()],
            next_var: 0,
            next_loop: 0,
            lazy: 0,
            subst: HashMap::new(),
            names: BTreeMap::new(),
        }
    }

    /// An Elements space over `shape`.
    pub fn elements(src: Source<'g>, index_ty: Ty, shape: &[usize]) -> KernelBuilder<'g> {
        let mut kb = KernelBuilder::new(src, index_ty);
        kb.bounds.elem = shape.iter().product::<usize>() as i64;
        kb.bounds.coords = shape.iter().map(|&d| d as i64).collect();
        kb.space_shape = Some(shape.to_vec());
        kb
    }

    /// A Rows space of `rows` rows.
    pub fn rows(src: Source<'g>, index_ty: Ty, rows: usize) -> KernelBuilder<'g> {
        let mut kb = KernelBuilder::new(src, index_ty);
        kb.bounds.row = rows as i64;
        kb
    }

    pub fn param(&mut self, buf: BufId, write: bool) -> ParamId {
        if let Some(p) = self.args.iter().position(|&b| b == buf) {
            self.params[p].write |= write;
            return p;
        }
        let b = &self.src.buffers[buf];
        let base = match (self.src.names.get(&buf), &b.kind) {
            (Some(n), _) => n.clone(),
            (None, crate::program::BufKind::Temp) => b.name.clone(),
            (None, _) if write => "out".into(),
            (None, _) => format!("in{}", self.params.len()),
        };
        let mut name = base.clone();
        let mut k = 1;
        while self.params.iter().any(|p| p.name == name) {
            name = format!("{base}{k}");
            k += 1;
        }
        self.params.push(Param { name, dtype: b.dtype, shape: b.shape.clone(), write });
        self.args.push(buf);
        self.params.len() - 1
    }

    pub fn push(&mut self, s: Stmt) {
        if let Some(b) = self.blocks.last_mut() {
            b.push(s);
        }
    }

    /// Binds `e` to a new variable (or returns it as is when trivial, or inside a lazy branch).
    pub fn bind(&mut self, ty: Ty, e: Expr) -> Expr {
        if self.lazy > 0 || matches!(e, Expr::Var(_) | Expr::Float(..) | Expr::Int(_) | Expr::Bool(_) | Expr::Ix(_)) {
            return e;
        }
        let var = self.next_var;
        self.next_var += 1;
        self.push(Stmt::Let { var, ty, value: e });
        Expr::Var(var)
    }

    /// Gives a variable a display name (`mean`), which also keeps it bound.
    pub fn name(&mut self, e: &Expr, name: &str) {
        if let Expr::Var(v) = e {
            self.names.insert(*v, name.to_string());
        }
    }

    pub fn memo_get(&self, key: &MemoKey) -> Option<Expr> {
        if self.lazy > 0 {
            return None;
        }
        self.memo.iter().rev().find_map(|m| m.get(key).cloned())
    }

    pub fn memo_put(&mut self, key: MemoKey, e: Expr) {
        if self.lazy == 0 {
            if let Some(m) = self.memo.last_mut() {
                m.insert(key, e);
            }
        }
    }

    pub fn enter_lazy(&mut self) {
        self.lazy += 1;
    }
    pub fn leave_lazy(&mut self) {
        self.lazy -= 1;
    }

    /// Opens a loop over `0..extent` (at most `max`) and returns its index variable.
    pub fn open_loop(&mut self, extent: Expr, max: usize) -> (Loop, Expr) {
        let var = self.next_loop;
        self.next_loop += 1;
        if self.bounds.loops.len() <= var as usize {
            self.bounds.loops.resize(var as usize + 1, 0);
        }
        self.bounds.loops[var as usize] = max as i64;
        self.blocks.push(Vec::new());
        self.memo.push(HashMap::new());
        (Loop { var, extent, max }, Expr::Ix(Ix::Loop(var)))
    }

    fn close(&mut self) -> Vec<Stmt> {
        self.memo.pop();
        self.blocks.pop().unwrap_or_default()
    }

    pub fn close_foreach(&mut self, lp: Loop) {
        let body = self.close();
        self.push(Stmt::ForEach { lp, body });
    }

    /// Closes a reduction loop: `value` (computed inside it) folded with `op`, bound to a var.
    pub fn close_reduce(&mut self, lp: Loop, op: ReduceOp, ty: Ty, value: Expr) -> Expr {
        let body = self.close();
        let var = self.next_var;
        self.next_var += 1;
        self.push(Stmt::Reduce { var, op, ty, lp, body, value });
        Expr::Var(var)
    }

    /// Reads element `coords` of a view.
    pub fn load_view(&mut self, view: &View, pos: &Pos) -> Expr {
        let p = self.param(view.buf, false);
        let idx = match pos {
            Pos::Lin(e) if view.is_contiguous() => self.bounds.add(Expr::Int(view.offset as i64), e.clone()),
            _ => {
                let cs = self.coords(pos, &view.shape);
                index::linearize(&self.bounds, view.offset, &cs, &view.strides)
            }
        };
        let key = MemoKey::Load(p, ExprKey(idx.clone()));
        if let Some(e) = self.memo_get(&key) {
            return e;
        }
        let ty = if self.src.buffers[view.buf].dtype.is_float() { Ty::F32 } else { Ty::I32 };
        let e = self.bind(ty, Expr::load(p, idx));
        self.memo_put(key, e.clone());
        e
    }

    pub fn store_view(&mut self, view: &View, pos: &Pos, value: Expr) {
        let p = self.param(view.buf, true);
        let cs = self.coords(pos, &view.shape);
        let idx = match pos {
            Pos::Lin(e) if view.is_contiguous() => self.bounds.add(Expr::Int(view.offset as i64), e.clone()),
            _ => index::linearize(&self.bounds, view.offset, &cs, &view.strides),
        };
        self.push(Stmt::Store { param: p, index: idx, value });
    }

    /// The coordinates of a position in a tensor of `shape`.
    pub fn coords(&self, pos: &Pos, shape: &[usize]) -> Vec<Expr> {
        match pos {
            Pos::Coords(cs) => cs.clone(),
            Pos::Lin(Expr::Ix(Ix::Elem)) if self.space_shape.as_deref() == Some(shape) => {
                shape.iter().enumerate().map(|(d, &n)| if n == 1 { Expr::Int(0) } else { Expr::Ix(Ix::Coord(d as u8)) }).collect()
            }
            Pos::Lin(e) => index::delinearize(&self.bounds, e, shape),
        }
    }

    /// The linear index of a position in a tensor of `shape`.
    pub fn lin(&self, pos: &Pos, shape: &[usize]) -> Expr {
        match pos {
            Pos::Lin(e) => e.clone(),
            Pos::Coords(cs) => {
                let canonical = self.space_shape.as_deref() == Some(shape)
                    && cs.iter().enumerate().all(|(d, c)| *c == Expr::Ix(Ix::Coord(d as u8)) || (shape[d] == 1 && *c == Expr::Int(0)));
                if canonical {
                    Expr::Ix(Ix::Elem)
                } else {
                    index::linearize(&self.bounds, 0, cs, &index::strides(shape))
                }
            }
        }
    }

    /// An index-typed view of an i32 value (a loaded id used in addressing).
    pub fn to_index(&self, e: Expr) -> Expr {
        if self.index_ty == Ty::I64 {
            Expr::cast(Ty::I64, e)
        } else {
            e
        }
    }

    pub fn finish(mut self, family: &str, space: Space, note: String) -> Result<(Kernel, Vec<BufId>), KernelError> {
        if self.blocks.len() != 1 {
            return Err(KernelError::Internal(format!("{family}: unbalanced loops")));
        }
        let names = self.names;
        let mut body = self.blocks.pop().unwrap_or_default();
        super::rounding::drop_exact_roundings(&mut body, &self.params);
        let mut stmts = super::tidy::inline_single_use(body, &|v| names.contains_key(&v));
        // operands in operand order, then outputs (each rank found once: `src.order` lists every
        // operand of the node, a multi-tensor AdamW's thousands)
        let rank = |i: usize| {
            let pos = self.src.order.iter().position(|&b| b == self.args[i]).unwrap_or(usize::MAX);
            (self.params[i].write, pos, i)
        };
        let mut perm: Vec<usize> = (0..self.params.len()).collect();
        perm.sort_by_cached_key(|&i| rank(i));
        let mut map = vec![0; perm.len()];
        for (new, &old) in perm.iter().enumerate() {
            map[old] = new;
        }
        super::tidy::remap_params(&mut stmts, &map);
        let params = perm.iter().map(|&i| self.params[i].clone()).collect();
        let args = perm.iter().map(|&i| self.args[i]).collect();
        let mut kernel =
            Kernel { family: family.to_string(), params, index_ty: self.index_ty, body: Body::Loops { space, stmts }, note, names };
        super::hoist::hoist_uniform(&mut kernel);
        Ok((kernel, args))
    }
}

/// Headroom below i32::MAX an I32 index keeps: a grid is rounded up to whole blocks of up to
/// 1024 threads, and the threads past the end compute their (out of range) index before testing
/// it, so that index must not overflow either.
pub const I32_HEADROOM: usize = 1024;

/// The index type for a kernel touching these buffers with this many iterations.
pub fn index_ty_for(sizes: impl IntoIterator<Item = usize>) -> Ty {
    if sizes.into_iter().all(|n| n <= i32::MAX as usize - I32_HEADROOM) {
        Ty::I32
    } else {
        Ty::I64
    }
}

/// A value of a node of type `d` inside a kernel: rounded to f16 / bf16 and kept in f32 (what the
/// interpreter holds for such a node), unchanged for the other types.
pub fn round_to(d: DType, e: Expr) -> Expr {
    match d {
        DType::F16 => Expr::un(UnOp::RoundF16, e),
        DType::BF16 => Expr::un(UnOp::RoundBf16, e),
        DType::F32 | DType::I32 | DType::U8 | DType::I4 => e,
    }
}

/// f32 clamp as Rust's `f32::clamp(lo, hi)`.
pub fn clamp(x: Expr, lo: f64, hi: f64) -> Expr {
    Expr::bin(BinOp::Min, Expr::bin(BinOp::Max, x, Expr::f32(lo)), Expr::f32(hi))
}

/// The scalar type computations on a tensor of `d` run in.
pub fn compute_ty(d: DType) -> Ty {
    if d.is_float() {
        Ty::F32
    } else {
        Ty::I32
    }
}

pub fn row_space(rows: usize, mapping: RowMapping) -> Space {
    Space::Rows { rows, mapping }
}
