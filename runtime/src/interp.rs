//! The interpreter: a precomputed schedule (the graph's topological order) walked once per run,
//! evaluating only what the requested values need and dropping each intermediate after its last
//! use, so a GPT-2-sized step holds only its live activations.

use std::borrow::Cow;
use std::collections::HashMap;
use std::marker::PhantomData;

use qatc_ir::{DType, Graph, InputKind, NodeId, Op, TensorType};

use crate::error::RuntimeError;
use crate::eval::{eval, round_to_dtype};
use crate::float::Float;
use crate::value::Value;

/// One node of the schedule. Operands are positions in the schedule, not node ids.
#[derive(Clone, Debug)]
struct Step {
    op: Op,
    ty: TensorType,
    operands: Vec<usize>,
    /// `Graph::describe` of the node, for messages.
    label: String,
    /// For inputs: the name the caller supplies the value under.
    input_name: Option<String>,
}

/// A named graph result, by schedule position.
#[derive(Clone, Debug)]
struct OutputRef {
    name: String,
    pos: usize,
    update: bool,
}

/// The reference interpreter for one graph. It owns everything it needs (the graph can be
/// dropped or changed afterwards) and can run any number of times, also from several threads.
#[derive(Clone, Debug)]
pub struct Interpreter<T> {
    steps: Vec<Step>,
    pos_of: HashMap<NodeId, usize>,
    outputs: Vec<OutputRef>,
    _t: PhantomData<fn() -> T>,
}

/// A run's results: non-update outputs and update outputs (new values of trainable and state
/// inputs, to be written back by the caller), each by name.
#[derive(Clone, Debug, PartialEq)]
pub struct RunOutputs<T> {
    pub outputs: HashMap<String, Value<T>>,
    pub updates: HashMap<String, Value<T>>,
}

impl<T: Float> Interpreter<T> {
    /// Verifies `graph` and precomputes its schedule.
    pub fn new(graph: &Graph) -> Result<Self, RuntimeError> {
        qatc_ir::verify(graph)?;
        let order = graph.topo_order()?;
        let pos_of: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let mut steps = Vec::with_capacity(order.len());
        for &id in &order {
            let node = graph.node(id);
            let mut operands = Vec::new();
            for o in graph.operands(id) {
                operands.push(*pos_of.get(&o).ok_or(RuntimeError::UnknownNode(o))?);
            }
            let input_name = match node.op {
                Op::Input { .. } => node.name.clone(),
                _ => None,
            };
            steps.push(Step { op: node.op.clone(), ty: node.ty.clone(), operands, label: graph.describe(id), input_name });
        }
        let mut outputs = Vec::new();
        for o in graph.outputs() {
            let pos = *pos_of.get(&o.node).ok_or(RuntimeError::UnknownNode(o.node))?;
            outputs.push(OutputRef { name: o.name.clone(), pos, update: o.update });
        }
        Ok(Interpreter { steps, pos_of, outputs, _t: PhantomData })
    }

    /// The graph's inputs as (name, kind, type), in schedule order: what `run` expects.
    pub fn inputs(&self) -> Vec<(&str, InputKind, &TensorType)> {
        self.steps
            .iter()
            .filter_map(|s| match (&s.op, &s.input_name) {
                (Op::Input { kind, .. }, Some(name)) => Some((name.as_str(), *kind, &s.ty)),
                _ => None,
            })
            .collect()
    }

    /// Runs the graph. `inputs` supplies Input nodes by name (extra names are ignored; only the
    /// inputs the outputs depend on are required). Returns every output and every update output
    /// by name; fails with `OutputClash` if an output and an update share a name but not a value
    /// (`run_split` keeps them apart).
    pub fn run(&self, inputs: &HashMap<String, Value<T>>) -> Result<HashMap<String, Value<T>>, RuntimeError> {
        let RunOutputs { mut outputs, updates } = self.run_split(inputs)?;
        for (name, v) in updates {
            match outputs.get(&name) {
                Some(old) if *old != v => return Err(RuntimeError::OutputClash(name)),
                _ => {
                    outputs.insert(name, v);
                }
            }
        }
        Ok(outputs)
    }

    /// Runs the graph, keeping outputs and updates apart.
    pub fn run_split(&self, inputs: &HashMap<String, Value<T>>) -> Result<RunOutputs<T>, RuntimeError> {
        let want: Vec<usize> = self.outputs.iter().map(|o| o.pos).collect();
        let vals = self.execute(inputs, &want)?;
        let mut res = RunOutputs { outputs: HashMap::new(), updates: HashMap::new() };
        for (o, v) in self.outputs.iter().zip(vals) {
            let map = if o.update { &mut res.updates } else { &mut res.outputs };
            map.insert(o.name.clone(), v);
        }
        Ok(res)
    }

