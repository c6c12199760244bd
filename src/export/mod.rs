//! `qatc export`: a trained LoRA adapter merged into its base model, written as what the trained
//! model computed with: Hugging Face safetensors (`hf`) or GGUF v3 for llama.cpp (`llama`,
//! `gguf`).
//!
//! The weights come from the evaluation graph itself (`step::model`, the graph `qatc eval
//! --adapter` runs), so the export cannot drift from the training semantics. Per linear:
//!
//! | trained with      | forward used            | `trained` (exported)   | `pre_quant` (Q4_0 source) |
//! |-------------------|-------------------------|------------------------|---------------------------|
//! | `--qat merged`    | FQ(W + s (BA)^T)        | that, on the grid      | W + s (BA)^T              |
//! | `--qat base`      | FQ(W) x + s (x A^T) B^T | FQ(W) + s (BA)^T       | W + s (BA)^T              |
//! | not adapted       | FQ(W) (or W)            | FQ(W) (or W)           | W                         |
//!
//! s (BA)^T is computed by the interpreter with the ops of the LoRA pass (`lora::merge`), so
//! under `--qat merged` `pre_quant` is bit for bit the tensor the trained FakeQuant rounded. With
//! learned scales (`--scales learned`) FakeQuant is FakeQuantLearned, and the adapter's scales
//! travel with the weight (`learned`), so GGUF blocks can hold the trained codes.

pub mod gguf;
pub mod hf;
pub mod llama;
pub mod vocab;

use std::collections::{BTreeMap, HashMap};

use qatc_ir::{NodeId, Op, QuantScheme, QuantSpec};
use qatc_passes::lora::lora_names;
use qatc_passes::quant::learned_names;
use qatc_runtime::{Interpreter, Tensor, Value};

