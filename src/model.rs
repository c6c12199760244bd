//! A GPT-2 checkpoint opened for compilation: the validated file, its config, and weight binding
//! for the interpreter.

use std::collections::HashMap;
use std::path::Path;

use qatc_ir::{Graph, Op};
use qatc_runtime::{Float, Tensor, Value};

use crate::frontend::checkpoint::Checkpoint;
use crate::frontend::config::{ConfigSource, Gpt2Config};
use crate::frontend::LoadError;

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
        let info = self.ckpt.info(name).ok_or_else(|| LoadError::MissingTensor {
            path: self.ckpt.path().to_path_buf(),
            tensor: name.to_string(),
        })?;
        let data: Vec<T> = if std::mem::size_of::<T>() == 8 {
            self.ckpt.to_f64(name)?.into_iter().map(T::from_f64).collect()
        } else {
            self.ckpt.to_f32(name)?.into_iter().map(|v| T::from_f64(v as f64)).collect()
        };
        Ok(Tensor { shape: info.shape.clone(), data })
    }

    /// Values for every weight input (frozen or trainable) of `g`, by name.
    pub fn bind<T: Float>(&self, g: &Graph) -> Result<HashMap<String, Value<T>>, LoadError> {
        let mut m = HashMap::new();
        for id in g.inputs() {
            let node = g.node(id);
            let (Op::Input { kind, .. }, Some(name)) = (&node.op, &node.name) else { continue };
            if kind.is_param() && self.ckpt.info(Self::tensor_name(name)).is_some() {
                m.insert(name.clone(), Value::Float(self.weight::<T>(name)?));
            }
        }
        Ok(m)
    }
}
