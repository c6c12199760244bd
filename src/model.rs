//! A GPT-2 checkpoint opened for compilation: the validated file, its config, and weight binding
//! for the interpreter.

use std::collections::HashMap;
use std::path::Path;

use qatc_ir::{Graph, Op, QuantSpec};
use qatc_passes::quant::{is_learned_name, learned_names, learned_storage_names, storage_names};
use qatc_runtime::{quant, Float, IntTensor, Tensor, Value};

use crate::adapter::{self, Adapter};
use crate::config::ScaleInit;

use crate::frontend::checkpoint::Checkpoint;
use crate::frontend::config::{ConfigSource, Gpt2Config};
use crate::frontend::LoadError;

#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("adapter: {0}")]
    Adapter(String),
}

pub struct Model {
    pub ckpt: Checkpoint,
    pub cfg: Gpt2Config,
    pub config_source: ConfigSource,
    /// Said once to the user when the config had to be inferred.
    pub notice: Option<String>,
}

impl Model {
    pub fn open(path: &Path) -> Result<Model, LoadError> {
        let ckpt = Checkpoint::open(path)?;
        let (cfg, config_source, notice) = Gpt2Config::load(&ckpt)?;
        cfg.validate(&ckpt)?;
        Ok(Model { ckpt, cfg, config_source, notice })
    }

    /// The checkpoint tensor behind a weight input: `lm_head.weight` is tied to `wte.weight`.
    pub fn tensor_name(name: &str) -> &str {
        if name == "lm_head.weight" {
            "wte.weight"
        } else {
            name
        }
    }

    /// Reads one weight converted to the interpreter's float type.
    pub fn weight<T: Float>(&self, name: &str) -> Result<Tensor<T>, LoadError> {
        let name = Self::tensor_name(name);
        let info = self
            .ckpt
            .info(name)
            .ok_or_else(|| LoadError::MissingTensor { path: self.ckpt.path().to_path_buf(), tensor: name.to_string() })?;
        let data: Vec<T> = if std::mem::size_of::<T>() == 8 {
            self.ckpt.to_f64(name)?.into_iter().map(T::from_f64).collect()
        } else {
            self.ckpt.to_f32(name)?.into_iter().map(|v| T::from_f64(v as f64)).collect()
        };
        Ok(Tensor { shape: info.shape.clone(), data })
    }

    /// Values for every weight input (frozen or trainable) of `g`, by name: checkpoint weights,
    /// the packed storage of folded weights (quantized here, from the checkpoint), and LoRA
    /// tensors and learned scales from `adapter` or freshly initialised (LoRA from `seed`).
    pub fn bind<T: Float>(&self, g: &Graph, adapter: Option<&Adapter>, seed: u64) -> Result<HashMap<String, Value<T>>, BindError> {
        match adapter {
            Some(a) => self.bind_trained(g, &Trained::Adapter(a)),
            None => self.bind_trained(g, &Trained::Fresh { seed, scale_init: ScaleInit::Minmax }),
        }
    }

