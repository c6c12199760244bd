//! Is there a CUDA GPU here? Asked of the driver library directly (dlopen `libcuda.so.1`,
//! `cuInit`, `cuDeviceGetCount`), because cudarc's dynamic loading panics when a library is
//! missing and `--device auto` must instead fall back to the CPU with a notice.

use libloading::{Library, Symbol};

/// What the probe found: the number of CUDA devices the driver reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaProbe {
    pub devices: usize,
}

type CuInit = unsafe extern "C" fn(flags: u32) -> i32;
type CuDeviceGetCount = unsafe extern "C" fn(count: *mut i32) -> i32;

/// The CUDA devices the driver sees, or why there are none (no driver library, `cuInit` failed,
/// zero devices), in words for a one-line notice.
pub fn probe_cuda() -> Result<CudaProbe, String> {
    // SAFETY: loading the NVIDIA driver library runs its initializers, which is what every CUDA
    // program does; nothing else of ours is touched.
    let lib = unsafe { Library::new("libcuda.so.1") }.map_err(|e| format!("no CUDA driver ({e})"))?;
    // SAFETY: the symbols are looked up with the signatures of the CUDA driver API (cuda.h):
    // CUresult cuInit(unsigned int) and CUresult cuDeviceGetCount(int*).
    unsafe {
        let init: Symbol<CuInit> = lib.get(b"cuInit\0").map_err(|e| format!("the CUDA driver has no cuInit ({e})"))?;
        let rc = init(0);
        if rc != 0 {
            return Err(format!("cuInit failed (CUresult {rc}): no usable GPU"));
        }
        let count: Symbol<CuDeviceGetCount> =
            lib.get(b"cuDeviceGetCount\0").map_err(|e| format!("the CUDA driver has no cuDeviceGetCount ({e})"))?;
        let mut n: i32 = 0;
        let rc = count(&mut n);
        if rc != 0 || n <= 0 {
            return Err(format!("the CUDA driver reports no device (CUresult {rc}, {n} devices)"));
        }
        Ok(CudaProbe { devices: n as usize })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_probe_answers_without_panicking() {
        // on a machine without a GPU this is an Err with a reason; with one, a device count
        match super::probe_cuda() {
            Ok(p) => assert!(p.devices > 0),
            Err(why) => assert!(!why.is_empty()),
        }
    }
}
