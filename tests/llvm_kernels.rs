//! Every kernel of the training step compiles through the LLVM backend (O3, host CPU).

#![cfg(feature = "llvm")]

use qatc::frontend::config::Gpt2Config;
use qatc::step::{self, StepOptions};
use qatc_ir::{QuantScheme, QuantSpec};
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::LoraOptions;
use qatc_passes::quant::QuantOptions;

fn qlora(b: usize, t: usize, r: usize, group: usize) -> StepOptions {
    let mut o = StepOptions::new(b, t);
    o.model.full_finetune = false;
    o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group, scheme: QuantScheme::Sym }));
    o.model.lora = Some(LoraOptions::new(r));
    o
}

fn compile_all(cfg: &Gpt2Config, o: &StepOptions) -> usize {
    let (g, _) = step::train(cfg, o, |_, _| {}).expect("the step builds");
    let prog = qatc_kernels::lower(&g).expect("the step lowers");
    let t = std::time::Instant::now();
    let jit = qatc_kernels::llvm::Jit::compile(&prog.kernels).expect("every kernel compiles");
    eprintln!("{} kernels JIT-compiled in {:.2} s", jit.len(), t.elapsed().as_secs_f64());
    jit.len()
}

#[test]
fn every_kernel_of_the_tiny_step_compiles() {
    let tiny = Gpt2Config { n_embd: 8, n_layer: 1, n_head: 2, n_positions: 8, vocab_size: 11, layer_norm_epsilon: 1e-5 };
    let mut o = StepOptions::new(2, 8);
    o.model.full_finetune = true;
    assert!(compile_all(&tiny, &o) > 10);
    let mut q = qlora(2, 8, 4, 8);
    compile_all(&tiny, &q);
    q.fuse = Some(FuseOptions::default());
    compile_all(&tiny, &q);
}

#[test]
fn every_kernel_of_the_gpt2_124m_step_compiles() {
    let cfg = Gpt2Config::preset("124M").expect("a preset");
    let mut o = qlora(1, 64, 16, 64);
    o.fuse = Some(FuseOptions::default());
    compile_all(&cfg, &o);
}

/// A kernel that loads packed 4-bit codes at its own element index unpacks them a block of
/// elements at a time (`llvm/space.rs`'s `UNPACK`, 512), with one element before the blocks and
/// one after when its range starts or ends on an odd element. Every split of a [3, 5]
/// dequantization (odd rows, so rows start on odd elements), and of the same without
/// coordinates, agrees with the kernel-IR evaluator exactly; so do splits of a [3, 1101] one
/// around the block boundaries (rows of three blocks, the last one short).
#[test]
fn packed_codes_by_blocks_at_every_range() {
    check_packed_codes(3, 5, &(0..=15).collect::<Vec<_>>());
    let edges = [0, 1, 2, 510, 511, 512, 513, 1023, 1024, 1025, 1100, 1101, 1102, 1103, 1613, 1614, 2202, 3302, 3303];
    check_packed_codes(3, 1101, &edges);
}

/// Every range between two of `edges` (element indices of a [rows, cols] dequantization).
fn check_packed_codes(rows: usize, cols: usize, edges: &[usize]) {
    use qatc_ir::DType;
    use qatc_kernels::kir::{BinOp, Body, Expr, Ix, Kernel, Param, Space, Stmt, Ty};
    use qatc_runtime::cpu::{KirEval, Launcher};

    let n = rows * cols;
    let param = |name: &str, dtype, shape: &[usize], write| Param { name: name.into(), dtype, shape: shape.to_vec(), write };
    let load = |p: usize, i: Expr| Expr::Load { param: p, index: Box::new(i) };
    let code = Expr::Cast(Ty::F32, Box::new(Expr::bin(BinOp::Sub, load(0, Expr::Ix(Ix::Elem)), Expr::Int(7))));
    let kernel = |scale_ix: Expr| Kernel {
        family: "dequant".into(),
        params: vec![
            param("codes", DType::I4, &[rows, cols], false),
            param("scales", DType::F32, &[cols], false),
            param("out", DType::F32, &[rows, cols], true),
        ],
        index_ty: Ty::I32,
        body: Body::Loops {
            space: Space::Elements { shape: vec![rows, cols] },
            stmts: vec![Stmt::Store { param: 2, index: Expr::Ix(Ix::Elem), value: Expr::bin(BinOp::Mul, code.clone(), load(1, scale_ix)) }],
        },
        note: String::new(),
        names: Default::default(),
    };
    // with coordinates (a row loop) and without (one flat loop)
    let kernels = [kernel(Expr::Ix(Ix::Coord(1))), kernel(Expr::Int(2))];
    let jit = qatc_kernels::llvm::Jit::compile(&kernels).expect("compiles");
    let eval = KirEval::new(&kernels);
    let mut codes: Vec<u8> = (0..n.div_ceil(2)).map(|i| (i as u8).wrapping_mul(37) ^ 0x5a).collect();
    let mut scales: Vec<f32> = (0..cols).map(|i| 0.5 + i as f32).collect();
    let edges: Vec<usize> = edges.iter().copied().filter(|&e| e <= n).collect();
    for k in 0..kernels.len() {
        for &start in &edges {
            for &end in edges.iter().filter(|&&e| e >= start) {
                let (mut a, mut b) = (vec![-1.0f32; n], vec![-1.0f32; n]);
                for (l, out) in [(&jit as &dyn Launcher, &mut a), (&eval as &dyn Launcher, &mut b)] {
                    let args = [codes.as_mut_ptr(), scales.as_mut_ptr().cast::<u8>(), out.as_mut_ptr().cast::<u8>()];
                    // SAFETY: one pointer per param, each to a live buffer of the param's size.
                    unsafe { l.launch(k, &args, start, end) }.expect("runs");
                }
                assert_eq!(a, b, "[{rows}, {cols}] kernel {k}, elements {start}..{end}");
            }
        }
    }
}

