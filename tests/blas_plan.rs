//! The cuBLAS(Lt) planner (`kernels/src/cuda/blas/`) checked on the CPU against a host model of
//! column-major GEMM semantics, for every GEMM of the tiny and the 124M training steps (unfused
//! and fused, full fine-tune and 4-bit + LoRA) and for hand-made GEMMs that need every fallback.
//!
//! Memory is virtual: an element's value is a hash of (buffer, index) until a step writes it, so
//! even the 124M step's GEMMs need no real buffers. Each plan's calls are checked for legality
//! (leading dimensions at least the rows as stored, strides, scratch); the tiny step's plans are
//! executed whole by the host model and every output element compared with the product computed
//! straight from the row-major views; the 124M step's are checked element by element on a sample
//! of outputs (`blas::host::value_at`, which follows the plan without running it). The same for
//! the steps in bf16 and fp16: 16-bit A/B with fp32 compute, 16-bit destinations rounded to
//! nearest even once, every call a type combination cuBLAS(Lt) takes.

mod common;

use std::collections::HashMap;

use qatc::frontend::config::Gpt2Config;
use qatc::step::{self, StepOptions};
use qatc_ir::{DType, QuantScheme, QuantSpec};
use qatc_kernels::cuda::blas::host::{self, HostMemory};
use qatc_kernels::cuda::blas::{plan, BlasMode, BlasPlan, BlasStep, Compute, ElemType, Mem, Op};
use qatc_kernels::program::{BufKind, Buffer, Gemm, View};
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::LoraOptions;
use qatc_passes::precision::Precision;
use qatc_passes::quant::QuantOptions;

/// Hash values under a sparse layer of written elements. Scratch must be written before it is
/// read (a plan that reads a scratch it never filled is wrong). A buffer of a 16-bit type holds
/// values of that type (its hashes rounded to it), and a store to it rounds to nearest even, as
/// the device's memory does.
#[derive(Clone, Default)]
struct VirtualMemory {
    written: HashMap<(Mem, usize), f32>,
    /// The element type of each buffer that is not f32.
    types: HashMap<Mem, ElemType>,
}

/// `v` as an element of type `ty` holds it (round to nearest even).
fn round_to(ty: ElemType, v: f32) -> f32 {
    match ty {
        ElemType::F32 => v,
        ElemType::BF16 => half::bf16::from_f32(v).to_f32(),
        ElemType::F16 => half::f16::from_f32(v).to_f32(),
    }
}

impl VirtualMemory {
    /// A memory whose buffers have the element types of `buffers`.
    fn typed(buffers: &[Buffer]) -> VirtualMemory {
        let types = buffers
            .iter()
            .enumerate()
            .filter_map(|(i, b)| match b.dtype {
                DType::BF16 => Some((Mem::Buf(i), ElemType::BF16)),
                DType::F16 => Some((Mem::Buf(i), ElemType::F16)),
                _ => None,
            })
            .collect();
        VirtualMemory { written: HashMap::new(), types }
    }

    fn ty(&self, m: Mem) -> ElemType {
        self.types.get(&m).copied().unwrap_or(ElemType::F32)
    }
}

fn hash_value(mem: Mem, i: usize) -> f32 {
    let key = match mem {
        Mem::Buf(b) => (b as u64) << 40,
        Mem::Scratch(s) => (1u64 << 63) | ((s as u64) << 40),
    } ^ i as u64;
    let mut z = key.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    ((z >> 40) as f64 / (1u64 << 24) as f64 * 2.0 - 1.0) as f32
}

impl HostMemory for VirtualMemory {
    fn load(&self, mem: Mem, i: usize, ty: ElemType) -> Result<f32, String> {
        if let Mem::Buf(_) = mem {
            if ty != self.ty(mem) {
                return Err(format!("{mem:?} of {:?} read as {ty:?}", self.ty(mem)));
            }
        }
        match (self.written.get(&(mem, i)), mem) {
            (Some(&v), _) => Ok(v),
            (None, Mem::Scratch(s)) => Err(format!("scratch {s} element {i} read before it was written")),
            (None, _) => Ok(hash_or_written(self, mem, i)),
        }
    }
    fn store(&mut self, mem: Mem, i: usize, ty: ElemType, v: f32) -> Result<(), String> {
        if let Mem::Buf(_) = mem {
            if ty != self.ty(mem) {
                return Err(format!("{mem:?} of {:?} written as {ty:?}", self.ty(mem)));
            }
        }
        self.written.insert((mem, i), round_to(ty, v));
        Ok(())
    }
}

