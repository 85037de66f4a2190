//! Cross entropy over the vocabulary (aclnnCrossEntropyLoss / aclnnCrossEntropyLossGrad).
//!
//! Legend: n = rows (tokens), v = vocabulary (padded: Megatron's padding rows take part in the
//! softmax). Per row `loss = lse − logit[label]`, `lse = max + log Σ exp(logits − max)`, the
//! exponentials vectorized and summed in 16 f32 lanes.

use crate::tensor::simd;
use rayon::prelude::*;

/// `loss [n]` and `lse [n]` (both overwritten) of `logits [n, v]` against `labels [n]`; a
/// label past the row (`NO_ROW`) has no target logit.
pub fn cross_entropy_fwd(
    logits: &[f32],
    labels: &[u32],
    v: usize,
    loss: &mut [f32],
    lse: &mut [f32],
) {
    loss.par_iter_mut()
        .zip(lse.par_iter_mut())
        .zip(logits.par_chunks(v).zip(labels.par_iter()))
        .for_each(|((loss, lse), (row, &label))| {
            let max = simd::max(row);
            let sum = f64::from(simd::sum_exp_sub(row, max));
            let log_sum = sum.ln() + f64::from(max);
            *lse = log_sum as f32;
            let target = row.get(label as usize).map_or(0.0, |&x| f64::from(x));
            *loss = (log_sum - target) as f32;
        });
}

/// The gradient of `Σ dloss[r] · loss[r]`, written over `logits` (which it consumes):
/// `dlogits = dloss · (exp(logits − lse) − onehot(label))`, no onehot for a label past the
/// row.
pub fn cross_entropy_bwd(logits: &mut [f32], labels: &[u32], lse: &[f32], dloss: &[f32], v: usize) {
    logits
        .par_chunks_mut(v)
        .zip(labels.par_iter().zip(lse.par_iter().zip(dloss.par_iter())))
        .for_each(|(row, (&label, (&lse, &dl)))| {
            if dl == 0.0 {
                row.fill(0.0);
                return;
            }
            simd::exp_sub(row, lse, dl);
            if let Some(x) = row.get_mut(label as usize) {
                *x -= dl;
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testing::{check_grad, seeded};

    #[test]
    fn backward_matches_finite_differences() {
        let (n, v) = (3, 7);
        let logits: Vec<f32> = seeded(n * v, 1).iter().map(|x| x * 3.0).collect();
        let labels = [2u32, 6, 0];
        let dloss = [0.5f32, 0.0, 1.25];
        let loss_of = |logits: &[f32]| {
            let (mut loss, mut lse) = (vec![0.0; n], vec![0.0; n]);
            cross_entropy_fwd(logits, &labels, v, &mut loss, &mut lse);
            loss.iter()
                .zip(&dloss)
                .map(|(a, b)| (a * b) as f64)
                .sum::<f64>()
        };
        let (mut loss, mut lse) = (vec![0.0; n], vec![0.0; n]);
        cross_entropy_fwd(&logits, &labels, v, &mut loss, &mut lse);
        let direct = lse[0] - logits[2];
        assert!((loss[0] - direct).abs() < 1e-6);
        let mut grad = logits.clone();
        cross_entropy_bwd(&mut grad, &labels, &lse, &dloss, v);
        check_grad("dlogits", &logits, &grad, loss_of);
    }
}
