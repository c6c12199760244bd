//! The rule catalogue: one file per family, the identity written above each rule.
//!
//! Most rules are a [`Fuse`]: an egg pattern over op mnemonics (the left-hand side of the
//! identity), the variables whose e-class is inlined into the kernel ([`Take`]), the family of the
//! kernel it produces, and a shape check. Applying it adds a fused e-node to the matched e-class;
//! the primitive e-node stays, and extraction picks the cheaper. Every op node of the pattern is
//! computed inside the kernel; a variable is read from memory unless it is absorbed.
//!
//! Rules are directional (primitive ops -> kernel) and never commute or reassociate: where order
//! matters (`add(gemm, r)` and `add(r, gemm)`) the catalogue lists both. A value may be inlined
//! only when every consumer it had in the input graph is inside the kernel, or when it is cheap to
//! recompute (layout ops, dequantization; see `OpKind::is_recomputable`); rules marked `aux` may
//! instead write such a value as an extra result of the kernel (a packed multi-result kernel).
//!
//! Rules that do not fit a single pattern (a chain of any pointwise ops, the multi-result kernels
//! of LoRA, cross-entropy and AdamW) are [`Custom`]: a searcher over root op kinds and a function.
//!
//! To add a rule: pick the family file, write the identity as a comment, add a `Fuse` (or a
//! `Custom`) to its `rules()`, and a test in `passes/tests/fusion_rules.rs` that it fires on a
//! small graph and does not fire when the shapes do not fit.

pub mod adamw;
pub mod attention;
pub mod cross_entropy;
pub mod dequant;
pub mod elementwise;
pub mod epilogue;
pub mod layernorm;
pub mod lora;

use egg::{Applier, ENodeOrVar, Id, Pattern, PatternAst, Rewrite, SearchMatches, Searcher, Subst, Symbol, Var};
use qatc_ir::{Anchor, Epilogue, GemmFamily, GemmPrologue, KernelFamily, Op, OpKind, TensorType};

use super::body::{self, add_kernel, add_pack, BRef, Builder, Frag};
use super::lang::{ENode, Entry, FusionAnalysis, Kind, EG};
use super::FusionError;

/// How an absorbed variable's e-class is inlined.
#[derive(Clone, Copy, Debug)]
pub enum Take {
    /// The largest fragment whose family has one of these anchors; the rule needs it.
    Must(&'static [Anchor]),
    /// Like `Must`, but the variable is read from memory when no such fragment can be inlined.
    May(&'static [Anchor]),
    /// Both alternatives: read the variable, or recompute it in this kernel from one of its
    /// fragments of these families even though other kernels read it too (FlashAttention's
    /// recomputation of the probabilities); extraction decides which pays.
    Recompute(&'static [Anchor]),
    /// The largest fragment of ops cheap to recompute (transpose, reshape, slice, broadcast,
    /// constants, scale-and-shift), if any: the kernel reads the operand strided, or scales it on
    /// load, instead of reading a materialized copy.
    Cheap,
    /// The largest pointwise fragment, if it can be absorbed.
    Pointwise,
}

/// The family of the kernel a rule builds.
#[derive(Clone, Debug)]
pub enum Family {
    New(KernelFamily),
    /// The absorbed variable's family with an epilogue (`gemm.dequant` + `bias`).
    Extend {
        var: &'static str,
        tag: Epilogue,
    },
    /// A GEMM tagged by what its cheap prologues do: `.strided` (transpose, reshape, slice,
    /// broadcast) and/or `.scaled` (scale-and-shift).
    GemmPrologue,
}

/// A rule from a pattern.
pub struct Fuse {
    pub name: &'static str,
    /// The left-hand side: an egg pattern over op mnemonics; attributes are not matched.
    pub lhs: &'static str,
    /// Variables (without `?`) whose e-class is inlined.
    pub absorb: &'static [(&'static str, Take)],
    pub family: Family,
    /// The shape check: the rule fires only where it holds.
    pub check: fn(&Match) -> bool,
    /// A `Must` variable that has other consumers is written as a second result instead of
    /// blocking the rule.
    pub aux: bool,
}

/// A rule that is a function of a root e-class.
pub struct Custom {
    pub name: &'static str,
    /// The e-node kinds whose e-classes the rule looks at.
    pub roots: &'static [Kind],
    /// Apply once per iteration, at the first matching class (rules over the whole graph).
    pub global: bool,
    pub apply: fn(&mut EG, Id, usize) -> Vec<Id>,
}

pub enum Rule {
    Fuse(Fuse),
    Custom(Custom),
}

/// What a rule's check sees: the types of the pattern's variables and the ops it matched.
pub struct Match<'a> {
    eg: &'a EG,
    subst: &'a Subst,
    root: Id,
    ops: Vec<&'a Op>,
}

