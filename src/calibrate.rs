//! The trainer's `calibrate` step: where learned scales start with `--scale-init activation` or
//! `auto`. It runs the full-precision forward (the `lower` stage's graph, on the reference
//! interpreter: exact, and only what the linears' inputs need, so never the LM head) on the first
//! batches of the training data, adds each quantized linear's input X into its Gram matrix
//! X^T X, and starts each weight's scales where its layer's output error ||X W - X Q(W)||^2 is
//! least (`quant::init_learned_activation`, whose doc states the objective and grid). With `auto`,
//! each weight takes whichever start (min-max, weight search, activation-aware) gives that error
//! least, ties to the simpler one.
//!
//! It is a step of the trainer's setup, not a stage of the graph pipeline (`pipeline::STAGES`):
//! its input is data and weights, and its output the values of the scale inputs, not a graph;
//! `qatc dump --list` names it after the stages.
//!
//! The tied embedding is no linear with an input to calibrate on (its lookup's input is one-hot,
//! so its output error is its weight error): it starts by the weight search with `activation`,
//! and by the least weight error of min-max and search with `auto`.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use qatc_ir::{NodeId, QuantSpec};
use qatc_passes::linears;
use qatc_runtime::{quant, IntTensor, Interpreter, Tensor, Value};

use crate::batches::Batches;
use crate::config::{ScaleInit, ScaleStarts};
use crate::model::{learned_specs, BindError, Model, Trained};
use crate::step::{self, ModelOptions, Stage};

/// How many batches of the training data the calibration reads (the first ones, in order).
pub const BATCHES: usize = 4;

/// The step's name, as `qatc dump --list` shows it.
pub const NAME: &str = "calibrate";

/// What `qatc dump --list` says the step does.
pub const ABOUT: &str =
    "(qatc train's setup, not a graph stage: it needs the training data) where learned scales start with --scale-init activation|auto: each linear's output error on the first batches";

