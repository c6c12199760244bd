//! A run killed with SIGKILL and resumed from its last checkpoint gives the same loss curve, bit
//! for bit, and the same adapter as a run that was never interrupted (CPU, interpreter).

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::cli::{loss_bits, refused};

fn args<'a>(m: &'a str, d: &'a str, out: &'a str, log: &'a str) -> Vec<&'a str> {
    vec![
        "train",
        m,
        "--data",
        d,
        "--batch",
        "2",
        "--seq",
        "32",
        "--steps",
        "10",
        "--bits",
        "4",
        "--lora",
        "r=8,dropout=0.1",
        "--lr",
        "2e-3",
        "--warmup",
        "2",
        "--schedule",
        "cosine",
        "--shuffle",
        "--seed",
        "5",
        "--save-every",
        "2",
        "--out",
        out,
        "--log-json",
        log,
    ]
}

#[test]
fn kill_9_and_resume_equals_an_uninterrupted_run() {
    kill_and_resume(&[], &["adapter_model.safetensors", "checkpoint/state.safetensors"]);
}

#[test]
fn kill_9_and_resume_with_learned_scales_equals_an_uninterrupted_run() {
    // the scales, their Adam moments and the scale learning rate's group resume exactly too
    kill_and_resume(
        &["--scales", "learned", "--scale-lr", "1e-3"],
        &["adapter_model.safetensors", "quant_scales.safetensors", "checkpoint/state.safetensors"],
    );
}

/// Runs `args` + `extra` once uninterrupted and once killed with SIGKILL after a checkpoint and
/// resumed; the loss curves and `files` in OUT must be the same bit for bit.
fn kill_and_resume(extra: &[&str], files: &[&str]) {
    let m = common::root().join("examples/gpt2-shakespeare-small/model.safetensors");
    let d = common::root().join("examples/shakespeare_val.bin");
    let (m, d) = (m.to_str().unwrap(), d.to_str().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    let (out_a, log_a, out_b, log_b) = (p("a"), p("a.jsonl"), p("b"), p("b.jsonl"));
    let bin = env!("CARGO_BIN_EXE_qatc");

    let run = |out, log| {
        let mut a = args(m, d, out, log);
        a.extend(extra);
        a
    };
    let st = Command::new(bin).args(run(&out_a, &log_a)).output().unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));

    // the same run, killed once a checkpoint exists and a few steps are logged
    let mut child = Command::new(bin).args(run(&out_b, &log_b)).spawn().unwrap();
    let t0 = Instant::now();
    loop {
        let lines = std::fs::read_to_string(&log_b).map(|s| s.lines().count()).unwrap_or(0);
        if lines >= 5 || t0.elapsed() > Duration::from_secs(120) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let killed_at = loss_bits(Path::new(&log_b)).len();
    assert!(killed_at < 10, "the run finished before it could be killed");
    assert!(Path::new(&out_b).join("checkpoint/resume.json").exists());

    let mut resumed = run(&out_b, &log_b);
    resumed.extend(["--resume", &out_b]);
    let st = Command::new(bin).args(&resumed).output().unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));

    assert_eq!(loss_bits(Path::new(&log_a)), loss_bits(Path::new(&log_b)), "loss curves differ (killed after {killed_at} steps)");
    for f in files {
        let a = std::fs::read(Path::new(&out_a).join(f)).unwrap();
        let b = std::fs::read(Path::new(&out_b).join(f)).unwrap();
        assert!(a == b, "{f} differs");
    }
}

/// The tiny fixture's 2-step LoRA run (`common::cli::tiny_train`).
fn tiny_train(out: &Path, extra: &[&str]) -> std::process::Output {
    common::cli::tiny_train(out, &[&["--lora", "r=4"], extra].concat())
}

#[test]
fn resume_with_other_options_is_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("o");
    let first = tiny_train(&out, &[]);
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    let o = out.to_str().unwrap();
    let e = refused(&tiny_train(&out, &["--lr", "5e-3", "--resume", o]));
    assert!(e.contains("the run was started with train.lr 0.001, not 0.005"), "{e}");
    let e = refused(&tiny_train(&out, &["--device", "cpu", "--resume", o]));
    assert!(e.contains("step.device \"auto\", not \"cpu\""), "{e}");
    let e = refused(&tiny_train(&out, &["--betas", "0.9,0.95", "--resume", o]));
    assert!(e.contains("step.optim.beta2 0.999, not 0.95 (--betas)"), "{e}");
    // the same options continue (here: nothing left to do, said as such, no NaN loss)
    let again = tiny_train(&out, &["--resume", o]);
    assert!(again.status.success());
    let said = String::from_utf8_lossy(&again.stdout);
    assert!(said.contains("nothing left to train: the run had done its 2 steps") && !said.contains("NaN"), "{said}");
}

