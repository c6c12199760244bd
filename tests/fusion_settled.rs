//! Saturation skips a rule application whose classes are all settled (`passes/src/fusion/
//! runner.rs`, `lang::settled`): the e-graph must grow exactly as it does when every match is
//! applied every iteration (`FuseOptions::recheck`, egg's plain scheduling). Checked on the
//! training steps of fp32 and bf16, AdamW and 8-bit AdamW, no checkpointing and `blocks`, LoRA
//! on 4-bit weights and a full fine-tune: the same e-nodes, e-classes, rules fired and fused
//! graph, and each case must have skipped something, or it would prove nothing.

mod common;

use common::steps::{describe, train_step, SETTINGS};
use qatc_passes::fusion::{fuse_graph, FuseOptions};

#[test]
fn skipping_settled_matches_grows_the_same_e_graph() {
    for setting in SETTINGS {
        let what = describe(setting);
        let g = train_step(setting, false);
        let skipping = fuse_graph(&g, &FuseOptions::default()).expect("fuses");
        let every = fuse_graph(&g, &FuseOptions { recheck: true, ..Default::default() }).expect("fuses");
        let (s, e) = (&skipping.report.saturation, &every.report.saturation);
        assert!(s.complete && e.complete, "{what}: saturated ({} / {})", s.stop_reason, e.stop_reason);
        assert_eq!(e.settled_skipped, 0, "{what}: recheck skips nothing");
        assert!(s.settled_skipped > 0, "{what}: nothing was skipped, so this case proves nothing");
        assert_eq!((s.enodes, s.eclasses, s.iterations), (e.enodes, e.eclasses, e.iterations), "{what}: the e-graph's size");
        assert_eq!(s.rules_fired, e.rules_fired, "{what}: rules fired");
        assert_eq!(qatc_ir::print(&skipping.graph), qatc_ir::print(&every.graph), "{what}: the fused step");
    }
}
