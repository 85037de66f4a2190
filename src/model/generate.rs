//! Text generation with a KV cache: greedy or sampled (temperature, top-k, top-p, seeded),
//! ending at EOS, at a stop sequence or after a number of tokens, streaming text as it comes.

use super::{Model, Step};
use crate::data::tokenizer::Tokenizer;
use crate::engine::Backend;
use anyhow::{bail, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;
use std::time::Instant;

/// How the next token is picked.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Logits are divided by it; 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1: all).
    pub top_p: f32,
    /// Random seed.
    pub seed: u64,
}

impl Sampling {
    /// Argmax decoding.
    pub const GREEDY: Sampling = Sampling {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
    };

    /// Refuse settings that cannot sample (a NaN temperature would turn every probability
    /// into NaN and pick token 0 forever).
    pub fn check(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            bail!(
                "--temperature must be a finite number ≥ 0 (0 is greedy), got {}",
                self.temperature
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!(
                "--top-p must be in (0, 1] (1 keeps every token), got {}",
                self.top_p
            );
        }
        Ok(())
    }
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// New tokens at most.
    pub max_new_tokens: usize,
    /// Token choice.
    pub sampling: Sampling,
    /// Generation ends before the first of these strings (which is not returned).
    pub stop: Vec<String>,
    /// Token ids that end the generation (not returned).
    pub eos: Vec<u32>,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An EOS token.
    Eos,
    /// A stop sequence.
    Stop,
    /// `max_new_tokens`.
    Length,
}

/// A finished generation.
#[derive(Debug, Clone)]
pub struct Generation {
    /// Generated token ids (EOS excluded).
    pub tokens: Vec<u32>,
    /// Their text, cut before a stop sequence.
    pub text: String,
    /// Why it ended.
    pub finish: Finish,
}

/// Index of the largest value; the first one on ties, as `torch.argmax`.
pub fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best
}

/// Pick a token from `logits` (transformers' order: temperature, top-k, top-p, then draw).
fn pick(logits: &[f32], s: &Sampling, rng: &mut StdRng) -> usize {
    if s.temperature <= 0.0 {
        return argmax(logits);
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if s.top_k > 0 {
        order.truncate(s.top_k);
    }
    let max = logits[order[0]];
    let mut probs: Vec<f64> = (order.iter())
        .map(|&i| (((logits[i] - max) / s.temperature) as f64).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if s.top_p < 1.0 {
        let mut mass = 0.0;
        let keep = probs
            .iter()
            .position(|&p| {
                mass += p;
                mass >= s.top_p as f64
            })
            .map_or(probs.len(), |i| i + 1);
        probs.truncate(keep);
    }
    let mut draw = rng.random::<f64>() * probs.iter().sum::<f64>();
    for (i, p) in probs.iter().enumerate() {
        draw -= p;
        if draw <= 0.0 {
            return order[i];
        }
    }
    order[probs.len() - 1]
}

/// The text of generated tokens: decoded whole each time (so multi-byte characters split over
/// tokens come out right) and released in pieces that cannot be the start of a stop sequence.
struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    stop: &'a [String],
    text: String,
    released: usize,
}

impl TextStream<'_> {
    /// Update with all tokens so far; `Some(cut)` when a stop sequence appeared.
    fn update(&mut self, tokens: &[u32]) -> Result<Option<usize>> {
        self.text = self.tokenizer.decode_text(tokens)?;
        Ok(self
            .stop
            .iter()
            .filter_map(|s| self.text.find(s.as_str()))
            .min())
    }

    /// Text safe to show now (complete characters, no possible stop prefix), once.
    fn release(&mut self, end: Option<usize>) -> &str {
        let mut upto = end.unwrap_or_else(|| {
            let hold = self
                .stop
                .iter()
                .map(|s| s.len().saturating_sub(1))
                .max()
                .unwrap_or(0);
            let text = self.text.trim_end_matches('\u{FFFD}');
            text.len().saturating_sub(hold)
        });
        while !self.text.is_char_boundary(upto) {
            upto -= 1;
        }
        let from = self.released.min(upto);
        self.released = self.released.max(upto);
        &self.text[from..upto]
    }
}

/// One sequence being generated: its tokens, the text they make, its own random stream, and
/// how it ended once it has.
struct Sequence<'a> {
    stream: TextStream<'a>,
    tokens: Vec<u32>,
    rng: StdRng,
    finish: Option<Finish>,
}

impl<'a> Sequence<'a> {
    fn new(tokenizer: &'a Tokenizer, o: &'a GenerateOptions) -> Self {
        Sequence {
            stream: TextStream {
                tokenizer,
                stop: &o.stop,
                text: String::new(),
                released: 0,
            },
            tokens: Vec::new(),
            rng: StdRng::seed_from_u64(o.sampling.seed),
            finish: (o.max_new_tokens == 0).then_some(Finish::Length),
        }
    }

