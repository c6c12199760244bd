//! [`HostGpu`]: the GPU emulated on the host, for tests (see the module docs of `cuda`). It is
//! strict where a GPU would be silently wrong: a launch must use the kernel's own launch
//! dimensions (a smaller grid would skip work), each argument must point at enough memory for
//! its param (packed 4-bit params padded to whole words, `Buffer::device_bytes`), suitably
//! aligned, and a written param may not overlap another param (the generated kernels' params are
//! `__restrict__`).
//!
//! Its device collectives ([`GpuApi::collective`]) stand in for NCCL: recorded and replayed as
//! stream work, each exchanges its device bytes through the communicator `open_collectives` was
//! given, by the host rule (`comm::run`), so they give the CPU ranks' bits.

use std::sync::Arc;

use qatc_ir::DType;
use qatc_kernels::cuda::blas::host::{self as blas_host, HostMemory};
use qatc_kernels::cuda::blas::{BlasCall, Compute, ElemType, Mem};
use qatc_kernels::cuda::LaunchDims;
use qatc_kernels::kir::{self, Kernel};
use qatc_kernels::nvrtc::Arch;
use rayon::prelude::*;

use super::host_mem::DeviceMemory;
use super::{DevPtr, DeviceCollective, FuncId, GemmPtrs, GpuApi, GpuDevice, GpuError, GraphId, KernelImage, MarkId, PinnedId, Result};
use crate::comm::{self, Communicator};
use crate::{KirEval, Launcher};

/// One piece of recorded (or immediate) stream work.
#[derive(Clone, Debug)]
enum Work {
    Launch { f: FuncId, dims: LaunchDims, args: Vec<DevPtr> },
    Gemm { call: Box<BlasCall>, compute: Compute, ptrs: GemmPtrs },
    Copy { dst: DevPtr, src: DevPtr, bytes: usize },
    Memset { dst: DevPtr, value: u8, bytes: usize },
    Upload { dst: DevPtr, src: PinnedId, offset: usize, len: usize },
    Download { dst: PinnedId, offset: usize, src: DevPtr, len: usize },
    Collective(Box<DeviceCollective>),
}

struct Loaded {
    name: String,
    kernel: Kernel,
    /// The dims it must be launched with (`KernelImage::launch`).
    launch: LaunchDims,
    eval: KirEval,
}

/// The emulated GPU.
pub struct HostGpu {
    device: GpuDevice,
    mem: DeviceMemory,
    pinned: Vec<Option<Vec<u8>>>,
    funcs: Vec<Loaded>,
    capture: Option<Vec<Work>>,
    graphs: Vec<Vec<Work>>,
    /// Kernel launches and GEMM calls run so far (replays included).
    pub launches: usize,
    pub gemms: usize,
    /// Bytes copied host to device and device to host so far (pageable and pinned; replays
    /// included): what an executor's resident state saves shows here.
    pub bytes_in: usize,
    pub bytes_out: usize,
    /// Device allocations made so far, and graphs captured.
    pub allocations: usize,
    pub captures: usize,
    /// Device collectives run so far (replays included).
    pub collectives: usize,
    /// Who the device collectives exchange with (`open_collectives`).
    comm: Option<Arc<dyn Communicator>>,
    /// `mark`'s timestamps: the host's clock, as the emulation runs work when it is submitted.
    marks: Vec<std::time::Instant>,
}

/// The bytes a param's allocation must have from its pointer on.
fn param_bytes(p: &kir::Param) -> usize {
    let b = p.dtype.bytes_for(p.numel());
    if p.dtype == DType::I4 {
        b.next_multiple_of(4)
    } else {
        b
    }
}

fn param_align(d: DType) -> u64 {
    match d {
        DType::F32 | DType::I32 | DType::I4 => 4,
        DType::F16 | DType::BF16 => 2,
        DType::U8 => 1,
    }
}

