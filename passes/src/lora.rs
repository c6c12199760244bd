//! LoRA as a pass, with PEFT's semantics for GPT-2's Conv1D linears:
//!
//!   y = x W' + b + scaling * (dropout(x) A^T) B^T      A [r, in], B [out, r]
//!
//! scaling = alpha / r (alpha / sqrt(r) with rsLoRA). A and B are new `Trainable` inputs named
//! `MODULE.lora_A.weight` / `MODULE.lora_B.weight` (PEFT's keys without the
//! `base_model.model.transformer.` prefix). With `merged`, the adapter is instead folded into the
//! weight before quantization, y = x FQ(W + scaling (B A)^T) + b, so the merged model lies
//! exactly on the quantization grid (QA-LoRA style); the STE carries the gradient into A and B.

use qatc_ir::{BinaryOp, DType, Graph, InputKind, NodeId, Op, Shape};
use serde::Serialize;

use crate::error::{InPass, PassError};
use crate::linears::{self, matches};
use crate::pipeline::PassReport;
use crate::pipeline::Stage;

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LoraOptions {
    pub r: usize,
    pub alpha: f64,
    pub dropout: f64,
    pub targets: Vec<String>,
    pub rslora: bool,
    /// Fold the adapter into the fake-quantized weight (`--qat merged`).
    pub merged: bool,
}

impl LoraOptions {
    pub fn new(r: usize) -> LoraOptions {
        LoraOptions {
            r,
            alpha: 2.0 * r as f64,
            dropout: 0.0,
            targets: vec!["c_attn".into(), "c_proj".into(), "c_fc".into()],
            rslora: false,
            merged: false,
        }
    }
    /// Whether the options make sense: r at least 1, alpha a positive finite number (a NaN or an
    /// infinite alpha makes every LoRA output NaN), dropout in [0, 1) and none with `merged`,
    /// and targets that name GPT-2 linears.
    pub fn check(&self) -> Result<(), String> {
        if self.r == 0 {
            return Err("LoRA rank r must be at least 1".into());
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(format!("LoRA alpha must be a positive number, got {}", self.alpha));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(format!("LoRA dropout must be in [0, 1), got {}", self.dropout));
        }
        if self.merged && self.dropout > 0.0 {
            return Err("--qat merged folds the adapter into the weight, so LoRA dropout must be 0".into());
        }
        for t in &self.targets {
            if !linears::is_known_target(t) {
                return Err(format!("unknown LoRA target `{t}`; GPT-2's linears are {}", linears::described()));
            }
        }
        Ok(())
    }

    pub fn scaling(&self) -> f64 {
        if self.rslora {
            self.alpha / (self.r as f64).sqrt()
        } else {
            self.alpha / self.r as f64
        }
    }
}

pub fn lora_names(module: &str) -> (String, String) {
    (format!("{module}.lora_A.weight"), format!("{module}.lora_B.weight"))
}

/// The name of the dropout seed input (an i32 scalar the runtime changes every step).
pub const DROPOUT_SEED: &str = "dropout.seed";

pub fn lora(mut g: Graph, o: &LoraOptions) -> Result<(Graph, PassReport), PassError> {
    let mut rep = PassReport::new(Stage::Lora);
    let bad = |msg: String| PassError::Invalid { pass: Stage::Lora, msg };
    o.check().map_err(bad)?;
    let lins: Vec<_> = linears::find(&g).into_iter().filter(|l| o.targets.iter().any(|t| matches(&l.module, t))).collect();
    let seed = if o.dropout > 0.0 {
        Some(g.input(DROPOUT_SEED, InputKind::Data, DType::I32, Shape::scalar()).in_pass(Stage::Lora)?)
    } else {
        None
    };
    let s = o.scaling();
    for (stream, lin) in lins.iter().enumerate() {
        if o.r > lin.n_in.min(lin.n_out) {
            return Err(bad(format!("LoRA rank {} exceeds min(in, out) = {} of {}", o.r, lin.n_in.min(lin.n_out), lin.module)));
        }
        let (an, bn) = lora_names(&lin.module);
        let a = g.input(an, InputKind::Trainable, DType::F32, [o.r, lin.n_in]).in_pass(Stage::Lora)?; // [r, in]
        let b = g.input(bn, InputKind::Trainable, DType::F32, [lin.n_out, o.r]).in_pass(Stage::Lora)?; // [out, r]
        if o.merged {
            merge(&mut g, lin, a, b, s)?;
        } else {
            // u [N, r] = dropout(x) A^T ; v [N, out] = u B^T ; y += scaling v
            let x = match seed {
                Some(sd) => g.add(Op::Dropout { p: o.dropout, stream }, &[lin.x, sd]).in_pass(Stage::Lora)?,
                None => lin.x,
            };
            let u = g.add_named(Op::MatMul { ta: false, tb: true }, &[x, a], format!("{}.lora_u", lin.module)).in_pass(Stage::Lora)?;
            let v = g.add(Op::MatMul { ta: false, tb: true }, &[u, b]).in_pass(Stage::Lora)?;
            let sv = g.add(Op::Affine { mul: s, add: 0.0 }, &[v]).in_pass(Stage::Lora)?;
            let y = g.add_named(Op::Binary(BinaryOp::Add), &[lin.out, sv], format!("{}.lora", lin.module)).in_pass(Stage::Lora)?;
            g.replace_all_uses(lin.out, y);
        }
        rep.count("modules", 1);
        rep.count("params", (o.r * (lin.n_in + lin.n_out)) as i64);
    }
    if lins.is_empty() {
        return Err(bad("no linear matched the LoRA targets".into()));
    }
    Ok((g, rep))
}

/// W_eff = W + scaling (B A)^T, placed under the linear's FakeQuant (or directly as its weight).
fn merge(g: &mut Graph, lin: &linears::Linear, a: NodeId, b: NodeId, s: f64) -> Result<(), PassError> {
    let ba_t = g.add(Op::MatMul { ta: true, tb: true }, &[a, b]).in_pass(Stage::Lora)?; // A^T B^T = (B A)^T [in, out]
    let d = g.add(Op::Affine { mul: s, add: 0.0 }, &[ba_t]).in_pass(Stage::Lora)?;
    let w_eff = g.add_named(Op::Binary(BinaryOp::Add), &[lin.weight, d], format!("{}.weight.merged", lin.module)).in_pass(Stage::Lora)?;
    g.replace_all_uses(lin.weight, w_eff);
    Ok(())
}
