//! The four public GPT-2 sizes lower, verify and build their QAT + LoRA training step from their
//! configs (lowering reads shapes only), with the parameter counts of the published models.

use qatc::frontend::config::Gpt2Config;
use qatc::step::{self, StepOptions};
use qatc_ir::{InputKind, Op};

#[test]
fn all_four_sizes_lower_with_the_published_parameter_counts() {
    for (name, params) in [("124M", 124_439_808usize), ("355M", 354_823_168), ("774M", 774_030_080), ("1.5B", 1_557_611_200)] {
        let cfg = Gpt2Config::preset(name).unwrap();
        assert_eq!(cfg.param_count(), params, "{name}");
        let g = step::forward(&cfg, 1, 64, false).unwrap();
        qatc_ir::verify(&g).unwrap();
        let n: usize = g.inputs().into_iter().filter(|&i| g.input_kind(i) == Some(InputKind::Frozen)).map(|i| g.ty(i).numel()).sum();
        assert_eq!(n, params, "{name}: the graph's weights are the model's");
        let mut o = StepOptions::new(1, 64);
        o.model.full_finetune = false;
        o.model.lora = Some(qatc_passes::lora::LoraOptions::new(16));
        let (t, _) = step::train(&cfg, &o, |_, _| {}).unwrap();
        let lora = t.inputs().into_iter().filter(|&i| t.input_kind(i) == Some(InputKind::Trainable)).count();
        assert_eq!(lora, cfg.n_layer * 4 * 2, "{name}: A and B per linear");
        assert!(t.node_ids().iter().any(|&n| matches!(t.node(n).op, Op::AdamParam { .. })));
    }
}
