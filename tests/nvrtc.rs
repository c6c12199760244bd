//! Every kernel of the training step compiles through NVRTC to machine code (CUBIN): the tiny
//! 1-layer model for sm_80 and sm_90, GPT-2 124M (4-bit + LoRA, B 1, T 64) for sm_90, unfused and
//! as egg fusion leaves it; the kernel cache makes a second build compile nothing; ptxas' resource
//! report agrees with the CUBIN's own attributes. No GPU is needed, only the NVRTC library:
//! `make test` installs the PyPI wheel `nvidia-cuda-nvrtc` into `.deps/` and points
//! QATC_NVRTC_LIB at it. Without any NVRTC these tests say why and pass as skipped.
//! Sources are written to `target/nvrtc-kernels/<model>/` so a failure names a file to open.

mod common;

use common::nvrtc::{build, nvrtc, test_cache};
use qatc::frontend::config::Gpt2Config;
use qatc::step::{self, StepOptions};
use qatc_ir::{QuantScheme, QuantSpec};
use qatc_kernels::cuda::LaunchDims;
use qatc_kernels::nvrtc::{Arch, KernelCache, Nvrtc};
use qatc_kernels::CudaKernel;
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::LoraOptions;
use qatc_passes::quant::QuantOptions;

fn qlora(b: usize, t: usize, r: usize) -> StepOptions {
    let mut o = StepOptions::new(b, t);
    o.model.full_finetune = false;
    o.model.quant = Some(QuantOptions::all_linears(QuantSpec { bits: 4, group: 64, scheme: QuantScheme::Sym }));
    o.model.lora = Some(LoraOptions::new(r));
    o
}

/// Lowers the step and builds every kernel for each architecture; returns (distinct kernels,
/// launches, chunked cross-entropies).
fn compile_all(nv: &Nvrtc, name: &str, cfg: &Gpt2Config, o: &StepOptions, archs: &[Arch]) -> (usize, usize, usize) {
    let (g, _) = step::train(cfg, o, |_, _| {}).expect("the step builds");
    let (prog, kernels) =
        qatc_kernels::cuda_kernels(&g, &qatc_kernels::Target::of(qatc_kernels::TargetKind::Cuda)).expect("the step lowers");
    for &arch in archs {
        let (_, report) = build(nv, name, &kernels, arch, Some(&test_cache()));
        eprintln!("{name}: {}", report.summary());
    }
    eprintln!("{name}: {} launches, {} GEMMs", prog.launches(), prog.gemms().count());
    (kernels.len(), prog.launches(), prog.cross_entropy.len())
}

fn tiny() -> Gpt2Config {
    Gpt2Config { n_embd: 8, n_layer: 1, n_head: 2, n_positions: 8, vocab_size: 11, layer_norm_epsilon: 1e-5 }
}

#[test]
fn every_kernel_of_the_tiny_step_compiles() {
    let Some(nv) = nvrtc() else { return };
    let mut o = StepOptions::new(1, 4);
    o.clip = Some(1.0);
    let (n, _, _) = compile_all(&nv, "tiny-full", &tiny(), &o, &Arch::ALL);
    assert!(n > 10);
    // fused, 32 rows of logits against a width of 8: the chunked linear + cross-entropy, with
    // the head's gradient accumulated chunk by chunk
    let mut f = StepOptions::new(4, 8);
    f.fuse = Some(FuseOptions::default());
    let (_, _, chunked) = compile_all(&nv, "tiny-full-fused", &tiny(), &f, &Arch::ALL);
    assert_eq!(chunked, 1, "the fused full fine-tune chunks its cross-entropy");
    let mut q = qlora(1, 4, 2);
    q.model.quant.as_mut().expect("set above").spec.group = 4;
    compile_all(&nv, "tiny-qlora", &tiny(), &q, &Arch::ALL);
    q.fuse = Some(FuseOptions::default());
    compile_all(&nv, "tiny-qlora-fused", &tiny(), &q, &Arch::ALL);
    // 8-bit AdamW: the MLP's weights (64 x 256) are large enough for 8-bit moments
    let wide = Gpt2Config { n_embd: 64, ..tiny() };
    let mut o8 = StepOptions::new(1, 4);
    o8.adamw.moments = qatc_passes::optim::Moments::Blockwise8;
    compile_all(&nv, "tiny-adamw8bit", &wide, &o8, &Arch::ALL);
    o8.fuse = Some(FuseOptions::default());
    compile_all(&nv, "tiny-adamw8bit-fused", &wide, &o8, &Arch::ALL);
    // fused, the 8-bit update is inside the in-place AdamW: its blockwise kernels are among those
    let (g, _) = step::train(&wide, &o8, |_, _| {}).expect("the step builds");
    let (prog, _) = qatc_kernels::cuda_kernels(&g, &qatc_kernels::Target::of(qatc_kernels::TargetKind::Cuda)).expect("the step lowers");
    let blockwise =
        prog.kernels.iter().filter(|k| k.family.starts_with("adamw") && k.params.iter().any(|p| p.write && p.dtype == qatc_ir::DType::U8));
    assert!(blockwise.count() > 0, "the fused 8-bit step updates its codes in the AdamW kernel");
    // learned scales: the learned fake-quant and its gradient parts (asym: zero points; nf4)
    for (scheme, merged, fuse) in [(QuantScheme::Asym, true, true), (QuantScheme::Nf4, false, false)] {
        let mut l = qlora(1, 4, 2);
        if let Some(qo) = l.model.quant.as_mut() {
            qo.spec = QuantSpec { bits: if scheme == QuantScheme::Nf4 { 4 } else { 3 }, group: 4, scheme };
            qo.learned_scales = true;
        }
        if let Some(lo) = l.model.lora.as_mut() {
            lo.merged = merged;
        }
        l.fuse = fuse.then(FuseOptions::default);
        compile_all(&nv, &format!("tiny-lsq-{}", scheme.name()), &tiny(), &l, &Arch::ALL);
    }
}

