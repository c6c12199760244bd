//! Where a compiled program's buffers live. Graph inputs get allocations of their own: they are
//! set by name at any time and kept between runs, so they must never share. Every other buffer
//! gets an offset in one arena, and buffers whose lifetimes (in steps) do not overlap get the same
//! bytes, so the arena approaches the most bytes live at one step instead of the sum of all
//! buffers.
//!
//! Offsets: greedy by size with best fit (Pisarchyk & Lee 2020, as TFLite's arena planner and
//! `qatc_passes::plan::arena`, which plans the graph before lowering): the largest buffers are
//! placed first, each into the smallest gap (among the buffers already placed whose lifetimes
//! overlap its own) that holds it, or above all of them. Sizes are rounded up to [`ALIGN`] so
//! every buffer starts 64-byte aligned, and keeps the padding a buffer of its own had (a vector
//! access past the last element stays inside the buffer's bytes).

use qatc_kernels::program::{BufId, BufKind, Buffer};

use super::values::{Allocation, ALIGN};
use crate::error::RuntimeError;

/// Whether buffers whose lifetimes do not overlap share memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BufferLayout {
    /// They do: a buffer holds its value only while some step still needs it, so after a run
    /// only graph inputs, outputs and the results of hoisted steps can be read back.
    #[default]
    Shared,
    /// Every buffer has bytes of its own, kept after the run: for tests that read any buffer
    /// (`CpuProgram::buffer`) or copy every buffer between two programs.
    Distinct,
}

/// When a buffer must hold its value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Live {
    /// A graph input: an allocation of its own.
    Input,
    /// The whole run and between runs: never shares.
    Whole,
    /// From step `first` to step `last`, both included.
    Steps(usize, usize),
    /// Touched by no step and no output.
    Never,
}

/// A buffer to place: its size in bytes and the steps it is live for (inclusive; `None` overlaps
/// nothing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub size: usize,
    pub steps: Option<(usize, usize)>,
}

impl Span {
    fn overlaps(&self, o: &Span) -> bool {
        match (self.steps, o.steps) {
            (Some((a0, a1)), Some((b0, b1))) => a0 <= b1 && b0 <= a1,
            _ => false,
        }
    }
}

/// How a program's memory is laid out, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayoutReport {
    /// The arena, holding every buffer but the inputs.
    pub arena_bytes: usize,
    /// The inputs' own allocations.
    pub input_bytes: usize,
    /// The buffers in the arena, summed: what it would take if none shared.
    pub placed_bytes: usize,
    /// The most arena bytes live at one step: no arena can be smaller.
    pub peak_live_bytes: usize,
}

impl LayoutReport {
    /// What a program that gives every buffer its own memory holds.
    pub fn distinct_bytes(&self) -> usize {
        self.placed_bytes + self.input_bytes
    }
}

/// Each buffer's lifetime over the steps, given what each step reads and writes (in step order)
/// and which buffers must live the whole run anyway (`whole`: outputs, results of hoisted steps).
/// A buffer read before any step wrote it holds what an earlier run (or the allocation's zeroing)
/// left there: it lives the whole run too.
pub fn lifetimes(bufs: &[Buffer], steps: &[(Vec<BufId>, Vec<BufId>)], whole: &[bool]) -> Vec<Live> {
    let n = bufs.len();
    let mut span: Vec<Option<(usize, usize)>> = vec![None; n];
    let mut written = vec![false; n];
    let mut carried = vec![false; n];
    let mut touch = |b: BufId, i: usize| {
        if let Some(s) = span.get_mut(b) {
            *s = Some(s.map_or((i, i), |(first, _)| (first, i)));
        }
    };
    for (i, (r, w)) in steps.iter().enumerate() {
        // reads first: a step that reads and writes a buffer (a GEMM accumulating into c) reads
        // what was there before it
        for &b in r {
            if !written.get(b).copied().unwrap_or(true) {
                carried[b] = true;
            }
            touch(b, i);
        }
        for &b in w {
            if let Some(x) = written.get_mut(b) {
                *x = true;
            }
            touch(b, i);
        }
    }
    (0..n)
        .map(|b| match (&bufs[b].kind, span[b]) {
            (BufKind::Input(_), _) => Live::Input,
            _ if whole.get(b).copied().unwrap_or(false) || carried[b] => Live::Whole,
            (_, Some((first, last))) => Live::Steps(first, last),
            (_, None) => Live::Never,
        })
        .collect()
}

