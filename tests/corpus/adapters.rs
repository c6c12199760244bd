//! PEFT adapters: `adapter_config.json` fields of the wrong type or range, unknown targets and
//! unsupported settings, and `adapter_model.safetensors` with foreign, misshapen or non-finite
//! tensors; read by eval, export and train alike.

use serde_json::{json, Map, Value};

use super::fixtures::{adapter_files, adapter_tensors, Base};
use crate::{s, Case};

pub fn cases(base: &Base) -> Vec<Case> {
    let model = s(&base.model());
    let tokens = s(&base.tokens());
    let m = model.as_str();
    let eval = |name: &str, files: Vec<(String, Vec<u8>)>, culprit: &[&str]| {
        Case::refused(name, &["eval", m, "--data", &tokens, "--batch", "2", "--seq", "8", "--adapter", "ad"], culprit).files(files)
    };
    let good = adapter_tensors();
    let cfg_case = |name: &str, f: fn(&mut Map<String, Value>), culprit: &[&str]| eval(name, adapter_files(f, &good), culprit);
    let mut v = vec![
        cfg_case(
            "adapter/r-string",
            |c| {
                c.insert("r".into(), json!("2"));
            },
            &["ad/adapter_config.json", "`r`", "\"2\""],
        ),
        cfg_case(
            "adapter/r-negative",
            |c| {
                c.insert("r".into(), json!(-2));
            },
            &["ad/adapter_config.json", "`r`", "-2"],
        ),
        cfg_case(
            "adapter/r-zero",
            |c| {
                c.insert("r".into(), json!(0));
            },
            &["`r`", "0"],
        ),
        cfg_case(
            "adapter/r-fraction",
            |c| {
                c.insert("r".into(), json!(2.5));
            },
            &["`r`", "2.5"],
        ),
        cfg_case(
            "adapter/r-huge",
            |c| {
                c.insert("r".into(), json!(1u64 << 40));
            },
            &["`r`"],
        ),
        cfg_case(
            "adapter/r-missing",
            |c| {
                c.remove("r");
            },
            &["ad/adapter_config.json", "missing field `r`"],
        ),
        cfg_case(
            "adapter/alpha-string",
            |c| {
                c.insert("lora_alpha".into(), json!("16"));
            },
            &["ad/adapter_config.json", "`lora_alpha`", "\"16\""],
        ),
        cfg_case(
            "adapter/alpha-negative",
            |c| {
                c.insert("lora_alpha".into(), json!(-16));
            },
            &["`lora_alpha`", "-16"],
        ),
        cfg_case(
            "adapter/alpha-zero",
            |c| {
                c.insert("lora_alpha".into(), json!(0));
            },
            &["`lora_alpha`"],
        ),
        cfg_case(
            "adapter/alpha-list",
            |c| {
                c.insert("lora_alpha".into(), json!([16]));
            },
            &["`lora_alpha`"],
        ),
        cfg_case(
            "adapter/dropout-one",
            |c| {
                c.insert("lora_dropout".into(), json!(1.0));
            },
            &["`lora_dropout`"],
        ),
        cfg_case(
            "adapter/dropout-negative",
            |c| {
                c.insert("lora_dropout".into(), json!(-0.1));
            },
            &["`lora_dropout`"],
        ),
        cfg_case(
            "adapter/rslora-string",
            |c| {
                c.insert("use_rslora".into(), json!("yes"));
            },
            &["`use_rslora`", "\"yes\""],
        ),
        cfg_case(
            "adapter/target-unknown",
            |c| {
                c.insert("target_modules".into(), json!(["q_proj"]));
            },
            &["`target_modules`", "q_proj"],
        ),
        cfg_case(
            "adapter/target-number",
            |c| {
                c.insert("target_modules".into(), json!([5]));
            },
            &["`target_modules`", "5"],
        ),
        cfg_case(
            "adapter/target-empty",
            |c| {
                c.insert("target_modules".into(), json!([]));
            },
            &["`target_modules`"],
        ),
        cfg_case(
            "adapter/target-object",
            |c| {
                c.insert("target_modules".into(), json!({"c_attn": 1}));
            },
            &["`target_modules`"],
        ),
        cfg_case(
            "adapter/peft-type",
            |c| {
                c.insert("peft_type".into(), json!("PREFIX_TUNING"));
            },
            &["peft_type", "PREFIX_TUNING"],
        ),
        cfg_case(
            "adapter/peft-type-number",
            |c| {
                c.insert("peft_type".into(), json!(3));
            },
            &["`peft_type`"],
        ),
        cfg_case(
            "adapter/bias-all",
            |c| {
                c.insert("bias".into(), json!("all"));
            },
            &["`bias`", "\"all\""],
        ),
        cfg_case(
            "adapter/rank-pattern",
            |c| {
                c.insert("rank_pattern".into(), json!({"h.0.attn.c_attn": 8}));
            },
            &["`rank_pattern`"],
        ),
        cfg_case(
            "adapter/alpha-pattern",
            |c| {
                c.insert("alpha_pattern".into(), json!({"c_attn": 4}));
            },
            &["`alpha_pattern`"],
        ),
        cfg_case(
            "adapter/layers-to-transform",
            |c| {
                c.insert("layers_to_transform".into(), json!([0]));
            },
            &["`layers_to_transform`"],
        ),
        cfg_case(
            "adapter/modules-to-save",
            |c| {
                c.insert("modules_to_save".into(), json!(["lm_head"]));
            },
            &["`modules_to_save`"],
        ),
    ];
    let raw = |name: &str, config: &[u8], culprit: &[&str]| {
        let mut files = adapter_files(|_| {}, &good);
        files[0].1 = config.to_vec();
        eval(name, files, culprit)
    };
    v.push(raw("adapter/config-not-json", b"{r: 2}", &["ad/adapter_config.json", "not JSON"]));
    v.push(raw("adapter/config-not-utf8", b"{\"r\": 2, \"x\": \"\xff\"}", &["ad/adapter_config.json", "invalid UTF-8"]));
    v.push(raw("adapter/config-nul", b"{\"r\": 2}\0", &["ad/adapter_config.json", "NUL"]));
    v.push(raw("adapter/config-array", b"[2]", &["ad/adapter_config.json", "not a JSON object"]));
    v.push(raw("adapter/config-huge-number", b"{\"r\": 2, \"lora_alpha\": 1e999}", &["ad/adapter_config.json"]));
    // the tensors
    let tensors = |name: &str, ts: Vec<(String, Vec<usize>, Vec<f32>)>, culprit: &[&str]| eval(name, adapter_files(|_| {}, &ts), culprit);
    let a0 = "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight";
    let b1 = "base_model.model.transformer.h.1.attn.c_attn.lora_B.weight";
    let poke = |key: &str, i: usize, x: f32| {
        let mut ts = good.clone();
        ts.iter_mut().find(|t| t.0 == key).unwrap().2[i] = x;
        ts
    };
    v.push(tensors("adapter/nan-in-a", poke(a0, 17, f32::NAN), &["ad/adapter_model.safetensors", a0, "index 17", "element [0, 17]"]));
    v.push(tensors("adapter/inf-in-b", poke(b1, 383, f32::INFINITY), &[b1, "index 383", "element [191, 1]"]));
    v.push(tensors("adapter/neg-inf-in-b", poke(b1, 0, f32::NEG_INFINITY), &[b1, "index 0"]));
    let mut foreign = good.clone();
    foreign.push(("base_model.model.transformer.h.0.attn.c_attn.bias".into(), vec![192], vec![0.0; 192]));
    v.push(tensors("adapter/foreign-tensor", foreign, &["ad/adapter_model.safetensors", "c_attn.bias"]));
    let mut untargeted = good.clone();
    untargeted.push(("base_model.model.transformer.h.0.mlp.c_fc.lora_A.weight".into(), vec![2, 64], vec![0.0; 128]));
    v.push(tensors("adapter/untargeted-module", untargeted, &["mlp.c_fc.lora_A.weight", "target_modules"]));
    let mut odd_key = good.clone();
    odd_key[0].0 = "model.h.0.attn.c_attn.lora_A.weight".into();
    v.push(tensors("adapter/unprefixed-key", odd_key, &["model.h.0.attn.c_attn.lora_A.weight"]));
    let mut wrong_rank = good.clone();
    wrong_rank[0] = (a0.into(), vec![4, 32], vec![0.0; 128]);
    v.push(tensors("adapter/rank-disagrees", wrong_rank, &[a0, "r = 2"]));
    let mut wrong_in = good.clone();
    wrong_in[0] = (a0.into(), vec![2, 32], vec![0.0; 64]);
    v.push(tensors("adapter/width-disagrees", wrong_in, &["h.0.attn.c_attn.lora_A.weight", "[2, 32]"]));
    let mut missing = good.clone();
    missing.remove(3);
    v.push(tensors("adapter/missing-tensor", missing, &["h.1.attn.c_attn.lora_B.weight"]));
    let mut files = adapter_files(|_| {}, &good);
    files[1].1 = b"not safetensors".to_vec();
    v.push(eval("adapter/model-not-safetensors", files, &["ad/adapter_model.safetensors", "not a safetensors file"]));
    let mut files = adapter_files(|_| {}, &good);
    files.pop();
    v.push(eval("adapter/model-missing", files, &["ad/adapter_model.safetensors", "No such file"]));
    let mut files = adapter_files(|_| {}, &good);
    files.remove(0);
    v.push(eval("adapter/config-missing", files, &["ad/adapter_config.json", "No such file"]));
    v.push(eval("adapter/dir-missing", vec![], &["ad/adapter_config.json"]));
    // the same reader under export and train --init-adapter
    let nan = adapter_files(|_| {}, &poke(a0, 1, f32::NAN));
    v.push(Case::refused("adapter/nan-under-export", &["export", m, "--adapter", "ad", "--out", "o"], &[a0, "index 1"]).files(nan.clone()));
    v.push(
        Case::refused(
            "adapter/nan-under-train",
            &[
                "train",
                m,
                "--data",
                &tokens,
                "--batch",
                "2",
                "--seq",
                "8",
                "--lora",
                "r=2,targets=c_attn",
                "--steps",
                "1",
                "--init-adapter",
                "ad",
                "--out",
                "o",
            ],
            &[a0, "index 1"],
        )
        .files(nan),
    );
    v.push(Case::refused("adapter/alpha-string-under-export", &["export", m, "--adapter", "ad", "--out", "o"], &["`lora_alpha`"]).files(
        adapter_files(
            |c| {
                c.insert("lora_alpha".into(), json!("x"));
            },
            &good,
        ),
    ));
    // control: the valid adapter is read and applied
    v.push(Case::accepted(
        "adapter/control-eval",
        &["eval", m, "--data", &tokens, "--batch", "2", "--seq", "8", "--batches", "1", "--adapter", &s(&base.adapter())],
        &[],
    ));
    v
}
