//! [`CudaDriver`]: [`GpuApi`] on the CUDA driver API through cudarc's thin `result` layer (raw
//! handles, every call's status checked), one non-blocking stream, the device's primary context.
//!
//! cudarc loads libcuda, libcublas and libcublasLt (and libnccl, `nccl.rs`, when a step's
//! collectives run on the device) at run time and panics when one is missing,
//! so [`CudaDriver::open`] first asks `is_culib_present` of each and returns
//! [`GpuError::Unavailable`] instead; nothing here calls into cudarc before that. The handles are
//! raw pointers owned by the driver alone. A `CudaDriver` may move to another thread (it is Send,
//! so an executor on it can be a `TrainStep`), not be shared (it is not Sync): every call first
//! makes its context current on the calling thread when that thread is not the last one it ran on.

use std::cell::Cell;
use std::ffi::{c_void, CString};
use std::sync::Arc;
use std::thread::{self, ThreadId};

use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys;
use qatc_kernels::cuda::blas::{BlasCall, Compute};
use qatc_kernels::cuda::LaunchDims;
use qatc_kernels::nvrtc::Arch;

use crate::comm::Communicator;

use super::driver_blas::Blas;
use super::nccl::Nccl;
use super::{DevPtr, DeviceCollective, FuncId, GemmPtrs, GpuApi, GpuDevice, GpuError, GraphId, KernelImage, MarkId, PinnedId, Result};

/// A driver error with the call that failed and CUDA's name and string for it.
pub(super) fn drv(call: &str, e: DriverError) -> GpuError {
    let name = e.error_name().map(|c| c.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("CUresult {:?}", e.0));
    let message = e.error_string().map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
    GpuError::Driver { call: call.into(), name, message }
}

/// Why CUDA cannot be used here, or Ok when the driver, cuBLAS and cuBLASLt libraries load.
pub fn probe_libraries() -> Result<()> {
    // SAFETY: each `is_culib_present` only tries to dlopen its library's candidate names and
    // drops what it opened; they are the checks that keep later cudarc calls from panicking.
    let present = unsafe {
        [
            ("the CUDA driver (libcuda.so)", cudarc::driver::sys::is_culib_present()),
            ("cuBLAS (libcublas.so)", cudarc::cublas::sys::is_culib_present()),
            ("cuBLASLt (libcublasLt.so)", cudarc::cublaslt::sys::is_culib_present()),
        ]
    };
    let missing: Vec<&str> = present.iter().filter(|(_, ok)| !ok).map(|(n, _)| *n).collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(GpuError::Unavailable(format!("{} not found on the loader's path (LD_LIBRARY_PATH)", missing.join(", "))))
    }
}

struct Module {
    module: sys::CUmodule,
    func: sys::CUfunction,
}

struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

/// The CUDA driver, cuBLAS and cuBLASLt on one device.
pub struct CudaDriver {
    device: GpuDevice,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    /// The thread the context was last made current on.
    thread: Cell<ThreadId>,
    stream: sys::CUstream,
    modules: Vec<Module>,
    pinned: Vec<Option<(*mut u8, usize)>>,
    graphs: Vec<Graph>,
    blas: Option<Blas>,
    /// The step's collectives on the device, once `open_collectives` joined a world.
    nccl: Option<Nccl>,
    capturing: bool,
    /// Events for `mark`, kept for reuse: the first `marks` are in use.
    events: Vec<sys::CUevent>,
    marks: usize,
}

impl CudaDriver {
    /// How many devices the driver sees (one rank per GPU: rank r of a world opens device
    /// r mod this).
    pub fn device_count() -> Result<usize> {
        probe_libraries()?;
        cu::init().map_err(|e| drv("cuInit", e))?;
        let n = cu::device::get_count().map_err(|e| drv("cuDeviceGetCount", e))?;
        Ok(n.max(0) as usize)
    }

