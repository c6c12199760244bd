//! Lowers a GPT-2 (Hugging Face `GPT2LMHeadModel`) into qatc's IR: forward pass and mean
//! cross-entropy, laid out as in llm.c's `gpt2_forward`. Every weight is an `Input` named by its
//! checkpoint key without the `transformer.` prefix, so passes (fake-quant, LoRA) find linears
//! by name and the runtime binds weights by name. `cached` builds generation's passes over a KV
//! cache from the same blocks, so the passes find the same linears in them.
//!
//! Shapes: B batch, T sequence, C = n_embd, NH heads, hs = C / NH, V vocab, P n_positions.

mod cached;

pub use cached::{attention_mask, cache_names, lower_cached, CachedOptions, ATTN_MASK, MASKED, POSITIONS};

use qatc_ir::{BinaryOp, DType, Graph, InputKind, IrError, NodeId, Op, Shape, UnaryOp};

use super::config::Gpt2Config;

/// What to build.
#[derive(Clone, Debug)]
pub struct LowerOptions {
    pub batch: usize,
    pub seq: usize,
    /// Also return the logits [B, T, V] as an output (eval and parity tests want them; the
    /// training step does not, so they need not outlive the loss).
    pub logits: bool,
    /// What the batches give beside the ids and targets.
    pub inputs: BatchInputs,
}

/// What a batch gives the graph beside `ids` and `targets` (instruction data, `crate::sft`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchInputs {
    /// `weights` [B, T] f32: the loss is sum_i weights[i] * nll_i (weighted_cross_entropy), 0 for
    /// a token that does not count (a prompt's, padding), the rest summing to 1 over the step.
    pub weights: bool,
    /// `positions` [B, T] i32: packed examples, each numbered from 0: the position embedding of
    /// each token is its own example's, and attention never crosses an example's start.
    pub positions: bool,
}

struct Builder<'a> {
    g: Graph,
    cfg: &'a Gpt2Config,
    /// Packed examples' position ids [B, T] (`BatchInputs::positions`), which also mask attention.
    positions: Option<NodeId>,
}

/// How a block's attention sees the sequence.
enum Attend {
    /// B sequences of T positions, each position attending to those before it and itself.
    Causal { b: usize, t: usize },
    /// S new positions of one sequence, written into each layer's KV cache and attending to the
    /// cache through a mask.
    Cached(cached::Cache),
}

impl Builder<'_> {
    fn param(&mut self, name: &str, shape: impl Into<Shape>) -> Result<NodeId, IrError> {
        self.g.input(name, InputKind::Frozen, DType::F32, shape)
    }

    fn op(&mut self, op: Op, args: &[NodeId]) -> Result<NodeId, IrError> {
        self.g.add(op, args)
    }

    fn named(&mut self, op: Op, args: &[NodeId], name: &str) -> Result<NodeId, IrError> {
        self.g.add_named(op, args, name)
    }

    /// y [N, out] = x [N, in] @ W [in, out] + b   (HF Conv1D stores W as [in, out])
    fn linear(&mut self, x: NodeId, prefix: &str, n_in: usize, n_out: usize) -> Result<NodeId, IrError> {
        let n = self.g.ty(x).shape.dims()[0];
        let w = self.param(&format!("{prefix}.weight"), [n_in, n_out])?;
        let b = self.param(&format!("{prefix}.bias"), [n_out])?;
        let xw = self.op(Op::MatMul { ta: false, tb: false }, &[x, w])?;
        let bb = self.op(Op::Broadcast { shape: Shape::new([n, n_out]) }, &[b])?;
        self.named(Op::Binary(BinaryOp::Add), &[xw, bb], prefix)
    }

    fn layernorm(&mut self, x: NodeId, prefix: &str) -> Result<NodeId, IrError> {
        let c = self.cfg.n_embd;
        let w = self.param(&format!("{prefix}.weight"), [c])?;
        let b = self.param(&format!("{prefix}.bias"), [c])?;
        self.named(Op::LayerNorm { eps: self.cfg.layer_norm_epsilon }, &[x, w, b], prefix)
    }

    /// One pre-LN transformer block: x + attn(ln_1(x)), then + mlp(ln_2(.)). x is [N, C] (N = B*T
    /// rows, or the S new positions of a cached pass); `attend` says how the heads see the sequence.
    fn block(&mut self, x: NodeId, l: usize, attend: &Attend) -> Result<NodeId, IrError> {
        let c = self.cfg.n_embd;
        let p = format!("h.{l}");
        // attention
        let h = self.layernorm(x, &format!("{p}.ln_1"))?; // [N, C]
        let qkv = self.linear(h, &format!("{p}.attn.c_attn"), c, 3 * c)?; // [N, 3C]
        let y = match *attend {
            Attend::Causal { b, t } => self.causal_attention(qkv, &p, b, t)?,
            Attend::Cached(ref cache) => self.cached_attention(qkv, l, cache)?,
        };
        let a = self.linear(y, &format!("{p}.attn.c_proj"), c, c)?;
        let x = self.named(Op::Binary(BinaryOp::Add), &[x, a], &format!("{p}.resid_attn"))?;
        // MLP
        let h = self.layernorm(x, &format!("{p}.ln_2"))?;
        let f = self.linear(h, &format!("{p}.mlp.c_fc"), c, 4 * c)?; // [N, 4C]
        let f = self.named(Op::Unary(UnaryOp::Gelu), &[f], &format!("{p}.mlp.gelu"))?;
        let m = self.linear(f, &format!("{p}.mlp.c_proj"), 4 * c, c)?;
        self.named(Op::Binary(BinaryOp::Add), &[x, m], &format!("{p}.resid_mlp"))
    }

    /// Causal self-attention of B sequences of T positions: qkv [BT, 3C] -> [BT, C].
    fn causal_attention(&mut self, qkv: NodeId, p: &str, b: usize, t: usize) -> Result<NodeId, IrError> {
        let (c, nh) = (self.cfg.n_embd, self.cfg.n_head);
        let hs = c / nh;
        let mut heads = Vec::new();
        for (i, which) in ["q", "k", "v"].iter().enumerate() {
            let s = self.op(Op::Slice { axis: 1, start: i * c, end: (i + 1) * c }, &[qkv])?; // [BT, C]
            let r = self.op(Op::Reshape { shape: Shape::new([b, t, nh, hs]) }, &[s])?;
            let tr = self.named(Op::Transpose { perm: vec![0, 2, 1, 3] }, &[r], &format!("{p}.attn.{which}"))?; // [B, NH, T, hs]
            heads.push(tr);
        }
        let att = self.op(Op::MatMul { ta: false, tb: true }, &[heads[0], heads[1]])?; // [B, NH, T, T]
        let scale = 1.0 / (hs as f64).sqrt();
        let probs = match self.positions {
            // packed examples: each token attends to its own example's tokens only
            Some(pos) => self.named(Op::PackedSoftmax { scale }, &[att, pos], &format!("{p}.attn.probs"))?,
            None => self.named(Op::Softmax { scale, causal: true }, &[att], &format!("{p}.attn.probs"))?,
        };
        let y = self.op(Op::MatMul { ta: false, tb: false }, &[probs, heads[2]])?; // [B, NH, T, hs]
        let y = self.op(Op::Transpose { perm: vec![0, 2, 1, 3] }, &[y])?; // [B, T, NH, hs]
        self.op(Op::Reshape { shape: Shape::new([b * t, c]) }, &[y]) // [BT, C]
    }
}

