//! `mindkit eval`: benchmark tasks scored on any HF or Megatron checkpoint with numbers
//! comparable to lm-evaluation-harness (`docs/evaluation.md`): its prompts, its tokenization
//! and loglikelihood (see [`loglikelihood`]), its results JSON and table.

pub mod boolq;
pub mod cache;
pub mod gsm8k;
pub mod loglikelihood;
pub mod mmlu;
mod pyrandom;

use crate::data::source::{expand_inputs, Item, Record, RecordReader, Sink};
use crate::data::tokenizer::Tokenizer;
use crate::device::Job;
use crate::engine::Backend;
use crate::model::generate::{generate_batch, GenerateOptions, Sampling};
use crate::model::Model;
use crate::util::{check_not_input, progress_bar, AtomicFile, OutputKind, ProgressUnit};
use anyhow::{anyhow, bail, Context, Result};
use cache::Cache;
use loglikelihood::{Request, Score, Scorer};
use serde_json::{json, Value as Json};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The tasks `mindkit eval` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// BoolQ (SuperGLUE dev), 0-shot, acc.
    Boolq,
    /// MMLU, 57 subjects, 5-shot by default, acc (micro average).
    Mmlu,
    /// GSM8K with 5 random train-split shots (the harness's default `gsm8k`), greedy, exact match.
    Gsm8k,
    /// GSM8K with the 8 fixed chain-of-thought exemplars, greedy, exact match.
    Gsm8kCot,
}

impl Task {
    /// The harness's task name.
    pub fn name(self) -> &'static str {
        match self {
            Task::Boolq => "boolq",
            Task::Mmlu => "mmlu",
            Task::Gsm8k => "gsm8k",
            Task::Gsm8kCot => "gsm8k_cot",
        }
    }

    fn version(self) -> f64 {
        match self {
            Task::Boolq => 2.0,
            Task::Mmlu => 2.0,
            Task::Gsm8k | Task::Gsm8kCot => 3.0,
        }
    }
}

/// What to evaluate.
#[derive(Debug, Clone)]
pub struct EvalOptions {
    /// Checkpoint directory (HF or Megatron).
    pub model: PathBuf,
    /// Tokenizer (default: the model directory).
    pub tokenizer: Option<PathBuf>,
    /// The task.
    pub task: Task,
    /// The task's data file or directory.
    pub data: PathBuf,
    /// Few-shot examples (task default when `None`).
    pub num_fewshot: Option<usize>,
    /// Where `gsm8k` draws its shots from (default: `train.jsonl` beside `data`).
    pub fewshot_data: Option<PathBuf>,
    /// `gsm8k`'s few-shot sampler seed ([`gsm8k::FEWSHOT_SEED`] as the harness).
    pub seed: u64,
    /// First N documents only.
    pub limit: Option<usize>,
    /// Documents per forward pass.
    pub batch_size: usize,
    /// Per-document log (JSON lines).
    pub log_samples: Option<PathBuf>,
    /// The results JSON (written by [`write_results`] after the run; checked before it).
    pub output: Option<PathBuf>,
    /// Per-document results kept across runs ([`cache`]).
    pub cache: Option<PathBuf>,
    /// Show a progress bar.
    pub progress: bool,
}

impl EvalOptions {
    /// Refuse settings that would give no result or a meaningless one, and outputs that would
    /// overwrite an input or cannot be created, before any work.
    pub fn check(&self) -> Result<()> {
        self.check_outputs()?;
        if self.limit == Some(0) {
            bail!("--limit must be at least 1 (it counts documents, per subject for MMLU)");
        }
        if self.batch_size == 0 {
            bail!("--batch-size must be at least 1");
        }
        Ok(())
    }
}

