//! `qatc train` end to end on the embedded Shakespeare GPT-2: the loss falls, the log is one JSON
//! object per step, and a LoRA run writes an adapter that reads back.

mod common;

use std::process::Command;

fn run(args: &[&str]) -> String {
    run_both(args).0
}

/// (stdout, stderr) of a successful run.
fn run_both(args: &[&str]) -> (String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_qatc")).args(args).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn losses(log: &std::path::Path) -> Vec<f64> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            for k in ["step", "loss", "lr", "tokens_per_s"] {
                assert!(v.get(k).is_some(), "log line lacks {k}: {l}");
            }
            v["loss"].as_f64().unwrap()
        })
        .collect()
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

#[test]
fn full_finetune_for_20_steps_lowers_the_loss() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log.jsonl");
    let out = dir.path().join("ft");
    let m = common::root().join("examples/gpt2-shakespeare-small/model.safetensors");
    let d = common::root().join("examples/shakespeare_train.bin");
    run(&[
        "train",
        m.to_str().unwrap(),
        "--data",
        d.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "64",
        "--steps",
        "20",
        "--lr",
        "1e-3",
        "--full-finetune",
        "--out",
        out.to_str().unwrap(),
        "--log-json",
        log.to_str().unwrap(),
    ]);
    let l = losses(&log);
    assert_eq!(l.len(), 20);
    assert!(mean(&l[15..]) < mean(&l[..5]) - 0.05, "the loss does not fall: {l:?}");
    assert!(out.join("model.safetensors").exists() && out.join("config.json").exists());
    // the fine-tuned weights are a loadable checkpoint again
    qatc::model::Model::open(&out.join("model.safetensors")).unwrap();
}

/// Also: validation during training reads the trained weights back from the executor (the last
/// validation loss is `qatc eval`'s of the adapter written at the end), and `--profile` prints
/// where a step's time goes.
#[test]
fn qat_lora_training_writes_an_adapter() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log.jsonl");
    let out = dir.path().join("adapter");
    let m = common::root().join("examples/gpt2-shakespeare-small/model.safetensors");
    let d = common::root().join("examples/shakespeare_train.bin");
    let v = common::root().join("examples/shakespeare_val.bin");
    let (_, stderr) = run_both(&[
        "train",
        m.to_str().unwrap(),
        "--data",
        d.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "64",
        "--steps",
        "12",
        "--lr",
        "3e-3",
        "--bits",
        "4",
        "--lora",
        "r=16",
        "--out",
        out.to_str().unwrap(),
        "--log-json",
        log.to_str().unwrap(),
        "--val",
        v.to_str().unwrap(),
        "--eval-every",
        "6",
        "--val-batches",
        "1",
        "--profile",
    ]);
    let l = losses(&log);
    assert!(mean(&l[8..]) < mean(&l[..4]), "the loss does not fall: {l:?}");
    assert!(stderr.contains("one step, ") && stderr.contains("gemm ") && stderr.contains("cross_entropy"), "{stderr}");
    // the step's time by phase: the blocks' forward, and the backward (with the head's fused loss)
    assert!(stderr.contains("by phase: forward ") && stderr.contains(", backward "), "{stderr}");
    let val: Vec<(u64, f64)> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let j: serde_json::Value = serde_json::from_str(l).unwrap();
            Some((j["step"].as_u64()?, j.get("val_loss")?.as_f64()?))
        })
        .collect();
    assert_eq!(val.iter().map(|v| v.0).collect::<Vec<_>>(), [5, 11], "validated after steps 6 and 12");
    assert!(val[0].1 != val[1].1, "{val:?}");
    let (e, eval_err) = run_both(&[
        "eval",
        m.to_str().unwrap(),
        "--data",
        v.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "64",
        "--batches",
        "1",
        "--bits",
        "4",
        "--adapter",
        out.to_str().unwrap(),
        "--json",
    ]);
    assert!(eval_err.contains("eval runs compiled"), "{eval_err}");
    let adapter_loss = serde_json::from_str::<serde_json::Value>(&e).unwrap()["loss"].as_f64().unwrap();
    assert!((adapter_loss - val[1].1).abs() <= 1e-6 * adapter_loss, "validation {} against the adapter's eval {adapter_loss}", val[1].1);
    // where an evaluation's batch goes (the first batch is not timed): a forward alone
    let (_, prof) = run_both(&[
        "eval",
        m.to_str().unwrap(),
        "--data",
        v.to_str().unwrap(),
        "--batch",
        "1",
        "--seq",
        "64",
        "--batches",
        "2",
        "--adapter",
        out.to_str().unwrap(),
        "--profile",
    ]);
    assert!(prof.contains("one batch, ") && prof.contains("by phase: forward ") && prof.contains("attention.flash"), "{prof}");
    assert!(!prof.contains("backward"), "{prof}");
    let a = qatc::adapter::read(&out).unwrap();
    assert_eq!(a.r, 16);
    assert_eq!(a.tensors.len(), 4 * 4 * 2, "A and B for 4 linears x 4 layers");
    assert!(a.tensors.iter().filter(|(k, _)| k.ends_with("lora_B.weight")).all(|(_, t)| t.data.iter().any(|&v| v != 0.0)));
}

