//! The block chain of a GPT-2 training step, as the checkpoint policies see it.
//!
//! The forward of each micro-batch is a chain of stages: stage 0 is the embedding (ending in
//! the value named `embed`), stages 1..=L are the transformer blocks (block i ends in
//! `h.{i-1}.resid_mlp`, its output and the next block's input), and stage L+1 is the head
//! (ln_f, lm_head, the loss). Those stage outputs are the boundaries B_0..B_L. A forward node's
//! stage is the number of boundaries it depends on through the chain; values computed from
//! weights alone (dequantized weights, broadcast biases) take the stage of their first user.

use super::super::plan::region::Dense;

#[derive(Clone, Debug)]
pub(crate) struct Chains {
    /// (chain, stage) of each dense forward non-input node; None outside every chain (the
    /// mean of the micro-batch losses) and for backward nodes.
    pub stage: Vec<Option<(usize, usize)>>,
    /// `boundary[c][k]`: dense id of B_k in chain c (k = 0..=L).
    pub boundary: Vec<Vec<usize>>,
    /// Which boundary (k) a node is, if it is one.
    pub boundary_index: Vec<Option<usize>>,
    pub layers: usize,
}

impl Chains {
    pub fn chains(&self) -> usize {
        self.boundary.len()
    }
    /// Forward values the backward reads (not inputs): the candidates for saving.
    pub fn needed(d: &Dense, i: usize) -> bool {
        d.forward[i] && !d.is_input(i) && d.users[i].iter().any(|&u| !d.forward[u])
    }
}

/// `h.{i}.resid_mlp` -> i.
fn block_output(name: &str) -> Option<usize> {
    name.strip_prefix("h.")?.strip_suffix(".resid_mlp")?.parse().ok()
}

/// Finds the chains; `Err` says why there are none (not a GPT-2 training step).
pub(crate) fn find(d: &Dense) -> Result<Chains, String> {
    let n = d.len();
    if !d.has_loss {
        return Err("the graph has no `loss` output, so there is no backward to checkpoint".into());
    }
    // chain ids: each `embed` starts one; they propagate along the forward dataflow
    const CONFLICT: usize = usize::MAX;
    let mut chain: Vec<Option<usize>> = vec![None; n];
    let mut embeds = Vec::new();
    for i in 0..n {
        if !d.forward[i] || d.is_input(i) {
            continue;
        }
        if d.names[i].as_deref() == Some("embed") {
            chain[i] = Some(embeds.len());
            embeds.push(i);
            continue;
        }
        let mut c = None;
        for &o in &d.operands[i] {
            match (c, chain[o]) {
                (_, None) => {}
                (None, x) => c = x,
                (Some(a), Some(b)) if a != b => c = Some(CONFLICT),
                _ => {}
            }
        }
        chain[i] = c;
    }
    if embeds.is_empty() {
        return Err("no `embed` value: the forward is not a GPT-2 block chain".into());
    }
    let k = embeds.len();
    let mut boundary: Vec<Vec<Option<usize>>> = vec![vec![None; 1]; k];
    let mut boundary_index = vec![None; n];
    for (c, &e) in embeds.iter().enumerate() {
        boundary[c][0] = Some(e);
        boundary_index[e] = Some(0);
    }
    for i in 0..n {
        let (Some(c), Some(b)) = (chain[i], d.names[i].as_deref().and_then(block_output)) else { continue };
        if c == CONFLICT || !d.forward[i] {
            continue;
        }
        let slot = b + 1;
        if boundary[c].len() <= slot {
            boundary[c].resize(slot + 1, None);
        }
        boundary[c][slot] = Some(i);
        boundary_index[i] = Some(slot);
    }
    let layers = boundary[0].len() - 1;
    let mut bounds: Vec<Vec<usize>> = Vec::with_capacity(k);
    for (c, b) in boundary.iter().enumerate() {
        if b.len() != layers + 1 || b.iter().any(Option::is_none) {
            return Err(format!("micro-batch {c} does not have the blocks h.0 .. h.{} that micro-batch 0 has", layers.saturating_sub(1)));
        }
        bounds.push(b.iter().flatten().copied().collect());
    }
    if layers == 0 {
        return Err("no transformer blocks (values named h.N.resid_mlp) in the forward".into());
    }
    // stages along the chain
    let mut stage: Vec<Option<(usize, usize)>> = vec![None; n];
    for i in 0..n {
        let Some(c) = chain[i].filter(|&c| c != CONFLICT) else { continue };
        if !d.forward[i] || d.is_input(i) {
            continue;
        }
        let s = match boundary_index[i] {
            Some(b) => b,
            None => d.operands[i]
                .iter()
                .filter_map(|&o| stage[o].map(|(_, s)| if boundary_index[o].is_some() { s + 1 } else { s }))
                .max()
                .unwrap_or(0),
        };
        stage[i] = Some((c, s));
    }
    // values off the chain's dataflow (weights prep, the token gather) join their first user
    for i in (0..n).rev() {
        if stage[i].is_some() || !d.forward[i] || d.is_input(i) || chain[i] == Some(CONFLICT) {
            continue;
        }
        stage[i] = d.users[i].iter().filter(|&&u| d.forward[u]).filter_map(|&u| stage[u]).min_by_key(|&(_, s)| s);
    }
    Ok(Chains { stage, boundary: bounds, boundary_index, layers })
}
