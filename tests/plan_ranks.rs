//! `qatc plan` over ranks (`--ranks N --zero S`): one rank's model states against ZeRO's
//! formula, its peak falling with them, the table side by side, and `--fit` searching the stage.

mod common;

use std::process::Command;

fn qatc(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_qatc")).args(args).current_dir(common::root()).output().unwrap()
}

/// `qatc plan --ranks N --zero S` on the full fine-tune of GPT-2 1.5B in bf16 with AdamW (no
/// weights needed: the size's shapes are all a plan needs): one rank's model states agree with
/// ZeRO's division of qatc's own bytes per parameter within 2% (the padding and the blocks'
/// rounding are all that differs), and shrink stage by stage as ZeRO says: qatc's parts are 4
/// (the f32 weight, its own master) + 0 (no gradient kept at K 1) + 8 (Adam's moments).
#[test]
fn plan_per_rank_of_gpt2_xl_agrees_with_zeros_formula() {
    let n = 4usize;
    let (mut totals, mut peaks) = (Vec::new(), Vec::new());
    for zero in 0..=3u8 {
        let (z, r) = (zero.to_string(), n.to_string());
        let args = [
            "plan",
            "1.5B",
            "--batch",
            "1",
            "--seq",
            "64",
            "--full-finetune",
            "--precision",
            "bf16",
            "--ranks",
            &r,
            "--zero",
            &z,
            "--json",
        ];
        let out = qatc(&args);
        assert!(out.status.success(), "ZeRO {zero}: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let ranks = &v["ranks"];
        let states = &ranks["model_states"];
        let psi = ranks["trainable_parameters"].as_f64().unwrap();
        assert_eq!(psi, 1_557_611_200.0, "GPT-2 1.5B's parameters, all trainable");
        let per = |k: &str| states["one_rank"][k].as_f64().unwrap() / psi;
        assert_eq!((per("parameters"), per("gradients"), per("optimizer")), (4.0, 0.0, 8.0), "qatc's bytes per parameter");
        let got = states["this_rank"]["total"].as_f64().unwrap();
        let want = states["zero_formula"]["total"].as_f64().unwrap();
        let by_hand = match zero {
            0 => 12.0,
            1 | 2 => 4.0 + 8.0 / n as f64,
            _ => 12.0 / n as f64,
        } * psi;
        assert!((want - by_hand).abs() / by_hand < 1e-6, "ZeRO {zero}: the formula {want} against {by_hand}");
        let dev = (got - want).abs() / want;
        assert!(dev <= 0.02, "ZeRO {zero}: {got} bytes per rank against the formula's {want} ({:.3}%)", 100.0 * dev);
        assert!(ranks["collectives"]["sent_bytes_per_step"].as_u64().unwrap() > 0);
        eprintln!("ZeRO {zero} over {n} ranks: {:.3} B/param per rank ({:.4}% from the formula)", got / psi, 100.0 * dev);
        totals.push(got);
        peaks.push(v["summary"]["peak_bytes"].as_f64().unwrap());
    }
    assert!(totals[0] > totals[1] && totals[1] >= totals[2] && totals[2] > totals[3], "{totals:?}");
    // and the rank's peak falls by at least what its model states do: the sharded update's new
    // values are written over the blocks and gathered straight into the weights, not held as
    // copies to the end of the step (before: ZeRO 1 saved 8.7 GiB of states and 4.8 of its peak)
    for s in 1..=3 {
        assert!(
            peaks[0] - peaks[s] >= 0.99 * (totals[0] - totals[s]),
            "ZeRO {s}: peak {} against ZeRO 0's {}, states {totals:?}",
            peaks[s],
            peaks[0]
        );
    }
}

/// The table prints the same side by side, and `qatc train --ranks 2` outside mpirun refuses in
/// one line that says how to start the ranks.
#[test]
fn plan_table_per_rank_and_train_outside_mpirun_refuses_ranks() {
    let tiny = "tests/fixtures/tiny/f32_prefix/model.safetensors";
    let out = qatc(&["plan", tiny, "--batch", "1", "--seq", "4", "--ranks", "2", "--zero", "1"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    for want in ["ranks 2, ZeRO 1", "ZeRO formula", "reduce_scatter", "all_gather", "sent per rank per run"] {
        assert!(text.contains(want), "no {want:?} in\n{text}");
    }
    let out = qatc(&["train", tiny, "--data", "tests/fixtures/tiny/tokens.bin", "--ranks", "2", "--steps", "1", "--out", "/nonexistent/x"]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    // one process is one rank: the ranks are mpirun's to start
    assert!(err.contains("--ranks 2") && err.contains("mpirun -np 2") && err.trim().lines().count() == 1, "{err}");
}

/// `--fit --ranks 2` searches the ZeRO stage too, lowest first: on the tiny model's full
/// fine-tune at 1 MiB nothing fits at ZeRO 0 (`--zero 0` pins it), and the rows that fit name the
/// stage that made them fit.
#[test]
fn fit_over_ranks_searches_the_zero_stage() {
    let tiny = "tests/fixtures/tiny/f32_prefix/model.safetensors";
    let fit = |zero: Option<&str>| {
        let mut args = vec!["plan", tiny, "--seq", "4", "--memory", "1MiB", "--fit", "--ranks", "2", "--max-batch", "2"];
        args.extend(["--precision", "fp32", "--optim", "adamw", "--json"]);
        if let Some(z) = zero {
            args.extend(["--zero", z]);
        }
        let out = qatc(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let pinned = fit(Some("0"));
    assert!(pinned["fits"].as_array().unwrap().is_empty(), "{pinned}");
    let searched = fit(None);
    let rows = searched["fits"].as_array().unwrap();
    assert!(!rows.is_empty(), "{searched}");
    for r in rows {
        assert_eq!(r["ranks"], 2);
        assert!(r["zero"].as_u64().unwrap() >= 1, "{r}");
    }
}
