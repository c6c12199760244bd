//! The GPU for the tests that need one: the driver and NVRTC, or a skip that says why.

use qatc::step::StepOptions;
use qatc_ir::{QuantScheme, QuantSpec};
use qatc_kernels::nvrtc::Nvrtc;
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::LoraOptions;
use qatc_passes::quant::QuantOptions;
use qatc_runtime::cuda::{CudaDriver, GpuApi};

/// The GPU and NVRTC, or None with the reason printed (the tests that need a GPU skip so).
pub fn gpu() -> Option<(CudaDriver, Nvrtc)> {
    let g = match CudaDriver::open(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("SKIPPED (no GPU): {e}");
            return None;
        }
    };
    let nv = super::nvrtc::nvrtc()?;
    eprintln!("GPU: {} ({}; {}), NVRTC {}.{}", g.device().name, g.device().arch, g.device().libraries, nv.version.0, nv.version.1);
    Some((g, nv))
}

/// The fixtures the GPU tests step: (model, token file), paths from the repository's root.
pub const TINY: (&str, &str) = ("tests/fixtures/tiny/f32_prefix/model.safetensors", "tests/fixtures/tiny/tokens.bin");
pub const SHAKESPEARE: (&str, &str) = ("examples/gpt2-shakespeare-small/model.safetensors", "examples/shakespeare_train.bin");

/// The step the GPU tests compare: a full fine-tune, or (qlora) 4-bit sym g32 frozen linears with
/// LoRA r 4; fused or not; B x T; the gradients kept as outputs, so they are compared too.
pub fn options(qlora: bool, fuse: bool, b: usize, t: usize) -> StepOptions {
    let mut o = StepOptions::new(b, t);
    if qlora {
        o.model.full_finetune = false;
        o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 32, scheme: QuantScheme::Sym }));
        o.model.lora = Some(LoraOptions::new(4));
    }
    o.fuse = fuse.then(FuseOptions::default);
    o.keep_grads = true;
    o
}
