//! [`CpuProgram`]: a lowered program's buffers, allocated once (buffers that are never live at
//! the same step share bytes: layout.rs), and its steps run in order on them, kernel launches
//! split over rayon's pool.

use std::collections::HashMap;

use qatc_ir::DType;
use qatc_kernels::kir::{self, Body, Expr, Kernel, Space, Stmt};
use qatc_kernels::program::{BufId, BufKind, Gemm, Program, Step};
use rayon::prelude::*;

use crate::exec::values::{check_view, read_view, write_input};
use super::kir_eval::{kernel_name, KirEval};
use crate::exec::layout::{self, BufferLayout, LayoutReport, Live, Memory};
use super::{gemm, Launcher};
use crate::error::RuntimeError;
use crate::value::Value;

/// Below this much estimated work (iterations times the longest loop) a launch runs on the
/// calling thread: handing it to the pool costs more.
const PAR_MIN_WORK: usize = 1 << 14;

/// A launch's buffer addresses, one per kernel param.
struct RawArgs(Box<[*mut u8]>);

// SAFETY: the pointers address memory owned by the same CpuProgram (re-resolved whenever it lays
// its memory out again), which dereferences them (through its launcher) only inside
// `execute_step(&mut self)`: moving or sharing the list between threads gives no access by itself.
unsafe impl Send for RawArgs {}
// SAFETY: see Send.
unsafe impl Sync for RawArgs {}

/// How one Launch step runs.
struct LaunchPlan {
    kernel: usize,
    args: RawArgs,
    iterations: usize,
    /// Iterations per parallel chunk (a multiple of `grain`); `iterations` or more: inline.
    chunk: usize,
    /// The buffers behind `args`.
    bufs: Vec<BufId>,
}

/// A GEMM whose operand b a kernel computes panel by panel (`qatc_kernels::panels`): before
/// each partial GEMM, `feed` runs over that panel's element range.
struct Fed {
    feed: LaunchPlan,
    /// The whole GEMM's (m, n, k), for the profile.
    dims: (usize, usize, usize),
    panels: Vec<((usize, usize), Gemm)>,
}

enum Plan {
    Launch(LaunchPlan),
    Gemm(Box<Gemm>),
    Fed(Box<Fed>),
}

/// Checks a launch's buffers against its kernel's params (count, dtype, size, no graph input
/// written) and marks them read.
fn check_args<'p>(prog: &'p Program, read: &mut [bool], kernel: usize, args: &[usize]) -> Result<&'p Kernel, RuntimeError> {
    let k = prog.kernels.get(kernel).ok_or_else(|| RuntimeError::Kernel {
        kernel: format!("#{kernel}"),
        msg: format!("the program has {} kernels", prog.kernels.len()),
    })?;
    let err = |msg: String| RuntimeError::Kernel { kernel: kernel_name(k), msg };
    if args.len() != k.params.len() {
        return Err(err(format!("launched with {} buffers for {} params", args.len(), k.params.len())));
    }
    for (p, &b) in k.params.iter().zip(args) {
        let buf = prog.buffers.get(b).ok_or_else(|| err(format!("param {} is buffer {b} of {}", p.name, prog.buffers.len())))?;
        if buf.dtype != p.dtype || buf.numel() != p.numel() {
            return Err(err(format!(
                "param {} ({} {:?}) gets buffer {} ({} {:?})",
                p.name, p.dtype, p.shape, buf.name, buf.dtype, buf.shape
            )));
        }
        if p.write && matches!(buf.kind, BufKind::Input(_)) {
            return Err(err(format!("param {} writes the graph input {}", p.name, buf.name)));
        }
        read[b] = true;
    }
    Ok(k)
}

/// Runs iterations `start..end` of a launch, in chunks of `l.chunk` over rayon's pool.
///
/// # Safety
/// `l`'s arguments must have been checked by `check_args` and resolved by `resolve` against live
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

