//! oneDNN's matmul primitive (the 2.x C API of `libdnnl.so.2`), for the bf16 GEMMs on a CPU with
//! AMX-BF16 tiles. `dnnl_gemm_bf16bf16f32` (onednn.rs) never runs on AMX: it is oneDNN's
//! AVX512-BF16 GEMM. The matmul primitive picks the brgemm kernels, which ask Linux for the tile
//! state and run on AMX, the path PyTorch's bf16 autocast takes on such a CPU. Measured on the
//! step's shapes (2-vCPU Sapphire Rapids-class KVM guest, bf16 operands, f32 result, same run,
//! bench/RESULTS.md): 256x2304x768 810-1375 GFLOP/s against the GEMM function's 357-408, the LM
//! head's 256x50257x768 with b transposed 955-1062 against 265-426.
//!
//! A primitive is made per shape, strides, thread count, alpha, accumulation and result type
//! (f32, or bf16 with or without a bias), which is slow (milliseconds) but happens once per
//! process for the step's few dozen shapes: they are cached. Products on one OpenMP thread
//! (`Shape::threads` 1: the attention's per-head products, which rayon's threads run side by
//! side) are cached per calling thread, with a stream of its own, so that they run in parallel;
//! the others share one cache behind a mutex. Where oneDNN would run a shape on
//! anything but its brgemm kernels (odd strides, tiny sizes), the cache remembers a refusal and
//! the caller falls back: to the GEMM function, or to f32 tiles for a bf16 result.
//!
//! The descriptors are opaque buffers sized past the 2.x headers' structs (`dnnl_memory_desc_t`
//! 696 bytes, `dnnl_matmul_desc_t` 2800 on Debian 12's oneDNN 2.6.3; `DNNL_MAX_NDIMS` fixes both
//! across 2.x), which the library only writes and reads through the pointers passed.

use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr};
use std::ptr::null_mut;
use std::sync::Mutex;

use libloading::Library;

type Handle = *mut c_void;
type Status = i32;
/// dnnl_engine_create(engine*, kind, index)
type EngineCreate = unsafe extern "C" fn(*mut Handle, i32, usize) -> Status;
/// dnnl_stream_create(stream*, engine, flags)
type StreamCreate = unsafe extern "C" fn(*mut Handle, Handle, u32) -> Status;
/// dnnl_memory_desc_init_by_strides(md*, ndims, dims, data_type, strides)
type MdInit = unsafe extern "C" fn(*mut MemDesc, i32, *const i64, i32, *const i64) -> Status;
/// dnnl_matmul_desc_init(desc*, src md*, weights md*, bias md*, dst md*)
type MatmulInit = unsafe extern "C" fn(*mut MatmulDesc, *const MemDesc, *const MemDesc, *const MemDesc, *const MemDesc) -> Status;
/// dnnl_primitive_desc_create(pd*, op desc, attr, engine, hint)
type PdCreate = unsafe extern "C" fn(*mut Handle, *const c_void, Handle, Handle, Handle) -> Status;
/// dnnl_primitive_desc_query(pd, what, index, result*)
type PdQuery = unsafe extern "C" fn(Handle, i32, i32, *mut c_void) -> Status;
/// dnnl_primitive_create(primitive*, pd) and dnnl_memory_create(memory*, md*, engine, handle)
type PrimCreate = unsafe extern "C" fn(*mut Handle, Handle) -> Status;
type MemCreate = unsafe extern "C" fn(*mut Handle, *const MemDesc, Handle, *mut c_void) -> Status;
/// dnnl_memory_set_data_handle(memory, handle)
type SetHandle = unsafe extern "C" fn(Handle, *mut c_void) -> Status;
/// dnnl_primitive_execute(primitive, stream, nargs, args)
type Execute = unsafe extern "C" fn(Handle, Handle, i32, *const ExecArg) -> Status;
/// dnnl_stream_wait, dnnl_primitive_desc_destroy, dnnl_primitive_attr_create, dnnl_post_ops_create, ...
type OneHandle = unsafe extern "C" fn(Handle) -> Status;
type CreateOut = unsafe extern "C" fn(*mut Handle) -> Status;
/// dnnl_primitive_attr_set_output_scales(attr, count, mask, scales)
type SetScales = unsafe extern "C" fn(Handle, i64, i32, *const f32) -> Status;
/// dnnl_post_ops_append_sum(post_ops, scale)
type AppendSum = unsafe extern "C" fn(Handle, f32) -> Status;
/// dnnl_primitive_attr_set_post_ops(attr, post_ops)
type SetPostOps = unsafe extern "C" fn(Handle, Handle) -> Status;

#[repr(C, align(8))]
struct MemDesc([u8; 1024]);
#[repr(C, align(8))]
struct MatmulDesc([u8; 4096]);
#[repr(C)]
struct ExecArg {
    arg: i32,
    memory: Handle,
}

