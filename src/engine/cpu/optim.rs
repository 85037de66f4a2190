//! Optimizer kernels: AdamW (aclnnApplyAdamWV2) and the sum of squares behind the gradient
//! norm (aclnnForeachNorm), and the embedding gradient (aclnnEmbeddingDenseBackward).

use crate::engine::{AdamWStep, NO_ROW};
use crate::tensor::DType;
use rayon::prelude::*;

/// Elements per parallel task.
const CHUNK: usize = 1 << 14;

/// One AdamW step on `param` with `grad` (first multiplied by `a.grad_scale` unless that is
/// 1), moments `m`, `v` updated in place, in the order and precision of torch's
/// single-tensor `AdamW` (torch/optim/adamw.py, `_single_tensor_adam` with decoupled decay):
/// `p ·= 1 − lr·wd; m = lerp(m, g, 1 − β₁); v = β₂v + (1 − β₂)g²; p −= lr/bc₁ · m /
/// (√v/√bc₂ + ε)`; then `p` rounded into `model`'s half bits where given, and `grad` zeroed
/// for the next accumulation. Each chunk goes through all of it while in cache: one pass over
/// memory (zeroing the gradient here spares the trainer a pass of its own).
pub fn adamw(
    param: &mut [f32],
    (grad, m, v): (&mut [f32], &mut [f32], &mut [f32]),
    a: AdamWStep,
    model: Option<(DType, &mut [u16])>,
) {
    let (b1, b2) = a.betas;
    let decay = (1.0 - a.lr * a.weight_decay) as f32;
    let w1 = (1.0 - b1) as f32;
    let (b2f, w2) = (b2 as f32, (1.0 - b2) as f32);
    let bc1 = 1.0 - b1.powf(a.step as f64);
    let bc2_sqrt = ((1.0 - b2.powf(a.step as f64)).sqrt()) as f32;
    let step_size = (a.lr / bc1) as f32;
    let eps = a.eps as f32;
    let grad_scale = a.grad_scale;
    let update = |p: &mut [f32], g: &mut [f32], m: &mut [f32], v: &mut [f32]| {
        for i in 0..p.len() {
            // × 1 is exact, so scaling unconditionally gives the same bits.
            let g = std::mem::take(&mut g[i]) * grad_scale;
            p[i] *= decay;
            m[i] += w1 * (g - m[i]);
            v[i] = v[i] * b2f + w2 * (g * g);
            let denom = v[i].sqrt() / bc2_sqrt + eps;
            p[i] += -step_size * (m[i] / denom);
        }
    };
    // Each operation is exactly rounded, so 16-lane code computes the same bits.
    let run =
        |p: &mut [f32], g: &mut [f32], m: &mut [f32], v: &mut [f32]| widest(|| update(p, g, m, v));
    let chunks = param
        .par_chunks_mut(CHUNK)
        .zip(grad.par_chunks_mut(CHUNK))
        .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)));
    match model {
        Some((dtype, bits)) => {
            chunks
                .zip(bits.par_chunks_mut(CHUNK))
                .for_each(|(((p, g), (m, v)), bits)| {
                    run(p, g, m, v);
                    super::narrow_half(p, dtype, bits);
                })
        }
        None => chunks.for_each(|((p, g), (m, v))| run(p, g, m, v)),
    }
}

/// `f`, compiled for AVX-512 where the CPU has it (see [`in_avx512`]), else as it is.
#[inline]
fn widest<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has the feature the function was compiled for.
        return unsafe { in_avx512(f) };
    }
    f()
}

/// `f` compiled for AVX-512 where it is inlined (the loops it runs vectorize to 16 lanes).
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn in_avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Independent f64 sums one chunk of [`sum_squares`] keeps (lanes of vector registers).
const LANES: usize = 32;

/// `Σ x²` in f64: within a chunk [`LANES`] running sums of every 32nd element, then the
/// lanes and the chunks summed in a fixed order.
pub fn sum_squares(x: &[f32]) -> f64 {
    let chunk_sum = |c: &[f32]| {
        let mut lanes = [0f64; LANES];
        let tail = c.chunks_exact(LANES);
        let rest: f64 = tail
            .remainder()
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum();
        for block in tail {
            for (s, &v) in lanes.iter_mut().zip(block) {
                *s += f64::from(v) * f64::from(v);
            }
        }
        lanes.iter().sum::<f64>() + rest
    };
    // Each operation is exactly rounded, so 8-lane code computes the same bits.
    let parts: Vec<f64> = (x.par_chunks(CHUNK))
        .map(|c| widest(|| chunk_sum(c)))
        .collect();
    parts.iter().sum()
}

/// `x ·= s`.
pub fn scale(x: &mut [f32], s: f32) {
    x.par_chunks_mut(CHUNK)
        .for_each(|c| c.iter_mut().for_each(|v| *v *= s));
}

/// Columns per task of the embedding gradient.
const EMBED_COLS: usize = 64;

/// `dtable [v, h] += onehot(ids)ᵀ · dy` for `dy [n, h]`: each token's gradient row added to
/// its id's row, tokens in order (column blocks in parallel, so no two tasks touch one value).
pub fn embedding_bwd(dy: &[f32], ids: &[u32], h: usize, dtable: &mut [f32]) {
    let blocks = h.div_ceil(EMBED_COLS);
    let out = crate::tensor::SharedOut(dtable.as_mut_ptr());
    (0..blocks).into_par_iter().for_each(|b| {
        let cols = b * EMBED_COLS..((b + 1) * EMBED_COLS).min(h);
        for (t, &id) in ids.iter().enumerate().filter(|(_, id)| **id != NO_ROW) {
            for c in cols.clone() {
                // SAFETY: column block b belongs to this task alone; id < v (or NO_ROW,
                // skipped) is checked by the caller.
                unsafe { *out.at(id as usize * h + c) += dy[t * h + c] };
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    // torch 2.9.1: p = torch.tensor([1.0, -2.0, 0.5]); g = torch.tensor([0.1, 0.2, -0.3]);
    // opt = torch.optim.AdamW([p], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1);
    // two steps with the same gradient.
    #[test]
    fn two_steps_equal_torch() {
        let mut p = vec![1.0f32, -2.0, 0.5];
        let g = [0.1f32, 0.2, -0.3];
        let (mut m, mut v) = (vec![0f32; 3], vec![0f32; 3]);
        for step in 1..=2 {
            let a = AdamWStep {
                lr: 0.01,
                betas: (0.9, 0.95),
                eps: 1e-8,
                weight_decay: 0.1,
                step,
                grad_scale: 1.0,
            };
            let mut g = g;
            adamw(&mut p, (&mut g, &mut m, &mut v), a, None);
            assert_eq!(g, [0.0; 3], "the gradient is left zeroed");
        }
        // Bit for bit.
        assert_eq!(p, [0.978_011_1_f32, -2.015_992_2, 0.518_990_5]);
    }

    #[test]
    fn embedding_gradients_add_per_id() {
        let dy = [1.0f32, 2.0, 10.0, 20.0, 100.0, 200.0];
        let mut table = vec![0f32; 3 * 2];
        embedding_bwd(&dy, &[2, 0, 2], 2, &mut table);
        assert_eq!(table, [10.0, 20.0, 0.0, 0.0, 101.0, 202.0]);
    }
}
