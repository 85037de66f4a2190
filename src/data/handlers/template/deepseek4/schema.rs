//! The handler's messages as V4 messages (MindSpeed-LLM
//! `mindspeed_llm/tasks/preprocess/templates.py`, class `DeepSeek4Template`:
//! `_normalize_to_v4_schema`, `_merge_tool_messages`, `_sort_tool_results_by_call_order`), for
//! the fields its handlers deliver: role and content, and from the OpenAI converter
//! `tool_calls`, `tool_call_id`, `reasoning_content` and a tools text.
//!
//! Where upstream raises (a tools text that is not JSON or not OpenAI-format tools, a malformed
//! tool call, arguments that parse to something other than an object) the record is refused,
//! naming the field. mindkit also refuses, rather than render Python's `str()` of them, a
//! tool-call name that is not a string and an id or `tool_call_id` that is not one (upstream
//! compares such ids as Python values).

use std::collections::HashMap;

use serde_json::Value;

use super::super::{Message, Role};
use super::dsml::{self, json_type, parse_py_json, ArgumentsError, ParseError};
use super::{THINKING_END, THINKING_START};
use crate::data::handlers::{py_isspace, py_strip, RecordError};

/// One part of a V4 user message.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Block {
    /// A user message's text.
    Text(String),
    /// A tool message's content, and the call it answers (`tool_call_id`, "" when none).
    ToolResult { id: String, content: String },
}

/// One tool call of an answer.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct ToolCall {
    /// What orders the results: the call's `id`, else its function's, when truthy.
    pub id: Option<String>,
    /// The call as a DSML `invoke` block.
    pub invoke: String,
}

/// A message of the V4 schema, after `_merge_tool_messages`.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum V4Message {
    /// A system message; the first one carries the tools (their `function` objects).
    System { content: String, tools: Vec<Value> },
    /// User text and tool results.
    User(Vec<Block>),
    /// An answer.
    Assistant {
        reasoning: Option<String>,
        content: String,
        calls: Vec<ToolCall>,
    },
}

/// The normalizer's `^\s*<think>\s*(.*?)\s*</think>\s*` on an answer: (reasoning, the rest), or
/// `None` when the answer does not open with a thought.
pub(super) fn split_thought(content: &str) -> Option<(&str, &str)> {
    let opened = content
        .trim_start_matches(py_isspace)
        .strip_prefix(THINKING_START)?
        .trim_start_matches(py_isspace);
    // The lazy group ends before the whitespace that precedes the first `</think>`.
    let end = opened.find(THINKING_END)?;
    let reasoning = opened[..end].trim_end_matches(py_isspace);
    let rest = opened[end + THINKING_END.len()..].trim_start_matches(py_isspace);
    Some((reasoning, rest))
}

fn refuse(detail: String) -> RecordError {
    RecordError::invalid("invalid tool data", detail)
}

/// Python's truth value of a JSON value.
fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// The tools text, as `_normalize_to_v4_schema` parses it: the `function` objects of a non-empty
/// JSON list of OpenAI-format tools; nothing for a blank text or other JSON.
pub(super) fn parse_tools(tools: &str) -> Result<Vec<Value>, RecordError> {
    if py_strip(tools).is_empty() {
        return Ok(Vec::new());
    }
    let parsed = match parse_py_json(tools) {
        Ok(v) => v,
        Err(ParseError::Invalid(e)) => {
            return Err(refuse(format!(
                "the tools column is not JSON ({e}), which DeepSeek4Template raises on"
            )))
        }
        Err(ParseError::PythonOnly) => return Err(refuse(python_only("the tools column"))),
    };
    let Value::Array(entries) = parsed else {
        return Ok(Vec::new());
    };
    entries
        .into_iter()
        .enumerate()
        .map(|(i, entry)| match entry {
            Value::Object(mut t) if t.contains_key("function") => {
                Ok(t.remove("function").unwrap_or(Value::Null))
            }
            other => Err(refuse(format!(
                "tools[{i}] is {}, not an OpenAI-format tool ({{\"type\": \"function\", \
                 \"function\": {{...}}}}), which DeepSeek4Template raises on",
                crate::data::handlers::template::py_json(&other)
            ))),
        })
        .collect()
}

