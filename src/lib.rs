//! qatc: compiles a Hugging Face GPT-2 checkpoint into a training step for quantization-aware
//! LoRA fine-tuning. This crate is the orchestration layer: the GPT-2 frontend, token data, the
//! pipeline of passes (`step`), artifacts, and the commands behind the `qatc` binary.

pub mod adapter;
pub mod artifacts;
pub mod batches;
pub mod bitalloc;
pub mod calibrate;
pub mod cli;
pub mod config;
pub mod data;
pub mod export;
pub mod finite;
pub mod frontend;
pub mod input;
pub mod instruct;
pub mod manifest;
pub mod memory;
pub mod model;
pub mod plot;
pub mod sample;
pub mod schedule;
pub mod step;
pub mod tokenize;
pub mod trainer;
