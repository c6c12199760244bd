//! The CPU backend: kernel IR -> LLVM IR (inkwell, LLVM 19) -> host machine code.
//!
//! Every kernel becomes one module with one exported function
//!
//! ```text
//! void fused_{family}_{hash8}(ptr %args, i64 %start, i64 %end)
//! ```
//!
//! that runs iterations `start..end` of the kernel's outer space ([`crate::kir::iterations`]):
//! elements of an `Elements` space, rows of a `Rows` space, (b, h, row) programs of attention.
//! `args[p]` is the base address of parameter p's buffer. The runtime splits `0..iterations`
//! across threads; disjoint ranges write disjoint memory (i4 stores share a byte between
//! neighbouring elements, so ranges start at even elements), and `AtomicAdd` (integer counts) is
//! an atomic add. The name is `Kernel::name` (`fused_{family}_{hash8}`), as in CUDA: one kernel,
//! one name, on both targets.
//!
//! The exported function loads the parameter pointers and calls `NAME.body`, whose pointer
//! parameters are `noalias` (a launch never passes one buffer twice; the runtime checks), so
//! LLVM may vectorize elementwise loops. Floating point is strict except where the kernel IR
//! allows otherwise: the adds of a `Reduce` `Sum` carry `reassoc` (the IR lets a backend fold in
//! any order), which lets LLVM vectorize row reductions; an f32 sum adds partial sums of 64 terms
//! in f64 and rounds the total once (nearly the kernel evaluator's and the interpreter's rule,
//! f64 throughout, at f32's vector width); a long `Max` reduction folds 8
//! independent lanes (max is exactly associative; LLVM will not vectorize `maxnum` reductions
//! without `nnan`). f32 `exp` and `tanh` are inline, vectorizable Cephes polynomials within 2 ulp
//! of libm's; log and pow, and f64 math, call libm (bound to Rust's implementations, `orc.rs`).
//!
//! Compiled kernels are cached in the process and, given a directory, on disk (`jit.rs`,
//! `objcache.rs`): a kernel compiled once is not compiled again.

mod attention;
mod fb;
mod jit;
mod loops;
mod math;
mod objcache;
mod orc;
mod scalar;
mod space;

use inkwell::context::Context;
use inkwell::module::Module;

use crate::error::KernelError;
use crate::kir::{Body, Kernel};

pub use jit::{host_machine, Jit, JitOptions, JitReport, KernelFn};
pub use objcache::{HostCpu, ObjectCache};

/// Builds the (unoptimized) module of one kernel.
pub(crate) fn module<'ctx>(cx: &'ctx Context, k: &Kernel, name: &str) -> Result<Module<'ctx>, KernelError> {
    let m = cx.create_module(name);
    let mut f = fb::FnBuilder::new(cx, &m, k, name)?;
    match &k.body {
        Body::Loops { space, stmts } => space::emit(&mut f, space, stmts)?,
        Body::Attention(a) => attention::emit(&mut f, a)?,
    }
    f.finish()?;
    m.verify().map_err(|e| KernelError::Llvm { kernel: name.to_string(), message: format!("invalid module: {}", e.to_string()) })?;
    Ok(m)
}

/// One kernel as LLVM IR text as the backend builds it, before any optimization: independent of
/// the host (the JIT adds the target and optimizes), so snapshot tests pin it: (name, text).
pub fn emit_unoptimized_ir(k: &Kernel) -> Result<(String, String), KernelError> {
    let name = k.name();
    let cx = Context::create();
    let m = module(&cx, k, &name)?;
    Ok((name, m.print_to_string().to_string()))
}

/// One kernel as LLVM IR text, optimized for this machine exactly as the JIT compiles it
/// (`qatc compile --emit-llvm`): (name, text).
pub fn emit_ir(k: &Kernel) -> Result<(String, String), KernelError> {
    let name = k.name();
    let cx = Context::create();
    let m = module(&cx, k, &name)?;
    let tm = host_machine()?;
    jit::optimize(&m, &tm, &name, &jit::JitOptions::default())?;
    Ok((name, m.print_to_string().to_string()))
}
