//! MindSpeed-LLM's `Prompter(AlpacaTemplate)` handlers (`mindspeed_llm/tasks/preprocess/
//! data_handler.py`: GeneralInstructionHandler, BelleMultiTurnInstructionHandler,
//! MOSSInstructionHandler; the same logic since AscendSpeed 2023).
//!
//! The prompt is `"\n" + SYSTEM + "\n"` then, per message, `"### Instruction:\n" + content + "\n"`
//! or `"### Response:\n" + content + "\n"`. The whole string is tokenized with special tokens
//! (BOS for LLaMA); the labels of the first `len(tok(prefix))` tokens are `-100`, where
//! `prefix` is the prompt up to and including the **last** `"### Response:\n"`.

use serde_json::{Map, Value};

use super::{
    instruction_document, opt_str_field, py_strip, str_field, widen, Document, Handler,
    RecordError, IGNORE, INSTRUCTION_KEYS,
};
use crate::data::tokenizer::Tokenizer;

const USER_TOKEN: &str = "### Instruction:";
const ASSISTANT_TOKEN: &str = "### Response:";
const SYSTEM: &str = "Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request. Please note that you need to think through your response logically and step by step.";

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq)]
pub enum Turn {
    /// A user message.
    User(String),
    /// An assistant message.
    Assistant(String),
}

/// `Prompter.generate_training_prompt`.
pub fn training_prompt(turns: &[Turn]) -> String {
    let mut prompt = format!("\n{SYSTEM}\n");
    for t in turns {
        let (token, content) = match t {
            Turn::User(c) => (USER_TOKEN, c),
            Turn::Assistant(c) => (ASSISTANT_TOKEN, c),
        };
        prompt.push_str(token);
        prompt.push('\n');
        prompt.push_str(content);
        prompt.push('\n');
    }
    prompt
}

/// Python's `labels[:n] = [-100] * n` (which also lengthens a shorter list).
fn mask_prefix(labels: &mut Vec<i64>, n: usize) {
    let n_kept = n.min(labels.len());
    labels.splice(..n_kept, std::iter::repeat_n(IGNORE, n));
}

/// Tokenize a full prompt and mask everything up to the last response header.
fn tokenize_masked(
    tok: &Tokenizer,
    prompt: &str,
    eod: Option<u32>,
) -> Result<(Vec<i64>, Vec<i64>), RecordError> {
    let mut ids = widen(&tok.encode(prompt, true)?);
    if let Some(e) = eod {
        ids.push(e as i64);
    }
    let mut labels = ids.clone();
    let head = prompt
        .rsplit_once(ASSISTANT_TOKEN)
        .map_or(prompt, |(h, _)| h);
    let user_prompt = format!("{head}{ASSISTANT_TOKEN}\n");
    let n = tok.encode(&user_prompt, true)?.len();
    mask_prefix(&mut labels, n);
    Ok((ids, labels))
}

/// Which record layout the prompter handler reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrompterKind {
    /// `instruction`, `input`, `output` (GeneralInstructionHandler).
    Alpaca,
    /// `instruction` holding `Human:`/`Assistant:` turns, `output` (BelleMultiTurnInstructionHandler).
    Belle,
    /// moss-003-sft `chat` turns (MOSSInstructionHandler): one sequence per turn prefix.
    Moss,
}

/// Prompter-based instruction handler.
pub struct PrompterHandler<'t> {
    /// The tokenizer.
    pub tokenizer: &'t Tokenizer,
    /// Record layout.
    pub kind: PrompterKind,
    /// `--append-eod`: eos appended to ids, mask and labels (not for MOSS, as upstream).
    pub eod: Option<u32>,
}

/// Belle's `_format_msg`: split the history on `Human:` then `Assistant:`, and put `output`
/// in place of the final empty assistant turn.
pub fn belle_turns(instruction: &str, output: &str) -> Result<Vec<Turn>, RecordError> {
    let mut turns = Vec::new();
    for part in instruction.split("Human:").filter(|p| !p.is_empty()) {
        let mut pieces = part.split("Assistant:");
        let first = pieces.next().unwrap_or("");
        match pieces.next() {
            Some(answer) => {
                turns.push(Turn::User(py_strip(first).to_string()));
                turns.push(Turn::Assistant(py_strip(answer).to_string()));
            }
            None => turns.push(Turn::Assistant(py_strip(first).to_string())),
        }
    }
    if turns.pop().is_none() {
        return Err(RecordError::invalid(
            "no turns",
            "field \"instruction\" holds no Human:/Assistant: turns",
        ));
    }
    turns.push(Turn::Assistant(py_strip(output).to_string()));
    Ok(turns)
}

