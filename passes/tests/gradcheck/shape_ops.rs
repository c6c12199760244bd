//! Shape ops: broadcast, sum_to, reshape, transpose, slice, concat.

use qatc_ir::{Op, Shape, UnaryOp};

use crate::harness::{count, Case, ANY};

#[test]
fn broadcast() {
    for (k, (from, to)) in [
        (vec![3, 1], vec![2, 3, 4]),
        (vec![], vec![2, 3]),
        (vec![5], vec![2, 3, 5]),
        (vec![1, 3, 1], vec![2, 3, 5]),
        (vec![2, 3], vec![2, 3]),
    ]
    .into_iter()
    .enumerate()
    {
        let mut c = Case::new(&format!("broadcast {from:?} -> {to:?}"), 500 + k as u64);
        let x = c.param("x", &from, ANY);
        let y = c.op(Op::Broadcast { shape: Shape(to) }, &[x]);
        c.check(y);
    }
}

#[test]
fn sum_to() {
    for (k, (from, to)) in [
        (vec![2, 3, 4], vec![3, 1]),
        (vec![2, 3, 4], vec![]),
        (vec![2, 3, 5], vec![5]),
        (vec![2, 3, 5], vec![2, 1, 5]),
        (vec![3, 5], vec![3, 5]),
    ]
    .into_iter()
    .enumerate()
    {
        let mut c = Case::new(&format!("sum_to {from:?} -> {to:?}"), 600 + k as u64);
        let x = c.param("x", &from, ANY);
        // Square first so the loss is not linear in x (a linear loss would pass a rule that
        // returned the right sum in the wrong places only by luck less often).
        let x2 = c.un(UnaryOp::Square, x);
        let y = c.op(Op::SumTo { shape: Shape(to) }, &[x2]);
        c.check(y);
    }
}

#[test]
fn reshape() {
    for (k, to) in [vec![5, 6], vec![30], vec![3, 1, 10], vec![1, 2, 15]].into_iter().enumerate() {
        let mut c = Case::new(&format!("reshape -> {to:?}"), 700 + k as u64);
        let x = c.param("x", &[2, 3, 5], ANY);
        let y = c.op(Op::Reshape { shape: Shape(to) }, &[x]);
        c.check(y);
    }
}

#[test]
fn transpose() {
    // Non-involutive permutations, so perm and its inverse differ.
    for (k, perm) in [vec![2, 0, 1], vec![1, 2, 0], vec![1, 0, 2], vec![0, 1, 2], vec![3, 1, 0, 2]].into_iter().enumerate() {
        let shape: &[usize] = if perm.len() == 4 { &[2, 3, 1, 5] } else { &[2, 3, 5] };
        let mut c = Case::new(&format!("transpose {perm:?}"), 800 + k as u64);
        let x = c.param("x", shape, ANY);
        let y = c.op(Op::Transpose { perm }, &[x]);
        c.check(y);
    }
}

#[test]
fn slice_with_padding_at_start_middle_and_end() {
    // x [4, 5, 3]: slices whose backward pads at the end only, both sides, the start only, and
    // none; along each axis.
    let cases = [(1, 0, 2), (1, 1, 3), (1, 3, 5), (1, 0, 5), (0, 1, 4), (0, 3, 4), (2, 0, 1), (2, 1, 2), (2, 2, 3)];
    for (k, (axis, start, end)) in cases.into_iter().enumerate() {
        let mut c = Case::new(&format!("slice axis {axis} [{start}, {end})"), 900 + k as u64);
        let x = c.param("x", &[4, 5, 3], ANY);
        let y = c.op(Op::Slice { axis, start, end }, &[x]);
        let ad = c.check(y);
        // The padding constants are built only where there is something to pad.
        let pads = usize::from(start > 0) + usize::from(end < [4, 5, 3][axis]);
        assert_eq!(count(&ad, "concat"), usize::from(pads > 0), "slice ({axis}, {start}, {end})");
    }
}

#[test]
fn concat() {
    let mut c = Case::new("concat axis 1", 1000);
    let a = c.param("a", &[2, 3], ANY);
    let b = c.param("b", &[2, 4], ANY);
    let d = c.param("d", &[2, 1], ANY);
    let y = c.op(Op::Concat { axis: 1 }, &[a, b, d]);
    c.check(y);

    let mut c = Case::new("concat axis 0", 1001);
    let a = c.param("a", &[1, 3, 2], ANY);
    let b = c.param("b", &[2, 3, 2], ANY);
    let y = c.op(Op::Concat { axis: 0 }, &[a, b]);
    c.check(y);

    // The same operand in several slots, mixed with a frozen one.
    let mut c = Case::new("concat (x, f, x)", 1002);
    let x = c.param("x", &[3, 2], ANY);
    let f = c.frozen("f", &[3, 5], ANY);
    let y = c.op(Op::Concat { axis: 1 }, &[x, f, x]);
    c.check(y);
}
