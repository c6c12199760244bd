use qatc_ir::IrError;
use thiserror::Error;

/// Errors of the interpreter. Node-level errors carry `Graph::describe` of the node so a failure
/// in a GPT-2-sized step points at the checkpoint tensor or the op that produced it.
#[derive(Debug, Error, PartialEq)]
pub enum RuntimeError {
    /// The graph failed the IR verifier when the interpreter was built.
    #[error("invalid graph: {0}")]
    Ir(#[from] IrError),
    #[error("missing input {0:?}")]
    MissingInput(String),
    #[error("input {name:?}: expected shape {want:?}, got {got:?}")]
    InputShape { name: String, want: Vec<usize>, got: Vec<usize> },
    #[error("input {name:?}: expected a {want} tensor, got {got}")]
    InputKind { name: String, want: String, got: String },
    #[error("tensor of shape {shape:?} needs {want} elements, got {got}")]
    BadTensor { shape: Vec<usize>, want: usize, got: usize },
    #[error("node id {0:?} is not in the interpreted graph")]
    UnknownNode(qatc_ir::NodeId),
    #[error("name {0:?} names both an output and an update with different values; use run_split")]
    OutputClash(String),
    /// An op failed at run time (an id out of range, operands of the wrong kind).
    #[error("node {node}: {msg}")]
    Node { node: String, msg: String },
    /// A compiled program's kernel failed or cannot run as given (`kernel` is its family and note).
    #[error("kernel {kernel}: {msg}")]
    Kernel { kernel: String, msg: String },
    /// A compiled program's library GEMM cannot run (`note` is what it computes).
    #[error("gemm {note}: {msg}")]
    Gemm { note: String, msg: String },
    /// A compiled program's buffer or a view of it is unusable (too small, wrong dtype).
    #[error("buffer {name:?}: {msg}")]
    Buffer { name: String, msg: String },
    /// `set_input` of a name the compiled program has no input for.
    #[error("the compiled program has no input {0:?}")]
    UnknownInput(String),
    /// An output asked for that the step has not (a name it has no output of, or no run yet).
    #[error("no output {0:?}: the step has none of that name, or has not run")]
    MissingOutput(String),
    /// Compiling a program for the CPU failed (lowering rewrites or the LLVM JIT; the message
    /// names the kernel).
    #[error("compiling the program: {0}")]
    Compile(String),
    /// The GPU failed or refused (`what` the executor was doing; `msg` CUDA's error name and
    /// string, or the emulation's finding).
    #[error("{what}: {msg}")]
    Device { what: String, msg: String },
    /// A collective cannot run (`what` the collective's note or the communicator's call).
    #[error("collective {what}: {msg}")]
    Collective { what: String, msg: String },
}