const ENGINE_CPU: i32 = 1;
const STREAM_DEFAULT: u32 = 1;
const DT_BF16: i32 = 2;
const DT_F32: i32 = 3;
const ARG_SRC: i32 = 1;
const ARG_DST: i32 = 17;
const ARG_WEIGHTS: i32 = 33;
const ARG_BIAS: i32 = 41;
const QUERY_IMPL_INFO_STR: i32 = 8;

struct Fns {
    md_init: MdInit,
    matmul_init: MatmulInit,
    pd_create: PdCreate,
    pd_query: PdQuery,
    pd_destroy: OneHandle,
    prim_create: PrimCreate,
    mem_create: MemCreate,
    set_handle: SetHandle,
    execute: Execute,
    stream_wait: OneHandle,
    stream_create: StreamCreate,
    attr_create: CreateOut,
    attr_destroy: OneHandle,
    set_scales: SetScales,
    post_ops_create: CreateOut,
    post_ops_destroy: OneHandle,
    append_sum: AppendSum,
    set_post_ops: SetPostOps,
}

/// One product as the cache keys it: sizes, the three matrices' (row, column) strides in
/// elements, the OpenMP thread count the primitive was made for, alpha's bits, accumulation.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Shape {
    pub mnk: (usize, usize, usize),
    pub a: (usize, usize),
    pub b: (usize, usize),
    pub c: (usize, usize),
    pub threads: i32,
    pub alpha: u32,
    pub accumulate: bool,
    /// The result's type: f32, or bf16 rounded once to nearest even by the primitive, with an
    /// f32 bias row [n] added before the rounding when `bias`.
    pub out: Out,
}

/// What the primitive writes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Out {
    F32,
    Bf16 { bias: bool },
}

/// A primitive and the memory objects its calls point at their operands.
struct Entry {
    prim: Handle,
    src: Handle,
    weights: Handle,
    dst: Handle,
    /// The bias row's memory object (null without a bias).
    bias: Handle,
    impl_name: String,
    /// Calls it completed.
    runs: usize,
}

struct State {
    engine: Handle,
    stream: Handle,
    /// None: oneDNN would not run this shape on its brgemm kernels.
    cache: HashMap<Shape, Option<Entry>>,
}

// SAFETY: oneDNN's engines, streams, primitives and memory objects may be used from any thread;
// `Matmul` reaches them only through its mutex, one call at a time.
unsafe impl Send for State {}

/// A thread's own one-thread primitives, keyed by the engine they were made on (one per loaded
/// library) and shape, and its stream. Kept for the thread's life, like the shared cache for the
/// process's.
#[derive(Default)]
struct Local {
    stream: Option<(usize, Handle)>,
    cache: HashMap<(usize, Shape), Option<Entry>>,
}

impl Local {
    /// This thread's stream on `engine`, made on first use.
    fn stream(&mut self, f: &Fns, engine: Handle) -> Option<Handle> {
        match self.stream {
            Some((e, s)) if e == engine as usize => Some(s),
            _ => {
                let mut s = null_mut();
                // SAFETY: `engine` is the library's live engine; the stream is kept for the
                // thread's life (a stream of another engine is left, as the process leaves its own).
                (unsafe { (f.stream_create)(&mut s, engine, STREAM_DEFAULT) } == 0).then(|| {
                    self.stream = Some((engine as usize, s));
                    s
                })
            }
        }
    }
}

thread_local! {
    static LOCAL: std::cell::RefCell<Local> = std::cell::RefCell::new(Local::default());
}

/// oneDNN's matmul primitive with bf16 operands and an f32 result, cached per shape.
pub struct Matmul {
    fns: Fns,
    state: Mutex<State>,
}

