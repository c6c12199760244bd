//! [`CpuProgram`]: a lowered program run on the CPU. Its [`ExecPlan`] (the executor core's:
//! checks, lifetimes, hoisting, the memory layout, the updates' write-backs) is made once; the
//! memory is allocated once as the layout says (memory.rs), and every run executes the steps in
//! order on it (steps.rs), then writes the updates over their inputs.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use qatc_ir::{DType, InputKind};
use qatc_kernels::panels::{PanelReport, PanelTable};
use qatc_kernels::program::{BufId, Program, View};

use super::blas;
use super::gemm::GemmLibs;
use super::kir_eval::KirEval;
use super::memory::{Memory, ALIGN};
use super::onednn;
use super::options::CpuOptions;
use super::steps::{cpu_steps, feed_label, label, run_fed_timed, run_step, CpuStep};
use super::Launcher;
use crate::comm::{Communicator, OneRank};
use crate::error::RuntimeError;
use crate::exec::values::{read_view, write_input};
use crate::exec::{ExecOptions, ExecPlan, MemoryLayout, PartCost, Region, TimedPart, TrainStep};
use crate::value::Value;

/// A lowered program ready to run on the CPU: its buffers allocated once (aligned, zeroed, laid
/// out by its [`ExecPlan`]), the launches' arguments resolved and checked, kernels run by a
/// [`Launcher`], large GEMMs by the BLAS library [`CpuOptions::blas`] names when it loads, bf16
/// ones by oneDNN ([`CpuOptions::bf16_gemm`]) where the CPU has bf16 units.
pub struct CpuProgram {
    prog: Program,
    /// The GEMMs fed their operand b panel by panel (`prepare`), by step.
    panels: PanelTable,
    plan: ExecPlan,
    launcher: Box<dyn Launcher>,
    libs: GemmLibs,
    mem: Memory,
    steps: Vec<CpuStep>,
    /// Whether each buffer has been given a value (inputs only).
    given: Vec<bool>,
    /// Input buffers whose setting makes the hoisted steps run again.
    frozen: Vec<bool>,
    /// The hoisted steps' results are out of date.
    stale: bool,
    profile_by_kernel: bool,
    /// Who the step's collectives exchange with (the world of one unless given).
    comm: Arc<dyn Communicator>,
    /// Attention kernels whose products run on AMX tiles over the stored bf16 heads
    /// (`GemmAttention::on_amx`), for the build line.
    attention_on_amx: usize,
}

/// The CPU's own rewrites of a lowered program, before it is laid out (the program
/// [`CpuProgram::compile`] runs, and the one `qatc plan --device cpu` plans): 4-bit weights fed
/// to their GEMMs in dequantized panels ([`CpuOptions::panel_bytes`]), the fed GEMMs in the table
/// returned, which the executor and its plan take beside the program.
pub fn prepare(prog: &mut Program, cpu: &CpuOptions) -> (PanelTable, PanelReport) {
    qatc_kernels::panels::feed_panels(prog, cpu.panel_bytes)
}

impl CpuProgram {
    /// Plans `prog` (buffers sharing memory by lifetime, nothing hoisted), checks every step
    /// against its buffers and allocates them; `launcher` runs its kernels.
    pub fn new(prog: Program, launcher: Box<dyn Launcher>) -> Result<CpuProgram, RuntimeError> {
        CpuProgram::with_options(prog, launcher, ExecOptions::new(ALIGN), &CpuOptions::default())
    }

    /// `prog` with its kernels run by the kernel-IR evaluator ([`KirEval`]).
    pub fn with_kir_eval(prog: Program) -> Result<CpuProgram, RuntimeError> {
        let eval = KirEval::new(&prog.kernels);
        CpuProgram::new(prog, Box::new(eval))
    }

    /// [`CpuProgram::new`] planned as `exec` says ([`crate::exec::BufferLayout::Distinct`] keeps
    /// every buffer readable after a run; `hoist` runs the steps that read only frozen weights
    /// once), with the CPU settings `cpu` (its BLAS library, how profiles name steps).
    pub fn with_options(
        prog: Program,
        launcher: Box<dyn Launcher>,
        exec: ExecOptions,
        cpu: &CpuOptions,
    ) -> Result<CpuProgram, RuntimeError> {
        CpuProgram::with_panels(prog, PanelTable::default(), launcher, exec, cpu)
    }

