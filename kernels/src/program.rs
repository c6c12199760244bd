//! What a whole graph lowers to: buffers, views on them, and steps in execution order (kernel
//! launches and library GEMMs). Shape-only ops become views, so they cost nothing at run time.

use std::fmt;

use qatc_ir::{DType, InputKind, Reduce, Role};

use crate::kir::Kernel;

pub type BufId = usize;

#[derive(Clone, Debug, PartialEq)]
pub enum BufKind {
    /// A graph input, supplied by name; its kind says whether it persists between steps
    /// (weights, optimizer state) or is given anew for each (`InputKind::Data`).
    Input(String, InputKind),
    /// The value of a graph node (named outputs and update targets among them).
    Value,
    /// Scratch that one step writes and a later step of the same node reads.
    Temp,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Buffer {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub kind: BufKind,
    /// What it holds, for memory accounting: the role (`qatc_ir::role`) of the graph node whose
    /// value it is, given at lowering time; a scratch buffer is a temporary of its step's phase.
    /// The executed memory plan (`qatc plan`) counts the buffers by it.
    pub role: Role,
}

impl Buffer {
    /// A buffer of this kind, with the role it implies alone: an input's by its kind, any other a
    /// forward temporary (the lowering gives node values their node's role).
    pub fn new(name: impl Into<String>, dtype: DType, shape: &[usize], kind: BufKind) -> Buffer {
        let role = match &kind {
            BufKind::Input(_, k) => Role::input(*k),
            BufKind::Value | BufKind::Temp => Role::temporary(qatc_ir::Phase::Forward),
        };
        Buffer { name: name.into(), dtype, shape: shape.to_vec(), kind, role }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn bytes(&self) -> usize {
        self.dtype.bytes_for(self.numel())
    }

    /// The bytes a device allocation of it needs: `bytes`, except that packed 4-bit buffers are
    /// rounded up to whole 32-bit words, because a 4-bit store updates the word around its byte
    /// atomically (`qatc::store_i4`); such a buffer must also start 4-byte aligned. (The
    /// executor's layout, `runtime/src/exec/layout.rs`, rounds every buffer up to its alignment,
    /// which covers this.)
    pub fn device_bytes(&self) -> usize {
        match self.dtype {
            DType::I4 => self.bytes().next_multiple_of(4),
            _ => self.bytes(),
        }
    }
}

/// A strided window on a buffer: element (c0, .., cr) is element `offset + sum c_d * strides[d]`
/// of the buffer. Stride 0 repeats (a broadcast dim).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct View {
    pub buf: BufId,
    pub offset: usize,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
}

impl View {
    pub fn contiguous(buf: BufId, shape: &[usize]) -> View {
        View { buf, offset: 0, shape: shape.to_vec(), strides: crate::index::strides(shape) }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Row-major and dense (size-1 dims may have any stride).
    pub fn is_contiguous(&self) -> bool {
        let want = crate::index::strides(&self.shape);
        self.shape.iter().zip(self.strides.iter().zip(&want)).all(|(&d, (s, w))| d == 1 || s == w)
    }

    pub fn transpose(&self, perm: &[usize]) -> View {
        View {
            buf: self.buf,
            offset: self.offset,
            shape: perm.iter().map(|&p| self.shape[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
        }
    }

    pub fn slice(&self, axis: usize, start: usize, end: usize) -> View {
        let mut v = self.clone();
        v.offset += start * self.strides[axis];
        v.shape[axis] = end - start;
        v
    }

    /// Numpy broadcast to `shape` (trailing dims aligned): new and size-1 dims get stride 0.
    pub fn broadcast(&self, shape: &[usize]) -> View {
        let off = shape.len() - self.shape.len();
        let mut strides = vec![0; shape.len()];
        for (i, (&d, &s)) in self.shape.iter().zip(&self.strides).enumerate() {
            strides[i + off] = if d == shape[i + off] { s } else { 0 };
        }
        View { buf: self.buf, offset: self.offset, shape: shape.to_vec(), strides }
    }

    /// The same elements under another shape, when that is still a strided view: dims are
    /// merged or split only where they are laid out one after the other.
    pub fn reshape(&self, shape: &[usize]) -> Option<View> {
        if self.is_contiguous() {
            let mut v = View::contiguous(self.buf, shape);
            v.offset = self.offset;
            return Some(v);
        }
        // Group the old dims into runs that are contiguous among themselves, then split each run
        // into new dims of the same total size.
        let old: Vec<(usize, usize)> = self.shape.iter().copied().zip(self.strides.iter().copied()).filter(|(d, _)| *d != 1).collect();
        let mut runs: Vec<(usize, usize)> = Vec::new(); // (size, innermost stride)
        for (d, s) in old {
            match runs.last_mut() {
                Some((size, inner)) if *inner == s * d => {
                    *size *= d;
                    *inner = s;
                }
                _ => runs.push((d, s)),
            }
        }
        let mut strides = vec![0; shape.len()];
        let mut run = 0;
        let mut left = runs.first().map_or(1, |r| r.0);
        for (i, &d) in shape.iter().enumerate() {
            if d == 1 {
                continue;
            }
            while left == 1 && run + 1 < runs.len() {
                run += 1;
                left = runs[run].0;
            }
            if !left.is_multiple_of(d) {
                return None;
            }
            left /= d;
            strides[i] = runs.get(run)?.1 * left;
        }
        Some(View { buf: self.buf, offset: self.offset, shape: shape.to_vec(), strides })
    }
}

/// The element types of a GEMM's operands, destination and bias (those of their buffers, which
/// `lower` copies here so a library planner reads them off the GEMM). Whatever they are, products
/// accumulate in f32: f16/bf16 operands widen exactly, and a f16/bf16 destination receives
/// alpha * a @ b (+ c) (+ bias), formed in f32, rounded once to nearest even.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmTypes {
    pub a: DType,
    pub b: DType,
    pub c: DType,
    pub bias: Option<DType>,
}

impl GemmTypes {
    /// f32 operands and destination, no bias.
    pub const F32: GemmTypes = GemmTypes { a: DType::F32, b: DType::F32, c: DType::F32, bias: None };

    /// Every operand and the destination f32 (the plain SGEMM).
    pub fn is_f32(&self) -> bool {
        [self.a, self.b, self.c].iter().chain(self.bias.iter()).all(|&d| d == DType::F32)
    }
}

/// A matrix product by the vendor library: c = alpha * a @ b (+ c when `accumulate`), a read as
/// [.., M, K] and b as [.., K, N] through their views' strides (a transposed operand is a view
/// with swapped strides), with an optional bias row [N] added to every row of c (cuBLASLt's BIAS
/// epilogue). Batch dims lead and are equal on all three. Accumulation is f32 (see [`GemmTypes`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Gemm {
    pub a: View,
    pub b: View,
    pub c: View,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub alpha: f64,
    pub accumulate: bool,
    pub bias: Option<View>,
    /// The element types of a, b, c and the bias.
    pub types: GemmTypes,
    pub note: String,
}

impl Gemm {
    pub fn batch(&self) -> usize {
        let r = self.c.shape.len();
        self.c.shape[..r.saturating_sub(2)].iter().product()
    }
    pub fn flops(&self) -> usize {
        2 * self.batch() * self.m * self.n * self.k
    }
    /// Its operand and result views: a, b, c, then the bias if any.
    pub fn views_mut(&mut self) -> impl Iterator<Item = &mut View> {
        [&mut self.a, &mut self.b, &mut self.c].into_iter().chain(self.bias.as_mut())
    }
}

/// What a collective exchanges (`qatc_ir::collective`'s ops).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exchange {
    AllReduce(Reduce),
    ReduceScatter(Reduce),
    AllGather,
}

impl Exchange {
    pub fn mnemonic(self) -> &'static str {
        match self {
            Exchange::AllReduce(_) => "all_reduce",
            Exchange::ReduceScatter(_) => "reduce_scatter",
            Exchange::AllGather => "all_gather",
        }
    }
}

