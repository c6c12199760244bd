//! Index arithmetic with the simplifications that keep generated addressing readable:
//! `(a * 128 + b) / 128` with `b < 128` is `a`, `(x / 32) % 8` with `x < 256` is `x / 32`, and so
//! on. Every rule assumes non-negative operands, which index expressions always are. Bounds are
//! exclusive upper limits of each index variable.

use crate::kir::{BinOp, Expr, Ix};

/// Exclusive upper bounds of the index variables in scope.
#[derive(Clone, Debug, Default)]
pub struct Bounds {
    pub elem: i64,
    pub coords: Vec<i64>,
    pub row: i64,
    pub loops: Vec<i64>,
}

impl Bounds {
    fn of(&self, ix: Ix) -> Option<i64> {
        match ix {
            Ix::Elem => Some(self.elem),
            Ix::Coord(d) => self.coords.get(d as usize).copied(),
            Ix::Row => Some(self.row),
            Ix::Loop(l) => self.loops.get(l as usize).copied(),
        }
        .filter(|&b| b > 0)
    }

    /// An exclusive upper bound of a non-negative index expression, when one is known.
    pub fn upper(&self, e: &Expr) -> Option<i64> {
        match e {
            Expr::Int(c) if *c >= 0 => Some(c + 1),
            Expr::Ix(ix) => self.of(*ix),
            Expr::Bin(BinOp::Add, a, b) => Some(self.upper(a)? + self.upper(b)? - 1),
            Expr::Bin(BinOp::Mul, a, b) => Some((self.upper(a)? - 1) * (self.upper(b)? - 1) + 1),
            Expr::Bin(BinOp::Div, a, b) => match **b {
                Expr::Int(k) if k > 0 => Some((self.upper(a)? - 1) / k + 1),
                _ => None,
            },
            Expr::Bin(BinOp::Rem, a, b) => match **b {
                Expr::Int(k) if k > 0 => Some(self.upper(a).map_or(k, |u| u.min(k))),
                _ => None,
            },
            _ => None,
        }
    }

    pub fn add(&self, a: Expr, b: Expr) -> Expr {
        match (&a, &b) {
            (Expr::Int(0), _) => b,
            (_, Expr::Int(0)) => a,
            (Expr::Int(x), Expr::Int(y)) => Expr::Int(x + y),
            _ => Expr::bin(BinOp::Add, a, b),
        }
    }

    pub fn mul(&self, a: Expr, k: i64) -> Expr {
        match a {
            _ if k == 0 => Expr::Int(0),
            _ if k == 1 => a,
            Expr::Int(x) => Expr::Int(x * k),
            Expr::Bin(BinOp::Mul, x, c) if matches!(*c, Expr::Int(_)) => {
                let Expr::Int(c) = *c else { unreachable_int() };
                self.mul(*x, c * k)
            }
            _ => Expr::bin(BinOp::Mul, a, Expr::Int(k)),
        }
    }

    pub fn div(&self, a: Expr, k: i64) -> Expr {
        if k == 1 {
            return a;
        }
        if let Expr::Int(x) = a {
            return Expr::Int(x / k);
        }
        if self.upper(&a).is_some_and(|u| u <= k) {
            return Expr::Int(0);
        }
        match a {
            Expr::Bin(BinOp::Div, x, c) if matches!(*c, Expr::Int(_)) => {
                let Expr::Int(c) = *c else { unreachable_int() };
                self.div(*x, c * k)
            }
            Expr::Bin(BinOp::Mul, ref x, ref c) if matches!(**c, Expr::Int(c) if c % k == 0) => {
                let Expr::Int(c) = **c else { unreachable_int() };
                self.mul((**x).clone(), c / k)
            }
            Expr::Bin(BinOp::Rem, ref x, ref m) if matches!(**m, Expr::Int(m) if m % k == 0) => {
                let Expr::Int(m) = **m else { unreachable_int() };
                let q = self.div((**x).clone(), k);
                self.rem(q, m / k)
            }
            _ => {
                // (sum of multiples of k) + rest, rest < k: the multiples divide exactly.
                let (multiples, rest) = split_terms(&a, k);
                if !multiples.is_empty() && self.upper(&sum(self, rest.clone())).is_some_and(|u| u <= k) {
                    let parts = multiples.into_iter().map(|(x, c)| self.mul(x, c / k)).collect();
                    sum(self, parts)
                } else {
                    Expr::bin(BinOp::Div, a, Expr::Int(k))
                }
            }
        }
    }

