//! Cross entropy over the vocabulary (aclnnCrossEntropyLoss / aclnnCrossEntropyLossGrad).
//!
//! Legend: n = rows (tokens), v = vocabulary (padded: Megatron's padding rows take part in the
//! softmax). Per row `loss = lse − logit[label]`, `lse = max + log Σ exp(logits − max)`, the
//! exponentials vectorized and summed in 16 f32 lanes.

use super::{narrow_half, CpuTensor, Data};
use crate::tensor::simd;
use rayon::prelude::*;

/// `loss [n]` and `lse [n]` (both overwritten) of `logits [n, v]` against `labels [n]`; a
/// label past the row (`NO_ROW`) has no target logit. Half rows are widened one at a time.
pub fn cross_entropy_fwd(logits: &CpuTensor, labels: &[u32], loss: &mut [f32], lse: &mut [f32]) {
    loss.par_iter_mut()
        .zip(lse.par_iter_mut())
        .zip(labels.par_iter())
        .enumerate()
        .for_each_init(Vec::new, |buf, (r, ((loss, lse), &label))| {
            let row = logits.row(r, buf);
            let max = simd::max(row);
            let sum = f64::from(simd::sum_exp_sub(row, max));
            let log_sum = sum.ln() + f64::from(max);
            *lse = log_sum as f32;
            let target = row.get(label as usize).map_or(0.0, |&x| f64::from(x));
            *loss = (log_sum - target) as f32;
        });
}

/// The gradient of `Σ dloss[r] · loss[r]`, written over `logits` (which it consumes) in their
/// dtype: `dlogits = dloss · (exp(logits − lse) − onehot(label))`, no onehot for a label past
/// the row. Half rows are widened, updated and rounded back one at a time.
pub fn cross_entropy_bwd(
    mut logits: CpuTensor,
    labels: &[u32],
    lse: &[f32],
    dloss: &[f32],
) -> CpuTensor {
    let v = logits.cols();
    let grad_row = |row: &mut [f32], r: usize| {
        let dl = dloss[r];
        if dl == 0.0 {
            row.fill(0.0);
            return;
        }
        simd::exp_sub(row, lse[r], dl);
        if let Some(x) = row.get_mut(labels[r] as usize) {
            *x -= dl;
        }
    };
    match logits.data_mut() {
        Data::F32(values) => values
            .par_chunks_mut(v)
            .enumerate()
            .for_each(|(r, row)| grad_row(row, r)),
        Data::Half(dtype, bits) => {
            let dtype = *dtype;
            bits.par_chunks_mut(v).enumerate().for_each_init(
                Vec::new,
                |buf: &mut Vec<f32>, (r, row)| {
                    buf.resize(v, 0.0);
                    simd::widen(row, dtype, buf);
                    grad_row(buf, r);
                    narrow_half(buf, dtype, row);
                },
            )
        }
        Data::Panels(_) => unreachable!("checked: logits are not a packed weight"),
    }
    logits
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
        let tensor = |values: &[f32]| CpuTensor::new(vec![n, v], values.to_vec());
        let loss_of = |logits: &[f32]| {
            let (mut loss, mut lse) = (vec![0.0; n], vec![0.0; n]);
            cross_entropy_fwd(&tensor(logits), &labels, &mut loss, &mut lse);
            loss.iter()
                .zip(&dloss)
                .map(|(a, b)| (a * b) as f64)
                .sum::<f64>()
        };
        let (mut loss, mut lse) = (vec![0.0; n], vec![0.0; n]);
        cross_entropy_fwd(&tensor(&logits), &labels, &mut loss, &mut lse);
        let direct = lse[0] - logits[2];
        assert!((loss[0] - direct).abs() < 1e-6);
        let grad = cross_entropy_bwd(tensor(&logits), &labels, &lse, &dloss);
        check_grad("dlogits", &logits, &grad.values(), loss_of);
    }
}
