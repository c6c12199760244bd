//! How a record becomes one example's tokens, and which of them the loss counts.
//!
//! A template joins a prompt and its completion: `--template alpaca` (the default),
//! `plain`, or the user's text holding `{prompt}` and then `{completion}`, once each (`\n`, `\t`
//! and `\\` in it are a newline, a tab and a backslash, so a one-line shell argument can hold
//! them). The text before `{completion}` is the prompt part, the rest the completion part; the
//! two are tokenized apart (GPT-2's BPE), so the boundary between what counts and what does not
//! is exact, and GPT-2's end-of-text token (50256) ends each completion:
//!
//! ```text
//! alpaca   "### Instruction:\n{prompt}\n\n### Response:\n{completion}"   (the default)
//! plain    "{prompt}{completion}"                                          (TRL's, without a chat template)
//! ```
//!
//! A conversation (`messages`) is a run of turns: each assistant message is a completion whose
//! prompt is the system and user messages since the one before, their contents joined by a blank
//! line, each turn through the template and ended by end-of-text (as DialoGPT ends its turns).
//! `{"text"}` is its text and end-of-text, every token counted. With `--train-on completion`
//! (the default) the loss counts the completions' tokens and their end-of-text; with `all`,
//! every token of the example.

use super::records::{Record, Role};

/// GPT-2's `<|endoftext|>`: ends every example, and pads.
pub const EOS: u16 = 50256;

/// Which tokens the loss counts (`--train-on`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TrainOn {
    /// The completions' tokens (and their end-of-text): the prompt is context only.
    #[default]
    Completion,
    /// Every token of the example, prompt included.
    All,
}

/// A template: `head {prompt} middle {completion} tail`.
#[derive(Clone, Debug, PartialEq)]
pub struct Template {
    head: String,
    middle: String,
    tail: String,
}

/// The named templates, by name.
const NAMED: [(&str, &str); 2] =
    [("alpaca", "### Instruction:\n{prompt}\n\n### Response:\n{completion}"), ("plain", "{prompt}{completion}")];

/// `--template` when not given.
pub const DEFAULT_TEMPLATE: &str = "alpaca";

impl Template {
    /// A named template or the user's text (see the module docs), or why it is neither.
    pub fn parse(spec: &str) -> Result<Template, String> {
        let text = match NAMED.iter().find(|(n, _)| *n == spec) {
            Some((_, t)) => t.to_string(),
            None => unescape(spec),
        };
        let bad = || {
            format!(
                "--template {spec:?}: a template is {} or a text holding {{prompt}} and then {{completion}}, once each",
                NAMED.map(|(n, _)| n).join(", ")
            )
        };
        let (head, rest) = text.split_once("{prompt}").ok_or_else(bad)?;
        let (middle, tail) = rest.split_once("{completion}").ok_or_else(bad)?;
        if [head, middle, tail].iter().any(|p| p.contains("{prompt}") || p.contains("{completion}")) {
            return Err(bad());
        }
        Ok(Template { head: head.into(), middle: middle.into(), tail: tail.into() })
    }

    /// The prompt part's text.
    pub fn prompt(&self, prompt: &str) -> String {
        format!("{}{prompt}{}", self.head, self.middle)
    }

    /// The completion part's text (end-of-text follows it as a token).
    pub fn completion(&self, completion: &str) -> String {
        format!("{completion}{}", self.tail)
    }
}

/// `\n`, `\t` and `\\` as the characters they name; any other backslash stays.
fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('\\') => out.push('\\'),
            Some(o) => {
                out.push('\\');
                out.push(o);
            }
            None => out.push('\\'),
        }
    }
    out
}

/// One example: its tokens, and for each whether the loss counts it as a target (the first
/// token is never a target).
#[derive(Clone, Debug, PartialEq)]
pub struct Example {
    pub tokens: Vec<u16>,
    pub counts: Vec<bool>,
}

impl Example {
    fn push(&mut self, text: &str, counts: bool) -> Result<(), String> {
        let ids = crate::tokenize::encode(text)?;
        self.counts.extend(std::iter::repeat_n(counts, ids.len()));
        self.tokens.extend(ids);
        Ok(())
    }

    fn end(&mut self) {
        self.tokens.push(EOS);
        self.counts.push(true);
    }

    /// The positions it fills in a sequence: its tokens but the last, each predicting the next
    /// (the end-of-text is a target, never an input that predicts anything).
    pub fn slots(&self) -> usize {
        self.tokens.len().saturating_sub(1)
    }

