//! [`ExecPlan`]: everything an executor needs to know about a lowered program before it
//! allocates anything, the same for every device.

use qatc_ir::{DType, InputKind};
use qatc_kernels::panels::PanelTable;
use qatc_kernels::program::{BufId, BufKind, Program, Step};
use qatc_kernels::Target;
use serde::Serialize;

use super::access::{self, Access};
use super::check::{check_gemm_step, check_launch, viewed};
use super::hoist::{hoisted, Hoist};
use super::layout::{lay_out, lifetimes, BufferLayout, Live, MemoryLayout};
use crate::error::RuntimeError;

/// How a program is laid out and run: settings of the device and of the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ExecOptions {
    /// Every buffer's offset and size in its region is a multiple of this many bytes (the
    /// target's: `Target::align`).
    pub align: usize,
    pub layout: BufferLayout,
    /// Which steps that read only frozen inputs run once, not every step (`hoist.rs`).
    pub hoist: Hoist,
    /// The per-step data inputs get a region of their own (else they are persistent inputs too:
    /// one allocation for every input).
    pub data_region: bool,
}

impl ExecOptions {
    /// Buffers aligned to `align`, sharing memory by lifetime, nothing hoisted.
    pub fn new(align: usize) -> ExecOptions {
        ExecOptions { align, layout: BufferLayout::Shared, hoist: Hoist::Nothing, data_region: true }
    }

    /// How `target`'s executor lays a program out: three allocations (arena, persistent inputs,
    /// per-step data inputs) at the target's alignment, buffers sharing the arena by lifetime,
    /// its frozen steps hoisted as it says. The one place a layout follows from a device, so
    /// that `qatc plan` shows exactly what the executor allocates.
    pub fn for_target(target: &Target) -> ExecOptions {
        ExecOptions { hoist: target.hoist, ..ExecOptions::new(target.align) }
    }
}

/// A graph input's buffer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct InputBuf {
    pub name: String,
    pub buf: BufId,
    #[serde(serialize_with = "kind_name")]
    pub kind: InputKind,
    /// Some step, output or write-back reads it: a run needs it given.
    pub needed: bool,
}

fn kind_name<S: serde::Serializer>(k: &InputKind, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(k.name())
}

/// An update's write-back, done by the executor after the last step: `bytes` bytes at byte
/// `from_offset` of buffer `from` (where the update output lives) copied over buffer `to` (the
/// input it is the new value of), on the device, never through the host.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WriteBack {
    pub name: String,
    pub from: BufId,
    pub from_offset: usize,
    pub to: BufId,
    pub bytes: usize,
}

/// A program checked and analysed for execution: what each step reads and writes, the inputs,
/// the updates' write-backs, the hoisted steps, every buffer's lifetime and its place in memory.
/// Plain data, deterministic: the same program and options give the same plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ExecPlan {
    pub options: ExecOptions,
    /// What each step of the program reads and writes, in step order.
    pub access: Vec<Access>,
    /// The graph inputs, in buffer order.
    pub inputs: Vec<InputBuf>,
    pub write_backs: Vec<WriteBack>,
    /// Per step: it runs on the first run and after a frozen input is set, not every run.
    pub hoisted: Vec<bool>,
    /// Per buffer, over the steps and a last step that stands for the write-backs.
    pub lifetimes: Vec<Live>,
    pub layout: MemoryLayout,
}

impl ExecPlan {
    /// Checks `prog` (`check.rs`: every launch, GEMM and output against the buffers; every
    /// update against the input it replaces) and plans its execution.
    pub fn new(prog: &Program, options: ExecOptions) -> Result<ExecPlan, RuntimeError> {
        ExecPlan::with_panels(prog, &PanelTable::default(), options)
    }

