//! Dequantization prologues: a frozen 4-bit weight is expanded tile by tile inside the GEMM that
//! reads it, so its f32 copy is never written (QLoRA's on-the-fly dequantization). The expansion
//! may be recomputed by every GEMM that reads the weight (forward and input-gradient): reading
//! the codes costs an eighth of reading the f32 weight.

use qatc_ir::{GemmFamily, GemmPrologue, KernelFamily};

use super::{Family, Fuse, Rule, Take};

pub fn rules() -> Vec<Rule> {
    vec![
        // matmul(x, dequantize(codes, scales))  =>  gemm.dequant(x, codes, scales)
        //   x may be read strided (its transpose / reshape / slice inlined)
        Rule::Fuse(Fuse {
            name: "dequant-prologue",
            lhs: "(matmul ?x (dequantize ?c ?s))",
            absorb: &[("x", Take::Cheap)],
            family: Family::New(KernelFamily::Gemm(GemmFamily::with_prologue(GemmPrologue::Dequant))),
            check: |m| m.root().is_some_and(|t| t.shape.rank() == 2),
            aux: false,
        }),
        // matmul(x, dequantize(codes, scales, zeros))  =>  gemm.dequant(x, codes, scales, zeros)
        //   (asymmetric scheme: a zero-point per group)
        Rule::Fuse(Fuse {
            name: "dequant-prologue-zp",
            lhs: "(matmul ?x (dequantize ?c ?s ?z))",
            absorb: &[("x", Take::Cheap)],
            family: Family::New(KernelFamily::Gemm(GemmFamily::with_prologue(GemmPrologue::Dequant))),
            check: |m| m.root().is_some_and(|t| t.shape.rank() == 2),
            aux: false,
        }),
        // matmul(x, fake_quant(w))  =>  gemm.fake_quant(x, w)
        //   a trainable quantized weight is rounded to its grid in the prologue (full QAT)
        Rule::Fuse(Fuse {
            name: "fake-quant-prologue",
            lhs: "(matmul ?x (fake_quant ?w))",
            absorb: &[("x", Take::Cheap)],
            family: Family::New(KernelFamily::Gemm(GemmFamily::with_prologue(GemmPrologue::FakeQuant))),
            check: |m| m.root().is_some_and(|t| t.shape.rank() == 2),
            aux: false,
        }),
    ]
}
