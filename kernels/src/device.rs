//! Is there a CUDA GPU here, and which? Asked of the driver library directly (dlopen
//! `libcuda.so.1`, `cuInit`, `cuDeviceGetCount`, ...), because cudarc's dynamic loading panics
//! when a library is missing and `--device auto` must instead fall back to the CPU with a notice.

use libloading::{Library, Symbol};

use crate::nvrtc::Arch;

/// One device as the driver describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub name: String,
    /// Compute capability (major, minor).
    pub capability: (i32, i32),
    pub total_memory: usize,
}

impl DeviceInfo {
    /// The architecture kernels compile for on this device.
    pub fn arch(&self) -> Option<Arch> {
        Arch::from_capability(self.capability.0, self.capability.1)
    }
}

/// What the probe found: the devices the driver reports (at least one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaProbe {
    pub devices: usize,
    /// Device 0, where the driver answered the questions.
    pub first: Option<DeviceInfo>,
}

type CuInit = unsafe extern "C" fn(flags: u32) -> i32;
type CuDeviceGetCount = unsafe extern "C" fn(count: *mut i32) -> i32;
type CuDeviceGet = unsafe extern "C" fn(dev: *mut i32, ordinal: i32) -> i32;
type CuDeviceGetName = unsafe extern "C" fn(name: *mut std::ffi::c_char, len: i32, dev: i32) -> i32;
type CuDeviceGetAttribute = unsafe extern "C" fn(v: *mut i32, attrib: i32, dev: i32) -> i32;
type CuDeviceTotalMem = unsafe extern "C" fn(bytes: *mut usize, dev: i32) -> i32;

/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR` / `_MINOR` (cuda.h).
const CC_MAJOR: i32 = 75;
const CC_MINOR: i32 = 76;

/// The CUDA devices the driver sees, or why there are none (no driver library, `cuInit` failed,
/// zero devices), in words for a one-line notice.
pub fn probe_cuda() -> Result<CudaProbe, String> {
    // SAFETY: loading the NVIDIA driver library runs its initializers, which is what every CUDA
    // program does; nothing else of ours is touched.
    let lib = unsafe { Library::new("libcuda.so.1") }.map_err(|e| format!("no CUDA driver ({e})"))?;
    // SAFETY: the symbols are looked up with the signatures of the CUDA driver API (cuda.h):
    // CUresult cuInit(unsigned int) and CUresult cuDeviceGetCount(int*).
    let n = unsafe {
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
        n as usize
    };
    Ok(CudaProbe { devices: n, first: describe(&lib, 0) })
}

/// Name, compute capability and memory of device `ordinal`; None when the driver lacks a symbol
/// or refuses (the count alone still answers "is there a GPU").
fn describe(lib: &Library, ordinal: i32) -> Option<DeviceInfo> {
    // SAFETY: the symbols are looked up with their cuda.h signatures (cuDeviceTotalMem_v2 is the
    // size_t version); every out-pointer is to a local, the name buffer's length is passed.
    unsafe {
        let get: Symbol<CuDeviceGet> = lib.get(b"cuDeviceGet\0").ok()?;
        let name: Symbol<CuDeviceGetName> = lib.get(b"cuDeviceGetName\0").ok()?;
        let attr: Symbol<CuDeviceGetAttribute> = lib.get(b"cuDeviceGetAttribute\0").ok()?;
        let mem: Symbol<CuDeviceTotalMem> = lib.get(b"cuDeviceTotalMem_v2\0").ok()?;
        let mut dev = 0;
        (get(&mut dev, ordinal) == 0).then_some(())?;
        let mut buf = [0 as std::ffi::c_char; 256];
        (name(buf.as_mut_ptr(), buf.len() as i32, dev) == 0).then_some(())?;
        let name = std::ffi::CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned();
        let (mut major, mut minor) = (0, 0);
        (attr(&mut major, CC_MAJOR, dev) == 0 && attr(&mut minor, CC_MINOR, dev) == 0).then_some(())?;
        let mut bytes = 0usize;
        (mem(&mut bytes, dev) == 0).then_some(())?;
        Some(DeviceInfo { name, capability: (major, minor), total_memory: bytes })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_probe_answers_without_panicking() {
        // on a machine without a GPU this is an Err with a reason; with one, a device count and
        // (from any driver of the last decade) device 0's description
        match super::probe_cuda() {
            Ok(p) => {
                assert!(p.devices > 0);
                let d = p.first.expect("device 0 described");
                assert!(d.capability.0 >= 5 && d.total_memory > 0 && !d.name.is_empty(), "{d:?}");
                eprintln!("GPU: {} (sm_{}{}), {} bytes", d.name, d.capability.0, d.capability.1, d.total_memory);
            }
            Err(why) => {
                eprintln!("SKIPPED (no GPU): {why}");
                assert!(!why.is_empty());
            }
        }
    }
}