#[test]
fn every_kernel_of_the_gpt2_124m_step_compiles() {
    let Some(nv) = nvrtc() else { return };
    let cfg = Gpt2Config::preset("124M").expect("a preset");
    let (n, launches, _) = compile_all(&nv, "gpt2-124m", &cfg, &qlora(1, 64, 16), &[Arch::SM90]);
    assert!(launches > n, "layers share kernels");
    // and as egg fusion leaves it: fused kernels, flash attention forward and backward
    let mut o = qlora(1, 64, 16);
    o.fuse = Some(FuseOptions::default());
    let (_, _, chunked) = compile_all(&nv, "gpt2-124m-fused", &cfg, &o, &[Arch::SM90]);
    assert_eq!(chunked, 1, "the fused step chunks its cross-entropy (the logits never whole)");
}

fn kernel(name: &str, source: &str) -> CudaKernel {
    CudaKernel { name: name.into(), family: "test".into(), source: source.into(), launch: LaunchDims { grid: [1, 1, 1], block: 1024 } }
}

#[test]
fn a_compile_error_shows_the_log_and_the_source_path() {
    let Some(nv) = nvrtc() else { return };
    let k = kernel("broken", "extern \"C\" __global__ void broken() { undefined_thing(); }\n");
    let dir = std::env::temp_dir();
    let err = nv.compile(&k, Arch::SM80, &dir.join("broken.cu")).expect_err("does not compile").to_string();
    assert!(err.contains("broken.cu") && err.contains("undefined_thing"), "{err}");
    let o = qatc_kernels::nvrtc::BuildOptions { arch: Arch::SM90, cache: None, jobs: 1, source_dir: Some(&dir) };
    let err = qatc_kernels::nvrtc::compile_cubins(&nv, &[k], &o).expect_err("does not compile").to_string();
    assert!(err.contains("broken.cu") && err.contains("undefined_thing") && err.contains("sm_90"), "{err}");
}

#[test]
fn an_architecture_nvrtc_does_not_know_is_named_in_the_error() {
    let Some(nv) = nvrtc() else { return };
    let o = qatc_kernels::nvrtc::BuildOptions { arch: Arch { major: 19, minor: 9 }, cache: None, jobs: 1, source_dir: None };
    let err = qatc_kernels::nvrtc::compile_cubins(&nv, &[], &o).expect_err("sm_199 is no GPU").to_string();
    assert!(err.contains("sm_199") && err.contains("sm_90"), "{err}");
}

/// Static shared memory, a stack frame (an array indexed at run time), spills (96 live floats
/// under a 32-register cap) and registers.
const PROBES: &str = r#"
extern "C" __global__ void shared256(float* __restrict__ a, int n) {
    __shared__ float s[64];
    const int i = threadIdx.x;
    s[i % 64] = a[i];
    __syncthreads();
    if (i < n) a[i] = s[(i + 1) % 64] * 2.0f;
}
extern "C" __global__ void stack256(const int* __restrict__ i, float* __restrict__ y) {
    float a[64];
    for (int k = 0; k < 64; ++k) a[k] = k * 0.5f;
    y[threadIdx.x] = a[i[threadIdx.x] & 63];
}
extern "C" __global__ void __launch_bounds__(1024, 2) spills(const float* __restrict__ x, float* __restrict__ y) {
    float acc[96];
#pragma unroll
    for (int k = 0; k < 96; ++k) acc[k] = x[k * 1024 + threadIdx.x];
#pragma unroll
    for (int r = 0; r < 8; ++r) {
#pragma unroll
        for (int k = 0; k < 96; ++k) acc[k] = acc[k] * acc[(k + r + 1) % 96] + 1.0f;
    }
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 96; ++k) s += acc[k];
    y[threadIdx.x] = s;
}
"#;

