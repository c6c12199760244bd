//! A GPT-2 checkpoint opened for compilation: the validated file, its config, and weight binding
//! for the interpreter.

use std::collections::HashMap;
use std::path::Path;

use qatc_ir::{Graph, Op};
use qatc_passes::quant::storage_names;
use qatc_runtime::{quant, Float, IntTensor, Tensor, Value};

use crate::adapter::{self, Adapter};

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
    /// tensors from `adapter` or freshly initialised from `seed`.
    pub fn bind<T: Float>(&self, g: &Graph, adapter: Option<&Adapter>, seed: u64) -> Result<HashMap<String, Value<T>>, BindError> {
        let mut m = HashMap::new();
        for id in g.inputs() {
            let node = g.node(id);
            let (Op::Input { kind, .. }, Some(name)) = (&node.op, &node.name) else { continue };
            if !kind.is_param() {
                continue;
            }
            if self.ckpt.info(Self::tensor_name(name)).is_some() {
                m.insert(name.clone(), Value::Float(self.weight::<T>(name)?));
            } else if name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight") {
                let want = node.ty.shape.dims();
                let t = match adapter {
                    Some(a) => {
                        let t = a.tensors.get(name).ok_or_else(|| BindError::Adapter(format!("the adapter has no tensor {name:?}")))?;
                        if t.shape != want {
                            return Err(BindError::Adapter(format!("{name:?} is {:?} in the adapter, the model needs {want:?}", t.shape)));
                        }
                        t.clone()
                    }
                    None => adapter::init_tensor(name, want, seed),
                };
                m.insert(
                    name.clone(),
                    Value::Float(Tensor { shape: t.shape, data: t.data.into_iter().map(|v| T::from_f64(v as f64)).collect() }),
                );
            }
        }
        // folded weights: quantize the checkpoint tensor once, hand out codes/scales/zero points
        for (spec, codes_name) in dequantized(g) {
            let Some(w) = codes_name.strip_suffix(".qcodes") else { continue };
            let info = self
                .ckpt
                .info(Self::tensor_name(w))
                .ok_or_else(|| LoadError::MissingTensor { path: self.ckpt.path().to_path_buf(), tensor: w.to_string() })?;
            let (n_in, n_out) = (info.shape[0], info.shape[1]);
            let q = quant::quantize(&self.ckpt.to_f32(Self::tensor_name(w))?, n_in, n_out, spec);
            let (cn, sn, zn) = storage_names(w);
            let codes = q.codes.iter().map(|&c| c as i32).collect();
            m.insert(cn, Value::Int(IntTensor { shape: vec![n_in, n_out], data: codes }));
            let groups = q.groups();
            let f =
                |v: &[f32]| Value::Float(Tensor { shape: vec![groups, n_out], data: v.iter().map(|&x| T::from_f64(x as f64)).collect() });
            m.insert(sn, f(&q.scales));
            if spec.scheme.has_zero_point() {
                m.insert(zn, f(&q.zeros));
            }
        }
        Ok(m)
    }
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
