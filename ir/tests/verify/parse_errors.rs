//! Parser errors carry the line number.

use qatc_ir::{parse, print, IrError};

/// Asserts a parse error on `line` whose message contains `msg`.
#[track_caller]
fn parse_err(text: &str, line: usize, msg: &str) {
    match parse(text) {
        Err(IrError::Parse { line: l, msg: m }) => {
            assert_eq!(l, line, "wrong line for {m:?}");
            assert!(m.contains(msg), "message {m:?} does not contain {msg:?}");
        }
        Err(e) => panic!("expected a parse error on line {line}, got {e:?}"),
        Ok(g) => panic!("expected a parse error on line {line}, parsed:\n{}", print(&g)),
    }
}

const HEAD: &str = "graph \"p\" {\n  %0 = input[kind=data] : f32[2, 3] \"x\"\n";

#[test]
fn parser_errors_carry_the_line() {
    // A valid baseline, so the errors below come from the one bad line.
    let ok = format!("{HEAD}  %1 = neg(%0) : f32[2, 3]\n  output \"y\" = %1\n}}\n");
    parse(&ok).expect("baseline parses");

    parse_err(&format!("{HEAD}  %1 = frobnicate(%0) : f32[2, 3]\n}}\n"), 3, "unknown op `frobnicate`");
    parse_err(&format!("{HEAD}  %1 = neg(%0) : f64[2, 3]\n}}\n"), 3, "unknown dtype `f64`");
    parse_err(&format!("{HEAD}  %1 = input[kind=data] : q8[2] \"q\"\n}}\n"), 3, "unknown dtype `q8`");
    parse_err(&format!("{HEAD}  %1 = cast[to=f8](%0) : f32[2, 3]\n}}\n"), 3, "unknown dtype `f8`");
    parse_err(&format!("{HEAD}  %1 = neg(%2) : f32[2, 3]\n  %2 = neg(%0) : f32[2, 3]\n}}\n"), 3, "%2 is used before it is defined");
    parse_err(&format!("{HEAD}  output \"y\" = %7\n}}\n"), 3, "%7 is used before it is defined");
    parse_err(&format!("{HEAD}  %1 = neg(%0) : f32[3, 2]\n}}\n"), 3, "written type f32[3, 2] but the op computes f32[2, 3]");
    parse_err(&format!("{HEAD}  %1 = neg(%0) : f16[2, 3]\n}}\n"), 3, "written type f16[2, 3]");
    parse_err(&format!("{HEAD}  %1 = input[kind=frozen] : f32[4] \"x\"\n}}\n"), 3, "input \"x\" is declared twice");
    parse_err(&format!("{HEAD}  %1 = neg(%0) : f32[2, 3]\n"), 3, "missing closing `}`");
    parse_err(&format!("{HEAD}  %1 = neg(%0) : f32[2, 3]\n  output \"y\" = %1"), 4, "missing closing `}`");
    parse_err(&format!("{HEAD}}}\n  %1 = neg(%0) : f32[2, 3]\n"), 4, "after the closing");
    parse_err(&format!("{HEAD}  %0 = neg(%0) : f32[2, 3]\n}}\n"), 3, "%0 is defined twice");
    parse_err(&format!("{HEAD}  %1 = matmul[ta=false, tb=false](%0, %0) : f32[2, 3]\n}}\n"), 3, "inner dims differ");
    parse_err(&format!("{HEAD}  %1 = input[kind=weird] : f32[2] \"w\"\n}}\n"), 3, "unknown input kind `weird`");
    parse_err(&format!("{HEAD}  %1 = affine[mul=2.0](%0) : f32[2, 3]\n}}\n"), 3, "missing attribute `add`");
    parse_err(&format!("{HEAD}  %1 = affine[mul=two, add=0.0](%0) : f32[2, 3]\n}}\n"), 3, "`two` is not a number");
    parse_err(&format!("{HEAD}  %1 = softmax[scale=1.0, causal=yes](%0) : f32[2, 3]\n}}\n"), 3, "`yes` is not a bool");
    parse_err(&format!("{HEAD}  %1 = neg(%0) : f32[2, 3] \"bad \\q escape\"\n}}\n"), 3, "unknown escape");
    parse_err(&format!("{HEAD}  %1 = neg(%0) : f32[2, 3] \"open\n}}\n"), 3, "unterminated string");
    parse_err(&format!("{HEAD}  %1 = neg(%0) : f32[2, 3] trailing\n}}\n"), 3, "unexpected `trailing`");
    parse_err(&format!("{HEAD}  update \"x\" = %0\n}}\n"), 3, "not a trainable or state input");
    parse_err(&format!("{HEAD}  output \"y\" = %0\n  output \"y\" = %0\n}}\n"), 4, "declared twice");
    let w = "  %1 = input[kind=frozen] : f32[64, 8] \"w\"\n";
    parse_err(
        &format!("{HEAD}{w}  %2 = fake_quant[bits=4, group=0, scheme=int4](%1) : f32[64, 8]\n}}\n"),
        4,
        "unknown quant scheme `int4`",
    );
    parse_err(&format!("{HEAD}{w}  %2 = fake_quant[bits=300, group=0, scheme=sym](%1) : f32[64, 8]\n}}\n"), 4, "bits 300 out of range");
    parse_err(&format!("{HEAD}{w}  %2 = fake_quant[bits=4, group=7, scheme=sym](%1) : f32[64, 8]\n}}\n"), 4, "group 7 does not divide");
    parse(&format!("{HEAD}{w}  %2 = fake_quant[bits=4, group=32, scheme=q4_0](%1) : f32[64, 8]\n}}\n")).expect("valid fake_quant");
    parse_err("", 1, "empty input");
    parse_err("grph \"p\" {\n}\n", 1, "expected `graph`");
    // Blank and comment lines are skipped but still counted.
    parse_err(&format!("{HEAD}\n  // a comment\n\n  %1 = nope(%0) : f32[2, 3]\n}}\n"), 6, "unknown op `nope`");
}

#[test]
fn parse_errors_display_the_line() {
    let e = parse(&format!("{HEAD}  %1 = frobnicate(%0) : f32[2, 3]\n}}\n")).expect_err("bad op");
    assert_eq!(e.to_string(), "line 3: unknown op `frobnicate`");
}
