//! Every kernel of the training step compiles through NVRTC for sm_80 and sm_90: the tiny
//! 1-layer model and GPT-2 124M (4-bit + LoRA, B 1, T 64), unfused and as egg fusion leaves it. No GPU is needed, only the NVRTC
//! library: `make test` installs the PyPI wheel `nvidia-cuda-nvrtc` into `.deps/` and points
//! QATC_NVRTC_LIB at it. Without any NVRTC these tests say why and pass as skipped.
//! Sources are written to `target/nvrtc-kernels/<model>/` so a failure names a file to open.

use std::path::PathBuf;

use qatc::frontend::config::Gpt2Config;
use qatc::step::{self, StepOptions};
use qatc_ir::{QuantScheme, QuantSpec};
use qatc_kernels::nvrtc::{Arch, Nvrtc};
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::LoraOptions;
use qatc_passes::quant::QuantOptions;

fn nvrtc() -> Option<Nvrtc> {
    // an explicit path wins; else the wheel `make test` installs; else the loader's path
    let wheel = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".deps/nvrtc/nvidia/cu13/lib/libnvrtc.so.13");
    let from_env = std::env::var_os("QATC_NVRTC_LIB").filter(|v| !v.is_empty()).map(PathBuf::from);
    let lib = from_env.or_else(|| wheel.exists().then_some(wheel));
    match Nvrtc::open_with(lib.as_deref()) {
        Ok(n) => Some(n),
        // CI installs it (`make test`), so there a missing library is a failure, not a skip
        Err(e) if std::env::var_os("CI").is_some() => panic!("CI must have NVRTC: {e}"),
        Err(e) => {
            eprintln!("SKIPPED: {e}");
            None
        }
    }
}

fn qlora(b: usize, t: usize, r: usize) -> StepOptions {
    let mut o = StepOptions::new(b, t);
    o.model.full_finetune = false;
    o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 64, scheme: QuantScheme::Sym }));
    o.model.lora = Some(LoraOptions::new(r));
    o
}

