//! The plan as JSON: schema `qatc.memory_plan`, version 1, documented in
//! `docs/memory_plan.md`. Buffers and steps are written one object per line so that the file
//! reads (and diffs) as a table.

use serde_json::{json, Map, Value};

use super::{Category, Plan};

pub const SCHEMA: &str = "qatc.memory_plan";
pub const VERSION: u32 = 1;

/// Totals by category: persistent ones are their storage; arena ones their bytes live at the
/// peak step and the most they ever reach.
fn totals(p: &Plan) -> Value {
    let mut m = Map::new();
    for (c, b) in &p.persistent {
        m.insert(c.name().into(), json!({ "region": "persistent", "at_peak": b, "max": b }));
    }
    for (k, c) in Category::ALL.iter().enumerate() {
        if c.persistent() {
            continue;
        }
        let at_peak = p.at_peak.iter().find(|(x, _)| x == c).map(|(_, b)| *b).unwrap_or(0);
        let max = p.profile.iter().map(|r| r[k]).max().unwrap_or(0);
        m.insert(c.name().into(), json!({ "region": "arena", "at_peak": at_peak, "max": max }));
    }
    m.insert("fragmentation".into(), json!({ "region": "arena", "at_peak": p.arena_bytes - p.lower_bound.min(p.arena_bytes) }));
    Value::Object(m)
}

/// The whole document. `context` (model, batch, options, policy, ...) is written as given.
pub fn to_json(p: &Plan, context: Value) -> Result<String, serde_json::Error> {
    let summary = json!({
        "peak_bytes": p.peak_bytes(),
        "persistent_bytes": p.persistent_bytes(),
        "arena_bytes": p.arena_bytes,
        "lower_bound_bytes": p.lower_bound,
        "ratio": (p.ratio() * 10000.0).round() / 10000.0,
        "peak_step": p.peak_step,
        "backward_starts": p.backward_starts,
        "steps": p.steps.len(),
        "buffers": p.buffers.len(),
        "in_place_steps": p.in_place_steps,
        "scheduler": p.scheduler,
        "total_flops": p.total_flops,
        "recompute_flops": p.recompute_flops,
        "recomputed_nodes": p.recomputed_nodes,
    });
    let head = [("schema", json!(SCHEMA)), ("version", json!(VERSION)), ("context", context), ("summary", summary), ("totals", totals(p))];
    let mut out = String::from("{\n");
    for (k, v) in head {
        let pretty = serde_json::to_string_pretty(&v)?.replace('\n', "\n  ");
        out += &format!("  {}: {pretty},\n", serde_json::to_string(k)?);
    }
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
