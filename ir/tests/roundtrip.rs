//! Round-trip properties of the text format on random well-typed graphs.
//!
//! The generator builds graphs step by step from a flat list of random choices (the
//! "choice sequence" style: proptest shrinks the list toward zeros and shorter, which the builder
//! reads as "first option, fewer steps", so failures shrink to small graphs). It starts from a few
//! leaves, then repeatedly picks an op and operands whose types fit, creating a fitting leaf when
//! no existing node fits. Every op of the closed op set can be generated; `op_slot` (roundtrip/ops.rs) is an
//! exhaustive match, so a new op fails to compile here until the generator learns it.
//!
//! Properties:
//! - every generated graph verifies;
//! - `print(parse(print(g))) == print(g)`, and the parsed graph verifies;
//! - the text does not depend on node indices: rebuilding a graph in another insertion order
//!   (inputs declared in another order, dead nodes in between) prints the same once dead nodes
//!   are removed.
//!
//! Here: the properties and the deterministic checks; `roundtrip/choices.rs`: the choice sequence
//! and the names and floats it draws; `roundtrip/builder.rs`: the graph builder;
//! `roundtrip/ops.rs`: the op list, how each op is built, and `op_slot`.

#[path = "roundtrip/builder.rs"]
mod builder;
#[path = "roundtrip/choices.rs"]
mod choices;
#[path = "roundtrip/ops.rs"]
mod ops;

use std::collections::{BTreeSet, HashMap};

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use qatc_ir::{parse, print, verify, BinaryOp, DType, Graph, InputKind, IrError, KernelFamily, NodeId, Op, OpKind, UnaryOp};

use builder::{every_op_graph, random_graph};
use choices::{families, variant, Choices, FAMILY_VARIANTS, FLOATS, NAMES};
use ops::{op_slot, N_SLOTS, UNARY};

// ---------------------------------------------------------------------------------------------
// Properties.

fn fail(what: &str, e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(format!("{what}: {e}"))
}

/// The round-trip property on one graph.
fn check_roundtrip(g: &Graph) -> Result<(), TestCaseError> {
    verify(g).map_err(|e| fail("the built graph does not verify", e))?;
    let text = print(g);
    let g2 = parse(&text).map_err(|e| fail(&format!("parse failed on\n{text}"), e))?;
    verify(&g2).map_err(|e| fail(&format!("the parsed graph does not verify\n{text}"), e))?;
    let text2 = print(&g2);
    prop_assert_eq!(&text2, &text, "print(parse(print(g))) != print(g)");
    prop_assert_eq!(g2.len(), g.len());
    prop_assert_eq!(g2.op_counts(), g.op_counts());
    prop_assert_eq!(&g2.name, &g.name);
    prop_assert_eq!(g2.outputs().len(), g.outputs().len());
    Ok(())
}

/// Rebuilds `g` in a random valid insertion order (a random linear extension of the operand
/// order, so inputs are declared in another order too), with dead nodes mixed in.
fn reinsert(g: &Graph, ch: &mut Choices) -> Result<Graph, IrError> {
    let mut h = Graph::new(g.name.clone());
    let mut map: HashMap<NodeId, NodeId> = HashMap::new();
    let mut todo: Vec<NodeId> = g.node_ids();
    while !todo.is_empty() {
        if ch.one_in(3) {
            // A dead node: a const, or an op on something already built.
            let c = h.constant(ch.float(), ch.float_dtype(), ch.dims(0, 2))?;
            if ch.flip() {
                h.add(Op::Unary(ch.pick(&UNARY)), &[c])?;
            }
            let made: Vec<NodeId> = map.values().copied().collect();
            if !made.is_empty() {
                let x = ch.pick(&made);
                h.add(Op::Reshape { shape: h.ty(x).shape.clone() }, &[x])?;
            }
        }
        let ready: Vec<usize> = (0..todo.len()).filter(|&i| g.operands(todo[i]).iter().all(|o| map.contains_key(o))).collect();
        let i = ready[ch.below(ready.len())];
        let n = todo.swap_remove(i);
        let ops: Vec<NodeId> = g.operands(n).iter().map(|o| map[o]).collect();
        let node = g.node(n);
        let id = h.add_node(node.op.clone(), &ops, node.name.clone())?;
        map.insert(n, id);
    }
    for o in g.outputs() {
        if o.update {
            h.set_update(o.name.clone(), map[&o.node])?;
        } else {
            h.set_output(o.name.clone(), map[&o.node])?;
        }
    }
    Ok(h)
}