/// `--betas` reaches the step and the saved configuration, which a resume then keeps without
/// the option. Adam's first update is lr * sign(g) whatever the betas (the bias correction
/// cancels them), so the curves part at the third step's loss, after the second update.
#[test]
fn betas_are_the_steps_and_the_saved_runs() {
    let dir = tempfile::tempdir().unwrap();
    let (m, d) = (common::fixture("tiny/f32_prefix/model.safetensors"), common::fixture("tiny/tokens.bin"));
    let run = |out: &Path, extra: &[&str]| {
        let log = out.with_extension("jsonl");
        let mut args = vec!["train", m.to_str().unwrap(), "--data", d.to_str().unwrap(), "--batch", "2", "--seq", "16"];
        args.extend(["--steps", "3", "--interpreter", "--no-fuse", "--lora", "r=4", "--lr", "1e-2"]);
        args.extend(["--out", out.to_str().unwrap(), "--log-json", log.to_str().unwrap()]);
        args.extend(extra);
        let r = common::cli::qatc(&args);
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        loss_bits(&log).into_values().collect::<Vec<u64>>()
    };
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let plain = run(&a, &[]);
    let betas = run(&b, &["--betas", "0.5,0.9"]);
    assert_eq!((plain.len(), betas.len()), (3, 3));
    assert_eq!(plain[..2], betas[..2], "before the second update the betas cannot show");
    assert_ne!(plain[2], betas[2], "the betas changed no update");
    let o = qatc::config::RunConfig::read(&b).unwrap().step.unwrap().optim;
    assert_eq!((o.beta1, o.beta2), (0.5, 0.9));
    assert!(run(&b, &["--resume", b.to_str().unwrap()]).len() == 3, "resumed without --betas");
}

#[test]
fn resume_with_a_changed_bit_map_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (out, map) = (dir.path().join("o"), dir.path().join("bits.json"));
    let write_map = |bits: u8| {
        let m = format!(
            "{{\"version\": 1, \"modules\": {{\"h.0.mlp.c_fc\": {{\"bits\": {bits}, \"group\": 32, \"scheme\": \"sym\"}}, \"h.1.attn.c_attn\": null}}}}"
        );
        std::fs::write(&map, m).unwrap();
    };
    write_map(4);
    let flags = ["--bits", "3", "--group", "32", "--bits-map", map.to_str().unwrap()];
    let first = tiny_train(&out, &flags);
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    let saved = qatc::config::RunConfig::read(&out).unwrap();
    let q = saved.model.quant.unwrap();
    assert_eq!((q.bits, q.group, q.modules.len()), (3, 32, 2), "the bit map is part of the saved configuration");
    write_map(5);
    let mut again = flags.to_vec();
    again.extend(["--resume", out.to_str().unwrap()]);
    let e = refused(&tiny_train(&out, &again));
    assert!(e.contains("model.quant.modules.h.0.mlp.c_fc.bits 4, not 5"), "{e}");
}

#[derive(clap::Parser)]
struct Train {
    #[command(flatten)]
    args: qatc::cli::train::Args,
}

/// A run cut short after its first save continues from `qatc train --out DIR --resume DIR`
/// alone: the saved qatc.json gives every option (quantization with a bit map, LoRA with
/// dropout, the schedule, the shuffled order), and the result is the uninterrupted run's, bit for
/// bit.
#[test]
fn resume_from_the_saved_configuration_alone() {
    use clap::Parser;
    use qatc::artifacts::Faults;
    use qatc::cli::resume::Given;
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n);
    std::fs::write(p("bits.json"), r#"{"version": 1, "modules": {"h.0.mlp.c_fc": {"bits": 4, "group": 32, "scheme": "nf4"}}}"#).unwrap();
    let (m, d) = (common::fixture("tiny/f32_prefix/model.safetensors"), common::fixture("tiny/tokens.bin"));
    let argv = |out: &Path, log: &Path| -> Vec<String> {
        let map = p("bits.json");
        [
            "train",
            m.to_str().unwrap(),
            "--data",
            d.to_str().unwrap(),
            "--batch",
            "2",
            "--seq",
            "16",
            "--steps",
            "4",
            "--bits",
            "3",
            "--group",
            "32",
            "--bits-map",
            map.to_str().unwrap(),
            "--lora",
            "r=4,dropout=0.1",
            "--lr",
            "3e-3",
            "--warmup",
            "1",
            "--schedule",
            "cosine",
            "--shuffle",
            "--seed",
            "9",
            "--save-every",
            "2",
            "--interpreter",
            "--no-fuse",
            "--out",
            out.to_str().unwrap(),
            "--log-json",
            log.to_str().unwrap(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let run = |out: &Path, log: &Path, faults: &Faults| {
        qatc::cli::train::run_with(&Train::parse_from(argv(out, log)).args, &Given::all(), faults)
    };
    let counted = Faults::counting();
    run(&p("a"), &p("a.jsonl"), &counted).unwrap();
    // the second save replaces the first, so it takes more steps: half of them all is inside it
    let cut = Faults::fail_at(counted.taken() / 2);
    assert!(run(&p("b"), &p("b.jsonl"), &cut).is_err());
    let o = p("b");
    let saved: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(o.join("checkpoint/resume.json")).unwrap()).unwrap();
    assert_eq!(saved["step"], 2, "cut short in the second save");
    let log = p("b.jsonl");
    let args = ["train", "--out", o.to_str().unwrap(), "--resume", o.to_str().unwrap(), "--log-json", log.to_str().unwrap()];
    let r = Command::new(env!("CARGO_BIN_EXE_qatc")).args(args).output().unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(loss_bits(&p("a.jsonl")), loss_bits(&log));
    // the steps the cut run logged after its last save are taken again, and logged once
    let steps: Vec<u64> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (0..steps.len() as u64).collect::<Vec<_>>(), "each step once, in order");
    for f in ["adapter_model.safetensors", "checkpoint/state.safetensors", "qatc.json", "checkpoint/resume.json"] {
        assert!(std::fs::read(p("a").join(f)).unwrap() == std::fs::read(o.join(f)).unwrap(), "{f} differs");
    }
    // an option given must agree; a matching one is fine
    let mut again = args.to_vec();
    again.extend(["--batch", "2", "--seq", "8"]);
    let e = refused(&Command::new(env!("CARGO_BIN_EXE_qatc")).args(&again).output().unwrap());
    assert!(e.contains("step.seq 16, not 8 (--seq)"), "{e}");
}
