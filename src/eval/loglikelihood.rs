//! Loglikelihood of continuations, computed the way lm-evaluation-harness's HF backend does
//! (`docs/evaluation.md` §4): context and continuation tokenized as `encode(context)` and
//! `encode(context + continuation)[len(context):]`, the input left-truncated to the model's
//! length, the sum of the continuation tokens' log-softmax, and whether each was the argmax.
//! Requests of a document that share their input run as one sequence (one forward pass scores
//! every single-token choice), and documents run together as a ragged batch.

use crate::data::tokenizer::Tokenizer;
use crate::engine::Backend;
use crate::model::{KvCache, Model, Step};
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
    /// The last batch's first input and its keys and values (one slot): the next batch's
    /// inputs that start with the same tokens (a few-shot context, a shared passage) take
    /// them from here rather than computing them again.
    last: Option<(Vec<u32>, KvCache<B::Tensor>)>,
    /// Input positions taken from [`Scorer::last`] so far, and computed.
    pub positions: (usize, usize),
}

/// Fewer shared positions than this are computed again: not worth the copies.
const MIN_SHARED: usize = 32;

/// How many tokens `a` and `b` begin with in common.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
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
            last: None,
            positions: (0, 0),
        }
    }

    /// How many leading positions every input of `sequences` could take from a cache of
    /// `tokens`: those they all begin with, up to each one's first position whose logits are
    /// wanted (`firsts`); none under [`MIN_SHARED`] or where the rotary embedding changes with
    /// the pass's length.
    fn shareable(&self, tokens: &[u32], sequences: &[Vec<u32>], firsts: &[usize]) -> usize {
        if self.model.spec.rope_depends_on_length() {
            return 0;
        }
        let shared = (sequences.iter().zip(firsts))
            .map(|(s, &first)| common_prefix(tokens, s).min(first))
            .min()
            .unwrap_or(0);
        if shared < MIN_SHARED {
            0
        } else {
            shared
        }
    }

    /// The leading positions every input of `sequences` takes from [`Scorer::last`]: those
    /// they share with the last batch's first input, or, where they share more with each
    /// other (a new subject's context), those, computed first (once) into it.
    fn share_prefix(&mut self, sequences: &[Vec<u32>], firsts: &[usize]) -> Result<usize> {
        let from_last =
            (self.last.as_ref()).map_or(0, |(tokens, _)| self.shareable(tokens, sequences, firsts));
        let within = match sequences.len() {
            0 | 1 => 0,
            _ => self.shareable(&sequences[0], sequences, firsts),
        };
        if within <= from_last {
            return Ok(from_last);
        }
        let tokens = &sequences[0][..within];
        let mut prefix = self.model.cache(1, within)?;
        let step = Step {
            slot: 0,
            past: 0,
            tokens,
        };
        self.model.forward(&mut prefix, &[step], &[within - 1])?;
        self.positions.1 += within;
        self.last = Some((tokens.to_vec(), prefix));
        Ok(within)
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

    /// Score the requests of `docs` (each document a list of requests), all in one batch;
    /// the leading positions every input shares with the last batch's first input are taken
    /// from its cache (the same keys and values, computed once).
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
        // Each input's first position whose logits are wanted.
        let mut firsts: Vec<usize> = sequences.iter().map(Vec::len).collect();
        for (seq, t) in placed.iter().flatten() {
            let first = &mut firsts[*seq];
            *first = (*first).min(sequences[*seq].len() - t.continuation.len());
        }
        let shared = self.share_prefix(&sequences, &firsts)?;
        // Rows whose logits are needed: the last len(continuation) positions of each input,
        // among the positions computed (those after the shared ones).
        let mut starts = Vec::with_capacity(sequences.len());
        let mut total = 0;
        for s in &sequences {
            starts.push(total);
            total += s.len() - shared;
        }
        let end_of = |seq: usize| starts[seq] + sequences[seq].len() - shared;
        let mut wanted: Vec<usize> = placed
            .iter()
            .flatten()
            .flat_map(|(seq, t)| {
                let end = end_of(*seq);
                end - t.continuation.len()..end
            })
            .collect();
        wanted.sort_unstable();
        wanted.dedup();
        let row_of: HashMap<usize, usize> =
            wanted.iter().enumerate().map(|(i, &r)| (r, i)).collect();
        let capacity = sequences.iter().map(Vec::len).max().unwrap_or(1);
        let mut cache = self.model.cache(sequences.len(), capacity)?;
        if let Some((_, last)) = self.last.as_ref().filter(|_| shared > 0) {
            for slot in 0..sequences.len() {
                self.model
                    .copy_positions((last, 0), (&mut cache, slot), shared)?;
            }
        }
        let steps: Vec<Step> = (sequences.iter().enumerate())
            .map(|(slot, s)| Step {
                slot,
                past: shared,
                tokens: &s[shared..],
            })
            .collect();
        let backend = self.model.backend();
        let logits = self.model.forward(&mut cache, &steps, &wanted)?;
        self.positions.0 += shared * sequences.len();
        self.positions.1 += total;
        if let Some(first) = sequences.first() {
            let mut kept = self.model.cache(1, first.len())?;
            self.model
                .copy_positions((&cache, 0), (&mut kept, 0), first.len())?;
            self.last = Some((first.clone(), kept));
        }
        let logprobs = backend.download_f32(&backend.log_softmax(&logits)?)?;
        let vocab = self.model.spec.vocab;
        Ok(placed
            .iter()
            .map(|reqs| {
                reqs.iter()
                    .map(|(seq, t)| {
                        let end = end_of(*seq);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::Cpu;
    use std::path::Path;

    /// Documents of two questions each after one long shared context.
    fn docs(context: &str, questions: &[&str]) -> Vec<Vec<Request>> {
        (questions.iter())
            .map(|q| {
                [" yes", " no"]
                    .map(|a| Request {
                        context: format!("{context}\nQuestion: {q}\nAnswer:"),
                        continuation: a.into(),
                    })
                    .to_vec()
            })
            .collect()
    }

    #[test]
    fn a_shared_prefix_is_computed_once_and_scores_as_computed_anew() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/models/demo");
        let model = Model::load(&Cpu, &dir).unwrap();
        let tokenizer = Tokenizer::load(&dir).unwrap();
        let context = "The sky over the old harbour town was grey all morning, and the fishing \
                       boats stayed in, their crews mending nets along the quay while the gulls \
                       circled and the tide came slowly up the stone steps.";
        let first = docs(context, &["Did the boats go out?", "Was it sunny?"]);
        let later = docs(context, &["Were the gulls there?"]);
        // one scorer: the first batch shares within itself, the second with the first
        let mut shared = Scorer::new(&model, &tokenizer, 512);
        let a = shared.score(&first).unwrap();
        let after_first = shared.positions;
        assert!(after_first.0 >= 2 * MIN_SHARED, "{after_first:?}");
        let b = shared.score(&later).unwrap();
        assert!(shared.positions.0 > after_first.0, "{:?}", shared.positions);
        // fresh scorers, every request alone: all computed
        let requests = first.iter().chain(&later).flatten();
        for (request, got) in requests.zip(a.iter().chain(&b).flatten()) {
            let mut alone = Scorer::new(&model, &tokenizer, 512);
            let want = alone.score(&[vec![request.clone()]]).unwrap()[0][0];
            assert_eq!(alone.positions.0, 0);
            let close = (got.logprob - want.logprob).abs() <= 1e-5 * want.logprob.abs();
            assert!(close, "{got:?} vs {want:?}");
            assert_eq!(got.is_greedy, want.is_greedy);
        }
    }
}
