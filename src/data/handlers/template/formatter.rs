//! Formatters: how a template's slots take a message's text (MindSpeed-LLM
//! `mindspeed_llm/tasks/preprocess/formatter.py`: StringFormatter, EmptyFormatter,
//! FunctionFormatter, FunctionFormatterForThink), and the Python `json.dumps` they rely on.

use serde_json::{Map, Value};

use super::super::RecordError;

/// One formatter slot.
#[derive(Debug, Clone, PartialEq)]
pub enum Slot {
    /// Text with `{{content}}` / `{{idx}}` (or `{{name}}` / `{{arguments}}`) placeholders,
    /// encoded without special tokens.
    Text(String),
    /// `{"token": "<x>"}`: a vocabulary token by name (the unk id when the vocabulary lacks it).
    Token(String),
    /// A JSON list, which MindSpeed turns into a set: the bos id when it names `bos_token` and the
    /// tokenizer has one, else the eos id when it names `eos_token` and the tokenizer has one,
    /// else nothing.
    Special {
        /// The set holds "bos_token".
        bos: bool,
        /// The set holds "eos_token".
        eos: bool,
    },
}

impl Slot {
    /// `["eos_token"]`.
    pub const EOS: Slot = Slot::Special {
        bos: false,
        eos: true,
    };
}

/// Whether `text` holds a `{{identifier}}` placeholder (formatter.py's
/// `\{\{[a-zA-Z_][a-zA-Z0-9_]*\}\}`).
fn has_placeholder(text: &str) -> bool {
    let mut rest = text;
    while let Some(at) = rest.find("{{") {
        rest = &rest[at + 2..];
        let ident = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        let starts_well = rest
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
        if starts_well && rest[ident..].starts_with("}}") {
            return true;
        }
    }
    false
}

fn texts(slots: &[Slot]) -> impl Iterator<Item = &str> {
    slots.iter().filter_map(|s| match s {
        Slot::Text(t) => Some(t.as_str()),
        _ => None,
    })
}

/// The formatter kinds' checks at construction: what is wrong with these slots, if anything.
pub(super) fn slots_problem(slots: &[Slot], kind: FormatterKind) -> Option<&'static str> {
    match kind {
        FormatterKind::String if !texts(slots).any(has_placeholder) => {
            Some("a placeholder is required in the string formatter")
        }
        FormatterKind::Empty if texts(slots).any(has_placeholder) => {
            Some("empty formatter should not contain any placeholder")
        }
        FormatterKind::Function
            if !texts(slots).any(|t| t.contains("{{name}}"))
                || !texts(slots).any(|t| t.contains("{{arguments}}")) =>
        {
            Some("name and arguments placeholders are required in the function formatter")
        }
        _ => None,
    }
}

/// Which formatter class reads a slot list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FormatterKind {
    /// StringFormatter (user, assistant, system, observation; the think function formatter).
    String,
    /// EmptyFormatter (separator, prefix).
    Empty,
    /// FunctionFormatter.
    Function,
}

/// `StringFormatter.apply`: Python's `str.replace(old, new, 1)`, content first, then idx.
pub(super) fn apply(slots: &[Slot], content: &str, idx: Option<&str>) -> Vec<Slot> {
    slots
        .iter()
        .map(|s| match s {
            Slot::Text(t) => {
                let mut t = t.replacen("{{content}}", content, 1);
                if let Some(i) = idx {
                    t = t.replacen("{{idx}}", i, 1);
                }
                Slot::Text(t)
            }
            other => other.clone(),
        })
        .collect()
}

/// How a template formats a function-call message.
#[derive(Debug, Clone)]
pub(super) enum FunctionFormat {
    /// `FunctionFormatter`: `{{name}}` / `{{arguments}}` of a `{"name", "arguments"}` JSON message.
    Plain(Vec<Slot>),
    /// `FunctionFormatterForThink` (templates named qwen3 or bailing_mini): the JSON call, or list
    /// of calls, as `<tool_call>` blocks in `{{content}}`, after a leading `<think>…</think>`.
    Think {
        /// Its slots.
        slots: Vec<Slot>,
        /// The entry's `tool_format`; only "ling" and "qwen3" have tool utils upstream.
        tool_format: String,
    },
}

impl FunctionFormat {
    /// The formatted slots of a function message of `template`.
    pub(super) fn apply(&self, template: &str, content: &str) -> Result<Vec<Slot>, RecordError> {
        match self {
            FunctionFormat::Plain(slots) => apply_function(slots, content),
            FunctionFormat::Think { slots, tool_format } => {
                apply_think_function(template, slots, tool_format, content)
            }
        }
    }
}

/// `FunctionFormatter.apply`: a content that is not `{"name", "arguments"}` JSON gives empty
/// name and arguments; a name that is not a string fails upstream (`str.replace` of a non-str).
fn apply_function(slots: &[Slot], content: &str) -> Result<Vec<Slot>, RecordError> {
    let parsed = serde_json::from_str::<Value>(content).ok().and_then(|f| {
        let name = f.get("name")?.clone();
        Some((name, py_json(f.get("arguments")?)))
    });
    let (name, arguments) = match parsed {
        None => (String::new(), String::new()),
        Some((Value::String(name), arguments)) => (name, arguments),
        Some((name, _)) => {
            return Err(RecordError::invalid(
                "function call",
                format!(
                "function name {} is not a string (MindSpeed-LLM's FunctionFormatter fails on it)",
                py_json(&name)
            ),
            ))
        }
    };
    Ok(slots
        .iter()
        .map(|s| match s {
            Slot::Text(t) => Slot::Text(
                t.replace("{{name}}", &name)
                    .replace("{{arguments}}", &arguments),
            ),
            other => other.clone(),
        })
        .collect())
}

