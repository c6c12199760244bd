//! The records of an instruction-data JSONL file, one JSON object a line, in one of three forms
//! (the ones Hugging Face's TRL reads):
//!
//! ```text
//! {"text": "..."}                                        plain text: every token counts
//! {"prompt": "...", "completion": "..."}                 the loss on the completion
//! {"messages": [{"role": "user", "content": "..."},      a conversation: the loss on the
//!               {"role": "assistant", "content": "..."}]} assistant's messages
//! ```
//!
//! Other keys beside a form's (`id`, `source`, ...) are ignored; a record of two forms, of none,
//! or with a field of the wrong type is a bad record, and so are an empty text or completion, an
//! assistant message with no content, a role other than system, user or assistant, and a
//! conversation that does not end with the assistant (what would follow it has nothing to learn
//! from). Blank lines are not records.

/// Who says a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    const ALL: [(&'static str, Role); 3] = [("system", Role::System), ("user", Role::User), ("assistant", Role::Assistant)];

    fn from_name(s: &str) -> Option<Role> {
        Role::ALL.iter().find(|(n, _)| *n == s).map(|&(_, r)| r)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Message {
    pub role: Role,
    pub content: String,
}

/// One example, as the file gives it.
#[derive(Clone, Debug, PartialEq)]
pub enum Record {
    Text(String),
    Pair { prompt: String, completion: String },
    Messages(Vec<Message>),
}

impl Record {
    /// The form's name, for the data summary.
    pub fn form(&self) -> &'static str {
        match self {
            Record::Text(_) => "text",
            Record::Pair { .. } => "prompt/completion",
            Record::Messages(_) => "messages",
        }
    }
}

/// The keys that name a form.
const FORMS: [&str; 4] = ["text", "prompt", "completion", "messages"];

/// A field's value as a string, or why not.
fn string(v: &serde_json::Value, what: &str) -> Result<String, String> {
    v.as_str().map(str::to_string).ok_or_else(|| format!("`{what}` must be a string, got {}", crate::input::excerpt(v)))
}

/// Parses one line (not blank) into a record, or says in a few words what is wrong with it.
pub fn parse(line: &str) -> Result<Record, String> {
    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    let Some(o) = v.as_object() else {
        return Err(format!("not a JSON object: {}", crate::input::excerpt(&v)));
    };
    let has: Vec<&str> = FORMS.iter().copied().filter(|k| o.contains_key(*k)).collect();
    match has[..] {
        ["text"] => {
            let text = string(&o["text"], "text")?;
            if text.is_empty() {
                return Err("empty `text`".into());
            }
            Ok(Record::Text(text))
        }
        ["prompt", "completion"] => {
            let (prompt, completion) = (string(&o["prompt"], "prompt")?, string(&o["completion"], "completion")?);
            if completion.is_empty() {
                return Err("empty `completion`: nothing to learn from".into());
            }
            Ok(Record::Pair { prompt, completion })
        }
        ["messages"] => messages(&o["messages"]).map(Record::Messages),
        [] => {
            let keys: Vec<&str> = o.keys().map(String::as_str).take(8).collect();
            Err(format!(
                "no `text`, `prompt` and `completion`, or `messages` (its keys: {})",
                if keys.is_empty() { "none".to_string() } else { keys.join(", ") }
            ))
        }
        ["prompt"] => Err("`prompt` without `completion`".into()),
        ["completion"] => Err("`completion` without `prompt`".into()),
        _ => Err(format!("fields of more than one form ({}): a record is text, prompt and completion, or messages", has.join(", "))),
    }
}

fn messages(v: &serde_json::Value) -> Result<Vec<Message>, String> {
    let Some(list) = v.as_array() else {
        return Err(format!("`messages` must be a list of {{\"role\", \"content\"}} objects, got {}", crate::input::excerpt(v)));
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let at = |why: String| format!("message {i}: {why}");
        let Some(o) = m.as_object() else {
            return Err(at(format!("not an object with `role` and `content`: {}", crate::input::excerpt(m))));
        };
        let role = o.get("role").ok_or_else(|| at("no `role`".into()))?;
        let name = role.as_str().ok_or_else(|| at(format!("`role` must be a string, got {}", crate::input::excerpt(role))))?;
        let role = Role::from_name(name).ok_or_else(|| at(format!("role `{name}` is not system, user or assistant")))?;
        let content = o.get("content").ok_or_else(|| at("no `content`".into()))?;
        let content = string(content, "content").map_err(at)?;
        if role == Role::Assistant && content.is_empty() {
            return Err(at("the assistant's content is empty: nothing to learn from".into()));
        }
        out.push(Message { role, content });
    }
    match out.last() {
        None => Err("`messages` is empty".into()),
        Some(m) if m.role != Role::Assistant => {
            Err(format!("the last message (message {}) is not the assistant's: it would have nothing to learn from", out.len() - 1))
        }
        Some(_) => Ok(out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_three_forms() {
        assert_eq!(parse(r#"{"text": "hi", "id": 3}"#).unwrap(), Record::Text("hi".into()));
        assert_eq!(parse(r#"{"prompt": "", "completion": "x"}"#).unwrap(), Record::Pair { prompt: String::new(), completion: "x".into() });
        let m = parse(r#"{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}"#)
            .unwrap();
        let Record::Messages(m) = m else { panic!() };
        assert_eq!(m.iter().map(|m| m.role).collect::<Vec<_>>(), [Role::System, Role::User, Role::Assistant]);
    }

    #[test]
    fn bad_records_say_why() {
        let cases = [
            ("{\"text\": ", "not JSON"),
            ("[1, 2]", "not a JSON object: [1,2]"),
            (r#"{"input": "x", "output": "y"}"#, "its keys: input, output"),
            (r#"{"prompt": "x"}"#, "`prompt` without `completion`"),
            (r#"{"prompt": "x", "completion": ""}"#, "empty `completion`"),
            (r#"{"prompt": "x", "completion": 4}"#, "`completion` must be a string, got 4"),
            (r#"{"text": "x", "prompt": "y", "completion": "z"}"#, "more than one form (text, prompt, completion)"),
            (r#"{"text": ""}"#, "empty `text`"),
            (r#"{"messages": []}"#, "`messages` is empty"),
            (r#"{"messages": [{"role": "user", "content": "u"}]}"#, "the last message (message 0) is not the assistant's"),
            (r#"{"messages": [{"role": "tool", "content": "u"}]}"#, "message 0: role `tool` is not system, user or assistant"),
            (r#"{"messages": [{"role": "assistant", "content": ""}]}"#, "message 0: the assistant's content is empty"),
            (r#"{"messages": [{"role": "assistant"}]}"#, "message 0: no `content`"),
            (r#"{"messages": "hi"}"#, "`messages` must be a list"),
        ];
        for (line, want) in cases {
            let e = parse(line).unwrap_err();
            assert!(e.contains(want), "{line}: {e}");
            assert!(!e.contains('\n'), "{e}");
        }
    }
}
