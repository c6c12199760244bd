//! 8-bit AdamW (`--optim adamw8bit`) inside the in-place AdamW (`adamw.rs`). The step's graph
//! dequantizes a tensor's moments (`block_dequant` of its u8 codes and f32 absmax per block of
//! `qmap::BLOCK`), updates them and the weight in f32 in the multi-tensor AdamW, and requantizes
//! each new moment (`block_absmax`, then `block_quant` with it) into the codes' and absmax' update
//! outputs. Lowered node by node, that holds every 8-bit tensor's moments in f32 twice over (the
//! dequantized copy and the pack's new value), four times the bytes 8-bit AdamW saves.
//!
//! Here one kernel per tensor does all of it over its own storage, one program per block: it reads
//! the block's old absmax, folds the new moments' absolute maxima over the block (each element's
//! moments dequantized and updated in registers), stores the new absmax, then visits each element
//! once more, recomputing its new moments and weight (the same f32 expression, so the same bits),
//! and writes the weight and the two codes over themselves. The maxima are `Max` reductions, which
//! give the same value in any order, so the kernel is deterministic on every backend. Nothing
//! of the moments is ever held in f32 outside registers, as the memory plan counts them (a byte per
//! element and an f32 per block).
//!
//! This applies only where nothing else can see it: the codes and absmax are read by the
//! dequantization alone, which the AdamW node alone reads, and the new moment (its slice of the
//! pack) is read by its requantization alone, whose results are the codes' and absmax' updates
//! ([`moment`]); [`check_in_place`] checks the kernel built.

use std::collections::{HashMap, HashSet};

use qatc_ir::{qmap, DynMap, Graph, KernelFamily, NodeId, Op};

use super::builder::{pos_key, KernelBuilder, Pos};
use super::inline::{block_dequant, block_quant};
use super::repeats::{self, Repeats};
use super::{Ctx, Lowerer};
use crate::error::KernelError;
use crate::kir::{BinOp, Body, Expr, Ix, Kernel, ReduceOp, RowMapping, Space, Stmt, Ty, UnOp};
use crate::program::{BufId, View};

/// An 8-bit moment the blockwise kernel reads and writes: its codes' and absmax' buffers (state
/// inputs), its map, and the graph nodes the kernel computes (the requantization's results:
/// the inputs' views; the dequantization and the pack's slices: nothing).
pub struct Moment8 {
    pub codes: View,
    pub absmax: View,
    pub map: DynMap,
    pub absorbed: Vec<(NodeId, Option<View>)>,
}

/// Whether `id` is a dequantization of 8-bit moments whose only readers are multi-tensor AdamW
/// nodes: the lowering leaves it for them (`adamw::lower`), and lowers it where it is needed
/// otherwise.
pub fn deferred(g: &Graph, id: NodeId) -> bool {
    matches!(g.node(id).op, Op::BlockDequant { .. })
        && g.users(id).iter().all(|&u| matches!(&g.node(u).op, Op::Kernel { family: KernelFamily::AdamWMultiTensor, .. }))
}

fn only_user(g: &Graph, n: NodeId, user: NodeId) -> bool {
    let us = g.users(n);
    !us.is_empty() && us.iter().all(|&u| u == user)
}

/// What [`moment`] asks of the graph about one AdamW node for each of its thousands of parts,
/// found once: its slices by start, and the outputs each node is (name, whether an update).
pub struct PackIndex {
    slices: HashMap<usize, Vec<NodeId>>,
    outputs: HashMap<NodeId, Vec<(bool, Option<String>)>>,
}

impl PackIndex {
    pub fn of(g: &Graph, id: NodeId) -> PackIndex {
        let mut slices: HashMap<usize, Vec<NodeId>> = HashMap::new();
        for u in g.users(id) {
            if let Op::Slice { axis: 0, start, .. } = g.node(u).op {
                slices.entry(start).or_default().push(u);
            }
        }
        let mut outputs: HashMap<NodeId, Vec<(bool, Option<String>)>> = HashMap::new();
        for o in g.outputs() {
            outputs.entry(o.node).or_default().push((o.update, Some(o.name.clone())));
        }
        PackIndex { slices, outputs }
    }
}

