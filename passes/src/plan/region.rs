//! The step as the planner sees it: the nodes the outputs need, densely numbered in the graph's
//! structural topological order, with their operands, users, sizes and FLOPs, and the facts
//! every later stage asks about: which nodes are the forward pass (ancestors of `loss`), which
//! are scheduled lazily (just before their first user), which update outputs write back into
//! their input's storage, and which values are views of others.

use std::collections::HashMap;

use qatc_ir::{Graph, InputKind, NodeId, Op};

use super::cost::{node_flops, value_bytes};
use super::PlanError;

pub use qatc_ir::role::{is_recompute_name, RECOMPUTE_SUFFIX};

/// The needed nodes of a graph, densely numbered (index order = structural topological order).
pub(crate) struct Dense {
    pub ids: Vec<NodeId>,
    pub index: HashMap<NodeId, usize>,
    /// Operands in slot order (a node may use the same operand twice).
    pub operands: Vec<Vec<usize>>,
    /// Distinct users, ascending.
    pub users: Vec<Vec<usize>>,
    pub bytes: Vec<usize>,
    pub flops: Vec<u64>,
    pub input_kind: Vec<Option<InputKind>>,
    pub names: Vec<Option<String>>,
    pub mnemonic: Vec<&'static str>,
    /// Ancestor-or-self of the `loss` output (everything, when there is no loss).
    pub forward: Vec<bool>,
    /// Autodiff's seed, or a fused kernel computing it (`qatc_ir::role::holds_gradient_seed`).
    pub seed: Vec<bool>,
    /// Each value's category and phase (`qatc_ir::role`).
    pub category: Vec<qatc_ir::Category>,
    pub phase: Vec<qatc_ir::Phase>,
    /// A non-update output: read by the caller after the step, so it lives to the end.
    pub output: Vec<bool>,
    /// `Some(input)`: this node's value is written into that input's storage in place.
    pub write_back: Vec<Option<usize>>,
    /// Update outputs that could not be written in place: kept to the end, copied after the step.
    pub copy_back: Vec<bool>,
    /// Readers of an input that must run before the node writing back into it.
    pub after: Vec<Vec<usize>>,
    /// The op allows its output to take over operand `slot`'s storage (see `in_place_slots`).
    pub in_place: Vec<Vec<usize>>,
    /// Reshape: the value is a view of operand 0 (same bytes, no copy).
    pub view: Vec<bool>,
    pub has_loss: bool,
}

/// Operand slots whose storage the op may overwrite with its result: elementwise ops (each output
/// element depends on the same element of its operands) and row-wise ops (each output row on the
/// same row), provided the kernel reads a row before writing it. `liveness` adds the other
/// conditions: the operand dies at this op and has the same byte size.
pub fn in_place_slots(op: &Op, arity: usize) -> Vec<usize> {
    match op {
        Op::Unary(_) | Op::Binary(_) | Op::Affine { .. } | Op::Cast { .. } => (0..arity).collect(),
        Op::AdamM { .. } | Op::AdamV { .. } => vec![0, 1],
        // (p, m', v', lr, t): elementwise in the three tensors, lr and t are scalars
        Op::AdamParam { .. } => vec![0, 1, 2],
        Op::Dropout { .. } | Op::ActQuant { .. } => vec![0],
        Op::Softmax { .. } | Op::PackedSoftmax { .. } => vec![0],
        Op::SoftmaxGrad { .. } => vec![0, 1],
        Op::LayerNorm { .. } => vec![0],
        Op::LayerNormGradX { .. } => vec![0, 2],
        Op::CrossEntropyGrad | Op::WeightedCrossEntropyGrad => vec![0],
        _ => Vec::new(),
    }
}

