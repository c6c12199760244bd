//! What a value is, for memory accounting: its category (the rows of the usual memory tables:
//! weights, trainable parameters, gradients, optimizer states, data, activations, temporaries)
//! and the phase of the step that computes it (forward, backward, recompute, optimizer).
//!
//! This is the one home of the rule. The graph-level planner (`qatc_passes::plan`, which the
//! `remat` pass searches with) classifies graph values by it, and the lowering tags every buffer
//! of a program with the role of the node it holds (`qatc_kernels::program::Buffer::role`), so
//! the executed memory plan (`qatc plan`) reads its categories off the buffers an executor
//! allocates.
//!
//! The rule, value by value:
//! - an input by its kind: `frozen` -> weights, `trainable` -> trainable, `state` -> optimizer
//!   (Adam moments, the step count), `data` -> data (token ids, targets, the learning rate);
//! - a value named `grad:NAME` -> gradients;
//! - a forward value (an ancestor of the `loss` output, or everything when there is none) that a
//!   value outside the forward reads, directly or through views -> activations (what is saved
//!   for the backward; a value the `remat` pass recomputes is made in the backward and is a
//!   temporary);
//! - anything else -> temporaries.
//!
//! Phases: a value named `NAME.recompute` (the `remat` pass's clones) is recomputed; AdamW's ops,
//! a fused kernel computing them, and the new value of a state or trainable input (`update`
//! outputs) are the optimizer; other forward values are the forward, the rest the backward.

use std::collections::HashSet;

use serde::Serialize;

use crate::graph::{Graph, NodeId};
use crate::op::{InputKind, Op};

/// Where a value's bytes are counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    Weights,
    Trainable,
    Gradients,
    Optimizer,
    Data,
    Activations,
    Temporaries,
}

impl Category {
    pub const ALL: [Category; 7] = [
        Category::Weights,
        Category::Trainable,
        Category::Gradients,
        Category::Optimizer,
        Category::Data,
        Category::Activations,
        Category::Temporaries,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Category::Weights => "weights",
            Category::Trainable => "trainable",
            Category::Gradients => "gradients",
            Category::Optimizer => "optimizer",
            Category::Data => "data",
            Category::Activations => "activations",
            Category::Temporaries => "temporaries",
        }
    }

    /// The label people know from the usual tables.
    pub fn label(self) -> &'static str {
        match self {
            Category::Weights => "weights (frozen)",
            Category::Trainable => "trainable params",
            Category::Gradients => "gradients",
            Category::Optimizer => "optimizer states",
            Category::Data => "data",
            Category::Activations => "activations",
            Category::Temporaries => "temporaries",
        }
    }

    /// An input's category: it lives in its own storage for the whole step.
    pub fn persistent(self) -> bool {
        matches!(self, Category::Weights | Category::Trainable | Category::Optimizer | Category::Data)
    }

    /// Its index in [`Category::ALL`].
    pub fn index(self) -> usize {
        Category::ALL.iter().position(|&c| c == self).unwrap_or(0)
    }

    /// When a buffer holds values of several categories at once, the one it counts as.
    pub fn rank(self) -> u8 {
        match self {
            Category::Gradients => 3,
            Category::Activations => 2,
            _ => 1,
        }
    }

    /// The category of an input of this kind.
    pub fn of_input(kind: InputKind) -> Category {
        match kind {
            InputKind::Frozen => Category::Weights,
            InputKind::Trainable => Category::Trainable,
            InputKind::State => Category::Optimizer,
            InputKind::Data => Category::Data,
        }
    }
}

/// The part of the step that computes a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Forward,
    Backward,
    /// A forward value recomputed in the backward (`remat`).
    Recompute,
    Optimizer,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Recompute => "recompute",
            Phase::Optimizer => "optimizer",
        }
    }
}

/// A value's category and phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Role {
    pub category: Category,
    pub phase: Phase,
}

impl Role {
    /// A scratch buffer of a step of this phase: a temporary.
    pub fn temporary(phase: Phase) -> Role {
        Role { category: Category::Temporaries, phase }
    }

    /// An input's role.
    pub fn input(kind: InputKind) -> Role {
        Role { category: Category::of_input(kind), phase: Phase::Forward }
    }
}

/// The name autodiff gives its seed, the constant 1 that the loss's gradient starts from: the
/// backward is what depends on it.
pub const GRADIENT_SEED: &str = "loss.grad";

/// Whether `n` is autodiff's seed (the constant named [`GRADIENT_SEED`]) or a fused kernel that
/// computes it (fusion inlines the seed into the kernel that starts the backward).
pub fn holds_gradient_seed(g: &Graph, n: NodeId) -> bool {
    let node = g.node(n);
    match &node.op {
        Op::Const { .. } => node.name.as_deref() == Some(GRADIENT_SEED),
        Op::Kernel { body, .. } => body.node_ids().into_iter().any(|b| holds_gradient_seed(body, b)),
        _ => false,
    }
}

/// Suffix of the name of a node the `remat` pass cloned into the backward region.
pub const RECOMPUTE_SUFFIX: &str = ".recompute";

/// Whether a node name marks a recomputed value.
pub fn is_recompute_name(name: Option<&str>) -> bool {
    name.is_some_and(|n| n == "recompute" || n.ends_with(RECOMPUTE_SUFFIX))
}

