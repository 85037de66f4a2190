//! `--prompt-type` chat templates, as MindSpeed-LLM defines them (`configs/finetune/
//! templates.json`, read by `mindspeed_llm/tasks/preprocess/templates.py`, which follows
//! LLaMA-Factory 0.8.2 for `Template` and 0.9.4 for `LFDefaultTemplate` and
//! `ReasoningTemplate`). A template is data: formatters made of slots. Every template of
//! MindSpeed's file is built in ([`builtin`], same JSON schema), and `--prompt-type-path` loads a
//! user's file in that schema.
//!
//! Template classes: `Template`, `LFDefaultTemplate` (no separator, `_infer_seqlen` truncation to
//! cutoff − 1), `Llama2Template` (system text inside the first user message) and
//! `ReasoningTemplate` (thought words and `enable_thinking`). `DeepSeek4Template` renders with an
//! encoder of its own ([`deepseek4`]: V4 messages, `reasoning_effort`, `drop_thinking`).

mod builtin;
pub mod deepseek4;
mod formatter;
mod truncation;

use serde_json::Value;

use super::{widen, RecordError};
use crate::data::tokenizer::{Tokenizer, TokenizerError};
use builtin::BUILTIN;
pub use deepseek4::{Deepseek4Thinking, ReasoningEffort};
use formatter::{apply, slots_problem, FormatterKind, FunctionFormat};
pub use formatter::{py_json, Slot};
use truncation::{make_pairs, Truncation};

/// A `--prompt-type` that cannot be used: unknown, or its template file is malformed.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// `--prompt-type-path` cannot be read.
    #[error("{}: {source}", .path.display())]
    Read {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The template list is not a JSON array of templates.
    #[error("{origin}: {problem}")]
    List {
        /// The file, or "built-in templates".
        origin: String,
        /// What is wrong.
        problem: String,
    },
    /// No template of that name.
    #[error("unknown prompt type {name:?}; available: {available}")]
    Unknown {
        /// The name asked for.
        name: String,
        /// The names the list holds, comma-separated.
        available: String,
    },
    /// A template whose entry mindkit cannot read.
    #[error("{at}: {problem}")]
    Entry {
        /// `template` or `template.formatter`.
        at: String,
        /// What is wrong.
        problem: String,
    },
    /// A stop word the tokenizer cannot take as a special token.
    #[error("template {name}: {source}")]
    StopWord {
        /// The template.
        name: String,
        /// The tokenizer's refusal.
        source: TokenizerError,
    },
}

/// One turn's (prompt ids, answer ids), as MindSpeed-LLM's `_make_pairs` yields them.
pub type TurnIds = (Vec<i64>, Vec<i64>);

/// The template classes of MindSpeed-LLM's `templates.py`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateClass {
    /// `Template`: system formatted before the first user message; `infer_max_len` truncation.
    Plain,
    /// `LFDefaultTemplate`: as `Template` without the separator, `_infer_seqlen` truncation.
    LfDefault,
    /// `Llama2Template`: system text placed inside the first user message.
    Llama2,
    /// `ReasoningTemplate`: `Template`'s layout, `_infer_seqlen` truncation, thought words.
    Reasoning,
    /// `DeepSeek4Template`: V4 messages rendered by an encoder of its own ([`deepseek4`]).
    DeepSeek4,
}

impl TemplateClass {
    fn parse(name: &str, class: Option<&Value>) -> Result<TemplateClass, TemplateError> {
        Ok(match class {
            None | Some(Value::Null) => TemplateClass::Plain,
            Some(Value::String(s)) => match s.as_str() {
                "" | "Template" => TemplateClass::Plain,
                "LFDefaultTemplate" => TemplateClass::LfDefault,
                "Llama2Template" => TemplateClass::Llama2,
                "ReasoningTemplate" => TemplateClass::Reasoning,
                "DeepSeek4Template" => TemplateClass::DeepSeek4,
                other => {
                    return Err(TemplateError::Entry {
                        at: format!("{name}.template_class"),
                        problem: format!(
                            "{other:?} is not a template class of MindSpeed-LLM's templates.py \
                             (Template, LFDefaultTemplate, Llama2Template, ReasoningTemplate, \
                             DeepSeek4Template)"
                        ),
                    })
                }
            },
            Some(other) => {
                return Err(TemplateError::Entry {
                    at: format!("{name}.template_class"),
                    problem: format!("expected a class name, found {other}"),
                })
            }
        })
    }
}

