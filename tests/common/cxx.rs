//! The system C++ compiler for tests that run generated CUDA C on the CPU
//! (tests/cuda_c_on_cpu.rs): one executable per kernel, built against `tests/cxx/cuda_on_cpu.h`
//! and qatc's CUDA headers and linked with the launcher `tests/cxx/cuda_on_cpu.cpp` (compiled
//! once), cached under `target/cuda-c-on-cpu/<hash>/`, built several at a time, and run with a
//! time limit.
#![allow(dead_code)]

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The shim: CUDA's execution model on the CPU (its header comment says how), and its launcher.
pub const SHIM: &str = include_str!("../cxx/cuda_on_cpu.h");
pub const LAUNCHER: &str = include_str!("../cxx/cuda_on_cpu.cpp");

/// How every kernel is compiled: C++20; no FMA contraction (NVRTC contracts a*b+c by default, a
/// difference of an ulp, which the comparison's tolerance covers); no type-based alias analysis
/// (the headers' 4-bit stores read bytes as words, as device code may); undefined behaviour
/// (signed overflow in index arithmetic, out-of-range shifts, an index past a fixed-size array:
/// shared memory, a register tile) stops the kernel with the compiler's message.
pub const FLAGS: [&str; 7] = [
    "-std=c++20",
    "-O1",
    "-pthread",
    "-ffp-contract=off",
    "-fno-strict-aliasing",
    "-fsanitize=undefined",
    "-fno-sanitize-recover=undefined",
];

/// A C++ compiler that works, and the cache its executables go to.
pub struct Cxx {
    compiler: String,
    version: String,
    cache: PathBuf,
    /// The headers (qatc's and the shim) and the launcher's object file.
    include: PathBuf,
}

/// What a run of an executable came to.
#[derive(Debug)]
pub enum Outcome {
    Ok,
    /// Exited non-zero or was killed by a signal: the status and what it wrote to stderr.
    Failed(String, String),
    /// Ran past its time limit and was killed.
    TimedOut(Duration),
}

fn hash(parts: &[&str]) -> String {
    // two differently seeded 64-bit hashes: a cache key, not a security boundary
    let h = |seed: u8| {
        let mut s = DefaultHasher::new();
        seed.hash(&mut s);
        parts.hash(&mut s);
        s.finish()
    };
    format!("{:016x}{:016x}", h(1), h(2))
}