/// Builds the forward + loss graph. Inputs: `ids` and `targets` (i32 [B, T]), `weights` (f32
/// [B, T]) and `positions` (i32 [B, T]) when `opts.inputs` says so, and every weight; outputs: `loss` (and `logits` [B, T, V]
/// when asked).
pub fn lower(cfg: &Gpt2Config, opts: &LowerOptions) -> Result<Graph, IrError> {
    let (b, t) = (opts.batch, opts.seq);
    let (c, v, p) = (cfg.n_embd, cfg.vocab_size, cfg.n_positions);
    let mut bl = Builder { g: Graph::new(format!("gpt2_L{}_C{}_B{b}_T{t}", cfg.n_layer, c)), cfg, positions: None };
    let ids = bl.g.input("ids", InputKind::Data, DType::I32, [b, t])?;
    let targets = bl.g.input("targets", InputKind::Data, DType::I32, [b, t])?;
    if opts.inputs.positions {
        bl.positions = Some(bl.g.input("positions", InputKind::Data, DType::I32, [b, t])?);
    }
    // embeddings: wte[ids] + wpe[0..T] (wpe[positions] for packed examples)
    let wte = bl.param("wte.weight", [v, c])?;
    let wpe = bl.param("wpe.weight", [p, c])?;
    let tok = bl.op(Op::Gather, &[wte, ids])?; // [B, T, C]
    let pos = match bl.positions {
        Some(ps) => bl.op(Op::Gather, &[wpe, ps])?, // [B, T, C]
        None => {
            let pos = bl.op(Op::Slice { axis: 0, start: 0, end: t }, &[wpe])?; // [T, C]
            bl.op(Op::Broadcast { shape: Shape::new([b, t, c]) }, &[pos])?
        }
    };
    let x = bl.named(Op::Binary(BinaryOp::Add), &[tok, pos], "embed")?;
    let mut x = bl.op(Op::Reshape { shape: Shape::new([b * t, c]) }, &[x])?; // [BT, C]
    for l in 0..cfg.n_layer {
        x = bl.block(x, l, &Attend::Causal { b, t })?;
    }
    let xf = bl.layernorm(x, "ln_f")?;
    // The LM head is tied to wte (HF's default): logits = xf @ wte^T.
    let logits = bl.named(Op::MatMul { ta: false, tb: true }, &[xf, wte], "lm_head")?; // [BT, V]
    let tgt = bl.op(Op::Reshape { shape: Shape::new([b * t]) }, &[targets])?;
    let loss = if opts.inputs.weights {
        let weights = bl.g.input("weights", InputKind::Data, DType::F32, [b, t])?;
        let w = bl.op(Op::Reshape { shape: Shape::new([b * t]) }, &[weights])?;
        bl.named(Op::WeightedCrossEntropy, &[logits, tgt, w], "loss")?
    } else {
        bl.named(Op::CrossEntropy, &[logits, tgt], "loss")?
    };
    bl.g.set_output("loss", loss)?;
    if opts.logits {
        let l3 = bl.op(Op::Reshape { shape: Shape::new([b, t, v]) }, &[logits])?;
        bl.g.set_output("logits", l3)?;
    }
    Ok(bl.g)
}