    /// Take the next token from `logits`; returns the text that became final.
    fn advance(&mut self, logits: &[f32], o: &GenerateOptions) -> Result<String> {
        // NaN logits (bad weights or config) would otherwise decode as token 0, silently.
        if let Some(bad) = logits.iter().find(|v| !v.is_finite()) {
            bail!(
                "the model produced a non-finite logit ({bad}) at new token {}: its weights or \
                 configuration (rms_norm_eps, rope_theta, …) are broken",
                self.tokens.len() + 1
            );
        }
        let next = pick(logits, &o.sampling, &mut self.rng) as u32;
        if o.eos.contains(&next) {
            self.finish = Some(Finish::Eos);
        } else {
            self.tokens.push(next);
            if let Some(cut) = self.stream.update(&self.tokens)? {
                let piece = self.stream.release(Some(cut)).to_string();
                self.stream.text.truncate(cut);
                self.finish = Some(Finish::Stop);
                return Ok(piece);
            }
            if self.tokens.len() == o.max_new_tokens {
                self.finish = Some(Finish::Length);
            }
        }
        let end = self.finish.map(|_| self.stream.text.len());
        Ok(self.stream.release(end).to_string())
    }

    fn into_generation(self) -> Generation {
        Generation {
            tokens: self.tokens,
            text: self.stream.text,
            finish: self.finish.unwrap_or(Finish::Length),
        }
    }
}

/// Generate after `prompt`, calling `on_text` with each new piece of text.
pub fn generate<B: Backend>(
    model: &Model<B>,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    o: &GenerateOptions,
    mut on_text: impl FnMut(&str),
) -> Result<Generation> {
    let mut out = generate_each(model, tokenizer, &[prompt], o, |_, text| on_text(text))?;
    Ok(out.remove(0))
}

/// Generate after each of `prompts`, all decoded together (one forward pass a step for the
/// sequences still running, each in its own KV-cache slot). No op mixes rows, so each sequence
/// gets what [`generate`] gives it alone (up to rounding where a kernel blocks rows otherwise).
pub fn generate_batch<B: Backend>(
    model: &Model<B>,
    tokenizer: &Tokenizer,
    prompts: &[&[u32]],
    o: &GenerateOptions,
) -> Result<Vec<Generation>> {
    generate_each(model, tokenizer, prompts, o, |_, _| {})
}

/// [`generate_batch`], calling `on_text(sequence, text)` with each new piece of text.
fn generate_each<B: Backend>(
    model: &Model<B>,
    tokenizer: &Tokenizer,
    prompts: &[&[u32]],
    o: &GenerateOptions,
    mut on_text: impl FnMut(usize, &str),
) -> Result<Vec<Generation>> {
    if prompts.is_empty() {
        return Ok(Vec::new());
    }
    if prompts.iter().any(|p| p.is_empty()) {
        bail!("the prompt is empty (no tokens)");
    }
    o.sampling.check()?;
    let longest = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
    if longest + o.max_new_tokens > model.spec.max_positions {
        bail!(
            "prompt ({longest} tokens) + {} new tokens exceed the model's {} positions",
            o.max_new_tokens,
            model.spec.max_positions
        );
    }
    let mut cache = model.cache(prompts.len(), longest + o.max_new_tokens)?;
    let mut seqs: Vec<Sequence> = prompts
        .iter()
        .map(|_| Sequence::new(tokenizer, o))
        .collect();
    // Per sequence: positions already in its cache slot, and the tokens to feed next.
    let mut inputs: Vec<(usize, Vec<u32>)> = prompts.iter().map(|p| (0, p.to_vec())).collect();
    let switch = model.spec.rope.switches_after();
    loop {
        let running: Vec<usize> = (0..seqs.len())
            .filter(|&i| seqs[i].finish.is_none())
            .collect();
        if running.is_empty() {
            break;
        }
        for &i in &running {
            let (past, input) = &mut inputs[i];
            let passes = |o: usize| (1..=o).contains(past) && *past + input.len() > o;
            if switch.is_some_and(passes) {
                // LongRoPE's long factors from here: the cache is computed again with them
                *input = [prompts[i], &seqs[i].tokens[..]].concat();
                *past = 0;
            }
        }
        let steps: Vec<Step> = (running.iter())
            .map(|&i| Step {
                slot: i,
                past: inputs[i].0,
                tokens: &inputs[i].1,
            })
            .collect();
        let last_rows: Vec<usize> = (steps.iter())
            .scan(0, |end, s| {
                *end += s.tokens.len();
                Some(*end - 1)
            })
            .collect();
        let logits = model.forward(&mut cache, &steps, &last_rows)?;
        let logits = model.backend().download_f32(&logits)?;
        let vocab = logits.len() / running.len();
        for (&i, row) in running.iter().zip(logits.chunks_exact(vocab)) {
            let text = seqs[i].advance(row, o)?;
            on_text(i, &text);
            let (past, input) = &mut inputs[i];
            *past += input.len();
            *input = seqs[i].tokens.last().copied().into_iter().collect();
        }
    }
    Ok(seqs.into_iter().map(Sequence::into_generation).collect())
}

