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
//! with the `mpi` feature, [`mpi::MpiComm`] (Open MPI through rsmpi), the one place that links MPI.

#[cfg(feature = "mpi")]
pub mod mpi;

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

/// An error of collective `c` (its note names the tensor).
pub fn collective_error(c: &Collective, msg: impl Into<String>) -> RuntimeError {
    RuntimeError::Collective { what: c.note.clone(), msg: msg.into() }
}

/// Runs collective `c` over `comm`: `src` holds this rank's operand (contiguous, `c.src`'s
/// elements), `dst` receives this rank's result (contiguous, `c.dst`'s elements).
pub fn run(comm: &dyn Communicator, c: &Collective, dtype: DType, src: &[u8], dst: &mut [u8]) -> Result<(), RuntimeError> {
    if comm.size() != c.world {
        return Err(collective_error(c, format!("the step is compiled for {} ranks, the world has {}", c.world, comm.size())));
    }
    let size = match dtype {
        DType::F32 => 4,
        DType::BF16 | DType::F16 => 2,
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
    match dtype {
        DType::F32 => reduce_as::<f32>(
            &all,
            n,
            world,
            reduce,
            range,
            dst,
            |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
            |x| (x as f32).to_le_bytes().to_vec(),
        ),
        DType::BF16 => reduce_as::<bf16>(
            &all,
            n,
            world,
            reduce,
            range,
            dst,
            |b| bf16::from_le_bytes([b[0], b[1]]).to_f64(),
            |x| bf16::from_f64(x).to_le_bytes().to_vec(),
        ),
        DType::F16 => reduce_as::<f16>(
            &all,
            n,
            world,
            reduce,
            range,
            dst,
            |b| f16::from_le_bytes([b[0], b[1]]).to_f64(),
            |x| f16::from_f64(x).to_le_bytes().to_vec(),
        ),
        _ => unreachable!("sized above"),
    }
    Ok(())
}

/// Elements `range` of the sum (or mean) over `world` ranks' `n` elements each, laid side by side
/// in `all`, into `dst`: in f64, in rank order, rounded once (`crate::collective::combine`'s rule).
#[allow(clippy::too_many_arguments)]
fn reduce_as<T>(
    all: &[u8],
    n: usize,
    world: usize,
    reduce: Reduce,
    range: std::ops::Range<usize>,
    dst: &mut [u8],
    read: impl Fn(&[u8]) -> f64,
    write: impl Fn(f64) -> Vec<u8>,
) {
    let size = std::mem::size_of::<T>();
    for (j, i) in range.enumerate() {
        let s: f64 = (0..world).map(|r| read(&all[(r * n + i) * size..])).sum();
        let s = if reduce == Reduce::Mean { s * (1.0 / world as f64) } else { s };
        dst[j * size..(j + 1) * size].copy_from_slice(&write(s));
    }
}