/// The device memory seen, read only, through one GEMM call's base pointers (shared by the
/// threads computing its outputs).
struct CallMemory<'a> {
    mem: &'a DeviceMemory,
    bases: Vec<(Mem, DevPtr)>,
}

impl CallMemory<'_> {
    fn base(&self, m: Mem) -> std::result::Result<DevPtr, String> {
        self.bases.iter().find(|(x, _)| *x == m).map(|(_, p)| *p).ok_or_else(|| format!("{m:?} has no pointer"))
    }
}

impl HostMemory for CallMemory<'_> {
    fn load(&self, m: Mem, i: usize, ty: ElemType) -> std::result::Result<f32, String> {
        self.mem.load(self.base(m)?, i, ty).map_err(|e| e.to_string())
    }
    fn store(&mut self, m: Mem, _: usize, _: ElemType, _: f32) -> std::result::Result<(), String> {
        Err(format!("{m:?}: the call's outputs are written after it is computed"))
    }
}

/// A launch's host addresses, shared by the threads running its iterations.
struct HostArgs(Vec<*mut u8>);

// SAFETY: the addresses point into `HostGpu`'s device memory, which `run_launch` borrows mutably
// for the whole launch; the threads only pass them to the evaluator, which touches disjoint
// elements per iteration range (the `Launcher` contract).
unsafe impl Sync for HostArgs {}

impl HostArgs {
    fn ptrs(&self) -> &[*mut u8] {
        &self.0
    }
}

/// Iterations per parallel chunk: a multiple of 64 (two iterations never store into one byte of
/// packed codes), about four chunks per thread.
fn chunk(n: usize) -> usize {
    n.div_ceil(4 * rayon::current_num_threads()).next_multiple_of(64).max(64)
}

impl HostGpu {
    /// An emulated GPU with `capacity` bytes of device memory, named and numbered as an H100.
    pub fn new(capacity: usize) -> HostGpu {
        HostGpu {
            device: GpuDevice {
                name: "qatc HostGpu (emulated)".into(),
                arch: Arch::SM90,
                total_memory: capacity,
                multiprocessors: 132,
                libraries: "emulated: cuBLAS modelled by the gemm crate".into(),
            },
            mem: DeviceMemory::new(capacity),
            pinned: Vec::new(),
            funcs: Vec::new(),
            capture: None,
            graphs: Vec::new(),
            launches: 0,
            gemms: 0,
            bytes_in: 0,
            bytes_out: 0,
            allocations: 0,
            captures: 0,
            collectives: 0,
            comm: None,
            marks: Vec::new(),
        }
    }

    /// The most device memory allocated at once so far.
    pub fn peak_memory(&self) -> usize {
        self.mem.peak
    }

    fn pinned_buf(&mut self, id: PinnedId) -> Result<&mut Vec<u8>> {
        self.pinned.get_mut(id.0).and_then(|p| p.as_mut()).ok_or_else(|| GpuError::Invalid(format!("no pinned buffer {}", id.0)))
    }

    fn not_capturing(&self, what: &str) -> Result<()> {
        match self.capture {
            Some(_) => Err(GpuError::Invalid(format!(
                "{what} while a stream capture is open (CUDA refuses it: cudaErrorStreamCaptureUnsupported)"
            ))),
            None => Ok(()),
        }
    }

    /// Runs work now, or records it while capturing.
    fn submit(&mut self, w: Work) -> Result<()> {
        match &mut self.capture {
            Some(rec) => {
                rec.push(w);
                Ok(())
            }
            None => self.run(&w),
        }
    }

