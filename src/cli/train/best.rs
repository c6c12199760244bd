//! `qatc train --keep-best [--patience N]`: the weights (or adapter) of the lowest validation
//! loss so far, kept in `OUT/best/` beside the last step's, and early stopping.
//!
//! A save replaces OUT whole (`artifacts::OutDir`), so the best weights cannot be written into
//! OUT on their own: the run holds their files' bytes (serialized when the validation that
//! found them ran) and every save writes them again into its staging directory. A resumed run
//! reads them back from the save it resumes (`Progress::best` says which step they are), so
//! a killed run loses neither its best weights nor its patience count.

use std::path::Path;

use anyhow::Context;

use super::resume::Progress;

/// Where a training output keeps the best weights, and what they are (`best.json`).
pub const DIR: &str = "best";
pub const FILE: &str = "best.json";

/// The step and validation loss of the best weights so far (`checkpoint/resume.json`'s `best`,
/// and `OUT/best/best.json`).
#[derive(serde::Serialize, serde::Deserialize, Clone, Copy, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BestAt {
    /// Steps done when the weights were validated.
    pub step: usize,
    pub val_loss: f64,
}

/// The best weights so far: where they were found and their files (relative to `best/`).
pub struct Best {
    pub at: BestAt,
    files: Vec<(String, Vec<u8>)>,
}

impl Best {
    /// The weights validated after `step` steps at `val_loss`, as the files `files` (those of a
    /// save: the adapter or the weights, learned scales, `qatc.json`).
    pub fn new(step: usize, val_loss: f64, mut files: Vec<(String, Vec<u8>)>) -> anyhow::Result<Best> {
        let at = BestAt { step, val_loss };
        files.push((FILE.to_string(), (serde_json::to_string_pretty(&at)? + "\n").into_bytes()));
        Ok(Best { at, files })
    }

    /// What a resumed run had kept: `out/best/`'s files, for the best step `progress` names
    /// (None when it names none). Refused when the files are missing or say another step.
    pub fn restore(out: &Path, progress: &Progress) -> anyhow::Result<Option<Best>> {
        let Some(at) = progress.best else { return Ok(None) };
        let dir = out.join(DIR);
        let said: BestAt = std::fs::read_to_string(dir.join(FILE))
            .map_err(anyhow::Error::from)
            .and_then(|t| Ok(serde_json::from_str(&t)?))
            .with_context(|| format!("{}: the save names best weights at step {}", dir.join(FILE).display(), at.step))?;
        if said != at {
            anyhow::bail!(
                "{}: says step {} (validation loss {}), but the save's resume state names step {} ({}): not one save's",
                dir.join(FILE).display(),
                said.step,
                said.val_loss,
                at.step,
                at.val_loss
            );
        }
        let mut files = Vec::new();
        for e in std::fs::read_dir(&dir).with_context(|| format!("{}", dir.display()))? {
            let e = e.with_context(|| format!("{}", dir.display()))?;
            let name = e.file_name().to_string_lossy().into_owned();
            let bytes = std::fs::read(e.path()).with_context(|| format!("{}", e.path().display()))?;
            files.push((name, bytes));
        }
        // a save writes them in one order whatever the directory listing says
        files.sort();
        Ok(Some(Best { at, files }))
    }

    /// Its files, as a save writes them (`best/NAME`).
    pub fn files(&self) -> impl Iterator<Item = (String, &[u8])> {
        self.files.iter().map(|(n, b)| (format!("{DIR}/{n}"), b.as_slice()))
    }
}

/// Whether validation loss `loss` is a new best over `best` (strictly lower; a tie keeps the
/// earlier weights).
pub fn improves(best: Option<&BestAt>, loss: f64) -> bool {
    loss.is_finite() && best.is_none_or(|b| loss < b.val_loss)
}

/// Whether a run validated every `every` steps, `done` steps in, whose best is at `best`,
/// stops with patience `patience`: that many validations in a row have not improved on it.
pub fn out_of_patience(best: &BestAt, done: usize, every: usize, patience: usize) -> bool {
    patience > 0 && every > 0 && done >= best.step + patience * every
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lower_loss_improves_a_tie_does_not() {
        let b = BestAt { step: 100, val_loss: 4.5 };
        assert!(improves(None, 9.0));
        assert!(improves(Some(&b), 4.4));
        assert!(!improves(Some(&b), 4.5));
        assert!(!improves(Some(&b), f64::NAN));
    }

    #[test]
    fn patience_counts_validations_since_the_best() {
        let b = BestAt { step: 400, val_loss: 4.5 };
        // validations at 500, 600, 700 have not improved: patience 3 stops at 700, not before
        assert!(!out_of_patience(&b, 600, 100, 3));
        assert!(out_of_patience(&b, 700, 100, 3));
        assert!(!out_of_patience(&b, 10_000, 100, 0));
    }
}