fn python_only(what: &str) -> String {
    format!(
        "{what} is not JSON to mindkit but holds NaN or Infinity, which Python's json reads; \
         mindkit refuses it rather than guess"
    )
}

/// `_normalize_to_v4_schema` then `_merge_tool_messages`: the system prompt and the tools as a
/// leading system message (merged into the first message when it is a system message), thoughts
/// split from answers, user and tool messages folded into block lists.
pub(super) fn to_v4(
    messages: &[Message],
    system: &str,
    tools: Vec<Value>,
) -> Result<Vec<V4Message>, RecordError> {
    let mut v4 = Vec::with_capacity(messages.len() + 1);
    let first_is_system = messages.first().is_some_and(|m| m.role == Role::System);
    let lead = !system.is_empty() || !tools.is_empty();
    let mut tools = Some(tools);
    if lead && !first_is_system {
        let tools = tools.take().unwrap_or_default();
        v4.push(V4Message::System {
            content: system.to_string(),
            tools,
        });
    }
    for (i, m) in messages.iter().enumerate() {
        let block = match m.role {
            Role::System => {
                let mut content = m.content.clone();
                let mut own_tools = Vec::new();
                if i == 0 && lead {
                    let sep = if content.is_empty() { "" } else { "\n\n" };
                    content = format!("{system}{sep}{content}");
                    own_tools = tools.take().unwrap_or_default();
                }
                v4.push(V4Message::System {
                    content,
                    tools: own_tools,
                });
                continue;
            }
            Role::Assistant => {
                v4.push(assistant(m)?);
                continue;
            }
            Role::User => Block::Text(m.content.clone()),
            // LLaMA-Factory's function and observation roles are V4 tool messages.
            Role::Function | Role::Observation => tool_result(m)?,
        };
        match v4.last_mut() {
            Some(V4Message::User(blocks)) => blocks.push(block),
            _ => v4.push(V4Message::User(vec![block])),
        }
    }
    Ok(v4)
}

/// Where a message is, for errors.
fn path(m: &Message) -> &str {
    m.extra.as_deref().map_or("a message", |e| e.path.as_str())
}

/// An answer: explicit `reasoning_content` (its falsy values read as "") wins over a leading
/// thought, which then stays in the content; `tool_calls` (when truthy) as invoke blocks.
fn assistant(m: &Message) -> Result<V4Message, RecordError> {
    let extra = m.extra.as_deref();
    let (reasoning, content) = match extra.and_then(|e| e.reasoning_content.as_ref()) {
        Some(Value::String(r)) => (Some(r.clone()), m.content.clone()),
        Some(v) if !truthy(v) => (Some(String::new()), m.content.clone()),
        Some(v) => {
            return Err(refuse(format!(
                "{}.reasoning_content is a {}, not a string, which DeepSeek4Template cannot join",
                path(m),
                json_type(v)
            )))
        }
        None => match split_thought(&m.content) {
            Some((r, c)) => (Some(r.to_string()), c.to_string()),
            None => (None, m.content.clone()),
        },
    };
    let calls = match extra.and_then(|e| e.tool_calls.as_ref()) {
        Some(v) if truthy(v) => tool_calls(m, v)?,
        _ => Vec::new(),
    };
    Ok(V4Message::Assistant {
        reasoning,
        content,
        calls,
    })
}

/// An answer's `tool_calls`: a list of `{"id": …, "function": {"name": …, "arguments": …}}`.
fn tool_calls(m: &Message, calls: &Value) -> Result<Vec<ToolCall>, RecordError> {
    let at = format!("{}.tool_calls", path(m));
    let Value::Array(calls) = calls else {
        return Err(refuse(format!(
            "{at} is a {}, not a list of calls, which DeepSeek4Template raises on",
            json_type(calls)
        )));
    };
    calls
        .iter()
        .enumerate()
        .map(|(j, call)| tool_call(&format!("{at}[{j}]"), call))
        .collect()
}