/// Gradient accumulation with LoRA dropout: every micro-batch has its own dropout seed input
/// (a regression: the trainer used to supply only `dropout.seed`). Compiled and interpreted
/// runs agree on the loss.
#[test]
fn accumulated_steps_with_lora_dropout_run_compiled_and_interpreted() {
    let dir = tempfile::tempdir().unwrap();
    let m = common::root().join("examples/gpt2-shakespeare-small/model.safetensors");
    let d = common::root().join("examples/shakespeare_train.bin");
    let mut curves = Vec::new();
    for engine in [None, Some("--interpreter")] {
        let log = dir.path().join(format!("log{}.jsonl", curves.len()));
        let out = dir.path().join(format!("ad{}", curves.len()));
        let mut args = vec![
            "train",
            m.to_str().unwrap(),
            "--data",
            d.to_str().unwrap(),
            "--batch",
            "2",
            "--seq",
            "32",
            "--steps",
            "2",
            "--grad-accum",
            "2",
            "--lora",
            "r=4,dropout=0.1",
            "--bits",
            "4",
            "--group",
            "32",
            "--out",
            out.to_str().unwrap(),
            "--log-json",
            log.to_str().unwrap(),
        ];
        args.extend(engine);
        run(&args);
        curves.push(losses(&log));
    }
    assert_eq!(curves[0].len(), 2);
    for (a, b) in curves[0].iter().zip(&curves[1]) {
        assert!((a - b).abs() < 1e-4 * b.abs(), "compiled {a} vs interpreter {b}");
    }
}

#[test]
fn learned_scales_train_save_and_evaluate_from_either_start() {
    // 2-bit learned scales on the tiny fixture: from min-max scales and from searched ones; the
    // scales are saved beside the adapter, move while training, and `qatc eval` reads them back
    // to the loss the run's own validation saw
    let m = common::fixture("tiny/f32_prefix/model.safetensors");
    let d = common::fixture("tiny/tokens.bin");
    let (m, d) = (m.to_str().unwrap(), d.to_str().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let q = ["--bits", "2", "--group", "16", "--scales", "learned"];
    let mut starts = Vec::new();
    for init in ["minmax", "search"] {
        let out = dir.path().join(init);
        let log = dir.path().join(format!("{init}.jsonl"));
        let mut a = vec!["train", m, "--data", d, "--batch", "2", "--seq", "16", "--steps", "4", "--lora", "r=4", "--lr", "1e-2"];
        a.extend(q);
        a.extend(["--scale-lr", "1e-3", "--scale-init", init, "--val", d, "--val-batches", "2"]);
        a.extend(["--out", out.to_str().unwrap(), "--log-json", log.to_str().unwrap()]);
        run(&a);
        let ad = qatc::adapter::read(&out).unwrap();
        assert_eq!(ad.quant.len(), 8, "{init}: one scale tensor per linear in quant_scales.safetensors");
        assert_eq!(ad.tensors.len(), 16, "{init}: the PEFT file holds LoRA's tensors only");
        let val = std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["val_loss"].as_f64());
        // the run's configuration records the learned scales and how they trained, so eval needs
        // no quantization flag
        let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("qatc.json")).unwrap()).unwrap();
        assert_eq!(cfg["model"]["quant"]["scales"], "learned", "{init}");
        assert_eq!((cfg["train"]["scale_lr"].as_f64(), cfg["train"]["scale_init"].as_str()), (Some(1e-3), Some(init)));
        let e = ["eval", m, "--data", d, "--batch", "2", "--seq", "16", "--batches", "2", "--json", "--adapter", out.to_str().unwrap()];
        let ev: serde_json::Value = serde_json::from_str(&run(&e)).unwrap();
        let got = ev["loss"].as_f64().unwrap();
        assert!((got - val.unwrap()).abs() < 1e-5, "{init}: eval {got} vs the run's validation {val:?}");
        let s = &ad.quant["h.0.mlp.c_fc.weight.scales"].data;
        starts.push(s.iter().map(|v| v.abs() as f64).sum::<f64>() / s.len() as f64);
    }
    // searched 2-bit scales start (and after 4 steps still are) well below the min-max ones
    assert!(starts[1] < 0.9 * starts[0], "mean |scale|: min-max start {} vs searched start {}", starts[0], starts[1]);
}