/// Where element `coords` of a view lives.
fn at(v: &View, coords: &[usize]) -> usize {
    v.offset + coords.iter().zip(&v.strides).map(|(c, s)| c * s).sum::<usize>()
}

/// c[batch.., i, j] after the GEMM, straight from the row-major definition: alpha a @ b (+ c)
/// (+ bias[j]).
fn reference(g: &Gemm, mem: &VirtualMemory, batch: &[usize], i: usize, j: usize) -> f64 {
    let load = |v: &View, c: &[usize]| f64::from(hash_or_written(mem, Mem::Buf(v.buf), at(v, c)));
    let with = |x: usize, y: usize| -> Vec<usize> { batch.iter().copied().chain([x, y]).collect() };
    let dot: f64 = (0..g.k).map(|l| load(&g.a, &with(i, l)) * load(&g.b, &with(l, j))).sum();
    let mut d = g.alpha * dot;
    if g.accumulate {
        d += load(&g.c, &with(i, j));
    }
    if let Some(b) = &g.bias {
        d += load(b, &[j]);
    }
    d
}

fn hash_or_written(mem: &VirtualMemory, m: Mem, i: usize) -> f32 {
    mem.written.get(&(m, i)).copied().unwrap_or_else(|| round_to(mem.ty(m), hash_value(m, i)))
}

/// The batch coordinates of batch number `b` of `g` (row-major over c's batch dims).
fn batch_coords(g: &Gemm, mut b: usize) -> Vec<usize> {
    let dims = &g.c.shape[..g.c.shape.len() - 2];
    let mut cs = vec![0; dims.len()];
    for (c, &d) in cs.iter_mut().zip(dims).rev() {
        *c = b % d;
        b /= d;
    }
    cs
}

/// Every call legal as cuBLAS defines it, every scratch in range.
fn check_legal(what: &str, p: &BlasPlan) {
    for step in &p.steps {
        if let BlasStep::Call(c) = step {
            let rows = c.stored_rows();
            for (x, r, name) in [(&c.a, rows[0], "A"), (&c.b, rows[1], "B"), (&c.c, rows[2], "C")] {
                assert!(x.ld >= r.max(1), "{what}: ld{name} {} below its {r} rows: {c:?}", x.ld);
                if let Mem::Scratch(s) = x.mem {
                    assert!(s < p.scratch.len(), "{what}: scratch {s}");
                }
            }
            assert!(c.batch >= 1 && c.m > 0 && c.n > 0 && c.k > 0, "{what}: {c:?}");
            assert!(c.batch == 1 || c.c.stride >= c.c.ld * (c.n - 1) + c.m, "{what}: batches of C overlap: {c:?}");
            assert!(c.beta == 0.0 || c.beta == 1.0);
        }
    }
    if p.compute == Compute::F32 {
        assert!(p.calls().all(|c| c.a.ty == ElemType::F32), "{what}: strict fp32 on fp32 operands");
    }
    // the type combinations cublasGemmEx and cublasLtMatmul take with compute type 32F (scale
    // 32F): A and B fp32 (C/D fp32), or A and B both 16BF or both 16F with C/D of that type or
    // 32F; cuBLASLt's bias of D's type or 32F
    for c in p.calls() {
        let sixteen = matches!(c.a.ty, ElemType::BF16 | ElemType::F16);
        assert_eq!(c.a.ty, c.b.ty, "{what}: A and B of one type: {c:?}");
        assert_eq!(sixteen, p.compute == Compute::F32Acc16, "{what}: 16-bit operands, compute 32F with fp32 accumulation: {c:?}");
        assert!(c.c.ty == c.a.ty || c.c.ty == ElemType::F32, "{what}: C/D of A's type or fp32: {c:?}");
        assert!(c.bias.is_none_or(|v| v.ty == c.c.ty || v.ty == ElemType::F32), "{what}: a bias of D's type or fp32: {c:?}");
    }
}

