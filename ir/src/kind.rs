//! Op kinds and the one table of their properties.
//!
//! An [`OpKind`] is an op without its attributes (`Op::kind`, an exhaustive `match`, gives every
//! op one). The table below gives each kind its mnemonic (the text format's name and the kind of
//! its e-nodes in fusion's e-graph), how fusion treats it ([`Fusion`]), whether a kernel may
//! compute it again rather than read it ([`Recompute`]) and how fusion's cost model counts it
//! unfused ([`CostClass`]). Fusion's e-graph language and its lists of pointwise, recomputable
//! and anchoring ops are derived from it, so an op added to `Op` without a row here does not
//! compile (the `match` in `Op::kind` has no arm for it) rather than silently falling out of
//! fusion. [`OpKind::ALL`] is built by the same macro as the enum, so it lists every kind.

use crate::family::KernelFamily;

/// How fusion treats an op kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fusion {
    /// Each output element is computed from a fixed set of input elements (no reduction): the
    /// op joins pointwise chains and the prologues and epilogues of other kernels; alone it is
    /// a `pointwise` kernel.
    Pointwise,
    /// The op is the core of a kernel of this family, which rules extend (`gemm` -> `gemm.bias`)
    /// and absorb.
    Anchors(KernelFamily),
    /// Fusion leaves the op a kernel of its own.
    Alone,
}

/// Whether a kernel may compute an op's value again from its inputs even when other kernels
/// read it too: when reading the inputs costs no more than reading the value would.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recompute {
    /// Never (it would cost a pass over its inputs, or its inputs are larger).
    No,
    /// The op only moves, replicates or fills data: read strided (or filled) in the kernel, it
    /// costs what reading the materialized copy would.
    Layout,
    /// A scale and shift: reading x costs what reading a x + b would.
    Scale,
    /// A weight's quantization: reading 4-bit codes costs an eighth of reading the f32 weight.
    Expand,
}

/// How fusion's cost model (`qatc_passes::fusion::cost`) counts an op left unfused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CostClass {
    /// Supplied from outside: nothing by itself, the kernels that read it pay for the read.
    Free,
    /// A fill: one launch writing its result, reading nothing.
    Fill,
    /// A view of its operand: no launch, no bytes.
    View,
    /// One launch that reads of its first operand only the elements it returns (a slice, the
    /// gathered rows). A slice along axis 0 is a contiguous sub-buffer: a view.
    Partial,
    /// One launch: each distinct operand read once, the result written once.
    Launch,
}

/// An op kind's row of the table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpProps {
    pub mnemonic: &'static str,
    pub fusion: Fusion,
    pub recompute: Recompute,
    pub cost: CostClass,
}

/// Defines `OpKind`, `OpKind::ALL` and the table from one list of rows.
macro_rules! op_kinds {
    ($($kind:ident = $mnemonic:literal, $fusion:expr, $recompute:ident, $cost:ident;)*) => {
        /// An op without its attributes (see the module docs).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum OpKind {
            $($kind,)*
        }

        impl OpKind {
            /// Every kind, in table order.
            pub const ALL: &'static [OpKind] = &[$(OpKind::$kind,)*];

            /// The kind's name in the text format.
            pub const fn mnemonic(self) -> &'static str {
                match self {
                    $(OpKind::$kind => $mnemonic,)*
                }
            }

            /// The kind's row of the table.
            pub fn props(self) -> OpProps {
                match self {
                    $(OpKind::$kind => OpProps {
                        mnemonic: $mnemonic,
                        fusion: $fusion,
                        recompute: Recompute::$recompute,
                        cost: CostClass::$cost,
                    },)*
                }
            }
        }
    };
}

use Fusion::{Alone, Pointwise as Pw};
const GEMM: Fusion = Fusion::Anchors(KernelFamily::GEMM);
use Fusion::Anchors as anchors;

