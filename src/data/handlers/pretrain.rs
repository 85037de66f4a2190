//! Pretraining text: Megatron-LM `tools/preprocess_data.py` `Encoder.encode` without
//! `--split-sentences`: each `--json-keys` field is tokenized whole, `--append-eod` adds
//! eos to a non-empty document, and an empty document becomes a document with no
//! sequence (a repeated document index), exactly as Megatron writes it.

use serde_json::{Map, Value};

use super::{str_field, widen, Document, Handler, RecordError};
use crate::data::tokenizer::Tokenizer;

/// Megatron pretraining handler.
pub struct Pretrain<'t> {
    /// The tokenizer.
    pub tokenizer: &'t Tokenizer,
    /// Fields to tokenize, one output each.
    pub json_keys: Vec<String>,
    /// Append eos to each non-empty document.
    pub eod: Option<u32>,
    /// Add the tokenizer's special tokens (BOS for LLaMA), as Megatron HEAD does.
    pub add_special_tokens: bool,
}

impl Handler for Pretrain<'_> {
    fn keys(&self) -> Vec<String> {
        self.json_keys.clone()
    }

    fn columns(&self) -> Vec<String> {
        self.json_keys.clone()
    }

    fn process(&self, record: &Map<String, Value>) -> Result<Document, RecordError> {
        let mut doc = Vec::with_capacity(self.json_keys.len());
        for key in &self.json_keys {
            let text = str_field(record, key)?;
            let mut ids = widen(&self.tokenizer.encode(text, self.add_special_tokens)?);
            if ids.is_empty() {
                doc.push(Vec::new());
                continue;
            }
            if let Some(eod) = self.eod {
                ids.push(eod as i64);
            }
            doc.push(vec![ids]);
        }
        Ok(doc)
    }
}
