//! Generation's passes over a KV cache (`qatc generate`): S new positions of one sequence, each
//! layer's keys and values written into a cache of M positions, the queries attending to the
//! cache. With S the prompt's length it is the prefill; with S = 1 one decode step, so each new
//! token costs one position, not the whole prefix. The blocks are the training forward's
//! (`Builder::block`), so fake-quant, LoRA and fold find the same linears by the same names.
//!
//! The IR has no dynamic shapes, so where the new rows go and what each query sees are data:
//! `positions` [1, S] (i32: each new token's position; it indexes wpe, and scatter_add places the
//! new rows there) and `attn_mask` [S, M] (0 where query j may see slot t, t <= positions[j];
//! else `MASKED`, added to the scores before the softmax). The caches are state inputs
//! `h.{l}.attn.{k,v}_cache` [M, C] with update outputs: the graph writes the new rows itself, so
//! the caches stay on the executor (a GPU's memory) between steps and the host sends only the
//! token, its position and the mask, never the cache.
//!
//! Per layer (S new positions, M slots, C = NH hs):
//!   k_new [S, C] --scatter_add at positions--> placed [M, C]    the new rows, zeros elsewhere
//!   K = select(written, placed, k_cache) [M, C]                 written: 1 on the rows placed
//!   softmax(q K^T + mask) V   (not `causal`: the mask is the causality, over the whole cache)
//! scatter_add of rows hit once adds each to zero, and select copies: the cache holds the keys
//! and values bit for bit as the pass computed them.

use qatc_ir::{BinaryOp, DType, Graph, InputKind, IrError, NodeId, Op, Shape};

use super::{Attend, Builder};
use crate::frontend::config::Gpt2Config;

/// The input holding each new token's position, i32 [1, S].
pub const POSITIONS: &str = "positions";
/// The input added to the attention scores, f32 [S, M]: 0 where a query may attend, else `MASKED`.
pub const ATTN_MASK: &str = "attn_mask";
/// What the mask adds to a score a query may not see: finite (no infinity reaches a kernel), and
/// far enough below any score that its exponential, after the row's maximum is taken off, is
/// exactly 0 in f32 (the row's maximum is a visible score: a query always sees its own slot).
pub const MASKED: f32 = -1e30;

/// What to build: a pass of `tokens` (S) new positions over a cache of `capacity` (M).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachedOptions {
    pub tokens: usize,
    pub capacity: usize,
}

/// The cache inputs of layer `layer`: keys, then values, each f32 [M, C].
pub fn cache_names(layer: usize) -> [String; 2] {
    [format!("h.{layer}.attn.k_cache"), format!("h.{layer}.attn.v_cache")]
}

/// `attn_mask` for `tokens` new positions from `start` on, over `capacity` slots: the query at
/// position start + j sees slots 0 ..= start + j (the prefix and itself), row-major [S, M].
pub fn attention_mask(start: usize, tokens: usize, capacity: usize) -> Vec<f32> {
    (0..tokens).flat_map(|j| (0..capacity).map(move |t| if t <= start + j { 0.0 } else { MASKED })).collect()
}

/// A cached pass's inputs that every layer reads.
pub(super) struct Cache {
    positions: NodeId,
    mask: NodeId,
    /// f32 [M, C]: 1 on the rows this pass writes, 0 elsewhere.
    written: NodeId,
    s: usize,
    m: usize,
}