    /// [`CpuProgram::with_options`] for a program whose GEMMs in `panels` are fed their operand b
    /// panel by panel (what [`prepare`] made of it).
    pub fn with_panels(
        prog: Program,
        panels: PanelTable,
        launcher: Box<dyn Launcher>,
        exec: ExecOptions,
        cpu: &CpuOptions,
    ) -> Result<CpuProgram, RuntimeError> {
        let plan = ExecPlan::with_panels(&prog, &panels, exec)?;
        let mem = Memory::new(&plan.layout)?;
        let steps = cpu_steps(&prog, &panels, &mem, rayon::current_num_threads().max(1));
        let nb = prog.buffers.len();
        let mut frozen = vec![false; nb];
        for i in plan.inputs.iter().filter(|i| i.kind == InputKind::Frozen && exec.hoist.any()) {
            frozen[i.buf] = true;
        }
        let blas = cpu.blas.as_deref().and_then(blas::load);
        // loaded only when a GEMM has bf16 operands
        let has_bf16 = prog.gemms().any(|g| g.types.a == DType::BF16 && g.types.b == DType::BF16);
        let bf16 = cpu.bf16_gemm.as_deref().filter(|_| has_bf16).and_then(onednn::load);
        Ok(CpuProgram {
            prog,
            panels,
            plan,
            launcher,
            libs: GemmLibs { blas, bf16 },
            mem,
            steps,
            given: vec![false; nb],
            frozen,
            stale: true,
            profile_by_kernel: cpu.profile_by_kernel,
            comm: Arc::new(OneRank),
            attention_on_amx: 0,
        })
    }

    /// This program with its collectives run through `comm` (this process's rank of a world the
    /// size the program was compiled for; a collective refuses any other size).
    pub fn with_communicator(mut self, comm: Arc<dyn Communicator>) -> CpuProgram {
        self.comm = comm;
        self
    }

    /// Compiles `prog` for this CPU as `qatc train` runs it: 4-bit weights fed to their GEMMs in
    /// dequantized panels ([`CpuOptions::panel_bytes`]), kernels JIT-compiled by LLVM, attention
    /// as GEMMs over blocks of query rows (unless [`CpuOptions::attention`] says otherwise), the
    /// steps that read only frozen weights hoisted. Returns what the panel rewrite did too.
    #[cfg(feature = "llvm")]
    pub fn compile(prog: Program, cpu: &CpuOptions) -> Result<(CpuProgram, PanelReport), RuntimeError> {
        let (p, report, _) = CpuProgram::compile_cached(prog, cpu, None)?;
        Ok((p, report))
    }

    /// [`CpuProgram::compile`] with the kernels' object code read from and kept in `cache`
    /// (kernels this process compiled before are never compiled again); returns where the
    /// kernels came from too.
    #[cfg(feature = "llvm")]
    pub fn compile_cached(
        mut prog: Program,
        cpu: &CpuOptions,
        cache: Option<&qatc_kernels::llvm::ObjectCache>,
    ) -> Result<(CpuProgram, PanelReport, qatc_kernels::llvm::JitReport), RuntimeError> {
        use qatc_kernels::llvm::{Jit, JitOptions};
        let (panels, report) = prepare(&mut prog, cpu);
        let jit = Jit::compile_cached(&prog.kernels, &JitOptions { vector_width: cpu.vector_width }, cache)
            .map_err(|e| RuntimeError::Compile(e.to_string()))?;
        let built = jit.report().clone();
        let (launcher, attention_on_amx): (Box<dyn Launcher>, usize) = match cpu.attention {
            super::CpuAttention::Gemm => {
                let a = super::GemmAttention::new(jit, &prog.kernels).with_onednn(cpu.bf16_gemm.as_deref().and_then(onednn::load));
                let on_amx = (0..prog.kernels.len()).filter(|&k| a.on_amx(k)).count();
                (Box::new(a), on_amx)
            }
            super::CpuAttention::Kernels => (Box::new(jit), 0),
        };
        let exec = ExecOptions::for_target(&qatc_kernels::Target::cpu());
        let mut cp = CpuProgram::with_panels(prog, panels, launcher, exec, cpu)?;
        cp.attention_on_amx = attention_on_amx;
        Ok((cp, report, built))
    }

    pub fn program(&self) -> &Program {
        &self.prog
    }

    /// The GEMMs fed panel by panel, by step (empty unless the program was [`prepare`]d).
    pub fn panels(&self) -> &PanelTable {
        &self.panels
    }

    /// The plan this program runs by: checks passed, lifetimes, hoisted steps, the layout.
    pub fn plan(&self) -> &ExecPlan {
        &self.plan
    }

    /// Where the buffers are, and how much each region holds.
    pub fn layout(&self) -> &MemoryLayout {
        &self.plan.layout
    }

    /// Bytes of memory its buffers hold, as allocated: the arena, the persistent inputs and the
    /// data inputs (what the layout says, unless a bug).
    pub fn held_bytes(&self) -> usize {
        self.mem.held_bytes()
    }

    /// The BLAS library the large GEMMs go to, if one loaded.
    pub fn blas_name(&self) -> Option<&str> {
        self.libs.blas.as_deref().map(|b| b.name.as_str())
    }

