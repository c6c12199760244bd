//! The CPU backend's kernel cache on disk: object code, as NVRTC's cache keeps CUBINs
//! (`nvrtc/cache.rs`). An entry is keyed by the SHA-256 of everything that decides the machine
//! code: qatc's format version, the LLVM version, the target triple, the host CPU's name and features, the optimization
//! pipeline, and the kernel's LLVM module as the optimizer receives it (its functions carrying
//! the CPU, the features and the preferred vector width as attributes). Keying on the module
//! rather than on the kernel IR means a change to how qatc writes LLVM IR is a new key, never a
//! stale hit.
//!
//! An entry is one file, `DIR/cpu/CPU/KEY.o`: a header (`QATCOBJ1` and the SHA-256 of the
//! object) and the ELF object. It is written to a temporary file and renamed into place, so
//! processes sharing a cache never read half an entry; one that is truncated or damaged fails its
//! checksum and is compiled again and overwritten.
//!
//! The directory is a value the caller passes (the driver's `Options::kernel_cache`: `qatc`
//! resolves `$XDG_CACHE_HOME/qatc`, then `~/.cache/qatc`); this crate reads no setting from the
//! environment.

use std::path::{Path, PathBuf};

use inkwell::targets::TargetMachine;

use crate::disk_cache::{sha256, write_atomic, Key};
use crate::error::KernelError;

/// What the machine code depends on besides the module and the pipeline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostCpu {
    /// LLVM's version, as the library loaded reports it (major, minor, patch).
    pub llvm: (u32, u32, u32),
    pub triple: String,
    /// LLVM's name for the host CPU (`znver3`, `sapphirerapids`).
    pub cpu: String,
    /// The host CPU's features as LLVM lists them (`+avx2,+fma,-avx512f,...`).
    pub features: String,
}

impl HostCpu {
    /// This machine, as LLVM sees it.
    pub fn this() -> HostCpu {
        let (mut major, mut minor, mut patch) = (0, 0, 0);
        // SAFETY: LLVMGetVersion only writes three unsigned ints through valid pointers to locals.
        unsafe { inkwell::llvm_sys::core::LLVMGetVersion(&mut major, &mut minor, &mut patch) };
        HostCpu {
            llvm: (major, minor, patch),
            triple: TargetMachine::get_default_triple().as_str().to_string_lossy().into_owned(),
            cpu: TargetMachine::get_host_cpu_name().to_string(),
            features: TargetMachine::get_host_cpu_features().to_string(),
        }
    }
}

/// A cache directory.
#[derive(Clone, Debug)]
pub struct ObjectCache {
    dir: PathBuf,
}

/// The version of how qatc keys and stores entries: a change to either (the header, the fields
/// hashed, how a kernel's module is written before it is hashed, if that could leave the text
/// the same) bumps it, and every older entry becomes a miss rather than a wrong hit.
const FORMAT: &str = "qatc cpu object cache 1";
const MAGIC: &[u8; 8] = b"QATCOBJ1";
const HEADER: usize = MAGIC.len() + 32;
const ELF_MAGIC: &[u8] = b"\x7fELF";

