//! What one step of a program moves and computes, for the rates a profile shows next to its times
//! (`qatc train --profile`): a launch moves the bytes of the distinct buffers it is passed (the
//! compulsory traffic: a kernel that reads a tile twice moves more, one that reads part of a
//! buffer less); a GEMM moves its operands' and its result's elements (the result read too when
//! it accumulates, and the bias) and computes 2 m n k per matrix. A kernel's FLOPs are not
//! counted: the rate that bounds it is its bandwidth.

use std::collections::HashSet;

use qatc_ir::{InputKind, Phase};
use qatc_kernels::program::{BufKind, Buffer, Program, Step, View};

use super::access::Access;

/// A step's traffic and arithmetic.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PartCost {
    pub bytes: u64,
    pub flops: u64,
}

impl std::ops::Add for PartCost {
    type Output = PartCost;
    fn add(self, o: PartCost) -> PartCost {
        PartCost { bytes: self.bytes + o.bytes, flops: self.flops + o.flops }
    }
}

/// Step `step` of `prog`'s cost.
pub fn step_cost(prog: &Program, step: &Step) -> PartCost {
    let elem = |v: &View| prog.buffers.get(v.buf).map_or(0, |b| b.dtype.bytes_for(v.numel())) as u64;
    match step {
        Step::Launch { args, .. } => {
            let distinct: HashSet<_> = args.iter().collect();
            PartCost { bytes: distinct.into_iter().map(|&b| prog.buffers.get(b).map_or(0, |b| b.bytes()) as u64).sum(), flops: 0 }
        }
        Step::Gemm(g) => {
            let batch: usize = g.c.shape.iter().rev().skip(2).product();
            let c = elem(&g.c) * if g.accumulate { 2 } else { 1 };
            PartCost { bytes: elem(&g.a) + elem(&g.b) + c + g.bias.as_ref().map_or(0, elem), flops: 2 * (g.m * g.n * g.k * batch) as u64 }
        }
        // what this rank reads and receives (not what crosses the network: `qatc plan --ranks`)
        Step::Collective(c) => PartCost { bytes: elem(&c.src) + elem(&c.dst), flops: 0 },
    }
}

/// The part of the training step a step of a program does, from the buffers it writes (a GEMM:
/// its result; a launch: its written params): the earliest phase among those that are no input
/// (forward, recompute, backward: a forward kernel that also keeps what the backward needs, the
/// attention's log-sum-exp, is forward; a backward one that recomputes a forward value is
/// recompute); where it writes only inputs, the optimizer (an update in place of a trainable
/// weight or optimizer state) or None. The LM head's loss fused with its gradient (the chunks'
/// logits, their online softmax) writes only the backward's scratch: backward.
pub fn step_phase(prog: &Program, step: &Step, access: &Access) -> Option<Phase> {
    let order = |p: Phase| match p {
        Phase::Forward => 0,
        Phase::Recompute => 1,
        Phase::Backward => 2,
        Phase::Optimizer => 3,
    };
    let written: Vec<&Buffer> = match step {
        Step::Gemm(g) => prog.buffers.get(g.c.buf).into_iter().collect(),
        Step::Launch { .. } | Step::Collective(_) => access.writes.iter().filter_map(|&b| prog.buffers.get(b)).collect(),
    };
    let values = written.iter().filter(|b| !matches!(b.kind, BufKind::Input(..))).map(|b| b.role.phase);
    match values.min_by_key(|&p| order(p)) {
        Some(p) => Some(p),
        None => {
            written.iter().any(|b| matches!(b.kind, BufKind::Input(_, InputKind::Trainable | InputKind::State))).then_some(Phase::Optimizer)
        }
    }
}

/// One timed part of a run (`TrainStep::run_timed`): what it was, its seconds and its cost
/// (zero where the executor does not count it), and the phase of the step it belongs to
/// (`step_phase`; None for what is no step of the program, such as the updates' write-back).
#[derive(Clone, Debug, PartialEq)]
pub struct TimedPart {
    pub what: String,
    pub secs: f64,
    pub cost: PartCost,
    pub phase: Option<Phase>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use qatc_ir::DType;
    use qatc_kernels::program::{BufKind, Buffer, Gemm, GemmTypes};

    #[test]
    fn a_gemm_moves_its_operands_and_a_launch_its_distinct_buffers() {
        let buffers = vec![
            Buffer::new("a", DType::BF16, &[2, 8, 4], BufKind::Temp),
            Buffer::new("b", DType::BF16, &[2, 4, 3], BufKind::Temp),
            Buffer::new("c", DType::F32, &[2, 8, 3], BufKind::Temp),
        ];
        let prog = Program { buffers, ..Default::default() };
        let g = Gemm {
            a: View::contiguous(0, &[2, 8, 4]),
            b: View::contiguous(1, &[2, 4, 3]),
            c: View::contiguous(2, &[2, 8, 3]),
            m: 8,
            n: 3,
            k: 4,
            alpha: 1.0,
            accumulate: true,
            bias: None,
            types: GemmTypes { a: DType::BF16, b: DType::BF16, c: DType::F32, bias: None },
            note: String::new(),
        };
        // 64 + 24 bf16 elements read, 48 f32 read and written; 2 matrices of 2 * 8 * 3 * 4
        assert_eq!(step_cost(&prog, &Step::Gemm(Box::new(g))), PartCost { bytes: 128 + 48 + 2 * 192, flops: 384 });
        // a buffer passed twice moves once
        let launch = Step::Launch { kernel: 0, args: vec![0, 0, 2], note: String::new() };
        assert_eq!(step_cost(&prog, &launch), PartCost { bytes: 128 + 192, flops: 0 });
    }
}