/// A lowered program ready to run on the CPU: its buffers allocated once (64-byte aligned,
/// zeroed; those never live at the same step at the same addresses unless [`BufferLayout::Distinct`]),
/// the launches' arguments resolved and checked, kernels run by a [`Launcher`].
pub struct CpuProgram {
    prog: Program,
    launcher: Box<dyn Launcher>,
    layout: BufferLayout,
    mem: Memory,
    plans: Vec<Plan>,
    /// Graph inputs: (name, buffer), in buffer order.
    inputs: Vec<(String, usize)>,
    /// Whether each buffer has been given a value (inputs only).
    given: Vec<bool>,
    /// Input buffers some step or output reads: a run needs them given.
    needed: Vec<usize>,
    /// Steps that compute the same values every run (`hoist`): run once, then skipped.
    hoisted: Vec<bool>,
    /// Input buffers whose setting makes the hoisted steps run again.
    frozen: Vec<bool>,
    /// The hoisted steps' results are out of date.
    stale: bool,
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

/// Which params of `k` it reads as well as writes (a load of a written param, or an atomic add
/// into one): such a param may read what the buffer held before the launch.
fn written_params_read(k: &Kernel) -> Vec<bool> {
    fn atomics(stmts: &[Stmt], read: &mut [bool]) {
        for s in stmts {
            match s {
                Stmt::AtomicAdd { param, .. } => {
                    if let Some(r) = read.get_mut(*param) {
                        *r = true;
                    }
                }
                Stmt::Reduce { body, .. } | Stmt::ForEach { body, .. } => atomics(body, read),
                Stmt::Let { .. } | Stmt::Store { .. } => {}
            }
        }
    }
    let mut read = vec![false; k.params.len()];
    // attention kernels read their inputs and only write their outputs
    if let Body::Loops { stmts, .. } = &k.body {
        kir::visit_exprs(stmts, &mut |e| {
            if let Expr::Load { param, .. } = e {
                if let Some(r) = read.get_mut(*param) {
                    *r = true;
                }
            }
        });
        atomics(stmts, &mut read);
    }
    read.iter_mut().zip(&k.params).for_each(|(r, p)| *r &= p.write);
    read
}

/// The buffers a step reads and those it writes: the one place that knows how each kind of step
/// uses its buffers (hoisting and the memory layout both ask it). A buffer read and written by
/// the same step is in both lists: a kernel's written param that it also reads, the destination
/// of an accumulating GEMM.
fn reads_writes(plan: &Plan, prog: &Program) -> (Vec<BufId>, Vec<BufId>) {
    match plan {
        Plan::Launch(l) => {
            let k = &prog.kernels[l.kernel];
            let (mut r, mut w) = (Vec::new(), Vec::new());
            for ((p, &b), read) in k.params.iter().zip(&l.bufs).zip(written_params_read(k)) {
                if p.write {
                    w.push(b);
                }
                if !p.write || read {
                    r.push(b);
                }
            }
            (r, w)
        }
        Plan::Gemm(g) => {
            let mut r = vec![g.a.buf, g.b.buf];
            r.extend(g.bias.as_ref().map(|b| b.buf));
            if g.accumulate {
                r.push(g.c.buf);
            }
            (r, vec![g.c.buf])
        }
        // the scratch is written (by the feed) before the partial GEMMs read it, inside the step
        Plan::Fed(f) => {
            let Some((_, g)) = f.panels.first() else { return (Vec::new(), Vec::new()) };
            let mut r: Vec<BufId> =
                prog.kernels[f.feed.kernel].params.iter().zip(&f.feed.bufs).filter(|(p, _)| !p.write).map(|(_, &b)| b).collect();
            r.push(g.a.buf);
            r.extend(f.panels.iter().filter_map(|(_, g)| g.bias.as_ref().map(|b| b.buf)));
            if g.accumulate {
                r.push(g.c.buf);
            }
            (r, vec![g.c.buf, g.b.buf])
        }
    }
}

/// Each buffer's lifetime: the outputs, and the results of hoisted steps (read on later runs
/// without being computed again), live the whole run, as does everything when distinct.
fn lifetimes(prog: &Program, plans: &[Plan], hoisted: &[bool], layout: BufferLayout) -> Vec<Live> {
    let steps: Vec<(Vec<BufId>, Vec<BufId>)> = plans.iter().map(|p| reads_writes(p, prog)).collect();
    let mut whole = vec![layout == BufferLayout::Distinct; prog.buffers.len()];
    for (_, v) in &prog.outputs {
        whole[v.buf] = true;
    }
    for ((_, w), _) in steps.iter().zip(hoisted).filter(|(_, h)| **h) {
        for &b in w {
            whole[b] = true;
        }
    }
    layout::lifetimes(&prog.buffers, &steps, &whole)
}

/// Points every launch at its buffers' current addresses in `mem`.
fn resolve(plans: &mut [Plan], mem: &Memory) {
    for plan in plans {
        match plan {
            Plan::Launch(l) => l.args = RawArgs(l.bufs.iter().map(|&b| mem.ptr(b)).collect()),
            Plan::Fed(f) => f.feed.args = RawArgs(f.feed.bufs.iter().map(|&b| mem.ptr(b)).collect()),
            Plan::Gemm(_) => {}
        }
    }
}

impl CpuProgram {
    /// Allocates `prog`'s buffers, sharing memory between buffers never live at the same step
    /// ([`BufferLayout::Shared`]), and checks every step against them (buffer counts, dtypes and
    /// sizes of kernel params, GEMM views, no step writing a graph input); `launcher` runs its
    /// kernels.
    pub fn new(prog: Program, launcher: Box<dyn Launcher>) -> Result<CpuProgram, RuntimeError> {
        CpuProgram::with_layout(prog, launcher, BufferLayout::Shared)
    }