/// Makes every node of `g` live: each node no output reaches becomes an output of its own, so
/// `remove_dead` keeps exactly the same nodes in both graphs compared.
fn keep_all(g: &mut Graph) -> Result<(), IrError> {
    let live: BTreeSet<NodeId> = {
        let mut stack: Vec<NodeId> = g.outputs().iter().map(|o| o.node).collect();
        let mut seen = BTreeSet::new();
        while let Some(n) = stack.pop() {
            if seen.insert(n) {
                stack.extend(g.operands(n));
            }
        }
        seen
    };
    for (k, n) in g.node_ids().into_iter().enumerate() {
        if !live.contains(&n) && g.users(n).is_empty() {
            g.set_output(format!("keep {k}"), n)?;
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, max_shrink_iters: 4096, .. ProptestConfig::default() })]

    #[test]
    fn print_parse_print_is_identity(choices in vec(any::<u32>(), 0..1500), steps in 0usize..40) {
        let mut ch = Choices::new(choices);
        let g = random_graph(&mut ch, steps).map_err(|e| fail("generator built an ill-typed node", e))?;
        check_roundtrip(&g)?;
    }

    #[test]
    fn text_is_independent_of_insertion_order(
        choices in vec(any::<u32>(), 0..1500),
        order in vec(any::<u32>(), 0..400),
        steps in 0usize..30,
    ) {
        let mut ch = Choices::new(choices);
        let mut g = random_graph(&mut ch, steps).map_err(|e| fail("generator", e))?;
        keep_all(&mut g).map_err(|e| fail("keep_all", e))?;
        let mut h = reinsert(&g, &mut Choices::new(order)).map_err(|e| fail("reinsert", e))?;
        // The rebuilt graph carries dead nodes; they print after the live ones, so drop them.
        h.remove_dead(false);
        g.remove_dead(false);
        prop_assert_eq!(print(&h), print(&g));
    }
}

// ---------------------------------------------------------------------------------------------
// Deterministic checks.

/// The generator really can produce every op: one graph holding each generator slot round-trips,
/// and its op set is the whole closed op set.
#[test]
fn every_op_round_trips() {
    for seed in 0..32 {
        let g = every_op_graph(seed).expect("every_op_graph builds");
        check_roundtrip(&g).expect("round trip");
        let seen: BTreeSet<usize> = g.node_ids().iter().map(|&n| op_slot(&g.node(n).op)).collect();
        assert_eq!(seen, (0..N_SLOTS).collect::<BTreeSet<_>>(), "seed {seed}: some op was not generated");
    }
}

/// Const values and float attributes come back bit for bit (NaN: as some NaN).
#[test]
fn floats_round_trip_exactly() {
    let mut g = Graph::new("floats");
    let mut ids = Vec::new();
    let extra = [1.0 + f64::EPSILON, 0.1 + 0.2, 2.5e-308, 9_007_199_254_740_993.0, -1e-320];
    for (i, &v) in FLOATS.iter().chain(&extra).enumerate() {
        let c = g.constant(v, DType::F32, [2]).expect("const");
        let a = g.add(Op::Affine { mul: v, add: -v }, &[c]).expect("affine");
        g.set_output(format!("o{i}"), a).expect("output");
        ids.push(v);
    }
    let text = print(&g);
    let h = parse(&text).expect("parse");
    assert_eq!(print(&h), text);
    let mut got = Vec::new();
    for o in h.outputs() {
        let Op::Affine { mul, add } = h.node(o.node).op else { panic!("not an affine: {:?}", h.node(o.node).op) };
        let c = h.operands(o.node)[0];
        let Op::Const { value, .. } = h.node(c).op else { panic!("not a const") };
        got.push((value, mul, add));
    }
    for (v, (value, mul, add)) in ids.iter().zip(got) {
        for w in [value, mul] {
            assert!(w.to_bits() == v.to_bits() || (v.is_nan() && w.is_nan()), "{v:?} came back as {w:?}");
        }
        assert!(add.to_bits() == (-v).to_bits() || (v.is_nan() && add.is_nan()), "{:?} came back as {add:?}", -v);
    }
}