/// The 8-bit moment that operand `d` of AdamW node `id` dequantizes and the part of the pack at
/// `start` requantizes, when the blockwise kernel may do both over the state (see the module doc).
/// `index` is `id`'s [`PackIndex`].
pub fn moment(
    g: &Graph,
    (id, index): (NodeId, &PackIndex),
    d: NodeId,
    start: usize,
    view_of: &dyn Fn(NodeId) -> Option<View>,
) -> Option<Moment8> {
    let Op::BlockDequant { map } = g.node(d).op else { return None };
    let [codes, absmax] = g.operands(d)[..] else { return None };
    let is_input = |n: NodeId| matches!(g.node(n).op, Op::Input { .. });
    if !is_input(codes) || !is_input(absmax) || !only_user(g, codes, d) || !only_user(g, absmax, d) || !only_user(g, d, id) {
        return None;
    }
    // the pack's slice, through reshapes, read by block_absmax and block_quant alone
    let [slice] = index.slices.get(&start).map_or(&[][..], Vec::as_slice)[..] else { return None };
    let mut chain = vec![slice];
    let mut x = slice;
    loop {
        let us: HashSet<NodeId> = g.users(x).into_iter().collect();
        match us.iter().next() {
            Some(&u) if us.len() == 1 && matches!(g.node(u).op, Op::Reshape { .. }) => {
                chain.push(u);
                x = u;
            }
            _ => break,
        }
    }
    let users: HashSet<NodeId> = g.users(x).into_iter().collect();
    let a = *users.iter().find(|&&u| matches!(g.node(u).op, Op::BlockAbsMax))?;
    let q = *users.iter().find(|&&u| matches!(g.node(u).op, Op::BlockQuant { map: m } if m == map))?;
    if users.len() != 2 || g.operands(q) != [x, a] || !only_user(g, a, q) || g.ty(x).numel() != g.ty(codes).numel() {
        return None;
    }
    // their results are the state's updates, and nothing else of them is an output
    let name = |n: NodeId| g.node(n).name.clone();
    let update_of = |n: NodeId| index.outputs.get(&n).map_or(&[][..], Vec::as_slice);
    if update_of(q) != [(true, name(codes))] || update_of(a) != [(true, name(absmax))] || chain.iter().any(|&c| !update_of(c).is_empty()) {
        return None;
    }
    let (cv, av) = (view_of(codes)?, view_of(absmax)?);
    if !cv.is_contiguous() || cv.offset != 0 || !av.is_contiguous() || av.offset != 0 {
        return None;
    }
    let mut absorbed: Vec<(NodeId, Option<View>)> = chain.into_iter().map(|c| (c, None)).collect();
    absorbed.extend([(d, None), (a, Some(av.clone())), (q, Some(cv.clone()))]);
    Some(Moment8 { codes: cv, absmax: av, map, absorbed })
}

/// The position of element `j` of the row's block.
fn at(kb: &KernelBuilder, j: &Expr) -> Pos {
    let b = &kb.bounds;
    Pos::Lin(b.add(b.mul(Expr::Ix(Ix::Row), qmap::BLOCK as i64), j.clone()))
}

/// Makes the body inputs of the 8-bit moments read as their dequantized codes at `pos`.
fn dequantize_at(kb: &mut KernelBuilder, moments: &[(NodeId, &Moment8, Expr)], pos: &Pos) {
    for (inp, m, old) in moments {
        let code = kb.load_view(&m.codes, pos);
        let v = kb.bind(Ty::F32, block_dequant(m.map, code, old.clone()));
        kb.subst.insert(pos_key(*inp, pos), v);
    }
}

