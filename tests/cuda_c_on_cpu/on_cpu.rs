//! The GPU the CUDA-C-on-CPU test drives: `HostGpu` (the kernel-IR evaluator behind the GPU API)
//! with every kernel's first launch also run as CUDA C, compiled by the system C++ compiler against
//! `tests/cxx/cuda_on_cpu.h`, on the same bytes, and compared.

use qatc_kernels::kir::{AttentionPart, Body};
use qatc_kernels::CudaSettings;

use super::*;

/// How long one kernel's executable may run (both orders) before it is killed and reported.
pub const TIME_LIMIT: Duration = Duration::from_secs(30);

/// The most compilers run at once.
pub fn jobs() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(1, 4)
}

/// The bytes a kernel param spans on the device (a packed 4-bit one padded to whole words, as
/// `Buffer::device_bytes`: `store_i4` updates the word holding its byte).
pub fn param_bytes(p: &Param) -> usize {
    let n = p.dtype.bytes_for(p.numel());
    if p.dtype == DType::I4 {
        n.next_multiple_of(4)
    } else {
        n
    }
}

/// Why a kernel's CUDA C cannot run on the CPU, if it cannot: inline PTX (but for the f16
/// conversions of `qatc_common.cuh` and the tensor-core attention's mma, which the shim runs).
pub fn cannot_run(source: &str) -> Option<&'static str> {
    if source.contains("asm(") || source.contains("asm volatile") {
        Some("inline PTX")
    } else {
        None
    }
}

/// Whether a kernel's threads meet at barriers, shuffles or mma (then they run as fibers; else each
/// thread is a plain call, and a barrier reached anyway stops the run: the shim says so). The
/// barriers live in the kernel's text or in the helpers it calls by these names.
pub fn needs_fibers(source: &str) -> bool {
    ["__syncthreads", "__syncwarp", "__shfl", "qatc::block_", "qatc::warp_", "qatc::attention", "qatc::Mma"]
        .iter()
        .any(|t| source.contains(t))
}

/// For checking this harness: `CUDA_C_ON_CPU_MUTATE='FROM=>TO'` replaces FROM by TO in every
/// kernel's CUDA C before it is compiled, e.g. `'(rank == 0 ? 1 : 0)=>rank == 0 ? 1 : 0'` undoes
/// the loop-bound fix in the generated text (the tiny steps' embedding-gradient kernel must then
/// fail, killed at the time limit or stopped by the overflow check).
pub fn mutate(source: String) -> String {
    match std::env::var("CUDA_C_ON_CPU_MUTATE") {
        Ok(m) => match m.split_once("=>") {
            Some((from, to)) => source.replace(from, to),
            None => panic!("CUDA_C_ON_CPU_MUTATE is FROM=>TO, not {m:?}"),
        },
        Err(_) => source,
    }
}

/// A kernel's translation unit: the shim, its CUDA C, a `main` that launches it.
pub fn unit(name: &str, source: &str) -> String {
    format!("#include \"cuda_on_cpu.h\"\n{source}\nQATC_CPU_MAIN({name})\n")
}

/// The tensor-core attention (`qatc_attention_mma.cuh`; the shim is an sm_80, so the kernel's
/// `#if __CUDA_ARCH__ >= 800` branch runs, its mma emulated): its part and the 16-bit type of
/// its operands, where `source` calls it.
pub fn tensor_core(k: &Kernel, source: &str) -> Option<(AttentionPart, DType)> {
    match &k.body {
        Body::Attention(a) if source.contains("_mma<") => Some((a.part, a.values)),
        _ => None,
    }
}

