//! Any bytes as a bit map (`--bits-map`, what `qatc prt` writes): reading must return an error or
//! a map whose every key is `h.LAYER.MODULE` and whose every quantization passes `QuantSpec`'s
//! checks; and fake-quantizing a tiny GPT-2 (1 layer, n_embd 8) with that map must return the
//! graph or an error naming the entry, never panic.
#![no_main]

use std::collections::BTreeMap;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use qatc::frontend::config::Gpt2Config;
use qatc_ir::{QuantScheme, QuantSpec};
use qatc_passes::quant::QuantOptions;

fn dir() -> &'static tempfile::TempDir {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir_in("/dev/shm").or_else(|_| tempfile::tempdir()).expect("temp dir for the fuzz input"))
}

fn forward() -> &'static qatc_ir::Graph {
    static G: OnceLock<qatc_ir::Graph> = OnceLock::new();
    G.get_or_init(|| {
        let cfg = Gpt2Config { n_embd: 8, n_layer: 1, n_head: 2, n_positions: 4, vocab_size: 11, layer_norm_epsilon: 1e-5 };
        qatc::step::forward(&cfg, 1, 4, false).expect("the tiny forward graph")
    })
}

fuzz_target!(|data: &[u8]| {
    let path = dir().path().join("bits.json");
    std::fs::write(&path, data).expect("write the fuzz input");
    let Ok(map) = qatc::cli::options::read_bit_map(&path) else { return };
    for (m, spec) in &map {
        let (layer, module) = m.strip_prefix("h.").and_then(|r| r.split_once('.')).expect("h.LAYER.MODULE");
        assert!(layer.parse::<usize>().is_ok() && qatc_passes::linears::MODULES.contains(&module), "{m}");
        if let Some(s) = spec {
            s.check(if s.group == 0 { 64 } else { s.group }).expect("an accepted entry's bits and scheme fit");
        }
    }
    let per_module: BTreeMap<String, Option<QuantSpec>> = map;
    let o = QuantOptions {
        spec: QuantSpec { bits: 4, group: 8, scheme: QuantScheme::Sym },
        targets: vec![],
        per_module,
        act_bits: None,
        per_module_source: Some(path.display().to_string()),
    };
    let _ = qatc_passes::quant::fake_quant(forward().clone(), &o);
});