    /// Opens device `ordinal`: its primary context, made current on this thread, a stream, and
    /// the BLAS handles with a workspace (so captured GEMMs allocate nothing).
    pub fn open(ordinal: usize) -> Result<CudaDriver> {
        probe_libraries()?;
        cu::init().map_err(|e| drv("cuInit", e))?;
        let n = cu::device::get_count().map_err(|e| drv("cuDeviceGetCount", e))?;
        if ordinal as i32 >= n {
            return Err(GpuError::Unavailable(format!("device {ordinal} asked for, the driver sees {n}")));
        }
        let dev = cu::device::get(ordinal as i32).map_err(|e| drv("cuDeviceGet", e))?;
        let name = cu::device::get_name(dev).map_err(|e| drv("cuDeviceGetName", e))?;
        let attr = |a: sys::CUdevice_attribute, what: &str| -> Result<i32> {
            // SAFETY: `dev` is a device handle the driver returned; the attribute is a valid enum.
            unsafe { cu::device::get_attribute(dev, a) }.map_err(|e| drv(&format!("cuDeviceGetAttribute({what})"), e))
        };
        let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "compute capability")?;
        let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "compute capability")?;
        let sms = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "multiprocessors")?;
        // SAFETY: as above.
        let total = unsafe { cu::device::total_mem(dev) }.map_err(|e| drv("cuDeviceTotalMem", e))?;
        let arch =
            Arch::from_capability(major, minor).ok_or_else(|| GpuError::Unavailable(format!("compute capability {major}.{minor}")))?;
        // SAFETY: the primary context of a valid device; it is released in Drop.
        let ctx = unsafe { cu::primary_ctx::retain(dev) }.map_err(|e| drv("cuDevicePrimaryCtxRetain", e))?;
        // SAFETY: a context just retained.
        unsafe { cu::ctx::set_current(ctx) }.map_err(|e| drv("cuCtxSetCurrent", e))?;
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| drv("cuStreamCreate", e))?;
        let mut driver_version = 0;
        // SAFETY: cuDriverGetVersion writes one int.
        unsafe { sys::cuDriverGetVersion(&mut driver_version) }.result().map_err(|e| drv("cuDriverGetVersion", e))?;
        let device = GpuDevice {
            name,
            arch,
            total_memory: total,
            multiprocessors: sms.max(0) as usize,
            libraries: format!("driver {}.{}", driver_version / 1000, driver_version % 1000 / 10),
        };
        let mut d = CudaDriver {
            device,
            dev,
            ctx,
            thread: Cell::new(thread::current().id()),
            stream,
            modules: Vec::new(),
            pinned: Vec::new(),
            graphs: Vec::new(),
            blas: None,
            nccl: None,
            capturing: false,
            events: Vec::new(),
            marks: 0,
        };
        let blas = Blas::new(d.stream)?;
        d.device.libraries = format!("{}, {}", d.device.libraries, blas.versions());
        d.blas = Some(blas);
        Ok(d)
    }

    /// Makes the context current on this thread, when the driver has moved here since its last
    /// call (a context is current per thread).
    fn bind(&self) -> Result<()> {
        let here = thread::current().id();
        if self.thread.get() != here {
            // SAFETY: the primary context retained in `open`, alive until Drop.
            unsafe { cu::ctx::set_current(self.ctx) }.map_err(|e| drv("cuCtxSetCurrent", e))?;
            self.thread.set(here);
        }
        Ok(())
    }

    fn sync(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: the stream is ours and alive.
        unsafe { cu::stream::synchronize(self.stream) }.map_err(|e| drv("cuStreamSynchronize", e))
    }

    fn not_capturing(&self, what: &str) -> Result<()> {
        if self.capturing {
            Err(GpuError::Invalid(format!("{what} while a stream capture is open")))
        } else {
            Ok(())
        }
    }

    fn pinned_ptr(&self, id: PinnedId, offset: usize, len: usize) -> Result<*mut u8> {
        match self.pinned.get(id.0).copied().flatten() {
            // SAFETY: offset + len is inside the buffer (checked), so the pointer stays in it.
            Some((p, n)) if offset.checked_add(len).is_some_and(|e| e <= n) => Ok(unsafe { p.add(offset) }),
            Some((_, n)) => Err(GpuError::Invalid(format!("{len} bytes at {offset} of a {n}-byte pinned buffer"))),
            None => Err(GpuError::Invalid(format!("no pinned buffer {}", id.0))),
        }
    }
}

impl GpuApi for CudaDriver {
    fn device(&self) -> &GpuDevice {
        &self.device
    }

    fn memory(&self) -> Result<(usize, usize)> {
        self.bind()?;
        cu::mem_get_info().map_err(|e| drv("cuMemGetInfo", e))
    }

    fn alloc(&mut self, bytes: usize) -> Result<DevPtr> {
        self.bind()?;
        // SAFETY: a plain allocation in the current context; uninitialized, as documented.
        unsafe { cu::malloc_sync(bytes.max(1)) }.map_err(|e| drv(&format!("cuMemAlloc({bytes} bytes)"), e))
    }

