//! [`CudaProgram`]: a lowered program run on a GPU through [`GpuApi`], planned by the same
//! [`ExecPlan`] as the CPU executor (alignment 256, no CPU rewrites):
//!
//! ```text
//! device memory   the layout's three regions (arena, persistent, data), one allocation each,
//!                 zeroed once; plus one scratch shared by the GEMM plans. Nothing is allocated
//!                 after the build.
//! set_input       persistent inputs (frozen weights at their stored precision: packed 4-bit codes
//!                 and scales; trainable parameters; AdamW moments) uploaded once, where they
//!                 stay; data inputs (ids, targets, lr, dropout seeds) written into pinned staging
//! run             hoisted steps (those that read only frozen inputs) run once after the frozen
//!                 inputs are set, outside the graph; then the step's work, captured once as a CUDA
//!                 graph and replayed every run: the staging uploaded, every launch and GEMM, the
//!                 updates' write-backs over their inputs, the non-update outputs (the loss, the
//!                 step's statistics) downloaded into pinned memory, which is all that comes back
//! read_input      a parameter or moment downloaded when asked (a save, a validation)
//! ```
//!
//! A collective (a step over ranks) runs through the communicator `with_communicator` gives (the
//! world of one unless given), by the path its [`Collectives`] says (`collectives.rs`).

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use qatc_ir::InputKind;
use qatc_kernels::cuda::blas::{BlasMode, Mem};
use qatc_kernels::cuda::emit::launch_dims_with;
use qatc_kernels::cuda::LaunchDims;
use qatc_kernels::nvrtc::BuildReport;
use qatc_kernels::program::{BufId, Program, Step, View};
use qatc_kernels::Target;

use super::build::{load_kernels, plan_gemms, KernelBuild, PlannedGemm};
use super::collectives::{Collectives, Exchanges};
use super::{run_plan, DevPtr, DeviceCollective, FuncId, GpuApi, GpuDevice, GpuError, GraphId, PinnedId};
use crate::comm::Communicator;
use crate::error::RuntimeError;
use crate::exec::values::{read_view, write_input};
use crate::exec::{kernel_label, ExecOptions, ExecPlan, MemoryLayout, Region, TimedPart, TrainStep};
use crate::value::Value;

mod timed;
use timed::Parts;

/// One step on the device, its pointers resolved.
enum DeviceStep {
    Launch { func: FuncId, dims: LaunchDims, args: Vec<DevPtr>, label: String },
    Gemm(PlannedGemm),
    Collective(DeviceCollective),
}

/// The device memory a program holds, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceBytes {
    /// The layout's three regions (what `ExecPlan`'s layout says, each at least one alignment).
    pub arena: usize,
    pub persistent: usize,
    pub data: usize,
    /// The GEMM plans' shared scratch (packed operands).
    pub scratch: usize,
    /// Page-locked host memory: the data staging and the outputs' read-back.
    pub pinned: usize,
    /// What the device reported in use once the program was built (its allocations, the BLAS
    /// workspace, the context, the modules; and any other process's).
    pub device_used: usize,
}

impl DeviceBytes {
    /// Device memory allocated for the program (not the library's own workspace).
    pub fn device_total(&self) -> usize {
        self.arena + self.persistent + self.data + self.scratch
    }
}

/// A lowered program ready to run on a GPU (see the module docs). The [`GpuApi`] sits in a
/// `RefCell`: reading an output or an input back is a download, through `&self`.
pub struct CudaProgram<A: GpuApi> {
    prog: Program,
    plan: ExecPlan,
    target: Target,
    api: RefCell<A>,
    /// Region bases, in `Region` order: arena, persistent, data; and the GEMM scratch.
    allocations: Vec<DevPtr>,
    bytes: DeviceBytes,
    /// Each buffer's device address.
    ptrs: Vec<DevPtr>,
    steps: Vec<DeviceStep>,
    scratch: DevPtr,
    /// The data region's staging, and the outputs' read-back (buffer, offset there).
    staging: PinnedId,
    readback: PinnedId,
    readback_at: Vec<(BufId, usize)>,
    /// The outputs' bytes after the last run, as `readback_at` places them.
    outputs: Vec<u8>,
    ran: bool,
    graph: Option<GraphId>,
    given: Vec<bool>,
    frozen: Vec<bool>,
    stale: bool,
    distinct_kernels: usize,
    report: Option<BuildReport>,
    /// Who the collectives exchange with, and by which path.
    exchanges: Exchanges,
}

