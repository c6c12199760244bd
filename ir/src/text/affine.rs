//! A family of graphs that differ only in numbers affine in one integer parameter: the step at
//! batch B, whose shapes, slices and reshapes are `a + b*B` (B x T rows, B x NH heads, the
//! flattened buffers fused kernels write) while its ops, attributes and wiring stay the same.
//!
//! Two members' texts (the text format, `print`) are split at their numbers; where the two agree
//! everywhere but in integers, the family is that text with each differing integer replaced by
//! the line through the two points, and the member at any other B is printed from it and parsed
//! (`qatc plan --fit` plans many batch sizes of one configuration; fusing each costs far more than
//! this). Whether a third member really is the line's is the caller's to check (by comparing with
//! one made the long way): two points fit any line.
//!
//! A number, here, is a run of digits (with an optional leading `-`, a fraction and an exponent)
//! that does not continue a word: `f32` and `gpt2_B8` are text, while the `12` of `%12` and the `0`
//! of `"h.0.attn"` are numbers (which then have to agree between the two members).

/// One number of the text: the same in both members, or an integer that differs.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Num {
    Same(String),
    /// Its values at the family's two parameters.
    Line(i64, i64),
}

/// A graph's text as an affine function of one integer parameter (`AffineText::of`).
#[derive(Clone, Debug)]
pub struct AffineText {
    /// The text between the numbers: one more piece than numbers.
    pieces: Vec<String>,
    nums: Vec<Num>,
    /// The two parameters it was made from (`p1 < p2`).
    p1: i64,
    p2: i64,
}

/// Splits `s` at its numbers: (the pieces between them, the numbers), `pieces.len() == nums.len() + 1`.
fn split(s: &str) -> (Vec<&str>, Vec<&str>) {
    let b = s.as_bytes();
    let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let (mut pieces, mut nums) = (Vec::new(), Vec::new());
    let (mut i, mut start) = (0, 0);
    while i < b.len() {
        let digit_at = |k: usize| k < b.len() && b[k].is_ascii_digit();
        let starts = (i == 0 || !word(b[i - 1])) && (digit_at(i) || (b[i] == b'-' && digit_at(i + 1)));
        if !starts {
            i += 1;
            continue;
        }
        let first = i;
        i += 1;
        while i < b.len() {
            let c = b[i];
            if c.is_ascii_digit() || (c == b'.' && digit_at(i + 1)) {
                i += 1;
            } else if (c == b'e' || c == b'E') && (digit_at(i + 1) || (matches!(b.get(i + 1), Some(b'-' | b'+')) && digit_at(i + 2))) {
                i += 2;
            } else {
                break;
            }
        }
        pieces.push(&s[start..first]);
        nums.push(&s[first..i]);
        start = i;
    }
    pieces.push(&s[start..]);
    (pieces, nums)
}

impl AffineText {
    /// The family through `t1` at parameter `p1` and `t2` at `p2` (`p1 != p2`): None when the two
    /// texts differ in anything but integers.
    pub fn of(p1: i64, t1: &str, p2: i64, t2: &str) -> Option<AffineText> {
        if p1 == p2 {
            return None;
        }
        let ((pieces, n1), (pieces2, n2)) = (split(t1), split(t2));
        if pieces != pieces2 || n1.len() != n2.len() {
            return None;
        }
        let mut nums = Vec::with_capacity(n1.len());
        for (a, b) in n1.iter().zip(&n2) {
            if a == b {
                nums.push(Num::Same(a.to_string()));
            } else {
                nums.push(Num::Line(a.parse().ok()?, b.parse().ok()?));
            }
        }
        let (p1, p2, nums) = if p1 < p2 {
            (p1, p2, nums)
        } else {
            let swapped = nums.into_iter().map(|n| if let Num::Line(a, b) = n { Num::Line(b, a) } else { n }).collect();
            (p2, p1, swapped)
        };
        Some(AffineText { pieces: pieces.into_iter().map(str::to_string).collect(), nums, p1, p2 })
    }

    /// The member at parameter `p`: None where a line does not pass through an integer there, or
    /// a size would be negative.
    pub fn at(&self, p: i64) -> Option<String> {
        let mut out = String::with_capacity(self.pieces.iter().map(String::len).sum::<usize>() + 8 * self.nums.len());
        for (piece, n) in self.pieces.iter().zip(&self.nums) {
            out.push_str(piece);
            match n {
                Num::Same(s) => out.push_str(s),
                Num::Line(a, b) => {
                    let rise = (b - a).checked_mul(p - self.p1)?;
                    let run = self.p2 - self.p1;
                    if rise % run != 0 {
                        return None;
                    }
                    let v = a.checked_add(rise / run)?;
                    if v < 0 {
                        return None;
                    }
                    out.push_str(&v.to_string());
                }
            }
        }
        out.push_str(self.pieces.last().map_or("", String::as_str));
        Some(out)
    }

    /// How many of its numbers change with the parameter.
    pub fn varying(&self) -> usize {
        self.nums.iter().filter(|n| matches!(n, Num::Line(..))).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_split_from_words() {
        let s = "%12 = add(%3, %4) : f32[2, 1024] \"h.0.mlp\" x=-1.5e-3 y2";
        let (pieces, nums) = split(s);
        assert_eq!(nums, ["12", "3", "4", "2", "1024", "0", "-1.5e-3"]);
        assert_eq!(pieces.len(), nums.len() + 1);
        assert_eq!(pieces.concat().len() + nums.concat().len(), s.len());
        assert!(pieces.iter().any(|p| p.contains("f32[")), "f32 keeps its digits: {pieces:?}");
    }

    #[test]
    fn a_line_through_two_members_gives_the_others() {
        let at = |b: i64| {
            format!("%0 = input : f32[{b}, 1024, 768] \"x\"\n%1 = reshape[shape=[{}, 768]](%0) : f32[{}, 768]\n", 1024 * b, 1024 * b + 7)
        };
        let f = AffineText::of(2, &at(2), 1, &at(1)).unwrap();
        assert_eq!(f.varying(), 3);
        for b in [1, 3, 4, 64] {
            assert_eq!(f.at(b).unwrap(), at(b));
        }
    }

    #[test]
    fn texts_that_differ_in_more_than_integers_are_no_family() {
        assert!(AffineText::of(1, "add(%0) : f32[4]", 2, "mul(%0) : f32[8]").is_none());
        assert!(AffineText::of(1, "scale[k=0.5] : f32[4]", 2, "scale[k=0.25] : f32[8]").is_none());
        assert!(AffineText::of(1, "f32[4]", 2, "f32[8, 1]").is_none());
        assert!(AffineText::of(1, "f32[4]", 1, "f32[4]").is_none());
    }

    #[test]
    fn a_line_off_the_integers_or_below_zero_gives_nothing() {
        // 4 at 2, 7 at 4: 5.5 at 3
        let f = AffineText::of(2, "f32[4]", 4, "f32[7]").unwrap();
        assert_eq!(f.at(6).as_deref(), Some("f32[10]"));
        assert_eq!(f.at(3), None);
        assert_eq!(AffineText::of(1, "f32[1]", 2, "f32[3]").unwrap().at(0), None);
    }
}
