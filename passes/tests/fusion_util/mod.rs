//! Helpers shared by the fusion tests: run the pass, list kernels, compare interpreter results.
#![allow(dead_code)]

use std::collections::HashMap;

use qatc_ir::{DType, Graph, Op};
use qatc_passes::fusion::{fuse_graph, FuseOptions, FusionReport};
use qatc_runtime::{Interpreter, Value};

/// Fuses with the default options; the result must verify.
pub fn fuse(g: &Graph) -> (Graph, FusionReport) {
    fuse_with(g, &FuseOptions::default())
}

pub fn fuse_with(g: &Graph, o: &FuseOptions) -> (Graph, FusionReport) {
    let f = fuse_graph(g, o).expect("fusion");
    qatc_ir::verify(&f.graph).expect("the fused graph verifies");
    assert_eq!(f.report.extraction.fallback, None, "extraction fell back");
    // the printed fused graph parses back to itself
    let text = qatc_ir::print(&f.graph);
    assert_eq!(qatc_ir::print(&qatc_ir::parse(&text).expect("parses")), text);
    (f.graph, f.report)
}

/// The families of the kernel nodes, sorted.
pub fn families(g: &Graph) -> Vec<String> {
    let mut v: Vec<String> = g
        .node_ids()
        .into_iter()
        .filter_map(|n| match &g.node(n).op {
            Op::Kernel { family, .. } => Some(family.to_string()),
            _ => None,
        })
        .collect();
    v.sort();
    v
}

pub fn fired(r: &FusionReport, rule: &str) -> usize {
    r.saturation.rules_fired.get(rule).copied().unwrap_or(0)
}

/// A small deterministic generator (xorshift).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    pub fn float(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }
}

/// Random values for every input of `g`: floats in [-1, 1), integers in [0, `int_bound`).
pub fn inputs(g: &Graph, seed: u64, int_bound: i32) -> HashMap<String, Value<f64>> {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut m = HashMap::new();
    for id in g.inputs() {
        let n = g.node(id);
        let name = n.name.clone().unwrap_or_default();
        let dims = n.ty.shape.dims().to_vec();
        let count = n.ty.numel();
        let v = match n.ty.dtype {
            DType::I32 | DType::U8 | DType::I4 => {
                let bound = if n.ty.dtype == DType::I4 { 16 } else { int_bound.max(1) };
                Value::ints(dims, (0..count).map(|_| (rng.next() % bound as u64) as i32).collect()).expect("ints")
            }
            _ => {
                let data: Vec<f64> = (0..count).map(|_| rng.float()).collect();
                Value::floats(dims, &data).expect("floats")
            }
        };
        m.insert(name, v);
    }
    m
}

/// max |a - b| / max |b| over every output and update of the two graphs (0 when equal).
pub fn max_rel_diff(a: &Graph, b: &Graph, ins: &HashMap<String, Value<f64>>) -> f64 {
    let ra = Interpreter::<f64>::new(a).expect("interp").run_split(ins).expect("run unfused");
    let rb = Interpreter::<f64>::new(b).expect("interp").run_split(ins).expect("run fused");
    let mut worst = 0.0f64;
    for (xa, xb) in [(&ra.outputs, &rb.outputs), (&ra.updates, &rb.updates)] {
        assert_eq!(xa.len(), xb.len());
        for (name, va) in xa {
            let vb = &xb[name];
            let (fa, fb) = (va.as_float().map(|t| t.data.clone()), vb.as_float().map(|t| t.data.clone()));
            match (fa, fb) {
                (Some(fa), Some(fb)) => {
                    let scale = fa.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-30);
                    let d = fa.iter().zip(&fb).fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
                    worst = worst.max(d / scale);
                }
                _ => assert_eq!(va, vb, "{name}"),
            }
        }
    }
    worst
}
