//! Kernel families: what a fused kernel (`Op::Kernel`) computes, as the fusion rules name it.
//!
//! A family is a value: the op a kernel is built around (its [`Anchor`]) and what the rules added
//! to it, as typed fields (a GEMM's prologue and epilogues, the chunked cross-entropy's rows per
//! chunk), so the lowering dispatches on it with a `match` and reads its parameters as fields.
//! Its text is dotted words, the anchor first (`gemm.dequant.bias.lora`,
//! `cross_entropy.linear.chunk=128`): the IR text format prints and parses it
//! (`kernel[family="..."]`), and generated kernels carry it in their names
//! (`fused_{family}_{hash8}`), so the text of each family is fixed by what is printed today.

use std::fmt;
use std::str::FromStr;

/// The op a kernel is built around: the first word of its family. Rules ask for fragments by it
/// (an epilogue absorbs a `gemm`, whatever its prologue and epilogues so far).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Anchor {
    Pointwise,
    Reduce,
    Gemm,
    Dequant,
    FakeQuant,
    LayerNorm,
    LayerNormBwd,
    LayerNormBwdGamma,
    Softmax,
    SoftmaxBwd,
    Attention,
    AttentionBwd,
    CrossEntropy,
    CrossEntropyGrad,
    AdamW,
}

impl Anchor {
    pub const ALL: [Anchor; 15] = [
        Anchor::Pointwise,
        Anchor::Reduce,
        Anchor::Gemm,
        Anchor::Dequant,
        Anchor::FakeQuant,
        Anchor::LayerNorm,
        Anchor::LayerNormBwd,
        Anchor::LayerNormBwdGamma,
        Anchor::Softmax,
        Anchor::SoftmaxBwd,
        Anchor::Attention,
        Anchor::AttentionBwd,
        Anchor::CrossEntropy,
        Anchor::CrossEntropyGrad,
        Anchor::AdamW,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Anchor::Pointwise => "pointwise",
            Anchor::Reduce => "reduce",
            Anchor::Gemm => "gemm",
            Anchor::Dequant => "dequant",
            Anchor::FakeQuant => "fake_quant",
            Anchor::LayerNorm => "layernorm",
            Anchor::LayerNormBwd => "layernorm_bwd",
            Anchor::LayerNormBwdGamma => "layernorm_bwd_gamma",
            Anchor::Softmax => "softmax",
            Anchor::SoftmaxBwd => "softmax_bwd",
            Anchor::Attention => "attention",
            Anchor::AttentionBwd => "attention_bwd",
            Anchor::CrossEntropy => "cross_entropy",
            Anchor::CrossEntropyGrad => "cross_entropy_grad",
            Anchor::AdamW => "adamw",
        }
    }

    pub fn from_name(s: &str) -> Option<Anchor> {
        Anchor::ALL.into_iter().find(|a| a.name() == s)
    }
}

/// What a GEMM kernel does to its operands as it loads them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GemmPrologue {
    /// Operands read as stored (or no prologue at all: a GEMM on its own).
    #[default]
    None,
    /// A transpose, reshape, slice or broadcast of an operand read strided (`.strided`).
    Strided,
    /// An operand scaled (and shifted) as its tile is loaded (`.scaled`).
    Scaled,
    /// Both (`.strided.scaled`).
    StridedScaled,
    /// A 4-bit weight dequantized tile by tile (`.dequant`).
    Dequant,
    /// A trainable weight rounded to its quantization grid (`.fake_quant`).
    FakeQuant,
}

impl GemmPrologue {
    /// The prologue of cheap operand fragments: `strided` when one moves data, `scaled` when
    /// one scales it.
    pub fn of_cheap(strided: bool, scaled: bool) -> GemmPrologue {
        match (strided, scaled) {
            (false, false) => GemmPrologue::None,
            (true, false) => GemmPrologue::Strided,
            (false, true) => GemmPrologue::Scaled,
            (true, true) => GemmPrologue::StridedScaled,
        }
    }