impl EvalOptions {
    /// Every output (results, sample log, cache) must be apart from every input and from the
    /// other outputs, and creatable in its directory now rather than after hours of work.
    fn check_outputs(&self) -> Result<()> {
        let mut inputs: Vec<&Path> = vec![&self.data, &self.model];
        inputs.extend(self.tokenizer.as_deref());
        inputs.extend(self.fewshot_data.as_deref());
        let outputs: Vec<(&str, &Path)> = [
            ("--output", self.output.as_deref()),
            ("--log-samples", self.log_samples.as_deref()),
            ("--cache", self.cache.as_deref()),
        ]
        .into_iter()
        .filter_map(|(flag, p)| Some((flag, p?)))
        .collect();
        for (i, &(flag, out)) in outputs.iter().enumerate() {
            check_not_input(out, &inputs).with_context(|| flag.to_string())?;
            for &(other_flag, other) in &outputs[i + 1..] {
                check_not_input(out, &[other])
                    .with_context(|| format!("{flag} and {other_flag} name the same file"))?;
            }
        }
        for (flag, out) in outputs.iter().filter(|(flag, _)| *flag != "--cache") {
            // A temporary created and dropped proves the directory takes the file.
            drop(AtomicFile::create(out, &EVAL_FILE, true).with_context(|| flag.to_string())?);
        }
        Ok(())
    }
}

/// A multiple-choice document: a context, the continuations to compare, the right one.
#[derive(Debug, Clone)]
pub struct ChoiceDoc {
    /// Context (prompt).
    pub context: String,
    /// Continuations, the target delimiter included.
    pub choices: Vec<String>,
    /// Index of the right continuation.
    pub gold: usize,
    /// Subtask (MMLU subject) it belongs to.
    pub subject: Option<String>,
}

/// The batches of `docs`: runs of at most `size` documents, never across two subtasks (an
/// MMLU subject's documents share their few-shot context, which the scorer then computes
/// once for the subject).
fn batches(docs: &[ChoiceDoc], size: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=docs.len() {
        if i == docs.len() || i - start == size || docs[i].subject != docs[start].subject {
            out.push(start..i);
            start = i;
        }
    }
    out
}

/// The outcome of a run.
#[derive(Debug, Clone)]
pub struct EvalReport {
    /// lm-evaluation-harness-shaped results.
    pub results: Json,
    /// The harness-style table.
    pub table: String,
}

struct Collect {
    records: Vec<Record>,
    bad: Option<String>,
}

impl Sink for Collect {
    fn wants(&mut self, _: u64) -> bool {
        true
    }
    fn accept(&mut self, _: u64, item: Item) -> bool {
        match item {
            Item::Record(r) => {
                self.records.push(r);
                true
            }
            Item::Bad(b) => {
                self.bad = Some(b.to_string());
                false
            }
        }
    }
}

/// Every record of a data file or directory (json, jsonl, parquet), in order.
pub fn read_records(path: &Path) -> Result<Vec<Record>> {
    let files = expand_inputs(&[path.to_path_buf()])?;
    let mut sink = Collect {
        records: Vec::new(),
        bad: None,
    };
    // A bad record stops the reader (its error then only says so): report the record.
    let outcome = RecordReader::new(files).run(&mut sink);
    if let Some(bad) = sink.bad {
        bail!("{bad}");
    }
    outcome?;
    if sink.records.is_empty() {
        bail!("{}: no records", path.display());
    }
    Ok(sink.records)
}

/// A string field of a record, or an error naming the record and field.
pub fn text_field<'a>(r: &'a Record, key: &str) -> Result<&'a str> {
    r.fields
        .get(key)
        .and_then(Json::as_str)
        .ok_or_else(|| anyhow!("{}: missing or non-string field \"{key}\"", r.loc))
}

/// `sample_std / √n` of 0/1 outcomes (the harness's `mean_stderr`).
fn mean_stderr(hits: &[bool]) -> f64 {
    let n = hits.len() as f64;
    if n < 2.0 {
        return f64::NAN;
    }
    let mean = hits.iter().filter(|&&h| h).count() as f64 / n;
    let var = hits
        .iter()
        .map(|&h| (f64::from(u8::from(h)) - mean).powi(2))
        .sum::<f64>()
        / (n - 1.0);
    (var / n).sqrt()
}

/// Options checked and the tokenizer loaded ([`EvalOptions::prepare`]): what can fail before a
/// device is opened has been tried. As a [`Job`], it runs the task on a backend
/// ([`crate::device::run`]).
pub struct Prepared<'a> {
    options: &'a EvalOptions,
    tokenizer: Tokenizer,
    /// When preparing began (the report's time counts from it).
    start: Instant,
}