impl ObjectCache {
    /// The cache in `dir` (the kernel cache's directory; entries go under `dir/cpu/`).
    pub fn new(dir: impl Into<PathBuf>) -> ObjectCache {
        ObjectCache { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The key of one kernel's object code: `pipeline` names the optimization and code
    /// generation it goes through, `module` is its LLVM IR as the optimizer receives it.
    pub fn key(host: &HostCpu, pipeline: &str, module: &str) -> String {
        let mut k = Key::new();
        let (a, b, c) = host.llvm;
        k.field(FORMAT.as_bytes())
            .field(format!("llvm {a}.{b}.{c}").as_bytes())
            .field(host.triple.as_bytes())
            .field(host.cpu.as_bytes())
            .field(host.features.as_bytes())
            .field(pipeline.as_bytes())
            .field(module.as_bytes());
        k.hex()
    }

    /// Where the entry of `key` is: under the CPU's name, so that machines sharing a home
    /// directory keep their entries apart where one can see them (the key separates them anyway).
    pub fn path(&self, host: &HostCpu, key: &str) -> PathBuf {
        let cpu: String = host.cpu.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect();
        self.dir.join("cpu").join(cpu).join(format!("{key}.o"))
    }

    /// The object code of `key`, if a whole, undamaged entry is there.
    pub fn get(&self, host: &HostCpu, key: &str) -> Option<Vec<u8>> {
        let bytes = std::fs::read(self.path(host, key)).ok()?;
        let (header, object) = (bytes.get(..HEADER)?, bytes.get(HEADER..)?);
        let whole = &header[..MAGIC.len()] == MAGIC && header[MAGIC.len()..] == sha256(object) && object.starts_with(ELF_MAGIC);
        whole.then(|| object.to_vec())
    }

    /// Stores the object code of `key`.
    pub fn put(&self, host: &HostCpu, key: &str, object: &[u8]) -> Result<(), KernelError> {
        let mut bytes = Vec::with_capacity(HEADER + object.len());
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&sha256(object));
        bytes.extend_from_slice(object);
        write_atomic(&self.path(host, key), &bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host() -> HostCpu {
        HostCpu { llvm: (19, 1, 7), triple: "x86_64-pc-linux-gnu".into(), cpu: "znver3".into(), features: "+avx2,+fma".into() }
    }

    #[test]
    fn entries_round_trip_and_damaged_ones_are_misses() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let cache = ObjectCache::new(dir.path());
        let h = host();
        let key = ObjectCache::key(&h, "default<O3>", "define void @f() { ret void }");
        assert_eq!(key.len(), 64);
        assert!(cache.get(&h, &key).is_none());
        let object = b"\x7fELF and the rest of an object".to_vec();
        cache.put(&h, &key, &object).expect("written");
        assert_eq!(cache.get(&h, &key).as_deref(), Some(object.as_slice()));
        assert!(cache.path(&h, &key).starts_with(dir.path().join("cpu").join("znver3")));
        let whole = std::fs::read(cache.path(&h, &key)).expect("read");
        // truncated (at every length, the header's included), or one byte changed: a miss
        for n in 0..whole.len() {
            std::fs::write(cache.path(&h, &key), &whole[..n]).expect("written");
            assert!(cache.get(&h, &key).is_none(), "truncated to {n} bytes");
        }
        for i in [0, 8, HEADER, whole.len() - 1] {
            let mut bad = whole.clone();
            bad[i] ^= 1;
            std::fs::write(cache.path(&h, &key), &bad).expect("written");
            assert!(cache.get(&h, &key).is_none(), "byte {i} changed");
        }
        // a checksummed entry that is not an ELF object is no hit either
        cache.put(&h, &key, b"not an object").expect("written");
        assert!(cache.get(&h, &key).is_none());
    }

    #[test]
    fn the_key_changes_with_every_input() {
        let h = host();
        let base = ObjectCache::key(&h, "default<O3>", "ir");
        let other = |f: &dyn Fn(&mut HostCpu)| {
            let mut o = host();
            f(&mut o);
            ObjectCache::key(&o, "default<O3>", "ir")
        };
        assert_ne!(base, other(&|o| o.llvm = (19, 1, 8)), "another LLVM");
        assert_ne!(base, other(&|o| o.llvm = (20, 1, 7)), "another LLVM");
        assert_ne!(base, other(&|o| o.features = "+avx2,+fma,+avx512f".into()), "other CPU features");
        assert_ne!(base, other(&|o| o.cpu = "znver4".into()), "another CPU");
        assert_ne!(base, other(&|o| o.triple = "aarch64-unknown-linux-gnu".into()), "another target");
        assert_ne!(base, ObjectCache::key(&h, "default<O2>", "ir"), "another pipeline");
        assert_ne!(base, ObjectCache::key(&h, "default<O3>", "ir2"), "another module");
        assert_eq!(base, ObjectCache::key(&host(), "default<O3>", "ir"), "a function of its inputs");
        // length prefixes: moving bytes between fields changes the key
        assert_ne!(ObjectCache::key(&h, "ab", "c"), ObjectCache::key(&h, "a", "bc"));
    }
}