    /// How many targets the loss counts.
    pub fn counted(&self) -> usize {
        self.counts.iter().skip(1).filter(|&&c| c).count()
    }
}

/// The example of `record`, tokenized (errors are the tokenizer's).
pub fn example(record: &Record, template: &Template, train_on: TrainOn) -> Result<Example, String> {
    let mut e = Example { tokens: Vec::new(), counts: Vec::new() };
    let prompt_counts = train_on == TrainOn::All;
    match record {
        Record::Text(t) => {
            e.push(t, true)?;
            e.end();
        }
        Record::Pair { prompt, completion } => {
            e.push(&template.prompt(prompt), prompt_counts)?;
            e.push(&template.completion(completion), true)?;
            e.end();
        }
        Record::Messages(ms) => {
            let mut context: Vec<&str> = Vec::new();
            for m in ms {
                match m.role {
                    Role::System | Role::User => context.push(&m.content),
                    Role::Assistant => {
                        e.push(&template.prompt(&context.join("\n\n")), prompt_counts)?;
                        e.push(&template.completion(&m.content), true)?;
                        e.end();
                        context.clear();
                    }
                }
            }
        }
    }
    Ok(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates() {
        let t = Template::parse("alpaca").unwrap();
        assert_eq!(t.prompt("Add 2 and 2."), "### Instruction:\nAdd 2 and 2.\n\n### Response:\n");
        assert_eq!(t.completion("4"), "4");
        let t = Template::parse(r"Q: {prompt}\nA: {completion}\n").unwrap();
        assert_eq!((t.prompt("x"), t.completion("y")), ("Q: x\nA: ".to_string(), "y\n".to_string()));
        // the user's content is never read for placeholders
        assert_eq!(t.prompt("{completion}"), "Q: {completion}\nA: ");
        for bad in ["{completion}{prompt}", "{prompt}", "x", "{prompt}{completion}{prompt}", "{prompt}{completion}{completion}"] {
            let e = Template::parse(bad).unwrap_err();
            assert!(e.contains("alpaca, plain or a text holding {prompt} and then {completion}"), "{e}");
        }
        assert_eq!(unescape(r"a\\n\q\"), "a\\n\\q\\");
    }

    #[test]
    fn what_counts() {
        let t = Template::parse("plain").unwrap();
        let pair = Record::Pair { prompt: "Hello".into(), completion: " world".into() };
        let e = example(&pair, &t, TrainOn::Completion).unwrap();
        // "Hello" | " world" | <|endoftext|>
        assert_eq!(e.tokens, [15496, 995, EOS]);
        assert_eq!(e.counts, [false, true, true]);
        assert_eq!((e.slots(), e.counted()), (2, 2));
        let e = example(&pair, &t, TrainOn::All).unwrap();
        assert_eq!(e.counts, [true, true, true]);
        let text = example(&Record::Text("Hello world".into()), &t, TrainOn::Completion).unwrap();
        assert_eq!((text.tokens.len(), text.counted()), (3, 2));
    }

    #[test]
    fn conversations_are_turns() {
        use super::super::records::Message;
        let m = |role, c: &str| Message { role, content: c.into() };
        let conv = Record::Messages(vec![
            m(Role::System, "Be brief."),
            m(Role::User, "Hi"),
            m(Role::Assistant, "Hello"),
            m(Role::User, "Bye"),
            m(Role::Assistant, "Bye"),
        ]);
        let t = Template::parse("Q: {prompt}\nA: {completion}").unwrap();
        let e = example(&conv, &t, TrainOn::Completion).unwrap();
        let mut want = crate::tokenize::encode("Q: Be brief.\n\nHi\nA: ").unwrap();
        let first = want.len();
        want.extend(crate::tokenize::encode("Hello").unwrap());
        want.push(EOS);
        let second = want.len();
        want.extend(crate::tokenize::encode("Q: Bye\nA: ").unwrap());
        let third = want.len();
        want.extend(crate::tokenize::encode("Bye").unwrap());
        want.push(EOS);
        assert_eq!(e.tokens, want);
        let counted: Vec<usize> = (0..want.len()).filter(|&i| e.counts[i]).collect();
        let expect: Vec<usize> = (first..second).chain(third..want.len()).collect();
        assert_eq!(counted, expect);
    }
}
