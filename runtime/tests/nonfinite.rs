//! Quantization never turns a NaN or an infinity into a finite number: a weight group holding one
//! fake-quantizes to NaN, in the interpreter (`quant::quantize`) and in the lowered kernel (the
//! kernel-IR evaluator, and LLVM's code when built with it) alike, and the other groups keep
//! their values.

mod common;

use common::{input_map, op_graph, In, Rng};
use qatc_ir::{Op, QuantScheme, QuantSpec};
use qatc_runtime::{CpuProgram, Interpreter, Value};

fn nan_mask(v: &Value<f32>) -> Vec<bool> {
    v.as_float().expect("a float output").data.iter().map(|x| x.is_nan()).collect()
}

#[test]
fn a_group_holding_a_nan_or_an_infinity_fake_quantizes_to_nan_everywhere() {
    let mut rng = Rng::new(11);
    for scheme in QuantScheme::ALL {
        let spec = QuantSpec { bits: 4, group: 32, scheme };
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            // w [64, 3]: groups of 32 rows per column; element [40, 2] (column 2's second group)
            let mut w = rng.vec(64 * 3, -1.0, 1.0);
            w[40 * 3 + 2] = bad;
            let ins = [In::F(vec![64, 3], w)];
            let (g, _) = op_graph(Op::FakeQuant { spec }, &ins);
            let inputs = input_map::<f32>(&ins);
            let want = Interpreter::<f32>::new(&g).unwrap().run(&inputs).unwrap()["y"].clone();
            let mask = nan_mask(&want);
            for (i, &m) in mask.iter().enumerate() {
                assert_eq!(m, i % 3 == 2 && i / 3 >= 32, "{scheme:?} {bad}: interpreter element {i}");
            }
            let prog = qatc_kernels::lower(&g).unwrap();
            #[cfg(feature = "llvm")]
            {
                let jit = qatc_kernels::llvm::Jit::compile(&prog.kernels).unwrap();
                let got = CpuProgram::new(prog.clone(), Box::new(jit)).unwrap().run(&inputs).unwrap();
                assert_eq!(nan_mask(&got["y"]), mask, "{scheme:?} {bad}: LLVM");
            }
            let got = CpuProgram::with_kir_eval(prog).unwrap().run(&inputs).unwrap();
            assert_eq!(nan_mask(&got["y"]), mask, "{scheme:?} {bad}: kernel IR");
            // the finite groups are untouched by the guard
            let (a, b) = (want.as_float().unwrap(), got["y"].as_float().unwrap());
            assert!(a.data.iter().zip(&b.data).all(|(x, y)| x.is_nan() || (x - y).abs() <= 1e-6 * x.abs().max(1.0)), "{scheme:?} {bad}");
        }
    }
}
