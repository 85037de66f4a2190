//! Micro-batches as Megatron's samplers draw them on one data-parallel rank
//! (megatron/legacy/data/data_samplers.py): `--dataloader-type single`'s
//! `MegatronPretrainingSampler` (iteration i, from 1, consumes samples `[(i−1)·G, i·G)` of the
//! split in order, micro-batch k the `k`-th M of them) or `cyclic`'s
//! `MegatronPretrainingRandomSampler` ([`RandomSampler`]); each sample becomes rows of one
//! [`MicroBatch`] with the loss weights of Megatron's loss averaging.

use crate::data::gpt_dataset::{MaskConfig, Sample, SplitSamples};
use crate::data::mt19937::Mt19937;
use crate::data::sft_dataset::{PairwiseDataset, SftDataset, IGNORE};
use crate::model::decoder::{DepthRows, MicroBatch};
use anyhow::{anyhow, bail, Result};
use std::sync::Arc;

/// `--dataloader-type`: how the data-parallel ranks draw a split's samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loader {
    /// `single` (Megatron's default): `MegatronPretrainingSampler`, the split in order, once.
    Single,
    /// `cyclic`: [`RandomSampler`], shuffled per rank and epoch, epoch after epoch.
    Cyclic,
}

impl Loader {
    /// The flag's value, as Megatron's args record it.
    pub fn name(self) -> &'static str {
        match self {
            Loader::Single => "single",
            Loader::Cyclic => "cyclic",
        }
    }
}

/// Megatron's `MegatronPretrainingRandomSampler` with `data_sharding` (its default, and always
/// so in MindSpeed-LLM's `build_pretraining_data_loader`), iterated through training.py's
/// `cyclic_iter` (Megatron-LM core_v0.15.3 megatron/legacy/data/data_samplers.py; the same in
/// core_v0.12.1, which MindSpeed-LLM runs on).
///
/// With `total` samples in the split, M × DP samples per draw: an epoch uses `A = total −
/// total mod (M·DP)` samples, rank r the bucket `[r·B, (r+1)·B)` of `B = A / DP` of them, read
/// in the order of `torch.randperm(B, generator=torch.Generator().manual_seed(epoch))`. The
/// sampler counts the samples consumed over all ranks: the micro-batch drawn after `c` of them
/// belongs to epoch `c / A`, and rank r takes `r·B + perm[(c mod A)/DP + u]`, u < M. An epoch
/// ends after A samples; the next draw starts the next epoch's permutation, within an
/// iteration if need be. Resuming with `c` from the checkpoint lands on the same draw.
#[derive(Debug, Clone, Copy)]
pub struct RandomSampler {
    /// Samples in the split (`len(dataset)`).
    pub total: u64,
    /// M.
    pub micro_batch: usize,
    /// DP.
    pub ranks: usize,
    /// This rank's data-parallel rank.
    pub rank: usize,
}

impl RandomSampler {
    /// M × DP: the samples one draw consumes over all ranks.
    fn draw(&self) -> u64 {
        (self.micro_batch * self.ranks) as u64
    }

    /// The samples an epoch reads (`active_total_samples`): the split less its last incomplete
    /// group of M × DP.
    pub fn active(&self) -> u64 {
        self.total - self.total % self.draw().max(1)
    }

    /// Samples of each rank's bucket (`bucket_size`).
    pub fn bucket(&self) -> u64 {
        self.active() / self.ranks.max(1) as u64
    }

    /// The epoch and the position in its permutation of the micro-batch drawn after
    /// `consumed` samples: an error where the split holds fewer than M × DP samples (Megatron
    /// divides by zero) or `consumed` is not a whole number of draws into its epoch (Megatron's
    /// assertion; a checkpoint of another batch layout).
    pub fn locate(&self, consumed: u64) -> Result<(u64, u64)> {
        let active = self.active();
        if active == 0 {
            bail!(
                "--dataloader-type cyclic: the split holds {} samples, fewer than one draw of \
                 --micro-batch-size {} × {} data-parallel ranks",
                self.total,
                self.micro_batch,
                self.ranks
            );
        }
        let within = consumed % active;
        if !within.is_multiple_of(self.draw()) {
            bail!(
                "--dataloader-type cyclic: {consumed} samples consumed leave {within} into an \
                 epoch of {active}, not a multiple of --micro-batch-size {} × {} data-parallel \
                 ranks (the checkpoint was written with another batch layout)",
                self.micro_batch,
                self.ranks
            );
        }
        Ok((consumed / active, within / self.ranks as u64))
    }

