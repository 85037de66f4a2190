//! `mindkit preprocess`: records → handler → Megatron `.bin/.idx`.
//!
//! A reader thread streams records in batches through a bounded channel; each batch is
//! tokenized in parallel on a rayon pool of `--workers` threads and written in input
//! order, so the output bytes do not depend on the worker count. Memory is bounded by a
//! few batches (of at most [`BATCH`] records and [`BATCH_BYTES`] of input, or one record
//! above that) plus 12 bytes per written sequence (the index kept for `.idx`); one record is
//! at most `--max-record-bytes` of input.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use super::handlers::chat::{ChatFormat, ChatHandler, Columns};
use super::handlers::pretrain::Pretrain;
use super::handlers::prompter::{PrompterHandler, PrompterKind};
use super::handlers::template::{ReasoningEffort, Template};
use super::handlers::{Document, Handler, RecordError, IGNORE};
use super::indexed::{self, DType, IndexedWriter};
use super::source::{expand_inputs_as, Format, Item, RecordReader, Sink, SkippedFile};
use super::tokenizer::Tokenizer;

/// Records per batch handed to the worker pool.
pub const BATCH: usize = 512;

/// Input bytes per batch: a batch is handed over when it reaches either bound, so that large
/// records (whose tokenization takes many times their size) do not pile up 512 to a batch.
pub const BATCH_BYTES: u64 = 8 << 20;

/// `--shard i/n`: the `index`-th of `count` contiguous slices of the input records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    index: usize,
    count: usize,
}

/// A malformed `--shard` value.
#[derive(Debug, Clone, thiserror::Error)]
#[error("expected I/N with 0 ≤ I < N (e.g. 0/4 for the first of four slices): {why}")]
pub struct ShardError {
    why: String,
}

impl Shard {
    /// Slice `index` of `count`; `index < count`.
    pub fn new(index: usize, count: usize) -> Result<Shard, ShardError> {
        let why = if count == 0 {
            "N must be at least 1".to_string()
        } else if index >= count {
            format!("I is {index}, so N must be at least {}", index + 1)
        } else {
            return Ok(Shard { index, count });
        };
        Err(ShardError { why })
    }

    /// The record indices of this slice, of `total` records.
    pub fn range(&self, total: u64) -> std::ops::Range<u64> {
        let (i, n) = (self.index as u64, self.count as u64);
        (total * i / n)..(total * (i + 1) / n)
    }
}

impl std::str::FromStr for Shard {
    type Err = ShardError;

    fn from_str(s: &str) -> Result<Shard, ShardError> {
        let bad = |why: String| ShardError { why };
        let (i, n) = s
            .split_once('/')
            .ok_or_else(|| bad(format!("{s:?} has no '/'")))?;
        let number = |part: &str, name: &str| {
            part.trim()
                .parse::<usize>()
                .map_err(|_| bad(format!("{name} {part:?} is not a whole number")))
        };
        Shard::new(number(i, "I")?, number(n, "N")?)
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

/// Instruction handler names (`--handler`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandlerKind {
    /// instruction / input / output.
    Alpaca,
    /// Belle multi-turn.
    Belle,
    /// moss-003-sft.
    Moss,
    /// ShareGPT conversations or OpenAI messages.
    Sharegpt,
    /// instruction / input with chosen and rejected answers (preference pairs).
    AlpacaPairwise,
    /// ShareGPT conversations with chosen and rejected answers (preference pairs).
    SharegptPairwise,
}

impl HandlerKind {
    /// Whether it writes preference pairs.
    pub fn pairwise(self) -> bool {
        matches!(
            self,
            HandlerKind::AlpacaPairwise | HandlerKind::SharegptPairwise
        )
    }