impl Matmul {
    /// The primitive's functions in `lib` (a 2.x oneDNN), an engine and a stream; None if any is
    /// missing (a 3.x library has none of the op descriptors).
    pub fn open(lib: &Library) -> Option<Matmul> {
        // SAFETY: the symbols are looked up with the signatures of oneDNN 2.x's dnnl.h.
        unsafe {
            let f = Fns {
                md_init: *lib.get(b"dnnl_memory_desc_init_by_strides\0").ok()?,
                matmul_init: *lib.get(b"dnnl_matmul_desc_init\0").ok()?,
                pd_create: *lib.get(b"dnnl_primitive_desc_create\0").ok()?,
                pd_query: *lib.get(b"dnnl_primitive_desc_query\0").ok()?,
                pd_destroy: *lib.get(b"dnnl_primitive_desc_destroy\0").ok()?,
                prim_create: *lib.get(b"dnnl_primitive_create\0").ok()?,
                mem_create: *lib.get(b"dnnl_memory_create\0").ok()?,
                set_handle: *lib.get(b"dnnl_memory_set_data_handle\0").ok()?,
                execute: *lib.get(b"dnnl_primitive_execute\0").ok()?,
                stream_wait: *lib.get(b"dnnl_stream_wait\0").ok()?,
                stream_create: *lib.get(b"dnnl_stream_create\0").ok()?,
                attr_create: *lib.get(b"dnnl_primitive_attr_create\0").ok()?,
                attr_destroy: *lib.get(b"dnnl_primitive_attr_destroy\0").ok()?,
                set_scales: *lib.get(b"dnnl_primitive_attr_set_output_scales\0").ok()?,
                post_ops_create: *lib.get(b"dnnl_post_ops_create\0").ok()?,
                post_ops_destroy: *lib.get(b"dnnl_post_ops_destroy\0").ok()?,
                append_sum: *lib.get(b"dnnl_post_ops_append_sum\0").ok()?,
                set_post_ops: *lib.get(b"dnnl_primitive_attr_set_post_ops\0").ok()?,
            };
            let engine_create: EngineCreate = *lib.get(b"dnnl_engine_create\0").ok()?;
            let (mut engine, mut stream) = (null_mut(), null_mut());
            if engine_create(&mut engine, ENGINE_CPU, 0) != 0 || (f.stream_create)(&mut stream, engine, STREAM_DEFAULT) != 0 {
                return None;
            }
            Some(Matmul { fns: f, state: Mutex::new(State { engine, stream, cache: HashMap::new() }) })
        }
    }

    /// c = alpha a @ b (+ bias) (+ c when `s.accumulate`) by the cached primitive for `s`, made
    /// on first use with the calling thread's OpenMP thread count; false, nothing done, when
    /// oneDNN runs this shape on anything but its brgemm kernels or refuses it.
    ///
    /// # Safety
    /// As `Bf16Gemm::gemm`: a, b and c (of `s.out`'s type) live and in bounds for `s`'s sizes and
    /// strides, c apart from a and b and untouched by anything else meanwhile; `bias` [n] f32
    /// when `s.out` has one.
    pub unsafe fn run(&self, s: &Shape, a: *const u16, b: *const u16, c: *mut c_void, bias: *const f32) -> bool {
        if s.threads == 1 {
            let engine = self.state.lock().unwrap_or_else(|e| e.into_inner()).engine;
            return LOCAL.with_borrow_mut(|local| {
                let Some(stream) = local.stream(&self.fns, engine) else { return false };
                let Some(e) = local.cache.entry((engine as usize, *s)).or_insert_with(|| self.make(engine, s)) else { return false };
                // SAFETY: the caller's contract; the entry and the stream are this thread's alone.
                unsafe { self.execute(e, stream, (a, b, c, bias)) }
            });
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let State { engine, stream, cache } = &mut *st;
        let Some(e) = cache.entry(*s).or_insert_with(|| self.make(*engine, s)) else { return false };
        // SAFETY: the caller's contract; the mutex keeps other calls off the entry and the stream.
        unsafe { self.execute(e, *stream, (a, b, c, bias)) }
    }

    /// Runs entry `e` on `stream` with these operands (a, b, c, bias).
    ///
    /// # Safety
    /// As [`Matmul::run`]'s, for the shape `e` was made for; nothing else uses `e` or `stream`
    /// meanwhile.
    unsafe fn execute(&self, e: &mut Entry, stream: Handle, (a, b, c, bias): (*const u16, *const u16, *mut c_void, *const f32)) -> bool {
        let f = &self.fns;
        // SAFETY: the memory objects were made for the entry's descriptors; the caller's contract
        // makes the pointers valid for them and keeps other calls off these objects; the
        // primitive runs to completion before `stream_wait` returns.
        unsafe {
            if (f.set_handle)(e.src, a.cast_mut().cast()) != 0
                || (f.set_handle)(e.weights, b.cast_mut().cast()) != 0
                || (f.set_handle)(e.dst, c) != 0
                || (!e.bias.is_null() && (f.set_handle)(e.bias, bias.cast_mut().cast()) != 0)
            {
                return false;
            }
            let args = [
                ExecArg { arg: ARG_SRC, memory: e.src },
                ExecArg { arg: ARG_WEIGHTS, memory: e.weights },
                ExecArg { arg: ARG_DST, memory: e.dst },
                ExecArg { arg: ARG_BIAS, memory: e.bias },
            ];
            let nargs = if e.bias.is_null() { 3 } else { 4 };
            let done = (f.execute)(e.prim, stream, nargs, args.as_ptr()) == 0 && (f.stream_wait)(stream) == 0;
            e.runs += usize::from(done);
            done
        }
    }

    /// The implementation oneDNN chose for `s` ("brg:avx512_core_amx_bf16") and how many calls
    /// it completed, once `run` made it; None if it has not, or refused it.
    #[cfg(test)]
    pub fn implementation(&self, s: &Shape) -> Option<(String, usize)> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.threads == 1 {
            let key = (st.engine as usize, *s);
            return LOCAL.with_borrow(|l| l.cache.get(&key)?.as_ref().map(|e| (e.impl_name.clone(), e.runs)));
        }
        st.cache.get(s)?.as_ref().map(|e| (e.impl_name.clone(), e.runs))
    }

