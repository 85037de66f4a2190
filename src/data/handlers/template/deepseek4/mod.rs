//! `DeepSeek4Template` (`--prompt-type deepseek4`): MindSpeed-LLM renders its conversations
//! with an encoder of its own instead of formatter slots
//! (`mindspeed_llm/tasks/preprocess/templates.py`, class `DeepSeek4Template`, read at commit
//! c77308a14b). Its `encode_multiturn`, for the messages the instruction handlers give it:
//!
//! 1. `_normalize_to_v4_schema`: the record's system prompt becomes a leading system message;
//!    an answer opening with `<think>…</think>` (whitespace around allowed) has that thought
//!    moved to its reasoning; function and observation messages become tool results.
//! 2. `_merge_tool_messages`: tool results and user messages fold into one user message of
//!    blocks (joined by `"\n\n"`, a tool result as `<tool_result>…</tool_result>`).
//! 3. `_drop_thinking_messages` (`--drop-thinking true`, the default, with
//!    `--enable-thinking true`): answers before the last user message lose their reasoning.
//! 4. `_render_message`: the text of each message; `<｜begin▁of▁sentence｜>` plus everything up
//!    to an answer is a source, the answer (ending in `<｜end▁of▁sentence｜>`) its target; each
//!    is encoded whole and the pairs are cut by `LFDefaultTemplate._make_pairs`.
//!
//! Thinking mode is `--enable-thinking true` (false and none are chat mode): a user message
//! before an answer ends `<｜Assistant｜><think>` (chat mode: `<｜Assistant｜></think>`) and an
//! answer is `reasoning</think>content<｜end▁of▁sentence｜>` (chat mode: content and eos only;
//! the thought is dropped). With the drop, earlier answers carry no `</think>` and earlier user
//! messages end `</think>`. `--reasoning-effort max` puts an instruction before the first
//! message, in thinking mode only; `high` changes nothing.
//!
//! The template's tool machinery (a tools column rendered as DSML tool schemas, OpenAI
//! `tool_calls` rendered as DSML invocations, tasks, developer messages) needs fields the
//! handlers mindkit implements do not carry (records with them are refused, not approximated):
//! function messages reach it as plain tool results, as in MindSpeed-LLM's sharegpt handler.

use super::truncation::{make_pairs, Truncation};
use super::{Message, Role, TurnIds};
use crate::data::handlers::{py_isspace, RecordError};
use crate::data::tokenizer::Tokenizer;

const BOS_TOKEN: &str = "<｜begin▁of▁sentence｜>";
const EOS_TOKEN: &str = "<｜end▁of▁sentence｜>";
const USER_SP_TOKEN: &str = "<｜User｜>";
const ASSISTANT_SP_TOKEN: &str = "<｜Assistant｜>";
const THINKING_START: &str = "<think>";
const THINKING_END: &str = "</think>";

/// `DeepSeek4Template.REASONING_EFFORT_MAX`.
const REASONING_EFFORT_MAX: &str = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n\
You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, \
rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n\
Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, \
and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

/// MindSpeed-LLM's `--reasoning-effort` (`preprocess_data.py`: choices None, max, high).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningEffort {
    /// `max`: the maximum-effort instruction opens the first message (thinking mode only).
    Max,
    /// `high`: accepted, changes nothing ("reserved (currently no-op)").
    High,
}

impl ReasoningEffort {
    /// `max` or `high`, as the flag spells them (case-sensitive, as argparse's choices).
    pub fn parse(value: &str) -> Option<ReasoningEffort> {
        match value {
            "max" => Some(ReasoningEffort::Max),
            "high" => Some(ReasoningEffort::High),
            _ => None,
        }
    }
}

/// The thinking switches of a `DeepSeek4Template`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deepseek4Thinking {
    /// `--enable-thinking`: only `Some(true)` is thinking mode.
    pub enable_thinking: Option<bool>,
    /// `--reasoning-effort`.
    pub reasoning_effort: Option<ReasoningEffort>,
    /// `--drop-thinking` (default true).
    pub drop_thinking: bool,
}

/// One part of a V4 user message.
#[derive(Debug, Clone, PartialEq)]
enum Block {
    /// A user message's text.
    Text(String),
    /// A function or observation message's text.
    ToolResult(String),
}

