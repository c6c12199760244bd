//! `qatc prt` finds the lowest bits per module within the threshold and writes a bit map that
//! `qatc eval --bits-map` (and compile/train) accept.

mod common;

use std::process::Command;

fn qatc(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_qatc")).args(args).output().unwrap()
}

#[test]
fn prt_writes_a_bit_map_that_eval_and_compile_use() {
    let m = common::fixture("tiny/f32_prefix/model.safetensors");
    let d = common::fixture("tiny/tokens.bin");
    let dir = tempfile::tempdir().unwrap();
    let map = dir.path().join("bits.json");
    let (m, d, map_s) = (m.to_str().unwrap(), d.to_str().unwrap(), map.to_str().unwrap());
    let base = ["--batch", "2", "--seq", "16"];
    let mut a = vec!["prt", m, "--data", d, "--batches", "3", "--group", "16", "--threshold", "0.0002", "--bits-map", map_s, "--json"];
    a.extend(base);
    let out = qatc(&a);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let fp = rep["full_precision_loss"].as_f64().unwrap();
    let mods = rep["modules"].as_array().unwrap();
    assert_eq!(mods.len(), 8, "4 linears x 2 layers");
    for r in mods {
        let tried = r["tried"].as_array().unwrap();
        match r["bits"].as_u64() {
            // the chosen width is within the threshold, and every narrower one tried was not
            Some(b) => {
                assert!(r["loss"].as_f64().unwrap() <= fp * 1.0002 + 1e-12);
                for t in tried {
                    let (tb, tl) = (t[0].as_u64().unwrap(), t[1].as_f64().unwrap());
                    if tb < b {
                        assert!(tl > fp * 1.0002, "{r}");
                    }
                }
            }
            None => assert!(tried.iter().all(|t| t[1].as_f64().unwrap() > fp * 1.0002)),
        }
    }
    assert!(rep["average_bits"].as_f64().unwrap() >= 2.0);
    // the map drives eval: equal to quantizing exactly those modules by hand is what --bits-map means
    let bm: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&map).unwrap()).unwrap();
    assert_eq!(bm["version"], 1);
    let mut e = vec!["eval", m, "--data", d, "--batches", "3", "--json", "--bits-map", map_s];
    e.extend(base);
    let ev = qatc(&e);
    assert!(ev.status.success(), "{}", String::from_utf8_lossy(&ev.stderr));
    let mapped: serde_json::Value = serde_json::from_slice(&ev.stdout).unwrap();
    assert!(mapped["loss"].as_f64().unwrap() != fp, "the map quantizes something");
    let mut c = vec!["compile", m, "-o", dir.path().join("o").to_str().unwrap().to_string().leak(), "--bits-map", map_s];
    c.extend(base);
    let co = qatc(&c);
    assert!(co.status.success(), "{}", String::from_utf8_lossy(&co.stderr));
    let step = std::fs::read_to_string(dir.path().join("o/train.qir")).unwrap();
    let chosen = mods.iter().filter(|r| r["bits"].is_u64()).count();
    // no --lora: a full fine-tune, so every quantized module keeps a (trainable) fake-quant
    assert_eq!(step.matches("= fake_quant[").count(), chosen, "each module the map quantizes is fake-quantized");
    // a broken map is one clear error
    std::fs::write(&map, "{\"version\": 1, \"modules\": {\"h.0.attn.c_attn\": {\"bits\": 4, \"group\": 16, \"scheme\": \"fp4\"}}}")
        .unwrap();
    let bad = qatc(&e);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown scheme `fp4`"));
}

#[test]
fn prt_with_a_budget_writes_a_whole_model_map_measured_within_it() {
    let m = common::fixture("tiny/f32_prefix/model.safetensors");
    let d = common::fixture("tiny/tokens.bin");
    let dir = tempfile::tempdir().unwrap();
    let map = dir.path().join("bits.json");
    let (m, d, map_s) = (m.to_str().unwrap(), d.to_str().unwrap(), map.to_str().unwrap());
    let base = ["--batch", "2", "--seq", "16", "--batches", "3"];
    for budget in ["0.0002", "0.002"] {
        let mut a = vec!["prt", m, "--data", d, "--group", "16", "--budget", budget, "--bits-map", map_s, "--json"];
        a.extend(base);
        let out = qatc(&a);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let b: f64 = budget.parse().unwrap();
        let measured = rep["measured_penalty"].as_f64().unwrap();
        assert!(measured <= b, "budget {b}: the map's measured penalty {measured}");
        assert!(rep["predicted_penalty"].as_f64().unwrap() <= b + 1e-12);
        // every module was measured from 8 bits down, so the allocation had whole curves to choose from
        for r in rep["modules"].as_array().unwrap() {
            assert_eq!(r["tried"][0][0].as_u64(), Some(8), "{r}");
        }
        // the map, evaluated on the same batches, is what prt measured
        let mut e = vec!["eval", m, "--data", d, "--json", "--bits-map", map_s];
        e.extend(base);
        let ev = qatc(&e);
        assert!(ev.status.success(), "{}", String::from_utf8_lossy(&ev.stderr));
        let loss = serde_json::from_slice::<serde_json::Value>(&ev.stdout).unwrap()["loss"].as_f64().unwrap();
        let fp = rep["full_precision_loss"].as_f64().unwrap();
        assert!((loss - fp - measured).abs() < 1e-9, "eval {loss} - {fp} vs measured {measured}");
        assert!(rep["average_bits"].as_f64().unwrap() < 16.0, "budget {b}: something is quantized");
    }
    let bad = qatc(&["prt", m, "--data", d, "--budget", "-1", "--bits-map", map_s]);
    assert_eq!(bad.status.code(), Some(2));
}

#[test]
fn prt_measurements_are_reused_across_budgets() {
    let m = common::fixture("tiny/f32_prefix/model.safetensors");
    let d = common::fixture("tiny/tokens.bin");
    let dir = tempfile::tempdir().unwrap();
    let (map, meas) = (dir.path().join("bits.json"), dir.path().join("m.json"));
    let (m, d, map_s, meas_s) = (m.to_str().unwrap(), d.to_str().unwrap(), map.to_str().unwrap(), meas.to_str().unwrap());
    let run = |budget: &str, group: &str| {
        let a = ["prt", m, "--data", d, "--batch", "2", "--seq", "16", "--batches", "3", "--group", group, "--budget", budget];
        let mut a = a.to_vec();
        a.extend(["--bits-map", map_s, "--measurements", meas_s, "--json"]);
        qatc(&a)
    };
    let first = run("0.002", "16");
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    let kept: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&meas).unwrap()).unwrap();
    assert_eq!(kept["modules"].as_object().unwrap().len(), 8);
    // a smaller budget from the same measurements: the same curves, a map within the new budget
    let second = run("0.0005", "16");
    assert!(second.status.success(), "{}", String::from_utf8_lossy(&second.stderr));
    let (a, b): (serde_json::Value, serde_json::Value) =
        (serde_json::from_slice(&first.stdout).unwrap(), serde_json::from_slice(&second.stdout).unwrap());
    for (x, y) in a["modules"].as_array().unwrap().iter().zip(b["modules"].as_array().unwrap()) {
        assert_eq!(x["tried"], y["tried"], "the measurements were reused");
    }
    assert!(b["measured_penalty"].as_f64().unwrap() <= 0.0005);
    // measurements of other settings are refused, not silently used
    let other = run("0.002", "32");
    assert_eq!(other.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&other.stderr).contains("other settings"), "{}", String::from_utf8_lossy(&other.stderr));
}