/// A chat template.
#[derive(Debug, Clone)]
pub struct Template {
    /// Its name.
    pub name: String,
    user: Vec<Slot>,
    assistant: Vec<Slot>,
    system: Vec<Slot>,
    function: FunctionFormat,
    observation: Vec<Slot>,
    separator: Vec<Slot>,
    prefix: Vec<Slot>,
    /// System prompt used when a record has none.
    pub default_system: String,
    /// Stop words; with `replace_eos` the first becomes the eos token.
    pub stop_words: Vec<String>,
    /// Whether the assistant formatter omits eos (eos is added once at the end instead).
    pub efficient_eos: bool,
    /// Whether eos is replaced by the first stop word.
    pub replace_eos: bool,
    /// The reasoning markers (default `"<think>\n"`, `"\n</think>\n\n"`).
    pub thought_words: (String, String),
    enable_thinking: Option<bool>,
    /// `--reasoning-effort` (DeepSeek4Template only).
    reasoning_effort: Option<ReasoningEffort>,
    /// `--drop-thinking` (DeepSeek4Template only; default true).
    drop_thinking: bool,
    class: TemplateClass,
}

/// Where the built-in templates come from, in errors.
const BUILTIN_ORIGIN: &str = "built-in templates";

/// Names of the built-in templates.
pub fn builtin_names() -> Vec<String> {
    parse_list(BUILTIN, BUILTIN_ORIGIN.into())
        .map(|l| {
            l.into_iter()
                .filter_map(|t| t.get("name")?.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

fn parse_list(text: &str, origin: String) -> Result<Vec<Value>, TemplateError> {
    let problem = match serde_json::from_str(text) {
        Ok(Value::Array(a)) => return Ok(a),
        Ok(_) => "expected a JSON array of templates".to_string(),
        Err(e) => format!("invalid JSON: {e}"),
    };
    Err(TemplateError::List { origin, problem })
}

/// Python truthiness of an optional JSON value.
fn truthy(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
    }
}

/// A formatter's slots: `None` when the entry leaves it to the default (absent, null or `{}`).
fn parse_slots(v: Option<&Value>, at: &str) -> Result<Option<Vec<Slot>>, TemplateError> {
    if !truthy(v) {
        return Ok(None);
    }
    let invalid = |problem: String| TemplateError::Entry {
        at: at.to_string(),
        problem,
    };
    let Some(Value::Object(formatter)) = v else {
        return Err(invalid("expected {\"slots\": [...]}".into()));
    };
    let slots = match formatter.get("slots") {
        // The formatter's default: no slots.
        None => return Ok(Some(Vec::new())),
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(_) => return Err(invalid("\"slots\" must be a non-empty list".into())),
    };
    slots
        .iter()
        .map(|s| match s {
            Value::String(t) => Ok(Slot::Text(t.clone())),
            Value::Object(o) => o
                .get("token")
                .and_then(Value::as_str)
                .map(|t| Slot::Token(t.to_string()))
                .ok_or_else(|| invalid("object slot needs \"token\"".into())),
            Value::Array(a) => {
                let names = |n: &str| a.iter().any(|x| x.as_str() == Some(n));
                Ok(Slot::Special {
                    bos: names("bos_token"),
                    eos: names("eos_token"),
                })
            }
            _ => Err(invalid(format!("unsupported slot {s}"))),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn strings(e: &Value, key: &str, name: &str) -> Result<Option<Vec<String>>, TemplateError> {
    match e.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(String::from))
            .collect::<Option<Vec<_>>>()
            .map(Some)
            .ok_or_else(|| TemplateError::Entry {
                at: format!("{name}.{key}"),
                problem: "expected a list of strings".into(),
            }),
        Some(_) => Err(TemplateError::Entry {
            at: format!("{name}.{key}"),
            problem: "expected a list of strings".into(),
        }),
    }
}

impl Template {
    /// A built-in template, or one from a MindSpeed-format JSON file.
    pub fn load(name: &str, path: Option<&std::path::Path>) -> Result<Template, TemplateError> {
        let list = match path {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|source| TemplateError::Read {
                    path: p.to_path_buf(),
                    source,
                })?;
                parse_list(&text, p.display().to_string())?
            }
            None => parse_list(BUILTIN, BUILTIN_ORIGIN.into())?,
        };
        let entry = list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some(name))
            .ok_or_else(|| {
                let names: Vec<&str> = list
                    .iter()
                    .filter_map(|t| t.get("name")?.as_str())
                    .collect();
                TemplateError::Unknown {
                    name: name.to_string(),
                    available: names.join(", "),
                }
            })?;
        Template::from_json(name, entry)
    }

    /// `register_custom_template` + `_register_template`: the entry's formatters, or the defaults.
    fn from_json(name: &str, e: &Value) -> Result<Template, TemplateError> {
        let entry_error = |key: &str, problem: &str| TemplateError::Entry {
            at: format!("{name}.{key}"),
            problem: problem.to_string(),
        };
        let formatter =
            |key: &str, kind: FormatterKind| -> Result<Option<Vec<Slot>>, TemplateError> {
                let slots = parse_slots(e.get(key), &format!("{name}.{key}"))?;
                match slots.as_deref().and_then(|s| slots_problem(s, kind)) {
                    Some(problem) => Err(entry_error(key, problem)),
                    None => Ok(slots),
                }
            };
        let efficient_eos = truthy(e.get("efficient_eos"));
        let eos_slots = if efficient_eos {
            vec![]
        } else {
            vec![Slot::EOS]
        };
        let content = || Slot::Text("{{content}}".into());
        let user = formatter("format_user", FormatterKind::String)?;
        let class = TemplateClass::parse(name, e.get("template_class"))?;
        let system =
            formatter("format_system", FormatterKind::String)?.unwrap_or_else(|| vec![content()]);
        if class == TemplateClass::Llama2 && !matches!(system.first(), Some(Slot::Text(_))) {
            return Err(entry_error(
                "format_system",
                "Llama2Template puts the system formatter's first slot, a string, in the first user message",
            ));
        }
        // format_tools is never applied (mindkit reads no tools column), but upstream refuses
        // one without a tool_format when it builds the template.
        if truthy(e.get("format_tools"))
            && !truthy(e.get("format_tools").and_then(|t| t.get("tool_format")))
        {
            return Err(entry_error("format_tools", "tool format was not found"));
        }
        let function = match (name, e.get("format_function")) {
            ("deepseek4", _) | (_, None) => None,
            ("qwen3" | "bailing_mini", Some(f)) if truthy(Some(f)) => {
                let Some(Value::String(tool_format)) = f.get("tool_format") else {
                    return Err(entry_error(
                        "format_function",
                        "needs a \"tool_format\" string",
                    ));
                };
                formatter("format_function", FormatterKind::String)?.map(|slots| {
                    FunctionFormat::Think {
                        slots,
                        tool_format: tool_format.clone(),
                    }
                })
            }
            _ => formatter("format_function", FormatterKind::Function)?.map(FunctionFormat::Plain),
        };
        let function = function.unwrap_or_else(|| {
            let mut s = vec![Slot::Text(
                "Action: {{name}}\nAction Input: {{arguments}}".into(),
            )];
            s.extend(eos_slots.clone());
            FunctionFormat::Plain(s)
        });
        let default_system = match e.get("default_system") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
                a.iter().filter_map(Value::as_str).collect()
            }
            Some(_) => {
                return Err(entry_error(
                    "default_system",
                    "expected a string or a list of strings",
                ))
            }
        };
        let thought_words = match strings(e, "thought_words", name)?.as_deref() {
            None | Some([]) => ("<think>\n".to_string(), "\n</think>\n\n".to_string()),
            Some([open, close]) if !open.is_empty() && !close.is_empty() => {
                (open.clone(), close.clone())
            }
            Some(_) => {
                return Err(entry_error(
                    "thought_words",
                    "expected two non-empty strings",
                ))
            }
        };
        let stop_words = strings(e, "stop_words", name)?.unwrap_or_default();
        if stop_words.iter().any(String::is_empty) {
            return Err(entry_error("stop_words", "a stop word is empty"));
        }
        Ok(Template {
            name: name.to_string(),
            system,
            observation: formatter("format_observation", FormatterKind::String)?
                .or_else(|| user.clone())
                .unwrap_or_else(|| vec![content()]),
            separator: formatter("format_separator", FormatterKind::Empty)?.unwrap_or_default(),
            prefix: formatter("format_prefix", FormatterKind::Empty)?.unwrap_or_default(),
            user: user.unwrap_or_else(|| vec![content()]),
            assistant: formatter("format_assistant", FormatterKind::String)?.unwrap_or_else(|| {
                let mut s = vec![content()];
                s.extend(eos_slots.clone());
                s
            }),
            function,
            default_system,
            stop_words,
            efficient_eos,
            replace_eos: truthy(e.get("replace_eos")),
            thought_words,
            enable_thinking: None,
            reasoning_effort: None,
            drop_thinking: true,
            class,
        })
    }

    /// MindSpeed-LLM's `--enable-thinking` (true, false, or none: the default); it changes only
    /// how a `ReasoningTemplate` or `DeepSeek4Template` treats thoughts.
    pub fn with_enable_thinking(mut self, enable_thinking: Option<bool>) -> Template {
        self.enable_thinking = enable_thinking;
        self
    }

    /// MindSpeed-LLM's `--reasoning-effort` (default none) and `--drop-thinking` (default true);
    /// only a `DeepSeek4Template` reads them.
    pub fn with_reasoning(
        mut self,
        reasoning_effort: Option<ReasoningEffort>,
        drop_thinking: bool,
    ) -> Template {
        self.reasoning_effort = reasoning_effort;
        self.drop_thinking = drop_thinking;
        self
    }

    /// The template class.
    pub fn class(&self) -> TemplateClass {
        self.class
    }

    /// MindSpeed's `fix_model_tokenizer`: with `replace_eos` the first stop word becomes eos (added
    /// as a special token when the vocabulary lacks it); a tokenizer without eos gets
    /// `<|endoftext|>`; pad defaults to eos; the other stop words become special tokens.
    pub fn fix_tokenizer(&self, tok: &mut Tokenizer) -> Result<(), TemplateError> {
        let stop_word_error = |source| TemplateError::StopWord {
            name: self.name.clone(),
            source,
        };
        let mut stop_words = self.stop_words.as_slice();
        if self.replace_eos {
            let (first, rest) = stop_words
                .split_first()
                .ok_or_else(|| TemplateError::Entry {
                    at: self.name.clone(),
                    problem: "stop words are required to replace the EOS token".into(),
                })?;
            tok.set_eos(first).map_err(stop_word_error)?;
            stop_words = rest;
        }
        if tok.eos().is_none() {
            tok.set_eos("<|endoftext|>").map_err(stop_word_error)?;
        }
        if let (None, Some(eos)) = (tok.pad(), tok.eos()) {
            tok.set_pad(eos);
        }
        for word in stop_words {
            tok.add_special_token(word).map_err(stop_word_error)?;
        }
        Ok(())
    }
}