    fn run(&mut self, w: &Work) -> Result<()> {
        match w {
            Work::Launch { f, dims, args } => self.run_launch(*f, dims, args),
            Work::Gemm { call, compute, ptrs } => self.run_gemm(call, *compute, *ptrs),
            Work::Copy { dst, src, bytes } => self.mem.copy(*dst, *src, *bytes),
            Work::Memset { dst, value, bytes } => {
                self.mem.bytes_mut(*dst, *bytes)?.fill(*value);
                Ok(())
            }
            Work::Upload { dst, src, offset, len } => {
                let data = self.pinned_buf(*src)?.get(*offset..offset + len).map(<[u8]>::to_vec);
                let data = data.ok_or_else(|| GpuError::Invalid(format!("{len} bytes at {offset} of pinned buffer {}", src.0)))?;
                self.mem.bytes_mut(*dst, *len)?.copy_from_slice(&data);
                self.bytes_in += len;
                Ok(())
            }
            Work::Download { dst, offset, src, len } => {
                let data = self.mem.bytes(*src, *len)?.to_vec();
                let buf = self.pinned_buf(*dst)?;
                let slot = buf
                    .get_mut(*offset..offset + len)
                    .ok_or_else(|| GpuError::Invalid(format!("{len} bytes at {offset} of pinned buffer {}", dst.0)))?;
                slot.copy_from_slice(&data);
                self.bytes_out += len;
                Ok(())
            }
            Work::Collective(c) => self.run_collective(c),
        }
    }

    /// A device collective by the host rule, on the emulated device memory.
    fn run_collective(&mut self, c: &DeviceCollective) -> Result<()> {
        let comm = self.comm.clone().ok_or_else(|| GpuError::Invalid(format!("collective {}: no world was joined", c.step.note)))?;
        let (n, m) = c.bytes();
        let src = self.mem.bytes(c.src, n)?.to_vec();
        let mut dst = vec![0u8; m];
        comm::run(&*comm, &c.step, c.dtype, &src, &mut dst).map_err(|e| match e {
            crate::error::RuntimeError::Collective { msg, .. } => GpuError::Invalid(msg),
            other => GpuError::Invalid(other.to_string()),
        })?;
        self.mem.bytes_mut(c.dst, m)?.copy_from_slice(&dst);
        self.collectives += 1;
        Ok(())
    }

    fn run_launch(&mut self, f: FuncId, dims: &LaunchDims, args: &[DevPtr]) -> Result<()> {
        let l = self.funcs.get(f.0).ok_or_else(|| GpuError::Invalid(format!("no function {}", f.0)))?;
        let bad = |msg: String| GpuError::Kernel { kernel: l.name.clone(), msg };
        let want = &l.launch;
        if dims != want {
            return Err(bad(format!("launched with {dims:?}; its mapping needs {want:?}")));
        }
        if args.len() != l.kernel.params.len() {
            return Err(bad(format!("{} arguments for {} params", args.len(), l.kernel.params.len())));
        }
        let mut ranges = Vec::new();
        let mut ptrs = Vec::new();
        for (p, &a) in l.kernel.params.iter().zip(args) {
            let need = param_bytes(p);
            if a % param_align(p.dtype) != 0 {
                return Err(bad(format!("param {} at {a:#x} is not {}-byte aligned", p.name, param_align(p.dtype))));
            }
            let (host, left) = self.mem.host_ptr(a).map_err(|e| bad(format!("param {}: {e}", p.name)))?;
            if left < need {
                return Err(bad(format!(
                    "param {} ({} {:?}) needs {need} bytes at {a:#x}; its allocation has {left} left",
                    p.name, p.dtype, p.shape
                )));
            }
            ranges.push((a, a + need as u64, p.write, &p.name));
            ptrs.push(host);
        }
        for (i, x) in ranges.iter().enumerate() {
            for y in &ranges[i + 1..] {
                if (x.2 || y.2) && x.0 < y.1 && y.0 < x.1 {
                    return Err(bad(format!("params {} and {} overlap, one of them written (params are __restrict__)", x.3, y.3)));
                }
            }
        }
        let n = kir::iterations(&l.kernel);
        // SAFETY: one pointer per param, each into a live allocation with at least the param's
        // bytes left (checked above), aligned for its type (device allocations are 256-aligned
        // and offsets were checked), and nothing else touches device memory while it runs.
        let (args, step, eval) = (HostArgs(ptrs), chunk(n), &l.eval);
        (0..n.div_ceil(step))
            .into_par_iter()
            // SAFETY: as above; the chunks are disjoint iteration ranges of one launch.
            .try_for_each(|c| unsafe { eval.launch(0, args.ptrs(), c * step, ((c + 1) * step).min(n)) })
            .map_err(|e| bad(e.to_string()))?;
        self.launches += 1;
        Ok(())
    }