    /// [`CpuProgram::new`] with the buffers laid out as `layout` says: [`BufferLayout::Distinct`]
    /// keeps every buffer readable after a run.
    pub fn with_layout(prog: Program, launcher: Box<dyn Launcher>, layout: BufferLayout) -> Result<CpuProgram, RuntimeError> {
        let threads = rayon::current_num_threads().max(1);
        let mut read = vec![false; prog.buffers.len()];
        let mut plans = Vec::with_capacity(prog.steps.len());
        for step in &prog.steps {
            plans.push(match step {
                Step::Launch { kernel, args: bufs, .. } => {
                    let k = check_args(&prog, &mut read, *kernel, bufs)?;
                    let iterations = kir::iterations(k);
                    let chunk = chunk_for(k, iterations, threads, 4);
                    // the addresses come once the memory is laid out (`resolve`)
                    Plan::Launch(LaunchPlan { kernel: *kernel, args: RawArgs(Box::new([])), iterations, chunk, bufs: bufs.clone() })
                }
                Step::Gemm(g) if g.feed.is_some() => {
                    let f = g.feed.as_ref().ok_or_else(|| RuntimeError::Gemm { note: g.note.clone(), msg: "no feed".into() })?;
                    let k = check_args(&prog, &mut read, f.kernel, &f.args)?;
                    let chunk = chunk_for(k, f.panel * f.cols, threads, 2);
                    let panels = g.panels();
                    for (_, sub) in &panels {
                        gemm::check(sub, &prog.buffers)?;
                    }
                    if matches!(prog.buffers[g.c.buf].kind, BufKind::Input(_)) {
                        return Err(RuntimeError::Gemm {
                            note: g.note.clone(),
                            msg: format!("writes the graph input {}", prog.buffers[g.c.buf].name),
                        });
                    }
                    for v in [Some(&g.a), Some(&g.b), Some(&g.c), g.bias.as_ref()].into_iter().flatten() {
                        read[v.buf] = true;
                    }
                    let feed = LaunchPlan {
                        kernel: f.kernel,
                        args: RawArgs(Box::new([])),
                        iterations: f.rows * f.cols,
                        chunk,
                        bufs: f.args.clone(),
                    };
                    Plan::Fed(Box::new(Fed { feed, dims: (g.m, g.n, g.k), panels }))
                }
                Step::Gemm(g) => {
                    gemm::check(g, &prog.buffers)?;
                    if matches!(prog.buffers[g.c.buf].kind, BufKind::Input(_)) {
                        return Err(RuntimeError::Gemm {
                            note: g.note.clone(),
                            msg: format!("writes the graph input {}", prog.buffers[g.c.buf].name),
                        });
                    }
                    for v in [Some(&g.a), Some(&g.b), Some(&g.c), g.bias.as_ref()].into_iter().flatten() {
                        read[v.buf] = true;
                    }
                    Plan::Gemm(g.clone())
                }
            });
        }
        for (name, v) in &prog.outputs {
            let buf = prog.buffers.get(v.buf).ok_or_else(|| RuntimeError::Buffer {
                name: name.clone(),
                msg: format!("output in buffer {} of {}", v.buf, prog.buffers.len()),
            })?;
            check_view(buf, v, &format!("output {name}"))?;
            read[v.buf] = true;
        }
        let inputs: Vec<(String, usize)> = prog
            .buffers
            .iter()
            .enumerate()
            .filter_map(|(i, b)| if let BufKind::Input(n) = &b.kind { Some((n.clone(), i)) } else { None })
            .collect();
        let needed = inputs.iter().map(|&(_, b)| b).filter(|&b| read[b]).collect();
        let given = vec![false; prog.buffers.len()];
        let (hoisted, frozen) = (vec![false; plans.len()], vec![false; prog.buffers.len()]);
        let mem = Memory::new(&prog.buffers, lifetimes(&prog, &plans, &hoisted, layout))?;
        resolve(&mut plans, &mem);
        Ok(CpuProgram { prog, launcher, layout, mem, plans, inputs, given, needed, hoisted, frozen, stale: true })
    }

