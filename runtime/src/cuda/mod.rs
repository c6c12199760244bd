//! The GPU side of the CUDA backend: what an executor of a lowered program needs from a GPU, as
//! one trait ([`GpuApi`]), with two implementations:
//!
//! - [`CudaDriver`]: the CUDA driver API, cuBLAS and cuBLASLt through cudarc, loaded at run time.
//!   Opening it never panics where CUDA is missing (each library is probed with cudarc's
//!   `is_culib_present` before any other call); every error names the call and carries CUDA's
//!   error name and string.
//! - [`HostGpu`]: an emulation for tests on machines without a GPU. Device memory is host memory
//!   behind fake device addresses (bounds-checked, allocations apart), a launch runs the kernel's
//!   kernel IR through the evaluator over all its iterations, a GEMM runs the host model of its
//!   cuBLAS call, and stream capture records the work for a graph that replays it.
//!
//! The model is one stream: every operation is ordered after the previous one. Copies from and to
//! ordinary host slices complete before the call returns (as CUDA's pageable copies do, so the
//! slice may be reused at once); copies from and to [pinned buffers](GpuApi::alloc_pinned) are
//! asynchronous, and [`GpuApi::pinned`] waits for the stream before handing the buffer out. While
//! a capture is open nothing runs: launches, GEMMs, device copies and pinned copies are recorded
//! for [`GpuApi::replay`]; copies of ordinary host slices are refused, as CUDA refuses them.
//!
//! A step's collectives (`qatc_kernels::program::Collective`) run one of two ways, the program's
//! [`Collectives`] setting: staged through the host (the operand downloaded, exchanged by the
//! [`Communicator`] by the CPU ranks' rule, the result uploaded: any GPU, bit for bit the CPU's), or
//! in the stream on device memory through [`GpuApi::collective`] (NCCL on a GPU, `nccl.rs`; the
//! emulation exchanges through its communicator by the host rule, so that what it tests is the
//! executor's plumbing: pointers, stream order, the graph's capture and replay).
//!
//! [`CudaProgram`] is the executor built on it (`program.rs`: the shared `ExecPlan`'s layout in
//! three allocations, resident state, data through pinned staging, the step captured once as a
//! graph; `build.rs`: kernels to CUBINs and loaded, GEMMs planned); [`run_plan`] runs one GEMM's
//! [`BlasPlan`] through the trait.

mod build;
mod collectives;
mod driver;
mod driver_blas;
mod error;
mod host;
mod host_mem;
mod nccl;
mod program;

use std::sync::Arc;

use qatc_ir::DType;
use qatc_kernels::cuda::blas::{BlasCall, BlasPlan, BlasStep, Compute, Mem};
use qatc_kernels::cuda::LaunchDims;
use qatc_kernels::kir::Kernel;
use qatc_kernels::nvrtc::Arch;
use qatc_kernels::program::Collective;

use crate::comm::Communicator;

pub use build::KernelBuild;
pub use collectives::Collectives;
pub use driver::{probe_libraries, CudaDriver};
pub use error::GpuError;
pub use host::HostGpu;
pub use nccl::probe_nccl;
pub use program::{CudaProgram, DeviceBytes};

/// A device address (`CUdeviceptr`).
pub type DevPtr = u64;

/// A loaded kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FuncId(pub usize);

/// A captured, instantiated graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphId(pub usize);

/// A timestamp recorded on the stream (`GpuApi::mark`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MarkId(pub usize);

/// A page-locked host buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PinnedId(pub usize);

/// The device a [`GpuApi`] drives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuDevice {
    pub name: String,
    pub arch: Arch,
    pub total_memory: usize,
    pub multiprocessors: usize,
    /// The driver's and libraries' versions as loaded ("driver 13.0, cuBLAS 13.1.0, cuBLASLt
    /// 13.1.0"): what ran, whatever the library path suggests.
    pub libraries: String,
}

/// A kernel ready to load: its CUBIN (for a GPU) and its kernel IR (for the emulation), under
/// the name the CUDA writer gave it (`fused_{family}_{hash8}`).
#[derive(Clone, Debug)]
pub struct KernelImage {
    pub name: String,
    pub cubin: Vec<u8>,
    pub kernel: Kernel,
    /// The grid and block its CUDA C was written for (`CudaKernel::launch`: a variant of the
    /// writer, `warp-rows`, may map the same kernel IR to other dims).
    pub launch: LaunchDims,
}

/// The base address of each operand's memory in one GEMM call (the call's offsets are added by
/// the implementation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmPtrs {
    pub a: DevPtr,
    pub b: DevPtr,
    pub c: DevPtr,
    pub bias: Option<DevPtr>,
}

/// One collective on device memory ([`GpuApi::collective`]): the program's step (its exchange,
/// world and note), its element type, and the device addresses of the operand's first element
/// and of the result.
#[derive(Clone, Debug)]
pub struct DeviceCollective {
    pub step: Collective,
    pub dtype: DType,
    pub src: DevPtr,
    pub dst: DevPtr,
}

impl DeviceCollective {
    /// The operand's and the result's bytes.
    pub fn bytes(&self) -> (usize, usize) {
        (self.dtype.bytes_for(self.step.src.numel()), self.dtype.bytes_for(self.step.dst.numel()))
    }
}

pub type Result<T> = std::result::Result<T, GpuError>;

/// What an executor needs from a GPU. See the module docs for the ordering model.
pub trait GpuApi {
    fn device(&self) -> &GpuDevice;
    /// (free, total) device memory, bytes.
    fn memory(&self) -> Result<(usize, usize)>;

