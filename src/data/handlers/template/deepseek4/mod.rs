//! `DeepSeek4Template` (`--prompt-type deepseek4`): MindSpeed-LLM renders its conversations
//! with an encoder of its own instead of formatter slots
//! (`mindspeed_llm/tasks/preprocess/templates.py`, class `DeepSeek4Template`, read at commit
//! c77308a14b). Its `encode_multiturn`, for the messages and tools text the instruction handlers
//! give it:
//!
//! 1. `_normalize_to_v4_schema` (module `schema`): the record's system prompt and its tools (a
//!    JSON list of OpenAI-format tools) become a leading system message, or merge into a first
//!    system message; an answer's `reasoning_content`, else a leading `<think>…</think>`
//!    (whitespace around allowed), is its reasoning; its `tool_calls` are kept; function and
//!    observation messages become tool results with their `tool_call_id`.
//! 2. `_merge_tool_messages`: tool results and user messages fold into one user message of
//!    blocks (joined by `"\n\n"`, a tool result as `<tool_result>…</tool_result>`).
//! 3. `_sort_tool_results_by_call_order`: the tool results of a user message follow the order of
//!    the calls of the latest answer that made any.
//! 4. `_drop_thinking_messages` (`--drop-thinking true`, the default, with
//!    `--enable-thinking true`, and only when there are no tools): answers before the last user
//!    message lose their reasoning.
//! 5. `_render_message`: the text of each message; a system message is its content, then
//!    `"\n\n"` and the DSML tools prompt with one schema a line (module `dsml`) when it has
//!    tools; an answer's tool calls follow its content as a DSML `tool_calls` block of `invoke`s.
//!    `<｜begin▁of▁sentence｜>` plus everything up to an answer is a source, the answer (ending in
//!    `<｜end▁of▁sentence｜>`) its target; each is encoded whole and the pairs are cut by
//!    `LFDefaultTemplate._make_pairs`.
//!
//! Thinking mode is `--enable-thinking true` (false and none are chat mode): a user message
//! before an answer ends `<｜Assistant｜><think>` (chat mode: `<｜Assistant｜></think>`) and an
//! answer is `reasoning</think>content<｜end▁of▁sentence｜>` (chat mode: content and eos only;
//! the thought is dropped). With the drop, earlier answers carry no `</think>` and earlier user
//! messages end `</think>`. `--reasoning-effort max` puts an instruction before the first
//! message, in thinking mode only; `high` changes nothing.
//!
//! What reaches it: role and content from every handler; a system message after the first,
//! `tool_calls`, `tool_call_id`, `reasoning_content` and tool content given as parts from the
//! OpenAI converter, with its `tools` column (a list or object is `json.dumps`ed first); the
//! ShareGPT converter's tools column when `--map-keys` names one (a string; any other value the
//! template ignores). The template's task tokens, developer and latest-reminder messages,
//! `response_format`, `wo_eos` and `mask` need fields no handler delivers.

mod dsml;
mod schema;

use super::truncation::{make_pairs, Truncation};
use super::{Message, TurnIds};
use crate::data::handlers::RecordError;
use crate::data::tokenizer::Tokenizer;
use schema::{Block, V4Message};

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

/// Index of the last user message, -1 when none (upstream's `last_user_idx`).
fn last_user_index(v4: &[V4Message]) -> i64 {
    v4.iter()
        .rposition(|m| matches!(m, V4Message::User(_)))
        .map_or(-1, |i| i as i64)
}

