//! Hoisting: the steps that compute the same values every run because they read only frozen
//! weights (dequantizing 4-bit weights, mostly) run on the first run, and again only after a
//! frozen input is set anew, not every step. Their results must then keep their bytes between
//! runs: the layout makes them live the whole run.

use super::access::Access;

/// Which steps qualify, given what each reads and writes and which buffers are frozen inputs: a
/// step qualifies when everything it reads is frozen or written by qualifying steps (or by
/// itself), and no other step writes what it writes.
pub fn hoisted(access: &[Access], frozen: &[bool]) -> Vec<bool> {
    let mut writers = vec![0usize; frozen.len()];
    for a in access {
        for &b in &a.writes {
            if let Some(w) = writers.get_mut(b) {
                *w += 1;
            }
        }
    }
    let mut constant = frozen.to_vec();
    access
        .iter()
        .map(|a| {
            let is_constant = |b: usize| constant.get(b).copied().unwrap_or(false);
            let ok = !a.writes.is_empty()
                && a.reads.iter().all(|&b| is_constant(b) || a.writes.contains(&b))
                && a.writes.iter().all(|&b| writers.get(b) == Some(&1));
            if ok {
                for &b in &a.writes {
                    constant[b] = true;
                }
            }
            ok
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// w frozen: t = f(w) and u = g(t) are hoisted, y = t + x is not (x is data), and neither is
    /// a step writing a buffer another step writes too.
    #[test]
    fn chains_of_frozen_reads_hoist() {
        let a = |r: &[usize], w: &[usize]| Access { reads: r.to_vec(), writes: w.to_vec() };
        // buffers: 0 w (frozen), 1 x, 2 t, 3 u, 4 y, 5 s
        let steps = [a(&[0], &[2]), a(&[2], &[3]), a(&[2, 1], &[4]), a(&[0], &[5]), a(&[1], &[5])];
        let frozen = [true, false, false, false, false, false];
        assert_eq!(hoisted(&steps, &frozen), [true, true, false, false, false]);
    }
}
