//! Instruction data: a JSONL file of records (`records.rs`: text, prompt and completion, or a
//! conversation), each made one example through a template (`template.rs`: its tokens, and which
//! of them the loss counts), the examples put into sequences of T positions (`pack.rs`: packed,
//! or one each and padded with `--no-pack`), and the sequences read B at a time as batches whose
//! per-token loss mask keeps prompts, padding and what lies across an example's boundary out of
//! the loss.
//!
//! Every bad record is an error naming the file and line, or with `--skip-bad-records` a skip
//! that is counted and reported with the first reasons: nothing is dropped without a word.

pub mod pack;
pub mod records;
pub mod template;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use thiserror::Error;

pub use template::{Example, Template, TrainOn, DEFAULT_TEMPLATE, EOS};

/// How a JSONL file becomes batches (`--template`, `--train-on`, `--no-pack`, `--skip-bad-records`).
#[derive(Clone, Debug)]
pub struct ExampleOptions {
    pub template: Template,
    pub train_on: TrainOn,
    /// Several examples to a sequence, attention kept within each (else one each, padded).
    pub pack: bool,
    /// Skip bad records (counted and reported) instead of stopping at the first.
    pub skip_bad: bool,
}

impl Default for ExampleOptions {
    fn default() -> ExampleOptions {
        ExampleOptions {
            // the named default parses: a test holds it
            template: Template::parse(DEFAULT_TEMPLATE).unwrap_or_else(|_| Template::parse("{prompt}{completion}").expect("plain")),
            train_on: TrainOn::Completion,
            pack: true,
            skip_bad: false,
        }
    }
}

#[derive(Debug, Error)]
pub enum ExampleError {
    #[error("{}: {error}", path.display())]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{}: not UTF-8 text: {why}", path.display())]
    NotText { path: PathBuf, why: String },
    /// A bad record, at its 1-based line.
    #[error("{}:{line}: {why}", path.display())]
    Record { path: PathBuf, line: usize, why: String },
    #[error("{}: no records (a JSONL file holds one JSON object a line)", path.display())]
    NoRecords { path: PathBuf },
    #[error("{}: all {skipped} records are bad (--skip-bad-records), the first at line {line}: {why}", path.display())]
    AllBad { path: PathBuf, skipped: usize, line: usize, why: String },
    #[error("{}: token {token} of the example at line {line} is not below the model's vocabulary size {vocab}", path.display())]
    TokenOutOfRange { path: PathBuf, line: usize, token: u16, vocab: usize },
}

/// A JSONL file's examples in sequences of T positions.
#[derive(Debug)]
pub struct Examples {
    path: PathBuf,
    seq: usize,
    pack: bool,
    examples: Vec<Example>,
    /// The line each example came from.
    lines: Vec<usize>,
    /// Each sequence's examples, in the order they fill it.
    rows: Vec<Vec<usize>>,
    /// Records by form.
    forms: BTreeMap<&'static str, usize>,
    /// (line, why) of every record skipped.
    skipped: Vec<(usize, String)>,
}

/// Whether `path` names a JSONL file (by its extension, `.jsonl`).
pub fn is_jsonl(path: &Path) -> bool {
    path.extension().and_then(|e| e.to_str()).is_some_and(|e| e.eq_ignore_ascii_case("jsonl"))
}

