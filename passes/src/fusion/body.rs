//! Kernel bodies and how rules build them.
//!
//! A [`Body`] is a small DAG of primitive ops over the kernel's inputs `In(0..n)`; its last node is
//! the result. A [`Frag`] is one way an e-class can be computed as a kernel: its primitive e-node
//! (a one-op body) or a fused kernel already in the class. Rules compose fragments with a
//! [`Builder`]: inlining a fragment ("absorbing" the class) means its value is computed in
//! registers instead of being read from memory.

use rustc_hash::FxHashMap as HashMap;
use std::sync::Arc;

use egg::Id;
use qatc_ir::{infer::infer, DType, KernelFamily, Op, OpKind, Shape, TensorType};

use super::lang::{ENode, Entry, Kernel, EG, FUSED};

/// An operand inside a body: a kernel input or an earlier body node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BRef {
    In(u32),
    Node(u32),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BNode {
    /// A primitive op of the [`super::lang::OpTable`].
    pub op: u32,
    pub args: Vec<BRef>,
    /// The e-class whose value this node computes (None for the reshapes and concat that pack
    /// several results into one buffer). Names in the printed body come from it.
    pub origin: Option<Id>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Body {
    pub nodes: Vec<BNode>,
    pub n_in: usize,
}

/// One way to compute an e-class as a kernel body.
#[derive(Clone, Debug)]
pub struct Frag {
    pub class: Id,
    pub family: KernelFamily,
    pub body: Arc<Body>,
    pub args: Vec<Id>,
    /// The e-node's op index (tie-breaks and memo keys).
    pub op: u32,
    pub fused: bool,
}

impl Frag {
    /// Every op in it may be recomputed by any kernel (`OpKind::is_recomputable`: layout ops,
    /// constants, scale-and-shift, a weight's quantization).
    pub fn recomputable(&self, eg: &EG) -> bool {
        self.kinds(eg).all(OpKind::is_recomputable)
    }

    /// Every op in it is cheap to recompute (`OpKind::is_cheap`).
    pub fn cheap(&self, eg: &EG) -> bool {
        self.kinds(eg).all(OpKind::is_cheap)
    }

    /// Every op in it is a layout op (`OpKind::is_layout`).
    pub fn layout_only(&self, eg: &EG) -> bool {
        self.kinds(eg).all(OpKind::is_layout)
    }

    /// The kinds of its ops (a body holds primitive ops only).
    pub fn kinds<'a>(&'a self, eg: &'a EG) -> impl Iterator<Item = OpKind> + 'a {
        self.body.nodes.iter().map(|n| eg.analysis.table.op(n.op).map_or(OpKind::Kernel, Op::kind))
    }
}

/// The fragment e-node `n` of class `c` gives, where [`rank_of`] says it gives one: a primitive
/// e-node as a body of its own, or a single-result fused kernel.
fn frag_of(eg: &EG, c: Id, n: &ENode) -> Option<Frag> {
    rank_of(eg, n)?;
    match eg.analysis.table.get(n.op)? {
        Entry::Prim { op, .. } => {
            // one body node over the distinct operands (mul(x, x) reads x once)
            let mut args: Vec<Id> = Vec::new();
            let mut refs = Vec::new();
            for &a in &n.args {
                let a = eg.find(a);
                let i = match args.iter().position(|&x| x == a) {
                    Some(i) => i,
                    None => {
                        args.push(a);
                        args.len() - 1
                    }
                };
                refs.push(BRef::In(i as u32));
            }
            let body = Body { n_in: args.len(), nodes: vec![BNode { op: n.op, args: refs, origin: Some(c) }] };
            // the family of a kernel of the op alone, from the op table
            let family = op.kind().family()?;
            Some(Frag { class: c, family, body: Arc::new(body), args, op: n.op, fused: false })
        }
        Entry::Fused(k) => Some(Frag {
            class: c,
            family: k.family.clone(),
            body: k.body.clone(),
            args: n.args.iter().map(|&a| eg.find(a)).collect(),
            op: n.op,
            fused: true,
        }),
    }
}

/// The largest fragment of `c` that `ok` accepts: the one that has absorbed the most.
pub fn best(eg: &EG, c: Id, ok: impl Fn(&Frag) -> bool) -> Option<Frag> {
    ranked_at_most(eg, c, 1, ok).pop()
}

/// The fragments of `c` that `ok` accepts, largest first (ties: fused first, then older).
pub fn ranked(eg: &EG, c: Id, ok: impl Fn(&Frag) -> bool) -> Vec<Frag> {
    ranked_at_most(eg, c, usize::MAX, ok)
}

/// The first `n` of [`ranked`]: the e-nodes are ranked by what their fragments would be before
/// any is built, and fragments built only until `n` are accepted (the rules take the best one
/// or a few, of classes that can hold dozens).
pub fn ranked_at_most(eg: &EG, c: Id, n: usize, ok: impl Fn(&Frag) -> bool) -> Vec<Frag> {
    let c = eg.find(c);
    let mut keyed: Vec<(FragRank, &ENode)> = eg[c].nodes.iter().filter_map(|e| rank_of(eg, e).map(|k| (k, e))).collect();
    // stable: equal ranks keep the e-nodes' order, as the fragments' order was
    keyed.sort_by_key(|(k, _)| std::cmp::Reverse(*k));
    let mut out = Vec::new();
    for (_, e) in keyed {
        if out.len() >= n {
            break;
        }
        if let Some(f) = frag_of(eg, c, e).filter(|f| ok(f)) {
            out.push(f);
        }
    }
    out
}

/// How [`ranked`] orders fragments: body nodes, fused, then the older op (`Reverse(op)`).
type FragRank = (usize, bool, std::cmp::Reverse<u32>);

/// The rank of the fragment e-node `e` gives ([`frag_of`]), None where it gives none: an input,
/// an op that fusion leaves alone (no rule absorbs it), or a fused kernel of several results.
fn rank_of(eg: &EG, e: &ENode) -> Option<FragRank> {
    match eg.analysis.table.get(e.op)? {
        Entry::Prim { op, .. } => {
            if matches!(op, Op::Input { .. } | Op::Kernel { .. }) {
                return None;
            }
            op.kind().family()?;
            Some((1, false, std::cmp::Reverse(e.op)))
        }
        Entry::Fused(k) => k.pack.is_empty().then(|| (k.body.nodes.len(), true, std::cmp::Reverse(e.op))),
    }
}

/// Builds one kernel body. Equal nodes are shared (a value two absorbed fragments both compute
/// is computed once), and every node's type is inferred as it is added.
#[derive(Default)]
pub struct Builder {
    nodes: Vec<BNode>,
    tys: Vec<TensorType>,
    memo: HashMap<(u32, Vec<BRef>), u32>,
    args: Vec<Id>,
    arg_tys: Vec<TensorType>,
    /// A node failed type inference: the rule must not fire.
    pub failed: bool,
}

impl Builder {
    pub fn new() -> Builder {
        Builder::default()
    }

    /// Reads e-class `c` as a kernel input.
    pub fn input(&mut self, eg: &EG, c: Id) -> BRef {
        let c = eg.find(c);
        if let Some(i) = self.args.iter().position(|&a| a == c) {
            return BRef::In(i as u32);
        }
        match &eg[c].data.ty {
            Some(t) => self.arg_tys.push(t.clone()),
            None => {
                self.failed = true;
                self.arg_tys.push(TensorType::f32(Shape::scalar()));
            }
        }
        self.args.push(c);
        BRef::In(self.args.len() as u32 - 1)
    }

    pub fn ty(&self, r: BRef) -> &TensorType {
        match r {
            BRef::In(i) => &self.arg_tys[i as usize],
            BRef::Node(i) => &self.tys[i as usize],
        }
    }

    /// Adds primitive op `op` (a table index) over `args`, computing e-class `origin`.
    pub fn node(&mut self, eg: &EG, op: u32, args: Vec<BRef>, origin: Option<Id>) -> BRef {
        if let Some(&i) = self.memo.get(&(op, args.clone())) {
            return BRef::Node(i);
        }
        let ty = match eg.analysis.table.op(op) {
            Some(o) => {
                let tys: Vec<&TensorType> = args.iter().map(|&a| self.ty(a)).collect();
                infer(o, &tys).ok()
            }
            None => None,
        };
        let ty = ty.unwrap_or_else(|| {
            self.failed = true;
            TensorType::f32(Shape::scalar())
        });
        let i = self.nodes.len() as u32;
        self.memo.insert((op, args.clone()), i);
        self.nodes.push(BNode { op, args, origin: origin.map(|o| eg.find(o)) });
        self.tys.push(ty);
        BRef::Node(i)
    }

    /// Like [`Builder::node`] for an op not yet in the table (the pack's reshapes and concat).
    pub fn new_node(&mut self, eg: &mut EG, op: Op, args: Vec<BRef>) -> BRef {
        let i = eg.analysis.table.prim(op, None);
        self.node(eg, i, args, None)
    }

    /// Inlines a fragment; `subst` replaces some of its inputs by values already in this body.
    /// Returns the fragment's result.
    pub fn splice(&mut self, eg: &EG, f: &Frag, subst: &[(Id, BRef)]) -> BRef {
        self.splice_all(eg, f, subst).last().copied().unwrap_or(BRef::In(0))
    }

    /// Inlines every node of a (possibly packed) kernel body and returns where each went; the
    /// nodes that pack results into one buffer (no origin) are left out.
    pub fn splice_all(&mut self, eg: &EG, f: &Frag, subst: &[(Id, BRef)]) -> Vec<BRef> {
        let ins: Vec<BRef> = f
            .args
            .iter()
            .map(|&a| match subst.iter().find(|(c, _)| eg.find(*c) == eg.find(a)) {
                Some((_, r)) => *r,
                None => self.input(eg, a),
            })
            .collect();
        let mut map: Vec<BRef> = Vec::with_capacity(f.body.nodes.len());
        for n in &f.body.nodes {
            if n.origin.is_none() {
                map.push(BRef::In(u32::MAX));
                continue;
            }
            let args = n
                .args
                .iter()
                .map(|r| match *r {
                    BRef::In(i) => ins[i as usize],
                    BRef::Node(j) => map[j as usize],
                })
                .collect();
            map.push(self.node(eg, n.op, args, n.origin));
        }
        map
    }

    /// The e-classes whose values the body computes.
    pub fn origins(&self) -> impl Iterator<Item = Id> + '_ {
        self.nodes.iter().filter_map(|n| n.origin)
    }

    pub fn args(&self) -> &[Id] {
        &self.args
    }

    /// The body node that computes e-class `c`, if the body computes it.
    pub fn result_of(&self, eg: &EG, c: Id) -> Option<BRef> {
        let c = eg.find(c);
        self.nodes.iter().rposition(|n| n.origin == Some(c)).map(|i| BRef::Node(i as u32))
    }

    /// Finishes a single-result kernel whose result is `root` (it must be the last node).
    pub fn finish(self, eg: &EG, root: BRef, family: KernelFamily, rule: &'static str) -> Option<(Kernel, Vec<Id>)> {
        // the IR's kernels read at least one operand: a body of constants alone (the loss
        // gradient's seed scaled by 1/K under --grad-accum) stays unfused
        if self.failed || self.nodes.is_empty() || self.args.is_empty() || root != BRef::Node(self.nodes.len() as u32 - 1) {
            return None;
        }
        let ty = self.tys.last()?.clone();
        let body = Body { nodes: self.nodes, n_in: self.args.len() };
        let read_bytes = super::cost::body_read_bytes(eg, &body, &self.arg_tys, &self.tys);
        Some((Kernel { family, body: Arc::new(body), ty, read_bytes, pack: vec![], rule }, self.args))
    }

    /// Finishes a kernel with several results: they are written, flattened, into one buffer
    /// (`concat` along axis 0 of `reshape(r, [numel])`), and each result is a view of it. The
    /// results share one element type.
    pub fn finish_pack(self, eg: &mut EG, outs: &[(Id, BRef)], family: KernelFamily, rule: &'static str) -> Option<(Kernel, Vec<Id>)> {
        self.finish_pack_as(eg, outs, family, rule, false)
    }

    /// `finish_pack` for float results of mixed types (an f32 loss beside bf16 gradients under
    /// `--precision bf16`): the pack is f32, a 16-bit result is widened into it (`cast`, exact)
    /// and its view narrowed back (`add_pack`), so it keeps its value and type. For results that
    /// are small beside what the kernel saves (the chunked cross-entropy's dh beside the logits it
    /// never writes): a widened part is written at twice its bytes.
    pub fn finish_pack_widened(
        self,
        eg: &mut EG,
        outs: &[(Id, BRef)],
        family: KernelFamily,
        rule: &'static str,
    ) -> Option<(Kernel, Vec<Id>)> {
        self.finish_pack_as(eg, outs, family, rule, true)
    }

    fn finish_pack_as(
        mut self,
        eg: &mut EG,
        outs: &[(Id, BRef)],
        family: KernelFamily,
        rule: &'static str,
        widen: bool,
    ) -> Option<(Kernel, Vec<Id>)> {
        if self.failed || outs.len() < 2 || self.args.is_empty() {
            return None;
        }
        let dtype = self.ty(outs[0].1).dtype;
        let mixed = outs.iter().any(|(_, r)| self.ty(*r).dtype != dtype);
        if mixed && !(widen && outs.iter().all(|(_, r)| self.ty(*r).dtype.is_float())) {
            return None;
        }
        let mut pack = Vec::new();
        let mut flat = Vec::new();
        for &(c, r) in outs {
            let BRef::Node(i) = r else { return None };
            pack.push((eg.find(c), i));
            let n = self.ty(r).numel();
            let r = if mixed && self.ty(r).dtype != DType::F32 { self.new_node(eg, Op::Cast { to: DType::F32 }, vec![r]) } else { r };
            flat.push(self.new_node(eg, Op::Reshape { shape: Shape::new([n]) }, vec![r]));
        }
        let root = self.new_node(eg, Op::Concat { axis: 0 }, flat);
        if self.failed || root != BRef::Node(self.nodes.len() as u32 - 1) {
            return None;
        }
        let ty = self.tys.last()?.clone();
        let body = Body { nodes: self.nodes, n_in: self.args.len() };
        let read_bytes = super::cost::body_read_bytes(eg, &body, &self.arg_tys, &self.tys);
        Some((Kernel { family, body: Arc::new(body), ty, read_bytes, pack, rule }, self.args))
    }
}

