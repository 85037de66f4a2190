//! RMSNorm forward and backward over rows (aclnnRmsNorm / aclnnRmsNormGrad).
//!
//! Legend: n = rows, h = row length. `y = x · rstd · γ` with `rstd = 1/√(mean(x²) + eps)`,
//! computed in f32 as HF `LlamaRMSNorm` and Megatron's RMSNorm do (γ applied last).

use crate::engine::simd::dot;
use rayon::prelude::*;

/// `y [n, h] = x · rstd · γ`, `rstd [n]` saved for the backward pass. Overwrites `y`, `rstd`.
pub fn rms_norm_fwd(x: &[f32], gamma: &[f32], eps: f32, y: &mut [f32], rstd: &mut [f32]) {
    let h = gamma.len();
    y.par_chunks_mut(h)
        .zip(x.par_chunks(h))
        .zip(rstd.par_iter_mut())
        .for_each(|((y, x), r)| {
            *r = 1.0 / (dot(x, x) / h as f32 + eps).sqrt();
            for ((y, &x), &g) in y.iter_mut().zip(x).zip(gamma) {
                *y = g * (x * *r);
            }
        });
}

/// Rows per task of the γ gradient: their partial sums are added in a fixed order, so the
/// result does not depend on the thread count.
const GRAD_ROWS: usize = 64;

/// `dx [n, h]` (overwritten) and `dγ [h]` (accumulated, unless frozen) of [`rms_norm_fwd`]:
/// `dx = rstd·(γ∘dy) − rstd³/h · x · Σ(γ∘dy∘x)`, `dγ += Σ_rows dy ∘ x · rstd`.
pub fn rms_norm_bwd(
    dy: &[f32],
    x: &[f32],
    gamma: &[f32],
    rstd: &[f32],
    dx: &mut [f32],
    dgamma: Option<&mut [f32]>,
) {
    let h = gamma.len();
    dx.par_chunks_mut(h)
        .zip(dy.par_chunks(h).zip(x.par_chunks(h)))
        .zip(rstd.par_iter())
        .for_each(|((dx, (dy, x)), &r)| {
            let mut proj = 0f32;
            for ((&dy, &x), &g) in dy.iter().zip(x).zip(gamma) {
                proj += g * dy * x;
            }
            let c = r * r * r * proj / h as f32;
            for (((dx, &dy), &x), &g) in dx.iter_mut().zip(dy).zip(x).zip(gamma) {
                *dx = r * g * dy - c * x;
            }
        });
    let Some(dgamma) = dgamma else { return };
    let partials: Vec<Vec<f32>> = dy
        .par_chunks(h * GRAD_ROWS)
        .zip(x.par_chunks(h * GRAD_ROWS))
        .zip(rstd.par_chunks(GRAD_ROWS))
        .map(|((dy, x), rstd)| {
            let mut acc = vec![0f32; h];
            for ((dy, x), &r) in dy.chunks_exact(h).zip(x.chunks_exact(h)).zip(rstd) {
                for ((a, &dy), &x) in acc.iter_mut().zip(dy).zip(x) {
                    *a += dy * x * r;
                }
            }
            acc
        })
        .collect();
    for p in partials {
        for (g, v) in dgamma.iter_mut().zip(p) {
            *g += v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testing::{check_grad, seeded};

    #[test]
    fn backward_matches_finite_differences() {
        let (n, h) = (3, 8);
        let x = seeded(n * h, 1);
        let gamma = seeded(h, 2);
        let dy = seeded(n * h, 3);
        let loss = |x: &[f32], gamma: &[f32]| {
            let (mut y, mut r) = (vec![0.0; n * h], vec![0.0; n]);
            rms_norm_fwd(x, gamma, 1e-5, &mut y, &mut r);
            y.iter().zip(&dy).map(|(a, b)| (a * b) as f64).sum::<f64>()
        };
        let (mut y, mut rstd) = (vec![0.0; n * h], vec![0.0; n]);
        rms_norm_fwd(&x, &gamma, 1e-5, &mut y, &mut rstd);
        let (mut dx, mut dgamma) = (vec![0.0; n * h], vec![0.0; h]);
        rms_norm_bwd(&dy, &x, &gamma, &rstd, &mut dx, Some(&mut dgamma));
        check_grad("dx", &x, &dx, |x| loss(x, &gamma));
        check_grad("dgamma", &gamma, &dgamma, |g| loss(&x, g));
    }
}
