//! A timed run (`qatc train --profile` on the GPU): the step's work submitted directly, never
//! the graph, with a mark (a CUDA event) after each part, so each kernel, GEMM and copy gets its
//! own time.

use qatc_ir::Phase;
use qatc_kernels::program::Step;

use super::{device_err, CudaProgram};
use crate::cuda::{GpuApi, MarkId};
use crate::error::RuntimeError;
use crate::exec::{gemm_label, step_cost, step_phase, PartCost, TimedPart};

/// What a timed part is: its name, its cost and its phase (`TimedPart`'s).
pub(super) type Part = (String, PartCost, Option<Phase>);

pub(super) struct Parts {
    ends: Vec<(Part, MarkId)>,
}

impl Parts {
    /// A mark ending the part `what` names (its cost `cost`), when the run is timed.
    pub(super) fn cut<A: GpuApi + ?Sized>(
        parts: &mut Option<&mut Parts>,
        api: &mut A,
        what: impl FnOnce() -> Part,
    ) -> Result<(), RuntimeError> {
        if let Some(p) = parts {
            let m = api.mark().map_err(device_err("marking the time"))?;
            p.ends.push((what(), m));
        }
        Ok(())
    }

    /// A part that is a copy of `bytes`.
    pub(super) fn copy(what: &str, bytes: usize) -> Part {
        (what.to_string(), PartCost { bytes: bytes as u64, flops: 0 }, None)
    }
}

impl<A: GpuApi> CudaProgram<A> {
    /// What step `i` is, for a profile: its kernel's family, or the GEMM's shape (as the CPU
    /// executor names them, so the two profiles read alike), with `suffix`; and its cost.
    pub(super) fn part(&self, i: usize, suffix: &str) -> Part {
        let step = &self.prog.steps[i];
        let what = match step {
            Step::Launch { kernel, .. } => self.prog.kernels.get(*kernel).map_or_else(|| "?".into(), |k| k.family.clone()),
            Step::Gemm(g) => gemm_label(g.m, g.n, g.k, g.c.shape.iter().rev().skip(2).product()),
            Step::Collective(c) => c.exchange.mnemonic().to_string(),
        };
        let phase = self.plan.access.get(i).and_then(|a| step_phase(&self.prog, step, a));
        (format!("{what}{suffix}"), step_cost(&self.prog, step), phase)
    }

    /// Runs the step as [`execute`](Self::execute) does, its work submitted directly (never the
    /// graph) with a mark (a CUDA event) after each part: (what, seconds) per part, in order.
    /// Each mark costs the stream a few microseconds, so the parts add up to a little more than
    /// the graph's step. What `qatc train --profile` shows.
    pub fn execute_timed(&mut self) -> Result<Vec<TimedPart>, RuntimeError> {
        self.check_given()?;
        let mut api =
            self.api.try_borrow_mut().map_err(|_| RuntimeError::Device { what: "run".into(), msg: "the GPU is in use".into() })?;
        api.clear_marks().map_err(device_err("clearing the marks"))?;
        let start = api.mark().map_err(device_err("marking the time"))?;
        let mut parts = Parts { ends: Vec::new() };
        if self.stale {
            for i in (0..self.steps.len()).filter(|&i| self.plan.hoisted[i]) {
                self.submit_one(&mut api, i)?;
                Parts::cut(&mut Some(&mut parts), &mut *api, || self.part(i, " (hoisted)"))?;
            }
        }
        self.submit_run(&mut api, Some(&mut parts))?;
        let back = api.pinned(self.readback).map_err(device_err("the timed step"))?;
        let n = self.outputs.len();
        self.outputs.copy_from_slice(&back[..n]);
        let mut times = Vec::with_capacity(parts.ends.len());
        let mut from = start;
        for ((what, cost, phase), to) in parts.ends {
            let secs = api.elapsed_ms(from, to).map_err(device_err("reading the marks"))? / 1e3;
            times.push(TimedPart { what, secs, cost, phase });
            from = to;
        }
        drop(api);
        self.ran_once();
        Ok(times)
    }
}
