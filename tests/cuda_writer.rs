//! What a CUDA reviewer found in the CUDA writer, one regression test each (kernels built by hand
//! in the kernel IR, so each case is exactly the one that went wrong):
//! - a Block-mapped row kernel with no rows still gets a block (CUDA launches none with zero
//!   blocks) and must touch nothing; attention likewise;
//! - an atomic outside a shared loop of a Block-mapped row ran once per thread;
//! - a float was atomically added (run-to-run nondeterminism; atomics are for integer counts);
//! - a 4-bit store updates the 32-bit word around its byte, past the end of an odd-sized buffer
//!   unless the allocation is padded (`Buffer::device_bytes`);
//! - float-to-integer casts saturated at i32's range for i64 and rounded doubles through float;
//!   a float stored into an integer param converted as C does (undefined out of range);
//! - doubles went through float helpers (rsqrt, max/min, block reductions);
//! - a top-level loop of a Block-mapped row reading what another thread of the block stored;
//! - grids past CUDA's limits were clamped (work silently dropped), and an I32 index of the last
//!   block could overflow.
//!
//! Where NVRTC is present each generated kernel is also compiled to a CUBIN.

mod common;

use std::collections::BTreeMap;

use qatc_ir::DType;
use qatc_kernels::cuda::{emit, emit_with, CudaKernel};
use qatc_kernels::kir::{
    Attention, AttentionPart, BinOp, Body, Expr, Ix, Kernel, Loop, Param, ReduceOp, RowMapping, Space, Stmt, Ty, UnOp,
};
use qatc_kernels::nvrtc::Arch;
use qatc_kernels::program::{BufKind, Buffer};
use qatc_kernels::CudaSettings;

fn param(name: &str, dtype: DType, n: usize, write: bool) -> Param {
    Param { name: name.into(), dtype, shape: vec![n], write }
}

fn kernel(params: Vec<Param>, space: Space, stmts: Vec<Stmt>) -> Kernel {
    Kernel {
        family: "test".into(),
        params,
        index_ty: Ty::I32,
        body: Body::Loops { space, stmts },
        note: "a test".into(),
        names: BTreeMap::new(),
    }
}

fn lp(var: u8, extent: Expr, max: usize) -> Loop {
    Loop { var, extent, max }
}

/// Compiles the kernels to sm_90 CUBINs where NVRTC is present.
fn compiles(name: &str, kernels: &[CudaKernel]) {
    if let Some(nv) = common::nvrtc::nvrtc() {
        common::nvrtc::build(&nv, name, kernels, Arch::SM90, None);
    }
}

fn row_sum_kernel(rows: usize, mapping: RowMapping) -> Kernel {
    // out[row] = sum_j x[row * 8 + j]
    let x = Expr::load(0, Expr::bin(BinOp::Add, Expr::bin(BinOp::Mul, Expr::Ix(Ix::Row), Expr::Int(8)), Expr::Ix(Ix::Loop(0))));
    let stmts = vec![
        Stmt::Reduce { var: 0, op: ReduceOp::Sum, ty: Ty::F32, lp: lp(0, Expr::Int(8), 8), body: vec![], value: x },
        Stmt::Store { param: 1, index: Expr::Ix(Ix::Row), value: Expr::Var(0) },
    ];
    kernel(vec![param("x", DType::F32, rows * 8, false), param("out", DType::F32, rows, true)], Space::Rows { rows, mapping }, stmts)
}

