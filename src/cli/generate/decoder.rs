//! The KV-cache decoder behind `qatc generate`: two compiled passes of the model
//! (`step::cached`, built and compiled as an evaluation's forward: the same passes, the same
//! executors), the prompt's (S = its length, the prefill) and one position's (a decode step),
//! sharing the layers' caches. The prefill runs first and its caches move to the one-position pass
//! once, through the host; from then on they stay on the executor, each step writing its new row
//! there, so a token costs one position of work and the host sends only the token, its position
//! and the attention mask.

use std::time::Instant;

use anyhow::Context;
use qatc_runtime::{IntTensor, Tensor, TrainStep, Value};

use super::super::eval::{compile_bound, EvalSetup};
use crate::frontend::gpt2::{attention_mask, cache_names, ATTN_MASK, POSITIONS};
use crate::model::Model;
use crate::step;
use crate::trainer::Profile;

/// Generation over one model: the prompt in one pass, then a token at a time.
pub struct Decoder<'a> {
    model: &'a Model,
    setup: &'a EvalSetup,
    /// M: the positions the caches hold (the prompt and every new token but the last).
    capacity: usize,
    /// The one-position pass, built after the prefill so that one executor holds the weights
    /// at a time.
    step: Option<Box<dyn TrainStep>>,
    /// Positions the caches hold, and held after the prefill.
    filled: usize,
    prefilled: usize,
    /// What runs the passes, in one line.
    pub description: String,
    /// Seconds spent building, binding and compiling the passes.
    pub compile_secs: f64,
    /// Where the decode steps' time goes (`--profile`), but the first's (it also runs what is
    /// hoisted out of the others).
    pub profile: Option<Profile>,
}

impl<'a> Decoder<'a> {
    /// A decoder whose caches hold `capacity` positions (at most the model's n_positions).
    pub fn new(model: &'a Model, setup: &'a EvalSetup, capacity: usize) -> anyhow::Result<Decoder<'a>> {
        let p = model.cfg.n_positions;
        if capacity == 0 || capacity > p {
            anyhow::bail!("internal: a KV cache of {capacity} positions for a model of {p}");
        }
        Ok(Decoder {
            model,
            setup,
            capacity,
            step: None,
            filled: 0,
            prefilled: 0,
            description: String::new(),
            compile_secs: 0.0,
            profile: None,
        })
    }

    /// Runs the prompt through the model in one pass, filling the caches from position 0; returns
    /// the next token's logits [V].
    pub fn prefill(&mut self, prompt: &[u32]) -> anyhow::Result<Vec<f32>> {
        if self.filled != 0 || self.step.is_some() {
            anyhow::bail!("internal: a prefill after the decoder started");
        }
        if prompt.is_empty() || prompt.len() > self.capacity {
            anyhow::bail!("internal: a prompt of {} tokens for a cache of {}", prompt.len(), self.capacity);
        }
        let mut pass = self.compile(prompt.len())?;
        let zeros = Value::Float(Tensor {
            shape: vec![self.capacity, self.model.cfg.n_embd],
            data: vec![0.0; self.capacity * self.model.cfg.n_embd],
        });
        for l in 0..self.model.cfg.n_layer {
            for name in cache_names(l) {
                pass.set_input(&name, &zeros).with_context(|| format!("setting {name}"))?;
            }
        }
        let logits = run(pass.as_mut(), prompt, 0, self.capacity, None)?;
        self.filled = prompt.len();
        self.prefilled = prompt.len();
        if prompt.len() == 1 {
            // the prompt's pass is the one-position pass
            self.step = Some(pass);
            return Ok(logits);
        }
        if prompt.len() == self.capacity {
            // one new token, from the prompt's pass: no position is left to decode
            return Ok(logits);
        }
        let mut caches = Vec::new();
        for l in 0..self.model.cfg.n_layer {
            for name in cache_names(l) {
                let v = pass.read_input(&name).with_context(|| format!("reading {name}"))?;
                caches.push((name, v));
            }
        }
        drop(pass);
        let mut one = self.compile(1)?;
        for (name, v) in &caches {
            one.set_input(name, v).with_context(|| format!("setting {name}"))?;
        }
        self.step = Some(one);
        Ok(logits)
    }

    /// Feeds one token at the next position; returns the following token's logits [V].
    pub fn step(&mut self, token: u32) -> anyhow::Result<Vec<f32>> {
        if self.filled >= self.capacity {
            anyhow::bail!("internal: the KV cache's {} positions are full", self.capacity);
        }
        let pass = self.step.as_mut().ok_or_else(|| anyhow::anyhow!("internal: a decode step before the prefill"))?;
        let first = self.filled == self.prefilled;
        let profile = self.profile.as_mut().filter(|_| !first);
        let logits = run(pass.as_mut(), &[token], self.filled, self.capacity, profile)?;
        self.filled += 1;
        Ok(logits)
    }

    /// Positions the caches hold.
    pub fn filled(&self) -> usize {
        self.filled
    }

    /// The pass over `tokens` new positions, built, bound and compiled.
    fn compile(&mut self, tokens: usize) -> anyhow::Result<Box<dyn TrainStep>> {
        let t = Instant::now();
        let (g, _) = step::cached(&self.model.cfg, tokens, self.capacity, &self.setup.model, |_, _| {})?;
        let bound = compile_bound(self.model, &g, self.setup, None)?;
        let (pass, description) = (bound.step, bound.description);
        self.description = description;
        self.compile_secs += t.elapsed().as_secs_f64();
        Ok(pass)
    }
}

/// One pass over `tokens` at positions `start..` of a cache of `capacity`: the ids, their
/// positions and the mask in, the last position's logits out (timed into `profile` when given).
pub fn run(
    pass: &mut dyn TrainStep,
    tokens: &[u32],
    start: usize,
    capacity: usize,
    profile: Option<&mut Profile>,
) -> anyhow::Result<Vec<f32>> {
    let s = tokens.len();
    let int = |data: Vec<i32>| Value::Int(IntTensor { shape: vec![1, s], data });
    let ids = tokens.iter().map(|&t| i32::try_from(t)).collect::<Result<Vec<_>, _>>().context("a token id past i32")?;
    let positions = (start..start + s).map(i32::try_from).collect::<Result<Vec<_>, _>>().context("a position past i32")?;
    pass.set_input("ids", &int(ids))?;
    pass.set_input(POSITIONS, &int(positions))?;
    pass.set_input(ATTN_MASK, &Value::Float(Tensor { shape: vec![s, capacity], data: attention_mask(start, s, capacity) }))?;
    match profile {
        Some(p) => {
            if let Some(times) = pass.run_timed()? {
                p.add(times, true);
            }
        }
        None => pass.run()?,
    }
    match pass.output("logits")? {
        Value::Float(t) => Ok(t.data),
        Value::Int(_) => anyhow::bail!("internal: integer logits"),
    }
}
