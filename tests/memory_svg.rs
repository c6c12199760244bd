//! `memory.svg` reads: every text inside the frame and apart from every other, whatever the model
//! path's length (a path longer than the picture is wide), and the planned-peak label above its
//! line, not across it. Boxes are measured as the picture measures them (0.62 em a character, a
//! generous width for Helvetica).

mod common;

use std::process::Command;

/// One `<text>`: its box (left, top, right, bottom) and what it says.
#[derive(Debug)]
struct TextBox {
    rect: [f64; 4],
    text: String,
}

fn attr(tag: &str, name: &str) -> Option<String> {
    let key = format!(" {name}=\"");
    let start = tag.find(&key)? + key.len();
    Some(tag[start..].split('"').next()?.to_string())
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", "\"").replace("&apos;", "'").replace("&amp;", "&")
}

/// Every text of the picture, boxed; and the root's size.
fn texts(svg: &str) -> (Vec<TextBox>, f64, f64) {
    let root = svg.split("<svg").nth(1).unwrap().split('>').next().unwrap();
    let num = |t: &str, n: &str| attr(t, n).and_then(|v| v.parse::<f64>().ok());
    let (w, h, font) = (num(root, "width").unwrap(), num(root, "height").unwrap(), num(root, "font-size").unwrap());
    let mut out = Vec::new();
    for chunk in svg.split("<text").skip(1) {
        let (tag, rest) = chunk.split_once('>').unwrap();
        let text = unescape(rest.split("</text>").next().unwrap());
        let (x, y) = (num(tag, "x").unwrap(), num(tag, "y").unwrap());
        let fs = num(tag, "font-size").unwrap_or(font);
        let width = 0.62 * fs * text.chars().count() as f64;
        let left = match attr(tag, "text-anchor").as_deref() {
            Some("end") => x - width,
            Some("middle") => x - width / 2.0,
            _ => x,
        };
        out.push(TextBox { rect: [left, y - fs, left + width, y + 0.25 * fs], text });
    }
    (out, w, h)
}

fn overlap(a: &[f64; 4], b: &[f64; 4]) -> bool {
    a[0] < b[2] && b[0] < a[2] && a[1] < b[3] && b[1] < a[3]
}

#[test]
fn every_text_stays_inside_the_frame_and_apart() {
    let dir = tempfile::tempdir().unwrap();
    // a model path longer than the picture is wide
    let deep = dir.path().join("a-directory-with-a-long-name-".repeat(8));
    std::fs::create_dir_all(&deep).unwrap();
    for f in ["model.safetensors", "config.json"] {
        std::fs::copy(common::fixture(&format!("tiny/f32_prefix/{f}")), deep.join(f)).unwrap();
    }
    let model = deep.join("model.safetensors");
    for (extra, svg) in [(vec!["--checkpoint", "blocks", "--memory", "1MiB"], "a.svg"), (vec!["--checkpoint", "none"], "b.svg")] {
        let out = dir.path().join(svg);
        let mut args =
            vec!["plan", model.to_str().unwrap(), "--batch", "4", "--seq", "32", "--bits", "4", "--group", "16", "--lora", "r=2"];
        args.extend(extra);
        args.extend(["--svg", out.to_str().unwrap()]);
        let r = Command::new(env!("CARGO_BIN_EXE_qatc")).args(&args).output().unwrap();
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        let svg = std::fs::read_to_string(&out).unwrap();
        let (boxes, w, h) = texts(&svg);
        assert!(boxes.len() > 15, "{} texts", boxes.len());
        for b in &boxes {
            let [l, t, r, btm] = b.rect;
            assert!(l >= 0.0 && t >= 0.0 && r <= w && btm <= h, "{:?} leaves the {w} x {h} frame", b);
        }
        for (i, a) in boxes.iter().enumerate() {
            for b in &boxes[i + 1..] {
                assert!(!overlap(&a.rect, &b.rect), "{a:?} overlaps {b:?}");
            }
        }
        let title = &boxes[0].text;
        assert!(title.starts_with(&dir.path().to_string_lossy()[..10]) && title.contains("..."), "the long title elided: {title}");
        // the planned-peak label sits above its line
        let line = svg.split("<line class=\"planned-peak\"").nth(1).unwrap().split('>').next().unwrap();
        let y = attr(line, "y1").unwrap().parse::<f64>().unwrap();
        let label = boxes.iter().find(|b| b.text.starts_with("planned peak")).unwrap();
        assert!(label.rect[3] <= y + 0.5, "the planned-peak label {:?} crosses its line at y {y}", label);
        assert!(boxes.iter().any(|b| b.text.starts_with("cross-entropy over")), "the chunking is said");
    }
}