    fn words(self) -> &'static [&'static str] {
        match self {
            GemmPrologue::None => &[],
            GemmPrologue::Strided => &["strided"],
            GemmPrologue::Scaled => &["scaled"],
            GemmPrologue::StridedScaled => &["strided", "scaled"],
            GemmPrologue::Dequant => &["dequant"],
            GemmPrologue::FakeQuant => &["fake_quant"],
        }
    }

    const ALL: [GemmPrologue; 6] = [
        GemmPrologue::None,
        GemmPrologue::Strided,
        GemmPrologue::Scaled,
        GemmPrologue::StridedScaled,
        GemmPrologue::Dequant,
        GemmPrologue::FakeQuant,
    ];
}

/// What a kernel applies to its anchor's result before storing it (a GEMM's tile; a LayerNorm
/// backward's row adds the residual stream's gradient).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Epilogue {
    /// + a per-column bias.
    Bias,
    /// GELU.
    Gelu,
    /// GELU's backward: dy * gelu'(x).
    DGelu,
    /// + a tensor of the result's type.
    Residual,
    /// * a constant (LoRA's alpha / r).
    Scale,
    /// Stored transposed.
    Permute,
    /// + LoRA's low-rank product.
    Lora,
}

impl Epilogue {
    pub const ALL: [Epilogue; 7] =
        [Epilogue::Bias, Epilogue::Gelu, Epilogue::DGelu, Epilogue::Residual, Epilogue::Scale, Epilogue::Permute, Epilogue::Lora];

    pub fn name(self) -> &'static str {
        match self {
            Epilogue::Bias => "bias",
            Epilogue::Gelu => "gelu",
            Epilogue::DGelu => "dgelu",
            Epilogue::Residual => "residual",
            Epilogue::Scale => "scale",
            Epilogue::Permute => "permute",
            Epilogue::Lora => "lora",
        }
    }

    pub fn from_name(s: &str) -> Option<Epilogue> {
        Epilogue::ALL.into_iter().find(|e| e.name() == s)
    }
}

/// A GEMM kernel: `gemm[.prologue][.epilogue]*[.aux][.lora_down]`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct GemmFamily {
    pub prologue: GemmPrologue,
    /// In the order the rules applied them (each to the result of the ones before).
    pub epilogues: Vec<Epilogue>,
    /// The kernel also writes a value it computed on the way (GELU's pre-activation, which the
    /// backward reads): a packed kernel of several results (`.aux`).
    pub aux: bool,
    /// The kernel also computes and writes LoRA's down-projection u = x A^T from the x tiles it
    /// reads anyway (`.lora_down`).
    pub lora_down: bool,
}

impl GemmFamily {
    /// A GEMM with `prologue` and nothing else.
    pub const fn with_prologue(prologue: GemmPrologue) -> GemmFamily {
        GemmFamily { prologue, epilogues: Vec::new(), aux: false, lora_down: false }
    }
}

