//! Template-driven instruction handlers (MindSpeed-LLM `LlamaFactoryInstructionHandler`
//! family): a record is aligned to `prompt` messages + one `response` + `system`
//! (`mindspeed_llm/tasks/preprocess/utils.py` `convert_alpaca_to_intermediate`,
//! `convert_sharegpt_to_intermediate`, `convert_openai_to_intermediate`), then encoded by a
//! [`Template`] into (source, target) pairs: sources are masked in labels, targets kept.
//! The pairwise handlers (`AlpacaStylePairwiseHandler`, `SharegptStylePairwiseHandler`) align
//! a prompt with a chosen and a rejected answer and encode each with the template's single
//! turn ([`PAIRWISE_KEYS`]).

use serde_json::{Map, Value};

use super::template::{py_json, Message, MessageExtra, Role, Template, TemplateClass};
use super::{opt_str_field, Document, Handler, RecordError, IGNORE, INSTRUCTION_KEYS};
use crate::data::tokenizer::Tokenizer;

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
    /// sharegpt/OpenAI: the tools column (OpenAI records: `tools` when unset), which only the
    /// deepseek4 template reads.
    pub tools: Option<String>,
    /// pairwise: the chosen answer's column.
    pub chosen: String,
    /// pairwise: the rejected answer's column.
    pub rejected: String,
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
            tools: None,
            chosen: "chosen".into(),
            rejected: "rejected".into(),
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
    pub fn with_map_keys(mut self, map: &Map<String, Value>) -> Result<Self, MapKeysError> {
        for (k, v) in map {
            let v = v
                .as_str()
                .ok_or_else(|| MapKeysError::NotAString(k.clone()))?
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
                "tools" => self.tools = Some(v),
                "chosen" => self.chosen = v,
                "rejected" => self.rejected = v,
                other => return Err(MapKeysError::UnknownKey(other.to_string())),
            }
        }
        Ok(self)
    }
}

/// A `--map-keys` object mindkit cannot apply.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MapKeysError {
    /// A column name that is not a JSON string.
    #[error("--map-keys: value of {0:?} must be a string")]
    NotAString(String),
    /// A key MindSpeed-LLM's `--map-keys` does not define.
    #[error("--map-keys: unknown key {0:?}")]
    UnknownKey(String),
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
    /// The tools text (deepseek4 only; else "").
    tools: String,
}

/// Template-driven instruction handler.
pub struct ChatHandler<'t> {
    /// Tokenizer (its eos already fixed by the template).
    pub tokenizer: &'t Tokenizer,
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
    /// MindSpeed-LLM's pairwise handlers (`AlpacaStylePairwiseHandler`,
    /// `SharegptStylePairwiseHandler`): a prompt with a chosen and a rejected answer.
    pub pairwise: bool,
}

/// Output key names of the pairwise handlers, in MindSpeed-LLM's order.
pub const PAIRWISE_KEYS: [&str; 4] = [
    "chosen_input_ids",
    "chosen_labels",
    "rejected_input_ids",
    "rejected_labels",
];

fn msg(role: Role, content: &str) -> Message {
    Message::new(role, content)
}

/// How a conversation's role tag reads.
enum Tag {
    /// A role the template encodes.
    Role(Role),
    /// The system tag (which only the first message may carry).
    System,
    /// None of the configured tags.
    Unknown,
}

/// `messages[i]`'s role tag: the message must be an object with a string role.
fn role_tag<'a>(c: &Columns, i: usize, m: &'a Value) -> Result<&'a str, RecordError> {
    let path = format!("{}[{i}]", c.messages);
    let Value::Object(m) = m else {
        return Err(RecordError::wrong_type(&path, "an object", m));
    };
    match m.get(&c.role_tag) {
        Some(Value::String(s)) => Ok(s),
        None | Some(Value::Null) => Err(RecordError::missing(&format!("{path}.{}", c.role_tag))),
        Some(other) => Err(RecordError::wrong_type(
            &format!("{path}.{}", c.role_tag),
            "a string",
            other,
        )),
    }
}