    /// The sample ids of the micro-batch this rank draws after `consumed` samples (counted
    /// over all ranks).
    pub fn micro_batch(&self, consumed: u64, perms: &mut Permutations) -> Result<Vec<u64>> {
        let (epoch, at) = self.locate(consumed)?;
        let bucket = self.bucket();
        let perm = perms.get(bucket, epoch);
        let start = self.rank as u64 * bucket;
        let at = at as usize;
        let drawn = perm
            .get(at..at + self.micro_batch)
            .ok_or_else(|| anyhow!("internal: draw {at} past the bucket of {bucket}"))?;
        Ok(drawn.iter().map(|&i| start + i).collect())
    }
}

/// The random sampler's permutations, kept for the few epochs in use (an iteration may span
/// two; validation reads another split): `torch.randperm(n, manual_seed(epoch))` depends on
/// `(n, epoch)` alone, so the splits share them.
#[derive(Default)]
pub struct Permutations {
    /// `((n, epoch), permutation)`, the most recently used last.
    kept: Vec<((u64, u64), Vec<u64>)>,
}

impl Permutations {
    /// Permutations kept at most.
    const KEPT: usize = 3;

    /// `torch.randperm(n, generator=torch.Generator().manual_seed(epoch))`.
    pub fn get(&mut self, n: u64, epoch: u64) -> &[u64] {
        let key = (n, epoch);
        let entry = match self.kept.iter().position(|(k, _)| *k == key) {
            Some(i) => self.kept.remove(i),
            None => (key, Mt19937::torch(epoch).torch_randperm(n)),
        };
        if self.kept.len() == Self::KEPT {
            self.kept.remove(0);
        }
        self.kept.push(entry);
        self.kept.last().map_or(&[], |(_, p)| p.as_slice())
    }
}

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
        indexer: None,
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