impl Match<'_> {
    /// The type of variable `v` (without `?`).
    pub fn ty(&self, v: &str) -> Option<&TensorType> {
        let var: Var = format!("?{v}").parse().ok()?;
        let c = self.subst.get(var)?;
        self.eg[*c].data.ty.as_ref()
    }
    /// The type of the matched root.
    pub fn root(&self) -> Option<&TensorType> {
        self.eg[self.root].data.ty.as_ref()
    }
    /// The first matched op of kind `kind`, in pattern order (root last).
    pub fn op(&self, kind: OpKind) -> Option<&Op> {
        self.ops.iter().copied().find(|o| o.kind() == kind)
    }
    /// Whether variable `v`'s class holds a primitive op of kind `kind`.
    pub fn has(&self, v: &str, kind: OpKind) -> bool {
        let Ok(var) = format!("?{v}").parse::<Var>() else { return false };
        self.subst.get(var).is_some_and(|c| self.eg[*c].nodes.iter().any(|n| n.is(kind)))
    }
}

/// Every rule, in catalogue order.
pub fn all() -> Vec<Rule> {
    let mut v = Vec::new();
    v.extend(elementwise::rules());
    v.extend(dequant::rules());
    v.extend(epilogue::rules());
    v.extend(lora::rules());
    v.extend(layernorm::rules());
    v.extend(attention::rules());
    v.extend(cross_entropy::rules());
    v.extend(adamw::rules());
    v
}

impl Rule {
    pub fn name(&self) -> &'static str {
        match self {
            Rule::Fuse(f) => f.name,
            Rule::Custom(c) => c.name,
        }
    }

    /// The egg rewrite; `index` keys the memo of applications.
    pub fn rewrite(self, index: usize) -> Result<Rewrite<ENode, FusionAnalysis>, FusionError> {
        let name = self.name();
        let bad = |msg: String| FusionError::Rule { rule: name, msg };
        match self {
            Rule::Fuse(f) => {
                let pat: Pattern<ENode> = f.lhs.parse().map_err(|e| bad(format!("{e:?}")))?;
                let mut absorb = Vec::new();
                for (v, t) in f.absorb {
                    absorb.push((format!("?{v}").parse::<Var>().map_err(|e| bad(format!("{e:?}")))?, *t));
                }
                let fam_var = match f.family {
                    Family::Extend { var, .. } => Some(format!("?{var}").parse::<Var>().map_err(|e| bad(format!("{e:?}")))?),
                    Family::New(_) | Family::GemmPrologue => None,
                };
                let ast = pat.ast.clone();
                let vars = pat.vars();
                Rewrite::new(name, pat, FuseApplier { rule: f, ast, vars, absorb, fam_var, index }).map_err(bad)
            }
            Rule::Custom(c) => {
                Rewrite::new(name, KindSearcher { roots: c.roots, global: c.global }, CustomApplier { apply: c.apply, index }).map_err(bad)
            }
        }
    }
}

/// Finds the e-classes holding an e-node of one of `roots`.
struct KindSearcher {
    roots: &'static [Kind],
    global: bool,
}