/// Every kernel family variant prints as a kernel node's family and parses back to the same
/// value; the texts fusion prints today read as the families that print them; texts that name
/// no family are refused with the line.
#[test]
fn every_kernel_family_round_trips() {
    let all = families();
    let numbered: BTreeSet<usize> = all.iter().map(variant).collect();
    assert_eq!(numbered, (0..FAMILY_VARIANTS).collect::<BTreeSet<_>>(), "a family variant has no example");
    for family in all {
        let mut body = Graph::new(family.to_string());
        let a = body.input("in0", InputKind::Data, DType::F32, [2, 3]).expect("input");
        let y = body.add(Op::Unary(UnaryOp::Neg), &[a]).expect("neg");
        body.set_output("out", y).expect("out");
        let mut g = Graph::new("families");
        let x = g.input("x", InputKind::Data, DType::F32, [2, 3]).expect("input");
        let k = g.add(Op::Kernel { family: family.clone(), body: Box::new(body) }, &[x]).expect("kernel");
        g.set_output("y", k).expect("output");
        let text = print(&g);
        assert!(text.contains(&format!("family={:?}", family.to_string())), "{text}");
        let h = parse(&text).unwrap_or_else(|e| panic!("{family}: {e}\n{text}"));
        let Op::Kernel { family: back, .. } = &h.node(h.output("y").expect("y")).op else { panic!("not a kernel") };
        assert_eq!(back, &family, "{text}");
        assert_eq!(print(&h), text);
    }
    // the families fusion built on GPT-2 (the fused snapshots, and kernel names) read back as text
    for text in [
        "pointwise",
        "reduce.sum",
        "gemm",
        "gemm.scaled",
        "gemm.strided",
        "gemm.strided.scaled",
        "gemm.strided.permute",
        "gemm.bias",
        "gemm.residual",
        "gemm.dgelu",
        "gemm.bias.gelu.aux",
        "gemm.dequant.lora",
        "gemm.dequant.bias.lora",
        "gemm.dequant.lora.dgelu",
        "gemm.dequant.bias.lora.lora_down",
        "gemm.dequant.bias.lora.gelu.aux.lora_down",
        "gemm.fake_quant",
        "layernorm.residual.aux",
        "layernorm_bwd",
        "layernorm_bwd.residual",
        "layernorm_bwd.all",
        "attention.scores",
        "attention.flash",
        "attention_bwd.scores",
        "attention_bwd.flash",
        "cross_entropy.softmax.inplace",
        "cross_entropy.linear.chunk=4",
        "cross_entropy.linear.chunk=128",
        "adamw.multi_tensor",
    ] {
        let f: KernelFamily = text.parse().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(f.to_string(), text);
    }
    let fam = |t: &str| t.parse::<KernelFamily>();
    assert_eq!(fam("cross_entropy.linear.chunk=128"), Ok(KernelFamily::CrossEntropyLinear { chunk_rows: 128 }));
    for bad in [
        "",
        "elementwise",
        "gemm.",
        "gemm.bias.strided",
        "gemm.aux.bias",
        "gemm.lora_down.aux",
        "gemm.scaled.strided",
        "layernorm.aux.residual",
        "attention",
        "cross_entropy.linear",
        "cross_entropy.linear.chunk=",
        "cross_entropy.linear.chunk=x",
        "cross_entropy.linear.chunk=007",
        "adamw",
        "pointwise.bias",
    ] {
        assert!(fam(bad).is_err(), "{bad:?} parsed as {:?}", fam(bad));
    }
    let text = "graph \"g\" {\n  %0 = input[kind=data] : f32[2] \"x\"\n  %1 = kernel[family=\"elementwise\"](%0) : f32[2] {\n    %0 = input[kind=data] : f32[2] \"in0\"\n    output \"out\" = %0\n  }\n  output \"y\" = %1\n}\n";
    let e = parse(text).expect_err("an unknown family");
    assert_eq!(e, IrError::Parse { line: 3, msg: "unknown kernel family `elementwise`".into() });
}

