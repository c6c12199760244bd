//! Kernel fusion by equality saturation (egg).
//!
//! The training step of a 4-bit LoRA GPT-2 moves most of its bytes outside the big matmuls:
//! dequantization, bias and GELU, residual adds, layernorms, the attention softmax, the LoRA side
//! branch, the cross-entropy over 50,257 logits and the optimizer. This pass groups them into
//! kernels, each one `Op::Kernel` node whose body is the original ops.
//!
//! ## Design
//!
//! - [`lang`]: the egg language. An e-node is an op kind (`qatc_ir::OpKind`), an index into an op
//!   table holding the op with its attributes, and operand e-classes; the analysis gives each class
//!   its type (by the IR's own inference), name and input-graph consumers. Patterns name kinds only
//!   (`(add ?y (broadcast ?b))`); attributes and shapes are checked in Rust by each rule. Which
//!   ops are pointwise, cheap to recompute or the anchor of a family, and how the cost model
//!   counts an unfused op, is `qatc_ir`'s op table (`qatc_ir::kind`), not a list here.
//! - [`convert`]: IR -> e-graph (the whole step, a DAG: shared nodes stay shared, one class per
//!   value) and extraction -> IR.
//! - Fused kernels are e-nodes of kind `fused` whose table entry holds a family
//!   (`qatc_ir::KernelFamily`, printed `gemm.dequant.bias.lora`) and a body ([`body::Body`]): the primitive ops it computes over its
//!   operands. A rule adds such an e-node to the class of the value it computes, so the class holds
//!   both the primitive op and every kernel that can produce it; kernels grow by absorbing the
//!   fragments already in their operands' classes, iteration after iteration (dequant prologue,
//!   then bias, then LoRA, then GELU). A body is always the original ops, so the interpreter's
//!   semantics of a kernel is exactly the unfused computation (fused and unfused steps give
//!   bit-identical results on the interpreter), and code generation lowers bodies.
//! - A kernel has one result. Where one pass should write several values (LoRA's y and u, the
//!   loss and the head's gradients, dQ and dK, AdamW's p', m', v' for every tensor), the kernel
//!   writes them flattened into one buffer, `concat(reshape(r1, [n1]), reshape(r2, [n2]), ..)`
//!   along axis 0, and each value becomes the view `reshape(slice[axis 0](buffer))`, which costs
//!   nothing (a contiguous sub-buffer). This keeps the IR's one-output invariant.
//! - A value is inlined into a kernel only when every consumer it had in the input graph is
//!   inside the kernel (else it would be computed twice and still written), except values cheap
//!   to recompute: layout ops, constants, scale-and-shift, dequantization, and, in the rules
//!   that say so, attention probabilities (FlashAttention) and the LM head's logits (computed once
//!   per row chunk inside the cross-entropy kernel).
//! - [`rules`]: the catalogue, one file per family (elementwise, dequant, epilogue, lora,
//!   layernorm, attention, cross_entropy, adamw). [`cost`]: bytes moved + launches;
//!   [`extract`]: DAG-aware extraction (greedy, then a local search). [`runner`]: bounded
//!   saturation with the stop reason. [`report`]: `fusion.json`.
//!
//! Fusion runs last in the pipeline, after autodiff and AdamW: it sees the joint step, so
//! forward-backward sharing (saved activations, dequantized weights read twice) is visible.
//! Saturating the GPT-2 124M QAT + LoRA step (B 8, T 1024) takes about 0.1 s and extraction
//! 0.05 s; 1.5B about 2 s in all (`bench/RESULTS.md`).

pub mod body;
pub mod convert;
pub mod cost;
pub mod extract;
pub mod lang;
pub mod report;
pub mod rules;
pub mod runner;

use std::collections::BTreeMap;
use std::time::Instant;

use qatc_ir::{Deadline, Expired, Graph, IrError};
use serde::Serialize;

use crate::error::PassError;
use crate::pipeline::PassReport;
use crate::pipeline::Stage;
pub use report::FusionReport;

