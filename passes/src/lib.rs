//! qatc's passes. A pass is a function over the graph that returns a [`PassReport`]; the
//! pipeline ([`pipeline::STAGES`], run by [`pipeline::run`]) is one table of them, top to
//! bottom, and verifies the graph after each, naming the stage that broke an invariant.
//!
//! Passes of the training step, in pipeline order:
//! - [`quant::fake_quant`]: FakeQuant on targeted weights (straight-through estimator);
//! - [`lora`]: LoRA branches (PEFT semantics) with trainable A and B;
//! - [`quant::fold`]: frozen FakeQuant -> packed 4-bit codes + Dequantize (bit-identical);
//! - [`microbatch`]: unrolls K micro-batches for gradient accumulation;
//! - [`autodiff`]: reverse-mode gradients of `loss` for the trainable inputs (a rule table);
//! - [`data_parallel`]: gradients averaged over ranks in buckets (ZeRO 1+: reduce-scattered);
//! - [`zero::zero3`]: ZeRO 3, each trainable weight a block gathered before each use;
//! - [`optim::clip`]: global-norm gradient clipping;
//! - [`optim::adamw`]: the AdamW update, with moments and the step count as graph state;
//! - [`precision::precision`]: bf16/fp16 storage with f32 masters, fp16 loss scaling;
//! - [`fusion::fuse`]: kernel fusion by equality saturation (egg), last.

pub mod autodiff;
pub mod data_parallel;
pub mod error;
pub mod fusion;
pub mod linears;
pub mod lora;
pub mod microbatch;
pub mod optim;
pub mod pipeline;
pub mod plan;
pub mod precision;
pub mod quant;
mod rebuild;
pub mod remat;
pub mod zero;

pub use error::PassError;
pub use pipeline::{PassReport, PipelineOptions, Stage};
