//! The pattern a `cross_entropy.linear` body must be for the chunked lowering (`xent.rs`): the
//! head (logits = h @ W^T, the loss, and when training the logits' gradient and the GEMMs that
//! consume it), the pack of its results, whether the vocabulary is walked in tiles, and the rows
//! per chunk. Read before lowering too: the planner asks how a step would be chunked
//! ([`planned`]) before it lowers anything.

use qatc_ir::{DType, Graph, NodeId, Op};

use super::{pack_parts, unreshaped, LowerOptions};

/// The most chunks one cross-entropy is split into (each launch passes its first row in a
/// buffer of its own, all filled by one kernel with a param per chunk).
pub const MAX_CHUNKS: usize = 256;

/// What a `cross_entropy.linear` body computes, found by shape: logits = h @ W^T, the loss, and
/// when training the logits' gradient and the GEMMs consuming it.
pub(super) struct Head {
    pub(super) logits: NodeId,
    pub(super) h: NodeId,
    pub(super) w: NodeId,
    pub(super) loss: NodeId,
    pub(super) targets: NodeId,
    /// The rows' weights of a weighted cross-entropy (instruction data), else the mean's 1/N.
    pub(super) weights: Option<NodeId>,
    pub(super) grad: Option<NodeId>,
    pub(super) dloss: Option<NodeId>,
    /// Consumers of the gradient: (matmul node, accumulates over the rows).
    pub(super) products: Vec<(NodeId, bool)>,
}

pub(super) fn find(body: &Graph, is_leaf: impl Fn(NodeId) -> bool) -> Option<Head> {
    let ids = body.node_ids();
    let kind = |n: NodeId| &body.node(n).op;
    let loss = ids.iter().copied().find(|&n| matches!(kind(n), Op::CrossEntropy | Op::WeightedCrossEntropy))?;
    let (logits, targets, weights) = match body.operands(loss)[..] {
        [l, t] => (l, t, None),
        [l, t, w] => (l, t, Some(w)),
        _ => return None,
    };
    let Op::MatMul { ta: false, tb: true } = kind(logits) else { return None };
    let [h, w] = body.operands(logits)[..] else { return None };
    if !is_leaf(h) || !is_leaf(w) || body.ty(logits).shape.0.len() != 2 {
        return None;
    }
    let grads: Vec<NodeId> =
        ids.iter().copied().filter(|&n| matches!(kind(n), Op::CrossEntropyGrad | Op::WeightedCrossEntropyGrad)).collect();
    let mut head = Head { logits, h, w, loss, targets, weights, grad: None, dloss: None, products: Vec::new() };
    // the logits feed the loss (and its gradient) only: they are never needed whole
    if body.users(logits).iter().any(|&u| u != loss && !grads.contains(&u)) {
        return None;
    }
    match grads[..] {
        [] => {}
        [g] => {
            // the loss's operands, then dloss
            let ops = body.operands(g);
            let (&d, args) = ops.split_last()?;
            if args != body.operands(loss) {
                return None;
            }
            head.grad = Some(g);
            head.dloss = Some(d);
            for u in body.users(g) {
                let ops = body.operands(u);
                match (kind(u), &ops[..]) {
                    // dh = dlogits @ X: chunk c's rows of the result
                    (Op::MatMul { ta: false, tb: _ }, [a, x]) if *a == g && *x != g && is_leaf(*x) => head.products.push((u, false)),
                    // dW = dlogits^T @ h: a sum over the rows, chunk by chunk
                    (Op::MatMul { ta: true, tb: false }, [a, x]) if *a == g && *x == h => head.products.push((u, true)),
                    _ => return None,
                }
            }
        }
        _ => return None,
    }
    Some(head)
}

/// The value a pack part stands for under a widening cast (`finish_pack_widened`: a 16-bit
/// result cast to the f32 pack), else the part itself.
fn widened(body: &Graph, p: NodeId) -> NodeId {
    match body.node(p).op {
        Op::Cast { to: DType::F32 } => body.operands(p)[0],
        _ => p,
    }
}

/// Whether the head's vocabulary is walked in tiles (`xent_online.rs`): a frozen head (dh the one
/// product, W its operand as stored) or a forward alone (evaluation), on one thread per row, with
/// f32 logits (the tiles hold f32 logits, which 16-bit logits are not).
pub(super) fn online(body: &Graph, head: &Head, options: &LowerOptions) -> bool {
    let frozen = head.grad.is_some()
        && matches!(head.products[..], [(p, false)] if body.operands(p).get(1) == Some(&head.w)
            && matches!(body.node(p).op, Op::MatMul { tb: false, .. }));
    let forward = head.grad.is_none() && head.products.is_empty();
    options.sequential_rows && body.ty(head.logits).dtype == DType::F32 && (frozen || forward)
}

/// How the lowering under `options` would chunk `g`'s cross-entropy, read off the graph before
/// lowering it (the planner's chunk-size choice starts from it): its rows, the fusion rule's rows
/// per chunk as the lowering takes them (the floor), and whether it walks the vocabulary in tiles.
/// None where `g` has no `cross_entropy.linear` node, or its body is not the pattern the
/// lowering knows (its inputs taken for the operands they stand for; the lowering has the last
/// word).
pub fn planned(g: &Graph, options: &LowerOptions) -> Option<Planned> {
    let (body, rule_rows) = g.node_ids().into_iter().find_map(|n| match &g.node(n).op {
        Op::Kernel { family: qatc_ir::KernelFamily::CrossEntropyLinear { chunk_rows }, body } => Some((body, *chunk_rows)),
        _ => None,
    })?;
    let head = find(body, |n| matches!(body.node(n).op, Op::Input { .. }))?;
    let rows = *body.ty(head.logits).shape.0.first()?;
    Some(Planned { rows, floor: rows_per_chunk(rows, rule_rows), online: online(body, &head, options) })
}

/// [`planned`]'s answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Planned {
    pub rows: usize,
    pub floor: usize,
    pub online: bool,
}

/// The rows per chunk of `rows` when `chunk_rows` are asked for: within [1, rows], and no more
/// than `MAX_CHUNKS` chunks.
pub(super) fn rows_per_chunk(rows: usize, chunk_rows: usize) -> usize {
    chunk_rows.clamp(1, rows.max(1)).max(rows.div_ceil(MAX_CHUNKS))
}

/// The node's value as (part, start, length) along the pack's axis 0: the loss itself, or a pack
/// of the loss and the gradient products; None when it holds anything else, or leaves a product
/// out.
pub(super) fn packed(body: &Graph, root: NodeId, head: &Head) -> Option<Vec<(NodeId, usize, usize)>> {
    let parts: Vec<(NodeId, usize, usize)> = match &body.node(root).op {
        _ if root == head.loss => vec![(head.loss, 0, 1)],
        Op::Concat { axis: 0 } => {
            pack_parts(body, root).into_iter().map(|(p, start, len)| (widened(body, unreshaped(body, p)), start, len)).collect()
        }
        _ => return None,
    };
    let known = |n: NodeId| n == head.loss || head.products.iter().any(|(p, _)| *p == n);
    if !parts.iter().all(|&(n, _, _)| known(n)) || head.products.iter().any(|(p, _)| !parts.iter().any(|q| q.0 == *p)) {
        return None;
    }
    Some(parts)
}