#[test]
fn a_kernel_with_no_rows_gets_a_block_that_touches_nothing() {
    let mut all = Vec::new();
    for mapping in [RowMapping::Block, RowMapping::Thread] {
        let k = emit(&row_sum_kernel(0, mapping)).expect("emits");
        assert_eq!(k.launch.grid, [1, 1, 1], "CUDA launches no grid of zero blocks");
        assert!(k.source.contains("if (row >= 0) return;"), "{mapping:?}:\n{}", k.source);
        all.push(k);
    }
    let k = emit_with(&row_sum_kernel(5, RowMapping::Block), &CudaSettings::GENERAL).expect("emits");
    assert!(k.source.contains("if (row >= 5) return;") && k.launch.grid == [5, 1, 1]);
    // a warp per row: 4 rows per block, the last block's fourth warp past the end
    let k = emit(&row_sum_kernel(7, RowMapping::Block)).expect("emits");
    assert!(k.source.contains("if (row >= 7) return;") && k.launch.grid == [2, 1, 1] && k.launch.block == 128, "{}", k.source);
    // attention over no rows: a block, and no call into the templates
    let a = Attention {
        b: 0,
        nh: 2,
        t: 8,
        hs: 4,
        scale: 0.5,
        strides: vec![[64, 32, 4]; 5],
        offsets: vec![0; 5],
        part: AttentionPart::Forward,
        values: DType::F32,
    };
    let params =
        ["q", "k", "v", "out"].iter().map(|n| param(n, DType::F32, 0, *n == "out")).chain([param("lse", DType::F32, 0, true)]).collect();
    let k =
        Kernel { family: "attn".into(), params, index_ty: Ty::I32, body: Body::Attention(a), note: "empty".into(), names: BTreeMap::new() };
    let k = emit(&k).expect("emits");
    assert!(k.source.contains("nothing to compute") && !k.source.contains("qatc::attention_forward"), "{}", k.source);
    all.push(k);
    compiles("writer-no-rows", &all);
}

#[test]
fn an_atomic_in_a_block_mapped_row_adds_once() {
    // count[0] += 1 per row, outside any loop: one thread of the block, not blockDim of them
    let stmts = vec![
        Stmt::Reduce {
            var: 0,
            op: ReduceOp::Sum,
            ty: Ty::F32,
            lp: lp(0, Expr::Int(64), 64),
            body: vec![],
            value: Expr::load(0, Expr::Ix(Ix::Loop(0))),
        },
        Stmt::AtomicAdd { param: 1, index: Expr::Int(0), value: Expr::Int(1) },
    ];
    let k = kernel(
        vec![param("x", DType::F32, 64, false), param("count", DType::I32, 1, true)],
        Space::Rows { rows: 4, mapping: RowMapping::Block },
        stmts,
    );
    let warp = emit(&k).expect("emits");
    assert!(warp.source.contains("if (lane == 0) atomicAdd(&count[0], (int)(1));"), "{}", warp.source);
    let k = emit_with(&k, &CudaSettings::GENERAL).expect("emits");
    assert!(k.source.contains("if (threadIdx.x == 0) atomicAdd(&count[0], (int)(1));"), "{}", k.source);
    compiles("writer-block-atomic", &[k, warp]);
}

#[test]
fn float_atomics_are_refused() {
    let k = kernel(
        vec![param("x", DType::F32, 8, false), param("out", DType::F32, 1, true)],
        Space::Elements { shape: vec![8] },
        vec![Stmt::AtomicAdd { param: 1, index: Expr::Int(0), value: Expr::load(0, Expr::Ix(Ix::Elem)) }],
    );
    let err = emit(&k).expect_err("a float atomic is nondeterministic").to_string();
    assert!(err.contains("integer counts only"), "{err}");
    #[cfg(feature = "llvm")]
    assert!(qatc_kernels::llvm::Jit::compile(&[k]).is_err(), "LLVM refuses it too");
}

#[test]
fn packed_4bit_buffers_are_padded_to_whole_words() {
    let buf = |n: usize| Buffer::new("codes", DType::I4, &[n], BufKind::Temp);
    // 5 codes are 3 bytes; store_i4 updates the word at bytes 0..4 of them
    for (n, bytes, device) in [(5, 3, 4), (8, 4, 4), (9, 5, 8), (1, 1, 4), (0, 0, 0)] {
        assert_eq!((buf(n).bytes(), buf(n).device_bytes()), (bytes, device), "{n} codes");
    }
    let f = Buffer::new("x", DType::F16, &[3], BufKind::Temp);
    assert_eq!(f.device_bytes(), 6, "only packed codes are padded");
    assert_eq!(qatc_kernels::target::CUDA_ALIGN % 4, 0);
}

/// Kernels whose one output element is `cast(to, value)`.
fn cast_kernel(value: Expr, to: Ty, out: DType) -> Kernel {
    kernel(
        vec![param("x", DType::F32, 1, false), param("out", out, 1, true)],
        Space::Elements { shape: vec![1] },
        vec![Stmt::Store { param: 1, index: Expr::Int(0), value: Expr::cast(to, value) }],
    )
}

