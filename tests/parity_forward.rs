//! Forward parity with Hugging Face transformers: logits within 1e-4 max-abs and the mean loss
//! within 1e-5 of `GPT2LMHeadModel` in float32, for F32, F16 and BF16 checkpoints with and
//! without the `transformer.` prefix (fixtures from tests/fixtures/gen_fixtures.py).

mod common;

use std::collections::HashMap;

use qatc::model::Model;
use qatc::step;
use qatc_runtime::{IntTensor, Interpreter, Value};

fn check(variant: &str) {
    let model = Model::open(&common::fixture(&format!("tiny/{variant}/model.safetensors"))).unwrap();
    let exp = common::read_safetensors(&format!("tiny/{variant}/expected.safetensors"));
    let (b, t) = (exp["ids"].shape[0], exp["ids"].shape[1]);
    let g = step::forward(&model.cfg, b, t, true).unwrap();
    let mut inputs: HashMap<String, Value<f32>> = model.bind(&g, None, 0).unwrap();
    inputs.insert("ids".into(), Value::Int(IntTensor { shape: vec![b, t], data: exp["ids"].ints.clone() }));
    inputs.insert("targets".into(), Value::Int(IntTensor { shape: vec![b, t], data: exp["targets"].ints.clone() }));
    let out = Interpreter::<f32>::new(&g).unwrap().run(&inputs).unwrap();
    let logits: Vec<f64> = out["logits"].as_float().unwrap().data.iter().map(|&v| v as f64).collect();
    let loss = out["loss"].as_float().unwrap().data[0] as f64;
    let dl = common::max_abs(&logits, &exp["logits"].data);
    let dloss = (loss - exp["loss"].data[0]).abs();
    assert!(dl <= 1e-4, "{variant}: logits differ from transformers by {dl:e} (max-abs; limit 1e-4)");
    assert!(dloss <= 1e-5, "{variant}: loss {loss} vs transformers {} (|diff| {dloss:e}; limit 1e-5)", exp["loss"].data[0]);
}

#[test]
fn f32_with_prefix_and_buffers() {
    check("f32_prefix");
}

#[test]
fn f32_without_prefix() {
    check("f32_noprefix");
}

#[test]
fn f16_without_prefix() {
    check("f16_noprefix");
}

#[test]
fn bf16_with_prefix_and_explicit_lm_head() {
    check("bf16_prefix");
}

#[test]
fn prefix_detection_and_buffer_skipping() {
    let with = Model::open(&common::fixture("tiny/f32_prefix/model.safetensors")).unwrap();
    let without = Model::open(&common::fixture("tiny/f32_noprefix/model.safetensors")).unwrap();
    assert!(with.ckpt.has_prefix());
    assert!(!without.ckpt.has_prefix());
    assert_eq!(with.ckpt.names(), without.ckpt.names(), "attn.bias / masked_bias buffers must be skipped");
    assert!(with.ckpt.names().contains(&"h.0.attn.c_attn.bias"), "c_attn.bias is a weight, not a buffer");
}