    /// Parse a handler name, accepting MindSpeed-LLM's class names.
    pub fn parse(name: &str) -> Option<HandlerKind> {
        Some(match name {
            "alpaca" | "GeneralInstructionHandler" | "AlpacaStyleInstructionHandler" => {
                HandlerKind::Alpaca
            }
            "belle" | "BelleMultiTurnInstructionHandler" => HandlerKind::Belle,
            "moss" | "MOSSInstructionHandler" => HandlerKind::Moss,
            "sharegpt" | "SharegptStyleInstructionHandler" | "OpenAIInstructionHandler" => {
                HandlerKind::Sharegpt
            }
            "alpaca-pairwise" | "AlpacaStylePairwiseHandler" => HandlerKind::AlpacaPairwise,
            "sharegpt-pairwise" | "SharegptStylePairwiseHandler" => HandlerKind::SharegptPairwise,
            _ => return None,
        })
    }
}

/// `--dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DTypeChoice {
    /// Megatron's rule (uint16 below 65500 tokens, else int32); int32 for instruction data.
    Auto,
    /// uint16.
    U16,
    /// int32 (MindSpeed-LLM always writes this).
    I32,
}

/// Everything `preprocess` needs, already validated by the CLI.
#[derive(Debug, Clone)]
pub struct PreprocessOptions {
    /// Input files, directories or globs.
    pub inputs: Vec<PathBuf>,
    /// Output prefix.
    pub output_prefix: PathBuf,
    /// Tokenizer path.
    pub tokenizer: PathBuf,
    /// Megatron's `--tokenizer-type`: MagistralTokenizer needs a tekken file, another type
    /// anything but one; none takes what the path holds.
    pub tokenizer_type: Option<String>,
    /// Pretrain fields.
    pub json_keys: Vec<String>,
    /// Append eos.
    pub append_eod: bool,
    /// Instruction handler, or pretrain when `None`.
    pub handler: Option<HandlerKind>,
    /// Chat template name.
    pub prompt_type: Option<String>,
    /// Custom template file.
    pub prompt_type_path: Option<PathBuf>,
    /// MindSpeed-LLM's `--enable-thinking` (true, false, none): how a reasoning template treats
    /// thoughts; no effect with other templates.
    pub enable_thinking: Option<bool>,
    /// MindSpeed-LLM's `--reasoning-effort` (max, high, or none: the default); read by the
    /// deepseek4 template only, and only with `enable_thinking` true.
    pub reasoning_effort: Option<ReasoningEffort>,
    /// MindSpeed-LLM's `--drop-thinking` (default true): the deepseek4 template strips the
    /// reasoning of answers before the last user message.
    pub drop_thinking: bool,
    /// `--map-keys` JSON.
    pub map_keys: Option<serde_json::Map<String, serde_json::Value>>,
    /// Drop sequences with this many tokens or more (MindSpeed); also the template cutoff.
    pub seq_length: Option<usize>,
    /// Greedy packing to `seq_length`.
    pub pack: bool,
    /// Worker threads.
    pub workers: usize,
    /// Output dtype.
    pub dtype: DTypeChoice,
    /// Add special tokens (BOS) in pretrain mode.
    pub add_special_tokens: bool,
    /// Skip and count bad records instead of failing.
    pub skip_bad_records: bool,
    /// Overwrite outputs.
    pub force: bool,
    /// Process only this slice of the input records.
    pub shard: Option<Shard>,
    /// Show a progress bar.
    pub progress: bool,
    /// Read only files of this format from directories and globs (required when they hold
    /// several); `None`: the one format they hold.
    pub input_format: Option<Format>,
    /// Refuse a record (line, array element, row) larger than this many bytes.
    pub max_record_bytes: u64,
}