impl Searcher<ENode, FusionAnalysis> for KindSearcher {
    fn search_eclass_with_limit(&self, eg: &EG, eclass: Id, limit: usize) -> Option<SearchMatches<'_, ENode>> {
        let hit = limit > 0 && eg[eclass].nodes.iter().any(|n| self.roots.contains(&n.kind));
        hit.then(|| SearchMatches { eclass, substs: vec![Subst::default()], ast: None })
    }

    fn search_with_limit(&self, eg: &EG, limit: usize) -> Vec<SearchMatches<'_, ENode>> {
        let mut ids: Vec<Id> = Vec::new();
        for k in self.roots {
            if let Some(cs) = eg.classes_for_op(k) {
                ids.extend(cs.map(|c| eg.find(c)));
            }
        }
        ids.sort();
        ids.dedup();
        if self.global {
            ids.truncate(1);
        }
        ids.into_iter().take(limit).filter_map(|c| self.search_eclass_with_limit(eg, c, 1)).collect()
    }

    fn vars(&self) -> Vec<Var> {
        vec![]
    }
}

struct CustomApplier {
    apply: fn(&mut EG, Id, usize) -> Vec<Id>,
    index: usize,
}

impl Applier<ENode, FusionAnalysis> for CustomApplier {
    fn apply_one(&self, eg: &mut EG, eclass: Id, _: &Subst, _: Option<&PatternAst<ENode>>, _: Symbol) -> Vec<Id> {
        (self.apply)(eg, eclass, self.index)
    }
}

struct FuseApplier {
    rule: Fuse,
    ast: PatternAst<ENode>,
    /// The pattern's variables, in the pattern's order (the memo's key of a match).
    vars: Vec<Var>,
    absorb: Vec<(Var, Take)>,
    fam_var: Option<Var>,
    index: usize,
}

/// The pattern resolved to concrete e-nodes.
enum Res {
    Var(Var, Id),
    Op { class: Id, node: ENode, kids: Vec<Res> },
}

fn resolve(eg: &EG, ast: &[ENodeOrVar<ENode>], i: usize, class: Id, subst: &Subst) -> Option<Res> {
    let class = eg.find(class);
    match ast.get(i)? {
        ENodeOrVar::Var(v) => (eg.find(*subst.get(*v)?) == class).then_some(Res::Var(*v, class)),
        ENodeOrVar::ENode(p) => {
            for n in &eg[class].nodes {
                if !egg::Language::matches(p, n) || !matches!(eg.analysis.table.get(n.op), Some(Entry::Prim { .. })) {
                    continue;
                }
                let kids: Option<Vec<Res>> =
                    p.args.iter().zip(&n.args).map(|(pi, &c)| resolve(eg, ast, usize::from(*pi), c, subst)).collect();
                if let Some(kids) = kids {
                    return Some(Res::Op { class, node: n.clone(), kids });
                }
            }
            None
        }
    }
}

/// The ops a match resolved to (pattern order, root last) and their classes with their kinds.
fn collect_ops<'a>(eg: &'a EG, r: &Res, out: &mut Vec<&'a Op>, classes: &mut Vec<(Id, OpKind)>) {
    if let Res::Op { class, node, kids } = r {
        for k in kids {
            collect_ops(eg, k, out, classes);
        }
        // a pattern's op nodes resolve to primitive ops only (`resolve`)
        let op = eg.analysis.table.op(node.op);
        out.extend(op);
        classes.push((*class, op.map_or(OpKind::Kernel, Op::kind)));
    }
}

/// Whether every consumer `c` had in the input graph is among `inside`.
pub fn consumers_inside(eg: &EG, c: Id, inside: &[Id]) -> bool {
    let d = &eg[c].data;
    !d.output && d.original && !d.users.is_empty() && d.users.iter().all(|u| inside.contains(&eg.find(*u)))
}

