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
/// elements at a time (`llvm/loops.rs`'s `UNPACK`, 512), with one element before the blocks and
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
