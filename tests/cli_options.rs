//! Impossible options get one clear error line, exit code 2, and no output directory.

mod common;

use std::process::Command;

fn tiny() -> String {
    common::fixture("tiny/f32_prefix/model.safetensors").display().to_string()
}

/// Runs `qatc compile` on the tiny model with extra flags; returns the one error line.
fn compile_fails(extra: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let m = tiny();
    let mut args = vec!["compile", m.as_str(), "--batch", "2", "--seq", "16", "-o", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    let r = Command::new(env!("CARGO_BIN_EXE_qatc")).args(&args).output().unwrap();
    let stderr = String::from_utf8_lossy(&r.stderr).into_owned();
    assert_eq!(r.status.code(), Some(2), "{extra:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr:?}");
    assert!(!out.exists(), "{extra:?} left {out:?} behind");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "no temp dir left either");
    stderr.trim().to_string()
}

#[test]
fn betas_outside_zero_one() {
    let e = compile_fails(&["--betas", "0.9,1.5"]);
    assert!(e.contains("\"1.5\" is not a decay rate in [0, 1)"), "{e}");
    let e = compile_fails(&["--betas", "0.9"]);
    assert!(e.contains("expected B1,B2"), "{e}");
}

#[test]
fn lora_rank_zero() {
    assert!(compile_fails(&["--lora", "r=0"]).contains("at least 1"));
}

#[test]
fn lora_rank_above_min_in_out() {
    let e = compile_fails(&["--lora", "r=65"]);
    assert!(e.contains("exceeds min(in, out) = 64"), "{e}");
}

#[test]
fn unknown_lora_target() {
    let e = compile_fails(&["--lora", "r=4,targets=q_proj"]);
    assert!(e.contains("unknown LoRA target `q_proj`") && e.contains("c_attn"), "{e}");
}

#[test]
fn group_that_does_not_divide_lists_the_sizes_that_do() {
    let e = compile_fails(&["--bits", "4", "--group", "48"]);
    assert!(e.contains("group 48 does not divide the input dimension 64") && e.contains("8, 16, 32, 64"), "{e}");
}

#[test]
fn q4_0_needs_group_32() {
    assert!(compile_fails(&["--bits", "4", "--scheme", "q4_0"]).contains("group 32"));
}

#[test]
fn nf4_needs_4_bits() {
    assert!(compile_fails(&["--bits", "3", "--group", "32", "--scheme", "nf4"]).contains("nf4 needs 4 bits"));
}

#[test]
fn bits_out_of_range() {
    assert!(compile_fails(&["--bits", "9"]).contains("2..8"));
}

#[test]
fn unknown_scheme_and_quant_target() {
    let e = compile_fails(&["--bits", "4", "--scheme", "fp4"]);
    assert!(e.contains("invalid value 'fp4' for '--scheme") && e.contains("sym, asym, nf4, q4_0"), "{e}");
    assert!(compile_fails(&["--bits", "4", "--quant-targets", "attn.q"]).contains("unknown quant target"));
}

#[test]
fn merged_qat_needs_lora_and_bits() {
    assert!(compile_fails(&["--bits", "4", "--qat", "merged"]).contains("needs --bits and --lora"));
    assert!(compile_fails(&["--bits", "4", "--qat", "merged", "--lora", "r=4,dropout=0.1"]).contains("dropout must be 0"));
}

/// A compile that outlives `--compile-timeout` ends with one line naming the stage it was in and
/// what to do, and writes nothing; a budget that is no number of seconds is refused.
#[test]
fn compile_budget_names_the_stage_it_ran_out_in() {
    let e = compile_fails(&["--bits", "4", "--group", "32", "--lora", "r=4", "--grad-accum", "3", "--compile-timeout", "0.000001"]);
    assert!(e.contains("compile budget of 0.000001 s ran out in "), "{e}");
    assert!(e.contains("--compile-timeout"), "{e}");
    for bad in ["0", "-1", "nan", "inf"] {
        assert!(compile_fails(&[&format!("--compile-timeout={bad}")]).contains("--compile-timeout must be"), "{bad}");
    }
}

/// `qatc dump --list` names every stage of the pipeline without a model, then the trainer's
/// `calibrate` step; dump without one is an error of one line.
#[test]
fn dump_lists_the_stages_without_a_model() {
    let r = Command::new(env!("CARGO_BIN_EXE_qatc")).args(["dump", "--list"]).output().unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let names: Vec<String> =
        String::from_utf8_lossy(&r.stdout).lines().filter_map(|l| l.split_whitespace().next().map(String::from)).collect();
    let mut want: Vec<&str> = qatc::step::Stage::ALL.iter().map(|s| s.name()).collect();
    want.push(qatc::calibrate::NAME);
    assert_eq!(names, want);
    let r = Command::new(env!("CARGO_BIN_EXE_qatc")).arg("dump").output().unwrap();
    assert_eq!(r.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&r.stderr).contains("MODEL"));
}
