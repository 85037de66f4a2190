//! MindSpeed-LLM's fine-tuning samples (`--is-instruction-dataset`): the
//! `<prefix>_packed_{input_ids,labels,attention_mask}_document` files `mindkit preprocess
//! --handler …` writes, split, shuffled and cut as MindSpeed-LLM's `DecoderPackedMTFDataset`
//! does (MindSpeed-LLM `mindspeed_llm/tasks/dataset/decoder_packed_mtf_dataset.py`,
//! `mtf_dataset.py`; the split is Megatron's legacy `get_train_valid_test_split_`,
//! megatron/legacy/data/dataset_utils.py).
//!
//! Legend: N = sequences (one instruction sample, or one pack, each), S = `--seq-length`.

use super::indexed::IndexedDataset;
use super::mt19937::Mt19937;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// The label of a position that is not scored.
pub const IGNORE: i64 = -100;

/// What can go wrong.
#[derive(Debug, thiserror::Error)]
pub enum SftError {
    /// A field file is missing.
    #[error("{0}: not found; fine-tuning data is made by `mindkit preprocess --handler …` (expected {1})")]
    Missing(PathBuf, String),
    /// The field files disagree.
    #[error("{prefix}: input_ids holds {ids} sequences, {field} {other}")]
    Mismatch {
        /// Prefix.
        prefix: PathBuf,
        /// Sequences in input_ids.
        ids: usize,
        /// The other field.
        field: &'static str,
        /// Its sequences.
        other: usize,
    },
    /// `--split` is malformed.
    #[error("--split {0:?}: {1}")]
    Split(String, String),
    /// A sample cannot be cut to the sequence length.
    #[error("{prefix}: sequence {index} ({len} tokens) {why}")]
    Sample {
        /// Prefix.
        prefix: PathBuf,
        /// Sequence.
        index: usize,
        /// Its length.
        len: usize,
        /// What is wrong.
        why: String,
    },
    /// A split holds no sequences.
    #[error("the {0} split holds no fine-tuning samples; give it data or change --split")]
    Empty(&'static str),
    /// The data could not be read.
    #[error(transparent)]
    Indexed(#[from] super::indexed::IndexedError),
}

type Result<T> = std::result::Result<T, SftError>;

/// The packed fine-tuning files of one prefix.
pub struct SftDataset {
    prefix: PathBuf,
    input_ids: IndexedDataset,
    labels: IndexedDataset,
    attention_mask: Option<IndexedDataset>,
}

fn field(prefix: &Path, name: &str) -> PathBuf {
    let mut p = prefix.as_os_str().to_owned();
    p.push(format!("_packed_{name}_document"));
    PathBuf::from(p)
}

impl SftDataset {
    /// Open `<prefix>_packed_{input_ids,labels[,attention_mask]}_document`.
    pub fn open(prefix: &Path) -> Result<SftDataset> {
        Self::open_fields(prefix, "")
    }

    /// Open `<prefix>_packed_{part}{input_ids,labels[,attention_mask]}_document`.
    fn open_fields(prefix: &Path, part: &str) -> Result<SftDataset> {
        let open = |name: &str| -> Result<Option<IndexedDataset>> {
            let p = field(prefix, name);
            let mut idx = p.as_os_str().to_owned();
            idx.push(".idx");
            if !Path::new(&idx).is_file() {
                return Ok(None);
            }
            Ok(Some(IndexedDataset::open(&p)?))
        };
        let required = |name: &str| -> Result<IndexedDataset> {
            let name = format!("{part}{name}");
            open(&name)?.ok_or_else(|| {
                SftError::Missing(
                    field(prefix, &name),
                    format!("_packed_{name}_document.bin/.idx"),
                )
            })
        };
        let input_ids = required("input_ids")?;
        let labels = required("labels")?;
        let attention_mask = open(&format!("{part}attention_mask"))?;
        for (name, other) in [
            ("labels", Some(&labels)),
            ("attention_mask", attention_mask.as_ref()),
        ] {
            if let Some(o) = other.filter(|o| o.len() != input_ids.len()) {
                return Err(SftError::Mismatch {
                    prefix: prefix.to_path_buf(),
                    ids: input_ids.len(),
                    field: name,
                    other: o.len(),
                });
            }
        }
        Ok(SftDataset {
            prefix: prefix.to_path_buf(),
            input_ids,
            labels,
            attention_mask,
        })
    }

    /// Sequences.
    pub fn len(&self) -> usize {
        self.input_ids.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.input_ids.len() == 0
    }

    /// The largest token id of the input ids.
    pub fn max_token(&self) -> i64 {
        self.input_ids.max_token()
    }

    /// Input ids and labels of sequence `i`, cut to `seq_length` as MindSpeed-LLM's
    /// `_cut_instruction_token` cuts a longer sample (per prompt/answer turn).
    pub fn sample(&self, i: usize, seq_length: usize) -> Result<(Vec<i64>, Vec<i64>)> {
        let ids = self.input_ids.sequence(i);
        let labels = self.labels.sequence(i);
        if ids.len() != labels.len() || ids.is_empty() {
            return Err(SftError::Sample {
                prefix: self.prefix.clone(),
                index: i,
                len: ids.len(),
                why: format!("has {} labels for {} input ids", labels.len(), ids.len()),
            });
        }
        if ids.len() <= seq_length {
            return Ok((ids, labels));
        }
        cut_turns(&ids, &labels, seq_length).map_err(|why| SftError::Sample {
            prefix: self.prefix.clone(),
            index: i,
            len: ids.len(),
            why,
        })
    }

    /// The stored attention-mask values of sequence `i` (neat packing numbers its
    /// sub-samples 1, 2, … and its tail padding 0).
    pub fn attention_mask(&self, i: usize) -> Option<Vec<i64>> {
        self.attention_mask.as_ref().map(|m| m.sequence(i))
    }
}

/// The preference pairs of one prefix (`--is-pairwise-dataset`): the
/// `<prefix>_packed_{chosen,rejected}_{input_ids,labels}_document` files MindSpeed-LLM's
/// pairwise handlers (`AlpacaStylePairwiseHandler`, `SharegptStylePairwiseHandler`) write, a
/// prompt followed by the chosen answer and the same prompt followed by the rejected one.
pub struct PairwiseDataset {
    chosen: SftDataset,
    rejected: SftDataset,
}

impl PairwiseDataset {
    /// Open the four files of `prefix`.
    pub fn open(prefix: &Path) -> Result<PairwiseDataset> {
        let chosen = SftDataset::open_fields(prefix, "chosen_")?;
        let rejected = SftDataset::open_fields(prefix, "rejected_")?;
        if rejected.len() != chosen.len() {
            return Err(SftError::Mismatch {
                prefix: prefix.to_path_buf(),
                ids: chosen.len(),
                field: "rejected_input_ids",
                other: rejected.len(),
            });
        }
        Ok(PairwiseDataset { chosen, rejected })
    }

    /// Pairs.
    pub fn len(&self) -> usize {
        self.chosen.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.chosen.is_empty()
    }

    /// The largest token id of the input ids.
    pub fn max_token(&self) -> i64 {
        self.chosen.max_token().max(self.rejected.max_token())
    }

    /// Pair `i` as (input ids, labels) of the chosen and of the rejected answer, cut to
    /// `seq_length` as MindSpeed-LLM's `_cut_pairwise_token` cuts them
    /// (mindspeed_llm/tasks/preprocess/decoder_packed_mtf_dataset.py): the prompt is the chosen
    /// sequence's tokens before its first scored label; it and the longer answer share
    /// `seq_length` by `_infer_seqlen`, both answers keep as many tokens, and an answer's labels
    /// are its own input ids.
    pub fn pair(&self, i: usize, seq_length: usize) -> Result<[(Vec<i64>, Vec<i64>); 2]> {
        let chosen_ids = self.chosen.input_ids.sequence(i);
        let chosen_labels = self.chosen.labels.sequence(i);
        let rejected_ids = self.rejected.input_ids.sequence(i);
        let bad = |len: usize, why: &str| SftError::Sample {
            prefix: self.chosen.prefix.clone(),
            index: i,
            len,
            why: why.to_string(),
        };
        let prompt = (chosen_labels.iter().take(chosen_ids.len()))
            .position(|&l| l != IGNORE)
            .ok_or_else(|| bad(chosen_ids.len(), "has no scored label in its chosen answer"))?;
        if rejected_ids.len() < prompt {
            return Err(bad(
                rejected_ids.len(),
                "(its rejected sequence) is shorter than its chosen sequence's prompt",
            ));
        }
        let (chosen, rejected) = (&chosen_ids[prompt..], &rejected_ids[prompt..]);
        let (s, t) = infer_seqlen(prompt, chosen.len().max(rejected.len()), seq_length);
        Ok([chosen, rejected].map(|answer| {
            let answer = &answer[..t.min(answer.len())];
            let ids = [&chosen_ids[..s], answer].concat();
            let labels = std::iter::repeat_n(IGNORE, s).chain(answer.iter().copied());
            (ids, labels.collect())
        }))
    }
}

/// `_infer_seqlen`: how many source and target tokens of a turn fit in `cut`.
fn infer_seqlen(source: usize, target: usize, cut: usize) -> (usize, usize) {
    let max_target = if 2 * target < cut {
        cut
    } else if 2 * source < cut {
        cut - source
    } else {
        (cut as f64 * (target as f64 / (source + target) as f64)) as usize
    };
    let t = max_target.min(target);
    let s = cut.saturating_sub(t).min(source);
    (s, t)
}

/// MindSpeed-LLM's turn-wise cut of a sample longer than `seq_length`
/// (`DecoderPackedMTFDataset._cut_instruction_token` without an `efficient_eos` template): the
/// runs of ignored labels are the prompts; each prompt and the answer after it are shortened
/// by `_infer_seqlen` until `seq_length` tokens are taken. Tokens before the first prompt run
/// are dropped, as there.
pub fn cut_turns(
    ids: &[i64],
    labels: &[i64],
    seq_length: usize,
) -> std::result::Result<(Vec<i64>, Vec<i64>), String> {
    let mut begins = Vec::new();
    let mut ends = Vec::new();
    let mut i = 0;
    while i < labels.len() {
        if labels[i] == IGNORE {
            begins.push(i);
            while i < labels.len() && labels[i] == IGNORE {
                i += 1;
            }
            ends.push(i);
        } else {
            i += 1;
        }
    }
    if ends.last() == Some(&labels.len()) {
        // MindSpeed-LLM indexes past the end here (an IndexError): a sample whose last token
        // is unscored has no answer to keep.
        return Err(
            "ends inside a prompt (its last label is ignored), which MindSpeed-LLM cannot cut"
                .into(),
        );
    }
    let (mut out_ids, mut out_labels) = (Vec::new(), Vec::new());
    let mut total = 0;
    for t in 0..begins.len() {
        if total >= seq_length {
            break;
        }
        let src = begins[t]..ends[t];
        let tgt = ends[t]..begins.get(t + 1).copied().unwrap_or(labels.len());
        let (s, g) = infer_seqlen(src.len(), tgt.len(), seq_length - total);
        out_ids.extend_from_slice(&ids[src.start..src.start + s]);
        out_ids.extend_from_slice(&labels[tgt.start..tgt.start + g]);
        out_labels.extend_from_slice(&labels[src.start..src.start + s]);
        out_labels.extend_from_slice(&labels[tgt.start..tgt.start + g]);
        total += s + g;
    }
    Ok((out_ids, out_labels))
}

/// Megatron's legacy `get_train_valid_test_split_`: the sequence ranges of train, valid, test.
pub fn legacy_split(split: &str, n: usize) -> Result<[Range<usize>; 3]> {
    let bad = |why: &str| SftError::Split(split.to_string(), why.to_string());
    let sep = if split.contains(',') {
        ','
    } else if split.contains('/') {
        '/'
    } else {
        '\u{0}'
    };
    let mut parts: Vec<f64> = split
        .split(sep)
        .map(|p| {
            p.trim()
                .parse::<f64>()
                .map_err(|_| bad(&format!("{p:?} is not a number")))
        })
        .collect::<Result<_>>()?;
    parts.resize(3, 0.0);
    parts.truncate(3);
    let total: f64 = parts.iter().sum();
    if total.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
        || parts.iter().any(|p| *p < 0.0)
    {
        return Err(bad("weights must be ≥ 0 and not all zero"));
    }
    let mut idx = [0i64; 4];
    for k in 0..3 {
        idx[k + 1] = idx[k] + round_half_even(parts[k] / total * n as f64);
    }
    let diff = idx[3] - n as i64;
    for v in idx.iter_mut().skip(1) {
        *v -= diff;
    }
    let at = |v: i64| v.clamp(0, n as i64) as usize;
    Ok([0, 1, 2].map(|k| at(idx[k])..at(idx[k + 1]).max(at(idx[k]))))
}

/// Python's `round` (half to even).
fn round_half_even(x: f64) -> i64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        (r - x.signum()) as i64
    } else {
        r as i64
    }
}

