//! What runs a step, in one line: the device, its kernels, and what it holds against the
//! executor's plan (`ExecPlan`'s layout, which `qatc plan` prints too).

use qatc_runtime::cuda::{CudaDriver, CudaProgram};

/// One line: the GPU, what the step is there, and what it holds on the device against the
/// executor's plan (`ExecPlan`'s layout, which `qatc plan` prints too).
pub fn cuda(p: &CudaProgram<CudaDriver>) -> String {
    let human = qatc_passes::plan::units::human;
    let d = p.device();
    let (launches, calls) = p.per_step();
    let b = p.bytes();
    let l = p.layout();
    let o = p.target();
    format!(
        "on CUDA: {} ({}, {} SMs, {}; {}): {} kernels, {launches} launches and {calls} cuBLAS calls per step{}{}, {} steps hoisted (run once), GEMMs {}; device memory {}: arena {} (the plan: {} of buffers, at least {} live at once), persistent {}, data {}, GEMM scratch {}; pinned {}; the device reports {} in use ({} beyond the step's: the CUDA context, modules and BLAS workspace, for which a plan keeps {})",
        d.name,
        d.arch,
        d.multiprocessors,
        human(d.total_memory),
        d.libraries,
        p.distinct_kernels(),
        if o.cuda.graph() && !p.host_staged() { " replayed as one CUDA graph" } else { "" },
        p.collectives().map(|c| format!(", {c}")).unwrap_or_default(),
        p.plan().hoisted_steps(),
        if o.cuda.tf32 { "TF32" } else { "strict fp32" },
        human(b.device_total()),
        human(b.arena),
        human(l.placed_bytes),
        human(l.lower_bound),
        human(b.persistent),
        human(b.data),
        human(b.scratch),
        human(b.pinned),
        human(b.device_used),
        human(b.device_used.saturating_sub(b.device_total())),
        human(o.reserved_bytes)
    )
}

/// One line: what the compiled step is and the memory it holds (where its kernels came from is
/// the executable's `KernelsBuilt`).
#[cfg(feature = "llvm")]
pub fn compiled(p: &qatc_runtime::CpuProgram, panels: &qatc_kernels::panels::PanelReport) -> String {
    let human = qatc_passes::plan::units::human;
    let prog = p.program();
    let fed = if panels.lines.is_empty() {
        String::new()
    } else {
        format!(
            ", {} weights computed into GEMM panels as the GEMMs read them (dequantized or cast; {} of copies never made)",
            panels.lines.len(),
            human(panels.bytes_saved)
        )
    };
    let mut gemms = match p.blas_name() {
        Some(b) => format!("large ones by OpenBLAS ({b})"),
        None => "by the gemm crate".into(),
    };
    let bf16 = prog.gemms().any(|g| g.types.a == qatc_ir::DType::BF16 && g.types.b == qatc_ir::DType::BF16);
    match p.bf16_gemm() {
        Some((lib, units, path)) => {
            gemms += &format!("; bf16 ones by oneDNN's {path} on {units} ({lib})");
            if p.attention_on_amx() > 0 {
                gemms += ", the attention's too";
            }
        }
        None if bf16 => gemms += "; bf16 ones widened to f32 (no bf16 units or no oneDNN)",
        None => {}
    }
    // what the plan says (the executed plan is this program's layout) against what the executor
    // allocated
    let plan = qatc_runtime::exec::MemoryPlan::new(prog, p.plan());
    format!(
        "compiled for this CPU: {} LLVM kernels, {} launches and {} GEMMs per step ({gemms}), {} threads{fed}; memory: planned peak {} (arena {}, at least {} live at once; inputs {}), held {}",
        prog.kernels.len(),
        prog.launches(),
        prog.gemms().count(),
        rayon::current_num_threads(),
        human(plan.peak_bytes()),
        human(plan.arena_bytes),
        human(plan.lower_bound),
        human(plan.input_bytes()),
        human(p.held_bytes())
    )
}