/// MOSS's per-turn cleaning of `chat.turn_i.{Human,MOSS}`.
fn moss_turns(record: &Map<String, Value>) -> Result<Vec<(String, String)>, RecordError> {
    let chat = match record.get("chat") {
        None => return Err(RecordError::missing("chat")),
        Some(Value::Object(c)) => c,
        Some(other) => return Err(RecordError::wrong_type("chat", "an object of turns", other)),
    };
    let mut out = Vec::new();
    for (name, turn) in chat {
        let turn = match turn {
            Value::Null => continue,
            Value::Object(t) if t.is_empty() => continue,
            Value::Object(t) => t,
            other => {
                return Err(RecordError::wrong_type(
                    &format!("chat.{name}"),
                    "an object",
                    other,
                ))
            }
        };
        let field = |k: &str| {
            str_field(turn, k)
                .map_err(|e| RecordError::invalid(e.reason, format!("chat.{name}: {}", e.detail)))
        };
        let user = field("Human")?
            .replace("<eoh>", "")
            .replace("<|Human|>: ", "");
        let assistant = field("MOSS")?.replace("<|MOSS|>:", "").replace("<eom>", "");
        out.push((
            py_strip(&user).to_string(),
            py_strip(&assistant).to_string(),
        ));
    }
    Ok(out)
}

impl Handler for PrompterHandler<'_> {
    fn keys(&self) -> Vec<String> {
        INSTRUCTION_KEYS.iter().map(|s| s.to_string()).collect()
    }

    fn columns(&self) -> Vec<String> {
        let fields: &[&str] = match self.kind {
            PrompterKind::Alpaca => &["instruction", "input", "output"],
            PrompterKind::Belle => &["instruction", "output"],
            PrompterKind::Moss => &["chat"],
        };
        fields.iter().map(|s| s.to_string()).collect()
    }

    fn process(&self, record: &Map<String, Value>) -> Result<Document, RecordError> {
        let turns = match self.kind {
            PrompterKind::Alpaca => {
                let user = format!(
                    "{}\n{}",
                    str_field(record, "instruction")?,
                    opt_str_field(record, "input")?
                );
                vec![
                    Turn::User(user),
                    Turn::Assistant(str_field(record, "output")?.to_string()),
                ]
            }
            PrompterKind::Belle => belle_turns(
                str_field(record, "instruction")?,
                str_field(record, "output")?,
            )?,
            PrompterKind::Moss => return self.moss(record),
        };
        let (ids, labels) = tokenize_masked(self.tokenizer, &training_prompt(&turns), self.eod)?;
        Ok(instruction_document(ids, labels))
    }
}

impl PrompterHandler<'_> {
    fn moss(&self, record: &Map<String, Value>) -> Result<Document, RecordError> {
        let mut turns = Vec::new();
        let mut doc: Document = vec![Vec::new(), Vec::new(), Vec::new()];
        for (user, assistant) in moss_turns(record)? {
            turns.push(Turn::User(user));
            turns.push(Turn::Assistant(assistant));
            let (ids, labels) = tokenize_masked(self.tokenizer, &training_prompt(&turns), None)?;
            doc[1].push(vec![1; ids.len()]);
            doc[0].push(ids);
            doc[2].push(labels);
        }
        Ok(doc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn belle_split_matches_upstream() {
        let t = belle_turns(
            "Human: hi\nAssistant: hello\nHuman: bye\nAssistant:",
            " ok ",
        )
        .unwrap();
        assert_eq!(
            t,
            vec![
                Turn::User("hi".into()),
                Turn::Assistant("hello".into()),
                Turn::User("bye".into()),
                Turn::Assistant("ok".into()),
            ]
        );
        assert!(belle_turns("", "x").is_err());
    }

    #[test]
    fn mask_prefix_is_python_slice_assignment() {
        let mut l = vec![1, 2, 3];
        mask_prefix(&mut l, 2);
        assert_eq!(l, vec![-100, -100, 3]);
        let mut l = vec![1];
        mask_prefix(&mut l, 3);
        assert_eq!(l, vec![-100, -100, -100]);
    }

    #[test]
    fn prompt_layout() {
        let p = training_prompt(&[Turn::User("q\n".into()), Turn::Assistant("a".into())]);
        assert!(p.starts_with("\nBelow is an instruction"));
        assert!(p.ends_with("step.\n### Instruction:\nq\n\n### Response:\na\n"));
    }
}