/// A message of the V4 schema, after `_merge_tool_messages`.
#[derive(Debug, Clone, PartialEq)]
enum V4Message {
    System(String),
    User(Vec<Block>),
    Assistant {
        reasoning: Option<String>,
        content: String,
    },
}

/// The normalizer's `^\s*<think>\s*(.*?)\s*</think>\s*` on an answer: (reasoning, the rest), or
/// `None` when the answer does not open with a thought.
fn split_thought(content: &str) -> Option<(&str, &str)> {
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

/// `_normalize_to_v4_schema` then `_merge_tool_messages`: the system prompt as a leading
/// message, thoughts split from answers, user and tool messages folded into block lists.
fn to_v4(messages: &[Message], system: &str) -> Vec<V4Message> {
    let mut v4 = Vec::with_capacity(messages.len() + 1);
    if !system.is_empty() {
        v4.push(V4Message::System(system.to_string()));
    }
    for m in messages {
        let block = match m.role {
            Role::Assistant => {
                let (reasoning, content) = match split_thought(&m.content) {
                    Some((r, c)) => (Some(r.to_string()), c.to_string()),
                    None => (None, m.content.clone()),
                };
                v4.push(V4Message::Assistant { reasoning, content });
                continue;
            }
            Role::User => Block::Text(m.content.clone()),
            // LLaMA-Factory's function and observation roles are V4 tool messages.
            Role::Function | Role::Observation => Block::ToolResult(m.content.clone()),
        };
        match v4.last_mut() {
            Some(V4Message::User(blocks)) => blocks.push(block),
            _ => v4.push(V4Message::User(vec![block])),
        }
    }
    v4
}

/// Index of the last user message, -1 when none (upstream's `last_user_idx`).
fn last_user_index(v4: &[V4Message]) -> i64 {
    v4.iter()
        .rposition(|m| matches!(m, V4Message::User(_)))
        .map_or(-1, |i| i as i64)
}

/// `_render_message`: message `index` as text.
fn render(
    index: usize,
    v4: &[V4Message],
    thinking: bool,
    drop_thinking: bool,
    reasoning_effort: Option<ReasoningEffort>,
) -> String {
    let last_user = last_user_index(v4);
    let at = index as i64;
    let mut text = String::new();
    if index == 0 && thinking && reasoning_effort == Some(ReasoningEffort::Max) {
        text.push_str(REASONING_EFFORT_MAX);
    }
    let Some(message) = v4.get(index) else {
        return text;
    };
    match message {
        V4Message::System(content) => text.push_str(content),
        V4Message::User(blocks) => {
            text.push_str(USER_SP_TOKEN);
            let parts: Vec<String> = blocks
                .iter()
                .map(|b| match b {
                    Block::Text(t) => t.clone(),
                    Block::ToolResult(t) => format!("<tool_result>{t}</tool_result>"),
                })
                .collect();
            text.push_str(&parts.join("\n\n"));
        }
        V4Message::Assistant { reasoning, content } => {
            if thinking && (!drop_thinking || at > last_user) {
                text.push_str(reasoning.as_deref().unwrap_or(""));
                text.push_str(THINKING_END);
            }
            text.push_str(content);
            text.push_str(EOS_TOKEN);
        }
    }
    // What follows a user message that an answer follows (or that ends the conversation).
    let next_is_answer = match v4.get(index + 1) {
        None => true,
        Some(next) => matches!(next, V4Message::Assistant { .. }),
    };
    if next_is_answer && matches!(message, V4Message::User(_)) {
        text.push_str(ASSISTANT_SP_TOKEN);
        text.push_str(if thinking && (!drop_thinking || at >= last_user) {
            THINKING_START
        } else {
            THINKING_END
        });
    }
    text
}

/// `DeepSeek4Template.encode_multiturn`: (source, target) pairs, one per answer, cut to
/// `cutoff_len` as `LFDefaultTemplate._make_pairs` cuts them.
pub(super) fn encode_multiturn(
    tok: &Tokenizer,
    messages: &[Message],
    system: &str,
    cutoff_len: usize,
    switches: Deepseek4Thinking,
) -> Result<Vec<TurnIds>, RecordError> {
    let mut v4 = to_v4(messages, system);
    let thinking = switches.enable_thinking == Some(true);
    // No tools column reaches the template, so the drop is never held back for tools.
    let drop_thinking = switches.drop_thinking && thinking;
    if drop_thinking {
        let last_user = last_user_index(&v4);
        for (i, m) in v4.iter_mut().enumerate() {
            if let V4Message::Assistant { reasoning, .. } = m {
                if (i as i64) < last_user {
                    *reasoning = None;
                }
            }
        }
    }
    let encode = |text: &str| -> Result<Vec<i64>, RecordError> {
        if text.is_empty() {
            return Ok(Vec::new());
        }
        Ok(tok
            .encode(text, false)?
            .into_iter()
            .map(i64::from)
            .collect())
    };
    let mut segments = Vec::new();
    let mut source = BOS_TOKEN.to_string();
    for (i, m) in v4.iter().enumerate() {
        let effort = if i == 0 {
            switches.reasoning_effort
        } else {
            None
        };
        let rendered = render(i, &v4, thinking, drop_thinking, effort);
        if matches!(m, V4Message::Assistant { .. }) {
            if source.is_empty() {
                return Err(RecordError::invalid(
                    "invalid conversation",
                    format!(
                        "message {i}: an answer right after an answer, which DeepSeek4Template \
                         refuses (its messages must alternate user and assistant)"
                    ),
                ));
            }
            segments.push(encode(&source)?);
            segments.push(encode(&rendered)?);
            source.clear();
        } else {
            source.push_str(&rendered);
        }
    }
    // A trailing source without an answer is dropped, as upstream.
    Ok(make_pairs(segments, cutoff_len, 1, Truncation::InferSeqlen))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: Role, content: &str) -> Message {
        Message {
            role,
            content: content.to_string(),
        }
    }

    fn rendered(v4: &[V4Message], thinking: bool, drop: bool) -> Vec<String> {
        (0..v4.len())
            .map(|i| render(i, v4, thinking, drop, None))
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
    fn tool_messages_fold_into_the_user_message_before_the_answer() {
        let v4 = to_v4(
            &[
                msg(Role::User, "Q"),
                msg(Role::Function, "call"),
                msg(Role::Observation, "result"),
                msg(Role::Assistant, "A"),
            ],
            "S",
        );
        assert_eq!(v4.len(), 3);
        assert_eq!(
            rendered(&v4, false, false),
            [
                "S",
                "<｜User｜>Q\n\n<tool_result>call</tool_result>\n\n<tool_result>result</tool_result>\
                 <｜Assistant｜></think>",
                "A<｜end▁of▁sentence｜>",
            ]
        );
    }

    #[test]
    fn thinking_mode_drops_earlier_thoughts_unless_told_not_to() {
        let messages = [
            msg(Role::User, "Q1"),
            msg(Role::Assistant, "<think>r1</think>A1"),
            msg(Role::User, "Q2"),
            msg(Role::Assistant, "<think>r2</think>A2"),
        ];
        let v4 = to_v4(&messages, "");
        assert_eq!(
            rendered(&v4, true, false),
            [
                "<｜User｜>Q1<｜Assistant｜><think>",
                "r1</think>A1<｜end▁of▁sentence｜>",
                "<｜User｜>Q2<｜Assistant｜><think>",
                "r2</think>A2<｜end▁of▁sentence｜>",
            ]
        );
        assert_eq!(
            rendered(&v4, true, true),
            [
                "<｜User｜>Q1<｜Assistant｜></think>",
                "A1<｜end▁of▁sentence｜>",
                "<｜User｜>Q2<｜Assistant｜><think>",
                "r2</think>A2<｜end▁of▁sentence｜>",
            ]
        );
        // Chat mode: no thought at all.
        assert_eq!(rendered(&v4, false, false)[1], "A1<｜end▁of▁sentence｜>");
    }

    #[test]
    fn maximum_effort_opens_the_first_message_in_thinking_mode_only() {
        let v4 = to_v4(&[msg(Role::User, "Q"), msg(Role::Assistant, "A")], "S");
        let max = Some(ReasoningEffort::Max);
        assert!(render(0, &v4, true, true, max).starts_with("Reasoning Effort: Absolute"));
        assert!(render(0, &v4, true, true, max).ends_with("checked.\n\nS"));
        assert_eq!(render(0, &v4, false, true, max), "S");
        assert_eq!(render(0, &v4, true, true, Some(ReasoningEffort::High)), "S");
        assert_eq!(ReasoningEffort::parse("MAX"), None);
    }
}
