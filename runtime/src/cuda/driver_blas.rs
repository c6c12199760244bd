//! The GEMM calls of [`CudaDriver`](super::CudaDriver): a plan's call without a bias through
//! cuBLAS' `cublasGemmStridedBatchedEx`, one with a bias through cuBLASLt (its BIAS epilogue).
//! Both get a fixed workspace, so a call captured into a graph allocates nothing. Compute types:
//! `CUBLAS_COMPUTE_32F` for strict fp32 and for 16-bit operands (fp32 accumulate),
//! `CUBLAS_COMPUTE_32F_FAST_TF32` for TF32.

use std::ffi::c_void;

use cudarc::cublas::result as blas;
use cudarc::cublas::sys as bsys;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys as lsys;
use cudarc::driver::result as cu;
use cudarc::driver::sys;
use qatc_kernels::cuda::blas::{BlasCall, Compute, ElemType, Matrix, Op};

use super::driver::drv;
use super::{DevPtr, GemmPtrs, GpuError, Result};

use qatc_kernels::cuda::blas::WORKSPACE_BYTES as WORKSPACE;

pub struct Blas {
    handle: bsys::cublasHandle_t,
    lt: lsys::cublasLtHandle_t,
    stream: sys::CUstream,
    workspace: DevPtr,
}

fn status(call: &str, e: impl std::fmt::Debug) -> GpuError {
    GpuError::Blas { call: call.into(), status: format!("{e:?}") }
}

fn int(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x).map_err(|_| GpuError::Invalid(format!("{what} {x} does not fit cuBLAS' int")))
}

impl Blas {
    pub fn new(stream: sys::CUstream) -> Result<Blas> {
        let handle = blas::create_handle().map_err(|e| status("cublasCreate", e))?;
        let lt = lt::create_handle().map_err(|e| status("cublasLtCreate", e))?;
        // SAFETY: an allocation in the current context, freed in Drop.
        let workspace = unsafe { cu::malloc_sync(WORKSPACE) }.map_err(|e| drv("cuMemAlloc(BLAS workspace)", e))?;
        let b = Blas { handle, lt, stream, workspace };
        // SAFETY: a live handle; the stream and workspace outlive it (Drop destroys the handle first).
        unsafe {
            bsys::cublasSetStream_v2(handle, stream.cast()).result().map_err(|e| status("cublasSetStream", e))?;
            bsys::cublasSetWorkspace_v2(handle, workspace as *mut c_void, WORKSPACE)
                .result()
                .map_err(|e| status("cublasSetWorkspace", e))?;
        }
        Ok(b)
    }

    /// cuBLAS' and cuBLASLt's versions as loaded, e.g. "cuBLAS 13.1.0, cuBLASLt 13.1.0" (a
    /// CUDA 12 library from a PyTorch wheel would say so here).
    pub fn versions(&self) -> String {
        // cuBLAS: major * 10000 + minor * 100 + patch (CUBLAS_VERSION's encoding); cuBLASLt the same
        let v = |x: i64| format!("{}.{}.{}", x / 10000, x % 10000 / 100, x % 100);
        let mut blas_version = 0;
        // SAFETY: a live handle; the call writes one int.
        let blas = match unsafe { bsys::cublasGetVersion_v2(self.handle, &mut blas_version) }.result() {
            Ok(()) => v(i64::from(blas_version)),
            Err(e) => format!("unknown ({e:?})"),
        };
        // SAFETY: takes nothing, returns the loaded library's version.
        let lt_version = unsafe { lsys::cublasLtGetVersion() };
        format!("cuBLAS {blas}, cuBLASLt {}", v(lt_version as i64))
    }

    pub fn gemm(&mut self, c: &BlasCall, compute: Compute, ptrs: GemmPtrs) -> Result<()> {
        let at = |base: DevPtr, x: &Matrix| base + (x.offset * x.ty.bytes()) as u64;
        let (a, b, d) = (at(ptrs.a, &c.a), at(ptrs.b, &c.b), at(ptrs.c, &c.c));
        match (&c.bias, ptrs.bias) {
            (None, _) => self.strided_batched(c, compute, a, b, d),
            (Some(v), Some(p)) => self.lt_bias(c, compute, a, b, d, p + (v.offset * v.ty.bytes()) as u64),
            (Some(_), None) => Err(GpuError::Invalid("a GEMM with a bias and no bias pointer".into())),
        }
    }