impl EvalOptions {
    /// Check the options ([`EvalOptions::check`]) and load the tokenizer, before any device is
    /// opened.
    pub fn prepare(&self) -> Result<Prepared<'_>> {
        let start = Instant::now();
        self.check()?;
        let tok_path = self.tokenizer.as_deref().unwrap_or(&self.model);
        let tokenizer = Tokenizer::load(tok_path)?;
        Ok(Prepared {
            options: self,
            tokenizer,
            start,
        })
    }
}

impl Job for Prepared<'_> {
    type Output = EvalReport;

    /// Run the task on `backend`.
    fn run<B: Backend>(self, backend: B) -> Result<EvalReport> {
        evaluate_on(&backend, self.options, &self.tokenizer, self.start)
    }
}

/// [`Prepared`]'s run on `backend`.
fn evaluate_on<B: Backend>(
    backend: &B,
    o: &EvalOptions,
    tokenizer: &Tokenizer,
    start: Instant,
) -> Result<EvalReport> {
    let tok_path = o.tokenizer.as_deref().unwrap_or(&o.model);
    let model = Model::load(backend, &o.model)?;
    if tokenizer.id_limit() > model.spec.vocab {
        bail!(
            "tokenizer {} has {} tokens but the model's vocabulary has {} rows",
            tok_path.display(),
            tokenizer.id_limit(),
            model.spec.vocab
        );
    }
    let mut cache = open_cache(o, &model, tokenizer)?;
    let variant = match o.task {
        Task::Gsm8k => Some(gsm8k::Variant::Standard),
        Task::Gsm8kCot => Some(gsm8k::Variant::Cot),
        Task::Boolq | Task::Mmlu => None,
    };
    if let Some(variant) = variant {
        return run_generation(o, variant, &model, tokenizer, &mut cache, start);
    }
    let (all, shots) = match o.task {
        Task::Gsm8k | Task::Gsm8kCot => unreachable!("generation tasks return above"),
        Task::Boolq => (boolq::load(&o.data, o.num_fewshot)?, 0),
        Task::Mmlu => (
            mmlu::load(&o.data, o.num_fewshot)?,
            o.num_fewshot.unwrap_or(5),
        ),
    };
    let original = all.len();
    let docs = limit_per_subtask(all, o.limit);
    let mut scorer = Scorer::new(&model, tokenizer, model.spec.max_positions);
    let mut log = open_log(&o.log_samples)?;
    let pb = progress_bar(docs.len() as u64, ProgressUnit::Docs, o.progress);
    pb.set_message(o.task.name());
    let mut hits: Vec<(Option<String>, bool)> = Vec::with_capacity(docs.len());
    for run in batches(&docs, o.batch_size) {
        let (first, batch) = (run.start, &docs[run]);
        let scores = score_batch(&mut scorer, cache.as_mut(), batch)?;
        for (i, (doc, s)) in batch.iter().zip(&scores).enumerate() {
            let lls: Vec<f64> = s.iter().map(|s| s.logprob).collect();
            if let Some(bad) = lls.iter().find(|l| !l.is_finite()) {
                bail!(
                    "document {} of {}: the model gave a non-finite loglikelihood ({bad}); its \
                     weights or configuration (rms_norm_eps, rope_theta, …) are broken",
                    first + i,
                    o.data.display()
                );
            }
            let pred = (0..lls.len()).fold(0, |best, j| if lls[j] > lls[best] { j } else { best });
            hits.push((doc.subject.clone(), pred == doc.gold));
            if let Some(w) = log.as_mut() {
                let record = json!({
                    "doc_id": first + i,
                    "subject": doc.subject,
                    "prompt": doc.context,
                    "choices": doc.choices,
                    "logprobs": lls,
                    "is_greedy": s.iter().map(|s| s.is_greedy).collect::<Vec<_>>(),
                    "target": doc.gold,
                    "pred": pred,
                    "acc": pred == doc.gold,
                });
                writeln!(w, "{record}")?;
            }
        }
        pb.inc(batch.len() as u64);
    }
    pb.finish_and_clear();
    if let Some(w) = log {
        w.finish()?;
    }
    let (entries, groups) = aggregate(o.task, &hits);
    let name = o.task.name();
    let mut results = json!({
        "results": entries.iter().map(|e| (e.key.clone(), e.json())).collect::<serde_json::Map<_, _>>(),
        "versions": {name: o.task.version()},
        "n-shot": {name: shots},
        "higher_is_better": {name: {"acc": true}},
        "n-samples": {name: {"original": original, "effective": docs.len()}},
        "config": {
            "model": "mindkit",
            "model_args": format!("pretrained={}", o.model.display()),
            "batch_size": o.batch_size,
            "device": backend.describe(),
            "limit": o.limit,
            "cache": cache_report(&cache),
        },
        "max_length": scorer.max_length,
        "n_truncated": scorer.truncated,
        // input positions taken from a shared prefix's cache, and computed
        "positions": {"shared": scorer.positions.0, "computed": scorer.positions.1},
        "total_evaluation_time_seconds": start.elapsed().as_secs_f64(),
    });
    if !groups.is_empty() {
        results["groups"] = groups
            .iter()
            .map(|k| (k.clone(), results["results"][k].clone()))
            .collect::<serde_json::Map<_, _>>()
            .into();
    }
    let table = table(o.task, shots, &entries);
    Ok(EvalReport { results, table })
}

