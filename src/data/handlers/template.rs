//! `--prompt-type` chat templates, as MindSpeed-LLM defines them (`configs/finetune/
//! templates.json`, read by `mindspeed_llm/tasks/preprocess/templates.py`, which follows
//! LLaMA-Factory 0.8.2). A template is data: formatters made of slots. The built-in ones
//! below use the same JSON schema as MindSpeed's file, and `--prompt-type-path` loads a
//! user's file in that schema.

use serde_json::Value;

use super::RecordError;
use crate::data::tokenizer::{HfTokenizer, TokenizerError};

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
    /// The template's stop word is not a token of the tokenizer.
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

/// One formatter slot.
#[derive(Debug, Clone, PartialEq)]
pub enum Slot {
    /// Text with `{{content}}` / `{{idx}}` placeholders, encoded without special tokens.
    Text(String),
    /// `{"token": "<x>"}`: a vocabulary token by name.
    Token(String),
    /// `["bos_token"]`: the tokenizer's bos id, if any.
    Bos,
    /// `["eos_token"]`: the tokenizer's eos id, if any.
    Eos,
}

/// Template variants that change how the system prompt is placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateClass {
    /// `Template`: system formatted before the first user message.
    Plain,
    /// `Llama2Template`: system text placed inside the first user message.
    Llama2,
}

/// A chat template.
#[derive(Debug, Clone)]
pub struct Template {
    /// Its name.
    pub name: String,
    user: Vec<Slot>,
    assistant: Vec<Slot>,
    system: Vec<Slot>,
    function: Vec<Slot>,
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
    class: TemplateClass,
}

/// The built-in templates (a subset of MindSpeed's templates.json, same schema).
const BUILTIN: &str = r####"[
 {"name": "empty", "format_user": {"slots": ["{{content}}"]}, "format_assistant": {"slots": ["{{content}}"]}},
 {"name": "default", "format_user": {"slots": ["Human: {{content}}\nAssistant:"]}, "format_system": {"slots": ["{{content}}\n"]}, "format_separator": {"slots": ["\n"]}},
 {"name": "alpaca", "format_user": {"slots": ["### Instruction:\n{{content}}\n\n### Response:\n"]}, "format_separator": {"slots": ["\n\n"]}, "default_system": "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"},
 {"name": "llama2", "format_user": {"slots": [["bos_token"], "[INST] {{content}} [/INST]"]}, "format_system": {"slots": ["<<SYS>>\n{{content}}\n<</SYS>>\n\n"]}, "template_class": "Llama2Template"},
 {"name": "chatml", "format_user": {"slots": ["<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n"]}, "format_system": {"slots": ["<|im_start|>system\n{{content}}<|im_end|>\n"]}, "format_observation": {"slots": ["<|im_start|>tool\n{{content}}<|im_end|>\n<|im_start|>assistant\n"]}, "format_separator": {"slots": ["\n"]}, "stop_words": ["<|im_end|>", "<|im_start|>"], "replace_eos": true},
 {"name": "qwen", "format_user": {"slots": ["<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n"]}, "format_system": {"slots": ["<|im_start|>system\n{{content}}<|im_end|>\n"]}, "format_observation": {"slots": ["<|im_start|>tool\n{{content}}<|im_end|>\n<|im_start|>assistant\n"]}, "format_separator": {"slots": ["\n"]}, "default_system": "You are a helpful assistant.", "stop_words": ["<|im_end|>"], "replace_eos": true},
 {"name": "llama3", "format_user": {"slots": ["<|start_header_id|>user<|end_header_id|>\n\n{{content}}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"]}, "format_system": {"slots": ["<|start_header_id|>system<|end_header_id|>\n\n{{content}}<|eot_id|>"]}, "format_observation": {"slots": ["<|start_header_id|>tool<|end_header_id|>\n\n{{content}}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"]}, "format_prefix": {"slots": [["bos_token"]]}, "stop_words": ["<|eot_id|>"], "replace_eos": true},
 {"name": "mistral", "format_user": {"slots": ["[INST] {{content}} [/INST]"]}, "format_prefix": {"slots": [["bos_token"]]}}
]"####;

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