/// How a split's samples are ordered.
#[derive(Debug, Clone, Copy)]
pub struct Order {
    /// `--seed`.
    pub seed: u32,
    /// Shuffle each epoch (not `--no-shuffle`).
    pub shuffle: bool,
    /// `--padded-samples`: pad each epoch to a multiple of this (the global batch).
    pub padded_to: Option<usize>,
}

/// `_build_index_mappings`: whole epochs of `range`, each shuffled in turn by one
/// `RandomState(seed)`, until `num_samples` are covered. With padding, an epoch is extended
/// by sequences `0..k` (absolute ids, as MindSpeed-LLM does) before its shuffle.
pub fn index(range: Range<usize>, num_samples: u64, order: Order) -> Vec<u64> {
    let mut rng = Mt19937::numpy(order.seed);
    let mut out = Vec::new();
    let nb = range.len();
    if nb == 0 {
        return out;
    }
    while (out.len() as u64) < num_samples {
        let mut epoch: Vec<u64> = range.clone().map(|i| i as u64).collect();
        if let Some(g) = order.padded_to.filter(|&g| g > 0 && !nb.is_multiple_of(g)) {
            epoch.extend(0..(g - nb % g) as u64);
        }
        if order.shuffle {
            rng.numpy_shuffle(&mut epoch);
        }
        out.extend(epoch);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    // Vectors from MindSpeed-LLM's code run with numpy (seed 1234, N = 10, G = 4).
    #[test]
    fn index_matches_mindspeed() {
        let o = |shuffle, padded_to| Order {
            seed: 1234,
            shuffle,
            padded_to,
        };
        assert_eq!(
            index(0..10, 25, o(true, None)),
            [
                7, 2, 9, 1, 0, 8, 4, 5, 6, 3, 7, 3, 5, 1, 4, 8, 0, 2, 6, 9, 7, 1, 9, 5, 8, 4, 3, 0,
                2, 6
            ]
        );
        assert_eq!(
            index(0..10, 25, o(true, Some(4))),
            [
                7, 8, 1, 2, 9, 0, 1, 0, 4, 5, 6, 3, 7, 1, 2, 3, 1, 9, 5, 4, 0, 8, 6, 0, 4, 7, 1, 0,
                9, 3, 8, 6, 1, 5, 0, 2
            ]
        );
        assert_eq!(
            index(0..10, 13, o(false, Some(4))),
            [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
        );
        let seed42 = Order {
            seed: 42,
            shuffle: true,
            padded_to: None,
        };
        assert_eq!(index(3..8, 5, seed42), [4, 7, 5, 3, 6]);
    }

    #[test]
    fn legacy_split_matches_megatron() {
        assert_eq!(
            legacy_split("949,50,1", 10).unwrap(),
            [0..10, 10..10, 10..10]
        );
        assert_eq!(
            legacy_split("969, 30, 1", 1000).unwrap(),
            [0..969, 969..999, 999..1000]
        );
        assert_eq!(
            legacy_split("98,2,0", 103).unwrap(),
            [0..101, 101..103, 103..103]
        );
        assert_eq!(legacy_split("100,0,0", 7).unwrap(), [0..7, 7..7, 7..7]);
        assert!(legacy_split("0,0,0", 7).is_err());
    }

    #[test]
    fn long_samples_are_cut_per_turn() {
        // Prompt [1 2 3] answer [4 5], prompt [6] answer [7 8 9]: 10 tokens cut to 6.
        let ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];
        let labels = [IGNORE, IGNORE, IGNORE, 4, 5, IGNORE, 7, 8, 9, 10];
        let (i, l) = cut_turns(&ids, &labels, 6).unwrap();
        assert_eq!(i.len(), l.len());
        assert!(i.len() <= 6);
        assert_eq!(&l[..3], [IGNORE, IGNORE, IGNORE]);
        assert!(cut_turns(&[1, 2], &[5, IGNORE], 1).is_err());
    }
}