/// A flat kernel indexed `i % C` and `i / C` (a bias broadcast over rows of C, read by a kernel
/// whose result is reshaped flat) runs as rows of C (`llvm/space.rs`'s `row_modulus`), the two
/// read off the row loop: every split of it, at and around the row edges, agrees with the
/// kernel-IR evaluator exactly; so does a kernel whose two moduli differ, which runs flat.
#[test]
fn a_flat_space_indexed_modulo_a_row_runs_by_rows() {
    use qatc_ir::DType;
    use qatc_kernels::kir::{BinOp, Body, Expr, Ix, Kernel, Param, Space, Stmt, Ty};
    use qatc_runtime::cpu::{KirEval, Launcher};

    let (rows, c) = (3usize, 40usize);
    let n = rows * c;
    let param = |name: &str, shape: &[usize], write| Param { name: name.into(), dtype: DType::F32, shape: shape.to_vec(), write };
    let load = |p: usize, i: Expr| Expr::Load { param: p, index: Box::new(i) };
    let elem = || Expr::Ix(Ix::Elem);
    let kernel = |second: i64| {
        // out[i] = x[i] * b[i % C] + (i / C) + b[i % second]
        let value = Expr::bin(
            BinOp::Add,
            Expr::bin(
                BinOp::Add,
                Expr::bin(BinOp::Mul, load(0, elem()), load(1, Expr::bin(BinOp::Rem, elem(), Expr::Int(c as i64)))),
                Expr::Cast(Ty::F32, Box::new(Expr::bin(BinOp::Div, elem(), Expr::Int(c as i64)))),
            ),
            load(1, Expr::bin(BinOp::Rem, elem(), Expr::Int(second))),
        );
        Kernel {
            family: "pointwise".into(),
            params: vec![param("x", &[n], false), param("b", &[c], false), param("out", &[n], true)],
            index_ty: Ty::I32,
            body: Body::Loops { space: Space::Elements { shape: vec![n] }, stmts: vec![Stmt::Store { param: 2, index: elem(), value }] },
            note: String::new(),
            names: Default::default(),
        }
    };
    // one modulus (rows of 40), and two (40 and 8: flat)
    let kernels = [kernel(c as i64), kernel(8)];
    let jit = qatc_kernels::llvm::Jit::compile(&kernels).expect("compiles");
    let eval = KirEval::new(&kernels);
    let mut x: Vec<f32> = (0..n).map(|i| 0.25 + i as f32 * 0.5).collect();
    let mut b: Vec<f32> = (0..c).map(|i| 1.0 - i as f32 * 0.125).collect();
    let edges = [0, 1, 7, 39, 40, 41, 79, 80, 81, 100, 119, 120];
    for k in 0..kernels.len() {
        for &start in &edges {
            for &end in edges.iter().filter(|&&e| e >= start) {
                let (mut got, mut want) = (vec![-1.0f32; n], vec![-1.0f32; n]);
                for (l, out) in [(&jit as &dyn Launcher, &mut got), (&eval as &dyn Launcher, &mut want)] {
                    let args = [x.as_mut_ptr().cast::<u8>(), b.as_mut_ptr().cast::<u8>(), out.as_mut_ptr().cast::<u8>()];
                    // SAFETY: one pointer per param, each to a live buffer of the param's size.
                    unsafe { l.launch(k, &args, start, end) }.expect("runs");
                }
                assert_eq!(got, want, "kernel {k}, elements {start}..{end}");
            }
        }
    }
}