/// What a fused kernel computes: one variant per family the fusion rules build (the rules in
/// `qatc_passes::fusion::rules`), plus the families of one anchor op alone, which the rules
/// extend (`gemm` -> `gemm.bias`). Its text is its `Display`; `FromStr` reads it back.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum KernelFamily {
    /// A chain of pointwise ops, one loop over the result (`pointwise`).
    Pointwise,
    /// A sum over broadcast dimensions of a pointwise chain (`reduce.sum`).
    ReduceSum,
    /// A GEMM with its prologue and epilogues (`gemm.dequant.bias.lora`).
    Gemm(GemmFamily),
    /// A weight's dequantization (`dequant`).
    Dequant,
    /// A weight's fake quantization (`fake_quant`).
    FakeQuant,
    /// LayerNorm, with the residual add before it (`layernorm.residual`), writing the sum as a
    /// second result (`.aux`).
    LayerNorm { residual: bool, aux: bool },
    /// LayerNorm's input gradient, with the residual stream's gradient added
    /// (`layernorm_bwd.residual`).
    LayerNormBwd { residual: bool },
    /// LayerNorm's three gradients (dx, dgamma, dbeta) from one pass (`layernorm_bwd.all`).
    LayerNormBwdAll,
    /// LayerNorm's gamma gradient (`layernorm_bwd_gamma`).
    LayerNormBwdGamma,
    /// Softmax (`softmax`).
    Softmax,
    /// Softmax's gradient (`softmax_bwd`).
    SoftmaxBwd,
    /// Attention's probabilities from the scores GEMM, never written (`attention.scores`).
    AttentionScores,
    /// The probabilities times V without P in memory (`attention.flash`).
    AttentionFlash,
    /// Softmax's gradient with dP = dO V^T formed in registers (`attention_bwd.scores`).
    AttentionBwdScores,
    /// dQ and dK from one kernel, dS in registers (`attention_bwd.flash`).
    AttentionBwdFlash,
    /// Cross-entropy's loss (`cross_entropy`).
    CrossEntropy,
    /// Cross-entropy's gradient (`cross_entropy_grad`).
    CrossEntropyGrad,
    /// Loss and gradient in one pass over the logits, the gradient written over them
    /// (`cross_entropy.softmax.inplace`).
    CrossEntropySoftmaxInPlace,
    /// The LM head's GEMM and cross-entropy (and its gradient's GEMMs) over `chunk_rows` rows at
    /// a time, the logits never written whole (`cross_entropy.linear.chunk=R`).
    CrossEntropyLinear { chunk_rows: usize },
    /// AdamW over every trainable tensor in one launch (`adamw.multi_tensor`).
    AdamWMultiTensor,
}

impl KernelFamily {
    /// A GEMM alone: the family of a matmul before any rule extends it.
    pub const GEMM: KernelFamily = KernelFamily::Gemm(GemmFamily::with_prologue(GemmPrologue::None));

    /// The op the kernel is built around.
    pub fn anchor(&self) -> Anchor {
        match self {
            KernelFamily::Pointwise => Anchor::Pointwise,
            KernelFamily::ReduceSum => Anchor::Reduce,
            KernelFamily::Gemm(_) => Anchor::Gemm,
            KernelFamily::Dequant => Anchor::Dequant,
            KernelFamily::FakeQuant => Anchor::FakeQuant,
            KernelFamily::LayerNorm { .. } => Anchor::LayerNorm,
            KernelFamily::LayerNormBwd { .. } | KernelFamily::LayerNormBwdAll => Anchor::LayerNormBwd,
            KernelFamily::LayerNormBwdGamma => Anchor::LayerNormBwdGamma,
            KernelFamily::Softmax => Anchor::Softmax,
            KernelFamily::SoftmaxBwd => Anchor::SoftmaxBwd,
            KernelFamily::AttentionScores | KernelFamily::AttentionFlash => Anchor::Attention,
            KernelFamily::AttentionBwdScores | KernelFamily::AttentionBwdFlash => Anchor::AttentionBwd,
            KernelFamily::CrossEntropy | KernelFamily::CrossEntropySoftmaxInPlace | KernelFamily::CrossEntropyLinear { .. } => {
                Anchor::CrossEntropy
            }
            KernelFamily::CrossEntropyGrad => Anchor::CrossEntropyGrad,
            KernelFamily::AdamWMultiTensor => Anchor::AdamW,
        }
    }

    /// This family with epilogue `e` applied to its result, unless `e` is already the last thing
    /// it applies (rules may meet a kernel they extended before); None where the family has no
    /// such epilogue (only GEMMs have them, and a LayerNorm backward its residual).
    pub fn with_epilogue(&self, e: Epilogue) -> Option<KernelFamily> {
        match self {
            KernelFamily::Gemm(g) => {
                let mut g = g.clone();
                if g.epilogues.last() != Some(&e) {
                    g.epilogues.push(e);
                }
                Some(KernelFamily::Gemm(g))
            }
            KernelFamily::LayerNormBwd { .. } if e == Epilogue::Residual => Some(KernelFamily::LayerNormBwd { residual: true }),
            _ => None,
        }
    }

