//! The choice sequence the generator reads, and the odd names and floats it draws from.

use qatc_ir::{DType, Epilogue, GemmFamily, GemmPrologue, KernelFamily};

/// Names with characters the printer must escape and the parser must unescape: quotes,
/// backslashes, whitespace, control characters, non-ASCII, a leading combining mark (which
/// Rust's `{:?}` escapes as `\u{301}`), text that looks like syntax, and the empty name.
pub const NAMES: [&str; 22] = [
    "x",
    "wte.weight",
    "h.0.attn.c_attn.lora_A",
    "with space",
    "quo\"te",
    "back\\slash",
    "\\\"both\\\"",
    "tab\tnew\nline\rcr",
    "nul\0byte",
    "del\u{7f}",
    "ünïcödé",
    "日本語",
    "🦀 crab",
    "\u{301}combining first",
    "zero\u{200b}width",
    "%0 = input",
    "} {",
    "// not a comment",
    "=,[]()",
    "'single'",
    "   ",
    "",
];

/// Float attributes and const values: ordinary, negative, signed zero, extreme, non-finite.
pub const FLOATS: [f64; 24] = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    -1.5,
    0.1,
    1.0 / 3.0,
    std::f64::consts::PI,
    1e-5,
    1e-300,
    -1e-300,
    5e-324,
    f64::MIN_POSITIVE,
    1e300,
    -1e300,
    f64::MAX,
    f64::MIN,
    123_456_789.0,
    -7.25e-12,
    f64::INFINITY,
    f64::NEG_INFINITY,
    f64::NAN,
    0.999,
];

/// Reads choices from a list; past its end every choice is 0 (the "simplest" option).
pub struct Choices {
    v: Vec<u32>,
    i: usize,
}

impl Choices {
    pub fn new(v: Vec<u32>) -> Choices {
        Choices { v, i: 0 }
    }
    pub fn next(&mut self) -> u32 {
        let x = self.v.get(self.i).copied().unwrap_or(0);
        self.i += 1;
        x
    }
    /// A number in [0, n); 0 when n is 0.
    pub fn below(&mut self, n: usize) -> usize {
        let x = self.next() as usize;
        if n == 0 {
            0
        } else {
            x % n
        }
    }
    /// A number in [lo, hi].
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }
    pub fn flip(&mut self) -> bool {
        self.next() % 2 == 1
    }
    /// True with probability about 1/n.
    pub fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == n - 1
    }
    pub fn pick<T: Clone>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())].clone()
    }
    pub fn float(&mut self) -> f64 {
        if self.one_in(5) {
            // Any bit pattern: subnormals, NaN payloads, everything the printer must cope with.
            f64::from_bits((u64::from(self.next()) << 32) | u64::from(self.next()))
        } else {
            self.pick(&FLOATS)
        }
    }
    pub fn float_dtype(&mut self) -> DType {
        self.pick(&[DType::F32, DType::F16, DType::BF16])
    }
    pub fn any_dtype(&mut self) -> DType {
        self.pick(&DType::ALL)
    }
    pub fn dim(&mut self) -> usize {
        if self.one_in(8) {
            self.pick(&[5, 7, 12])
        } else {
            self.range(1, 4)
        }
    }
    pub fn dims(&mut self, min_rank: usize, max_rank: usize) -> Vec<usize> {
        let r = self.range(min_rank, max_rank);
        (0..r).map(|_| self.dim()).collect()
    }
    /// A random permutation of 0..n (Fisher-Yates).
    pub fn perm(&mut self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = self.below(i + 1);
            p.swap(i, j);
        }
        p
    }
}

/// Every kernel family variant at least once, every GEMM prologue, epilogue and flag, and the
/// texts fusion prints on GPT-2's steps. `variant` (below) is an exhaustive match: a new family
/// fails to compile here until it is numbered, and `every_kernel_family_round_trips` asks for
/// an example of each number.
pub fn families() -> Vec<KernelFamily> {
    use KernelFamily as F;
    let gemm =
        |prologue, epilogues: &[Epilogue], aux, lora_down| F::Gemm(GemmFamily { prologue, epilogues: epilogues.to_vec(), aux, lora_down });
    let mut v = vec![
        F::Pointwise,
        F::ReduceSum,
        F::GEMM,
        F::Dequant,
        F::FakeQuant,
        F::LayerNorm { residual: false, aux: false },
        F::LayerNorm { residual: true, aux: false },
        F::LayerNorm { residual: false, aux: true },
        F::LayerNorm { residual: true, aux: true },
        F::LayerNormBwd { residual: false },
        F::LayerNormBwd { residual: true },
        F::LayerNormBwdAll,
        F::LayerNormBwdGamma,
        F::Softmax,
        F::SoftmaxBwd,
        F::AttentionScores,
        F::AttentionFlash,
        F::AttentionBwdScores,
        F::AttentionBwdFlash,
        F::CrossEntropy,
        F::CrossEntropyGrad,
        F::CrossEntropySoftmaxInPlace,
        F::CrossEntropyLinear { chunk_rows: 1 },
        F::CrossEntropyLinear { chunk_rows: 128 },
        F::AdamWMultiTensor,
        gemm(GemmPrologue::Dequant, &[Epilogue::Bias, Epilogue::Lora, Epilogue::Gelu], true, true),
        gemm(GemmPrologue::StridedScaled, &[Epilogue::Permute, Epilogue::Scale, Epilogue::Scale], false, false),
        gemm(GemmPrologue::FakeQuant, &[Epilogue::DGelu, Epilogue::Residual], true, false),
    ];
    for p in [GemmPrologue::None, GemmPrologue::Strided, GemmPrologue::Scaled] {
        for e in Epilogue::ALL {
            v.push(gemm(p, &[e], false, false));
            v.push(gemm(p, &[e, Epilogue::Lora], false, true));
        }
    }
    v
}

/// The number of kernel family variants.
pub const FAMILY_VARIANTS: usize = 20;

/// A kernel family's variant, numbered 0..FAMILY_VARIANTS.
pub fn variant(f: &KernelFamily) -> usize {
    use KernelFamily as F;
    match f {
        F::Pointwise => 0,
        F::ReduceSum => 1,
        F::Gemm(_) => 2,
        F::Dequant => 3,
        F::FakeQuant => 4,
        F::LayerNorm { .. } => 5,
        F::LayerNormBwd { .. } => 6,
        F::LayerNormBwdAll => 7,
        F::LayerNormBwdGamma => 8,
        F::Softmax => 9,
        F::SoftmaxBwd => 10,
        F::AttentionScores => 11,
        F::AttentionFlash => 12,
        F::AttentionBwdScores => 13,
        F::AttentionBwdFlash => 14,
        F::CrossEntropy => 15,
        F::CrossEntropyGrad => 16,
        F::CrossEntropySoftmaxInPlace => 17,
        F::CrossEntropyLinear { .. } => 18,
        F::AdamWMultiTensor => 19,
    }
}
