//! The executed memory plan: what an executor holds while it runs a program, read off the
//! program's buffers (each tagged with its role at lowering time, `qatc_ir::role`) and the
//! [`ExecPlan`]'s layout (the very offsets the executor allocates). `qatc plan`, `qatc compile`
//! (`memory_plan.json`, `memory.svg`) and `qatc train`'s memory line all show this, never an
//! estimate of another program.
//!
//! Time is the program's steps, plus one last step that stands for the updates' write-backs (as
//! in the lifetimes). At each step the arena holds the buffers live then; the most it ever holds
//! is the lower bound of any layout, and the arena the layout reserves is at least that. The
//! peak is what the executor allocates: the arena, the persistent inputs and the data inputs.

use qatc_ir::{Category, Phase};
use qatc_kernels::program::{BufKind, Program, Step};
use serde::Serialize;

use super::layout::{Live, Region};
use super::plan::ExecPlan;

/// One buffer as the plan shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PlannedBuffer {
    pub id: usize,
    pub name: String,
    pub category: Category,
    /// The phase of the node whose value it holds (a scratch buffer: of the step using it).
    pub phase: Phase,
    pub region: Region,
    /// Bytes of its elements, and bytes reserved (aligned).
    pub bytes: usize,
    pub size: usize,
    pub offset: usize,
    /// First and last step it is live in (inclusive); inputs and whole-run buffers span them all.
    pub first_step: usize,
    pub last_step: usize,
    /// `input`, `value` (a graph node's) or `temp` (a step's scratch).
    pub kind: &'static str,
}

/// One step of the program (or the write-back step at the end).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PlannedStep {
    pub index: usize,
    /// The kernel's family, `gemm MxNxK`, or `write-back`.
    pub what: String,
    pub phase: Phase,
    /// Floating-point operations of a GEMM (kernels: 0, not counted).
    pub flops: u64,
    /// Runs once, not every step (it reads only frozen weights).
    pub hoisted: bool,
    /// Arena bytes live during it.
    pub live_bytes: usize,
}

/// What an executor holds, buffer by buffer and step by step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemoryPlan {
    pub align: usize,
    pub buffers: Vec<PlannedBuffer>,
    pub steps: Vec<PlannedStep>,
    pub arena_bytes: usize,
    pub persistent_bytes: usize,
    pub data_bytes: usize,
    /// The most arena bytes live at one step: no layout of this program can use less arena.
    pub lower_bound: usize,
    /// The step where it is reached.
    pub peak_step: usize,
    /// The first backward (or recompute) step, if the program has one.
    pub backward_starts: Option<usize>,
    /// Input bytes by category (indexed as `Category::ALL`; aligned sizes, as allocated).
    pub inputs: [usize; 7],
    /// Arena bytes live at each step, by category.
    pub profile: Vec<[usize; 7]>,
}