fn tool_call(at: &str, call: &Value) -> Result<ToolCall, RecordError> {
    let malformed = |what: &str| {
        refuse(format!(
            "{at} {what}, which DeepSeek4Template raises on (a call is \
             {{\"id\": …, \"function\": {{\"name\": …, \"arguments\": …}}}})"
        ))
    };
    let Value::Object(call) = call else {
        return Err(malformed(&format!("is a {}", json_type(call))));
    };
    let Some(Value::Object(function)) = call.get("function") else {
        return Err(malformed("has no \"function\" object"));
    };
    let (Some(name), Some(arguments)) = (function.get("name"), function.get("arguments")) else {
        return Err(malformed("has no function name or arguments"));
    };
    let Value::String(name) = name else {
        return Err(refuse(format!(
            "{at}.function.name is a {}: mindkit writes string names only",
            json_type(name)
        )));
    };
    let id = match call.get("id").filter(|v| truthy(v)) {
        Some(id) => Some(id_string(&format!("{at}.id"), id)?),
        None => match function.get("id").filter(|v| truthy(v)) {
            Some(id) => Some(id_string(&format!("{at}.function.id"), id)?),
            None => None,
        },
    };
    let invoke = dsml::invoke(name, arguments).map_err(|e| match e {
        ArgumentsError::NotAnObject(t) => refuse(format!(
            "{at}.function.arguments parse to a {t}, not an object, which \
             DeepSeek4Template raises on"
        )),
        ArgumentsError::PythonOnly => refuse(python_only(&format!("{at}.function.arguments"))),
    })?;
    Ok(ToolCall { id, invoke })
}

/// A call id or `tool_call_id`: strings only (see the module doc).
fn id_string(at: &str, id: &Value) -> Result<String, RecordError> {
    match id {
        Value::String(s) => Ok(s.clone()),
        other => Err(refuse(format!(
            "{at} is a {}: mindkit matches tool results to calls by string ids only",
            json_type(other)
        ))),
    }
}

/// A function or observation message as a tool result: its `tool_call_id` ("" when none) and
/// its content (a list of parts: the text parts, `[Unsupported <type>]` for the others, joined
/// by blank lines).
fn tool_result(m: &Message) -> Result<Block, RecordError> {
    let extra = m.extra.as_deref();
    let id = match extra.and_then(|e| e.tool_call_id.as_ref()) {
        Some(id) => id_string(&format!("{}.tool_call_id", path(m)), id)?,
        None => String::new(),
    };
    let content = match extra.and_then(|e| e.content_parts.as_ref()) {
        Some(parts) => tool_parts(extra.map_or("", |e| e.path.as_str()), parts)?,
        None => m.content.clone(),
    };
    Ok(Block::ToolResult { id, content })
}

fn tool_parts(at: &str, parts: &[Value]) -> Result<String, RecordError> {
    let texts = parts.iter().enumerate().map(|(k, part)| {
        let bad = |what: &str| {
            refuse(format!(
                "{at}.content[{k}] {what}, which DeepSeek4Template cannot render"
            ))
        };
        let Value::Object(part) = part else {
            return Err(bad(&format!("is a {}, not a part object", json_type(part))));
        };
        let kind = part.get("type");
        match (kind, part.get("text")) {
            (Some(Value::String(t)), text) if t == "text" => match text {
                None => Ok(String::new()),
                Some(Value::String(s)) => Ok(s.clone()),
                Some(other) => Err(bad(&format!("has a {} text", json_type(other)))),
            },
            (None | Some(Value::Null), _) => Ok("[Unsupported None]".to_string()),
            (Some(Value::String(t)), _) => Ok(format!("[Unsupported {t}]")),
            (Some(other), _) => Err(bad(&format!("has a {} type", json_type(other)))),
        }
    });
    Ok(texts.collect::<Result<Vec<_>, _>>()?.join("\n\n"))
}