/// The `--cache` file, bound to the contents of this model's weights and this tokenizer.
fn open_cache<B: Backend>(
    o: &EvalOptions,
    model: &Model<'_, B>,
    tokenizer: &Tokenizer,
) -> Result<Option<Cache>> {
    let Some(path) = &o.cache else {
        return Ok(None);
    };
    let identity = json!({
        "weights": format!("{:032x}", cache::files_hash(model.source_files())?),
        "tokenizer": format!("{:032x}", tokenizer.fingerprint()?),
    });
    let about = json!({
        "model": o.model.display().to_string(),
        "tokenizer": tokenizer.path().display().to_string(),
    });
    Ok(Some(Cache::open(path, identity, about)?))
}

/// What the results JSON says of the cache.
fn cache_report(cache: &Option<Cache>) -> Json {
    match cache {
        Some(c) => json!({"path": c.path().display().to_string(), "reused_docs": c.reused}),
        None => Json::Null,
    }
}

/// Loglikelihoods of every choice of every document: from the cache where it has them,
/// the rest computed in one scorer call (and cached).
fn score_batch<B: Backend>(
    scorer: &mut Scorer<'_, '_, B>,
    mut cache: Option<&mut Cache>,
    batch: &[ChoiceDoc],
) -> Result<Vec<Vec<Score>>> {
    let keys: Vec<u128> = batch
        .iter()
        .map(|d| {
            let mut parts = vec!["loglikelihood", d.context.as_str()];
            parts.extend(d.choices.iter().map(String::as_str));
            cache::key(&parts)
        })
        .collect();
    let mut scores: Vec<Option<Vec<Score>>> = keys
        .iter()
        .map(|&k| {
            let found = cache.as_mut().and_then(|c| c.get(k))?;
            serde_json::from_value(found).ok()
        })
        .collect();
    let missing: Vec<usize> = (0..batch.len()).filter(|&i| scores[i].is_none()).collect();
    let requests: Vec<Vec<Request>> = missing
        .iter()
        .map(|&i| {
            (batch[i].choices.iter())
                .map(|c| Request {
                    context: batch[i].context.clone(),
                    continuation: c.clone(),
                })
                .collect()
        })
        .collect();
    if !requests.is_empty() {
        for (&i, s) in missing.iter().zip(scorer.score(&requests)?) {
            if let Some(c) = cache.as_mut() {
                c.put(keys[i], serde_json::to_value(&s)?)?;
            }
            scores[i] = Some(s);
        }
    }
    Ok(scores.into_iter().flatten().collect())
}

