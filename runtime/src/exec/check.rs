//! Checks of a program against its buffers, made once before anything runs, whatever the
//! device: every launch's buffers against its kernel's params, every GEMM's views against their
//! buffers and shapes, every output inside its buffer, and no step writing a graph input (inputs
//! change only by being set, or by an update's write-back after the step), except a kernel that
//! writes an update over its own input (AdamW in place: the update's view is the input itself,
//! and `ExecPlan::new` checks that no later step reads it). The executors' unchecked pointer
//! arithmetic relies on them.

use qatc_ir::DType;
use qatc_kernels::kir::Kernel;
use qatc_kernels::panels::PanelFeed;
use qatc_kernels::program::{BufId, BufKind, Buffer, Collective, Exchange, Gemm, Program, View};

use crate::error::RuntimeError;

/// A kernel as messages name it: its family and what it computes.
pub fn kernel_label(k: &Kernel) -> String {
    format!("{} ({})", k.family, k.note)
}

/// A GEMM in a profile: `gemm MxNxK`, and ` xBATCH` when batched (both executors' profiles).
pub fn gemm_label(m: usize, n: usize, k: usize, batch: usize) -> String {
    format!("gemm {m}x{n}x{k}{}", if batch > 1 { format!(" x{batch}") } else { String::new() })
}

/// The last element a view reaches, plus one (0 for an empty view).
pub fn view_extent(v: &View) -> usize {
    if v.shape.contains(&0) {
        return 0;
    }
    v.offset + v.shape.iter().zip(&v.strides).map(|(&d, &s)| (d - 1) * s).sum::<usize>() + 1
}

/// Checks that `v` stays inside `buf` and has one stride per dim.
pub fn check_view(buf: &Buffer, v: &View, what: &str) -> Result<(), RuntimeError> {
    let err = |msg: String| RuntimeError::Buffer { name: buf.name.clone(), msg };
    if v.shape.len() != v.strides.len() {
        return Err(err(format!("{what}: view of shape {:?} has strides {:?}", v.shape, v.strides)));
    }
    let end = view_extent(v);
    if end > buf.numel() {
        return Err(err(format!("{what}: view {v:?} reaches element {} of {}", end - 1, buf.numel())));
    }
    Ok(())
}

/// The buffer a view names, checked to hold it.
pub fn viewed<'p>(bufs: &'p [Buffer], v: &View, what: &str) -> Result<&'p Buffer, RuntimeError> {
    let buf = bufs
        .get(v.buf)
        .ok_or_else(|| RuntimeError::Buffer { name: what.to_string(), msg: format!("in buffer {} of {}", v.buf, bufs.len()) })?;
    check_view(buf, v, what)?;
    Ok(buf)
}

fn is_input(buf: &Buffer) -> bool {
    matches!(buf.kind, BufKind::Input(..))
}

/// Whether input buffer `b` is updated in place: its update is a view of the whole of itself.
pub fn updated_in_place(prog: &Program, b: BufId) -> bool {
    match prog.buffers.get(b).map(|x| &x.kind) {
        Some(BufKind::Input(name, _)) => prog.updates.iter().any(|(n, v)| n == name && v.buf == b && v.offset == 0),
        _ => false,
    }
}

/// Checks a launch's buffers against its kernel's params: their count, each one's dtype and
/// size, and that no graph input is written.
pub fn check_launch<'p>(prog: &'p Program, kernel: usize, args: &[BufId]) -> Result<&'p Kernel, RuntimeError> {
    let k = prog.kernels.get(kernel).ok_or_else(|| RuntimeError::Kernel {
        kernel: format!("#{kernel}"),
        msg: format!("the program has {} kernels", prog.kernels.len()),
    })?;
    let err = |msg: String| RuntimeError::Kernel { kernel: kernel_label(k), msg };
    if args.len() != k.params.len() {
        return Err(err(format!("launched with {} buffers for {} params", args.len(), k.params.len())));
    }
    for (p, &b) in k.params.iter().zip(args) {
        let buf = prog.buffers.get(b).ok_or_else(|| err(format!("param {} is buffer {b} of {}", p.name, prog.buffers.len())))?;
        if buf.dtype != p.dtype || buf.numel() != p.numel() {
            return Err(err(format!(
                "param {} ({} {:?}) gets buffer {} ({} {:?})",
                p.name, p.dtype, p.shape, buf.name, buf.dtype, buf.shape
            )));
        }
        if p.write && is_input(buf) && !updated_in_place(prog, b) {
            return Err(err(format!("param {} writes the graph input {}", p.name, buf.name)));
        }
    }
    no_written_alias(k, args).map_err(err)?;
    Ok(k)
}

/// A buffer a launch writes is passed to it once: every CUDA kernel param is `__restrict__`
/// (`kernels/src/cuda/emit.rs`), so a written buffer that also arrives as another param is
/// undefined behaviour on a GPU, though the CPU and the emulated GPU would compute the intended
/// result. A kernel that reads what it writes does so through the one param.
fn no_written_alias(k: &Kernel, args: &[BufId]) -> Result<(), String> {
    for (i, (p, &b)) in k.params.iter().zip(args).enumerate() {
        if !p.write {
            continue;
        }
        if let Some((q, _)) = k.params.iter().zip(args).enumerate().find(|&(j, (_, &c))| j != i && c == b).map(|(_, x)| x) {
            return Err(format!(
                "param {} writes buffer {b}, which the launch also passes as param {}: kernel params are __restrict__",
                p.name, q.name
            ));
        }
    }
    Ok(())
}

fn gemm_err(g: &Gemm, msg: String) -> RuntimeError {
    RuntimeError::Gemm { note: g.note.clone(), msg }
}