/// A chat role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// user
    User,
    /// assistant
    Assistant,
    /// observation (tool output)
    Observation,
    /// function (tool call)
    Function,
    /// system, after the first message: only OpenAI records keep one (`convert_openai_to_intermediate`
    /// maps the role; the ShareGPT converter skips such records). Only `DeepSeek4Template` renders it.
    System,
}

/// A chat message.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// Who speaks.
    pub role: Role,
    /// What is said.
    pub content: String,
    /// The structured fields of an OpenAI record's message, when it has any (deepseek4 only).
    pub extra: Option<Box<MessageExtra>>,
}

impl Message {
    /// A message of role and text alone.
    pub fn new(role: Role, content: &str) -> Message {
        Message {
            role,
            content: content.to_string(),
            extra: None,
        }
    }
}

/// What `convert_openai_to_intermediate` passes on beyond role and content (`tool_calls`,
/// `tool_call_id`, `reasoning_content`, each unless null), and a tool message's content given as
/// a list of parts. As read from the record: only `DeepSeek4Template` renders them (and checks
/// them); the slot templates ignore them, as upstream's do.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MessageExtra {
    /// Where the message is in the record (`messages[3]`), for errors.
    pub path: String,
    /// `tool_calls`.
    pub tool_calls: Option<Value>,
    /// `tool_call_id`.
    pub tool_call_id: Option<Value>,
    /// `reasoning_content`.
    pub reasoning_content: Option<Value>,
    /// The content when it is a list of parts (`content` is then empty).
    pub content_parts: Option<Vec<Value>>,
}

