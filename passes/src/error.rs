use qatc_ir::{Expired, IrError};
use thiserror::Error;

use crate::pipeline::Stage;

#[derive(Debug, Error)]
pub enum PassError {
    /// A pass built an ill-typed node, or the verifier rejected its output.
    #[error("pass {pass}: {error}")]
    Ir { pass: Stage, error: IrError },
    #[error("pass {pass}: {msg}")]
    Invalid { pass: Stage, msg: String },
    /// The compile budget ran out (`qatc_ir::Deadline`).
    #[error(transparent)]
    Expired(#[from] Expired),
    #[error("autodiff: no gradient rule for {op} (node {node}); it cannot lie between a trainable input and the loss")]
    NoRule { op: &'static str, node: String },
}

/// Adds the pass name to IR errors raised inside a pass body.
pub(crate) trait InPass<T> {
    fn in_pass(self, pass: Stage) -> Result<T, PassError>;
}

impl<T> InPass<T> for Result<T, IrError> {
    fn in_pass(self, pass: Stage) -> Result<T, PassError> {
        self.map_err(|source| PassError::Ir { pass, error: source })
    }
}
