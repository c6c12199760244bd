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
