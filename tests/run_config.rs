//! The run's configuration as data (`qatc.json`) and safe output directories, end to end on the
//! tiny fixture (reference interpreter):
//!
//! - an adapter trained with `--bits 3 --group 32 --bits-map` is evaluated and exported from
//!   its `qatc.json` alone: the same loss and the same bytes as with every flag repeated; a
//!   flag that contradicts the file is one error naming both values;
//! - `--out` never destroys input: an output directory that holds an input is refused before
//!   any work, a failed run leaves an earlier output as it was and no partial one, and an
//!   unwritable `--plot` is refused before training.

mod common;

use std::path::Path;
use std::process::Output;

use common::cli::{files, qatc, refused};

fn ok(o: Output) -> String {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The error of a command that failed after it started work (its notices come first).
fn failed(o: Output) -> String {
    let e = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{e}");
    e.trim().lines().last().unwrap_or_default().to_string()
}

fn model() -> String {
    common::fixture("tiny/f32_prefix/model.safetensors").display().to_string()
}

fn data() -> String {
    common::fixture("tiny/tokens.bin").display().to_string()
}

fn train(out: &Path, extra: &[&str]) -> Output {
    common::cli::tiny_train(out, extra)
}

#[test]
fn eval_and_export_read_the_adapters_configuration() {
    let tmp = tempfile::tempdir().unwrap();
    let (ad, map) = (tmp.path().join("ad"), tmp.path().join("bits.json"));
    std::fs::write(
        &map,
        r#"{"version": 1, "modules": {"h.0.mlp.c_fc": {"bits": 4, "group": 32, "scheme": "nf4"}, "h.1.attn.c_attn": null}}"#,
    )
    .unwrap();
    let quant = ["--bits", "3", "--group", "32", "--scheme", "sym", "--bits-map", map.to_str().unwrap()];
    let mut t = quant.to_vec();
    t.extend(["--lora", "r=4", "--lr", "1e-2"]);
    ok(train(&ad, &t));
    let saved = qatc::config::RunConfig::read(&ad).unwrap();
    assert_eq!(saved.model.quant.as_ref().map(|q| (q.bits, q.group, q.modules.len())), Some((3, 32, 2)));

    // eval: the same loss with the flags and without them
    let (m, d, a) = (model(), data(), ad.display().to_string());
    let eval = |extra: &[&str]| {
        let mut args = vec!["eval", &m, "--data", &d, "--batch", "2", "--seq", "16", "--batches", "3", "--json", "--adapter", &a];
        args.extend(extra);
        qatc(&args)
    };
    // the result without the build's timings, which differ from run to run
    let result = |o: Output| {
        let mut v: serde_json::Value = serde_json::from_str(&ok(o)).unwrap();
        v.as_object_mut().unwrap().remove("build");
        v
    };
    let with = result(eval(&quant));
    assert_eq!(result(eval(&[])), with);
    // without the bit map the model is another one: the configuration did change the result
    let plain = result(qatc(&["eval", &m, "--data", &d, "--batch", "2", "--seq", "16", "--batches", "3", "--json"]));
    assert_ne!(plain, with);
    let e = refused(&eval(&["--group", "64"]));
    assert!(e.contains("--group 64 contradicts") && e.ends_with("qatc.json, which has 32"), "{e}");
    let e = refused(&eval(&["--scheme", "asym"]));
    assert!(e.contains("--scheme asym contradicts") && e.contains("which has sym"), "{e}");

    // export: the same bytes with the flags and without them
    let export = |out: &Path, extra: &[&str]| {
        let o = out.display().to_string();
        let mut args = vec!["export", &m, "--adapter", &a, "--out", &o];
        args.extend(extra);
        qatc(&args)
    };
    let (x, y) = (tmp.path().join("x"), tmp.path().join("y"));
    let mut with_flags = quant.to_vec();
    with_flags.extend(["--qat", "base"]);
    ok(export(&x, &with_flags));
    ok(export(&y, &[]));
    let (fx, fy) = (files(&x), files(&y));
    assert_eq!(fx.iter().map(|f| &f.0).collect::<Vec<_>>(), ["config.json", "export.json", "model.safetensors", "qatc.json"]);
    assert!(fx == fy, "the exports differ");
    assert!(fx[3].1 == std::fs::read(ad.join("qatc.json")).unwrap(), "the export carries the adapter's configuration");
    let e = refused(&export(&tmp.path().join("z"), &["--bits", "4"]));
    assert!(e.contains("--bits 4 contradicts") && e.contains("which has 3"), "{e}");
    assert!(!tmp.path().join("z").exists());
}

#[test]
fn an_output_directory_that_holds_an_input_is_refused_before_any_work() {
    let tmp = tempfile::tempdir().unwrap();
    let ft = tmp.path().join("ft");
    ok(train(&ft, &["--full-finetune"]));
    let before = files(&ft);
    // a full fine-tune of the earlier export, into the directory it lives in
    let (m2, d) = (ft.join("model.safetensors").display().to_string(), data());
    let o = ft.display().to_string();
    let e = refused(&qatc(&[
        "train",
        &m2,
        "--data",
        &d,
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "1",
        "--interpreter",
        "--full-finetune",
        "--out",
        &o,
    ]));
    assert!(e.contains("is inside the output directory"), "{e}");
    // an adapter that would be its own output
    let ad = tmp.path().join("ad");
    ok(train(&ad, &["--lora", "r=4"]));
    let e = refused(&train(&ad, &["--lora", "r=4", "--init-adapter", ad.to_str().unwrap()]));
    assert!(e.contains("is inside the output directory"), "{e}");
    let e = refused(&qatc(&["export", &model(), "--adapter", ad.to_str().unwrap(), "--out", ad.to_str().unwrap()]));
    assert!(e.contains("is inside the output directory"), "{e}");
    assert!(files(&ft) == before, "the refused run changed its input");
}

#[test]
fn a_failed_run_leaves_an_earlier_output_as_it_was_and_no_partial_one() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("o");
    ok(train(&out, &["--lora", "r=4"]));
    let before = files(&out);
    // fails after compiling, before the first save: --lr so large the loss is not finite
    let e = failed(train(&out, &["--lora", "r=4", "--lr", "1e30"]));
    assert!(e.contains("the loss is"), "{e}");
    assert!(files(&out) == before, "the earlier output changed");
    let fresh = tmp.path().join("fresh");
    failed(train(&fresh, &["--lora", "r=4", "--lr", "1e30"]));
    assert!(!fresh.exists(), "a failed run left a partial output");
    let names: Vec<String> =
        std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["o"]);
}