/// A tensor-core kernel's param that passes through a 16-bit rounding (out, dq, dk, dv: P and
/// dS are rounded to the operands' type as mma operands, the evaluator keeps them f32) is
/// compared norm-wise, ||cpu - evaluator||_2 / ||evaluator||_2, within this. The row statistics
/// (lse, delta) sum unrounded P in f32 and are held to the f32 tolerance like any other kernel's.
/// Measured (tests/cuda_c_on_cpu.rs): at most 2.0e-3 with bf16 and 2.8e-4 with f16 on the
/// hand-made `the_tensor_core_attention`, 2.8e-3 and 3.2e-4 on the demo model's step; two
/// fragment registers swapped gives 1 to 5, a mask one key off 0.2 to 11 (see there).
pub fn mma_tolerance(values: DType) -> f64 {
    match values {
        DType::BF16 => 1e-2,
        // f16: 8 times bf16's precision
        _ => 1.5e-3,
    }
}

/// How many warp-wide mma.sync the shim emulated in a run (what it wrote to stderr), 0 if none.
pub fn mma_count(stderr: &str) -> u64 {
    stderr
        .lines()
        .find_map(|l| l.strip_prefix("cuda_on_cpu: ")?.strip_suffix(" warp-wide mma.sync emulated (both runs)")?.parse().ok())
        .unwrap_or(0)
}

/// One param of a tensor-core kernel as compared: the errors norm-wise and max-wise
/// (`common::norm_rel_err`, `common::rel_err`).
pub struct MmaCheck {
    pub name: String,
    pub part: AttentionPart,
    pub values: DType,
    pub param: String,
    pub norm: f64,
    pub max: f64,
    pub mma: u64,
}

/// One distinct kernel as loaded.
pub struct Loaded {
    pub name: String,
    pub kernel: Kernel,
    pub source: String,
    pub launch: LaunchDims,
    pub skip: Option<&'static str>,
}

/// What one case found.
#[derive(Default)]
pub struct Findings {
    pub run: usize,
    pub skipped: Vec<(String, &'static str)>,
    pub failures: Vec<String>,
    pub worst: (f64, String),
    pub compiled: usize,
    /// In the checked launches: the CPU run and the evaluator's launch, side by side.
    pub cpu: Duration,
    /// In the evaluator's GEMMs (the host model of cuBLAS).
    pub gemm: Duration,
    /// The tensor-core attention kernels' params, as compared.
    pub mma: Vec<MmaCheck>,
}

/// `HostGpu` (the kernel-IR evaluator behind the GPU API) with every kernel's first launch also
/// run as CUDA C on the CPU, on the same bytes, and compared.
pub struct OnCpu<'c> {
    pub host: HostGpu,
    pub cxx: &'c Cxx,
    pub funcs: HashMap<FuncId, usize>,
    pub kernels: Vec<Loaded>,
    pub exes: HashMap<String, Result<PathBuf, String>>,
    pub checked: HashSet<String>,
    pub dir: tempfile::TempDir,
    pub found: Findings,
    /// The variants the CUDA writer may use (`CudaSettings::GENERAL` runs the general kernels).
    pub codegen: CudaSettings,
}

