//! qatc's intermediate representation: a graph of tensor ops with static shapes.
//!
//! - [`types`]: element types, shapes.
//! - [`op`]: the closed op set.
//! - [`graph`]: the graph (on petgraph, kept private) and its builder.
//! - [`infer`] / [`verify`]: type inference and the verifier.
//! - [`text`]: the printer and the parser of the text format.
//! - [`role`]: what a value is for memory accounting (category, phase): the one rule.

pub mod error;
pub mod graph;
pub mod infer;
pub mod op;
pub mod role;
pub mod text;
pub mod types;
pub mod verify;

pub use error::IrError;
pub use graph::{Graph, Node, NodeId, Output};
pub use op::{Attr, BinaryOp, InputKind, Op, QuantScheme, QuantSpec, UnaryOp, NF4};
pub use role::{Category, Phase, Role, Roles};
pub use text::{parse, print};
pub use types::{DType, Shape, TensorType};
pub use verify::verify;