fn device_err(what: impl Into<String>) -> impl FnOnce(GpuError) -> RuntimeError {
    let what = what.into();
    move |e| RuntimeError::Device { what, msg: e.to_string() }
}

impl<A: GpuApi> CudaProgram<A> {
    /// Plans `prog` for `target` (a CUDA target: its alignment, hoisting, variants, TF32 and
    /// graph replay; buffers sharing the arena by lifetime), builds its kernels for the device
    /// (`build`: NVRTC through the cache; None where the emulation needs no machine code), plans
    /// its GEMMs, allocates and zeroes its memory and loads everything.
    pub fn new(prog: Program, mut api: A, target: &Target, build: Option<&KernelBuild>) -> Result<CudaProgram<A>, RuntimeError> {
        // laid out as `qatc plan --device cuda` plans it (the one home of how an executor allocates)
        let exec = ExecOptions::for_target(target);
        let plan = ExecPlan::new(&prog, exec)?;
        let mut plans = plan_gemms(&prog, BlasMode::of(&target.cuda))?;
        let arch = api.device().arch;
        let loaded = load_kernels(&mut api, &prog, &mut plans, arch, build, &target.cuda)?;
        let align = target.align;
        let l = &plan.layout;
        let sizes = [l.arena_bytes, l.persistent_bytes, l.data_bytes, plans.scratch_bytes];
        let mut allocations = Vec::with_capacity(4);
        for (what, &n) in ["the arena", "the persistent inputs", "the data inputs", "the GEMM scratch"].iter().zip(&sizes) {
            // one alignment at least: an empty region still has an address
            let n = n.max(align);
            let p = api.alloc(n).map_err(device_err(format!("allocating {what} ({n} bytes)")))?;
            allocations.push(p);
            // zeroed, as the CPU's: a buffer read before written in a run holds zeros the first time
            api.memset(p, 0, n).map_err(device_err(format!("zeroing {what}")))?;
        }
        let base = |r: Region| match r {
            Region::Arena => allocations[0],
            Region::Persistent => allocations[1],
            Region::Data => allocations[2],
        };
        let ptrs: Vec<DevPtr> = l.places.iter().map(|p| base(p.region) + p.offset as u64).collect();
        let scratch = allocations[3];
        let mut steps = Vec::with_capacity(prog.steps.len());
        for (step, planned) in prog.steps.iter().zip(plans.gemms) {
            steps.push(match (step, planned) {
                (Step::Launch { kernel, args, .. }, _) => {
                    let k = &prog.kernels[*kernel];
                    DeviceStep::Launch {
                        func: loaded.funcs[*kernel],
                        dims: launch_dims_with(k, &target.cuda),
                        args: args.iter().map(|&b| ptrs[b]).collect(),
                        label: kernel_label(k),
                    }
                }
                (Step::Gemm(_), Some(g)) => DeviceStep::Gemm(g),
                (Step::Gemm(g), None) => return Err(RuntimeError::Gemm { note: g.note.clone(), msg: "not planned".into() }),
                (Step::Collective(c), _) => {
                    // the operand's first element (a contiguous view, `exec::check_collective`)
                    let dtype = prog.buffers[c.dst.buf].dtype;
                    let src = ptrs[c.src.buf] + dtype.bytes_for(c.src.offset) as u64;
                    DeviceStep::Collective(DeviceCollective { step: (**c).clone(), dtype, src, dst: ptrs[c.dst.buf] })
                }
            });
        }
        let mut readback_at = Vec::new();
        let mut out_bytes = 0;
        for (_, v) in &prog.outputs {
            if !readback_at.iter().any(|(b, _)| *b == v.buf) {
                readback_at.push((v.buf, out_bytes));
                out_bytes += prog.buffers[v.buf].bytes().next_multiple_of(8);
            }
        }
        let staging = api.alloc_pinned(l.data_bytes).map_err(device_err("pinned staging for the data inputs"))?;
        let readback = api.alloc_pinned(out_bytes).map_err(device_err("pinned memory for the outputs"))?;
        let (free, total) = api.memory().map_err(device_err("asking the device for its free memory"))?;
        let bytes = DeviceBytes {
            arena: sizes[0].max(align),
            persistent: sizes[1].max(align),
            data: sizes[2].max(align),
            scratch: sizes[3].max(align),
            pinned: l.data_bytes + out_bytes,
            device_used: total.saturating_sub(free),
        };
        let nb = prog.buffers.len();
        let mut frozen = vec![false; nb];
        for i in plan.inputs.iter().filter(|i| i.kind == InputKind::Frozen && target.hoist.any()) {
            frozen[i.buf] = true;
        }
        Ok(CudaProgram {
            prog,
            plan,
            target: *target,
            api: RefCell::new(api),
            allocations,
            bytes,
            ptrs,
            steps,
            scratch,
            staging,
            readback,
            readback_at,
            outputs: vec![0; out_bytes],
            ran: false,
            graph: None,
            given: vec![false; nb],
            frozen,
            stale: true,
            distinct_kernels: loaded.distinct,
            report: loaded.report,
            exchanges: Exchanges::default(),
        })
    }

