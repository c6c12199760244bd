//! Bit maps (`--bits-map`, what `qatc prt` writes): unknown versions, layers and modules, bad
//! schemes, widths and groups, and files that are no bit map; each error names the file and the
//! entry.

use serde_json::json;

use super::fixtures::{bit_map, Base};
use crate::{s, Case};

pub fn cases(base: &Base) -> Vec<Case> {
    let model = s(&base.model());
    let tokens = s(&base.tokens());
    let m = model.as_str();
    let eval = |name: &str, text: String, culprit: &[&str]| {
        Case::refused(name, &["eval", m, "--data", &tokens, "--batch", "2", "--seq", "8", "--bits-map", "b.json"], culprit)
            .file("b.json", text)
    };
    let one = |entry: serde_json::Value| bit_map(json!({ "h.0.attn.c_attn": entry }));
    let mut v = vec![
        eval("bitmap/version-2", json!({"version": 2, "modules": {}}).to_string(), &["b.json", "version 2"]),
        eval("bitmap/version-missing", json!({"modules": {}}).to_string(), &["b.json", "version"]),
        eval("bitmap/version-string", json!({"version": "1", "modules": {}}).to_string(), &["b.json", "version"]),
        eval("bitmap/modules-missing", json!({"version": 1}).to_string(), &["b.json", "modules"]),
        eval("bitmap/unknown-field", json!({"version": 1, "modules": {}, "extra": true}).to_string(), &["b.json", "extra"]),
        eval(
            "bitmap/layer-beyond",
            bit_map(json!({"h.9.attn.c_attn": {"bits": 4, "group": 32, "scheme": "sym"}})),
            &["b.json", "h.9.attn.c_attn"],
        ),
        eval(
            "bitmap/unknown-module",
            bit_map(json!({"h.0.attn.q_proj": {"bits": 4, "group": 32, "scheme": "sym"}})),
            &["b.json", "h.0.attn.q_proj"],
        ),
        eval("bitmap/not-a-module-name", bit_map(json!({"layer0": null})), &["b.json", "layer0"]),
        eval("bitmap/scheme-unknown", one(json!({"bits": 4, "group": 32, "scheme": "fp4"})), &["b.json", "h.0.attn.c_attn", "fp4"]),
        eval("bitmap/scheme-number", one(json!({"bits": 4, "group": 32, "scheme": 4})), &["b.json", "h.0.attn.c_attn"]),
        eval("bitmap/bits-9", one(json!({"bits": 9, "group": 32, "scheme": "sym"})), &["b.json", "h.0.attn.c_attn", "9"]),
        eval("bitmap/bits-1", one(json!({"bits": 1, "group": 32, "scheme": "sym"})), &["b.json", "h.0.attn.c_attn"]),
        eval("bitmap/bits-string", one(json!({"bits": "4", "group": 32, "scheme": "sym"})), &["b.json", "h.0.attn.c_attn"]),
        eval("bitmap/bits-300", one(json!({"bits": 300, "group": 32, "scheme": "sym"})), &["b.json", "h.0.attn.c_attn"]),
        eval("bitmap/group-not-dividing", one(json!({"bits": 4, "group": 48, "scheme": "sym"})), &["b.json", "h.0.attn.c_attn", "48"]),
        eval("bitmap/nf4-3-bits", one(json!({"bits": 3, "group": 32, "scheme": "nf4"})), &["b.json", "h.0.attn.c_attn", "nf4"]),
        eval("bitmap/q4_0-group-64", one(json!({"bits": 4, "group": 64, "scheme": "q4_0"})), &["b.json", "h.0.attn.c_attn", "q4_0"]),
        eval("bitmap/entry-missing-field", one(json!({"bits": 4, "scheme": "sym"})), &["b.json", "h.0.attn.c_attn"]),
        eval("bitmap/entry-extra-field", one(json!({"bits": 4, "group": 32, "scheme": "sym", "x": 1})), &["b.json", "h.0.attn.c_attn"]),
        eval("bitmap/entry-number", one(json!(4)), &["b.json", "h.0.attn.c_attn"]),
        eval("bitmap/not-json", "{version: 1}".into(), &["b.json"]),
        eval("bitmap/array", "[]".into(), &["b.json"]),
        eval("bitmap/empty", String::new(), &["b.json"]),
    ];
    v.push(
        Case::refused(
            "bitmap/not-utf8",
            &["eval", m, "--data", &tokens, "--batch", "2", "--seq", "8", "--bits-map", "b.json"],
            &["b.json", "UTF-8"],
        )
        .file("b.json", b"{\"version\": 1, \"modules\": {\"\xff\": null}}".to_vec()),
    );
    v.push(Case::refused(
        "bitmap/missing",
        &["eval", m, "--data", &tokens, "--batch", "2", "--seq", "8", "--bits-map", "nope.json"],
        &["nope.json", "No such file"],
    ));
    // the same reader under compile and train
    let bad = bit_map(json!({"h.7.mlp.c_fc": null}));
    v.push(
        Case::refused(
            "bitmap/layer-beyond-compile",
            &["compile", m, "--batch", "2", "--seq", "8", "--bits-map", "b.json", "-o", "o"],
            &["b.json", "h.7.mlp.c_fc"],
        )
        .file("b.json", bad.clone()),
    );
    v.push(
        Case::refused(
            "bitmap/layer-beyond-train",
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
                "r=2",
                "--steps",
                "1",
                "--bits-map",
                "b.json",
                "--out",
                "o",
            ],
            &["b.json", "h.7.mlp.c_fc"],
        )
        .file("b.json", bad),
    );
    // control: the valid map is accepted
    v.push(Case::accepted(
        "bitmap/control-eval",
        &["eval", m, "--data", &tokens, "--batch", "2", "--seq", "8", "--batches", "1", "--bits-map", &s(&base.bits())],
        &[],
    ));
    v
}
