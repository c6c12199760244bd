//! Any bytes as a checkpoint: `Checkpoint::open` must return an error or a checkpoint whose every
//! tensor converts, and config inference and validation must not panic either.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use qatc::frontend::checkpoint::Checkpoint;
use qatc::frontend::config::Gpt2Config;

/// One directory per fuzzing process, reused, in memory (/dev/shm) where there is one: the
/// target would otherwise mostly measure the disk. It holds no config.json, so
/// `Gpt2Config::load` takes the inference path.
fn dir() -> &'static tempfile::TempDir {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir_in("/dev/shm").or_else(|_| tempfile::tempdir()).expect("temp dir for the fuzz input"))
}

fuzz_target!(|data: &[u8]| {
    let path = dir().path().join("model.safetensors");
    std::fs::write(&path, data).expect("write the fuzz input");
    let Ok(ckpt) = Checkpoint::open(&path) else { return };
    let mut bytes = 0;
    for name in ckpt.names() {
        let info = ckpt.info(name).expect("listed names have info");
        let v = ckpt.to_f32(name).expect("listed tensors convert");
        assert_eq!(v.len(), info.shape.iter().product::<usize>());
        bytes += ckpt.raw_bytes(name).expect("listed tensors have bytes").len();
    }
    assert_eq!(bytes, ckpt.stored_bytes());
    if let Ok((cfg, _, _)) = Gpt2Config::load(&ckpt) {
        let _ = cfg.validate(&ckpt);
        let _ = cfg.param_count();
    }
    // Inference needs n_embd % 64 == 0, which seeds small enough to fuzz fast do not have; so
    // also validate against the seeds' own config, to reach every shape check.
    let _ = tiny().validate(&ckpt);
});

fn tiny() -> &'static Gpt2Config {
    static CFG: OnceLock<Gpt2Config> = OnceLock::new();
    CFG.get_or_init(|| Gpt2Config { n_embd: 8, n_layer: 1, n_head: 2, n_positions: 4, vocab_size: 11, layer_norm_epsilon: 1e-5 })
}