    /// This program with its collectives run through `comm` (this process's rank of a world the
    /// size the program was compiled for: any other is refused here) by path `how`. The device
    /// path opens the GPU's collective library now, which every rank must do at once.
    pub fn with_communicator(mut self, comm: Arc<dyn Communicator>, how: Collectives) -> Result<CudaProgram<A>, RuntimeError> {
        self.exchanges = Exchanges::join(&self.prog, self.api.get_mut(), comm, how)?;
        // a graph captured before exchanged the old way
        self.graph = None;
        Ok(self)
    }

    /// What the program's collectives run on, in words (None when it has none).
    pub fn collectives(&self) -> Option<String> {
        self.exchanges.words(&self.prog)
    }

    /// Whether a collective is staged through the host (the step then runs without its graph).
    pub fn host_staged(&self) -> bool {
        self.exchanges.host_staged(&self.prog)
    }

    pub fn program(&self) -> &Program {
        &self.prog
    }

    /// The plan this program runs by (the same as the CPU's, at the device's alignment).
    pub fn plan(&self) -> &ExecPlan {
        &self.plan
    }

    pub fn layout(&self) -> &MemoryLayout {
        &self.plan.layout
    }

    /// The target it was built for.
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// What the program holds on the device and in pinned host memory.
    pub fn bytes(&self) -> DeviceBytes {
        self.bytes
    }

    pub fn device(&self) -> GpuDevice {
        self.api.borrow().device().clone()
    }

    /// The GPU API, to inspect (the emulation's counters).
    pub fn api(&mut self) -> &mut A {
        self.api.get_mut()
    }

    /// NVRTC's build report (None when no machine code was built).
    pub fn build_report(&self) -> Option<&BuildReport> {
        self.report.as_ref()
    }

    /// Distinct kernels loaded: the program's and its GEMM plans' data moves.
    pub fn distinct_kernels(&self) -> usize {
        self.distinct_kernels
    }

    /// Kernel launches and library calls of one run, the hoisted steps not counted.
    pub fn per_step(&self) -> (usize, usize) {
        let (mut launches, mut calls) = (0, 0);
        for (s, hoisted) in self.steps.iter().zip(&self.plan.hoisted) {
            if *hoisted {
                continue;
            }
            match s {
                DeviceStep::Launch { .. } => launches += 1,
                DeviceStep::Gemm(g) => {
                    let c = g.plan.calls().count();
                    calls += c;
                    launches += g.plan.steps.len() - c;
                }
                DeviceStep::Collective(_) => {}
            }
        }
        (launches, calls)
    }