/// A `mindkit generate` request.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Checkpoint directory (HF or Megatron).
    pub model: PathBuf,
    /// Tokenizer file or directory (default: the model directory).
    pub tokenizer: Option<PathBuf>,
    /// The prompt text.
    pub prompt: String,
    /// Wrap the prompt in the tokenizer's chat template as a user message.
    pub chat: bool,
    /// A system message for `chat`.
    pub system: Option<String>,
    /// `enable_thinking` for the chat template (Qwen3's reasoning switch); `None` leaves it
    /// undefined, the template's default.
    pub enable_thinking: Option<bool>,
    /// What to generate.
    pub options: GenerateOptions,
}

/// What a generation took.
#[derive(Debug, Clone, Copy)]
pub struct GenerateStats {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Seconds loading the model.
    pub load_seconds: f64,
    /// Seconds generating (prefill + decoding).
    pub seconds: f64,
}

/// A request checked and its tokenizer loaded ([`GenerateRequest::prepare`]): what can fail
/// before a device is opened has been tried. [`Prepared::run`] generates on a backend.
pub struct Prepared<'a> {
    request: &'a GenerateRequest,
    tokenizer: Tokenizer,
    /// When preparing began (the load time counts from it).
    start: Instant,
}

impl GenerateRequest {
    /// Check the sampling options and load the tokenizer, before any device is opened.
    pub fn prepare(&self) -> Result<Prepared<'_>> {
        let start = Instant::now();
        self.options.sampling.check()?;
        let tok_path = self.tokenizer.as_deref().unwrap_or(&self.model);
        let tokenizer = Tokenizer::load(tok_path)?;
        Ok(Prepared {
            request: self,
            tokenizer,
            start,
        })
    }
}

impl Prepared<'_> {
    /// Load the model on `backend`, build the prompt and generate, streaming text.
    pub fn run<B: Backend>(
        self,
        backend: &B,
        on_text: impl FnMut(&str),
    ) -> Result<(Generation, GenerateStats)> {
        generate_on(backend, self.request, &self.tokenizer, on_text, self.start)
    }
}

/// [`Prepared::run`].
fn generate_on<B: Backend>(
    backend: &B,
    r: &GenerateRequest,
    tokenizer: &Tokenizer,
    on_text: impl FnMut(&str),
    start: Instant,
) -> Result<(Generation, GenerateStats)> {
    let tok_path = r.tokenizer.as_deref().unwrap_or(&r.model);
    let model = Model::load(backend, &r.model)?;
    if tokenizer.id_limit() > model.spec.vocab {
        bail!(
            "tokenizer {} has {} tokens but the model's vocabulary has {} rows: they do not belong together",
            tok_path.display(),
            tokenizer.id_limit(),
            model.spec.vocab
        );
    }
    let prompt = if r.chat {
        let mut messages = Vec::new();
        if let Some(s) = &r.system {
            messages.push(("system", s.as_str()));
        }
        messages.push(("user", r.prompt.as_str()));
        let text = tokenizer.apply_chat_template(&messages, true, r.enable_thinking)?;
        tokenizer.encode(&text, false)?
    } else {
        tokenizer.encode(&r.prompt, true)?
    };
    let mut options = r.options.clone();
    if options.eos.is_empty() {
        options.eos.extend(tokenizer.eos());
    }
    let load_seconds = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let generation = generate(&model, tokenizer, &prompt, &options, on_text)?;
    let stats = GenerateStats {
        prompt_tokens: prompt.len(),
        load_seconds,
        seconds: start.elapsed().as_secs_f64(),
    };
    Ok((generation, stats))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_the_first_of_equal_maxima() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
    }

    #[test]
    fn sampling_respects_top_k_and_top_p_and_the_seed() {
        let logits = [0.0, 5.0, 4.9, -3.0, 1.0];
        let s = Sampling {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
            seed: 7,
        };
        let mut rng = StdRng::seed_from_u64(s.seed);
        let picks: Vec<usize> = (0..200).map(|_| pick(&logits, &s, &mut rng)).collect();
        assert!(picks.iter().all(|&p| p == 1 || p == 2));
        assert!(picks.contains(&1) && picks.contains(&2));
        let mut again = StdRng::seed_from_u64(s.seed);
        let repeat: Vec<usize> = (0..200).map(|_| pick(&logits, &s, &mut again)).collect();
        assert_eq!(picks, repeat);
        let nucleus = Sampling {
            top_k: 0,
            top_p: 0.3,
            ..s
        };
        assert!((0..50).all(|_| pick(&logits, &nucleus, &mut rng) == 1));
        assert_eq!(pick(&logits, &Sampling::GREEDY, &mut rng), 1);
    }
}