    /// Runs the graph on `inputs.len()` ranks in step, simulating them in one process (the
    /// reference for data parallelism and ZeRO): each node is evaluated for every rank, a
    /// collective from every rank's operand at once (`collective.rs`). Each rank's outputs and
    /// updates, in rank order.
    pub fn run_ranks(&self, inputs: &[HashMap<String, Value<T>>]) -> Result<Vec<RunOutputs<T>>, RuntimeError> {
        let want: Vec<usize> = self.outputs.iter().map(|o| o.pos).collect();
        let (needed, last_use) = self.plan(&want);
        let (n, ranks) = (self.steps.len(), inputs.len());
        let mut vals: Vec<Vec<Option<Cow<'_, Value<T>>>>> = (0..ranks).map(|_| (0..n).map(|_| None).collect()).collect();
        let missing = |i: usize, o: usize| self.node_err(i, format!("operand at schedule position {o} was not computed"));
        for i in 0..n {
            if !needed[i] {
                continue;
            }
            let step = &self.steps[i];
            if let Op::Input { .. } = step.op {
                for (r, given) in inputs.iter().enumerate() {
                    vals[r][i] = Some(self.input(step, given)?);
                }
            } else if crate::collective::is_collective(&step.op) {
                let o = step.operands[0];
                let args = vals.iter().map(|v| v[o].as_deref().ok_or_else(|| missing(i, o))).collect::<Result<Vec<_>, _>>()?;
                let outs = crate::collective::combine(&step.op, &args).map_err(|m| self.node_err(i, m))?;
                for (r, v) in outs.into_iter().enumerate() {
                    vals[r][i] = Some(Cow::Owned(v));
                }
            } else {
                for rank in vals.iter_mut() {
                    let v = {
                        let args = step
                            .operands
                            .iter()
                            .map(|&o| rank[o].as_deref().ok_or_else(|| missing(i, o)))
                            .collect::<Result<Vec<_>, _>>()?;
                        eval(&step.op, &step.ty, &args).map_err(|m| self.node_err(i, m))?
                    };
                    rank[i] = Some(Cow::Owned(v));
                }
            }
            for &o in &step.operands {
                if last_use[o] == i {
                    for rank in vals.iter_mut() {
                        rank[o] = None;
                    }
                }
            }
        }
        vals.into_iter()
            .map(|rank| {
                let mut res = RunOutputs { outputs: HashMap::new(), updates: HashMap::new() };
                for o in &self.outputs {
                    let v = rank[o.pos].as_ref().ok_or_else(|| self.node_err(o.pos, "was not computed".into()))?;
                    let map = if o.update { &mut res.updates } else { &mut res.outputs };
                    map.insert(o.name.clone(), v.clone().into_owned());
                }
                Ok(res)
            })
            .collect()
    }

    /// Runs only what the requested nodes need and returns their values, in `want`'s order.
    pub fn run_nodes(&self, inputs: &HashMap<String, Value<T>>, want: &[NodeId]) -> Result<Vec<Value<T>>, RuntimeError> {
        let pos =
            want.iter().map(|id| self.pos_of.get(id).copied().ok_or(RuntimeError::UnknownNode(*id))).collect::<Result<Vec<_>, _>>()?;
        self.execute(inputs, &pos)
    }

    fn node_err(&self, pos: usize, msg: String) -> RuntimeError {
        RuntimeError::Node { node: self.steps[pos].label.clone(), msg }
    }

