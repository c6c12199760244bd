//! Where the memory goes, in the categories of the usual tables.
//!
//! The rule, value by value, is `qatc_ir::role`'s (the one home, which the lowering tags program
//! buffers by too): inputs by kind (weights at the graph's dtype: i4 codes count 4 bits per
//! element, plus their scales), `grad:NAME` values are gradients, forward values the backward
//! reads are activations, everything else temporaries.
//!
//! Inputs live in their own storage for the whole step; the others share the arena. An arena
//! buffer holds several values over time (views, in-place results): at each step its bytes
//! count in the category of the values alive in it then (gradients before activations before
//! temporaries when several are), and the buffer itself is labelled by the category it spends
//! the most steps in.

use super::liveness::Liveness;
use super::region::Dense;

pub use qatc_ir::Category;

/// The category of one value: `qatc_ir::role`'s rule (see the module docs).
pub(crate) fn value_category(d: &Dense, i: usize) -> Category {
    d.category[i]
}

/// Per-step arena bytes by category, and each buffer's label.
pub(crate) struct Profile {
    /// `by_step[s][c]`: arena bytes of category `c` (index in `Category::ALL`) live at step s.
    pub by_step: Vec<[usize; 7]>,
    pub buffer_category: Vec<Category>,
}

pub(crate) fn cat_index(c: Category) -> usize {
    c.index()
}

pub(crate) fn profile(d: &Dense, lv: &Liveness) -> Profile {
    let steps = lv.live.len();
    let cats: Vec<Category> = (0..d.len()).map(|i| value_category(d, i)).collect();
    let mut diff = vec![[0i64; 7]; steps + 1];
    let mut buffer_category = Vec::with_capacity(lv.bufs.len());
    for b in &lv.bufs {
        if let Some(p) = b.persistent {
            buffer_category.push(cats[p]);
            continue;
        }
        // segments between the members' births and deaths; each gets the highest-ranked
        // category among the members alive in it (or the last one's, between two of them)
        let mut cuts: Vec<usize> = vec![b.first, b.last + 1];
        for &m in &b.members {
            cuts.push(lv.pos[m]);
            cuts.push(lv.last_use[m] + 1);
        }
        cuts.sort_unstable();
        cuts.dedup();
        let mut steps_in = [0usize; 7];
        let mut prev = cats[b.members[0]];
        for w in cuts.windows(2) {
            let (lo, hi) = (w[0], w[1]);
            if lo < b.first || hi > b.last + 1 || lo >= hi {
                continue;
            }
            let alive = b.members.iter().filter(|&&m| lv.pos[m] <= lo && lv.last_use[m] >= lo);
            let c = alive.map(|&m| cats[m]).max_by_key(|c| c.rank()).unwrap_or(prev);
            prev = c;
            let k = cat_index(c);
            diff[lo][k] += b.size as i64;
            diff[hi][k] -= b.size as i64;
            steps_in[k] += hi - lo;
        }
        let label = (0..7).max_by_key(|&k| (steps_in[k], std::cmp::Reverse(k))).map(|k| Category::ALL[k]).unwrap_or(Category::Temporaries);
        buffer_category.push(label);
    }
    let mut by_step = Vec::with_capacity(steps);
    let mut acc = [0i64; 7];
    for row in diff.iter().take(steps) {
        let mut out = [0usize; 7];
        for k in 0..7 {
            acc[k] += row[k];
            out[k] = acc[k].max(0) as usize;
        }
        by_step.push(out);
    }
    Profile { by_step, buffer_category }
}