impl Examples {
    /// Reads, tokenizes and packs `path` into sequences of `seq` positions.
    pub fn load(path: &Path, seq: usize, o: &ExampleOptions) -> Result<Examples, ExampleError> {
        let io = |error| ExampleError::Io { path: path.into(), error };
        // checked before opening: a FIFO would block
        if !std::fs::metadata(path).map_err(io)?.is_file() {
            return Err(io(std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file")));
        }
        let bytes = std::fs::read(path).map_err(io)?;
        let text = crate::input::text(&bytes).map_err(|why| {
            // the line of the first bad byte (invalid UTF-8, or a NUL)
            let at = match std::str::from_utf8(&bytes) {
                Err(e) => e.valid_up_to(),
                Ok(s) => s.find('\0').unwrap_or(0),
            };
            let line = bytes[..at].iter().filter(|&&b| b == b'\n').count() + 1;
            ExampleError::NotText { path: path.into(), why: format!("{why} (line {line})") }
        })?;
        let mut ex = Examples {
            path: path.into(),
            seq,
            pack: o.pack,
            examples: Vec::new(),
            lines: Vec::new(),
            rows: Vec::new(),
            forms: BTreeMap::new(),
            skipped: Vec::new(),
        };
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let n = i + 1;
            match one(line, seq, o) {
                Ok((form, e)) => {
                    *ex.forms.entry(form).or_default() += 1;
                    ex.examples.push(e);
                    ex.lines.push(n);
                }
                Err(why) if o.skip_bad => ex.skipped.push((n, why)),
                Err(why) => {
                    return Err(ExampleError::Record {
                        path: path.into(),
                        line: n,
                        why: format!("{why} (--skip-bad-records skips such records)"),
                    })
                }
            }
        }
        if ex.examples.is_empty() {
            return Err(match ex.skipped.first() {
                Some((line, why)) => ExampleError::AllBad { path: path.into(), skipped: ex.skipped.len(), line: *line, why: why.clone() },
                None => ExampleError::NoRecords { path: path.into() },
            });
        }
        let slots: Vec<usize> = ex.examples.iter().map(Example::slots).collect();
        ex.rows = if o.pack { pack::pack(&slots, seq) } else { (0..slots.len()).map(|i| vec![i]).collect() };
        Ok(ex)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether sequences hold several examples (the graph then takes position ids).
    pub fn packed(&self) -> bool {
        self.pack
    }

    /// The sequences' length T.
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// How many sequences.
    pub fn rows(&self) -> usize {
        self.rows.len()
    }

    /// Every example's tokens, summed (what a resumed run checks the data by).
    pub fn tokens(&self) -> usize {
        self.examples.iter().map(|e| e.tokens.len()).sum()
    }

    /// Batches of `b` sequences: the last filled up with sequences of padding.
    pub fn num_batches(&self, b: usize) -> usize {
        if b == 0 {
            0
        } else {
            self.rows.len().div_ceil(b)
        }
    }

    /// The records skipped as bad, with their lines.
    pub fn skipped(&self) -> &[(usize, String)] {
        &self.skipped
    }

    /// Every token must index the model's embedding table.
    pub fn check_vocab(&self, vocab: usize) -> Result<(), ExampleError> {
        for (e, &line) in self.examples.iter().zip(&self.lines) {
            if let Some(&token) = e.tokens.iter().find(|&&x| x as usize >= vocab) {
                return Err(ExampleError::TokenOutOfRange { path: self.path.clone(), line, token, vocab });
            }
        }
        Ok(())
    }

    /// Batch `s` of `b` sequences: ids, targets, the loss mask (1 where a target counts) and the
    /// position ids, each [B*T] row-major. A batch past the sequences' end is padding.
    pub fn batch(&self, s: usize, b: usize) -> super::batches::Batch {
        let t = self.seq;
        let mut ids = vec![0; b * t];
        let mut targets = vec![0; b * t];
        let mut mask = vec![0.0; b * t];
        let mut positions = vec![0; b * t];
        for r in 0..b {
            let row: &[usize] = self.rows.get(s * b + r).map_or(&[], Vec::as_slice);
            let span = r * t..(r + 1) * t;
            let out = pack::Fill {
                ids: &mut ids[span.clone()],
                targets: &mut targets[span.clone()],
                mask: &mut mask[span.clone()],
                positions: &mut positions[span],
            };
            pack::fill(&self.examples, row, out);
        }
        super::batches::Batch { ids, targets, mask: Some(mask), positions: self.pack.then_some(positions) }
    }

    /// One line on what the file gave: records by form, skips, sequences, padding, what the loss
    /// counts; with batches of `b` sequences (the last filled up with padding).
    pub fn summary(&self, b: usize) -> String {
        let t = self.seq;
        let forms: Vec<String> = self.forms.iter().map(|(f, n)| format!("{n} {f}")).collect();
        let positions = self.num_batches(b) * b * t;
        let used: usize = self.examples.iter().map(Example::slots).sum();
        let counted: usize = self.examples.iter().map(Example::counted).sum();
        let pct = |x: usize| 100.0 * x as f64 / positions.max(1) as f64;
        let skipped = match self.skipped.first() {
            None => String::new(),
            Some((line, why)) => format!("; {} bad records skipped (the first, line {line}: {why})", self.skipped.len()),
        };
        let how = if self.pack { "packed" } else { "one example each, padded (--no-pack)" };
        format!(
            "{}: {} records ({}){skipped}; {} sequences of T {t}, {how}, in {} batches of B {b}: {:.1}% of the positions are padding, the loss counts {:.1}%",
            self.path.display(),
            self.examples.len(),
            forms.join(", "),
            self.rows.len(),
            self.num_batches(b),
            pct(positions - used),
            pct(counted),
        )
    }
}

/// One line's record as an example that fits T, or why not.
fn one(line: &str, seq: usize, o: &ExampleOptions) -> Result<(&'static str, Example), String> {
    let record = records::parse(line)?;
    let e = template::example(&record, &o.template, o.train_on)?;
    if e.slots() > seq {
        return Err(format!(
            "the example is {} tokens, {} positions (each but the last predicts the next), more than --seq {seq}",
            e.tokens.len(),
            e.slots()
        ));
    }
    if e.counted() == 0 {
        return Err("no token of the example counts toward the loss".into());
    }
    Ok((record.form(), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(dir: &tempfile::TempDir, text: &str) -> PathBuf {
        let p = dir.path().join("data.jsonl");
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn the_default_template_parses() {
        assert_eq!(ExampleOptions::default().template, Template::parse("alpaca").unwrap());
    }

    #[test]
    fn bad_records_name_the_line_or_are_counted() {
        let dir = tempfile::tempdir().unwrap();
        let p = file(&dir, "{\"text\": \"a b c\"}\n\n{\"prompt\": \"x\"}\nnot json\n{\"text\": \"d\"}\n");
        let e = Examples::load(&p, 16, &ExampleOptions::default()).unwrap_err().to_string();
        assert!(e.contains("data.jsonl:3: `prompt` without `completion`"), "{e}");
        let o = ExampleOptions { skip_bad: true, ..Default::default() };
        let ex = Examples::load(&p, 16, &o).unwrap();
        assert_eq!(ex.skipped().iter().map(|s| s.0).collect::<Vec<_>>(), [3, 4]);
        let s = ex.summary(2);
        assert!(s.contains("2 records (2 text); 2 bad records skipped (the first, line 3: `prompt` without `completion`)"), "{s}");
        // too long for T
        let p = file(&dir, "{\"text\": \"one two three four five six\"}\n");
        let e = Examples::load(&p, 4, &ExampleOptions::default()).unwrap_err().to_string();
        assert!(e.contains("data.jsonl:1: the example is 7 tokens, 6 positions"), "{e}");
        let e = Examples::load(&p, 4, &o).unwrap_err().to_string();
        assert!(e.contains("all 1 records are bad"), "{e}");
        let p = file(&dir, "\n  \n");
        assert!(Examples::load(&p, 4, &o).unwrap_err().to_string().contains("no records"));
        let p = file(&dir, "{\"text\": \"a\"}\n\u{0}");
        assert!(Examples::load(&p, 4, &o).unwrap_err().to_string().contains("a NUL byte at byte 14 (line 2)"));
    }

    #[test]
    fn batches_keep_padding_and_prompts_out() {
        let dir = tempfile::tempdir().unwrap();
        let p = file(&dir, "{\"prompt\": \"Hi\", \"completion\": \" there\"}\n{\"text\": \"Hello world\"}\n{\"text\": \"a\"}\n");
        let o = ExampleOptions { template: Template::parse("plain").unwrap(), ..Default::default() };
        let ex = Examples::load(&p, 4, &o).unwrap();
        // slots 2, 2, 1 into T 4: [0, 1] and [2]
        assert_eq!(ex.rows(), 2);
        let b = ex.batch(0, 3);
        let e = i32::from(EOS);
        assert_eq!(b.ids[..4], [17250, 612, 15496, 995]);
        assert_eq!(b.targets[..4], [612, e, 995, e]);
        assert_eq!(b.mask.as_deref().unwrap()[..4], [1.0, 1.0, 1.0, 1.0]);
        assert_eq!(b.positions.as_deref().unwrap()[..4], [0, 1, 0, 1]);
        // the second sequence: "a" and three positions of padding; the third all padding
        assert_eq!(b.mask.as_deref().unwrap()[4..], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        assert_eq!(b.positions.as_deref().unwrap()[4..8], [0, 0, 1, 2]);
        let s = ex.summary(3);
        assert!(s.contains("3 records (1 prompt/completion, 2 text); 2 sequences of T 4, packed, in 1 batches of B 3: 58.3% of the positions are padding, the loss counts 41.7%"), "{s}");
        let o = ExampleOptions { pack: false, train_on: TrainOn::Completion, ..o };
        let ex = Examples::load(&p, 4, &o).unwrap();
        assert_eq!(ex.rows(), 3);
        assert!(ex.batch(0, 3).positions.is_none());
        let e = ex.check_vocab(100).unwrap_err().to_string();
        assert!(e.contains("data.jsonl: token 17250 of the example at line 1 is not below the model's vocabulary size 100"), "{e}");
    }
}