/// One tensor's update, blockwise: `writes` are the (body input, new value) pairs of the weight
/// and its two moments, `eight` the 8-bit ones among them (None: written over its input as f32).
/// Tensors alike but for their buffers share one build (`repeats.rs`): `places` is the operand
/// order's (`repeats::order_places`).
pub fn lower_tensor(
    lw: &mut Lowerer,
    cx: &mut Ctx,
    (places, rep): (&HashMap<BufId, usize>, &mut Repeats<String>),
    family: &str,
    param: NodeId,
    writes: &[(NodeId, NodeId)],
    eight: &[Option<&Moment8>],
) -> Result<(), KernelError> {
    for (i, (&(inp, _), m)) in writes.iter().zip(eight).enumerate() {
        let role = ["p", "m", "v"].get(i).copied().unwrap_or("s");
        match m {
            Some(m) => {
                cx.names.insert(m.codes.buf, format!("{role}8"));
                cx.names.insert(m.absmax.buf, format!("{role}_absmax"));
            }
            None => {
                let Some(v) = cx.leaves.get(&inp) else { return Err(KernelError::Internal(format!("adamw: {role} has no buffer"))) };
                cx.names.insert(v.buf, role.to_string());
            }
        }
    }
    // what decides the kernel: the body from the writes, the 8-bit moments' codes and absmax
    // (their inputs read through them) and maps
    let more = repeats::More {
        views: eight.iter().flatten().flat_map(|m| [&m.codes, &m.absmax]).collect(),
        inputs: writes.iter().zip(eight).filter(|(_, m)| m.is_some()).map(|(w, _)| w.0).collect(),
        what: format!("blockwise {:?}", eight.iter().map(|m| m.map(|m| m.map)).collect::<Vec<_>>()),
    };
    let roots: Vec<NodeId> = writes.iter().flat_map(|&(inp, new)| [inp, new]).collect();
    let (key, slots) = repeats::body_key(lw, cx, places, &roots, &more);
    // the launch's note names the tensor's gradient
    let note = format!("{}, blockwise: written over p and the 8-bit moments", lw.note(cx, param, None));
    let cx = &*cx;
    rep.launch(lw, key, &slots, Some(note.clone()), |lw| tensor_kernel(lw, cx, family, param, (writes, eight), note))
}

/// The blockwise kernel of [`lower_tensor`].
fn tensor_kernel(
    lw: &Lowerer,
    cx: &Ctx,
    family: &str,
    param: NodeId,
    (writes, eight): (&[(NodeId, NodeId)], &[Option<&Moment8>]),
    note: String,
) -> Result<(Kernel, Vec<BufId>), KernelError> {
    let n = cx.g.ty(param).numel();
    let (bl, rows) = (qmap::BLOCK, qmap::blocks(n));
    let mut dests: Vec<&View> = Vec::new();
    for (&(inp, _), m) in writes.iter().zip(eight) {
        match m {
            Some(m) => dests.extend([&m.codes, &m.absmax]),
            None => dests.extend(cx.leaves.get(&inp)),
        }
    }
    let mut kb = lw.kb_rows(cx, rows, &dests);
    // the old absmax first: the new one is stored over it before the elements are rewritten
    let mut moments: Vec<(NodeId, &Moment8, Expr)> = Vec::new();
    for (&(inp, _), m) in writes.iter().zip(eight) {
        if let Some(m) = m {
            let old = kb.load_view(&m.absmax, &Pos::Lin(Expr::Ix(Ix::Row)));
            moments.push((inp, m, old));
        }
    }
    let left = Expr::bin(BinOp::Sub, Expr::Int(n as i64), Expr::bin(BinOp::Mul, Expr::Ix(Ix::Row), Expr::Int(bl as i64)));
    let extent = Expr::bin(BinOp::Min, Expr::Int(bl as i64), left);
    // the block's new absmax of each 8-bit moment (`block_absmax`: the maximum of |x|)
    let mut absmax = HashMap::new();
    for (&(inp, new), m) in writes.iter().zip(eight) {
        let Some(m) = m else { continue };
        let (lp, j) = kb.open_loop(extent.clone(), bl);
        let pos = at(&kb, &j);
        let own: Vec<(NodeId, &Moment8, Expr)> = moments.iter().filter(|x| x.0 == inp).cloned().collect();
        dequantize_at(&mut kb, &own, &pos);
        let x = kb.value(new, &pos)?;
        let a = kb.close_reduce(lp, ReduceOp::Max, Ty::F32, Expr::un(UnOp::Abs, x));
        kb.name(&a, "absmax");
        kb.store_view(&m.absmax, &Pos::Lin(Expr::Ix(Ix::Row)), a.clone());
        absmax.insert(inp, a);
    }
    // each element: the new weight and f32 moments over themselves, the 8-bit ones requantized
    let (lp, j) = kb.open_loop(extent, bl);
    let pos = at(&kb, &j);
    dequantize_at(&mut kb, &moments, &pos);
    let mut stores = Vec::new();
    for (&(inp, new), m) in writes.iter().zip(eight) {
        let x = kb.value(new, &pos)?;
        match (m, absmax.get(&inp)) {
            (Some(m), Some(a)) => stores.push((m.codes.clone(), block_quant(m.map, x, a.clone()))),
            _ => stores.push((cx.leaves[&inp].clone(), x)),
        }
    }
    for (d, v) in stores {
        kb.store_view(&d, &pos, v);
    }
    kb.close_foreach(lp);
    let space = Space::Rows { rows, mapping: RowMapping::Block };
    let (kernel, args) = kb.finish(family, space, note)?;
    check_in_place(&kernel)?;
    Ok((kernel, args))
}

