//! Template-driven instruction handlers (MindSpeed-LLM `LlamaFactoryInstructionHandler`
//! family): a record is aligned to `prompt` messages + one `response` + `system`
//! (`mindspeed_llm/tasks/preprocess/utils.py` `convert_alpaca_to_intermediate`,
//! `convert_sharegpt_to_intermediate`, `convert_openai_to_intermediate`), then encoded by a
//! [`Template`] into (source, target) pairs: sources are masked in labels, targets kept.

use serde_json::{Map, Value};

use super::template::{Message, Role, Template};
use super::{opt_str_field, Document, Handler, RecordError, IGNORE, INSTRUCTION_KEYS};
use crate::data::tokenizer::HfTokenizer;

/// Column and tag names (MindSpeed's `InstructionDatasetAttr`; override with `--map-keys`).
#[derive(Debug, Clone)]
pub struct Columns {
    /// alpaca: instruction column.
    pub prompt: String,
    /// alpaca: input column.
    pub query: String,
    /// alpaca: output column.
    pub response: String,
    /// alpaca: optional `[[q, a], ...]` history column.
    pub history: Option<String>,
    /// optional system column.
    pub system: Option<String>,
    /// sharegpt: messages column.
    pub messages: String,
    /// sharegpt: role key in a message.
    pub role_tag: String,
    /// sharegpt: content key in a message.
    pub content_tag: String,
    /// role value of the user.
    pub user_tag: String,
    /// role value of the assistant.
    pub assistant_tag: String,
    /// role value of tool output.
    pub observation_tag: String,
    /// role value of a tool call.
    pub function_tag: String,
    /// role value of the system prompt.
    pub system_tag: String,
}

impl Default for Columns {
    fn default() -> Self {
        Columns {
            prompt: "instruction".into(),
            query: "input".into(),
            response: "output".into(),
            history: None,
            system: None,
            messages: "conversations".into(),
            role_tag: "from".into(),
            content_tag: "value".into(),
            user_tag: "human".into(),
            assistant_tag: "gpt".into(),
            observation_tag: "observation".into(),
            function_tag: "function_call".into(),
            system_tag: "system".into(),
        }
    }
}

impl Columns {
    /// The OpenAI `messages` layout (`role`/`content`, `user`/`assistant`/`tool`).
    pub fn openai() -> Self {
        Columns {
            messages: "messages".into(),
            role_tag: "role".into(),
            content_tag: "content".into(),
            user_tag: "user".into(),
            assistant_tag: "assistant".into(),
            observation_tag: "tool".into(),
            ..Columns::default()
        }
    }

    /// Apply a `--map-keys` JSON object (`{"prompt": "question", "system": "sys", ...}`).
    pub fn with_map_keys(mut self, map: &Map<String, Value>) -> Result<Self, String> {
        for (k, v) in map {
            let v = v
                .as_str()
                .ok_or_else(|| format!("--map-keys: value of {k:?} must be a string"))?
                .to_string();
            match k.as_str() {
                "prompt" => self.prompt = v,
                "query" => self.query = v,
                "response" => self.response = v,
                "history" => self.history = Some(v),
                "system" => self.system = Some(v),
                "messages" => self.messages = v,
                "role_tag" => self.role_tag = v,
                "content_tag" => self.content_tag = v,
                "user_tag" => self.user_tag = v,
                "assistant_tag" => self.assistant_tag = v,
                "observation_tag" => self.observation_tag = v,
                "function_tag" => self.function_tag = v,
                "system_tag" => self.system_tag = v,
                other => return Err(format!("--map-keys: unknown key {other:?}")),
            }
        }
        Ok(self)
    }
}

/// Record layouts of the chat handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatFormat {
    /// instruction / input / output (+ history, system).
    Alpaca,
    /// `conversations` of from/value, or OpenAI `messages` of role/content (auto-detected).
    Sharegpt,
}

