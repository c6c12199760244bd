//! `mpirun -np N qatc train` with real processes (issue 31's exactness tests): N ranks of B rows
//! each train as one rank of N x B rows does, within 1e-6 in the loss and 1e-5 in the trained
//! weights after 3 steps, for 4-bit + LoRA and for a full fine-tune; ZeRO 1, 2 and 3 as stage 0;
//! a run resumed across a save as an unbroken one, from each rank's own shard of the sharded
//! state (a missing shard, or another rank's, refused naming the file); 8-bit moments sharded as
//! whole ones; validation and instruction data as on one rank; a resume on another number of
//! ranks refused.
//!
//! On the tiny model: 3 ranks oversubscribe this 2-core machine (`--oversubscribe`, no binding).
//! Built without the `mpi` feature, qatc must refuse to run under mpirun (or, with no mpirun, the
//! test says why it skips); with the feature, a missing mpirun is a failure.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Output};

/// Rows of the global batch (divisible by 1, 2 and 3 ranks) and the sequence length: the tiny
/// token file holds 4 such batches.
const GLOBAL: usize = 6;
const T: &str = "8";
const STEPS: &str = "3";

fn qatc_bin() -> &'static str {
    env!("CARGO_BIN_EXE_qatc")
}

fn has_mpirun() -> bool {
    Command::new("mpirun").arg("--version").output().is_ok_and(|o| o.status.success())
}

/// `qatc train` on `ranks` processes (plain, on one), `--batch` GLOBAL / ranks and `--steps`
/// STEPS unless `extra` gives them, with `extra` options, writing OUT and its log under `dir`.
fn train(dir: &Path, ranks: usize, out: &str, extra: &[&str]) -> Output {
    let tiny = common::fixture("tiny/f32_noprefix/model.safetensors");
    let tokens = common::fixture("tiny/tokens.bin");
    train_on(dir, ranks, &tiny, &tokens, out, extra)
}

/// `train`, of model `model` on data `data` (`--seq` T unless `extra` gives it).
fn train_on(dir: &Path, ranks: usize, model: &Path, data: &Path, out: &str, extra: &[&str]) -> Output {
    let batch = (GLOBAL / ranks).to_string();
    let log = format!("{out}.log.json");
    let mut args: Vec<String> = vec!["train".into(), model.display().to_string(), "--data".into(), data.display().to_string()];
    for a in ["--out", out, "--log-json", &log] {
        args.push(a.into());
    }
    if !extra.contains(&"--seq") {
        args.extend(["--seq".to_string(), T.to_string()]);
    }
    if !extra.contains(&"--batch") {
        args.extend(["--batch".to_string(), batch]);
    }
    if !extra.contains(&"--steps") {
        args.extend(["--steps".to_string(), STEPS.to_string()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let mut cmd = if ranks == 1 {
        Command::new(qatc_bin())
    } else {
        let mut c = Command::new("timeout");
        c.args(["300", "mpirun", "--oversubscribe", "--bind-to", "none", "-np", &ranks.to_string(), qatc_bin()]);
        // root in a container: Open MPI's launcher refuses it unless both are set
        c.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        c
    };
    cmd.args(&args).current_dir(dir).output().expect("runs")
}

fn ok(o: Output) -> Output {
    assert!(o.status.success(), "exit {:?}\n{}", o.status, String::from_utf8_lossy(&o.stderr));
    o
}

/// The losses a run logged, by step.
fn losses(dir: &Path, out: &str) -> Vec<f64> {
    let text = std::fs::read_to_string(dir.join(format!("{out}.log.json"))).expect("the log");
    text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON")["loss"].as_f64().expect("a loss")).collect()
}

/// The trained tensors a run saved (the adapter, or the whole model of a full fine-tune).
fn weights(dir: &Path, out: &str) -> HashMap<String, Vec<f32>> {
    let d = dir.join(out);
    let file = ["adapter_model.safetensors", "model.safetensors"].iter().map(|f| d.join(f)).find(|p| p.exists()).expect("saved weights");
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, v.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()))
        .collect()
}

/// Run `b` equals run `a`: losses within 1e-6, every saved tensor within 1e-5.
fn same(dir: &Path, a: &str, b: &str) {
    let (la, lb) = (losses(dir, a), losses(dir, b));
    assert_eq!(la.len(), lb.len(), "{a} against {b}");
    for (s, (x, y)) in la.iter().zip(&lb).enumerate() {
        assert!((x - y).abs() <= 1e-6, "{b} against {a}: step {s}'s loss {y} against {x}");
    }
    let (wa, wb) = (weights(dir, a), weights(dir, b));
    assert_eq!(wa.len(), wb.len(), "{b} against {a}: tensors");
    let mut worst = 0.0f32;
    for (name, x) in &wa {
        let y = wb.get(name).unwrap_or_else(|| panic!("{b} has no {name}"));
        assert_eq!(x.len(), y.len(), "{name}");
        let d = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0.0, f32::max);
        assert!(d <= 1e-5, "{b} against {a}: {name} differs by {d}");
        worst = worst.max(d);
    }
    eprintln!(
        "{b} = {a}: worst loss difference {:.1e}, worst weight difference {worst:.1e}",
        la.iter().zip(&lb).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
    );
}