    /// `prog` with its kernels run by the kernel-IR evaluator ([`KirEval`]).
    pub fn with_kir_eval(prog: Program) -> Result<CpuProgram, RuntimeError> {
        let eval = KirEval::new(&prog.kernels);
        CpuProgram::new(prog, Box::new(eval))
    }

    pub fn program(&self) -> &Program {
        &self.prog
    }

    /// Bytes this program holds for its buffers: the arena and the inputs' own allocations.
    pub fn allocated_bytes(&self) -> usize {
        let r = self.mem.report();
        r.arena_bytes + r.input_bytes
    }

    /// How the buffers are laid out: the arena against the sum of the buffers in it, and the
    /// most bytes live at one step (no arena can be smaller).
    pub fn layout_report(&self) -> LayoutReport {
        self.mem.report()
    }

    /// Copies a graph input's value into its buffer, where it stays for later runs: floats into
    /// f32 buffers (f16/bf16 ones rounded to nearest even), ints into i32, u8 and packed i4.
    pub fn set_input(&mut self, name: &str, v: &Value<f32>) -> Result<(), RuntimeError> {
        let mut found = false;
        for &(ref n, b) in &self.inputs {
            if n == name {
                write_input(&self.prog.buffers[b], self.mem.bytes_mut(b), v)?;
                self.given[b] = true;
                self.stale |= self.frozen[b];
                found = true;
            }
        }
        if found {
            Ok(())
        } else {
            Err(RuntimeError::UnknownInput(name.to_string()))
        }
    }

    /// Runs the program, as `Interpreter::<f32>::run` runs the graph: copies in the given inputs
    /// (extra names are ignored; inputs given before, by `set_input` or an earlier run, stay),
    /// runs every step and returns every named output, update outputs under their input's name.
    pub fn run(&mut self, inputs: &HashMap<String, Value<f32>>) -> Result<HashMap<String, Value<f32>>, RuntimeError> {
        for i in 0..self.inputs.len() {
            let (name, b) = (&self.inputs[i].0, self.inputs[i].1);
            if let Some(v) = inputs.get(name) {
                write_input(&self.prog.buffers[b], self.mem.bytes_mut(b), v)?;
                self.given[b] = true;
                self.stale |= self.frozen[b];
            }
        }
        self.execute()?;
        self.outputs()
    }

    /// Runs the steps on the inputs already given.
    pub fn execute(&mut self) -> Result<(), RuntimeError> {
        if let Some(&b) = self.needed.iter().find(|&&b| !self.given[b]) {
            return Err(RuntimeError::MissingInput(self.prog.buffers[b].name.clone()));
        }
        for i in 0..self.plans.len() {
            if !self.hoisted[i] || self.stale {
                self.execute_step(i)?;
            }
        }
        self.stale = false;
        Ok(())
    }

