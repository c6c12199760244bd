//! Every checkpoint layout GPT-2 comes in on the Hub, as PyTorch and transformers write them
//! (`tests/fixtures/gen_checkpoint_fixtures.py`, from the tiny model): `pytorch_model.bin` (with
//! and without `transformer.` and `lm_head`, the old mask buffers, bf16, a strided view), sharded
//! safetensors and sharded `.bin` through their index, each file or its directory. Each holds the
//! tiny model's tensors exactly (bf16: rounded to nearest even), and `qatc eval` gives the same
//! loss as from `model.safetensors`. Hostile files get one line and exit code 2, and the pickle
//! that would run a shell command runs nothing.

mod common;

use std::path::PathBuf;

use common::cli::{qatc, refused};
use qatc::model::Model;

fn fixture(rel: &str) -> PathBuf {
    common::fixture(&format!("checkpoints/{rel}"))
}

fn reference() -> Model {
    Model::open(&common::fixture("tiny/f32_prefix/model.safetensors")).unwrap()
}

/// Every layout's tensors, bit for bit against the safetensors reference.
#[test]
fn every_layout_holds_the_models_tensors() {
    let want = reference();
    let layouts = [
        ("bin/pytorch_model.bin", false),
        ("bin", false),
        ("bin_old/pytorch_model.bin", false),
        ("bin_views/pytorch_model.bin", false),
        ("bin_bf16/pytorch_model.bin", true),
        ("sharded", false),
        ("sharded/model.safetensors.index.json", false),
        ("sharded_bin/pytorch_model.bin.index.json", false),
        ("sharded_bin", false),
    ];
    for (rel, bf16) in layouts {
        let m = Model::open(&fixture(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
        assert_eq!(m.cfg, want.cfg, "{rel}: the config beside it");
        let names: Vec<&str> = m.ckpt.names().into_iter().filter(|n| *n != "lm_head.weight").collect();
        assert_eq!(names, want.ckpt.names(), "{rel}: the same tensors");
        for name in names {
            let (got, w) = (m.ckpt.to_f32(name).unwrap(), want.ckpt.to_f32(name).unwrap());
            let w: Vec<f32> = if bf16 { w.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect() } else { w };
            assert!(got.iter().zip(&w).all(|(a, b)| a.to_bits() == b.to_bits()), "{rel}: {name} differs");
        }
        if let Some(head) = m.ckpt.info("lm_head.weight") {
            assert_eq!(m.ckpt.to_f32("lm_head.weight").unwrap(), m.ckpt.to_f32("wte.weight").unwrap(), "{rel}: the tied head");
            assert_eq!(head.key, "lm_head.weight");
        }
    }
}

/// `qatc eval` on each layout gives the loss it gives on `model.safetensors`, to the bit.
#[test]
fn eval_reads_every_layout_as_the_safetensors_file() {
    let data = common::fixture("tiny/tokens.bin");
    let loss = |model: &PathBuf| {
        let args =
            ["eval", model.to_str().unwrap(), "--data", data.to_str().unwrap(), "--batch", "2", "--seq", "16", "--batches", "2", "--json"];
        let o = qatc(&args);
        assert!(o.status.success(), "{}: {}", model.display(), String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["loss"].as_f64().unwrap()
    };
    let want = loss(&common::fixture("tiny/f32_prefix/model.safetensors"));
    for rel in ["bin", "bin_old/pytorch_model.bin", "bin_views/pytorch_model.bin", "sharded", "sharded_bin"] {
        assert_eq!(loss(&fixture(rel)).to_bits(), want.to_bits(), "{rel}");
    }
}

/// A pickle that calls anything but a state dict's constructors, a truncated archive, a storage
/// shorter than its tensor, PyTorch's legacy format, a missing shard, a directory without a
/// checkpoint: one line naming the file and the reason, exit code 2, and nothing run.
#[test]
fn hostile_and_broken_files_are_refused_in_one_line() {
    let pwned = std::path::Path::new("/tmp/qatc-pwned");
    let _ = std::fs::remove_file(pwned);
    let data = common::fixture("tiny/tokens.bin");
    let empty = tempfile::tempdir().unwrap();
    let cases = [
        (fixture("evil/call.bin"), "posix.system"),
        (fixture("evil/truncated.bin"), "truncated"),
        (fixture("evil/short_storage.bin"), "storage 0 holds"),
        (fixture("evil/legacy.bin"), "legacy format"),
        (fixture("evil/shard_missing/model.safetensors.index.json"), "model-00002-of-00004.safetensors, which is not there"),
        (empty.path().to_path_buf(), "pytorch_model.bin.index.json"),
    ];
    for (path, why) in cases {
        let o = qatc(&["eval", path.to_str().unwrap(), "--data", data.to_str().unwrap(), "--batch", "2", "--seq", "16"]);
        let line = refused(&o);
        assert!(line.contains(path.file_name().unwrap().to_str().unwrap()) && line.contains(why), "{}: {line}", path.display());
    }
    assert!(!pwned.exists(), "the hostile pickle ran");
}
