//! Output directories written all at once: everything goes into a temporary directory beside the
//! target, which is renamed into place only when complete, so a failure never leaves a partial
//! OUT behind.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

pub struct OutDir {
    tmp: Option<tempfile::TempDir>,
    target: PathBuf,
}

impl OutDir {
    /// Starts writing `target`. An existing target is replaced on commit, but only if it is a
    /// directory qatc wrote (it has `marker`) or is empty: qatc never deletes a user's files.
    pub fn create(target: &Path, marker: &str) -> io::Result<OutDir> {
        if target.exists() {
            let ours = target.join(marker).exists() || fs::read_dir(target).map(|mut d| d.next().is_none()).unwrap_or(false);
            if !target.is_dir() || !ours {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{} exists and is not a qatc output directory; choose another -o", target.display()),
                ));
            }
        }
        let parent = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        fs::create_dir_all(&parent)?;
        let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
        let tmp = tempfile::Builder::new().prefix(&format!(".{name}.tmp-")).tempdir_in(&parent)?;
        Ok(OutDir { tmp: Some(tmp), target: target.to_path_buf() })
    }

    pub fn path(&self) -> &Path {
        self.tmp.as_ref().map(|t| t.path()).unwrap_or(&self.target)
    }

    pub fn write(&self, name: &str, contents: impl AsRef<[u8]>) -> io::Result<()> {
        let p = self.path().join(name);
        if let Some(d) = p.parent() {
            fs::create_dir_all(d)?;
        }
        fs::write(p, contents)
    }

    /// Moves the finished directory into place.
    pub fn commit(mut self) -> io::Result<PathBuf> {
        let Some(tmp) = self.tmp.take() else { return Ok(self.target.clone()) };
        let staged = tmp.keep();
        if self.target.exists() {
            fs::remove_dir_all(&self.target)?;
        }
        fs::rename(&staged, &self.target)?;
        Ok(self.target.clone())
    }
}

/// Writes one file atomically: a temporary file in the same directory, then a rename.
pub fn write_atomic(path: &Path, contents: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut f = tempfile::NamedTempFile::new_in(&dir)?;
    f.write_all(contents)?;
    f.as_file().sync_all()?;
    f.persist(path).map_err(|e| e.error)?;
    Ok(())
}
