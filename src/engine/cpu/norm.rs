//! RMSNorm forward and backward over rows (aclnnRmsNorm / aclnnRmsNormGrad), and LayerNorm's
//! (aclnnLayerNorm / aclnnLayerNormBackward).
//!
//! Legend: n = rows, h = row length. RMSNorm: `y = x · rstd · γ` with
//! `rstd = 1/√(mean(x²) + eps)`, computed in f32 as HF `LlamaRMSNorm` and Megatron's RMSNorm
//! do (γ applied last). LayerNorm: `y = (x − μ) · rstd · γ + β` with μ the row's mean and
//! `rstd = 1/√(mean((x − μ)²) + eps)` (the biased variance), in f32 as `torch.nn.LayerNorm`
//! computes a bf16 input.

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

/// `y [n, h] = (x − μ)·rstd·γ + β`, the rows' `mean [n]` and `rstd [n]` saved for the backward
/// pass. Overwrites `y`, `mean`, `rstd`.
pub fn layer_norm_fwd(
    x: &[f32],
    (gamma, beta): (&[f32], &[f32]),
    eps: f32,
    y: &mut [f32],
    (mean, rstd): (&mut [f32], &mut [f32]),
) {
    let h = gamma.len();
    let rows = y.chunks_exact_mut(h).zip(x.chunks_exact(h));
    for (((y, x), m), r) in rows.zip(mean.iter_mut()).zip(rstd.iter_mut()) {
        *m = x.iter().sum::<f32>() / h as f32;
        let var = x.iter().map(|&v| (v - *m) * (v - *m)).sum::<f32>() / h as f32;
        *r = 1.0 / (var + eps).sqrt();
        for (((y, &x), &g), &b) in y.iter_mut().zip(x).zip(gamma).zip(beta) {
            *y = (x - *m) * *r * g + b;
        }
    }
}

/// `dx [n, h]` (overwritten) of [`layer_norm_fwd`], and `dγ += Σ_rows dy ∘ x̂`, `dβ += Σ_rows dy`
/// (accumulated unless frozen), `x̂ = (x − μ)·rstd`:
/// `dx = rstd · (g − mean(g) − x̂ · mean(g ∘ x̂))` with `g = γ ∘ dy`.
pub fn layer_norm_bwd(
    (dy, x): (&[f32], &[f32]),
    gamma: &[f32],
    (mean, rstd): (&[f32], &[f32]),
    dx: &mut [f32],
    (dgamma, dbeta): (Option<&mut [f32]>, Option<&mut [f32]>),
) {
    let h = gamma.len();
    let rows = || {
        (dy.chunks_exact(h).zip(x.chunks_exact(h)))
            .zip(mean.iter().zip(rstd))
            .map(|((dy, x), (&m, &r))| (dy, x, m, r))
    };
    for (dx, (dy, x, m, r)) in dx.chunks_exact_mut(h).zip(rows()) {
        let (mut sum_g, mut sum_gx) = (0f32, 0f32);
        for ((&dy, &x), &g) in dy.iter().zip(x).zip(gamma) {
            sum_g += g * dy;
            sum_gx += g * dy * (x - m) * r;
        }
        let (mean_g, mean_gx) = (sum_g / h as f32, sum_gx / h as f32);
        for (((dx, &dy), &x), &g) in dx.iter_mut().zip(dy).zip(x).zip(gamma) {
            *dx = r * (g * dy - mean_g - (x - m) * r * mean_gx);
        }
    }
    if let Some(dgamma) = dgamma {
        for (dy, x, m, r) in rows() {
            for ((a, &dy), &x) in dgamma.iter_mut().zip(dy).zip(x) {
                *a += dy * (x - m) * r;
            }
        }
    }
    if let Some(dbeta) = dbeta {
        for (dy, ..) in rows() {
            dbeta.iter_mut().zip(dy).for_each(|(a, &d)| *a += d);
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

    #[test]
    fn layer_norm_backward_matches_finite_differences() {
        let (n, h) = (3, 8);
        let (x, gamma, beta, dy) = (
            seeded(n * h, 4),
            seeded(h, 5),
            seeded(h, 6),
            seeded(n * h, 7),
        );
        let loss = |x: &[f32], gamma: &[f32], beta: &[f32]| {
            let (mut y, mut m, mut r) = (vec![0.0; n * h], vec![0.0; n], vec![0.0; n]);
            layer_norm_fwd(x, (gamma, beta), 1e-5, &mut y, (&mut m, &mut r));
            y.iter().zip(&dy).map(|(a, b)| (a * b) as f64).sum::<f64>()
        };
        let (mut y, mut mean, mut rstd) = (vec![0.0; n * h], vec![0.0; n], vec![0.0; n]);
        layer_norm_fwd(&x, (&gamma, &beta), 1e-5, &mut y, (&mut mean, &mut rstd));
        let (ones, zeros) = (vec![1.0; h], vec![0.0; h]);
        let mut unit = vec![0.0; n * h];
        layer_norm_fwd(&x, (&ones, &zeros), 0.0, &mut unit, (&mut mean, &mut rstd));
        for row in unit.chunks(h) {
            let m = row.iter().sum::<f32>() / h as f32;
            let var = row.iter().map(|v| v * v).sum::<f32>() / h as f32;
            assert!(m.abs() < 1e-6 && (var - 1.0).abs() < 1e-5, "{m} {var}");
        }
        layer_norm_fwd(&x, (&gamma, &beta), 1e-5, &mut y, (&mut mean, &mut rstd));
        let (mut dx, mut dgamma, mut dbeta) = (vec![0.0; n * h], vec![0.0; h], vec![0.0; h]);
        let grads = (Some(&mut dgamma[..]), Some(&mut dbeta[..]));
        layer_norm_bwd((&dy, &x), &gamma, (&mean, &rstd), &mut dx, grads);
        check_grad("dx", &x, &dx, |x| loss(x, &gamma, &beta));
        check_grad("dgamma", &gamma, &dgamma, |g| loss(&x, g, &beta));
        check_grad("dbeta", &beta, &dbeta, |b| loss(&x, &gamma, b));
    }
}
