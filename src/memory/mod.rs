//! The memory plan a user reads (`qatc plan`, `qatc compile`'s `memory_plan.json` and
//! `memory.svg`, `qatc train`'s memory line, `qatc plan --fit`), drawn and printed: the executed
//! program's, as `qatc_driver::plan` makes it for the target (the program the target's executor
//! runs, laid out by the executor core's own layout function with the target's parameters). The
//! buffers listed are the buffers the executor allocates, at the same offsets.
//!
//! - [`json`]: the plan as JSON (schema `qatc.memory_plan`, version 2, `docs/memory_plan.md`);
//! - [`svg`]: its timeline as a picture;
//! - [`fit`]: `--fit`, the fastest configurations that fit a memory size; [`replay`]: its fused
//!   steps reused across batch sizes;
//! - [`ranks`]: with `--ranks N --zero S`, one rank's model states beside ZeRO's formula, and the
//!   bytes its collectives move.
//!
//! The graph-level planner (`qatc_passes::plan`) stays the `remat` pass's model for its search
//! over checkpoint policies; nothing a user sees comes from it.

pub mod fit;
pub mod json;
pub mod ranks;
pub mod replay;
pub mod svg;

pub use qatc_driver::Executed;

/// One line on a chunked cross-entropy, for the table and the picture.
pub fn chunking_line(c: &qatc_kernels::program::CeChunking) -> String {
    let whole = qatc_passes::plan::units::human(c.whole_bytes());
    let scratch = qatc_passes::plan::units::human(c.scratch_bytes());
    if c.tile_cols < c.vocab {
        return format!(
            "cross-entropy over {} x {} logits in {} chunk(s) of {} rows x tiles of {} columns (online softmax): one {scratch} tile, never the whole {whole}",
            c.rows,
            c.vocab,
            c.chunks(),
            c.chunk_rows,
            c.tile_cols
        );
    }
    if c.chunks() == 1 {
        return format!(
            "cross-entropy over {} x {} logits in one chunk of {} rows: the whole {whole} at once",
            c.rows, c.vocab, c.chunk_rows
        );
    }
    format!(
        "cross-entropy over {} x {} logits in {} chunks of {} rows: one {scratch} chunk, never the whole {whole}",
        c.rows,
        c.vocab,
        c.chunks(),
        c.chunk_rows
    )
}

/// What each cross-entropy over the vocabulary computes its logits in: rows, vocabulary, rows
/// per chunk and the chunk scratch (`Program::cross_entropy`), and the planner's choice of rows
/// per chunk (`chunk`: the floor, every size planned with its peak, why).
pub fn chunking(e: &Executed) -> Vec<serde_json::Value> {
    e.program
        .cross_entropy
        .iter()
        .map(|c| {
            let choice = e.chunk.as_ref().map(|k| {
                let tried: Vec<serde_json::Value> =
                    k.tried.iter().map(|&(rows, peak)| serde_json::json!({ "chunk_rows": rows, "peak_bytes": peak })).collect();
                let mut v = serde_json::json!({ "floor": k.floor, "tried": tried, "why": k.why });
                if !k.ruled_out.is_empty() {
                    // sizes not planned: the floor's plan bounds their peak above what it keeps
                    v["ruled_out"] = k
                        .ruled_out
                        .iter()
                        .map(|&(rows, least)| serde_json::json!({ "chunk_rows": rows, "peak_at_least": least }))
                        .collect();
                }
                v
            });
            serde_json::json!({
                "rows": c.rows, "vocab": c.vocab, "chunk_rows": c.chunk_rows, "tile_cols": c.tile_cols, "chunks": c.chunks(),
                "scratch_bytes": c.scratch_bytes(), "chosen": choice,
            })
        })
        .collect()
}