/// A collective over `world` ranks, run by the executor's communicator (as a GEMM is a library
/// call): `src`'s elements (this rank's operand, contiguous) in, `dst`'s (this rank's result, a
/// whole buffer) out, of one float type. A CPU executor runs it through MPI; the CUDA executor
/// through NCCL or staged through the host (`qatc_runtime::cuda::Collectives`).
#[derive(Clone, Debug, PartialEq)]
pub struct Collective {
    pub exchange: Exchange,
    pub world: usize,
    pub src: View,
    pub dst: View,
    pub note: String,
}

impl Collective {
    pub fn src_elements(&self) -> usize {
        self.src.numel()
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// Launch `kernel` (an index into `Program::kernels`) with one buffer per param, in order.
    Launch {
        kernel: usize,
        args: Vec<BufId>,
        note: String,
    },
    Gemm(Box<Gemm>),
    Collective(Box<Collective>),
}

/// A kernel launch that exists only to feed a GEMM an operand it cannot read itself (a 4-bit
/// weight dequantized to f32): its traffic is the price of not fusing, shown in the report.
#[derive(Clone, Debug, PartialEq)]
pub struct Materialized {
    pub what: String,
    pub bytes_read: usize,
    pub bytes_written: usize,
}

/// A cross-entropy over the vocabulary whose logits are computed chunk by chunk of rows
/// (`lower/xent.rs`): they never exist whole, only one chunk's [chunk_rows, vocab] scratch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CeChunking {
    /// Rows of the logits (B x T) and the vocabulary.
    pub rows: usize,
    pub vocab: usize,
    pub chunk_rows: usize,
    /// Columns of the vocabulary per tile: `vocab` (a chunk's whole rows at once), or fewer where
    /// the chunk walks the vocabulary in tiles with an online softmax (`xent.rs`, a frozen head
    /// on the CPU).
    pub tile_cols: usize,
    /// The gradient is computed too (training), not only the loss (evaluation).
    pub with_grad: bool,
    /// Bytes per logit: 4, or 2 for bf16/fp16 logits (`--precision`).
    pub elem_bytes: usize,
}

