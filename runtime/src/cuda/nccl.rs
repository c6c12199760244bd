//! NCCL on the CUDA driver's stream: a step's collectives in-stream on the arena's device memory,
//! one rank per GPU, through cudarc's thin `result` layer.
//!
//! cudarc loads libnccl at run time and panics when it is missing, so [`probe_nccl`] asks
//! `is_culib_present` first and [`Nccl::open`] returns [`GpuError::Unavailable`] instead; nothing
//! here calls into NCCL before that. The unique id NCCL needs on every rank is made by rank 0 and
//! carried to the others by the step's [`Communicator`] (MPI under `mpirun`): NCCL never reads the
//! environment for it.
//!
//! NCCL sums in its own order (a ring's or a tree's, in the element type), so its results agree
//! with the host rule's (`comm::run`: f64, rank order, one rounding) within rounding, not bit for
//! bit; at one rank every collective is a copy and the two agree exactly.

use std::ffi::{c_int, CStr};

use cudarc::driver::sys::CUstream;
use cudarc::nccl::result::{self as nc, NcclError};
use cudarc::nccl::sys as ncs;
use qatc_ir::{DType, Reduce};
use qatc_kernels::program::Exchange;

use super::{DeviceCollective, GpuError, Result};
use crate::comm::{self, Communicator};

/// The oldest NCCL qatc runs on: 2.10 brought bf16 (ncclBfloat16) and ncclAvg.
const OLDEST: c_int = 21000;

/// An NCCL error with the call that failed and NCCL's name and string for it.
fn nccl_err(call: &str, e: NcclError) -> GpuError {
    // SAFETY: ncclGetErrorString returns a static string for any status; it is called only after
    // the library was found present (every caller is past `probe_nccl`).
    let text = unsafe {
        let p = ncs::ncclGetErrorString(e.0);
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    GpuError::Nccl { call: call.into(), status: format!("{:?} ({text})", e.0) }
}

/// Ok when NCCL (libnccl.so.2) loads; why not otherwise.
pub fn probe_nccl() -> Result<()> {
    // SAFETY: `is_culib_present` only tries to dlopen libnccl's candidate names and drops what it
    // opened; it is the check that keeps later cudarc NCCL calls from panicking.
    if unsafe { ncs::is_culib_present() } {
        Ok(())
    } else {
        Err(GpuError::Unavailable(
            "NCCL (libnccl.so.2) not found on the loader's path (LD_LIBRARY_PATH): install NCCL 2.10 or later, or run the step's collectives staged through the host (Collectives::Host)".into(),
        ))
    }
}

/// NCCL's version number in words: 22703 is "2.27.3" (NCCL_VERSION's encoding since 2.9).
fn version_words(v: c_int) -> String {
    if v >= 10000 {
        format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
    } else {
        format!("{}.{}.{}", v / 1000, v / 100 % 10, v % 100)
    }
}

/// One NCCL communicator: this process's rank of the step's world, on the device whose context
/// was current when it was opened.
pub(super) struct Nccl {
    comm: ncs::ncclComm_t,
    pub(super) version: String,
}

impl Nccl {
    /// Joins `comm`'s world: checks that NCCL loads and is recent enough, has rank 0 make the
    /// unique id and `comm` carry it to every rank, then initializes this rank's communicator
    /// (collective: every rank calls this at once). The device's context must be current.
    pub(super) fn open(comm: &dyn Communicator) -> Result<Nccl> {
        probe_nccl()?;
        let v = nc::get_nccl_version().map_err(|e| nccl_err("ncclGetVersion", e))?;
        if v < OLDEST {
            return Err(GpuError::Unavailable(format!("NCCL {} found; qatc needs 2.10 or later (bf16, ncclAvg)", version_words(v))));
        }
        let (rank, size) = (comm.rank(), comm.size());
        let (Ok(r), Ok(n)) = (c_int::try_from(rank), c_int::try_from(size)) else {
            return Err(GpuError::Invalid(format!("rank {rank} of {size}: more than NCCL's int")));
        };
        let mut id = ncs::ncclUniqueId { internal: [0; 128] };
        if rank == 0 {
            id = nc::get_uniqueid().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
        }
        let mine: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
        let shared = comm::from_rank0(comm, &mine).map_err(|e| GpuError::Invalid(format!("sharing NCCL's unique id: {e}")))?;
        for (d, s) in id.internal.iter_mut().zip(&shared) {
            *d = *s as std::ffi::c_char;
        }
        let mut c: ncs::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `c` receives the communicator; the id is rank 0's, the same on every rank; the
        // caller made the device's context current (NCCL binds the communicator to it).
        unsafe { nc::comm_init_rank(&mut c, n, id, r) }.map_err(|e| nccl_err(&format!("ncclCommInitRank(rank {rank} of {size})"), e))?;
        Ok(Nccl { comm: c, version: format!("NCCL {}", version_words(v)) })
    }

    /// Enqueues collective `c` on `stream` (recorded into the graph while the stream captures).
    pub(super) fn run(&self, c: &DeviceCollective, stream: CUstream) -> Result<()> {
        let ty = match c.dtype {
            DType::F32 => ncs::ncclDataType_t::ncclFloat32,
            DType::BF16 => ncs::ncclDataType_t::ncclBfloat16,
            DType::F16 => ncs::ncclDataType_t::ncclFloat16,
            other => return Err(GpuError::Invalid(format!("NCCL exchanges float tensors (f32, bf16, f16), not {other}"))),
        };
        let op = |r: Reduce| match r {
            Reduce::Sum => ncs::ncclRedOp_t::ncclSum,
            // the sum divided by the ranks, in NCCL (2.10+)
            Reduce::Mean => ncs::ncclRedOp_t::ncclAvg,
        };
        let (src, dst) = (c.src as *const std::ffi::c_void, c.dst as *mut std::ffi::c_void);
        let stream: ncs::cudaStream_t = stream.cast();
        let (n, m) = (c.step.src.numel(), c.step.dst.numel());
        // SAFETY: `src` and `dst` are device addresses of the program's arena, `n` and `m` elements
        // of `ty` there (`exec::check_collective` sized them for the exchange and its world, and
        // they do not overlap); the communicator and the stream are alive, on the same device.
        let status = unsafe {
            match c.step.exchange {
                Exchange::AllReduce(r) => nc::all_reduce(src, dst, n, ty, op(r), self.comm, stream),
                Exchange::ReduceScatter(r) => nc::reduce_scatter(src, dst, m, ty, op(r), self.comm, stream),
                Exchange::AllGather => nc::all_gather(src, dst, n, ty, self.comm, stream),
            }
        };
        let call = match c.step.exchange {
            Exchange::AllReduce(_) => "ncclAllReduce",
            Exchange::ReduceScatter(_) => "ncclReduceScatter",
            Exchange::AllGather => "ncclAllGather",
        };
        status.map(|_| ()).map_err(|e| nccl_err(call, e))
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // SAFETY: the communicator was initialized in `open` and is destroyed once, here; the
        // owner synchronized its stream first, so no collective is pending.
        let _ = unsafe { nc::comm_destroy(self.comm) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_read_as_nccl_writes_them() {
        assert_eq!(version_words(22703), "2.27.3");
        assert_eq!(version_words(21005), "2.10.5");
        assert_eq!(version_words(2804), "2.8.4");
    }
}