impl Template {
    /// `_convert_elements_to_ids`: each element encoded on its own, then concatenated.
    fn to_ids(&self, tok: &Tokenizer, elements: &[Slot]) -> Result<Vec<i64>, RecordError> {
        let mut ids = Vec::new();
        for e in elements {
            match e {
                Slot::Text(t) if !t.is_empty() => {
                    ids.extend(tok.encode(t, false)?.into_iter().map(i64::from))
                }
                Slot::Text(_) => {}
                Slot::Token(t) => ids.push(i64::from(tok.token_id_or_unk(t).ok_or_else(|| {
                    RecordError::invalid(
                        "tokenizer error",
                        format!(
                            "template {}: token {t:?} is not in the vocabulary and the tokenizer \
                             has no unk token",
                            self.name
                        ),
                    )
                })?)),
                Slot::Special { bos, eos } => {
                    let id = match (tok.bos(), tok.eos()) {
                        (Some(b), _) if *bos => Some(b),
                        (_, Some(e)) if *eos => Some(e),
                        _ => None,
                    };
                    ids.extend(id.map(i64::from));
                }
            }
        }
        Ok(ids)
    }

    /// `_encode`: each message's ids; the first message gets the prefix and the system block
    /// (inside the user text for llama2), later user turns the separator (not for LFDefault).
    fn encode_messages(
        &self,
        tok: &Tokenizer,
        messages: &[Message],
        system: &str,
    ) -> Result<Vec<Vec<i64>>, RecordError> {
        let system = if system.is_empty() {
            self.default_system.as_str()
        } else {
            system
        };
        let llama2 = self.class == TemplateClass::Llama2;
        let mut encoded = Vec::with_capacity(messages.len());
        for (i, m) in messages.iter().enumerate() {
            let mut elements = Vec::new();
            let mut system_text = String::new();
            if i == 0 {
                elements.extend(self.prefix.iter().cloned());
                if !system.is_empty() {
                    let formatted = apply(&self.system, system, None);
                    match formatted.first() {
                        Some(Slot::Text(t)) if llama2 => system_text = t.clone(),
                        _ => elements.extend(formatted),
                    }
                }
            } else if i % 2 == 0 && self.class != TemplateClass::LfDefault {
                elements.extend(self.separator.iter().cloned());
            }
            let idx = (i / 2).to_string();
            elements.extend(match m.role {
                Role::User if llama2 => {
                    apply(&self.user, &format!("{system_text}{}", m.content), None)
                }
                Role::User => apply(&self.user, &m.content, Some(&idx)),
                Role::Assistant => apply(&self.assistant, &m.content, None),
                Role::Observation => apply(&self.observation, &m.content, None),
                Role::Function => self.function.apply(&self.name, &m.content)?,
                Role::System => return Err(self.system_after_first(i)),
            });
            encoded.push(self.to_ids(tok, &elements)?);
        }
        Ok(encoded)
    }

