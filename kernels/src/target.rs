//! [`Target`]: what a device is and can do, the one description that the lowering, the memory
//! layout, the code generators and the executors read. A step is compiled for a target
//! (`qatc_driver::compile`); nothing below the CLI asks which device it is on by any other
//! means.
//!
//! ```text
//!                 lowering                  layout (exec core)     code            executor
//! Target::cpu()   rows on one thread,       align 64, hoist        LLVM for the    CpuProgram
//!                 one attention backward    everything frozen      host CPU
//! Target::cuda()  rows shared by threads,   align 256, hoist       CUDA C for      CudaProgram
//!                 a kernel per gradient     what shrinks           `arch`, NVRTC   (tf32, graph)
//! ```

use serde::{Deserialize, Serialize};

use crate::cuda::codegen::{Variant, Variants};
use crate::nvrtc::Arch;

/// A cache line: every CPU buffer starts on one (vector loads never split a line).
pub const CPU_ALIGN: usize = 64;

/// cudaMalloc's alignment, which every CUDA buffer keeps (any element type's loads, and
/// word-wide 4-bit stores).
pub const CUDA_ALIGN: usize = 256;

/// What the CUDA context holds on the device before the executor allocates anything: the
/// driver's and runtime's state, the kernel modules (qatc's CUBINs are a few MiB) and cuBLAS's
/// own buffers. An estimate: about 500 MiB on an H100 with CUDA 12-13 (NVIDIA's figure varies
/// with the driver, lazy module loading and the libraries loaded); `bench/gpu.sh fit` reads the
/// device's use beside the plan (`DeviceBytes::device_used`), which is where to correct it.
pub const CUDA_CONTEXT_BYTES: usize = 512 << 20;

/// The kind of device a target is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TargetKind {
    Cpu,
    Cuda,
}

impl TargetKind {
    pub fn name(self) -> &'static str {
        match self {
            TargetKind::Cpu => "cpu",
            TargetKind::Cuda => "cuda",
        }
    }
}

impl std::fmt::Display for TargetKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Which of the steps that read only frozen weights run once, not every step (the layout keeps
/// their results for the run).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Hoist {
    /// None: each runs every step (only steps that read nothing at all run once).
    Nothing,
    /// Those that write no more bytes than they read (a cast of a frozen f32 weight to bf16,
    /// every step the same, is kept; a 4-bit weight's dequantization, four times its codes' bytes
    /// in bf16, is not: holding it for the run is what storing 4 bits avoids). CUDA's.
    Shrinking,
    /// Every one (the CPU's: its GEMMs dequantize panel by panel, so nothing large is hoisted).
    Everything,
}

impl Hoist {
    /// Whether any frozen input may be read by a hoisted step.
    pub fn any(self) -> bool {
        self != Hoist::Nothing
    }
}

/// How a step runs on a GPU (`qatc train --tf32`, `--no-cuda-graph`, `--general-kernels`,
/// `--no-variant`): read by the CUDA writer (which fast variants it may pick), the GEMM planner
/// (TF32) and the CUDA executor (graph replay). Saved in the run's `qatc.json` (`step.cuda`),
/// since TF32 changes the numbers and the others what runs: a resumed run keeps them (a file from
/// before they were saved reads as all off).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CudaSettings {
    /// fp32 GEMMs on TF32 tensor cores instead of strict IEEE fp32.
    pub tf32: bool,
    /// Submit every launch on every step, each waited for, instead of replaying the step as one
    /// CUDA graph (slower; an asynchronous error then names its kernel).
    pub no_graph: bool,
    /// The general kernels only: none of the writer's fast variants, to rule one out when a step
    /// on the GPU goes wrong.
    pub general_kernels: bool,
    /// These variants off, the others as chosen (`--no-variant`; absent when none).
    #[serde(skip_serializing_if = "Variants::is_empty")]
    pub no_variants: Variants,
}

impl CudaSettings {
    /// The general kernels only (`--general-kernels`).
    pub const GENERAL: CudaSettings = CudaSettings { tf32: false, no_graph: false, general_kernels: true, no_variants: Variants::EMPTY };

    /// Whether the CUDA writer may write a kernel as `v` where that variant applies.
    pub fn allows(&self, v: Variant) -> bool {
        !self.general_kernels && !self.no_variants.contains(v)
    }

    /// These settings with `v` off too.
    pub fn without(mut self, v: Variant) -> CudaSettings {
        self.no_variants = self.no_variants.iter().chain([v]).collect();
        self
    }

    /// Whether the step is captured once as a CUDA graph and replayed.
    pub fn graph(&self) -> bool {
        !self.no_graph
    }
}

