//! Quantization-aware training as passes.
//!
//! - [`fake_quant`] wraps each targeted weight in a FakeQuant node (STE gradient) and, with
//!   `act_bits`, the linear's input in an ActQuant node.
//!   With `learned_scales` the node is a FakeQuantLearned whose per-group scales (and asym's zero
//!   points) are new `Trainable` inputs `W.scales`, `W.zeros` (LSQ), initialized by the runtime
//!   from the weight's min-max quantization (`quant::init_learned`).
//! - [`fold`] replaces a FakeQuant of a FROZEN weight, a constant, by a Dequantize of packed codes
//!   and scales (new inputs `W.qcodes`, `W.qscales`, `W.qzeros`): the weight is then stored at
//!   4 bits and the result is bit-identical (see `qatc_runtime::quant`). A FakeQuantLearned whose
//!   weight and scales are all frozen (evaluation, export) folds the same way, into
//!   `W.lsq.qcodes`, `W.lsq.qscales`, `W.lsq.qzeros`: codes of the learned grid (the runtime
//!   computes them from the bound scales, `quant::quantize_learned`). While the scales train, the
//!   weight stays as it is: its codes change whenever a scale does.

use std::collections::BTreeMap;

use qatc_ir::{DType, Graph, InputKind, NodeId, Op, QuantSpec, Shape};
use serde::Serialize;

use crate::error::{InPass, PassError};
use crate::linears::{self, matches};
use crate::pipeline::PassReport;
use crate::pipeline::Stage;

/// Which weights are quantized, and how.
#[derive(Clone, Debug, Serialize)]
pub struct QuantOptions {
    pub spec: QuantSpec,
    /// Module suffixes (`attn.c_attn`, `c_proj`, ...); `lm_head` and `wte` name the tied
    /// embedding's two uses.
    pub targets: Vec<String>,
    /// Per-module overrides from a bit map (`h.3.mlp.c_fc` -> spec); `None` keeps the module at
    /// full precision.
    pub per_module: BTreeMap<String, Option<QuantSpec>>,
    pub act_bits: Option<u8>,
    /// Learn the per-group scales (and zero points) with LSQ instead of the min-max rule.
    pub learned_scales: bool,
    /// Where `per_module` came from (a bit map's path), for messages about its entries.
    #[serde(skip)]
    pub per_module_source: Option<String>,
}

impl QuantOptions {
    pub fn default_targets() -> Vec<String> {
        linears::MODULES.iter().map(|s| s.to_string()).collect()
    }

    /// `spec` on the four GPT-2 linears, no bit map, no activation quantization.
    pub fn all_linears(spec: QuantSpec) -> QuantOptions {
        QuantOptions {
            spec,
            targets: Self::default_targets(),
            per_module: BTreeMap::new(),
            act_bits: None,
            learned_scales: false,
            per_module_source: None,
        }
    }
    fn spec_for(&self, module: &str) -> Option<QuantSpec> {
        match self.per_module.get(module) {
            Some(s) => *s,
            None => self.targets.iter().any(|t| matches(module, t)).then_some(self.spec),
        }
    }
}

/// The input names of a folded weight's storage.
pub fn storage_names(weight: &str) -> (String, String, String) {
    (format!("{weight}.qcodes"), format!("{weight}.qscales"), format!("{weight}.qzeros"))
}

/// The input names of a weight's learned scales and zero points.
pub fn learned_names(weight: &str) -> (String, String) {
    (format!("{weight}.scales"), format!("{weight}.zeros"))
}

/// Whether an input name is a learned scale or zero point (an optimizer group of its own).
pub fn is_learned_name(name: &str) -> bool {
    name.ends_with(".scales") || name.ends_with(".zeros")
}

/// The input names of a folded learned weight's storage (codes of the learned grid).
pub fn learned_storage_names(weight: &str) -> (String, String, String) {
    storage_names(&format!("{weight}.lsq"))
}