/// Every op kind has one row of the op table (`OpKind::ALL` and the rows are one list, and
/// `Op::kind` is an exhaustive match: a kind without a row does not compile); here: the
/// mnemonics are distinct and name their kinds.
#[test]
fn op_kinds_have_distinct_mnemonics() {
    for &k in OpKind::ALL {
        assert_eq!(OpKind::from_mnemonic(k.mnemonic()), Some(k));
        assert_eq!(k.props().mnemonic, k.mnemonic());
    }
    let names: BTreeSet<&str> = OpKind::ALL.iter().map(|k| k.mnemonic()).collect();
    assert_eq!(names.len(), OpKind::ALL.len());
}

/// Odd names survive the round trip exactly, as graph, input, node, output and update names.
#[test]
fn odd_names_round_trip_exactly() {
    for (i, &name) in NAMES.iter().enumerate() {
        let mut g = Graph::new(name);
        let x = g.input(name, InputKind::Trainable, DType::F32, [3]).expect("input");
        let y = g.add_named(Op::Unary(UnaryOp::Neg), &[x], name).expect("neg");
        g.set_output(name, y).expect("output");
        g.set_update(name, y).expect("update");
        let text = print(&g);
        let h = parse(&text).unwrap_or_else(|e| panic!("name #{i} {name:?}: {e}\n{text}"));
        assert_eq!(h.name, name);
        let hx = h.find_input(name).unwrap_or_else(|| panic!("input {name:?} lost"));
        assert_eq!(h.node(hx).name.as_deref(), Some(name));
        let hy = h.output(name).unwrap_or_else(|| panic!("output {name:?} lost"));
        assert_eq!(h.node(hy).name.as_deref(), Some(name));
        assert_eq!(h.outputs().iter().filter(|o| o.update && o.name == name).count(), 1);
        assert_eq!(print(&h), text);
    }
}

/// Hand-built: the same graph with inputs declared in opposite orders and a dead node in between
/// prints the same (after the dead node is removed); the numbering follows the outputs.
#[test]
fn input_declaration_order_does_not_change_the_text() {
    let build = |flip: bool| -> Result<Graph, IrError> {
        let mut g = Graph::new("order");
        let (a, b) = if flip {
            let b = g.input("b", InputKind::Frozen, DType::F32, [2, 3])?;
            let dead = g.constant(7.0, DType::F32, [5])?;
            g.add(Op::Unary(UnaryOp::Exp), &[dead])?;
            let a = g.input("a", InputKind::Data, DType::F32, [2, 3])?;
            (a, b)
        } else {
            let a = g.input("a", InputKind::Data, DType::F32, [2, 3])?;
            let b = g.input("b", InputKind::Frozen, DType::F32, [2, 3])?;
            (a, b)
        };
        let s = g.add(Op::Binary(BinaryOp::Sub), &[a, b])?;
        let t = g.add(Op::Unary(UnaryOp::Tanh), &[s])?;
        g.set_output("t", t)?;
        g.set_output("s", s)?;
        Ok(g)
    };
    let g1 = build(false).expect("build");
    let mut g2 = build(true).expect("build");
    assert_ne!(print(&g1), print(&g2), "the dead nodes print before removal");
    assert_eq!(g2.remove_dead(false), 2);
    assert_eq!(print(&g1), print(&g2));
    let want = "graph \"order\" {\n  %0 = input[kind=data] : f32[2, 3] \"a\"\n  %1 = input[kind=frozen] : f32[2, 3] \"b\"\n  %2 = sub(%0, %1) : f32[2, 3]\n  %3 = tanh(%2) : f32[2, 3]\n  output \"t\" = %3\n  output \"s\" = %2\n}\n";
    assert_eq!(print(&g1), want);
}
