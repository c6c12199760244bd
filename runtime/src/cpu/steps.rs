//! How the CPU runs one step of a program: a launch's iterations split into chunks over rayon's
//! pool, a library GEMM, or a GEMM fed its 4-bit weight a dequantized panel at a time.

use qatc_ir::DType;
use qatc_kernels::kir::{self, Body, Kernel, Space, Stmt};
use qatc_kernels::panels::PanelTable;
use qatc_kernels::program::{BufId, Collective, Gemm, Program, Step};
use rayon::prelude::*;

use super::gemm::GemmLibs;
use super::memory::Memory;
use super::{gemm, Launcher};
use crate::comm::{self, Communicator};
use crate::error::RuntimeError;

/// Below this much estimated work (iterations times the longest loop) a launch runs on the
/// calling thread: handing it to the pool costs more.
const PAR_MIN_WORK: usize = 1 << 14;

/// A launch's buffer addresses, one per kernel param.
pub struct RawArgs(Box<[*mut u8]>);

// SAFETY: the pointers address memory owned by the same CpuProgram (resolved once its memory is
// allocated; it never moves), which dereferences them (through its launcher) only inside
// `execute_step(&mut self)`: moving or sharing the list between threads gives no access by itself.
unsafe impl Send for RawArgs {}
// SAFETY: see Send.
unsafe impl Sync for RawArgs {}

/// How one launch runs.
pub struct LaunchPlan {
    pub kernel: usize,
    pub args: RawArgs,
    pub iterations: usize,
    /// Iterations per parallel chunk (a multiple of the kernel's grain); `iterations` or more:
    /// on the calling thread.
    pub chunk: usize,
}

/// A GEMM whose operand b a kernel computes panel by panel (`qatc_kernels::panels`): before
/// each partial GEMM, `feed` runs over that panel's element range.
pub struct Fed {
    pub feed: LaunchPlan,
    /// The whole GEMM's (m, n, k), for the profile.
    pub dims: (usize, usize, usize),
    pub panels: Vec<((usize, usize), Gemm)>,
}

/// One step as the CPU runs it.
pub enum CpuStep {
    Launch(LaunchPlan),
    Gemm(Box<Gemm>),
    Fed(Box<Fed>),
    /// A collective, run through the program's communicator; its buffers' element type.
    Collective(Box<Collective>, DType),
}

/// The longest loop of a kernel: a rough cost of one iteration.
fn longest_loop(stmts: &[Stmt]) -> usize {
    stmts
        .iter()
        .map(|s| match s {
            Stmt::Reduce { lp, body, .. } | Stmt::ForEach { lp, body } => lp.max.max(1) * longest_loop(body).max(1),
            _ => 1,
        })
        .max()
        .unwrap_or(1)
}

/// (grain, cost of one iteration). Elements kernels and kernels storing packed i4 split on
/// multiples of 64 iterations, so two threads never store into the two nibbles of one byte;
/// attention on multiples of T.
fn shape_of(k: &Kernel) -> (usize, usize) {
    let packed = k.params.iter().any(|p| p.write && p.dtype == DType::I4);
    match &k.body {
        Body::Loops { space: Space::Elements { .. }, .. } => (64, 1),
        Body::Loops { stmts, .. } => (if packed { 64 } else { 1 }, longest_loop(stmts)),
        // whole heads: `GemmAttention` runs a head's query blocks as GEMMs
        Body::Attention(a) => (a.t.max(1), a.t.max(1) * a.hs.max(1)),
    }
}

/// Iterations per parallel chunk when `n` iterations of `k` run at once (a launch, or one panel
/// of a feed): about `per_thread` chunks per thread, on `k`'s grain; all `n` on the calling
/// thread when that is too little work to hand out.
fn chunk_for(k: &Kernel, n: usize, threads: usize, per_thread: usize) -> usize {
    let (grain, cost) = shape_of(k);
    if n.saturating_mul(cost) < PAR_MIN_WORK || threads == 1 {
        n.max(1)
    } else {
        n.div_ceil(per_thread * threads).next_multiple_of(grain).max(grain)
    }
}