impl MemoryPlan {
    /// The plan of `prog` as `exec` lays it out.
    pub fn new(prog: &Program, exec: &ExecPlan) -> MemoryPlan {
        let l = &exec.layout;
        let nsteps = prog.steps.len() + 1;
        let end = nsteps - 1;
        let mut inputs = [0usize; 7];
        let mut diff = vec![[0i64; 7]; nsteps + 1];
        let mut buffers = Vec::with_capacity(prog.buffers.len());
        for (b, buf) in prog.buffers.iter().enumerate() {
            let place = l.places[b];
            let (first, last) = match exec.lifetimes[b] {
                Live::Steps(f, t) => (f, t),
                Live::Input | Live::Whole => (0, end),
                Live::Never => (0, 0),
            };
            let c = buf.role.category;
            match (&buf.kind, exec.lifetimes[b]) {
                (BufKind::Input(..), _) => inputs[c.index()] += place.bytes,
                (_, Live::Never) => {}
                _ => {
                    diff[first][c.index()] += place.bytes as i64;
                    diff[last + 1][c.index()] -= place.bytes as i64;
                }
            }
            buffers.push(PlannedBuffer {
                id: b,
                name: buf.name.clone(),
                category: c,
                phase: buf.role.phase,
                region: place.region,
                bytes: buf.bytes(),
                size: place.bytes,
                offset: place.offset,
                first_step: first,
                last_step: last,
                kind: match buf.kind {
                    BufKind::Input(..) => "input",
                    BufKind::Value => "value",
                    BufKind::Temp => "temp",
                },
            });
        }
        let mut profile = Vec::with_capacity(nsteps);
        let mut acc = [0i64; 7];
        for row in diff.iter().take(nsteps) {
            let mut out = [0usize; 7];
            for k in 0..7 {
                acc[k] += row[k];
                out[k] = acc[k].max(0) as usize;
            }
            profile.push(out);
        }
        let live: Vec<usize> = profile.iter().map(|r| r.iter().sum()).collect();
        // the first step where the most is live
        let peak_step = live.iter().enumerate().fold(0, |best, (s, &v)| if v > live[best] { s } else { best });
        let mut steps = Vec::with_capacity(nsteps);
        for (i, step) in prog.steps.iter().enumerate() {
            // the phase a profile gives the step (one rule: `step_phase`); a step writing only
            // inputs updates them
            let phase = super::step_phase(prog, step, &exec.access[i]).unwrap_or(Phase::Optimizer);
            let (what, flops) = match step {
                Step::Launch { kernel, .. } => (prog.kernels.get(*kernel).map_or("?".into(), |k| k.family.clone()), 0),
                Step::Gemm(g) => (format!("gemm {}x{}x{}", g.m, g.n, g.k), g.flops() as u64),
                Step::Collective(c) => (c.exchange.mnemonic().to_string(), 0),
            };
            steps.push(PlannedStep { index: i, what, phase, flops, hoisted: exec.hoisted[i], live_bytes: live[i] });
        }
        steps.push(PlannedStep {
            index: end,
            what: "write-back".into(),
            phase: Phase::Optimizer,
            flops: 0,
            hoisted: false,
            live_bytes: live[end],
        });
        let backward_starts = steps.iter().position(|s| matches!(s.phase, Phase::Backward | Phase::Recompute));
        MemoryPlan {
            align: l.align,
            buffers,
            steps,
            arena_bytes: l.arena_bytes,
            persistent_bytes: l.persistent_bytes,
            data_bytes: l.data_bytes,
            lower_bound: l.lower_bound,
            peak_step,
            backward_starts,
            inputs,
            profile,
        }
    }

    /// What the executor allocates: the arena, the persistent inputs and the data inputs.
    pub fn peak_bytes(&self) -> usize {
        self.arena_bytes + self.persistent_bytes + self.data_bytes
    }

    /// The inputs' bytes (persistent and data).
    pub fn input_bytes(&self) -> usize {
        self.persistent_bytes + self.data_bytes
    }

    /// The arena over the least any layout could use (1.0 is optimal).
    pub fn ratio(&self) -> f64 {
        if self.lower_bound == 0 {
            1.0
        } else {
            self.arena_bytes as f64 / self.lower_bound as f64
        }
    }

    /// Bytes of `c` at the peak: an input category's storage, an arena category's bytes live at
    /// the peak step.
    pub fn at_peak(&self, c: Category) -> usize {
        if c.persistent() {
            self.inputs[c.index()]
        } else {
            self.profile.get(self.peak_step).map_or(0, |r| r[c.index()])
        }
    }

    /// The most bytes of `c` at any step.
    pub fn max_of(&self, c: Category) -> usize {
        if c.persistent() {
            self.inputs[c.index()]
        } else {
            self.profile.iter().map(|r| r[c.index()]).max().unwrap_or(0)
        }
    }

    /// The arena's bytes no buffer uses at the peak step.
    pub fn fragmentation(&self) -> usize {
        self.arena_bytes.saturating_sub(self.lower_bound)
    }

    /// FLOPs of the GEMM steps run every step.
    pub fn gemm_flops(&self) -> u64 {
        self.steps.iter().filter(|s| !s.hoisted).map(|s| s.flops).sum()
    }
}