/// `prefix` and a suffix no other writer (process or thread) uses at the same time.
fn unique(prefix: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!("{prefix}{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Writes `bytes` to `path` through a file beside it and a rename, so a reader (another test
/// process sharing the cache) sees the whole file or none.
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension(unique("tmp"));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

impl Cxx {
    /// `g++` (or `$CXX`) with the headers written to the cache, or None with the reason printed;
    /// under CI (`$CI` set) a missing compiler is a failure, not a skip.
    pub fn find(headers: &[(&str, &str)]) -> Option<Cxx> {
        let compiler = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
        let version = match Command::new(&compiler).arg("--version").output() {
            Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or_default().to_string(),
            r => {
                let why = format!("no working C++ compiler `{compiler}` ({r:?})");
                assert!(std::env::var_os("CI").is_none(), "{why}: CI must run the generated CUDA C on the CPU");
                eprintln!("SKIPPED: {why}");
                return None;
            }
        };
        let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).parent().expect("the target directory").join("cuda-c-on-cpu");
        let mut parts = vec![compiler.as_str(), version.as_str(), SHIM, LAUNCHER];
        parts.extend(FLAGS);
        for (name, text) in headers {
            parts.extend([*name, *text]);
        }
        let include = cache.join(format!("include-{}", hash(&parts)));
        let launcher = include.join("cuda_on_cpu.o");
        if !launcher.exists() {
            std::fs::create_dir_all(&include).expect("the cache directory");
            for (name, text) in headers.iter().chain(&[("cuda_on_cpu.h", SHIM), ("cuda_on_cpu.cpp", LAUNCHER)]) {
                write_atomic(&include.join(name), text.as_bytes()).expect("writes a header");
            }
            let tmp = include.join(unique("launcher.o"));
            let o = Command::new(&compiler)
                .args(FLAGS)
                .arg("-c")
                .arg(include.join("cuda_on_cpu.cpp"))
                .arg("-o")
                .arg(&tmp)
                .output()
                .unwrap_or_else(|e| panic!("{compiler}: {e}"));
            assert!(o.status.success(), "the launcher tests/cxx/cuda_on_cpu.cpp does not compile:\n{}", String::from_utf8_lossy(&o.stderr));
            std::fs::rename(&tmp, &launcher).expect("the launcher's object in the cache");
        }
        Some(Cxx { compiler, version, cache, include })
    }

    /// Where the executables are kept (`target/cuda-c-on-cpu`).
    pub fn cache(&self) -> &Path {
        &self.cache
    }

    pub fn version(&self) -> &str {
        &self.version
    }

    /// Each (name, translation unit) built, in order: the executable's path, or the compiler's
    /// messages. Cached by a hash of the compiler, flags, headers and text; `jobs` at a time.
    /// Returns also how many were compiled (not found in the cache).
    pub fn build(&self, units: &[(String, String)], jobs: usize) -> (Vec<Result<PathBuf, String>>, usize) {
        let next = AtomicUsize::new(0);
        let compiled = AtomicUsize::new(0);
        let out: Mutex<Vec<Option<Result<PathBuf, String>>>> = Mutex::new(vec![None; units.len()]);
        std::thread::scope(|s| {
            for _ in 0..jobs.max(1) {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((name, text)) = units.get(i) else { break };
                    let r = self.build_one(name, text, &compiled);
                    out.lock().expect("the results")[i] = Some(r);
                });
            }
        });
        let built = out.into_inner().expect("the results").into_iter().map(|r| r.expect("every unit built")).collect();
        (built, compiled.into_inner())
    }

    fn build_one(&self, name: &str, text: &str, compiled: &AtomicUsize) -> Result<PathBuf, String> {
        let include = self.include.to_string_lossy().to_string();
        let mut parts = vec![self.compiler.as_str(), self.version.as_str(), include.as_str(), text];
        parts.extend(FLAGS);
        let dir = self.cache.join(hash(&parts));
        let exe = dir.join(name);
        if exe.exists() {
            return Ok(exe);
        }
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let src = dir.join(format!("{name}.cpp"));
        write_atomic(&src, text.as_bytes()).map_err(|e| format!("{}: {e}", src.display()))?;
        let tmp = dir.join(format!("{name}.{}", unique("tmp")));
        let o = Command::new(&self.compiler)
            .args(FLAGS)
            .arg("-I")
            .arg(&self.include)
            .arg(&src)
            .arg(self.include.join("cuda_on_cpu.o"))
            .arg("-o")
            .arg(&tmp)
            .output()
            .map_err(|e| format!("{}: {e}", self.compiler))?;
        if !o.status.success() {
            let _ = std::fs::remove_file(&tmp);
            return Err(format!("{} {}: {}\n{}", self.compiler, src.display(), o.status, String::from_utf8_lossy(&o.stderr)));
        }
        std::fs::rename(&tmp, &exe).map_err(|e| format!("{}: {e}", exe.display()))?;
        compiled.fetch_add(1, Ordering::Relaxed);
        Ok(exe)
    }
}

/// A started run of an executable, its stderr going to a file.
pub struct Running {
    child: std::process::Child,
    stderr: PathBuf,
    start: Instant,
}

/// Starts `exe` with `args`, its stderr to `stderr` (a file, so a chatty child cannot block on a
/// full pipe while nobody reads it).
pub fn start(exe: &Path, args: &[String], stderr: &Path) -> Result<Running, String> {
    let err = std::fs::File::create(stderr).map_err(|e| format!("{}: {e}", stderr.display()))?;
    let child = Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(err)
        .spawn()
        .map_err(|e| format!("{}: {e}", exe.display()))?;
    Ok(Running { child, stderr: stderr.to_path_buf(), start: Instant::now() })
}

impl Running {
    /// Waits for the run to end, killing it once `limit` has passed since it started.
    pub fn wait(mut self, limit: Duration) -> Outcome {
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) if status.success() => return Outcome::Ok,
                Ok(Some(status)) => {
                    let err = std::fs::read_to_string(&self.stderr).unwrap_or_default();
                    return Outcome::Failed(status.to_string(), err);
                }
                Ok(None) if self.start.elapsed() > limit => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return Outcome::TimedOut(self.start.elapsed());
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(5)),
                Err(e) => return Outcome::Failed(format!("waiting: {e}"), String::new()),
            }
        }
    }
}