/// The backend's inline exp and tanh (`llvm/math.rs`: Cephes' polynomials, their multiply-adds
/// fused where the CPU has FMA) against libm's, over every range the step's kernels meet (the
/// softmaxes' x - max <= 0, GELU's tanh arguments, the clamps at -104 and 89): within 2 ulp
/// wherever the result is a normal f32, and the edges exact (exp(0) = 1, exp(-inf) = 0,
/// exp(+inf) = inf, tanh(0) = 0, tanh(+-20) = +-1, NaN stays NaN). A vector path and its scalar
/// tail are both exercised (the length is no multiple of any vector width).
#[test]
fn inline_exp_and_tanh_are_within_two_ulp_of_libm() {
    use qatc_ir::DType;
    use qatc_kernels::kir::{Body, Expr, Ix, Kernel, Param, Space, Stmt, Ty, UnOp};
    use qatc_runtime::cpu::Launcher;

    let mut xs: Vec<f32> = (0..200_003).map(|i| -104.0 + i as f32 * (193.0 / 200_003.0)).collect();
    xs.extend((0..20_001).map(|i| -1.0 + i as f32 * 1e-4));
    xs.extend([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 20.0, -20.0, 1e-30, -1e-30]);
    let n = xs.len();
    let param = |name: &str, write| Param { name: name.into(), dtype: DType::F32, shape: vec![n], write };
    let kernel = |op: UnOp| Kernel {
        family: "pointwise".into(),
        params: vec![param("x", false), param("y", true)],
        index_ty: Ty::I32,
        body: Body::Loops {
            space: Space::Elements { shape: vec![n] },
            stmts: vec![Stmt::Store {
                param: 1,
                index: Expr::Ix(Ix::Elem),
                value: Expr::un(op, Expr::Load { param: 0, index: Box::new(Expr::Ix(Ix::Elem)) }),
            }],
        },
        note: String::new(),
        names: Default::default(),
    };
    let kernels = [kernel(UnOp::Exp), kernel(UnOp::Tanh)];
    let jit = qatc_kernels::llvm::Jit::compile(&kernels).expect("compiles");
    let libm: [fn(f32) -> f32; 2] = [f32::exp, f32::tanh];
    for (k, name) in ["exp", "tanh"].iter().enumerate() {
        let (mut x, mut y) = (xs.clone(), vec![0f32; n]);
        let args = [x.as_mut_ptr().cast::<u8>(), y.as_mut_ptr().cast::<u8>()];
        // SAFETY: one pointer per param, each to a live buffer of n floats.
        unsafe { jit.launch(k, &args, 0, n) }.expect("runs");
        let mut worst = 0f64;
        for (&x, &got) in xs.iter().zip(&y) {
            let want = libm[k](x);
            if want.is_nan() {
                assert!(got.is_nan(), "{name}({x}) = {got}, not NaN");
                continue;
            }
            if !want.is_normal() || want.is_infinite() {
                assert!(got == want || (got - want).abs() <= f32::MIN_POSITIVE, "{name}({x}) = {got}, libm {want}");
                continue;
            }
            // one unit in the last place of the result: 2^(its exponent - 23)
            let ulp = f64::from(f32::from_bits(want.to_bits() & 0x7f80_0000)) * f64::from(f32::EPSILON);
            let err = f64::from(got - want).abs() / ulp;
            worst = worst.max(err);
            assert!(err <= 2.0, "{name}({x}) = {got:e}, libm {want:e}: {err:.2} ulp");
        }
        let at = |v: f32| xs.iter().rposition(|&x| x.to_bits() == v.to_bits()).expect("in the inputs");
        let edges: &[(f32, f32)] = if k == 0 {
            &[(0.0, 1.0), (f32::NEG_INFINITY, 0.0), (f32::INFINITY, f32::INFINITY)]
        } else {
            &[(0.0, 0.0), (20.0, 1.0), (-20.0, -1.0), (f32::INFINITY, 1.0), (f32::NEG_INFINITY, -1.0)]
        };
        for &(x, want) in edges {
            assert_eq!(y[at(x)], want, "{name}({x})");
        }
        eprintln!("{name}: worst {worst:.2} ulp over {n} arguments");
    }
}