/// `re.search(r"<think>(.*)</think>", content, re.DOTALL)`: from the first `<think>` to the
/// last `</think>` after it.
fn greedy_think(content: &str) -> Option<&str> {
    const OPEN: &str = "<think>";
    const CLOSE: &str = "</think>";
    let start = content.find(OPEN)?;
    let after = start + OPEN.len();
    let close = content[after..].rfind(CLOSE)?;
    Some(&content[start..after + close + CLOSE.len()])
}

/// `FunctionFormatterForThink.apply` with the Qwen tool utils (LingToolUtils inherits its
/// `function_formatter`).
fn apply_think_function(
    template: &str,
    slots: &[Slot],
    tool_format: &str,
    content: &str,
) -> Result<Vec<Slot>, RecordError> {
    let fail = |detail: String| RecordError::invalid("function call", detail);
    if tool_format != "ling" && tool_format != "qwen3" {
        return Err(fail(format!(
            "template {template} cannot format function calls: MindSpeed-LLM's FunctionFormatterForThink \
             has no tool utils for its tool_format {tool_format:?} (only \"ling\" and \"qwen3\") and \
             fails on every function-call message, so mindkit refuses them"
        )));
    }
    let thought = greedy_think(content);
    let content = match thought {
        Some(t) => content.replace(t, ""),
        None => content.to_string(),
    };
    let calls = match serde_json::from_str::<Value>(&content) {
        Ok(Value::Array(calls)) => calls,
        Ok(call) => vec![call],
        Err(_) => {
            return Err(fail(format!(
                "invalid JSON format in function message: {content:?}"
            )))
        }
    };
    let mut blocks = Vec::with_capacity(calls.len());
    for call in &calls {
        let (Some(name), Some(arguments)) = (call.get("name"), call.get("arguments")) else {
            return Err(fail(format!(
                "a function call must be an object with \"name\" and \"arguments\", found {}",
                py_json(call)
            )));
        };
        let mut object = Map::new();
        object.insert("name".into(), name.clone());
        object.insert("arguments".into(), arguments.clone());
        blocks.push(format!(
            "<tool_call>\n{}\n</tool_call>",
            py_json(&Value::Object(object))
        ));
    }
    let text = format!("{}{}", thought.unwrap_or(""), blocks.join("\n"));
    Ok(apply(slots, &text, None))
}

/// `json.dumps(value, ensure_ascii=False)` with Python's default separators and float repr.
pub fn py_json(v: &Value) -> String {
    match v {
        Value::Array(a) => format!("[{}]", a.iter().map(py_json).collect::<Vec<_>>().join(", ")),
        Value::Object(o) => format!(
            "{{{}}}",
            o.iter()
                .map(|(k, v)| format!("{}: {}", py_json(&Value::String(k.clone())), py_json(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Value::Number(n) if n.is_f64() => n.as_f64().map_or_else(|| n.to_string(), py_float),
        other => other.to_string(),
    }
}

/// Python's `repr(float)`: the shortest round-trip digits, positional for exponents in
/// [-4, 16), else `d.ddde±XX`.
fn py_float(x: f64) -> String {
    // `{:e}` gives the same shortest digits: `[-]d[.ddd]e[-]N`.
    let s = format!("{x:e}");
    let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let body = if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            let mut int = digits[..int_len.min(digits.len())].to_string();
            while int.len() < int_len {
                int.push('0');
            }
            let frac = digits
                .get(int_len..)
                .filter(|f| !f.is_empty())
                .unwrap_or("0");
            format!("{int}.{frac}")
        } else {
            format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
        }
    } else {
        let frac = if digits.len() > 1 {
            format!(".{}", &digits[1..])
        } else {
            String::new()
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{}{frac}e{esign}{:02}", &digits[..1], exp.abs())
    };
    format!("{sign}{body}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_json_dumps() {
        let v: Value =
            serde_json::from_str(r#"{"a": [1, "é", 1.5, 1e2], "b": {"c": null, "d": "x\ny"}}"#)
                .unwrap();
        assert_eq!(
            py_json(&v),
            r#"{"a": [1, "é", 1.5, 100.0], "b": {"c": null, "d": "x\ny"}}"#
        );
    }

    #[test]
    fn floats_print_as_python_repr() {
        for (x, want) in [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (0.1, "0.1"),
            (1e-4, "0.0001"),
            (1.5e-5, "1.5e-05"),
            (123456789012345.0, "123456789012345.0"),
            (1e16, "1e+16"),
            (2.5e300, "2.5e+300"),
            (-3.25, "-3.25"),
        ] {
            assert_eq!(py_float(x), want, "{x}");
        }
    }

    #[test]
    fn placeholders_as_formatter_py_finds_them() {
        assert!(has_placeholder("a {{content}} b"));
        assert!(has_placeholder("{{_x1}}"));
        assert!(!has_placeholder("{{1x}} {{}} { {content}}"));
        assert!(!has_placeholder("{{content"));
    }

    #[test]
    fn think_function_calls_become_tool_call_blocks() {
        let slots = vec![Slot::Text("{{content}}<|role_end|>".into())];
        let content = r#"<think>plan</think>[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]"#;
        let out = apply_think_function("bailing_mini", &slots, "ling", content).unwrap();
        assert_eq!(
            out,
            vec![Slot::Text(
                "<think>plan</think><tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>\n\
                 <tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call><|role_end|>"
                    .into()
            )]
        );
        let err = apply_think_function("qwen3", &slots, "qwen", content).unwrap_err();
        assert!(err
            .detail
            .contains("template qwen3 cannot format function calls"));
    }
}
