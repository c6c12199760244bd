//! The value of a graph node at a position, as an expression: elementwise ops compose, shape ops
//! become index arithmetic, nodes in memory become loads. This is what makes a chain of ops one
//! pass over memory. Each op follows its doc in `qatc_ir::op` and the interpreter's kernel.

use qatc_ir::{BinaryOp, DType, DynMap, NodeId, Op, Points, QuantParam, QuantSpec, UnaryOp};

use super::builder::{compute_ty, pos_key, round_to, KernelBuilder, Pos};
use crate::error::KernelError;
use crate::kir::MemoKey;
use crate::kir::{BinOp, Expr, Intrinsic, Ty, UnOp};

/// Whether `value` can produce this op at any position without a pass of its own.
pub fn inlinable(op: &Op) -> bool {
    matches!(
        op,
        Op::Const { .. }
            | Op::Unary(_)
            | Op::Binary(_)
            | Op::Affine { .. }
            | Op::Cast { .. }
            | Op::Broadcast { .. }
            | Op::Reshape { .. }
            | Op::Transpose { .. }
            | Op::Slice { .. }
            | Op::Concat { .. }
            | Op::Gather
            | Op::Dequantize { .. }
            | Op::FakeQuantLearned { .. }
            | Op::FakeQuantLearnedGrad { .. }
            | Op::Dropout { .. }
            | Op::Select
            | Op::LossScale { .. }
            | Op::AdamM { .. }
            | Op::AdamV { .. }
            | Op::AdamParam { .. }
            | Op::BlockDequant { .. }
            | Op::BlockQuant { .. }
    )
}

fn int_range(d: DType) -> (i64, i64) {
    match d {
        DType::U8 => (0, 255),
        DType::I4 => (0, 15),
        DType::I32 | DType::F32 | DType::F16 | DType::BF16 => (i32::MIN as i64, i32::MAX as i64),
    }
}

/// The part that position `c` falls in, as a balanced tree of lazy selects on the parts' ends:
/// log2(parts) compares per element rather than one per part (the multi-tensor AdamW concatenates
/// every trainable tensor's update, 84 parts for the tiny model). Up to three parts this is the
/// plain chain `c < e0 ? p0 : c < e1 ? p1 : p2`.
fn select_tree(c: &Expr, mut parts: Vec<(usize, Expr)>) -> Expr {
    if parts.len() == 1 {
        return parts.pop().map(|p| p.1).unwrap_or(Expr::Int(0));
    }
    let right = parts.split_off(parts.len() / 2);
    let end = parts.last().map_or(0, |p| p.0);
    Expr::select(Expr::bin(BinOp::Lt, c.clone(), Expr::Int(end as i64)), select_tree(c, parts), select_tree(c, right))
}

fn f(v: f64) -> Expr {
    Expr::f32(v)
}

/// An 8-bit moment's value (`quant::block_dequant`): its code's map value times its block's absmax.
pub fn block_dequant(map: DynMap, code: Expr, absmax: Expr) -> Expr {
    Expr::bin(BinOp::Mul, Expr::Call(Intrinsic::DynValue(map), vec![code]), absmax)
}

/// The code of `x` in a block of absmax `a` (`quant::block_quant`): the map value nearest to
/// x / a (of 0 when the block is all zeros). `a` is read twice: bind it first.
pub fn block_quant(map: DynMap, x: Expr, a: Expr) -> Expr {
    let y = Expr::select(Expr::bin(BinOp::Lt, f(0.0), a.clone()), Expr::bin(BinOp::Div, x, a), f(0.0));
    Expr::Call(Intrinsic::DynNearest(map), vec![y])
}