/// Plans every GEMM of a program and checks it: whole (`full`) or on a sample of outputs.
/// Returns (GEMMs, library calls, calls on 16-bit operands, notes).
fn check_program(what: &str, prog: &qatc_kernels::Program, full: bool) -> (usize, usize, usize, Vec<String>) {
    let (mut gemms, mut calls, mut sixteen, mut notes) = (0, 0, 0, Vec::new());
    for g in prog.gemms() {
        let p = plan(g, &prog.buffers, BlasMode::Strict).unwrap_or_else(|e| panic!("{what}: {e}"));
        check_legal(what, &p);
        gemms += 1;
        calls += p.calls().count();
        sixteen += p.calls().filter(|c| c.a.ty != ElemType::F32).count();
        notes.extend(p.notes.iter().map(|n| format!("{}: {n}", g.note)));
        let mem = VirtualMemory::typed(&prog.buffers);
        // a 16-bit destination holds the product rounded to nearest even once
        let out_ty = mem.ty(Mem::Buf(g.c.buf));
        let batches: usize = g.c.shape[..g.c.shape.len() - 2].iter().product();
        let outputs = batches * g.m * g.n;
        let tol = |want: f64| 1e-5 * want.abs().max(1.0);
        if full {
            let mut run = mem.clone();
            host::execute(&p, &mut run).unwrap_or_else(|e| panic!("{what}: {e}"));
            for o in 0..outputs {
                let (b, i, j) = (o / (g.m * g.n), o / g.n % g.m, o % g.n);
                let cs = batch_coords(g, b);
                let want = f64::from(round_to(out_ty, reference(g, &mem, &cs, i, j) as f32));
                let loc = at(&g.c, &cs.iter().copied().chain([i, j]).collect::<Vec<_>>());
                let got = hash_or_written(&run, Mem::Buf(g.c.buf), loc);
                assert!(
                    (f64::from(got) - want).abs() <= tol(want),
                    "{what}, {}: c[{cs:?}, {i}, {j}] {got} vs {want}\n{}",
                    g.note,
                    p.summary()
                );
                // and the element-wise model agrees with the whole run
                if o % 7 == 0 {
                    let v = host::value_at(&p, &mem, Mem::Buf(g.c.buf), loc, out_ty).unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert_eq!(round_to(out_ty, v), got, "{what}, {}: value_at against execute", g.note);
                }
            }
        } else {
            // the corners and a spread of outputs
            let picks = (0..61).map(|s| s * 7919 % outputs.max(1)).chain([0, outputs.saturating_sub(1)]);
            for o in picks {
                let (b, i, j) = (o / (g.m * g.n), o / g.n % g.m, o % g.n);
                let cs = batch_coords(g, b);
                let want = f64::from(round_to(out_ty, reference(g, &mem, &cs, i, j) as f32));
                let loc = at(&g.c, &cs.iter().copied().chain([i, j]).collect::<Vec<_>>());
                let got = host::value_at(&p, &mem, Mem::Buf(g.c.buf), loc, out_ty).unwrap_or_else(|e| panic!("{what}: {e}"));
                let got = round_to(out_ty, got);
                assert!(
                    (f64::from(got) - want).abs() <= tol(want),
                    "{what}, {}: c[{cs:?}, {i}, {j}] {got} vs {want}\n{}",
                    g.note,
                    p.summary()
                );
            }
        }
    }
    (gemms, calls, sixteen, notes)
}

fn options(full_finetune: bool, fuse: bool, b: usize, t: usize) -> StepOptions {
    let mut o = StepOptions::new(b, t);
    if !full_finetune {
        o.model.full_finetune = false;
        // a group that divides every input dimension of both models (8 for the tiny one)
        let group = if t <= 8 { 8 } else { 64 };
        o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group, scheme: QuantScheme::Sym }));
        o.model.lora = Some(LoraOptions::new(4));
    }
    o.fuse = fuse.then(FuseOptions::default);
    o
}

