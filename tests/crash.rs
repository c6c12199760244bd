//! Saves survive being cut short at any point. `qatc train --save-every 1` on the tiny fixture
//! (reference interpreter, LoRA with dropout, shuffled data, cosine schedule):
//!
//! - in process, every filesystem step of every save fails in turn (`artifacts::Faults`: an
//!   error there leaves exactly what a kill would), then the run is resumed;
//! - the real binary is killed with SIGKILL at least 100 times, each kill aimed at the save
//!   that follows a logged step, and resumed after each.
//!
//! After every interruption OUT is absent (nothing saved yet) or one whole save: the adapter
//! and the checkpoint hold the same weights. Resuming needs no hand: it cleans what the cut
//! save left, and continues exactly: every logged loss, the final adapter and the resume state
//! equal an uninterrupted run's bit for bit.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use qatc::artifacts::Faults;
use qatc::cli::resume::Given;
use qatc::cli::train::{run_with, Args};

use common::cli::loss_bits;

#[derive(Parser)]
struct Train {
    #[command(flatten)]
    args: Args,
}

fn train_args(out: &Path, log: &Path, steps: usize, resume: bool) -> Vec<String> {
    let m = common::fixture("tiny/f32_prefix/model.safetensors");
    let d = common::fixture("tiny/tokens.bin");
    let mut v: Vec<String> = [
        m.to_str().unwrap(),
        "--data",
        d.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        &steps.to_string(),
        "--bits",
        "4",
        "--group",
        "32",
        "--lora",
        "r=4,dropout=0.1",
        "--lr",
        "3e-3",
        "--schedule",
        "cosine",
        "--shuffle",
        "--seed",
        "3",
        "--save-every",
        "1",
        "--interpreter",
        "--no-fuse",
        "--out",
        out.to_str().unwrap(),
        "--log-json",
        log.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if resume {
        v.extend(["--resume".to_string(), out.display().to_string()]);
    }
    v
}

fn in_process(out: &Path, log: &Path, steps: usize, resume: bool, faults: &Faults) -> anyhow::Result<()> {
    let mut argv = vec!["train".to_string()];
    argv.extend(train_args(out, log, steps, resume));
    run_with(&Train::parse_from(argv).args, &Given::all(), faults)
}

fn tensors(path: &Path) -> BTreeMap<String, Vec<u8>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    st.tensors().into_iter().map(|(k, v)| (k, v.data().to_vec())).collect()
}

/// OUT as an interruption may leave it: absent, or one complete save whose adapter holds the
/// checkpoint's weights. Returns the saved step.
fn check_whole(out: &Path, when: &str) -> Option<u64> {
    if !out.exists() {
        return None;
    }
    for f in ["adapter_config.json", "adapter_model.safetensors", "qatc.json", "checkpoint/state.safetensors", "checkpoint/resume.json"] {
        assert!(out.join(f).exists(), "{when}: {} lacks {f}", out.display());
    }
    let adapter = tensors(&out.join("adapter_model.safetensors"));
    let state = tensors(&out.join("checkpoint/state.safetensors"));
    assert!(!adapter.is_empty());
    for (k, v) in &adapter {
        let name = k.strip_prefix("base_model.model.transformer.").unwrap();
        assert!(state.get(name) == Some(v), "{when}: the adapter's {name} is not the checkpoint's: two saves mixed");
    }
    let p: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("checkpoint/resume.json")).unwrap()).unwrap();
    p["step"].as_u64()
}

/// What lies beside OUT other than OUT and the log.
fn leftovers(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "o" && n != "log.jsonl")
        .collect();
    v.sort();
    v
}

struct Reference {
    curve: BTreeMap<u64, u64>,
    adapter: Vec<u8>,
    state: Vec<u8>,
}

impl Reference {
    fn check(&self, out: &Path, log: &Path, when: &str) {
        assert_eq!(loss_bits(log), self.curve, "{when}: the loss curve differs");
        assert!(std::fs::read(out.join("adapter_model.safetensors")).unwrap() == self.adapter, "{when}: the adapter differs");
        assert!(std::fs::read(out.join("checkpoint/state.safetensors")).unwrap() == self.state, "{when}: the resume state differs");
    }
}

fn reference(dir: &Path, steps: usize, faults: &Faults) -> Reference {
    std::fs::create_dir(dir).unwrap();
    let (out, log) = (dir.join("o"), dir.join("log.jsonl"));
    in_process(&out, &log, steps, false, faults).unwrap();
    Reference {
        curve: loss_bits(&log),
        adapter: std::fs::read(out.join("adapter_model.safetensors")).unwrap(),
        state: std::fs::read(out.join("checkpoint/state.safetensors")).unwrap(),
    }
}