    fn run_gemm(&mut self, call: &BlasCall, compute: Compute, ptrs: GemmPtrs) -> Result<()> {
        let mut bases = vec![(call.a.mem, ptrs.a), (call.b.mem, ptrs.b), (call.c.mem, ptrs.c)];
        if let (Some(v), Some(p)) = (&call.bias, ptrs.bias) {
            bases.push((v.mem, p));
        }
        let err = |e: String| GpuError::Blas { call: "cublasGemmStridedBatchedEx / cublasLtMatmul (emulated)".into(), status: e };
        // the outputs computed in parallel from memory as it was, then written
        let outputs = call.batch * call.n;
        let step = outputs.div_ceil(4 * rayon::current_num_threads()).max(1);
        let mem = CallMemory { mem: &self.mem, bases };
        let parts: Vec<Vec<(usize, f32)>> = (0..outputs.div_ceil(step))
            .into_par_iter()
            .map(|c| blas_host::call_outputs(call, compute, &mem, c * step..((c + 1) * step).min(outputs)))
            .collect::<std::result::Result<_, _>>()
            .map_err(err)?;
        let base = mem.base(call.c.mem).map_err(err)?;
        for (at, v) in parts.into_iter().flatten() {
            self.mem.store(base, at, call.c.ty, v)?;
        }
        self.gemms += 1;
        Ok(())
    }
}

impl GpuApi for HostGpu {
    fn device(&self) -> &GpuDevice {
        &self.device
    }

    fn memory(&self) -> Result<(usize, usize)> {
        Ok((self.mem.capacity - self.mem.used, self.mem.capacity))
    }

    fn alloc(&mut self, bytes: usize) -> Result<DevPtr> {
        self.allocations += 1;
        self.mem.alloc(bytes)
    }

    fn free(&mut self, ptr: DevPtr) -> Result<()> {
        self.mem.free(ptr)
    }

    fn alloc_pinned(&mut self, bytes: usize) -> Result<PinnedId> {
        self.pinned.push(Some(vec![0; bytes]));
        Ok(PinnedId(self.pinned.len() - 1))
    }

    fn pinned(&mut self, id: PinnedId) -> Result<&mut [u8]> {
        self.not_capturing("reading a pinned buffer (a stream synchronization)")?;
        self.pinned_buf(id).map(|b| b.as_mut_slice())
    }

    fn free_pinned(&mut self, id: PinnedId) -> Result<()> {
        let slot = self.pinned.get_mut(id.0).ok_or_else(|| GpuError::Invalid(format!("no pinned buffer {}", id.0)))?;
        slot.take().map(|_| ()).ok_or_else(|| GpuError::Invalid(format!("pinned buffer {} freed twice", id.0)))
    }

    fn upload(&mut self, dst: DevPtr, src: &[u8]) -> Result<()> {
        self.not_capturing("a copy from pageable host memory")?;
        self.mem.bytes_mut(dst, src.len())?.copy_from_slice(src);
        self.bytes_in += src.len();
        Ok(())
    }

    fn download(&mut self, dst: &mut [u8], src: DevPtr) -> Result<()> {
        self.not_capturing("a copy to pageable host memory")?;
        dst.copy_from_slice(self.mem.bytes(src, dst.len())?);
        self.bytes_out += dst.len();
        Ok(())
    }

    fn upload_pinned(&mut self, dst: DevPtr, src: PinnedId, offset: usize, len: usize) -> Result<()> {
        self.submit(Work::Upload { dst, src, offset, len })
    }

