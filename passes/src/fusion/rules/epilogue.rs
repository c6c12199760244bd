//! GEMM epilogues and prologues: what a GEMM's output goes through next is applied to each tile
//! before it is stored (cuBLASLt's epilogues, llm.c's fused bias + GELU), and operands that are
//! only a transpose, reshape or slice of another tensor are read strided.
//!
//! Every epilogue rule absorbs the largest GEMM fragment of its operand, so they stack:
//! `gemm.dequant` + bias + lora + gelu.

use qatc_ir::{Anchor, Epilogue, OpKind, TensorType};

use super::{Family, Fuse, Match, Rule, Take};

const GEMM: &[Anchor] = &[Anchor::Gemm];

/// `r` has exactly the GEMM result's type (elementwise with it, no broadcast).
fn same_as_root(m: &Match, r: &str) -> bool {
    matches!((m.ty(r), m.root()), (Some(a), Some(b)) if a == b)
}

/// A per-column vector of the result: `b` is [N] for a result [.., N].
fn column_vector(b: Option<&TensorType>, y: Option<&TensorType>) -> bool {
    matches!((b, y), (Some(b), Some(y)) if b.shape.rank() == 1 && y.shape.rank() >= 2 && b.shape.dims()[0] == y.shape.last())
}

pub fn rules() -> Vec<Rule> {
    vec![
        // matmul(cheap(a), cheap(b))  =>  gemm[.strided][.scaled](a, b)
        //   transposes, reshapes and slices of the operands become strided loads, a scale (LoRA's
        //   alpha / r on the incoming gradient) is applied as the tile is loaded
        Rule::Fuse(Fuse {
            name: "gemm-prologue",
            lhs: "(matmul ?a ?b)",
            absorb: &[("a", Take::Cheap), ("b", Take::Cheap)],
            family: Family::GemmPrologue,
            check: |_| true,
            aux: false,
        }),
        // add(gemm(..), broadcast(b))  =>  gemm[+bias](.., b)          b [N], result [.., N]
        Rule::Fuse(Fuse {
            name: "epilogue-bias",
            lhs: "(add ?y (broadcast ?b))",
            absorb: &[("y", Take::Must(GEMM))],
            family: Family::Extend { var: "y", tag: Epilogue::Bias },
            check: |m| column_vector(m.ty("b"), m.root()),
            aux: false,
        }),
        // gelu(gemm(..))  =>  gemm[+gelu](..)
        //   aux: when the backward needs the pre-activation too, the kernel writes both
        //   (cuBLASLt's GELU_AUX)
        Rule::Fuse(Fuse {
            name: "epilogue-gelu",
            lhs: "(gelu ?y)",
            absorb: &[("y", Take::Must(GEMM))],
            family: Family::Extend { var: "y", tag: Epilogue::Gelu },
            check: |m| m.root().is_some_and(|t| t.shape.rank() >= 2),
            aux: true,
        }),
        // gelu_grad(x, gemm(..))  =>  gemm[+dgelu](.., x)       GELU's backward on the dx tile
        Rule::Fuse(Fuse {
            name: "epilogue-dgelu",
            lhs: "(gelu_grad ?x ?y)",
            absorb: &[("y", Take::Must(GEMM))],
            family: Family::Extend { var: "y", tag: Epilogue::DGelu },
            check: |m| same_as_root(m, "x"),
            aux: false,
        }),
        // add(gemm(..), r)  =>  gemm[+residual](.., r)          r has the result's type
        Rule::Fuse(Fuse {
            name: "epilogue-residual",
            lhs: "(add ?y ?r)",
            absorb: &[("y", Take::Must(GEMM))],
            family: Family::Extend { var: "y", tag: Epilogue::Residual },
            check: |m| same_as_root(m, "r") && !m.has("r", OpKind::Broadcast),
            aux: false,
        }),
        // add(r, gemm(..))  =>  gemm[+residual](.., r)
        Rule::Fuse(Fuse {
            name: "epilogue-residual-lhs",
            lhs: "(add ?r ?y)",
            absorb: &[("y", Take::Must(GEMM))],
            family: Family::Extend { var: "y", tag: Epilogue::Residual },
            check: |m| same_as_root(m, "r") && !m.has("r", OpKind::Broadcast),
            aux: false,
        }),
        // affine[s](gemm(..))  =>  gemm[*s](..)                 alpha scaling (LoRA's alpha / r)
        Rule::Fuse(Fuse {
            name: "epilogue-scale",
            lhs: "(affine ?y)",
            absorb: &[("y", Take::Must(GEMM))],
            family: Family::Extend { var: "y", tag: Epilogue::Scale },
            check: |m| m.root().is_some_and(|t| t.shape.rank() >= 2),
            aux: false,
        }),
        // transpose(gemm(..))  =>  gemm[permuted store](..)     attention's [B, NH, T, hs] ->
        //   [B, T, NH, hs] written directly in the layout the output projection reads
        Rule::Fuse(Fuse {
            name: "epilogue-permute",
            lhs: "(transpose ?y)",
            absorb: &[("y", Take::Must(GEMM))],
            family: Family::Extend { var: "y", tag: Epilogue::Permute },
            check: |m| m.root().is_some_and(|t| t.shape.rank() >= 2),
            aux: false,
        }),
    ]
}
