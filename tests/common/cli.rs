//! Helpers for the tests that run the `qatc` binary: the run, a refusal's one line, a training
//! log's losses, a directory's files.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

/// `qatc ARGS`, run to completion.
pub fn qatc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_qatc")).args(args).output().unwrap()
}

/// The one error line of a refused command: exit code 2, one line, no panic.
pub fn refused(o: &Output) -> String {
    let e = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert_eq!(e.trim().lines().count(), 1, "{e}");
    assert!(!e.contains("panicked"), "{e}");
    e.trim().to_string()
}

/// Per-step losses of a `--log-json` log, as exact bit patterns. A step logged twice (a resumed
/// run repeats the steps after its checkpoint) must log the same loss: resuming is exact.
pub fn loss_bits(log: &Path) -> BTreeMap<u64, u64> {
    let mut c = BTreeMap::new();
    for l in std::fs::read_to_string(log).unwrap().lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}"));
        let (s, bits) = (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap().to_bits());
        if let Some(old) = c.insert(s, bits) {
            assert_eq!(old, bits, "step {s} logged two different losses");
        }
    }
    c
}

/// Every file of a directory tree with its bytes, by path relative to `dir`, sorted.
pub fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                v.push((p.strip_prefix(dir).unwrap().display().to_string(), std::fs::read(&p).unwrap()));
            }
        }
    }
    v.sort();
    v
}

/// `qatc train` of the tiny fixture for 2 steps of B 2, T 16 on the reference interpreter,
/// unfused, into `out`, with `extra` flags (what to train: `--lora r=4`, `--full-finetune`).
pub fn tiny_train(out: &Path, extra: &[&str]) -> Output {
    let m = super::fixture("tiny/f32_prefix/model.safetensors");
    let d = super::fixture("tiny/tokens.bin");
    let (m, d) = (m.to_str().unwrap(), d.to_str().unwrap());
    let mut args = vec!["train", m, "--data", d, "--batch", "2", "--seq", "16", "--steps", "2", "--interpreter", "--no-fuse"];
    args.extend(["--out", out.to_str().unwrap()]);
    args.extend(extra);
    qatc(&args)
}