    /// [`ExecPlan::new`] for a program whose GEMMs in `panels` are fed their operand b panel by
    /// panel (the CPU's rewrite, `qatc_kernels::panels`): each such step checked, and its reads
    /// and writes counted, with its feed.
    pub fn with_panels(prog: &Program, panels: &PanelTable, options: ExecOptions) -> Result<ExecPlan, RuntimeError> {
        if let Some((i, _)) = panels.iter().find(|(i, _)| !matches!(prog.steps.get(*i), Some(Step::Gemm(_)))) {
            let msg = format!("fed in panels, but step {i} of {} is no GEMM", prog.steps.len());
            return Err(RuntimeError::Gemm { note: format!("step {i}"), msg });
        }
        for (i, step) in prog.steps.iter().enumerate() {
            match step {
                Step::Launch { kernel, args, .. } => {
                    check_launch(prog, *kernel, args)?;
                }
                Step::Gemm(g) => check_gemm_step(prog, g, panels.get(i))?,
                Step::Collective(c) => super::check::check_collective(prog, c)?,
            }
        }
        for (name, v) in &prog.outputs {
            viewed(&prog.buffers, v, &format!("output {name}"))?;
        }
        let write_backs = write_backs(prog)?;
        let access: Vec<Access> = prog.steps.iter().enumerate().map(|(i, s)| access::of_step(prog, s, panels.get(i))).collect();
        // an input updated in place holds its new value from the step that writes it: nothing
        // after that step may read it (it would see the new value where the graph reads the old)
        let mut written_at: Vec<Option<usize>> = vec![None; prog.buffers.len()];
        for (i, a) in access.iter().enumerate() {
            for &b in &a.reads {
                if let Some(w) = written_at.get(b).copied().flatten().filter(|&w| w < i && !a.writes.contains(&b)) {
                    return Err(RuntimeError::Buffer {
                        name: prog.buffers[b].name.clone(),
                        msg: format!("updated in place by step {w}, then read by step {i}"),
                    });
                }
            }
            for &b in &a.writes {
                if matches!(prog.buffers[b].kind, BufKind::Input(..)) {
                    written_at[b] = Some(i);
                }
            }
        }
        let nb = prog.buffers.len();
        let frozen: Vec<bool> =
            prog.buffers.iter().map(|b| options.hoist.any() && matches!(b.kind, BufKind::Input(_, InputKind::Frozen))).collect();
        let bytes: Vec<usize> = prog.buffers.iter().map(|b| b.bytes()).collect();
        let hoisted = hoisted(&access, &frozen, &bytes, options.hoist);
        // the write-backs read the updates after the last step: one more step for the lifetimes
        let mut steps = access.clone();
        steps.push(Access { reads: write_backs.iter().map(|w| w.from).collect(), writes: Vec::new() });
        let mut whole = vec![options.layout == BufferLayout::Distinct; nb];
        for (_, v) in &prog.outputs {
            whole[v.buf] = true;
        }
        for (a, _) in access.iter().zip(&hoisted).filter(|(_, h)| **h) {
            for &b in &a.writes {
                whole[b] = true;
            }
        }
        let lifetimes = lifetimes(&prog.buffers, &steps, &whole);
        let layout = lay_out(&prog.buffers, &lifetimes, steps.len(), options.align, options.data_region);
        let mut read = vec![false; nb];
        for b in steps.iter().flat_map(|a| &a.reads).chain(prog.outputs.iter().map(|(_, v)| &v.buf)) {
            read[*b] = true;
        }
        let inputs = prog
            .buffers
            .iter()
            .enumerate()
            .filter_map(|(b, buf)| match &buf.kind {
                BufKind::Input(name, kind) => Some(InputBuf { name: name.clone(), buf: b, kind: *kind, needed: read[b] }),
                _ => None,
            })
            .collect();
        Ok(ExecPlan { options, access, inputs, write_backs, hoisted, lifetimes, layout })
    }

    /// The input of that name.
    pub fn input(&self, name: &str) -> Option<&InputBuf> {
        self.inputs.iter().find(|i| i.name == name)
    }

    /// How many steps are hoisted.
    pub fn hoisted_steps(&self) -> usize {
        self.hoisted.iter().filter(|h| **h).count()
    }
}

