//! One op computed by a kernel of its own (a row op, a reduction across rows, scatter_add): where
//! its value is stored, and its store through an elementwise epilogue. `rows.rs`, `reduce.rs` and
//! `scatter.rs` each lower some of these ops; `fused.rs` says which lowers which.

use qatc_ir::NodeId;

use super::builder::{pos_key, round_to, KernelBuilder, Pos};
use crate::error::KernelError;
use crate::kir::Expr;
use crate::program::View;

/// One op computed by a kernel of its own: where it stores, and the elementwise epilogue (a node
/// of the same shape reading this one at the same position) applied before the store.
pub struct Anchor {
    pub node: NodeId,
    pub dest: View,
    pub epilogue: Option<NodeId>,
    pub family: String,
}

/// Stores `y`, the anchor's value at `pos`, through the epilogue if there is one.
pub fn emit_out(kb: &mut KernelBuilder, a: &Anchor, pos: Pos, y: Expr) -> Result<(), KernelError> {
    let v = match a.epilogue {
        Some(root) => {
            // the epilogue reads the anchor's value as the interpreter holds it: rounded to its type
            let y = round_to(kb.src.g.ty(a.node).dtype, y);
            kb.subst.insert(pos_key(a.node, &pos), y);
            kb.value(root, &pos)?
        }
        None => y,
    };
    kb.store_view(&a.dest, &pos, v);
    Ok(())
}