    /// `bind`, the trained tensors taken from `trained`: a tensor it has wins over the
    /// checkpoint's, and the storage of folded weights is quantized from the resolved weight (and,
    /// for learned scales, from the resolved scales).
    pub fn bind_trained<T: Float>(&self, g: &Graph, trained: &Trained) -> Result<HashMap<String, Value<T>>, BindError> {
        let specs = learned_specs(g);
        let mut m = HashMap::new();
        for id in g.inputs() {
            let node = g.node(id);
            let (Op::Input { kind, .. }, Some(name)) = (&node.op, &node.name) else { continue };
            if !kind.is_param() {
                continue;
            }
            let want = node.ty.shape.dims();
            let t = match trained.get(name) {
                Some(t) if t.shape != want => {
                    return Err(BindError::Adapter(format!("{name:?} is {:?} in {}, the model needs {want:?}", t.shape, trained.what())))
                }
                Some(t) => t,
                None if self.ckpt.info(Self::tensor_name(name)).is_some() => self.weight::<f32>(name)?,
                None if name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight") => match trained {
                    Trained::Adapter(_) => return Err(BindError::Adapter(format!("the adapter has no tensor {name:?}"))),
                    Trained::Fresh { seed, .. } | Trained::Started { seed, .. } => adapter::init_tensor(name, want, *seed),
                    Trained::State(_) => return Err(BindError::Adapter(format!("the training state has no tensor {name:?}"))),
                },
                // not trained yet (an adapter trained with min-max scales starts them here)
                None if is_learned_name(name) => {
                    let spec =
                        specs.get(name).copied().ok_or_else(|| BindError::Adapter(format!("{name:?} feeds no learned fake-quant")))?;
                    self.init_learned(name, spec, trained)?
                }
                None => continue,
            };
            m.insert(
                name.clone(),
                Value::Float(Tensor { shape: t.shape, data: t.data.into_iter().map(|v| T::from_f64(v as f64)).collect() }),
            );
        }
        // folded weights: quantize the (resolved) weight once, hand out codes/scales/zero points
        for (spec, codes_name) in dequantized(g) {
            let (names, q) = if let Some(w) = codes_name.strip_suffix(".lsq.qcodes") {
                let (sn, zn) = learned_names(w);
                let weight = self.resolved(w, trained)?;
                let (n_in, n_out) = (weight.shape[0], weight.shape[1]);
                let scales = match trained.get(&sn) {
                    Some(s) => s,
                    None => self.init_learned(&sn, spec, trained)?,
                };
                let zeros = if spec.scheme.has_zero_point() {
                    match trained.get(&zn) {
                        Some(z) => z.data,
                        None => self.init_learned(&zn, spec, trained)?.data,
                    }
                } else {
                    Vec::new()
                };
                let groups = n_in / spec.group_for(n_in);
                if scales.data.len() != groups * n_out || (spec.scheme.has_zero_point() && zeros.len() != groups * n_out) {
                    return Err(BindError::Adapter(format!(
                        "{sn:?}: {} scales for a weight of {groups} x {n_out} groups",
                        scales.data.len()
                    )));
                }
                (learned_storage_names(w), quant::quantize_learned(&weight.data, n_in, n_out, spec, &scales.data, &zeros))
            } else if let Some(w) = codes_name.strip_suffix(".qcodes") {
                let weight = self.resolved(w, trained)?;
                (storage_names(w), quant::quantize(&weight.data, weight.shape[0], weight.shape[1], spec))
            } else {
                continue;
            };
            let (cn, sn, zn) = names;
            let codes = q.codes.iter().map(|&c| c as i32).collect();
            m.insert(cn, Value::Int(IntTensor { shape: vec![q.n_in, q.n_out], data: codes }));
            let groups = q.groups();
            let n_out = q.n_out;
            let f =
                |v: &[f32]| Value::Float(Tensor { shape: vec![groups, n_out], data: v.iter().map(|&x| T::from_f64(x as f64)).collect() });
            m.insert(sn, f(&q.scales));
            if spec.scheme.has_zero_point() {
                m.insert(zn, f(&q.zeros));
            }
        }
        Ok(m)
    }

    /// A weight as trained: from `trained` if it has it (a full fine-tune's state), else the
    /// checkpoint's.
    fn resolved(&self, name: &str, trained: &Trained) -> Result<Tensor<f32>, BindError> {
        match trained.get(name) {
            Some(t) => Ok(t),
            None => Ok(self.weight::<f32>(name)?),
        }
    }

    /// The initial learned scales (`W.scales`) or zero points (`W.zeros`) of weight W: its
    /// min-max quantization (`quant::init_learned`). The tied embedding is quantized as the
    /// [C, V] matrix of the LM head.
    fn init_learned(&self, name: &str, spec: QuantSpec, trained: &Trained) -> Result<Tensor<f32>, BindError> {
        let (w, zeros) = match (name.strip_suffix(".scales"), name.strip_suffix(".zeros")) {
            (Some(w), _) => (w, false),
            (_, Some(w)) => (w, true),
            _ => return Err(BindError::Adapter(format!("{name:?} is not a learned scale or zero point"))),
        };
        let t = self.quantized_view(w, trained)?;
        let (n_in, n_out) = (t.shape[0], t.shape[1]);
        let (s, z) = match trained {
            Trained::Fresh { scale_init: ScaleInit::Search, .. } => quant::init_learned_searched(&t.data, n_in, n_out, spec),
            Trained::Fresh { scale_init: init @ (ScaleInit::Activation | ScaleInit::Auto), .. } => {
                return Err(BindError::Adapter(format!(
                    "{name:?}: --scale-init {} starts from the calibration step (crate::calibrate), which did not run",
                    init.described()
                )))
            }
            _ => quant::init_learned(&t.data, n_in, n_out, spec),
        };
        let shape = vec![n_in / spec.group_for(n_in), n_out];
        Ok(Tensor { shape, data: if zeros { z } else { s } })
    }
}

