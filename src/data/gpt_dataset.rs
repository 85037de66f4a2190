//! Megatron's GPT pretraining samples, index for index: which tokens sample `k` of the train,
//! validation or test split holds, in megatron-core 0.15's order.
//!
//! Ported from Megatron-LM (tag `core_v0.15.3`): `megatron/core/datasets/gpt_dataset.py`
//! (`GPTDataset`: epochs, document / sample / shuffle indices, `__getitem__`),
//! `blended_megatron_dataset_builder.py` (split ranges, per-dataset sample budgets),
//! `blended_dataset.py` + `helpers.cpp` (`build_sample_idx`, `build_blending_indices`,
//! `build_exhaustive_blending_indices`), `utils.py` (`get_blend_from_list`, `normalize`) and
//! `blended_megatron_dataset_config.py` (`parse_and_normalize_split`). The random order comes
//! from numpy's legacy `RandomState(seed)`, reproduced draw for draw by [`Mt19937`].
//!
//! Legend: N = sequences in an indexed dataset, E = epochs, S = sequence length (tokens a
//! sample feeds the model), a sample's text is S + 1 tokens (Megatron's
//! `add_extra_token_to_sequence`, always on in `pretrain_gpt.py`).

use super::indexed::IndexedDataset;
use super::mt19937::Mt19937;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One extra token per sample: inputs are `text[..S]`, labels `text[1..]`.
const EXTRA: usize = 1;

/// What can go wrong building the samples.
#[derive(Debug, thiserror::Error)]
pub enum GptDatasetError {
    /// `--data-path` is empty or malformed.
    #[error("--data-path: {0}")]
    Blend(String),
    /// `--split` is malformed.
    #[error("--split {split:?}: {why}")]
    Split {
        /// The flag's value.
        split: String,
        /// What is wrong.
        why: String,
    },
    /// A split asks for samples from a range of the data that holds no tokens.
    #[error(
        "the {split} split of {prefix} holds no tokens (sequences {range:?} of {total}); \
         give it more data or change --split"
    )]
    EmptySplit {
        /// Split name.
        split: &'static str,
        /// Dataset prefix.
        prefix: PathBuf,
        /// Its sequence range.
        range: Range<usize>,
        /// Sequences in the dataset.
        total: usize,
    },
    /// A blend asks a dataset for more samples than it built.
    #[error(
        "the {split} blend asks {asked} samples of {prefix}, which has only {has}; \
         Megatron stops here too (raise its weight's data or lower the samples asked)"
    )]
    Oversampled {
        /// Split name.
        split: &'static str,
        /// Dataset prefix.
        prefix: PathBuf,
        /// Samples the blend wants.
        asked: u64,
        /// Samples it has.
        has: u64,
    },
    /// Too many datasets for Megatron's int16 blend index.
    #[error("{0} datasets in --data-path; Megatron's blend index holds at most 32,766")]
    TooManyDatasets(usize),
    /// The indexed dataset could not be read.
    #[error(transparent)]
    Indexed(#[from] super::indexed::IndexedError),
}

type Result<T> = std::result::Result<T, GptDatasetError>;

/// Megatron's three splits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Training.
    Train = 0,
    /// Validation.
    Valid = 1,
    /// Test.
    Test = 2,
}

impl Split {
    /// All three, in Megatron's order.
    pub const ALL: [Split; 3] = [Split::Train, Split::Valid, Split::Test];

    /// Megatron's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Valid => "valid",
            Split::Test => "test",
        }
    }
}

/// `--data-path` parsed: prefixes and, if given, their weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Blend {
    /// Dataset prefixes (`.bin/.idx` without the extension).
    pub prefixes: Vec<PathBuf>,
    /// Weights as given (not normalized), one per prefix.
    pub weights: Option<Vec<f64>>,
}