/// The updates' write-backs: each update output (a dense view) into its input's buffer. An
/// update that is its input unchanged needs none. An update read from another input that is
/// itself updated would depend on the order of the copies: refused.
fn write_backs(prog: &Program) -> Result<Vec<WriteBack>, RuntimeError> {
    let mut out = Vec::new();
    for (name, v) in &prog.updates {
        let err = |msg: String| RuntimeError::Buffer { name: name.clone(), msg: format!("update: {msg}") };
        let src = viewed(&prog.buffers, v, &format!("update {name}"))?;
        let to = prog
            .buffers
            .iter()
            .position(|b| matches!(&b.kind, BufKind::Input(n, _) if n == name))
            .ok_or_else(|| err("the program has no input of that name".into()))?;
        let dst = &prog.buffers[to];
        if src.dtype != dst.dtype || v.numel() != dst.numel() {
            return Err(err(format!("{} {:?} for the input's {} {:?}", src.dtype, v.shape, dst.dtype, dst.shape)));
        }
        if !v.is_contiguous() || (dst.dtype == DType::I4 && v.offset % 2 != 0) {
            return Err(err(format!("a strided view {v:?}: write-backs copy dense bytes")));
        }
        if v.buf == to && v.offset == 0 {
            continue;
        }
        out.push(WriteBack { name: name.clone(), from: v.buf, from_offset: dst.dtype.bytes_for(v.offset), to, bytes: dst.bytes() });
    }
    if let Some(w) = out.iter().find(|w| out.iter().any(|o| o.to == w.from)) {
        return Err(RuntimeError::Buffer {
            name: w.name.clone(),
            msg: format!("update: read from the input {}, which an update replaces too", prog.buffers[w.from].name),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use qatc_kernels::program::{Buffer, View};

    /// p (trainable), m (state), p.next = x @ w (x data, w frozen), then the updates given.
    fn program(updates: Vec<(String, View)>) -> Program {
        let buf = |name: &str, shape: &[usize], kind: BufKind| Buffer::new(name, DType::F32, shape, kind);
        let gemm = qatc_kernels::program::Gemm {
            a: View::contiguous(3, &[2, 2]),
            b: View::contiguous(4, &[2, 3]),
            c: View::contiguous(2, &[2, 3]),
            m: 2,
            n: 3,
            k: 2,
            alpha: 1.0,
            accumulate: false,
            bias: None,
            types: qatc_kernels::program::GemmTypes::F32,
            note: "p.next = x @ w".into(),
        };
        Program {
            buffers: vec![
                buf("p", &[2, 3], BufKind::Input("p".into(), InputKind::Trainable)),
                buf("m", &[2, 3], BufKind::Input("m".into(), InputKind::State)),
                buf("p.next", &[2, 3], BufKind::Value),
                buf("x", &[2, 2], BufKind::Input("x".into(), InputKind::Data)),
                buf("w", &[2, 3], BufKind::Input("w".into(), InputKind::Frozen)),
            ],
            steps: vec![Step::Gemm(Box::new(gemm))],
            updates,
            ..Program::default()
        }
    }

    /// An update in a buffer of its own is copied over its input after the step, and its buffer
    /// lives until then; the input unchanged needs no copy; strided views, a missing input and
    /// an order-dependent chain are errors naming the update.
    #[test]
    fn updates_are_written_back_on_the_device() {
        let v = |b: usize| View::contiguous(b, &[2, 3]);
        let p = ExecPlan::new(&program(vec![("p".into(), v(2)), ("m".into(), v(1))]), ExecOptions::new(64)).unwrap();
        assert_eq!(p.write_backs, [WriteBack { name: "p".into(), from: 2, from_offset: 0, to: 0, bytes: 24 }]);
        // p.next is written by step 0 and read by the write-back, step 1
        assert_eq!(p.lifetimes[..3], [Live::Input, Live::Input, Live::Steps(0, 1)]);
        assert_eq!(p.access[0], Access { reads: vec![3, 4], writes: vec![2] });
        let needed: Vec<&str> = p.inputs.iter().filter(|i| i.needed).map(|i| i.name.as_str()).collect();
        assert_eq!(needed, ["x", "w"], "p and m are read by no step (m's update is m itself: no write-back)");
        assert_eq!(p.layout.places[0].region, super::super::layout::Region::Persistent);
        assert_eq!(p.layout.places[3].region, super::super::layout::Region::Data);
        let hoisting = ExecPlan::new(&program(vec![]), ExecOptions { hoist: Hoist::Everything, ..ExecOptions::new(64) }).unwrap();
        assert_eq!(hoisting.hoisted, [false], "x @ w reads data");
        let strided = v(2).transpose(&[1, 0]);
        let e = ExecPlan::new(&program(vec![("p".into(), strided)]), ExecOptions::new(64)).unwrap_err();
        assert!(e.to_string().contains("\"p\"") && e.to_string().contains("strided"), "{e}");
        assert!(ExecPlan::new(&program(vec![("q".into(), v(2))]), ExecOptions::new(64)).is_err());
        let chain = program(vec![("p".into(), v(1)), ("m".into(), v(2))]);
        assert!(ExecPlan::new(&chain, ExecOptions::new(64)).unwrap_err().to_string().contains("which an update replaces"));
    }
}
