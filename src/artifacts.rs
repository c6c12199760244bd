//! Output directories and files replaced whole, so that a kill at any instant leaves either the
//! old contents or the new ones, never a mixture, and never an empty or partial target.
//!
//! A directory is written into a staging directory beside its target (`.NAME.qatc-stage-XXXX`),
//! every file and the directory fsync'ed, then swapped with the target in one step
//! (`renameat2(RENAME_EXCHANGE)` on Linux), the parent fsync'ed, and the old contents, now under
//! the staging name, deleted. Where the filesystem cannot exchange, the target is first renamed
//! aside (`.NAME.qatc-old-XXXX`) and the new one renamed in; a kill between the two renames
//! leaves no target, and the next write of the same target renames the old one back.
//!
//! An error removes the unfinished staging directory (or temporary file); a kill cannot, so the
//! next `OutDir::create` or `write_atomic` of the same target removes what a killed write left
//! beside it. The crash tests (`tests/crash.rs`) fail every filesystem step in turn through
//! `Faults`, whose failures stand for kills (nothing is removed after one), and kill the real
//! binary in a loop.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Where a write may be cut short, for the crash tests: every filesystem step of `OutDir` and
/// `write_atomic` asks `step` first, and the chosen one fails, as if the process died there.
/// `Faults::none()` never fails and records nothing.
pub struct Faults {
    fail_at: Option<usize>,
    /// Count and name the steps (the tests' faults do; `none()` does not).
    record: bool,
    /// Swap directories by two renames even where the filesystem can exchange them (to test
    /// the fallback).
    pub(crate) no_exchange: bool,
    taken: AtomicUsize,
    /// An injected failure happened: the process is to be taken as killed there.
    fired: AtomicBool,
    names: Mutex<Vec<String>>,
}

static NO_FAULTS: Faults = Faults::new(None, false);

impl Faults {
    const fn new(fail_at: Option<usize>, record: bool) -> Faults {
        Faults {
            fail_at,
            record,
            no_exchange: false,
            taken: AtomicUsize::new(0),
            fired: AtomicBool::new(false),
            names: Mutex::new(Vec::new()),
        }
    }

    /// No failures: what every command uses.
    pub fn none() -> &'static Faults {
        &NO_FAULTS
    }

    /// Fails the `n`-th step (0-based) and every step after it.
    pub fn fail_at(n: usize) -> Faults {
        Faults::new(Some(n), true)
    }

    /// Never fails, but counts and names the steps (to enumerate them).
    pub fn counting() -> Faults {
        Faults::new(None, true)
    }

    /// The same faults, with directories swapped by two renames (the fallback of filesystems
    /// that cannot exchange).
    pub fn without_exchange(mut self) -> Faults {
        self.no_exchange = true;
        self
    }

    /// One filesystem step about to happen.
    pub fn step(&self, what: impl FnOnce() -> String) -> io::Result<()> {
        if !self.record {
            return Ok(());
        }
        let i = self.taken.fetch_add(1, Ordering::SeqCst);
        let name = what();
        if let Ok(mut v) = self.names.lock() {
            v.push(name.clone());
        }
        match self.fail_at {
            Some(n) if i >= n => {
                self.fired.store(true, Ordering::SeqCst);
                Err(io::Error::other(format!("injected failure at step {i} ({name})")))
            }
            _ => Ok(()),
        }
    }

    /// Whether an injected failure happened (then nothing is cleaned up, as after a kill).
    fn fired(&self) -> bool {
        self.fired.load(Ordering::SeqCst)
    }

    /// The steps taken so far.
    pub fn taken(&self) -> usize {
        self.taken.load(Ordering::SeqCst)
    }

    /// The names of the steps taken so far.
    pub fn names(&self) -> Vec<String> {
        self.names.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

/// The parent directory of `p` (`.` for a bare name) and `p`'s file name.
fn split(p: &Path) -> io::Result<(PathBuf, String)> {
    let parent = match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = p
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("{}: not a file or directory name", p.display())))?;
    Ok((parent, name))
}

/// The prefix of every temporary name qatc uses beside `name`.
fn temp_prefix(name: &str) -> String {
    format!(".{name}.qatc-")
}

fn sync_dir(d: &Path) -> io::Result<()> {
    fs::File::open(d)?.sync_all()
}

/// Whether `inner` is `outer` or lies inside it (both made absolute; `outer` need not exist).
pub fn is_within(inner: &Path, outer: &Path) -> bool {
    let canon = |p: &Path| -> PathBuf {
        if let Ok(c) = fs::canonicalize(p) {
            return c;
        }
        // a path that does not exist yet: its parent's canonical form plus its name
        match (p.parent().map(|d| if d.as_os_str().is_empty() { Path::new(".") } else { d }), p.file_name()) {
            (Some(d), Some(n)) => fs::canonicalize(d).map(|d| d.join(n)).unwrap_or_else(|_| p.to_path_buf()),
            _ => std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf()),
        }
    };
    canon(inner).starts_with(canon(outer))
}

