//! Compiling kernels for the host: each kernel's module is built, optimized (O3 for this CPU),
//! compiled to object code and linked by the process's JIT (`orc.rs`), through two caches keyed
//! by the module as the optimizer receives it, this CPU and LLVM's version (`objcache.rs`):
//!
//! - in this process: a kernel linked once is linked for good, and a program that uses it again
//!   (the next program `qatc prt` evaluates, the next test) gets its address without compiling;
//! - on disk ([`ObjectCache`], when the caller gives one): object code from an earlier process
//!   is linked without optimizing or generating code again.
//!
//! Where the time went, on GPT-2 124M's training step (51 kernels, this repository's 2-core
//! AMD EPYC VM): building the modules 0.01 s, O3 1.4 s, generating the code 1.5-2 s. Caching
//! optimized bitcode would have saved only the O3 half, so the disk holds object code, which
//! MCJIT (inkwell's JIT) cannot take, hence ORC's LLJIT. The code generator is the one MCJIT
//! ran, on the same target machine settings (O3, the JIT code model, static relocation), so the
//! machine code and every result are unchanged.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use inkwell::context::Context;
use inkwell::module::Module;
use inkwell::passes::PassBuilderOptions;
use inkwell::targets::{CodeModel, FileType, InitializationConfig, RelocMode, Target, TargetMachine};
use inkwell::OptimizationLevel;

use super::objcache::{HostCpu, ObjectCache};
use super::orc::Orc;
use crate::error::KernelError;
use crate::kir::Kernel;

/// A compiled kernel: runs iterations `start..end` with `args[p]` the base of param p's buffer.
pub type KernelFn = unsafe extern "C" fn(args: *const *mut u8, start: u64, end: u64);

fn llvm_err(kernel: &str, message: impl ToString) -> KernelError {
    KernelError::Llvm { kernel: kernel.to_string(), message: message.to_string() }
}

/// A target machine for this host's CPU and its features (AVX2, AVX-512, ..): O3, the JIT's code
/// model, default relocation (static). [`CODEGEN`] says so in every cache key.
pub fn host_machine() -> Result<TargetMachine, KernelError> {
    Target::initialize_native(&InitializationConfig::default()).map_err(|e| llvm_err("-", e))?;
    let triple = TargetMachine::get_default_triple();
    let target = Target::from_triple(&triple).map_err(|e| llvm_err("-", e.to_string()))?;
    let cpu = TargetMachine::get_host_cpu_name().to_string();
    let features = TargetMachine::get_host_cpu_features().to_string();
    target
        .create_target_machine(&triple, &cpu, &features, OptimizationLevel::Aggressive, RelocMode::Default, CodeModel::JITDefault)
        .ok_or_else(|| llvm_err("-", format!("no target machine for {}", triple.as_str().to_string_lossy())))
}

/// How [`host_machine`] generates code, for the cache key: change it with its arguments.
const CODEGEN: &str = "codegen O3, code model JITDefault, reloc Default, ELF object";

/// How the JIT compiles a program's kernels (a setting passed in: the CPU executor's
/// `CpuOptions` carries it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct JitOptions {
    /// The vector width LLVM should prefer, in bits; None: 512 where the host has AVX-512 (see
    /// `vector_width`), else LLVM's own choice.
    pub vector_width: Option<u32>,
}

/// The vector width LLVM should prefer: 512 bits where the host has AVX-512. LLVM's own default
/// for these CPUs is 256, to spare the clock; the kernels here are exp- and memory-bound loops,
/// and on the development VM (Sapphire Rapids features) 512-bit vectors halved the
/// cross-entropy gradient (27.6 -> 14 ms) and took the config A step from 0.29-0.37 s to
/// 0.26-0.28 s (bench/RESULTS.md). `JitOptions::vector_width` overrides it.
fn vector_width(features: &str, opts: &JitOptions) -> Option<String> {
    match opts.vector_width {
        Some(w) => Some(w.to_string()),
        None => features.split(',').any(|f| f == "+avx512f").then(|| "512".to_string()),
    }
}

/// The module as the optimizer receives it: for the host's triple and data layout, its functions
/// carrying the host CPU, its features and the preferred vector width as attributes (the
/// optimizer and the code generator read a function's target there; MCJIT, which this JIT
/// replaced, generated generic x86-64 (SSE2) code without them). The cache key hashes this text.
fn for_host(m: &Module, tm: &TargetMachine, opts: &JitOptions) {
    m.set_triple(&tm.get_triple());
    m.set_data_layout(&tm.get_target_data().get_data_layout());
    let cpu = tm.get_cpu().to_string();
    let features = tm.get_feature_string().to_string_lossy().into_owned();
    let cx = m.get_context();
    let width = vector_width(&features, opts);
    for f in m.get_functions().filter(|f| f.count_basic_blocks() > 0) {
        f.add_attribute(inkwell::attributes::AttributeLoc::Function, cx.create_string_attribute("target-cpu", &cpu));
        f.add_attribute(inkwell::attributes::AttributeLoc::Function, cx.create_string_attribute("target-features", &features));
        if let Some(w) = &width {
            f.add_attribute(inkwell::attributes::AttributeLoc::Function, cx.create_string_attribute("prefer-vector-width", w));
        }
    }
}

/// The optimization pipeline every kernel goes through.
const PIPELINE: &str = "default<O3>";

/// O3 for the host (`qatc compile --emit-llvm` writes what this makes).
pub(crate) fn optimize(m: &Module, tm: &TargetMachine, name: &str, opts: &JitOptions) -> Result<(), KernelError> {
    for_host(m, tm, opts);
    m.run_passes(PIPELINE, tm, PassBuilderOptions::create()).map_err(|e| llvm_err(name, e))
}

