//! Micro-batches as Megatron's `MegatronPretrainingSampler` draws them on one data-parallel
//! rank (megatron/legacy/data/data_samplers.py): iteration i (from 1) consumes samples
//! `[(i−1)·G, i·G)` of the split in order, micro-batch k the `k`-th M of them; each sample
//! becomes rows of one [`MicroBatch`] with the loss weights of Megatron's loss averaging.

use crate::data::gpt_dataset::{MaskConfig, Sample, SplitSamples};
use crate::data::sft_dataset::{SftDataset, IGNORE};
use crate::model::decoder::{DepthRows, MicroBatch};
use anyhow::Result;
use std::sync::Arc;

/// How per-row losses are combined into the objective (megatron-core 0.15
/// `forward_step_calc_loss` and `finalize_model_grads`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossAveraging {
    /// Each micro-batch's mean over its unmasked tokens, then the mean over micro-batches.
    PerMicroBatch,
    /// `--calculate-per-token-loss`: the sum over every token of the step, then the gradient
    /// divided by the step's token count.
    PerToken,
}

/// A micro-batch with the bookkeeping of its loss.
pub struct Prepared {
    /// The rows.
    pub batch: MicroBatch,
    /// `[T]` 1 where a row's loss counts.
    pub mask: Vec<f32>,
    /// Unmasked rows.
    pub tokens: u64,
}

/// Rows of `samples` (consecutive, each S long) as one micro-batch: loss weights
/// `mask / max(n, 1) / K` (per micro-batch averaging) or `mask` (per token), attention
/// segments per sample (per document with `reset_attention_mask`), RoPE positions `0..S`.
pub fn micro_batch(samples: &[Sample], k: usize, averaging: LossAveraging) -> Prepared {
    let mut batch = MicroBatch {
        tokens: Vec::new(),
        labels: Vec::new(),
        dloss: Vec::new(),
        segments: Vec::new(),
        positions: Vec::new(),
        dropout: None,
        aux: None,
        mtp: Vec::new(),
    };
    let mut mask = Vec::new();
    for s in samples {
        let base = batch.tokens.len();
        let len = s.tokens.len();
        let mut starts = s.segments.clone();
        starts.push(len);
        batch
            .segments
            .extend(starts.windows(2).map(|w| base + w[0]..base + w[1]));
        batch.tokens.extend_from_slice(&s.tokens);
        batch.labels.extend_from_slice(&s.labels);
        batch.positions.extend(0..len);
        mask.extend_from_slice(&s.loss_mask);
    }
    let tokens = mask.iter().filter(|&&m| m != 0.0).count() as u64;
    // As autograd computes them: the gradient 1 divided by K, then by max(n, 1), in f32.
    let weight = match averaging {
        LossAveraging::PerMicroBatch => (1.0f32 / k as f32) / tokens.max(1) as f32,
        LossAveraging::PerToken => 1.0,
    };
    batch.dloss = mask.iter().map(|&m| m * weight).collect();
    Prepared {
        batch,
        mask,
        tokens,
    }
}

/// Multi-token prediction's rows of `p` for `depths` depths, each weighing `scale` /
/// `depths` of the loss (megatron-core gpt_model.py `_postprocess`): depth k's ids, targets and
/// mask rolled k + 1 rows left within each sequence, zeros past its end (`roll_tensor` once per
/// depth), its loss weights `mask · ((1/K · scale/depths) / n_k)` as autograd takes them
/// through `MTPLossAutoScaler` (its backward scale 1/K) and the division by the depth's own
/// count `n_k` (at least 1), or `mask · scale/depths` with per-token loss; attention segments
/// whose inner boundaries move back with the ids where `moved` (MindSpeed-LLM's shifted
/// `actual_seq_len`), else the main model's (megatron-core hands its depths the same mask).
pub fn mtp_rows(
    p: &Prepared,
    (depths, scale, moved): (usize, f64, bool),
    k: usize,
    averaging: LossAveraging,
) -> Vec<DepthRows> {
    let b = &p.batch;
    let starts: Vec<usize> = (b.positions.iter().enumerate())
        .filter(|&(_, &pos)| pos == 0)
        .map(|(r, _)| r)
        .collect();
    // the sequence holding row r: its first row and the row past its last
    let sequence = |r: usize| {
        let i = starts.partition_point(|&s| s <= r);
        let end = starts.get(i).copied().unwrap_or(b.tokens.len());
        (starts[i.saturating_sub(1)], end)
    };
    let share = (scale / depths as f64) as f32;
    (1..=depths)
        .map(|d| {
            let rolled = |at: usize| Some(at + d).filter(|&from| from < sequence(at).1);
            let roll = |v: &[u32]| -> Vec<u32> {
                (0..v.len())
                    .map(|r| rolled(r).map_or(0, |f| v[f]))
                    .collect()
            };
            let mask: Vec<f32> = (0..p.mask.len())
                .map(|r| rolled(r).map_or(0.0, |f| p.mask[f]))
                .collect();
            let n = mask.iter().filter(|&&m| m != 0.0).count();
            let weight = match averaging {
                LossAveraging::PerMicroBatch => ((1.0f32 / k as f32) * share) / n.max(1) as f32,
                LossAveraging::PerToken => share,
            };
            let segments = (b.segments.iter())
                .filter_map(|s| {
                    let (first, end) = sequence(s.start);
                    let place = |at: usize| match !moved || at == first || at == end {
                        true => at,
                        false => at.saturating_sub(d).max(first),
                    };
                    let (from, to) = (place(s.start), place(s.end));
                    (from < to).then_some(from..to)
                })
                .collect();
            DepthRows {
                tokens: roll(&b.tokens),
                labels: roll(&b.labels),
                dloss: mask.iter().map(|&m| m * weight).collect(),
                mask,
                segments,
            }
        })
        .collect()
}