/// Errors of a preprocessing run.
#[derive(Debug, thiserror::Error)]
pub enum PreprocessError {
    /// Input error.
    #[error(transparent)]
    Source(#[from] super::source::SourceError),
    /// Output error.
    #[error(transparent)]
    Indexed(#[from] super::indexed::IndexedError),
    /// Tokenizer error.
    #[error(transparent)]
    Tokenizer(#[from] super::tokenizer::TokenizerError),
    /// A record that could not be processed.
    #[error("{location}: {error} (use --skip-bad-records to skip and count such records)")]
    Record {
        /// file:line
        location: String,
        /// What is wrong.
        error: String,
    },
    /// Inconsistent options.
    #[error("{0}")]
    Options(String),
    /// `--prompt-type` / `--prompt-type-path` cannot be used.
    #[error("--prompt-type: {0}")]
    Template(#[from] super::handlers::template::TemplateError),
    /// `--map-keys` cannot be applied.
    #[error(transparent)]
    MapKeys(#[from] super::handlers::chat::MapKeysError),
}

/// What a run did.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Records read (in this shard).
    pub records: u64,
    /// Documents written (per output key).
    pub documents: u64,
    /// Sequences written.
    pub sequences: u64,
    /// Tokens written (first key).
    pub tokens: u64,
    /// Empty documents (written as Megatron does, with no sequence).
    pub empty_documents: u64,
    /// Skipped records by reason.
    pub skipped: BTreeMap<String, u64>,
    /// Input bytes read.
    pub input_bytes: u64,
    /// Output bytes written.
    pub output_bytes: u64,
    /// Wall time.
    pub elapsed: Duration,
    /// Output prefixes written.
    pub outputs: Vec<PathBuf>,
    /// Files of the input directories and globs that were not read (other format).
    pub skipped_files: Vec<SkippedFile>,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secs = self.elapsed.as_secs_f64().max(1e-9);
        let skipped: u64 = self.skipped.values().sum();
        write!(
            f,
            "{} records → {} documents, {} sequences, {} tokens; {} empty; {} skipped",
            self.records,
            self.documents,
            self.sequences,
            self.tokens,
            self.empty_documents,
            skipped
        )?;
        if skipped > 0 {
            let reasons: Vec<String> = self
                .skipped
                .iter()
                .map(|(r, n)| format!("{r}: {n}"))
                .collect();
            write!(f, " ({})", reasons.join(", "))?;
        }
        if !self.skipped_files.is_empty() {
            const SHOWN: usize = 5;
            let mut names: Vec<String> = self
                .skipped_files
                .iter()
                .take(SHOWN)
                .map(ToString::to_string)
                .collect();
            if self.skipped_files.len() > SHOWN {
                names.push(format!("and {} more", self.skipped_files.len() - SHOWN));
            }
            let n = self.skipped_files.len();
            let files = if n == 1 { "file" } else { "files" };
            write!(f, "; {n} {files} not read: {}", names.join(", "))?;
        }
        write!(
            f,
            "; read {:.1} MB, wrote {:.1} MB in {:.2}s ({:.0} docs/s, {:.2} M tokens/s, {:.1} MB/s)",
            self.input_bytes as f64 / 1e6,
            self.output_bytes as f64 / 1e6,
            secs,
            self.records as f64 / secs,
            self.tokens as f64 / secs / 1e6,
            self.input_bytes as f64 / secs / 1e6
        )
    }
}

/// Output prefix of one key: `{prefix}[_packed]_{key}_document`.
pub fn key_prefix(prefix: &Path, key: &str, instruction: bool) -> PathBuf {
    let mut p = prefix.as_os_str().to_owned();
    if instruction {
        p.push("_packed");
    }
    p.push(format!("_{key}_document"));
    PathBuf::from(p)
}

fn build_handler<'t>(
    opts: &PreprocessOptions,
    tok: &'t Tokenizer,
    template: Option<Template>,
) -> Result<Box<dyn Handler + 't>, PreprocessError> {
    let eod = if opts.append_eod {
        Some(tok.require_eos()?)
    } else {
        None
    };
    let Some(kind) = opts.handler else {
        return Ok(Box::new(Pretrain {
            tokenizer: tok,
            json_keys: opts.json_keys.clone(),
            eod,
            add_special_tokens: opts.add_special_tokens,
        }));
    };
    if let Some(template) = template {
        let format = match kind {
            HandlerKind::Alpaca | HandlerKind::AlpacaPairwise => ChatFormat::Alpaca,
            HandlerKind::Sharegpt | HandlerKind::SharegptPairwise => ChatFormat::Sharegpt,
            _ => return Err(PreprocessError::Options("--prompt-type works with --handler alpaca or sharegpt (belle and moss use the fixed Alpaca prompter, as in MindSpeed-LLM)".into())),
        };
        let mut columns = Columns::default();
        if let Some(m) = &opts.map_keys {
            columns = columns.with_map_keys(m)?;
        }
        if format == ChatFormat::Alpaca && columns.tools.is_some() {
            // check_dataset_info_map: not a column of AlpacaStyleInstructionHandler.
            return Err(PreprocessError::Options(
                "--map-keys: \"tools\" is not a column of the alpaca format (MindSpeed-LLM \
                 refuses it too); use --handler sharegpt"
                    .into(),
            ));
        }
        return Ok(Box::new(ChatHandler {
            tokenizer: tok,
            template,
            format,
            columns,
            cutoff_len: opts.seq_length.unwrap_or(100_000),
            eod,
            pairwise: kind.pairwise(),
        }));
    }
    let kind =
        match kind {
            HandlerKind::Alpaca => PrompterKind::Alpaca,
            HandlerKind::Belle => PrompterKind::Belle,
            HandlerKind::Moss => PrompterKind::Moss,
            HandlerKind::AlpacaPairwise | HandlerKind::SharegptPairwise => {
                return Err(PreprocessError::Options(
                    "the pairwise handlers need --prompt-type (MindSpeed-LLM encodes their \
                     pairs with its template)"
                        .into(),
                ))
            }
            HandlerKind::Sharegpt => return Err(PreprocessError::Options(
                "--handler sharegpt needs --prompt-type (e.g. qwen, chatml, llama2, alpaca, empty)"
                    .into(),
            )),
        };
    Ok(Box::new(PrompterHandler {
        tokenizer: tok,
        kind,
        eod: if kind == PrompterKind::Moss {
            None
        } else {
            eod
        },
    }))
}

fn resolve_dtype(opts: &PreprocessOptions, vocab: usize) -> Result<DType, PreprocessError> {
    let instruction = opts.handler.is_some();
    Ok(match (opts.dtype, instruction) {
        (DTypeChoice::I32, _) | (DTypeChoice::Auto, true) => DType::I32,
        (DTypeChoice::U16, true) => {
            return Err(PreprocessError::Options(
                "instruction data needs --dtype int32 (labels hold -100)".into(),
            ))
        }
        (DTypeChoice::U16, false) => DType::U16,
        (DTypeChoice::Auto, false) => DType::optimal_for_vocab(vocab),
    })
}

/// Batches items from the reader thread to the workers.
struct BatchSink {
    tx: crossbeam_channel::Sender<Vec<(u64, Item)>>,
    batch: Vec<(u64, Item)>,
    /// Input bytes of the records in `batch`.
    batch_bytes: u64,
    range: std::ops::Range<u64>,
}

impl Sink for BatchSink {
    fn wants(&mut self, index: u64) -> bool {
        self.range.contains(&index)
    }
    fn accept(&mut self, index: u64, item: Item) -> bool {
        if let Item::Record(r) = &item {
            self.batch_bytes += r.bytes;
        }
        self.batch.push((index, item));
        if self.batch.len() >= BATCH || self.batch_bytes >= BATCH_BYTES {
            self.batch_bytes = 0;
            return self.tx.send(std::mem::take(&mut self.batch)).is_ok();
        }
        true
    }
}

struct CountOnly;
impl Sink for CountOnly {
    fn wants(&mut self, _: u64) -> bool {
        false
    }
    fn accept(&mut self, _: u64, _: Item) -> bool {
        true
    }
}

/// MindSpeed's drop rule: a sequence of `limit` tokens or more in any key is dropped from all keys.
fn drop_long_sequences(doc: &mut Document, limit: usize, summary: &mut Summary) {
    let n = doc.first().map_or(0, Vec::len);
    let too_long: Vec<bool> = (0..n)
        .map(|k| {
            doc.iter()
                .any(|key| key.get(k).is_some_and(|s| s.len() >= limit))
        })
        .collect();
    let dropped = too_long.iter().filter(|&&b| b).count() as u64;
    if dropped == 0 {
        return;
    }
    *summary
        .skipped
        .entry(format!("sequence ≥ --seq-length {limit}"))
        .or_default() += dropped;
    for key in doc.iter_mut() {
        let mut k = 0;
        key.retain(|_| {
            k += 1;
            !too_long[k - 1]
        });
    }
}

/// Writers for every output key plus the packing buffer.
struct Output {
    writers: Vec<IndexedWriter>,
    seq_length: Option<usize>,
    instruction: bool,
    pack: Option<Vec<Document>>,
}

impl Output {
    /// Write one document, applying MindSpeed's `--seq-length` drop rule.
    fn write(&mut self, mut doc: Document, summary: &mut Summary) -> Result<(), PreprocessError> {
        let had_sequences = doc.iter().any(|key| !key.is_empty());
        if let Some(limit) = self.seq_length {
            drop_long_sequences(&mut doc, limit, summary);
        }
        if doc.iter().all(Vec::is_empty) {
            summary.empty_documents += 1;
            // MindSpeed writes no document for a row its handler gave no sequences, but closes
            // an (empty) document for a row whose sequences the --seq-length rule all dropped.
            if self.instruction && !had_sequences {
                return Ok(());
            }
        }
        if let Some(buffer) = self.pack.as_mut() {
            buffer.push(doc);
            return Ok(());
        }
        summary.sequences += doc.first().map_or(0, |d| d.len() as u64);
        summary.tokens += doc
            .first()
            .map_or(0, |d| d.iter().map(|s| s.len() as u64).sum());
        for (w, seqs) in self.writers.iter_mut().zip(doc.iter()) {
            w.add_document(seqs)?;
        }
        summary.documents += 1;
        Ok(())
    }
}

/// MindSpeed's `greedy_knapsack`: sorted lengths, each knapsack takes the largest that fits.
pub fn greedy_knapsack(mut lengths: Vec<usize>, capacity: usize) -> Vec<Vec<usize>> {
    lengths.sort_unstable();
    let mut out = Vec::new();
    while !lengths.is_empty() {
        let mut knapsack = Vec::new();
        let mut remaining = capacity;
        loop {
            let idx = lengths.partition_point(|&l| l <= remaining);
            if idx == 0 {
                break;
            }
            remaining -= lengths[idx - 1];
            knapsack.push(lengths.remove(idx - 1));
        }
        if knapsack.is_empty() {
            break; // cannot happen: longer samples were dropped before packing
        }
        out.push(knapsack);
    }
    out
}

/// MindSpeed's `_pack_serialize_to_disk`: pack sequences into `seq_length`-token items.
fn write_packed(
    out: &mut Output,
    docs: Vec<Document>,
    seq_length: usize,
    pad: i64,
    summary: &mut Summary,
) -> Result<(), PreprocessError> {
    let mut samples: Vec<[Vec<i64>; 3]> = Vec::new();
    for doc in docs {
        let mut keys = doc.into_iter();
        let (ids, mask, labels) = (
            keys.next().unwrap_or_default(),
            keys.next().unwrap_or_default(),
            keys.next().unwrap_or_default(),
        );
        for ((i, m), l) in ids.into_iter().zip(mask).zip(labels) {
            samples.push([i, m, l]);
        }
    }
    let mut by_length: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (n, s) in samples.iter().enumerate() {
        by_length.entry(s[0].len()).or_default().push(n);
    }
    let lengths = samples.iter().map(|s| s[0].len()).collect();
    for knapsack in greedy_knapsack(lengths, seq_length - 1) {
        let mut packed: [Vec<i64>; 3] = Default::default();
        for len in knapsack {
            let n = by_length
                .get_mut(&len)
                .and_then(Vec::pop)
                .ok_or_else(|| PreprocessError::Options("packing bookkeeping failed".into()))?;
            for (k, p) in packed.iter_mut().enumerate() {
                p.extend(&samples[n][k]);
            }
        }
        let pad_len = seq_length - packed[0].len();
        packed[0].extend(std::iter::repeat_n(pad, pad_len));
        packed[1].extend(std::iter::repeat_n(1, pad_len));
        packed[2].extend(std::iter::repeat_n(IGNORE, pad_len));
        for (w, p) in out.writers.iter_mut().zip(packed.iter()) {
            w.add_document(std::slice::from_ref(p))?;
        }
        summary.documents += 1;
        summary.sequences += 1;
        summary.tokens += seq_length as u64;
    }
    Ok(())
}

fn record_failure(
    e: &RecordError,
    skip: bool,
    location: String,
    summary: &mut Summary,
) -> Result<(), PreprocessError> {
    if skip || e.dropped_upstream {
        *summary.skipped.entry(e.reason.to_string()).or_default() += 1;
        Ok(())
    } else {
        Err(PreprocessError::Record {
            location,
            error: e.detail.clone(),
        })
    }
}

/// MindSpeed-LLM's `--enable-thinking` value: `true`, `false` or `none`, in any case.
pub fn parse_enable_thinking(value: &str) -> Result<Option<bool>, PreprocessError> {
    match value.to_lowercase().as_str() {
        "true" => Ok(Some(true)),
        "false" => Ok(Some(false)),
        "none" => Ok(None),
        _ => Err(PreprocessError::Options(format!(
            "--enable-thinking {value}: choose true, false or none"
        ))),
    }
}

/// MindSpeed-LLM's `--reasoning-effort`: `max` or `high` (argparse choices, case-sensitive).
pub fn parse_reasoning_effort(value: &str) -> Result<ReasoningEffort, PreprocessError> {
    ReasoningEffort::parse(value).ok_or_else(|| {
        PreprocessError::Options(format!("--reasoning-effort {value}: choose max or high"))
    })
}

/// MindSpeed-LLM's `--drop-thinking` value: `true` or `false`, in any case.
pub fn parse_drop_thinking(value: &str) -> Result<bool, PreprocessError> {
    match value.to_lowercase().as_str() {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(PreprocessError::Options(format!(
            "--drop-thinking {value}: choose true or false"
        ))),
    }
}

/// Run preprocessing. Outputs appear only if the whole run succeeds.
pub fn preprocess(opts: &PreprocessOptions) -> Result<Summary, PreprocessError> {
    let start = Instant::now();
    // preprocess_data.py's own check, made before anything is read.
    if opts.reasoning_effort.is_some() && opts.enable_thinking != Some(true) {
        return Err(PreprocessError::Options(
            "--reasoning-effort requires --enable-thinking true: remove --reasoning-effort or \
             enable thinking"
                .into(),
        ));
    }
    let mut tok = match opts.tokenizer_type.as_deref() {
        None => Tokenizer::load(&opts.tokenizer)?,
        Some(kind) => Tokenizer::load_as(&opts.tokenizer, kind == "MagistralTokenizer")?,
    };
    let template = match &opts.prompt_type {
        Some(name) => {
            let t = Template::load(name, opts.prompt_type_path.as_deref())?
                .with_enable_thinking(opts.enable_thinking)
                .with_reasoning(opts.reasoning_effort, opts.drop_thinking);
            t.fix_tokenizer(&mut tok)?;
            Some(t)
        }
        None => None,
    };
    if opts.pack && (opts.handler.is_none() || opts.seq_length.is_none()) {
        return Err(PreprocessError::Options(
            "--pack needs an instruction --handler and --seq-length".into(),
        ));
    }
    if opts.pack && opts.handler.is_some_and(HandlerKind::pairwise) {
        return Err(PreprocessError::Options(
            "--pack packs instruction samples; preference pairs are written one per document"
                .into(),
        ));
    }
    let handler = build_handler(opts, &tok, template)?;
    let instruction = opts.handler.is_some();
    let dtype = resolve_dtype(opts, tok.vocab_size())?;
    let prefixes: Vec<PathBuf> = handler
        .keys()
        .iter()
        .map(|k| key_prefix(&opts.output_prefix, k, instruction))
        .collect();
    let input_paths: Vec<&Path> = opts.inputs.iter().map(PathBuf::as_path).collect();
    for p in &prefixes {
        indexed::check_output(p, &input_paths, opts.force)?;
    }
    let inputs = expand_inputs_as(&opts.inputs, opts.input_format)?;
    let reader = || {
        RecordReader::new(inputs.files.clone())
            .with_max_record_bytes(opts.max_record_bytes)
            .with_columns(handler.columns())
    };
    let range = match opts.shard {
        None => 0..u64::MAX,
        Some(shard) => shard.range(reader().run(&mut CountOnly)?),
    };
    let reader = reader();
    let total_bytes = reader.total_bytes();
    let writers = prefixes
        .iter()
        .map(|p| IndexedWriter::create(p, dtype, opts.force))
        .collect::<Result<Vec<_>, _>>()?;
    let mut out = Output {
        writers,
        seq_length: opts.seq_length,
        instruction,
        pack: opts.pack.then(Vec::new),
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(opts.workers.max(1))
        .build()
        .map_err(|e| {
            PreprocessError::Options(format!("cannot start {} workers: {e}", opts.workers))
        })?;
    let bar =
        crate::util::progress_bar(total_bytes, crate::util::ProgressUnit::Bytes, opts.progress);
    let progress = reader.progress();
    let (tx, rx) = crossbeam_channel::bounded::<Vec<(u64, Item)>>(4);
    let mut summary = Summary::default();
    let read_result = std::thread::scope(|scope| -> Result<Result<u64, _>, PreprocessError> {
        let reader_thread = scope.spawn(|| {
            let mut sink = BatchSink {
                tx,
                batch: Vec::with_capacity(BATCH),
                batch_bytes: 0,
                range: range.clone(),
            };
            let r = reader.run(&mut sink);
            let rest = std::mem::take(&mut sink.batch);
            if !rest.is_empty() {
                let _ = sink.tx.send(rest);
            }
            r
        });
        let consumed = consume(
            &rx,
            &pool,
            handler.as_ref(),
            &mut out,
            opts.skip_bad_records,
            &mut summary,
            &bar,
            &progress,
        );
        drop(rx); // unblock the reader if we stopped early
        let read = reader_thread
            .join()
            .map_err(|_| PreprocessError::Options("reader thread panicked".into()))?;
        consumed?;
        Ok(read)
    })?;
    match read_result {
        Ok(_) | Err(super::source::SourceError::Stopped) => {}
        Err(e) => return Err(e.into()),
    }
    if let Some(docs) = out.pack.take() {
        let pad = tok.pad_or_eos()? as i64;
        write_packed(
            &mut out,
            docs,
            opts.seq_length.unwrap_or(0),
            pad,
            &mut summary,
        )?;
    }
    for w in out.writers {
        summary.output_bytes += w.finish()?;
    }
    bar.finish_and_clear();
    summary.input_bytes = progress.load(Ordering::Relaxed).min(total_bytes.max(1));
    summary.elapsed = start.elapsed();
    summary.outputs = prefixes;
    summary.skipped_files = inputs.skipped;
    Ok(summary)
}

#[allow(clippy::too_many_arguments)]
fn consume(
    rx: &crossbeam_channel::Receiver<Vec<(u64, Item)>>,
    pool: &rayon::ThreadPool,
    handler: &dyn Handler,
    out: &mut Output,
    skip_bad: bool,
    summary: &mut Summary,
    bar: &indicatif::ProgressBar,
    progress: &std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> Result<(), PreprocessError> {
    for batch in rx.iter() {
        let results: Vec<Result<Document, (RecordError, String)>> = pool.install(|| {
            batch
                .par_iter()
                .map(|(_, item)| match item {
                    Item::Record(r) => handler
                        .process(&r.fields)
                        .map_err(|e| (e, r.loc.to_string())),
                    Item::Bad(b) => Err((
                        RecordError::invalid(b.reason, b.detail.clone()),
                        b.loc.to_string(),
                    )),
                })
                .collect()
        });
        for r in results {
            summary.records += 1;
            match r {
                Ok(doc) => out.write(doc, summary)?,
                Err((e, loc)) => record_failure(&e, skip_bad, loc, summary)?,
            }
        }
        bar.set_position(progress.load(Ordering::Relaxed));
        bar.set_message(format!(
            "{} docs, {:.2} M tokens",
            summary.records,
            summary.tokens as f64 / 1e6
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knapsack_like_mindspeed() {
        // sorted [1,2,3,5,8], capacity 8: [8], [5,3], [2,1]
        assert_eq!(
            greedy_knapsack(vec![3, 8, 1, 5, 2], 8),
            vec![vec![8], vec![5, 3], vec![2, 1]]
        );
    }

    #[test]
    fn handler_aliases() {
        assert_eq!(
            HandlerKind::parse("BelleMultiTurnInstructionHandler"),
            Some(HandlerKind::Belle)
        );
        assert_eq!(HandlerKind::parse("nope"), None);
    }
}