#[derive(Debug, thiserror::Error)]
pub enum FusionError {
    #[error("{0}")]
    Ir(IrError),
    #[error("fusion: node {0} has no type")]
    Untyped(String),
    #[error("fusion rule {rule}: {msg}")]
    Rule { rule: &'static str, msg: String },
    #[error("fusion extraction: {0}")]
    Extract(String),
    #[error("fusion extraction chose a cycle through {0}")]
    Cycle(String),
    #[error(transparent)]
    Expired(#[from] Expired),
}

impl From<FusionError> for PassError {
    fn from(e: FusionError) -> PassError {
        match e {
            FusionError::Ir(source) => PassError::Ir { pass: Stage::Fuse, error: source },
            FusionError::Expired(x) => PassError::Expired(x),
            e => PassError::Invalid { pass: Stage::Fuse, msg: e.to_string() },
        }
    }
}

/// The pass's knobs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FuseOptions {
    /// The e-node limit is max(this, 20 x the starting e-nodes).
    pub min_node_limit: usize,
    pub node_factor: usize,
    pub iter_limit: usize,
    pub time_limit_s: f64,
    /// What a launch costs, in bytes moved (see [`cost`]).
    pub launch_bytes: u64,
    /// Time for extraction's local search, in seconds.
    pub extract_budget_s: f64,
    /// Rules to leave out, by name (for experiments and tests).
    pub disabled: Vec<String>,
    /// Apply every rule to every match in every iteration, as egg's plain scheduler does: the
    /// reference the runner's shortcut (`runner`'s `Changed`) is tested against.
    pub recheck: bool,
}

impl Default for FuseOptions {
    fn default() -> FuseOptions {
        FuseOptions {
            min_node_limit: 50_000,
            node_factor: 20,
            iter_limit: 40,
            time_limit_s: 20.0,
            launch_bytes: 8 << 20,
            extract_budget_s: 2.0,
            disabled: Vec::new(),
            recheck: false,
        }
    }
}

/// The fused graph and the report.
pub struct Fused {
    pub graph: Graph,
    pub report: FusionReport,
}

/// Fuses `g`. Never changes what the graph computes: if extraction cannot produce a valid graph,
/// the unfused graph is returned and the report says why.
pub fn fuse_graph(g: &Graph, o: &FuseOptions) -> Result<Fused, FusionError> {
    fuse_graph_within(g, o, &Deadline::unlimited())
}

/// [`fuse_graph`] within the compile budget: saturation and extraction's search are cut short
/// when it runs out, and the pass then fails with [`FusionError::Expired`].
pub fn fuse_graph_within(g: &Graph, o: &FuseOptions, deadline: &Deadline) -> Result<Fused, FusionError> {
    deadline.check("fuse")?;
    let mut report = FusionReport { launch_bytes: o.launch_bytes, ..Default::default() };
    let (eg, roots) = convert::to_egraph(g)?;
    let (mut rewrites, mut local) = (Vec::new(), std::collections::HashSet::new());
    for (i, r) in rules::all().into_iter().enumerate() {
        if !o.disabled.iter().any(|d| d == r.name()) {
            if matches!(r, rules::Rule::Fuse(_)) {
                local.insert(egg::Symbol::from(r.name()));
            }
            rewrites.push(r.rewrite(i)?);
        }
    }
    let limits = runner::Limits {
        node_limit: o.min_node_limit.max(o.node_factor * eg.total_size()),
        iter_limit: o.iter_limit,
        time_limit_s: o.time_limit_s,
    };
    let (eg, sat) = runner::saturate(eg, &rewrites, local, o.recheck, &limits, deadline);
    deadline.check("fuse (equality saturation)")?;
    report.saturation = sat;
    let t0 = Instant::now();
    let search_s = deadline.cap(std::time::Duration::from_secs_f64(o.extract_budget_s)).as_secs_f64();
    let mut ex = extract::extract(&eg, &roots.classes(&eg), o.launch_bytes, search_s);
    let build = |ex: &extract::Extraction| {
        convert::to_graph(&eg, &roots, &ex.choice).and_then(|f| qatc_ir::verify(&f).map(|_| f).map_err(FusionError::Ir))
    };
    let mut fused = build(&ex);
    if fused.is_err() {
        // the local search's choice failed to convert (a cycle through packed kernels): the
        // greedy choice, else the unfused graph
        let greedy = extract::extract(&eg, &roots.classes(&eg), o.launch_bytes, 0.0);
        if let Ok(f) = build(&greedy) {
            fused = Ok(f);
            ex = greedy;
        }
    }
    deadline.check("fuse (extraction)")?;
    report.extraction = report::ExtractionReport {
        greedy_cost: ex.greedy_cost.clamp(0, u64::MAX as i128) as u64,
        final_cost: ex.final_cost.clamp(0, u64::MAX as i128) as u64,
        switches: ex.switches,
        time_s: t0.elapsed().as_secs_f64(),
        fallback: None,
    };
    let graph = match fused {
        Ok(f) => f,
        Err(e) => {
            report.extraction.fallback = Some(e.to_string());
            g.clone()
        }
    };
    let mut used: BTreeMap<String, usize> = BTreeMap::new();
    for n in ex.choice.values() {
        if let Some(k) = eg.analysis.table.kernel(n.op) {
            *used.entry(k.rule.to_string()).or_default() += 1;
        }
    }
    if report.extraction.fallback.is_none() {
        report.rules_used = used;
    }
    report::compare(g, &graph, &mut report);
    Ok(Fused { graph, report })
}

/// The pipeline stage: [`fuse_graph_within`] with the report's headline figures as counters and
/// the whole report attached.
pub fn fuse(g: Graph, o: &FuseOptions, deadline: &Deadline) -> Result<(Graph, PassReport), PassError> {
    let Fused { graph, report } = fuse_graph_within(&g, o, deadline)?;
    let mut r = PassReport::new(Stage::Fuse);
    r.set("kernels_before", report.kernels_before as i64);
    r.set("kernels_after", report.kernels_after as i64);
    r.set("bytes_before", report.bytes_before as i64);
    r.set("bytes_after", report.bytes_after as i64);
    r.set("ideal_bytes", report.ideal_bytes as i64);
    r.set("enodes", report.saturation.enodes as i64);
    r.set("iterations", report.saturation.iterations as i64);
    r.notes.push(format!("saturation stopped: {}", report.saturation.stop_reason));
    if let Some(f) = &report.extraction.fallback {
        r.notes.push(format!("extraction failed, graph left unfused: {f}"));
    }
    r.fusion = Some(Box::new(report));
    Ok((graph, r))
}
