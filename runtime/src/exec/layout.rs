//! Where a program's buffers live, on any device: three regions, one allocation each.
//!
//! ```text
//! persistent   the graph inputs that persist between steps (frozen weights, trainable
//!              parameters, optimizer state): set once, updated in place by write-backs
//! data         the inputs given anew for every step (token ids, targets, lr, dropout seeds)
//! arena        every other buffer, at an offset from `qatc_arena::place`: buffers whose
//!              lifetimes (in steps) do not overlap share bytes
//! ```
//!
//! Inputs are placed one after the other in buffer order. Every offset and size is a multiple of
//! the device's alignment (`ExecOptions::align`: 64 on the CPU, a cache line; 256 for CUDA), so a
//! buffer keeps the padding an allocation of its own would have (a vector access past its last
//! element stays inside its bytes). The layout is plain data, the same for the same program and
//! options: `qatc plan` can print exactly what an executor allocates.

use qatc_arena::{aligned, Interval};
use qatc_ir::InputKind;
use qatc_kernels::program::{BufId, BufKind, Buffer};
use serde::Serialize;

use super::access::Access;

/// Whether buffers whose lifetimes do not overlap share memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BufferLayout {
    /// They do: a buffer holds its value only while some step still needs it, so after a run
    /// only graph inputs, non-update outputs and the results of hoisted steps can be read back.
    #[default]
    Shared,
    /// Every buffer has bytes of its own, kept after the run: for tests that read any buffer
    /// (`CpuProgram::buffer`) or copy every buffer between two programs.
    Distinct,
}

/// When a buffer must hold its value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Live {
    /// A graph input: in the persistent or the data region.
    Input,
    /// The whole run and between runs: never shares.
    Whole,
    /// From step `first` to step `last`, both included.
    Steps(usize, usize),
    /// Touched by no step and no output.
    Never,
}

/// Which of the three allocations a buffer is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Region {
    Arena,
    Persistent,
    Data,
}

impl Region {
    /// Where an input of this kind lives.
    pub fn of_input(kind: InputKind) -> Region {
        match kind {
            InputKind::Data => Region::Data,
            InputKind::Frozen | InputKind::Trainable | InputKind::State => Region::Persistent,
        }
    }
}

/// Where one buffer is: its region, its offset in it and the bytes reserved there (its size
/// rounded up to the alignment).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Place {
    pub region: Region,
    pub offset: usize,
    pub bytes: usize,
}

/// Every buffer's place, and the size of each region, in bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MemoryLayout {
    /// Every offset and size is a multiple of this.
    pub align: usize,
    /// One per buffer, in buffer order.
    pub places: Vec<Place>,
    pub arena_bytes: usize,
    pub persistent_bytes: usize,
    pub data_bytes: usize,
    /// The buffers in the arena, summed: what it would take if none shared.
    pub placed_bytes: usize,
    /// The most arena bytes live at one step: no arena can be smaller.
    pub lower_bound: usize,
}

impl MemoryLayout {
    /// The bytes of the three regions together: what an executor allocates for the buffers.
    pub fn total_bytes(&self) -> usize {
        self.arena_bytes + self.persistent_bytes + self.data_bytes
    }

    /// The bytes of the inputs (persistent and data).
    pub fn input_bytes(&self) -> usize {
        self.persistent_bytes + self.data_bytes
    }

    /// The size of one region.
    pub fn region_bytes(&self, r: Region) -> usize {
        match r {
            Region::Arena => self.arena_bytes,
            Region::Persistent => self.persistent_bytes,
            Region::Data => self.data_bytes,
        }
    }

    /// What giving every buffer memory of its own would take.
    pub fn distinct_bytes(&self) -> usize {
        self.placed_bytes + self.input_bytes()
    }
}

