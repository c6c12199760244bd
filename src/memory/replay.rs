//! `--fit` plans each configuration (precision, optimizer, checkpoint policy, ZeRO stage) at batch
//! after batch, and fusion is most of a plan's time (GPT-2 1.5B: 0.5 of 0.8 s; building the step
//! before fusion takes 0.03 s). The fused step is the same program at every batch, its sizes
//! affine in B (measured: GPT-2 124M and 1.5B, fp32 and bf16, both optimizers, policies `none`,
//! `blocks` and `sqrt`, B 1 to 32, every number of the fused step's text on the line through B 1
//! and 2). So a configuration is fused for real at its first two batches, the line through them
//! is confirmed against a third real fusion, and from then on the fused step is printed from the
//! line (`qatc_ir::text::AffineText`) wherever the step before fusion is on its own line too.
//!
//! What makes this safe rather than likely: the step before fusion is always built and compared
//! (so `auto`, whose recompute choice changes with B, is fused for real whenever its graph is not
//! the line's), the line must have matched a real fusion before it is used, one miss turns the
//! configuration's reuse off, and the printed step is parsed and verified like any pass's output.

use qatc_ir::text::AffineText;
use qatc_ir::Graph;
use qatc_passes::pipeline::{self, Stage};

use crate::frontend::config::Gpt2Config;
use crate::step::{self, StepOptions};

/// One configuration's fused steps across batch sizes.
#[derive(Default)]
pub struct Replay {
    /// The last batch fused for real: (batch, the step's text before fusion, after).
    last: Option<(usize, String, String)>,
    line: Option<Line>,
    /// Set when the fused step was off the line although the step before fusion was on it:
    /// fusion chose differently at this batch, so nothing is reused for this configuration.
    off: bool,
    /// Plans whose fused step came from the line.
    pub reused: usize,
}

struct Line {
    before: AffineText,
    fused: AffineText,
    /// Whether a real fusion matched the line (only then is it used).
    confirmed: bool,
}

/// `g`'s text without its name (the name says the batch size: `gpt2_L48_C1600_B4_T1024`).
fn text(g: &mut Graph) -> String {
    let name = std::mem::take(&mut g.name);
    let t = qatc_ir::print(g);
    g.name = name;
    t
}

impl Replay {
    /// The step of `o` (whose `fuse` is set) built and fused, as `step::train` does it, or the
    /// fused step printed from this configuration's line where that is safe (module docs).
    pub fn fused_step(&mut self, cfg: &Gpt2Config, o: &StepOptions) -> anyhow::Result<Graph> {
        let unfused = StepOptions { fuse: None, ..o.clone() };
        let (mut before, _) = step::train(cfg, &unfused, |_, _| {})?;
        if o.fuse.is_none() {
            return Ok(before);
        }
        let b = o.batch as i64;
        let before_text = text(&mut before);
        let on_line = self.line.as_ref().is_some_and(|l| l.before.at(b).as_deref() == Some(before_text.as_str()));
        if on_line && !self.off {
            if let Some(fused) = self.line.as_ref().filter(|l| l.confirmed).and_then(|l| l.fused.at(b)) {
                let mut g = qatc_ir::parse(&fused)?;
                g.name = before.name.clone();
                qatc_ir::verify(&g)?;
                self.reused += 1;
                return Ok(g);
            }
        }
        let name = before.name.clone();
        let (mut g, _) = pipeline::run(before, Stage::Fuse, Stage::Fuse, &o.pipeline(), |_, _| {})?;
        debug_assert_eq!(g.name, name, "fusion keeps the step's name");
        let fused_text = text(&mut g);
        if on_line {
            if let Some(l) = self.line.as_mut().filter(|l| !l.confirmed) {
                match l.fused.at(b) {
                    Some(t) if t == fused_text => l.confirmed = true,
                    _ => self.off = true,
                }
            }
        } else if let Some((b0, before0, fused0)) = &self.last {
            // a new line through the last real fusion and this one, to be confirmed by the next
            self.line = match (AffineText::of(*b0 as i64, before0, b, &before_text), AffineText::of(*b0 as i64, fused0, b, &fused_text)) {
                (Some(before), Some(fused)) => Some(Line { before, fused, confirmed: false }),
                _ => None,
            };
        }
        self.last = Some((o.batch, before_text, fused_text));
        Ok(g)
    }
}