/// The samples `from..from + count` of `split`, masked as `masks` says.
pub fn samples(split: &SplitSamples, masks: &MaskConfig, from: u64, count: usize) -> Vec<Sample> {
    (0..count)
        .map(|j| {
            let (_, text) = split.text(from as usize + j, masks.pad_value());
            masks.sample(&text)
        })
        .collect()
}

/// `(Σ loss·mask, Σ mask)` of a micro-batch in f32, as Megatron's `loss_func` reports it.
pub fn masked_sum(losses: &[f32], mask: &[f32]) -> (f32, f32) {
    let sum = losses.iter().zip(mask).map(|(l, m)| l * m).sum();
    (sum, mask.iter().sum())
}

/// The `(Σ loss·mask, Σ mask)` of each micro-batch of a step (or an evaluation), reduced to
/// the lm loss Megatron reports.
#[derive(Debug, Clone, Default)]
pub struct LossSums {
    parts: Vec<(f32, f32)>,
}

impl LossSums {
    /// Add one micro-batch.
    pub fn push(&mut self, sum: f32, count: f32) {
        self.parts.push((sum, count));
    }

    /// Add every micro-batch of `other`.
    pub fn extend(&mut self, other: LossSums) {
        self.parts.extend(other.parts);
    }

    /// `[S₀, n₀, S₁, n₁, …]`, to send to other ranks.
    pub fn flat(&self) -> Vec<f32> {
        self.parts.iter().flat_map(|&(s, n)| [s, n]).collect()
    }

    /// The sums of `ranks` ranks' [`LossSums::flat`] concatenated in rank order, put back in
    /// the order of the micro-batches of one global batch: rank r's j-th micro-batch is the
    /// (j·ranks + r)-th.
    pub fn interleaved(flat: &[f32], ranks: usize) -> LossSums {
        let per_rank = flat.len() / 2 / ranks.max(1);
        let parts = (0..per_rank * ranks)
            .map(|i| {
                let (j, r) = (i / ranks, i % ranks);
                let at = 2 * (r * per_rank + j);
                (flat[at], flat[at + 1])
            })
            .collect();
        LossSums { parts }
    }

    /// Unmasked tokens.
    pub fn tokens(&self) -> f32 {
        self.parts.iter().map(|p| p.1).sum()
    }

    /// Token-weighted `Σ S / Σ n` (pretraining's `loss_func`, and any per-token loss), or the
    /// mean of the micro-batch means (MindSpeed-LLM's SFT `loss_func`, which reports each
    /// micro-batch's mean).
    pub fn report(&self, token_weighted: bool) -> f32 {
        if token_weighted {
            self.parts.iter().map(|p| p.0).sum::<f32>() / self.tokens()
        } else {
            let means: f32 = self.parts.iter().map(|(s, n)| s / n.max(1.0)).sum();
            means / self.parts.len().max(1) as f32
        }
    }
}

/// How fine-tuning samples become rows (MindSpeed-LLM's collator and `get_batch`).
#[derive(Debug, Clone, Copy)]
pub struct SftRows {
    /// `--seq-length`.
    pub seq_length: usize,
    /// The id right padding writes (the tokenizer's pad, else eos).
    pub pad: u32,
    /// Rows are padded to a multiple of this: `--seq-length`, or with
    /// `--no-pad-to-seq-lengths` `--pad-to-multiple-of` (8).
    pub multiple_of: usize,
    /// `--reset-attention-mask`: attention stays inside each document of a pack (the EOD id,
    /// and whether `--neat-pack` numbers the documents in the stored attention mask).
    pub reset: Option<(u32, bool)>,
}

/// The samples of one split.
pub enum Source {
    /// Megatron GPT pretraining samples.
    Pretrain {
        /// Their order and tokens.
        samples: SplitSamples,
        /// EOD, pad and masking.
        masks: MaskConfig,
    },
    /// MindSpeed-LLM fine-tuning samples.
    Sft {
        /// The packed files.
        data: Arc<SftDataset>,
        /// Sample k is sequence `index[k]`.
        index: Vec<u64>,
        /// Row layout.
        rows: SftRows,
    },
}

