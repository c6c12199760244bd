//! The GPU for the tests that need one: the driver and NVRTC, or a skip that says why.

use std::collections::HashMap;

use qatc::data::TokenFile;
use qatc::model::Model;
use qatc::step::StepOptions;
use qatc::trainer::Trainer;
use qatc_ir::{QuantScheme, QuantSpec};
use qatc_kernels::cuda::blas::{self, BlasMode, BlasPlan};
use qatc_kernels::kir::Kernel;
use qatc_kernels::nvrtc::Nvrtc;
use qatc_kernels::Program;
use qatc_kernels::Step;
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::{LoraOptions, DROPOUT_SEED};
use qatc_passes::quant::QuantOptions;
use qatc_runtime::cuda::{CudaDriver, DevPtr, GpuApi, KernelImage, PlanFuncs};
use qatc_runtime::Value;

/// Whether a missing GPU fails the test instead of skipping it: `QATC_REQUIRE_GPU=1`, which
/// `bench/gpu.sh` sets on the GPU machine, where a driver, cuBLAS or NVRTC that does not load is
/// a finding, not a reason to print SKIPPED and pass.
pub fn gpu_required() -> bool {
    std::env::var_os("QATC_REQUIRE_GPU").is_some_and(|v| v == "1")
}

/// None with the reason printed, or (`required`) a failure naming the setting.
pub fn skip_or_fail<T>(required: bool, why: &str) -> Option<T> {
    assert!(!required, "QATC_REQUIRE_GPU=1, but {why}");
    eprintln!("SKIPPED (no GPU): {why}");
    None
}

/// The GPU and NVRTC, or None with the reason printed (the tests that need a GPU skip so,
/// unless `gpu_required`).
pub fn gpu() -> Option<(CudaDriver, Nvrtc)> {
    let g = match CudaDriver::open(0) {
        Ok(g) => g,
        Err(e) => return skip_or_fail(gpu_required(), &format!("the CUDA driver did not open: {e}")),
    };
    let Some(nv) = super::nvrtc::nvrtc() else {
        return skip_or_fail(gpu_required(), "a GPU is present but NVRTC did not load");
    };
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

/// A step's program and trainer, on a model and token file from the repository.
pub fn setup(model: &str, tokens: &str, o: StepOptions) -> (Program, Trainer, TokenFile) {
    let m = Model::open(&super::root().join(model)).expect("the model");
    let data = TokenFile::open(&super::root().join(tokens)).expect("tokens");
    let tr = Trainer::new(&m, o, None, 3).expect("a trainer");
    let prog = qatc_kernels::lower(&tr.graph).expect("lowers");
    (prog, tr, data)
}

/// The inputs of step `s`: the state, batch s, a dropout seed, a learning rate.
pub fn inputs(state: &HashMap<String, Value<f32>>, data: &TokenFile, o: &StepOptions, s: usize) -> HashMap<String, Value<f32>> {
    let mut v = state.clone();
    let (ids, targets) = data.batch(s, o.batch, o.seq).expect("a batch");
    v.insert("ids".into(), Value::ints([o.batch, o.seq], ids).expect("ids"));
    v.insert("targets".into(), Value::ints([o.batch, o.seq], targets).expect("targets"));
    v.insert(DROPOUT_SEED.into(), Value::ints([], vec![5 + s as i32]).expect("a seed"));
    v.insert("lr".into(), Value::scalar(1e-2));
    v
}

/// One GEMM step, ready: its plan, its data-move kernels loaded, its scratch.
pub struct PlannedGemm {
    pub plan: BlasPlan,
    pub moves: PlanFuncs,
    pub scratch: Vec<DevPtr>,
}

/// Each step of `prog` that is a GEMM planned (strict fp32 BLAS), its data moves loaded on
/// `gpu` as `image` makes them and its scratch allocated; None for a launch.
pub fn planned_gemms(gpu: &mut dyn GpuApi, prog: &Program, image: &dyn Fn(&Kernel) -> KernelImage) -> Vec<Option<PlannedGemm>> {
    let mut gemms = Vec::new();
    for step in &prog.steps {
        gemms.push(match step {
            Step::Gemm(g) => {
                let plan = blas::plan(g, &prog.buffers, BlasMode::Strict).expect("plans");
                let scratch = plan.scratch.iter().map(|(t, n)| gpu.alloc((t.bytes() * n).max(4)).expect("scratch")).collect();
                let moves = blas::move_kernels(&plan)
                    .iter()
                    .map(|m| {
                        let img = image(&m.kernel);
                        (m.step, gpu.load(&img).expect("loads"), img.launch.clone())
                    })
                    .collect();
                Some(PlannedGemm { plan, moves, scratch })
            }
            Step::Launch { .. } | Step::Collective(_) => None,
        });
    }
    gemms
}
