//! A program's memory on the CPU: one zeroed allocation per region of the layout
//! (`exec::layout`: arena, persistent inputs, per-step data inputs), each aligned to the
//! layout's alignment, and every buffer at its offset in its region.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use qatc_kernels::program::BufId;

use crate::error::RuntimeError;
use crate::exec::{MemoryLayout, Place, Region};

/// The CPU's alignment (`Target::cpu`'s): a cache line, so no two buffers share a line and
/// vector loads of any width are aligned.
pub use qatc_kernels::target::CPU_ALIGN as ALIGN;

/// What `zeroed` asks the allocator for: std's `alloc_zeroed` of a larger alignment is
/// `posix_memalign` plus a memset that touches every page at once, while at this one it is
/// `calloc`, which leaves the fresh pages of a large allocation untouched (and not resident)
/// until used (the arena's bytes that no buffer of the step reaches, say).
const ALLOC_ALIGN: usize = 16;

/// Zeroed memory owned like a `Box<[u8]>`, but aligned to a chosen power of two.
pub struct Allocation {
    /// What the allocator returned, with `layout`.
    base: NonNull<u8>,
    layout: Layout,
    /// From `base` to the first aligned byte.
    offset: usize,
    len: usize,
}

// SAFETY: an Allocation uniquely owns its memory (as Box<[u8]> does, which is Send and Sync); it
// hands out `&[u8]` through `&self` and `&mut [u8]` through `&mut self` only, and raw pointers
// that the executor dereferences only while it holds `&mut` of the whole program.
unsafe impl Send for Allocation {}
// SAFETY: see Send: shared access only reads.
unsafe impl Sync for Allocation {}

impl Allocation {
    /// `bytes` zeroed bytes for `name` (a region), starting at a multiple of `align` (a power of
    /// two, at least [`ALIGN`] is used).
    pub fn zeroed(name: &str, bytes: usize, align: usize) -> Result<Allocation, RuntimeError> {
        let err = |msg: String| RuntimeError::Buffer { name: name.to_string(), msg };
        let align = align.max(ALIGN);
        if !align.is_power_of_two() {
            return Err(err(format!("alignment {align} is not a power of two")));
        }
        // an empty region gets one line (never read): a zero-size layout may not be allocated
        let len = bytes.max(1).next_multiple_of(align);
        // aligned by hand: room for the slack up to the next boundary (see ALLOC_ALIGN)
        let size = len.checked_add(align - ALLOC_ALIGN).ok_or_else(|| err(format!("{bytes} bytes: too many")))?;
        let layout = Layout::from_size_align(size, ALLOC_ALIGN).map_err(|e| err(format!("{bytes} bytes: {e}")))?;
        // SAFETY: the layout's size is at least `align`, so non-zero.
        let p = unsafe { alloc_zeroed(layout) };
        let base = NonNull::new(p).ok_or_else(|| err(format!("cannot allocate {bytes} bytes")))?;
        let offset = p.align_offset(align);
        if offset > align - ALLOC_ALIGN {
            // SAFETY: allocated just above with this layout, and not handed out.
            unsafe { dealloc(p, layout) };
            return Err(err(format!("the allocator returned {p:?}, not {ALLOC_ALIGN}-byte aligned")));
        }
        Ok(Allocation { base, layout, offset, len })
    }