/// `messages[i]`'s content: a string, or `None` when absent or null.
fn content<'a>(c: &Columns, i: usize, m: &'a Value) -> Result<Option<&'a str>, RecordError> {
    match m.get(&c.content_tag) {
        Some(Value::String(s)) => Ok(Some(s)),
        None | Some(Value::Null) => Ok(None),
        Some(other) => Err(RecordError::wrong_type(
            &format!("{}[{i}].{}", c.messages, c.content_tag),
            "a string",
            other,
        )),
    }
}

impl Columns {
    fn tag(&self, tag: &str) -> Tag {
        let roles = [
            (&self.user_tag, Role::User),
            (&self.assistant_tag, Role::Assistant),
            (&self.observation_tag, Role::Observation),
            (&self.function_tag, Role::Function),
        ];
        match roles.into_iter().find(|(t, _)| *t == tag) {
            Some((_, role)) => Tag::Role(role),
            None if tag == self.system_tag => Tag::System,
            None => Tag::Unknown,
        }
    }

    /// The error for a role tag that is none of the configured ones.
    fn unknown_role(&self, i: usize, tag: &str) -> RecordError {
        RecordError::invalid(
            "unknown role",
            format!(
                "{}[{i}].{} is {tag:?}, not one of {:?}, {:?}, {:?}, {:?} (or {:?} first); --map-keys renames the tags",
                self.messages,
                self.role_tag,
                self.user_tag,
                self.assistant_tag,
                self.observation_tag,
                self.function_tag,
                self.system_tag
            ),
        )
    }
}

