//! Training that diverges stops with what is known and the likeliest cause, before anything is
//! saved: the step, its loss (or the tensor the update made non-finite), the last finite loss,
//! the gradient norm (the step outputs it with `--clip`), the learning rate and the loss scale (fp16
//! loss scaling keeps it as state `loss_scale`), and which knob to turn. The last good save stays
//! as it was: the run stops before the next save, and a save never writes non-finite weights.

use std::collections::HashMap;
use std::path::Path;

use qatc_runtime::Value;

/// What went non-finite.
pub enum Symptom {
    /// The step's loss.
    Loss(f64),
    /// A trainable tensor or optimizer state after the update, while the loss was still finite:
    /// the tensor, the first bad index and its value.
    State(String, usize, f32),
}

/// What the run knows when a step goes non-finite.
pub struct Known<'a> {
    pub step: usize,
    pub symptom: Symptom,
    /// The last finite loss of this run, with its step.
    pub last_finite: Option<(usize, f64)>,
    pub lr: f64,
    /// The step's outputs and the trainer's state (read for `grad_norm` and `loss_scale`).
    pub outputs: &'a HashMap<String, Value<f32>>,
    pub state: &'a HashMap<String, Value<f32>>,
    /// LoRA's alpha and scaling (alpha / r, or alpha / sqrt r with rsLoRA), when training one.
    pub lora: Option<(f64, f64)>,
    pub allowed_nonfinite: bool,
    /// The last save (its step) in OUT, if any.
    pub saved: Option<usize>,
    pub out: &'a Path,
}

/// The first element of a float value, if it is one.
fn first(v: Option<&Value<f32>>) -> Option<f64> {
    v.and_then(|v| v.as_float()).and_then(|t| t.data.first()).map(|&x| x as f64)
}

/// A number as a person reads it: plain when moderate, in exponent form when huge or tiny.
fn num(x: f64) -> String {
    if x != 0.0 && x.is_finite() && !(1e-4..1e6).contains(&x.abs()) {
        format!("{x:e}")
    } else {
        format!("{x}")
    }
}

/// A LoRA scaling above this (PEFT's default alpha = 2r gives 2) is called out as a cause.
const LARGE_SCALING: f64 = 64.0;

/// The first non-finite element of the trainer's persistent state (weights, moments, step) as
/// this rank holds it, if any: (tensor, index in the whole tensor, value). Reads the state back
/// from the executor; over ranks with ZeRO each rank sees its own blocks.
pub fn nonfinite_state(tr: &crate::trainer::Trainer) -> anyhow::Result<Option<(String, usize, f32)>> {
    Ok(tr
        .held_tensors()?
        .into_iter()
        .find_map(|(name, t, at)| t.data.iter().position(|v| !v.is_finite()).map(|i| (name, at + i, t.data[i]))))
}

/// The trainer's persistent state by name as this rank holds it (for the message: `loss_scale`
/// lives there), read back once the run has already failed; empty if even that fails.
pub fn state_for_message(tr: &crate::trainer::Trainer) -> HashMap<String, Value<f32>> {
    tr.held_tensors().map(|v| v.into_iter().map(|(n, t, _)| (n, Value::Float(t))).collect()).unwrap_or_default()
}

/// The one line the run stops with.
pub fn message(k: &Known) -> String {
    let mut s = match &k.symptom {
        Symptom::Loss(l) => format!("training diverged at step {}: the loss is {l}", k.step),
        Symptom::State(tensor, index, value) => format!(
            "training diverged at step {}: the update made {tensor} hold {value} at index {index} (the loss was still finite)",
            k.step
        ),
    };
    match k.last_finite {
        Some((step, l)) => s += &format!("; last finite loss {l:.6} at step {step}"),
        None => s += "; no finite loss in this run",
    }
    let grad_norm = first(k.outputs.get("grad_norm"));
    match grad_norm {
        Some(g) => s += &format!("; gradient norm {g:.6e}"),
        None => s += "; gradient norm not tracked (--clip tracks it)",
    }
    s += &format!("; learning rate {:e}", k.lr);
    if let Some(scale) = first(k.state.get("loss_scale")) {
        s += &format!("; loss scale {}", num(scale));
    }
    let scaling = k.lora;
    let cause = if k.allowed_nonfinite && k.last_finite.is_none() {
        "a non-finite weight let in by --allow-nonfinite".to_string()
    } else if let Some((alpha, sc)) = scaling.filter(|(_, sc)| *sc > LARGE_SCALING || !sc.is_finite()) {
        format!(
            "--lora alpha={} (LoRA's scaling alpha/r = {} multiplies every adapter update; PEFT's default is alpha = 2r)",
            num(alpha),
            num(sc)
        )
    } else if k.last_finite.is_none() {
        "a weight: the first step already overflows (check the checkpoint and the adapter)".to_string()
    } else if grad_norm.is_some() {
        format!("--lr {:e} is too high for these gradients: lower it", k.lr)
    } else {
        format!("--lr {:e} is too high: lower it, or bound the update with --clip 1.0", k.lr)
    };
    s += &format!("; likeliest cause: {cause}");
    match k.saved {
        Some(step) => s += &format!("; stopped, the last save (step {step}) in {} is intact", k.out.display()),
        None => s += "; stopped before anything was saved",
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use qatc_runtime::Tensor;

    fn scalar(v: f32) -> Value<f32> {
        Value::Float(Tensor { shape: vec![], data: vec![v] })
    }

    #[test]
    fn the_message_says_what_is_known_and_the_likeliest_cause() {
        let none = HashMap::new();
        let out = Path::new("run");
        let mut k = Known {
            step: 7,
            symptom: Symptom::Loss(f64::NAN),
            last_finite: Some((6, 2.5)),
            lr: 0.5,
            outputs: &none,
            state: &none,
            lora: Some((32.0, 2.0)),
            allowed_nonfinite: false,
            saved: Some(4),
            out,
        };
        let m = message(&k);
        assert!(m.starts_with("training diverged at step 7: the loss is NaN; last finite loss 2.500000 at step 6"), "{m}");
        assert!(m.contains("gradient norm not tracked") && m.contains("likeliest cause: --lr 5e-1 is too high"), "{m}");
        assert!(m.ends_with("the last save (step 4) in run is intact"), "{m}");
        let with_norm = HashMap::from([("grad_norm".to_string(), scalar(1e9))]);
        let scale = HashMap::from([("loss_scale".to_string(), scalar(65536.0))]);
        k.outputs = &with_norm;
        k.state = &scale;
        let m = message(&k);
        assert!(m.contains("gradient norm 1.000000e9") && m.contains("loss scale 65536"), "{m}");
        k.lora = Some((1e6, 62500.0));
        assert!(message(&k).contains("likeliest cause: --lora alpha=1e6 (LoRA's scaling alpha/r = 62500 multiplies"), "{}", message(&k));
        k.lora = None;
        k.last_finite = None;
        k.saved = None;
        let m = message(&k);
        assert!(m.contains("no finite loss in this run") && m.contains("likeliest cause: a weight"), "{m}");
        assert!(m.ends_with("stopped before anything was saved"), "{m}");
        assert!(!m.contains('\n'));
    }
}