#[derive(Debug, thiserror::Error)]
pub enum CalibrateError {
    #[error("calibrate: {0}")]
    Pass(#[from] qatc_passes::PassError),
    #[error("calibrate: {0}")]
    Runtime(#[from] qatc_runtime::RuntimeError),
    #[error("calibrate: {0}")]
    Data(#[from] crate::data::DataError),
    #[error("calibrate: {0}")]
    Bind(#[from] BindError),
    #[error("calibrate: {0}")]
    Invalid(String),
}

/// One quantized weight's start: the output error of each candidate on the calibration data
/// (activation-aware is None for the embedding) and the one taken.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerStart {
    pub weight: String,
    pub minmax: f64,
    pub search: f64,
    pub activation: Option<f64>,
    pub chosen: ScaleInit,
}

/// The calibration's result.
#[derive(Clone, Debug)]
pub struct Calibration {
    /// Each learned scale and zero-point input's start, by input name (`Trained::Started`).
    pub tensors: HashMap<String, Tensor<f32>>,
    /// By weight name.
    pub layers: Vec<LayerStart>,
    pub batches: usize,
    pub tokens: usize,
    pub seconds: f64,
}

impl Calibration {
    /// What `qatc.json` keeps: the batches and each weight's choice.
    pub fn starts(&self) -> ScaleStarts {
        ScaleStarts { batches: self.batches, chosen: self.layers.iter().map(|l| (l.weight.clone(), l.chosen)).collect() }
    }

    /// The run's line: "10 activation-aware, 4 weight search, 2 min-max".
    pub fn counts(&self) -> String {
        let mut parts = Vec::new();
        for init in [ScaleInit::Activation, ScaleInit::Search, ScaleInit::Minmax] {
            let n = self.layers.iter().filter(|l| l.chosen == init).count();
            if n > 0 {
                parts.push(format!("{n} {}", init.described()));
            }
        }
        parts.join(", ")
    }
}

/// Calibrates the learned scales of the model `mo` builds (B x T batches of `data`) for `init`
/// (activation or auto).
pub fn calibrate(
    m: &Model,
    mo: &ModelOptions,
    (b, t): (usize, usize),
    data: &impl Batches,
    init: ScaleInit,
) -> Result<Calibration, CalibrateError> {
    if !init.calibrates() {
        return Err(CalibrateError::Invalid(format!("--scale-init {} needs no calibration", init.described())));
    }
    let start = Instant::now();
    // the model as it trains names the learned scales and their specs; its `lower` stage is the
    // full-precision forward the activations come from
    let mut lowered = None;
    let (model, _) = step::model(&m.cfg, b, t, false, mo, |stage, g| {
        if stage == Stage::Lower {
            lowered = Some(g.clone());
        }
    })?;
    let lowered = lowered.ok_or_else(|| CalibrateError::Invalid("the lower stage did not run".into()))?;
    let mut specs: BTreeMap<String, QuantSpec> = BTreeMap::new();
    for (name, spec) in learned_specs(&model) {
        if let Some(w) = name.strip_suffix(".scales") {
            specs.insert(w.to_string(), spec);
        }
    }
    // each quantized linear's input, and its Gram matrix
    let lins: Vec<(String, NodeId, usize)> = linears::find(&lowered)
        .into_iter()
        .map(|l| (format!("{}.weight", l.module), l.x, l.n_in))
        .filter(|(w, _, _)| specs.contains_key(w))
        .collect();
    let mut grams: Vec<quant::Gram> = lins.iter().map(|&(_, _, n)| quant::Gram::new(n)).collect();
    let interp = Interpreter::<f32>::new(&lowered)?;
    let mut inputs = m.bind::<f32>(&lowered, None, 0)?;
    let want: Vec<NodeId> = lins.iter().map(|&(_, x, _)| x).collect();
    let nb = data.num_batches(b, t).max(1);
    let batches = BATCHES.min(nb);
    for s in 0..batches {
        let batch = data.batch(s, b, t)?;
        inputs.insert("ids".into(), Value::Int(IntTensor { shape: vec![b, t], data: batch.ids }));
        if let Some(p) = batch.positions {
            inputs.insert("positions".into(), Value::Int(IntTensor { shape: vec![b, t], data: p }));
        }
        for (gram, x) in grams.iter_mut().zip(interp.run_nodes(&inputs, &want)?) {
            match x {
                Value::Float(x) => gram.add(&x.data),
                Value::Int(_) => return Err(CalibrateError::Invalid("a linear's input is not a float tensor".into())),
            }
        }
    }
    drop(inputs);
    let fresh = Trained::Fresh { seed: 0, scale_init: ScaleInit::Minmax };
    let mut out = Calibration { tensors: HashMap::new(), layers: Vec::new(), batches, tokens: batches * b * t, seconds: 0.0 };
    for (weight, &spec) in &specs {
        let w = m.quantized_view(weight, &fresh)?;
        let (n_in, n_out) = (w.shape[0], w.shape[1]);
        let gram = lins.iter().position(|(name, _, _)| name == weight).map(|i| &grams[i]);
        let eye;
        let measure = match gram {
            Some(g) => g,
            None => {
                eye = quant::Gram::identity(n_in);
                &eye
            }
        };
        let err = |(s, z): &(Vec<f32>, Vec<f32>)| quant::output_error(&w.data, n_in, n_out, spec, s, z, measure);
        let minmax = quant::init_learned(&w.data, n_in, n_out, spec);
        let search = quant::init_learned_searched(&w.data, n_in, n_out, spec);
        let activation = gram.map(|g| quant::init_learned_activation_from(&w.data, n_in, n_out, spec, g, search.clone()));
        let (e_mm, e_se) = (err(&minmax), err(&search));
        let e_aa = activation.as_ref().map(err);
        let chosen = match (init, e_aa) {
            (ScaleInit::Activation, Some(_)) => ScaleInit::Activation,
            (ScaleInit::Activation, None) => ScaleInit::Search,
            // the least error; on a tie the simpler start
            _ => {
                let mut best = (e_mm, ScaleInit::Minmax);
                for (e, i) in [(Some(e_se), ScaleInit::Search), (e_aa, ScaleInit::Activation)] {
                    if let Some(e) = e.filter(|&e| e < best.0) {
                        best = (e, i);
                    }
                }
                best.1
            }
        };
        let (s, z) = match chosen {
            ScaleInit::Minmax => minmax,
            ScaleInit::Search => search,
            _ => activation.ok_or_else(|| CalibrateError::Invalid(format!("{weight}: no activation-aware start")))?,
        };
        let shape = vec![n_in / spec.group_for(n_in), n_out];
        out.tensors.insert(format!("{weight}.scales"), Tensor { shape: shape.clone(), data: s });
        if spec.scheme.has_zero_point() {
            out.tensors.insert(format!("{weight}.zeros"), Tensor { shape, data: z });
        }
        out.layers.push(LayerStart { weight: weight.clone(), minmax: e_mm, search: e_se, activation: e_aa, chosen });
    }
    out.seconds = start.elapsed().as_secs_f64();
    Ok(out)
}
