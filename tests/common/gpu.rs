//! The GPU for the tests that need one: the driver and NVRTC, or a skip that says why.

use qatc_kernels::nvrtc::Nvrtc;
use qatc_runtime::cuda::{CudaDriver, GpuApi};

/// The GPU and NVRTC, or None with the reason printed (the tests that need a GPU skip so).
pub fn gpu() -> Option<(CudaDriver, Nvrtc)> {
    let g = match CudaDriver::open(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("SKIPPED (no GPU): {e}");
            return None;
        }
    };
    let nv = super::nvrtc::nvrtc()?;
    eprintln!("GPU: {} ({}), NVRTC {}.{}", g.device().name, g.device().arch, nv.version.0, nv.version.1);
    Some((g, nv))
}
