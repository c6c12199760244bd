//! Any bytes as a resume state (`checkpoint/state.safetensors`) for a fixed step (the tiny LoRA
//! step's persistent inputs: two adapters' A and B, their Adam moments, the step count). Reading
//! must return an error or exactly the wanted tensors, each with its shape's number of values,
//! all finite (and, with non-finite values allowed, must still not panic).
#![no_main]

use std::path::Path;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

fn want() -> &'static Vec<(String, Vec<usize>)> {
    static W: OnceLock<Vec<(String, Vec<usize>)>> = OnceLock::new();
    W.get_or_init(|| {
        let mut w = vec![("step".to_string(), vec![])];
        for l in 0..2 {
            for (t, s) in [("lora_A", vec![2, 8]), ("lora_B", vec![24, 2])] {
                let name = format!("h.{l}.attn.c_attn.{t}.weight");
                w.push((format!("adam.m:{name}"), s.clone()));
                w.push((format!("adam.v:{name}"), s.clone()));
                w.push((name, s));
            }
        }
        w
    })
}

fuzz_target!(|data: &[u8]| {
    let path = Path::new("checkpoint/state.safetensors");
    let _ = qatc::trainer::read_state(path, data, want(), true);
    let Ok(tensors) = qatc::trainer::read_state(path, data, want(), false) else { return };
    assert_eq!(tensors.len(), want().len());
    for ((name, t), (wname, shape)) in tensors.iter().zip(want()) {
        assert_eq!((name, &t.shape), (wname, shape));
        assert_eq!(t.data.len(), shape.iter().product::<usize>(), "{name}");
        assert!(t.data.iter().all(|v| v.is_finite()), "{name} holds a non-finite value");
    }
});
