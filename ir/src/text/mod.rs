//! The text format: deterministic, human-readable, and parsed back exactly
//! (`print(parse(print(g))) == print(g)`).
//!
//! ```text
//! graph "tiny" {
//!   %0 = input[kind=frozen] : f32[97, 64] "wte.weight"
//!   %1 = input[kind=data] : i32[2, 16] "ids"
//!   %2 = gather(%0, %1) : f32[2, 16, 64]
//!   output "loss" = %40
//!   update "h.0.attn.c_attn.lora_A" = %77
//! }
//! ```
//! Nodes are numbered in the graph's topological order (see `Graph::topo_order`), attributes
//! print in a fixed order, floats in Rust's shortest round-trip form, names as escaped strings.

pub mod affine;
mod parse;
mod print;

pub use affine::AffineText;
pub use parse::parse;
pub use print::print;
