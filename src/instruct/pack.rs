//! Examples into sequences of T positions: packed several to a sequence, or one each, padded.
//!
//! An example of L tokens fills L - 1 positions (its tokens but the last, each predicting the
//! next). Packing places the examples longest first, each into the sequence with the least room
//! that still holds it (the first such sequence on a tie), or a new one: best-fit decreasing,
//! deterministic. In a packed sequence each example's positions are numbered from 0 (its position
//! ids: the position embedding it would have alone, and the attention mask, which keeps each
//! token to the earlier tokens of its own example); the positions after the last example are
//! padding, numbered from 0 as a segment of their own. Padding's inputs and targets are
//! end-of-text, and the loss never counts them.

use std::collections::BTreeSet;

use super::template::{Example, EOS};

/// Sequences of `t` positions holding examples of `slots` positions each (every one at most `t`),
/// as lists of example indices: best-fit decreasing.
pub fn pack(slots: &[usize], t: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..slots.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(slots[i]), i));
    let mut rows: Vec<Vec<usize>> = Vec::new();
    // (room left, sequence) of the sequences with room
    let mut room: BTreeSet<(usize, usize)> = BTreeSet::new();
    for i in order {
        let s = slots[i];
        let (r, left) = match room.range((s, 0)..).next().copied() {
            Some((left, r)) => {
                room.remove(&(left, r));
                rows[r].push(i);
                (r, left - s)
            }
            None => {
                rows.push(vec![i]);
                (rows.len() - 1, t.saturating_sub(s))
            }
        };
        if left > 0 {
            room.insert((left, r));
        }
    }
    rows
}

/// One sequence's inputs, targets, counted targets (1 or 0) and position ids, written into the
/// slices (each `t` long) from the examples `row` names.
pub struct Fill<'a> {
    pub ids: &'a mut [i32],
    pub targets: &'a mut [i32],
    pub mask: &'a mut [f32],
    pub positions: &'a mut [i32],
}

pub fn fill(examples: &[Example], row: &[usize], out: Fill) {
    let mut at = 0;
    for &e in row {
        let ex = &examples[e];
        for k in 0..ex.slots() {
            out.ids[at] = i32::from(ex.tokens[k]);
            out.targets[at] = i32::from(ex.tokens[k + 1]);
            out.mask[at] = if ex.counts[k + 1] { 1.0 } else { 0.0 };
            out.positions[at] = k as i32;
            at += 1;
        }
    }
    let used = at;
    for p in used..out.ids.len() {
        out.ids[p] = i32::from(EOS);
        out.targets[p] = i32::from(EOS);
        out.mask[p] = 0.0;
        out.positions[p] = (p - used) as i32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_decreasing() {
        // longest first: 7 -> A, 5 -> B (A has 3 left), 3 -> A (fits exactly), 2 -> B, 2 -> B (1 left), 1 -> B
        let rows = pack(&[2, 7, 3, 5, 2, 1], 10);
        assert_eq!(rows, vec![vec![1, 2], vec![3, 0, 4, 5]]);
        // every example once, no sequence over t
        let slots: Vec<usize> = (0..200).map(|i| 1 + (i * 37) % 64).collect();
        let rows = pack(&slots, 64);
        let mut seen: Vec<usize> = rows.iter().flatten().copied().collect();
        seen.sort();
        assert_eq!(seen, (0..200).collect::<Vec<_>>());
        assert!(rows.iter().all(|r| r.iter().map(|&i| slots[i]).sum::<usize>() <= 64));
        let total: usize = slots.iter().sum();
        assert!(rows.len() <= total.div_ceil(64) + 1, "{} sequences for {total} positions", rows.len());
    }

    #[test]
    fn a_sequence_numbers_each_example_from_zero() {
        let ex = |tokens: &[u16], counts: &[bool]| Example { tokens: tokens.to_vec(), counts: counts.to_vec() };
        let examples = [ex(&[1, 2, 3], &[false, false, true]), ex(&[4, 5], &[false, true])];
        let (mut ids, mut targets, mut mask, mut positions) = (vec![0; 6], vec![0; 6], vec![0.0; 6], vec![0; 6]);
        fill(&examples, &[0, 1], Fill { ids: &mut ids, targets: &mut targets, mask: &mut mask, positions: &mut positions });
        let e = i32::from(EOS);
        assert_eq!(ids, [1, 2, 4, e, e, e]);
        assert_eq!(targets, [2, 3, 5, e, e, e]);
        assert_eq!(mask, [0.0, 1.0, 1.0, 0.0, 0.0, 0.0]);
        assert_eq!(positions, [0, 1, 0, 0, 1, 2]);
    }
}