    /// `_encode` raises on a system message after the first (only OpenAI records keep one).
    fn system_after_first(&self, i: usize) -> RecordError {
        RecordError::invalid(
            "unsupported role",
            format!(
                "message {i} is a system message after the first, which MindSpeed-LLM's template \
                 {} raises on (only deepseek4 renders one)",
                self.name
            ),
        )
    }

    /// `remove_thought`: every `thought_words[0] … thought_words[1]` block (shortest match)
    /// removed, then leading newlines.
    fn remove_thought(&self, content: &str) -> String {
        let (open, close) = (&self.thought_words.0, &self.thought_words.1);
        let mut out = String::with_capacity(content.len());
        let mut rest = content;
        while let Some(start) = rest.find(open.as_str()) {
            let after = start + open.len();
            let Some(end) = rest[after..].find(close.as_str()) else {
                break;
            };
            out.push_str(&rest[..start]);
            rest = &rest[after + end + close.len()..];
        }
        out.push_str(rest);
        out.trim_start_matches('\n').to_string()
    }

    /// `encode_multiturn`: (source, target) id pairs, truncated to `cutoff_len` by the class's
    /// `_make_pairs`. `tools`: the handler's tools text, which only deepseek4 reads (mindkit has no
    /// `format_tools` for the slot templates, whose handlers read no tools column).
    pub fn encode_multiturn(
        &self,
        tok: &Tokenizer,
        messages: &[Message],
        system: &str,
        tools: &str,
        cutoff_len: usize,
    ) -> Result<Vec<TurnIds>, RecordError> {
        match self.class {
            TemplateClass::Plain | TemplateClass::Llama2 => Ok(make_pairs(
                self.encode_messages(tok, messages, system)?,
                cutoff_len,
                1,
                Truncation::InferMaxLen,
            )),
            TemplateClass::LfDefault => Ok(make_pairs(
                self.encode_messages(tok, messages, system)?,
                cutoff_len,
                1,
                Truncation::InferSeqlen,
            )),
            TemplateClass::Reasoning => Ok(make_pairs(
                self.encode_reasoning(tok, messages, system)?,
                cutoff_len,
                1,
                Truncation::InferSeqlen,
            )),
            TemplateClass::DeepSeek4 => deepseek4::encode_multiturn(
                tok,
                messages,
                system,
                tools,
                cutoff_len,
                Deepseek4Thinking {
                    enable_thinking: self.enable_thinking,
                    reasoning_effort: self.reasoning_effort,
                    drop_thinking: self.drop_thinking,
                },
            ),
        }
    }