    /// This family writing an absorbed value as a second result (`.aux`); None where the family
    /// has no such form (a GEMM's and a LayerNorm's).
    pub fn with_aux(&self) -> Option<KernelFamily> {
        match self {
            KernelFamily::Gemm(g) => Some(KernelFamily::Gemm(GemmFamily { aux: true, ..g.clone() })),
            KernelFamily::LayerNorm { residual, .. } => Some(KernelFamily::LayerNorm { residual: *residual, aux: true }),
            _ => None,
        }
    }

    /// Whether the kernel applies LoRA's up-projection and does not compute its down-projection
    /// yet: what the shared-input rule extends with `.lora_down`.
    pub fn applies_lora(&self) -> bool {
        matches!(self, KernelFamily::Gemm(g) if g.epilogues.contains(&Epilogue::Lora) && !g.lora_down)
    }

    /// This family also computing LoRA's down-projection (`.lora_down`); None unless
    /// [`KernelFamily::applies_lora`].
    pub fn with_lora_down(&self) -> Option<KernelFamily> {
        match self {
            KernelFamily::Gemm(g) if self.applies_lora() => Some(KernelFamily::Gemm(GemmFamily { lora_down: true, ..g.clone() })),
            _ => None,
        }
    }

    /// The words after the anchor's name of the families whose words are fixed (a GEMM's and
    /// the chunked cross-entropy's are written by `Display` from their fields).
    fn fixed_words(&self) -> &'static [&'static str] {
        match self {
            KernelFamily::LayerNorm { residual, aux } => match (residual, aux) {
                (false, false) => &[],
                (true, false) => &["residual"],
                (false, true) => &["aux"],
                (true, true) => &["residual", "aux"],
            },
            KernelFamily::LayerNormBwd { residual: true } => &["residual"],
            KernelFamily::LayerNormBwdAll => &["all"],
            KernelFamily::ReduceSum => &["sum"],
            KernelFamily::AttentionScores | KernelFamily::AttentionBwdScores => &["scores"],
            KernelFamily::AttentionFlash | KernelFamily::AttentionBwdFlash => &["flash"],
            KernelFamily::CrossEntropySoftmaxInPlace => &["softmax", "inplace"],
            KernelFamily::AdamWMultiTensor => &["multi_tensor"],
            KernelFamily::Gemm(_)
            | KernelFamily::CrossEntropyLinear { .. }
            | KernelFamily::Pointwise
            | KernelFamily::Dequant
            | KernelFamily::FakeQuant
            | KernelFamily::LayerNormBwd { residual: false }
            | KernelFamily::LayerNormBwdGamma
            | KernelFamily::Softmax
            | KernelFamily::SoftmaxBwd
            | KernelFamily::CrossEntropy
            | KernelFamily::CrossEntropyGrad => &[],
        }
    }
}

impl fmt::Display for KernelFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.anchor().name())?;
        match self {
            KernelFamily::Gemm(g) => {
                let flags = [(g.aux, "aux"), (g.lora_down, "lora_down")].into_iter().filter_map(|(on, w)| on.then_some(w));
                let mut words = g.prologue.words().iter().copied().chain(g.epilogues.iter().map(|e| e.name())).chain(flags);
                words.try_for_each(|w| write!(f, ".{w}"))
            }
            KernelFamily::CrossEntropyLinear { chunk_rows } => write!(f, ".linear.chunk={chunk_rows}"),
            _ => self.fixed_words().iter().try_for_each(|w| write!(f, ".{w}")),
        }
    }
}

/// A family's text that names no family.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown kernel family `{0}`")]
pub struct UnknownFamily(pub String);

impl FromStr for KernelFamily {
    type Err = UnknownFamily;