    /// The library the bf16 GEMMs go to, the units it runs them on ("AVX512-BF16", "AMX-BF16")
    /// and its path ("matmul primitive", "GEMM function"), if one loaded (only for a program
    /// with bf16 GEMMs, on a CPU with such units).
    pub fn bf16_gemm(&self) -> Option<(&str, &str, &str)> {
        self.libs.bf16.as_deref().map(|b| (b.name.as_str(), b.units, b.path()))
    }

    /// How many attention kernels multiply on AMX tiles over their stored bf16 heads.
    pub fn attention_on_amx(&self) -> usize {
        self.attention_on_amx
    }

    /// Where buffer `b` is in memory, measured from the addresses the steps are given: its region
    /// and its byte offset from the region's start (what the layout says, unless a bug).
    pub fn address_of(&self, b: BufId) -> Option<(Region, usize)> {
        let p = self.plan.layout.places.get(b)?;
        Some((p.region, (self.mem.ptr(b) as usize).wrapping_sub(self.mem.base(p.region) as usize)))
    }

    /// Copies a graph input's value into its buffer, where it stays for later runs: floats into
    /// f32 buffers (f16/bf16 ones rounded to nearest even), ints into i32, u8 and packed i4.
    pub fn set_input(&mut self, name: &str, v: &Value<f32>) -> Result<(), RuntimeError> {
        let b = self.plan.input(name).ok_or_else(|| RuntimeError::UnknownInput(name.to_string()))?.buf;
        write_input(&self.prog.buffers[b], self.mem.bytes_mut(b), v)?;
        self.given[b] = true;
        self.stale |= self.frozen[b];
        Ok(())
    }

    /// Runs the program, as `Interpreter::<f32>::run` runs the graph: copies in the given inputs
    /// (extra names are ignored; inputs given before, by `set_input` or an earlier run, stay),
    /// runs every step and returns every named output, update outputs under their input's name.
    pub fn run(&mut self, inputs: &HashMap<String, Value<f32>>) -> Result<HashMap<String, Value<f32>>, RuntimeError> {
        for i in 0..self.plan.inputs.len() {
            if let Some(v) = inputs.get(&self.plan.inputs[i].name) {
                let b = self.plan.inputs[i].buf;
                write_input(&self.prog.buffers[b], self.mem.bytes_mut(b), v)?;
                self.given[b] = true;
                self.stale |= self.frozen[b];
            }
        }
        self.execute()?;
        self.results()
    }

    fn check_given(&self) -> Result<(), RuntimeError> {
        match self.plan.inputs.iter().find(|i| i.needed && !self.given[i.buf]) {
            Some(i) => Err(RuntimeError::MissingInput(i.name.clone())),
            None => Ok(()),
        }
    }

    /// Runs the steps on the inputs already given, then writes every update over its input.
    pub fn execute(&mut self) -> Result<(), RuntimeError> {
        self.check_given()?;
        for i in 0..self.steps.len() {
            if !self.plan.hoisted[i] || self.stale {
                self.execute_step(i)?;
            }
        }
        self.stale = false;
        self.write_back()
    }

    /// The updates' write-backs: each update output copied over its input (memory to memory).
    fn write_back(&mut self) -> Result<(), RuntimeError> {
        for w in &self.plan.write_backs {
            self.mem.copy(w.from, w.from_offset, w.to, w.bytes)?;
            self.given[w.to] = true;
            self.stale |= self.frozen[w.to];
        }
        Ok(())
    }

    /// Runs step `i` alone (a launch or a GEMM) on whatever the buffers hold: the per-kernel
    /// differential test runs one step at a time on two launchers.
    pub fn execute_step(&mut self, i: usize) -> Result<(), RuntimeError> {
        let step = self.steps.get(i).ok_or_else(|| RuntimeError::Kernel { kernel: "-".into(), msg: format!("no step {i}") })?;
        // SAFETY: `cpu_steps` made the step over `self.mem` for this checked program (`with_panels`),
        // and `&mut self` keeps every other access away from the buffers.
        unsafe { run_step(step, &*self.launcher, &self.libs, &*self.comm, &self.mem) }
    }