/// Replaces loop variable `from` by `to` in `e`.
fn rename_loop(e: &Expr, from: u8, to: u8) -> Expr {
    let mut e = e.clone();
    fn walk(e: &mut Expr, from: u8, to: u8) {
        if *e == Expr::Ix(Ix::Loop(from)) {
            *e = Expr::Ix(Ix::Loop(to));
        }
        e.for_each_child_mut(|c| walk(c, from, to));
    }
    walk(&mut e, from, to);
    e
}

/// Checks that blockwise kernel `k` reads what it writes before writing it, each program within
/// its own block: before its last loop, the written params are only read (in reductions over the
/// block, at the same index as the last loop writes them, renamed to the reduction's loop) except
/// per-row ones, read at the row before they are stored at it; in the last loop, each written param
/// is read only at the index it is stored at, before the store.
pub fn check_in_place(k: &Kernel) -> Result<(), KernelError> {
    let err = |msg: String| Err(KernelError::Internal(format!("{}: not a blockwise in-place update: {msg}", k.family)));
    let Body::Loops { space: Space::Rows { .. }, stmts } = &k.body else { return err("not a row kernel".into()) };
    let Some((Stmt::ForEach { lp, body }, before)) = stmts.split_last() else { return err("no last loop".into()) };
    let written = |p: usize| k.params[p].write;
    // the last loop: the index each element param is stored at
    let mut index: HashMap<usize, Expr> = HashMap::new();
    let mut stored: HashSet<usize> = HashSet::new();
    for s in body {
        let mut bad = None;
        let mut check = |e: &Expr, stored: &HashSet<usize>| {
            e.visit(&mut |x| {
                if let Expr::Load { param, index: i } = x {
                    if written(*param) && (stored.contains(param) || body_store(body, *param).is_none_or(|w| w != **i)) {
                        bad = Some(*param);
                    }
                }
            })
        };
        match s {
            Stmt::Let { value, .. } => check(value, &stored),
            Stmt::Store { param, index: i, value } => {
                check(value, &stored);
                if index.insert(*param, i.clone()).is_some() {
                    return err(format!("{} stored twice", k.params[*param].name));
                }
                stored.insert(*param);
            }
            _ => return err("a nested loop or an atomic in the last loop".into()),
        }
        if let Some(p) = bad {
            return err(format!("{} is read in the last loop after it is written, or off its element", k.params[p].name));
        }
    }
    // before it: element params read in reductions at their own element; row params at the row
    let row = Expr::Ix(Ix::Row);
    let mut row_stored: HashSet<usize> = HashSet::new();
    let mut bad = None;
    for s in before {
        let loads_ok = |e: &Expr, inner: Option<u8>, row_stored: &HashSet<usize>, bad: &mut Option<usize>| {
            e.visit(&mut |x| {
                if let Expr::Load { param, index: i } = x {
                    if !written(*param) {
                        return;
                    }
                    let ok = match (index.get(param), inner) {
                        (Some(w), Some(l)) => rename_loop(w, lp.var, l) == **i,
                        (None, _) => **i == row && !row_stored.contains(param),
                        (Some(_), None) => false,
                    };
                    if !ok {
                        *bad = Some(*param);
                    }
                }
            })
        };
        match s {
            Stmt::Let { value, .. } => loads_ok(value, None, &row_stored, &mut bad),
            Stmt::Reduce { lp: rl, body: rb, value, .. } => {
                loads_ok(value, Some(rl.var), &row_stored, &mut bad);
                for st in rb {
                    match st {
                        Stmt::Let { value, .. } => loads_ok(value, Some(rl.var), &row_stored, &mut bad),
                        _ => return err("a reduction that stores".into()),
                    }
                }
            }
            Stmt::Store { param, index: i, value } => {
                loads_ok(value, None, &row_stored, &mut bad);
                if *i != row || index.contains_key(param) || !row_stored.insert(*param) {
                    return err(format!("{} is stored off its row, or twice", k.params[*param].name));
                }
            }
            _ => return err("a loop before the last".into()),
        }
        if let Some(p) = bad {
            return err(format!("{} is read after it is written, or off its element", k.params[p].name));
        }
    }
    Ok(())
}