/// A results file or sample log as an output.
pub static EVAL_FILE: OutputKind = OutputKind {
    tag: "eval",
    what: "evaluation output",
    dir: None,
};

fn open_log(path: &Option<PathBuf>) -> Result<Option<AtomicFile>> {
    let create = |p: &Path| AtomicFile::create(p, &EVAL_FILE, true);
    Ok(path.as_deref().map(create).transpose()?)
}

/// Write the results JSON to `path` (atomically).
pub fn write_results(path: &Path, report: &EvalReport) -> Result<()> {
    let mut f = AtomicFile::create(path, &EVAL_FILE, true)?;
    f.write_all((serde_json::to_string_pretty(&report.results)? + "\n").as_bytes())?;
    f.finish()?;
    Ok(())
}

/// The generated text of each of `docs` (prompted by `prompts`): from the cache where it has
/// it, the rest generated together and added to the cache.
fn generate_or_reuse<B: Backend>(
    model: &Model<B>,
    tokenizer: &Tokenizer,
    cache: &mut Option<Cache>,
    docs: &[gsm8k::GenDoc],
    prompts: &[Vec<u32>],
    options: &GenerateOptions,
) -> Result<Vec<String>> {
    let keys: Vec<u128> = (docs.iter())
        .map(|doc| {
            cache::key(&[
                "generate",
                &doc.context,
                &options.max_new_tokens.to_string(),
                &options.stop.join("\u{0}"),
            ])
        })
        .collect();
    let mut texts: Vec<Option<String>> = (keys.iter())
        .map(|&k| match cache.as_mut().and_then(|c| c.get(k)) {
            Some(Json::String(text)) => Some(text),
            _ => None,
        })
        .collect();
    let missing: Vec<usize> = (0..docs.len()).filter(|&i| texts[i].is_none()).collect();
    let inputs: Vec<&[u32]> = missing.iter().map(|&i| prompts[i].as_slice()).collect();
    let generated = generate_batch(model, tokenizer, &inputs, options)?;
    for (&i, g) in missing.iter().zip(generated) {
        if let Some(c) = cache.as_mut() {
            c.put(keys[i], json!(g.text))?;
        }
        texts[i] = Some(g.text);
    }
    Ok(texts.into_iter().flatten().collect())
}

