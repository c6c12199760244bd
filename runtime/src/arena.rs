//! Executing a memory plan: the step's nodes run in the planned order, and every value lives at
//! its planned byte offset in one arena (`Vec<u8>`), stored at its dtype (f16 as 2 bytes, i4
//! packed two codes a byte) and read back from there by its users. Inputs live in their own
//! storage, and a write-back overwrites its input's storage when it runs. Nothing is kept on
//! the side, so a plan that lets two live values share a byte, or writes back into an input that
//! is still to be read, corrupts the result: comparing with [`crate::Interpreter`] checks the
//! plan. f32 only (the arena stores f32 values bit for bit; f64 mode has no f32 storage).

use std::collections::HashMap;

use qatc_ir::{DType, Graph, NodeId, Op, TensorType};

use crate::error::RuntimeError;
use crate::eval::eval;
use crate::interp::RunOutputs;
use crate::value::{IntTensor, Tensor, Value};

/// Where a value is stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Slot {
    /// At this byte offset of the arena.
    Arena(usize),
    /// In the storage of the input of this name.
    Input(String),
}

/// A memory plan as the executor needs it: the order, a slot for every node, the arena size.
#[derive(Clone, Debug, Default)]
pub struct ArenaLayout {
    pub order: Vec<NodeId>,
    pub slots: HashMap<NodeId, Slot>,
    pub arena_bytes: usize,
}

#[derive(Clone, Debug)]
struct Step {
    op: Op,
    ty: TensorType,
    operands: Vec<NodeId>,
    label: String,
}

/// Runs a graph inside one arena, following a layout.
#[derive(Clone, Debug)]
pub struct ArenaInterpreter {
    steps: Vec<(NodeId, Step)>,
    slots: HashMap<NodeId, Slot>,
    types: HashMap<NodeId, TensorType>,
    inputs: Vec<(String, TensorType)>,
    outputs: Vec<(String, NodeId, bool)>,
    arena_bytes: usize,
}

/// Poison for bytes never written: a read of one shows up as NaN or garbage, not as zeros.
const POISON: u8 = 0xA5;

fn encode(v: &Value<f32>, ty: &TensorType, out: &mut [u8]) -> Result<(), String> {
    let want = ty.bytes();
    if out.len() < want {
        return Err(format!("slot of {} bytes for a {ty} value", out.len()));
    }
    match (ty.dtype, v) {
        (DType::F32, Value::Float(t)) => t.data.iter().zip(out.chunks_exact_mut(4)).for_each(|(x, b)| b.copy_from_slice(&x.to_le_bytes())),
        (DType::F16, Value::Float(t)) => {
            t.data.iter().zip(out.chunks_exact_mut(2)).for_each(|(x, b)| b.copy_from_slice(&half::f16::from_f32(*x).to_le_bytes()))
        }
        (DType::BF16, Value::Float(t)) => {
            t.data.iter().zip(out.chunks_exact_mut(2)).for_each(|(x, b)| b.copy_from_slice(&half::bf16::from_f32(*x).to_le_bytes()))
        }
        (DType::I32, Value::Int(t)) => t.data.iter().zip(out.chunks_exact_mut(4)).for_each(|(x, b)| b.copy_from_slice(&x.to_le_bytes())),
        (DType::U8, Value::Int(t)) => {
            for (x, b) in t.data.iter().zip(out.iter_mut()) {
                *b = u8::try_from(*x).map_err(|_| format!("code {x} does not fit u8"))?;
            }
        }
        (DType::I4, Value::Int(t)) => {
            for (k, pair) in t.data.chunks(2).enumerate() {
                let mut byte = 0u8;
                for (h, x) in pair.iter().enumerate() {
                    let c = u8::try_from(*x).ok().filter(|c| *c < 16).ok_or_else(|| format!("code {x} does not fit i4"))?;
                    byte |= c << (4 * h);
                }
                out[k] = byte;
            }
        }
        _ => return Err(format!("a {} value cannot be stored as {ty}", if matches!(v, Value::Float(_)) { "float" } else { "int" })),
    }
    Ok(())
}

fn decode(ty: &TensorType, b: &[u8]) -> Value<f32> {
    let shape = ty.shape.dims().to_vec();
    let n = ty.numel();
    match ty.dtype {
        DType::F32 => {
            Value::Float(Tensor { shape, data: b.chunks_exact(4).take(n).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect() })
        }
        DType::F16 => Value::Float(Tensor {
            shape,
            data: b.chunks_exact(2).take(n).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        }),
        DType::BF16 => Value::Float(Tensor {
            shape,
            data: b.chunks_exact(2).take(n).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        }),
        DType::I32 => {
            Value::Int(IntTensor { shape, data: b.chunks_exact(4).take(n).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect() })
        }
        DType::U8 => Value::Int(IntTensor { shape, data: b.iter().take(n).map(|&x| i32::from(x)).collect() }),
        DType::I4 => Value::Int(IntTensor { shape, data: (0..n).map(|k| i32::from((b[k / 2] >> (4 * (k % 2))) & 15)).collect() }),
    }
}