    /// Declares the graph inputs named in `frozen` constant between runs (frozen weights), so
    /// that the steps computing only from them (dequantizing 4-bit weights, mostly) run on the
    /// first run and after such an input is set again, not every step: their results live the
    /// whole run (the memory is laid out again here), so they stay. A step qualifies when
    /// everything it reads is frozen or written by qualifying steps (or by itself), and no other
    /// step writes what it writes. Returns how many; fails only if the new layout cannot be
    /// allocated.
    pub fn hoist(&mut self, frozen: &std::collections::HashSet<String>) -> Result<usize, RuntimeError> {
        let nb = self.prog.buffers.len();
        let mut writers = vec![0usize; nb];
        for plan in &self.plans {
            for b in reads_writes(plan, &self.prog).1 {
                writers[b] += 1;
            }
        }
        let mut constant = vec![false; nb];
        for &(ref n, b) in &self.inputs {
            if frozen.contains(n) {
                constant[b] = true;
                self.frozen[b] = true;
            }
        }
        let mut count = 0;
        let before = self.hoisted.clone();
        for (i, plan) in self.plans.iter().enumerate() {
            let (r, w) = reads_writes(plan, &self.prog);
            let ok = !w.is_empty() && r.iter().all(|&b| constant[b] || w.contains(&b)) && w.iter().all(|&b| writers[b] == 1);
            self.hoisted[i] = ok;
            if ok {
                count += 1;
                for b in w {
                    constant[b] = true;
                }
            }
        }
        self.stale = true;
        if self.hoisted != before {
            if let Err(e) = self.mem.relayout(&self.prog.buffers, lifetimes(&self.prog, &self.plans, &self.hoisted, self.layout)) {
                // the old layout stays, and is right only for the old hoisting
                self.hoisted = before;
                return Err(e);
            }
            resolve(&mut self.plans, &self.mem);
        }
        Ok(count)
    }

    /// Runs step `i` alone (a launch or a GEMM) on whatever the buffers hold: the per-kernel
    /// differential test runs one step at a time on two launchers.
    pub fn execute_step(&mut self, i: usize) -> Result<(), RuntimeError> {
        let plan = self.plans.get(i).ok_or_else(|| RuntimeError::Kernel { kernel: "-".into(), msg: format!("no step {i}") })?;
        match plan {
            Plan::Launch(l) => {
                // SAFETY: `new` checked each param against its buffer, and `resolve` pointed it at
                // that buffer's bytes in `self.mem` (64-byte aligned, at least the param's
                // elements in its dtype), which no other buffer live at this step shares
                // (layout.rs); `&mut self` keeps everything else away from the buffers.
                unsafe { run_range(&*self.launcher, l, 0, l.iterations)? };
            }
            Plan::Fed(f) => {
                let mem = &self.mem;
                for ((start, end), g) in &f.panels {
                    // SAFETY: as for a launch (the feed's arguments are resolved like one), and
                    // each partial GEMM passed `gemm::check` in `new`; the feed fills the
                    // scratch before the GEMM that reads it, one after the other.
                    unsafe {
                        run_range(&*self.launcher, &f.feed, *start, *end)?;
                        gemm::run(g, |b| mem.ptr(b));
                    }
                }
            }
            Plan::Gemm(g) => {
                let mem = &self.mem;
                // SAFETY: `gemm::check` passed for this step in `new`, against these buffers;
                // all of them are live at this step, so the layout gives them disjoint bytes
                // (c aliases no operand), and `&mut self` keeps them from any other access.
                unsafe { gemm::run(g, |b| mem.ptr(b)) };
            }
        }
        Ok(())
    }