/// Whether the multi-process tests can run here; without the `mpi` feature they cannot (qatc
/// must then refuse mpirun in one line), and with it mpirun must be there.
fn mpi_ready(dir: &Path) -> bool {
    let mpirun = has_mpirun();
    if cfg!(feature = "mpi") {
        assert!(mpirun, "qatc is built with the `mpi` feature but mpirun is missing: `make mpi` installs Open MPI");
        return true;
    }
    if mpirun {
        let o = train(dir, 2, "refused", &["--lora", "r=2"]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains("built without MPI"), "{err}");
    }
    eprintln!("skipped: qatc is built without the `mpi` feature (mpirun {})", if mpirun { "refused, as it must" } else { "absent" });
    false
}

#[test]
fn ranks_train_as_one_rank_of_the_global_batch() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    if !mpi_ready(d) {
        return;
    }
    for (what, opts) in [("lora4", &["--lora", "r=2", "--bits", "4"][..]), ("full", &["--full-finetune"][..])] {
        ok(train(d, 1, &format!("{what}1"), opts));
        for n in [2, 3] {
            ok(train(d, n, &format!("{what}{n}"), opts));
            same(d, &format!("{what}1"), &format!("{what}{n}"));
        }
    }
}

#[test]
fn zero_stages_train_as_stage_zero() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    if !mpi_ready(d) {
        return;
    }
    // two micro-batches a step, so stage 2's sharded sums differ from stage 1
    let full = ["--full-finetune", "--grad-accum", "2"];
    ok(train(d, 1, "one", &full));
    for (n, zero) in [(2, "0"), (2, "1"), (2, "2"), (2, "3"), (3, "3")] {
        let out = format!("n{n}z{zero}");
        ok(train(d, n, &out, &[&full[..], &["--zero", zero]].concat()));
        same(d, "one", &out);
    }
    let lora = ["--lora", "r=2", "--bits", "4", "--grad-accum", "2"];
    ok(train(d, 1, "lora1", &lora));
    ok(train(d, 3, "lora3z2", &[&lora[..], &["--zero", "2"]].concat()));
    same(d, "lora1", "lora3z2");
}