#[test]
fn outputs_written_at_the_end_are_checked_at_the_start() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("o");
    let plot = tmp.path().join("no/such/dir/loss.svg");
    let e = refused(&train(&out, &["--lora", "r=4", "--plot", plot.to_str().unwrap()]));
    assert!(e.contains("--plot"), "{e}");
    let e = refused(&train(&out, &["--lora", "r=4", "--log-json", out.join("log.jsonl").to_str().unwrap()]));
    assert!(e.contains("is inside --out"), "{e}");
    assert!(!out.exists());
    let svg = tmp.path().to_str().unwrap();
    let e = refused(&qatc(&["plan", &model(), "--batch", "2", "--seq", "16", "--svg", svg]));
    assert!(e.contains("is a directory"), "{e}");
}

/// The GPU settings (`--tf32`, `--no-cuda-graph`, `--general-kernels`, `--no-variant`) are part of the run's
/// `qatc.json` (`step.cuda`): a resumed run runs with the saved ones, a flag that contradicts them
/// is refused, and a file from before they were saved reads as all off.
#[test]
fn the_gpu_settings_are_saved_with_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    ok(train(&out, &["--lora", "r=2"]));
    let path = out.join("qatc.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(v["step"]["cuda"], serde_json::json!({ "tf32": false, "no_graph": false, "general_kernels": false }), "{v}");
    // a file from before the settings were saved
    v["step"].as_object_mut().unwrap().remove("cuda");
    std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    let read = qatc::config::RunConfig::read(&out).unwrap();
    assert_eq!(read.step.as_ref().unwrap().cuda, qatc_driver::CudaSettings::default());
    // on --resume, the flag against the saved run
    let o = out.to_str().unwrap();
    let e = failed(qatc(&["train", "--resume", o, "--tf32", "--out", o]));
    assert!(e.contains("step.cuda.tf32 false, not true (--tf32)"), "{e}");
    // the saved settings are the run's: TF32 saved, the resumed run (on the interpreter) is refused
    v["step"]["cuda"] = serde_json::json!({ "tf32": true });
    std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    assert!(qatc::config::RunConfig::read(&out).unwrap().step.unwrap().cuda.tf32);
    let e = failed(qatc(&["train", "--resume", o, "--out", o]));
    assert!(e.contains("are for the GPU"), "{e}");
    // the variants turned off, by name
    v["step"]["cuda"] = serde_json::json!({ "no_variants": ["warp-rows", "tensor-core-attention"] });
    std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    let saved = qatc::config::RunConfig::read(&out).unwrap().step.unwrap().cuda.no_variants;
    let names: Vec<&str> = saved.iter().map(|v| v.name()).collect();
    assert_eq!(names, ["tensor-core-attention", "warp-rows"]);
    let e = failed(qatc(&["train", "--resume", o, "--no-variant", "warp-rows", "--out", o]));
    assert!(e.contains("step.cuda.no_variants") && e.contains("(--no-variant)"), "{e}");
}

/// `--no-variant` takes a variant's name; anything else is one line naming them, exit 2; on the
/// CPU it is refused as the other GPU settings are.
#[test]
fn no_variant_takes_the_names_of_the_kernel_variants() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let o = out.to_str().unwrap();
    let (m, d) = (model(), data());
    let e = refused(&qatc(&["train", &m, "--data", &d, "--no-variant", "fast", "--out", o]));
    assert!(e.contains("warp-rows") && e.contains("tensor-core-attention-backward"), "{e}");
    let e = failed(qatc(&["train", &m, "--data", &d, "--lora", "r=2", "--no-variant", "warp-rows", "--device", "cpu", "--out", o]));
    assert!(e.contains("--no-variant are for the GPU"), "{e}");
    assert!(!out.exists(), "nothing written");
}
