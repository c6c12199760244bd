//! How a compiled step's collectives (`qatc_kernels::program::Collective`) reach the other ranks:
//! a [`Communicator`], passed to the executor as a value. One primitive, an all-gather of bytes,
//! is all a communicator provides; the reductions are computed here from every rank's operand, as
//! the reference interpreter's are (`crate::collective`): in f64, in rank order, rounded once to
//! the stored type. Every rank then holds the same bits as `Interpreter::run_ranks` gives, whatever
//! the transport and however it orders its sums, at the price of moving N blocks where a ring
//! all-reduce moves about 2 (the plan's bytes, `qatc plan --ranks`, state the ring's: what a
//! backend that reduces in the network, NCCL's, would move).
//!
//! Implementations: [`OneRank`] (the world of one: every collective gives its operand back) and,
//! with the `mpi` feature, [`mpi::MpiComm`] (Open MPI through rsmpi), the one place that links MPI;
//! [`threads::threads`], the ranks as threads of one process (for tests).

#[cfg(feature = "mpi")]
pub mod mpi;
pub mod threads;

use half::{bf16, f16};
use qatc_ir::{DType, Reduce};
use qatc_kernels::program::{Collective, Exchange};

use crate::error::RuntimeError;

/// The ranks a step runs on, and the one exchange they make.
pub trait Communicator: Send + Sync + std::fmt::Debug {
    /// This process's rank, 0-based.
    fn rank(&self) -> usize;
    /// How many ranks the world has.
    fn size(&self) -> usize;
    /// Every rank's `send` (the same length on all) into `recv`, in rank order: `recv` is
    /// `size()` times as long. A failed peer is an error naming it where the transport can.
    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> Result<(), RuntimeError>;
}

/// The world of one process: an all-gather is a copy.
#[derive(Clone, Copy, Debug, Default)]
pub struct OneRank;

impl Communicator for OneRank {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> Result<(), RuntimeError> {
        recv.copy_from_slice(send);
        Ok(())
    }
}

/// Rank 0's `bytes` on every rank (each rank's `bytes` of the same length; only rank 0's are
/// kept): an all-gather, everyone taking rank 0's block. How NCCL's unique id, made by rank 0,
/// reaches the others (`cuda/nccl.rs`).
pub fn from_rank0(comm: &dyn Communicator, bytes: &[u8]) -> Result<Vec<u8>, RuntimeError> {
    let mut all = vec![0u8; bytes.len() * comm.size()];
    comm.all_gather_bytes(bytes, &mut all)?;
    all.truncate(bytes.len());
    Ok(all)
}

/// An error of collective `c` (its note names the tensor).
pub fn collective_error(c: &Collective, msg: impl Into<String>) -> RuntimeError {
    RuntimeError::Collective { what: c.note.clone(), msg: msg.into() }
}

/// How an element of a float type is read as f64 and written back rounded (to nearest even).
type Read = fn(&[u8]) -> f64;
type Write = fn(f64, &mut [u8]);

/// Runs collective `c` over `comm`: `src` holds this rank's operand (contiguous, `c.src`'s
/// elements), `dst` receives this rank's result (contiguous, `c.dst`'s elements).
pub fn run(comm: &dyn Communicator, c: &Collective, dtype: DType, src: &[u8], dst: &mut [u8]) -> Result<(), RuntimeError> {
    if comm.size() != c.world {
        return Err(collective_error(c, format!("the step is compiled for {} ranks, the world has {}", c.world, comm.size())));
    }
    let (size, read, write): (usize, Read, Write) = match dtype {
        DType::F32 => (4, |b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])), |x, o| o.copy_from_slice(&(x as f32).to_le_bytes())),
        DType::BF16 => (2, |b| bf16::from_le_bytes([b[0], b[1]]).to_f64(), |x, o| o.copy_from_slice(&bf16::from_f64(x).to_le_bytes())),
        DType::F16 => (2, |b| f16::from_le_bytes([b[0], b[1]]).to_f64(), |x, o| o.copy_from_slice(&f16::from_f64(x).to_le_bytes())),
        other => return Err(collective_error(c, format!("exchanges float tensors (f32, bf16, f16), not {other}"))),
    };
    if !src.len().is_multiple_of(size) || src.len() / size != c.src_elements() {
        return Err(collective_error(c, format!("{} bytes sent for {} elements of {dtype}", src.len(), c.src_elements())));
    }
    let world = c.world;
    let mut all = vec![0u8; src.len() * world];
    comm.all_gather_bytes(src, &mut all)?;
    let reduce = match c.exchange {
        Exchange::AllGather => {
            if dst.len() != all.len() {
                return Err(collective_error(c, format!("{} bytes to receive {} gathered", dst.len(), all.len())));
            }
            dst.copy_from_slice(&all);
            return Ok(());
        }
        Exchange::AllReduce(r) | Exchange::ReduceScatter(r) => r,
    };
    let n = src.len() / size;
    // the result's elements: the whole sum, or this rank's block of it
    let range = match c.exchange {
        Exchange::ReduceScatter(_) => {
            let block = n / world;
            comm.rank() * block..(comm.rank() + 1) * block
        }
        _ => 0..n,
    };
    if dst.len() != range.len() * size {
        return Err(collective_error(c, format!("{} bytes to receive {} elements of {dtype}", dst.len(), range.len())));
    }
    // in f64, in rank order, rounded once (`crate::collective::combine`'s rule)
    for (j, i) in range.enumerate() {
        let s: f64 = (0..world).map(|r| read(&all[(r * n + i) * size..])).sum();
        let s = if reduce == Reduce::Mean { s * (1.0 / world as f64) } else { s };
        write(s, &mut dst[j * size..(j + 1) * size]);
    }
    Ok(())
}
