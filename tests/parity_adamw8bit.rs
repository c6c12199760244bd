//! 8-bit AdamW (`--optim adamw8bit`) against its NumPy reference
//! (`tests/fixtures/gen_adamw8bit_fixtures.py`, bitsandbytes' blockwise scheme): the maps bit for
//! bit, and after 5 steps on given tensors and gradients the parameters and the dequantized
//! moments within 1e-6, the codes and block absmax equal. The tensors cover a partial last block
//! (80 x 64 = 5120 elements: 2048 + 2048 + 1024), whole blocks (4096) and one below
//! `MIN_8BIT_ELEMS` (17 elements), which keeps f32 moments.

mod common;

use std::collections::HashMap;

use qatc_ir::{qmap, DType, DynMap, Graph, InputKind, Shape};
use qatc_passes::autodiff::grad_name;
use qatc_passes::optim::{self, blockwise_moment_names, moment_names, AdamW, Moments};
use qatc_runtime::{CpuProgram, IntTensor, Interpreter, Tensor, Value};

const TOL: f64 = 1e-6;

fn meta() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(common::fixture("adamw8bit/meta.json")).unwrap()).unwrap()
}

#[test]
fn maps_equal_the_reference_bit_for_bit() {
    let maps = common::read_safetensors("adamw8bit/maps.safetensors");
    for m in DynMap::ALL {
        let want = &maps[m.name()].data;
        let got = m.values();
        assert_eq!(want.len(), 256);
        for (i, (&w, &g)) in want.iter().zip(got.iter()).enumerate() {
            assert_eq!((w as f32).to_bits(), g.to_bits(), "{} map, code {i}: reference {w}, qatc {g}", m.name());
        }
    }
    assert_eq!(meta()["block"].as_u64(), Some(qmap::BLOCK as u64));
    assert_eq!(meta()["min_8bit"].as_u64(), Some(optim::MIN_8BIT_ELEMS as u64));
}

fn floats(shape: &[usize], data: &[f64]) -> Value<f32> {
    Value::Float(Tensor { shape: shape.to_vec(), data: data.iter().map(|&v| v as f32).collect() })
}

fn as_f64(v: &Value<f32>) -> Vec<f64> {
    match v {
        Value::Float(t) => t.data.iter().map(|&x| f64::from(x)).collect(),
        Value::Int(t) => t.data.iter().map(|&x| f64::from(x)).collect(),
    }
}

/// The reference's hyperparameters, tensors and the optimizer-only graph: each trainable tensor's
/// gradient is an input (`gin:NAME`), then the AdamW pass with 8-bit moments.
struct Case {
    fx: HashMap<String, common::T>,
    shapes: Vec<(String, Vec<usize>)>,
    lrs: Vec<f64>,
    g: Graph,
}