    fn free(&mut self, ptr: DevPtr) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller frees what `alloc` gave it, once; the driver checks the pointer.
        unsafe { cu::free_sync(ptr) }.map_err(|e| drv("cuMemFree", e))
    }

    fn alloc_pinned(&mut self, bytes: usize) -> Result<PinnedId> {
        self.bind()?;
        // SAFETY: page-locked host memory of `bytes`, zeroed before use and freed in free_pinned
        // or Drop.
        let p = unsafe { cu::malloc_host(bytes.max(1), 0) }.map_err(|e| drv(&format!("cuMemHostAlloc({bytes} bytes)"), e))?.cast::<u8>();
        // SAFETY: the allocation has at least `bytes` bytes.
        unsafe { std::ptr::write_bytes(p, 0, bytes) };
        self.pinned.push(Some((p, bytes)));
        Ok(PinnedId(self.pinned.len() - 1))
    }

    fn pinned(&mut self, id: PinnedId) -> Result<&mut [u8]> {
        self.not_capturing("reading a pinned buffer")?;
        self.sync()?;
        let p = self.pinned_ptr(id, 0, 0)?;
        let n = self.pinned.get(id.0).copied().flatten().map_or(0, |(_, n)| n);
        // SAFETY: the stream is idle (synchronized above), so no copy touches the buffer, and the
        // slice borrows self mutably, so no other call can start one while it lives.
        Ok(unsafe { std::slice::from_raw_parts_mut(p, n) })
    }

    fn free_pinned(&mut self, id: PinnedId) -> Result<()> {
        self.bind()?;
        self.sync()?;
        let (p, _) =
            self.pinned.get_mut(id.0).and_then(Option::take).ok_or_else(|| GpuError::Invalid(format!("no pinned buffer {}", id.0)))?;
        // SAFETY: allocated by cuMemHostAlloc, taken out of the table, so freed once; idle stream.
        unsafe { cu::free_host(p.cast()) }.map_err(|e| drv("cuMemFreeHost", e))
    }

    fn upload(&mut self, dst: DevPtr, src: &[u8]) -> Result<()> {
        self.bind()?;
        self.not_capturing("a copy from pageable host memory")?;
        // SAFETY: `src` is a live slice; the stream is synchronized before returning, so it is
        // no longer read once the borrow ends.
        unsafe { cu::memcpy_htod_async(dst, src, self.stream) }.map_err(|e| drv(&format!("cuMemcpyHtoDAsync({} bytes)", src.len()), e))?;
        self.sync()
    }

    fn download(&mut self, dst: &mut [u8], src: DevPtr) -> Result<()> {
        self.bind()?;
        self.not_capturing("a copy to pageable host memory")?;
        // SAFETY: `dst` is a live slice, written only until the synchronization below.
        unsafe { cu::memcpy_dtoh_async(dst, src, self.stream) }.map_err(|e| drv(&format!("cuMemcpyDtoHAsync({} bytes)", dst.len()), e))?;
        self.sync()
    }

    fn upload_pinned(&mut self, dst: DevPtr, src: PinnedId, offset: usize, len: usize) -> Result<()> {
        self.bind()?;
        let p = self.pinned_ptr(src, offset, len)?;
        // SAFETY: the range is inside a pinned buffer that lives until free_pinned, which
        // synchronizes first; `pinned` synchronizes before handing the bytes out.
        let s = unsafe { std::slice::from_raw_parts(p, len) };
        // SAFETY: as above.
        unsafe { cu::memcpy_htod_async(dst, s, self.stream) }.map_err(|e| drv("cuMemcpyHtoDAsync(pinned)", e))
    }

    fn download_pinned(&mut self, dst: PinnedId, offset: usize, src: DevPtr, len: usize) -> Result<()> {
        self.bind()?;
        let p = self.pinned_ptr(dst, offset, len)?;
        // SAFETY: as upload_pinned.
        let d = unsafe { std::slice::from_raw_parts_mut(p, len) };
        // SAFETY: as upload_pinned.
        unsafe { cu::memcpy_dtoh_async(d, src, self.stream) }.map_err(|e| drv("cuMemcpyDtoHAsync(pinned)", e))
    }

    fn copy(&mut self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: device addresses; the driver checks them.
        unsafe { cu::memcpy_dtod_async(dst, src, bytes, self.stream) }.map_err(|e| drv("cuMemcpyDtoDAsync", e))
    }

    fn memset(&mut self, dst: DevPtr, value: u8, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: as copy.
        unsafe { cu::memset_d8_async(dst, value, bytes, self.stream) }.map_err(|e| drv("cuMemsetD8Async", e))
    }

    fn load(&mut self, image: &KernelImage) -> Result<FuncId> {
        self.bind()?;
        if !image.cubin.starts_with(b"\x7fELF") {
            return Err(GpuError::Invalid(format!("{}: its image is not a CUBIN", image.name)));
        }
        // SAFETY: a whole CUBIN (an ELF image, checked above) that outlives the call.
        let module = unsafe { cu::module::load_data(image.cubin.as_ptr().cast::<c_void>()) }
            .map_err(|e| drv(&format!("cuModuleLoadData({})", image.name), e))?;
        let name = CString::new(image.name.as_str()).map_err(|_| GpuError::Invalid(format!("kernel name {:?} has a NUL", image.name)))?;
        // SAFETY: a module just loaded.
        let func =
            unsafe { cu::module::get_function(module, name) }.map_err(|e| drv(&format!("cuModuleGetFunction({})", image.name), e))?;
        self.modules.push(Module { module, func });
        Ok(FuncId(self.modules.len() - 1))
    }

    fn launch(&mut self, f: FuncId, dims: &LaunchDims, args: &[DevPtr]) -> Result<()> {
        self.bind()?;
        let func = self.modules.get(f.0).map(|m| m.func).ok_or_else(|| GpuError::Invalid(format!("no function {}", f.0)))?;
        let mut values: Vec<DevPtr> = args.to_vec();
        let mut params: Vec<*mut c_void> = values.iter_mut().map(|v| (v as *mut DevPtr).cast::<c_void>()).collect();
        let g = (dims.grid[0], dims.grid[1], dims.grid[2]);
        // SAFETY: a function of a loaded module, one pointer-sized argument per kernel param
        // (the kernels take only device pointers), `values` alive until the launch has copied
        // them (cuLaunchKernel copies the parameters before returning).
        unsafe { cu::launch_kernel(func, g, (dims.block, 1, 1), 0, self.stream, &mut params) }.map_err(|e| drv("cuLaunchKernel", e))
    }

    fn gemm(&mut self, call: &BlasCall, compute: Compute, ptrs: GemmPtrs) -> Result<()> {
        self.bind()?;
        let blas = self.blas.as_mut().ok_or_else(|| GpuError::Unavailable("cuBLAS was not opened".into()))?;
        blas.gemm(call, compute, ptrs)
    }

    fn begin_capture(&mut self) -> Result<()> {
        self.bind()?;
        self.not_capturing("beginning a capture")?;
        // SAFETY: our stream, not capturing.
        unsafe { cu::stream::begin_capture(self.stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) }
            .map_err(|e| drv("cuStreamBeginCapture", e))?;
        self.capturing = true;
        Ok(())
    }

    fn end_capture(&mut self) -> Result<GraphId> {
        self.bind()?;
        if !self.capturing {
            return Err(GpuError::Invalid("end of a capture that never began".into()));
        }
        self.capturing = false;
        // SAFETY: our stream, capturing.
        let graph = unsafe { cu::stream::end_capture(self.stream) }.map_err(|e| drv("cuStreamEndCapture", e))?;
        // SAFETY: a graph just captured.
        let exec = unsafe { cu::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) }.map_err(|e| drv("cuGraphInstantiate", e))?;
        self.graphs.push(Graph { graph, exec });
        Ok(GraphId(self.graphs.len() - 1))
    }

    fn replay(&mut self, g: GraphId) -> Result<()> {
        self.bind()?;
        let exec = self.graphs.get(g.0).map(|x| x.exec).ok_or_else(|| GpuError::Invalid(format!("no graph {}", g.0)))?;
        // SAFETY: an instantiated graph of this context, on our stream.
        unsafe { cu::graph::launch(exec, self.stream) }.map_err(|e| drv("cuGraphLaunch", e))
    }

    fn mark(&mut self) -> Result<MarkId> {
        self.bind()?;
        self.not_capturing("marking the time")?;
        if self.marks == self.events.len() {
            // timing events (not CU_EVENT_DISABLE_TIMING), destroyed in Drop
            let e = cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| drv("cuEventCreate", e))?;
            self.events.push(e);
        }
        let e = self.events[self.marks];
        // SAFETY: an event of this context, on our stream (not capturing).
        unsafe { cu::event::record(e, self.stream) }.map_err(|e| drv("cuEventRecord", e))?;
        self.marks += 1;
        Ok(MarkId(self.marks - 1))
    }

    fn elapsed_ms(&mut self, from: MarkId, to: MarkId) -> Result<f64> {
        self.bind()?;
        let at = |m: MarkId| (m.0 < self.marks).then(|| self.events[m.0]).ok_or_else(|| GpuError::Invalid(format!("no mark {}", m.0)));
        let (a, b) = (at(from)?, at(to)?);
        // SAFETY: two recorded events of this context, on one stream, alive until Drop.
        let ms = unsafe { cu::event::elapsed(a, b) }.map_err(|e| drv("cuEventElapsedTime", e))?;
        Ok(f64::from(ms))
    }

    fn clear_marks(&mut self) -> Result<()> {
        self.marks = 0;
        Ok(())
    }

    fn synchronize(&mut self) -> Result<()> {
        self.not_capturing("synchronizing")?;
        self.sync()
    }

    fn open_collectives(&mut self, comm: Arc<dyn Communicator>) -> Result<String> {
        self.bind()?;
        self.not_capturing("opening NCCL")?;
        // a second call replaces the first communicator (after its pending work)
        self.sync()?;
        self.nccl = None;
        let nccl = Nccl::open(&*comm)?;
        let words = nccl.version.clone();
        self.nccl = Some(nccl);
        Ok(words)
    }

    fn collective(&mut self, c: &DeviceCollective) -> Result<()> {
        self.bind()?;
        let nccl = self.nccl.as_ref().ok_or_else(|| GpuError::Invalid(format!("collective {}: NCCL was not opened", c.step.note)))?;
        nccl.run(c, self.stream)
    }
}