/// Assigns every span a byte offset (a multiple of [`ALIGN`]) such that spans whose steps
/// overlap never share a byte; returns the offsets and the arena size. Empty spans, and spans
/// that overlap nothing, go at 0.
pub fn assign(spans: &[Span]) -> (Vec<usize>, usize) {
    let size = |i: usize| spans[i].size.next_multiple_of(ALIGN);
    let mut order: Vec<usize> = (0..spans.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(size(i)), spans[i].steps.map(|s| s.0), i));
    let mut offset = vec![0usize; spans.len()];
    let mut placed: Vec<usize> = Vec::with_capacity(spans.len());
    let mut top = 0usize;
    let mut ranges: Vec<(usize, usize)> = Vec::new();
    for i in order {
        let me = size(i);
        if me == 0 {
            continue;
        }
        ranges.clear();
        ranges.extend(placed.iter().filter(|&&p| spans[p].overlaps(&spans[i])).map(|&p| (offset[p], offset[p] + size(p))));
        ranges.sort_unstable();
        // best fit: the smallest gap between overlapping buffers that holds this one (the lowest
        // on ties); a near-miss gap left by a larger buffer is what the smaller ones fill
        let mut best: Option<(usize, usize)> = None; // (gap, offset)
        let mut cursor = 0usize;
        for &(lo, hi) in &ranges {
            if lo > cursor {
                let gap = lo - cursor;
                if gap >= me && best.is_none_or(|(g, _)| gap < g) {
                    best = Some((gap, cursor));
                }
            }
            cursor = cursor.max(hi);
        }
        offset[i] = best.map_or(cursor, |(_, at)| at);
        top = top.max(offset[i] + me);
        placed.push(i);
    }
    (offset, top)
}

/// The most bytes (sizes rounded up to [`ALIGN`]) live at one step: a lower bound on any
/// assignment's arena.
pub fn peak_live(spans: &[Span]) -> usize {
    let end = spans.iter().filter_map(|s| s.steps.map(|(_, last)| last)).max().map_or(0, |l| l + 1);
    let mut diff = vec![0i128; end + 1];
    for s in spans {
        if let Some((first, last)) = s.steps {
            let n = s.size.next_multiple_of(ALIGN) as i128;
            diff[first] += n;
            diff[last + 1] -= n;
        }
    }
    let (mut acc, mut best) = (0i128, 0i128);
    for d in diff {
        acc += d;
        best = best.max(acc);
    }
    best as usize
}

/// Where one buffer is.
enum Home {
    Own(Allocation),
    Arena { offset: usize, len: usize },
}

/// A program's buffers in memory: inputs in their own allocations, the rest in one arena.
pub struct Memory {
    arena: Allocation,
    homes: Vec<Home>,
    live: Vec<Live>,
    report: LayoutReport,
}

impl Memory {
    /// Zeroed memory for `bufs`, laid out by `live` (from [`lifetimes`]).
    pub fn new(bufs: &[Buffer], live: Vec<Live>) -> Result<Memory, RuntimeError> {
        let mut homes = Vec::with_capacity(bufs.len());
        for (b, l) in bufs.iter().zip(&live) {
            homes.push(match l {
                Live::Input => Home::Own(Allocation::zeroed(&b.name, b.bytes())?),
                _ => Home::Arena { offset: 0, len: 0 },
            });
        }
        let mut m =
            Memory { arena: Allocation::zeroed("arena", 0)?, homes, live: vec![Live::Never; bufs.len()], report: LayoutReport::default() };
        m.relayout(bufs, live)?;
        Ok(m)
    }