#[test]
fn casts_saturate_at_the_target_type_from_the_source_width() {
    let cases = [
        (Expr::Float(3e9, Ty::F32), Ty::I64, "__float2ll_rz(3000000000.0f)"),
        (Expr::Float(123456789.9, Ty::F64), Ty::I32, "__double2int_rz(123456789.9)"),
        (Expr::Float(-1e19, Ty::F64), Ty::I64, "__double2ll_rz(-1e19)"),
        (Expr::Float(-2.5, Ty::F32), Ty::I32, "__float2int_rz(-2.5f)"),
    ];
    let mut all = Vec::new();
    for (v, to, want) in cases {
        let k = emit(&cast_kernel(v, to, DType::I32)).expect("emits");
        assert!(k.source.contains(want), "{want}:\n{}", k.source);
        all.push(k);
    }
    // a float stored into an integer param converts as a cast (saturating), not as C does
    let k = kernel(
        vec![param("x", DType::F32, 4, false), param("out", DType::U8, 4, true)],
        Space::Elements { shape: vec![4] },
        vec![Stmt::Store { param: 1, index: Expr::Ix(Ix::Elem), value: Expr::load(0, Expr::Ix(Ix::Elem)) }],
    );
    let k = emit(&k).expect("emits");
    assert!(k.source.contains("(unsigned char)(__float2int_rz(x[idx]))"), "{}", k.source);
    all.push(k);
    compiles("writer-casts", &all);
}

/// The LLVM backend and the kernel-IR evaluator agree on the casts the CUDA writer now emits:
/// f64 -> i32 without going through f32 (123456789.9 -> 123456789, not 123456792), f32 -> i64
/// saturating at i64's range (3e9 fits).
#[cfg(feature = "llvm")]
#[test]
fn llvm_and_the_evaluator_cast_alike() {
    use qatc_runtime::Launcher;
    let cases = [
        (Expr::Float(123456789.9, Ty::F64), Ty::I32, 123456789i64),
        (Expr::Float(3e9, Ty::F32), Ty::I64, 3_000_000_000),
        (Expr::Float(-1e19, Ty::F64), Ty::I64, i64::MIN),
        (Expr::Float(f64::NAN, Ty::F32), Ty::I32, 0),
        (Expr::Float(-7e9, Ty::F32), Ty::I32, i64::from(i32::MIN)),
    ];
    for (v, to, want) in cases {
        // the integer as two f32-exact parts: out[0] = c / 4096, out[1] = c % 4096 (every
        // quotient above is below 2^24 or a power of two)
        let c = Expr::Var(0);
        let k = kernel(
            vec![param("x", DType::F32, 1, false), param("out", DType::F32, 2, true)],
            Space::Elements { shape: vec![1] },
            vec![
                Stmt::Let { var: 0, ty: to, value: Expr::cast(to, v.clone()) },
                Stmt::Store { param: 1, index: Expr::Int(0), value: Expr::bin(BinOp::Div, c.clone(), Expr::Int(4096)) },
                Stmt::Store { param: 1, index: Expr::Int(1), value: Expr::bin(BinOp::Rem, c, Expr::Int(4096)) },
            ],
        );
        let run = |l: &dyn Launcher| -> i64 {
            let mut x = [0f32; 1];
            let mut out = [0f32; 2];
            let args = [x.as_mut_ptr().cast::<u8>(), out.as_mut_ptr().cast::<u8>()];
            // SAFETY: one pointer per param, each to a live buffer of the param's size.
            unsafe { l.launch(0, &args, 0, 1) }.expect("runs");
            out[0] as i64 * 4096 + out[1] as i64
        };
        let jit = qatc_kernels::llvm::Jit::compile(std::slice::from_ref(&k)).expect("compiles");
        let eval = qatc_runtime::KirEval::new(std::slice::from_ref(&k));
        let (a, b) = (run(&jit), run(&eval));
        assert_eq!(a, b, "{v:?} as {to:?}: LLVM {a}, evaluator {b}");
        assert_eq!(a, want, "{v:?} as {to:?}");
    }
}

