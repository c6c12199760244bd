use thiserror::Error;

/// Errors of the IR crate. Each names the node (by name when it has one, else by op) so a message
/// can be traced back to the checkpoint tensor or pass that produced it.
#[derive(Debug, Error, PartialEq)]
pub enum IrError {
    #[error("node {node}: {msg}")]
    Type { node: String, msg: String },
    #[error("input {0:?} is declared twice")]
    DuplicateInput(String),
    #[error("output {0:?} is declared twice")]
    DuplicateOutput(String),
    #[error("update target {0:?} is not a trainable or state input")]
    BadUpdateTarget(String),
    #[error("update of {name:?}: value type {got} differs from the input's {want}")]
    UpdateType { name: String, got: String, want: String },
    #[error("unknown node id {0}")]
    UnknownNode(u32),
    #[error("the graph has a cycle through node {0}")]
    Cycle(String),
    #[error("line {line}: {msg}")]
    Parse { line: usize, msg: String },
}