/// Adds a single-result kernel to e-class `root`. Returns the class if that changed the e-graph.
pub fn add_kernel(eg: &mut EG, root: Id, k: Kernel, args: Vec<Id>) -> Option<Id> {
    let op = eg.analysis.table.fused(k);
    let id = eg.add(ENode { kind: FUSED, op, args });
    eg.union(root, id).then_some(root)
}

/// Whether one of `args` is computed from one of `outs` in the input graph: a packed kernel
/// reading it would depend on its own result.
///
/// The search walks the input graph's consumers forward from `outs`, but not past the last of
/// `args` in its topological order: what comes later cannot reach them. Unbounded, each packed
/// kernel walked the rest of the step (the later layers, the backward), quadratic in its length.
fn reads_own_result(eg: &EG, outs: &[Id], args: &[Id]) -> bool {
    let args: Vec<Id> = args.iter().map(|a| eg.find(*a)).collect();
    // a class the rules created has no place in the order: no bound then
    let last = args.iter().map(|&a| eg[a].data.topo.unwrap_or(u32::MAX)).max().unwrap_or(0);
    let mut seen = rustc_hash::FxHashSet::default();
    let mut stack: Vec<Id> = outs.iter().map(|c| eg.find(*c)).collect();
    while let Some(c) = stack.pop() {
        if !seen.insert(c) {
            continue;
        }
        for &u in &eg[c].data.users {
            let u = eg.find(u);
            if args.contains(&u) {
                return true;
            }
            if eg[u].data.topo.is_none_or(|t| t <= last) {
                stack.push(u);
            }
        }
    }
    false
}