#[test]
fn doubles_stay_doubles() {
    // out = rsqrt(d) + max(d, x) with d a double: no float helper in between
    let d = Expr::Float(2.0, Ty::F64);
    let value = Expr::bin(BinOp::Add, Expr::un(UnOp::Rsqrt, d.clone()), Expr::bin(BinOp::Max, d, Expr::load(0, Expr::Ix(Ix::Elem))));
    let k = kernel(
        vec![param("x", DType::F32, 4, false), param("out", DType::F32, 4, true)],
        Space::Elements { shape: vec![4] },
        vec![Stmt::Store { param: 1, index: Expr::Ix(Ix::Elem), value }],
    );
    let k = emit(&k).expect("emits");
    assert!(k.source.contains("1.0 / sqrt(2.0)") && k.source.contains("qatc::max_nan(2.0, (double)(x[idx]))"), "{}", k.source);
    // a double block reduction reduces doubles in a double scratch
    let x = Expr::cast(
        Ty::F64,
        Expr::load(0, Expr::bin(BinOp::Add, Expr::bin(BinOp::Mul, Expr::Ix(Ix::Row), Expr::Int(64)), Expr::Ix(Ix::Loop(0)))),
    );
    let r = kernel(
        vec![param("x", DType::F32, 256, false), param("out", DType::F32, 4, true)],
        Space::Rows { rows: 4, mapping: RowMapping::Block },
        vec![
            Stmt::Reduce { var: 0, op: ReduceOp::Max, ty: Ty::F64, lp: lp(0, Expr::Int(64), 64), body: vec![], value: x.clone() },
            Stmt::Reduce { var: 1, op: ReduceOp::Sum, ty: Ty::F64, lp: lp(1, Expr::Int(64), 64), body: vec![], value: x },
            Stmt::Store { param: 1, index: Expr::Ix(Ix::Row), value: Expr::bin(BinOp::Add, Expr::Var(0), Expr::Var(1)) },
        ],
    );
    let warp = emit(&r).expect("emits");
    for want in ["qatc::warp_max(acc0)", "qatc::warp_sum(acc1)"] {
        assert!(warp.source.contains(want), "{want}:\n{}", warp.source);
    }
    let r = emit_with(&r, &CudaSettings::GENERAL).expect("emits");
    for want in [
        "__shared__ double scratch_f64[32];",
        "double acc0 = -INFINITY;",
        "fmax(acc0,",
        "qatc::block_max(acc0, scratch_f64)",
        "qatc::block_sum(acc1, scratch_f64)",
    ] {
        assert!(r.source.contains(want), "{want}:\n{}", r.source);
    }
    compiles("writer-doubles", &[k, r, warp]);
}

#[test]
fn a_block_reads_what_it_stored_only_after_a_barrier() {
    // tmp[row * 64 + j] = x[..] * 2 over the block's threads, then sum_j tmp[row * 64 + 63 - j]:
    // each thread reads elements other threads wrote
    let at = |j: Expr| Expr::bin(BinOp::Add, Expr::bin(BinOp::Mul, Expr::Ix(Ix::Row), Expr::Int(64)), j);
    let stmts = vec![
        Stmt::ForEach {
            lp: lp(0, Expr::Int(64), 64),
            body: vec![Stmt::Store {
                param: 1,
                index: at(Expr::Ix(Ix::Loop(0))),
                value: Expr::bin(BinOp::Mul, Expr::load(0, at(Expr::Ix(Ix::Loop(0)))), Expr::f32(2.0)),
            }],
        },
        Stmt::Reduce {
            var: 0,
            op: ReduceOp::Sum,
            ty: Ty::F32,
            lp: lp(1, Expr::Int(64), 64),
            body: vec![],
            value: Expr::load(1, at(Expr::bin(BinOp::Sub, Expr::Int(63), Expr::Ix(Ix::Loop(1))))),
        },
        Stmt::Store { param: 2, index: Expr::Ix(Ix::Row), value: Expr::Var(0) },
    ];
    let k = kernel(
        vec![param("x", DType::F32, 256, false), param("tmp", DType::F32, 256, true), param("out", DType::F32, 4, true)],
        Space::Rows { rows: 4, mapping: RowMapping::Block },
        stmts,
    );
    let warp = emit(&k).expect("emits");
    let (store, sync, read) = (warp.source.find("tmp[").expect("a store"), warp.source.find("__syncwarp();"), warp.source.rfind("tmp["));
    assert!(sync.is_some_and(|s| store < s && Some(s) < read), "a warp barrier between the store and the read:\n{}", warp.source);
    let k = emit_with(&k, &CudaSettings::GENERAL).expect("emits");
    let (store, sync, read) = (k.source.find("tmp[").expect("a store"), k.source.find("__syncthreads();"), k.source.rfind("tmp["));
    assert!(sync.is_some_and(|s| store < s && Some(s) < read), "a barrier between the store and the read:\n{}", k.source);
    // and none where nothing is read back
    let plain = emit_with(&row_sum_kernel(4, RowMapping::Block), &CudaSettings::GENERAL).expect("emits");
    assert!(!plain.source.contains("__syncthreads();  //"), "{}", plain.source);
    compiles("writer-barrier", &[k, plain, warp]);
}