    /// Device memory of `bytes` (uninitialized), 256-byte aligned.
    fn alloc(&mut self, bytes: usize) -> Result<DevPtr>;
    fn free(&mut self, ptr: DevPtr) -> Result<()>;
    /// Page-locked host memory for asynchronous copies (zeroed).
    fn alloc_pinned(&mut self, bytes: usize) -> Result<PinnedId>;
    /// A pinned buffer's bytes, once the stream has finished what it does with them.
    fn pinned(&mut self, id: PinnedId) -> Result<&mut [u8]>;
    fn free_pinned(&mut self, id: PinnedId) -> Result<()>;

    /// `src` to device memory at `dst`; `src` may be reused when this returns.
    fn upload(&mut self, dst: DevPtr, src: &[u8]) -> Result<()>;
    /// Device memory at `src` into `dst`, complete when this returns.
    fn download(&mut self, dst: &mut [u8], src: DevPtr) -> Result<()>;
    /// `len` bytes of a pinned buffer from `offset` to `dst`, asynchronously.
    fn upload_pinned(&mut self, dst: DevPtr, src: PinnedId, offset: usize, len: usize) -> Result<()>;
    /// `len` bytes at `src` into a pinned buffer at `offset`, asynchronously.
    fn download_pinned(&mut self, dst: PinnedId, offset: usize, src: DevPtr, len: usize) -> Result<()>;
    fn copy(&mut self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<()>;
    fn memset(&mut self, dst: DevPtr, value: u8, bytes: usize) -> Result<()>;

    /// Loads one kernel.
    fn load(&mut self, image: &KernelImage) -> Result<FuncId>;
    /// Launches `f` with one device pointer per kernel param (qatc's kernels take only
    /// buffers; each points at the buffer's first element: kernels add view offsets themselves).
    fn launch(&mut self, f: FuncId, dims: &LaunchDims, args: &[DevPtr]) -> Result<()>;
    /// One cuBLAS(Lt) call of a plan, with `compute` the plan's compute type.
    fn gemm(&mut self, call: &BlasCall, compute: Compute, ptrs: GemmPtrs) -> Result<()>;

    /// From now on, work is recorded instead of run.
    fn begin_capture(&mut self) -> Result<()>;
    /// Ends the capture: the recorded work as a graph ready to replay.
    fn end_capture(&mut self) -> Result<GraphId>;
    fn replay(&mut self, g: GraphId) -> Result<()>;
    /// Waits for everything submitted so far.
    fn synchronize(&mut self) -> Result<()>;

    /// A timestamp on the stream after the work submitted so far (a CUDA event), for timing the
    /// parts of a step; not while capturing. Read with `elapsed_ms` once synchronized.
    fn mark(&mut self) -> Result<MarkId>;
    /// Milliseconds between two marks, both reached (call after `synchronize`).
    fn elapsed_ms(&mut self, from: MarkId, to: MarkId) -> Result<f64>;
    /// Forgets every mark (the ids given so far are no longer valid).
    fn clear_marks(&mut self) -> Result<()>;

    /// Joins `comm`'s world with the device's collective library, so that
    /// [`collective`](Self::collective) can run: NCCL on a GPU (rank 0's unique id carried to
    /// every rank by `comm`; every rank must call this at the same point, as NCCL's own
    /// initialization is collective). Returns what was opened, in words ("NCCL 2.27.3").
    fn open_collectives(&mut self, comm: Arc<dyn Communicator>) -> Result<String>;
    /// One collective on device memory, ordered in the stream like a launch (and captured like
    /// one), over the world `open_collectives` joined.
    fn collective(&mut self, c: &DeviceCollective) -> Result<()>;
}

/// The kernels of a plan's data moves, loaded: (step index, function, the grid and block its
/// CUDA C was written for: `KernelImage::launch`), in step order.
pub type PlanFuncs = Vec<(usize, FuncId, LaunchDims)>;

/// Runs a GEMM's plan: its library calls through [`GpuApi::gemm`], its data moves as the
/// kernels `funcs` (loaded from `qatc_kernels::cuda::blas::move_kernels(plan)`). `resolve` gives
/// the device address of each memory the plan names (program buffers and the plan's scratch).
pub fn run_plan(api: &mut dyn GpuApi, plan: &BlasPlan, funcs: &PlanFuncs, resolve: &dyn Fn(Mem) -> Result<DevPtr>) -> Result<()> {
    let moves = qatc_kernels::cuda::blas::move_kernels(plan);
    for (i, step) in plan.steps.iter().enumerate() {
        match step {
            BlasStep::Call(c) => {
                let ptrs = GemmPtrs {
                    a: resolve(c.a.mem)?,
                    b: resolve(c.b.mem)?,
                    c: resolve(c.c.mem)?,
                    bias: c.bias.map(|v| resolve(v.mem)).transpose()?,
                };
                api.gemm(c, plan.compute, ptrs)?;
            }
            _ => {
                let f = funcs.iter().find(|(s, _, _)| *s == i);
                let m = moves.iter().find(|m| m.step == i);
                let (Some((_, f, dims)), Some(m)) = (f, m) else {
                    return Err(GpuError::Invalid(format!("plan step {i} ({step:?}) has no loaded kernel")));
                };
                let args = m.args.iter().map(|&mem| resolve(mem)).collect::<Result<Vec<_>>>()?;
                // the dims it was written with (a writer's variant may map it otherwise than the
                // default, `--general-kernels` among them)
                api.launch(*f, dims, &args)?;
            }
        }
    }
    Ok(())
}