    /// Copies a graph input's value in: a persistent one to the device at once (it stays there),
    /// a data one into the pinned staging (uploaded by the next run).
    pub fn set_input(&mut self, name: &str, v: &Value<f32>) -> Result<(), RuntimeError> {
        let i = self.plan.input(name).ok_or_else(|| RuntimeError::UnknownInput(name.to_string()))?;
        let b = i.buf;
        let buf = &self.prog.buffers[b];
        let place = self.plan.layout.places[b];
        let api = self.api.get_mut();
        if place.region == Region::Data {
            let st = api.pinned(self.staging).map_err(device_err(format!("staging input {name}")))?;
            let slot = st.get_mut(place.offset..place.offset + place.bytes).ok_or_else(|| RuntimeError::Buffer {
                name: name.to_string(),
                msg: format!("{} bytes at {} of the staging", place.bytes, place.offset),
            })?;
            write_input(buf, slot, v)?;
        } else {
            let mut bytes = vec![0u8; place.bytes];
            write_input(buf, &mut bytes, v)?;
            api.upload(self.ptrs[b], &bytes).map_err(device_err(format!("uploading input {name}")))?;
        }
        self.given[b] = true;
        self.stale |= self.frozen[b];
        Ok(())
    }

    fn check_given(&self) -> Result<(), RuntimeError> {
        match self.plan.inputs.iter().find(|i| i.needed && !self.given[i.buf]) {
            Some(i) => Err(RuntimeError::MissingInput(i.name.clone())),
            None => Ok(()),
        }
    }

    /// Submits step `i` (run now, or recorded while capturing); without the graph, waits for it.
    fn submit_step(&self, api: &mut A, i: usize) -> Result<(), RuntimeError> {
        self.submit_one(api, i)?;
        if self.target.cuda.graph() {
            return Ok(());
        }
        api.synchronize().map_err(|e| match &self.steps[i] {
            DeviceStep::Launch { label, .. } => RuntimeError::Kernel { kernel: label.clone(), msg: e.to_string() },
            DeviceStep::Gemm(g) => RuntimeError::Gemm { note: g.note.clone(), msg: e.to_string() },
            DeviceStep::Collective(c) => RuntimeError::Collective { what: c.step.note.clone(), msg: e.to_string() },
        })
    }

    fn submit_one(&self, api: &mut A, i: usize) -> Result<(), RuntimeError> {
        match &self.steps[i] {
            DeviceStep::Launch { func, dims, args, label } => {
                api.launch(*func, dims, args).map_err(|e| RuntimeError::Kernel { kernel: label.clone(), msg: e.to_string() })
            }
            DeviceStep::Gemm(g) => {
                let (ptrs, scratch) = (&self.ptrs, self.scratch);
                let resolve = |m: Mem| -> super::Result<DevPtr> {
                    match m {
                        Mem::Buf(b) => ptrs.get(b).copied().ok_or_else(|| GpuError::Invalid(format!("no buffer {b}"))),
                        Mem::Scratch(s) => {
                            g.scratch.get(s).map(|&o| scratch + o as u64).ok_or_else(|| GpuError::Invalid(format!("no scratch {s}")))
                        }
                    }
                };
                run_plan(api, &g.plan, &g.moves, &resolve)
                    .map_err(|e| RuntimeError::Gemm { note: g.note.clone(), msg: format!("{e} (plan: {})", g.plan.summary()) })
            }
            DeviceStep::Collective(c) => self.exchanges.submit(api, c),
        }
    }