fn parse_slots(v: Option<&Value>, at: &str) -> Result<Option<Vec<Slot>>, TemplateError> {
    let Some(v) = v else { return Ok(None) };
    let invalid = |problem: String| TemplateError::Entry {
        at: at.to_string(),
        problem,
    };
    let slots = v
        .get("slots")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid("expected {\"slots\": [...]}".into()))?;
    slots
        .iter()
        .map(|s| match s {
            Value::String(t) => Ok(Slot::Text(t.clone())),
            Value::Object(o) => o
                .get("token")
                .and_then(Value::as_str)
                .map(|t| Slot::Token(t.to_string()))
                .ok_or_else(|| invalid("object slot needs \"token\"".into())),
            Value::Array(a) => match a.first().and_then(Value::as_str) {
                Some("bos_token") => Ok(Slot::Bos),
                Some("eos_token") => Ok(Slot::Eos),
                _ => Err(invalid(format!("unknown set slot {s}"))),
            },
            _ => Err(invalid(format!("unsupported slot {s}"))),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
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

    fn from_json(name: &str, e: &Value) -> Result<Template, TemplateError> {
        let flag = |k: &str| e.get(k).and_then(Value::as_bool).unwrap_or(false);
        let efficient_eos = flag("efficient_eos");
        let eos_slots = if efficient_eos {
            vec![]
        } else {
            vec![Slot::Eos]
        };
        let slots = |k: &str| parse_slots(e.get(k), &format!("{name}.{k}"));
        let user = slots("format_user")?.unwrap_or_else(|| vec![Slot::Text("{{content}}".into())]);
        let assistant = slots("format_assistant")?.unwrap_or_else(|| {
            let mut s = vec![Slot::Text("{{content}}".into())];
            s.extend(eos_slots.clone());
            s
        });
        let function = slots("format_function")?.unwrap_or_else(|| {
            let mut s = vec![Slot::Text(
                "Action: {{name}}\nAction Input: {{arguments}}".into(),
            )];
            s.extend(eos_slots.clone());
            s
        });
        let default_system = match e.get("default_system") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
            _ => String::new(),
        };
        let class = match e.get("template_class").and_then(Value::as_str) {
            Some("Llama2Template") => TemplateClass::Llama2,
            None | Some("Template") => TemplateClass::Plain,
            Some(other) => {
                return Err(TemplateError::Entry {
                    at: name.to_string(),
                    problem: format!("template class {other} is not supported by mindkit"),
                })
            }
        };
        Ok(Template {
            name: name.to_string(),
            // Upstream defaults the system formatter to a bare "{{content}}", not to format_user.
            system: slots("format_system")?
                .unwrap_or_else(|| vec![Slot::Text("{{content}}".into())]),
            observation: slots("format_observation")?.unwrap_or_else(|| user.clone()),
            separator: slots("format_separator")?.unwrap_or_default(),
            prefix: slots("format_prefix")?.unwrap_or_default(),
            user,
            assistant,
            function,
            default_system,
            stop_words: e
                .get("stop_words")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(Value::as_str)
                        .map(String::from)
                        .collect()
                })
                .unwrap_or_default(),
            efficient_eos,
            replace_eos: flag("replace_eos"),
            class,
        })
    }

    /// MindSpeed's `fix_model_tokenizer`: with `replace_eos`, eos becomes the first stop word.
    pub fn fix_tokenizer(&self, tok: &mut HfTokenizer) -> Result<(), TemplateError> {
        if self.replace_eos {
            let stop = self
                .stop_words
                .first()
                .ok_or_else(|| TemplateError::Entry {
                    at: self.name.clone(),
                    problem: "replace_eos needs stop words".into(),
                })?;
            tok.set_eos(stop)
                .map_err(|source| TemplateError::StopWord {
                    name: self.name.clone(),
                    source,
                })?;
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
}

/// A chat message.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// Who speaks.
    pub role: Role,
    /// What is said.
    pub content: String,
}