/// Each buffer's lifetime over the steps, given what each step reads and writes (in step order)
/// and which buffers must live the whole run anyway (`whole`: outputs, results of hoisted steps).
/// A buffer read before any step wrote it holds what an earlier run (or the allocation's zeroing)
/// left there: it lives the whole run too.
pub fn lifetimes(bufs: &[Buffer], steps: &[Access], whole: &[bool]) -> Vec<Live> {
    let n = bufs.len();
    let mut span: Vec<Option<(usize, usize)>> = vec![None; n];
    let mut written = vec![false; n];
    let mut carried = vec![false; n];
    let mut touch = |b: BufId, i: usize| {
        if let Some(s) = span.get_mut(b) {
            *s = Some(s.map_or((i, i), |(first, _)| (first, i)));
        }
    };
    for (i, a) in steps.iter().enumerate() {
        // reads first: a step that reads and writes a buffer (a GEMM accumulating into c) reads
        // what was there before it
        for &b in &a.reads {
            if !written.get(b).copied().unwrap_or(true) {
                carried[b] = true;
            }
            touch(b, i);
        }
        for &b in &a.writes {
            if let Some(x) = written.get_mut(b) {
                *x = true;
            }
            touch(b, i);
        }
    }
    (0..n)
        .map(|b| match (&bufs[b].kind, span[b]) {
            (BufKind::Input(..), _) => Live::Input,
            _ if whole.get(b).copied().unwrap_or(false) || carried[b] => Live::Whole,
            (_, Some((first, last))) => Live::Steps(first, last),
            (_, None) => Live::Never,
        })
        .collect()
}

