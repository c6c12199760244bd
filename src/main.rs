//! The `qatc` command line. Errors print as one line (`error: ...`) and exit with code 2.

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use qatc::cli;

// mimalloc's thread-local free lists: the planner's many small allocations without glibc's
// consolidation passes (Cargo.toml says why)
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "qatc", version, about = "Compiles GPT-2 checkpoints into quantization-aware LoRA training steps")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Lower a checkpoint and build its training step; write the IR and a manifest.
    Compile(cli::compile::Args),
    /// Mean loss and perplexity over a token file.
    Eval(cli::eval::Args),
    /// Print the IR after a named pipeline stage.
    Dump(cli::dump::Args),
    /// Fine-tune on a token file.
    Train(Box<cli::train::Args>),
    /// Precision range test: the lowest bits per module that keep the loss within a threshold.
    Prt(cli::prt::Args),
    /// The memory plan of the training step: will it fit, and where the memory goes.
    Plan(cli::plan::Args),
    /// Merge a LoRA adapter and write the trained weights: Hugging Face safetensors or GGUF.
    Export(cli::export::Args),
    /// Continue a text: the model as deployed (an adapter with its trained quantization), over a
    /// KV cache, greedy or sampled.
    Generate(Box<cli::generate::Args>),
}

/// Clap's error as one line (as every other error), exit code 2; help and version as clap prints them.
fn usage_error(e: clap::Error) -> ! {
    use clap::error::ErrorKind;
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        e.exit()
    }
    if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
        eprintln!(
            "error: qatc needs a command: compile, eval, dump, train, prt, plan, export or generate (qatc --help says what each does)"
        );
        std::process::exit(2);
    }
    let text = e.render().to_string();
    let parts: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with("For more information")).collect();
    eprintln!("{}", parts.join(" "));
    std::process::exit(2);
}

/// Rust ignores SIGPIPE, so a print to a closed pipe (`qatc plan MODEL | head`) panics; a
/// command-line tool should end quietly instead, as the default action of SIGPIPE does.
#[cfg(unix)]
fn default_sigpipe() {
    // SAFETY: called first in main, before any thread exists; signal() with SIG_DFL installs no
    // handler code, it only restores the default disposition of one signal.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() {
    #[cfg(unix)]
    default_sigpipe();
    // Process-wide settings, made before any thread starts: what the GEMM libraries read when
    // they load (`qatc_runtime::cpu::library_env` says why), unless the user set them.
    let mut notes = Vec::new();
    for (name, value) in qatc_runtime::cpu::library_env() {
        match std::env::var(name) {
            Err(_) => std::env::set_var(name, value),
            // a machine's environment may name a weaker kernel set than the CPU has (seen here:
            // OPENBLAS_CORETYPE=Haswell on AVX-512 machines, which made 124M's fp32 step take
            // 0.76 s instead of 0.44): the user's choice stands, and `qatc train` points it out
            Ok(set) if set != value && name == "OPENBLAS_CORETYPE" => notes.push(format!(
                "qatc: note: {name}={set} is set in the environment; this CPU's best OpenBLAS kernels are {value}'s, which qatc would pick: unset it for faster f32 GEMMs"
            )),
            Ok(_) => {}
        }
    }
    let _ = cli::LIBRARY_ENV_NOTES.set(notes);
    let matches = Cli::command().try_get_matches().unwrap_or_else(|e| usage_error(e));
    let args = Cli::from_arg_matches(&matches).unwrap_or_else(|e| usage_error(e));
    // which of train's options were given (with --resume, the others are the saved run's)
    let given = matches.subcommand_matches("train").map(cli::resume::Given::from_matches).unwrap_or_else(cli::resume::Given::all);
    // and plan's (a --precision or --optim given pins it for --fit)
    let plan_given = matches.subcommand_matches("plan").map(cli::resume::Given::from_matches).unwrap_or_else(cli::resume::Given::all);
    let r = match &args.cmd {
        Cmd::Compile(a) => cli::compile::run(a),
        Cmd::Eval(a) => cli::eval::run(a),
        Cmd::Dump(a) => cli::dump::run(a),
        Cmd::Train(a) => cli::train::run(a, &given),
        Cmd::Prt(a) => cli::prt::run(a),
        Cmd::Plan(a) => cli::plan::run(a, &plan_given),
        Cmd::Export(a) => cli::export::run(a),
        Cmd::Generate(a) => cli::generate::run(a),
    };
    if let Err(e) = r {
        // One line: the chain of causes joined, newlines folded.
        let mut msg = format!("{e:#}").replace('\n', " ");
        msg.push_str(cli::hint(&e).unwrap_or_default());
        cli::print_error(&msg);
        std::process::exit(2);
    }
}