fn case() -> Case {
    let meta = meta();
    let fx = common::read_safetensors("adamw8bit/steps.safetensors");
    let h = AdamW {
        beta1: meta["beta1"].as_f64().unwrap(),
        beta2: meta["beta2"].as_f64().unwrap(),
        eps: meta["eps"].as_f64().unwrap(),
        weight_decay: meta["weight_decay"].as_f64().unwrap(),
        moments: Moments::Blockwise8,
        ..AdamW::default()
    };
    let shapes: Vec<(String, Vec<usize>)> = meta["shapes"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(n, s)| (n.clone(), s.as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect()))
        .collect();
    let mut g = Graph::new("adamw8bit");
    for (name, shape) in &shapes {
        g.input(name, InputKind::Trainable, DType::F32, Shape::new(shape.clone())).unwrap();
        let gi = g.input(format!("gin:{name}"), InputKind::Data, DType::F32, Shape::new(shape.clone())).unwrap();
        g.set_output(grad_name(name), gi).unwrap();
    }
    let (g, report) = optim::adamw(g, &h, false, Default::default()).unwrap();
    qatc_ir::verify(&g).unwrap();
    assert!(format!("{report:?}").contains("blockwise_8bit"), "{report:?}");
    let lrs = meta["lrs"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    Case { fx, shapes, lrs, g }
}

/// Runs the 5 steps with `step` (inputs -> updates) from zero moments; returns the final inputs.
fn five_steps(c: &Case, mut step: impl FnMut(&HashMap<String, Value<f32>>) -> HashMap<String, Value<f32>>) -> HashMap<String, Value<f32>> {
    let g = &c.g;
    let mut inputs: HashMap<String, Value<f32>> = HashMap::new();
    for id in g.inputs() {
        let name = g.node(id).name.clone().unwrap();
        let ty = g.ty(id);
        if g.input_kind(id) == Some(InputKind::State) {
            let shape = ty.shape.dims().to_vec();
            let zero = if ty.dtype == DType::U8 {
                Value::Int(IntTensor { shape, data: vec![0; ty.numel()] })
            } else {
                Value::Float(Tensor { shape, data: vec![0.0; ty.numel()] })
            };
            inputs.insert(name, zero);
        }
    }
    for (name, shape) in &c.shapes {
        inputs.insert(name.clone(), floats(shape, &c.fx[&format!("init:{name}")].data));
    }
    for (i, lr) in c.lrs.iter().enumerate() {
        inputs.insert("lr".into(), Value::Float(Tensor { shape: vec![], data: vec![*lr as f32] }));
        for (name, shape) in &c.shapes {
            inputs.insert(format!("gin:{name}"), floats(shape, &c.fx[&format!("grad{i}:{name}")].data));
        }
        let updates = step(&inputs);
        let names: Vec<String> = g.outputs().iter().filter(|o| o.update).map(|o| o.name.clone()).collect();
        for n in names {
            let v = updates.get(&n).unwrap_or_else(|| panic!("no update {n}")).clone();
            inputs.insert(n, v);
        }
    }
    inputs
}

/// The final state against the reference: parameters and dequantized moments within 1e-6,
/// codes and absmax equal.
fn check(c: &Case, inputs: &HashMap<String, Value<f32>>, what: &str) {
    let fx = &c.fx;
    let max_diff = |a: &[f64], b: &[f64]| a.iter().zip(b).fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
    for (name, shape) in &c.shapes {
        let n: usize = shape.iter().product();
        let p = as_f64(&inputs[name]);
        let d = max_diff(&p, &fx[&format!("final:{name}")].data);
        assert!(d <= TOL, "{what}: {name}: parameters differ by {d}");
        let (m, v) = if optim::is_blockwise(&c.g, c.g.find_input(name).unwrap(), Moments::Blockwise8) {
            let [mc, ma, vc, va] = blockwise_moment_names(name);
            for (state, fixture) in [(&mc, "codes.m"), (&vc, "codes.v")] {
                let want: Vec<f64> = fx[&format!("{fixture}:{name}")].ints.iter().map(|&c| f64::from(c)).collect();
                let got = as_f64(&inputs[state]);
                let wrong = got.iter().zip(&want).filter(|(a, b)| a != b).count();
                assert_eq!(wrong, 0, "{what}: {name}: {wrong} of {n} {fixture} codes differ");
            }
            for (state, fixture) in [(&ma, "absmax.m"), (&va, "absmax.v")] {
                let want = &fx[&format!("{fixture}:{name}")].data;
                assert_eq!(want.len(), qmap::blocks(n));
                assert_eq!(as_f64(&inputs[state]), *want, "{what}: {name}: {fixture}");
            }
            let deq = |codes: &str, absmax: &str, map: DynMap| {
                let c: Vec<u8> = as_f64(&inputs[codes]).iter().map(|&c| c as u8).collect();
                let a: Vec<f32> = as_f64(&inputs[absmax]).iter().map(|&a| a as f32).collect();
                qatc_runtime::quant::block_dequant(map, &c, &a).into_iter().map(f64::from).collect::<Vec<f64>>()
            };
            (deq(&mc, &ma, DynMap::Signed), deq(&vc, &va, DynMap::Unsigned))
        } else {
            let (mn, vn) = moment_names(name);
            (as_f64(&inputs[&mn]), as_f64(&inputs[&vn]))
        };
        for (got, fixture) in [(m, "m"), (v, "v")] {
            let d = max_diff(&got, &fx[&format!("{fixture}:{name}")].data);
            assert!(d <= TOL, "{what}: {name}: moment {fixture} differs by {d}");
        }
    }
}

#[test]
fn five_steps_match_the_numpy_reference() {
    let c = case();
    let g = &c.g;
    let interp = Interpreter::<f32>::new(g).unwrap();
    let out = five_steps(&c, |inputs| interp.run_split(inputs).unwrap().updates);
    check(&c, &out, "interpreter");
    // the moments that went 8-bit really are: the big tensors' state is u8, the small one's f32
    for id in g.inputs() {
        let name = g.node(id).name.clone().unwrap();
        if name.starts_with("adam.m8:") || name.starts_with("adam.v8:") {
            assert_eq!(g.ty(id).dtype, DType::U8, "{name}");
        }
    }
    assert!(g.find_input("adam.m:c.bias").is_some() && g.find_input("adam.m8:a.weight").is_some());
}

/// The same 5 steps as kernels (lowered unfused, fused and packed, and fused with the 8-bit update
/// inside the in-place AdamW kernel: `kernels/src/lower/adamw8.rs`), run by the kernel-IR
/// evaluator and by LLVM: the same codes, absmax, moments and parameters as the reference.
#[test]
fn five_compiled_steps_match_the_numpy_reference() {
    let c = case();
    let (fused, _) = qatc_passes::fusion::fuse(c.g.clone(), &Default::default(), &qatc_ir::Deadline::unlimited()).unwrap();
    let packed = qatc_kernels::LowerOptions { adamw_packed: true, ..Default::default() };
    let in_place = qatc_kernels::LowerOptions::default();
    for (label, g, options) in [("unfused", &c.g, &in_place), ("fused, packed", &fused, &packed), ("fused, in place", &fused, &in_place)] {
        let prog = qatc_kernels::lower_with(g, options).unwrap_or_else(|e| panic!("{label}: lower: {e}"));
        let families: Vec<&str> = prog.kernels.iter().map(|k| k.family.as_str()).collect();
        let blockwise =
            prog.kernels.iter().any(|k| k.family.starts_with("adamw") && k.params.iter().any(|p| p.write && p.dtype == DType::U8));
        if label == "fused, in place" {
            assert!(blockwise && !families.iter().any(|f| f.contains("block_absmax")), "{label}: {families:?}");
        } else {
            assert!(!blockwise && families.iter().any(|f| f.contains("block_absmax")), "{label}: {families:?}");
        }
        let mut runners = Vec::new();
        runners.push(("KIR evaluator", CpuProgram::with_kir_eval(prog.clone()).unwrap()));
        #[cfg(feature = "llvm")]
        {
            let jit = qatc_kernels::llvm::Jit::compile(&prog.kernels).unwrap();
            runners.push(("LLVM", CpuProgram::new(prog.clone(), Box::new(jit)).unwrap()));
        }
        for (runner, mut cp) in runners {
            let out = five_steps(&c, |inputs| cp.run(inputs).unwrap_or_else(|e| panic!("{label}, {runner}: {e}")));
            check(&c, &out, &format!("{label}, {runner}"));
        }
    }
}