/// A generation task (GSM8K): greedy generation per question (`--batch-size` questions decoded
/// together), answers extracted and matched.
fn run_generation<B: Backend>(
    o: &EvalOptions,
    variant: gsm8k::Variant,
    model: &Model<B>,
    tokenizer: &Tokenizer,
    cache: &mut Option<Cache>,
    start: Instant,
) -> Result<EvalReport> {
    let few = gsm8k::FewShot {
        num: o.num_fewshot,
        data: o.fewshot_data.as_deref(),
        seed: o.seed,
    };
    let all = gsm8k::load(&o.data, variant, few)?;
    let shots = o.num_fewshot.unwrap_or(variant.default_shots());
    let docs = &all[..o.limit.unwrap_or(all.len()).min(all.len())];
    let max_context = model
        .spec
        .max_positions
        .saturating_sub(gsm8k::MAX_NEW_TOKENS);
    let options = GenerateOptions {
        max_new_tokens: gsm8k::MAX_NEW_TOKENS,
        sampling: Sampling::GREEDY,
        stop: variant.stop().iter().map(|s| s.to_string()).collect(),
        eos: tokenizer.eos().into_iter().collect(),
    };
    let mut log = open_log(&o.log_samples)?;
    let pb = progress_bar(docs.len() as u64, ProgressUnit::Docs, o.progress);
    pb.set_message(o.task.name());
    let (mut strict_hits, mut flexible_hits, mut truncated) = (Vec::new(), Vec::new(), 0);
    for (b, batch) in docs.chunks(o.batch_size).enumerate() {
        let mut prompts = Vec::with_capacity(batch.len());
        for doc in batch {
            let mut ids = loglikelihood::harness_encode(tokenizer, &doc.context)?;
            if ids.len() > max_context {
                truncated += 1;
                ids.drain(..ids.len() - max_context);
            }
            prompts.push(ids);
        }
        let texts = generate_or_reuse(model, tokenizer, cache, batch, &prompts, &options)?;
        for (j, (doc, text)) in batch.iter().zip(texts).enumerate() {
            let i = b * o.batch_size + j;
            let (strict, flexible) = (variant.strict_match(&text), gsm8k::flexible_extract(&text));
            strict_hits.push(gsm8k::exact_match(&strict, &doc.target));
            flexible_hits.push(gsm8k::exact_match(&flexible, &doc.target));
            if let Some(w) = log.as_mut() {
                let record = json!({
                    "doc_id": i,
                    "prompt": doc.context,
                    "generation": text,
                    "target": doc.target,
                    "strict-match": strict,
                    "flexible-extract": flexible,
                    "correct": {"strict-match": strict_hits[i], "flexible-extract": flexible_hits[i]},
                });
                writeln!(w, "{record}")?;
            }
        }
        pb.inc(batch.len() as u64);
    }
    pb.finish_and_clear();
    if let Some(w) = log {
        w.finish()?;
    }
    let score = |hits: &[bool]| {
        let m = hits.iter().filter(|&&h| h).count() as f64 / hits.len().max(1) as f64;
        (m, mean_stderr(hits))
    };
    let name = o.task.name();
    let (strict, strict_se) = score(&strict_hits);
    let (flexible, flexible_se) = score(&flexible_hits);
    let results = json!({
        "results": {name: {
            "alias": name,
            "exact_match,strict-match": strict,
            "exact_match_stderr,strict-match": strict_se,
            "exact_match,flexible-extract": flexible,
            "exact_match_stderr,flexible-extract": flexible_se,
            "sample_len": docs.len(),
        }},
        "versions": {name: o.task.version()},
        "n-shot": {name: shots},
        "higher_is_better": {name: {"exact_match": true}},
        "n-samples": {name: {"original": all.len(), "effective": docs.len()}},
        "config": {
            "model": "mindkit",
            "model_args": format!("pretrained={}", o.model.display()),
            "device": model.backend().describe(),
            "limit": o.limit,
            "fewshot_seed": o.seed,
            "gen_kwargs": {"until": variant.stop(), "max_gen_toks": gsm8k::MAX_NEW_TOKENS, "do_sample": false},
            "cache": cache_report(cache),
        },
        "max_length": model.spec.max_positions,
        "n_truncated": truncated,
        "total_evaluation_time_seconds": start.elapsed().as_secs_f64(),
    });
    let mut table = String::from(
        "|Tasks|Version|Filter|n-shot|Metric|   |Value |   |Stderr|\n\
         |-----|------:|------|-----:|------|---|-----:|---|-----:|\n",
    );
    for (filter, v, se) in [
        ("strict-match", strict, strict_se),
        ("flexible-extract", flexible, flexible_se),
    ] {
        table += &format!(
            "|{name}|{:>7}|{filter}|{shots:>6}|exact_match|↑  |{v:.4}|±  |{se:.4}|\n",
            o.task.version()
        );
    }
    Ok(EvalReport { results, table })
}

/// The first `limit` documents of each subtask (the harness applies `--limit` per task).
fn limit_per_subtask(docs: Vec<ChoiceDoc>, limit: Option<usize>) -> Vec<ChoiceDoc> {
    let Some(limit) = limit else {
        return docs;
    };
    let mut seen: std::collections::HashMap<Option<String>, usize> = Default::default();
    docs.into_iter()
        .filter(|d| {
            let n = seen.entry(d.subject.clone()).or_default();
            *n += 1;
            *n <= limit
        })
        .collect()
}

/// One row of the results: a task, group or subtask.
#[derive(Clone)]
struct Entry {
    key: String,
    alias: String,
    depth: usize,
    n: usize,
    acc: f64,
    stderr: f64,
    /// Mean of the subtasks' accuracies (groups only).
    macro_acc: Option<f64>,
}

impl Entry {
    fn of(key: String, alias: String, depth: usize, hits: &[bool]) -> Entry {
        let n = hits.len();
        Entry {
            key,
            alias,
            depth,
            n,
            acc: hits.iter().filter(|&&h| h).count() as f64 / n.max(1) as f64,
            stderr: mean_stderr(hits),
            macro_acc: None,
        }
    }

