//! qatc's intermediate representation: a graph of tensor ops with static shapes.
//!
//! - [`types`]: element types, shapes.
//! - [`op`]: the closed op set; [`kind`]: op kinds and the one table of their properties
//!   (fusion's language and lists are derived from it); [`family`]: fused kernels' families.
//! - [`qmap`]: the 8-bit blockwise dynamic quantization maps (8-bit AdamW's moments).
//! - [`graph`]: the graph (on petgraph, kept private) and its builder.
//! - [`infer`] / [`verify`]: type inference and the verifier.
//! - [`text`]: the printer and the parser of the text format.
//! - [`deadline`]: the compile budget every long stage is handed.
//! - [`role`]: what a value is for memory accounting (category, phase): the one rule.

pub mod collective;
pub mod deadline;
pub mod error;
pub mod family;
pub mod graph;
pub mod infer;
pub mod kind;
pub mod op;
pub mod qmap;
pub mod quant;
pub mod role;
pub mod text;
pub mod types;
pub mod verify;

pub use collective::Reduce;
pub use deadline::{Deadline, Expired};
pub use error::IrError;
pub use family::{Anchor, Epilogue, GemmFamily, GemmPrologue, KernelFamily, UnknownFamily};
pub use graph::{Graph, Node, NodeId, Output};
pub use kind::{CostClass, Fusion, OpKind, OpProps, Recompute};
pub use op::{Attr, BinaryOp, InputKind, Op, QuantParam, QuantScheme, QuantSpec, UnaryOp, NF4};
pub use qmap::DynMap;
pub use quant::{Grid, Points, ScaleRule};
pub use role::{Category, Phase, Role, Roles};
pub use text::{parse, print};
pub use types::{DType, Shape, TensorType};
pub use verify::verify;
