//! A small indenting text writer: generated code is written line by line into blocks, never
//! assembled by patching strings, so its layout follows the code's structure.

#[derive(Debug, Default)]
pub struct Writer {
    out: String,
    depth: usize,
}

impl Writer {
    pub fn new() -> Writer {
        Writer::default()
    }

    /// One line at the current indentation (an empty line stays empty).
    pub fn line(&mut self, s: impl AsRef<str>) {
        let s = s.as_ref();
        if !s.is_empty() {
            for _ in 0..self.depth {
                self.out.push_str("    ");
            }
            self.out.push_str(s);
        }
        self.out.push('\n');
    }

    pub fn blank(&mut self) {
        self.out.push('\n');
    }

    /// `head {` and one level deeper.
    pub fn open(&mut self, head: impl AsRef<str>) {
        let head = head.as_ref();
        self.line(if head.is_empty() { "{".to_string() } else { format!("{head} {{") });
        self.depth += 1;
    }

    /// One level shallower and `}`.
    pub fn close(&mut self) {
        self.close_with("");
    }

    /// One level shallower and `}` followed by `tail` (`;`, `else {`, ...).
    pub fn close_with(&mut self, tail: &str) {
        self.depth = self.depth.saturating_sub(1);
        self.line(format!("}}{tail}"));
    }

    pub fn indent(&mut self) {
        self.depth += 1;
    }

    pub fn dedent(&mut self) {
        self.depth = self.depth.saturating_sub(1);
    }

    pub fn finish(self) -> String {
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_indent_and_close() {
        let mut w = Writer::new();
        w.open("void f()");
        w.line("int x = 1;");
        w.open("if (x)");
        w.line("x = 2;");
        w.close();
        w.blank();
        w.close();
        assert_eq!(w.finish(), "void f() {\n    int x = 1;\n    if (x) {\n        x = 2;\n    }\n\n}\n");
    }
}
