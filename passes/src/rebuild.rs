//! Copying nodes between graphs, for passes that build a new graph from an old one.

use std::collections::HashMap;

use qatc_ir::{Graph, IrError, NodeId, Op};

/// Copies the nodes of `src` in `order` into `dst`. Nodes already in `map` (e.g. shared inputs)
/// are reused; inputs not in `map` are created in `dst` under `rename(name)`.
pub(crate) fn copy_nodes(
    src: &Graph,
    dst: &mut Graph,
    order: &[NodeId],
    map: &mut HashMap<NodeId, NodeId>,
    rename: &dyn Fn(&str) -> String,
) -> Result<(), IrError> {
    for &n in order {
        if map.contains_key(&n) {
            continue;
        }
        let node = src.node(n);
        let ops = src
            .operands(n)
            .iter()
            .map(|o| map.get(o).copied().ok_or(IrError::UnknownNode(o.index() as u32)))
            .collect::<Result<Vec<NodeId>, IrError>>()?;
        let name = match (&node.op, &node.name) {
            (Op::Input { .. }, Some(name)) => Some(rename(name)),
            (_, name) => name.clone(),
        };
        let id = dst.add_node(node.op.clone(), &ops, name)?;
        map.insert(n, id);
    }
    Ok(())
}