impl Blend {
    /// Megatron's `get_blend_from_list`: an odd-length list is prefixes; an even-length one is
    /// `weight prefix weight prefix …` when every weight parses as a number, else prefixes.
    pub fn parse(items: &[String]) -> Result<Blend> {
        if items.is_empty() {
            return Err(GptDatasetError::Blend("no dataset prefix given".into()));
        }
        let prefixes = |items: &[String]| items.iter().map(|p| PathBuf::from(p.trim())).collect();
        if items.len() % 2 == 1 {
            return Ok(Blend {
                prefixes: prefixes(items),
                weights: None,
            });
        }
        let weights: Vec<Option<f64>> = items
            .iter()
            .step_by(2)
            .map(|w| w.trim().parse::<f64>().ok())
            .collect();
        if weights.iter().all(Option::is_none) {
            return Ok(Blend {
                prefixes: prefixes(items),
                weights: None,
            });
        }
        if weights.iter().any(Option::is_none) {
            return Err(GptDatasetError::Blend(format!(
                "either every other item is a weight (`W1 PREFIX1 W2 PREFIX2 …`) or none is; \
                 got {items:?}"
            )));
        }
        let weights: Vec<f64> = weights.into_iter().flatten().collect();
        if let Some(w) = weights.iter().find(|w| !(w.is_finite() && **w > 0.0)) {
            return Err(GptDatasetError::Blend(format!(
                "weight {w} is not a positive number (Megatron requires weights > 0)"
            )));
        }
        let odd: Vec<String> = items.iter().skip(1).step_by(2).cloned().collect();
        Ok(Blend {
            prefixes: prefixes(&odd),
            weights: Some(weights),
        })
    }
}

/// `numpy.sum` of float64: pairwise summation as numpy's `pairwise_sum` does it (8
/// accumulators up to 128 values, halves above), so normalized weights equal numpy's to the
/// last bit (they decide the blend order).
pub fn numpy_sum(a: &[f64]) -> f64 {
    let n = a.len();
    if n < 8 {
        return a.iter().fold(-0.0, |s, &x| s + x);
    }
    if n <= 128 {
        let mut r = [0f64; 8];
        r.copy_from_slice(&a[..8]);
        let whole = n - n % 8;
        for block in a[8..whole].chunks_exact(8) {
            for (acc, x) in r.iter_mut().zip(block) {
                *acc += x;
            }
        }
        let mut res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for x in &a[whole..] {
            res += x;
        }
        return res;
    }
    let half = n / 2;
    let half = half - half % 8;
    numpy_sum(&a[..half]) + numpy_sum(&a[half..])
}

/// Megatron's `normalize`: `w / numpy.sum(w)`.
pub fn normalize(w: &[f64]) -> Vec<f64> {
    let total = numpy_sum(w);
    w.iter().map(|x| x / total).collect()
}

/// The weights of `--split` as Megatron reads them (megatron-core
/// `parse_and_normalize_split`): the numbers in the string (`re.findall("[.0-9]+")`) padded
/// with zeros to three; and the runs of characters it skips other than the separators (commas,
/// spaces): `"x"` in `80,x,20` (read as 80, 20, 0), `"-"` in `-1,1,1`.
pub fn split_weights(split: &str) -> Result<([f64; 3], Vec<String>)> {
    let bad = |why: String| GptDatasetError::Split {
        split: split.to_string(),
        why,
    };
    let mut numbers = Vec::new();
    let mut skipped = Vec::new();
    let (mut number, mut other) = (String::new(), String::new());
    for c in split.chars().chain(std::iter::once(',')) {
        let part_of_number = c.is_ascii_digit() || c == '.';
        if !part_of_number && !number.is_empty() {
            let v = number
                .parse::<f64>()
                .map_err(|_| bad(format!("{number:?} is not a number")))?;
            numbers.push(v);
            number.clear();
        }
        let separator = c == ',' || c.is_whitespace();
        if (part_of_number || separator) && !other.is_empty() {
            skipped.push(std::mem::take(&mut other));
        }
        match (part_of_number, separator) {
            (true, _) => number.push(c),
            (false, false) => other.push(c),
            (false, true) => {}
        }
    }
    if numbers.is_empty() {
        let quoted: Vec<String> = skipped.iter().map(|s| format!("{s:?}")).collect();
        return Err(bad(format!(
            "no number in it (Megatron reads only the runs of digits and dots; skipped {})",
            quoted.join(", ")
        )));
    }
    if numbers.len() > 3 {
        return Err(bad(format!(
            "{} numbers; Megatron takes at most three (train, valid, test)",
            numbers.len()
        )));
    }
    numbers.resize(3, 0.0);
    Ok(([numbers[0], numbers[1], numbers[2]], skipped))
}