op_kinds! {
    // kind            mnemonic                     fusion                                          recompute  cost
    Input              = "input",                   Alone,                                          No,        Free;
    Const              = "const",                   Pw,                                             Layout,    Fill;
    Neg                = "neg",                     Pw,                                             No,        Launch;
    Exp                = "exp",                     Pw,                                             No,        Launch;
    Log                = "log",                     Pw,                                             No,        Launch;
    Sqrt               = "sqrt",                    Pw,                                             No,        Launch;
    Rsqrt              = "rsqrt",                   Pw,                                             No,        Launch;
    Recip              = "recip",                   Pw,                                             No,        Launch;
    Tanh               = "tanh",                    Pw,                                             No,        Launch;
    Square             = "square",                  Pw,                                             No,        Launch;
    Gelu               = "gelu",                    Pw,                                             No,        Launch;
    Add                = "add",                     Pw,                                             No,        Launch;
    Sub                = "sub",                     Pw,                                             No,        Launch;
    Mul                = "mul",                     Pw,                                             No,        Launch;
    Div                = "div",                     Pw,                                             No,        Launch;
    Max                = "max",                     Pw,                                             No,        Launch;
    Min                = "min",                     Pw,                                             No,        Launch;
    GeluGrad           = "gelu_grad",               Pw,                                             No,        Launch;
    Affine             = "affine",                  Pw,                                             Scale,     Launch;
    Cast               = "cast",                    Pw,                                             No,        Launch;
    Broadcast          = "broadcast",               Pw,                                             Layout,    Launch;
    // a reduction: the `reduce.sum` rule absorbs a pointwise chain into it
    SumTo              = "sum_to",                  Alone,                                          No,        Launch;
    Reshape            = "reshape",                 Pw,                                             Layout,    View;
    Transpose          = "transpose",               Pw,                                             Layout,    Launch;
    Slice              = "slice",                   Pw,                                             Layout,    Partial;
    Concat             = "concat",                  Pw,                                             No,        Launch;
    MatMul             = "matmul",                  GEMM,                                           No,        Launch;
    Gather             = "gather",                  Pw,                                             No,        Partial;
    ScatterAdd         = "scatter_add",             Alone,                                          No,        Launch;
    LayerNorm          = "layernorm",               anchors(KernelFamily::LayerNorm { residual: false, aux: false }), No, Launch;
    LayerNormGradX     = "layernorm_grad_x",        anchors(KernelFamily::LayerNormBwd { residual: false }), No, Launch;
    LayerNormGradGamma = "layernorm_grad_gamma",    anchors(KernelFamily::LayerNormBwdGamma),       No,        Launch;
    Softmax            = "softmax",                 anchors(KernelFamily::Softmax),                 No,        Launch;
    SoftmaxGrad        = "softmax_grad",            anchors(KernelFamily::SoftmaxBwd),              No,        Launch;
    // a softmax row kernel; the attention rules (causal `softmax` only) leave it unfused
    PackedSoftmax      = "packed_softmax",          anchors(KernelFamily::Softmax),                 No,        Launch;
    CrossEntropy       = "cross_entropy",           anchors(KernelFamily::CrossEntropy),            No,        Launch;
    CrossEntropyGrad   = "cross_entropy_grad",      anchors(KernelFamily::CrossEntropyGrad),        No,        Launch;
    // the per-token weighted loss (instruction data): the same kernels, a weight read per row
    WeightedCrossEntropy = "weighted_cross_entropy", anchors(KernelFamily::CrossEntropy),           No,        Launch;
    WeightedCrossEntropyGrad = "weighted_cross_entropy_grad", anchors(KernelFamily::CrossEntropyGrad), No,      Launch;
    FakeQuant          = "fake_quant",              anchors(KernelFamily::FakeQuant),               Expand,    Launch;
    Dequantize         = "dequantize",              anchors(KernelFamily::Dequant),                 Expand,    Launch;
    // reads its element and its group's scale (and zero point)
    FakeQuantLearned   = "fake_quant_learned",      Pw,                                             No,        Launch;
    FakeQuantLearnedGrad = "fake_quant_learned_grad", Pw,                                           No,        Launch;
    // a per-row absmax: a reduction
    ActQuant           = "act_quant",               Alone,                                          No,        Launch;
    Dropout            = "dropout",                 Pw,                                             No,        Launch;
    AllFinite          = "all_finite",              Alone,                                          No,        Launch;
    Select             = "select",                  Pw,                                             No,        Launch;
    LossScale          = "loss_scale",              Alone,                                          No,        Launch;
    // already a kernel: fusion runs once, on a graph without them
    Kernel             = "kernel",                  Alone,                                          No,        Launch;
    AdamM              = "adam_m",                  Pw,                                             No,        Launch;
    AdamV              = "adam_v",                  Pw,                                             No,        Launch;
    AdamParam          = "adam_param",              Pw,                                             No,        Launch;
    // 8-bit AdamW's moments. block_dequant and block_quant compute each element from a fixed set
    // of input elements (its code or value and its block's absmax), so they could join pointwise
    // chains; they stay alone because the blockwise AdamW (`qatc_kernels`' `lower/adamw8.rs`)
    // takes the unfused dequantization, update and requantization of a tensor's moments into one
    // kernel over their own storage, which a pointwise chain through them would hide from it.
    // (Marked pointwise, today's rules happen to fuse them into nothing: the tiny model's fused
    // step and plan are the same under adamw8bit with full fine-tune, bf16, LoRA 4-bit, clipping,
    // grad-accum 2 and block checkpoints. Alone keeps it so by construction, not by extraction's
    // choice.) block_absmax is a reduction over a block.
    BlockDequant       = "block_dequant",           Alone,                                          No,        Launch;
    BlockAbsMax        = "block_absmax",            Alone,                                          No,        Launch;
    BlockQuant         = "block_quant",             Alone,                                          No,        Launch;
    // collectives: each rank's result needs every rank's operand, so never part of a kernel
    AllReduce          = "all_reduce",              Alone,                                          No,        Launch;
    ReduceScatter      = "reduce_scatter",          Alone,                                          No,        Launch;
    AllGather          = "all_gather",              Alone,                                          No,        Launch;
}

