//! The communicator over MPI (Open MPI through rsmpi): the one module that links libmpi. The
//! world is `mpirun`'s: each process one rank of MPI_COMM_WORLD.
//!
//! A rank that dies mid-step is MPI's to report: Open MPI's default error handler
//! (MPI_ERRORS_ARE_FATAL) and `mpirun` end every other rank with a message naming the dead one,
//! so a collective never waits forever on a rank that is gone.

use std::sync::Mutex;

use mpi::environment::Universe;
use mpi::traits::{Communicator as _, CommunicatorCollectives as _};
use mpi::Threading;

use super::Communicator;
use crate::error::RuntimeError;

/// MPI's world, initialized once per process (finalized when this is dropped).
pub struct MpiComm {
    universe: Universe,
    rank: usize,
    size: usize,
    /// MPI is initialized for serialized calls: one at a time, from any thread.
    calls: Mutex<()>,
}

impl MpiComm {
    /// Initializes MPI and joins its world; an error if MPI was initialized already in this
    /// process or gives less than serialized calls.
    pub fn init() -> Result<MpiComm, RuntimeError> {
        let err = |msg: &str| RuntimeError::Collective { what: "MPI_Init_thread".into(), msg: msg.into() };
        let (universe, level) =
            mpi::initialize_with_threading(Threading::Serialized).ok_or_else(|| err("MPI is initialized already in this process"))?;
        if level < Threading::Serialized {
            return Err(err(&format!("the MPI library gives threading level {level:?}, qatc needs Serialized")));
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        Ok(MpiComm { universe, rank, size, calls: Mutex::new(()) })
    }
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MPI rank {} of {}", self.rank, self.size)
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> Result<(), RuntimeError> {
        let err = |msg: String| RuntimeError::Collective { what: "MPI_Allgather".into(), msg };
        if recv.len() != send.len() * self.size {
            return Err(err(format!("{} bytes to receive {} ranks' {} bytes", recv.len(), self.size, send.len())));
        }
        if i32::try_from(send.len()).is_err() {
            return Err(err(format!("{} bytes in one call: more than MPI's int count", send.len())));
        }
        let _one_at_a_time = self.calls.lock().map_err(|_| err("an earlier call panicked".into()))?;
        self.universe.world().all_gather_into(send, recv);
        Ok(())
    }
}