/// The buffers' addresses in `mem`.
fn resolve(mem: &Memory, bufs: &[BufId]) -> RawArgs {
    RawArgs(bufs.iter().map(|&b| mem.ptr(b)).collect())
}

/// How the CPU runs each step of `prog` (checked by `ExecPlan::with_panels` with `panels`), the
/// launches' arguments pointed at their buffers in `mem`, split for `threads` threads.
pub fn cpu_steps(prog: &Program, panels: &PanelTable, mem: &Memory, threads: usize) -> Vec<CpuStep> {
    prog.steps
        .iter()
        .enumerate()
        .map(|(i, step)| match step {
            Step::Launch { kernel, args, .. } => {
                let k = &prog.kernels[*kernel];
                let iterations = kir::iterations(k);
                let chunk = chunk_for(k, iterations, threads, 4);
                CpuStep::Launch(LaunchPlan { kernel: *kernel, args: resolve(mem, args), iterations, chunk })
            }
            Step::Gemm(g) => match panels.get(i) {
                Some(f) => {
                    let chunk = chunk_for(&prog.kernels[f.kernel], f.panel * f.cols, threads, 2);
                    let feed = LaunchPlan { kernel: f.kernel, args: resolve(mem, &f.args), iterations: f.rows * f.cols, chunk };
                    CpuStep::Fed(Box::new(Fed { feed, dims: (g.m, g.n, g.k), panels: f.panels(g) }))
                }
                None => CpuStep::Gemm(g.clone()),
            },
            Step::Collective(c) => CpuStep::Collective(c.clone(), prog.buffers[c.dst.buf].dtype),
        })
        .collect()
}

/// Runs iterations `start..end` of a launch, in chunks of `l.chunk` over rayon's pool.
///
/// # Safety
/// `l`'s arguments must have been checked (`exec::check_launch`) and resolved against live
/// memory that nothing else accesses during the call.
unsafe fn run_range(launcher: &dyn Launcher, l: &LaunchPlan, start: usize, end: usize) -> Result<(), RuntimeError> {
    let args = &l.args;
    // SAFETY (both calls): the caller's guarantee, and parallel chunks are disjoint ranges of
    // one launch.
    if end - start <= l.chunk {
        unsafe { launcher.launch(l.kernel, &args.0, start, end) }
    } else {
        let chunks = (end - start).div_ceil(l.chunk);
        (0..chunks)
            .into_par_iter()
            .try_for_each(|c| unsafe { launcher.launch(l.kernel, &args.0, start + c * l.chunk, (start + (c + 1) * l.chunk).min(end)) })
    }
}