impl OpKind {
    /// The kind whose mnemonic is `s`.
    pub fn from_mnemonic(s: &str) -> Option<OpKind> {
        OpKind::ALL.iter().copied().find(|k| k.mnemonic() == s)
    }

    /// A leaf: an op without operands.
    pub fn is_leaf(self) -> bool {
        matches!(self, OpKind::Input | OpKind::Const)
    }

    /// Fusion treats it as pointwise (see [`Fusion::Pointwise`]).
    pub fn is_pointwise(self) -> bool {
        self.props().fusion == Fusion::Pointwise
    }

    /// The family of a kernel made of this op alone: `pointwise` for pointwise ops, the anchored
    /// family for the others fusion builds kernels around, None for ops fusion leaves alone.
    pub fn family(self) -> Option<KernelFamily> {
        match self.props().fusion {
            Fusion::Pointwise => Some(KernelFamily::Pointwise),
            Fusion::Anchors(f) => Some(f),
            Fusion::Alone => None,
        }
    }

    /// The op only moves, replicates or fills data.
    pub fn is_layout(self) -> bool {
        self.props().recompute == Recompute::Layout
    }

    /// The op is cheap to recompute in any kernel: a layout op or a scale and shift.
    pub fn is_cheap(self) -> bool {
        matches!(self.props().recompute, Recompute::Layout | Recompute::Scale)
    }

    /// A kernel may recompute the op even when other kernels also need its value.
    pub fn is_recomputable(self) -> bool {
        self.props().recompute != Recompute::No
    }
}