    /// Runs the steps like `execute`, timing each: (what, seconds) per step in order, `what`
    /// being the kernel's family or `gemm MxNxK` (where a step's time goes: `qatc train --profile`).
    /// Costs are not counted here (the CPU's steps are its own rewrites of the program's).
    pub fn execute_timed(&mut self) -> Result<Vec<TimedPart>, RuntimeError> {
        self.check_given()?;
        let mut times = Vec::with_capacity(self.steps.len() + 1);
        for i in 0..self.steps.len() {
            if self.plan.hoisted[i] && !self.stale {
                continue;
            }
            let phase = match (self.prog.steps.get(i), self.plan.access.get(i)) {
                (Some(step), Some(a)) => crate::exec::step_phase(&self.prog, step, a),
                _ => None,
            };
            let what = label(&self.steps[i], &self.prog, self.profile_by_kernel);
            if let CpuStep::Fed(f) = &self.steps[i] {
                // the panels' computation and the GEMMs as two parts
                // SAFETY: as `execute_step`: made over `self.mem` for this checked program, and
                // `&mut self` keeps every other access away.
                let (feed, product) = unsafe { run_fed_timed(f, &*self.launcher, &self.libs, &self.mem)? };
                times.push(TimedPart { what: feed_label(f, &self.prog), secs: feed, cost: PartCost::default(), phase });
                times.push(TimedPart { what, secs: product, cost: PartCost::default(), phase });
                continue;
            }
            let t = Instant::now();
            self.execute_step(i)?;
            times.push(TimedPart { what, secs: t.elapsed().as_secs_f64(), cost: PartCost::default(), phase });
        }
        self.stale = false;
        let t = Instant::now();
        self.write_back()?;
        let what = "write-back of the updates".into();
        times.push(TimedPart { what, secs: t.elapsed().as_secs_f64(), cost: PartCost::default(), phase: None });
        Ok(times)
    }

    /// The raw bytes of buffer `b` (its size rounded up to the alignment). With the shared
    /// layout, after a run only inputs, outputs and hoisted results still hold their value:
    /// another buffer's bytes may since have been reused by a buffer that lives later.
    pub fn buffer_bytes(&self, b: usize) -> Option<&[u8]> {
        (b < self.prog.buffers.len()).then(|| self.mem.bytes(b))
    }

    /// Overwrites buffer `b` with `bytes` (its exact size), as if a step had written it. With the
    /// shared layout that also overwrites whatever buffers share its bytes: copying every buffer
    /// in needs [`crate::exec::BufferLayout::Distinct`].
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

    /// The whole of buffer `b`, as it is now.
    fn whole(&self, b: BufId) -> Result<Value<f32>, RuntimeError> {
        let buf = self.prog.buffers.get(b).ok_or_else(|| RuntimeError::Kernel { kernel: "-".into(), msg: format!("no buffer {b}") })?;
        read_view(buf, self.mem.bytes(b), &View::contiguous(b, &buf.shape))
    }

    /// Every output of the last run by name, each update under its input's name (read from the
    /// input, where the write-back put it), as the interpreter's `run` returns them. A name given
    /// to both an output and an update must hold one value.
    pub fn results(&self) -> Result<HashMap<String, Value<f32>>, RuntimeError> {
        let mut out: HashMap<String, Value<f32>> = HashMap::with_capacity(self.prog.outputs.len() + self.prog.updates.len());
        for (name, v) in &self.prog.outputs {
            out.insert(name.clone(), read_view(&self.prog.buffers[v.buf], self.mem.bytes(v.buf), v)?);
        }
        for (name, _) in &self.prog.updates {
            let val = self.read_input(name)?;
            match out.get(name) {
                Some(old) if *old != val => return Err(RuntimeError::OutputClash(name.clone())),
                _ => {
                    out.insert(name.clone(), val);
                }
            }
        }
        Ok(out)
    }

    /// The whole of buffer `b` after the last run (any buffer, not only outputs: the LLVM
    /// equivalence test compares every value a kernel wrote with the interpreter's). That needs
    /// [`crate::exec::BufferLayout::Distinct`]: shared, only inputs, outputs and hoisted results
    /// are sure to hold their value after a run (see `buffer_bytes`).
    pub fn buffer(&self, b: usize) -> Result<Value<f32>, RuntimeError> {
        self.whole(b)
    }
}

impl TrainStep for CpuProgram {
    fn set_input(&mut self, name: &str, v: &Value<f32>) -> Result<(), RuntimeError> {
        CpuProgram::set_input(self, name, v)
    }

    fn run(&mut self) -> Result<(), RuntimeError> {
        self.execute()
    }

    fn output_names(&self) -> Vec<String> {
        self.prog.output_names()
    }

    fn output(&self, name: &str) -> Result<Value<f32>, RuntimeError> {
        let (_, v) = self.prog.outputs.iter().find(|(n, _)| n == name).ok_or_else(|| RuntimeError::MissingOutput(name.to_string()))?;
        read_view(&self.prog.buffers[v.buf], self.mem.bytes(v.buf), v)
    }

    fn read_input(&self, name: &str) -> Result<Value<f32>, RuntimeError> {
        let i = self.plan.input(name).ok_or_else(|| RuntimeError::UnknownInput(name.to_string()))?;
        self.whole(i.buf)
    }

    fn run_timed(&mut self) -> Result<Option<Vec<TimedPart>>, RuntimeError> {
        self.execute_timed().map(Some)
    }
}