    /// `encode_oneturn` (what MindSpeed-LLM's pairwise handlers call): every message but the
    /// last as the prompt, the last (an answer) as the response, never truncated. The reasoning
    /// template strips the thoughts of earlier answers always, the last's only with
    /// `enable_thinking` false, and gives the empty thought to the last answer alone
    /// (`ReasoningTemplate.encode_oneturn`); deepseek4's is not built.
    pub fn encode_oneturn(
        &self,
        tok: &Tokenizer,
        messages: &[Message],
        system: &str,
    ) -> Result<TurnIds, RecordError> {
        let Some(last) = messages.len().checked_sub(1) else {
            return Ok((Vec::new(), Vec::new()));
        };
        let mut messages = messages.to_vec();
        let reasoning = self.class == TemplateClass::Reasoning;
        match self.class {
            TemplateClass::DeepSeek4 => {
                return Err(RecordError::invalid(
                    "unsupported template",
                    "the deepseek4 template's single-turn encoding (pairwise data) is not built",
                ))
            }
            TemplateClass::Reasoning => {
                for m in messages
                    .iter_mut()
                    .take(last.saturating_sub(1))
                    .skip(1)
                    .step_by(2)
                {
                    m.content = self.remove_thought(&m.content);
                }
                if self.enable_thinking == Some(false) {
                    messages[last].content = self.remove_thought(&messages[last].content);
                }
            }
            _ => {}
        }
        let mut encoded = self.encode_messages(tok, &messages, system)?;
        let mut answer = encoded.pop().unwrap_or_default();
        let mut prompt = encoded.concat();
        if reasoning && !self.has_thought_words(&messages[last].content) {
            self.add_empty_thought(&self.empty_thought(tok)?, &mut prompt, &mut answer);
        }
        Ok((prompt, answer))
    }

    /// Whether an answer holds either thought word.
    fn has_thought_words(&self, content: &str) -> bool {
        let (open, close) = &self.thought_words;
        content.contains(open.as_str()) || content.contains(close.as_str())
    }

    /// The empty thought's ids: `thought_words[0] + thought_words[1]`, encoded on its own.
    fn empty_thought(&self, tok: &Tokenizer) -> Result<Vec<i64>, RecordError> {
        let (open, close) = &self.thought_words;
        Ok(widen(&tok.encode(&format!("{open}{close}"), false)?))
    }

    /// The empty thought given to an answer without thought words: at the end of its prompt,
    /// untrained, unless `enable_thinking` is true, which puts it at the start of the answer,
    /// trained.
    fn add_empty_thought(&self, empty: &[i64], prompt: &mut Vec<i64>, answer: &mut Vec<i64>) {
        match self.enable_thinking == Some(true) {
            true => _ = answer.splice(0..0, empty.iter().copied()),
            false => prompt.extend(empty),
        }
    }