use crate::adapter::Adapter;
use crate::frontend::config::Gpt2Config;
use crate::model::Model;
use crate::step::{self, ModelOptions};

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(transparent)]
    Load(#[from] crate::frontend::LoadError),
    #[error(transparent)]
    Bind(#[from] crate::model::BindError),
    #[error(transparent)]
    Pass(#[from] qatc_passes::PassError),
    #[error(transparent)]
    Runtime(#[from] qatc_runtime::RuntimeError),
    #[error(transparent)]
    Gguf(#[from] gguf::GgufError),
    #[error("safetensors: {0}")]
    Safetensors(#[from] safetensors::SafeTensorError),
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
    /// Settings the export cannot represent, or an adapter that does not fit the model.
    #[error("{0}")]
    Unsupported(String),
    /// The graph did not have the structure the export reads (a bug, not bad input).
    #[error("internal: {0}")]
    Internal(String),
}

/// The output formats (`--format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Hugging Face: float32 `model.safetensors` + `config.json`.
    Safetensors,
    /// llama.cpp: GGUF v3.
    Gguf,
}

impl Format {
    /// The name `--format` takes.
    pub fn name(self) -> String {
        clap::ValueEnum::to_possible_value(&self).map(|v| v.get_name().to_string()).unwrap_or_default()
    }
}

/// One linear (Conv1D) weight as the trained model used it; matrices are [in, out] row-major.
#[derive(Clone, Debug)]
pub struct LinearExport {
    /// `h.{i}.attn.c_attn` ...
    pub module: String,
    pub n_in: usize,
    pub n_out: usize,
    /// The quantization training applied to this weight.
    pub spec: Option<QuantSpec>,
    pub adapted: bool,
    /// The weight the trained forward computed with (see the module table).
    pub trained: Vec<f32>,
    /// W + s (BA)^T before quantization; kept only for Q4_0 weights and learned scales, whose
    /// export re-runs the trained quantizer on it (exact under `--qat merged` or when not adapted).
    pub pre_quant: Option<Vec<f32>>,
    /// The learned scales and zero points ([in/G, out]; zero points empty unless asym) the weight
    /// was trained with (`--scales learned`).
    pub learned: Option<(Vec<f32>, Vec<f32>)>,
}

impl LinearExport {
    /// Whether `trained` is exactly `quantize(pre_quant)` dequantized: the export of the codes
    /// is then the trained model bit for bit.
    pub fn on_grid(&self, qat_merged: bool) -> bool {
        self.spec.is_some() && (!self.adapted || qat_merged)
    }
}

/// The merged model: every tensor of the checkpoint, linears as trained.
#[derive(Clone, Debug)]
pub struct Merged {
    pub cfg: Gpt2Config,
    /// Trained with `--qat merged`.
    pub qat_merged: bool,
    pub linears: Vec<LinearExport>,
    /// Embeddings, LayerNorms and biases by HF name (no `transformer.`), as f32.
    pub others: BTreeMap<String, Tensor<f32>>,
}

impl Merged {
    /// Every tensor under its HF name, in the checkpoint's canonical order; linears [in, out].
    pub fn hf_tensors(&self) -> Vec<(String, Tensor<f32>)> {
        let lin: HashMap<String, &LinearExport> = self.linears.iter().map(|l| (format!("{}.weight", l.module), l)).collect();
        self.cfg
            .expected_tensors()
            .into_iter()
            .filter_map(|(name, _)| match lin.get(&name) {
                Some(l) => Some((name, Tensor { shape: vec![l.n_in, l.n_out], data: l.trained.clone() })),
                None => self.others.get(&name).map(|t| (name, t.clone())),
            })
            .collect()
    }
}

/// Checks the options an export can represent: only the linears' weights may be quantized (a
/// quantized tied embedding or quantized activations have no place in either format).
fn check_options(mo: &ModelOptions) -> Result<(), ExportError> {
    if mo.lora.is_none() {
        return Err(ExportError::Internal("export needs the adapter's LoRA options".into()));
    }
    if let Some(q) = &mo.quant {
        if q.act_bits.is_some() {
            return Err(ExportError::Unsupported(
                "--act-bits: activation fake-quantization has no equivalent in the exported model; export without it".into(),
            ));
        }
        if let Some(t) = q.targets.iter().find(|t| *t == "lm_head" || *t == "wte") {
            return Err(ExportError::Unsupported(format!(
                "--quant-targets {t}: export supports quantized linears only (the tied embedding stays f32)"
            )));
        }
    }
    Ok(())
}

/// A linear's learned scales and zero points from the adapter's `adapter::QUANT_FILE`.
fn learned_of(adapter: &Adapter, module: &str, spec: QuantSpec, n_in: usize, n_out: usize) -> Result<(Vec<f32>, Vec<f32>), ExportError> {
    let (sn, zn) = learned_names(&format!("{module}.weight"));
    let want = [n_in / spec.group_for(n_in), n_out];
    let get = |name: &str| match adapter.quant.get(name) {
        Some(t) if t.shape == want => Ok(t.data.clone()),
        Some(t) => Err(ExportError::Unsupported(format!("the adapter's {name:?} is {:?}, the model needs {want:?}", t.shape))),
        None => Err(ExportError::Unsupported(format!("the adapter has no learned scales {name:?} ({})", crate::adapter::QUANT_FILE))),
    };
    let zeros = if spec.scheme.has_zero_point() { get(&zn)? } else { Vec::new() };
    Ok((get(&sn)?, zeros))
}

/// What to read from the graph for one linear.
struct Plan {
    module: String,
    n_in: usize,
    n_out: usize,
    spec: Option<QuantSpec>,
    adapted: bool,
    /// The matmul's weight operand: FakeQuant, Dequantize or the weight input.
    weight_op: NodeId,
    /// s (BA)^T [in, out] (`--qat base`), or W + s (BA)^T, FakeQuant's operand (`--qat merged`).
    extra: Option<NodeId>,
}

/// Merges `adapter` into `m` under `mo` (the quantization and LoRA options it was trained with).
pub fn merge(m: &Model, mo: &ModelOptions, adapter: &Adapter) -> Result<Merged, ExportError> {
    check_options(mo)?;
    let mut mo = mo.clone();
    mo.training = false;
    mo.full_finetune = false;
    let qat_merged = mo.lora.as_ref().is_some_and(|l| l.merged);
    let learned_scales = mo.quant.as_ref().is_some_and(|q| q.learned_scales);
    let scaling = mo.lora.as_ref().map_or(1.0, |l| l.scaling());
    // B = T = 1: the weights do not depend on the batch, and only they are computed
    let (mut g, _) = step::model(&m.cfg, 1, 1, false, &mo, |_, _| {})?;
    for name in adapter.tensors.keys() {
        if g.find_input(name).is_none() {
            return Err(ExportError::Unsupported(format!(
                "the adapter's tensor {name:?} matches no linear of this model ({} layers)",
                m.cfg.n_layer
            )));
        }
    }
    let by_name: HashMap<String, NodeId> = g.node_ids().into_iter().filter_map(|id| g.node(id).name.clone().map(|n| (n, id))).collect();
    let internal = |what: String| ExportError::Internal(what);
    let mut plans = Vec::new();
    for l in 0..m.cfg.n_layer {
        for lin in qatc_passes::linears::MODULES {
            let module = format!("h.{l}.{lin}");
            // lowering: add(matmul(x, weight_op), broadcast(bias)) named after the module
            let out = *by_name.get(&module).ok_or_else(|| internal(format!("no node named {module}")))?;
            let mm = g.operands(out)[0];
            if !matches!(g.node(mm).op, Op::MatMul { .. }) {
                return Err(internal(format!("{module}: its output is not a matmul plus bias")));
            }
            let weight_op = g.operands(mm)[1];
            let dims = g.ty(weight_op).shape.dims().to_vec();
            let spec = match g.node(weight_op).op {
                Op::FakeQuant { spec } | Op::Dequantize { spec, .. } | Op::FakeQuantLearned { spec } => Some(spec),
                _ => None,
            };
            let (an, bn) = lora_names(&module);
            let adapted = g.find_input(&an).is_some();
            let extra = match (adapted, qat_merged) {
                (false, _) => None,
                (true, true) => match g.node(weight_op).op {
                    Op::FakeQuant { .. } | Op::FakeQuantLearned { .. } => Some(g.operands(weight_op)[0]),
                    _ => return Err(internal(format!("{module}: --qat merged without a FakeQuant on the merged weight"))),
                },
                (true, false) => {
                    // the ops of lora::merge: (B A)^T = A^T B^T [in, out], times s
                    let (a, b) = (g.find_input(&an), g.find_input(&bn));
                    let (Some(a), Some(b)) = (a, b) else { return Err(internal(format!("{module}: lora_B without lora_A"))) };
                    let ba_t = g.add(Op::MatMul { ta: true, tb: true }, &[a, b]).map_err(|e| internal(e.to_string()))?;
                    let d = g.add(Op::Affine { mul: scaling, add: 0.0 }, &[ba_t]).map_err(|e| internal(e.to_string()))?;
                    g.set_output(format!("export.delta:{module}"), d).map_err(|e| internal(e.to_string()))?;
                    Some(d)
                }
            };
            plans.push(Plan { module, n_in: dims[0], n_out: dims[1], spec, adapted, weight_op, extra });
        }
    }
    let interp = Interpreter::<f32>::new(&g)?;
    let inputs = m.bind::<f32>(&g, Some(adapter), 0)?;
    let mut linears = Vec::new();
    for p in plans {
        let want: Vec<NodeId> = std::iter::once(p.weight_op).chain(p.extra).collect();
        let mut vals = interp.run_nodes(&inputs, &want)?.into_iter().map(|v| match v {
            Value::Float(t) => Ok(t.data),
            _ => Err(internal(format!("{}: the weight is not a float tensor", p.module))),
        });
        let w_op = vals.next().ok_or_else(|| internal(format!("{}: no value", p.module)))??;
        let extra = vals.next().transpose()?;
        let learned = match p.spec {
            Some(spec) if learned_scales => Some(learned_of(adapter, &p.module, spec, p.n_in, p.n_out)?),
            _ => None,
        };
        let is_q4_0 = p.spec.is_some_and(|s| s.scheme == QuantScheme::Q4_0) || learned.is_some();
        let weight = |m: &Model| m.weight::<f32>(&format!("{}.weight", p.module)).map(|t| t.data);
        let (trained, pre_quant) = match (p.adapted, qat_merged, extra) {
            (true, true, Some(w_eff)) => (w_op, is_q4_0.then_some(w_eff)),
            (true, false, Some(d)) => {
                let trained = w_op.iter().zip(&d).map(|(w, d)| w + d).collect();
                let pre = if is_q4_0 { Some(weight(m)?.iter().zip(&d).map(|(w, d)| w + d).collect()) } else { None };
                (trained, pre)
            }
            (false, _, None) => (w_op, if is_q4_0 { Some(weight(m)?) } else { None }),
            _ => return Err(internal(format!("{}: inconsistent merge plan", p.module))),
        };
        linears.push(LinearExport {
            module: p.module,
            n_in: p.n_in,
            n_out: p.n_out,
            spec: p.spec,
            adapted: p.adapted,
            trained,
            pre_quant,
            learned,
        });
    }
    let lin_names: std::collections::HashSet<String> = linears.iter().map(|l| format!("{}.weight", l.module)).collect();
    let mut others = BTreeMap::new();
    for (name, _) in m.cfg.expected_tensors() {
        if !lin_names.contains(&name) {
            let t = m.weight::<f32>(&name)?;
            others.insert(name, t);
        }
    }
    Ok(Merged { cfg: m.cfg.clone(), qat_merged, linears, others })
}