impl ArenaInterpreter {
    /// Checks `layout` against `graph` (a topological order of the nodes the outputs need, a slot
    /// for each, arena slots in bounds, input slots naming an input of the same size).
    pub fn new(graph: &Graph, layout: &ArenaLayout) -> Result<Self, RuntimeError> {
        qatc_ir::verify(graph)?;
        let bad = |msg: String| RuntimeError::Node { node: "memory plan".into(), msg };
        let mut done: HashMap<NodeId, ()> = HashMap::new();
        let mut steps = Vec::with_capacity(layout.order.len());
        let mut types = HashMap::new();
        let mut inputs = Vec::new();
        for id in graph.inputs() {
            let name = graph.node(id).name.clone().unwrap_or_default();
            inputs.push((name, graph.ty(id).clone()));
            types.insert(id, graph.ty(id).clone());
            done.insert(id, ());
        }
        for &id in &layout.order {
            if !graph.contains(id) {
                return Err(RuntimeError::UnknownNode(id));
            }
            let node = graph.node(id);
            if matches!(node.op, Op::Input { .. }) {
                continue;
            }
            let operands = graph.operands(id);
            if let Some(o) = operands.iter().find(|o| !done.contains_key(o)) {
                return Err(bad(format!("{} runs before its operand {}", graph.describe(id), graph.describe(*o))));
            }
            let slot = layout.slots.get(&id).ok_or_else(|| bad(format!("{} has no slot", graph.describe(id))))?;
            match slot {
                Slot::Arena(off) if off + node.ty.bytes() > layout.arena_bytes => {
                    return Err(bad(format!("{} at {off} reaches past the arena ({} bytes)", graph.describe(id), layout.arena_bytes)))
                }
                Slot::Input(name) => {
                    let same = graph.find_input(name).is_some_and(|x| graph.ty(x).bytes() == node.ty.bytes());
                    if !same {
                        return Err(bad(format!("{} writes into input {name:?}, which does not have its size", graph.describe(id))));
                    }
                }
                Slot::Arena(_) => {}
            }
            done.insert(id, ());
            types.insert(id, node.ty.clone());
            steps.push((id, Step { op: node.op.clone(), ty: node.ty.clone(), operands, label: graph.describe(id) }));
        }
        let mut outputs = Vec::new();
        for o in graph.outputs() {
            if !done.contains_key(&o.node) {
                return Err(bad(format!("output {:?} is never computed", o.name)));
            }
            outputs.push((o.name.clone(), o.node, o.update));
        }
        let mut slots = layout.slots.clone();
        for id in graph.inputs() {
            slots.insert(id, Slot::Input(graph.node(id).name.clone().unwrap_or_default()));
        }
        Ok(ArenaInterpreter { steps, slots, types, inputs, outputs, arena_bytes: layout.arena_bytes })
    }

    /// Runs the step. Inputs are copied into their storage at their dtype; outputs and updates
    /// are read from where the plan left them.
    pub fn run_split(&self, inputs: &HashMap<String, Value<f32>>) -> Result<RunOutputs<f32>, RuntimeError> {
        let mut store: HashMap<String, Vec<u8>> = HashMap::new();
        for (name, ty) in &self.inputs {
            let Some(v) = inputs.get(name) else { continue };
            if v.shape() != ty.shape.dims() || v.len() != ty.numel() {
                return Err(RuntimeError::InputShape { name: name.clone(), want: ty.shape.dims().to_vec(), got: v.shape().to_vec() });
            }
            let mut bytes = vec![POISON; ty.bytes()];
            encode(v, ty, &mut bytes).map_err(|msg| RuntimeError::InputKind { name: name.clone(), want: ty.to_string(), got: msg })?;
            store.insert(name.clone(), bytes);
        }
        let mut arena = vec![POISON; self.arena_bytes];
        for (id, step) in &self.steps {
            let mut args = Vec::with_capacity(step.operands.len());
            for o in &step.operands {
                args.push(self.read(*o, &store, &arena)?);
            }
            let refs: Vec<&Value<f32>> = args.iter().collect();
            let v = eval(&step.op, &step.ty, &refs).map_err(|msg| RuntimeError::Node { node: step.label.clone(), msg })?;
            let node_err = |msg: String| RuntimeError::Node { node: step.label.clone(), msg };
            match &self.slots[id] {
                Slot::Arena(off) => encode(&v, &step.ty, &mut arena[*off..*off + step.ty.bytes()]).map_err(node_err)?,
                Slot::Input(name) => {
                    let buf = store.entry(name.clone()).or_insert_with(|| vec![POISON; step.ty.bytes()]);
                    encode(&v, &step.ty, buf).map_err(node_err)?;
                }
            }
        }
        let mut res = RunOutputs { outputs: HashMap::new(), updates: HashMap::new() };
        for (name, node, update) in &self.outputs {
            let v = self.read(*node, &store, &arena)?;
            if *update {
                res.updates.insert(name.clone(), v);
            } else {
                res.outputs.insert(name.clone(), v);
            }
        }
        Ok(res)
    }

    fn read(&self, id: NodeId, store: &HashMap<String, Vec<u8>>, arena: &[u8]) -> Result<Value<f32>, RuntimeError> {
        let ty = self.types.get(&id).ok_or(RuntimeError::UnknownNode(id))?;
        match self.slots.get(&id) {
            Some(Slot::Arena(off)) => Ok(decode(ty, &arena[*off..*off + ty.bytes()])),
            Some(Slot::Input(name)) => {
                let b = store.get(name).ok_or_else(|| RuntimeError::MissingInput(name.clone()))?;
                Ok(decode(ty, b))
            }
            None => Err(RuntimeError::UnknownNode(id)),
        }
    }
}
