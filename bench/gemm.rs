//! The CPU's GEMM libraries on the training step's shapes (bench/RESULTS.md, "bf16 on the CPU's
//! bf16 units"): OpenBLAS's sgemm on f32 operands against oneDNN's bf16 GEMM (bf16 operands, f32
//! accumulation and result) on the same values, GFLOP/s of the best of 5 calls after a warm-up,
//! as the executor calls them (row-major, the library's own threads). The 4096-cube row is the
//! practical peak the step's GEMMs are measured against.
//! Run: `cargo run --release --example bench_gemm`

use std::time::Instant;

use qatc_runtime::cpu::{blas, onednn};

fn main() -> anyhow::Result<()> {
    // as `qatc`'s main: the GEMM libraries' settings made before any thread starts
    for (name, value) in qatc_runtime::cpu::library_env() {
        if std::env::var_os(name).is_none() {
            std::env::set_var(name, value);
        }
    }
    let sgemm = blas::load(blas::OPENBLAS).ok_or_else(|| anyhow::anyhow!("OpenBLAS ({}) did not load", blas::OPENBLAS))?;
    let bf16 = onednn::load(onednn::ONEDNN);
    if bf16.is_none() {
        eprintln!("oneDNN ({}) did not load, or this CPU has no bf16 units: f32 only", onednn::ONEDNN);
    }
    // (M, N, K, b stored transposed [N, K])
    let shapes = [
        (256, 2304, 768, false),
        (256, 768, 768, false),
        (256, 3072, 768, false),
        (256, 768, 3072, false),
        (128, 50257, 768, true),
        (128, 768, 50257, false),
        (256, 50257, 768, true),
        (256, 768, 50257, false),
        (1024, 50257, 768, true),
        (1024, 768, 50257, false),
        (4096, 4096, 4096, false),
    ];
    println!("{:>22} {:>12} {:>12} {:>7}", "M x N x K", "sgemm GF/s", "bf16 GF/s", "ratio");
    for (m, n, k, bt) in shapes {
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 100) as f32) / 100.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 13 % 100) as f32) / 100.0).collect();
        let (ah, bh): (Vec<u16>, Vec<u16>) =
            (a.iter().map(|x| (x.to_bits() >> 16) as u16).collect(), b.iter().map(|x| (x.to_bits() >> 16) as u16).collect());
        let mut c = vec![0f32; m * n];
        // b as [K, N] with strides (row, column): transposed storage is [N, K]
        let bs = if bt { (1, k) } else { (n, 1) };
        let reps = if m * n * k > 10_000_000_000 { 2 } else { 5 };
        let best = |f: &mut dyn FnMut()| {
            f();
            (0..reps)
                .map(|_| {
                    let t = Instant::now();
                    f();
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min)
        };
        let flops = 2.0 * (m * n * k) as f64;
        // SAFETY: the matrices are the vectors above, in bounds for these strides.
        let s = best(&mut || unsafe {
            sgemm.sgemm(m, n, k, 1.0, false, (a.as_ptr(), k, 1), (b.as_ptr(), bs.0, bs.1), (c.as_mut_ptr(), n, 1));
        });
        let h = bf16.as_ref().map(|lib| {
            // SAFETY: as above.
            best(&mut || unsafe {
                lib.gemm((m, n, k), 1.0, false, (ah.as_ptr(), k, 1), (bh.as_ptr(), bs.0, bs.1), (c.as_mut_ptr(), n, 1));
            })
        });
        let shape = format!("{m} x {n} x {k}{}", if bt { " (b^T)" } else { "" });
        match h {
            Some(h) => println!("{shape:>22} {:>12.0} {:>12.0} {:>7.2}", flops / s / 1e9, flops / h / 1e9, s / h),
            None => println!("{shape:>22} {:>12.0} {:>12} {:>7}", flops / s / 1e9, "-", "-"),
        }
    }
    Ok(())
}