impl KernelBuilder<'_> {
    /// The value of `node` at `pos` (a position in the node's own shape).
    pub fn value(&mut self, node: NodeId, pos: &Pos) -> Result<Expr, KernelError> {
        let key = pos_key(node, pos);
        if let Some(e) = self.subst.get(&key) {
            return Ok(e.clone());
        }
        if let Some(view) = self.src.leaves.get(&node).cloned() {
            return Ok(self.load_view(&view, pos));
        }
        let memo = MemoKey::Value(key.0, key.1);
        if let Some(e) = self.memo_get(&memo) {
            return Ok(e);
        }
        let n = self.src.g.node(node);
        let (op, ty) = (n.op.clone(), n.ty.clone());
        let ops = self.src.g.operands(node);
        let shape = ty.shape.0.clone();
        let arg = |i: usize| ops.get(i).copied().ok_or_else(|| KernelError::Internal(format!("{} lacks operand {i}", op.mnemonic())));
        let e = match &op {
            Op::Const { value, dtype, .. } => {
                if dtype.is_float() {
                    f(*value)
                } else {
                    Expr::Int(*value as i64)
                }
            }
            Op::Unary(u) => {
                let x = self.value(arg(0)?, pos)?;
                unary(*u, x)
            }
            Op::Binary(b) => {
                let x = self.value(arg(0)?, pos)?;
                let y = self.value(arg(1)?, pos)?;
                binary(*b, x, y)
            }
            Op::Affine { mul, add } => {
                let x = self.value(arg(0)?, pos)?;
                let scaled = if *mul == 1.0 { x } else { Expr::bin(BinOp::Mul, x, f(*mul)) };
                if *add == 0.0 {
                    scaled
                } else {
                    Expr::bin(BinOp::Add, scaled, f(*add))
                }
            }
            Op::Cast { to } => {
                let src = arg(0)?;
                let x = self.value(src, pos)?;
                cast(self.src.g.ty(src).dtype, *to, x)
            }
            Op::Broadcast { .. } => {
                let src = arg(0)?;
                let in_shape = self.src.g.ty(src).shape.0.clone();
                let cs = self.coords(pos, &shape);
                let off = shape.len() - in_shape.len();
                let ics = in_shape.iter().enumerate().map(|(i, &d)| if d == 1 { Expr::Int(0) } else { cs[i + off].clone() }).collect();
                self.value(src, &Pos::Coords(ics))?
            }
            Op::Reshape { .. } => {
                let lin = self.lin(pos, &shape);
                self.value(arg(0)?, &Pos::Lin(lin))?
            }
            Op::Transpose { perm } => {
                let cs = self.coords(pos, &shape);
                let mut ics = vec![Expr::Int(0); cs.len()];
                for (i, &p) in perm.iter().enumerate() {
                    ics[p] = cs[i].clone();
                }
                self.value(arg(0)?, &Pos::Coords(ics))?
            }
            Op::Slice { axis, start, .. } => {
                let mut cs = self.coords(pos, &shape);
                cs[*axis] = self.bounds.add(cs[*axis].clone(), Expr::Int(*start as i64));
                self.value(arg(0)?, &Pos::Coords(cs))?
            }
            Op::Concat { axis } => self.concat(&ops, *axis, pos, &shape)?,
            Op::Gather => {
                // (table [V, C], ids [..]) -> [.., C]; ids are clamped into the table so a bad id
                // reads a wrong row rather than foreign memory (the interpreter rejects it).
                let (table, ids) = (arg(0)?, arg(1)?);
                let v = self.src.g.ty(table).shape.0[0] as i64;
                let cs = self.coords(pos, &shape);
                let (last, lead) = cs.split_last().ok_or_else(|| KernelError::Internal("gather of a scalar".into()))?;
                let id = self.value(ids, &Pos::Coords(lead.to_vec()))?;
                let clamped = Expr::bin(BinOp::Min, Expr::bin(BinOp::Max, id, Expr::Int(0)), Expr::Int(v - 1));
                let row = self.bind(Ty::I32, clamped);
                let row = self.to_index(row);
                self.value(table, &Pos::Coords(vec![row, last.clone()]))?
            }
            Op::Dequantize { spec, .. } => self.dequantize(*spec, &ops, pos, &shape)?,
            Op::FakeQuantLearned { spec } => self.learned(*spec, None, &ops, pos, &shape)?,
            Op::FakeQuantLearnedGrad { spec, wrt } => self.learned(*spec, Some(*wrt), &ops, pos, &shape)?,
            Op::Dropout { p, stream } => {
                let x = self.value(arg(0)?, pos)?;
                let seed = self.value(arg(1)?, &Pos::Coords(vec![]))?;
                let i = self.lin(pos, &shape);
                let keep = Expr::Call(Intrinsic::DropoutKeep { stream: *stream as u64 }, vec![seed, i, Expr::Float(*p, Ty::F64)]);
                let k = 1.0 / (1.0 - p);
                Expr::select(keep, Expr::bin(BinOp::Mul, x, f(k)), f(0.0))
            }
            Op::AdamM { beta1 } => {
                let (m, g) = (self.value(arg(0)?, pos)?, self.value(arg(1)?, pos)?);
                Expr::bin(BinOp::Add, Expr::bin(BinOp::Mul, f(*beta1), m), Expr::bin(BinOp::Mul, f(1.0 - beta1), g))
            }
            Op::AdamV { beta2 } => {
                let (v, g) = (self.value(arg(0)?, pos)?, self.value(arg(1)?, pos)?);
                let g2 = Expr::bin(BinOp::Mul, Expr::bin(BinOp::Mul, f(1.0 - beta2), g.clone()), g);
                Expr::bin(BinOp::Add, Expr::bin(BinOp::Mul, f(*beta2), v), g2)
            }
            Op::AdamParam { beta1, beta2, eps, weight_decay } => self.adam_param(&ops, pos, [*beta1, *beta2, *eps, *weight_decay])?,
            // a where cond != 0 (NaN included: `Ne` is unordered), else b
            Op::Select => {
                let c = self.value(arg(0)?, pos)?;
                let (a, b) = (self.value(arg(1)?, pos)?, self.value(arg(2)?, pos)?);
                Expr::select(Expr::bin(BinOp::Ne, c, f(0.0)), a, b)
            }
            Op::LossScale { interval, growth, backoff } => self.loss_scale(&ops, pos, *interval, *growth, *backoff)?,
            // 8-bit moments (`quant::block_dequant` / `block_quant`): element i's block is i / BLOCK
            Op::BlockDequant { map } => {
                let code = self.value(arg(0)?, pos)?;
                let block = Pos::Coords(vec![self.bounds.div(self.lin(pos, &shape), qatc_ir::qmap::BLOCK as i64)]);
                let absmax = self.value(arg(1)?, &block)?;
                block_dequant(*map, code, absmax)
            }
            Op::BlockQuant { map } => {
                let x = self.value(arg(0)?, pos)?;
                let block = Pos::Coords(vec![self.bounds.div(self.lin(pos, &shape), qatc_ir::qmap::BLOCK as i64)]);
                let a = self.value(arg(1)?, &block)?;
                let a = self.bind(Ty::F32, a);
                block_quant(*map, x, a)
            }
            _ => {
                return Err(KernelError::Internal(format!(
                    "{} must be computed by a kernel of its own before it is read",
                    self.src.g.describe(node)
                )))
            }
        };
        // an f16/bf16 node's value is rounded to its type, as the interpreter does
        let e = if self.src.leaves.contains_key(&node) { e } else { round_to(ty.dtype, e) };
        let e = self.bind(compute_ty(ty.dtype), e);
        match op {
            Op::AdamM { .. } => self.name(&e, "m_next"),
            Op::AdamV { .. } => self.name(&e, "v_next"),
            _ => {}
        }
        self.memo_put(memo, e.clone());
        Ok(e)
    }

    fn concat(&mut self, ops: &[NodeId], axis: usize, pos: &Pos, shape: &[usize]) -> Result<Expr, KernelError> {
        let cs = self.coords(pos, shape);
        let c = cs[axis].clone();
        // The last part is the fallback; each earlier one is chosen by `c < end`. Branches are
        // lazy: a part is read only where it lies.
        let mut parts = Vec::new();
        let mut start = 0usize;
        self.enter_lazy();
        for &o in ops {
            let len = self.src.g.ty(o).shape.0[axis];
            let mut ics = cs.clone();
            ics[axis] = if start == 0 { c.clone() } else { Expr::bin(BinOp::Sub, c.clone(), Expr::Int(start as i64)) };
            let v = self.value(o, &Pos::Coords(ics));
            parts.push((start + len, v));
            start += len;
        }
        self.leave_lazy();
        let parts = parts.into_iter().map(|(end, v)| v.map(|v| (end, v))).collect::<Result<Vec<_>, _>>()?;
        if parts.is_empty() {
            return Err(KernelError::Internal("concat of nothing".into()));
        }
        Ok(select_tree(&c, parts))
    }

    /// `quant::dequant_one` for element (i, j) of codes [in, out]: group i / G.
    fn dequantize(&mut self, spec: QuantSpec, ops: &[NodeId], pos: &Pos, shape: &[usize]) -> Result<Expr, KernelError> {
        let cs = self.coords(pos, shape);
        let (n_in, g) = (shape[0], spec.group_for(shape[0]));
        let _ = n_in;
        let group = Pos::Coords(vec![self.bounds.div(cs[0].clone(), g as i64), cs[1].clone()]);
        let code = self.value(ops[0], pos)?;
        let scale = self.value(ops[1], &group)?;
        let c = Expr::cast(Ty::F32, code.clone());
        Ok(match spec.grid().points {
            Points::Offset(o) => Expr::bin(BinOp::Mul, Expr::bin(BinOp::Sub, c, f(f64::from(o))), scale),
            Points::ZeroPoint => {
                let zp = *ops.get(2).ok_or_else(|| KernelError::Internal("asym dequantize without zero points".into()))?;
                let z = self.value(zp, &group)?;
                Expr::bin(BinOp::Mul, scale, Expr::bin(BinOp::Sub, c, z))
            }
            // the one table grid, NF4, which every backend's `Nf4Value` reads
            Points::Table(_) => Expr::bin(BinOp::Mul, Expr::Call(Intrinsic::Nf4Value, vec![code]), scale),
        })
    }

    /// `torch._amp_update_scale_` on [scale, good steps] (element `pos` of the new state), in f32
    /// as the interpreter's `scaling::loss_scale`. A value is finite when `v - v == 0` (false for
    /// infinities and NaN; kernels are compiled without fast-math, so this is not folded away).
    fn loss_scale(&mut self, ops: &[NodeId], pos: &Pos, interval: usize, growth: f64, backoff: f64) -> Result<Expr, KernelError> {
        let scale = self.value(ops[0], &Pos::Lin(Expr::Int(0)))?;
        let good = self.value(ops[0], &Pos::Lin(Expr::Int(1)))?;
        let finite = self.value(ops[1], &Pos::Coords(vec![]))?;
        let next = self.bind(Ty::F32, Expr::bin(BinOp::Add, good, f(1.0)));
        let grown = self.bind(Ty::F32, Expr::bin(BinOp::Mul, scale.clone(), f(growth)));
        let grown_ok = Expr::bin(BinOp::Eq, Expr::bin(BinOp::Sub, grown.clone(), grown.clone()), f(0.0));
        let skipped = self.bind(Ty::Bool, Expr::bin(BinOp::Eq, finite, f(0.0)));
        let grows = self.bind(Ty::Bool, Expr::bin(BinOp::Eq, next.clone(), f(interval as f64)));
        let new_scale = Expr::select(
            skipped.clone(),
            Expr::bin(BinOp::Mul, scale.clone(), f(backoff)),
            Expr::select(grows.clone(), Expr::select(grown_ok, grown, scale.clone()), scale),
        );
        let new_good = Expr::select(skipped, f(0.0), Expr::select(grows, f(0.0), next));
        let i = self.lin(pos, &[2]);
        Ok(Expr::select(Expr::bin(BinOp::Eq, i, Expr::Int(0)), new_scale, new_good))
    }

    /// `quant::point` for element (i, j) of w [in, out] (group i / G): the learned fake-quant's
    /// value, or with `wrt` that part of its gradient (operands w, scales[, zeros], dy).
    fn learned(
        &mut self,
        spec: QuantSpec,
        wrt: Option<QuantParam>,
        ops: &[NodeId],
        pos: &Pos,
        shape: &[usize],
    ) -> Result<Expr, KernelError> {
        let cs = self.coords(pos, shape);
        let group = Pos::Coords(vec![self.bounds.div(cs[0].clone(), spec.group_for(shape[0]) as i64), cs[1].clone()]);
        let w = self.value(ops[0], pos)?;
        let scale = self.value(ops[1], &group)?;
        let s = self.bind(Ty::F32, Expr::Call(Intrinsic::F16Round, vec![scale]));
        let grid = spec.grid();
        let (lo, hi) = if grid.points == Points::ZeroPoint {
            let zp = *ops.get(2).ok_or_else(|| KernelError::Internal("asym learned fake-quant without zero points".into()))?;
            let z = self.value(zp, &group)?;
            let top = f64::from(grid.max_code);
            // `quant::zero_point` and `Grid::range`, with z a kernel value
            let z = self.bind(Ty::F32, Expr::bin(BinOp::Min, Expr::bin(BinOp::Max, Expr::un(UnOp::RoundEven, z), f(0.0)), f(top)));
            (Expr::un(UnOp::Neg, z.clone()), Expr::bin(BinOp::Sub, f(top), z))
        } else {
            let (lo, hi) = grid.range(0.0);
            (f(lo), f(hi))
        };
        let (lo, hi) = (self.bind(Ty::F32, lo), self.bind(Ty::F32, hi));
        let zero_scale = self.bind(Ty::Bool, Expr::bin(BinOp::Eq, s.clone(), f(0.0)));
        let x = self.bind(Ty::F32, Expr::bin(BinOp::Div, w, s.clone()));
        let q = match grid.points {
            Points::Table(_) => Expr::Call(Intrinsic::Nf4Value, vec![Expr::Call(Intrinsic::Nf4Nearest, vec![x.clone()])]),
            Points::Offset(_) | Points::ZeroPoint => {
                Expr::bin(BinOp::Min, Expr::bin(BinOp::Max, Expr::un(UnOp::RoundEven, x.clone()), lo.clone()), hi.clone())
            }
        };
        // a zero scale: q = 0 and nothing inside (x is not a number there)
        let q = self.bind(Ty::F32, Expr::select(zero_scale.clone(), f(0.0), q));
        let in_range = Expr::bin(BinOp::And, Expr::bin(BinOp::Le, lo, x.clone()), Expr::bin(BinOp::Le, x.clone(), hi));
        let inside = || Expr::bin(BinOp::And, Expr::un(UnOp::Not, zero_scale.clone()), in_range.clone());
        let dy = match wrt {
            Some(_) => {
                Some(self.value(*ops.last().ok_or_else(|| KernelError::Internal("learned fake-quant gradient without dy".into()))?, pos)?)
            }
            None => None,
        };
        Ok(match (wrt, dy) {
            (None, _) => Expr::bin(BinOp::Mul, q, s),
            (Some(QuantParam::Weight), Some(dy)) => Expr::select(inside(), dy, f(0.0)),
            (Some(QuantParam::Scale), Some(dy)) => {
                Expr::bin(BinOp::Mul, dy, Expr::select(inside(), Expr::bin(BinOp::Sub, q.clone(), x), q))
            }
            (Some(QuantParam::Zero), Some(dy)) => Expr::select(inside(), f(0.0), Expr::un(UnOp::Neg, Expr::bin(BinOp::Mul, s, dy))),
            (Some(_), None) => return Err(KernelError::Internal("learned fake-quant gradient without dy".into())),
        })
    }

    /// PyTorch's AdamW step, scalars formed in f64 as the interpreter does (`adam_param`).
    fn adam_param(&mut self, ops: &[NodeId], pos: &Pos, h: [f64; 4]) -> Result<Expr, KernelError> {
        let [beta1, beta2, eps, wd] = h;
        let p = self.value(ops[0], pos)?;
        let m = self.value(ops[1], pos)?;
        let v = self.value(ops[2], pos)?;
        let lr = self.value(ops[3], &Pos::Coords(vec![]))?;
        let t = self.value(ops[4], &Pos::Coords(vec![]))?;
        let d = |x: f64| Expr::Float(x, Ty::F64);
        let lr = self.bind(Ty::F64, Expr::cast(Ty::F64, lr));
        let t = self.bind(Ty::F64, Expr::cast(Ty::F64, t));
        let bc1 = self.bind(Ty::F64, Expr::bin(BinOp::Sub, d(1.0), Expr::bin(BinOp::Pow, d(beta1), t.clone())));
        let bc2 = self.bind(Ty::F64, Expr::bin(BinOp::Sub, d(1.0), Expr::bin(BinOp::Pow, d(beta2), t.clone())));
        let decay = self.bind(Ty::F32, Expr::cast(Ty::F32, Expr::bin(BinOp::Sub, d(1.0), Expr::bin(BinOp::Mul, lr.clone(), d(wd)))));
        let step = self.bind(Ty::F32, Expr::cast(Ty::F32, Expr::bin(BinOp::Div, lr.clone(), bc1.clone())));
        let bc2_sqrt = self.bind(Ty::F32, Expr::cast(Ty::F32, Expr::un(UnOp::Sqrt, bc2.clone())));
        let denom = Expr::bin(BinOp::Add, Expr::bin(BinOp::Div, Expr::un(UnOp::Sqrt, v), bc2_sqrt.clone()), f(eps));
        let denom = self.bind(Ty::F32, denom);
        for (e, n) in [
            (&lr, "lr"),
            (&t, "t"),
            (&bc1, "bias1"),
            (&bc2, "bias2"),
            (&decay, "decay"),
            (&step, "step_size"),
            (&bc2_sqrt, "bias2_sqrt"),
            (&denom, "denom"),
        ] {
            self.name(e, n);
        }
        Ok(Expr::bin(BinOp::Sub, Expr::bin(BinOp::Mul, p, decay), Expr::bin(BinOp::Mul, step, Expr::bin(BinOp::Div, m, denom))))
    }
}