/// Places every buffer (`live` from [`lifetimes`], over `steps` steps): inputs one after the
/// other in their region (data inputs in the persistent one unless `data_region`), the rest in
/// the arena by `qatc_arena::place`. Buffers live the whole
/// run span every step; buffers never live overlap nothing (at offset 0, the arena at least as
/// large as each of them, so their bytes can still be addressed).
pub fn lay_out(bufs: &[Buffer], live: &[Live], steps: usize, align: usize, data_region: bool) -> MemoryLayout {
    let align = align.max(1);
    let end = steps.saturating_sub(1);
    let mut places: Vec<Place> = Vec::with_capacity(bufs.len());
    let (mut persistent_bytes, mut data_bytes) = (0usize, 0usize);
    let mut arena: Vec<(BufId, Interval)> = Vec::new();
    let mut never = 0usize;
    for (b, (buf, l)) in bufs.iter().zip(live).enumerate() {
        let bytes = aligned(buf.bytes(), align);
        let place = match (&buf.kind, l) {
            (BufKind::Input(_, kind), _) => {
                let region = match Region::of_input(*kind) {
                    Region::Data if !data_region => Region::Persistent,
                    r => r,
                };
                let top = if region == Region::Data { &mut data_bytes } else { &mut persistent_bytes };
                let offset = *top;
                *top += bytes;
                Place { region, offset, bytes }
            }
            (_, Live::Steps(first, last)) => {
                arena.push((b, Interval { first: *first, last: *last, size: bytes }));
                Place { region: Region::Arena, offset: 0, bytes }
            }
            (_, Live::Whole | Live::Input) => {
                arena.push((b, Interval { first: 0, last: end, size: bytes }));
                Place { region: Region::Arena, offset: 0, bytes }
            }
            (_, Live::Never) => {
                never = never.max(bytes);
                Place { region: Region::Arena, offset: 0, bytes }
            }
        };
        places.push(place);
    }
    let intervals: Vec<Interval> = arena.iter().map(|&(_, i)| i).collect();
    let placed = qatc_arena::place(&intervals, align);
    for (&(b, _), &offset) in arena.iter().zip(&placed.offsets) {
        places[b].offset = offset;
    }
    let placed_bytes = places.iter().filter(|p| p.region == Region::Arena).map(|p| p.bytes).sum();
    MemoryLayout {
        align,
        places,
        arena_bytes: placed.size.max(never),
        persistent_bytes,
        data_bytes,
        placed_bytes,
        lower_bound: qatc_arena::max_live(&intervals, align),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use qatc_ir::DType;

    fn buf(kind: BufKind, elems: usize) -> Buffer {
        Buffer::new("b", DType::F32, &[elems], kind)
    }

    fn access(reads: &[BufId], writes: &[BufId]) -> Access {
        Access { reads: reads.to_vec(), writes: writes.to_vec() }
    }

    /// A buffer first read by a step that also writes it (a GEMM accumulating) holds what a run
    /// before left: it must live the whole run; so must the buffers asked for; the others live
    /// from their first step to their last.
    #[test]
    fn read_before_written_lives_the_whole_run() {
        let bufs = vec![
            buf(BufKind::Input("x".into(), InputKind::Data), 4),
            buf(BufKind::Value, 4),
            buf(BufKind::Temp, 4),
            buf(BufKind::Value, 4),
            buf(BufKind::Value, 4),
            buf(BufKind::Temp, 4),
        ];
        let steps = vec![access(&[0], &[1]), access(&[1], &[2]), access(&[2, 3], &[3]), access(&[3], &[4])];
        let whole = [false, false, false, false, true, false];
        let live = lifetimes(&bufs, &steps, &whole);
        assert_eq!(live, [Live::Input, Live::Steps(0, 1), Live::Steps(1, 2), Live::Whole, Live::Whole, Live::Never]);
    }

    /// Inputs go to their region by kind, one after the other; arena buffers never live at once
    /// share bytes; a whole-run buffer shares with none; an empty buffer takes no bytes; a
    /// never-live buffer still fits in the arena.
    #[test]
    fn regions_by_kind_and_arena_sharing() {
        let mut bufs = vec![
            buf(BufKind::Input("w".into(), InputKind::Frozen), 10),
            buf(BufKind::Input("ids".into(), InputKind::Data), 3),
            buf(BufKind::Input("p".into(), InputKind::Trainable), 16),
            buf(BufKind::Value, 16),
            buf(BufKind::Value, 16),
            buf(BufKind::Value, 16),
            buf(BufKind::Value, 0),
            buf(BufKind::Temp, 100),
        ];
        bufs[6].shape = vec![0];
        let live =
            [Live::Input, Live::Input, Live::Input, Live::Steps(0, 0), Live::Steps(1, 1), Live::Whole, Live::Steps(0, 1), Live::Never];
        let l = lay_out(&bufs, &live, 2, 64, true);
        let at = |b: usize| (l.places[b].region, l.places[b].offset, l.places[b].bytes);
        assert_eq!(at(0), (Region::Persistent, 0, 64));
        assert_eq!(at(1), (Region::Data, 0, 64));
        assert_eq!(at(2), (Region::Persistent, 64, 64));
        assert_eq!(l.places[3].offset, l.places[4].offset, "never live at once: the same bytes");
        assert_ne!(l.places[5].offset, l.places[3].offset);
        assert_eq!(at(6).2, 0);
        assert_eq!((l.persistent_bytes, l.data_bytes), (128, 64));
        assert_eq!((l.arena_bytes, l.placed_bytes, l.lower_bound), (448, 640, 128));
        assert_eq!(l.total_bytes(), 448 + 192);
        let wide = lay_out(&bufs, &live, 2, 256, true);
        assert!(wide.places.iter().all(|p| p.offset % 256 == 0 && p.bytes % 256 == 0), "{wide:?}");
        assert_eq!(wide.persistent_bytes, 512);
        // without a data region the data inputs join the persistent ones, in buffer order
        let one = lay_out(&bufs, &live, 2, 256, false);
        assert_eq!((one.persistent_bytes, one.data_bytes), (768, 0));
        assert_eq!((one.places[1].region, one.places[1].offset, one.places[2].offset), (Region::Persistent, 256, 512));
    }
}