/// `--split` as Megatron reads it ([`split_weights`]), normalized, then cumulated into
/// `[lo, hi)` book-ends; a split of zero weight is `None` (not built).
pub fn split_matrix(split: &str) -> Result<[Option<(f64, f64)>; 3]> {
    let (numbers, _) = split_weights(split)?;
    if numbers.iter().sum::<f64>() <= 0.0 {
        return Err(GptDatasetError::Split {
            split: split.to_string(),
            why: "every weight is zero".into(),
        });
    }
    let v = normalize(&numbers);
    // Python: functools.reduce from [0] (an int, so the first book-end is exactly 0).
    let ends = [0.0, v[0], v[0] + v[1], v[0] + v[1] + v[2]];
    Ok([0, 1, 2].map(|i| (ends[i + 1] > ends[i]).then_some((ends[i], ends[i + 1]))))
}

/// Python's `int(round(x))` for the non-negative values a split book-end gives: round half
/// to even.
fn round_half_even(x: f64) -> usize {
    let r = x.round();
    let r = if (x - x.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        r - x.signum()
    } else {
        r
    };
    r as usize
}

/// The sequences of a dataset of `n` that a split's book-ends select.
pub fn split_range(bookends: (f64, f64), n: usize) -> Range<usize> {
    round_half_even(bookends.0 * n as f64)..round_half_even(bookends.1 * n as f64)
}

/// What decides a dataset's samples besides its data.
#[derive(Debug, Clone)]
pub struct SampleConfig {
    /// S: tokens a sample feeds the model.
    pub seq_length: usize,
    /// `--seed` (numpy `RandomState` seed).
    pub seed: u32,
    /// `--mid-level-dataset-surplus`: the extra share of samples each blended dataset builds
    /// ([`MID_LEVEL_SURPLUS`] by default).
    pub surplus: f64,
}

/// One split of one indexed dataset as Megatron's `GPTDataset` samples it.
pub struct GptDataset {
    data: Arc<IndexedDataset>,
    prefix: PathBuf,
    /// `[E·|range|]`: the order in which sequences are concatenated.
    document_index: Vec<u32>,
    /// `[samples + 1]`: (position in `document_index`, token offset) where each sample starts.
    sample_index: Vec<(usize, usize)>,
    /// `[samples]`: sample `k` is the `shuffle_index[k]`-th of the concatenation.
    shuffle_index: Vec<u64>,
    seq_length: usize,
}

