//! Every kernel of the training step compiles through the LLVM backend (O3, host CPU).

#![cfg(feature = "llvm")]

use qatc::frontend::config::Gpt2Config;
use qatc::step::{self, StepOptions};
use qatc_ir::{QuantScheme, QuantSpec};
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::LoraOptions;
use qatc_passes::quant::QuantOptions;

fn qlora(b: usize, t: usize, r: usize, group: usize) -> StepOptions {
    let mut o = StepOptions::new(b, t);
    o.model.full_finetune = false;
    o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group, scheme: QuantScheme::Sym }));
    o.model.lora = Some(LoraOptions::new(r));
    o
}

fn compile_all(cfg: &Gpt2Config, o: &StepOptions) -> usize {
    let (g, _) = step::train(cfg, o, |_, _| {}).expect("the step builds");
    let prog = qatc_kernels::lower(&g).expect("the step lowers");
    let t = std::time::Instant::now();
    let jit = qatc_kernels::llvm::Jit::compile(&prog.kernels).expect("every kernel compiles");
    eprintln!("{} kernels JIT-compiled in {:.2} s", jit.len(), t.elapsed().as_secs_f64());
    jit.len()
}

#[test]
fn every_kernel_of_the_tiny_step_compiles() {
    let tiny = Gpt2Config { n_embd: 8, n_layer: 1, n_head: 2, n_positions: 8, vocab_size: 11, layer_norm_epsilon: 1e-5 };
    let mut o = StepOptions::new(2, 8);
    o.model.full_finetune = true;
    assert!(compile_all(&tiny, &o) > 10);
    let mut q = qlora(2, 8, 4, 8);
    compile_all(&tiny, &q);
    q.fuse = Some(FuseOptions::default());
    compile_all(&tiny, &q);
}

#[test]
fn every_kernel_of_the_gpt2_124m_step_compiles() {
    let cfg = Gpt2Config::preset("124M").expect("a preset");
    let mut o = qlora(1, 64, 16, 64);
    o.fuse = Some(FuseOptions::default());
    compile_all(&cfg, &o);
}
