//! The interpreter's ops, on plain slices (not to be confused with the `qatc-kernels` crate, which
//! generates code). Output shapes come from the node's inferred type, so kernels
//! receive them rather than re-deriving them; messages are plain strings the interpreter prefixes
//! with the node.

pub mod elementwise;
pub mod embed;
pub mod layout;
pub mod matmul;
pub mod norm;
pub mod scaling;
pub mod softmax;

/// Below this many output elements a kernel runs on the calling thread: spawning costs more.
const PAR_MIN: usize = 1 << 16;

/// Fills `out` by calling `f(first_index, chunk)` on disjoint chunks, in parallel when large.
/// Chunks start on multiples of `align` (a row length), so row-wise kernels see whole rows.
/// Each element is computed independently, so the result does not depend on the thread count.
pub(crate) fn par_chunks<T: Send>(out: &mut [T], align: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let align = align.max(1);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(8);
    if out.len() < PAR_MIN || threads <= 1 {
        f(0, out);
        return;
    }
    let rows = out.len().div_ceil(align);
    let chunk = rows.div_ceil(threads) * align;
    std::thread::scope(|s| {
        for (i, c) in out.chunks_mut(chunk).enumerate() {
            let f = &f;
            s.spawn(move || f(i * chunk, c));
        }
    });
}

/// Elementwise map of one operand, parallel when large.
pub(crate) fn map1<T: Copy + Send + Sync>(x: &[T], f: impl Fn(T) -> T + Sync) -> Vec<T> {
    let mut out = x.to_vec();
    par_chunks(&mut out, 1, |_, c| c.iter_mut().for_each(|v| *v = f(*v)));
    out
}

/// Elementwise map of two equal-length operands, parallel when large.
pub(crate) fn map2<T: Copy + Send + Sync>(a: &[T], b: &[T], f: impl Fn(T, T) -> T + Sync) -> Vec<T> {
    let mut out = a.to_vec();
    par_chunks(&mut out, 1, |start, c| {
        for (i, v) in c.iter_mut().enumerate() {
            *v = f(*v, b[start + i]);
        }
    });
    out
}

/// Checks that an operand holds as many elements as its type says (hand-built values can lie).
pub(crate) fn expect_len(what: &str, got: usize, want: usize) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what} holds {got} elements, its type needs {want}"))
    }
}