pub fn unary(u: UnaryOp, x: Expr) -> Expr {
    match u {
        UnaryOp::Neg => Expr::un(UnOp::Neg, x),
        UnaryOp::Exp => Expr::un(UnOp::Exp, x),
        UnaryOp::Log => Expr::un(UnOp::Log, x),
        UnaryOp::Sqrt => Expr::un(UnOp::Sqrt, x),
        // 1 / sqrt(x) exactly as the interpreter (CUDA's rsqrtf is approximate)
        UnaryOp::Rsqrt => Expr::bin(BinOp::Div, f(1.0), Expr::un(UnOp::Sqrt, x)),
        UnaryOp::Recip => Expr::bin(BinOp::Div, f(1.0), x),
        UnaryOp::Tanh => Expr::un(UnOp::Tanh, x),
        UnaryOp::Square => Expr::bin(BinOp::Mul, x.clone(), x),
        UnaryOp::Gelu => Expr::un(UnOp::Gelu, x),
    }
}

pub fn binary(b: BinaryOp, x: Expr, y: Expr) -> Expr {
    let op = match b {
        BinaryOp::Add => BinOp::Add,
        BinaryOp::Sub => BinOp::Sub,
        BinaryOp::Mul => BinOp::Mul,
        BinaryOp::Div => BinOp::Div,
        BinaryOp::Max => BinOp::Max,
        BinaryOp::Min => BinOp::Min,
        BinaryOp::GeluGrad => BinOp::GeluGrad,
    };
    Expr::bin(op, x, y)
}

/// `Op::Cast`: float -> int truncates and saturates at the type's range (NaN -> 0); int -> int
/// saturates; anything -> float converts (f16/bf16 rounding happens on the node's value).
fn cast(from: DType, to: DType, x: Expr) -> Expr {
    match (from.is_float(), to.is_float()) {
        (_, true) if !from.is_float() => Expr::cast(Ty::F32, x),
        (_, true) => x,
        (is_float, false) => {
            let i = if is_float { Expr::cast(Ty::I32, x) } else { x };
            let (lo, hi) = int_range(to);
            if (lo, hi) == (i32::MIN as i64, i32::MAX as i64) {
                i
            } else {
                Expr::bin(BinOp::Min, Expr::bin(BinOp::Max, i, Expr::Int(lo)), Expr::Int(hi))
            }
        }
    }
}
