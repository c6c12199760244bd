//! A run killed with SIGKILL and resumed from its last checkpoint gives the same loss curve, bit
//! for bit, and the same adapter as a run that was never interrupted (CPU, interpreter).

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

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

/// Per-step losses (the last record of each step wins: a resumed run repeats the steps after its
/// checkpoint) as exact bit patterns.
fn curve(log: &Path) -> BTreeMap<u64, u64> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap().to_bits())
        })
        .collect()
}

#[test]
fn kill_9_and_resume_equals_an_uninterrupted_run() {
    let m = common::root().join("examples/gpt2-shakespeare-small/model.safetensors");
    let d = common::root().join("examples/shakespeare_val.bin");
    let (m, d) = (m.to_str().unwrap(), d.to_str().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    let (out_a, log_a, out_b, log_b) = (p("a"), p("a.jsonl"), p("b"), p("b.jsonl"));
    let bin = env!("CARGO_BIN_EXE_qatc");

    let st = Command::new(bin).args(args(m, d, &out_a, &log_a)).output().unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));

    // the same run, killed once a checkpoint exists and a few steps are logged
    let mut child = Command::new(bin).args(args(m, d, &out_b, &log_b)).spawn().unwrap();
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
    let killed_at = curve(Path::new(&log_b)).len();
    assert!(killed_at < 10, "the run finished before it could be killed");
    assert!(Path::new(&out_b).join("checkpoint/resume.json").exists());

    let mut resumed = args(m, d, &out_b, &log_b);
    resumed.extend(["--resume", &out_b]);
    let st = Command::new(bin).args(&resumed).output().unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));

    assert_eq!(curve(Path::new(&log_a)), curve(Path::new(&log_b)), "loss curves differ (killed after {killed_at} steps)");
    for f in ["adapter_model.safetensors", "checkpoint/state.safetensors"] {
        let a = std::fs::read(Path::new(&out_a).join(f)).unwrap();
        let b = std::fs::read(Path::new(&out_b).join(f)).unwrap();
        assert!(a == b, "{f} differs");
    }
}

#[test]
fn resume_with_other_options_is_refused() {
    let m = common::fixture("tiny/f32_prefix/model.safetensors");
    let d = common::fixture("tiny/tokens.bin");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("o");
    let base = [
        "train",
        m.to_str().unwrap(),
        "--data",
        d.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "2",
        "--lora",
        "r=4",
        "--out",
        out.to_str().unwrap(),
    ];
    assert!(Command::new(env!("CARGO_BIN_EXE_qatc")).args(base).output().unwrap().status.success());
    let mut other: Vec<&str> = base.to_vec();
    other.extend(["--lr", "5e-3", "--resume", out.to_str().unwrap()]);
    let r = Command::new(env!("CARGO_BIN_EXE_qatc")).args(&other).output().unwrap();
    assert_eq!(r.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&r.stderr).contains("other options"));
}