    /// Runs the steps like `execute`, timing each: (what, seconds) per step in order, `what`
    /// being the kernel's family or `gemm MxNxK` (where a step's time goes: `bench_cpu_train`).
    pub fn execute_timed(&mut self) -> Result<Vec<(String, f64)>, RuntimeError> {
        let mut times = Vec::with_capacity(self.plans.len());
        let by_kernel = std::env::var_os("QATC_PROFILE_KERNELS").is_some();
        for i in 0..self.plans.len() {
            if self.hoisted[i] && !self.stale {
                continue;
            }
            let t = std::time::Instant::now();
            self.execute_step(i)?;
            let what = match &self.plans[i] {
                Plan::Launch(l) if by_kernel => format!("{} [{}] #{}", self.prog.kernels[l.kernel].family, l.iterations, l.kernel),
                Plan::Launch(l) => self.prog.kernels[l.kernel].family.clone(),
                Plan::Gemm(g) => {
                    format!("gemm {}x{}x{}{}", g.m, g.n, g.k, if g.batch() > 1 { format!(" x{}", g.batch()) } else { String::new() })
                }
                Plan::Fed(f) => format!("gemm {}x{}x{} fed by {}", f.dims.0, f.dims.1, f.dims.2, self.prog.kernels[f.feed.kernel].family),
            };
            times.push((what, t.elapsed().as_secs_f64()));
        }
        Ok(times)
    }

    /// The raw bytes of buffer `b` (its size rounded up to 64). With [`BufferLayout::Shared`],
    /// after a run only inputs, outputs and hoisted results still hold their value: another
    /// buffer's bytes may since have been reused by a buffer that lives later.
    pub fn buffer_bytes(&self, b: usize) -> Option<&[u8]> {
        (b < self.prog.buffers.len()).then(|| self.mem.bytes(b))
    }

    /// Overwrites buffer `b` with `bytes` (its exact size), as if a step had written it. With
    /// [`BufferLayout::Shared`] that also overwrites whatever buffers share its bytes: copying
    /// every buffer in needs [`BufferLayout::Distinct`].
    pub fn set_buffer_bytes(&mut self, b: usize, bytes: &[u8]) -> Result<(), RuntimeError> {
        let name = self.prog.buffers.get(b).map(|x| x.name.clone()).unwrap_or_default();
        if b >= self.prog.buffers.len() {
            return Err(RuntimeError::Buffer { name, msg: format!("no buffer {b}") });
        }
        let dst = self.mem.bytes_mut(b);
        if dst.len() < bytes.len() {
            return Err(RuntimeError::Buffer { name, msg: format!("{} bytes into {}", bytes.len(), dst.len()) });
        }
        dst[..bytes.len()].copy_from_slice(bytes);
        if let Some(g) = self.given.get_mut(b) {
            *g = true;
        }
        Ok(())
    }

    /// Every named output of the last run, by name. A name given to both an output and an update
    /// must hold one value (as the interpreter's `run` requires).
    pub fn outputs(&self) -> Result<HashMap<String, Value<f32>>, RuntimeError> {
        let mut out: HashMap<String, Value<f32>> = HashMap::with_capacity(self.prog.outputs.len());
        for (name, v) in &self.prog.outputs {
            let val = read_view(&self.prog.buffers[v.buf], self.mem.bytes(v.buf), v)?;
            match out.get(name) {
                Some(old) if *old != val => return Err(RuntimeError::OutputClash(name.clone())),
                _ => {
                    out.insert(name.clone(), val);
                }
            }
        }
        Ok(out)
    }

    /// One named output of the last run.
    pub fn output(&self, name: &str) -> Option<Result<Value<f32>, RuntimeError>> {
        let (_, v) = self.prog.outputs.iter().find(|(n, _)| n == name)?;
        Some(read_view(&self.prog.buffers[v.buf], self.mem.bytes(v.buf), v))
    }
}

impl CpuProgram {
    /// The whole of buffer `b` after the last run (any buffer, not only outputs: the LLVM
    /// equivalence test compares every value a kernel wrote with the interpreter's). That needs
    /// [`BufferLayout::Distinct`]: shared, only inputs, outputs and hoisted results are sure to
    /// hold their value after a run (see `buffer_bytes`).
    pub fn buffer(&self, b: usize) -> Result<Value<f32>, RuntimeError> {
        let buf = self.prog.buffers.get(b).ok_or_else(|| RuntimeError::Kernel { kernel: "-".into(), msg: format!("no buffer {b}") })?;
        read_view(buf, self.mem.bytes(b), &qatc_kernels::View::contiguous(b, &buf.shape))
    }
}
