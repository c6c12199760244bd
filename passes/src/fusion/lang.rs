//! The egg language of qatc's ops and its analysis.
//!
//! An e-node is `(kind, op, args)`: `kind` is the op's [`OpKind`] (or [`Kind::Fused`] for a
//! kernel built by the rules), `op` indexes the [`OpTable`] entry that holds the full op with its
//! attributes (or a fused kernel's family and body), and `args` are the operand e-classes in slot
//! order. The kinds are `qatc_ir`'s op table's, so the language has every op: an op added to the
//! IR is in it, under its mnemonic. Patterns name kinds by mnemonic (`(add ?y (broadcast ?b))`):
//! a pattern node carries [`ANY`] and matches every op of its kind whatever the attributes, so
//! rule conditions look at attributes and types in Rust, where they can be shape-checked.
//!
//! The analysis gives every e-class its tensor type (by `qatc_ir::infer`, the same inference the
//! verifier runs), the checkpoint name it carries, and the consumers it had in the input graph:
//! a rule may inline a value into a kernel only when every consumer is inside that kernel.

use rustc_hash::FxHashMap as HashMap;
use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use egg::{Analysis, DidMerge, EGraph, FromOp, Id, Language};
use qatc_ir::{infer::infer, KernelFamily, Op, OpKind, TensorType};

use super::body::Body;

/// The kind of an e-node: a qatc op's, or a fused kernel's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Op(OpKind),
    /// A kernel built by the rules (`fused` in patterns).
    Fused,
}

/// The kind of the e-nodes that stand for fused kernels.
pub const FUSED: Kind = Kind::Fused;

impl Kind {
    /// The name patterns use: the op's mnemonic, or `fused`.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Op(k) => k.mnemonic(),
            Kind::Fused => "fused",
        }
    }

    /// The kind named `name` in a pattern.
    pub fn from_name(name: &str) -> Option<Kind> {
        match name {
            "fused" => Some(Kind::Fused),
            _ => OpKind::from_mnemonic(name).map(Kind::Op),
        }
    }
}

impl From<OpKind> for Kind {
    fn from(k: OpKind) -> Kind {
        Kind::Op(k)
    }
}

// Hashed and ordered by name, as when kinds were their mnemonics: egg orders a class's e-nodes by
// them (and hashes them in its tables), and extraction breaks ties by that order, so typing the
// kinds moves no fusion decision.
impl Hash for Kind {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.name().hash(h)
    }
}

impl Ord for Kind {
    fn cmp(&self, other: &Kind) -> Ordering {
        self.name().cmp(other.name())
    }
}

impl PartialOrd for Kind {
    fn partial_cmp(&self, other: &Kind) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// The `op` of a pattern node: any op of the node's kind.
pub const ANY: u32 = u32::MAX;

/// An e-node: an op (by table index) applied to operand e-classes.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ENode {
    pub kind: Kind,
    pub op: u32,
    pub args: Vec<Id>,
}

impl ENode {
    /// Whether it is an op of kind `k`.
    pub fn is(&self, k: OpKind) -> bool {
        self.kind == Kind::Op(k)
    }
}

impl Language for ENode {
    type Discriminant = Kind;

    fn discriminant(&self) -> Kind {
        self.kind
    }

    /// Same kind and arity, and the same op unless one side is a pattern's [`ANY`].
    fn matches(&self, other: &Self) -> bool {
        self.kind == other.kind && self.args.len() == other.args.len() && (self.op == ANY || other.op == ANY || self.op == other.op)
    }

    fn children(&self) -> &[Id] {
        &self.args
    }

    fn children_mut(&mut self) -> &mut [Id] {
        &mut self.args
    }
}

impl fmt::Display for ENode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind.name())
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown op `{0}` in a fusion pattern")]
pub struct UnknownKind(String);

impl FromOp for ENode {
    type Error = UnknownKind;

    fn from_op(op: &str, args: Vec<Id>) -> Result<Self, Self::Error> {
        match Kind::from_name(op) {
            Some(kind) => Ok(ENode { kind, op: ANY, args }),
            None => Err(UnknownKind(op.to_string())),
        }
    }
}

