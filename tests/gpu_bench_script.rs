//! The parts of the GPU benchmark (`bench/gpu.sh`, `bench/mfu.py`, `bench/torch_cuda_peer.py`)
//! that run without a GPU, without the bundle and without PyTorch: the script parses, prints its
//! help and refuses a section it does not have with exit code 2; the MFU helper (issue 20's
//! FLOPs-per-token formula's one home) gives the figure the formula gives for GPT-2 124M and the
//! peak of the devices it knows; the twin's `--help` needs no torch. The whole dry run
//! (`bash bench/gpu.sh --dry-run`) needs `make gpu-bundle` first, a build of its own: it is run
//! by hand, as README says.

mod common;

use std::process::Command;

fn python() -> Option<&'static str> {
    match Command::new("python3").arg("--version").output() {
        Ok(o) if o.status.success() => Some("python3"),
        _ => {
            eprintln!("SKIPPED: no python3");
            None
        }
    }
}

#[test]
fn the_script_parses_and_refuses_an_unknown_section() {
    let root = common::root();
    let script = root.join("bench/gpu.sh");
    let syntax = Command::new("bash").arg("-n").arg(&script).output().expect("bash runs");
    assert!(syntax.status.success(), "{}", String::from_utf8_lossy(&syntax.stderr));
    let help = Command::new("bash").arg(&script).arg("--help").output().expect("bash runs");
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(help.status.success());
    for section in ["tests", "tests16", "first", "speed", "peer", "fit", "sanitizer"] {
        assert!(text.contains(&format!("#   {section}")) || text.contains(&format!("  {section} ")), "the help names {section}");
    }
    let bad = Command::new("bash").arg(&script).arg("nosuchsection").output().expect("bash runs");
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown section nosuchsection"));
}

/// GPT-2 124M, T 1024, r 16: N_matmul = 12 x 12 x 768^2 + 50257 x 768 = 84,934,656 + 38,597,376
/// = 123,532,032; N_lora = 12 x 16 x 16 x 768 = 2,359,296; 12 L C T = 12 x 12 x 768 x 1024 =
/// 113,246,208; so 4 x 123,532,032 + 6 x 2,359,296 + 113,246,208 = 621,530,112 FLOPs per token.
#[test]
fn the_mfu_helper_gives_issue_20s_formula() {
    let Some(py) = python() else { return };
    let root = common::root();
    let run = |device: &str| {
        let o = Command::new(py)
            .arg(root.join("bench/mfu.py"))
            .args(["--layers", "12", "--embd", "768", "--seq", "1024", "--r", "16", "--tokens-per-s", "100000", "--device", device])
            .output()
            .expect("python runs");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).expect("one JSON line")
    };
    let h100 = run("NVIDIA H100 80GB HBM3");
    assert_eq!(h100["flops_per_token"], 621_530_112u64);
    assert_eq!(h100["peak_flops"].as_f64(), Some(989e12));
    let mfu = h100["mfu"].as_f64().expect("an MFU");
    assert!((mfu - 1e5 * 621_530_112.0 / 989e12).abs() < 1e-12, "{mfu}");
    assert_eq!(run("NVIDIA H200")["peak_flops"].as_f64(), Some(989e12));
    let unknown = run("NVIDIA A10");
    assert!(unknown["mfu"].is_null() && unknown["peak_flops"].is_null(), "no MFU against a peak it does not know: {unknown}");
    let help = Command::new(py).arg(root.join("bench/torch_cuda_peer.py")).arg("--help").output().expect("python runs");
    assert!(help.status.success(), "{}", String::from_utf8_lossy(&help.stderr));
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(["--compile", "--checkpoint", "--fit", "--attn"].iter().all(|f| text.contains(f)), "{text}");
}
