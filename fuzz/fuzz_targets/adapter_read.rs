//! Any bytes as a PEFT adapter directory: the first two bytes (little-endian) say how many of the
//! rest are `adapter_config.json`, the remainder is `adapter_model.safetensors`. Reading must
//! return an error or an adapter whose settings pass LoRA's own checks and whose every tensor is
//! a LoRA A [r, in] or B [out, r] weight of a configured target, with as many values as its shape
//! says, all finite (unless non-finite values were allowed, a second read that must not panic
//! either).
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use qatc_passes::linears;

/// One directory per fuzzing process, reused, in memory (/dev/shm) where there is one.
fn dir() -> &'static tempfile::TempDir {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir_in("/dev/shm").or_else(|_| tempfile::tempdir()).expect("temp dir for the fuzz input"))
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let n = (u16::from_le_bytes([data[0], data[1]]) as usize).min(data.len() - 2);
    let (config, model) = data[2..].split_at(n);
    let d = dir().path();
    std::fs::write(d.join("adapter_config.json"), config).expect("write the config");
    std::fs::write(d.join("adapter_model.safetensors"), model).expect("write the tensors");
    let _ = qatc::adapter::read_with(d, true);
    let Ok(a) = qatc::adapter::read(d) else { return };
    let o = a.options();
    o.check().expect("an adapter that reads passes LoRA's checks");
    assert!(o.alpha.is_finite() && o.alpha > 0.0 && o.r >= 1);
    for (name, t) in &a.tensors {
        let (module, rank_dim) = match (name.strip_suffix(".lora_A.weight"), name.strip_suffix(".lora_B.weight")) {
            (Some(m), _) => (m, 0),
            (_, Some(m)) => (m, 1),
            _ => panic!("{name} is not a LoRA weight"),
        };
        assert!(o.targets.iter().any(|t| linears::matches(module, t)), "{name} is not a configured target");
        assert_eq!(t.shape.len(), 2, "{name}");
        assert_eq!(t.shape[rank_dim], o.r, "{name}");
        assert_eq!(t.data.len(), t.shape.iter().product::<usize>(), "{name}");
        assert!(t.data.iter().all(|v| v.is_finite()), "{name} holds a non-finite value");
    }
});