    /// The work of every run: the data staging uploaded, the steps not hoisted, the updates'
    /// write-backs, the outputs downloaded into pinned memory. What a graph captures. With
    /// `parts` (a timed run), a mark after each part, and no wait after each step.
    fn submit_run(&self, api: &mut A, mut parts: Option<&mut Parts>) -> Result<(), RuntimeError> {
        let data = self.plan.layout.data_bytes;
        if data > 0 {
            api.upload_pinned(self.allocations[2], self.staging, 0, data).map_err(device_err("uploading the data inputs"))?;
            Parts::cut(&mut parts, api, || Parts::copy("data in (pinned copy)", data))?;
        }
        for i in 0..self.steps.len() {
            if !self.plan.hoisted[i] {
                if parts.is_some() {
                    self.submit_one(api, i)?;
                } else {
                    self.submit_step(api, i)?;
                }
                Parts::cut(&mut parts, api, || self.part(i, ""))?;
            }
        }
        for w in &self.plan.write_backs {
            api.copy(self.ptrs[w.to], self.ptrs[w.from] + w.from_offset as u64, w.bytes)
                .map_err(device_err(format!("writing back the update of {}", w.name)))?;
        }
        let written: usize = self.plan.write_backs.iter().map(|w| w.bytes).sum();
        Parts::cut(&mut parts, api, || Parts::copy("write-back of the updates", 2 * written))?;
        for &(b, at) in &self.readback_at {
            api.download_pinned(self.readback, at, self.ptrs[b], self.prog.buffers[b].bytes())
                .map_err(device_err(format!("reading back output buffer {}", self.prog.buffers[b].name)))?;
        }
        let back: usize = self.readback_at.iter().map(|&(b, _)| self.prog.buffers[b].bytes()).sum();
        Parts::cut(&mut parts, api, || Parts::copy("outputs back (pinned copy)", back))
    }

    /// What a finished run leaves: nothing stale, the outputs there, the updated inputs given.
    fn ran_once(&mut self) {
        self.stale = false;
        self.ran = true;
        for w in &self.plan.write_backs {
            self.given[w.to] = true;
        }
    }

    /// Runs the program on the inputs given: the hoisted steps when a frozen input changed, then
    /// the step's work (submitted directly the first time, captured as a graph the second and
    /// replayed from then on), and reads the outputs back.
    pub fn execute(&mut self) -> Result<(), RuntimeError> {
        self.check_given()?;
        let mut api =
            self.api.try_borrow_mut().map_err(|_| RuntimeError::Device { what: "run".into(), msg: "the GPU is in use".into() })?;
        if self.stale {
            for i in (0..self.steps.len()).filter(|&i| self.plan.hoisted[i]) {
                self.submit_step(&mut api, i)?;
            }
        }
        // The first run is submitted as it is, the graph captured from the second: a process's
        // first library calls (cuBLAS loading its kernels, first-call setup) then run outside a
        // capture, where anything a capture forbids is an error naming its call, not a broken
        // capture (what frameworks do too: warm up, then capture).
        // (a collective staged through the host cannot be captured: such a step runs without)
        let replay = self.target.cuda.graph() && !self.exchanges.host_staged(&self.prog) && (self.graph.is_some() || self.ran);
        if replay {
            let g = match self.graph {
                Some(g) => g,
                None => {
                    api.begin_capture().map_err(device_err("beginning the step's capture"))?;
                    let recorded = self.submit_run(&mut api, None);
                    // the capture is ended whatever happened, so the stream is usable again
                    let ended = api.end_capture().map_err(device_err("capturing the step as a CUDA graph"));
                    recorded?;
                    ended?
                }
            };
            api.replay(g).map_err(device_err("replaying the step's CUDA graph"))?;
            self.graph = Some(g);
        } else {
            self.submit_run(&mut api, None)?;
        }
        // waits for the step: an error of any kernel in it (an illegal address) surfaces here
        let (launches, calls) = self.per_step();
        let what = if replay {
            format!("the step ({launches} launches and {calls} GEMM calls in one CUDA graph; run without the graph to name the kernel)")
        } else {
            format!("the step ({launches} launches and {calls} GEMM calls)")
        };
        let back = api.pinned(self.readback).map_err(device_err(what))?;
        let n = self.outputs.len();
        self.outputs.copy_from_slice(&back[..n]);
        drop(api);
        self.ran_once();
        Ok(())
    }

    /// A non-update output of the last run, from the bytes read back.
    pub fn output(&self, name: &str) -> Result<Value<f32>, RuntimeError> {
        let missing = || RuntimeError::MissingOutput(name.to_string());
        let (_, v) = self.prog.outputs.iter().find(|(n, _)| n == name).ok_or_else(missing)?;
        if !self.ran {
            return Err(missing());
        }
        let &(b, at) = self.readback_at.iter().find(|(b, _)| *b == v.buf).ok_or_else(missing)?;
        let buf = &self.prog.buffers[b];
        read_view(buf, &self.outputs[at..at + buf.bytes()], v)
    }

