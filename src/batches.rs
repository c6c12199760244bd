//! What `--data` and `--val` give the step, batch by batch: an llm.c token file or plain text
//! (windows of B x T + 1 tokens, `data.rs`), or instruction data (a `.jsonl` file of records,
//! `instruct`), whose batches also carry a per-token loss mask and, packed, position ids.

use std::path::Path;

use crate::data::{DataError, TokenFile};
use crate::instruct::{ExampleOptions, Examples};
use crate::step::BatchInputs;

/// One micro-batch as the step takes it, each [B*T] row-major as [B, T].
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub ids: Vec<i32>,
    pub targets: Vec<i32>,
    /// 1 where a target counts toward the loss, 0 where not (a prompt's, padding); None: every
    /// target counts (a token file).
    pub mask: Option<Vec<f32>>,
    /// Each token's position in its example (packed examples); None: 0 .. T in every sequence.
    pub positions: Option<Vec<i32>>,
}

impl Batch {
    /// How many targets the loss counts.
    pub fn counted(&self) -> usize {
        match &self.mask {
            Some(m) => m.iter().filter(|&&w| w != 0.0).count(),
            None => self.targets.len(),
        }
    }

    /// Rows `first .. first + n` of this batch of sequences of `t`: a rank's share of a global
    /// batch (rank r of ranks of B rows each takes rows r B .. (r + 1) B).
    pub fn rows(&self, first: usize, n: usize, t: usize) -> Batch {
        fn take<X: Copy>(x: &[X], first: usize, n: usize, t: usize) -> Vec<X> {
            x[first * t..(first + n) * t].to_vec()
        }
        Batch {
            ids: take(&self.ids, first, n, t),
            targets: take(&self.targets, first, n, t),
            mask: self.mask.as_deref().map(|m| take(m, first, n, t)),
            positions: self.positions.as_deref().map(|p| take(p, first, n, t)),
        }
    }
}

/// The loss weights of batches whose masks are `masks` (a step's micro-batches, or one batch):
/// each counted target weighs `total / counted` (counted over all the masks), so that the weights
/// sum to `total` (K for a step of K micro-batches: the step's loss, the mean of theirs, is the
/// mean over every target the step counts; 1 for one batch evaluated). Rounded to f32 one by one
/// so that their exact running sum stays within half an f32 ulp of where it should be: f32(1/n)
/// times n alone is off by up to 6e-8, the same way for every target, a bias of up to 5e-7 in a
/// loss of 8.
pub fn loss_weights(masks: &[&[f32]], total: f64) -> Vec<Vec<f32>> {
    let counted = masks.iter().flat_map(|m| m.iter()).filter(|&&m| m != 0.0).count();
    let per = if counted == 0 { 0.0 } else { total / counted as f64 };
    let (mut n, mut sum) = (0usize, 0.0f64);
    masks
        .iter()
        .map(|m| {
            m.iter()
                .map(|&c| {
                    if c == 0.0 {
                        return 0.0;
                    }
                    n += 1;
                    let w = (per * n as f64 - sum) as f32;
                    sum += f64::from(w);
                    w
                })
                .collect()
        })
        .collect()
}

/// A source of batches of B sequences of T.
pub trait Batches {
    /// The file they come from.
    fn source(&self) -> &Path;
    /// Whole batches of B x T.
    fn num_batches(&self, b: usize, t: usize) -> usize;
    /// Batch `s`.
    fn batch(&self, s: usize, b: usize, t: usize) -> Result<Batch, DataError>;
    /// What its batches give the graph beside ids and targets.
    fn inputs(&self) -> BatchInputs;
}

impl Batches for TokenFile {
    fn source(&self) -> &Path {
        self.path()
    }

    fn num_batches(&self, b: usize, t: usize) -> usize {
        TokenFile::num_batches(self, b, t)
    }

    fn batch(&self, s: usize, b: usize, t: usize) -> Result<Batch, DataError> {
        let (ids, targets) = TokenFile::batch(self, s, b, t)?;
        Ok(Batch { ids, targets, mask: None, positions: None })
    }

    fn inputs(&self) -> BatchInputs {
        BatchInputs::default()
    }
}

/// `--data` or `--val`: tokens, or instruction data.
#[derive(Debug)]
pub enum Dataset {
    Tokens {
        file: TokenFile,
        /// Said once when loading: a text file that looks like JSONL records is read as text.
        note: Option<String>,
    },
    Examples(Examples),
}

impl Dataset {
    /// A `.jsonl` file's records as examples in sequences of `seq` (as `o` says), else a token
    /// file or text (`TokenFile::load`).
    pub fn load(path: &Path, seq: usize, o: &ExampleOptions) -> Result<Dataset, DataError> {
        if crate::instruct::is_jsonl(path) {
            return Ok(Dataset::Examples(Examples::load(path, seq, o)?));
        }
        let file = TokenFile::load(path)?;
        Ok(Dataset::Tokens { note: looks_like_records(path), file })
    }

    pub fn path(&self) -> &Path {
        match self {
            Dataset::Tokens { file, .. } => file.path(),
            Dataset::Examples(e) => e.path(),
        }
    }

