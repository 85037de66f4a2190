//! RMSNorm forward and backward over rows (aclnnRmsNorm / aclnnRmsNormGrad).
//!
//! Legend: n = rows, h = row length. `y = x · rstd · γ` with `rstd = 1/√(mean(x²) + eps)`,
//! computed in f32 as HF `LlamaRMSNorm` and Megatron's RMSNorm do (γ applied last).

use crate::tensor::simd::dot;

/// `y [n, h] = x · rstd · γ`, `rstd [n]` saved for the backward pass. Overwrites `y`, `rstd`.
/// One thread: the backend runs blocks of rows in parallel.
pub fn rms_norm_fwd(x: &[f32], gamma: &[f32], eps: f32, y: &mut [f32], rstd: &mut [f32]) {
    let h = gamma.len();
    y.chunks_exact_mut(h)
        .zip(x.chunks_exact(h))
        .zip(rstd.iter_mut())
        .for_each(|((y, x), r)| {
            *r = 1.0 / (dot(x, x) / h as f32 + eps).sqrt();
            for ((y, &x), &g) in y.iter_mut().zip(x).zip(gamma) {
                *y = g * (x * *r);
            }
        });
}

/// `dx [n, h]` (overwritten) and `dγ [h]` (accumulated, unless frozen) of [`rms_norm_fwd`]:
/// `dx = rstd·(γ∘dy) − rstd³/h · x · Σ(γ∘dy∘x)`, `dγ += Σ_rows dy ∘ x · rstd`. One thread: the
/// backend runs blocks of rows in parallel and adds their `dγ` parts in block order.
pub fn rms_norm_bwd(
    dy: &[f32],
    x: &[f32],
    gamma: &[f32],
    rstd: &[f32],
    dx: &mut [f32],
    dgamma: Option<&mut [f32]>,
) {
    let h = gamma.len();
    let rows = || dy.chunks_exact(h).zip(x.chunks_exact(h)).zip(rstd);
    for (dx, ((dy, x), &r)) in dx.chunks_exact_mut(h).zip(rows()) {
        // γ∘dy, then its dot product with x summed in the lanes of `dot` (one running sum
        // would wait on every addition).
        for ((d, &dy), &g) in dx.iter_mut().zip(dy).zip(gamma) {
            *d = g * dy;
        }
        let proj = dot(dx, x);
        let c = r * r * r * proj / h as f32;
        for (((dx, &dy), &x), &g) in dx.iter_mut().zip(dy).zip(x).zip(gamma) {
            *dx = r * g * dy - c * x;
        }
    }
    let Some(dgamma) = dgamma else { return };
    for ((dy, x), &r) in rows() {
        for ((a, &dy), &x) in dgamma.iter_mut().zip(dy).zip(x) {
            *a += dy * x * r;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testing::{check_grad, seeded};

    #[test]
    fn backward_matches_finite_differences() {
        // γ the width of the row, and γ of one head of three (Qwen3's q/k norms).
        for (n, h, groups) in [(3, 8, 1), (2, 8, 3)] {
            let x = seeded(n * h * groups, 1);
            let gamma = seeded(h, 2);
            let dy = seeded(n * h * groups, 3);
            let rows = n * groups;
            let loss = |x: &[f32], gamma: &[f32]| {
                let (mut y, mut r) = (vec![0.0; rows * h], vec![0.0; rows]);
                rms_norm_fwd(x, gamma, 1e-5, &mut y, &mut r);
                y.iter().zip(&dy).map(|(a, b)| (a * b) as f64).sum::<f64>()
            };
            let (mut y, mut rstd) = (vec![0.0; rows * h], vec![0.0; rows]);
            rms_norm_fwd(&x, &gamma, 1e-5, &mut y, &mut rstd);
            let (mut dx, mut dgamma) = (vec![0.0; rows * h], vec![0.0; h]);
            rms_norm_bwd(&dy, &x, &gamma, &rstd, &mut dx, Some(&mut dgamma));
            check_grad("dx", &x, &dx, |x| loss(x, &gamma));
            check_grad("dgamma", &gamma, &dgamma, |g| loss(&x, g));
        }
    }
}