/// Checks every GEMM of the step; returns how many library calls multiply 16-bit operands.
fn check_step(what: &str, cfg: &Gpt2Config, o: &StepOptions, full: bool) -> usize {
    let (g, _) = step::train(cfg, o, |_, _| {}).expect("the step builds");
    let prog = qatc_kernels::lower(&g).expect("lowers");
    let (gemms, calls, sixteen, notes) = check_program(what, &prog, full);
    assert!(gemms > 0);
    eprintln!("{what}: {gemms} GEMMs -> {calls} library calls ({sixteen} on 16-bit operands); {} not one plain call", notes.len());
    for n in notes.iter().take(8) {
        eprintln!("  {n}");
    }
    sixteen
}

#[test]
fn every_gemm_of_the_tiny_steps_runs_as_planned() {
    let tiny = Gpt2Config { n_embd: 8, n_layer: 1, n_head: 2, n_positions: 8, vocab_size: 11, layer_norm_epsilon: 1e-5 };
    for (full, fuse) in [(true, false), (true, true), (false, false), (false, true)] {
        check_step(&format!("tiny, full fine-tune {full}, fused {fuse}"), &tiny, &options(full, fuse, 2, 4), true);
    }
    let mut o = options(false, true, 1, 4);
    o.grad_accum = 2;
    check_step("tiny, 4-bit + LoRA, 2 micro-batches", &tiny, &o, true);
}

#[test]
fn every_gemm_of_the_124m_steps_is_planned_right() {
    let cfg = Gpt2Config::preset("124M").expect("a preset");
    check_step("124M, 4-bit + LoRA, unfused", &cfg, &options(false, false, 1, 64), false);
    check_step("124M, 4-bit + LoRA, fused", &cfg, &options(false, true, 1, 64), false);
    // B 2: the unfused attention's batch dims (B, heads) over slices of one qkv buffer do not nest
    check_step("124M, full fine-tune, unfused, B 2", &cfg, &options(true, false, 2, 64), false);
}

/// `--precision bf16|fp16`: every GEMM of the tiny steps (fused and unfused, full fine-tune and
/// 4-bit + LoRA) is 16-bit A/B with fp32 compute, legal, and the host model's result (16-bit
/// outputs rounded to nearest even once) is the product computed straight from the views.
#[test]
fn every_gemm_of_the_tiny_bf16_and_fp16_steps_runs_as_planned() {
    let tiny = Gpt2Config { n_embd: 8, n_layer: 1, n_head: 2, n_positions: 8, vocab_size: 11, layer_norm_epsilon: 1e-5 };
    for p in [Precision::Bf16, Precision::Fp16] {
        for (full, fuse) in [(true, false), (true, true), (false, false), (false, true)] {
            let mut o = options(full, fuse, 2, 4);
            o.precision = p;
            let sixteen = check_step(&format!("tiny, {p}, full fine-tune {full}, fused {fuse}"), &tiny, &o, true);
            assert!(sixteen > 0, "{p}: 16-bit GEMMs");
        }
    }
}

/// The 124M steps in bf16 (4-bit + LoRA unfused and fused, full fine-tune): every GEMM planned
/// legally, checked on a sample of outputs.
#[test]
fn every_gemm_of_the_124m_bf16_steps_is_planned_right() {
    let cfg = Gpt2Config::preset("124M").expect("a preset");
    for (what, full, fuse, b) in
        [("4-bit + LoRA, unfused", false, false, 1), ("4-bit + LoRA, fused", false, true, 1), ("full fine-tune, fused", true, true, 2)]
    {
        let mut o = options(full, fuse, b, 64);
        o.precision = Precision::Bf16;
        let sixteen = check_step(&format!("124M, bf16, {what}, B {b}"), &cfg, &o, false);
        assert!(sixteen > 0, "{what}: 16-bit GEMMs");
    }
}

/// A program of hand-made GEMMs over buffers of `sizes` elements.
fn program_of(sizes: &[usize], gemms: Vec<Gemm>) -> qatc_kernels::Program {
    let buffers = sizes.iter().enumerate().map(|(i, &n)| Buffer::new(format!("b{i}"), DType::F32, &[n], BufKind::Temp)).collect();
    qatc_kernels::Program {
        buffers,
        steps: gemms.into_iter().map(|g| qatc_kernels::Step::Gemm(Box::new(g))).collect(),
        ..Default::default()
    }
}

fn view(buf: usize, offset: usize, shape: &[usize], strides: &[usize]) -> View {
    View { buf, offset, shape: shape.to_vec(), strides: strides.to_vec() }
}