/// A little-endian integer of `n` bytes at `at`.
fn le(b: &[u8], at: usize, n: usize) -> usize {
    b[at..at + n].iter().rev().fold(0usize, |v, &x| (v << 8) | x as usize)
}

/// The sections of an ELF64 file: (name, bytes, entry size), read from its section headers (by
/// hand: the `object` crate rejects CUBINs, "Invalid ELF program header size or alignment").
fn elf_sections(elf: &[u8]) -> Vec<(String, &[u8], usize)> {
    assert!(elf.starts_with(b"\x7fELF") && elf[4] == 2, "a CUBIN is an ELF64 file");
    let (shoff, shentsize, shnum, shstrndx) = (le(elf, 0x28, 8), le(elf, 0x3a, 2), le(elf, 0x3c, 2), le(elf, 0x3e, 2));
    let header = |i: usize| shoff + i * shentsize;
    let data = |i: usize| {
        let (off, size) = (le(elf, header(i) + 0x18, 8), le(elf, header(i) + 0x20, 8));
        if le(elf, header(i) + 4, 4) == 8 {
            &elf[0..0]
        } else {
            &elf[off..off + size]
        } // SHT_NOBITS has no bytes
    };
    let names = data(shstrndx);
    let cstr = |b: &[u8], at: usize| String::from_utf8_lossy(&b[at..at + b[at..].iter().position(|&c| c == 0).unwrap_or(0)]).into_owned();
    (0..shnum).map(|i| (cstr(names, le(elf, header(i), 4)), data(i), le(elf, header(i) + 0x38, 8))).collect()
}

/// EIATTR_REGCOUNT of function `name` in a CUBIN's `.nv.info` section: entries are
/// (format u8, attribute u8, size u16, payload); REGCOUNT (0x2f) carries (symbol index u32,
/// registers u32), the index into `.symtab` (24-byte entries whose first word names the symbol
/// in `.strtab`).
fn elf_registers(cubin: &[u8], name: &str) -> Option<u32> {
    let sections = elf_sections(cubin);
    let find = |n: &str| sections.iter().find(|s| s.0 == n).map(|s| (s.1, s.2));
    let ((symtab, entsize), (strtab, _), (info, _)) = (find(".symtab")?, find(".strtab")?, find(".nv.info")?);
    let sym_name = |i: usize| {
        let at = le(symtab, i * entsize, 4);
        String::from_utf8_lossy(&strtab[at..at + strtab[at..].iter().position(|&c| c == 0).unwrap_or(0)]).into_owned()
    };
    let sym = (0..symtab.len() / entsize).find(|&i| sym_name(i) == name)?;
    let mut at = 0;
    while at + 4 <= info.len() {
        let (fmt, attr, size) = (info[at], info[at + 1], le(info, at + 2, 2));
        if fmt == 0x04 && attr == 0x2f && size == 8 && le(info, at + 4, 4) == sym {
            return Some(le(info, at + 8, 4) as u32);
        }
        // EIFMT_SVAL (4) has a payload of `size` bytes; the others keep their value in `size`
        at += 4 + if fmt == 0x04 { size } else { 0 };
    }
    None
}

#[test]
fn the_resource_report_is_what_ptxas_built() {
    let Some(nv) = nvrtc() else { return };
    let names = ["shared256", "stack256", "spills"];
    let kernels: Vec<CudaKernel> = names.iter().map(|n| kernel(n, PROBES)).collect();
    let (built, report) = build(&nv, "resource-probes", &kernels, Arch::SM90, None);
    let by = |n: &str| built.iter().find(|c| c.name == n).expect("built");
    let reported = |n: &str| by(n).resources.expect("ptxas reported");
    let (sh, st, sp) = (reported("shared256"), reported("stack256"), reported("spills"));
    assert_eq!((sh.shared_bytes, sh.barriers, sh.stack_bytes), (256, 1, 0), "{sh:?}");
    assert!(!sh.spills());
    assert_eq!((st.stack_bytes, st.shared_bytes), (256, 0), "{st:?}");
    assert!(sp.spills() && sp.registers <= 32 && sp.stack_bytes > 0, "{sp:?}");
    for c in &built {
        let r = c.resources.expect("ptxas reported");
        assert!(r.registers > 0);
        assert_eq!(elf_registers(&c.cubin, &c.name), Some(r.registers), "{}: ptxas' report against the CUBIN", c.name);
    }
    let json = serde_json::to_value(&report).expect("serializable");
    assert_eq!(json["entries"][0]["shared_bytes"], 256);
    assert!(report.table().contains("spills"));
}