impl CeChunking {
    pub fn chunks(&self) -> usize {
        self.rows.div_ceil(self.chunk_rows.max(1))
    }
    /// The [chunk_rows, tile_cols] scratch the logits of one chunk (or tile) live in.
    pub fn scratch_bytes(&self) -> usize {
        self.elem_bytes * self.chunk_rows * self.tile_cols
    }
    /// The [rows, vocab] logits it never holds whole.
    pub fn whole_bytes(&self) -> usize {
        self.elem_bytes * self.rows * self.vocab
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Program {
    pub buffers: Vec<Buffer>,
    /// Distinct kernels; launches refer to them by index.
    pub kernels: Vec<Kernel>,
    pub steps: Vec<Step>,
    /// Where each named graph output lives (not the updates).
    pub outputs: Vec<(String, View)>,
    /// Where each update output lives, under the name of the input it is the new value of
    /// (`Graph::set_update`): after a step the executor copies it into that input's buffer.
    pub updates: Vec<(String, View)>,
    pub materialized: Vec<Materialized>,
    /// Fused nodes that could not run as one kernel and were split, with why.
    pub splits: Vec<String>,
    /// The cross-entropies lowered chunk by chunk, as the planner chose them.
    pub cross_entropy: Vec<CeChunking>,
}

impl Program {
    /// The names of the graph outputs, sorted, each once (an output may be named twice for one view).
    pub fn output_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.outputs.iter().map(|(n, _)| n.clone()).collect();
        names.sort();
        names.dedup();
        names
    }

    /// The whole program as text, one line per buffer, step and output: what the lowering
    /// decided (which kernel each launch runs on which buffers, every GEMM's operand views,
    /// where each output lives). Snapshot tests pin it.
    pub fn listing(&self) -> String {
        let mut o = String::new();
        let view = |v: &View| -> String {
            let whole = self.buffers.get(v.buf).is_some_and(|b| b.shape == v.shape) && v.offset == 0 && v.is_contiguous();
            if whole {
                format!("b{}", v.buf)
            } else {
                let dims = |xs: &[usize]| xs.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",");
                if v.shape.is_empty() {
                    format!("b{}+{}[]", v.buf, v.offset)
                } else {
                    format!("b{}+{}[{} : {}]", v.buf, v.offset, dims(&v.shape), dims(&v.strides))
                }
            }
        };
        o += "buffers:\n";
        for (i, b) in self.buffers.iter().enumerate() {
            let (kind, name) = match &b.kind {
                BufKind::Input(n, _) => ("input", n),
                BufKind::Value => ("value", &b.name),
                BufKind::Temp => ("temp", &b.name),
            };
            let dims: Vec<String> = b.shape.iter().map(|d| d.to_string()).collect();
            o += &format!("  b{i} {:?}[{}] {kind} \"{name}\"\n", b.dtype, dims.join(", "));
        }
        o += "kernels:\n";
        for (i, k) in self.kernels.iter().enumerate() {
            o += &format!("  k{i} {} ({} params): {}\n", k.name(), k.params.len(), k.note);
        }
        o += "steps:\n";
        for (i, s) in self.steps.iter().enumerate() {
            match s {
                Step::Launch { kernel, args, note } => {
                    let args: Vec<String> = args.iter().map(|b| format!("b{b}")).collect();
                    o += &format!("  {i} launch k{kernel}({})  // {note}\n", args.join(", "));
                }
                Step::Gemm(g) => {
                    let mut line = format!("  {i} gemm {} = {} * {} @ {}", view(&g.c), g.alpha, view(&g.a), view(&g.b));
                    line += &format!(" (batch {}, M {}, N {}, K {})", g.batch(), g.m, g.n, g.k);
                    if g.accumulate {
                        line += " accumulate";
                    }
                    if let Some(b) = &g.bias {
                        line += &format!(" + bias {}", view(b));
                    }
                    o += &format!("{line}  // {}\n", g.note);
                }
                Step::Collective(c) => {
                    let reduce = match c.exchange {
                        Exchange::AllReduce(r) | Exchange::ReduceScatter(r) => format!("reduce={}, ", r.name()),
                        Exchange::AllGather => String::new(),
                    };
                    o += &format!(
                        "  {i} {}[{reduce}world={}] {} <- {}  // {}\n",
                        c.exchange.mnemonic(),
                        c.world,
                        view(&c.dst),
                        view(&c.src),
                        c.note
                    );
                }
            }
        }
        o += "outputs:\n";
        for (name, v) in &self.outputs {
            o += &format!("  {name} = {}\n", view(v));
        }
        if !self.updates.is_empty() {
            o += "updates:\n";
            for (name, v) in &self.updates {
                o += &format!("  {name} <- {}\n", view(v));
            }
        }
        o
    }