impl GptDataset {
    /// Build the indices of `range` of `data` for `num_samples` samples (one epoch when
    /// `None`), as `GPTDataset._build_document_sample_shuffle_indices` does.
    pub fn build(
        data: Arc<IndexedDataset>,
        prefix: &Path,
        range: Range<usize>,
        num_samples: Option<u64>,
        split: Split,
        cfg: &SampleConfig,
    ) -> Result<GptDataset> {
        let s = cfg.seq_length as u64;
        let extra = EXTRA as u64;
        let tokens_per_epoch: u64 = range.clone().map(|i| data.sequence_length(i) as u64).sum();
        // Megatron would loop forever on an empty split (its epoch count never reaches the
        // request), and build_sample_idx asserts more than one token per epoch.
        if tokens_per_epoch <= 1 {
            return Err(GptDatasetError::EmptySplit {
                split: split.name(),
                prefix: prefix.to_path_buf(),
                range,
                total: data.len(),
            });
        }
        let epochs = match num_samples {
            None => 1,
            Some(n) => (n * s + extra).div_ceil(tokens_per_epoch).max(1),
        };
        let mut rng = Mt19937::numpy(cfg.seed);
        let docs: Vec<u32> = range.clone().map(|i| i as u32).collect();
        let per_epoch = (tokens_per_epoch - extra) / s;
        // Megatron shuffles a final epoch of which few samples are used on its own, so that
        // its documents are not spread over the whole run.
        let separate = match num_samples {
            Some(n) if epochs > 1 => {
                let sans_final = ((epochs - 1) * tokens_per_epoch - extra) / s;
                let from_final = n.saturating_sub(sans_final);
                (from_final as f64) < (0.80 * per_epoch as f64).trunc()
            }
            _ => false,
        };
        let document_index = if separate {
            let mut first = tile(&docs, epochs - 1);
            rng.numpy_shuffle(&mut first);
            let mut last = docs.clone();
            rng.numpy_shuffle(&mut last);
            first.extend(last);
            first
        } else {
            let mut all = tile(&docs, epochs);
            rng.numpy_shuffle(&mut all);
            all
        };
        let sample_index = build_sample_index(
            &data,
            &document_index,
            cfg.seq_length,
            epochs * tokens_per_epoch,
        );
        let total = (sample_index.len() - 1) as u64;
        let shuffle_index = if separate {
            let sans_final = ((epochs - 1) * tokens_per_epoch - extra) / s;
            let mut first: Vec<u64> = (0..sans_final).collect();
            rng.numpy_shuffle(&mut first);
            let mut last: Vec<u64> = (sans_final..total).collect();
            rng.numpy_shuffle(&mut last);
            first.extend(last);
            first
        } else {
            let mut all: Vec<u64> = (0..total).collect();
            rng.numpy_shuffle(&mut all);
            all
        };
        Ok(GptDataset {
            data,
            prefix: prefix.to_path_buf(),
            document_index,
            sample_index,
            shuffle_index,
            seq_length: cfg.seq_length,
        })
    }

    /// Samples it holds (`len(GPTDataset)`).
    pub fn len(&self) -> usize {
        self.shuffle_index.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.shuffle_index.is_empty()
    }

    /// The S + 1 tokens of sample `idx` (`_query_document_sample_shuffle_indices`), padded
    /// with `pad` (Megatron's pad id, −1 when the tokenizer has none) if the data runs out.
    pub fn text(&self, idx: usize, pad: i64) -> Vec<i64> {
        let j = self.shuffle_index[idx] as usize;
        let (first, first_offset) = self.sample_index[j];
        let (last, last_offset) = self.sample_index[j + 1];
        let want = self.seq_length + EXTRA;
        let mut text = Vec::with_capacity(want);
        for (pos, &doc) in self.document_index[first..=last].iter().enumerate() {
            let pos = first + pos;
            let from = if pos == first { first_offset } else { 0 };
            let len = if pos == last {
                (last_offset + EXTRA).saturating_sub(from)
            } else {
                usize::MAX
            };
            self.data.tokens_into(doc as usize, from, len, &mut text);
        }
        text.resize(want, pad);
        text
    }

    /// Its dataset prefix.
    pub fn prefix(&self) -> &Path {
        &self.prefix
    }
}

/// `docs` repeated `epochs` times, epoch after epoch.
fn tile(docs: &[u32], epochs: u64) -> Vec<u32> {
    let mut out = Vec::with_capacity(docs.len() * epochs as usize);
    for _ in 0..epochs {
        out.extend_from_slice(docs);
    }
    out
}

