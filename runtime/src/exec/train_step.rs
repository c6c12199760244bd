//! [`TrainStep`]: a compiled training step as the trainer uses it, on any executor. The state
//! lives on the executor: the persistent inputs (frozen weights, trainable parameters, optimizer
//! moments, the step count) are given once and stay there; every run writes its updates over
//! them there; per step only the data inputs go in (ids, targets, lr, dropout seeds) and only
//! the scalar outputs come back. A tensor is read back only when asked for (a save, a
//! validation).
//!
//! [`InterpretedStep`] is the reference interpreter behind the same interface.

use std::collections::{HashMap, HashSet};

use qatc_ir::Graph;

use crate::error::RuntimeError;
use crate::interp::Interpreter;
use crate::value::Value;

/// A training step whose state stays on its executor between runs.
pub trait TrainStep: Send {
    /// Copies an input's value in, where it stays until set again: a persistent input once (and
    /// again on a resume), a data input before every run. A name the step has no input for is
    /// [`RuntimeError::UnknownInput`].
    fn set_input(&mut self, name: &str, v: &Value<f32>) -> Result<(), RuntimeError>;

    /// Runs the step on the inputs given; each update output lands in its input's storage, on
    /// the executor.
    fn run(&mut self) -> Result<(), RuntimeError>;

    /// The names of the non-update outputs (the loss, `grad_norm` with clipping, gradients when
    /// the step keeps them), sorted.
    fn output_names(&self) -> Vec<String>;

    /// A non-update output of the last run, read back.
    fn output(&self, name: &str) -> Result<Value<f32>, RuntimeError>;

    /// An input's current value, read back: after a run, a parameter or moment as updated.
    fn read_input(&self, name: &str) -> Result<Value<f32>, RuntimeError>;

    /// Runs the step as [`TrainStep::run`] does, timing its parts: what, seconds and cost per
    /// part in order; None when this executor does not time its parts.
    fn run_timed(&mut self) -> Result<Option<Vec<super::TimedPart>>, RuntimeError> {
        self.run()?;
        Ok(None)
    }

    /// Every non-update output of the last run, read back.
    fn outputs(&self) -> Result<HashMap<String, Value<f32>>, RuntimeError> {
        self.output_names().into_iter().map(|n| self.output(&n).map(|v| (n, v))).collect()
    }
}

/// The reference interpreter as a [`TrainStep`]: its "device" is the host, where the inputs are
/// kept; each run's updates replace their inputs' values (moved, not copied).
pub struct InterpretedStep {
    interp: Interpreter<f32>,
    names: HashSet<String>,
    inputs: HashMap<String, Value<f32>>,
    last: HashMap<String, Value<f32>>,
    output_names: Vec<String>,
}

impl InterpretedStep {
    pub fn new(g: &Graph) -> Result<InterpretedStep, RuntimeError> {
        let interp = Interpreter::<f32>::new(g)?;
        let names = interp.inputs().into_iter().map(|(n, _, _)| n.to_string()).collect();
        let mut output_names: Vec<String> = g.outputs().iter().filter(|o| !o.update).map(|o| o.name.clone()).collect();
        output_names.sort();
        output_names.dedup();
        Ok(InterpretedStep { interp, names, inputs: HashMap::new(), last: HashMap::new(), output_names })
    }
}

impl TrainStep for InterpretedStep {
    fn set_input(&mut self, name: &str, v: &Value<f32>) -> Result<(), RuntimeError> {
        if !self.names.contains(name) {
            return Err(RuntimeError::UnknownInput(name.to_string()));
        }
        self.inputs.insert(name.to_string(), v.clone());
        Ok(())
    }

    fn run(&mut self) -> Result<(), RuntimeError> {
        let r = self.interp.run_split(&self.inputs)?;
        self.inputs.extend(r.updates);
        self.last = r.outputs;
        Ok(())
    }

    fn output_names(&self) -> Vec<String> {
        self.output_names.clone()
    }

    fn output(&self, name: &str) -> Result<Value<f32>, RuntimeError> {
        self.last.get(name).cloned().ok_or_else(|| RuntimeError::MissingOutput(name.to_string()))
    }

    fn read_input(&self, name: &str) -> Result<Value<f32>, RuntimeError> {
        match self.inputs.get(name) {
            Some(v) => Ok(v.clone()),
            None if self.names.contains(name) => Err(RuntimeError::MissingInput(name.to_string())),
            None => Err(RuntimeError::UnknownInput(name.to_string())),
        }
    }
}
