//! Gradient accumulation as a loop (`--grad-accum K`): one micro-batch's step, run K times with
//! running sums, must give what the unrolled graph (K copies of the forward, the reference
//! `qatc_passes::microbatch::unroll`) gives, within 1e-6, while the graph does not grow with K.
//! Both run on the reference interpreter, so the difference is the order of the sums alone; each
//! step starts from the same state.

mod common;

use std::collections::HashMap;

use qatc::data::TokenFile;
use qatc::model::Model;
use qatc::step::{self, StepOptions};
use qatc_ir::{Graph, QuantScheme, QuantSpec};
use qatc_passes::lora::{LoraOptions, DROPOUT_SEED};
use qatc_passes::microbatch::{self, micro_name};
use qatc_passes::quant::QuantOptions;
use qatc_runtime::{Interpreter, Tensor, Value};

const LR: f64 = 1e-2;

fn model() -> Model {
    Model::open(&common::fixture("tiny/f32_prefix/model.safetensors")).unwrap()
}

fn qlora(o: &mut StepOptions) {
    o.model.full_finetune = false;
    o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 32, scheme: QuantScheme::Sym }));
    let mut l = LoraOptions::new(4);
    l.dropout = 0.1;
    o.model.lora = Some(l);
}

/// The weights, zero state (moments, step count, sums) and the learning rate for `g`.
fn start(m: &Model, g: &Graph) -> HashMap<String, Value<f32>> {
    let mut v = m.bind::<f32>(g, None, 7).unwrap();
    common::zero_state(g, &mut v);
    v.insert("lr".into(), Value::scalar(LR));
    v
}

fn floats(v: &Value<f32>) -> Vec<f64> {
    match v {
        Value::Float(t) => t.data.iter().map(|&x| f64::from(x)).collect(),
        Value::Int(t) => t.data.iter().map(|&x| f64::from(x)).collect(),
    }
}

/// Two optimizer steps of `o` (K = o.grad_accum) both ways; every output of the last run and
/// every update compared.
fn loop_equals_unrolled(what: &str, o: &StepOptions) {
    let m = model();
    let data = TokenFile::open(&common::fixture("tiny/tokens.bin")).unwrap();
    let (b, t, k) = (o.batch, o.seq, o.grad_accum);
    let (looped, _) = step::train(&m.cfg, o, |_, _| {}).unwrap();
    let (g, _) = step::model(&m.cfg, b, t, false, &o.model, |_, _| {}).unwrap();
    let unrolled = microbatch::unroll(g, k).unwrap();
    let (unrolled, _) = step::train_from(unrolled, &StepOptions { grad_accum: 1, ..o.clone() }, |_, _| {}).unwrap();
    let (li, ui) = (Interpreter::<f32>::new(&looped).unwrap(), Interpreter::<f32>::new(&unrolled).unwrap());
    let (mut ls, mut us) = (start(&m, &looped), start(&m, &unrolled));
    for s in 0..2 {
        let mut last = None;
        for i in 0..k {
            let (ids, tgt) = data.batch(s * k + i, b, t).unwrap();
            let seed = Value::ints([], vec![100 + (s * k + i) as i32]).unwrap();
            ls.insert("ids".into(), Value::ints([b, t], ids.clone()).unwrap());
            ls.insert("targets".into(), Value::ints([b, t], tgt.clone()).unwrap());
            ls.insert(DROPOUT_SEED.into(), seed.clone());
            ls.insert(microbatch::APPLY.into(), Value::scalar(if i + 1 == k { 1.0 } else { 0.0 }));
            us.insert(micro_name("ids", i), Value::ints([b, t], ids).unwrap());
            us.insert(micro_name("targets", i), Value::ints([b, t], tgt).unwrap());
            us.insert(micro_name(DROPOUT_SEED, i), seed);
            let r = li.run_split(&ls).unwrap();
            if i + 1 < k {
                for (name, v) in &r.updates {
                    let kept = microbatch::is_sum(name) || floats(v) == floats(&ls[name]);
                    assert!(kept, "{what}: {name} changed before the step's last micro-batch");
                }
            }
            ls.extend(r.updates.clone());
            last = Some(r);
        }
        let got = last.unwrap();
        let want = ui.run_split(&us).unwrap();
        us.extend(want.updates.clone());
        assert_eq!(got.outputs.keys().len(), want.outputs.keys().len(), "{what}: the same outputs");
        let mut worst = (0.0f64, String::new());
        for (name, w) in want.outputs.iter().chain(&want.updates) {
            let g = got.outputs.get(name).or_else(|| got.updates.get(name)).unwrap_or_else(|| panic!("{what}: no {name}"));
            // a weight after AdamW moves by ~lr where its gradient is at rounding level: norm-wise
            let e = if name.contains("weight") || name.contains("lora") || name.contains("bias") {
                common::norm_rel_err(&floats(g), &floats(w))
            } else {
                common::rel_err(&floats(g), &floats(w))
            };
            assert!(e <= 1e-6, "{what}, step {s}: {name} differs by {e:e}");
            if e > worst.0 {
                worst = (e, name.clone());
            }
        }
        for (name, v) in &got.updates {
            if microbatch::is_sum(name) {
                assert!(floats(v).iter().all(|&x| x == 0.0), "{what}: {name} is zeroed by the step's last micro-batch");
            }
        }
        eprintln!(
            "{what}, step {s}: worst {:.2e} ({}); loss {:?} vs {:?}",
            worst.0,
            worst.1,
            floats(&got.outputs["loss"]),
            floats(&want.outputs["loss"])
        );
        // the next step starts from one state: AdamW turns rounding-level differences of a
        // gradient that is zero in exact arithmetic (the keys' third of c_attn.bias) into steps
        // of up to lr, which the next step's gradients would carry
        for (name, v) in &want.updates {
            ls.insert(name.clone(), v.clone());
        }
    }
}