impl FuseApplier {
    /// The fragments variable `var` may be inlined as, largest first: the largest is usually
    /// best, but a smaller one can leave a neighbour free to fuse better (extraction decides).
    fn choose(&self, eg: &EG, root: Id, var: Var, take: Take, subst: &Subst) -> Vec<Frag> {
        let Some(c) = subst.get(var).map(|c| eg.find(*c)) else { return vec![] };
        if c == root {
            return vec![];
        }
        let n = MAX_ALTERNATIVES;
        match take {
            Take::Must(anchors) | Take::May(anchors) | Take::Recompute(anchors) => {
                body::ranked_at_most(eg, c, n, |f| anchors.contains(&f.family.anchor()))
            }
            Take::Cheap => body::ranked_at_most(eg, c, n, |f| f.family == KernelFamily::Pointwise && f.cheap(eg)),
            Take::Pointwise => body::ranked_at_most(eg, c, n, |f| f.family == KernelFamily::Pointwise),
        }
    }

    fn build(&self, eg: &EG, r: &Res, chosen: &[(Var, Frag)], b: &mut Builder) -> BRef {
        match r {
            Res::Var(v, c) => match chosen.iter().find(|(cv, _)| cv == v) {
                Some((_, f)) => b.splice(eg, f, &[]),
                None => b.input(eg, *c),
            },
            Res::Op { class, node, kids } => {
                let args = kids.iter().map(|k| self.build(eg, k, chosen, b)).collect();
                b.node(eg, node.op, args, Some(*class))
            }
        }
    }
}

impl Applier<ENode, FusionAnalysis> for FuseApplier {
    fn apply_one(&self, eg: &mut EG, eclass: Id, subst: &Subst, _: Option<&PatternAst<ENode>>, _: Symbol) -> Vec<Id> {
        let root = eg.find(eclass);
        let ast = self.ast.as_ref();
        let Some(res) = resolve(eg, ast, ast.len() - 1, root, subst) else { return vec![] };
        let (mut ops, mut internal) = (Vec::new(), Vec::new());
        collect_ops(eg, &res, &mut ops, &mut internal);
        internal.retain(|&(c, _)| c != root);
        if !(self.rule.check)(&Match { eg, subst, root, ops }) {
            return vec![];
        }
        let has_internal = !internal.is_empty();
        let cands: Vec<Vec<Frag>> = self.absorb.iter().map(|&(v, t)| self.choose(eg, root, v, t, subst)).collect();
        // The match's memo: the same root, variables and candidate fragments were tried in an
        // earlier iteration, and what they build is a function of these alone (the e-graph only
        // grows by kernels, which a new candidate fragment would show), so every kernel they
        // give is in the e-graph already. Checked before any body is built: rebuilding them
        // every iteration was most of saturation's time on a 48-layer step.
        let mut key: Vec<usize> = vec![usize::MAX - 1, usize::from(root)];
        key.extend(self.vars.iter().map(|v| subst.get(*v).map_or(usize::MAX, |&c| usize::from(eg.find(c)))));
        for c in &cands {
            key.push(usize::MAX);
            key.extend(c.iter().map(|f| f.op as usize));
        }
        if !eg.analysis.memo.insert((self.index, key)) {
            return vec![];
        }
        // every combination of the variables' candidate fragments, up to MAX_COMBINATIONS
        let mut combos: Vec<Vec<(Var, Frag)>> = vec![Vec::new()];
        for (&(v, t), cands) in self.absorb.iter().zip(cands) {
            if cands.is_empty() {
                if let Take::Must(_) = t {
                    return vec![];
                }
                continue;
            }
            let keep_unabsorbed = matches!(t, Take::Recompute(_));
            combos = combos
                .into_iter()
                .flat_map(|c| {
                    let plain = keep_unabsorbed.then(|| c.clone());
                    cands
                        .iter()
                        .map(move |f| {
                            let mut c = c.clone();
                            c.push((v, f.clone()));
                            c
                        })
                        .chain(plain)
                })
                .take(MAX_COMBINATIONS)
                .collect();
        }
        let mut changed = Vec::new();
        for chosen in combos {
            changed.extend(self.apply_combo(eg, root, &res, &internal, has_internal, chosen));
        }
        changed
    }
}

/// Candidate fragments per absorbed variable, and combinations per match.
const MAX_ALTERNATIVES: usize = 3;
const MAX_COMBINATIONS: usize = 6;

