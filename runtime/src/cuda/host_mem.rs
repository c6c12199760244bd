//! The emulated device memory of [`HostGpu`](super::HostGpu): host allocations behind fake device
//! addresses. Allocations start 256-byte aligned (as cudaMalloc's) with a gap of at least 256
//! bytes between them, so an address past an allocation's end is in no allocation and every access
//! is checked against the allocation it starts in. New memory is filled with 0xff bytes (NaN as
//! f32, -1 as i32), so a kernel that reads what nothing wrote shows it.

use std::collections::BTreeMap;

use half::{bf16, f16};
use qatc_kernels::cuda::blas::ElemType;

use super::{DevPtr, GpuError, Result};

/// Where the fake addresses start: far from anything a test would mistake for a real pointer.
const BASE: DevPtr = 0x7f00_0000_0000;
pub const ALIGN: u64 = qatc_kernels::target::CUDA_ALIGN as u64;

struct Alloc {
    bytes: usize,
    /// 8-byte aligned backing storage of at least `bytes` bytes.
    data: Vec<u64>,
}

/// Device memory: allocations by base address, and what they add up to.
pub struct DeviceMemory {
    allocs: BTreeMap<DevPtr, Alloc>,
    next: DevPtr,
    pub used: usize,
    pub peak: usize,
    pub capacity: usize,
}

impl DeviceMemory {
    pub fn new(capacity: usize) -> DeviceMemory {
        DeviceMemory { allocs: BTreeMap::new(), next: BASE, used: 0, peak: 0, capacity }
    }

    pub fn alloc(&mut self, bytes: usize) -> Result<DevPtr> {
        if self.used.saturating_add(bytes) > self.capacity {
            return Err(GpuError::Driver {
                call: format!("cuMemAlloc({bytes})"),
                name: "CUDA_ERROR_OUT_OF_MEMORY".into(),
                message: format!("out of memory: {} of {} bytes in use", self.used, self.capacity),
            });
        }
        let base = self.next;
        self.next += (bytes as u64).div_ceil(ALIGN) * ALIGN + ALIGN;
        self.allocs.insert(base, Alloc { bytes, data: vec![u64::MAX; bytes.div_ceil(8)] });
        self.used += bytes;
        self.peak = self.peak.max(self.used);
        Ok(base)
    }

    pub fn free(&mut self, ptr: DevPtr) -> Result<()> {
        let a = self.allocs.remove(&ptr).ok_or_else(|| GpuError::Invalid(format!("free of {ptr:#x}, which no allocation starts at")))?;
        self.used -= a.bytes;
        Ok(())
    }

    /// (allocation base, offset of `ptr` in it, bytes from `ptr` to the allocation's end).
    pub fn locate(&self, ptr: DevPtr) -> Result<(DevPtr, usize, usize)> {
        let (&base, a) = self.allocs.range(..=ptr).next_back().ok_or_else(|| GpuError::Invalid(format!("{ptr:#x} is in no allocation")))?;
        let off = (ptr - base) as usize;
        if off >= a.bytes.max(1) {
            return Err(GpuError::Invalid(format!(
                "{ptr:#x} is {} bytes past the end of the {}-byte allocation at {base:#x}",
                off - a.bytes,
                a.bytes
            )));
        }
        Ok((base, off, a.bytes - off))
    }

    fn alloc_of(&mut self, base: DevPtr) -> Result<&mut Alloc> {
        self.allocs.get_mut(&base).ok_or_else(|| GpuError::Invalid(format!("no allocation at {base:#x}")))
    }

    /// `len` bytes at `ptr`, all inside one allocation.
    pub fn bytes_mut(&mut self, ptr: DevPtr, len: usize) -> Result<&mut [u8]> {
        if len == 0 {
            return Ok(&mut []);
        }
        let (base, off, left) = self.locate(ptr)?;
        if len > left {
            return Err(GpuError::Invalid(format!("{len} bytes at {ptr:#x}: only {left} left in its allocation at {base:#x}")));
        }
        let a = self.alloc_of(base)?;
        let bytes = a.bytes;
        // SAFETY: `data` holds at least `bytes` bytes (len of u64s rounded up), u8 has no
        // alignment or validity requirement, and the slice borrows `a` mutably for its lifetime.
        let all = unsafe { std::slice::from_raw_parts_mut(a.data.as_mut_ptr().cast::<u8>(), bytes) };
        Ok(&mut all[off..off + len])
    }

