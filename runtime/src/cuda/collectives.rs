//! How a [`CudaProgram`](super::CudaProgram) runs its collectives: who they exchange with (the
//! step's [`Communicator`]) and by which path ([`Collectives`]).

use std::sync::Arc;

use qatc_kernels::program::Program;

use super::{DeviceCollective, GpuApi, GpuError};
use crate::comm::{self, collective_error, Communicator, OneRank};
use crate::error::RuntimeError;

/// The path a CUDA program's collectives take.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Collectives {
    /// Staged through the host: the stream waited for, the operand downloaded, exchanged by the
    /// communicator by the CPU ranks' rule (`comm::run`: f64, rank order, one rounding) and the
    /// result uploaded. Runs on any GPU and the emulated one and gives the CPU ranks' bits, but
    /// a step that exchanges so runs without its CUDA graph (a host exchange cannot be captured)
    /// and moves every rank's block through host memory. In a world of one every collective is
    /// its operand, and this path copies it in the stream instead (the graph kept, the bits the
    /// same).
    #[default]
    Host,
    /// In the stream on device memory through the GPU's collective library (NCCL:
    /// `GpuApi::collective`), captured in the step's graph. NCCL sums in its own order, so its
    /// results agree with the host rule's within rounding, not bit for bit (exactly at one rank).
    Device,
}

/// The step's communicator, the path, and what the device path opened.
pub(super) struct Exchanges {
    pub comm: Arc<dyn Communicator>,
    pub how: Collectives,
    /// What `GpuApi::open_collectives` opened ("NCCL 2.27.3"), on the device path.
    pub opened: Option<String>,
}

impl Default for Exchanges {
    fn default() -> Exchanges {
        Exchanges { comm: Arc::new(OneRank), how: Collectives::Host, opened: None }
    }
}

impl Exchanges {
    /// Joins `comm`'s world by path `how` for `prog`'s collectives: each must be compiled for
    /// the world's size (refused here, before any of them runs); the device path opens the GPU's
    /// library (collective: every rank at once), unless the program exchanges nothing.
    pub fn join<A: GpuApi>(prog: &Program, api: &mut A, comm: Arc<dyn Communicator>, how: Collectives) -> Result<Exchanges, RuntimeError> {
        if let Some(c) = prog.collectives().find(|c| c.world != comm.size()) {
            return Err(collective_error(c, format!("the step is compiled for {} ranks, the world has {}", c.world, comm.size())));
        }
        let opened = match (how, prog.collectives().next()) {
            (Collectives::Device, Some(c)) => {
                let e = |e: GpuError| {
                    collective_error(c, format!("opening the GPU's collectives (rank {} of {}): {e}", comm.rank(), comm.size()))
                };
                Some(api.open_collectives(comm.clone()).map_err(e)?)
            }
            _ => None,
        };
        Ok(Exchanges { comm, how, opened })
    }

    /// Whether a collective of this program is staged through the host (the step then runs
    /// without its CUDA graph).
    pub fn host_staged(&self, prog: &Program) -> bool {
        self.how == Collectives::Host && prog.collectives().any(|c| c.world > 1 || self.comm.size() > 1)
    }

    /// What the program's collectives run on, in words (None when it has none).
    pub fn words(&self, prog: &Program) -> Option<String> {
        let n = prog.collectives().count();
        if n == 0 {
            return None;
        }
        let ranks = self.comm.size();
        Some(match (&self.opened, self.host_staged(prog)) {
            (Some(lib), _) => format!("{n} collectives over {ranks} ranks in the stream ({lib})"),
            (None, true) => format!("{n} collectives over {ranks} ranks staged through the host ({:?})", self.comm),
            (None, false) => format!("{n} collectives of one rank (copies in the stream)"),
        })
    }

    /// Submits collective `d`: in the stream (the device path, or a world of one's copy), or
    /// staged through the host (waiting for the stream first: the download does).
    pub fn submit<A: GpuApi + ?Sized>(&self, api: &mut A, d: &DeviceCollective) -> Result<(), RuntimeError> {
        let err = |e: GpuError| collective_error(&d.step, e.to_string());
        let (n, m) = d.bytes();
        match self.how {
            Collectives::Device => api.collective(d).map_err(err),
            // a world of one: a copy, or nothing when the result is written over its operand
            Collectives::Host if self.comm.size() == 1 && d.step.world == 1 && n == m && d.dst == d.src => Ok(()),
            Collectives::Host if self.comm.size() == 1 && d.step.world == 1 && n == m => api.copy(d.dst, d.src, n).map_err(err),
            Collectives::Host => {
                let mut src = vec![0u8; n];
                api.download(&mut src, d.src).map_err(err)?;
                let mut dst = vec![0u8; m];
                comm::run(&*self.comm, &d.step, d.dtype, &src, &mut dst)?;
                api.upload(d.dst, &dst).map_err(err)
            }
        }
    }
}