    pub fn rem(&self, a: Expr, k: i64) -> Expr {
        if k == 1 {
            return Expr::Int(0);
        }
        if let Expr::Int(x) = a {
            return Expr::Int(x % k);
        }
        if self.upper(&a).is_some_and(|u| u <= k) {
            return a;
        }
        match a {
            Expr::Bin(BinOp::Mul, _, ref c) if matches!(**c, Expr::Int(c) if c % k == 0) => Expr::Int(0),
            Expr::Bin(BinOp::Rem, x, m) if matches!(*m, Expr::Int(m) if m % k == 0) => self.rem(*x, k),
            _ => {
                let (multiples, rest) = split_terms(&a, k);
                if multiples.is_empty() {
                    Expr::bin(BinOp::Rem, a, Expr::Int(k))
                } else {
                    self.rem(sum(self, rest), k)
                }
            }
        }
    }
}

/// Never reached: the guard of the arm that calls it matched an `Expr::Int`.
fn unreachable_int() -> ! {
    unreachable!("guarded by matches!(.., Expr::Int(_))")
}

/// Splits a sum into terms `x * c` with c a multiple of k, and the rest.
fn split_terms(e: &Expr, k: i64) -> (Vec<(Expr, i64)>, Vec<Expr>) {
    let mut terms = Vec::new();
    flatten(e, &mut terms);
    let (mut mult, mut rest) = (Vec::new(), Vec::new());
    for t in terms {
        match &t {
            Expr::Bin(BinOp::Mul, x, c) => match **c {
                Expr::Int(c) if c % k == 0 => mult.push(((**x).clone(), c)),
                _ => rest.push(t),
            },
            Expr::Int(c) if c % k == 0 => mult.push((Expr::Int(1), *c)),
            _ => rest.push(t),
        }
    }
    (mult, rest)
}

fn flatten(e: &Expr, out: &mut Vec<Expr>) {
    match e {
        Expr::Bin(BinOp::Add, a, b) => {
            flatten(a, out);
            flatten(b, out);
        }
        _ => out.push(e.clone()),
    }
}

fn sum(b: &Bounds, parts: Vec<Expr>) -> Expr {
    parts.into_iter().fold(Expr::Int(0), |acc, p| b.add(acc, p))
}

/// Row-major strides.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// The coordinates of linear index `lin` in `shape`.
pub fn delinearize(b: &Bounds, lin: &Expr, shape: &[usize]) -> Vec<Expr> {
    let st = strides(shape);
    shape.iter().zip(&st).map(|(&d, &s)| if d == 1 { Expr::Int(0) } else { b.rem(b.div(lin.clone(), s as i64), d as i64) }).collect()
}

/// offset + sum of coords[d] * strides[d].
pub fn linearize(b: &Bounds, offset: usize, coords: &[Expr], strides: &[usize]) -> Expr {
    let mut e = Expr::Int(offset as i64);
    for (c, &s) in coords.iter().zip(strides) {
        e = b.add(e, b.mul(c.clone(), s as i64));
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(ix: Ix) -> Expr {
        Expr::Ix(ix)
    }

    #[test]
    fn div_and_rem_of_a_linearized_pair_give_the_pair_back() {
        let b = Bounds { elem: 1024, row: 8, loops: vec![128], ..Default::default() };
        let lin = b.add(b.mul(v(Ix::Row), 128), v(Ix::Loop(0)));
        assert_eq!(b.div(lin.clone(), 128), v(Ix::Row));
        assert_eq!(b.rem(lin, 128), v(Ix::Loop(0)));
        // x < 1024: (x / 128) % 8 needs no remainder
        assert_eq!(b.rem(b.div(v(Ix::Elem), 128), 8), b.div(v(Ix::Elem), 128));
        // nested divisions merge, remainders of remainders shrink
        assert_eq!(b.div(b.div(v(Ix::Elem), 4), 8), b.div(v(Ix::Elem), 32));
        assert_eq!(b.rem(b.rem(v(Ix::Elem), 64), 8), b.rem(v(Ix::Elem), 8));
    }

    #[test]
    fn delinearize_then_linearize_round_trips_on_a_contiguous_shape() {
        let b = Bounds { elem: 24, ..Default::default() };
        let cs = delinearize(&b, &v(Ix::Elem), &[2, 3, 4]);
        assert_eq!(cs[0], b.div(v(Ix::Elem), 12));
        let back = linearize(&b, 0, &cs, &strides(&[2, 3, 4]));
        assert!(matches!(back, Expr::Bin(BinOp::Add, ..)), "{back:?}");
    }
}