    /// Lays the arena out again for new lifetimes (hoisting makes some buffers live the whole
    /// run). The inputs stay where they are, and so does the value of every buffer that lives the
    /// whole run both before and after (state carried between runs, outputs of the last run);
    /// the others hold nothing a later step needs and start zeroed.
    pub fn relayout(&mut self, bufs: &[Buffer], live: Vec<Live>) -> Result<(), RuntimeError> {
        let end = live.iter().filter_map(|l| if let Live::Steps(_, last) = l { Some(*last) } else { None }).max().unwrap_or(0);
        let spans: Vec<Span> = bufs
            .iter()
            .zip(&live)
            .map(|(b, l)| match l {
                Live::Input => Span { size: 0, steps: None },
                Live::Whole => Span { size: b.bytes(), steps: Some((0, end)) },
                Live::Steps(first, last) => Span { size: b.bytes(), steps: Some((*first, *last)) },
                Live::Never => Span { size: b.bytes(), steps: None },
            })
            .collect();
        let (offsets, size) = assign(&spans);
        let mut arena = Allocation::zeroed("arena", size)?;
        let mut input_bytes = 0;
        for (b, home) in self.homes.iter_mut().enumerate() {
            match home {
                Home::Own(a) => input_bytes += a.len(),
                Home::Arena { offset, len } => {
                    let (to, n) = (offsets[b], spans[b].size.next_multiple_of(ALIGN));
                    if self.live[b] == Live::Whole && live[b] == Live::Whole && *len == n {
                        arena.bytes_mut()[to..to + n].copy_from_slice(&self.arena.bytes()[*offset..*offset + n]);
                    }
                    *home = Home::Arena { offset: to, len: n };
                }
            }
        }
        let placed_bytes = spans.iter().map(|s| s.size.next_multiple_of(ALIGN)).sum();
        self.report = LayoutReport { arena_bytes: arena.len(), input_bytes, placed_bytes, peak_live_bytes: peak_live(&spans) };
        self.arena = arena;
        self.live = live;
        Ok(())
    }

    pub fn report(&self) -> LayoutReport {
        self.report
    }

    /// Buffer `b`'s base address (64-byte aligned, also for an empty buffer).
    pub fn ptr(&self, b: BufId) -> *mut u8 {
        match &self.homes[b] {
            Home::Own(a) => a.ptr(),
            // in bounds: `relayout` made the arena at least offset + len long
            Home::Arena { offset, .. } => self.arena.ptr().wrapping_add(*offset),
        }
    }

    /// Buffer `b`'s bytes (its size rounded up to [`ALIGN`]; an input's at least one line).
    pub fn bytes(&self, b: BufId) -> &[u8] {
        match &self.homes[b] {
            Home::Own(a) => a.bytes(),
            Home::Arena { offset, len } => &self.arena.bytes()[*offset..*offset + *len],
        }
    }

