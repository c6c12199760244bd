//! Learned quantization scales (LSQ, `--scales learned`) against a PyTorch implementation of LSQ
//! (tests/fixtures/gen_qat_fixtures.py, `fake_quant_lsq`): one forward and backward of the tiny
//! model on batch 0, LoRA from `tiny_qat/adapter_init` (B non-zero), scales that clip some weights
//! and are not fp16 values, under sym 3-bit `--qat base`, nf4 `--qat merged` and asym 4-bit with
//! zero points. The loss must agree within 1e-5 and every gradient (scales, zero points, LoRA's A
//! and B) within 1e-4 relative (max |ours - torch| / max |torch|), as `parity_qat.rs` asks of LoRA.

mod common;

use qatc::adapter;
use qatc::cli::options::{model_options, QuantArgs};
use qatc::cli::train::Trainer;
use qatc::config::{Qat, Scales};
use qatc::data::TokenFile;
use qatc::model::Model;
use qatc::step::StepOptions;
use qatc_ir::QuantScheme;
use qatc_runtime::Tensor;

fn check(cfg: &str, bits: u8, group: usize, scheme: &str, qat: &str) {
    let fx = common::read_safetensors("tiny_qat/lsq_grads_step0.safetensors");
    let mut ad = adapter::read(&common::fixture("tiny_qat/adapter_init")).unwrap();
    for (key, t) in &fx {
        let Some(rest) = key.strip_prefix(&format!("{cfg}/")) else { continue };
        if let Some(name) = rest.strip_prefix("scales/").or_else(|| rest.strip_prefix("zeros/")) {
            ad.quant.insert(name.to_string(), Tensor { shape: t.shape.clone(), data: t.data.iter().map(|&v| v as f32).collect() });
        }
    }
    let zeros = if scheme == "asym" { 8 } else { 0 };
    assert_eq!(ad.quant.len(), 8 + zeros, "{cfg}: the fixture's scales");
    let q = QuantArgs {
        bits: Some(bits),
        group: Some(group),
        scheme: QuantScheme::from_name(scheme),
        qat: Some(<Qat as clap::ValueEnum>::from_str(qat, false).unwrap()),
        scales: Some(Scales::Learned),
        ..Default::default()
    };
    let mut o = StepOptions::new(2, 16);
    o.keep_grads = true;
    o.model = model_options(&q, Some(ad.options()), false, true).unwrap();
    let m = Model::open(&common::fixture("tiny/f32_prefix/model.safetensors")).unwrap();
    let mut tr = Trainer::new(&m, o, Some(&ad), 0).unwrap();
    let out = tr.step(&TokenFile::open(&common::fixture("tiny/tokens.bin")).unwrap(), 0, 1e-3).unwrap();
    let loss = out["loss"].as_float().unwrap().data[0] as f64;
    let want = fx[&format!("{cfg}/loss")].data[0];
    assert!((loss - want).abs() <= 1e-5, "{cfg}: loss {loss} vs torch {want}");
    let mut n = 0;
    for (key, w) in &fx {
        let Some(name) = key.strip_prefix(&format!("{cfg}/grad/")) else { continue };
        let g = out.get(&format!("grad:{name}")).unwrap_or_else(|| panic!("{cfg}: no gradient of {name}")).as_float().unwrap();
        assert_eq!(g.shape, w.shape, "{cfg}: grad of {name}");
        let ours: Vec<f64> = g.data.iter().map(|&v| v as f64).collect();
        let e = common::rel_err(&ours, &w.data);
        assert!(e <= 1e-4, "{cfg}: grad of {name}: {e:e} relative to torch");
        assert!(w.data.iter().any(|&v| v != 0.0), "{cfg}: torch's grad of {name} is all zero");
        n += 1;
    }
    // per linear: the scales (and zero points), A and B
    assert_eq!(n, 8 * 3 + zeros, "{cfg}: gradients compared");
}

#[test]
fn sym_3bit_scale_gradients_match_torch_lsq() {
    check("sym_b3_g16_base", 3, 16, "sym", "base");
}

#[test]
fn nf4_merged_gradients_match_torch_lsq() {
    check("nf4_b4_g16_merged", 4, 16, "nf4", "merged");
}

#[test]
fn asym_zero_point_gradients_match_torch_lsq() {
    check("asym_b4_g16_base", 4, 16, "asym", "base");
}
