//! The CPU backend's kernel cache across processes (issue 30, 6): a second `qatc train` reads
//! every kernel's object code from `--kernel-cache DIR` and compiles none, and trains to the same
//! losses, bit for bit, as a run that compiled them; damaged entries are compiled again and
//! rewritten; `--no-kernel-cache` keeps nothing. (Within one process: `kernels/tests/jit_cache.rs`;
//! the key's inputs: `kernels/src/llvm/objcache.rs`.)
#![cfg(feature = "llvm")]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::cli::{loss_bits, qatc};

/// `qatc train` of the tiny fixture, compiled for the CPU, 2 steps, with `cache` flags; its
/// per-step losses (bits) and its log's `build` (the first line's).
fn train(dir: &Path, name: &str, cache: &[&str]) -> (BTreeMap<u64, u64>, serde_json::Value) {
    let m = common::fixture("tiny/f32_prefix/model.safetensors");
    let d = common::fixture("tiny/tokens.bin");
    let (out, log) = (dir.join(name), dir.join(format!("{name}.jsonl")));
    let mut args = vec!["train", m.to_str().unwrap(), "--data", d.to_str().unwrap(), "--batch", "2", "--seq", "16", "--steps", "2"];
    args.extend(["--device", "cpu", "--lora", "r=4", "--bits", "4"]);
    args.extend(["--out", out.to_str().unwrap(), "--log-json", log.to_str().unwrap()]);
    args.extend(cache);
    let o = qatc(&args);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(stderr.lines().any(|l| l.starts_with("qatc: built the step in ")), "{stderr}");
    let first =
        std::fs::read_to_string(&log).unwrap().lines().next().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()).unwrap();
    (loss_bits(&log), first["build"].clone())
}

/// (kernels, from the cache, compiled) of a log's `build`.
fn counts(build: &serde_json::Value) -> (u64, u64, u64) {
    let k = &build["kernels"];
    (k["kernels"].as_u64().unwrap(), k["cached"].as_u64().unwrap(), k["compiled"].as_u64().unwrap())
}

fn entries(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn a_second_train_compiles_nothing_and_trains_the_same() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let flag = ["--kernel-cache", cache.to_str().unwrap()];

    let (uncached, b) = train(tmp.path(), "none", &["--no-kernel-cache"]);
    let (n, cached, compiled) = counts(&b);
    assert!(n > 0 && cached == 0 && compiled == n, "{b}");
    assert!(!cache.exists(), "--no-kernel-cache wrote {}", cache.display());

    let (first, b) = train(tmp.path(), "first", &flag);
    assert_eq!(counts(&b), (n, 0, n), "{b}");
    let kept = entries(&cache.join("cpu"));
    assert_eq!(kept.len() as u64, n, "one entry per kernel: {kept:?}");

    let (second, b) = train(tmp.path(), "second", &flag);
    assert_eq!(counts(&b), (n, n, 0), "every kernel from the cache: {b}");
    assert_eq!(second, uncached, "kernels read from the cache train to the same losses as compiled ones");
    assert_eq!(first, uncached);

    // damaged entries (truncated, or one byte flipped) are misses: compiled again and rewritten
    for (i, p) in kept.iter().enumerate() {
        let mut bytes = std::fs::read(p).unwrap();
        if i % 2 == 0 {
            bytes.truncate(bytes.len() / 2);
        } else {
            let last = bytes.len() - 1;
            bytes[last] ^= 0x40;
        }
        std::fs::write(p, bytes).unwrap();
    }
    let (damaged, b) = train(tmp.path(), "damaged", &flag);
    assert_eq!(counts(&b), (n, 0, n), "{b}");
    assert_eq!(damaged, uncached);
    let (healed, b) = train(tmp.path(), "healed", &flag);
    assert_eq!(counts(&b), (n, n, 0), "the damaged entries were rewritten: {b}");
    assert_eq!(healed, uncached);
}

#[test]
fn eval_reports_its_build_in_json() {
    let tmp = tempfile::tempdir().unwrap();
    let m = common::fixture("tiny/f32_prefix/model.safetensors");
    let d = common::fixture("tiny/tokens.bin");
    let cache = tmp.path().join("cache");
    let args = [
        "eval",
        m.to_str().unwrap(),
        "--data",
        d.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "16",
        "--batches",
        "1",
        "--device",
        "cpu",
        "--json",
        "--kernel-cache",
        cache.to_str().unwrap(),
    ];
    let run = || {
        let o = qatc(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        (v["loss"].as_f64().unwrap().to_bits(), counts(&v["build"]), v["build"]["seconds"].as_f64().unwrap())
    };
    let (loss, (n, cached, compiled), seconds) = run();
    assert!(n > 0 && (cached, compiled) == (0, n) && seconds > 0.0);
    let (again, counted, _) = run();
    assert_eq!((again, counted), (loss, (n, n, 0)));
}
