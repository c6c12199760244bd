//! Token files and text: headers, counts, vocabularies, encodings, and paths that are no data.

use super::fixtures::Base;
use crate::{s, Case};

/// An llm.c header (magic, version, count) followed by `tokens`.
fn token_file(magic: i32, version: i32, count: i32, tokens: &[u16]) -> Vec<u8> {
    let mut h = vec![0u8; 1024];
    for (i, v) in [magic, version, count].into_iter().enumerate() {
        h[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
    }
    h.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    h
}

pub fn cases(base: &Base) -> Vec<Case> {
    let model = s(&base.model());
    let m = model.as_str();
    let eval = |name: &str, bytes: Vec<u8>, culprit: &[&str]| {
        Case::refused(name, &["eval", m, "--data", "t.bin", "--batch", "2", "--seq", "8"], culprit).file("t.bin", bytes)
    };
    let ok: Vec<u16> = (0..40).map(|i| i % 97).collect();
    let mut v = vec![
        eval("data/empty", vec![], &["t.bin", "empty"]),
        eval("data/wrong-magic", token_file(20240326, 1, 40, &ok), &["t.bin", "20240326", "20240520"]),
        eval("data/bad-version", token_file(20240520, 2, 40, &ok), &["t.bin", "version 2"]),
        eval("data/count-too-big", token_file(20240520, 1, 41, &ok), &["t.bin", "41 tokens"]),
        eval("data/count-negative", token_file(20240520, 1, -1, &ok), &["t.bin", "-1 tokens"]),
        eval("data/count-too-small", token_file(20240520, 1, 10, &ok), &["t.bin", "10 tokens"]),
        eval(
            "data/odd-bytes",
            {
                let mut b = token_file(20240520, 1, 40, &ok);
                b.push(7);
                b
            },
            &["t.bin"],
        ),
        eval(
            "data/short-header",
            {
                let mut b = token_file(20240520, 1, 0, &[]);
                b.truncate(600);
                b
            },
            &["t.bin", "1024-byte"],
        ),
        eval("data/too-few-tokens", token_file(20240520, 1, 10, &ok[..10]), &["t.bin", "10 tokens", "17"]),
        eval(
            "data/token-out-of-vocab",
            {
                let mut t = ok.clone();
                t[5] = 97;
                token_file(20240520, 1, 40, &t)
            },
            &["t.bin", "token 97", "position 5"],
        ),
        eval(
            "data/token-max",
            {
                let mut t = ok.clone();
                t[39] = u16::MAX;
                token_file(20240520, 1, 40, &t)
            },
            &["t.bin", "65535"],
        ),
        eval("data/binary-short", vec![0xff, 0xfe, 0x00, 0x01], &["t.bin", "neither", "invalid UTF-8 at byte 0"]),
        eval("data/binary-long", (0..3000u32).map(|i| (i * 131 % 251) as u8).collect(), &["t.bin", "neither", "magic"]),
        eval("data/text-with-nul", b"To be, or not\0 to be".to_vec(), &["t.bin", "a NUL byte at byte 13"]),
        eval("data/text-bad-utf8", b"To be, or not to be\xc3".to_vec(), &["t.bin", "invalid UTF-8 at byte 19"]),
        eval("data/utf16-text", "\u{feff}To be".encode_utf16().flat_map(|u| u.to_le_bytes()).collect(), &["t.bin", "neither"]),
        // text tokenizes with GPT-2's 50,257 ids: the tiny model's 97 cannot embed them
        eval(
            "data/text-beyond-vocab",
            b"To be, or not to be, that is the question.".to_vec(),
            &["t.bin", "not below the vocabulary size 97"],
        ),
        Case::refused("data/missing", &["eval", m, "--data", "nope.bin", "--batch", "2", "--seq", "8"], &["nope.bin", "No such file"]),
        Case::refused("data/directory", &["eval", m, "--data", "d", "--batch", "2", "--seq", "8"], &["d"]).dir("d"),
    ];
    let t = s(&base.tokens());
    v.push(Case::refused(
        "data/batches-beyond",
        &["eval", m, "--data", &t, "--batch", "2", "--seq", "8", "--batches", "1000"],
        &["--batches 1000"],
    ));
    v.push(Case::refused("data/batches-zero", &["eval", m, "--data", &t, "--batch", "2", "--seq", "8", "--batches", "0"], &["--batches"]));
    // the same faults where training reads data, and its validation file
    let train = |name: &str, flag: &str, bytes: Vec<u8>, culprit: &[&str]| {
        let mut args = vec!["train", m, "--data", &t, "--batch", "2", "--seq", "8", "--lora", "r=2", "--steps", "1", "--out", "o"];
        args.extend([flag, "x.bin"]);
        if flag == "--data" {
            args.drain(2..4);
        }
        Case::refused(name, &args, culprit).file("x.bin", bytes)
    };
    v.push(train("data/train-empty", "--data", vec![], &["x.bin", "empty"]));
    v.push(train("data/train-nul-text", "--data", b"a\0b".to_vec(), &["x.bin", "NUL"]));
    v.push(train("data/val-wrong-magic", "--val", token_file(7, 1, 40, &ok), &["x.bin", "magic 7"]));
    v.push(train("data/val-out-of-vocab", "--val", token_file(20240520, 1, 40, &[500; 40]), &["x.bin", "token 500"]));
    // prt reads data too
    let bits = "b.json";
    v.push(
        Case::refused(
            "data/prt-wrong-magic",
            &["prt", m, "--data", "x.bin", "--batch", "2", "--seq", "8", "--bits-map", bits],
            &["x.bin", "magic 9"],
        )
        .file("x.bin", token_file(9, 1, 40, &ok)),
    );
    // control: the valid token file is accepted and evaluated
    v.push(Case::accepted("data/control-eval", &["eval", m, "--data", &t, "--batch", "2", "--seq", "8", "--batches", "2"], &[]));
    v
}