#[test]
fn clipped_qlora_with_dropout_over_three_micro_batches() {
    let mut o = StepOptions::new(2, 16);
    qlora(&mut o);
    o.clip = Some(0.5);
    o.keep_grads = true;
    o.grad_accum = 3;
    loop_equals_unrolled("4-bit + LoRA, clipped, K 3", &o);
}

#[test]
fn full_finetune_with_weight_decay_over_two_micro_batches() {
    let mut o = StepOptions::new(2, 16);
    o.adamw.weight_decay = 0.1;
    o.keep_grads = true;
    o.grad_accum = 2;
    loop_equals_unrolled("full fine-tune, K 2", &o);
}

/// The graph, and so compiling and planning it, is the same size whatever K is: at K = 1000 the
/// unrolled form had 466,233 nodes on the demo model.
#[test]
fn the_step_does_not_grow_with_k() {
    let m = model();
    let size = |k: usize| {
        let mut o = StepOptions::new(1, 8);
        qlora(&mut o);
        o.grad_accum = k;
        let (g, _) = step::train(&m.cfg, &o, |_, _| {}).unwrap();
        (g.len(), g.inputs().len())
    };
    assert_eq!(size(2), size(1000));
}

/// fp16 with loss scaling: the scale moves once per optimizer step, and a micro-batch whose
/// gradients are not finite makes the whole step non-finite: it is skipped (every weight kept),
/// the sums are zeroed all the same and the scale backs off once, as GradScaler does with
/// accumulation. The poisoned micro-batch is simulated by an infinite sum before the last run.
#[test]
fn fp16_skips_a_step_with_a_non_finite_micro_batch() {
    use qatc_passes::precision::{Precision, LOSS_SCALE};
    let m = model();
    let data = TokenFile::open(&common::fixture("tiny/tokens.bin")).unwrap();
    let mut o = StepOptions::new(2, 16);
    qlora(&mut o);
    o.precision = Precision::Fp16;
    o.grad_accum = 2;
    let (g, _) = step::train(&m.cfg, &o, |_, _| {}).unwrap();
    let interp = Interpreter::<f32>::new(&g).unwrap();
    let mut v = start(&m, &g);
    v.insert(LOSS_SCALE.into(), Value::Float(Tensor { shape: vec![2], data: o.loss_scaling.initial_state().to_vec() }));
    let scale0 = floats(&v[LOSS_SCALE])[0];
    for (s, poison) in [(0, false), (1, true)] {
        let before = v.clone();
        for i in 0..2 {
            let (ids, tgt) = data.batch(s * 2 + i, 2, 16).unwrap();
            v.insert("ids".into(), Value::ints([2, 16], ids).unwrap());
            v.insert("targets".into(), Value::ints([2, 16], tgt).unwrap());
            v.insert(DROPOUT_SEED.into(), Value::ints([], vec![5]).unwrap());
            v.insert(microbatch::APPLY.into(), Value::scalar(i as f64));
            if poison && i == 1 {
                let name = g.inputs().into_iter().filter_map(|id| g.node(id).name.clone()).find(|n| n.starts_with("accum.grad:")).unwrap();
                let Value::Float(t) = v.get_mut(&name).unwrap() else { panic!() };
                t.data[0] = f32::INFINITY;
            }
            let r = interp.run_split(&v).unwrap();
            v.extend(r.updates);
            if i == 0 {
                assert_eq!(
                    floats(&v[LOSS_SCALE]),
                    floats(&before[LOSS_SCALE]),
                    "the scale and its count wait for the step's last micro-batch"
                );
            }
        }
        // the parameter itself (a HashMap's first match was at times its accumulation sum, which
        // is zero before and after every step)
        let lora_b = v.keys().filter(|n| n.starts_with("h.") && n.ends_with("lora_B.weight")).min().unwrap().clone();
        let moved = floats(&v[&lora_b]) != floats(&before[&lora_b]);
        assert_eq!(moved, !poison, "step {s}: the weights move unless a micro-batch was not finite");
        for (name, x) in &v {
            if microbatch::is_sum(name) {
                assert!(floats(x).iter().all(|&e| e == 0.0), "step {s}: {name} zeroed");
            }
        }
        let want = if poison { scale0 * 0.5 } else { scale0 };
        assert_eq!(floats(&v[LOSS_SCALE])[0], want, "step {s}: the scale");
    }
}
