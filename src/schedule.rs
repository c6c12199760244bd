//! What changes from step to step without recompiling: the learning rate and the data order.

use std::f64::consts::PI;

/// `--schedule`: the learning rate after warmup.
#[derive(serde::Serialize, serde::Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    #[default]
    Constant,
    /// Cosine decay to --min-lr by the end of the run.
    Cosine,
}

/// The learning rate at each optimizer step: linear warmup, then constant or cosine decay.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct LrSchedule {
    pub lr: f64,
    pub warmup: usize,
    pub kind: Schedule,
    /// Cosine reaches this at step `total` (the end of the run).
    pub min_lr: f64,
    pub total: usize,
}

impl LrSchedule {
    /// The learning rate of step `s` (0-based): warmup ramps (s+1)/warmup of the peak, as llm.c.
    pub fn at(&self, s: usize) -> f64 {
        if s < self.warmup {
            return self.lr * (s + 1) as f64 / self.warmup as f64;
        }
        match self.kind {
            Schedule::Cosine => {
                let span = self.total.saturating_sub(self.warmup).max(1) as f64;
                let frac = ((s - self.warmup) as f64 / span).min(1.0);
                self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + (PI * frac).cos())
            }
            Schedule::Constant => self.lr,
        }
    }
}

/// Which batch of the data the j-th micro-batch of the run reads.
#[derive(Clone, Debug, PartialEq)]
pub enum DataOrder {
    /// llm.c's loader: batch j mod n.
    Sequential,
    /// A fresh permutation of the n batches every epoch, drawn from (seed, epoch).
    Shuffle { seed: u64 },
}

impl DataOrder {
    pub fn batch(&self, j: usize, n: usize) -> usize {
        let n = n.max(1);
        match self {
            DataOrder::Sequential => j % n,
            DataOrder::Shuffle { seed } => permutation(*seed, (j / n) as u64, n)[j % n],
        }
    }
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fisher-Yates over 0..n from a seed: the same (seed, epoch) always gives the same order.
pub fn permutation(seed: u64, epoch: u64, n: usize) -> Vec<usize> {
    let mut p: Vec<usize> = (0..n).collect();
    let mut st = seed ^ epoch.wrapping_mul(0xD1B5_4A32_D192_ED03);
    for i in (1..n).rev() {
        let j = (splitmix(&mut st) % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_to_min() {
        let s = LrSchedule { lr: 1.0, warmup: 4, kind: Schedule::Cosine, min_lr: 0.1, total: 14 };
        assert_eq!(s.at(0), 0.25);
        assert_eq!(s.at(3), 1.0);
        assert!((s.at(4) - 1.0).abs() < 1e-12);
        assert!((s.at(9) - 0.55).abs() < 1e-12);
        assert!((s.at(14) - 0.1).abs() < 1e-12);
        let c = LrSchedule { kind: Schedule::Constant, ..s };
        assert_eq!(c.at(10), 1.0);
    }

    #[test]
    fn shuffle_is_a_permutation_per_epoch() {
        let o = DataOrder::Shuffle { seed: 3 };
        let mut e0: Vec<usize> = (0..10).map(|j| o.batch(j, 10)).collect();
        let e1: Vec<usize> = (10..20).map(|j| o.batch(j, 10)).collect();
        assert_ne!(e0, e1, "each epoch has its own order");
        e0.sort();
        assert_eq!(e0, (0..10).collect::<Vec<_>>());
        assert_eq!(DataOrder::Sequential.batch(13, 10), 3);
    }
}