// Records that are well formed but whose conversation MindSpeed-LLM's alignment skips without
// an error (mindspeed_llm/tasks/preprocess/utils.py: roles out of turn order, an odd number of
// messages, no final assistant turn, nothing besides a system prompt) are `RecordError::dropped`:
// skipped and counted as it does, so that the output stays identical to its. A missing or
// mistyped field, or an unknown role, is bad input: an error unless --skip-bad-records.
impl ChatHandler<'_> {
    /// An alpaca record's prompt messages (its history, then the instruction and input as one
    /// user message) and system prompt.
    fn align_alpaca_prompt(
        &self,
        r: &Map<String, Value>,
    ) -> Result<(Vec<Message>, String), RecordError> {
        let c = &self.columns;
        let mut prompt = self.alpaca_history(r)?;
        let parts: Vec<&str> = [opt_str_field(r, &c.prompt)?, opt_str_field(r, &c.query)?]
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect();
        prompt.push(msg(Role::User, &parts.join("\n")));
        let system = match &c.system {
            Some(s) => opt_str_field(r, s)?.to_string(),
            None => String::new(),
        };
        Ok((prompt, system))
    }

    fn align_alpaca(&self, r: &Map<String, Value>) -> Result<Aligned, RecordError> {
        let c = &self.columns;
        let (prompt, system) = self.align_alpaca_prompt(r)?;
        let response = match r.get(&c.response) {
            Some(Value::String(s)) => vec![msg(Role::Assistant, s)],
            Some(Value::Array(a)) if a.is_empty() => {
                return Err(RecordError::invalid(
                    "missing field",
                    format!("field {:?} is an empty list: no response", c.response),
                ))
            }
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
            None | Some(Value::Null) => return Err(RecordError::missing(&c.response)),
            Some(other) => {
                return Err(RecordError::wrong_type(
                    &c.response,
                    "a string or list of strings",
                    other,
                ))
            }
        };
        Ok(Aligned {
            prompt,
            response,
            system,
            tools: String::new(),
        })
    }

    /// A pairwise alpaca record's two answers (`convert_alpaca_to_intermediate` with
    /// `ranking`): the chosen and rejected columns' strings, or from lists the chosen one's
    /// first and the rejected one's second element, as upstream indexes them. A chosen answer
    /// that is neither leaves the record no response, which upstream drops.
    fn alpaca_answers(&self, r: &Map<String, Value>) -> Result<[Message; 2], RecordError> {
        let c = &self.columns;
        let (chosen, at) = match r.get(&c.chosen) {
            Some(Value::String(s)) => (s.as_str(), None),
            Some(Value::Array(a)) => match a.first().and_then(Value::as_str) {
                Some(s) => (s, Some(1)),
                None => return Err(not_text(&c.chosen, 0)),
            },
            _ => return Err(RecordError::dropped(format!("no {:?} answer", c.chosen))),
        };
        let rejected = match (r.get(&c.rejected), at) {
            (None | Some(Value::Null), _) => return Err(RecordError::missing(&c.rejected)),
            (Some(Value::String(s)), None) => Some(s.as_str()),
            (Some(Value::Array(a)), Some(i)) => a.get(i).and_then(Value::as_str),
            _ => None,
        };
        let rejected = rejected.ok_or_else(|| not_text(&c.rejected, at.unwrap_or(0)))?;
        Ok([chosen, rejected].map(|text| msg(Role::Assistant, text)))
    }

    /// A pairwise ShareGPT record's two answers (`convert_sharegpt_to_intermediate` with
    /// `ranking`): the chosen and rejected columns, messages of an assistant or function role
    /// (another role upstream drops the record).
    fn sharegpt_answers(&self, r: &Map<String, Value>) -> Result<[Message; 2], RecordError> {
        let c = &self.columns;
        let answer = |column: &str| -> Result<Message, RecordError> {
            let m = r.get(column).ok_or_else(|| RecordError::missing(column))?;
            if !m.is_object() {
                return Err(RecordError::wrong_type(column, "a message object", m));
            }
            let role = match c.tag(
                role_tag(c, 0, m)
                    .map_err(|_| RecordError::missing(&format!("{column}.{}", c.role_tag)))?,
            ) {
                Tag::Role(role @ (Role::Assistant | Role::Function)) => role,
                _ => {
                    return Err(RecordError::dropped(format!(
                        "{column}.{} is not an assistant or function tag",
                        c.role_tag
                    )))
                }
            };
            match m.get(&c.content_tag) {
                Some(Value::String(s)) => Ok(msg(role, s)),
                _ => Err(RecordError::missing(&format!("{column}.{}", c.content_tag))),
            }
        };
        Ok([answer(&c.chosen)?, answer(&c.rejected)?])
    }

    /// A pairwise record as MindSpeed-LLM's `AlpacaStylePairwiseHandler._filter` encodes it: the
    /// prompt messages plus each answer through the template's single-turn encoding, the answer's
    /// ids its labels (the prompt's ignored), the eos after each answer with an `efficient_eos`
    /// template. A record upstream cannot align (it raises) is an error.
    fn process_pairwise(&self, record: &Map<String, Value>) -> Result<Document, RecordError> {
        let (prompt, system, answers) = match self.format {
            ChatFormat::Alpaca => {
                let (prompt, system) = self.align_alpaca_prompt(record)?;
                (prompt, system, self.alpaca_answers(record)?)
            }
            ChatFormat::Sharegpt => {
                let (prompt, system) =
                    self.align_sharegpt_messages(record, &self.columns, false)?;
                if prompt.len() % 2 == 0 {
                    return Err(RecordError::dropped(
                        "a pairwise conversation's messages (its prompt) must be odd in number",
                    ));
                }
                (prompt, system, self.sharegpt_answers(record)?)
            }
        };
        let eos = self.tokenizer.eos().map(i64::from);
        let mut out = Vec::with_capacity(4);
        // both answers follow the chosen encoding's prompt (upstream drops the rejected one's,
        // which a reasoning template may end differently)
        let mut shared_prompt = None;
        for answer in answers {
            let messages: Vec<Message> = prompt.iter().cloned().chain([answer]).collect();
            let (prompt_ids, mut answer_ids) =
                self.template
                    .encode_oneturn(self.tokenizer, &messages, &system)?;
            let prompt_ids = shared_prompt.get_or_insert(prompt_ids);
            if let (true, Some(e)) = (self.template.efficient_eos, eos) {
                answer_ids.push(e);
            }
            let labels = std::iter::repeat_n(IGNORE, prompt_ids.len()).chain(answer_ids.clone());
            out.push(vec![[&prompt_ids[..], &answer_ids].concat()]);
            out.push(vec![labels.collect()]);
        }
        Ok(out)
    }

    /// The `[[query, answer], ...]` history column as messages (none when absent or null).
    fn alpaca_history(&self, r: &Map<String, Value>) -> Result<Vec<Message>, RecordError> {
        let Some(column) = &self.columns.history else {
            return Ok(Vec::new());
        };
        let history = match r.get(column) {
            None | Some(Value::Null) => return Ok(Vec::new()),
            Some(Value::Array(h)) => h,
            Some(other) => {
                return Err(RecordError::wrong_type(
                    column,
                    "a list of [query, answer] pairs",
                    other,
                ))
            }
        };
        let mut prompt = Vec::with_capacity(2 * history.len());
        for (i, pair) in history.iter().enumerate() {
            let pair = pair.as_array().filter(|p| p.len() == 2).ok_or_else(|| {
                RecordError::invalid(
                    "wrong type",
                    format!("{column}[{i}] should be a [query, answer] pair"),
                )
            })?;
            let text = |v: &Value| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| RecordError::wrong_type(&format!("{column}[{i}]"), "strings", v))
            };
            prompt.push(msg(Role::User, &text(&pair[0])?));
            prompt.push(msg(Role::Assistant, &text(&pair[1])?));
        }
        Ok(prompt)
    }

    fn align_sharegpt(&self, r: &Map<String, Value>) -> Result<Aligned, RecordError> {
        let openai_cols;
        let c = if !r.contains_key(&self.columns.messages) && r.contains_key("messages") {
            // OpenAIInstructionHandler's columns; --map-keys still names system and tools.
            openai_cols = Columns {
                system: self.columns.system.clone(),
                tools: self.columns.tools.clone(),
                ..Columns::openai()
            };
            &openai_cols
        } else {
            &self.columns
        };
        let openai = c.messages == "messages";
        let (mut aligned, system) = self.align_sharegpt_messages(r, c, openai)?;
        if openai {
            if !matches!(
                aligned.first().map(|m| m.role),
                Some(Role::User | Role::System)
            ) {
                return Err(RecordError::dropped(
                    "first message must be from the user or the system",
                ));
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
            tools: if self.template.class() == TemplateClass::DeepSeek4 {
                tools_text(r, c, openai)
            } else {
                String::new()
            },
        })
    }

    /// A conversation record's messages after its system prompt (each aligned by
    /// [`Self::align_message`]), and the system prompt (its column's, or the first message's).
    fn align_sharegpt_messages(
        &self,
        r: &Map<String, Value>,
        c: &Columns,
        openai: bool,
    ) -> Result<(Vec<Message>, String), RecordError> {
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
        let mut system = match &c.system {
            Some(s) => opt_str_field(r, s)?.to_string(),
            None => String::new(),
        };
        let mut first = 0;
        if let Some(m) = messages.first() {
            if matches!(c.tag(role_tag(c, 0, m)?), Tag::System) {
                system = content(c, 0, m)?.unwrap_or("").to_string();
                first = 1;
            }
        }
        if messages.len() == first {
            return Err(RecordError::dropped(
                "no messages besides the system prompt",
            ));
        }
        let mut aligned = Vec::new();
        for (turn, (i, m)) in messages.iter().enumerate().skip(first).enumerate() {
            aligned.push(self.align_message(c, openai, turn, i, m)?);
        }
        Ok((aligned, system))
    }

    /// Message `i` of a conversation (`turn` after the system prompt). ShareGPT records must
    /// alternate user/observation and assistant/function turns, and a system message after the
    /// first is skipped; OpenAI records keep a later system message and, for deepseek4, carry
    /// their structured fields (`convert_openai_to_intermediate`). An unknown role is an error.
    fn align_message(
        &self,
        c: &Columns,
        openai: bool,
        turn: usize,
        i: usize,
        m: &Value,
    ) -> Result<Message, RecordError> {
        let tag = role_tag(c, i, m)?;
        let role = match c.tag(tag) {
            Tag::Role(role) => role,
            Tag::System if openai => Role::System,
            Tag::System => {
                return Err(RecordError::dropped(format!(
                    "message {i}: role {tag:?} after the first message"
                )))
            }
            Tag::Unknown => return Err(c.unknown_role(i, tag)),
        };
        let in_place = matches!(
            (role, turn.is_multiple_of(2)),
            (Role::User | Role::Observation, true) | (Role::Assistant | Role::Function, false)
        );
        if !openai && !in_place {
            return Err(RecordError::dropped(format!(
                "message {i}: role {tag:?} out of turn order"
            )));
        }
        if !openai {
            return match content(c, i, m)? {
                Some(s) => Ok(msg(role, s)),
                None => Err(RecordError::missing(&format!(
                    "{}[{i}].{}",
                    c.messages, c.content_tag
                ))),
            };
        }
        if self.template.class() != TemplateClass::DeepSeek4 {
            return Ok(msg(role, content(c, i, m)?.unwrap_or("")));
        }
        openai_message(c, role, i, m)
    }
}