/// `helpers.cpp` `build_sample_idx` (train: the last partial sample dropped): where each
/// sample of S + 1 tokens starts in the concatenation of `document_index`'s sequences,
/// consecutive samples overlapping by one token.
fn build_sample_index(
    data: &IndexedDataset,
    document_index: &[u32],
    seq_length: usize,
    tokens: u64,
) -> Vec<(usize, usize)> {
    let samples = ((tokens - EXTRA as u64) / seq_length as u64) as usize;
    let len = |pos: usize| data.sequence_length(document_index[pos] as usize) as i64;
    let mut index = Vec::with_capacity(samples + 1);
    let (mut pos, mut offset) = (0usize, 0i64);
    index.push((0, 0));
    while index.len() <= samples {
        let mut remaining = (seq_length + EXTRA) as i64;
        while remaining != 0 {
            let doc_len = len(pos) - offset;
            remaining -= doc_len;
            if remaining <= 0 {
                offset += remaining + doc_len - EXTRA as i64;
                remaining = 0;
            } else if pos == document_index.len() - 1 {
                offset = len(pos) - EXTRA as i64;
                break;
            } else {
                pos += 1;
                offset = 0;
            }
        }
        index.push((pos, offset as usize));
    }
    index
}

/// A split's samples: one dataset, or Megatron's blend of several.
pub enum SplitSamples {
    /// One prefix without a weight.
    Single(GptDataset),
    /// Several prefixes (or one with a weight): sample `k` is sample
    /// `dataset_sample_index[k]` of dataset `dataset_index[k]`.
    Blended {
        /// The mid-level datasets.
        datasets: Vec<GptDataset>,
        /// `[size]`: which dataset.
        dataset_index: Vec<u16>,
        /// `[size]`: which of its samples.
        dataset_sample_index: Vec<u64>,
    },
}

