//! Options: out of range, the wrong kind of value, sizes that overflow, combinations that make
//! no sense, and budgets; each refused naming the flag.

use super::fixtures::Base;
use crate::{s, Case};

/// `base` with `extra` appended; a flag in `extra` replaces the same flag (and its value) in
/// `base`, so a case can say `--batch 0` over the default `--batch 2`.
fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    let name = |a: &str| a.split('=').next().unwrap_or(a).to_string();
    let given: Vec<String> = extra.iter().filter(|a| a.starts_with("--")).map(|a| name(a)).collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < base.len() {
        if base[i].starts_with("--") && given.contains(&name(base[i])) {
            i += 2;
            continue;
        }
        out.push(base[i]);
        i += 1;
    }
    out.extend_from_slice(extra);
    out
}

pub fn cases(base: &Base) -> Vec<Case> {
    let model = s(&base.model());
    let tokens = s(&base.tokens());
    let m = model.as_str();
    let t = tokens.as_str();
    let compile = |name: &str, extra: &[&str], culprit: &[&str]| {
        Case::refused(name, &with(&["compile", m, "--batch", "2", "--seq", "8", "-o", "o"], extra), culprit)
    };
    let plan = |name: &str, extra: &[&str], culprit: &[&str]| {
        Case::refused(name, &with(&["plan", m, "--batch", "2", "--seq", "8"], extra), culprit)
    };
    let train = |name: &str, extra: &[&str], culprit: &[&str]| {
        Case::refused(name, &with(&["train", m, "--data", t, "--batch", "2", "--seq", "8", "--steps", "1", "--out", "o"], extra), culprit)
    };
    let max = u64::MAX.to_string();
    let mut v = vec![
        compile("options/batch-zero", &["--batch", "0"], &["--batch"]),
        compile("options/seq-zero", &["--seq", "0"], &["--seq"]),
        compile("options/seq-beyond-context", &["--seq", "64"], &["64", "n_positions 32"]),
        compile("options/batch-overflow", &["--batch", &max], &["--batch 18446744073709551615", "2^40"]),
        plan("options/plan-batch-overflow", &["--batch", &max], &["--batch 18446744073709551615"]),
        Case::refused(
            "options/plan-size-batch-overflow",
            &["plan", "124M", "--batch", &max, "--seq", "1024"],
            &["--batch 18446744073709551615"],
        ),
        compile("options/batch-not-a-number", &["--batch", "four"], &["four", "--batch"]),
        compile("options/batch-negative", &["--batch=-4"], &["--batch"]),
        compile("options/grad-accum-zero", &["--grad-accum", "0"], &["--grad-accum"]),
        compile("options/grad-accum-overflow", &["--grad-accum", &max], &["18446744073709551615 micro-batches", "--grad-accum"]),
        // the step is one micro-batch's at any K: a huge K is refused only past what qatc counts
        plan("options/grad-accum-huge", &["--grad-accum", "4294967297"], &["4294967297 micro-batches", "at most 4294967296"]),
        plan("options/memory-huge", &["--memory", "1e30GiB"], &["--memory", "1e30GiB", "over the limit"]),
        plan("options/memory-word", &["--memory", "lots"], &["--memory", "lots"]),
        plan("options/memory-zero", &["--memory", "0GiB"], &["--memory", "at least 1 byte"]),
        plan("options/memory-negative", &["--memory=-1GiB"], &["--memory"]),
        plan("options/memory-nan", &["--memory", "NaNGiB"], &["--memory", "NaNGiB"]),
        plan("options/memory-bad-unit", &["--memory", "4GX"], &["--memory", "4GX"]),
        plan("options/memory-too-small", &["--memory", "1KiB"], &["--memory", "smallest plan needs"]),
        plan("options/checkpoint-unknown", &["--checkpoint", "everything"], &["--checkpoint", "everything"]),
        plan("options/checkpoint-auto-without-memory", &["--checkpoint", "auto"], &["--checkpoint auto needs --memory"]),
        plan("options/checkpoint-budget-huge", &["--checkpoint", "budget=1e40TB"], &["budget=1e40TB", "over the limit"]),
        plan("options/checkpoint-budget-tiny", &["--checkpoint", "budget=1B"], &["budget=1B", "cannot fit"]),
        Case::refused("options/plan-unknown-size", &["plan", "999M"], &["999M", "not a GPT-2 size"]),
        Case::refused("options/plan-size-seq-beyond", &["plan", "124M", "--seq", "4096"], &["--seq 4096", "1024"]),
        compile("options/clip-negative", &["--clip=-1"], &["--clip"]),
        compile("options/clip-nan", &["--clip", "NaN"], &["--clip"]),
        compile("options/clip-inf", &["--clip", "inf"], &["--clip"]),
        compile("options/weight-decay-negative", &["--weight-decay=-0.1"], &["--weight-decay"]),
        compile("options/weight-decay-nan", &["--weight-decay", "nan"], &["--weight-decay"]),
        compile("options/lora-r-zero", &["--lora", "r=0"], &["--lora", "at least 1"]),
        compile("options/lora-r-word", &["--lora", "r=two"], &["--lora r=two"]),
        compile("options/lora-r-missing", &["--lora", "alpha=4"], &["--lora needs r=N"]),
        compile("options/lora-r-too-big", &["--lora", "r=65"], &["rank 65"]),
        compile("options/lora-alpha-nan", &["--lora", "r=2,alpha=nan"], &["--lora", "alpha", "NaN"]),
        compile("options/lora-alpha-inf", &["--lora", "r=2,alpha=inf"], &["--lora", "alpha", "inf"]),
        compile("options/lora-alpha-negative", &["--lora", "r=2,alpha=-4"], &["--lora", "alpha", "-4"]),
        compile("options/lora-alpha-zero", &["--lora", "r=2,alpha=0"], &["--lora", "alpha"]),
        compile("options/lora-dropout-one", &["--lora", "r=2,dropout=1"], &["--lora", "dropout"]),
        compile("options/lora-dropout-nan", &["--lora", "r=2,dropout=nan"], &["--lora", "dropout"]),
        compile("options/lora-target-unknown", &["--lora", "r=2,targets=q_proj"], &["q_proj"]),
        compile("options/lora-key-unknown", &["--lora", "r=2,rank=4"], &["unknown key `rank`"]),
        compile("options/lora-not-key-value", &["--lora", "r=2,fast"], &["`fast`"]),
        compile("options/bits-9", &["--bits", "9"], &["--bits", "2..8"]),
        compile("options/bits-1", &["--bits", "1"], &["--bits", "2..8"]),
        compile("options/bits-300", &["--bits", "300"], &["--bits"]),
        compile("options/group-not-dividing", &["--bits", "4", "--group", "48"], &["48"]),
        compile("options/group-overflow", &["--bits", "4", "--group", &max], &["18446744073709551615"]),
        compile("options/scheme-unknown", &["--bits", "4", "--scheme", "fp4"], &["fp4"]),
        compile("options/scheme-without-bits", &["--scheme", "nf4"], &["--scheme", "--bits"]),
        compile("options/group-without-bits", &["--group", "32"], &["--group", "--bits"]),
        compile("options/quant-targets-without-bits", &["--quant-targets", "c_fc"], &["--quant-targets", "--bits"]),
        compile("options/scales-without-bits", &["--scales", "minmax"], &["--scales", "--bits"]),
        compile("options/q4_0-group-64", &["--bits", "4", "--scheme", "q4_0", "--group", "64"], &["q4_0", "group 32"]),
        compile("options/nf4-3-bits", &["--bits", "3", "--group", "32", "--scheme", "nf4"], &["nf4 needs 4 bits"]),
        compile("options/act-bits-without-bits", &["--act-bits", "8"], &["--act-bits needs --bits"]),
        compile("options/act-bits-200", &["--bits", "4", "--act-bits", "200"], &["--act-bits"]),
        compile("options/quant-target-unknown", &["--bits", "4", "--quant-targets", "q_proj"], &["q_proj"]),
        compile("options/qat-merged-without-lora", &["--bits", "4", "--qat", "merged"], &["--qat merged"]),
        compile("options/qat-unknown", &["--bits", "4", "--lora", "r=2", "--qat", "both"], &["--qat", "both"]),
        compile("options/merged-with-dropout", &["--bits", "4", "--lora", "r=2,dropout=0.1", "--qat", "merged"], &["dropout"]),
        compile("options/compile-timeout-zero", &["--compile-timeout", "0"], &["--compile-timeout"]),
        compile("options/compile-timeout-nan", &["--compile-timeout", "nan"], &["--compile-timeout"]),
        compile(
            "options/compile-timeout-spent",
            &["--lora", "r=2", "--grad-accum", "4", "--compile-timeout", "0.000001"],
            &["compile budget", "--compile-timeout"],
        ),
        compile("options/unknown-flag", &["--turbo"], &["--turbo"]),
        train("options/train-nothing-to-train", &[], &["nothing to train"]),
        train("options/train-lora-and-full", &["--lora", "r=2", "--full-finetune"], &["--full-finetune", "--lora"]),
        train("options/train-steps-zero", &["--lora", "r=2", "--steps", "0"], &["--steps"]),
        train("options/train-lr-zero", &["--lora", "r=2", "--lr", "0"], &["--lr"]),
        train("options/train-lr-nan", &["--lora", "r=2", "--lr", "nan"], &["--lr"]),
        train("options/train-lr-inf", &["--lora", "r=2", "--lr", "inf"], &["--lr"]),
        train("options/train-min-lr-above-lr", &["--lora", "r=2", "--min-lr", "1"], &["--min-lr"]),
        train("options/train-schedule-unknown", &["--lora", "r=2", "--schedule", "linear"], &["--schedule", "linear"]),
        train("options/train-eval-every-without-val", &["--lora", "r=2", "--eval-every", "1"], &["--eval-every needs --val"]),
        train("options/train-device-cuda", &["--lora", "r=2", "--device", "cuda"], &["--device cuda"]),
        train("options/train-device-unknown", &["--lora", "r=2", "--device", "tpu"], &["tpu"]),
        train("options/train-resume-missing", &["--lora", "r=2", "--resume", "nowhere"], &["nowhere"]),
        Case::refused("options/prt-batches-zero", &["prt", m, "--data", t, "--batch", "2", "--seq", "8", "--batches", "0"], &["--batches"]),
        Case::refused(
            "options/prt-threshold-negative",
            &["prt", m, "--data", t, "--batch", "2", "--seq", "8", "--threshold=-0.5"],
            &["--threshold"],
        ),
        Case::refused(
            "options/prt-threshold-nan",
            &["prt", m, "--data", t, "--batch", "2", "--seq", "8", "--threshold", "nan"],
            &["--threshold"],
        ),
        Case::refused(
            "options/prt-target-unknown",
            &["prt", m, "--data", t, "--batch", "2", "--seq", "8", "--targets", "q_proj"],
            &["q_proj"],
        ),
        Case::refused(
            "options/eval-batch-overflow",
            &["eval", m, "--data", t, "--batch", &max, "--seq", "8"],
            &["--batch 18446744073709551615"],
        ),
        Case::refused(
            "options/export-format-unknown",
            &["export", m, "--adapter", &s(&base.adapter()), "--out", "o", "--format", "onnx"],
            &["onnx"],
        ),
        Case::refused("options/dump-stage-unknown", &["dump", m, "--after", "everything"], &["everything", "--after"]),
        Case::refused("options/command-unknown", &["optimize", m], &["optimize"]),
        Case::refused("options/no-command", &[], &["qatc needs a command"]),
        Case::refused("options/model-missing-argument", &["compile"], &["<MODEL>"]),
    ];
    // controls: the same commands with sane options succeed
    v.push(Case::accepted(
        "options/control-plan",
        &["plan", m, "--batch", "2", "--seq", "8", "--bits", "4", "--group", "32", "--lora", "r=2", "--grad-accum", "3"],
        &[],
    ));
    v.push(Case::accepted(
        "options/control-compile",
        &["compile", m, "--batch", "2", "--seq", "8", "--lora", "r=2", "-o", "o"],
        &["o/manifest.json"],
    ));
    v
}
