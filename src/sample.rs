//! The next token from a pass's logits (`qatc generate`): greedy, the first largest logit (as
//! `torch.argmax`, so greedy text is transformers' `generate(do_sample=False)`), or a draw from
//! the softmax at a temperature, cut to the top k and to the top-p nucleus in transformers' order
//! (temperature, then top-k, then top-p), from ChaCha8 seeded by `--seed`: the same seed gives
//! the same text on any machine.

use std::cmp::Ordering;

use rand::rngs::ChaCha8Rng;
use rand::{RngExt, SeedableRng};

/// How to choose: temperature 0 is greedy; top-k and top-p cut a sampled distribution.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    pub temperature: f64,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
}

impl Sampling {
    pub fn greedy() -> Sampling {
        Sampling { temperature: 0.0, top_k: None, top_p: None }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Whether the settings make sense, in the flags' words.
    pub fn check(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!("--temperature must be 0 (greedy) or a positive number, got {}", self.temperature));
        }
        if self.top_k == Some(0) {
            return Err("--top-k must be at least 1".into());
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(format!("--top-p must be in (0, 1], got {p}"));
            }
        }
        if self.is_greedy() && (self.top_k.is_some() || self.top_p.is_some()) {
            return Err("--top-k and --top-p cut a sampled distribution: give a --temperature above 0 (0 is greedy)".into());
        }
        Ok(())
    }
}

/// Chooses tokens as its `Sampling` says, drawing from its own seeded stream.
pub struct Sampler {
    sampling: Sampling,
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(sampling: Sampling, seed: u64) -> Result<Sampler, String> {
        sampling.check()?;
        Ok(Sampler { sampling, rng: ChaCha8Rng::seed_from_u64(seed) })
    }

    /// The next token's id (an index into `logits`, which must be finite and not empty).
    pub fn next(&mut self, logits: &[f32]) -> usize {
        if self.sampling.is_greedy() {
            return argmax(logits);
        }
        let t = self.sampling.temperature;
        // (scaled logit, id), the candidates in the order they are drawn from
        let mut cand: Vec<(f64, usize)> = logits.iter().enumerate().map(|(i, &x)| (x as f64 / t, i)).collect();
        if self.sampling.top_k.is_some() || self.sampling.top_p.is_some() {
            cand.sort_by(highest_first);
        }
        if let Some(k) = self.sampling.top_k.filter(|&k| k < cand.len()) {
            // transformers keeps every logit at least the k-th largest (ties at the cut stay)
            let kth = cand[k - 1].0;
            cand.retain(|c| c.0 >= kth);
        }
        let max = cand.iter().map(|c| c.0).fold(f64::NEG_INFINITY, f64::max);
        let mut weights: Vec<f64> = cand.iter().map(|c| (c.0 - max).exp()).collect();
        if let Some(p) = self.sampling.top_p {
            // the smallest highest-first prefix whose mass reaches p (at least one token): a token
            // stays while the mass above it is below p (transformers' TopPLogitsWarper)
            let total: f64 = weights.iter().sum();
            let mut above = 0.0;
            let keep = weights
                .iter()
                .take_while(|&&w| {
                    let stays = above < p * total;
                    above += w;
                    stays
                })
                .count()
                .max(1);
            weights.truncate(keep);
        }
        let total: f64 = weights.iter().sum();
        let u = self.rng.random::<f64>() * total;
        let mut acc = 0.0;
        for (w, c) in weights.iter().zip(&cand) {
            acc += w;
            if u < acc {
                return c.1;
            }
        }
        cand[weights.len() - 1].1
    }
}

/// The index of the first largest value (`torch.argmax` on a row without NaN).
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best
}

/// Larger logits first; equal ones by id.
fn highest_first(a: &(f64, usize), b: &(f64, usize)) -> Ordering {
    b.0.partial_cmp(&a.0).unwrap_or(Ordering::Equal).then(a.1.cmp(&b.1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(temperature: f64, top_k: Option<usize>, top_p: Option<f64>, seed: u64) -> Sampler {
        Sampler::new(Sampling { temperature, top_k, top_p }, seed).unwrap()
    }

    #[test]
    fn greedy_takes_the_first_largest() {
        assert_eq!(argmax(&[0.5, 2.0, -1.0, 2.0]), 1);
        assert_eq!(Sampler::new(Sampling::greedy(), 9).unwrap().next(&[0.1, 0.3, 0.2]), 1);
    }

    /// The same seed draws the same tokens; another seed, other ones.
    #[test]
    fn draws_repeat_with_the_seed() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let draw = |seed| {
            let mut s = sampler(1.0, None, None, seed);
            (0..40).map(|_| s.next(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    /// top-k 2 draws only the two largest; top-p 0.5 over probabilities .6/.3/.1 only the first;
    /// top-p 0.7 the first two (the mass above the second, .6, is below .7).
    #[test]
    fn cuts_keep_the_top_tokens() {
        let logits = [1.0f32, 3.0, 2.0, 0.0];
        let mut s = sampler(1.0, Some(2), None, 1);
        let mut seen: Vec<usize> = (0..200).map(|_| s.next(&logits)).collect();
        seen.sort();
        seen.dedup();
        assert_eq!(seen, [1, 2]);
        let probs = [0.6f64, 0.3, 0.1];
        let logits: Vec<f32> = probs.iter().map(|p| p.ln() as f32).collect();
        let mut s = sampler(1.0, None, Some(0.5), 2);
        assert!((0..100).all(|_| s.next(&logits) == 0));
        let mut s = sampler(1.0, None, Some(0.7), 3);
        let mut seen: Vec<usize> = (0..300).map(|_| s.next(&logits)).collect();
        seen.sort();
        seen.dedup();
        assert_eq!(seen, [0, 1]);
    }

    /// Frequencies follow the softmax at the temperature.
    #[test]
    fn frequencies_follow_the_softmax() {
        let logits = [0.0f32, (3.0f64).ln() as f32];
        let mut s = sampler(1.0, None, None, 5);
        let n = 20_000;
        let ones = (0..n).filter(|_| s.next(&logits) == 1).count() as f64 / n as f64;
        assert!((ones - 0.75).abs() < 0.02, "{ones}");
        // temperature 2 flattens 1:3 to 1:sqrt(3)
        let mut s = sampler(2.0, None, None, 5);
        let ones = (0..n).filter(|_| s.next(&logits) == 1).count() as f64 / n as f64;
        let want = 3f64.sqrt() / (1.0 + 3f64.sqrt());
        assert!((ones - want).abs() < 0.02, "{ones} against {want}");
    }

    #[test]
    fn bad_settings_are_refused() {
        let bad = |t, k, p| Sampling { temperature: t, top_k: k, top_p: p }.check().unwrap_err();
        assert!(bad(-1.0, None, None).contains("--temperature"));
        assert!(bad(f64::NAN, None, None).contains("--temperature"));
        assert!(bad(1.0, Some(0), None).contains("--top-k"));
        assert!(bad(1.0, None, Some(0.0)).contains("--top-p"));
        assert!(bad(1.0, None, Some(1.5)).contains("--top-p"));
        assert!(bad(0.0, Some(5), None).contains("--temperature above 0"));
    }
}