    fn from_str(s: &str) -> Result<KernelFamily, UnknownFamily> {
        let bad = || UnknownFamily(s.to_string());
        let mut words = s.split('.');
        let anchor = words.next().and_then(Anchor::from_name).ok_or_else(bad)?;
        let rest: Vec<&str> = words.collect();
        let family = match (anchor, &rest[..]) {
            (Anchor::Gemm, rest) => KernelFamily::Gemm(gemm(rest).ok_or_else(bad)?),
            (Anchor::CrossEntropy, ["linear", chunk]) => {
                let rows = chunk.strip_prefix("chunk=").and_then(|r| r.parse().ok()).ok_or_else(bad)?;
                KernelFamily::CrossEntropyLinear { chunk_rows: rows }
            }
            (Anchor::Pointwise, []) => KernelFamily::Pointwise,
            (Anchor::Reduce, ["sum"]) => KernelFamily::ReduceSum,
            (Anchor::Dequant, []) => KernelFamily::Dequant,
            (Anchor::FakeQuant, []) => KernelFamily::FakeQuant,
            (Anchor::LayerNorm, []) => KernelFamily::LayerNorm { residual: false, aux: false },
            (Anchor::LayerNorm, ["residual"]) => KernelFamily::LayerNorm { residual: true, aux: false },
            (Anchor::LayerNorm, ["aux"]) => KernelFamily::LayerNorm { residual: false, aux: true },
            (Anchor::LayerNorm, ["residual", "aux"]) => KernelFamily::LayerNorm { residual: true, aux: true },
            (Anchor::LayerNormBwd, []) => KernelFamily::LayerNormBwd { residual: false },
            (Anchor::LayerNormBwd, ["residual"]) => KernelFamily::LayerNormBwd { residual: true },
            (Anchor::LayerNormBwd, ["all"]) => KernelFamily::LayerNormBwdAll,
            (Anchor::LayerNormBwdGamma, []) => KernelFamily::LayerNormBwdGamma,
            (Anchor::Softmax, []) => KernelFamily::Softmax,
            (Anchor::SoftmaxBwd, []) => KernelFamily::SoftmaxBwd,
            (Anchor::Attention, ["scores"]) => KernelFamily::AttentionScores,
            (Anchor::Attention, ["flash"]) => KernelFamily::AttentionFlash,
            (Anchor::AttentionBwd, ["scores"]) => KernelFamily::AttentionBwdScores,
            (Anchor::AttentionBwd, ["flash"]) => KernelFamily::AttentionBwdFlash,
            (Anchor::CrossEntropy, []) => KernelFamily::CrossEntropy,
            (Anchor::CrossEntropy, ["softmax", "inplace"]) => KernelFamily::CrossEntropySoftmaxInPlace,
            (Anchor::CrossEntropyGrad, []) => KernelFamily::CrossEntropyGrad,
            (Anchor::AdamW, ["multi_tensor"]) => KernelFamily::AdamWMultiTensor,
            _ => return Err(bad()),
        };
        // one spelling per family: `chunk=007` or a `strided` after an epilogue reads as nothing
        if family.to_string() != s {
            return Err(bad());
        }
        Ok(family)
    }
}

/// A GEMM's words after `gemm`: a prologue, epilogues, then `aux` and `lora_down`.
fn gemm(words: &[&str]) -> Option<GemmFamily> {
    // the longest prologue whose words start the list (`strided.scaled` before `strided`)
    let prologue = GemmPrologue::ALL
        .into_iter()
        .filter(|p| words.starts_with(p.words()))
        .max_by_key(|p| p.words().len())
        .unwrap_or(GemmPrologue::None);
    let mut rest = &words[prologue.words().len()..];
    let mut g = GemmFamily::with_prologue(prologue);
    while let Some(e) = rest.first().and_then(|w| Epilogue::from_name(w)) {
        g.epilogues.push(e);
        rest = &rest[1..];
    }
    if rest.first() == Some(&"aux") {
        g.aux = true;
        rest = &rest[1..];
    }
    if rest.first() == Some(&"lora_down") {
        g.lora_down = true;
        rest = &rest[1..];
    }
    rest.is_empty().then_some(g)
}