impl Dense {
    pub fn new(g: &Graph) -> Result<Dense, PlanError> {
        let topo = g.topo_order().map_err(PlanError::Ir)?;
        // needed: what the outputs depend on, plus every input that an update writes
        let mut needed: HashMap<NodeId, bool> = HashMap::new();
        let mut stack: Vec<NodeId> = g.outputs().iter().map(|o| o.node).collect();
        stack.extend(g.outputs().iter().filter(|o| o.update).filter_map(|o| g.find_input(&o.name)));
        while let Some(n) = stack.pop() {
            if needed.insert(n, true).is_none() {
                stack.extend(g.operands(n));
            }
        }
        let ids: Vec<NodeId> = topo.into_iter().filter(|n| needed.contains_key(n)).collect();
        let index: HashMap<NodeId, usize> = ids.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let n = ids.len();
        let mut d = Dense {
            operands: Vec::with_capacity(n),
            users: vec![Vec::new(); n],
            bytes: Vec::with_capacity(n),
            flops: Vec::with_capacity(n),
            input_kind: Vec::with_capacity(n),
            names: Vec::with_capacity(n),
            mnemonic: Vec::with_capacity(n),
            forward: vec![false; n],
            seed: Vec::with_capacity(n),
            category: Vec::with_capacity(n),
            phase: Vec::with_capacity(n),
            output: vec![false; n],
            write_back: vec![None; n],
            copy_back: vec![false; n],
            after: vec![Vec::new(); n],
            in_place: Vec::with_capacity(n),
            view: Vec::with_capacity(n),
            has_loss: false,
            ids,
            index,
        };
        for i in 0..n {
            let id = d.ids[i];
            let node = g.node(id);
            let ops: Vec<usize> = g
                .operands(id)
                .iter()
                .map(|o| d.index.get(o).copied().ok_or_else(|| PlanError::Internal(format!("operand of {} is not needed", g.describe(id)))))
                .collect::<Result<_, _>>()?;
            for &o in &ops {
                if d.users[o].last() != Some(&i) {
                    d.users[o].push(i);
                }
            }
            d.in_place.push(in_place_slots(&node.op, ops.len()));
            d.view.push(matches!(node.op, Op::Reshape { .. }));
            d.operands.push(ops);
            d.bytes.push(value_bytes(&node.ty));
            d.flops.push(node_flops(g, id));
            d.input_kind.push(g.input_kind(id));
            d.names.push(node.name.clone());
            d.mnemonic.push(node.op.mnemonic());
            d.seed.push(qatc_ir::role::holds_gradient_seed(g, id));
        }
        for u in &mut d.users {
            u.sort_unstable();
            u.dedup();
        }
        // forward region, categories and phases: `qatc_ir::role`'s rule
        let roles = qatc_ir::Roles::of(g);
        d.has_loss = roles.has_loss();
        for i in 0..n {
            let role = roles.role(g, d.ids[i]);
            d.forward[i] = roles.is_forward(d.ids[i]);
            d.category.push(role.category);
            d.phase.push(role.phase);
        }
        for o in g.outputs().iter().filter(|o| !o.update) {
            if let Some(&i) = d.index.get(&o.node) {
                d.output[i] = true;
            }
        }
        d.plan_write_backs(g);
        Ok(d)
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_input(&self, i: usize) -> bool {
        self.input_kind[i].is_some()
    }

    pub fn name(&self, i: usize) -> String {
        match &self.names[i] {
            Some(n) => n.clone(),
            None => format!("%{} {}", self.ids[i].index(), self.mnemonic[i]),
        }
    }

    /// The view root of a value: follows reshapes back to the value that owns the bytes.
    pub fn view_root(&self, mut i: usize) -> usize {
        while self.view[i] {
            match self.operands[i].first() {
                Some(&o) => i = o,
                None => break,
            }
        }
        i
    }

    /// Values that are `i` or views of it (transitively).
    fn view_family(&self, i: usize) -> Vec<usize> {
        let mut fam = vec![i];
        let mut k = 0;
        while k < fam.len() {
            let v = fam[k];
            for &u in &self.users[v] {
                if self.view[u] && !fam.contains(&u) {
                    fam.push(u);
                }
            }
            k += 1;
        }
        fam
    }

    /// Decides which update outputs write into their input's storage. The new value U of input
    /// X may overwrite X when every other reader of X (or of a view of X) can run before U:
    /// none of them depends on U, neither X nor a view of X is read after the step (as an output
    /// or as another update's value), U is not a view or an input, and U writes back into one input only. The schedule then orders
    /// those readers first (`after`). Anything else is kept in the arena to the end and copied.
    fn plan_write_backs(&mut self, g: &Graph) {
        let mut used = vec![false; self.len()];
        // the orderings already promised (reader -> write-back): two write-backs that each wait
        // for a reader of the other (a swap) would deadlock, so the second is refused
        let mut extra: Vec<Vec<usize>> = vec![Vec::new(); self.len()];
        // values read after the step (any output's node): their storage must survive it
        let mut read_after = vec![false; self.len()];
        for o in g.outputs() {
            if let Some(&i) = self.index.get(&o.node) {
                read_after[i] = true;
            }
        }
        for o in g.outputs().iter().filter(|o| o.update) {
            let (Some(&u), Some(x)) = (self.index.get(&o.node), g.find_input(&o.name).and_then(|x| self.index.get(&x).copied())) else {
                continue;
            };
            let family = self.view_family(x);
            let readers: Vec<usize> =
                family.iter().flat_map(|&v| self.users[v].iter().copied()).filter(|r| *r != u && !family.contains(r)).collect();
            let ok = !self.is_input(u)
                && !self.view[u]
                && !used[u]
                && self.bytes[u] == self.bytes[x]
                && !family.iter().any(|&v| read_after[v])
                && !self.reaches_any(u, &readers, &extra);
            if ok {
                used[u] = true;
                self.write_back[u] = Some(x);
                let mut r = readers;
                r.sort_unstable();
                r.dedup();
                for &rd in &r {
                    extra[rd].push(u);
                }
                self.after[u] = r;
            } else if !self.is_input(u) {
                self.copy_back[u] = true;
            }
        }
    }

    /// Whether any of `targets` must run after `from`: reachable along data edges or along the
    /// orderings `extra` already promises.
    fn reaches_any(&self, from: usize, targets: &[usize], extra: &[Vec<usize>]) -> bool {
        if targets.is_empty() {
            return false;
        }
        let mut seen = vec![false; self.len()];
        let mut stack = vec![from];
        while let Some(v) = stack.pop() {
            for &u in self.users[v].iter().chain(&extra[v]) {
                if targets.contains(&u) {
                    return true;
                }
                if !std::mem::replace(&mut seen[u], true) {
                    stack.push(u);
                }
            }
        }
        false
    }

    /// The nodes that depend on the loss's gradient (autodiff's seed, the constant `loss.grad`,
    /// or the fused kernels computing it), and whether there is such a seed.
    pub fn gradient_stream(&self) -> (bool, Vec<bool>) {
        let n = self.len();
        let mut from_seed = self.seed.clone();
        for i in 0..n {
            if !self.is_input(i) && self.operands[i].iter().any(|&o| from_seed[o]) {
                from_seed[i] = true;
            }
        }
        (self.seed.iter().any(|&s| s), from_seed)
    }

    /// Every byte count the planner adds up (offsets, live bytes, the arena) stays below 2^62
    /// when the step's values together do: a step past that is refused here, instead of its
    /// sums wrapping around into a small, wrong plan.
    pub fn check_total(&self) -> Result<(), PlanError> {
        const MAX_TOTAL: usize = 1 << 62;
        match self.bytes.iter().try_fold(0usize, |a, &b| a.checked_add(b)) {
            Some(t) if t <= MAX_TOTAL => Ok(()),
            _ => Err(PlanError::TooLarge(format!(
                "the step's values add up to more than 2^62 bytes ({} values); no memory holds that",
                self.bytes.len()
            ))),
        }
    }

    /// Nodes scheduled just before their first user instead of on their own: values computed
    /// from weights, state and constants alone (dequantized weights, broadcast biases, constants:
    /// made where they are needed, not at the start), and backward values that do not depend on
    /// the loss's gradient: the values the `remat` pass recomputes (`NAME.recompute`, and fused
    /// kernels made of them), made when the backward reaches them, not during the forward. The
    /// gradient's seed is autodiff's constant `loss.grad` (or the fused kernel holding it). A write-back is never lazy.
    pub fn lazy(&self) -> Vec<bool> {
        let n = self.len();
        let mut source_only = vec![false; n];
        let mut lazy = vec![false; n];
        let (seeded, from_seed) = self.gradient_stream();
        for i in 0..n {
            if self.is_input(i) {
                continue;
            }
            let detached = seeded && !self.forward[i] && !from_seed[i];
            // weights, state and constants only: anything that reads step data (token ids)
            // is the real dataflow and is scheduled on its own
            source_only[i] = self.operands[i].iter().all(|&o| match self.input_kind[o] {
                Some(k) => k != InputKind::Data,
                None => source_only[o],
            });
            lazy[i] = (source_only[i] || detached || is_recompute_name(self.names[i].as_deref())) && self.write_back[i].is_none();
        }
        lazy
    }
}