/// `_render_message`: message `index` as text. `drop_thinking`: the effective drop (thinking
/// mode, the flag, no tools).
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
        V4Message::System { content, tools } => {
            text.push_str(content);
            if !tools.is_empty() {
                text.push_str("\n\n");
                text.push_str(&dsml::tools_prompt(tools));
            }
        }
        V4Message::User(blocks) => {
            text.push_str(USER_SP_TOKEN);
            let parts: Vec<String> = blocks
                .iter()
                .map(|b| match b {
                    Block::Text(t) => t.clone(),
                    Block::ToolResult { content, .. } => {
                        format!("<tool_result>{content}</tool_result>")
                    }
                })
                .collect();
            text.push_str(&parts.join("\n\n"));
        }
        V4Message::Assistant {
            reasoning,
            content,
            calls,
        } => {
            if thinking && (!drop_thinking || at > last_user) {
                text.push_str(reasoning.as_deref().unwrap_or(""));
                text.push_str(THINKING_END);
            }
            text.push_str(content);
            if !calls.is_empty() {
                let invokes: Vec<String> = calls.iter().map(|c| c.invoke.clone()).collect();
                text.push_str(&dsml::tool_calls_block(&invokes));
            }
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

/// The V4 messages of a conversation: normalized, merged, tool results sorted.
fn v4_messages(
    messages: &[Message],
    system: &str,
    tools: &str,
) -> Result<Vec<V4Message>, RecordError> {
    let tools = schema::parse_tools(tools)?;
    let mut v4 = schema::to_v4(messages, system, tools)?;
    schema::sort_tool_results(&mut v4);
    Ok(v4)
}

/// `DeepSeek4Template.encode_multiturn`: (source, target) pairs, one per answer, cut to
/// `cutoff_len` as `LFDefaultTemplate._make_pairs` cuts them.
pub(super) fn encode_multiturn(
    tok: &Tokenizer,
    messages: &[Message],
    system: &str,
    tools: &str,
    cutoff_len: usize,
    switches: Deepseek4Thinking,
) -> Result<Vec<TurnIds>, RecordError> {
    let v4 = v4_messages(messages, system, tools)?;
    let thinking = switches.enable_thinking == Some(true);
    let has_tools = v4
        .iter()
        .any(|m| matches!(m, V4Message::System { tools, .. } if !tools.is_empty()));
    // Tool-calling conversations keep their history reasoning. `_drop_thinking_messages` itself
    // changes nothing the rendering shows: an answer before the last user message renders
    // without reasoning under the drop anyway.
    let drop_thinking = switches.drop_thinking && thinking && !has_tools;
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
    use super::super::{MessageExtra, Role};
    use super::*;
    use serde_json::json;

    fn msg(role: Role, content: &str) -> Message {
        Message::new(role, content)
    }

    fn rendered(v4: &[V4Message], thinking: bool, drop: bool) -> Vec<String> {
        (0..v4.len())
            .map(|i| render(i, v4, thinking, drop, None))
            .collect()
    }

    #[test]
    fn tool_messages_fold_into_the_user_message_before_the_answer() {
        let v4 = v4_messages(
            &[
                msg(Role::User, "Q"),
                msg(Role::Function, "call"),
                msg(Role::Observation, "result"),
                msg(Role::Assistant, "A"),
            ],
            "S",
            "",
        )
        .unwrap();
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
        let v4 = v4_messages(&messages, "", "").unwrap();
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
    fn tools_and_tool_calls_render_as_dsml() {
        let tools = r#"[{"type": "function", "function": {"name": "f"}}]"#;
        let answer = Message {
            extra: Some(Box::new(MessageExtra {
                tool_calls: Some(
                    json!([{"id": "1", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]),
                ),
                reasoning_content: Some(json!("plan")),
                ..Default::default()
            })),
            ..msg(Role::Assistant, "")
        };
        let messages = [msg(Role::User, "Q"), answer];
        let v4 = v4_messages(&messages, "", tools).unwrap();
        let text = rendered(&v4, true, false);
        assert!(text[0].starts_with("\n\n## Tools\n\n"), "{}", text[0]);
        assert!(text[0].contains("### Available Tool Schemas\n\n{\"name\": \"f\"}\n\n"));
        assert_eq!(
            text[2],
            "plan</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n\
             <｜DSML｜parameter name=\"x\" string=\"false\">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n\
             </｜DSML｜tool_calls><｜end▁of▁sentence｜>"
        );
    }

    #[test]
    fn a_system_message_between_user_messages_holds_back_the_transition() {
        let messages = [
            msg(Role::User, "Q"),
            msg(Role::System, "Mid"),
            msg(Role::User, "Q2"),
            msg(Role::Assistant, "A"),
        ];
        let v4 = v4_messages(&messages, "", "").unwrap();
        assert_eq!(
            rendered(&v4, true, true),
            [
                "<｜User｜>Q",
                "Mid",
                "<｜User｜>Q2<｜Assistant｜><think>",
                "</think>A<｜end▁of▁sentence｜>"
            ]
        );
    }

    #[test]
    fn maximum_effort_opens_the_first_message_in_thinking_mode_only() {
        let v4 = v4_messages(&[msg(Role::User, "Q"), msg(Role::Assistant, "A")], "S", "").unwrap();
        let max = Some(ReasoningEffort::Max);
        assert!(render(0, &v4, true, true, max).starts_with("Reasoning Effort: Absolute"));
        assert!(render(0, &v4, true, true, max).ends_with("checked.\n\nS"));
        assert_eq!(render(0, &v4, false, true, max), "S");
        assert_eq!(render(0, &v4, true, true, Some(ReasoningEffort::High)), "S");
        assert_eq!(ReasoningEffort::parse("MAX"), None);
    }
}