/// A pairwise answer column that is not text where upstream reads it.
fn not_text(column: &str, at: usize) -> RecordError {
    RecordError::invalid(
        "wrong type",
        format!(
            "field {column:?} should be a string, or a list whose element {at} is one (as \
             MindSpeed-LLM reads it)"
        ),
    )
}

/// The tools text the converters hand the template (read for deepseek4 only): the OpenAI
/// converter's `tools` column (a list or object `json.dumps`ed), the ShareGPT converter's when
/// `--map-keys` names one. A value that is not a string after that, absent or null, is "" (the
/// template reads strings only).
fn tools_text(r: &Map<String, Value>, c: &Columns, openai: bool) -> String {
    let column = match (&c.tools, openai) {
        (Some(column), _) => column.as_str(),
        (None, true) => "tools",
        (None, false) => return String::new(),
    };
    match r.get(column) {
        Some(Value::String(s)) => s.clone(),
        Some(v @ (Value::Array(_) | Value::Object(_))) if openai => py_json(v),
        _ => String::new(),
    }
}

/// An OpenAI message for deepseek4: `tool_calls`, `tool_call_id` and `reasoning_content` when not
/// null, and a tool message's content given as a list of parts, as `convert_openai_to_intermediate`
/// passes them on (the template checks them).
fn openai_message(c: &Columns, role: Role, i: usize, m: &Value) -> Result<Message, RecordError> {
    let parts = match m.get(&c.content_tag) {
        Some(Value::Array(parts)) if matches!(role, Role::Observation | Role::Function) => {
            Some(parts.clone())
        }
        _ => None,
    };
    let text = match parts {
        Some(_) => "",
        None => content(c, i, m)?.unwrap_or(""),
    };
    let field = |f: &str| m.get(f).filter(|v| !v.is_null()).cloned();
    let extra = MessageExtra {
        path: format!("{}[{i}]", c.messages),
        tool_calls: field("tool_calls"),
        tool_call_id: field("tool_call_id"),
        reasoning_content: field("reasoning_content"),
        content_parts: parts,
    };
    let any = extra.tool_calls.is_some()
        || extra.tool_call_id.is_some()
        || extra.reasoning_content.is_some()
        || extra.content_parts.is_some();
    Ok(Message {
        extra: any.then(|| Box::new(extra)),
        ..msg(role, text)
    })
}