    /// Its tokens (a token file's; every example's, summed): what a resumed run checks it by.
    pub fn tokens(&self) -> usize {
        match self {
            Dataset::Tokens { file, .. } => file.len(),
            Dataset::Examples(e) => e.tokens(),
        }
    }

    /// Every token must index the model's embedding table.
    pub fn check_vocab(&self, vocab: usize) -> Result<(), DataError> {
        match self {
            Dataset::Tokens { file, .. } => file.check_vocab(vocab),
            Dataset::Examples(e) => Ok(e.check_vocab(vocab)?),
        }
    }

    /// Like `num_batches`, but an error naming the file when not even one batch fits.
    pub fn require_batches(&self, b: usize, t: usize) -> Result<usize, DataError> {
        match self {
            Dataset::Tokens { file, .. } => file.require_batches(b, t),
            Dataset::Examples(e) => Ok(e.num_batches(b).max(1)),
        }
    }

    /// What to say about it once loaded (instruction data's summary, with batches of `b`), if
    /// anything.
    pub fn summary(&self, b: usize) -> Option<String> {
        match self {
            Dataset::Tokens { note, .. } => note.clone(),
            Dataset::Examples(e) => Some(e.summary(b)),
        }
    }
}

impl Batches for Dataset {
    fn source(&self) -> &Path {
        self.path()
    }

    fn num_batches(&self, b: usize, t: usize) -> usize {
        match self {
            Dataset::Tokens { file, .. } => file.num_batches(b, t),
            Dataset::Examples(e) => e.num_batches(b),
        }
    }

    fn batch(&self, s: usize, b: usize, t: usize) -> Result<Batch, DataError> {
        match self {
            Dataset::Tokens { file, .. } => Batches::batch(file, s, b, t),
            Dataset::Examples(e) => {
                if t != e.seq() {
                    return Err(DataError::SeqMismatch { path: e.path().into(), packed: e.seq(), t });
                }
                let n = e.num_batches(b);
                if s >= n {
                    return Err(DataError::BatchOutOfRange { path: e.path().into(), s, n, b, t });
                }
                Ok(e.batch(s, b))
            }
        }
    }

    fn inputs(&self) -> BatchInputs {
        match self {
            Dataset::Tokens { .. } => BatchInputs::default(),
            Dataset::Examples(e) => BatchInputs { weights: true, positions: e.packed() },
        }
    }
}

/// A note when a file read as text starts with what looks like an instruction record (a JSON
/// object with `text`, `prompt` or `messages`): it is trained on as text, braces and keys
/// included, unless it is named `.jsonl`.
fn looks_like_records(path: &Path) -> Option<String> {
    let bytes = std::fs::read(path).ok()?;
    let text = crate::input::text(&bytes).ok()?;
    let first = text.lines().find(|l| !l.trim().is_empty())?;
    let v: serde_json::Value = serde_json::from_str(first).ok()?;
    let key = ["text", "prompt", "messages"].into_iter().find(|k| v.get(k).is_some())?;
    Some(format!(
        "{}: its first line is a JSON object with `{key}`, but the file is read as plain text, braces and keys included; name it *.jsonl to train on its records",
        path.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loss_weights_sum_to_the_total() {
        // 3 micro-batches counting 7 targets of 12 (as f32 1/7 * 7 alone would not sum to 3)
        let masks = [vec![1.0, 0.0, 1.0, 1.0], vec![0.0, 0.0, 0.0, 0.0], vec![1.0, 1.0, 1.0, 1.0]];
        let refs: Vec<&[f32]> = masks.iter().map(Vec::as_slice).collect();
        let w = loss_weights(&refs, 3.0);
        assert_eq!(w[1], [0.0; 4]);
        assert_eq!(w[0][1], 0.0);
        let sum: f64 = w.iter().flatten().map(|&x| f64::from(x)).sum();
        assert!((sum - 3.0).abs() <= 3.0 / 7.0 * f64::from(f32::EPSILON), "{sum}");
        assert!(w.iter().flatten().filter(|&&x| x != 0.0).all(|&x| (f64::from(x) - 3.0 / 7.0).abs() <= 1e-7));
        for n in [3usize, 97, 1000, 12345] {
            let m = vec![1.0f32; n];
            let s: f64 = loss_weights(&[&m], 1.0)[0].iter().map(|&x| f64::from(x)).sum();
            assert!((s - 1.0).abs() < 1e-9, "{n}: {s}");
        }
        assert_eq!(loss_weights(&[&[0.0, 0.0]], 1.0), [vec![0.0, 0.0]]);
    }

    #[test]
    fn records_in_a_text_file_are_read_as_text_with_a_note() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("chat.txt");
        std::fs::write(&p, "{\"prompt\": \"Hi\", \"completion\": \" there\"}\n").unwrap();
        let d = Dataset::load(&p, 8, &ExampleOptions::default()).unwrap();
        assert!(matches!(d, Dataset::Tokens { .. }));
        let note = d.summary(1).unwrap();
        assert!(note.contains("chat.txt: its first line is a JSON object with `prompt`") && note.contains("name it *.jsonl"), "{note}");
        std::fs::write(&p, "plain words\n").unwrap();
        assert!(Dataset::load(&p, 8, &ExampleOptions::default()).unwrap().summary(1).is_none());
    }
}