/// An aligned record.
struct Aligned {
    prompt: Vec<Message>,
    response: Vec<Message>,
    system: String,
}

/// Template-driven instruction handler.
pub struct ChatHandler<'t> {
    /// Tokenizer (its eos already fixed by the template).
    pub tokenizer: &'t HfTokenizer,
    /// The `--prompt-type` template.
    pub template: Template,
    /// Record layout.
    pub format: ChatFormat,
    /// Column names.
    pub columns: Columns,
    /// `--seq-length` (cutoff for the template's truncation; 100000 when unset, as upstream).
    pub cutoff_len: usize,
    /// `--append-eod`.
    pub eod: Option<u32>,
}

fn msg(role: Role, content: &str) -> Message {
    Message {
        role,
        content: content.to_string(),
    }
}

impl ChatHandler<'_> {
    fn align_alpaca(&self, r: &Map<String, Value>) -> Result<Aligned, RecordError> {
        let c = &self.columns;
        let mut prompt = Vec::new();
        if let Some(Value::Array(history)) = c.history.as_ref().and_then(|h| r.get(h)) {
            for (i, pair) in history.iter().enumerate() {
                let pair = pair.as_array().filter(|p| p.len() == 2).ok_or_else(|| {
                    RecordError::invalid(
                        "wrong type",
                        format!("history[{i}] should be a [query, answer] pair"),
                    )
                })?;
                let text = |v: &Value| {
                    v.as_str().map(str::to_string).ok_or_else(|| {
                        RecordError::wrong_type(&format!("history[{i}]"), "strings", v)
                    })
                };
                prompt.push(msg(Role::User, &text(&pair[0])?));
                prompt.push(msg(Role::Assistant, &text(&pair[1])?));
            }
        }
        let parts: Vec<&str> = [opt_str_field(r, &c.prompt)?, opt_str_field(r, &c.query)?]
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect();
        prompt.push(msg(Role::User, &parts.join("\n")));
        let response = match r.get(&c.response) {
            Some(Value::String(s)) => vec![msg(Role::Assistant, s)],
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_str().map(|s| msg(Role::Assistant, s)))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    RecordError::wrong_type(
                        &c.response,
                        "a string or list of strings",
                        &r[&c.response],
                    )
                })?,
            _ => {
                return Err(RecordError::dropped(format!(
                    "no {:?} response",
                    c.response
                )))
            }
        };
        let system = match &c.system {
            Some(s) => opt_str_field(r, s)?.to_string(),
            None => String::new(),
        };
        Ok(Aligned {
            prompt,
            response,
            system,
        })
    }

    fn align_sharegpt(&self, r: &Map<String, Value>) -> Result<Aligned, RecordError> {
        let openai_cols;
        let c = if !r.contains_key(&self.columns.messages) && r.contains_key("messages") {
            openai_cols = Columns::openai();
            &openai_cols
        } else {
            &self.columns
        };
        let openai = c.messages == "messages";
        let messages = match r.get(&c.messages) {
            None => return Err(RecordError::missing(&c.messages)),
            Some(Value::Array(m)) => m,
            Some(other) => {
                return Err(RecordError::wrong_type(
                    &c.messages,
                    "a list of messages",
                    other,
                ))
            }
        };
        let role_of = |m: &Value| {
            m.get(&c.role_tag)
                .and_then(Value::as_str)
                .map(str::to_string)
        };
        let mut messages: &[Value] = messages;
        let mut system = match &c.system {
            Some(s) => opt_str_field(r, s)?.to_string(),
            None => String::new(),
        };
        if let Some(first) = messages.first() {
            if role_of(first).as_deref() == Some(c.system_tag.as_str()) {
                system = first
                    .get(&c.content_tag)
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string();
                messages = &messages[1..];
            }
        }
        if messages.is_empty() {
            return Err(RecordError::dropped(
                "no messages besides the system prompt",
            ));
        }
        let map_role = |tag: &str| -> Option<Role> {
            if tag == c.user_tag {
                Some(Role::User)
            } else if tag == c.assistant_tag {
                Some(Role::Assistant)
            } else if tag == c.observation_tag {
                Some(Role::Observation)
            } else if tag == c.function_tag {
                Some(Role::Function)
            } else {
                None
            }
        };
        let mut aligned = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            let tag = role_of(m).unwrap_or_default();
            let role = map_role(&tag);
            let expected_user = i % 2 == 0;
            let in_place = matches!(
                (role, expected_user),
                (Some(Role::User | Role::Observation), true)
                    | (Some(Role::Assistant | Role::Function), false)
            );
            if !openai && !in_place {
                return Err(RecordError::dropped(format!(
                    "message {i}: role {tag:?} out of turn order"
                )));
            }
            let Some(role) = role else {
                return Err(RecordError::dropped(format!(
                    "message {i}: unknown role {tag:?}"
                )));
            };
            match m.get(&c.content_tag) {
                Some(Value::String(s)) => aligned.push(msg(role, s)),
                None | Some(Value::Null) if openai => aligned.push(msg(role, "")),
                None | Some(Value::Null) => {}
                Some(other) => {
                    return Err(RecordError::wrong_type(
                        &format!("{}[{i}].{}", c.messages, c.content_tag),
                        "a string",
                        other,
                    ))
                }
            }
        }
        if openai {
            if aligned.first().map(|m| m.role) != Some(Role::User) {
                return Err(RecordError::dropped("first message must be from the user"));
            }
            if aligned.last().map(|m| m.role) != Some(Role::Assistant) {
                return Err(RecordError::dropped(
                    "last message must be from the assistant",
                ));
            }
        } else if aligned.len() % 2 != 0 {
            return Err(RecordError::dropped("odd number of messages"));
        }
        let response = aligned.split_off(aligned.len() - 1);
        Ok(Aligned {
            prompt: aligned,
            response,
            system,
        })
    }
}