impl FuseApplier {
    fn apply_combo(
        &self,
        eg: &mut EG,
        root: Id,
        res: &Res,
        internal: &[(Id, OpKind)],
        has_internal: bool,
        mut chosen: Vec<(Var, Frag)>,
    ) -> Vec<Id> {
        // Inlining is legal when every consumer is inside; optional takes that fail are dropped,
        // `aux` rules write a failing `Must` take as a second result.
        let mut aux: Vec<Id> = Vec::new();
        for _attempt in 0..2 {
            let mut b = Builder::new();
            let out = self.build(eg, res, &chosen, &mut b);
            let mut inside: Vec<Id> = b.origins().collect();
            inside.push(root);
            aux.clear();
            for &(c, kind) in internal {
                if !consumers_inside(eg, c, &inside) && !kind.is_recomputable() {
                    if !self.rule.aux {
                        return vec![];
                    }
                    aux.push(c);
                }
            }
            if chosen.is_empty() && !has_internal {
                return vec![]; // nothing to fuse: the kernel would be the op itself
            }
            let mut drop = Vec::new();
            for (v, f) in &chosen {
                let recompute = self.absorb.iter().any(|(av, t)| av == v && matches!(t, Take::Recompute(_)));
                if recompute || f.recomputable(eg) || consumers_inside(eg, f.class, &inside) {
                    continue;
                }
                match self.absorb.iter().find(|(av, _)| av == v).map(|a| a.1) {
                    Some(Take::Must(_)) if self.rule.aux => aux.push(f.class),
                    Some(Take::Must(_)) => return vec![],
                    _ => drop.push(*v),
                }
            }
            if !drop.is_empty() {
                chosen.retain(|(v, _)| !drop.contains(v));
                continue;
            }
            let family = match &self.rule.family {
                Family::New(f) => f.clone(),
                Family::GemmPrologue => {
                    let kinds: Vec<OpKind> = chosen.iter().flat_map(|(_, f)| f.kinds(eg).collect::<Vec<_>>()).collect();
                    let strided = kinds.iter().any(|k| k.is_layout() && *k != OpKind::Const);
                    let scaled = kinds.contains(&OpKind::Affine);
                    KernelFamily::Gemm(GemmFamily::with_prologue(GemmPrologue::of_cheap(strided, scaled)))
                }
                Family::Extend { tag, .. } => match self.fam_var.and_then(|fv| chosen.iter().find(|(v, _)| *v == fv)) {
                    Some((_, f)) => match f.family.with_epilogue(*tag) {
                        Some(family) => family,
                        None => return vec![],
                    },
                    None => return vec![],
                },
            };
            // the memo: the same root, operands and inlined fragments were already fused
            let mut key: Vec<usize> = vec![usize::from(root)];
            key.extend(b.args().iter().map(|&a| usize::from(a)));
            key.extend(chosen.iter().map(|(_, f)| f.op as usize));
            key.push(aux.len());
            if !eg.analysis.memo.insert((self.index, key)) {
                return vec![];
            }
            if aux.is_empty() {
                let Some((k, args)) = b.finish(eg, out, family, self.rule.name) else { return vec![] };
                return add_kernel(eg, root, k, args).into_iter().collect();
            }
            let mut outs = vec![(root, out)];
            for &a in &aux {
                let Some(r) = b.result_of(eg, a) else { return vec![] };
                outs.push((a, r));
            }
            let name = eg[root].data.name.clone().unwrap_or_else(|| family.to_string());
            let Some(family) = family.with_aux() else { return vec![] };
            let Some((k, args)) = b.finish_pack(eg, &outs, family, self.rule.name) else { return vec![] };
            return add_pack(eg, k, args, &name);
        }
        vec![]
    }
}

/// Memo helper for custom rules: false if this (rule, key) was applied already.
pub fn first_time(eg: &mut EG, index: usize, key: Vec<usize>) -> bool {
    eg.analysis.memo.insert((index, key))
}