/// Whether an op is AdamW's (or a fused kernel computing AdamW).
fn is_optimizer_op(op: &Op) -> bool {
    match op {
        Op::AdamM { .. } | Op::AdamV { .. } | Op::AdamParam { .. } => true,
        Op::Kernel { body, .. } => body.node_ids().into_iter().any(|n| is_optimizer_op(&body.node(n).op)),
        _ => false,
    }
}

/// The roles of a graph's values (see the module docs for the rule).
pub struct Roles {
    /// Ancestor-or-self of the `loss` output (every node when there is none).
    forward: HashSet<NodeId>,
    /// Nodes that are an update output's value.
    updates: HashSet<NodeId>,
    has_loss: bool,
}

impl Roles {
    pub fn of(g: &Graph) -> Roles {
        let mut forward = HashSet::new();
        let loss = g.output("loss");
        if let Some(l) = loss {
            let mut stack = vec![l];
            while let Some(n) = stack.pop() {
                if forward.insert(n) {
                    stack.extend(g.operands(n));
                }
            }
        }
        let updates = g.outputs().iter().filter(|o| o.update).map(|o| o.node).collect();
        Roles { forward, updates, has_loss: loss.is_some() }
    }

    /// Whether the graph has a `loss` output (else everything counts as forward).
    pub fn has_loss(&self) -> bool {
        self.has_loss
    }

    /// Whether `n` is a forward value.
    pub fn is_forward(&self, n: NodeId) -> bool {
        !self.has_loss || self.forward.contains(&n)
    }

    pub fn phase(&self, g: &Graph, n: NodeId) -> Phase {
        let node = g.node(n);
        if is_recompute_name(node.name.as_deref()) {
            Phase::Recompute
        } else if self.updates.contains(&n) || is_optimizer_op(&node.op) {
            Phase::Optimizer
        } else if self.is_forward(n) {
            Phase::Forward
        } else {
            Phase::Backward
        }
    }

    pub fn category(&self, g: &Graph, n: NodeId) -> Category {
        if let Some(k) = g.input_kind(n) {
            return Category::of_input(k);
        }
        if g.node(n).name.as_deref().is_some_and(|s| s.starts_with("grad:")) {
            return Category::Gradients;
        }
        if self.has_loss && self.is_forward(n) && self.read_outside_forward(g, n) {
            return Category::Activations;
        }
        Category::Temporaries
    }

    /// Whether a value outside the forward reads `n`, directly or through views of it (a
    /// reshape, transpose, slice or broadcast reads the same bytes: a packed kernel's results
    /// are read through slices).
    fn read_outside_forward(&self, g: &Graph, n: NodeId) -> bool {
        let mut stack = vec![n];
        let mut seen = HashSet::new();
        while let Some(v) = stack.pop() {
            for u in g.users(v) {
                let view = matches!(g.node(u).op, Op::Reshape { .. } | Op::Transpose { .. } | Op::Slice { .. } | Op::Broadcast { .. });
                if view && self.is_forward(u) {
                    if seen.insert(u) {
                        stack.push(u);
                    }
                } else if !self.is_forward(u) {
                    return true;
                }
            }
        }
        false
    }

    /// `n`'s category and phase.
    pub fn role(&self, g: &Graph, n: NodeId) -> Role {
        if let Some(k) = g.input_kind(n) {
            return Role::input(k);
        }
        Role { category: self.category(g, n), phase: self.phase(g, n) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BinaryOp, DType, UnaryOp};

    /// x (data), w (trainable): h = x*w (forward, read by the backward: an activation),
    /// loss = sum(h); the backward's grad:w; a recomputed clone; w's update.
    #[test]
    fn values_by_category_and_phase() {
        let mut g = Graph::new("t");
        let x = g.input("x", InputKind::Data, DType::F32, [4]).unwrap();
        let w = g.input("w", InputKind::Trainable, DType::F32, [4]).unwrap();
        let h = g.add(Op::Binary(BinaryOp::Mul), &[x, w]).unwrap();
        let t = g.add(Op::Unary(UnaryOp::Exp), &[h]).unwrap();
        let loss = g.add_named(Op::SumTo { shape: crate::Shape::scalar() }, &[t], "loss").unwrap();
        let r = g.add_named(Op::Unary(UnaryOp::Exp), &[h], "t.recompute").unwrap();
        let gw = g.add_named(Op::Binary(BinaryOp::Mul), &[r, x], "grad:w").unwrap();
        let w1 = g.add_named(Op::Binary(BinaryOp::Sub), &[w, gw], "w.next").unwrap();
        g.set_output("loss", loss).unwrap();
        g.set_update("w", w1).unwrap();
        let roles = Roles::of(&g);
        let role = |n| roles.role(&g, n);
        assert_eq!(role(x), Role::input(InputKind::Data));
        assert_eq!(role(w).category, Category::Trainable);
        assert_eq!(role(h), Role { category: Category::Activations, phase: Phase::Forward });
        assert_eq!(role(t), Role { category: Category::Temporaries, phase: Phase::Forward });
        assert_eq!(role(r), Role { category: Category::Temporaries, phase: Phase::Recompute });
        assert_eq!(role(gw), Role { category: Category::Gradients, phase: Phase::Backward });
        assert_eq!(role(w1), Role { category: Category::Temporaries, phase: Phase::Optimizer });
        assert!(Category::ALL.iter().enumerate().all(|(i, c)| c.index() == i));
    }
}
