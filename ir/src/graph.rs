//! The graph: nodes with one op and one output each, operand edges ordered by slot, named outputs.
//! petgraph's StableGraph stores it (indices survive removals, so passes can delete nodes while
//! holding ids), but no petgraph type crosses this module's public API.

use std::collections::BTreeMap;

use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::{EdgeRef, NodeIndexable};
use petgraph::Direction;

use crate::error::IrError;
use crate::infer::infer;
use crate::op::{InputKind, Op};
use crate::types::{DType, Shape, TensorType};

/// A node's id in its graph. Stable under removal of other nodes; not stable across printing
/// (the printer renumbers in topological order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub(crate) u32);

impl NodeId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub op: Op,
    pub ty: TensorType,
    /// The checkpoint key or other human name this value carries (inputs always have one).
    pub name: Option<String>,
}

/// A named result of the graph. `update` outputs are written back into the trainable or state
/// input of the same name after the step (new weights, Adam moments, the step count).
#[derive(Clone, Debug, PartialEq)]
pub struct Output {
    pub name: String,
    pub node: NodeId,
    pub update: bool,
}

/// Graphs compare by their printed text: structure, types, names and outputs, not indices.
impl PartialEq for Graph {
    fn eq(&self, other: &Graph) -> bool {
        crate::text::print(self) == crate::text::print(other)
    }
}

#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub name: String,
    g: StableDiGraph<Node, u32>,
    outputs: Vec<Output>,
    inputs: BTreeMap<String, NodeId>,
}

impl Graph {
    pub fn new(name: impl Into<String>) -> Graph {
        Graph { name: name.into(), ..Default::default() }
    }

    fn idx(id: NodeId) -> NodeIndex {
        NodeIndex::new(id.0 as usize)
    }

    /// Describes a node for error messages: its name if it has one, else its op.
    pub fn describe(&self, id: NodeId) -> String {
        match self.g.node_weight(Self::idx(id)) {
            Some(n) => match &n.name {
                Some(name) => format!("{:?} ({})", name, n.op.mnemonic()),
                None => format!("#{} ({})", id.0, n.op.mnemonic()),
            },
            None => format!("#{}", id.0),
        }
    }

    /// Adds a node after inferring its type from its operands.
    pub fn add(&mut self, op: Op, operands: &[NodeId]) -> Result<NodeId, IrError> {
        self.add_node(op, operands, None)
    }

    /// Adds a node that carries a name (a checkpoint key, or the role it plays).
    pub fn add_named(&mut self, op: Op, operands: &[NodeId], name: impl Into<String>) -> Result<NodeId, IrError> {
        self.add_node(op, operands, Some(name.into()))
    }

    pub fn add_node(&mut self, op: Op, operands: &[NodeId], name: Option<String>) -> Result<NodeId, IrError> {
        let mut tys = Vec::with_capacity(operands.len());
        for &o in operands {
            tys.push(&self.try_node(o)?.ty);
        }
        let ty = infer(&op, &tys).map_err(|msg| IrError::Type {
            node: match &name {
                Some(n) => format!("{n:?} ({})", op.mnemonic()),
                None => format!("new {}", op.mnemonic()),
            },
            msg,
        })?;
        if ty.checked_bytes().is_none() {
            let node = match &name {
                Some(n) => format!("{n:?} ({})", op.mnemonic()),
                None => format!("new {}", op.mnemonic()),
            };
            return Err(IrError::Type { node, msg: format!("{ty} is more than 2^60 bytes: no memory holds it") });
        }
        if let Op::Input { .. } = op {
            let Some(n) = &name else {
                return Err(IrError::Type { node: "new input".into(), msg: "inputs must be named".into() });
            };
            if self.inputs.contains_key(n) {
                return Err(IrError::DuplicateInput(n.clone()));
            }
        }
        let is_input = matches!(op, Op::Input { .. });
        let idx = self.g.add_node(Node { op, ty, name: name.clone() });
        let id = NodeId(idx.index() as u32);
        for (slot, &o) in operands.iter().enumerate() {
            self.g.add_edge(Self::idx(o), idx, slot as u32);
        }
        if is_input {
            if let Some(n) = name {
                self.inputs.insert(n, id);
            }
        }
        Ok(id)
    }

    /// Declares an input leaf.
    pub fn input(&mut self, name: impl Into<String>, kind: InputKind, dtype: DType, shape: impl Into<Shape>) -> Result<NodeId, IrError> {
        self.add_named(Op::Input { kind, dtype, shape: shape.into() }, &[], name)
    }

    pub fn constant(&mut self, value: f64, dtype: DType, shape: impl Into<Shape>) -> Result<NodeId, IrError> {
        self.add(Op::Const { value, dtype, shape: shape.into() }, &[])
    }