/// Removes what killed writes of `target` left beside it; a target that a kill caught between
/// the two renames of the fallback swap gets its old contents back first. Every write of a
/// target does this first; a command that reads a target it will write calls it before reading.
pub fn recover(target: &Path, faults: &Faults) -> io::Result<()> {
    clean_leftovers(target, faults)
}

fn clean_leftovers(target: &Path, faults: &Faults) -> io::Result<()> {
    let (parent, name) = split(target)?;
    let prefix = temp_prefix(&name);
    let Ok(entries) = fs::read_dir(&parent) else { return Ok(()) };
    let mut found: Vec<PathBuf> = entries.filter_map(|e| e.ok()).map(|e| e.path()).collect();
    found.retain(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&prefix)));
    found.sort();
    if !target.exists() {
        if let Some(old) = found.iter().find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&format!("{prefix}old-")))) {
            faults.step(|| format!("restore {}", target.display()))?;
            fs::rename(old, target)?;
            sync_dir(&parent)?;
        }
    }
    for p in found.into_iter().filter(|p| p.exists()) {
        faults.step(|| format!("remove leftover {}", p.display()))?;
        if p.is_dir() {
            fs::remove_dir_all(&p)?;
        } else {
            fs::remove_file(&p)?;
        }
    }
    Ok(())
}

/// Writes `contents` to a new file, the second half after a step of its own (a kill can land
/// in the middle of a write), then fsyncs it.
fn write_file(path: &Path, contents: &[u8], faults: &Faults) -> io::Result<()> {
    faults.step(|| format!("create {}", path.display()))?;
    let mut f = fs::File::create(path)?;
    let (a, b) = contents.split_at(contents.len() / 2);
    f.write_all(a)?;
    faults.step(|| format!("write the rest of {}", path.display()))?;
    f.write_all(b)?;
    faults.step(|| format!("fsync {}", path.display()))?;
    f.sync_all()
}

/// Swaps two directory entries in one step (Linux: `renameat2(RENAME_EXCHANGE)`); false where
/// the filesystem or the system cannot.
#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> io::Result<bool> {
    use rustix::fs::{renameat_with, RenameFlags, CWD};
    match renameat_with(CWD, a, CWD, b, RenameFlags::EXCHANGE) {
        Ok(()) => Ok(true),
        Err(e) if e == rustix::io::Errno::INVAL || e == rustix::io::Errno::NOSYS || e == rustix::io::Errno::OPNOTSUPP => Ok(false),
        Err(e) => Err(e.into()),
    }
}

#[cfg(not(target_os = "linux"))]
fn exchange(_: &Path, _: &Path) -> io::Result<bool> {
    Ok(false)
}

/// A directory being written: files go into the staging directory; `commit` swaps it in.
/// Dropped unfinished (an error), it removes the staging directory.
pub struct OutDir<'f> {
    staging: PathBuf,
    target: PathBuf,
    faults: &'f Faults,
    committed: bool,
}

impl Drop for OutDir<'_> {
    fn drop(&mut self) {
        if !self.committed && !self.faults.fired() {
            // best effort: what stays behind, the next write of the target removes
            let _ = fs::remove_dir_all(&self.staging);
        }
    }
}

impl OutDir<'static> {
    /// Starts writing `target` (see `create_with`).
    pub fn create(target: &Path, markers: &[&str], inputs: &[&Path]) -> io::Result<OutDir<'static>> {
        OutDir::create_with(target, markers, inputs, Faults::none())
    }
}