    pub fn bytes_mut(&mut self, b: BufId) -> &mut [u8] {
        match &mut self.homes[b] {
            Home::Own(a) => a.bytes_mut(),
            Home::Arena { offset, len } => &mut self.arena.bytes_mut()[*offset..*offset + *len],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use qatc_ir::DType;

    /// Every pair of spans that overlap in time is apart in memory; every offset is aligned; the
    /// arena holds every span and is no smaller than the most bytes live at once.
    fn check(spans: &[Span], offsets: &[usize], arena: usize) -> Result<(), String> {
        for (i, a) in spans.iter().enumerate() {
            let ea = offsets[i] + a.size.next_multiple_of(ALIGN);
            if !offsets[i].is_multiple_of(ALIGN) || ea > arena {
                return Err(format!("span {i} at {} ({} bytes) in an arena of {arena}", offsets[i], a.size));
            }
            for (j, b) in spans.iter().enumerate().skip(i + 1) {
                let eb = offsets[j] + b.size.next_multiple_of(ALIGN);
                if a.overlaps(b) && a.size > 0 && b.size > 0 && offsets[i] < eb && offsets[j] < ea {
                    return Err(format!("spans {i} {a:?} at {} and {j} {b:?} at {} share bytes", offsets[i], offsets[j]));
                }
            }
        }
        if arena < peak_live(spans) {
            return Err(format!("arena {arena} below the live peak {}", peak_live(spans)));
        }
        Ok(())
    }

    fn span() -> impl Strategy<Value = Span> {
        // mostly short lives among a few long ones, sizes from empty to a few lines, some spans
        // that are live nowhere
        (0usize..5000, 0usize..40, prop_oneof![4 => 0usize..6, 1 => 0usize..40], 0u8..10)
            .prop_map(|(size, first, len, never)| Span { size, steps: (never > 0).then_some((first, first + len)) })
    }

    proptest! {
        #[test]
        fn live_spans_never_share_bytes(spans in proptest::collection::vec(span(), 0..120)) {
            let (offsets, arena) = assign(&spans);
            prop_assert_eq!(offsets.len(), spans.len());
            if let Err(e) = check(&spans, &offsets, arena) {
                prop_assert!(false, "{}", e);
            }
            let total: usize = spans.iter().map(|s| s.size.next_multiple_of(ALIGN)).sum();
            prop_assert!(arena <= total, "arena {} above the sum of the spans {}", arena, total);
        }
    }

    /// A small deterministic generator (xorshift), so the report below is the same every run.
    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % n as u64) as usize
        }
    }

    /// How close the heuristic gets to the lower bound on step-like lifetimes (most buffers die a
    /// few steps after they are made, a few live long): printed, and held to a loose bound that a
    /// broken placement (everything stacked, or gaps never reused) exceeds.
    #[test]
    fn arena_is_near_the_live_peak() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let (mut worst, mut sum, runs) = (1.0f64, 0.0f64, 200);
        for _ in 0..runs {
            let n = 50 + rng.below(250);
            let spans: Vec<Span> = (0..n)
                .map(|_| {
                    let first = rng.below(200);
                    let len = if rng.below(10) == 0 { rng.below(200) } else { rng.below(8) };
                    let scale = 1 << rng.below(12);
                    Span { size: 64 * (1 + rng.below(scale)), steps: Some((first, first + len)) }
                })
                .collect();
            let (offsets, arena) = assign(&spans);
            check(&spans, &offsets, arena).unwrap();
            let ratio = arena as f64 / peak_live(&spans) as f64;
            worst = worst.max(ratio);
            sum += ratio;
        }
        eprintln!("arena / live peak over {runs} random programs: mean {:.3}, worst {worst:.3}", sum / runs as f64);
        assert!(worst < 1.5, "worst arena {worst:.3}x the live peak");
    }

    fn buf(kind: BufKind, elems: usize) -> Buffer {
        Buffer { name: "b".into(), dtype: DType::F32, shape: vec![elems], kind }
    }

    /// A buffer first read by a step that also writes it (a GEMM accumulating) holds what a run
    /// before left: it must live the whole run; so must the buffers asked for; the others live
    /// from their first step to their last.
    #[test]
    fn read_before_written_lives_the_whole_run() {
        let bufs = vec![
            buf(BufKind::Input("x".into()), 4),
            buf(BufKind::Value, 4),
            buf(BufKind::Temp, 4),
            buf(BufKind::Value, 4),
            buf(BufKind::Value, 4),
            buf(BufKind::Temp, 4),
        ];
        let steps = vec![(vec![0], vec![1]), (vec![1], vec![2]), (vec![2, 3], vec![3]), (vec![3], vec![4])];
        let whole = [false, false, false, false, true, false];
        let live = lifetimes(&bufs, &steps, &whole);
        assert_eq!(live, [Live::Input, Live::Steps(0, 1), Live::Steps(1, 2), Live::Whole, Live::Whole, Live::Never]);
    }

    /// Buffers 1 and 2 never live at once and share bytes; an empty buffer still has an aligned
    /// address; relaying out keeps inputs and whole-run values and zeroes the rest.
    #[test]
    fn memory_shares_and_relays_out() {
        let mut bufs = vec![buf(BufKind::Input("x".into()), 16), buf(BufKind::Value, 16), buf(BufKind::Value, 16), buf(BufKind::Value, 0)];
        bufs[3].shape = vec![0];
        let live = vec![Live::Input, Live::Steps(0, 0), Live::Steps(1, 1), Live::Steps(0, 1)];
        let mut m = Memory::new(&bufs, live).unwrap();
        assert_eq!(m.ptr(1), m.ptr(2));
        assert!((0..4).all(|b| (m.ptr(b) as usize).is_multiple_of(ALIGN)));
        assert_eq!(m.report(), LayoutReport { arena_bytes: 64, input_bytes: 64, placed_bytes: 128, peak_live_bytes: 64 });
        m.bytes_mut(0)[0] = 7;
        m.bytes_mut(1)[0] = 8;
        m.relayout(&bufs, vec![Live::Input, Live::Whole, Live::Steps(1, 1), Live::Steps(0, 1)]).unwrap();
        assert_ne!(m.ptr(1), m.ptr(2));
        assert_eq!((m.bytes(0)[0], m.bytes(1)[0]), (7, 0), "buffer 1 was not whole-run before: nothing to keep");
        m.bytes_mut(1)[0] = 9;
        m.relayout(&bufs, vec![Live::Input, Live::Whole, Live::Whole, Live::Never]).unwrap();
        assert_eq!((m.bytes(0)[0], m.bytes(1)[0], m.bytes(2)[0]), (7, 9, 0));
        assert_eq!(m.report().arena_bytes, 128);
    }
}