#[test]
fn grids_past_cudas_limits_are_errors_and_i32_indices_keep_headroom() {
    // 2^31 blocks of 256 threads along x: one more than CUDA launches
    let n = (1usize << 31) * 256;
    let k = kernel(
        vec![param("out", DType::F32, n, true)],
        Space::Elements { shape: vec![n] },
        vec![Stmt::Store { param: 0, index: Expr::Ix(Ix::Elem), value: Expr::f32(0.0) }],
    );
    let err = emit(&k).expect_err("too many blocks").to_string();
    assert!(err.contains("2147483648 blocks"), "{err}");
    // attention over more than 65535 (batch, head) pairs: grid.y
    let a = Attention {
        b: 1024,
        nh: 65,
        t: 64,
        hs: 4,
        scale: 0.5,
        strides: vec![[0; 3]; 5],
        offsets: vec![0; 5],
        part: AttentionPart::Forward,
        values: DType::F32,
    };
    let params = ["q", "k", "v", "out", "lse"].iter().map(|n| param(n, DType::F32, 4, *n == "out" || *n == "lse")).collect();
    let k =
        Kernel { family: "attn".into(), params, index_ty: Ty::I64, body: Body::Attention(a), note: "big".into(), names: BTreeMap::new() };
    let err = emit(&k).expect_err("too many (b, h)").to_string();
    assert!(err.contains("axis 1"), "{err}");
    // an I32 index leaves a block's headroom below i32::MAX: the last block's threads compute
    // indices past the end before testing them
    use qatc_kernels::lower::builder::{index_ty_for, I32_HEADROOM};
    assert_eq!(index_ty_for([1usize << 20]), Ty::I32);
    assert_eq!(index_ty_for([i32::MAX as usize - I32_HEADROOM]), Ty::I32);
    assert_eq!(index_ty_for([i32::MAX as usize - 100]), Ty::I64);
}

/// Q4_0's first-of-largest-magnitude fold declared a local `x`, which hid a param named `x` (the
/// full fine-tune's fake-quant of a weight named by its role): found by tests/cuda_matrix.rs.
#[test]
fn a_local_never_hides_a_param() {
    let stmts = vec![
        Stmt::Reduce {
            var: 0,
            op: ReduceOp::FirstAbsMax,
            ty: Ty::F32,
            lp: lp(0, Expr::Int(8), 8),
            body: vec![],
            value: Expr::load(0, Expr::bin(BinOp::Add, Expr::bin(BinOp::Mul, Expr::Ix(Ix::Row), Expr::Int(8)), Expr::Ix(Ix::Loop(0)))),
        },
        Stmt::Store { param: 1, index: Expr::Ix(Ix::Row), value: Expr::Var(0) },
    ];
    let k = kernel(
        vec![param("x", DType::F32, 32, false), param("out", DType::F32, 4, true)],
        Space::Rows { rows: 4, mapping: RowMapping::Thread },
        stmts,
    );
    let k = emit(&k).expect("emits");
    assert!(k.source.contains("const float x1 = x[") && k.source.contains("acc0 = x1;"), "{}", k.source);
    compiles("writer-shadowing", &[k]);
}
