//! A fused node's lowering replayed from a node like it (`kernels/src/lower/memo.rs`) is the
//! lowering itself: the program lowered with the memo equals, field for field (buffers, kernels,
//! steps, notes, outputs, dequantizations, splits), the one lowered with every node afresh; for
//! fp32 and bf16, AdamW and 8-bit AdamW, no checkpointing and `blocks`, LoRA on 4-bit weights and
//! a full fine-tune, on the CPU's and CUDA's lowering options; and across the planner's two
//! lowerings of one graph (the chunk-size floor, then every row in one chunk) sharing one memo.
//! Kernels launched again for tensors alike (AdamW's, `repeats.rs`) and for every chunk and tile
//! of the cross-entropy (at eight chunks) are held the same way. Each case must replay nodes, or it would prove nothing.

mod common;

use common::steps::{describe, train_step, SETTINGS};
use qatc_kernels::{lower_with_memo, LowerOptions, NodeMemo, Program, Target};

fn lowered(g: &qatc_ir::Graph, options: &LowerOptions, memo: &mut NodeMemo) -> Program {
    lower_with_memo(g, options, memo).expect("lowers")
}

/// The first field where two programs differ, for the failure message.
fn first_difference(a: &Program, b: &Program) -> String {
    let (la, lb) = (a.listing(), b.listing());
    if let Some((i, (x, y))) = la.lines().zip(lb.lines()).enumerate().find(|(_, (x, y))| x != y) {
        return format!("listing line {i}:\n  memo:  {x}\n  fresh: {y}");
    }
    if a.kernels != b.kernels {
        let i = a.kernels.iter().zip(&b.kernels).position(|(x, y)| x != y).unwrap_or(a.kernels.len().min(b.kernels.len()));
        return format!("kernel {i} of {} / {}", a.kernels.len(), b.kernels.len());
    }
    if a.materialized != b.materialized {
        return format!("materialized: {:?}\n vs {:?}", a.materialized, b.materialized);
    }
    if a.buffers != b.buffers {
        let i = a.buffers.iter().zip(&b.buffers).position(|(x, y)| x != y).unwrap_or(0);
        return format!("buffer {i}: {:?} vs {:?}", a.buffers.get(i), b.buffers.get(i));
    }
    format!("steps, splits or outputs (splits {:?} vs {:?})", a.splits, b.splits)
}

#[test]
fn a_replayed_lowering_is_the_lowering() {
    let mut cases = 0;
    for s in SETTINGS {
        let g = train_step(s, true);
        for target in [Target::cpu(), Target::of(qatc_kernels::TargetKind::Cuda)] {
            let what = format!("{}, {:?}", describe(s), target.kind);
            let options = target.lower_options();
            let mut memo = NodeMemo::default();
            let with = lowered(&g, &options, &mut memo);
            let fresh = lowered(&g, &options, &mut NodeMemo::disabled());
            assert!(with == fresh, "{what}: the memo changed the program: {}", first_difference(&with, &fresh));
            assert!(memo.hits > 0, "{what}: no node was replayed");
            assert!(memo.repeats > 0, "{what}: no AdamW tensor's kernel was launched again");
            // the planner's second lowering (every row in one chunk) on the first one's memo
            let rows = with.cross_entropy.first().map(|c| c.rows);
            let top = LowerOptions { ce_chunk_rows: rows, ..options.clone() };
            let hits = memo.hits;
            let again = lowered(&g, &top, &mut memo);
            let fresh = lowered(&g, &top, &mut NodeMemo::disabled());
            assert!(again == fresh, "{what}, one chunk: the memo changed the program: {}", first_difference(&again, &fresh));
            assert!(memo.hits > hits, "{what}, one chunk: no node was replayed");
            // eight chunks (and on the CPU's online cross-entropy, tiles of 16 columns): every
            // chunk's and tile's kernels after the first are launched again (`repeats.rs`)
            let many = LowerOptions { ce_chunk_rows: Some(8), ce_tile_cols: Some(16), ..options.clone() };
            let repeats = memo.repeats;
            let again = lowered(&g, &many, &mut memo);
            let fresh = lowered(&g, &many, &mut NodeMemo::disabled());
            assert!(again == fresh, "{what}, 8 chunks: a repeated kernel changed the program: {}", first_difference(&again, &fresh));
            assert_eq!(again.cross_entropy.first().map(|c| c.chunk_rows), Some(8), "{what}");
            assert!(memo.repeats > repeats, "{what}, 8 chunks: no kernel was launched again");
            cases += 1;
        }
    }
    assert_eq!(cases, 12);
}