    /// `len` bytes at `ptr`, read only.
    pub fn bytes(&self, ptr: DevPtr, len: usize) -> Result<&[u8]> {
        if len == 0 {
            return Ok(&[]);
        }
        let (base, off, left) = self.locate(ptr)?;
        if len > left {
            return Err(GpuError::Invalid(format!("{len} bytes at {ptr:#x}: only {left} left in its allocation at {base:#x}")));
        }
        let a = self.allocs.get(&base).ok_or_else(|| GpuError::Invalid(format!("no allocation at {base:#x}")))?;
        // SAFETY: as `bytes_mut`, shared.
        let all = unsafe { std::slice::from_raw_parts(a.data.as_ptr().cast::<u8>(), a.bytes) };
        Ok(&all[off..off + len])
    }

    /// The host address of `ptr` and the bytes from there to its allocation's end, for a kernel
    /// launch (the evaluator checks every access against its param's size).
    pub fn host_ptr(&mut self, ptr: DevPtr) -> Result<(*mut u8, usize)> {
        let (base, off, left) = self.locate(ptr)?;
        let a = self.alloc_of(base)?;
        // SAFETY: off < bytes <= the backing storage's size, so the pointer stays inside `data`.
        Ok((unsafe { a.data.as_mut_ptr().cast::<u8>().add(off) }, left))
    }

    /// Element `i` (of type `ty`) of the array at `ptr`, as f32.
    pub fn load(&self, ptr: DevPtr, i: usize, ty: ElemType) -> Result<f32> {
        let n = ty.bytes();
        let b = self.bytes(ptr + (i * n) as u64, n)?;
        Ok(match ty {
            ElemType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            ElemType::F16 => f16::from_le_bytes([b[0], b[1]]).to_f32(),
            ElemType::BF16 => bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        })
    }

    /// Stores `v` into element `i`, rounded to nearest even for 16-bit types.
    pub fn store(&mut self, ptr: DevPtr, i: usize, ty: ElemType, v: f32) -> Result<()> {
        let n = ty.bytes();
        let b = self.bytes_mut(ptr + (i * n) as u64, n)?;
        match ty {
            ElemType::F32 => b.copy_from_slice(&v.to_le_bytes()),
            ElemType::F16 => b.copy_from_slice(&f16::from_f32(v).to_le_bytes()),
            ElemType::BF16 => b.copy_from_slice(&bf16::from_f32(v).to_le_bytes()),
        }
        Ok(())
    }

    /// Copies `bytes` between two device ranges (which may be in the same allocation).
    pub fn copy(&mut self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<()> {
        let data = self.bytes(src, bytes)?.to_vec();
        self.bytes_mut(dst, bytes)?.copy_from_slice(&data);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_aligned_apart_poisoned_and_checked() {
        let mut m = DeviceMemory::new(1 << 20);
        let a = m.alloc(10).expect("room");
        let b = m.alloc(3).expect("room");
        assert_eq!((a % ALIGN, b % ALIGN), (0, 0));
        assert!(b >= a + 10 + ALIGN, "a gap between allocations");
        assert_eq!(m.bytes(a, 10).expect("inside"), &[0xff; 10]);
        assert!(m.bytes(a + 8, 4).is_err(), "two bytes past the end");
        assert!(m.locate(a + 10).is_err() && m.locate(b + 3).is_err());
        m.store(a, 1, ElemType::F32, 2.5).expect("inside");
        assert_eq!(m.load(a, 1, ElemType::F32).expect("inside"), 2.5);
        assert!(m.load(a, 0, ElemType::F32).expect("inside").is_nan(), "unwritten f32 reads as NaN");
        m.store(b, 0, ElemType::BF16, 1.0 + 1.0 / 256.0).expect("inside");
        assert_eq!(m.load(b, 0, ElemType::BF16).expect("inside"), 1.0, "rounded to bf16 (ties to even)");
        assert_eq!(m.used, 13);
        m.free(a).expect("freed");
        assert!(m.free(a).is_err() && m.locate(a).is_err());
        assert_eq!((m.used, m.peak), (3, 13));
        assert!(m.alloc(1 << 21).is_err(), "past the capacity: out of memory");
    }
}
