//! `qatc train --keep-best --patience N`: OUT/best/ holds the weights of the lowest validation
//! loss, the very weights a run stopped at that step saves; the run stops N validations after
//! its best; a save cut short resumes with its best weights and its patience count, and a run
//! that stopped stays stopped (the tiny fixture on the interpreter, learning rate 2e-2: its
//! validation loss falls to step 18 with one bump on the way, then rises).

mod common;

use std::path::Path;

use clap::Parser;
use qatc::artifacts::Faults;
use qatc::cli::resume::Given;
use qatc::cli::train::{run_with, Args};

use common::cli::{files, loss_bits, refused, tiny_train};

#[derive(Parser)]
struct Train {
    #[command(flatten)]
    args: Args,
}

/// The run: 60 steps at most, validated every 2 steps on 2 batches; `extra` adds options.
fn train_args(out: &Path, steps: usize, extra: &[&str]) -> Vec<String> {
    let m = common::fixture("tiny/f32_prefix/model.safetensors");
    let d = common::fixture("tiny/tokens.bin");
    let (m, d) = (m.to_str().unwrap(), d.to_str().unwrap());
    let steps = steps.to_string();
    let mut v: Vec<String> = [
        "train",
        m,
        "--data",
        d,
        "--val",
        d,
        "--val-batches",
        "2",
        "--eval-every",
        "2",
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        &steps,
        "--bits",
        "4",
        "--group",
        "32",
        "--lora",
        "r=4",
        "--lr",
        "2e-2",
        "--shuffle",
        "--seed",
        "3",
        "--interpreter",
        "--no-fuse",
        "--out",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.push(out.display().to_string());
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn train(out: &Path, steps: usize, extra: &[&str], faults: &Faults) -> anyhow::Result<()> {
    run_with(&Train::parse_from(train_args(out, steps, extra)).args, &Given::all(), faults)
}

fn json(p: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
}

/// (steps done, validation loss) of every validation a log holds.
fn validations(log: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|v| Some((v["step"].as_u64()? + 1, v["val_loss"].as_f64()?)))
        .collect()
}

const KEEP: [&str; 4] = ["--keep-best", "--patience", "2", "--log-json"];

#[test]
fn early_stopping_keeps_the_weights_a_run_stopped_at_its_best_saves() {
    let dir = tempfile::tempdir().unwrap();
    let (a, log) = (dir.path().join("a"), dir.path().join("a.jsonl"));
    let mut extra = KEEP.to_vec();
    extra.push(log.to_str().unwrap());
    train(&a, 60, &extra, Faults::none()).unwrap();

    let best = json(&a.join("best/best.json"));
    let (step, loss) = (best["step"].as_u64().unwrap(), best["val_loss"].as_f64().unwrap());
    let vals = validations(&log);
    // the best is the lowest validation, and it was not the first: the run improved, then stopped
    let lowest = vals.iter().cloned().fold((0, f64::INFINITY), |b, v| if v.1 < b.1 { v } else { b });
    assert_eq!((step, loss.to_bits()), (lowest.0, lowest.1.to_bits()), "{vals:?}");
    assert!(step > 2, "the first validation was the best: the fixture no longer shows a stop after an improvement ({vals:?})");
    // stopped two validations after it, both no better, and said so in the resume state
    let done = json(&a.join("checkpoint/resume.json"));
    assert_eq!(done["step"].as_u64(), Some(step + 4), "{vals:?}");
    assert_eq!(done["best"], best);
    assert_eq!(vals.last().unwrap().0, step + 4);
    assert!(vals.iter().filter(|v| v.0 > step).all(|v| v.1 >= loss));

    // a run of exactly `step` steps, without --keep-best, ends with those weights, bit for bit
    let b = dir.path().join("b");
    train(&b, step as usize, &[], Faults::none()).unwrap();
    for f in ["adapter_model.safetensors", "adapter_config.json"] {
        assert!(std::fs::read(a.join("best").join(f)).unwrap() == std::fs::read(b.join(f)).unwrap(), "best/{f} differs");
    }
    // and OUT itself holds the last step's weights, which differ
    assert!(std::fs::read(a.join("adapter_model.safetensors")).unwrap() != std::fs::read(b.join("adapter_model.safetensors")).unwrap());
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn a_cut_save_resumes_with_its_best_weights_and_stops_where_an_uninterrupted_run_does() {
    let dir = tempfile::tempdir().unwrap();
    let (a, log_a, b, log_b) = (dir.path().join("a"), dir.path().join("a.jsonl"), dir.path().join("b"), dir.path().join("b.jsonl"));
    let with = |log: &Path| {
        let mut v: Vec<String> = KEEP.iter().map(|s| s.to_string()).collect();
        v.extend([log.display().to_string(), "--save-every".into(), "1".into()]);
        v
    };
    let (extra_a, extra_b) = (with(&log_a), with(&log_b));
    let counting = Faults::counting();
    train(&a, 60, &strs(&extra_a), &counting).unwrap();
    let expected = files(&a);

    // cut at a filesystem step two thirds in: after the best was found, before the stop
    let cut = Faults::fail_at(counting.taken() * 2 / 3);
    assert!(train(&b, 60, &strs(&extra_b), &cut).is_err());
    let saved = json(&b.join("checkpoint/resume.json"));
    assert!(saved["best"].is_object(), "the cut fell before a best was kept: {saved}");
    let mut resumed = strs(&extra_b);
    let out = b.display().to_string();
    resumed.extend(["--resume", &out]);
    train(&b, 60, &resumed, Faults::none()).unwrap();
    assert_eq!(files(&b), expected, "the resumed run's OUT (best/ and checkpoint/ included) differs");
    assert_eq!(loss_bits(&log_b), loss_bits(&log_a));

    // resumed again, a run that stopped takes no step
    let lines = std::fs::read_to_string(&log_b).unwrap();
    train(&b, 60, &resumed, Faults::none()).unwrap();
    assert_eq!(std::fs::read_to_string(&log_b).unwrap(), lines);
    assert_eq!(files(&b), expected);
}

#[test]
fn keep_best_and_patience_are_refused_without_what_they_need() {
    let dir = tempfile::tempdir().unwrap();
    let e = refused(&tiny_train(&dir.path().join("o"), &["--keep-best"]));
    assert!(e.contains("--keep-best needs --val FILE and --eval-every N"), "{e}");
    let e = refused(&tiny_train(&dir.path().join("o"), &["--patience", "3"]));
    assert!(e.contains("--patience needs --keep-best"), "{e}");
    assert!(!dir.path().join("o").exists());
}