/// Adds a packed kernel and, to each result's e-class, the view `reshape(slice(buffer))` of it.
pub fn add_pack(eg: &mut EG, k: Kernel, args: Vec<Id>, name: &str) -> Vec<Id> {
    let pack = k.pack.clone();
    let outs: Vec<Id> = pack.iter().map(|p| p.0).collect();
    if reads_own_result(eg, &outs, &args) {
        return vec![];
    }
    let tys: Vec<(Shape, Option<DType>)> =
        pack.iter().map(|(c, _)| eg[*c].data.ty.as_ref().map(|t| (t.shape.clone(), Some(t.dtype))).unwrap_or_default()).collect();
    let packed = k.ty.dtype;
    let op = eg.analysis.table.fused(k);
    let buf = eg.add(ENode { kind: FUSED, op, args });
    if eg[buf].data.name.is_none() {
        eg[buf].data.name = Some(name.to_string());
    }
    let mut changed = Vec::new();
    let mut start = 0;
    for ((c, _), (shape, dtype)) in pack.iter().zip(tys) {
        let n = shape.numel();
        let s = eg.analysis.table.prim(Op::Slice { axis: 0, start, end: start + n }, None);
        let sl = eg.add(ENode { kind: OpKind::Slice.into(), op: s, args: vec![buf] });
        let r = eg.analysis.table.prim(Op::Reshape { shape }, None);
        let mut view = eg.add(ENode { kind: OpKind::Reshape.into(), op: r, args: vec![sl] });
        // a part widened into the pack (`finish_pack_widened`) narrowed back to its own type
        if let Some(to) = dtype.filter(|&d| d != packed) {
            let cast = eg.analysis.table.prim(Op::Cast { to }, None);
            view = eg.add(ENode { kind: OpKind::Cast.into(), op: cast, args: vec![view] });
        }
        if eg.union(*c, view) {
            changed.push(*c);
        }
        start += n;
    }
    changed
}