    /// The whole of buffer `b` as it is on the device now (downloaded).
    pub fn read_buffer(&self, b: BufId) -> Result<Value<f32>, RuntimeError> {
        let buf = self.prog.buffers.get(b).ok_or_else(|| RuntimeError::Buffer { name: format!("#{b}"), msg: "no such buffer".into() })?;
        let mut bytes = vec![0u8; buf.bytes()];
        let mut api =
            self.api.try_borrow_mut().map_err(|_| RuntimeError::Device { what: "read".into(), msg: "the GPU is in use".into() })?;
        api.download(&mut bytes, self.ptrs[b]).map_err(device_err(format!("downloading {}", buf.name)))?;
        read_view(buf, &bytes, &View::contiguous(b, &buf.shape))
    }

    /// An input's current value, downloaded.
    pub fn read_input(&self, name: &str) -> Result<Value<f32>, RuntimeError> {
        let i = self.plan.input(name).ok_or_else(|| RuntimeError::UnknownInput(name.to_string()))?;
        if !self.given[i.buf] {
            return Err(RuntimeError::MissingInput(name.to_string()));
        }
        if i.kind == InputKind::Data {
            let place = self.plan.layout.places[i.buf];
            let mut api =
                self.api.try_borrow_mut().map_err(|_| RuntimeError::Device { what: "read".into(), msg: "the GPU is in use".into() })?;
            let st = api.pinned(self.staging).map_err(device_err(format!("reading input {name}")))?;
            let buf = &self.prog.buffers[i.buf];
            return read_view(buf, &st[place.offset..place.offset + place.bytes], &View::contiguous(i.buf, &buf.shape));
        }
        self.read_buffer(i.buf)
    }

    /// Runs as `CpuProgram::run` does: the given inputs set, one run, every output by name
    /// (updates under their input's name, read back). For tests and one-off runs.
    pub fn run(&mut self, inputs: &HashMap<String, Value<f32>>) -> Result<HashMap<String, Value<f32>>, RuntimeError> {
        for i in 0..self.plan.inputs.len() {
            if let Some(v) = inputs.get(&self.plan.inputs[i].name) {
                let name = self.plan.inputs[i].name.clone();
                self.set_input(&name, v)?;
            }
        }
        self.execute()?;
        let mut out = HashMap::new();
        for (name, _) in &self.prog.outputs {
            out.insert(name.clone(), self.output(name)?);
        }
        for (name, _) in &self.prog.updates {
            out.insert(name.clone(), self.read_input(name)?);
        }
        Ok(out)
    }
}

impl<A: GpuApi> Drop for CudaProgram<A> {
    fn drop(&mut self) {
        // errors cannot be returned here; a device that failed reported it where it failed
        let api = self.api.get_mut();
        for &p in &self.allocations {
            let _ = api.free(p);
        }
        let _ = api.free_pinned(self.staging);
        let _ = api.free_pinned(self.readback);
    }
}

impl<A: GpuApi + Send> TrainStep for CudaProgram<A> {
    fn set_input(&mut self, name: &str, v: &Value<f32>) -> Result<(), RuntimeError> {
        CudaProgram::set_input(self, name, v)
    }

    fn run(&mut self) -> Result<(), RuntimeError> {
        self.execute()
    }

    fn run_timed(&mut self) -> Result<Option<Vec<TimedPart>>, RuntimeError> {
        self.execute_timed().map(Some)
    }

    fn output_names(&self) -> Vec<String> {
        self.prog.output_names()
    }

    fn output(&self, name: &str) -> Result<Value<f32>, RuntimeError> {
        CudaProgram::output(self, name)
    }

    fn read_input(&self, name: &str) -> Result<Value<f32>, RuntimeError> {
        CudaProgram::read_input(self, name)
    }
}