impl<'f> OutDir<'f> {
    /// Starts writing `target`. It is refused when it exists and is not a directory qatc wrote
    /// (one with any of `markers`) or an empty one (qatc never deletes a user's files), and when any of
    /// `inputs` lies inside it (the input would be replaced). What a killed earlier write left
    /// beside it is cleaned first.
    pub fn create_with(target: &Path, markers: &[&str], inputs: &[&Path], faults: &'f Faults) -> io::Result<OutDir<'f>> {
        check_target(target, markers, inputs)?;
        let (parent, name) = split(target)?;
        fs::create_dir_all(&parent).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", parent.display())))?;
        clean_leftovers(target, faults)?;
        faults.step(|| format!("create the staging directory of {}", target.display()))?;
        let staging = tempfile::Builder::new().prefix(&format!("{}stage-", temp_prefix(&name))).tempdir_in(&parent)?.keep();
        Ok(OutDir { staging, target: target.to_path_buf(), faults, committed: false })
    }

    /// Where the files are being written (not the target: that changes only at `commit`).
    pub fn path(&self) -> &Path {
        &self.staging
    }

    /// Writes (and fsyncs) one file, `name` relative to the directory.
    pub fn write(&self, name: &str, contents: impl AsRef<[u8]>) -> io::Result<()> {
        let p = self.staging.join(name);
        if let Some(d) = p.parent() {
            if !d.exists() {
                self.faults.step(|| format!("create {}", d.display()))?;
                fs::create_dir_all(d)?;
            }
        }
        write_file(&p, contents.as_ref(), self.faults)
    }

    /// Swaps the finished directory into place and deletes the old contents.
    pub fn commit(mut self) -> io::Result<PathBuf> {
        self.swap_in()?;
        self.committed = true;
        Ok(self.target.clone())
    }

    fn swap_in(&self) -> io::Result<()> {
        let f = self.faults;
        let (parent, name) = split(&self.target)?;
        // every subdirectory, then the directory itself: their entries are on disk before the swap
        let mut dirs = vec![self.staging.clone()];
        let mut i = 0;
        while i < dirs.len() {
            for e in fs::read_dir(&dirs[i])?.filter_map(|e| e.ok()) {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    dirs.push(e.path());
                }
            }
            i += 1;
        }
        for d in dirs.iter().rev() {
            f.step(|| format!("fsync directory {}", d.display()))?;
            sync_dir(d)?;
        }
        if self.target.exists() {
            f.step(|| format!("swap {} into place", self.target.display()))?;
            if f.no_exchange || !exchange(&self.staging, &self.target)? {
                let aside = tempfile::Builder::new().prefix(&format!("{}old-", temp_prefix(&name))).tempdir_in(&parent)?.keep();
                fs::rename(&self.target, &aside)?;
                f.step(|| format!("rename {} into place", self.staging.display()))?;
                fs::rename(&self.staging, &self.target)?;
                fs::rename(&aside, &self.staging)?;
            }
            f.step(|| format!("fsync {}", parent.display()))?;
            sync_dir(&parent)?;
            // the old contents, now under the staging name
            f.step(|| format!("remove the old contents of {}", self.target.display()))?;
            fs::remove_dir_all(&self.staging)?;
        } else {
            f.step(|| format!("rename {} into place", self.staging.display()))?;
            fs::rename(&self.staging, &self.target)?;
            f.step(|| format!("fsync {}", parent.display()))?;
            sync_dir(&parent)?;
        }
        Ok(())
    }
}

/// The checks of `OutDir::create`, on their own: a command calls this before any work, so that
/// a run never fails at its end on an output it could have refused at its start.
pub fn check_target(target: &Path, markers: &[&str], inputs: &[&Path]) -> io::Result<()> {
    let refuse = |why: String| Err(io::Error::new(io::ErrorKind::AlreadyExists, why));
    for i in inputs {
        if i.exists() && is_within(i, target) {
            return refuse(format!(
                "{} is inside the output directory {}, which the output replaces; write the output elsewhere",
                i.display(),
                target.display()
            ));
        }
    }
    // a path through a file can never be made: say so before any work, not at the first save
    if let Some(f) = target.ancestors().skip(1).find(|a| !a.as_os_str().is_empty() && a.exists() && !a.is_dir()) {
        return Err(io::Error::new(
            io::ErrorKind::NotADirectory,
            format!("{} is a file, so {} cannot be made; choose another output", f.display(), target.display()),
        ));
    }
    if target.exists() {
        let ours = markers.iter().any(|m| target.join(m).exists()) || fs::read_dir(target).map(|mut d| d.next().is_none()).unwrap_or(false);
        if !target.is_dir() || !ours {
            return refuse(format!("{} exists and is not a qatc output directory; choose another output", target.display()));
        }
    }
    Ok(())
}

/// Checks that a file written only at the end of a command (`--plot`, `--svg`) can be written:
/// its directory exists and takes a new file, and it is not a directory.
pub fn check_writable(path: &Path) -> io::Result<()> {
    let (parent, _) = split(path)?;
    if path.is_dir() {
        return Err(io::Error::new(io::ErrorKind::IsADirectory, format!("{} is a directory", path.display())));
    }
    let probe = tempfile::Builder::new()
        .prefix(".qatc-probe-")
        .tempfile_in(&parent)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", parent.display())))?;
    drop(probe);
    Ok(())
}

/// Writes one file atomically: a temporary file beside it, fsync'ed, renamed over the target,
/// and the directory fsync'ed.
pub fn write_atomic(path: &Path, contents: &[u8]) -> io::Result<()> {
    write_atomic_with(path, contents, Faults::none())
}