/// The samples `ids` of `split`, masked as `masks` says.
pub fn samples(split: &SplitSamples, masks: &MaskConfig, ids: &[u64]) -> Vec<Sample> {
    ids.iter()
        .map(|&id| {
            let (_, text) = split.text(id as usize, masks.pad_value());
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
    /// MindSpeed-LLM's preference pairs (`--is-pairwise-dataset`): sample k is pair
    /// `index[k]`, a micro-batch of M pairs the M chosen sequences then the M rejected ones
    /// (`PairwiseDataCollatorWithPadding`), all padded to one length.
    Pairwise {
        /// The packed files.
        data: Arc<PairwiseDataset>,
        /// Sample k is pair `index[k]`.
        index: Vec<u64>,
        /// Row layout.
        rows: SftRows,
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
            Source::Sft { index, .. } | Source::Pairwise { index, .. } => index.len(),
        }
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Samples `ids` as one micro-batch of K.
    pub fn micro_batch(&self, ids: &[u64], k: usize, averaging: LossAveraging) -> Result<Prepared> {
        if let Some(id) = ids.iter().find(|&&id| id >= self.len() as u64) {
            bail!("internal: sample {id} of a split of {}", self.len());
        }
        match self {
            Source::Pretrain {
                samples: split,
                masks,
            } => Ok(micro_batch(&samples(split, masks, ids), k, averaging)),
            Source::Sft { data, index, rows } => {
                let mut out = Vec::with_capacity(ids.len());
                for &doc in ids.iter().map(|&id| &index[id as usize]) {
                    let (ids, labels) = data.sample(doc as usize, rows.seq_length)?;
                    let mask = match rows.reset {
                        Some((_, true)) => data.attention_mask(doc as usize),
                        _ => None,
                    };
                    out.push((ids, labels, mask));
                }
                Ok(micro_batch(&padded(&out, rows), k, averaging))
            }
            Source::Pairwise { data, index, rows } => {
                let (mut out, mut rejected) = (Vec::new(), Vec::new());
                for &pair in ids.iter().map(|&id| &index[id as usize]) {
                    let [(c_ids, c_labels), (r_ids, r_labels)] =
                        data.pair(pair as usize, rows.seq_length)?;
                    out.push((c_ids, c_labels, None));
                    rejected.push((r_ids, r_labels, None));
                }
                out.append(&mut rejected);
                Ok(micro_batch(&padded(&out, rows), k, averaging))
            }
        }
    }
}

/// A fine-tuning sequence as read: input ids, labels, and a neat pack's stored mask.
type SftSequence = (Vec<i64>, Vec<i64>, Option<Vec<i64>>);

/// Fine-tuning sequences as rows of one length: the longest rounded up to `rows.multiple_of`.
fn padded(out: &[SftSequence], rows: &SftRows) -> Vec<Sample> {
    let longest = out.iter().map(|(ids, _, _)| ids.len()).max().unwrap_or(0);
    let t = longest.div_ceil(rows.multiple_of) * rows.multiple_of;
    out.iter()
        .map(|(ids, labels, mask)| sft_sample(ids, labels, mask.as_deref(), t, rows))
        .collect()
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

    // Megatron-LM core_v0.15.3's MegatronPretrainingRandomSampler (data_sharding=True) run with
    // torch 2.9.1 through training.py's cyclic_iter, one sampler per rank built at the consumed
    // count given: each case's ids by iteration, then rank, then micro-batch.
    #[test]
    fn the_random_sampler_draws_as_megatrons() {
        // (samples in the split, consumed at start, M, DP, G, iterations, ids)
        type Case = (u64, u64, usize, usize, usize, u64, &'static [u64]);
        let cases: [Case; 5] = [
            // epochs of 10 crossed inside iterations 3 and 5
            (
                10,
                0,
                1,
                1,
                4,
                6,
                &[
                    4, 1, 7, 5, 3, 9, 0, 8, 6, 2, 5, 6, 1, 2, 0, 8, 9, 3, 7, 4, 8, 7, 1, 5,
                ],
            ),
            // 23 samples: epochs of 20, buckets of 10; rank 1 reads 10..20
            (
                23,
                0,
                2,
                2,
                8,
                7,
                &[
                    4, 1, 7, 5, 14, 11, 17, 15, 3, 9, 0, 8, 13, 19, 10, 18, 6, 2, 5, 6, 16, 12, 15,
                    16, 1, 2, 0, 8, 11, 12, 10, 18, 9, 3, 7, 4, 19, 13, 17, 14, 8, 7, 1, 5, 18, 17,
                    11, 15, 6, 9, 0, 4, 16, 19, 10, 14,
                ],
            ),
            // the same run resumed after two iterations
            (
                23,
                16,
                2,
                2,
                8,
                5,
                &[
                    6, 2, 5, 6, 16, 12, 15, 16, 1, 2, 0, 8, 11, 12, 10, 18, 9, 3, 7, 4, 19, 13, 17,
                    14, 8, 7, 1, 5, 18, 17, 11, 15, 6, 9, 0, 4, 16, 19, 10, 14,
                ],
            ),
            // resumed in epoch 2, four ranks of buckets of 5
            (
                23,
                40,
                1,
                4,
                4,
                5,
                &[
                    3, 8, 13, 18, 4, 9, 14, 19, 1, 6, 11, 16, 0, 5, 10, 15, 2, 7, 12, 17,
                ],
            ),
            (
                1000,
                96,
                4,
                2,
                16,
                3,
                &[
                    110, 235, 90, 155, 125, 477, 401, 300, 610, 735, 590, 655, 625, 977, 901, 800,
                    49, 464, 94, 439, 59, 58, 161, 176, 549, 964, 594, 939, 559, 558, 661, 676, 99,
                    220, 20, 66, 148, 257, 167, 367, 599, 720, 520, 566, 648, 757, 667, 867,
                ],
            ),
        ];
        let mut perms = Permutations::default();
        for (total, start, m, dp, g, iters, want) in cases {
            let mut got = Vec::new();
            for i in 0..iters {
                for rank in 0..dp {
                    let sampler = RandomSampler {
                        total,
                        micro_batch: m,
                        ranks: dp,
                        rank,
                    };
                    for j in 0..g / (m * dp) {
                        let consumed = start + i * g as u64 + (j * m * dp) as u64;
                        got.extend(sampler.micro_batch(consumed, &mut perms).unwrap());
                    }
                }
            }
            assert_eq!(got, want, "{total} samples from {start}, M {m}, DP {dp}");
        }
    }

    #[test]
    fn the_random_sampler_refuses_what_megatron_cannot_draw() {
        let sampler = |total| RandomSampler {
            total,
            micro_batch: 2,
            ranks: 2,
            rank: 0,
        };
        let mut perms = Permutations::default();
        // fewer samples than one draw of M × DP
        let small = sampler(3).micro_batch(0, &mut perms).unwrap_err();
        assert!(
            format!("{small}").contains("fewer than one draw"),
            "{small}"
        );
        // a consumed count inside a draw (a checkpoint of another layout)
        let inside = sampler(23).micro_batch(22, &mut perms).unwrap_err();
        assert!(
            format!("{inside}").contains("2 into an epoch of 20"),
            "{inside}"
        );
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
