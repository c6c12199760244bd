//! CUBINs on disk. An entry is keyed by the SHA-256 of everything that decides the machine code:
//! the NVRTC version, the architecture, the options, every helper header and the source. It is
//! two files, `KEY.cubin` and `KEY.log` (ptxas' report, so a cached kernel still reports its
//! registers), under `DIR/cubin/ARCH/`, each written to a temporary file and renamed into place:
//! concurrent builds never read half an entry, and a damaged entry (not an ELF file, or no log)
//! is compiled again and overwritten.
//!
//! The directory is a value the caller passes (`qatc compile` resolves `--kernel-cache`, then
//! `$XDG_CACHE_HOME/qatc`, then `~/.cache/qatc`); this crate reads no setting from the environment.

use std::path::{Path, PathBuf};

use super::Arch;
use crate::cuda::emit::headers;
use crate::disk_cache::{write_atomic, Key};
use crate::error::KernelError;

/// A cache directory.
#[derive(Clone, Debug)]
pub struct KernelCache {
    dir: PathBuf,
}

/// One cached compile.
pub struct Entry {
    pub cubin: Vec<u8>,
    pub log: String,
}

const ELF_MAGIC: &[u8] = b"\x7fELF";

impl KernelCache {
    pub fn new(dir: impl Into<PathBuf>) -> KernelCache {
        KernelCache { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The key of one compile: hex SHA-256 over its inputs, each length-prefixed so no two
    /// different input lists hash the same bytes.
    pub fn key(nvrtc: (i32, i32), arch: Arch, options: &[String], source: &str) -> String {
        let mut k = Key::new();
        k.field(format!("nvrtc {}.{}", nvrtc.0, nvrtc.1).as_bytes()).field(arch.name().as_bytes());
        for o in options {
            k.field(o.as_bytes());
        }
        for (name, text) in headers() {
            k.field(name.as_bytes()).field(text.as_bytes());
        }
        k.field(source.as_bytes());
        k.hex()
    }

    fn path(&self, arch: Arch, key: &str, ext: &str) -> PathBuf {
        self.dir.join("cubin").join(arch.name()).join(format!("{key}.{ext}"))
    }

    /// The entry for `key`, if a whole one is there.
    pub fn get(&self, arch: Arch, key: &str) -> Option<Entry> {
        let cubin = std::fs::read(self.path(arch, key, "cubin")).ok()?;
        let log = std::fs::read_to_string(self.path(arch, key, "log")).ok()?;
        cubin.starts_with(ELF_MAGIC).then_some(Entry { cubin, log })
    }

    /// Stores an entry (the log first: `get` needs both, and the CUBIN is what it checks).
    pub fn put(&self, arch: Arch, key: &str, cubin: &[u8], log: &str) -> Result<(), KernelError> {
        write_atomic(&self.path(arch, key, "log"), log.as_bytes())?;
        write_atomic(&self.path(arch, key, "cubin"), cubin)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_damaged_ones_are_misses() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let cache = KernelCache::new(dir.path());
        let key = KernelCache::key((13, 0), Arch::SM90, &["-lineinfo".into()], "src");
        assert_eq!(key.len(), 64);
        assert!(cache.get(Arch::SM90, &key).is_none());
        cache.put(Arch::SM90, &key, b"\x7fELF...", "ptxas info").expect("written");
        let e = cache.get(Arch::SM90, &key).expect("a hit");
        assert_eq!((e.cubin.as_slice(), e.log.as_str()), (&b"\x7fELF..."[..], "ptxas info"));
        // another architecture is another entry
        assert!(cache.get(Arch::SM80, &key).is_none());
        // a truncated CUBIN is no hit
        std::fs::write(cache.path(Arch::SM90, &key, "cubin"), b"\x7fE").expect("written");
        assert!(cache.get(Arch::SM90, &key).is_none());
    }

    #[test]
    fn the_key_changes_with_every_input() {
        let base = KernelCache::key((13, 0), Arch::SM90, &["-a".into()], "src");
        assert_ne!(base, KernelCache::key((13, 1), Arch::SM90, &["-a".into()], "src"));
        assert_ne!(base, KernelCache::key((13, 0), Arch::SM80, &["-a".into()], "src"));
        assert_ne!(base, KernelCache::key((13, 0), Arch::SM90, &["-b".into()], "src"));
        assert_ne!(base, KernelCache::key((13, 0), Arch::SM90, &["-a".into()], "src2"));
        // length prefixes: moving bytes between fields changes the key
        assert_ne!(
            KernelCache::key((13, 0), Arch::SM90, &["-ab".into()], "c"),
            KernelCache::key((13, 0), Arch::SM90, &["-a".into()], "bc")
        );
    }
}
