//! Bit allocation under a loss budget, for `qatc prt --budget`: from the precision range test's
//! measurements (each module quantized alone at each width, the rest at full precision), the
//! width of every module that spends the fewest bits while the modules' penalties sum to at most
//! the budget. A multiple-choice knapsack, solved by Lagrangian relaxation (every module takes
//! the width minimizing elements x bits + lambda x penalty; lambda bisected to the smallest that
//! fits the budget) and then filled greedily: the relaxation lands on the convex hull of each
//! module's (bits, penalty) curve, and the greedy pass spends what budget is left.
//!
//! Penalties of modules quantized together add up only roughly, so the caller measures the map it
//! gets and tightens the budget when the sum was optimistic.

/// One width a module may take: its bits (None: full precision), the bits per element it costs,
/// and its loss penalty in nats.
type Choice = (Option<u8>, u32, f64);

/// One module's measurements.
#[derive(Clone, Debug, PartialEq)]
pub struct Curve {
    /// Weights in the module: what one bit of width costs.
    pub elems: usize,
    /// The module's width at full precision (its checkpoint's dtype, 16 for f16).
    pub full_bits: u32,
    /// (bits, loss penalty in nats) for each width tried; a negative penalty counts as 0.
    pub tried: Vec<(u8, f64)>,
}

impl Curve {
    /// The options: every width tried, and full precision (no penalty).
    fn options(&self) -> Vec<Choice> {
        let mut v: Vec<Choice> = self.tried.iter().map(|&(b, p)| (Some(b), u32::from(b), p.max(0.0))).collect();
        v.push((None, self.full_bits, 0.0));
        v
    }
}

/// The width per module (None: full precision) and the summed penalty.
pub fn allocate(curves: &[Curve], budget: f64) -> (Vec<Option<u8>>, f64) {
    let pick = |lambda: f64| -> Vec<Choice> {
        curves
            .iter()
            .map(|c| {
                let cost = |o: &Choice| c.elems as f64 * f64::from(o.1) + lambda * o.2;
                c.options().into_iter().min_by(|a, b| cost(a).total_cmp(&cost(b)).then(a.2.total_cmp(&b.2))).unwrap_or((
                    None,
                    c.full_bits,
                    0.0,
                ))
            })
            .collect()
    };
    let total = |v: &[Choice]| v.iter().map(|o| o.2).sum::<f64>();
    // lambda large enough that every module stays at its least penalty, then bisect (log scale)
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    while total(&pick(hi)) > budget && hi < 1e30 {
        hi *= 16.0;
    }
    let mut best = pick(hi);
    if total(&pick(lo)) <= budget {
        best = pick(lo);
    } else {
        for _ in 0..200 {
            let mid = if lo == 0.0 { hi / 1e6 } else { (lo * hi).sqrt() };
            let v = pick(mid);
            if total(&v) <= budget {
                hi = mid;
                best = v;
            } else {
                lo = mid;
            }
            if hi / lo.max(1e-300) < 1.0 + 1e-9 {
                break;
            }
        }
    }
    // greedy: spend the rest of the budget on the cheapest bits saved per nat
    loop {
        let used = total(&best);
        let mut step: Option<(usize, Choice, f64)> = None;
        for (i, c) in curves.iter().enumerate() {
            for o in c.options() {
                let (saved, extra) = (f64::from(best[i].1) - f64::from(o.1), o.2 - best[i].2);
                if saved <= 0.0 || used + extra > budget {
                    continue;
                }
                let gain = saved * c.elems as f64 / extra.max(1e-12);
                if step.as_ref().is_none_or(|s| gain > s.2) {
                    step = Some((i, o, gain));
                }
            }
        }
        match step {
            Some((i, o, _)) => best[i] = o,
            None => break,
        }
    }
    let sum = total(&best);
    (best.into_iter().map(|o| o.0).collect(), sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn curve(elems: usize, tried: &[(u8, f64)]) -> Curve {
        Curve { elems, full_bits: 16, tried: tried.to_vec() }
    }

    #[test]
    fn a_loose_budget_takes_the_fewest_bits_and_a_zero_one_full_precision() {
        let cs = [curve(100, &[(2, 0.5), (4, 0.01), (8, 0.0)]), curve(300, &[(2, 0.2), (4, 0.02), (8, 0.001)])];
        assert_eq!(allocate(&cs, 10.0).0, vec![Some(2), Some(2)]);
        // 8 bits costs 0.001 in the second module: over a zero budget it stays at full precision
        assert_eq!(allocate(&cs, 0.0).0, vec![Some(8), None]);
    }

    #[test]
    fn the_budget_goes_where_it_saves_the_most_bits() {
        // the big module saves 3x the bits per step: it gets the low width, the small one waits
        let cs = [curve(100, &[(3, 0.02), (4, 0.005), (8, 0.0)]), curve(300, &[(3, 0.02), (4, 0.005), (8, 0.0)])];
        let (bits, sum) = allocate(&cs, 0.026);
        assert_eq!(bits, vec![Some(4), Some(3)]);
        assert!(sum <= 0.026 && (sum - 0.025).abs() < 1e-12, "{sum}");
        // never over budget, whatever the budget
        for k in 0..50 {
            let b = k as f64 * 0.001;
            assert!(allocate(&cs, b).1 <= b + 1e-15, "{b}");
        }
    }
}
