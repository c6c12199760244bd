//! The `calibrate` step (`--scale-init activation|auto`) on the embedded Shakespeare GPT-2: the
//! same bits twice, the activation-aware start never worse than the weight search on the
//! calibration data's output error for any layer, auto taking each layer's least; and through the
//! CLI, the choice printed and saved in qatc.json, and a resumed run not calibrating again.

mod common;

use std::process::Command;

use qatc::calibrate::{calibrate, Calibration};
use qatc::config::ScaleInit;
use qatc::data::TokenFile;
use qatc::model::Model;
use qatc::step::ModelOptions;
use qatc_ir::{QuantScheme, QuantSpec};
use qatc_passes::quant::QuantOptions;

fn options(spec: QuantSpec) -> ModelOptions {
    let mut q = QuantOptions::all_linears(spec);
    q.learned_scales = true;
    ModelOptions { quant: Some(q), training: true, ..Default::default() }
}

fn bits(c: &Calibration) -> Vec<(String, Vec<u32>)> {
    let mut v: Vec<_> = c.tensors.iter().map(|(n, t)| (n.clone(), t.data.iter().map(|x| x.to_bits()).collect())).collect();
    v.sort();
    v
}

#[test]
fn deterministic_never_worse_than_the_weight_search_and_auto_takes_the_least() {
    let m = Model::open(&common::root().join("examples/gpt2-shakespeare-small/model.safetensors")).unwrap();
    let data = TokenFile::load(&common::root().join("examples/shakespeare_train.bin")).unwrap();
    for spec in [QuantSpec { bits: 2, group: 64, scheme: QuantScheme::Sym }, QuantSpec { bits: 3, group: 32, scheme: QuantScheme::Asym }] {
        let mo = options(spec);
        let auto = calibrate(&m, &mo, (2, 32), &data, ScaleInit::Auto).unwrap();
        assert_eq!(auto.batches, 4);
        assert_eq!(auto.layers.len(), 16, "{spec:?}: every linear of the 4 blocks");
        // deterministic: two runs give the same bits
        assert_eq!(bits(&auto), bits(&calibrate(&m, &mo, (2, 32), &data, ScaleInit::Auto).unwrap()), "{spec:?}");
        for l in &auto.layers {
            let aa = l.activation.unwrap_or_else(|| panic!("{}: no activation-aware start", l.weight));
            assert!(aa <= l.search * (1.0 + 1e-9), "{spec:?} {}: activation-aware {aa} > weight search {}", l.weight, l.search);
            let least = [(l.minmax, ScaleInit::Minmax), (l.search, ScaleInit::Search), (aa, ScaleInit::Activation)]
                .into_iter()
                .fold((f64::INFINITY, ScaleInit::Auto), |b, (e, i)| if e < b.0 { (e, i) } else { b });
            assert_eq!(l.chosen, least.1, "{spec:?} {}: {l:?}", l.weight);
        }
        // activation-aware alone takes it everywhere, with the same tensors where auto chose it
        let act = calibrate(&m, &mo, (2, 32), &data, ScaleInit::Activation).unwrap();
        assert!(act.layers.iter().all(|l| l.chosen == ScaleInit::Activation), "{spec:?}");
        for l in auto.layers.iter().filter(|l| l.chosen == ScaleInit::Activation) {
            let n = format!("{}.scales", l.weight);
            assert_eq!(auto.tensors[&n], act.tensors[&n], "{spec:?} {n}");
        }
        assert_eq!(act.tensors.len(), if spec.scheme.has_zero_point() { 32 } else { 16 });
    }
}

fn qatc(args: &[&str]) -> (String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_qatc")).args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{err}");
    (String::from_utf8_lossy(&out.stdout).into_owned(), err)
}

#[test]
fn the_default_start_is_auto_printed_saved_and_not_redone_on_resume() {
    let m = common::fixture("tiny/f32_prefix/model.safetensors");
    let d = common::fixture("tiny/tokens.bin");
    let (m, d) = (m.to_str().unwrap(), d.to_str().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let o = out.to_str().unwrap();
    let args = |steps: &'static str| {
        let mut a = vec!["train", m, "--data", d, "--batch", "2", "--seq", "16", "--steps", steps, "--lora", "r=4"];
        a.extend(["--bits", "2", "--group", "16", "--scales", "learned", "--out", o, "--save-every", "1"]);
        a
    };
    let (_, err) = qatc(&args("2"));
    let line = err.lines().find(|l| l.contains("calibrate: ")).unwrap_or_else(|| panic!("no calibration line: {err}"));
    assert!(line.contains("4 batches") && line.contains("scale starts: "), "{line}");
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("qatc.json")).unwrap()).unwrap();
    assert_eq!(cfg["train"]["scale_init"], "auto");
    let chosen = cfg["train"]["scale_starts"]["chosen"].as_object().unwrap();
    assert_eq!(chosen.len(), 8, "the tiny model's two blocks of four linears: {chosen:?}");
    // the printed counts are the saved choices'
    let mut printed = 0;
    for (init, word) in [("activation", "activation-aware"), ("search", "weight search"), ("minmax", "min-max")] {
        let n = chosen.values().filter(|v| v.as_str() == Some(init)).count();
        if n > 0 {
            assert!(line.contains(&format!("{n} {word}")), "{line} against {chosen:?}");
        }
        printed += n;
    }
    assert_eq!(printed, 8, "{chosen:?}");
    // a resumed run keeps its scales from its state: no calibration, the choice still saved
    let mut more = args("2");
    more.extend(["--resume", o]);
    let (_, err) = qatc(&more);
    assert!(!err.contains("calibrate: "), "{err}");
    let again: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("qatc.json")).unwrap()).unwrap();
    assert_eq!(again["train"]["scale_starts"], cfg["train"]["scale_starts"]);
    // an explicit start keeps its old behaviour: no calibration, nothing more saved
    let plain = dir.path().join("minmax");
    let mut a = args("1");
    let at = a.iter().position(|s| *s == o).unwrap();
    a[at] = plain.to_str().unwrap();
    a.extend(["--scale-init", "minmax"]);
    let (_, err) = qatc(&a);
    assert!(!err.contains("calibrate: "), "{err}");
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(plain.join("qatc.json")).unwrap()).unwrap();
    assert_eq!((cfg["train"]["scale_init"].as_str(), cfg["train"].get("scale_starts")), (Some("minmax"), None));
    // such a run (as every run before auto) resumed without --scale-init, now auto by default:
    // the saved minmax holds, nothing calibrates
    let mut r = a[..a.len() - 2].to_vec();
    r.extend(["--resume", plain.to_str().unwrap()]);
    let (_, err) = qatc(&r);
    assert!(!err.contains("calibrate: "), "{err}");
}