fn apply(slots: &[Slot], content: &str, idx: Option<&str>) -> Vec<Slot> {
    slots
        .iter()
        .map(|s| match s {
            // Python's str.replace(old, new, 1): content first, then idx.
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

/// `json.dumps(value, ensure_ascii=False)` with Python's default separators.
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
        other => other.to_string(),
    }
}

/// `FunctionFormatter.apply`: content is `{"name", "arguments"}` JSON, else both empty.
fn apply_function(slots: &[Slot], content: &str) -> Vec<Slot> {
    let parsed: Option<(String, String)> =
        serde_json::from_str::<Value>(content).ok().and_then(|f| {
            let name = f.get("name")?;
            let name = name
                .as_str()
                .map(String::from)
                .unwrap_or_else(|| py_json(name));
            Some((name, py_json(f.get("arguments")?)))
        });
    let (name, arguments) = parsed.unwrap_or_default();
    slots
        .iter()
        .map(|s| match s {
            Slot::Text(t) => Slot::Text(
                t.replace("{{name}}", &name)
                    .replace("{{arguments}}", &arguments),
            ),
            other => other.clone(),
        })
        .collect()
}

impl Template {
    fn to_ids(&self, tok: &HfTokenizer, elements: &[Slot]) -> Result<Vec<i64>, RecordError> {
        let mut ids = Vec::new();
        for e in elements {
            match e {
                Slot::Text(t) if !t.is_empty() => {
                    ids.extend(tok.encode(t, false)?.into_iter().map(i64::from))
                }
                Slot::Text(_) => {}
                Slot::Token(t) => ids.push(tok.token_id(t)? as i64),
                Slot::Bos => ids.extend(tok.bos().map(i64::from)),
                Slot::Eos => ids.extend(tok.eos().map(i64::from)),
            }
        }
        Ok(ids)
    }

    /// `Template._encode` + `_make_pairs`: (source, target) id pairs, truncated to `cutoff_len`.
    pub fn encode_multiturn(
        &self,
        tok: &HfTokenizer,
        messages: &[Message],
        system: &str,
        cutoff_len: usize,
    ) -> Result<Vec<TurnIds>, RecordError> {
        let system = if system.is_empty() {
            self.default_system.as_str()
        } else {
            system
        };
        let mut encoded = Vec::with_capacity(messages.len());
        for (i, m) in messages.iter().enumerate() {
            let mut elements = Vec::new();
            let mut system_text = String::new();
            if i == 0 {
                elements.extend(self.prefix.iter().cloned());
                if !system.is_empty() {
                    let formatted = apply(&self.system, system, None);
                    match self.class {
                        TemplateClass::Plain => elements.extend(formatted),
                        TemplateClass::Llama2 => {
                            if let Some(Slot::Text(t)) = formatted.first() {
                                system_text = t.clone();
                            }
                        }
                    }
                }
            } else if i % 2 == 0 {
                elements.extend(self.separator.iter().cloned());
            }
            let idx = (i / 2).to_string();
            elements.extend(match m.role {
                Role::User if self.class == TemplateClass::Llama2 => {
                    apply(&self.user, &format!("{system_text}{}", m.content), None)
                }
                Role::User => apply(&self.user, &m.content, Some(&idx)),
                Role::Assistant => apply(&self.assistant, &m.content, None),
                Role::Observation => apply(&self.observation, &m.content, None),
                Role::Function => apply_function(&self.function, &m.content),
            });
            encoded.push(self.to_ids(tok, &elements)?);
        }
        Ok(make_pairs(encoded, cutoff_len, 1))
    }
}

/// `infer_max_len` of LLaMA-Factory 0.8.2.
fn infer_max_len(
    source_len: usize,
    target_len: usize,
    max_len: usize,
    reserved: usize,
) -> (usize, usize) {
    let max_target = if source_len + target_len == 0 {
        0
    } else {
        (max_len as f64 * (target_len as f64 / (source_len + target_len) as f64)) as usize
    };
    let max_target = max_target.max(reserved);
    let max_source = max_len.saturating_sub(max_target.min(target_len));
    (max_source, max_target)
}

fn make_pairs(
    encoded: Vec<Vec<i64>>,
    cutoff_len: usize,
    reserved: usize,
) -> Vec<(Vec<i64>, Vec<i64>)> {
    let mut pairs = Vec::new();
    let mut total = 0usize;
    let mut it = encoded.into_iter();
    while let (Some(mut source), Some(mut target)) = (it.next(), it.next()) {
        if total >= cutoff_len {
            break;
        }
        let (max_source, max_target) =
            infer_max_len(source.len(), target.len(), cutoff_len - total, reserved);
        source.truncate(max_source);
        target.truncate(max_target);
        total += source.len() + target.len();
        pairs.push((source, target));
    }
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_parse() {
        for name in builtin_names() {
            Template::load(&name, None).unwrap();
        }
        assert!(builtin_names().contains(&"qwen".to_string()));
        let e = Template::load("nope", None).unwrap_err().to_string();
        assert!(e.contains("available: empty, default"), "{e}");
    }

    #[test]
    fn empty_has_no_eos_alpaca_has() {
        let empty = Template::load("empty", None).unwrap();
        assert_eq!(empty.assistant, vec![Slot::Text("{{content}}".into())]);
        let alpaca = Template::load("alpaca", None).unwrap();
        assert_eq!(alpaca.assistant.last(), Some(&Slot::Eos));
    }

    #[test]
    fn python_json_dumps() {
        let v: Value = serde_json::from_str(r#"{"a": [1, "é"], "b": {"c": null}}"#).unwrap();
        assert_eq!(py_json(&v), r#"{"a": [1, "é"], "b": {"c": null}}"#);
    }

    #[test]
    fn truncation_like_llamafactory() {
        assert_eq!(infer_max_len(10, 10, 10, 1), (5, 5));
        assert_eq!(infer_max_len(0, 0, 10, 1), (10, 1));
        let pairs = make_pairs(vec![vec![1; 6], vec![2; 6], vec![3; 4], vec![4; 4]], 10, 1);
        assert_eq!(pairs.len(), 1);
        assert_eq!((pairs[0].0.len(), pairs[0].1.len()), (5, 5));
    }
}
