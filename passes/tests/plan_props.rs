//! Property tests of the memory planner on random DAGs: the schedule is topological, buffers
//! whose lifetimes overlap never share a byte, the planned arena is at least the lower bound,
//! in-place reuse happens only where the op allows it, and executing the plan inside one arena
//! (the runtime's `ArenaInterpreter`, where any wrong overlap corrupts a value) gives exactly
//! the interpreter's results.

use std::collections::HashMap;

use proptest::prelude::*;
use qatc_ir::{BinaryOp, DType, Graph, InputKind, NodeId, Op, Shape, UnaryOp};
use qatc_passes::plan::region::in_place_slots;
use qatc_passes::plan::{self, Location, Plan, Region};
use qatc_runtime::{ArenaInterpreter, ArenaLayout, Interpreter, Slot, Value};

/// The shapes values take; reshapes move between those of equal size.
const SHAPES: [&[usize]; 5] = [&[4, 8], &[8, 4], &[32], &[4, 4], &[16]];

#[derive(Clone, Debug)]
enum Step {
    Unary(usize, u8),
    Binary(usize, usize, u8),
    Affine(usize),
    Reshape(usize, usize),
    Transpose(usize),
    MatMul(usize, usize),
    Softmax(usize),
    Const(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (any::<usize>(), 0u8..4).prop_map(|(a, k)| Step::Unary(a, k)),
        (any::<usize>(), any::<usize>(), 0u8..4).prop_map(|(a, b, k)| Step::Binary(a, b, k)),
        any::<usize>().prop_map(Step::Affine),
        (any::<usize>(), any::<usize>()).prop_map(|(a, s)| Step::Reshape(a, s)),
        any::<usize>().prop_map(Step::Transpose),
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Step::MatMul(a, b)),
        any::<usize>().prop_map(Step::Softmax),
        any::<usize>().prop_map(Step::Const),
    ]
}

/// A random graph: a few inputs of every kind, then `steps` ops on earlier values (picked by
/// index modulo, so every choice is valid), some outputs, and updates into the trainable and
/// state inputs.
fn build(n_inputs: usize, steps: &[Step], outs: &[usize], updates: u8, with_loss: bool) -> Graph {
    let mut g = Graph::new("random");
    let mut vals: Vec<NodeId> = Vec::new();
    let kinds = [InputKind::Data, InputKind::Frozen, InputKind::Trainable, InputKind::State];
    for i in 0..n_inputs.max(1) {
        let shape = SHAPES[i % SHAPES.len()].to_vec();
        vals.push(g.input(format!("x{i}"), kinds[i % 4], DType::F32, shape).unwrap());
    }
    let same = |g: &Graph, vals: &[NodeId], a: usize, b: usize| -> Option<(NodeId, NodeId)> {
        let x = vals[a % vals.len()];
        let shape = &g.ty(x).shape;
        let cands: Vec<NodeId> = vals.iter().copied().filter(|&v| &g.ty(v).shape == shape).collect();
        Some((x, cands[b % cands.len()]))
    };
    for s in steps {
        let pick = |k: usize| vals[k % vals.len()];
        let node = match s {
            Step::Unary(a, k) => {
                let u = [UnaryOp::Neg, UnaryOp::Tanh, UnaryOp::Square, UnaryOp::Gelu][*k as usize % 4];
                g.add(Op::Unary(u), &[pick(*a)])
            }
            Step::Binary(a, b, k) => {
                let op = [BinaryOp::Add, BinaryOp::Mul, BinaryOp::Sub, BinaryOp::Max][*k as usize % 4];
                let Some((x, y)) = same(&g, &vals, *a, *b) else { continue };
                g.add(Op::Binary(op), &[x, y])
            }
            Step::Affine(a) => g.add(Op::Affine { mul: 0.5, add: 0.25 }, &[pick(*a)]),
            Step::Reshape(a, t) => {
                let x = pick(*a);
                let n = g.ty(x).numel();
                let targets: Vec<&[usize]> = SHAPES.iter().copied().filter(|s| s.iter().product::<usize>() == n).collect();
                g.add(Op::Reshape { shape: Shape::new(targets[t % targets.len()].to_vec()) }, &[x])
            }
            Step::Transpose(a) => {
                let x = pick(*a);
                if g.ty(x).shape.rank() != 2 {
                    continue;
                }
                g.add(Op::Transpose { perm: vec![1, 0] }, &[x])
            }
            Step::MatMul(a, b) => {
                let x = pick(*a);
                let d = g.ty(x).shape.dims().to_vec();
                if d.len() != 2 {
                    continue;
                }
                let ys: Vec<NodeId> =
                    vals.iter().copied().filter(|&v| g.ty(v).shape.rank() == 2 && g.ty(v).shape.dims()[0] == d[1]).collect();
                if ys.is_empty() {
                    continue;
                }
                let y = ys[b % ys.len()];
                if g.ty(y).shape.dims()[1] != 4 {
                    continue; // keep results among SHAPES: [4|8, 4]
                }
                g.add(Op::MatMul { ta: false, tb: false }, &[x, y])
            }
            Step::Softmax(a) => {
                let x = pick(*a);
                if g.ty(x).shape.rank() != 2 {
                    continue;
                }
                g.add(Op::Softmax { scale: 0.5, causal: false }, &[x])
            }
            Step::Const(k) => g.constant(0.125 * (*k % 7) as f64, DType::F32, SHAPES[k % SHAPES.len()].to_vec()),
        };
        vals.push(node.unwrap());
    }
    let computed: Vec<NodeId> = vals[n_inputs.max(1)..].to_vec();
    let pool = if computed.is_empty() { &vals } else { &computed };
    for (k, &o) in outs.iter().enumerate() {
        let _ = g.set_output(format!("out{k}"), pool[o % pool.len()]);
    }
    if with_loss {
        let _ = g.set_output("loss", pool[pool.len() / 2]);
    }
    // updates: a trainable/state input takes the value of a computed node of its type
    for (i, &x) in vals.iter().enumerate().take(n_inputs.max(1)) {
        if !matches!(g.input_kind(x), Some(InputKind::Trainable | InputKind::State)) || updates & (1 << (i % 8)) == 0 {
            continue;
        }
        let ty = g.ty(x).clone();
        if let Some(&u) = computed.iter().rev().find(|&&c| *g.ty(c) == ty) {
            let name = g.node(x).name.clone().unwrap();
            let _ = g.set_update(name, u);
        }
    }
    if g.outputs().is_empty() {
        let _ = g.set_output("out", *vals.last().unwrap());
    }
    g
}