    fn try_node(&self, id: NodeId) -> Result<&Node, IrError> {
        self.g.node_weight(Self::idx(id)).ok_or(IrError::UnknownNode(id.0))
    }

    /// The node behind an id. Ids come from this graph, so a missing node is a caller bug.
    pub fn node(&self, id: NodeId) -> &Node {
        &self.g[Self::idx(id)]
    }

    pub fn contains(&self, id: NodeId) -> bool {
        self.g.contains_node(Self::idx(id))
    }

    pub fn ty(&self, id: NodeId) -> &TensorType {
        &self.node(id).ty
    }

    pub fn set_name(&mut self, id: NodeId, name: impl Into<String>) {
        if !matches!(self.node(id).op, Op::Input { .. }) {
            self.g[Self::idx(id)].name = Some(name.into());
        }
    }

    /// Operands in slot order.
    pub fn operands(&self, id: NodeId) -> Vec<NodeId> {
        let mut es: Vec<(u32, NodeId)> =
            self.g.edges_directed(Self::idx(id), Direction::Incoming).map(|e| (*e.weight(), NodeId(e.source().index() as u32))).collect();
        es.sort_unstable();
        es.into_iter().map(|(_, n)| n).collect()
    }

    /// Nodes that use `id` as an operand (each once, in id order).
    pub fn users(&self, id: NodeId) -> Vec<NodeId> {
        let mut us: Vec<NodeId> = self.g.neighbors_directed(Self::idx(id), Direction::Outgoing).map(|n| NodeId(n.index() as u32)).collect();
        us.sort_unstable();
        us.dedup();
        us
    }

    /// All live node ids in insertion order.
    pub fn node_ids(&self) -> Vec<NodeId> {
        self.g.node_indices().map(|n| NodeId(n.index() as u32)).collect()
    }

    pub fn len(&self) -> usize {
        self.g.node_count()
    }

    pub fn is_empty(&self) -> bool {
        self.g.node_count() == 0
    }

    pub fn find_input(&self, name: &str) -> Option<NodeId> {
        self.inputs.get(name).copied()
    }

    /// Input leaves, ordered by name.
    pub fn inputs(&self) -> Vec<NodeId> {
        self.inputs.values().copied().collect()
    }

    pub fn input_kind(&self, id: NodeId) -> Option<InputKind> {
        match self.node(id).op {
            Op::Input { kind, .. } => Some(kind),
            _ => None,
        }
    }

    /// Changes an input's kind (freezing or unfreezing a weight).
    pub fn set_input_kind(&mut self, id: NodeId, new_kind: InputKind) {
        if let Op::Input { kind, .. } = &mut self.g[Self::idx(id)].op {
            *kind = new_kind;
        }
    }

    pub fn outputs(&self) -> &[Output] {
        &self.outputs
    }

    pub fn output(&self, name: &str) -> Option<NodeId> {
        self.outputs.iter().find(|o| o.name == name && !o.update).map(|o| o.node)
    }

    /// Declares a named result.
    pub fn set_output(&mut self, name: impl Into<String>, node: NodeId) -> Result<(), IrError> {
        let name = name.into();
        if self.outputs.iter().any(|o| o.name == name && !o.update) {
            return Err(IrError::DuplicateOutput(name));
        }
        self.try_node(node)?;
        self.outputs.push(Output { name, node, update: false });
        Ok(())
    }

    /// Declares that after the step, input `target` takes the value of `node`.
    pub fn set_update(&mut self, target: impl Into<String>, node: NodeId) -> Result<(), IrError> {
        let name = target.into();
        let inp = self.find_input(&name).ok_or_else(|| IrError::BadUpdateTarget(name.clone()))?;
        if !matches!(self.input_kind(inp), Some(InputKind::Trainable | InputKind::State)) {
            return Err(IrError::BadUpdateTarget(name));
        }
        let (want, got) = (self.ty(inp).clone(), self.try_node(node)?.ty.clone());
        if want != got {
            return Err(IrError::UpdateType { name, got: got.to_string(), want: want.to_string() });
        }
        if self.outputs.iter().any(|o| o.name == name && o.update) {
            return Err(IrError::DuplicateOutput(name));
        }
        self.outputs.push(Output { name, node, update: true });
        Ok(())
    }

    pub fn clear_outputs(&mut self) {
        self.outputs.clear();
    }

