//! qatc's reference interpreter: the numerical oracle every optimization (fusion, LLVM/CUDA code
//! generation) is checked against, and a slow but complete way to run training steps. Also the
//! executor of compiled programs on the CPU ([`cpu`]: a lowered `qatc_kernels::Program`'s
//! kernel launches and GEMMs over buffers allocated once), built on the executor core that every
//! device shares ([`exec`]: checks, lifetimes, hoisting, the memory layout, [`TrainStep`]).
//!
//! [`Interpreter<T>`] runs a [`qatc_ir::Graph`] with values stored in `T` (`f32` or `f64`): f64
//! mode is the accurate reference used for finite-difference gradient checks; f32 mode stores
//! every value in f32 as device code does, but accumulates every sum (GEMM dot products, row
//! statistics, softmax and log-sum-exp, the reductions of gradients) in f64 and rounds it once
//! ([`WideSum`]), so that it is more accurate than any engine it judges (issue 34: the embedded
//! model's loss within 6e-8 of float64's, relative, where f32 sums put it up to 3e-5 off;
//! `tests/fidelity.rs`). Elementwise ops compute in `T`. Whatever `T`, every value whose node
//! type is f16/bf16 is rounded to that dtype when produced (inputs, consts, casts and every other
//! op), so mixed-precision graphs round as on hardware; f32-typed values are not rounded in f64
//! mode.
//! Integer dtypes (i32, and u8/i4 codes one per element) are [`IntTensor`]s of i32.
//!
//! ```no_run
//! # use std::collections::HashMap;
//! # use qatc_ir::{DType, Graph, InputKind, Op, UnaryOp};
//! # use qatc_runtime::{Interpreter, Value};
//! let mut g = Graph::new("demo");
//! let x = g.input("x", InputKind::Data, DType::F32, [2, 3])?;
//! let y = g.add(Op::Unary(UnaryOp::Gelu), &[x])?;
//! g.set_output("y", y)?;
//! let interp = Interpreter::<f64>::new(&g)?;
//! let inputs = HashMap::from([("x".to_string(), Value::floats([2, 3], &[0.0, 1.0, 2.0, -1.0, -2.0, 0.5])?)]);
//! let out = interp.run(&inputs)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Semantics worth knowing beyond the op docs in `qatc_ir::op`:
//! - matmul runs on matrixmultiply's dgemm (threaded; f32 operands widened, [`Float::gemm`]);
//!   transposed operands are strides.
//! - max/min propagate NaN. Float-to-integer casts truncate toward zero and saturate at the
//!   target's range (i32; u8 0..=255; i4 0..=15, codes being unsigned), NaN becoming 0.
//! - fake_quant, dequantize and act_quant run in f32 whatever `T` ([`quant`]: one code path, so
//!   Dequantize of stored codes equals FakeQuant bit for bit); dropout masks come from
//!   [`quant::dropout_keep`].
//! - gather/scatter_add ids and cross-entropy targets out of range are errors naming the node.
//! - adam_param forms its scalar factors (bias corrections, lr/bc1) in f64, as PyTorch does with
//!   Python floats, and applies them in `T`.
//! - Intermediates are freed after their last use; only what the requested values depend on is
//!   computed, and only the inputs that those need must be supplied.
//! - Large elementwise and row-wise kernels split their output over threads; each element is
//!   computed the same way regardless, so results do not depend on the thread count.

mod arena;
mod collective;
pub mod comm;
pub mod cpu;
pub mod cuda;
mod error;
mod eval;
pub mod exec;
mod float;
mod interp;
pub mod ops;
pub mod quant;
mod value;

pub use arena::{ArenaInterpreter, ArenaLayout, Slot};
pub use cpu::{CpuOptions, CpuProgram, KirEval, Launcher};
pub use error::RuntimeError;
pub use exec::{BufferLayout, ExecOptions, ExecPlan, InterpretedStep, MemoryLayout, TrainStep};
pub use float::{Float, WideSum};
pub use interp::{Interpreter, RunOutputs};
pub use value::{IntTensor, Tensor, Value};