/// `_sort_tool_results_by_call_order`: in each user message, the tool results (more than one)
/// reordered, in place among the texts, by the position of their id in the tool calls of the
/// latest answer that made any; an unknown id counts as the first call (the sort is stable).
pub(super) fn sort_tool_results(v4: &mut [V4Message]) {
    let mut order: HashMap<String, usize> = HashMap::new();
    for m in v4.iter_mut() {
        match m {
            V4Message::Assistant { calls, .. } if !calls.is_empty() => {
                order.clear();
                for (k, call) in calls.iter().enumerate() {
                    if let Some(id) = &call.id {
                        order.insert(id.clone(), k);
                    }
                }
            }
            V4Message::User(blocks) if !order.is_empty() => {
                let rank = |b: &Block| match b {
                    Block::ToolResult { id, .. } => order.get(id).copied().unwrap_or(0),
                    Block::Text(_) => 0,
                };
                let slots: Vec<usize> = (0..blocks.len())
                    .filter(|&k| matches!(blocks[k], Block::ToolResult { .. }))
                    .collect();
                if slots.len() < 2 {
                    continue;
                }
                let mut results: Vec<Block> = slots.iter().map(|&k| blocks[k].clone()).collect();
                results.sort_by_key(|b| rank(b));
                for (k, block) in slots.into_iter().zip(results) {
                    blocks[k] = block;
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::MessageExtra;
    use super::*;
    use serde_json::json;

    fn with_extra(role: Role, content: &str, extra: MessageExtra) -> Message {
        Message {
            extra: Some(Box::new(extra)),
            ..Message::new(role, content)
        }
    }

    fn msg(role: Role, content: &str) -> Message {
        Message::new(role, content)
    }

    fn call(id: &str, name: &str, arguments: &str) -> Value {
        json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
    }

    fn answer_with_calls(calls: Value) -> Message {
        with_extra(
            Role::Assistant,
            "",
            MessageExtra {
                path: "messages[1]".into(),
                tool_calls: Some(calls),
                ..Default::default()
            },
        )
    }

    fn result(id: Option<&str>, content: &str) -> Message {
        with_extra(
            Role::Observation,
            content,
            MessageExtra {
                path: "messages[2]".into(),
                tool_call_id: id.map(|i| json!(i)),
                ..Default::default()
            },
        )
    }

    fn result_ids(m: &V4Message) -> Vec<String> {
        let V4Message::User(blocks) = m else {
            panic!("{m:?}")
        };
        blocks
            .iter()
            .map(|b| match b {
                Block::Text(t) => format!("text {t}"),
                Block::ToolResult { id, .. } => id.clone(),
            })
            .collect()
    }

    #[test]
    fn a_leading_thought_is_split_from_the_answer_with_its_whitespace() {
        assert_eq!(
            split_thought(" \n<think>\n  why \n</think>\n\nanswer"),
            Some(("why", "answer"))
        );
        assert_eq!(split_thought("<think></think>x"), Some(("", "x")));
        // The first end marker closes the thought.
        assert_eq!(
            split_thought("<think>a</think>b</think>c"),
            Some(("a", "b</think>c"))
        );
        assert_eq!(split_thought("x<think>a</think>"), None);
        assert_eq!(split_thought("<think>never closed"), None);
    }

    #[test]
    fn tools_are_the_functions_of_a_non_empty_list() {
        let tools = parse_tools(r#"[{"type": "function", "function": {"name": "f"}}]"#).unwrap();
        assert_eq!(tools, [json!({"name": "f"})]);
        for ignored in ["", "  ", "[]", "{\"type\": \"function\"}", "3"] {
            assert!(parse_tools(ignored).unwrap().is_empty(), "{ignored}");
        }
        let e = parse_tools("[{\"function\": ").unwrap_err();
        assert!(e.detail.contains("not JSON"), "{}", e.detail);
        let e = parse_tools(r#"[{"name": "f"}]"#).unwrap_err();
        assert!(e
            .detail
            .starts_with("tools[0] is {\"name\": \"f\"}, not an OpenAI-format tool"));
    }

    #[test]
    fn the_system_prompt_and_tools_lead_or_merge_into_a_first_system_message() {
        let tools = vec![json!({"name": "f"})];
        let v4 = to_v4(
            &[msg(Role::User, "Q"), msg(Role::Assistant, "A")],
            "",
            tools.clone(),
        );
        assert_eq!(
            v4.unwrap()[0],
            V4Message::System {
                content: String::new(),
                tools: tools.clone()
            }
        );
        let messages = [
            msg(Role::System, "Second"),
            msg(Role::User, "Q"),
            msg(Role::System, "Mid"),
        ];
        let v4 = to_v4(&messages, "First", tools.clone()).unwrap();
        assert_eq!(v4.len(), 3);
        assert_eq!(
            v4[0],
            V4Message::System {
                content: "First\n\nSecond".into(),
                tools
            }
        );
        assert_eq!(
            v4[2],
            V4Message::System {
                content: "Mid".into(),
                tools: vec![]
            }
        );
    }

    #[test]
    fn explicit_reasoning_wins_over_a_leading_thought() {
        let m = with_extra(
            Role::Assistant,
            "<think>inline</think>Hello",
            MessageExtra {
                reasoning_content: Some(json!("explicit")),
                ..Default::default()
            },
        );
        let V4Message::Assistant {
            reasoning, content, ..
        } = assistant(&m).unwrap()
        else {
            panic!()
        };
        assert_eq!(reasoning.as_deref(), Some("explicit"));
        assert_eq!(content, "<think>inline</think>Hello");
    }

    #[test]
    fn tool_results_follow_the_order_of_the_calls_in_place_among_texts() {
        let calls = json!([
            call("x", "f", "{}"),
            call("y", "f", "{}"),
            call("z", "f", "{}")
        ]);
        let messages = [
            msg(Role::User, "Q"),
            answer_with_calls(calls),
            result(Some("z"), "3"),
            msg(Role::User, "between"),
            result(Some("nope"), "?"),
            result(None, "none"),
            result(Some("x"), "1"),
        ];
        let mut v4 = to_v4(&messages, "", vec![]).unwrap();
        sort_tool_results(&mut v4);
        // Unknown and missing ids rank as the first call; the sort is stable.
        assert_eq!(result_ids(&v4[2]), ["nope", "text between", "", "x", "z"]);
    }

    #[test]
    fn malformed_tool_calls_are_refused_by_field() {
        let detail = |calls: Value| {
            to_v4(&[answer_with_calls(calls)], "", vec![])
                .unwrap_err()
                .detail
        };
        assert!(detail(json!("f()")).starts_with("messages[1].tool_calls is a str"));
        assert!(detail(json!([{"id": "k"}]))
            .starts_with("messages[1].tool_calls[0] has no \"function\""));
        assert!(detail(json!([call("a", "f", "[1]")]))
            .starts_with("messages[1].tool_calls[0].function.arguments parse to a list"));
        assert!(
            detail(json!([{"id": 3, "function": {"name": "f", "arguments": "{}"}}]))
                .starts_with("messages[1].tool_calls[0].id is a int")
        );
        // Empty tool calls are none.
        assert!(to_v4(&[answer_with_calls(json!([]))], "", vec![]).is_ok());
    }

    #[test]
    fn tool_content_parts_are_joined_text_with_unsupported_markers() {
        let parts = vec![
            json!({"type": "text", "text": "a"}),
            json!({"type": "image_url", "image_url": {}}),
            json!({"text": "no type"}),
            json!({"type": "text"}),
        ];
        assert_eq!(
            tool_parts("messages[2]", &parts).unwrap(),
            "a\n\n[Unsupported image_url]\n\n[Unsupported None]\n\n"
        );
        assert_eq!(tool_parts("m", &[]).unwrap(), "");
        let e = tool_parts("messages[2]", &[json!("x")]).unwrap_err();
        assert!(e.detail.starts_with("messages[2].content[0] is a str"));
    }
}