    /// Points every use of `old` (operands and outputs) at `new`, except `new`'s own use of `old`
    /// (so a node can be wrapped: `let q = add(f, [w]); replace_all_uses(w, q)`).
    pub fn replace_all_uses(&mut self, old: NodeId, new: NodeId) {
        let edges: Vec<_> = self
            .g
            .edges_directed(Self::idx(old), Direction::Outgoing)
            .filter(|e| e.target() != Self::idx(new))
            .map(|e| (e.id(), e.target(), *e.weight()))
            .collect();
        for (id, t, slot) in edges {
            self.g.remove_edge(id);
            self.g.add_edge(Self::idx(new), t, slot);
        }
        for o in &mut self.outputs {
            if o.node == old {
                o.node = new;
            }
        }
    }

    /// Points `user`'s operands that are `old` at `new` instead (one user's uses, where
    /// `replace_all_uses` moves every user: ZeRO-3 gives each use of a parameter its own gather).
    pub fn replace_use(&mut self, user: NodeId, old: NodeId, new: NodeId) {
        let edges: Vec<_> = self
            .g
            .edges_directed(Self::idx(old), Direction::Outgoing)
            .filter(|e| e.target() == Self::idx(user))
            .map(|e| (e.id(), *e.weight()))
            .collect();
        for (id, slot) in edges {
            self.g.remove_edge(id);
            self.g.add_edge(Self::idx(new), Self::idx(user), slot);
        }
    }

    /// Gives input `id` a new shape (ZeRO-3: a parameter becomes this rank's shard). Its users
    /// keep the types they were built with, so the caller rewires every one of them before the
    /// verifier sees the graph.
    pub fn set_input_shape(&mut self, id: NodeId, new_shape: Shape) {
        let node = &mut self.g[Self::idx(id)];
        if let Op::Input { shape, dtype, .. } = &mut node.op {
            *shape = new_shape.clone();
            node.ty = TensorType::new(*dtype, new_shape);
        }
    }

    /// Deterministic topological order: depth-first post-order from the outputs (operands left to
    /// right), then nodes no output reaches, in insertion order. It depends only on the graph's
    /// structure and output order, never on how indices were allocated.
    pub fn topo_order(&self) -> Result<Vec<NodeId>, IrError> {
        let mut state = vec![0u8; self.g.node_bound()]; // 1 open, 2 done
        let mut order = Vec::with_capacity(self.len());
        let roots: Vec<NodeId> = self.outputs.iter().map(|o| o.node).chain(self.node_ids()).collect();
        for root in roots {
            if state[root.index()] != 0 {
                continue;
            }
            // Iterative DFS: (node, next operand to visit).
            let mut stack = vec![(root, 0usize, self.operands(root))];
            state[root.index()] = 1;
            while let Some((n, i, ops)) = stack.last_mut() {
                if *i < ops.len() {
                    let o = ops[*i];
                    *i += 1;
                    match state[o.index()] {
                        0 => {
                            state[o.index()] = 1;
                            let oo = self.operands(o);
                            stack.push((o, 0, oo));
                        }
                        1 => return Err(IrError::Cycle(self.describe(o))),
                        _ => {}
                    }
                } else {
                    let n = *n;
                    state[n.index()] = 2;
                    order.push(n);
                    stack.pop();
                }
            }
        }
        Ok(order)
    }

    /// Removes nodes that no output needs. Inputs stay (they are the graph's signature) unless
    /// `drop_inputs`. Returns how many nodes were removed.
    pub fn remove_dead(&mut self, drop_inputs: bool) -> usize {
        let mut live = vec![false; self.g.node_bound()];
        let mut stack: Vec<NodeId> = self.outputs.iter().map(|o| o.node).collect();
        // an input that an update writes is part of the step's state even if nothing reads it
        stack.extend(self.outputs.iter().filter(|o| o.update).filter_map(|o| self.inputs.get(&o.name).copied()));
        while let Some(n) = stack.pop() {
            if std::mem::replace(&mut live[n.index()], true) {
                continue;
            }
            stack.extend(self.operands(n));
        }
        let dead: Vec<NodeId> = self
            .node_ids()
            .into_iter()
            .filter(|n| !live[n.index()] && (drop_inputs || !matches!(self.node(*n).op, Op::Input { .. })))
            .collect();
        for &n in &dead {
            if let Some(node) = self.g.remove_node(Self::idx(n)) {
                if let (Op::Input { .. }, Some(name)) = (&node.op, &node.name) {
                    self.inputs.remove(name);
                }
            }
        }
        dead.len()
    }

    /// Counts live nodes by mnemonic (for reports and tests).
    pub fn op_counts(&self) -> BTreeMap<&'static str, usize> {
        let mut m = BTreeMap::new();
        for n in self.g.node_weights() {
            *m.entry(n.op.mnemonic()).or_insert(0) += 1;
        }
        m
    }
}