pub fn write_atomic_with(path: &Path, contents: &[u8], faults: &Faults) -> io::Result<()> {
    let (dir, name) = split(path)?;
    clean_leftovers(path, faults)?;
    let (_, tmp) =
        tempfile::Builder::new().prefix(&format!("{}tmp-", temp_prefix(&name))).tempfile_in(&dir)?.keep().map_err(|e| e.error)?;
    let written = write_file(&tmp, contents, faults).and_then(|()| {
        faults.step(|| format!("rename {} into place", tmp.display()))?;
        fs::rename(&tmp, path)
    });
    if written.is_err() && !faults.fired() {
        let _ = fs::remove_file(&tmp);
    }
    written?;
    faults.step(|| format!("fsync {}", dir.display()))?;
    sync_dir(&dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listing(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    fn write_dir(target: &Path, text: &str, faults: &Faults) -> io::Result<()> {
        let o = OutDir::create_with(target, &["m"], &[], faults)?;
        o.write("m", text)?;
        o.write("sub/x", text)?;
        o.commit().map(|_| ())
    }

    /// A failure at any step leaves the old directory or the new one, whole; the next write
    /// leaves nothing else behind.
    #[test]
    fn a_failure_at_any_step_leaves_old_or_new_and_the_next_write_cleans_up() {
        let count = Faults::counting();
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path().join("out");
        write_dir(&t, "old", Faults::none()).unwrap();
        write_dir(&t, "new", &count).unwrap();
        let n = count.taken();
        assert!(n >= 10, "{:?}", count.names());
        for i in 0..n {
            write_dir(&t, "old", Faults::none()).unwrap();
            assert!(write_dir(&t, "new", &Faults::fail_at(i)).is_err());
            let m = fs::read_to_string(t.join("m")).unwrap();
            assert!(m == "old" || m == "new", "step {i}");
            assert_eq!(fs::read_to_string(t.join("sub/x")).unwrap(), m, "step {i}: one directory, one generation");
            write_dir(&t, "again", Faults::none()).unwrap();
            assert_eq!(listing(tmp.path()), ["out"], "step {i}: leftovers cleaned");
        }
    }

    /// The same through the fallback swap (two renames), whose window without a target the
    /// next write repairs.
    #[test]
    fn the_two_rename_fallback_is_repaired_by_the_next_write() {
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path().join("out");
        let count = Faults::counting().without_exchange();
        write_dir(&t, "old", Faults::none()).unwrap();
        write_dir(&t, "new", &count).unwrap();
        for i in 0..count.taken() {
            write_dir(&t, "old", Faults::none()).unwrap();
            assert!(write_dir(&t, "new", &Faults::fail_at(i).without_exchange()).is_err());
            let o = OutDir::create(&t, &["m"], &[]).unwrap();
            let m = fs::read_to_string(t.join("m")).unwrap();
            assert!(m == "old" || m == "new", "step {i}");
            assert_eq!(fs::read_to_string(t.join("sub/x")).unwrap(), m, "step {i}");
            o.commit().unwrap();
            assert_eq!(listing(tmp.path()), ["out"], "step {i}: leftovers cleaned");
        }
    }

    /// An error (not a kill) leaves nothing beside the target.
    #[test]
    fn an_unfinished_directory_dropped_on_an_error_is_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path().join("out");
        {
            let o = OutDir::create(&t, &["m"], &[]).unwrap();
            o.write("m", "x").unwrap();
        }
        assert!(listing(tmp.path()).is_empty());
    }

    #[test]
    fn refuses_a_foreign_directory_and_an_input_inside_the_target() {
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path().join("out");
        fs::create_dir(&t).unwrap();
        fs::write(t.join("precious"), "x").unwrap();
        assert!(OutDir::create(&t, &["m"], &[]).is_err());
        let t2 = tmp.path().join("out2");
        write_dir(&t2, "a", Faults::none()).unwrap();
        let e = OutDir::create(&t2, &["m"], &[&t2.join("sub/x")]).err().unwrap();
        assert!(e.to_string().contains("is inside the output directory"), "{e}");
        assert_eq!(listing(tmp.path()), ["out", "out2"]);
    }

    #[test]
    fn atomic_file_writes_clean_their_leftovers() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("f.json");
        let count = Faults::counting();
        write_atomic_with(&p, b"one", &count).unwrap();
        for i in 0..count.taken() {
            assert!(write_atomic_with(&p, b"two", &Faults::fail_at(i)).is_err());
            let got = fs::read(&p).unwrap();
            assert!(got == b"one" || got == b"two");
            write_atomic(&p, b"one").unwrap();
            assert_eq!(listing(tmp.path()), ["f.json"], "step {i}");
        }
    }
}