#[test]
fn a_sharded_run_resumes_as_if_unbroken() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    if !mpi_ready(d) {
        return;
    }
    let o = ["--full-finetune", "--zero", "3"];
    ok(train(d, 2, "whole", &o));
    // a run of 3 steps that stopped after its save at step 2 (the tiny steps are too quick to
    // kill reliably): 2 steps, their configuration then saying 3 (the schedule is constant)
    ok(train(d, 2, "cut", &[&o[..], &["--steps", "2"]].concat()));
    let cfg_path = d.join("cut/qatc.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["train"]["steps"] = 3.into();
    std::fs::write(&cfg_path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    // each rank saved its own blocks beside rank 0's checkpoint; rank 0's state holds the rest
    let shards = [d.join("cut/checkpoint/state.rank-0-of-2.safetensors"), d.join("cut/checkpoint/state.rank-1-of-2.safetensors")];
    for f in &shards {
        let names = tensor_names(f);
        assert!(names.iter().any(|n| n.starts_with("adam.m:")) && names.contains(&"wte.weight".to_string()), "{}: {names:?}", f.display());
    }
    let alike = tensor_names(&d.join("cut/checkpoint/state.safetensors"));
    assert!(alike.contains(&"step".to_string()) && !alike.iter().any(|n| n.starts_with("adam.")), "{alike:?}");
    // a missing shard, or another rank's in its place, is refused in one line naming the file
    let rank1 = "checkpoint/state.rank-1-of-2.safetensors";
    for (case, break_it) in [("missing", None), ("rank 0's", Some("checkpoint/state.rank-0-of-2.safetensors"))] {
        let broken = format!("broken-{}", case.len());
        copy_dir(&d.join("cut"), &d.join(&broken));
        match break_it {
            None => std::fs::remove_file(d.join(&broken).join(rank1)).unwrap(),
            Some(other) => std::fs::copy(d.join(&broken).join(other), d.join(&broken).join(rank1)).map(|_| ()).unwrap(),
        }
        let o2 = train(d, 2, &broken, &[&o[..], &["--resume", &broken]].concat());
        let err = String::from_utf8_lossy(&o2.stderr);
        assert_eq!(o2.status.code(), Some(2), "{case}: {err}");
        let line = err
            .lines()
            .find(|l| l.starts_with("error: ") && l.contains(rank1))
            .unwrap_or_else(|| panic!("{case}: no line names {rank1}:\n{err}"));
        let says = if break_it.is_none() { "missing" } else { "says qatc.rank 0, not 1" };
        assert!(line.contains(says), "{case}: {line}");
    }
    ok(train(d, 2, "cut", &[&o[..], &["--resume", "cut"]].concat()));
    same(d, "whole", "cut");
    // on another number of ranks (of the same rows each) the saved run is refused, naming both
    let refused = train(d, 3, "cut", &[&o[..], &["--resume", "cut", "--batch", "3"]].concat());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("trained on 2 ranks") && err.contains("this one has 3"), "{err}");
}

