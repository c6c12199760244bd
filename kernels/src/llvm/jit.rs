//! Optimizing and JIT-compiling kernel modules for the host (MCJIT through inkwell).

use std::mem::ManuallyDrop;

use inkwell::context::Context;
use inkwell::execution_engine::ExecutionEngine;
use inkwell::module::Module;
use inkwell::passes::PassBuilderOptions;
use inkwell::targets::{CodeModel, InitializationConfig, RelocMode, Target, TargetMachine};
use inkwell::OptimizationLevel;

use crate::error::KernelError;
use crate::kir::Kernel;

/// A compiled kernel: runs iterations `start..end` with `args[p]` the base of param p's buffer.
pub type KernelFn = unsafe extern "C" fn(args: *const *mut u8, start: u64, end: u64);

extern "C" fn qatc_tanhf(x: f32) -> f32 {
    x.tanh()
}
extern "C" fn qatc_tanh(x: f64) -> f64 {
    x.tanh()
}
extern "C" fn qatc_logf(x: f32) -> f32 {
    x.ln()
}
extern "C" fn qatc_log(x: f64) -> f64 {
    x.ln()
}
extern "C" fn qatc_exp(x: f64) -> f64 {
    x.exp()
}
extern "C" fn qatc_powf(x: f32, y: f32) -> f32 {
    x.powf(y)
}
extern "C" fn qatc_pow(x: f64, y: f64) -> f64 {
    x.powf(y)
}

/// The libm functions kernels call, bound to Rust's (the interpreter's) implementations so both
/// sides round the same way.
fn externs() -> [(&'static str, usize); 7] {
    [
        ("tanhf", qatc_tanhf as extern "C" fn(f32) -> f32 as usize),
        ("tanh", qatc_tanh as extern "C" fn(f64) -> f64 as usize),
        ("logf", qatc_logf as extern "C" fn(f32) -> f32 as usize),
        ("log", qatc_log as extern "C" fn(f64) -> f64 as usize),
        ("exp", qatc_exp as extern "C" fn(f64) -> f64 as usize),
        ("powf", qatc_powf as extern "C" fn(f32, f32) -> f32 as usize),
        ("pow", qatc_pow as extern "C" fn(f64, f64) -> f64 as usize),
    ]
}

fn llvm_err(kernel: &str, message: impl ToString) -> KernelError {
    KernelError::Llvm { kernel: kernel.to_string(), message: message.to_string() }
}

/// A target machine for this host's CPU and its features (AVX2, AVX-512, ..).
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

/// O3 for the host. The functions carry the host CPU as attributes, because MCJIT's code
/// generator otherwise targets generic x86-64 (SSE2) whatever the optimizer assumed.
pub(crate) fn optimize(m: &Module, tm: &TargetMachine, name: &str, opts: &JitOptions) -> Result<(), KernelError> {
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
    m.run_passes("default<O3>", tm, PassBuilderOptions::create()).map_err(|e| llvm_err(name, e))
}

/// Every kernel of a program, compiled for this CPU. Owns the LLVM context and the machine code.
pub struct Jit {
    fns: Vec<KernelFn>,
    names: Vec<String>,
    engine: ManuallyDrop<ExecutionEngine<'static>>,
    cx: *mut Context,
}

// SAFETY: after `compile` returns, the engine and context are only touched by `Drop`; kernels
// run through plain function pointers into finalized, immutable machine code, which any thread
// may call.
unsafe impl Send for Jit {}
// SAFETY: as above: `&Jit` only hands out function pointers and names.
unsafe impl Sync for Jit {}

impl Jit {
    /// Builds, optimizes (O3, host CPU) and compiles `kernels`; `function(i)` is kernel i's entry.
    pub fn compile(kernels: &[Kernel]) -> Result<Jit, KernelError> {
        Self::compile_with(kernels, &JitOptions::default())
    }

    /// [`Jit::compile`] with the settings given.
    pub fn compile_with(kernels: &[Kernel], opts: &JitOptions) -> Result<Jit, KernelError> {
        let cx: *mut Context = Box::into_raw(Box::new(Context::create()));
        // SAFETY: `cx` comes from Box::into_raw and is freed only in Drop, after the engine
        // (which owns every module of this context) has been dropped.
        let cxr: &'static Context = unsafe { &*cx };
        match Self::build(cxr, kernels, opts) {
            Ok((engine, fns, names)) => Ok(Jit { fns, names, engine: ManuallyDrop::new(engine), cx }),
            Err(e) => {
                // SAFETY: `build` dropped every module and engine it made before returning an
                // error, so nothing refers to the context any more.
                drop(unsafe { Box::from_raw(cx) });
                Err(e)
            }
        }
    }

    #[allow(clippy::type_complexity)]
    fn build(
        cx: &'static Context,
        kernels: &[Kernel],
        opts: &JitOptions,
    ) -> Result<(ExecutionEngine<'static>, Vec<KernelFn>, Vec<String>), KernelError> {
        inkwell::support::load_visible_symbols();
        let tm = host_machine()?;
        let mut engine: Option<ExecutionEngine<'static>> = None;
        let mut names = Vec::new();
        for k in kernels {
            let name = k.name();
            let m = super::module(cx, k, &name)?;
            optimize(&m, &tm, &name, opts)?;
            let e = match &engine {
                Some(e) => {
                    e.add_module(&m).map_err(|()| llvm_err(&name, "could not add the module to the JIT"))?;
                    e
                }
                None => engine.insert(m.create_jit_execution_engine(OptimizationLevel::Aggressive).map_err(|e| llvm_err(&name, e))?),
            };
            for (sym, addr) in externs() {
                if let Some(f) = m.get_function(sym) {
                    e.add_global_mapping(&f, addr);
                }
            }
            names.push(name);
        }
        let engine = match engine {
            Some(e) => e,
            None => {
                let m = cx.create_module("empty");
                m.create_jit_execution_engine(OptimizationLevel::Aggressive).map_err(|e| llvm_err("-", e))?
            }
        };
        let mut fns = Vec::new();
        for name in &names {
            let addr = engine.get_function_address(name).map_err(|e| llvm_err(name, e))?;
            // SAFETY: `addr` is the entry of a function this module defines with exactly the
            // signature `void (ptr, i64, i64)` (`FnBuilder::finish`).
            fns.push(unsafe { std::mem::transmute::<usize, KernelFn>(addr) });
        }
        Ok((engine, fns, names))
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
}

impl Drop for Jit {
    fn drop(&mut self) {
        // SAFETY: the engine (and with it every module) goes first, then the context they were
        // made in; neither is used again.
        unsafe {
            ManuallyDrop::drop(&mut self.engine);
            drop(Box::from_raw(self.cx));
        }
    }
}
