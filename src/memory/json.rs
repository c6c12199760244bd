//! The executed plan as JSON: schema `qatc.memory_plan`, version 2, documented in
//! `docs/memory_plan.md`. Buffers and steps are written one object per line so that the file
//! reads (and diffs) as a table.

use qatc_ir::Category;
use serde_json::{json, Map, Value};

use super::Executed;

pub const SCHEMA: &str = "qatc.memory_plan";
/// Version 2: the plan is the executed program's (its buffers, steps and layout), not the
/// graph's; steps are the program's launches and GEMMs.
pub const VERSION: u32 = 2;

/// Totals by category: input ones are their storage; arena ones their bytes live at the peak
/// step and the most they ever reach.
fn totals(e: &Executed) -> Value {
    let p = &e.plan;
    let mut m = Map::new();
    for c in Category::ALL {
        let region = if c.persistent() { "inputs" } else { "arena" };
        m.insert(c.name().into(), json!({ "region": region, "at_peak": p.at_peak(c), "max": p.max_of(c) }));
    }
    m.insert("fragmentation".into(), json!({ "region": "arena", "at_peak": p.fragmentation() }));
    Value::Object(m)
}

/// The `summary` object.
pub fn summary(e: &Executed) -> Value {
    let p = &e.plan;
    let prog = &e.program;
    json!({
        "peak_bytes": p.peak_bytes(),
        "persistent_bytes": p.persistent_bytes,
        "data_bytes": p.data_bytes,
        "arena_bytes": p.arena_bytes,
        "lower_bound_bytes": p.lower_bound,
        "ratio": (p.ratio() * 10000.0).round() / 10000.0,
        "peak_step": p.peak_step,
        "peak_at": p.steps.get(p.peak_step).map(|s| s.what.clone()),
        "backward_starts": p.backward_starts,
        "steps": p.steps.len(),
        "buffers": p.buffers.len(),
        "kernels": prog.kernels.len(),
        "launches": prog.launches(),
        "gemms": prog.gemms().count(),
        "hoisted_steps": e.exec.hoisted_steps(),
        "align": p.align,
        "gemm_flops": p.gemm_flops(),
        "total_flops": e.total_flops,
        "recompute_flops": e.recompute_flops,
        "recomputed_nodes": e.recomputed_nodes,
        "cross_entropy": super::chunking(e),
    })
}

/// The whole document. `context` (model, batch, options, policy, device, ...) is written as given.
pub fn to_json(e: &Executed, context: Value) -> Result<String, serde_json::Error> {
    to_json_with(e, context, None)
}

/// [`to_json`] with the plan per rank (`qatc plan --ranks N`, `super::ranks`) as `ranks`.
pub fn to_json_with(e: &Executed, context: Value, ranks: Option<Value>) -> Result<String, serde_json::Error> {
    let mut head =
        vec![("schema", json!(SCHEMA)), ("version", json!(VERSION)), ("context", context), ("summary", summary(e)), ("totals", totals(e))];
    if let Some(r) = ranks {
        head.push(("ranks", r));
    }
    let mut out = String::from("{\n");
    for (k, v) in head {
        let pretty = serde_json::to_string_pretty(&v)?.replace('\n', "\n  ");
        out += &format!("  {}: {pretty},\n", serde_json::to_string(k)?);
    }
    let p = &e.plan;
    out += "  \"buffers\": [\n";
    for (i, b) in p.buffers.iter().enumerate() {
        let sep = if i + 1 < p.buffers.len() { "," } else { "" };
        out += &format!("    {}{sep}\n", serde_json::to_string(b)?);
    }
    out += "  ],\n  \"steps\": [\n";
    for (i, s) in p.steps.iter().enumerate() {
        let sep = if i + 1 < p.steps.len() { "," } else { "" };
        out += &format!("    {}{sep}\n", serde_json::to_string(s)?);
    }
    out += "  ]\n}\n";
    Ok(out)
}