impl Source {
    /// Samples it holds.
    pub fn len(&self) -> usize {
        match self {
            Source::Pretrain { samples, .. } => samples.len(),
            Source::Sft { index, .. } => index.len(),
        }
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Samples `from..from + m` as one micro-batch of K.
    pub fn micro_batch(
        &self,
        from: u64,
        m: usize,
        k: usize,
        averaging: LossAveraging,
    ) -> Result<Prepared> {
        match self {
            Source::Pretrain {
                samples: split,
                masks,
            } => Ok(micro_batch(&samples(split, masks, from, m), k, averaging)),
            Source::Sft { data, index, rows } => {
                let docs = &index[from as usize..from as usize + m];
                let mut out = Vec::with_capacity(m);
                for &doc in docs {
                    let (ids, labels) = data.sample(doc as usize, rows.seq_length)?;
                    let mask = match rows.reset {
                        Some((_, true)) => data.attention_mask(doc as usize),
                        _ => None,
                    };
                    out.push((ids, labels, mask));
                }
                let longest = out.iter().map(|(ids, _, _)| ids.len()).max().unwrap_or(0);
                let t = longest.div_ceil(rows.multiple_of) * rows.multiple_of;
                let samples: Vec<Sample> = out
                    .iter()
                    .map(|(ids, labels, mask)| sft_sample(ids, labels, mask.as_deref(), t, rows))
                    .collect();
                Ok(micro_batch(&samples, k, averaging))
            }
        }
    }
}

/// One fine-tuning sample as `t` rows: right-padded ids, labels shifted by one (the model
/// scores position j against label j + 1, MindSpeed-LLM's `labels[:, 1:]`), the loss mask
/// where that label is not ignored, and the attention segments.
fn sft_sample(
    ids: &[i64],
    labels: &[i64],
    neat: Option<&[i64]>,
    t: usize,
    rows: &SftRows,
) -> Sample {
    let len = ids.len();
    let mut tokens: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
    tokens.resize(t, rows.pad);
    let mut row_labels = vec![0u32; t];
    let mut loss_mask = vec![0f32; t];
    for j in 0..t {
        if let Some(&l) = labels.get(j + 1).filter(|&&l| l != IGNORE) {
            row_labels[j] = l as u32;
            loss_mask[j] = 1.0;
        }
    }
    let segments = match (rows.reset, neat) {
        (Some((_, true)), Some(mask)) => {
            // Neat packing numbers its documents 1, 2, … in the attention mask (0 = padding).
            let mut starts = vec![0];
            for j in 1..len {
                if mask[j] != mask[j - 1] {
                    starts.push(j);
                }
            }
            if len < t {
                starts.push(len);
            }
            starts
        }
        (Some((eod, _)), _) => {
            let mut starts = vec![0];
            starts.extend(
                (0..len)
                    .filter(|&j| ids[j] == i64::from(eod) && j + 1 < t)
                    .map(|j| j + 1),
            );
            starts.dedup();
            starts
        }
        (None, _) => vec![0],
    };
    Sample {
        tokens,
        labels: row_labels,
        loss_mask,
        segments,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(tokens: &[u32], mask: &[f32], segments: &[usize]) -> Sample {
        Sample {
            tokens: tokens.to_vec(),
            labels: tokens.iter().map(|t| t + 100).collect(),
            loss_mask: mask.to_vec(),
            segments: segments.to_vec(),
        }
    }

    #[test]
    fn prediction_depths_roll_each_sequence_and_weigh_their_own_tokens() {
        // two sequences of 5, the second packing two documents (3 + 2)
        let p = micro_batch(
            &[
                sample(&[1, 2, 3, 4, 5], &[1.0, 1.0, 0.0, 1.0, 1.0], &[0]),
                sample(&[6, 7, 8, 9, 10], &[1.0; 5], &[0, 3]),
            ],
            2,
            LossAveraging::PerMicroBatch,
        );
        let rows = mtp_rows(&p, (2, 0.3, true), 2, LossAveraging::PerMicroBatch);
        assert_eq!(rows.len(), 2);
        let (one, two) = (&rows[0], &rows[1]);
        assert_eq!(one.tokens, [2, 3, 4, 5, 0, 7, 8, 9, 10, 0]);
        assert_eq!(two.tokens, [3, 4, 5, 0, 0, 8, 9, 10, 0, 0]);
        assert_eq!(one.labels, [102, 103, 104, 105, 0, 107, 108, 109, 110, 0]);
        assert_eq!(one.mask, [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0]);
        // each depth's 0.15 of the loss over its own 7 (then 5) tokens and the 2 micro-batches
        let w = |n: f32| ((1.0f32 / 2.0) * 0.15) / n;
        assert_eq!(one.dloss[0], w(7.0));
        assert_eq!(one.dloss[1], 0.0);
        assert_eq!(two.mask, [0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]);
        assert_eq!(two.dloss[1], w(5.0));
        // the documents' boundary moves back with the ids; the sequences' do not
        assert_eq!(one.segments, [0..5, 5..7, 7..10]);
        assert_eq!(two.segments, [0..5, 5..6, 6..10]);
        let per_token = mtp_rows(&p, (2, 0.3, false), 2, LossAveraging::PerToken);
        assert_eq!(per_token[1].dloss[1], 0.15);
        // megatron-core's depths attend within the main model's documents
        assert_eq!(per_token[1].segments, [0..5, 5..8, 8..10]);
    }
}
