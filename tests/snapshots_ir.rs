//! Snapshots of the IR after every stage of the pipeline for a 1-layer tiny GPT-2
//! (C 8, NH 2, V 11, B 1, T 4). A change here is a change to what qatc builds: review the diff
//! like code (`cargo insta review`).

use qatc::frontend::config::Gpt2Config;
use qatc::step::{self, StepOptions, Trainable};
use qatc_ir::print;

fn tiny() -> Gpt2Config {
    Gpt2Config { n_embd: 8, n_layer: 1, n_head: 2, n_positions: 8, vocab_size: 11, layer_norm_epsilon: 1e-5 }
}

#[test]
fn every_stage_of_the_one_layer_step() {
    let fwd = step::forward(&tiny(), 1, 4, false).unwrap();
    insta::assert_snapshot!("lower", print(&fwd));
    let mut o = StepOptions::new(1, 4);
    o.clip = Some(1.0);
    let mut stages = Vec::new();
    step::train(fwd, Trainable::All, &o, |name, g| stages.push((name, print(g)))).unwrap();
    let names: Vec<_> = stages.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, ["trainable", "microbatch", "autodiff", "clip", "adamw"]);
    for (name, text) in stages {
        if name == "autodiff" || name == "adamw" {
            insta::assert_snapshot!(name, text);
        }
    }
}

#[test]
fn printing_is_deterministic_across_builds() {
    let a = print(&step::forward(&tiny(), 1, 4, false).unwrap());
    let b = print(&step::forward(&tiny(), 1, 4, false).unwrap());
    assert_eq!(a, b);
    assert_eq!(print(&qatc_ir::parse(&a).unwrap()), a, "the printed step parses back to itself");
}
