//! BoolQ as the harness's `boolq` task (`docs/evaluation.md` §1.2): context
//! `"{passage}\nQuestion: {question}?\nAnswer:"`, continuations `" no"` / `" yes"`, 0-shot.
//! Reads the original release (`answer`: bool) and the SuperGLUE / HF layouts (`label`: 0/1,
//! bool, or the strings "true"/"false"), as jsonl, json or parquet.

use super::{read_records, text_field, ChoiceDoc};
use crate::data::source::Record;
use anyhow::{anyhow, bail, Result};
use serde_json::Value as Json;
use std::path::Path;

/// The answer of a record: 1 for yes, 0 for no.
fn gold(r: &Record) -> Result<usize> {
    let value = r
        .fields
        .get("label")
        .or_else(|| r.fields.get("answer"))
        .ok_or_else(|| anyhow!("{}: no \"label\" or \"answer\" field", r.loc))?;
    match value {
        Json::Bool(b) => Ok(usize::from(*b)),
        Json::Number(n) if n.as_u64() == Some(0) || n.as_u64() == Some(1) => {
            Ok(n.as_u64().unwrap_or(0) as usize)
        }
        Json::String(s) if s.eq_ignore_ascii_case("true") => Ok(1),
        Json::String(s) if s.eq_ignore_ascii_case("false") => Ok(0),
        other => bail!(
            "{}: the answer {other} is not a boolean, 0/1 or \"true\"/\"false\"",
            r.loc
        ),
    }
}

/// The documents of a BoolQ file (or directory).
pub fn load(path: &Path, num_fewshot: Option<usize>) -> Result<Vec<ChoiceDoc>> {
    if num_fewshot.unwrap_or(0) != 0 {
        bail!("boolq is evaluated 0-shot (as the harness does by default); drop --num-fewshot");
    }
    read_records(path)?
        .iter()
        .map(|r| {
            Ok(ChoiceDoc {
                context: format!(
                    "{}\nQuestion: {}?\nAnswer:",
                    text_field(r, "passage")?,
                    text_field(r, "question")?
                ),
                choices: vec![" no".into(), " yes".into()],
                gold: gold(r)?,
                subject: None,
            })
        })
        .collect()
}