/// 8-bit moments sharded by ZeRO 1-3, each rank's blocks saved by itself: where every rank's
/// block is whole quantization blocks (2 ranks on the tiny model) ZeRO 1 and 3 train as the same
/// ranks do with the moments whole (ZeRO 0; at stage 3 the same tensors have 8-bit moments,
/// decided by the whole tensor, not the block), and a run resumes across a save as if unbroken;
/// where they are not (3 ranks), the run is refused, saying why. (8-bit moments are not compared
/// across other reductions: ZeRO 2-3's per-micro-batch sums, or one rank's, round a gradient's
/// last bits otherwise, and that flips a code now and then, moving a weight by up to 5e-4 in 3
/// steps.)
#[test]
fn sharded_8bit_moments_train_and_resume_as_whole_ones() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    if !mpi_ready(d) {
        return;
    }
    let o = ["--full-finetune", "--optim", "adamw8bit", "--grad-accum", "2"];
    ok(train(d, 2, "z0", &[&o[..], &["--zero", "0"]].concat()));
    ok(train(d, 2, "z1", &[&o[..], &["--zero", "1"]].concat()));
    same(d, "z0", "z1");
    // stage 3 with one micro-batch a step (its gradient sums are blocks, as stage 2's)
    let one = ["--full-finetune", "--optim", "adamw8bit"];
    ok(train(d, 2, "k1z0", &[&one[..], &["--zero", "0"]].concat()));
    ok(train(d, 2, "k1z3", &[&one[..], &["--zero", "3"]].concat()));
    same(d, "k1z0", "k1z3");
    let names = tensor_names(&d.join("z1/checkpoint/state.rank-1-of-2.safetensors"));
    assert!(names.iter().any(|n| n.starts_with("adam.m8:")) && names.iter().any(|n| n.starts_with("adam.v8.absmax:")), "{names:?}");
    let z = [&o[..], &["--zero", "2"]].concat();
    ok(train(d, 2, "z2", &z));
    ok(train(d, 2, "cut", &[&z[..], &["--steps", "2"]].concat()));
    let cfg_path = d.join("cut/qatc.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["train"]["steps"] = 3.into();
    std::fs::write(&cfg_path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    ok(train(d, 2, "cut", &[&z[..], &["--resume", "cut"]].concat()));
    same(d, "z2", "cut");
    for (n, zero, says) in [(3, "1", "elements of h.0."), (3, "3", "elements of h.0.")] {
        let r = train(d, n, "refused", &[&o[..], &["--zero", zero, "--batch", "2"]].concat());
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(!r.status.success() && err.contains(says), "{n} ranks, ZeRO {zero}: {err}");
    }
}

/// The tensor names of a safetensors file.
fn tensor_names(f: &Path) -> Vec<String> {
    let bytes = std::fs::read(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
    safetensors::SafeTensors::deserialize(&bytes).unwrap().names().into_iter().map(String::from).collect()
}

/// A copy of directory `from` (and its subdirectories) at `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// `--val` over ranks: each rank evaluates its rows of the validation's global batches and their
/// sums are added up, so the validation loss is one rank's (of the global batch) within 1e-6,
/// the weights whole (ZeRO 0) or gathered from the ranks' blocks (ZeRO 3).
#[test]
fn validation_over_ranks_is_one_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    if !mpi_ready(d) {
        return;
    }
    let tokens = common::fixture("tiny/tokens.bin");
    let v = ["--full-finetune", "--val", tokens.to_str().unwrap(), "--eval-every", "1", "--val-batches", "3"];
    ok(train(d, 1, "one", &v));
    for (n, zero) in [(2, "0"), (3, "3")] {
        let out = format!("n{n}z{zero}");
        ok(train(d, n, &out, &[&v[..], &["--zero", zero]].concat()));
        same(d, "one", &out);
        same_validation(d, "one", &out);
    }
}

/// Instruction data over ranks (records, each row's loss mask its own): each rank takes its rows
/// of the global batch, and the loss weights are the global batch's, so the ranks' mean loss is
/// the mean over the global step's counted targets, not a mean of the ranks' means: the ranks
/// train and validate as one rank of the global batch, padded (rows counting different numbers
/// of targets, two micro-batches a step) and packed (position ids). LoRA on the MLP's c_fc only:
/// on c_attn, the key part of lora_B has gradient elements that are 0 but for rounding (softmax
/// ignores what a row's scores share), which Adam's first step scales up to a step of up to lr,
/// so they differ by up to 2e-5 between any two ways of splitting the sums (a token file's runs
/// too).
#[test]
fn instruction_data_over_ranks_trains_as_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    if !mpi_ready(d) {
        return;
    }
    let model = common::root().join("examples/gpt2-shakespeare-small/model.safetensors");
    let data = common::fixture("instruct/data.jsonl");
    let lora = ["--lora", "r=2,targets=c_fc", "--seq", "64", "--val", data.to_str().unwrap(), "--eval-every", "1", "--val-batches", "2"];
    for (what, extra) in [("padded", &["--no-pack", "--grad-accum", "2"][..]), ("packed", &[][..])] {
        let (one, two) = (format!("{what}1"), format!("{what}2"));
        ok(train_on(d, 1, &model, &data, &one, &[&lora[..], extra, &["--batch", "2"]].concat()));
        ok(train_on(d, 2, &model, &data, &two, &[&lora[..], extra, &["--batch", "1"]].concat()));
        same(d, &one, &two);
        same_validation(d, &one, &two);
    }
}

/// The validation losses of runs `a` and `b`, logged at every step, agree within 1e-6.
fn same_validation(dir: &Path, a: &str, b: &str) {
    let val = |out: &str| -> Vec<f64> {
        let text = std::fs::read_to_string(dir.join(format!("{out}.log.json"))).expect("the log");
        text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["val_loss"].as_f64().expect("a val_loss")).collect()
    };
    let (va, vb) = (val(a), val(b));
    assert_eq!(va.len(), vb.len());
    for (s, (x, y)) in va.iter().zip(&vb).enumerate() {
        assert!((x - y).abs() <= 1e-6, "{b} against {a}: step {s}'s validation loss {y} against {x}");
    }
    eprintln!("{b} = {a}: worst validation difference {:.1e}", va.iter().zip(&vb).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max));
}

/// A rank killed with SIGKILL mid-run: the others are ended within seconds (never a hang), with
/// mpirun's line naming the rank, and the last checkpoint rank 0 wrote stays whole: with ZeRO 1
/// too, every rank's shard in it, of the same save.
#[test]
fn a_killed_rank_ends_the_run_and_the_checkpoint_stays_whole() {
    let dir = tempfile::tempdir().unwrap();
    if !mpi_ready(dir.path()) {
        return;
    }
    for zero in ["0", "1"] {
        let d = &dir.path().join(format!("zero{zero}"));
        std::fs::create_dir(d).unwrap();
        killed_rank(d, zero);
    }
}