/// The fake-quant node of weight `w` (named `weight`, [in, out]): FakeQuant, or FakeQuantLearned
/// with new trainable scales (and zero points).
fn quantize(g: &mut Graph, w: NodeId, weight: &str, spec: QuantSpec, learned: bool, name: String) -> Result<NodeId, PassError> {
    if !learned {
        return g.add_named(Op::FakeQuant { spec }, &[w], name).in_pass(Stage::FakeQuant);
    }
    let dims = g.ty(w).shape.dims().to_vec();
    let shape = Shape::new([dims[0] / spec.group_for(dims[0]), dims[1]]);
    let (sn, zn) = learned_names(weight);
    let mut ops = vec![w, g.input(sn, InputKind::Trainable, DType::F32, shape.clone()).in_pass(Stage::FakeQuant)?];
    if spec.scheme.has_zero_point() {
        ops.push(g.input(zn, InputKind::Trainable, DType::F32, shape).in_pass(Stage::FakeQuant)?);
    }
    g.add_named(Op::FakeQuantLearned { spec }, &ops, name).in_pass(Stage::FakeQuant)
}

pub fn fake_quant(mut g: Graph, o: &QuantOptions) -> Result<(Graph, PassReport), PassError> {
    let mut r = PassReport::new(Stage::FakeQuant);
    for t in &o.targets {
        if !(linears::is_known_target(t) || t == "lm_head" || t == "wte") {
            return Err(PassError::Invalid {
                pass: Stage::FakeQuant,
                msg: format!("unknown quant target `{t}`; targets: {}, lm_head, wte", linears::described()),
            });
        }
    }
    let lins = linears::find(&g);
    // every per-module entry must name a linear of this model, and fit it
    let entry = |module: &str, why: String| PassError::Invalid {
        pass: Stage::FakeQuant,
        msg: match &o.per_module_source {
            Some(src) => format!("{src}: entry {module:?}: {why}"),
            None => format!("{module}: {why}"),
        },
    };
    for module in o.per_module.keys() {
        if !lins.iter().any(|l| &l.module == module) {
            let layers = lins.iter().filter_map(|l| l.module.split('.').nth(1)?.parse::<usize>().ok()).max();
            let have = layers.map_or("none".to_string(), |n| format!("h.0 to h.{n}, each with {}", linears::MODULES.join(", ")));
            return Err(entry(module, format!("no such linear in this model (it has {have})")));
        }
    }
    for lin in lins {
        let Some(spec) = o.spec_for(&lin.module) else { continue };
        spec.check(lin.n_in).map_err(|m| {
            if o.per_module.contains_key(&lin.module) {
                entry(&lin.module, m)
            } else {
                PassError::Invalid { pass: Stage::FakeQuant, msg: format!("{}: {m}", lin.module) }
            }
        })?;
        let weight = g.node(lin.weight).name.clone().unwrap_or_else(|| format!("{}.weight", lin.module));
        let fq = quantize(&mut g, lin.weight, &weight, spec, o.learned_scales, format!("{}.weight.fq", lin.module))?;
        g.replace_all_uses(lin.weight, fq);
        r.count("weights", 1);
        r.count("elements", (lin.n_in * lin.n_out) as i64);
        if let Some(bits) = o.act_bits {
            let aq = g.add_named(Op::ActQuant { bits }, &[lin.x], format!("{}.input.aq", lin.module)).in_pass(Stage::FakeQuant)?;
            // only this linear's use of x is quantized (x also feeds other linears and residuals)
            let mm_ops = g.operands(lin.matmul);
            let mm = g.node(lin.matmul).clone();
            let new = g.add_node(mm.op, &[aq, mm_ops[1]], mm.name).in_pass(Stage::FakeQuant)?;
            g.replace_all_uses(lin.matmul, new);
            r.count("activations", 1);
        }
    }
    // The tied embedding: its rows are [V, C] with C the input features of the LM head, so it is
    // quantized as the [C, V] matrix it is in the head (groups along C).
    let embed_targets: Vec<&str> = ["lm_head", "wte"].into_iter().filter(|t| o.targets.iter().any(|x| x == t)).collect();
    if let Some(wte) = g.find_input("wte.weight").filter(|_| !embed_targets.is_empty()) {
        let dims = g.ty(wte).shape.dims().to_vec();
        o.spec.check(dims[1]).map_err(|m| PassError::Invalid { pass: Stage::FakeQuant, msg: format!("wte: {m}") })?;
        let t = g.add(Op::Transpose { perm: vec![1, 0] }, &[wte]).in_pass(Stage::FakeQuant)?; // [C, V]
        let fq = quantize(&mut g, t, "wte.weight", o.spec, o.learned_scales, "wte.weight.fq".into())?;
        let back = g.add(Op::Transpose { perm: vec![1, 0] }, &[fq]).in_pass(Stage::FakeQuant)?; // [V, C]
        for u in g.users(wte) {
            if u == t {
                continue;
            }
            let is_head = matches!(g.node(u).op, Op::MatMul { .. });
            if (is_head && embed_targets.contains(&"lm_head")) || (!is_head && embed_targets.contains(&"wte")) {
                let node = g.node(u).clone();
                let ops: Vec<_> = g.operands(u).into_iter().map(|o| if o == wte { back } else { o }).collect();
                let new = g.add_node(node.op, &ops, node.name).in_pass(Stage::FakeQuant)?;
                g.replace_all_uses(u, new);
                r.count("embedding_uses", 1);
            }
        }
        g.remove_dead(false);
    }
    g.remove_dead(false);
    Ok((g, r))
}