fn gemm(a: View, b: View, c: View, alpha: f64, accumulate: bool, bias: Option<View>) -> Gemm {
    let r = c.shape.len();
    let (m, n, k) = (c.shape[r - 2], c.shape[r - 1], a.shape[r - 1]);
    let types =
        qatc_kernels::program::GemmTypes { bias: bias.as_ref().map(|_| qatc_ir::DType::F32), ..qatc_kernels::program::GemmTypes::F32 };
    Gemm { a, b, c, m, n, k, alpha, accumulate, bias, types, note: "hand-made".into() }
}

/// What a case's plan must look like.
type ShapeCheck = fn(&BlasPlan) -> bool;

#[test]
fn every_fallback_computes_the_product() {
    let cases: Vec<(&str, Gemm, ShapeCheck)> = vec![
        // plain row-major with a bias: one call, the bias as the epilogue
        (
            "row-major + bias",
            gemm(
                view(0, 0, &[3, 5], &[5, 1]),
                view(1, 0, &[5, 4], &[4, 1]),
                view(2, 0, &[3, 4], &[4, 1]),
                0.5,
                true,
                Some(view(3, 4, &[4], &[1])),
            ),
            |p| p.calls().count() == 1 && p.calls().all(|c| c.bias.is_some() && c.ta == Op::N && c.tb == Op::N && c.m == 4),
        ),
        // the same with a bias 4 bytes off a 16-byte boundary, which some cuBLASLt algorithms
        // refuse: the call without it, then a step of its own
        (
            "row-major + an unaligned bias",
            gemm(
                view(0, 0, &[3, 5], &[5, 1]),
                view(1, 0, &[5, 4], &[4, 1]),
                view(2, 0, &[3, 4], &[4, 1]),
                0.5,
                true,
                Some(view(3, 1, &[4], &[1])),
            ),
            |p| p.calls().count() == 1 && p.calls().all(|c| c.bias.is_none()) && matches!(p.steps.last(), Some(BlasStep::AddBias { .. })),
        ),
        // transposed operands (a = x^T, b = w^T) read in place as op T
        (
            "transposed operands",
            gemm(view(0, 2, &[3, 5], &[1, 3]), view(1, 0, &[5, 4], &[1, 5]), view(2, 0, &[3, 4], &[4, 1]), 1.0, false, None),
            |p| p.calls().count() == 1 && p.steps.len() == 1 && p.calls().all(|c| c.ta == Op::T && c.tb == Op::T),
        ),
        // a column-major destination with a bias: computed directly, the bias a step of its own
        (
            "column-major c + bias",
            gemm(
                view(0, 0, &[3, 5], &[5, 1]),
                view(1, 0, &[5, 4], &[4, 1]),
                view(2, 0, &[3, 4], &[1, 3]),
                1.0,
                false,
                Some(view(3, 0, &[4], &[1])),
            ),
            |p| p.calls().all(|c| c.bias.is_none() && c.m == 3) && matches!(p.steps.last(), Some(BlasStep::AddBias { .. })),
        ),
        // an operand with no unit stride: packed
        (
            "a packed operand",
            gemm(view(0, 1, &[3, 5], &[10, 2]), view(1, 0, &[5, 4], &[4, 1]), view(2, 0, &[3, 4], &[4, 1]), 1.0, false, None),
            |p| matches!(p.steps.first(), Some(BlasStep::Pack { .. })) && p.calls().count() == 1,
        ),
        // a broadcast operand (stride 0 along a dim of size > 1): not a legal ld, packed
        (
            "a broadcast operand",
            gemm(view(0, 0, &[3, 5], &[0, 1]), view(1, 0, &[5, 4], &[4, 1]), view(2, 0, &[3, 4], &[4, 1]), 1.0, false, None),
            |p| matches!(p.steps.first(), Some(BlasStep::Pack { .. })),
        ),
        // a destination with no unit stride, accumulating: packed, computed, unpacked
        (
            "a strided destination",
            gemm(
                view(0, 0, &[3, 5], &[5, 1]),
                view(1, 0, &[5, 4], &[4, 1]),
                view(2, 0, &[3, 4], &[9, 2]),
                1.0,
                true,
                Some(view(3, 0, &[4], &[1])),
            ),
            |p| matches!(p.steps.first(), Some(BlasStep::Pack { .. })) && p.steps.iter().any(|s| matches!(s, BlasStep::Unpack { .. })),
        ),
        // attention-like heads: [B 2, NH 3] batch dims over slices of one qkv buffer, which do not
        // nest (NH stride hs, B stride T * 3C): a loop over B of strided-batched calls over NH
        (
            "heads: a loop of strided-batched calls",
            gemm(
                view(0, 0, &[2, 3, 4, 2], &[72, 2, 18, 1]),
                view(0, 6, &[2, 3, 2, 4], &[72, 2, 1, 18]),
                view(1, 0, &[2, 3, 4, 4], &[48, 16, 4, 1]),
                0.7,
                false,
                None,
            ),
            |p| p.calls().count() == 2 && p.calls().all(|c| c.batch == 3),
        ),
        // nesting batch dims: one strided-batched call
        (
            "nested batch dims",
            gemm(
                view(0, 0, &[2, 3, 4, 5], &[60, 20, 5, 1]),
                view(1, 0, &[2, 3, 5, 2], &[30, 10, 2, 1]),
                view(2, 0, &[2, 3, 4, 2], &[24, 8, 2, 1]),
                1.0,
                false,
                None,
            ),
            |p| p.calls().count() == 1 && p.calls().all(|c| c.batch == 6),
        ),
        // a weight shared across the batch: the batch folds into M, one call
        (
            "batch folded into M",
            gemm(
                view(0, 0, &[2, 3, 4, 5], &[60, 20, 5, 1]),
                view(1, 0, &[2, 3, 5, 2], &[0, 0, 2, 1]),
                view(2, 0, &[2, 3, 4, 2], &[24, 8, 2, 1]),
                1.0,
                false,
                None,
            ),
            |p| p.calls().count() == 1 && p.calls().all(|c| c.batch == 1 && c.n == 24),
        ),
        // k = 0: c = bias, no call
        (
            "k = 0",
            gemm(
                view(0, 0, &[3, 0], &[0, 1]),
                view(1, 0, &[0, 4], &[4, 1]),
                view(2, 0, &[3, 4], &[4, 1]),
                1.0,
                false,
                Some(view(3, 0, &[4], &[1])),
            ),
            |p| p.calls().count() == 0 && matches!(p.steps.as_slice(), [BlasStep::Zero { .. }, BlasStep::AddBias { .. }]),
        ),
    ];
    for (what, g, shape_ok) in cases {
        let prog = program_of(&[200, 200, 200, 10], vec![g.clone()]);
        let p = plan(&g, &prog.buffers, BlasMode::Strict).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(shape_ok(&p), "{what}: {}\n{p:#?}", p.summary());
        check_program(what, &prog, true);
        check_program(what, &prog, false);
        eprintln!("{what}: {}", p.summary());
    }
}