    /// Looks up and checks one input's value. f16/bf16 inputs are rounded to their dtype (a copy);
    /// others are borrowed, so weights are not copied per run.
    fn input<'a>(&self, step: &Step, inputs: &'a HashMap<String, Value<T>>) -> Result<Cow<'a, Value<T>>, RuntimeError> {
        let name = step.input_name.clone().unwrap_or_default();
        let v = inputs.get(&name).ok_or_else(|| RuntimeError::MissingInput(name.clone()))?;
        let want_kind = if step.ty.dtype.is_float() { "float" } else { "int" };
        if v.kind_name() != want_kind {
            return Err(RuntimeError::InputKind { name, want: format!("{want_kind} ({})", step.ty), got: v.kind_name().to_string() });
        }
        let want = step.ty.shape.dims();
        if v.shape() != want {
            return Err(RuntimeError::InputShape { name, want: want.to_vec(), got: v.shape().to_vec() });
        }
        if v.len() != step.ty.numel() {
            return Err(RuntimeError::BadTensor { shape: want.to_vec(), want: step.ty.numel(), got: v.len() });
        }
        Ok(match step.ty.dtype {
            DType::F16 | DType::BF16 => {
                let mut owned = v.clone();
                round_to_dtype(&mut owned, step.ty.dtype);
                Cow::Owned(owned)
            }
            DType::F32 | DType::I32 | DType::U8 | DType::I4 => Cow::Borrowed(v),
        })
    }

    /// Which steps `want` needs, and the position of each value's last use (`usize::MAX` for the
    /// wanted values, which are never freed).
    fn plan(&self, want: &[usize]) -> (Vec<bool>, Vec<usize>) {
        let n = self.steps.len();
        // The schedule is topological, so one reverse sweep sees every user before its operands.
        let mut needed = vec![false; n];
        for &w in want {
            needed[w] = true;
        }
        for i in (0..n).rev() {
            if needed[i] {
                for &o in &self.steps[i].operands {
                    needed[o] = true;
                }
            }
        }
        let mut last_use: Vec<usize> = vec![0; n];
        for (i, s) in self.steps.iter().enumerate() {
            if needed[i] {
                for &o in &s.operands {
                    last_use[o] = i;
                }
            }
        }
        for &w in want {
            last_use[w] = usize::MAX;
        }
        (needed, last_use)
    }

    /// Evaluates the schedule positions in `want` (and what they need) and returns their values.
    fn execute(&self, inputs: &HashMap<String, Value<T>>, want: &[usize]) -> Result<Vec<Value<T>>, RuntimeError> {
        self.execute_counting(inputs, want).map(|(v, _)| v)
    }

    /// `execute`, also returning the most values held at once (what freeing after last use keeps
    /// small; checked by the tests).
    fn execute_counting(&self, inputs: &HashMap<String, Value<T>>, want: &[usize]) -> Result<(Vec<Value<T>>, usize), RuntimeError> {
        let n = self.steps.len();
        let (needed, last_use) = self.plan(want);
        let mut vals: Vec<Option<Cow<'_, Value<T>>>> = (0..n).map(|_| None).collect();
        let (mut live, mut peak) = (0usize, 0usize);
        for i in 0..n {
            if !needed[i] {
                continue;
            }
            let step = &self.steps[i];
            let v = if let Op::Input { .. } = step.op {
                self.input(step, inputs)?
            } else {
                let mut args = Vec::with_capacity(step.operands.len());
                for &o in &step.operands {
                    match vals[o].as_deref() {
                        Some(v) => args.push(v),
                        None => return Err(self.node_err(i, format!("operand at schedule position {o} was not computed"))),
                    }
                }
                Cow::Owned(eval(&step.op, &step.ty, &args).map_err(|m| self.node_err(i, m))?)
            };
            vals[i] = Some(v);
            live += 1;
            peak = peak.max(live);
            for &o in &step.operands {
                if last_use[o] == i && vals[o].take().is_some() {
                    live -= 1;
                }
            }
        }
        let out = want
            .iter()
            .map(|&w| match &vals[w] {
                Some(v) => Ok(v.clone().into_owned()),
                None => Err(self.node_err(w, "was not computed".into())),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((out, peak))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use qatc_ir::UnaryOp;

    /// A chain x -> neg -> neg -> ... holds two values at a time however long it is, and a node
    /// no output reaches is neither computed nor needs its input.
    #[test]
    fn values_are_freed_after_their_last_use() {
        let mut g = Graph::new("chain");
        let x = g.input("x", InputKind::Data, DType::F32, [4]).unwrap();
        let unused = g.input("unused", InputKind::Data, DType::F32, [4]).unwrap();
        g.add(Op::Unary(UnaryOp::Log), &[unused]).unwrap();
        let mut y = x;
        for _ in 0..50 {
            y = g.add(Op::Unary(UnaryOp::Neg), &[y]).unwrap();
        }
        // x is used twice, early and at the end, so it stays live throughout: 3 at peak.
        let z = g.add(Op::Binary(qatc_ir::BinaryOp::Add), &[y, x]).unwrap();
        g.set_output("z", z).unwrap();
        let interp = Interpreter::<f32>::new(&g).unwrap();
        let inputs = HashMap::from([("x".to_string(), Value::floats([4], &[1.0, 2.0, 3.0, 4.0]).unwrap())]);
        let want = vec![interp.pos_of[&z]];
        let (out, peak) = interp.execute_counting(&inputs, &want).unwrap();
        assert_eq!(out[0], Value::floats([4], &[2.0, 4.0, 6.0, 8.0]).unwrap());
        assert_eq!(peak, 3);
    }
}