impl Model {
    /// Weight `w` as its fake-quant sees it, [in, out]: the tied embedding is quantized as the
    /// [C, V] matrix of the LM head.
    pub fn quantized_view(&self, w: &str, trained: &Trained) -> Result<Tensor<f32>, BindError> {
        let t = self.resolved(w, trained)?;
        if w == "wte.weight" {
            return Ok(Tensor {
                shape: vec![t.shape[1], t.shape[0]],
                data: crate::export::llama::transpose(&t.data, t.shape[0], t.shape[1]),
            });
        }
        Ok(t)
    }
}

/// Where the values of trained tensors (LoRA's A and B, learned scales and zero points) come
/// from when a graph is bound.
pub enum Trained<'a> {
    /// Fresh: LoRA as PEFT initialises it (from the seed), scales by `scale_init` (an adapter or
    /// a state without scales starts them by the min-max rule).
    Fresh { seed: u64, scale_init: ScaleInit },
    /// A saved adapter, with its learned scales when it has them.
    Adapter(&'a Adapter),
    /// A training run's persistent state (validation while training).
    State(&'a HashMap<String, Value<f32>>),
    /// Fresh LoRA from the seed, learned scales and zero points from the calibration step
    /// (`crate::calibrate`), by input name.
    Started { seed: u64, starts: &'a HashMap<String, Tensor<f32>> },
}

impl Trained<'_> {
    fn get(&self, name: &str) -> Option<Tensor<f32>> {
        match self {
            Trained::Fresh { .. } => None,
            Trained::Adapter(a) => a.tensors.get(name).or_else(|| a.quant.get(name)).cloned(),
            Trained::State(s) => match s.get(name) {
                Some(Value::Float(t)) => Some(t.clone()),
                _ => None,
            },
            Trained::Started { starts, .. } => starts.get(name).cloned(),
        }
    }
    fn what(&self) -> &'static str {
        match self {
            Trained::Fresh { .. } => "the initialisation",
            Trained::Adapter(_) => "the adapter",
            Trained::State(_) => "the training state",
            Trained::Started { .. } => "the calibrated start",
        }
    }
}

/// The spec of the learned fake-quant each learned scale or zero-point input feeds, also inside
/// fused kernels' bodies.
pub fn learned_specs(g: &Graph) -> HashMap<String, QuantSpec> {
    let mut out = HashMap::new();
    for id in g.node_ids() {
        let ops = g.operands(id);
        match &g.node(id).op {
            Op::FakeQuantLearned { spec } => {
                for &o in &ops[1..] {
                    out.extend(g.node(o).name.clone().map(|n| (n, *spec)));
                }
            }
            Op::Kernel { body, .. } => {
                for (inner, spec) in learned_specs(body) {
                    let slot = inner.strip_prefix("in").and_then(|i| i.parse::<usize>().ok());
                    out.extend(slot.and_then(|i| ops.get(i)).and_then(|&o| g.node(o).name.clone()).map(|n| (n, spec)));
                }
            }
            _ => {}
        }
    }
    out
}

/// Every Dequantize of `g`, also inside fused kernels' bodies, with its spec and the name of the
/// codes input it reads (a body's inputs `in0..inN` are the kernel's operands).
fn dequantized(g: &Graph) -> Vec<(qatc_ir::QuantSpec, String)> {
    let mut out = Vec::new();
    for id in g.node_ids() {
        let ops = g.operands(id);
        match &g.node(id).op {
            Op::Dequantize { spec, .. } => out.extend(g.node(ops[0]).name.clone().map(|n| (*spec, n))),
            Op::Kernel { body, .. } => {
                for (spec, inner) in dequantized(body) {
                    let slot = inner.strip_prefix("in").and_then(|i| i.parse::<usize>().ok());
                    out.extend(slot.and_then(|i| ops.get(i)).and_then(|&o| g.node(o).name.clone()).map(|n| (spec, n)));
                }
            }
            _ => {}
        }
    }
    out
}