impl Handler for ChatHandler<'_> {
    fn keys(&self) -> Vec<String> {
        INSTRUCTION_KEYS.iter().map(|s| s.to_string()).collect()
    }

    fn process(&self, record: &Map<String, Value>) -> Result<Document, RecordError> {
        let a = match self.format {
            ChatFormat::Alpaca => self.align_alpaca(record)?,
            ChatFormat::Sharegpt => self.align_sharegpt(record)?,
        };
        let messages: Vec<Message> = if a.prompt.len() % 2 != 1 || a.response.len() != 1 {
            // Upstream replaces an ill-shaped example by an empty exchange rather than dropping it.
            vec![msg(Role::User, ""), msg(Role::Assistant, "")]
        } else {
            a.prompt.into_iter().chain(a.response).collect()
        };
        let eos = self.tokenizer.eos().map(i64::from);
        let mut input_ids = Vec::new();
        let mut labels = Vec::new();
        for (source, target) in
            self.template
                .encode_multiturn(self.tokenizer, &messages, &a.system, self.cutoff_len)?
        {
            let source_mask: Vec<i64> = match eos {
                Some(e) if !input_ids.is_empty() && self.template.efficient_eos => {
                    std::iter::once(e)
                        .chain(std::iter::repeat_n(IGNORE, source.len().saturating_sub(1)))
                        .collect()
                }
                _ => vec![IGNORE; source.len()],
            };
            input_ids.extend(&source);
            input_ids.extend(&target);
            labels.extend(source_mask);
            labels.extend(target);
        }
        if self.template.efficient_eos {
            if let Some(e) = eos {
                input_ids.push(e);
                labels.push(e);
            }
        }
        if input_ids.is_empty() {
            return Err(RecordError::invalid(
                "empty document",
                "the template produced no tokens",
            ));
        }
        if let Some(e) = self.eod {
            input_ids.push(e as i64);
            labels.push(e as i64);
        }
        Ok(super::instruction_document(input_ids, labels))
    }
}
