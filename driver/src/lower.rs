//! A step graph lowered for a target, and the memory plan of what its executor holds: the
//! program the executor runs, laid out by the executor core's own layout function with the
//! target's parameters, so the buffers `qatc plan` lists are the ones the executor allocates, at
//! the same offsets.

use qatc_ir::{Graph, Phase, Roles};
use qatc_kernels::panels::PanelTable;
use qatc_kernels::{Program, Target, TargetKind};
use qatc_passes::plan::cost::node_flops;
use qatc_runtime::exec::{ExecOptions, ExecPlan, MemoryPlan};

use crate::chunk::{self, ChunkChoice};
use crate::{DriverError, Options};

/// A step lowered for a target, before the target's own rewrites.
pub struct Lowered {
    pub program: Program,
    /// The rows per chunk of the chunked cross-entropy, and why (`chunk`).
    pub chunk: Option<ChunkChoice>,
}

/// The program step graph `g` runs as on `target`, before that target's rewrites: lowered in the
/// order of the graph-level planner's memory-aware schedule (`qatc_passes::plan`), so that a
/// value runs when the schedule says (a recomputed one just before the backward step that reads
/// it, a weight gradient's GEMM as soon as it can) and the executor holds what that schedule
/// holds; the chunked cross-entropy's rows per chunk chosen by [`chunk::choose`].
pub fn lower(g: &Graph, target: &Target, options: &Options) -> Result<Lowered, DriverError> {
    lower_laid_out(g, target, options).map(|(lowered, _)| lowered)
}

/// [`lower`], and the chosen program as its target lays it out (which choosing the chunk size
/// already did: [`plan`] keeps it rather than laying the program out again).
fn lower_laid_out(g: &Graph, target: &Target, options: &Options) -> Result<(Lowered, LaidOut), DriverError> {
    let schedule = qatc_passes::plan::schedule(g)?;
    let (program, chunk, laid) = chunk::choose(g, &schedule, target, options)?;
    Ok((Lowered { program, chunk }, laid))
}

/// The target's own rewrites of a lowered program, before it is laid out (what its executor
/// runs): on the CPU, 4-bit weights fed to their GEMMs in dequantized panels, those GEMMs in the
/// table returned; none on CUDA (an empty table).
pub fn prepare(program: &mut Program, target: &Target, options: &Options) -> PanelTable {
    match target.kind {
        TargetKind::Cpu => qatc_runtime::cpu::prepare(program, &options.cpu).0,
        TargetKind::Cuda => PanelTable::default(),
    }
}

/// A lowered program after the target's rewrites, laid out as its executor lays it out.
pub(crate) struct LaidOut {
    pub program: Program,
    pub panels: PanelTable,
    pub exec: ExecPlan,
    pub plan: MemoryPlan,
}

/// `program` with the target's rewrites applied, laid out (its executed plan's peak:
/// `.plan.peak_bytes()`).
pub(crate) fn lay_out(program: &Program, target: &Target, options: &Options) -> Result<LaidOut, DriverError> {
    let mut program = program.clone();
    let panels = prepare(&mut program, target, options);
    let exec = ExecPlan::with_panels(&program, &panels, ExecOptions::for_target(target))?;
    let plan = MemoryPlan::new(&program, &exec);
    Ok(LaidOut { program, panels, exec, plan })
}

/// A step as a target's executor would run it, and what it holds.
pub struct Executed {
    pub target: Target,
    /// The lowered program after the target's rewrites.
    pub program: Program,
    /// The GEMMs the CPU executor feeds panel by panel (empty on CUDA).
    pub panels: PanelTable,
    pub exec: ExecPlan,
    pub plan: MemoryPlan,
    /// FLOPs of the whole step (every node of the graph, a fused kernel its body's), and of the
    /// values recomputed in the backward (`remat`).
    pub total_flops: u64,
    pub recompute_flops: u64,
    pub recomputed_nodes: usize,
    /// The rows per chunk of the chunked cross-entropy, and why (`chunk`).
    pub chunk: Option<ChunkChoice>,
}

/// Lowers `g` for `target` and lays it out as that target's executor does (`options.cpu`: the
/// CPU executor's settings, whose panel size changes the program).
///
/// A step with collectives (`--ranks`) is one rank's program: each collective a step of its own
/// (`qatc_kernels::program::Collective`) that receives into a buffer of its result.
pub fn plan(g: &Graph, target: &Target, options: &Options) -> Result<Executed, DriverError> {
    let (Lowered { chunk, .. }, LaidOut { program, panels, exec, plan }) = lower_laid_out(g, target, options)?;
    let roles = Roles::of(g);
    let (mut total_flops, mut recompute_flops, mut recomputed_nodes) = (0u64, 0u64, 0usize);
    for n in g.node_ids() {
        let f = node_flops(g, n);
        total_flops += f;
        if roles.phase(g, n) == Phase::Recompute {
            recompute_flops += f;
            recomputed_nodes += 1;
        }
    }
    Ok(Executed { target: *target, program, panels, exec, plan, total_flops, recompute_flops, recomputed_nodes, chunk })
}