/// The index the statements of a loop body store param `p` at.
fn body_store(body: &[Stmt], p: usize) -> Option<Expr> {
    body.iter().find_map(|s| match s {
        Stmt::Store { param, index, .. } if *param == p => Some(index.clone()),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kir::{Loop, Param};
    use qatc_ir::DType;

    fn kernel(stmts: Vec<Stmt>) -> Kernel {
        let p = |name: &str, dtype, shape: Vec<usize>| Param { name: name.into(), dtype, shape, write: true };
        Kernel {
            family: "t".into(),
            params: vec![p("codes", DType::U8, vec![4096]), p("absmax", DType::F32, vec![2])],
            index_ty: Ty::I32,
            body: Body::Loops { space: Space::Rows { rows: 2, mapping: RowMapping::Block }, stmts },
            note: String::new(),
            names: Default::default(),
        }
    }
    fn at(l: u8) -> Expr {
        Expr::bin(BinOp::Add, Expr::bin(BinOp::Mul, Expr::Ix(Ix::Row), Expr::Int(2048)), Expr::Ix(Ix::Loop(l)))
    }
    fn load(p: usize, i: Expr) -> Expr {
        Expr::Load { param: p, index: Box::new(i) }
    }
    fn lp(var: u8) -> Loop {
        Loop { var, extent: Expr::Int(2048), max: 2048 }
    }
    fn old_absmax() -> Stmt {
        Stmt::Let { var: 0, ty: Ty::F32, value: load(1, Expr::Ix(Ix::Row)) }
    }
    fn fold(i: Expr) -> Stmt {
        Stmt::Reduce { var: 1, op: ReduceOp::Max, ty: Ty::F32, lp: lp(0), body: vec![], value: load(0, i) }
    }
    fn new_absmax() -> Stmt {
        Stmt::Store { param: 1, index: Expr::Ix(Ix::Row), value: Expr::Var(1) }
    }
    fn rewrite(read: Expr) -> Stmt {
        Stmt::ForEach {
            lp: lp(1),
            body: vec![Stmt::Store { param: 0, index: at(1), value: Expr::bin(BinOp::Mul, load(0, read), Expr::Var(0)) }],
        }
    }

    #[test]
    fn read_the_block_store_its_absmax_then_rewrite_each_element() {
        assert!(check_in_place(&kernel(vec![old_absmax(), fold(at(0)), new_absmax(), rewrite(at(1))])).is_ok());
    }

    #[test]
    fn reads_after_writes_or_off_the_element_are_refused() {
        // the old absmax read after the new one is stored
        assert!(check_in_place(&kernel(vec![fold(at(0)), new_absmax(), old_absmax(), rewrite(at(1))])).is_err());
        // an element of the next block folded
        let next = Expr::bin(BinOp::Add, at(0), Expr::Int(2048));
        assert!(check_in_place(&kernel(vec![old_absmax(), fold(next), new_absmax(), rewrite(at(1))])).is_err());
        // another element read in the rewrite
        let other = Expr::bin(BinOp::Add, at(1), Expr::Int(1));
        assert!(check_in_place(&kernel(vec![old_absmax(), fold(at(0)), new_absmax(), rewrite(other)])).is_err());
        // the absmax stored off its row
        let off = Stmt::Store { param: 1, index: Expr::Int(0), value: Expr::Var(1) };
        assert!(check_in_place(&kernel(vec![old_absmax(), fold(at(0)), off, rewrite(at(1))])).is_err());
    }
}