/// Folds FakeQuant(frozen weight), and FakeQuantLearned(frozen weight, frozen scales[, frozen zero
/// points]), into Dequantize(codes, scales[, zero points]).
pub fn fold(mut g: Graph) -> Result<(Graph, PassReport), PassError> {
    let mut r = PassReport::new(Stage::Fold);
    for id in g.node_ids() {
        let (spec, learned) = match g.node(id).op {
            Op::FakeQuant { spec } => (spec, false),
            Op::FakeQuantLearned { spec } => (spec, true),
            _ => continue,
        };
        let operands = g.operands(id);
        if operands.iter().any(|&o| g.input_kind(o) != Some(InputKind::Frozen)) {
            continue;
        }
        let w = operands[0];
        let name = g.node(w).name.clone().unwrap_or_default();
        let dims = g.ty(w).shape.dims().to_vec();
        let (n_in, n_out) = (dims[0], dims[1]);
        let groups = n_in / spec.group_for(n_in);
        let (cn, sn, zn) = if learned { learned_storage_names(&name) } else { storage_names(&name) };
        let codes = g.input(cn, InputKind::Frozen, spec.code_dtype(), [n_in, n_out]).in_pass(Stage::Fold)?;
        let scales = g.input(sn, InputKind::Frozen, spec.scale_dtype(), [groups, n_out]).in_pass(Stage::Fold)?;
        let mut ops = vec![codes, scales];
        if let Some(zd) = spec.zero_dtype() {
            ops.push(g.input(zn, InputKind::Frozen, zd, Shape::new([groups, n_out])).in_pass(Stage::Fold)?);
        }
        let dq = g.add_node(Op::Dequantize { spec, to: DType::F32 }, &ops, g.node(id).name.clone()).in_pass(Stage::Fold)?;
        g.replace_all_uses(id, dq);
        r.count(if learned { "learned_weights" } else { "weights" }, 1);
        r.count("bytes_before", operands.iter().map(|&o| g.ty(o).bytes()).sum::<usize>() as i64);
        let after = g.ty(codes).bytes() + ops[1..].iter().map(|&o| g.ty(o).bytes()).sum::<usize>();
        r.count("bytes_after", after as i64);
    }
    g.remove_dead(true);
    Ok((g, r))
}
