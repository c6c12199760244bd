//! Hoisting: the steps that compute the same values every run because they read only frozen
//! weights (dequantizing 4-bit weights, casting f32 ones to the compute type) run on the first
//! run, and again only after a frozen input is set anew, not every step. Their results must then
//! keep their bytes between runs: the layout makes them live the whole run.

use super::access::Access;

pub use qatc_kernels::target::Hoist;

/// Which steps qualify, given what each reads and writes, which buffers are frozen inputs and
/// each buffer's bytes: a step qualifies when everything it reads is frozen or written by
/// qualifying steps (or by itself), no other step writes what it writes, and under
/// `Hoist::Shrinking` it writes no more bytes than it reads (or reads nothing).
pub fn hoisted(access: &[Access], frozen: &[bool], bytes: &[usize], policy: Hoist) -> Vec<bool> {
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
            let size = |bs: &[usize]| bs.iter().map(|&b| bytes.get(b).copied().unwrap_or(0)).sum::<usize>();
            let small = policy != Hoist::Shrinking || a.reads.is_empty() || size(&a.writes) <= size(&a.reads);
            let ok = !a.writes.is_empty()
                && a.reads.iter().all(|&b| is_constant(b) || a.writes.contains(&b))
                && a.writes.iter().all(|&b| writers.get(b) == Some(&1))
                && small;
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
        let bytes = [8; 6];
        assert_eq!(hoisted(&steps, &frozen, &bytes, Hoist::Everything), [true, true, false, false, false]);
    }

    /// Under `Shrinking` a step that writes more than it reads stays in the step, and so does
    /// what reads its result; one that writes no more is hoisted.
    #[test]
    fn shrinking_hoists_casts_not_expansions() {
        let a = |r: &[usize], w: &[usize]| Access { reads: r.to_vec(), writes: w.to_vec() };
        // buffers: 0 codes (frozen, 4 B), 1 dequantized (16 B), 2 w (frozen, 16 B), 3 w cast
        // (8 B), 4 a constant (4 B), 5 its use (16 B)
        let steps = [a(&[0], &[1]), a(&[1], &[5]), a(&[2], &[3]), a(&[], &[4])];
        let frozen = [true, false, true, false, false, false];
        let bytes = [4, 16, 16, 8, 4, 16];
        assert_eq!(hoisted(&steps, &frozen, &bytes, Hoist::Shrinking), [false, false, true, true]);
        assert_eq!(hoisted(&steps, &frozen, &bytes, Hoist::Everything), [true, true, true, true]);
        let nothing = [false; 6];
        assert_eq!(hoisted(&steps, &nothing, &bytes, Hoist::Nothing), [false, false, false, true]);
    }
}