    fn download_pinned(&mut self, dst: PinnedId, offset: usize, src: DevPtr, len: usize) -> Result<()> {
        self.submit(Work::Download { dst, offset, src, len })
    }

    fn copy(&mut self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<()> {
        self.submit(Work::Copy { dst, src, bytes })
    }

    fn memset(&mut self, dst: DevPtr, value: u8, bytes: usize) -> Result<()> {
        self.submit(Work::Memset { dst, value, bytes })
    }

    fn load(&mut self, image: &KernelImage) -> Result<FuncId> {
        let eval = KirEval::new(std::slice::from_ref(&image.kernel));
        self.funcs.push(Loaded { name: image.name.clone(), kernel: image.kernel.clone(), launch: image.launch.clone(), eval });
        Ok(FuncId(self.funcs.len() - 1))
    }

    fn launch(&mut self, f: FuncId, dims: &LaunchDims, args: &[DevPtr]) -> Result<()> {
        if f.0 >= self.funcs.len() {
            return Err(GpuError::Invalid(format!("no function {}", f.0)));
        }
        self.submit(Work::Launch { f, dims: dims.clone(), args: args.to_vec() })
    }

    fn gemm(&mut self, call: &BlasCall, compute: Compute, ptrs: GemmPtrs) -> Result<()> {
        self.submit(Work::Gemm { call: Box::new(call.clone()), compute, ptrs })
    }

    fn begin_capture(&mut self) -> Result<()> {
        self.not_capturing("beginning a capture")?;
        self.capture = Some(Vec::new());
        Ok(())
    }

    fn end_capture(&mut self) -> Result<GraphId> {
        let rec = self.capture.take().ok_or_else(|| GpuError::Invalid("end of a capture that never began".into()))?;
        self.graphs.push(rec);
        self.captures += 1;
        Ok(GraphId(self.graphs.len() - 1))
    }

    fn replay(&mut self, g: GraphId) -> Result<()> {
        self.not_capturing("replaying a graph inside a capture")?;
        let work = self.graphs.get(g.0).cloned().ok_or_else(|| GpuError::Invalid(format!("no graph {}", g.0)))?;
        for w in &work {
            self.run(w)?;
        }
        Ok(())
    }

    fn open_collectives(&mut self, comm: Arc<dyn Communicator>) -> Result<String> {
        self.not_capturing("joining a world")?;
        // NCCL's unique id, as its path carries it: made by rank 0, every rank taking rank 0's
        let made = *b"qatc HostGpu's stand-in for NCCL's unique id";
        let mut id = [0u8; 128];
        if comm.rank() == 0 {
            id[..made.len()].copy_from_slice(&made);
        }
        let shared = comm::from_rank0(&*comm, &id).map_err(|e| GpuError::Invalid(format!("sharing the unique id: {e}")))?;
        if shared[..made.len()] != made {
            return Err(GpuError::Invalid(format!("rank {} received another unique id than rank 0's", comm.rank())));
        }
        let words = format!("emulated device collectives over {} ranks", comm.size());
        self.comm = Some(comm);
        Ok(words)
    }

    fn collective(&mut self, c: &DeviceCollective) -> Result<()> {
        self.submit(Work::Collective(Box::new(c.clone())))
    }

    fn synchronize(&mut self) -> Result<()> {
        self.not_capturing("synchronizing")
    }

    fn mark(&mut self) -> Result<MarkId> {
        self.not_capturing("marking the time")?;
        self.marks.push(std::time::Instant::now());
        Ok(MarkId(self.marks.len() - 1))
    }

    fn elapsed_ms(&mut self, from: MarkId, to: MarkId) -> Result<f64> {
        let at = |m: MarkId| self.marks.get(m.0).copied().ok_or_else(|| GpuError::Invalid(format!("no mark {}", m.0)));
        Ok(at(to)?.saturating_duration_since(at(from)?).as_secs_f64() * 1e3)
    }

    fn clear_marks(&mut self) -> Result<()> {
        self.marks.clear();
        Ok(())
    }
}
