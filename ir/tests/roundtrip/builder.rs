//! The graph builder: the pool of nodes built so far, operands drawn from it (or fitting leaves
//! made for them), the outputs, and the two ways a whole graph is built.

use std::collections::BTreeSet;

use qatc_ir::{DType, Graph, InputKind, IrError, NodeId, Op, Shape, TensorType};

use crate::choices::{Choices, NAMES};
use crate::ops::N_SLOTS;

pub struct Builder<'a> {
    pub g: Graph,
    pub ch: &'a mut Choices,
    /// Every node built so far, in build order (the pool operands are drawn from).
    nodes: Vec<NodeId>,
    input_names: BTreeSet<String>,
}

impl<'a> Builder<'a> {
    fn new(ch: &'a mut Choices) -> Builder<'a> {
        let name = format!("g {}", ch.pick(&NAMES));
        Builder { g: Graph::new(name), ch, nodes: Vec::new(), input_names: BTreeSet::new() }
    }

    pub fn ty(&self, id: NodeId) -> TensorType {
        self.g.ty(id).clone()
    }

    /// A fresh input name: an odd name from the list, suffixed when already taken.
    fn fresh_input_name(&mut self) -> String {
        let base = self.ch.pick(&NAMES).to_string();
        let mut name = base.clone();
        let mut k = 0;
        while self.input_names.contains(&name) {
            k += 1;
            name = format!("{base}#{k}");
        }
        self.input_names.insert(name.clone());
        name
    }

    fn push(&mut self, id: NodeId) -> NodeId {
        self.nodes.push(id);
        id
    }

    pub fn input(&mut self, ty: TensorType) -> Result<NodeId, IrError> {
        let kind = self.ch.pick(&[InputKind::Frozen, InputKind::Trainable, InputKind::Data, InputKind::State]);
        let name = self.fresh_input_name();
        let id = self.g.input(name, kind, ty.dtype, ty.shape)?;
        Ok(self.push(id))
    }

    pub fn constant(&mut self, ty: TensorType) -> Result<NodeId, IrError> {
        let v = self.ch.float();
        let id = self.g.constant(v, ty.dtype, ty.shape)?;
        Ok(self.push(id))
    }

    /// A new leaf (input or const) of type `ty`.
    pub fn leaf(&mut self, ty: TensorType) -> Result<NodeId, IrError> {
        if self.ch.flip() {
            self.input(ty)
        } else {
            self.constant(ty)
        }
    }

    /// An existing node satisfying `pred` (usually), or None.
    pub fn existing(&mut self, pred: impl Fn(&TensorType) -> bool) -> Option<NodeId> {
        let cands: Vec<NodeId> = self.nodes.iter().copied().filter(|&n| pred(self.g.ty(n))).collect();
        if cands.is_empty() || self.ch.one_in(4) {
            None
        } else {
            Some(self.ch.pick(&cands))
        }
    }

    /// A node of exactly type `ty`: an existing one or a new leaf.
    pub fn of_type(&mut self, ty: TensorType) -> Result<NodeId, IrError> {
        match self.existing(|t| *t == ty) {
            Some(n) => Ok(n),
            None => self.leaf(ty),
        }
    }

    /// A float node of rank in [min_rank, max_rank].
    pub fn float_operand(&mut self, min_rank: usize, max_rank: usize) -> Result<NodeId, IrError> {
        match self.existing(|t| t.dtype.is_float() && (min_rank..=max_rank).contains(&t.shape.rank())) {
            Some(n) => Ok(n),
            None => {
                let ty = TensorType::new(self.ch.float_dtype(), self.ch.dims(min_rank, max_rank.min(4)));
                self.leaf(ty)
            }
        }
    }

    /// A node of any dtype of rank in [min_rank, 4].
    pub fn any_operand(&mut self, min_rank: usize) -> Result<NodeId, IrError> {
        match self.existing(|t| t.shape.rank() >= min_rank) {
            Some(n) => Ok(n),
            None => {
                let ty = TensorType::new(self.ch.any_dtype(), self.ch.dims(min_rank, 3));
                self.leaf(ty)
            }
        }
    }

    /// An i32 node of rank <= 2.
    pub fn ids(&mut self) -> Result<NodeId, IrError> {
        match self.existing(|t| t.dtype == DType::I32 && t.shape.rank() <= 2) {
            Some(n) => Ok(n),
            None => {
                let ty = TensorType::new(DType::I32, self.ch.dims(0, 2));
                self.leaf(ty)
            }
        }
    }

    /// A float scalar of any float dtype (learning rate, step, dloss).
    pub fn float_scalar(&mut self) -> Result<NodeId, IrError> {
        let d = self.ch.float_dtype();
        self.of_type(TensorType::new(d, Shape::scalar()))
    }

    /// Adds an op node, naming some of them (non-input names need not be unique).
    pub fn op(&mut self, op: Op, operands: &[NodeId]) -> Result<NodeId, IrError> {
        let name = if self.ch.one_in(4) { Some(self.ch.pick(&NAMES).to_string()) } else { None };
        let id = self.g.add_node(op, operands, name)?;
        Ok(self.push(id))
    }

    /// A shape with `n` elements: n's prime factors spread over a random rank, 1s mixed in.
    pub fn factor_shape(&mut self, n: usize) -> Vec<usize> {
        let r = if n == 1 { self.ch.range(0, 3) } else { self.ch.range(1, 4) };
        let mut dims = vec![1; r];
        let (mut m, mut p) = (n, 2);
        while m > 1 {
            while m % p == 0 {
                let i = self.ch.below(r);
                dims[i] *= p;
                m /= p;
            }
            p += 1;
        }
        dims
    }

    /// Builds one node in generator slot `slot`.
    /// Declares 1..=3 outputs and, for some trainable/state inputs, an update of equal type.
    fn outputs(&mut self) -> Result<(), IrError> {
        let mut names = BTreeSet::new();
        for _ in 0..self.ch.range(1, 3) {
            let node = self.ch.pick(&self.nodes);
            let base = self.ch.pick(&NAMES).to_string();
            let mut name = base.clone();
            let mut k = 0;
            while names.contains(&name) {
                k += 1;
                name = format!("{base}~{k}");
            }
            names.insert(name.clone());
            self.g.set_output(name, node)?;
        }
        for inp in self.g.inputs() {
            if !matches!(self.g.input_kind(inp), Some(InputKind::Trainable | InputKind::State)) || self.ch.flip() {
                continue;
            }
            let ty = self.ty(inp);
            let cands: Vec<NodeId> = self.nodes.iter().copied().filter(|&n| *self.g.ty(n) == ty).collect();
            let node = self.ch.pick(&cands);
            let name = self.g.node(inp).name.clone().unwrap_or_default();
            self.g.set_update(name, node)?;
        }
        Ok(())
    }
}

/// Builds a random graph: a few leaves, `steps` ops drawn from `ch`, then outputs.
pub fn random_graph(ch: &mut Choices, steps: usize) -> Result<Graph, IrError> {
    let mut b = Builder::new(ch);
    for _ in 0..b.ch.range(1, 4) {
        let ty = TensorType::new(b.ch.any_dtype(), b.ch.dims(0, 4));
        b.input(ty)?;
    }
    for _ in 0..steps {
        let slot = b.ch.below(N_SLOTS);
        b.step(slot)?;
    }
    b.outputs()?;
    Ok(b.g)
}

/// A graph with one node of every generator slot (plus the leaves they needed).
pub fn every_op_graph(seed: u32) -> Result<Graph, IrError> {
    let mut ch = Choices::new((0..4000u32).map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 7).collect());
    let mut b = Builder::new(&mut ch);
    for slot in 0..N_SLOTS {
        b.step(slot)?;
    }
    b.outputs()?;
    Ok(b.g)
}