impl<'c> OnCpu<'c> {
    pub fn new(cxx: &'c Cxx, capacity: usize) -> OnCpu<'c> {
        OnCpu {
            host: HostGpu::new(capacity),
            cxx,
            funcs: HashMap::new(),
            kernels: Vec::new(),
            exes: HashMap::new(),
            checked: HashSet::new(),
            dir: tempfile::tempdir().expect("a scratch directory"),
            found: Findings::default(),
            codegen: CudaSettings::default(),
        }
    }

    /// Compiles every kernel loaded so far that can run (cached ones are not compiled again).
    pub fn build(&mut self) {
        let units: Vec<(String, String)> = self
            .kernels
            .iter()
            .filter(|k| k.skip.is_none() && !self.exes.contains_key(&k.name))
            .map(|k| (k.name.clone(), unit(&k.name, &k.source)))
            .collect();
        let (built, compiled) = self.cxx.build(&units, jobs());
        self.found.compiled += compiled;
        for ((name, _), r) in units.into_iter().zip(built) {
            self.exes.insert(name, r);
        }
    }

    pub fn fail(&mut self, k: usize, what: String) {
        let l = &self.kernels[k];
        self.found.failures.push(format!("{} ({}: {}): {what}", l.name, l.kernel.family, l.kernel.note));
    }

    /// Runs kernel `k`'s CUDA C on the CPU on the evaluator's bytes of `args`, then the evaluator's
    /// launch, and compares what they write. A kernel that fails keeps its inputs under
    /// `target/cuda-c-on-cpu/failed/<name>/` with a script that runs it again.
    pub fn check(&mut self, k: usize, f: FuncId, dims: &LaunchDims, args: &[DevPtr]) -> GpuResult<()> {
        let (name, params, launch, tc) = {
            let l = &self.kernels[k];
            (l.name.clone(), l.kernel.params.clone(), l.launch.clone(), tensor_core(&l.kernel, &l.source))
        };
        let mut problems = Vec::new();
        if *dims != launch {
            problems.push(format!("launched with {dims:?}, its CUDA C written for {launch:?}"));
        }
        // one slot per distinct buffer (an in-place kernel names one buffer twice)
        let mut slots: Vec<(DevPtr, usize)> = Vec::new();
        let mut slot_of = Vec::new();
        for (p, &a) in params.iter().zip(args) {
            let n = param_bytes(p);
            match slots.iter().position(|s| s.0 == a) {
                Some(s) => {
                    slots[s].1 = slots[s].1.max(n);
                    slot_of.push(s);
                }
                None => {
                    slot_of.push(slots.len());
                    slots.push((a, n));
                }
            }
        }
        let dir = self.dir.path().join(&name);
        std::fs::create_dir_all(&dir).expect("a directory for the kernel's buffers");
        for (s, &(ptr, n)) in slots.iter().enumerate() {
            let mut b = vec![0u8; n];
            self.host.download(&mut b, ptr)?;
            std::fs::write(dir.join(format!("in{s}.bin")), &b).expect("writes a buffer");
        }
        let exe = match self.exes.get(&name) {
            Some(Ok(exe)) => exe.clone(),
            Some(Err(e)) => {
                let e = format!("its CUDA C does not compile on the CPU: {}", e.lines().take(30).collect::<Vec<_>>().join("\n"));
                self.fail(k, e);
                return self.host.launch(f, dims, args);
            }
            None => panic!("{name}: launched but never loaded"),
        };
        let list = |v: &[usize]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",");
        let grid: Vec<usize> = dims.grid.iter().map(|&g| g as usize).collect();
        let mode = if needs_fibers(&self.kernels[k].source) { "fibers" } else { "direct" };
        let argv = [dir.display().to_string(), list(&slot_of), list(&grid), format!("{},1,1", dims.block), mode.to_string()];
        let start = Instant::now();
        let running = cxx::start(&exe, &argv, &dir.join("stderr.txt"));
        // the evaluator runs meanwhile
        self.host.launch(f, dims, args)?;
        let outcome = match running {
            Ok(r) => r.wait(TIME_LIMIT),
            Err(e) => Outcome::Failed(e, String::new()),
        };
        self.found.cpu += start.elapsed();
        let ran = matches!(outcome, Outcome::Ok);
        let mma = mma_count(&std::fs::read_to_string(dir.join("stderr.txt")).unwrap_or_default());
        if ran && tc.is_some() && mma == 0 {
            problems.push("its tensor-core branch did not run: no mma.sync reached the shim (is __CUDA_ARCH__ 800 there?)".into());
        }
        match outcome {
            Outcome::Ok => self.found.run += 1,
            Outcome::Failed(status, err) => {
                let tail: Vec<&str> = err.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect();
                problems.push(format!("the CPU run failed ({status}):\n{}", tail.join("\n")));
            }
            Outcome::TimedOut(t) => {
                problems.push(format!("no result in {t:.1?}: killed (an endless loop, e.g. a misparsed loop bound; or a stuck barrier)"))
            }
        }
        for (i, p) in params.iter().enumerate().filter(|(_, p)| p.write && ran) {
            let n = param_bytes(p);
            let mut want = vec![0u8; n];
            self.host.download(&mut want, args[i])?;
            std::fs::write(dir.join(format!("want{}.bin", slot_of[i])), &want).expect("writes a buffer");
            let got = std::fs::read(dir.join(format!("out{}.bin", slot_of[i]))).unwrap_or_default();
            if got.len() < n {
                problems.push(format!("param {} came back with {} bytes, not {n}", p.name, got.len()));
                continue;
            }
            let (g, w): (Vec<f64>, Vec<f64>) = (0..p.numel()).map(|e| (element(p.dtype, &got, e), element(p.dtype, &want, e))).unzip();
            let mut err = if p.dtype.is_float() { common::rel_err(&g, &w) } else { common::max_abs(&g, &w) };
            let mut tol = match p.dtype {
                DType::F32 => 1e-5,
                DType::BF16 => 2f64.powi(-7),
                DType::F16 => 2f64.powi(-10),
                _ => 0.0,
            };
            // a tensor-core result rounded through 16 bits: norm-wise (`mma_tolerance`)
            let mut how = "";
            if let Some((part, values)) = tc {
                let norm = common::norm_rel_err(&g, &w);
                self.found.mma.push(MmaCheck { name: name.clone(), part, values, param: p.name.clone(), norm, max: err, mma });
                if part.roles().out.contains(&Some(i)) {
                    (err, tol, how) = (norm, mma_tolerance(values), " norm-wise (P and dS rounded to 16 bits as mma operands)");
                }
            }
            // a NaN error fails too
            let off_by = |err: f64| err.is_nan() || err > tol;
            if off_by(err) {
                // how far apart element e is (NaN where one side only is NaN: the farthest)
                let off = |e: usize| if (g[e].is_nan() && w[e].is_nan()) || g[e] == w[e] { 0.0 } else { (g[e] - w[e]).abs() };
                let at = (0..g.len()).max_by(|&a, &b| off(a).total_cmp(&off(b))).unwrap_or(0);
                let first = (0..g.len()).find(|&e| off(e) != 0.0).unwrap_or(0);
                let scale = w.iter().filter(|v| v.is_finite()).fold(0.0f64, |m, v| m.max(v.abs()));
                problems.push(format!(
                    "param {} ({} {:?}) off by {err:e}{how} of its largest element {scale:e} (tolerance {tol:e}): \
                     element {at} is {:e} on the CPU, {:e} in the evaluator; the first that differs is {first} ({:e} vs {:e})",
                    p.name, p.dtype, p.shape, g[at], w[at], g[first], w[first]
                ));
            }
            // (the norm-wise errors of tensor-core results are listed on their own)
            if how.is_empty() && (err > self.found.worst.0 || self.found.worst.1.is_empty()) {
                self.found.worst = (err, format!("{} param {}", name, p.name));
            }
        }
        if !problems.is_empty() {
            let kept = self.cxx.cache().join("failed").join(&name);
            let _ = std::fs::remove_dir_all(&kept);
            let copied = std::fs::create_dir_all(&kept).and_then(|_| {
                for e in std::fs::read_dir(&dir)? {
                    let e = e?;
                    std::fs::copy(e.path(), kept.join(e.file_name()))?;
                }
                let mut again = argv.clone();
                again[0] = kept.display().to_string();
                std::fs::write(kept.join("run.sh"), format!("#!/bin/sh\n{} {}\n", exe.display(), again.join(" ")))
            });
            let note = match copied {
                Ok(()) => format!("(its inputs, the evaluator's results want*.bin and `run.sh` are in {})", kept.display()),
                Err(e) => format!("(keeping its inputs in {} failed: {e})", kept.display()),
            };
            for p in problems {
                self.fail(k, format!("{p}\n{note}"));
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }
}

impl GpuApi for OnCpu<'_> {
    fn device(&self) -> &GpuDevice {
        self.host.device()
    }
    fn memory(&self) -> GpuResult<(usize, usize)> {
        self.host.memory()
    }
    fn alloc(&mut self, bytes: usize) -> GpuResult<DevPtr> {
        self.host.alloc(bytes)
    }
    fn free(&mut self, ptr: DevPtr) -> GpuResult<()> {
        self.host.free(ptr)
    }
    fn alloc_pinned(&mut self, bytes: usize) -> GpuResult<PinnedId> {
        self.host.alloc_pinned(bytes)
    }
    fn pinned(&mut self, id: PinnedId) -> GpuResult<&mut [u8]> {
        self.host.pinned(id)
    }
    fn free_pinned(&mut self, id: PinnedId) -> GpuResult<()> {
        self.host.free_pinned(id)
    }
    fn upload(&mut self, dst: DevPtr, src: &[u8]) -> GpuResult<()> {
        self.host.upload(dst, src)
    }
    fn download(&mut self, dst: &mut [u8], src: DevPtr) -> GpuResult<()> {
        self.host.download(dst, src)
    }
    fn upload_pinned(&mut self, dst: DevPtr, src: PinnedId, offset: usize, len: usize) -> GpuResult<()> {
        self.host.upload_pinned(dst, src, offset, len)
    }
    fn download_pinned(&mut self, dst: PinnedId, offset: usize, src: DevPtr, len: usize) -> GpuResult<()> {
        self.host.download_pinned(dst, offset, src, len)
    }
    fn copy(&mut self, dst: DevPtr, src: DevPtr, bytes: usize) -> GpuResult<()> {
        self.host.copy(dst, src, bytes)
    }
    fn memset(&mut self, dst: DevPtr, value: u8, bytes: usize) -> GpuResult<()> {
        self.host.memset(dst, value, bytes)
    }
    fn load(&mut self, image: &KernelImage) -> GpuResult<FuncId> {
        let f = self.host.load(image)?;
        let k = match self.kernels.iter().position(|l| l.name == image.name) {
            Some(k) => k,
            None => {
                let cuda = qatc_kernels::cuda::emit_with(&image.kernel, &self.codegen).expect("emits");
                assert_eq!(cuda.name, image.name, "the image's name is its kernel's");
                let source = mutate(cuda.source);
                let skip = cannot_run(&source);
                self.kernels.push(Loaded { name: cuda.name, kernel: image.kernel.clone(), source, launch: cuda.launch, skip });
                self.kernels.len() - 1
            }
        };
        self.funcs.insert(f, k);
        Ok(f)
    }
    fn launch(&mut self, f: FuncId, dims: &LaunchDims, args: &[DevPtr]) -> GpuResult<()> {
        let Some(&k) = self.funcs.get(&f) else { return self.host.launch(f, dims, args) };
        if !self.checked.insert(self.kernels[k].name.clone()) {
            return self.host.launch(f, dims, args);
        }
        if let Some(why) = self.kernels[k].skip {
            self.found.skipped.push((self.kernels[k].name.clone(), why));
            return self.host.launch(f, dims, args);
        }
        self.check(k, f, dims, args)
    }
    fn gemm(&mut self, call: &BlasCall, compute: Compute, ptrs: GemmPtrs) -> GpuResult<()> {
        let t = Instant::now();
        let r = self.host.gemm(call, compute, ptrs);
        self.found.gemm += t.elapsed();
        r
    }
    fn begin_capture(&mut self) -> GpuResult<()> {
        self.host.begin_capture()
    }
    fn end_capture(&mut self) -> GpuResult<GraphId> {
        self.host.end_capture()
    }
    fn replay(&mut self, g: GraphId) -> GpuResult<()> {
        self.host.replay(g)
    }
    fn synchronize(&mut self) -> GpuResult<()> {
        self.host.synchronize()
    }
    fn mark(&mut self) -> GpuResult<MarkId> {
        self.host.mark()
    }
    fn elapsed_ms(&mut self, from: MarkId, to: MarkId) -> GpuResult<f64> {
        self.host.elapsed_ms(from, to)
    }
    fn clear_marks(&mut self) -> GpuResult<()> {
        self.host.clear_marks()
    }
    fn open_collectives(&mut self, comm: std::sync::Arc<dyn qatc_runtime::comm::Communicator>) -> GpuResult<String> {
        self.host.open_collectives(comm)
    }
    fn collective(&mut self, c: &qatc_runtime::cuda::DeviceCollective) -> GpuResult<()> {
        self.host.collective(c)
    }
}
