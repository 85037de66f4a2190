//! Record → token sequences. Each handler turns one input record into one document per
//! output key: a list of sequences (usually one).
//!
//! * [`pretrain`]: Megatron `tools/preprocess_data.py` semantics, one output per `--json-keys` key.
//! * [`prompter`]: MindSpeed-LLM's Alpaca `Prompter` handlers: `alpaca` without
//!   `--prompt-type` (GeneralInstructionHandler), `belle` (BelleMultiTurnInstructionHandler),
//!   `moss` (MOSSInstructionHandler).
//! * [`chat`]: MindSpeed-LLM's LLaMA-Factory-style handlers driven by a `--prompt-type`
//!   [`template`]: `alpaca` with a prompt type (AlpacaStyleInstructionHandler) and `sharegpt`
//!   (SharegptStyleInstructionHandler, OpenAIInstructionHandler for `messages` records), and
//!   their preference-pair forms `alpaca-pairwise` / `sharegpt-pairwise` (DPO data).
//!
//! Instruction handlers write `input_ids`, `attention_mask`, `labels` with prompt tokens
//! masked as `-100` in labels, aligned with `input_ids` (the shift happens in training); the
//! pairwise ones `chosen_input_ids`, `chosen_labels`, `rejected_input_ids`, `rejected_labels`.

pub mod chat;
pub mod pretrain;
pub mod prompter;
pub mod template;

use serde_json::{Map, Value};

/// Label value of tokens that are not trained on.
pub const IGNORE: i64 = -100;

/// Output key names of the instruction handlers, in MindSpeed's order.
pub const INSTRUCTION_KEYS: [&str; 3] = ["input_ids", "attention_mask", "labels"];

/// Why one record could not be turned into tokens.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{detail}")]
pub struct RecordError {
    /// Short category for the summary ("missing field", "wrong type", ...).
    pub reason: &'static str,
    /// Details naming the field.
    pub detail: String,
    /// MindSpeed drops such records silently; mindkit drops and counts them without
    /// needing `--skip-bad-records`.
    pub dropped_upstream: bool,
}

impl RecordError {
    /// A missing field.
    pub fn missing(field: &str) -> Self {
        RecordError {
            reason: "missing field",
            detail: format!("missing field {field:?}"),
            dropped_upstream: false,
        }
    }

    /// A field of the wrong JSON type.
    pub fn wrong_type(field: &str, expected: &str, got: &Value) -> Self {
        RecordError {
            reason: "wrong type",
            detail: format!(
                "field {field:?} should be {expected}, found {}",
                crate::data::source::type_name(got)
            ),
            dropped_upstream: false,
        }
    }

    /// Any other invalid content.
    pub fn invalid(reason: &'static str, detail: impl Into<String>) -> Self {
        RecordError {
            reason,
            detail: detail.into(),
            dropped_upstream: false,
        }
    }

    /// A record MindSpeed-LLM filters out (malformed conversation, no response).
    pub fn dropped(detail: impl Into<String>) -> Self {
        RecordError {
            reason: "malformed conversation",
            detail: detail.into(),
            dropped_upstream: true,
        }
    }
}

impl From<crate::data::tokenizer::TokenizerError> for RecordError {
    fn from(e: crate::data::tokenizer::TokenizerError) -> Self {
        RecordError::invalid("tokenizer error", e.to_string())
    }
}

/// One processed record: for each output key, the sequences of its document.
pub type Document = Vec<Vec<Vec<i64>>>;

/// A record → tokens transformation.
pub trait Handler: Sync + Send {
    /// Output key names; the output files are `{prefix}_{key}_document`.
    fn keys(&self) -> Vec<String>;
    /// The top-level record fields `process` reads: parquet and arrow inputs convert only these
    /// columns (so an unrelated binary column is not decoded as text, nor checked).
    fn columns(&self) -> Vec<String>;
    /// Turn one record into one document per key.
    fn process(&self, record: &Map<String, Value>) -> Result<Document, RecordError>;
}

/// A required string field.
pub fn str_field<'a>(record: &'a Map<String, Value>, field: &str) -> Result<&'a str, RecordError> {
    match record.get(field) {
        None => Err(RecordError::missing(field)),
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(RecordError::wrong_type(field, "a string", other)),
    }
}

/// An optional string field (`null` and absent read as "").
pub fn opt_str_field<'a>(
    record: &'a Map<String, Value>,
    field: &str,
) -> Result<&'a str, RecordError> {
    match record.get(field) {
        None | Some(Value::Null) => Ok(""),
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(RecordError::wrong_type(field, "a string", other)),
    }
}

/// Python's `str.isspace()` for one character (also what `\s` matches in a `str` regex):
/// Unicode White_Space plus the separators U+001C..U+001F.
pub fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.strip()` with no arguments.
pub fn py_strip(s: &str) -> &str {
    s.trim_matches(py_isspace)
}

/// Token ids as i64.
pub fn widen(ids: &[u32]) -> Vec<i64> {
    ids.iter().map(|&t| t as i64).collect()
}

/// A one-sequence instruction document from ids and labels (attention mask all ones).
pub fn instruction_document(input_ids: Vec<i64>, labels: Vec<i64>) -> Document {
    let mask = vec![1; input_ids.len()];
    vec![vec![input_ids], vec![mask], vec![labels]]
}