/// A fused kernel: its family (`gemm.dequant.bias`, ...), body, result type and traffic.
#[derive(Clone, Debug)]
pub struct Kernel {
    pub family: KernelFamily,
    pub body: Arc<Body>,
    pub ty: TensorType,
    /// Bytes read from device memory: each operand once, or only the part its slices or gathers
    /// touch (see `cost::footprint`).
    pub read_bytes: u64,
    /// For a kernel with several results packed into one buffer: each result's e-class and body
    /// node (the buffer is their flat concatenation, in this order).
    pub pack: Vec<(Id, u32)>,
    /// The rule that built it (for the report).
    pub rule: &'static str,
}

/// What an e-node's `op` index stands for.
#[derive(Clone, Debug)]
pub enum Entry {
    /// A qatc op with its attributes; leaves keep their name (inputs are identified by it).
    Prim {
        op: Op,
        name: Option<String>,
    },
    Fused(Kernel),
}

/// The ops of one e-graph, interned: equal ops share an index, so equal e-nodes hash-cons.
#[derive(Clone, Debug, Default)]
pub struct OpTable {
    entries: Vec<Entry>,
    prims: HashMap<String, u32>,
    fused: HashMap<(KernelFamily, Arc<Body>), u32>,
}

/// The interning key of a primitive op: its mnemonic and attributes, plus name and type for leaves
/// (two inputs never merge; two equal constants do).
fn prim_key(op: &Op, name: Option<&str>) -> String {
    match op {
        Op::Input { dtype, shape, .. } => format!("input {:?} {dtype}{shape}", name.unwrap_or("")),
        Op::Const { value, dtype, shape } => format!("const {value:?} {dtype}{shape}"),
        Op::Kernel { family, body } => format!("kernel {:?} {}", family.to_string(), qatc_ir::print(body)),
        _ => format!("{}{:?}", op.mnemonic(), op.attrs()),
    }
}

impl OpTable {
    pub fn prim(&mut self, op: Op, name: Option<String>) -> u32 {
        let key = prim_key(&op, name.as_deref());
        if let Some(&i) = self.prims.get(&key) {
            return i;
        }
        let i = self.entries.len() as u32;
        self.entries.push(Entry::Prim { op, name });
        self.prims.insert(key, i);
        i
    }

    /// A new entry even if an equal op exists: the input graph's nodes never merge (two equal
    /// nodes may be deliberate, like the `remat` pass's recomputed copies of forward values).
    pub fn unique(&mut self, op: Op, name: Option<String>) -> u32 {
        self.entries.push(Entry::Prim { op, name });
        self.entries.len() as u32 - 1
    }

    pub fn fused(&mut self, k: Kernel) -> u32 {
        let key = (k.family.clone(), k.body.clone());
        if let Some(&i) = self.fused.get(&key) {
            return i;
        }
        let i = self.entries.len() as u32;
        self.entries.push(Entry::Fused(k));
        self.fused.insert(key, i);
        i
    }

    pub fn get(&self, i: u32) -> Option<&Entry> {
        self.entries.get(i as usize)
    }

    /// The primitive op behind `i` (None for fused kernels and unknown indices).
    pub fn op(&self, i: u32) -> Option<&Op> {
        match self.get(i) {
            Some(Entry::Prim { op, .. }) => Some(op),
            _ => None,
        }
    }

    pub fn kernel(&self, i: u32) -> Option<&Kernel> {
        match self.get(i) {
            Some(Entry::Fused(k)) => Some(k),
            _ => None,
        }
    }
}

/// What the analysis knows about an e-class.
#[derive(Clone, Debug, Default)]
pub struct Data {
    /// None only if inference failed, which conversion reports as an error.
    pub ty: Option<TensorType>,
    /// The name of the input-graph node (checkpoint key or role) this value is.
    pub name: Option<String>,
    /// The e-classes that consumed this value in the input graph (each once). Empty for classes
    /// the rules created (a packed kernel's buffer and its slices).
    pub users: Vec<Id>,
    /// A graph output or update reads it: it is always materialized.
    pub output: bool,
    /// The class stands for a node of the input graph.
    pub original: bool,
    /// Its node's position in the input graph's topological order (None for classes the rules
    /// created): every class in `users` comes later, which bounds searches along them.
    pub topo: Option<u32>,
    /// The saturation iteration that last gave this class a node or merged it ([`settled`]).
    pub changed_at: u32,
}