impl Builder<'_> {
    /// Attention of the S new positions of layer `l` over its cache: qkv [S, 3C] -> [S, C]; the
    /// cache with the new rows is the layer's cache update.
    pub(super) fn cached_attention(&mut self, qkv: NodeId, l: usize, cache: &Cache) -> Result<NodeId, IrError> {
        let (c, nh) = (self.cfg.n_embd, self.cfg.n_head);
        let hs = c / nh;
        let (s, m) = (cache.s, cache.m);
        let p = format!("h.{l}");
        let mut kv = Vec::new();
        for (i, (which, input)) in ["k", "v"].into_iter().zip(cache_names(l)).enumerate() {
            let part = i + 1; // q | k | v along qkv's columns
            let new = self.op(Op::Slice { axis: 1, start: part * c, end: (part + 1) * c }, &[qkv])?; // [S, C]
            let new = self.op(Op::Reshape { shape: Shape::new([1, s, c]) }, &[new])?;
            let placed = self.op(Op::ScatterAdd { rows: m }, &[cache.positions, new])?; // [M, C]
            let old = self.g.input(input.as_str(), InputKind::State, DType::F32, [m, c])?;
            let all = self.named(Op::Select, &[cache.written, placed, old], &format!("{input}.next"))?; // [M, C]
            self.g.set_update(input.as_str(), all)?;
            let r = self.op(Op::Reshape { shape: Shape::new([1, m, nh, hs]) }, &[all])?;
            kv.push(self.named(Op::Transpose { perm: vec![0, 2, 1, 3] }, &[r], &format!("{p}.attn.{which}"))?);
            // [1, NH, M, hs]
        }
        let q = self.op(Op::Slice { axis: 1, start: 0, end: c }, &[qkv])?; // [S, C]
        let q = self.op(Op::Reshape { shape: Shape::new([1, s, nh, hs]) }, &[q])?;
        let q = self.named(Op::Transpose { perm: vec![0, 2, 1, 3] }, &[q], &format!("{p}.attn.q"))?; // [1, NH, S, hs]
        let att = self.op(Op::MatMul { ta: false, tb: true }, &[q, kv[0]])?; // [1, NH, S, M]
        let mask = self.op(Op::Broadcast { shape: Shape::new([1, nh, s, m]) }, &[cache.mask])?;
        let att = self.op(Op::Binary(BinaryOp::Add), &[att, mask])?;
        let scale = 1.0 / (hs as f64).sqrt();
        let probs = self.named(Op::Softmax { scale, causal: false }, &[att], &format!("{p}.attn.probs"))?;
        let y = self.op(Op::MatMul { ta: false, tb: false }, &[probs, kv[1]])?; // [1, NH, S, hs]
        let y = self.op(Op::Transpose { perm: vec![0, 2, 1, 3] }, &[y])?; // [1, S, NH, hs]
        self.op(Op::Reshape { shape: Shape::new([s, c]) }, &[y]) // [S, C]
    }
}

/// Builds a cached pass. Inputs: `ids` and `positions` (i32 [1, S]), `attn_mask` (f32 [S, M]),
/// each layer's caches (state, f32 [M, C], updated) and every weight; output: `logits` [1, V],
/// the next-token logits after the last new position.
pub fn lower_cached(cfg: &Gpt2Config, o: &CachedOptions) -> Result<Graph, IrError> {
    let (s, m) = (o.tokens, o.capacity);
    let (c, v, p) = (cfg.n_embd, cfg.vocab_size, cfg.n_positions);
    if s == 0 || s > m || m > p {
        let msg = format!("a cached pass needs 1 <= S <= M <= n_positions {p}, got S {s}, M {m}");
        return Err(IrError::Type { node: ATTN_MASK.into(), msg });
    }
    let mut bl = Builder { g: Graph::new(format!("gpt2_L{}_C{c}_S{s}_M{m}", cfg.n_layer)), cfg, positions: None };
    let ids = bl.g.input("ids", InputKind::Data, DType::I32, [1, s])?;
    let positions = bl.g.input(POSITIONS, InputKind::Data, DType::I32, [1, s])?;
    let mask = bl.g.input(ATTN_MASK, InputKind::Data, DType::F32, [s, m])?;
    // embeddings: wte[ids] + wpe[positions]
    let wte = bl.param("wte.weight", [v, c])?;
    let wpe = bl.param("wpe.weight", [p, c])?;
    let tok = bl.op(Op::Gather, &[wte, ids])?; // [1, S, C]
    let pos = bl.op(Op::Gather, &[wpe, positions])?; // [1, S, C]
    let x = bl.named(Op::Binary(BinaryOp::Add), &[tok, pos], "embed")?;
    let mut x = bl.op(Op::Reshape { shape: Shape::new([s, c]) }, &[x])?; // [S, C]
                                                                         // the rows this pass writes, shared by every layer's caches
    let ones = bl.g.constant(1.0, DType::F32, [1, s, 1])?;
    let hit = bl.op(Op::ScatterAdd { rows: m }, &[positions, ones])?; // [M, 1]
    let written = bl.named(Op::Broadcast { shape: Shape::new([m, c]) }, &[hit], "cache.written")?; // [M, C]
    let attend = Attend::Cached(Cache { positions, mask, written, s, m });
    for l in 0..cfg.n_layer {
        x = bl.block(x, l, &attend)?;
    }
    // only the last position's next token is asked for
    let last = bl.op(Op::Slice { axis: 0, start: s - 1, end: s }, &[x])?; // [1, C]
    let xf = bl.layernorm(last, "ln_f")?;
    let logits = bl.named(Op::MatMul { ta: false, tb: true }, &[xf, wte], "lm_head")?; // [1, V]
    bl.g.set_output("logits", logits)?;
    Ok(bl.g)
}