/// No two elements of `v` share an address (a GEMM's destination must not).
fn distinct_elements(v: &View) -> bool {
    let mut dims: Vec<(usize, usize)> = v.shape.iter().zip(&v.strides).filter(|(&d, _)| d > 1).map(|(&d, &s)| (s, d)).collect();
    dims.sort_unstable();
    let mut span = 0; // elements spanned by the dims so far, minus one
    for (s, d) in dims {
        if s <= span {
            return false;
        }
        span += (d - 1) * s;
    }
    true
}

/// Checks one GEMM against the program's buffers: views inside their buffers, operands of
/// matching shapes, a destination that overlaps neither itself nor an operand's buffer and is no
/// graph input. Which dtypes a device's GEMM takes is the device's check.
pub fn check_gemm(g: &Gemm, bufs: &[Buffer]) -> Result<(), RuntimeError> {
    // each view inside its buffer, of a float type, the one the GEMM says (a library planner reads
    // the types off the GEMM: they must be the buffers')
    let buf = |v: &View, want: Option<DType>, what: &str| {
        let b = viewed(bufs, v, what).map_err(|e| gemm_err(g, e.to_string()))?;
        if !b.dtype.is_float() || Some(b.dtype) != want {
            let want = want.map_or("no".to_string(), |d| d.to_string());
            return Err(gemm_err(g, format!("{what} ({}) is {}, the GEMM says {want} (f32, f16 or bf16)", b.name, b.dtype)));
        }
        Ok(b)
    };
    buf(&g.a, Some(g.types.a), "a")?;
    buf(&g.b, Some(g.types.b), "b")?;
    let c = buf(&g.c, Some(g.types.c), "c")?;
    if is_input(c) {
        return Err(gemm_err(g, format!("writes the graph input {}", c.name)));
    }
    let r = g.c.shape.len();
    if r < 2 || g.a.shape.len() != r || g.b.shape.len() != r {
        return Err(gemm_err(g, format!("ranks of a {:?}, b {:?}, c {:?}", g.a.shape, g.b.shape, g.c.shape)));
    }
    let batch = &g.c.shape[..r - 2];
    let want = |v: &View, rows: usize, cols: usize| v.shape[..r - 2] == *batch && v.shape[r - 2..] == [rows, cols];
    if !(want(&g.a, g.m, g.k) && want(&g.b, g.k, g.n) && want(&g.c, g.m, g.n)) {
        return Err(gemm_err(
            g,
            format!("a {:?} @ b {:?} -> c {:?} is not [.., {}, {}] @ [.., {}, {}]", g.a.shape, g.b.shape, g.c.shape, g.m, g.k, g.k, g.n),
        ));
    }
    if g.c.buf == g.a.buf || g.c.buf == g.b.buf || !distinct_elements(&g.c) {
        return Err(gemm_err(g, "the destination overlaps itself or an operand".into()));
    }
    if let Some(bias) = &g.bias {
        buf(bias, g.types.bias, "bias")?;
        if bias.shape != [g.n] || bias.buf == g.c.buf {
            return Err(gemm_err(g, format!("bias of shape {:?} for {} columns", bias.shape, g.n)));
        }
    }
    Ok(())
}

/// Checks a GEMM step: fed panel by panel (`feed`, from the CPU's `qatc_kernels::panels`), its
/// feed kernel's launch and every partial GEMM; else the GEMM itself.
pub fn check_gemm_step(prog: &Program, g: &Gemm, feed: Option<&PanelFeed>) -> Result<(), RuntimeError> {
    match feed {
        Some(f) => {
            check_launch(prog, f.kernel, &f.args)?;
            if is_input(viewed(&prog.buffers, &g.c, "c")?) {
                return Err(gemm_err(g, format!("writes the graph input {}", prog.buffers[g.c.buf].name)));
            }
            f.panels(g).iter().try_for_each(|(_, sub)| check_gemm(sub, &prog.buffers))
        }
        None => check_gemm(g, &prog.buffers),
    }
}

/// Checks a collective against its buffers: both views in range, one float type, the operand
/// contiguous, the result a whole buffer that is no graph input (but one updated in place: an
/// all-gather of a weight's blocks straight into it), the same buffer as the operand only as the
/// same view (an all-reduce in place), and their sizes as the exchange and its world make them.
pub fn check_collective(prog: &Program, c: &Collective) -> Result<(), RuntimeError> {
    let err = |msg: String| RuntimeError::Collective { what: c.note.clone(), msg };
    let src = viewed(&prog.buffers, &c.src, "a collective's operand")?;
    let dst = viewed(&prog.buffers, &c.dst, "a collective's result")?;
    if src.dtype != dst.dtype || !src.dtype.is_float() {
        return Err(err(format!("exchanges {} into {}: one float type", src.dtype, dst.dtype)));
    }
    let written_input = is_input(dst) && !updated_in_place(prog, c.dst.buf);
    if !c.src.is_contiguous() || c.dst.offset != 0 || !c.dst.is_contiguous() || c.dst.numel() != dst.numel() || written_input {
        return Err(err("its operand must be contiguous and its result a whole buffer of its own".into()));
    }
    if c.src.buf == c.dst.buf && (c.src.offset != 0 || c.src.numel() != c.dst.numel()) {
        return Err(err("written over its operand, it must be the operand's whole buffer".into()));
    }
    let (n, m, w) = (c.src.numel(), c.dst.numel(), c.world);
    let sized = match c.exchange {
        Exchange::AllReduce(_) => m == n,
        Exchange::ReduceScatter(_) => w > 0 && n == m * w,
        Exchange::AllGather => m == n * w,
    };
    if !sized {
        return Err(err(format!("{} over {w} ranks of {n} elements into {m}", c.exchange.mnemonic())));
    }
    Ok(())
}
