//! Output directories: a user's directory, a file, a path through a file, the current directory,
//! inputs inside the output, and outputs that are directories. qatc refuses each without touching
//! a file; a directory it wrote itself (or an empty one) it may replace.

use super::fixtures::Base;
use crate::{s, Case};

/// Issue 16 items 1-2 (the `runs` helper): outputs checked before any work, OUT absent until the
/// first save.
pub fn cases(base: &Base) -> Vec<Case> {
    let model = s(&base.model());
    let tokens = s(&base.tokens());
    let adapter = s(&base.adapter());
    let m = model.as_str();
    let t = tokens.as_str();
    let compile =
        |name: &str, out: &str, culprit: &[&str]| Case::refused(name, &["compile", m, "--batch", "2", "--seq", "8", "-o", out], culprit);
    let train = |name: &str, out: &str, culprit: &[&str]| {
        Case::refused(
            name,
            &["train", m, "--data", t, "--batch", "2", "--seq", "8", "--lora", "r=2", "--steps", "1", "--interpreter", "--out", out],
            culprit,
        )
    };
    let export =
        |name: &str, out: &str, culprit: &[&str]| Case::refused(name, &["export", m, "--adapter", &adapter, "--out", out], culprit);
    let mine = |c: Case| c.file("o/thesis.tex", b"\\chapter{Results}\n".to_vec()).file("o/data/raw.csv", b"1,2,3\n".to_vec());
    let mut v = vec![
        mine(compile("outdir/compile-users-dir", "o", &["o", "not a qatc output directory"])),
        mine(train("outdir/train-users-dir", "o", &["o", "not a qatc output directory"])),
        mine(export("outdir/export-users-dir", "o", &["o", "not a qatc output directory"])),
        compile("outdir/compile-file", "f", &["f"]).file("f", b"keep me".to_vec()),
        train("outdir/train-file", "f", &["f"]).file("f", b"keep me".to_vec()),
        export("outdir/export-file", "f", &["f"]).file("f", b"keep me".to_vec()),
        compile("outdir/compile-through-file", "f/o", &["f/o"]).file("f", b"keep me".to_vec()),
        train("outdir/train-through-file", "f/o", &["f is a file", "f/o"]).file("f", b"keep me".to_vec()),
        compile("outdir/compile-cwd", ".", &["."]).file("notes.txt", b"mine".to_vec()),
        train("outdir/train-cwd", ".", &["."]).file("notes.txt", b"mine".to_vec()),
        compile("outdir/compile-parent", "..", &[".."]),
    ];
    // inputs inside the output: a save would replace them
    let config = std::fs::read(base.model().with_file_name("config.json")).unwrap();
    let own_model = |c: Case| c.file("in/model.safetensors", std::fs::read(base.model()).unwrap()).file("in/config.json", config.clone());
    v.push(own_model(Case::refused(
        "outdir/train-out-holds-model",
        &["train", "in/model.safetensors", "--data", t, "--batch", "2", "--seq", "8", "--lora", "r=2", "--steps", "1", "--out", "in"],
        &["in"],
    )));
    v.push(own_model(Case::refused(
        "outdir/compile-out-holds-model",
        &["compile", "in/model.safetensors", "--batch", "2", "--seq", "8", "-o", "in"],
        &["in"],
    )));
    v.push(Case::refused(
        "outdir/train-log-inside-out",
        &[
            "train",
            m,
            "--data",
            t,
            "--batch",
            "2",
            "--seq",
            "8",
            "--lora",
            "r=2",
            "--steps",
            "1",
            "--out",
            "o",
            "--log-json",
            "o/log.jsonl",
        ],
        &["--log-json"],
    ));
    // outputs that are directories
    v.push(
        Case::refused("outdir/prt-bits-map-is-dir", &["prt", m, "--data", t, "--batch", "2", "--seq", "8", "--bits-map", "d"], &["d"])
            .dir("d"),
    );
    v.push(Case::refused("outdir/plan-svg-is-dir", &["plan", m, "--batch", "2", "--seq", "8", "--svg", "d"], &["d"]).dir("d"));
    v.push(
        Case::refused(
            "outdir/train-log-is-dir",
            &["train", m, "--data", t, "--batch", "2", "--seq", "8", "--lora", "r=2", "--steps", "1", "--out", "o", "--log-json", "d"],
            &["d"],
        )
        .dir("d"),
    );
    // controls: an empty directory, and qatc's own earlier output, are replaced
    v.push(
        Case::accepted("outdir/control-empty-dir", &["compile", m, "--batch", "2", "--seq", "8", "-o", "o"], &["o/manifest.json"]).dir("o"),
    );
    v.push(
        Case::accepted("outdir/control-own-output", &["compile", m, "--batch", "2", "--seq", "8", "-o", "o"], &["o/manifest.json"])
            .file("o/manifest.json", b"{}".to_vec()),
    );
    v
}