impl SplitSamples {
    /// Samples it holds.
    pub fn len(&self) -> usize {
        match self {
            SplitSamples::Single(d) => d.len(),
            SplitSamples::Blended { dataset_index, .. } => dataset_index.len(),
        }
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The S + 1 tokens of sample `k`, and the dataset (index into the blend) it came from.
    pub fn text(&self, k: usize, pad: i64) -> (usize, Vec<i64>) {
        match self {
            SplitSamples::Single(d) => (0, d.text(k, pad)),
            SplitSamples::Blended {
                datasets,
                dataset_index,
                dataset_sample_index,
            } => {
                let d = dataset_index[k] as usize;
                (d, datasets[d].text(dataset_sample_index[k] as usize, pad))
            }
        }
    }
}

/// `_get_size_per_split_per_dataset`: `ceil(ceil(size · w) · (1 + surplus))`.
fn samples_per_dataset(weight: f64, size: u64, surplus: f64) -> u64 {
    ((size as f64 * weight).ceil() * (1.0 + surplus)).ceil() as u64
}

/// Megatron's default `--mid-level-dataset-surplus`.
pub const MID_LEVEL_SURPLUS: f64 = 0.005;

/// Build the samples of each split Megatron would build (`BlendedMegatronDatasetBuilder`
/// with a blend and `--split`): `sizes[s]` samples asked of split `s` (`None`: one epoch).
/// A split of zero weight, or one not asked for (`wanted[s]` false), is `None`.
pub fn build_splits(
    blend: &Blend,
    split: &str,
    sizes: [Option<u64>; 3],
    wanted: [bool; 3],
    cfg: &SampleConfig,
) -> Result<[Option<SplitSamples>; 3]> {
    let matrix = split_matrix(split)?;
    if blend.prefixes.len() >= 32_767 {
        return Err(GptDatasetError::TooManyDatasets(blend.prefixes.len()));
    }
    let data: Vec<Arc<IndexedDataset>> = blend
        .prefixes
        .iter()
        .map(|p| IndexedDataset::open(p).map(Arc::new))
        .collect::<std::result::Result<_, _>>()?;
    let weights = blend.weights.as_deref().map(normalize);
    let mut out: [Option<SplitSamples>; 3] = [None, None, None];
    for s in Split::ALL {
        let (Some(bookends), true) = (matrix[s as usize], wanted[s as usize]) else {
            continue;
        };
        let size = sizes[s as usize];
        let build = |d: usize, n: Option<u64>| {
            let range = split_range(bookends, data[d].len());
            GptDataset::build(data[d].clone(), &blend.prefixes[d], range, n, s, cfg)
        };
        out[s as usize] = Some(match (&weights, size) {
            (None, _) if data.len() == 1 => SplitSamples::Single(build(0, size)?),
            (Some(w), Some(size)) => {
                let budgets: Vec<u64> = w
                    .iter()
                    .map(|&w| samples_per_dataset(w, size, 0.0))
                    .collect();
                let datasets = (0..data.len())
                    .map(|d| build(d, Some(samples_per_dataset(w[d], size, cfg.surplus))))
                    .collect::<Result<Vec<_>>>()?;
                let total: u64 = budgets.iter().sum();
                // BlendedDataset normalizes the (already normalized) weights once more.
                let (index, sample) = blending_indices(&normalize(w), total);
                blended(datasets, index, sample, s)?
            }
            (Some(_), None) => {
                return Err(GptDatasetError::Blend(
                    "weighted blends need a number of samples (Megatron: \"Using \
                     client-specified weights requires client-specified size\")"
                        .into(),
                ))
            }
            (None, size) => {
                let datasets = (0..data.len())
                    .map(|d| build(d, None))
                    .collect::<Result<Vec<_>>>()?;
                let lengths: Vec<u64> = datasets.iter().map(|d| d.len() as u64).collect();
                let (index, sample) = match size {
                    Some(size) => {
                        let size = size.min(lengths.iter().sum());
                        let w: Vec<f64> = lengths.iter().map(|&l| l as f64).collect();
                        blending_indices(&normalize(&w), size)
                    }
                    None => exhaustive_blending_indices(&lengths),
                };
                blended(datasets, index, sample, s)?
            }
        });
    }
    Ok(out)
}

/// A blend, after Megatron's check that no dataset is asked for more than it holds.
fn blended(
    datasets: Vec<GptDataset>,
    dataset_index: Vec<u16>,
    dataset_sample_index: Vec<u64>,
    split: Split,
) -> Result<SplitSamples> {
    let mut asked = vec![0u64; datasets.len()];
    for &d in &dataset_index {
        asked[d as usize] += 1;
    }
    for (d, &n) in asked.iter().enumerate() {
        if n > datasets[d].len() as u64 {
            return Err(GptDatasetError::Oversampled {
                split: split.name(),
                prefix: datasets[d].prefix.clone(),
                asked: n,
                has: datasets[d].len() as u64,
            });
        }
    }
    Ok(SplitSamples::Blended {
        datasets,
        dataset_index,
        dataset_sample_index,
    })
}

/// `helpers.cpp` `build_blending_indices`: sample `k` goes to the dataset furthest behind its
/// weight (the first on ties), no randomness.
fn blending_indices(weights: &[f64], size: u64) -> (Vec<u16>, Vec<u64>) {
    let mut counts = vec![0u64; weights.len()];
    let mut index = Vec::with_capacity(size as usize);
    let mut sample = Vec::with_capacity(size as usize);
    for k in 0..size {
        let x = (k as f64).max(1.0);
        let mut best = 0;
        let mut best_err = weights[0] * x - counts[0] as f64;
        for (d, &w) in weights.iter().enumerate().skip(1) {
            let err = w * x - counts[d] as f64;
            if err > best_err {
                best_err = err;
                best = d;
            }
        }
        index.push(best as u16);
        sample.push(counts[best]);
        counts[best] += 1;
    }
    (index, sample)
}

/// `helpers.cpp` `build_exhaustive_blending_indices`: every sample of every dataset once,
/// interleaved in proportion to their sizes.
fn exhaustive_blending_indices(sizes: &[u64]) -> (Vec<u16>, Vec<u64>) {
    let total: u64 = sizes.iter().sum();
    let weights: Vec<f64> = sizes.iter().map(|&s| s as f64 / total as f64).collect();
    let mut counts = vec![0u64; sizes.len()];
    let mut unspent: Vec<usize> = (0..sizes.len()).filter(|&d| sizes[d] > 0).collect();
    let mut index = Vec::with_capacity(total as usize);
    let mut sample = Vec::with_capacity(total as usize);
    let mut k = 0u64;
    while !unspent.is_empty() {
        let x = (k as f64).max(1.0);
        let mut best = unspent[0];
        let mut best_err = f64::MIN;
        for &d in &unspent {
            let err = weights[d] * x - counts[d] as f64;
            if err > best_err {
                best_err = err;
                best = d;
            }
        }
        index.push(best as u16);
        sample.push(counts[best]);
        counts[best] += 1;
        if counts[best] == sizes[best] {
            unspent.retain(|&d| d != best);
        }
        k += 1;
    }
    (index, sample)
}

/// A training sample as `GPTDataset.__getitem__` returns it.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// `[S]` input ids.
    pub tokens: Vec<u32>,
    /// `[S]` target ids.
    pub labels: Vec<u32>,
    /// `[S]` 1 where the prediction counts in the loss.
    pub loss_mask: Vec<f32>,
    /// Start of each attention segment (a new one after every EOD input token with
    /// `--reset-attention-mask`; `[0]` otherwise).
    pub segments: Vec<usize>,
}

