//! A kernel's hardware resources as ptxas reports them with `-v` (through NVRTC's
//! `--ptxas-options=-v`, into the program log):
//!
//! ```text
//! ptxas info    : Compiling entry function 'fused_x' for 'sm_90'
//! ptxas info    : Function properties for fused_x
//! ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
//! ptxas info    : Used 10 registers, used 1 barriers, 256 bytes smem, 380 bytes cmem[0]
//! ```
//!
//! The report is ptxas' own account, read by entry function; `tests/nvrtc.rs` checks its
//! register count against the `EIATTR_REGCOUNT` attribute in the CUBIN's `.nv.info` section.

use serde::Serialize;

/// Per-thread registers, spills and stack, per-block static shared memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Resources {
    pub registers: u32,
    /// Static shared memory per block, bytes.
    pub shared_bytes: u32,
    /// Local-memory stack frame per thread, bytes (arrays indexed at run time live here).
    pub stack_bytes: u32,
    pub spill_store_bytes: u32,
    pub spill_load_bytes: u32,
    pub barriers: u32,
}

impl Resources {
    pub fn spills(&self) -> bool {
        self.spill_store_bytes > 0 || self.spill_load_bytes > 0
    }
}

/// The number written just before `unit` in `line` (`10 registers` -> 10).
fn number_before(line: &str, unit: &str) -> Option<u32> {
    let at = line.find(unit)?;
    line[..at].split(|c: char| !c.is_ascii_digit()).rfind(|w| !w.is_empty())?.parse().ok()
}

/// The resources of entry function `name` in a ptxas `-v` log, or None when the log has no
/// report for it (ptxas did not run with `-v`, or the name is wrong).
pub fn parse(log: &str, name: &str) -> Option<Resources> {
    let head = format!("Compiling entry function '{name}'");
    let mut lines = log.lines().skip_while(|l| !l.contains(&head));
    lines.next()?;
    let mut r = Resources::default();
    let mut used = false;
    for line in lines {
        if line.contains("Compiling entry function") {
            break;
        }
        if line.contains("bytes stack frame") {
            r.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
            r.spill_store_bytes = number_before(line, "bytes spill stores").unwrap_or(0);
            r.spill_load_bytes = number_before(line, "bytes spill loads").unwrap_or(0);
        }
        if line.contains("Used ") && line.contains("registers") {
            used = true;
            r.registers = number_before(line, "registers")?;
            r.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
            r.barriers = number_before(line, "barriers").unwrap_or(0);
        }
    }
    used.then_some(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "ptxas info    : 0 bytes gmem, 64 bytes cmem[3]
ptxas info    : Compiling entry function 'first' for 'sm_90'
ptxas info    : Function properties for first
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 1 barriers, 256 bytes smem
ptxas info    : Compile time = 25.883 ms
ptxas info    : Compiling entry function 'second' for 'sm_90'
ptxas info    : Function properties for second
ptxas         .     416 bytes stack frame, 24 bytes spill stores, 28 bytes spill loads
ptxas info    : Used 255 registers, 380 bytes cmem[0]
";

    #[test]
    fn reads_each_entry_function_of_a_verbose_ptxas_log() {
        let a = parse(LOG, "first").expect("reported");
        assert_eq!(a, Resources { registers: 10, shared_bytes: 256, barriers: 1, ..Resources::default() });
        let b = parse(LOG, "second").expect("reported");
        assert_eq!(
            b,
            Resources { registers: 255, stack_bytes: 416, spill_store_bytes: 24, spill_load_bytes: 28, shared_bytes: 0, barriers: 0 }
        );
        assert!(b.spills() && !a.spills());
        assert_eq!(parse(LOG, "third"), None);
        assert_eq!(parse("", "first"), None);
    }
}