    /// The base address: aligned as asked.
    pub fn ptr(&self) -> *mut u8 {
        // in bounds: `zeroed` checked that offset + len fits in the allocation
        self.base.as_ptr().wrapping_add(self.offset)
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr()..ptr() + len` lies inside the live allocation (`zeroed` reserved the
        // slack before it) and is initialized (zeroed at allocation); `&self` excludes writers
        // (the executor writes only through `&mut`).
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len) }
    }

    /// Bytes it holds (its aligned length; an empty region holds one line).
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len) }
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this very layout at `base`, and freed only here.
        unsafe { dealloc(self.base.as_ptr(), self.layout) }
    }
}

/// A program's buffers in memory, as its layout places them.
pub struct Memory {
    arena: Allocation,
    persistent: Allocation,
    data: Allocation,
    places: Vec<Place>,
}

impl Memory {
    /// Zeroed memory for every region of `layout`.
    pub fn new(layout: &MemoryLayout) -> Result<Memory, RuntimeError> {
        let region = |r: Region, name: &str| Allocation::zeroed(name, layout.region_bytes(r), layout.align);
        Ok(Memory {
            arena: region(Region::Arena, "arena")?,
            persistent: region(Region::Persistent, "persistent inputs")?,
            data: region(Region::Data, "data inputs")?,
            places: layout.places.clone(),
        })
    }

    fn region(&self, r: Region) -> &Allocation {
        match r {
            Region::Arena => &self.arena,
            Region::Persistent => &self.persistent,
            Region::Data => &self.data,
        }
    }

    /// Bytes the three allocations hold, as allocated (what `qatc train` says it holds).
    pub fn held_bytes(&self) -> usize {
        self.arena.len() + self.persistent.len() + self.data.len()
    }

    /// Region `r`'s base address.
    pub fn base(&self, r: Region) -> *mut u8 {
        self.region(r).ptr()
    }

    /// Buffer `b`'s base address (aligned, also for an empty buffer).
    pub fn ptr(&self, b: BufId) -> *mut u8 {
        let p = &self.places[b];
        // in bounds: the region is at least as long as the layout says, and every place in it
        // ends inside it (an empty buffer at its end points at the region's spare line)
        self.region(p.region).ptr().wrapping_add(p.offset)
    }

    /// Buffer `b`'s bytes (its size rounded up to the alignment).
    pub fn bytes(&self, b: BufId) -> &[u8] {
        let p = &self.places[b];
        &self.region(p.region).bytes()[p.offset..p.offset + p.bytes]
    }

    pub fn bytes_mut(&mut self, b: BufId) -> &mut [u8] {
        let p = self.places[b];
        let region = match p.region {
            Region::Arena => &mut self.arena,
            Region::Persistent => &mut self.persistent,
            Region::Data => &mut self.data,
        };
        &mut region.bytes_mut()[p.offset..p.offset + p.bytes]
    }

    /// Copies `bytes` bytes from byte `from_offset` of buffer `from` over the start of buffer `to`
    /// (an update's write-back). The two never overlap: `to` is an input, `from` another buffer
    /// (`ExecPlan` refuses a write-back from an input that is itself written back).
    pub fn copy(&mut self, from: BufId, from_offset: usize, to: BufId, bytes: usize) -> Result<(), RuntimeError> {
        let (pf, pt) = (self.places[from], self.places[to]);
        if from == to || from_offset + bytes > pf.bytes || bytes > pt.bytes {
            return Err(RuntimeError::Buffer { name: format!("#{to}"), msg: format!("write-back of {bytes} bytes from buffer {from}") });
        }
        let src = self.ptr(from).wrapping_add(from_offset);
        // SAFETY: both ranges lie inside their buffers' places (checked above), which lie inside
        // their regions; they do not overlap (distinct buffers: different regions, or disjoint
        // places of one region, as `to` is an input and inputs are placed one after the other);
        // `&mut self` keeps every other access away.
        unsafe { std::ptr::copy_nonoverlapping(src, self.ptr(to), bytes) };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_aligned_and_zeroed() {
        for align in [16, 64, 256, 4096] {
            let a = Allocation::zeroed("t", 1000, align).unwrap();
            assert_eq!(a.ptr() as usize % align.max(ALIGN), 0);
            assert!(a.bytes().len() >= 1000 && a.bytes().iter().all(|&b| b == 0));
        }
        assert!(Allocation::zeroed("t", 0, 64).unwrap().bytes().len() == 64, "an empty region still has a line");
        assert!(Allocation::zeroed("t", 10, 96).is_err());
    }
}