fn layout(p: &Plan) -> ArenaLayout {
    let slots = p
        .location
        .iter()
        .map(|(id, l)| {
            (
                *id,
                match l {
                    Location::Arena { offset } => Slot::Arena(*offset),
                    Location::Input { name } => Slot::Input(name.clone()),
                },
            )
        })
        .collect();
    ArenaLayout { order: p.order(), slots, arena_bytes: p.arena_bytes }
}

fn inputs(g: &Graph, seed: u64) -> HashMap<String, Value<f32>> {
    let mut m = HashMap::new();
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    for id in g.inputs() {
        let ty = g.ty(id);
        let data: Vec<f64> = (0..ty.numel())
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((x >> 33) as f64 / (1u64 << 31) as f64) - 0.5
            })
            .collect();
        m.insert(g.node(id).name.clone().unwrap(), Value::floats(ty.shape.dims().to_vec(), &data).unwrap());
    }
    m
}

fn bits(v: &Value<f32>) -> Vec<u32> {
    v.as_float().map(|t| t.data.iter().map(|x| x.to_bits()).collect()).unwrap_or_default()
}

fn check(g: &Graph, seed: u64) -> Result<(), TestCaseError> {
    let p = plan::plan(g, &Default::default()).map_err(|e| TestCaseError::fail(e.to_string()))?;
    p.verify().map_err(|e| TestCaseError::fail(e.to_string()))?;
    // the schedule: every node once, operands first
    let pos: HashMap<NodeId, usize> = p.steps.iter().map(|s| (s.node, s.index)).collect();
    for s in &p.steps {
        for o in g.operands(s.node) {
            if let Some(&po) = pos.get(&o) {
                prop_assert!(po < s.index, "{} before its operand", s.name);
            } else {
                prop_assert!(g.input_kind(o).is_some(), "operand of {} never scheduled", s.name);
            }
        }
    }
    // overlap, independently of `verify`: every pair of arena buffers
    let arena: Vec<_> = p.buffers.iter().filter(|b| b.region == Region::Arena && b.size > 0).collect();
    for (i, a) in arena.iter().enumerate() {
        prop_assert!(a.offset + a.size <= p.arena_bytes);
        for b in &arena[i + 1..] {
            let time = a.first_step <= b.last_step && b.first_step <= a.last_step;
            let bytes = a.offset < b.offset + b.size && b.offset < a.offset + a.size;
            prop_assert!(!(time && bytes), "buffers {} and {} share bytes while both live", a.id, b.id);
        }
    }
    prop_assert!(p.arena_bytes >= p.lower_bound);
    // the lower bound is the most bytes live at one step
    let mut live = vec![0usize; p.steps.len().max(1)];
    for b in &arena {
        for l in live.iter_mut().take(b.last_step + 1).skip(b.first_step) {
            *l += b.size;
        }
    }
    prop_assert_eq!(live.iter().copied().max().unwrap_or(0), p.lower_bound);
    // in place only where allowed: an allowed slot whose value dies here, of the same size
    let last_read: HashMap<NodeId, usize> =
        p.steps.iter().flat_map(|s| g.operands(s.node).into_iter().map(move |o| (o, s.index))).fold(HashMap::new(), |mut m, (o, i)| {
            let e = m.entry(o).or_insert(i);
            *e = (*e).max(i);
            m
        });
    let buffer_of: HashMap<NodeId, usize> = p.steps.iter().map(|s| (s.node, s.buffer)).collect();
    for s in p.steps.iter().filter(|s| s.in_place) {
        let node = g.node(s.node);
        let ops = g.operands(s.node);
        let ok = in_place_slots(&node.op, ops.len()).iter().any(|&k| {
            let o = ops[k];
            buffer_of.get(&o) == Some(&s.buffer)
                && last_read.get(&o) == Some(&s.index)
                && g.ty(o).bytes() == node.ty.bytes()
                && !g.outputs().iter().any(|out| out.node == o)
        });
        prop_assert!(ok, "step {} ({}) is in place without an allowed dying operand", s.index, s.op);
    }
    // executing the plan inside one arena gives the interpreter's results, bit for bit
    let ins = inputs(g, seed);
    let want = Interpreter::<f32>::new(g).unwrap().run_split(&ins).unwrap();
    let got = ArenaInterpreter::new(g, &layout(&p)).map_err(|e| TestCaseError::fail(e.to_string()))?.run_split(&ins).unwrap();
    for (name, v) in &want.outputs {
        prop_assert_eq!(bits(v), bits(&got.outputs[name]), "output {}", name);
    }
    for (name, v) in &want.updates {
        prop_assert_eq!(bits(v), bits(&got.updates[name]), "update {}", name);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn plans_of_random_dags_are_sound(
        n_inputs in 1usize..8,
        steps in prop::collection::vec(step(), 0..40),
        outs in prop::collection::vec(any::<usize>(), 0..4),
        updates in any::<u8>(),
        with_loss in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let g = build(n_inputs, &steps, &outs, updates, with_loss);
        check(&g, seed)?;
    }
}

/// A chain that can be done in place end to end: one buffer, reused by every elementwise op.
#[test]
fn an_elementwise_chain_runs_in_one_buffer() {
    let mut g = Graph::new("chain");
    let x = g.input("x", InputKind::Data, DType::F32, [64]).unwrap();
    let mut y = g.add(Op::Unary(UnaryOp::Neg), &[x]).unwrap();
    for _ in 0..10 {
        y = g.add(Op::Unary(UnaryOp::Tanh), &[y]).unwrap();
    }
    g.set_output("y", y).unwrap();
    let p = plan::plan(&g, &Default::default()).unwrap();
    assert_eq!(p.in_place_steps, 10);
    assert_eq!(p.arena_bytes, 256);
    assert_eq!(p.lower_bound, 256);
}

/// AdamW's update is written over the parameter: only after every other reader of it.
#[test]
fn a_write_back_waits_for_the_other_readers() {
    let mut g = Graph::new("wb");
    let w = g.input("w", InputKind::Trainable, DType::F32, [4, 4]).unwrap();
    let x = g.input("x", InputKind::Data, DType::F32, [4, 4]).unwrap();
    let y = g.add(Op::MatMul { ta: false, tb: false }, &[x, w]).unwrap();
    let w2 = g.add(Op::Affine { mul: 0.5, add: 0.0 }, &[w]).unwrap();
    let z = g.add(Op::MatMul { ta: false, tb: false }, &[y, w]).unwrap();
    g.set_output("z", z).unwrap();
    g.set_update("w", w2).unwrap();
    let p = plan::plan(&g, &Default::default()).unwrap();
    assert_eq!(p.location[&w2], Location::Input { name: "w".into() });
    let pos = |n: NodeId| p.steps.iter().position(|s| s.node == n).unwrap();
    assert!(pos(w2) > pos(y) && pos(w2) > pos(z));
    check(&g, 1).unwrap();
}