#[test]
fn a_second_build_compiles_nothing() {
    let Some(nv) = nvrtc() else { return };
    let (g, _) = step::train(&tiny(), &StepOptions::new(1, 4), |_, _| {}).expect("the step builds");
    let (_, kernels) = qatc_kernels::cuda_kernels(&g, &qatc_kernels::Target::of(qatc_kernels::TargetKind::Cuda)).expect("the step lowers");
    let dir = tempfile::tempdir().expect("a temp dir");
    let cache = KernelCache::new(dir.path());
    let (first, r1) = build(&nv, "cache-first", &kernels, Arch::SM90, Some(&cache));
    assert_eq!((r1.compiled, r1.cached), (kernels.len(), 0));
    let (second, r2) = build(&nv, "cache-second", &kernels, Arch::SM90, Some(&cache));
    assert_eq!((r2.compiled, r2.cached), (0, kernels.len()), "{}", r2.summary());
    for (a, b) in first.iter().zip(&second) {
        assert_eq!((&a.name, &a.cubin, a.resources), (&b.name, &b.cubin, b.resources));
    }
    eprintln!("tiny step: cold {:.2} s, cached {:.3} s ({} kernels)", r1.wall_s, r2.wall_s, kernels.len());
}

#[test]
fn qatc_compile_device_cuda_writes_cubins_and_the_report() {
    let Some(_) = nvrtc() else { return };
    let dir = tempfile::tempdir().expect("a temp dir");
    let out = dir.path().join("out");
    let model = common::root().join("examples/gpt2-shakespeare-small/model.safetensors");
    let lib = common::root().join(".deps/nvrtc/nvidia/cu13/lib/libnvrtc.so.13");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_qatc"));
    cmd.args(["compile", &model.display().to_string(), "--batch", "1", "--seq", "16", "--no-fuse", "--device", "cuda", "--arch", "sm_90"]);
    cmd.arg("-o").arg(&out).arg("--kernel-cache").arg(dir.path().join("cache"));
    if std::env::var_os("QATC_NVRTC_LIB").is_none() && lib.exists() {
        cmd.env("QATC_NVRTC_LIB", &lib);
    }
    let o = cmd.output().expect("qatc runs");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{stdout}{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout.contains("kernels for sm_90") && stdout.contains("regs"), "{stdout}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("kernels/report.json")).expect("report.json")).expect("JSON");
    let entries = report["entries"].as_array().expect("entries");
    assert!(!entries.is_empty());
    for e in entries {
        let name = e["name"].as_str().expect("a name");
        assert!(e["registers"].as_u64().is_some_and(|r| r > 0), "{e}");
        assert!(out.join(format!("kernels/{name}.cubin")).exists() && out.join(format!("kernels/{name}.cu")).exists());
    }
}

/// `--precision bf16|fp16`: the step's kernels load f16/bf16 buffers widened to f32 and store
/// them rounded to nearest even (`qatc_common.cuh`), and loss scaling's kernels (all_finite,
/// select, loss_scale) compile too.
#[test]
fn every_kernel_of_the_bf16_and_fp16_steps_compiles() {
    let Some(nv) = nvrtc() else { return };
    let tiny = Gpt2Config { n_embd: 8, n_layer: 1, n_head: 2, n_positions: 8, vocab_size: 11, layer_norm_epsilon: 1e-5 };
    for p in [qatc_passes::precision::Precision::Bf16, qatc_passes::precision::Precision::Fp16] {
        let mut q = qlora(1, 4, 2);
        q.model.quant.as_mut().expect("set above").spec.group = 4;
        q.clip = Some(1.0);
        q.precision = p;
        q.fuse = Some(FuseOptions::default());
        compile_all(&nv, &format!("tiny-qlora-{p}-fused"), &tiny, &q, &[Arch::SM90]);
    }
    // unfused, full fine-tune: every op's kernel on its own, the embedding gradient's f32 sums
    let mut f = StepOptions::new(1, 4);
    f.precision = qatc_passes::precision::Precision::Bf16;
    compile_all(&nv, "tiny-full-bf16", &tiny, &f, &[Arch::SM90]);
}
