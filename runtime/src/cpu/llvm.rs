//! Kernels compiled by the LLVM backend (`qatc_kernels::llvm`) as a [`Launcher`]: each kernel is
//! a native function over one range of its iterations.

use qatc_kernels::llvm::Jit;

use super::Launcher;
use crate::error::RuntimeError;

impl Launcher for Jit {
    unsafe fn launch(&self, kernel: usize, args: &[*mut u8], start: usize, end: usize) -> Result<(), RuntimeError> {
        let name = || self.name(kernel).unwrap_or("?").to_string();
        let f = self
            .function(kernel)
            .ok_or_else(|| RuntimeError::Kernel { kernel: format!("#{kernel}"), msg: format!("the JIT has {} kernels", self.len()) })?;
        if start > end {
            return Err(RuntimeError::Kernel { kernel: name(), msg: format!("iterations {start}..{end}") });
        }
        // SAFETY: the caller guarantees one pointer per param of this kernel, each to an
        // allocation of the param's size that nothing else touches but other ranges of this
        // launch; the compiled function reads `args` as that array and runs start..end only.
        unsafe { f(args.as_ptr(), start as u64, end as u64) };
        Ok(())
    }
}