// SAFETY: the handles (context, stream, modules, graphs, pinned memory, BLAS handles, the NCCL
// communicator) are owned by
// this value alone and used only through `&mut self` or `&self` calls, one at a time (it is not
// Sync); each call makes the context current on its thread first (`bind`), which is all the
// driver API and cuBLAS need to be used from another thread. A capture begins and ends within
// one executor call, on one thread (the capture mode is thread-local).
unsafe impl Send for CudaDriver {}

impl Drop for CudaDriver {
    fn drop(&mut self) {
        let _ = self.bind();
        // Errors here cannot be returned; a sticky error was already reported by the call that
        // caused it. Everything is released in reverse order of creation.
        if self.capturing {
            // dropped mid-capture (a panic between begin and end): a capturing stream can be
            // neither synchronized nor destroyed, so the capture is ended and its graph dropped
            self.capturing = false;
            // SAFETY: our stream, capturing; the graph it returns (if any) is destroyed once, here.
            if let Ok(graph) = unsafe { cu::stream::end_capture(self.stream) } {
                if !graph.is_null() {
                    // SAFETY: as above.
                    let _ = unsafe { cu::graph::destroy(graph) };
                }
            }
        }
        let _ = self.sync();
        // NCCL's communicator before the stream and the context it uses
        self.nccl = None;
        self.blas = None;
        for g in self.graphs.drain(..) {
            // SAFETY: each graph and its exec were created once and are destroyed once, here.
            unsafe {
                let _ = cu::graph::exec_destroy(g.exec);
                let _ = cu::graph::destroy(g.graph);
            }
        }
        for e in self.events.drain(..) {
            // SAFETY: created once in `mark`, destroyed once; nothing pending (synchronized above).
            let _ = unsafe { cu::event::destroy(e) };
        }
        for m in self.modules.drain(..) {
            // SAFETY: loaded once, unloaded once; no launch is pending (synchronized above).
            let _ = unsafe { cu::module::unload(m.module) };
        }
        for (p, _) in self.pinned.drain(..).flatten() {
            // SAFETY: allocated by cuMemHostAlloc and not yet freed (free_pinned takes it out).
            let _ = unsafe { cu::free_host(p.cast()) };
        }
        // SAFETY: our stream, destroyed once; then the primary context retained in open.
        unsafe {
            let _ = cu::stream::destroy(self.stream);
            let _ = cu::primary_ctx::release(self.dev);
        }
    }
}