    pub fn launches(&self) -> usize {
        self.steps.iter().filter(|s| matches!(s, Step::Launch { .. })).count()
    }
    pub fn gemms(&self) -> impl Iterator<Item = &Gemm> {
        self.steps.iter().filter_map(|s| match s {
            Step::Gemm(g) => Some(&**g),
            Step::Launch { .. } | Step::Collective(_) => None,
        })
    }
    pub fn collectives(&self) -> impl Iterator<Item = &Collective> {
        self.steps.iter().filter_map(|s| match s {
            Step::Collective(c) => Some(&**c),
            _ => None,
        })
    }
}

impl fmt::Display for Program {
    /// A short report: counts, GEMM FLOPs, what was materialized and split.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let flops: usize = self.gemms().map(Gemm::flops).sum();
        writeln!(
            f,
            "{} steps: {} kernel launches of {} distinct kernels, {} GEMMs ({:.3} GFLOP)",
            self.steps.len(),
            self.launches(),
            self.kernels.len(),
            self.gemms().count(),
            flops as f64 / 1e9
        )?;
        let (r, w): (usize, usize) = self.materialized.iter().fold((0, 0), |(r, w), m| (r + m.bytes_read, w + m.bytes_written));
        if !self.materialized.is_empty() {
            writeln!(f, "{} operands materialized for GEMMs: {r} bytes read, {w} bytes written", self.materialized.len())?;
            for m in &self.materialized {
                writeln!(f, "  {}: {} bytes read, {} bytes written", m.what, m.bytes_read, m.bytes_written)?;
            }
        }
        for s in &self.splits {
            writeln!(f, "split: {s}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_of_the_attention_heads() {
        // qkv [8, 384] -> slice cols 128..256 -> [1, 8, 4, 32] -> transpose (0, 2, 1, 3)
        let qkv = View::contiguous(0, &[8, 384]);
        let k = qkv.slice(1, 128, 256).reshape(&[1, 8, 4, 32]).map(|v| v.transpose(&[0, 2, 1, 3]));
        let k = k.expect("a strided view");
        assert_eq!(k.offset, 128);
        assert_eq!(k.shape, [1, 4, 8, 32]);
        assert_eq!(k.strides[1..], [32, 384, 1]);
        // and back: transpose then reshape to [8, 128] is not a view of the sliced buffer... it is
        let back = k.transpose(&[0, 2, 1, 3]).reshape(&[8, 128]).expect("rows of 128 at stride 384");
        assert_eq!((back.offset, back.strides.clone()), (128, vec![384, 1]));
        // a transposed matrix cannot merge its dims
        assert!(View::contiguous(0, &[4, 6]).transpose(&[1, 0]).reshape(&[24]).is_none());
    }

    #[test]
    fn broadcast_gives_zero_strides() {
        let bias = View::contiguous(3, &[384]).broadcast(&[8, 384]);
        assert_eq!(bias.strides, [0, 1]);
    }
}