    /// A group over `parts`: accuracy weighted by size (micro), stderr pooled as the harness
    /// pools it, and the unweighted mean of the parts' accuracies.
    fn group(key: String, alias: String, depth: usize, parts: &[&Entry]) -> Entry {
        let n: usize = parts.iter().map(|p| p.n).sum();
        let acc = parts.iter().map(|p| p.acc * p.n as f64).sum::<f64>() / n.max(1) as f64;
        let var = parts
            .iter()
            .map(|p| (p.n as f64 - 1.0) * p.stderr.powi(2) * p.n as f64)
            .sum::<f64>()
            / (n as f64 - parts.len() as f64);
        Entry {
            key,
            alias,
            depth,
            n,
            acc,
            stderr: (var / n as f64).sqrt(),
            macro_acc: Some(parts.iter().map(|p| p.acc).sum::<f64>() / parts.len().max(1) as f64),
        }
    }

    fn json(&self) -> Json {
        let mut j = json!({
            "alias": self.alias,
            "acc,none": self.acc,
            "acc_stderr,none": if self.stderr.is_finite() { json!(self.stderr) } else { json!("N/A") },
            "sample_len": self.n,
        });
        if let Some(m) = self.macro_acc {
            j["acc_macro,none"] = json!(m);
        }
        j
    }
}

/// Result rows, in table order (group, its subgroups, their subtasks), and the group keys.
fn aggregate(task: Task, hits: &[(Option<String>, bool)]) -> (Vec<Entry>, Vec<String>) {
    let name = task.name().to_string();
    if task != Task::Mmlu {
        let all: Vec<bool> = hits.iter().map(|h| h.1).collect();
        return (vec![Entry::of(name.clone(), name, 0, &all)], Vec::new());
    }
    let mut by_subject: BTreeMap<&str, Vec<bool>> = BTreeMap::new();
    for (s, h) in hits {
        by_subject
            .entry(s.as_deref().unwrap_or_default())
            .or_default()
            .push(*h);
    }
    let subjects: Vec<Entry> = (by_subject.iter())
        .map(|(s, h)| Entry::of(format!("mmlu_{s}"), s.to_string(), 2, h))
        .collect();
    let mut groups = Vec::new();
    for g in ["humanities", "other", "social_sciences", "stem"] {
        let parts: Vec<&Entry> = (subjects.iter())
            .filter(|e| mmlu::group_of(&e.alias) == Some(g))
            .collect();
        if !parts.is_empty() {
            let group = Entry::group(format!("mmlu_{g}"), g.to_string(), 1, &parts);
            groups.push((group, parts));
        }
    }
    let top_parts: Vec<&Entry> = groups.iter().map(|(g, _)| g).collect();
    let mut rows = vec![Entry::group(name.clone(), name, 0, &top_parts)];
    let mut keys = vec![rows[0].key.clone()];
    for (group, parts) in groups {
        keys.push(group.key.clone());
        rows.push(group);
        rows.extend(parts.into_iter().cloned());
    }
    (rows, keys)
}

/// The harness's console table.
fn table(task: Task, shots: usize, rows: &[Entry]) -> String {
    let mut out = String::from(
        "|Tasks|Version|Filter|n-shot|Metric|   |Value |   |Stderr|\n\
         |-----|------:|------|-----:|------|---|-----:|---|-----:|\n",
    );
    for e in rows {
        let name = match e.depth {
            0 => e.alias.clone(),
            d => format!("{}- {}", " ".repeat(d), e.alias),
        };
        out += &format!(
            "|{name}|{:>7}|none  |{shots:>6}|acc   |↑  |{:.4}|±  |{:.4}|\n",
            task.version(),
            e.acc,
            e.stderr
        );
        if let (0, Some(m)) = (e.depth, e.macro_acc) {
            out += &format!(
                "|{name} (macro average)|       |none  |{shots:>6}|acc   |↑  |{m:.4}|   |      |\n"
            );
        }
    }
    out
}