#[test]
fn tf32_and_16_bit_operands_pick_their_compute_type() {
    let g = gemm(view(0, 0, &[3, 5], &[5, 1]), view(1, 0, &[5, 4], &[4, 1]), view(2, 0, &[3, 4], &[4, 1]), 1.0, false, None);
    let mut prog = program_of(&[15, 20, 12], vec![g.clone()]);
    assert_eq!(plan(&g, &prog.buffers, BlasMode::Strict).expect("plans").compute, Compute::F32);
    assert_eq!(plan(&g, &prog.buffers, BlasMode::Tf32).expect("plans").compute, Compute::Tf32);
    for b in &mut prog.buffers[..2] {
        b.dtype = DType::BF16;
    }
    let p = plan(&g, &prog.buffers, BlasMode::Strict).expect("plans");
    assert_eq!(p.compute, Compute::F32Acc16);
    assert!(p.calls().all(|c| c.a.ty == ElemType::BF16 && c.b.ty == ElemType::BF16 && c.c.ty == ElemType::F32));
    // operands of two types, an integer operand and a panel-fed GEMM are refused with the reason
    prog.buffers[1].dtype = DType::F16;
    assert!(plan(&g, &prog.buffers, BlasMode::Strict).expect_err("two types").to_string().contains("two types"));
    prog.buffers[1].dtype = DType::I32;
    assert!(plan(&g, &prog.buffers, BlasMode::Strict).is_err());
}