pub type EG = EGraph<ENode, FusionAnalysis>;

/// The analysis: the op table lives here so rules (which see the e-graph) can intern new kernels,
/// plus a memo of rule applications already done.
#[derive(Clone, Debug, Default)]
pub struct FusionAnalysis {
    pub table: OpTable,
    /// (rule index, the e-classes and e-nodes a match used): applications already made, so a
    /// saturated rule costs a lookup instead of rebuilding its kernel every iteration.
    pub memo: rustc_hash::FxHashSet<(usize, Vec<usize>)>,
    /// The saturation iteration being applied (0 while the e-graph is built).
    pub now: u32,
    /// Classes stamped before this iteration are settled ([`settled`]); None while every match
    /// is to be applied (the first two iterations, and `FuseOptions::recheck`).
    pub settled_before: Option<u32>,
    /// Rule applications skipped as settled (the saturation report's `settled_skipped`).
    pub skipped: usize,
}

/// Whether class `c` has neither gained a node nor been merged since before the previous
/// iteration's search. A rule application that reads only settled classes (and what no rule
/// changes: primitive ops, types, the input graph's users) was made in the previous iteration over
/// the same classes, so the rules' memo would refuse what it builds: it can be skipped before
/// anything is built (`runner`'s scheduler does so for pattern rules, custom rules themselves).
pub fn settled(eg: &EG, c: Id) -> bool {
    eg.analysis.settled_before.is_some_and(|s| eg[c].data.changed_at < s)
}

/// Whether `root` and every class of `reads` are [`settled`]: a rule application reading only
/// these may be skipped.
pub fn all_settled(eg: &EG, root: Id, reads: impl IntoIterator<Item = Id>) -> bool {
    settled(eg, root) && reads.into_iter().all(|c| settled(eg, c))
}

/// [`all_settled`], counting the skip when so (for custom rules, which skip for themselves).
pub fn skip_settled(eg: &mut EG, root: Id, reads: &[Id]) -> bool {
    let skip = all_settled(eg, root, reads.iter().copied());
    eg.analysis.skipped += usize::from(skip);
    skip
}

impl Analysis<ENode> for FusionAnalysis {
    type Data = Data;

    fn make(eg: &mut EG, n: &ENode, _id: Id) -> Data {
        let ty = match eg.analysis.table.get(n.op) {
            Some(Entry::Prim { op, .. }) => {
                let tys: Option<Vec<TensorType>> = n.args.iter().map(|&a| eg[a].data.ty.clone()).collect();
                tys.and_then(|tys| infer(op, &tys.iter().collect::<Vec<_>>()).ok())
            }
            Some(Entry::Fused(k)) => Some(k.ty.clone()),
            None => None,
        };
        Data { ty, changed_at: eg.analysis.now, ..Default::default() }
    }

    /// Kernels are only ever added to the class of the value they compute, so the merged classes
    /// agree on the type; the rest is bookkeeping that the original class carries.
    fn merge(&mut self, a: &mut Data, b: Data) -> DidMerge {
        let a_before = a.ty.is_some();
        let b_had = b.ty.is_some();
        if a.ty.is_none() {
            a.ty = b.ty;
        }
        if a.name.is_none() {
            a.name = b.name;
        }
        if a.users.is_empty() {
            a.users = b.users;
        }
        a.changed_at = self.now;
        a.output |= b.output;
        a.original |= b.original;
        a.topo = match (a.topo, b.topo) {
            (Some(x), Some(y)) => Some(x.min(y)),
            (x, y) => x.or(y),
        };
        DidMerge(!a_before && a.ty.is_some(), !b_had && a.ty.is_some())
    }
}
