//! `qatc plan --fit`'s pruned search (a policy that did not fit at one batch is not planned at
//! the next; a precision and optimizer none of whose policies fitted is dropped) gives the
//! exhaustive search's answer, in fewer plans: the demo model's shapes, 4-bit + LoRA, in a memory
//! nothing fits (the answer is the smallest plan) and in one where fp32 fits batches 1-2 without
//! recompute and 4-8 with `blocks` and bf16 fits nowhere (20 plans against 48).

use qatc::cli::options::{model_options, QuantArgs};
use qatc::frontend::config::Gpt2Config;
use qatc::memory::fit::{self, Pinned};
use qatc::step::StepOptions;
use qatc_driver::{Options, Target};
use qatc_passes::fusion::FuseOptions;
use qatc_passes::lora::LoraOptions;

const MIB: usize = 1 << 20;

#[test]
fn the_pruned_search_gives_the_exhaustive_answer() {
    let cfg = Gpt2Config { n_embd: 128, n_layer: 4, n_head: 4, n_positions: 256, vocab_size: 50257, layer_norm_epsilon: 1e-5 };
    let mut base = StepOptions::new(1, 128);
    let q = QuantArgs { bits: Some(4), group: Some(32), scheme: qatc_ir::QuantScheme::from_name("q4_0"), ..Default::default() };
    base.model = model_options(&q, Some(LoraOptions::new(16)), false, true).unwrap();
    base.fuse = Some(FuseOptions::default());
    let (target, options) = (Target::cpu(), Options::default());
    let (mut saved, mut policies) = (0, std::collections::BTreeSet::new());
    for memory in [30 * MIB, 48 * MIB] {
        let pruned = fit::search(&cfg, &base, Pinned::default(), memory, 8, &target, &options).unwrap();
        let every = fit::search_every(&cfg, &base, Pinned::default(), memory, 8, &target, &options).unwrap();
        let json = |f: &fit::Fit| serde_json::to_value(&f.fits).unwrap();
        assert_eq!(json(&pruned), json(&every), "{} MiB", memory / MIB);
        let smallest = |f: &fit::Fit| f.smallest.as_ref().map(|(c, _)| serde_json::to_value(c).unwrap());
        assert_eq!(smallest(&pruned), smallest(&every), "{} MiB", memory / MIB);
        let best = |f: &fit::Fit| f.best.as_ref().map(|(o, e)| (o.batch, o.checkpoint.describe(), e.plan.peak_bytes()));
        assert_eq!(best(&pruned), best(&every), "{} MiB", memory / MIB);
        assert!(pruned.tried <= every.tried);
        saved += every.tried - pruned.tried;
        policies.extend(every.fits.iter().map(|c| c.checkpoint.clone()));
    }
    // the sizes exercise the pruning: plans were saved, and more than one policy was chosen
    assert!(saved > 0 && policies.len() > 1, "saved {saved} plans; policies chosen {policies:?}");
}

/// The demo's shapes with 4-bit + LoRA, fused: `--fit`'s base options.
fn demo_base() -> (Gpt2Config, StepOptions) {
    let cfg = Gpt2Config { n_embd: 128, n_layer: 4, n_head: 4, n_positions: 256, vocab_size: 50257, layer_norm_epsilon: 1e-5 };
    let mut base = StepOptions::new(1, 128);
    let q = QuantArgs { bits: Some(4), group: Some(32), scheme: qatc_ir::QuantScheme::from_name("q4_0"), ..Default::default() };
    base.model = model_options(&q, Some(LoraOptions::new(16)), false, true).unwrap();
    base.fuse = Some(FuseOptions::default());
    (cfg, base)
}

/// A fused step printed from its configuration's earlier batches is the step fused the long way,
/// text for text (its name included), for every policy `--fit` tries and both precisions; and
/// reuse does happen, from the fourth batch on.
#[test]
fn a_reused_fused_step_is_the_fused_step() {
    use qatc::memory::replay::Replay;
    use qatc_passes::precision::Precision;
    use qatc_passes::remat::Checkpoint;
    let (cfg, base) = demo_base();
    for precision in [Precision::Fp32, Precision::Bf16] {
        for policy in [Checkpoint::None, Checkpoint::Blocks, Checkpoint::Sqrt, Checkpoint::Auto(60 * MIB)] {
            let mut replay = Replay::default();
            for batch in [1, 2, 4, 8, 16] {
                let o = StepOptions { batch, precision, checkpoint: policy, ..base.clone() };
                let direct = match qatc::step::train(&cfg, &o, |_, _| {}) {
                    Ok((g, _)) => g,
                    // auto at a batch its memory does not hold: so does the replay say
                    Err(_) if matches!(policy, Checkpoint::Auto(_)) => {
                        assert!(replay.fused_step(&cfg, &o).is_err());
                        break;
                    }
                    Err(e) => panic!("{e}"),
                };
                let reused = replay.fused_step(&cfg, &o).unwrap();
                assert_eq!(qatc_ir::print(&reused), qatc_ir::print(&direct), "{precision:?} {} at batch {batch}", policy.describe());
            }
            if !matches!(policy, Checkpoint::Auto(_)) {
                assert_eq!(replay.reused, 2, "{precision:?} {}: batches 8 and 16 reused", policy.describe());
            }
        }
    }
}

/// The search with fused steps reused across batch sizes gives the answer of the one without, in
/// a memory where `none` fits every batch up to 32 (so each precision and optimizer reuses its
/// fused step at batches 8, 16 and 32).
#[test]
fn reusing_fused_steps_gives_the_same_answer() {
    let (cfg, base) = demo_base();
    let (target, options) = (Target::cpu(), Options::default());
    let memory = 1024 * MIB;
    let search = |replay| {
        let s = fit::Shortcuts { prune: true, replay };
        fit::search_with(&cfg, &base, Pinned::default(), memory, 32, &target, &options, s, &|_| {}).unwrap()
    };
    let (plain, reused) = (search(false), search(true));
    assert_eq!(fit::table(&plain, "demo", memory, &target), fit::table(&reused, "demo", memory, &target));
    assert_eq!(serde_json::to_value(&plain.fits).unwrap(), serde_json::to_value(&reused.fits).unwrap());
    assert_eq!(plain.tried, reused.tried);
    assert_eq!(plain.reused, 0);
    assert_eq!(reused.reused, 4 * 3, "4 precision and optimizer pairs, batches 8, 16 and 32");
    assert!(reused.fits.iter().all(|c| c.checkpoint == "none"), "{:?}", reused.fits);
}