/// Lowers the step, writes its kernels, compiles each for both architectures; returns
/// (distinct kernels, launches, chunked cross-entropies).
fn compile_all(nv: &Nvrtc, name: &str, cfg: &Gpt2Config, o: &StepOptions) -> (usize, usize, usize) {
    let (g, _) = step::train(cfg, o, |_, _| {}).expect("the step builds");
    let (prog, kernels) = qatc_kernels::cuda_kernels(&g).expect("the step lowers");
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/nvrtc-kernels").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    let paths = qatc_kernels::write_cuda(&dir, &kernels).expect("sources written");
    // two threads: NVRTC compiles independent programs concurrently
    let chunks: Vec<_> = kernels.iter().zip(&paths).collect();
    let failures: Vec<String> = std::thread::scope(|s| {
        let half = chunks.len().div_ceil(2).max(1);
        let handles: Vec<_> = chunks
            .chunks(half)
            .map(|part| {
                let dir = &dir;
                s.spawn(move || {
                    let mut errs = Vec::new();
                    for (k, path) in part {
                        for arch in Arch::ALL {
                            if let Err(e) = nv.compile(k, arch, dir, path) {
                                errs.push(e.to_string());
                            }
                        }
                    }
                    errs
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap_or_else(|_| vec!["a compile thread panicked".into()])).collect()
    });
    assert!(failures.is_empty(), "{} of {} compiles failed:\n{}", failures.len(), 2 * kernels.len(), failures.join("\n\n"));
    eprintln!(
        "{name}: {} kernels compiled for sm_80 and sm_90 (NVRTC {}.{}), {} launches, {} GEMMs; sources in {}",
        kernels.len(),
        nv.version.0,
        nv.version.1,
        prog.launches(),
        prog.gemms().count(),
        dir.display()
    );
    (kernels.len(), prog.launches(), prog.cross_entropy.len())
}

#[test]
fn every_kernel_of_the_tiny_step_compiles() {
    let Some(nv) = nvrtc() else { return };
    let tiny = Gpt2Config { n_embd: 8, n_layer: 1, n_head: 2, n_positions: 8, vocab_size: 11, layer_norm_epsilon: 1e-5 };
    let mut o = StepOptions::new(1, 4);
    o.clip = Some(1.0);
    let (n, _, _) = compile_all(&nv, "tiny-full", &tiny, &o);
    assert!(n > 10);
    // fused, 32 rows of logits against a width of 8: the chunked linear + cross-entropy, with
    // the head's gradient accumulated chunk by chunk
    let mut f = StepOptions::new(4, 8);
    f.fuse = Some(FuseOptions::default());
    let (_, _, chunked) = compile_all(&nv, "tiny-full-fused", &tiny, &f);
    assert_eq!(chunked, 1, "the fused full fine-tune chunks its cross-entropy");
    let mut q = qlora(1, 4, 2);
    q.model.quant.as_mut().expect("set above").spec.group = 4;
    compile_all(&nv, "tiny-qlora", &tiny, &q);
    q.fuse = Some(FuseOptions::default());
    compile_all(&nv, "tiny-qlora-fused", &tiny, &q);
}

#[test]
fn every_kernel_of_the_gpt2_124m_step_compiles() {
    let Some(nv) = nvrtc() else { return };
    let cfg = Gpt2Config::preset("124M").expect("a preset");
    let (n, launches, _) = compile_all(&nv, "gpt2-124m", &cfg, &qlora(1, 64, 16));
    assert!(launches > n, "layers share kernels");
    // and as egg fusion leaves it: fused kernels, flash attention forward and backward
    let mut o = qlora(1, 64, 16);
    o.fuse = Some(FuseOptions::default());
    let (_, _, chunked) = compile_all(&nv, "gpt2-124m-fused", &cfg, &o);
    assert_eq!(chunked, 1, "the fused step chunks its cross-entropy (the logits never whole)");
}

#[test]
fn a_compile_error_shows_the_log_and_the_source_path() {
    let Some(nv) = nvrtc() else { return };
    let k = qatc_kernels::CudaKernel {
        name: "broken".into(),
        family: "test".into(),
        source: "extern \"C\" __global__ void broken() { undefined_thing(); }\n".into(),
        launch: qatc_kernels::cuda::LaunchDims { grid: [1, 1, 1], block: 32 },
    };
    let dir = std::env::temp_dir();
    let err = nv.compile(&k, Arch::Sm80, &dir, &dir.join("broken.cu")).expect_err("does not compile").to_string();
    assert!(err.contains("broken.cu") && err.contains("undefined_thing"), "{err}");
}

/// `--precision bf16|fp16`: the step's kernels load f16/bf16 buffers widened to f32 and store
/// them rounded to nearest even (`qatc_common.cuh`), and loss scaling's kernels (all_finite,
/// select, loss_scale) compile too.
#[test]
fn every_kernel_of_the_bf16_and_fp16_steps_compiles() {
    let Some(nv) = nvrtc() else { return };
    let tiny = Gpt2Config { n_embd: 8, n_layer: 1, n_head: 2, n_positions: 8, vocab_size: 11, layer_norm_epsilon: 1e-5 };
    for p in [qatc_passes::precision::Precision::Bf16, qatc_passes::precision::Precision::Fp16] {
        let mut q = qlora(1, 4, 2);
        q.model.quant.as_mut().expect("set above").spec.group = 4;
        q.clip = Some(1.0);
        q.precision = p;
        q.fuse = Some(FuseOptions::default());
        compile_all(&nv, &format!("tiny-qlora-{p}-fused"), &tiny, &q);
    }
    // unfused, full fine-tune: every op's kernel on its own, the embedding gradient's f32 sums
    let mut f = StepOptions::new(1, 4);
    f.precision = qatc_passes::precision::Precision::Bf16;
    compile_all(&nv, "tiny-full-bf16", &tiny, &f);
}
