//! A run that diverges (issue 16.3): `qatc train` stops with one line that says what is known
//! (the step, the last finite loss, the gradient norm, the learning rate) and the likeliest cause,
//! exit code 2, and the last good save in OUT is intact: a finite adapter and a resume state of
//! the step the line names. Evaluating that adapter, whose weights overflow, is refused rather
//! than printing NaN.

use std::path::Path;
use std::process::{Command, Output};

use qatc::data::TokenFile;
use qatc::frontend::checkpoint::write_synthetic;
use qatc::frontend::config::Gpt2Config;
use qatc_ir::DType;

fn qatc(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_qatc")).args(args).current_dir(dir).output().unwrap()
}

/// The one `error:` line of a refused run (notices start with `qatc:` or `note:`).
fn error_line(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.starts_with("qatc: ") && !l.starts_with("note: ")).collect();
    assert_eq!(lines.len(), 1, "one error line: {stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    lines[0].to_string()
}

#[test]
fn a_diverging_run_stops_with_what_is_known_and_keeps_the_last_good_save() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cfg = Gpt2Config { n_embd: 64, n_layer: 2, n_head: 4, n_positions: 32, vocab_size: 97, layer_norm_epsilon: 1e-5 };
    std::fs::create_dir(d.join("m")).unwrap();
    write_synthetic(&d.join("m/model.safetensors"), &cfg, DType::F32, true, 5).unwrap();
    let tokens: Vec<u16> = (0..400u16).map(|i| (i * 7 + 3) % 97).collect();
    TokenFile::write(&d.join("tokens.bin"), &tokens).unwrap();

    // AdamW moves every weight by about lr per step: at 1e30 the first update is finite, and the
    // next forward pass overflows
    let train = ["train", "m/model.safetensors", "--data", "tokens.bin", "--batch", "2", "--seq", "8", "--lora", "r=2"];
    let run = [&train[..], &["--steps", "8", "--save-every", "1", "--lr", "1e30", "--interpreter", "--out", "o"]].concat();
    let line = error_line(&qatc(d, &run));
    for part in ["training diverged at step", "last finite loss", "gradient norm", "learning rate 1e30", "likeliest cause: --lr 1e30"] {
        assert!(line.contains(part), "the line lacks {part:?}: {line}");
    }
    // the step it stopped at, and the last save it names
    let after = |key: &str| -> usize {
        let rest = &line[line.find(key).unwrap_or_else(|| panic!("no {key:?} in {line}")) + key.len()..];
        rest.split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
    };
    let (stopped, saved) = (after("diverged at step "), after("the last save (step "));
    assert!(line.contains("in o is intact"), "{line}");
    assert!(saved >= 1 && saved <= stopped, "saved {saved}, stopped at {stopped}: {line}");

    // OUT holds that save, whole: its resume state's step, a finite adapter (qatc's reader
    // refuses a non-finite one), and nothing half-written beside it
    let progress: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(d.join("o/checkpoint/resume.json")).unwrap()).unwrap();
    assert_eq!(progress["step"].as_u64(), Some(saved as u64));
    let adapter = qatc::adapter::read(&d.join("o")).expect("the last save's adapter is finite and reads back");
    assert!(!adapter.tensors.is_empty());
    let mut names: Vec<String> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    assert_eq!(names, ["m", "o", "tokens.bin"], "nothing left beside OUT");

    // that adapter's weights are finite but overflow the forward pass: eval says so, never NaN
    let out = qatc(d, &["eval", "m/model.safetensors", "--data", "tokens.bin", "--batch", "2", "--seq", "8", "--adapter", "o"]);
    let line = error_line(&out);
    assert!(line.contains("tokens.bin: batch 0 gives a loss of") && line.contains("no result"), "{line}");
    assert!(String::from_utf8_lossy(&out.stdout).trim().is_empty(), "eval printed a result: {}", String::from_utf8_lossy(&out.stdout));
}