    /// Calls completed by the primitives made so far that write bf16.
    #[cfg(test)]
    pub fn runs_into_bf16(&self) -> usize {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let local: usize = LOCAL
            .with_borrow(|l| l.cache.iter().filter(|(k, _)| k.1.out != Out::F32).filter_map(|(_, e)| e.as_ref()).map(|e| e.runs).sum());
        local + st.cache.iter().filter(|(s, _)| s.out != Out::F32).filter_map(|(_, e)| e.as_ref()).map(|e| e.runs).sum::<usize>()
    }

    /// The primitive and memory objects for `s`, if oneDNN runs it on its brgemm kernels.
    fn make(&self, engine: Handle, s: &Shape) -> Option<Entry> {
        let f = &self.fns;
        let (m, n, k) = s.mnk;
        let md = |rows: usize, cols: usize, (rs, cs): (usize, usize), dt: i32| -> Option<Box<MemDesc>> {
            let mut d = Box::new(MemDesc([0; 1024]));
            let (dims, strides) = ([rows as i64, cols as i64], [rs as i64, cs as i64]);
            // SAFETY: `d` is larger than the library's descriptor; dims and strides hold 2 each.
            (unsafe { (f.md_init)(&mut *d, 2, dims.as_ptr(), dt, strides.as_ptr()) } == 0).then_some(d)
        };
        let dst_type = if s.out == Out::F32 { DT_F32 } else { DT_BF16 };
        let (src, wei, dst) = (md(m, k, s.a, DT_BF16)?, md(k, n, s.b, DT_BF16)?, md(m, n, s.c, dst_type)?);
        let bias = if s.out == (Out::Bf16 { bias: true }) { Some(md(1, n, (n, 1), DT_F32)?) } else { None };
        let mut desc = Box::new(MatmulDesc([0; 4096]));
        // SAFETY (this block): descriptors made above; every handle made here is destroyed here or
        // kept in the entry; the attribute and post-ops objects are the library's own.
        unsafe {
            let bias_md = bias.as_deref().map_or(std::ptr::null(), |b| b as *const MemDesc);
            if (f.matmul_init)(&mut *desc, &*src, &*wei, bias_md, &*dst) != 0 {
                return None;
            }
            let mut attr = null_mut();
            if (f.attr_create)(&mut attr) != 0 {
                return None;
            }
            let alpha = f32::from_bits(s.alpha);
            let mut ok = alpha == 1.0 || (f.set_scales)(attr, 1, 0, &alpha) == 0;
            if ok && s.accumulate {
                let mut po = null_mut();
                ok = (f.post_ops_create)(&mut po) == 0;
                ok = ok && (f.append_sum)(po, 1.0) == 0 && (f.set_post_ops)(attr, po) == 0;
                if !po.is_null() {
                    (f.post_ops_destroy)(po);
                }
            }
            let mut pd = null_mut();
            ok = ok && (f.pd_create)(&mut pd, (&*desc as *const MatmulDesc).cast(), attr, engine, null_mut()) == 0;
            (f.attr_destroy)(attr);
            if !ok {
                return None;
            }
            let mut name: *const c_char = std::ptr::null();
            let impl_name = if (f.pd_query)(pd, QUERY_IMPL_INFO_STR, 0, (&mut name as *mut *const c_char).cast()) == 0 && !name.is_null() {
                CStr::from_ptr(name).to_string_lossy().into_owned()
            } else {
                String::new()
            };
            let mut e =
                Entry { prim: null_mut(), src: null_mut(), weights: null_mut(), dst: null_mut(), bias: null_mut(), impl_name, runs: 0 };
            let brgemm = e.impl_name.starts_with("brg");
            let made = brgemm
                && (f.prim_create)(&mut e.prim, pd) == 0
                && (f.mem_create)(&mut e.src, &*src, engine, null_mut()) == 0
                && (f.mem_create)(&mut e.weights, &*wei, engine, null_mut()) == 0
                && (f.mem_create)(&mut e.dst, &*dst, engine, null_mut()) == 0
                && bias.as_deref().is_none_or(|b| (f.mem_create)(&mut e.bias, b, engine, null_mut()) == 0);
            (f.pd_destroy)(pd);
            // a failed entry's objects are leaked: the library failed to make them, a case that
            // has not been seen, and the process keeps only the refusal
            made.then_some(e)
        }
    }
}