    fn strided_batched(&mut self, c: &BlasCall, compute: Compute, a: DevPtr, b: DevPtr, d: DevPtr) -> Result<()> {
        let op = |o: Op| if o == Op::N { bsys::cublasOperation_t::CUBLAS_OP_N } else { bsys::cublasOperation_t::CUBLAS_OP_T };
        let ty = |t: ElemType| match t {
            ElemType::F32 => bsys::cudaDataType_t::CUDA_R_32F,
            ElemType::F16 => bsys::cudaDataType_t::CUDA_R_16F,
            ElemType::BF16 => bsys::cudaDataType_t::CUDA_R_16BF,
        };
        let ct = match compute {
            Compute::Tf32 => bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            Compute::F32 | Compute::F32Acc16 => bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        };
        let (alpha, beta) = (c.alpha, c.beta);
        // SAFETY: a live handle bound to our stream; the pointers are device addresses of the
        // plan's operands, whose layouts the planner made legal (ld >= rows as stored); alpha and
        // beta are f32, as the 32F compute types take them; they live until the call returns
        // (cuBLAS reads host scalars before returning).
        unsafe {
            blas::gemm_strided_batched_ex(
                self.handle,
                op(c.ta),
                op(c.tb),
                int(c.m, "m")?,
                int(c.n, "n")?,
                int(c.k, "k")?,
                (&alpha as *const f32).cast(),
                a as *const c_void,
                ty(c.a.ty),
                int(c.a.ld, "lda")?,
                c.a.stride as i64,
                b as *const c_void,
                ty(c.b.ty),
                int(c.b.ld, "ldb")?,
                c.b.stride as i64,
                (&beta as *const f32).cast(),
                d as *mut c_void,
                ty(c.c.ty),
                int(c.c.ld, "ldc")?,
                c.c.stride as i64,
                int(c.batch, "batch")?,
                ct,
                bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| status("cublasGemmStridedBatchedEx", e))
    }

    #[allow(clippy::too_many_arguments)]
    fn lt_bias(&mut self, c: &BlasCall, compute: Compute, a: DevPtr, b: DevPtr, d: DevPtr, bias: DevPtr) -> Result<()> {
        let ty = |t: ElemType| match t {
            ElemType::F32 => lsys::cudaDataType_t::CUDA_R_32F,
            ElemType::F16 => lsys::cudaDataType_t::CUDA_R_16F,
            ElemType::BF16 => lsys::cudaDataType_t::CUDA_R_16BF,
        };
        let ct = match compute {
            Compute::Tf32 => lsys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            Compute::F32 | Compute::F32Acc16 => lsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        };
        // cuBLASLt's TRANSA/TRANSB attributes hold a cublasOperation_t (cuBLAS' enum, 32 bits)
        let op = |o: Op| if o == Op::N { bsys::cublasOperation_t::CUBLAS_OP_N } else { bsys::cublasOperation_t::CUBLAS_OP_T };
        fn lt_err(call: &'static str) -> impl Fn(lt::CublasError) -> GpuError {
            move |e| status(call, e)
        }
        let desc = lt::create_matmul_desc(ct, lsys::cudaDataType_t::CUDA_R_32F).map_err(lt_err("cublasLtMatmulDescCreate"))?;
        let guard = LtObjects { desc, layouts: Vec::new(), pref: None };
        let rows = c.stored_rows();
        let cols = [if c.ta == Op::N { c.k } else { c.m }, if c.tb == Op::N { c.n } else { c.k }, c.n];
        let mut g = guard;
        for (i, x) in [&c.a, &c.b, &c.c].into_iter().enumerate() {
            let l = lt::create_matrix_layout(ty(x.ty), rows[i] as u64, cols[i] as u64, x.ld as i64)
                .map_err(lt_err("cublasLtMatrixLayoutCreate"))?;
            g.layouts.push(l);
            if c.batch > 1 {
                let (count, stride) = (c.batch as i32, x.stride as i64);
                // SAFETY: a live layout; the buffers are the attribute's documented types
                // (int32 count, int64 stride) and sizes.
                unsafe {
                    lt::set_matrix_layout_attribute(
                        l,
                        lsys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                        (&count as *const i32).cast(),
                        4,
                    )
                    .map_err(lt_err("cublasLtMatrixLayoutSetAttribute(BATCH_COUNT)"))?;
                    lt::set_matrix_layout_attribute(
                        l,
                        lsys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                        (&stride as *const i64).cast(),
                        8,
                    )
                    .map_err(lt_err("cublasLtMatrixLayoutSetAttribute(STRIDED_BATCH_OFFSET)"))?;
                }
            }
        }
        let (ta, tb) = (op(c.ta), op(c.tb));
        let epilogue = lsys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
        let bias_ptr = bias as *const c_void;
        let bias_ty = ty(c.bias.map_or(ElemType::F32, |v| v.ty));
        let set = |attr: lsys::cublasLtMatmulDescAttributes_t, p: *const c_void, n: usize, what: &str| -> Result<()> {
            // SAFETY: a live descriptor; `p` points at a value of the attribute's type and size.
            unsafe { lt::set_matmul_desc_attribute(desc, attr, p, n) }
                .map_err(|e| status(&format!("cublasLtMatmulDescSetAttribute({what})"), e))
        };
        use lsys::cublasLtMatmulDescAttributes_t as A;
        set(A::CUBLASLT_MATMUL_DESC_TRANSA, (&ta as *const bsys::cublasOperation_t).cast(), std::mem::size_of_val(&ta), "TRANSA")?;
        set(A::CUBLASLT_MATMUL_DESC_TRANSB, (&tb as *const bsys::cublasOperation_t).cast(), std::mem::size_of_val(&tb), "TRANSB")?;
        set(
            A::CUBLASLT_MATMUL_DESC_EPILOGUE,
            (&epilogue as *const lsys::cublasLtEpilogue_t).cast(),
            std::mem::size_of_val(&epilogue),
            "EPILOGUE",
        )?;
        set(
            A::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
            (&bias_ptr as *const *const c_void).cast(),
            std::mem::size_of_val(&bias_ptr),
            "BIAS_POINTER",
        )?;
        set(
            A::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
            (&bias_ty as *const lsys::cudaDataType_t).cast(),
            std::mem::size_of_val(&bias_ty),
            "BIAS_DATA_TYPE",
        )?;
        let pref = lt::create_matmul_pref().map_err(lt_err("cublasLtMatmulPreferenceCreate"))?;
        g.pref = Some(pref);
        let ws = WORKSPACE as u64;
        // SAFETY: a live preference; a u64 workspace size.
        unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                lsys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const u64).cast(),
                8,
            )
        }
        .map_err(lt_err("cublasLtMatmulPreferenceSetAttribute"))?;
        // The heuristic sees no pointer: unless told, it assumes 256-byte aligned operands and
        // may pick an algorithm that rejects an operand at an offset (a concat's slice, a looped
        // call's batch). Each operand's alignment: the largest power of two, up to 256, dividing
        // its address and, batched, its batch stride in bytes.
        let align = |p: DevPtr, x: &Matrix| -> u32 {
            let stride = if c.batch > 1 { (x.stride * x.ty.bytes()) as u64 } else { 0 };
            1u32 << (p | stride | 256).trailing_zeros()
        };
        use lsys::cublasLtMatmulPreferenceAttributes_t as P;
        for (attr, bytes, what) in [
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align(a, &c.a), "MIN_ALIGNMENT_A_BYTES"),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align(b, &c.b), "MIN_ALIGNMENT_B_BYTES"),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align(d, &c.c), "MIN_ALIGNMENT_C_BYTES"),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align(d, &c.c), "MIN_ALIGNMENT_D_BYTES"),
        ] {
            // SAFETY: a live preference; the attribute is a uint32_t.
            unsafe { lt::set_matmul_pref_attribute(pref, attr, (&bytes as *const u32).cast(), 4) }
                .map_err(|e| status(&format!("cublasLtMatmulPreferenceSetAttribute({what})"), e))?;
        }
        let (la, lb, lc) = (g.layouts[0], g.layouts[1], g.layouts[2]);
        // SAFETY: live handle, descriptor, layouts and preference.
        let heuristic = unsafe { lt::get_matmul_algo_heuristic(self.lt, desc, la, lb, lc, lc, pref) }.map_err(|e| {
            status(
                &format!(
                    "cublasLtMatmulAlgoGetHeuristic (m {} n {} k {}, {:?}/{:?}/{:?}, ld {}/{}/{}, bias epilogue)",
                    c.m, c.n, c.k, c.a.ty, c.b.ty, c.c.ty, c.a.ld, c.b.ld, c.c.ld
                ),
                e,
            )
        })?;
        let (alpha, beta) = (c.alpha, c.beta);
        // SAFETY: as `strided_batched`; D is C (in place, same layout, which cuBLASLt allows);
        // the algorithm came from the heuristic for these descriptors; the workspace is ours.
        unsafe {
            lt::matmul(
                self.lt,
                desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                a as *const c_void,
                la,
                b as *const c_void,
                lb,
                d as *const c_void,
                lc,
                d as *mut c_void,
                lc,
                &heuristic.algo,
                self.workspace as *mut c_void,
                WORKSPACE,
                self.stream.cast(),
            )
        }
        .map_err(lt_err("cublasLtMatmul"))?;
        drop(g);
        Ok(())
    }
}

/// cuBLASLt descriptors of one call, destroyed when it ends (cuBLASLt copies what it needs at
/// enqueue time).
struct LtObjects {
    desc: lsys::cublasLtMatmulDesc_t,
    layouts: Vec<lsys::cublasLtMatrixLayout_t>,
    pref: Option<lsys::cublasLtMatmulPreference_t>,
}

impl Drop for LtObjects {
    fn drop(&mut self) {
        // SAFETY: each object was created once by this call and is destroyed once, here.
        unsafe {
            for l in self.layouts.drain(..) {
                let _ = lt::destroy_matrix_layout(l);
            }
            if let Some(p) = self.pref.take() {
                let _ = lt::destroy_matmul_pref(p);
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: handles created once in `new`, destroyed once; the workspace last, after the
        // handles that use it (the owning CudaDriver synchronized its stream before dropping us).
        unsafe {
            let _ = blas::destroy_handle(self.handle);
            let _ = lt::destroy_handle(self.lt);
            let _ = cu::free_sync(self.workspace);
        }
    }
}
