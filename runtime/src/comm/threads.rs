//! The ranks of a world as threads of one process ([`threads`]): what tests use to run several
//! ranks' executors at once, each on its own thread, exchanging as separate processes would.

use std::sync::{Arc, Barrier, Mutex};

use super::Communicator;
use crate::error::RuntimeError;

/// What the ranks share: a slot per rank and a barrier they all meet at.
#[derive(Debug)]
struct Shared {
    slots: Mutex<Vec<Vec<u8>>>,
    met: Barrier,
    size: usize,
}

/// One thread's rank of a world made by [`threads`].
#[derive(Debug)]
pub struct ThreadRank {
    shared: Arc<Shared>,
    rank: usize,
}

/// A world of `size` ranks, one communicator per rank (each to be used on its own thread: an
/// exchange waits for every rank).
pub fn threads(size: usize) -> Vec<Arc<dyn Communicator>> {
    let shared = Arc::new(Shared { slots: Mutex::new(vec![Vec::new(); size]), met: Barrier::new(size), size });
    (0..size).map(|rank| Arc::new(ThreadRank { shared: shared.clone(), rank }) as Arc<dyn Communicator>).collect()
}

impl Communicator for ThreadRank {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.shared.size
    }
    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> Result<(), RuntimeError> {
        let err = |msg: &str| RuntimeError::Collective { what: format!("thread rank {}", self.rank), msg: msg.into() };
        if recv.len() != send.len() * self.shared.size {
            return Err(err("the receive buffer is not every rank's send"));
        }
        // each rank's bytes in its slot; once all are in, each copies them out; the second
        // meeting keeps a fast rank's next exchange from overwriting a slot not yet read
        self.shared.slots.lock().map_err(|_| err("another rank panicked"))?[self.rank] = send.to_vec();
        self.shared.met.wait();
        {
            let slots = self.shared.slots.lock().map_err(|_| err("another rank panicked"))?;
            for (r, s) in slots.iter().enumerate() {
                if s.len() != send.len() {
                    return Err(err(&format!("rank {r} sent {} bytes, this rank {}", s.len(), send.len())));
                }
                recv[r * send.len()..(r + 1) * send.len()].copy_from_slice(s);
            }
        }
        self.shared.met.wait();
        Ok(())
    }
}