    /// `ReasoningTemplate.encode_multiturn` before `_make_pairs`. With `enable_thinking` false
    /// every answer loses its thoughts; then an answer holding neither thought word gets the
    /// empty thought (`thought_words[0] + thought_words[1]`, encoded on its own): at the end of
    /// its prompt, untrained, unless `enable_thinking` is true, which puts it at the start of
    /// the answer, trained. Thoughts of earlier turns are kept unless it is false.
    fn encode_reasoning(
        &self,
        tok: &Tokenizer,
        messages: &[Message],
        system: &str,
    ) -> Result<Vec<Vec<i64>>, RecordError> {
        let mut messages = messages.to_vec();
        if self.enable_thinking == Some(false) {
            for m in messages.iter_mut().skip(1).step_by(2) {
                m.content = self.remove_thought(&m.content);
            }
        }
        let mut encoded = self.encode_messages(tok, &messages, system)?;
        let empty = self.empty_thought(tok)?;
        for (i, answer) in messages.iter().enumerate().skip(1).step_by(2) {
            if !self.has_thought_words(&answer.content) {
                let (prompts, answers) = encoded.split_at_mut(i);
                self.add_empty_thought(&empty, &mut prompts[i - 1], &mut answers[0]);
            }
        }
        Ok(encoded)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_upstream_template_is_built_in() {
        let names = builtin_names();
        assert_eq!(names.len(), 34);
        for name in &names {
            Template::load(name, None).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        for name in [
            "qwen3",
            "glm4_moe",
            "magistral",
            "deepseek3",
            "cpm",
            "gpt_oss",
            "qwen_lf",
        ] {
            assert!(names.iter().any(|n| n == name), "{name}");
        }
        let e = Template::load("nope", None).unwrap_err().to_string();
        assert!(e.contains("available: chatglm2, chatglm3"), "{e}");
    }

    #[test]
    fn template_classes_are_read_from_the_entries() {
        let class = |n: &str| Template::load(n, None).unwrap().class();
        assert_eq!(class("qwen3"), TemplateClass::Reasoning);
        assert_eq!(class("gpt_oss"), TemplateClass::Reasoning);
        assert_eq!(class("qwen_lf"), TemplateClass::LfDefault);
        assert_eq!(class("llama2"), TemplateClass::Llama2);
        assert_eq!(class("deepseek3"), TemplateClass::Plain);
        let gpt_oss = Template::load("gpt_oss", None).unwrap();
        assert_eq!(gpt_oss.thought_words.0, "<|channel|>analysis<|message|>");
        let qwen3 = Template::load("qwen3", None).unwrap();
        assert_eq!(
            qwen3.thought_words,
            ("<think>\n".into(), "\n</think>\n\n".into())
        );
    }

    #[test]
    fn deepseek4_is_its_own_class_with_the_end_of_sentence_stop_word() {
        let t = Template::load("deepseek4", None).unwrap();
        assert_eq!(t.class(), TemplateClass::DeepSeek4);
        assert_eq!(t.stop_words, ["<｜end▁of▁sentence｜>"]);
        assert!(!t.efficient_eos && !t.replace_eos);
    }

    #[test]
    fn empty_has_no_eos_alpaca_has() {
        let empty = Template::load("empty", None).unwrap();
        assert_eq!(empty.assistant, vec![Slot::Text("{{content}}".into())]);
        let alpaca = Template::load("alpaca", None).unwrap();
        assert_eq!(alpaca.assistant.last(), Some(&Slot::EOS));
        // An explicit assistant formatter gets no eos: qwen3 ends its answers with <|im_end|>\n.
        let qwen3 = Template::load("qwen3", None).unwrap();
        assert_eq!(
            qwen3.assistant,
            vec![Slot::Text("{{content}}<|im_end|>\n".into())]
        );
    }

    #[test]
    fn malformed_formatters_are_refused_as_upstream_does() {
        let load = |entry: &str| {
            let v: Value = serde_json::from_str(entry).unwrap();
            Template::from_json("t", &v)
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        assert!(load(r#"{"format_user": {"slots": ["no placeholder"]}}"#)
            .unwrap_err()
            .contains("placeholder is required"));
        assert!(load(r#"{"format_prefix": {"slots": ["{{content}}"]}}"#)
            .unwrap_err()
            .contains("should not contain"));
        assert!(load(r#"{"format_function": {"slots": ["{{name}}"]}}"#)
            .unwrap_err()
            .contains("name and arguments"));
        assert!(load(r#"{"template_class": "Foo"}"#)
            .unwrap_err()
            .contains("not a template class"));
        load(r#"{"format_user": {}, "template_class": "LFDefaultTemplate"}"#).unwrap();
    }

    #[test]
    fn remove_thought_takes_shortest_blocks_and_leading_newlines() {
        let t = Template::load("qwen3", None).unwrap();
        assert_eq!(
            t.remove_thought("<think>\na\n</think>\n\n\nX<think>\nb\n</think>\n\nY"),
            "XY"
        );
        // Markers without their newlines are not thoughts.
        assert_eq!(t.remove_thought("<think>a</think>X"), "<think>a</think>X");
        assert_eq!(
            t.remove_thought("\n<think>\nopen only"),
            "<think>\nopen only"
        );
    }
}