#[test]
fn eval_measures_post_training_quantization_at_the_starting_scales() {
    // `eval --scales learned --scale-init X` without an adapter: the model at the scales a run
    // would start from; min-max is the post-training grid (up to the fp16 rounding of the
    // scales), the searched start another, closer grid
    let m = common::fixture("tiny/f32_prefix/model.safetensors");
    let d = common::fixture("tiny/tokens.bin");
    let (m, d) = (m.to_str().unwrap(), d.to_str().unwrap());
    let loss = |extra: &[&str]| -> f64 {
        let mut e = vec!["eval", m, "--data", d, "--batch", "2", "--seq", "16", "--batches", "2", "--json", "--bits", "2", "--group", "16"];
        e.extend(extra);
        serde_json::from_str::<serde_json::Value>(&run(&e)).unwrap()["loss"].as_f64().unwrap()
    };
    let ptq = loss(&[]);
    let minmax = loss(&["--scales", "learned", "--scale-init", "minmax"]);
    let search = loss(&["--scales", "learned", "--scale-init", "search"]);
    assert!((minmax - ptq).abs() < 1e-2 * ptq.abs(), "min-max start {minmax} vs post-training {ptq}");
    assert!((search - minmax).abs() > 1e-4, "the searched start {search} is the min-max grid {minmax}");
    // without learned scales there is nothing to start
    let out = Command::new(env!("CARGO_BIN_EXE_qatc"))
        .args([
            "eval",
            m,
            "--data",
            d,
            "--batch",
            "2",
            "--seq",
            "16",
            "--batches",
            "1",
            "--bits",
            "2",
            "--group",
            "16",
            "--scale-init",
            "search",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--scale-init needs --scales learned"), "{err}");
}

/// `--precision auto` says what it chose and why: bf16 exactly where this CPU's bf16 GEMMs run on
/// AMX tiles (oneDNN's matmul primitive loads), fp32 elsewhere and on the interpreter (the build
/// line names the attention on the tiles where it runs there); the run's
/// saved configuration holds the choice. On the GPU it is refused, exit code 2.
#[test]
fn precision_auto_chooses_bf16_where_amx_runs_the_gemms() {
    let dir = tempfile::tempdir().unwrap();
    let m = common::root().join("examples/gpt2-shakespeare-small/model.safetensors");
    let d = common::root().join("examples/shakespeare_train.bin");
    let amx = qatc_runtime::cpu::onednn::bf16_runs_on_amx(qatc_runtime::cpu::onednn::ONEDNN);
    // the same answer from the machine itself: AMX-BF16 in /proc/cpuinfo and oneDNN installed
    let cpu_has = std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|c| c.split_whitespace().any(|f| f == "amx_bf16"));
    let installed = std::path::Path::new("/usr/lib/x86_64-linux-gnu/libdnnl.so.2").exists();
    assert_eq!(amx, cpu_has && installed, "AMX-BF16 in /proc/cpuinfo: {cpu_has}, oneDNN installed: {installed}");
    for (interpreter, want) in [(false, if amx { "bf16" } else { "fp32" }), (true, "fp32")] {
        let out = dir.path().join(format!("auto-{interpreter}"));
        let mut args = vec!["train", m.to_str().unwrap(), "--data", d.to_str().unwrap(), "--batch", "2", "--seq", "32", "--steps", "2"];
        args.extend(["--lora", "r=4", "--precision", "auto", "--device", "cpu", "--out", out.to_str().unwrap()]);
        if interpreter {
            args.push("--interpreter");
        }
        let (_, err) = run_both(&args);
        let line = err.lines().find(|l| l.starts_with("qatc: --precision auto: ")).unwrap_or_else(|| panic!("no choice said:\n{err}"));
        assert!(line.starts_with(&format!("qatc: --precision auto: {want} (")), "{line} (AMX: {amx}, interpreter: {interpreter})");
        if !interpreter {
            // the build line names the attention on AMX tiles where it runs there
            let built = err.lines().find(|l| l.starts_with("qatc: the step runs compiled for this CPU")).unwrap_or_else(|| panic!("{err}"));
            assert_eq!(built.contains("the attention's too"), amx, "{built}");
        }
        let saved: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("qatc.json")).unwrap()).unwrap();
        assert_eq!(saved["step"]["precision"]["mode"], want, "the saved configuration");
    }
    let gpu_out = dir.path().join("auto-cuda");
    let out = Command::new(env!("CARGO_BIN_EXE_qatc"))
        .args(["train", m.to_str().unwrap(), "--data", d.to_str().unwrap(), "--steps", "1", "--precision", "auto", "--device", "cuda"])
        .args(["--lora", "r=4", "--out", gpu_out.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--precision auto chooses for the CPU"), "{err}");
    assert!(!gpu_out.exists(), "nothing written for a refused run");
}