fn killed_rank(d: &Path, zero: &str) {
    let model = common::root().join("examples/gpt2-shakespeare-small/model.safetensors");
    let data = common::root().join("examples/shakespeare_train.bin");
    let (model, data) = (model.to_str().unwrap(), data.to_str().unwrap());
    let mut child = Command::new("mpirun")
        .args(["--oversubscribe", "--bind-to", "none", "-np", "2", qatc_bin(), "train", model, "--data", data])
        .args(["--batch", "2", "--seq", "64", "--steps", "100000", "--bits", "4", "--lora", "r=4", "--save-every", "2"])
        .args(["--out", "o", "--log-json", "o.jsonl", "--zero", zero])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .current_dir(d)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    let logged = || std::fs::read_to_string(d.join("o.jsonl")).map(|s| s.lines().count()).unwrap_or(0);
    while logged() < 5 {
        assert!(t0.elapsed().as_secs() < 120, "no steps logged in 2 minutes");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // rank 1 is mpirun's second child
    let kids = Command::new("pgrep").args(["-P", &child.id().to_string()]).output().unwrap();
    let pids: Vec<String> = String::from_utf8_lossy(&kids.stdout).split_whitespace().map(String::from).collect();
    assert_eq!(pids.len(), 2, "mpirun's children: {pids:?}");
    let killed_at = std::time::Instant::now();
    assert!(Command::new("kill").args(["-9", &pids[1]]).status().unwrap().success());
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if killed_at.elapsed().as_secs() > 60 {
            child.kill().unwrap();
            panic!("the run did not end within 60 s of a rank's death");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.lines().any(|l| l.contains("rank 1") && l.contains("signal 9")), "no line names the dead rank:\n{err}");
    // the checkpoint is one save's, whole: its progress at an even step, its state readable
    let progress: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(d.join("o/checkpoint/resume.json")).unwrap()).unwrap();
    assert_eq!(progress["step"].as_u64().unwrap() % 2, 0, "{progress}");
    let state = std::fs::read(d.join("o/checkpoint/state.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&state).expect("a whole state");
    assert!(st.tensor("step").is_ok());
    let _ = weights(d, "o");
    if zero != "0" {
        for r in 0..2 {
            let f = d.join(format!("o/checkpoint/state.rank-{r}-of-2.safetensors"));
            let bytes = std::fs::read(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).expect("a whole shard");
            let step = meta.metadata().as_ref().and_then(|m| m.get("qatc.step").cloned());
            assert_eq!(step, Some(progress["step"].to_string()), "{}: another save's shard", f.display());
        }
    }
    eprintln!("ZeRO {zero}: the run ended {:.1} s after rank 1's death", killed_at.elapsed().as_secs_f64());
}

/// Ranks started with different options (mpirun's `A : B` form) refuse before the first step,
/// every one of them, naming the option.
#[test]
fn ranks_started_unlike_refuse_naming_the_option() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    if !mpi_ready(d) {
        return;
    }
    let tiny = common::fixture("tiny/f32_noprefix/model.safetensors");
    let tokens = common::fixture("tiny/tokens.bin");
    let rank = |lr: &str| -> Vec<String> {
        let a = ["-np", "1", qatc_bin(), "train", tiny.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--batch", "3"];
        let b = ["--seq", T, "--steps", "1", "--lora", "r=2", "--lr", lr, "--out", "o", "--log-json", "o.jsonl"];
        a.iter().chain(&b).map(|s| s.to_string()).collect()
    };
    let out = Command::new("timeout")
        .args(["300", "mpirun", "--oversubscribe", "--bind-to", "none"])
        .args(rank("1e-3"))
        .arg(":")
        .args(rank("2e-3"))
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .current_dir(d)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    let refusals = err.lines().filter(|l| l.starts_with("error: rank 1 was started with train.lr 0.002, rank 0 with 0.001")).count();
    assert_eq!(refusals, 2, "each rank refuses in one line naming the option:\n{err}");
    assert!(!d.join("o").exists() && !d.join("o.jsonl").exists(), "nothing written");
}