/// Runs one step on whatever the buffers hold.
///
/// # Safety
/// `step` must come from [`cpu_steps`] over `mem`, for a program that passed `ExecPlan::with_panels`
/// (with its layout behind `mem`); nothing else may access `mem`'s buffers
/// during the call.
pub unsafe fn run_step(
    step: &CpuStep,
    launcher: &dyn Launcher,
    libs: &GemmLibs,
    comm: &dyn Communicator,
    mem: &Memory,
) -> Result<(), RuntimeError> {
    match step {
        CpuStep::Launch(l) => {
            // SAFETY: each param was checked against its buffer, and `resolve` pointed it at that
            // buffer's bytes in `mem` (aligned, at least the param's elements in its dtype),
            // which no other buffer live at this step shares (the layout); the caller keeps
            // everything else away.
            unsafe { run_range(launcher, l, 0, l.iterations) }
        }
        CpuStep::Fed(f) => {
            for ((start, end), g) in &f.panels {
                // SAFETY: as for a launch (the feed's arguments are resolved like one), and each
                // partial GEMM passed `exec::check_gemm`; the feed fills the scratch before the
                // GEMM that reads it, one after the other.
                unsafe {
                    run_range(launcher, &f.feed, *start, *end)?;
                    gemm::run(g, libs, |b| mem.ptr(b));
                }
            }
            Ok(())
        }
        CpuStep::Gemm(g) => {
            // SAFETY: the GEMM passed `exec::check_gemm` against these buffers;
            // all of them are live at this step, so the layout gives them disjoint bytes (c
            // aliases no operand), and the caller keeps them from any other access.
            unsafe { gemm::run(g, libs, |b| mem.ptr(b)) };
            Ok(())
        }
        CpuStep::Collective(c, dtype) if c.src.buf == c.dst.buf => {
            // written over its operand (an all-reduce in place): the operand copied out first
            // SAFETY: the collective passed `exec::check_collective`: its operand is then its
            // result's whole buffer, of `dtype`, live at this step, and the caller keeps it from
            // any other access; the shared slice is dropped before the mutable one is made.
            let src = unsafe { std::slice::from_raw_parts(mem.ptr(c.dst.buf), dtype.bytes_for(c.dst.numel())) }.to_vec();
            // SAFETY: as above; the one reference to these bytes now.
            let dst = unsafe { std::slice::from_raw_parts_mut(mem.ptr(c.dst.buf), dtype.bytes_for(c.dst.numel())) };
            comm::run(comm, c, *dtype, &src, dst)
        }
        CpuStep::Collective(c, dtype) => {
            // SAFETY: the collective passed `exec::check_collective`: its operand is a contiguous
            // view inside its buffer and its result a whole buffer of another, both of `dtype`;
            // both are live at this step, so the layout gives them disjoint bytes, and the
            // caller keeps them from any other access.
            let (src, dst) = unsafe {
                let src = std::slice::from_raw_parts(mem.ptr(c.src.buf).add(dtype.bytes_for(c.src.offset)), dtype.bytes_for(c.src.numel()));
                let dst = std::slice::from_raw_parts_mut(mem.ptr(c.dst.buf), dtype.bytes_for(c.dst.numel()));
                (src, dst)
            };
            comm::run(comm, c, *dtype, src, dst)
        }
    }
}

/// Runs a fed GEMM as `run_step` does, timing its two halves: (seconds computing the panels,
/// seconds in the GEMMs), for a profile that tells dequantization from multiplication.
///
/// # Safety
/// As `run_step`.
pub unsafe fn run_fed_timed(f: &Fed, launcher: &dyn Launcher, libs: &GemmLibs, mem: &Memory) -> Result<(f64, f64), RuntimeError> {
    let (mut feed, mut product) = (0.0, 0.0);
    for ((start, end), g) in &f.panels {
        let t = std::time::Instant::now();
        // SAFETY: as in `run_step`.
        unsafe { run_range(launcher, &f.feed, *start, *end)? };
        feed += t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        // SAFETY: as in `run_step`.
        unsafe { gemm::run(g, libs, |b| mem.ptr(b)) };
        product += t.elapsed().as_secs_f64();
    }
    Ok((feed, product))
}

/// The feed half of a fed GEMM in a profile (`run_fed_timed`): its kernel's family and the GEMM.
pub fn feed_label(f: &Fed, prog: &Program) -> String {
    let family = prog.kernels.get(f.feed.kernel).map_or("?", |k| k.family.as_str());
    format!("{family} feeding gemm {}x{}x{}", f.dims.0, f.dims.1, f.dims.2)
}

/// What a step is, for a profile: the kernel's family (with `by_kernel`, also its iterations,
/// index and the start of its note), or `gemm MxNxK`.
pub fn label(step: &CpuStep, prog: &Program, by_kernel: bool) -> String {
    let family = |k: usize| prog.kernels.get(k).map_or("?", |k| k.family.as_str());
    match step {
        CpuStep::Launch(l) if by_kernel => {
            let note = prog.kernels.get(l.kernel).map_or("", |k| k.note.as_str());
            let short: String = note.chars().take(72).collect();
            format!("{} [{}] #{} {short}", family(l.kernel), l.iterations, l.kernel)
        }
        CpuStep::Launch(l) => family(l.kernel).to_string(),
        CpuStep::Gemm(g) => crate::exec::gemm_label(g.m, g.n, g.k, g.batch()),
        CpuStep::Fed(f) => format!("gemm {}x{}x{} fed by {}", f.dims.0, f.dims.1, f.dims.2, family(f.feed.kernel)),
        CpuStep::Collective(c, _) => c.exchange.mnemonic().to_string(),
    }
}