/// Megatron's per-sample masking choices.
#[derive(Debug, Clone, Copy)]
pub struct MaskConfig {
    /// The tokenizer's end-of-document id.
    pub eod: u32,
    /// The tokenizer's pad id, if it has one.
    pub pad: Option<u32>,
    /// `--eod-mask-loss`: no loss on the prediction made after an EOD input token.
    pub eod_mask_loss: bool,
    /// `--reset-attention-mask`: attention never crosses an EOD.
    pub reset_attention_mask: bool,
}

impl MaskConfig {
    /// The pad value text is filled with (Megatron's `_PAD_TOKEN_ID` −1 without a pad id).
    pub fn pad_value(&self) -> i64 {
        self.pad.map_or(-1, i64::from)
    }

    /// Split S + 1 tokens into inputs and labels with the loss mask and attention segments
    /// (`__getitem__` and `_get_ltor_masks_and_position_ids`). Pad tokens become id 0 and are
    /// masked out of the loss, as Megatron does.
    pub fn sample(&self, text: &[i64]) -> Sample {
        let pad = self.pad_value();
        let s = text.len() - 1;
        let inputs = &text[..s];
        let targets = &text[1..];
        let mut loss_mask = vec![1f32; s];
        let mut segments = vec![0];
        for (i, &t) in inputs.iter().enumerate() {
            if t == i64::from(self.eod) {
                if self.eod_mask_loss {
                    loss_mask[i] = 0.0;
                }
                if self.reset_attention_mask && i + 1 < s {
                    segments.push(i + 1);
                }
            }
        }
        for (m, &l) in loss_mask.iter_mut().zip(targets) {
            if l == pad {
                *m = 0.0;
            }
        }
        let id = |t: i64| if t == pad { 0 } else { t as u32 };
        Sample {
            tokens: inputs.iter().map(|&t| id(t)).collect(),
            labels: targets.iter().map(|&t| id(t)).collect(),
            loss_mask,
            segments,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blend_lists_parse_as_megatron() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let b = Blend::parse(&s(&["a"])).unwrap();
        assert_eq!((b.prefixes.len(), b.weights), (1, None));
        let b = Blend::parse(&s(&["30", "a", "70", "b"])).unwrap();
        assert_eq!(b.weights, Some(vec![30.0, 70.0]));
        assert_eq!(b.prefixes, [PathBuf::from("a"), PathBuf::from("b")]);
        let b = Blend::parse(&s(&["a", "b"])).unwrap();
        assert_eq!((b.prefixes.len(), b.weights), (2, None));
        assert!(Blend::parse(&s(&["1", "a", "b", "c"])).is_err());
        assert!(Blend::parse(&s(&["0", "a"])).is_err());
        assert!(Blend::parse(&[]).is_err());
    }

    #[test]
    fn split_strings_parse_as_megatron() {
        let m = split_matrix("969, 30, 1").unwrap();
        assert_eq!(m[0], Some((0.0, 0.969)));
        assert_eq!(m[1], Some((0.969, 0.999)));
        assert_eq!(m[2].map(|b| b.0), Some(0.999));
        assert_eq!(split_range(m[0].unwrap(), 1000), 0..969);
        assert_eq!(split_range(m[0].unwrap(), 1001), 0..970);
        let m = split_matrix("98,2,0").unwrap();
        assert!(m[2].is_none());
        assert_eq!(split_matrix("1").unwrap()[0], Some((0.0, 1.0)));
        assert!(split_matrix("0,0,0").is_err());
        assert!(split_matrix("1,2,3,4").is_err());
        assert_eq!(
            split_weights("80,x,20").unwrap(),
            ([80.0, 20.0, 0.0], vec!["x".into()])
        );
        assert_eq!(split_weights("-1, 1,1").unwrap().1, vec!["-".to_string()]);
        assert_eq!(split_weights("98, 2, 0").unwrap().1, Vec::<String>::new());
        let err = split_weights("a,b,c").unwrap_err().to_string();
        assert!(
            err.contains(r#"no number in it"#) && err.contains(r#""a", "b", "c""#),
            "{err}"
        );
    }

    #[test]
    fn python_rounding_is_half_to_even() {
        assert_eq!(round_half_even(2.5), 2);
        assert_eq!(round_half_even(3.5), 4);
        assert_eq!(round_half_even(2.4999), 2);
        assert_eq!(round_half_even(0.5), 0);
    }

    // The worked example of build_sample_idx: sizes [5, 3, 7], S = 4, one epoch.
    #[test]
    fn sample_index_matches_the_worked_example() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("d");
        let mut w = super::super::indexed::IndexedWriter::create(
            &prefix,
            super::super::indexed::DType::I32,
            false,
        )
        .unwrap();
        for (base, n) in [(100, 5), (200, 3), (300, 7)] {
            let seq: Vec<i32> = (base..base + n).collect();
            w.add_document(&[seq]).unwrap();
        }
        w.finish().unwrap();
        let data = IndexedDataset::open(&prefix).unwrap();
        let index = build_sample_index(&data, &[0, 1, 2], 4, 15);
        assert_eq!(index, [(0, 0), (0, 4), (2, 0), (2, 4)]);
    }

    #[test]
    fn blending_follows_the_weights() {
        let (index, sample) = blending_indices(&[0.25, 0.75], 8);
        assert_eq!(index, [1, 0, 1, 1, 0, 1, 1, 1]);
        assert_eq!(sample, [0, 0, 1, 2, 1, 3, 4, 5]);
        let (index, _) = exhaustive_blending_indices(&[1, 3]);
        assert_eq!(index.iter().filter(|&&d| d == 0).count(), 1);
        assert_eq!(index.len(), 4);
    }

    #[test]
    fn masks_follow_megatron() {
        let cfg = MaskConfig {
            eod: 2,
            pad: None,
            eod_mask_loss: true,
            reset_attention_mask: true,
        };
        let s = cfg.sample(&[5, 2, 7, 8, -1]);
        assert_eq!(s.tokens, [5, 2, 7, 8]);
        assert_eq!(s.labels, [2, 7, 8, 0]);
        assert_eq!(s.loss_mask, [1.0, 0.0, 1.0, 0.0]);
        assert_eq!(s.segments, [0, 2]);
    }

    #[test]
    fn pairwise_sum_matches_numpy_on_known_values() {
        // numpy.sum([1e16, 1.0, 1.0]) == 1e16 (sequential below 8 values).
        assert_eq!(numpy_sum(&[1e16, 1.0, 1.0]), 1e16);
        assert_eq!(numpy_sum(&[1.0, 1.0, 1e16]), 1.0000000000000002e16);
    }
}