#[test]
fn a_save_failing_at_any_filesystem_step_resumes_exactly() {
    // the first save creates OUT, the second replaces it
    const STEPS: usize = 2;
    let tmp = tempfile::tempdir().unwrap();
    let counted = Faults::counting();
    let want = reference(&tmp.path().join("ref"), STEPS, &counted);
    let n = counted.taken();
    let names = counted.names();
    assert!(n >= 2 * 20, "two saves of five files each: {names:?}");
    for (i, name) in names.iter().enumerate() {
        let dir = tmp.path().join(format!("f{i}"));
        std::fs::create_dir(&dir).unwrap();
        let (out, log) = (dir.join("o"), dir.join("log.jsonl"));
        let when = format!("failed at step {i} ({name})");
        let e = in_process(&out, &log, STEPS, false, &Faults::fail_at(i)).unwrap_err();
        assert!(format!("{e:#}").contains("injected failure"), "{when}: {e:#}");
        let saved = check_whole(&out, &when);
        // the next run: a resume when a save is there, else the run from the start
        in_process(&out, &log, STEPS, saved.is_some(), Faults::none()).unwrap_or_else(|e| panic!("{when}: the next run failed: {e:#}"));
        want.check(&out, &log, &when);
        assert!(leftovers(&dir).is_empty(), "{when}: left {:?}", leftovers(&dir));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// A small deterministic generator for the kill delays (the test's own choices repeat; where
/// the kills land still depends on timing).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

fn lines(log: &Path) -> usize {
    std::fs::read_to_string(log).map(|s| s.lines().count()).unwrap_or(0)
}

fn spawn(out: &Path, log: &Path, steps: usize, resume: bool) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_qatc"))
        .arg("train")
        .args(train_args(out, log, steps, resume))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

#[test]
fn a_hundred_kills_aimed_at_saves_resume_exactly() {
    const KILLS: usize = 100;
    // each run is killed in the save after its first or second logged step (or, when that
    // save was quick, in the next): about two steps of progress per kill, so with three per
    // kill the run is still going at the last one
    const STEPS: usize = 3 * KILLS;
    let tmp = tempfile::tempdir().unwrap();

    // the uninterrupted run, timing how long a logged step and its save take (the window the
    // kills aim at)
    let rdir = tmp.path().join("ref");
    std::fs::create_dir(&rdir).unwrap();
    let (rout, rlog) = (rdir.join("o"), rdir.join("log.jsonl"));
    let mut child = spawn(&rout, &rlog, STEPS, false);
    let (mut seen, mut stamps) = (0, Vec::new());
    while child.try_wait().unwrap().is_none() {
        let n = lines(&rlog);
        if n > seen {
            seen = n;
            stamps.push(Instant::now());
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    assert!(child.wait().unwrap().success());
    let mut gaps: Vec<Duration> = stamps.windows(2).map(|w| w[1] - w[0]).collect();
    gaps.sort();
    let cycle = gaps.get(gaps.len() / 2).copied().unwrap_or(Duration::from_millis(5)).max(Duration::from_micros(500));
    let want = Reference {
        curve: loss_bits(&rlog),
        adapter: std::fs::read(rout.join("adapter_model.safetensors")).unwrap(),
        state: std::fs::read(rout.join("checkpoint/state.safetensors")).unwrap(),
    };
    assert_eq!(want.curve.len(), STEPS);

    let dir = tmp.path().join("kill");
    std::fs::create_dir(&dir).unwrap();
    let (out, log) = (dir.join("o"), dir.join("log.jsonl"));
    let mut rng = SplitMix(20_261_123);
    let (mut cut_short, mut last_step) = (0, None);
    for kill in 0..KILLS {
        let resume = out.exists();
        let before = lines(&log);
        let mut child = spawn(&out, &log, STEPS, resume);
        let target = before + 1 + (rng.next() % 2) as usize;
        let t0 = Instant::now();
        while lines(&log) < target {
            assert!(child.try_wait().unwrap().is_none(), "kill {kill}: the run ended before it was killed");
            assert!(t0.elapsed() < Duration::from_secs(60), "kill {kill}: no progress");
            std::thread::sleep(Duration::from_micros(100));
        }
        // the logged step's save starts now; land anywhere within one step-and-save
        std::thread::sleep(cycle.mul_f64((rng.next() % 1000) as f64 / 1000.0));
        child.kill().unwrap();
        child.wait().unwrap();
        let when = format!("kill {kill}");
        let step = check_whole(&out, &when);
        assert!(step >= last_step, "{when}: OUT went back from step {last_step:?} to {step:?}");
        last_step = step;
        if !leftovers(&dir).is_empty() {
            cut_short += 1;
        }
    }
    eprintln!("{KILLS} kills, {cut_short} of them inside a save (a staging directory left behind); one cycle {cycle:?}");
    assert!(cut_short > 0, "no kill landed inside a save: the test did not test saves");
    let st = spawn(&out, &log, STEPS, out.exists()).wait().unwrap();
    assert!(st.success());
    want.check(&out, &log, "after the kills");
    assert!(leftovers(&dir).is_empty(), "left {:?}", leftovers(&dir));
}