/// Where a program's kernels came from, and how long getting them took.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JitReport {
    pub kernels: usize,
    /// Already linked in this process (by an earlier program).
    pub in_process: usize,
    /// Object code read from the disk cache.
    pub from_disk: usize,
    /// Optimized and compiled here.
    pub compiled: usize,
    /// Seconds from the first module built to the last kernel linked.
    pub wall_s: f64,
    /// Why the disk cache could not keep a kernel it compiled (the first such error), if one
    /// could not: the build goes on without it.
    pub cache_warning: Option<String>,
}

impl JitReport {
    /// Kernels that came from a cache, in this process or on disk.
    pub fn cached(&self) -> usize {
        self.in_process + self.from_disk
    }
}

/// Every kernel of a program, compiled for this CPU: entry points into code linked for the
/// life of the process.
pub struct Jit {
    fns: Vec<KernelFn>,
    names: Vec<String>,
    report: JitReport,
}

/// Kernels linked in this process: their key -> the entry's address.
fn linked() -> &'static Mutex<HashMap<String, usize>> {
    static LINKED: OnceLock<Mutex<HashMap<String, usize>>> = OnceLock::new();
    LINKED.get_or_init(|| Mutex::new(HashMap::new()))
}

/// What every kernel of one compile shares.
struct Session<'a> {
    cx: Context,
    tm: TargetMachine,
    host: HostCpu,
    pipeline: String,
    opts: &'a JitOptions,
    disk: Option<&'a ObjectCache>,
    orc: &'static Orc,
}

impl Jit {
    /// Builds, optimizes (O3, host CPU) and compiles `kernels`; `function(i)` is kernel i's entry.
    /// Kernels this process compiled before are not compiled again.
    pub fn compile(kernels: &[Kernel]) -> Result<Jit, KernelError> {
        Self::compile_with(kernels, &JitOptions::default())
    }

    /// [`Jit::compile`] with the settings given.
    pub fn compile_with(kernels: &[Kernel], opts: &JitOptions) -> Result<Jit, KernelError> {
        Self::compile_cached(kernels, opts, None)
    }

    /// [`Jit::compile_with`], reading and keeping object code in `disk`.
    pub fn compile_cached(kernels: &[Kernel], opts: &JitOptions, disk: Option<&ObjectCache>) -> Result<Jit, KernelError> {
        let start = Instant::now();
        let s = Session {
            cx: Context::create(),
            tm: host_machine()?,
            host: HostCpu::this(),
            pipeline: format!("{PIPELINE}; {CODEGEN}"),
            opts,
            disk,
            orc: Orc::get().map_err(|e| llvm_err("-", format!("the JIT could not start: {e}")))?,
        };
        let mut report = JitReport { kernels: kernels.len(), ..JitReport::default() };
        let (mut fns, mut names) = (Vec::with_capacity(kernels.len()), Vec::with_capacity(kernels.len()));
        for k in kernels {
            let name = k.name();
            let addr = s.kernel(k, &name, &mut report)?;
            // SAFETY: `addr` is the entry of the function the kernel's module defines under this
            // name with exactly the signature `void (ptr, i64, i64)` (`FnBuilder::finish`),
            // linked for the life of the process.
            fns.push(unsafe { std::mem::transmute::<usize, KernelFn>(addr) });
            names.push(name);
        }
        report.wall_s = start.elapsed().as_secs_f64();
        Ok(Jit { fns, names, report })
    }

    pub fn function(&self, i: usize) -> Option<KernelFn> {
        self.fns.get(i).copied()
    }

    pub fn name(&self, i: usize) -> Option<&str> {
        self.names.get(i).map(String::as_str)
    }

    pub fn len(&self) -> usize {
        self.fns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.fns.is_empty()
    }

    /// Where the kernels came from.
    pub fn report(&self) -> &JitReport {
        &self.report
    }
}

impl Session<'_> {
    /// One kernel's entry: linked before in this process, else linked from the disk cache, else
    /// compiled (and kept on disk).
    fn kernel(&self, k: &Kernel, name: &str, report: &mut JitReport) -> Result<usize, KernelError> {
        let m = super::module(&self.cx, k, name)?;
        for_host(&m, &self.tm, self.opts);
        let key = ObjectCache::key(&self.host, &self.pipeline, &m.print_to_string().to_string_lossy());
        let poisoned = || llvm_err(name, "a thread panicked while holding the JIT's kernel table");
        if let Some(&addr) = linked().lock().map_err(|_| poisoned())?.get(&key) {
            report.in_process += 1;
            return Ok(addr);
        }
        // an entry that does not link (an object this LLVM cannot read) is compiled again
        let from_disk = self.disk.and_then(|d| d.get(&self.host, &key)).and_then(|object| self.orc.link(name, &object).ok());
        let addr = match from_disk {
            Some(addr) => {
                report.from_disk += 1;
                addr
            }
            None => {
                m.run_passes(PIPELINE, &self.tm, PassBuilderOptions::create()).map_err(|e| llvm_err(name, e))?;
                let object = self.tm.write_to_memory_buffer(&m, FileType::Object).map_err(|e| llvm_err(name, e))?;
                let addr = self.orc.link(name, object.as_slice()).map_err(|e| llvm_err(name, e))?;
                if let Some(d) = self.disk {
                    // a cache that cannot be written costs the next run time, not this one its build
                    if let Err(e) = d.put(&self.host, &key, object.as_slice()) {
                        report.cache_warning.get_or_insert_with(|| e.to_string());
                    }
                }
                report.compiled += 1;
                addr
            }
        };
        Ok(*linked().lock().map_err(|_| poisoned())?.entry(key).or_insert(addr))
    }
}