impl Handler for ChatHandler<'_> {
    fn keys(&self) -> Vec<String> {
        let keys = match self.pairwise {
            true => &PAIRWISE_KEYS[..],
            false => &INSTRUCTION_KEYS[..],
        };
        keys.iter().map(|s| s.to_string()).collect()
    }

    fn columns(&self) -> Vec<String> {
        let c = &self.columns;
        let mut names = match self.format {
            ChatFormat::Alpaca => {
                let history = c.history.iter().cloned();
                [c.prompt.clone(), c.query.clone(), c.response.clone()]
                    .into_iter()
                    .chain(history)
                    .collect()
            }
            // `messages` too: OpenAI records are recognised by that column.
            ChatFormat::Sharegpt => vec![c.messages.clone(), Columns::openai().messages],
        };
        if self.template.class() == TemplateClass::DeepSeek4 {
            // The tools column, which only deepseek4 reads (`tools` in OpenAI records).
            names.push(c.tools.clone().unwrap_or_else(|| "tools".into()));
        }
        names.extend(c.system.iter().cloned());
        if self.pairwise {
            names.retain(|n| *n != c.response);
            names.extend([c.chosen.clone(), c.rejected.clone()]);
        }
        names
    }

    fn process(&self, record: &Map<String, Value>) -> Result<Document, RecordError> {
        if self.pairwise {
            return self.process_pairwise(record);
        }
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
        for (source, target) in self.template.encode_multiturn(
            self.tokenizer,
            &messages,
            &a.system,
            &a.tools,
            self.cutoff_len,
        )? {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn record(json: &str) -> Map<String, Value> {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn the_tools_column_as_each_converter_hands_it_on() {
        let openai = Columns::openai();
        let r = record(r#"{"tools": [{"function": {"name": "é", "x": 1.0}}], "t": "[]"}"#);
        assert_eq!(
            tools_text(&r, &openai, true),
            r#"[{"function": {"name": "é", "x": 1.0}}]"#
        );
        // The ShareGPT converter reads a tools column only when --map-keys names one, and the
        // template only a string.
        assert_eq!(tools_text(&r, &Columns::default(), false), "");
        let mapped = |column: &str| Columns {
            tools: Some(column.into()),
            ..Columns::default()
        };
        assert_eq!(tools_text(&r, &mapped("t"), false), "[]");
        assert_eq!(tools_text(&r, &mapped("tools"), false), "");
        assert_eq!(tools_text(&record(r#"{"tools": 3}"#), &openai, true), "");
    }

    #[test]
    fn openai_messages_carry_their_structured_fields_for_deepseek4() {
        let c = Columns::openai();
        let m: Value = serde_json::from_str(
            r#"{"role": "tool", "content": [{"type": "text", "text": "x"}], "tool_call_id": "1",
                "reasoning_content": null}"#,
        )
        .unwrap();
        let m = openai_message(&c, Role::Observation, 2, &m).unwrap();
        let extra = m.extra.unwrap();
        assert_eq!(extra.path, "messages[2]");
        assert_eq!(extra.tool_call_id, Some(Value::from("1")));
        assert_eq!(extra.reasoning_content, None);
        assert_eq!(extra.content_parts.unwrap().len(), 1);
        // Only tool messages may give their content as parts.
        let m: Value = serde_json::from_str(r#"{"role": "user", "content": []}"#).unwrap();
        let e = openai_message(&c, Role::User, 0, &m).unwrap_err();
        assert!(e.detail.contains("messages[0].content"), "{}", e.detail);
        let m: Value = serde_json::from_str(r#"{"role": "user", "content": null}"#).unwrap();
        assert_eq!(
            openai_message(&c, Role::User, 0, &m).unwrap(),
            msg(Role::User, "")
        );
    }

    #[test]
    fn map_keys_name_the_tools_column() {
        let map = record(r#"{"tools": "fns"}"#);
        let c = Columns::default().with_map_keys(&map).unwrap();
        assert_eq!(c.tools.as_deref(), Some("fns"));
    }
}
