//! The memory plan a user reads (`qatc plan`, `qatc compile`'s `memory_plan.json` and
//! `memory.svg`, `qatc train`'s memory line, `qatc plan --fit`): the executed program's. The
//! step graph (fused, checkpointed) is lowered to the program the device runs, rewritten as that
//! device's executor rewrites it (GEMM panels on the CPU), and laid out by the executor core's
//! own layout function with the device's parameters (`qatc_runtime::exec::Device`). The buffers
//! listed are the buffers the executor allocates, at the same offsets.
//!
//! - [`json`]: the plan as JSON (schema `qatc.memory_plan`, version 2, `docs/memory_plan.md`);
//! - [`svg`]: its timeline as a picture;
//! - [`fit`]: `--fit`, the fastest configurations that fit a memory size;
//! - [`chunk`]: the rows per chunk of the chunked linear + cross-entropy, chosen here.
//!
//! The graph-level planner (`qatc_passes::plan`) stays the `remat` pass's model for its search
//! over checkpoint policies; nothing a user sees comes from it.

pub mod chunk;
pub mod fit;
pub mod json;
pub mod svg;

use anyhow::Context;
use qatc_ir::{Graph, Phase, Roles};
use qatc_kernels::{LowerOptions, Program};
use qatc_passes::plan::cost::node_flops;
use qatc_runtime::exec::{Device, ExecPlan, MemoryPlan};
use qatc_runtime::CpuOptions;

/// A step as a device's executor would run it, and what it holds.
pub struct Executed {
    pub device: Device,
    /// The lowered program after the device's rewrites.
    pub program: Program,
    pub exec: ExecPlan,
    pub plan: MemoryPlan,
    /// FLOPs of the whole step (every node of the graph, a fused kernel its body's), and of the
    /// values recomputed in the backward (`remat`).
    pub total_flops: u64,
    pub recompute_flops: u64,
    pub recomputed_nodes: usize,
    /// The rows per chunk of the chunked cross-entropy, and why (`chunk`).
    pub chunk: Option<chunk::ChunkChoice>,
}

/// What the lowering must know of `device`'s executor (the schedule and the chunk size aside):
/// whether it runs a row on one thread in order, whether its attention kernels read and write the
/// stored 16-bit type.
pub fn lower_options(device: Device) -> LowerOptions {
    LowerOptions {
        sequential_rows: device.sequential_rows(),
        attention_reads_stored: device.attention_reads_stored(),
        ..Default::default()
    }
}

/// The program a step graph runs as on `device`, before that device's rewrites: lowered in the
/// order of the graph-level planner's memory-aware schedule (`qatc_passes::plan`), so that a
/// value runs when the schedule says (a recomputed one just before the backward step that reads
/// it, a weight gradient's GEMM as soon as it can) and the executor holds what that schedule
/// holds; the chunked cross-entropy's rows per chunk chosen by [`chunk::choose`].
pub fn lower_step(g: &Graph, device: Device, cpu: &CpuOptions) -> anyhow::Result<(Program, Option<chunk::ChunkChoice>)> {
    let schedule = qatc_passes::plan::schedule(g).context("scheduling the step")?;
    chunk::choose(g, &schedule, device, cpu)
}

/// The CPU executor of step graph `g`, as `qatc train` runs it: the program [`execute_plan`]
/// plans for the CPU, compiled (the executor applies the same rewrites and the same layout).
#[cfg(feature = "llvm")]
pub fn compile_cpu(g: &Graph, cpu: &CpuOptions) -> anyhow::Result<(qatc_runtime::CpuProgram, qatc_kernels::panels::PanelReport)> {
    let (prog, _) = lower_step(g, Device::Cpu, cpu)?;
    Ok(qatc_runtime::CpuProgram::compile(prog, cpu)?)
}

/// The program the CUDA executor of step graph `g` runs, as `qatc train --device cuda` builds it:
/// the program [`execute_plan`] plans for CUDA (the same schedule and chunk size), so the device
/// holds what `qatc plan --device cuda` says.
pub fn lower_cuda(g: &Graph) -> anyhow::Result<Program> {
    Ok(lower_step(g, Device::Cuda, &CpuOptions::default())?.0)
}

/// The bytes of a device of `memory` bytes (`--memory`) that a step's plan may use on `device`:
/// all of them on the CPU; on CUDA what the context and the BLAS workspace leave
/// (`Device::reserved_bytes`). Every check of a plan against `--memory` goes through here.
pub fn step_budget(memory: usize, device: Device) -> usize {
    memory.saturating_sub(device.reserved_bytes())
}

/// Lowers `g` for `device` and lays it out as that device's executor does. `cpu` are the CPU
/// executor's settings (its panel size changes the program).
pub fn execute_plan(g: &Graph, device: Device, cpu: &CpuOptions) -> anyhow::Result<Executed> {
    let (mut program, chunk) = lower_step(g, device, cpu)?;
    if device == Device::Cpu {
        qatc_runtime::cpu::prepare(&mut program, cpu);
    }
    let exec = ExecPlan::new(&program, device.exec_options()).context("planning the program's execution")?;
    let plan = MemoryPlan::new(&program, &exec);
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
    Ok(Executed { device, program, exec, plan, total_flops, recompute_flops, recomputed_nodes, chunk })
}

/// One line on a chunked cross-entropy, for the table and the picture.
pub fn chunking_line(c: &qatc_kernels::program::CeChunking) -> String {
    let whole = qatc_passes::plan::units::human(c.whole_bytes());
    let scratch = qatc_passes::plan::units::human(c.scratch_bytes());
    if c.tile_cols < c.vocab {
        return format!(
            "cross-entropy over {} x {} logits in {} chunk(s) of {} rows x tiles of {} columns (online softmax): one {scratch} tile, never the whole {whole}",
            c.rows,
            c.vocab,
            c.chunks(),
            c.chunk_rows,
            c.tile_cols
        );
    }
    if c.chunks() == 1 {
        return format!(
            "cross-entropy over {} x {} logits in one chunk of {} rows: the whole {whole} at once",
            c.rows, c.vocab, c.chunk_rows
        );
    }
    format!(
        "cross-entropy over {} x {} logits in {} chunks of {} rows: one {scratch} chunk, never the whole {whole}",
        c.rows,
        c.vocab,
        c.chunks(),
        c.chunk_rows
    )
}

/// What each cross-entropy over the vocabulary computes its logits in: rows, vocabulary, rows
/// per chunk and the chunk scratch (`Program::cross_entropy`), and the planner's choice of rows
/// per chunk (`chunk`: the floor, every size planned with its peak, why).
pub fn chunking(e: &Executed) -> Vec<serde_json::Value> {
    e.program
        .cross_entropy
        .iter()
        .map(|c| {
            let choice = e.chunk.as_ref().map(|k| {
                let tried: Vec<serde_json::Value> =
                    k.tried.iter().map(|&(rows, peak)| serde_json::json!({ "chunk_rows": rows, "peak_bytes": peak })).collect();
                serde_json::json!({ "floor": k.floor, "tried": tried, "why": k.why })
            });
            serde_json::json!({
                "rows": c.rows, "vocab": c.vocab, "chunk_rows": c.chunk_rows, "tile_cols": c.tile_cols, "chunks": c.chunks(),
                "scratch_bytes": c.scratch_bytes(), "chosen": choice,
            })
        })
        .collect()
}
