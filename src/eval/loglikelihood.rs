//! Loglikelihood of continuations, computed the way lm-evaluation-harness's HF backend does
//! (`docs/evaluation.md` §4): context and continuation tokenized as `encode(context)` and
//! `encode(context + continuation)[len(context):]`, the input left-truncated to the model's
//! length, the sum of the continuation tokens' log-softmax, and whether each was the argmax.
//! Requests of a document that share their input run as one sequence (one forward pass scores
//! every single-token choice), and documents run together as a ragged batch.

use crate::data::tokenizer::Tokenizer;
use crate::engine::Backend;
use crate::model::{Model, Step};
use anyhow::{bail, Result};
use std::collections::HashMap;

/// BOS, else EOS (the harness's `prefix_token_id`).
pub fn prefix_token(tokenizer: &Tokenizer) -> Result<u32> {
    match tokenizer.bos().or(tokenizer.eos()) {
        Some(t) => Ok(t),
        None => bail!("the tokenizer defines neither a BOS nor an EOS token"),
    }
}

/// The harness's `tok_encode`: tokenizer defaults (BOS where the tokenizer adds one), except
/// that a string already starting with the BOS text gets no second one.
pub fn harness_encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let prefix = prefix_token(tokenizer)?;
    let starts_with_prefix = tokenizer
        .decode(&[prefix])
        .is_ok_and(|p| !p.is_empty() && text.starts_with(&p));
    Ok(tokenizer.encode(text, !starts_with_prefix)?)
}

/// One continuation to score after a context.
#[derive(Debug, Clone)]
pub struct Request {
    /// The conditioning text.
    pub context: String,
    /// The text whose loglikelihood is wanted.
    pub continuation: String,
}

/// The score of a request.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Score {
    /// Σ log p(continuation token | everything before it).
    pub logprob: f64,
    /// Every continuation token was the most likely one.
    pub is_greedy: bool,
}

/// Scores requests with a model and its tokenizer.
pub struct Scorer<'m, 'b, B: Backend> {
    model: &'m Model<'b, B>,
    tokenizer: &'m Tokenizer,
    /// Longest input (the model's positions, as the harness's `max_length`).
    pub max_length: usize,
    /// Requests whose input was left-truncated so far.
    pub truncated: usize,
}

/// One request, tokenized: its input sequence and the continuation tokens at its end.
struct Tokenized {
    input: Vec<u32>,
    continuation: Vec<u32>,
}

impl<'m, 'b, B: Backend> Scorer<'m, 'b, B> {
    /// A scorer over `model` with inputs of at most `max_length` tokens.
    pub fn new(model: &'m Model<'b, B>, tokenizer: &'m Tokenizer, max_length: usize) -> Self {
        Scorer {
            model,
            tokenizer,
            max_length,
            truncated: 0,
        }
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        harness_encode(self.tokenizer, text)
    }

    fn prefix_token(&self) -> Result<u32> {
        prefix_token(self.tokenizer)
    }

    fn tokenize(&mut self, r: &Request) -> Result<Tokenized> {
        // Trailing whitespace of the context belongs to the continuation (`_encode_pair`).
        let context = r.context.trim_end();
        let continuation = format!("{}{}", &r.context[context.len()..], r.continuation);
        let (ctx, cont) = if context.is_empty() {
            (vec![self.prefix_token()?], self.encode(&continuation)?)
        } else {
            let whole = self.encode(&format!("{context}{continuation}"))?;
            let ctx = self.encode(context)?;
            let cont = whole.get(ctx.len()..).unwrap_or_default().to_vec();
            (ctx, cont)
        };
        if cont.is_empty() || cont.len() > self.max_length {
            bail!(
                "continuation {:?} has {} tokens (1..={} supported)",
                r.continuation,
                cont.len(),
                self.max_length
            );
        }
        let mut all = ctx;
        all.extend_from_slice(&cont);
        if all.len() > self.max_length + 1 {
            self.truncated += 1;
            all.drain(..all.len() - (self.max_length + 1));
        }
        all.pop();
        Ok(Tokenized {
            input: all,
            continuation: cont,
        })
    }

    /// Score the requests of `docs` (each document a list of requests), all in one batch.
    pub fn score(&mut self, docs: &[Vec<Request>]) -> Result<Vec<Vec<Score>>> {
        // Distinct inputs (per document) become the batch's sequences.
        let mut sequences: Vec<Vec<u32>> = Vec::new();
        let mut placed = Vec::new(); // per doc, per request: (sequence, tokenized)
        for doc in docs {
            let mut seen: HashMap<Vec<u32>, usize> = HashMap::new();
            let mut reqs = Vec::with_capacity(doc.len());
            for r in doc {
                let t = self.tokenize(r)?;
                let seq = *seen.entry(t.input.clone()).or_insert_with(|| {
                    sequences.push(t.input.clone());
                    sequences.len() - 1
                });
                reqs.push((seq, t));
            }
            placed.push(reqs);
        }
        // Rows whose logits are needed: the last len(continuation) positions of each input.
        let mut starts = Vec::with_capacity(sequences.len());
        let mut total = 0;
        for s in &sequences {
            starts.push(total);
            total += s.len();
        }
        let mut wanted: Vec<usize> = placed
            .iter()
            .flatten()
            .flat_map(|(seq, t)| {
                let end = starts[*seq] + sequences[*seq].len();
                end - t.continuation.len()..end
            })
            .collect();
        wanted.sort_unstable();
        wanted.dedup();
        let row_of: HashMap<usize, usize> =
            wanted.iter().enumerate().map(|(i, &r)| (r, i)).collect();
        let capacity = sequences.iter().map(Vec::len).max().unwrap_or(1);
        let mut cache = self.model.cache(sequences.len(), capacity)?;
        let steps: Vec<Step> = (sequences.iter().enumerate())
            .map(|(slot, s)| Step {
                slot,
                past: 0,
                tokens: s,
            })
            .collect();
        let backend = self.model.backend();
        let logits = self.model.forward(&mut cache, &steps, &wanted)?;
        let logprobs = backend.download_f32(&backend.log_softmax(&logits)?)?;
        let vocab = self.model.spec.vocab;
        Ok(placed
            .iter()
            .map(|reqs| {
                reqs.iter()
                    .map(|(seq, t)| {
                        let end = starts[*seq] + sequences[*seq].len();
                        let first = end - t.continuation.len();
                        let mut score = Score {
                            logprob: 0.0,
                            is_greedy: true,
                        };
                        for (i, &tok) in t.continuation.iter().enumerate() {
                            let r = row_of[&(first + i)];
                            let row = &logprobs[r * vocab..(r + 1) * vocab];
                            score.logprob += f64::from(row[tok as usize]);
                            score.is_greedy &= crate::model::generate::argmax(row) == tok as usize;
                        }
                        score
                    })
                    .collect()
            })
            .collect())
    }
}