/// A device a step is compiled for, and what its executor does with a program: everything the
/// compiler must know of it, in one value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    pub kind: TargetKind,
    /// CUDA: the architecture the kernels are built for (None: the GPU's own, asked of the
    /// driver when the step is built). The CPU: None (LLVM compiles for the host it runs on).
    pub arch: Option<Arch>,
    /// Every buffer's offset and size in its region is a multiple of this many bytes.
    pub align: usize,
    /// The executor runs each row of a row kernel on one thread, its statements in order (the
    /// CPU's LLVM kernels: rows split over threads, a row's loops one after another), rather than
    /// a block or warp of threads sharing a row (CUDA): the lowering may then rewrite a row
    /// between its passes (`LowerOptions::sequential_rows`).
    pub sequential_rows: bool,
    /// A layer's three attention gradients come from one kernel (the CPU's attention GEMMs, which
    /// compute the probabilities once per query block for all three) rather than one kernel each
    /// (`LowerOptions::attention_one_backward`).
    pub attention_one_backward: bool,
    /// Which frozen steps run once.
    pub hoist: Hoist,
    /// The device's memory in bytes, where known (a GPU's, as its driver reports it).
    pub memory: Option<usize>,
    /// What a process running a step holds on the device outside the executor's planned
    /// allocations, so a plan for a device of some size (`--memory`) must leave it free: nothing
    /// on the CPU (the host's other memory is not the step's to plan); on CUDA the context and
    /// the BLAS workspace.
    pub reserved_bytes: usize,
    /// GPU settings (all off on the CPU).
    pub cuda: CudaSettings,
}

impl Target {
    /// The host CPU: LLVM kernels, rows on one thread, three allocations at a cache line's
    /// alignment, every frozen step hoisted (its GEMMs dequantize panel by panel).
    pub fn cpu() -> Target {
        Target {
            kind: TargetKind::Cpu,
            arch: None,
            align: CPU_ALIGN,
            sequential_rows: true,
            attention_one_backward: true,
            hoist: Hoist::Everything,
            memory: None,
            reserved_bytes: 0,
            cuda: CudaSettings::default(),
        }
    }

    /// A CUDA GPU of `arch` (None: the GPU's own) run with `settings`: three allocations at
    /// cudaMalloc's alignment, only the frozen steps that shrink what they read hoisted (a
    /// 4-bit weight stays 4-bit, dequantized around its GEMMs).
    pub fn cuda(arch: Option<Arch>, settings: CudaSettings) -> Target {
        Target {
            kind: TargetKind::Cuda,
            arch,
            align: CUDA_ALIGN,
            sequential_rows: false,
            attention_one_backward: false,
            hoist: Hoist::Shrinking,
            memory: None,
            reserved_bytes: CUDA_CONTEXT_BYTES + crate::cuda::blas::WORKSPACE_BYTES,
            cuda: settings,
        }
    }

    /// The target of `kind` with default settings.
    pub fn of(kind: TargetKind) -> Target {
        match kind {
            TargetKind::Cpu => Target::cpu(),
            TargetKind::Cuda => Target::cuda(None, CudaSettings::default()),
        }
    }

    pub fn is_cuda(&self) -> bool {
        self.kind == TargetKind::Cuda
    }

    /// The bytes of a device of `memory` bytes (`--memory`) that a step's plan may use here: what
    /// the reserve leaves. Every check of a plan against `--memory` goes through here.
    pub fn step_budget(&self, memory: usize) -> usize {
        memory.saturating_sub(self.reserved_bytes)
    }

    /// What the lowering must know of this target (the schedule and the chunk size aside).
    pub fn lower_options(&self) -> crate::LowerOptions {
        crate::LowerOptions {
            sequential_rows: self.sequential_rows,
            // every target's attention kernels read q, k, v and dout in their buffers' type and
            // write their result in it, rounded once at the store (CUDA's templates, the CPU's
            // LLVM kernels and attention GEMMs), rather than f32 copies of whole tensors
            attention_reads_stored: true,
            attention_one_backward: self.attention_one_backward,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The settings' file format is a run's `qatc.json`: a file from before the settings were
    /// saved (no `cuda` object, or an empty one) reads as all off, and the variants by name.
    #[test]
    fn cuda_settings_read_as_saved() {
        let s: CudaSettings = serde_json::from_str(r#"{"tf32": true, "no_variants": ["warp-rows"]}"#).expect("reads");
        assert!(s.tf32 && !s.allows(Variant::WarpRows) && s.allows(Variant::SplitColumns));
        assert_eq!(serde_json::from_str::<CudaSettings>("{}").expect("reads"), CudaSettings::default());
        assert!(Variant::ALL.iter().all(|&v| !CudaSettings::GENERAL.allows(v) && CudaSettings::default().allows(v)));
        assert_eq!(
            serde_json::to_string(&CudaSettings::default()).expect("writes"),
            r#"{"tf32":false,"no_graph":false,"general_kernels":false}"#
        );
    }
}
