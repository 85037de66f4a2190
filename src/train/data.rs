//! Micro-batches as Megatron's `MegatronPretrainingSampler` draws them on one data-parallel
//! rank (megatron/legacy/data/data_samplers.py): iteration i (from 1) consumes samples
//! `[(i−1)·G, i·G)` of the split in order, micro-batch k the `k`-th M of them; each sample
//! becomes rows of one [`MicroBatch`] with the loss weights of Megatron's loss averaging.

use crate::data::gpt_dataset::{MaskConfig, Sample, SplitSamples};
use crate::model::llama::MicroBatch;

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
