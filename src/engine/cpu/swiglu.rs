//! SwiGLU over fused `[gate | up]` rows (aclnnSwiGlu / aclnnSwiGluGrad).
//!
//! Legend: n = rows, f = ffn width; `x [n, 2f]` holds the gate then the up projection (Megatron's
//! `linear_fc1` order); `y [n, f] = silu(gate) · up`, `silu(a) = a·σ(a)`.

use crate::tensor::simd::{silu_mul, swiglu_grad};

/// `y [n, f] = silu(gate) · up` (overwrites `y`). One thread: the backend runs blocks of rows
/// in parallel.
pub fn swiglu_fwd(x: &[f32], f: usize, y: &mut [f32]) {
    y.chunks_exact_mut(f)
        .zip(x.chunks_exact(2 * f))
        .for_each(|(y, row)| {
            let (gate, up) = row.split_at(f);
            silu_mul(gate, up, y);
        });
}

/// `dx [n, 2f]` (overwritten) of [`swiglu_fwd`]: `d gate = dy·up·σ(a)(1 + a(1 − σ(a)))`,
/// `d up = dy·silu(a)`.
pub fn swiglu_bwd(dy: &[f32], x: &[f32], f: usize, dx: &mut [f32]) {
    dx.chunks_exact_mut(2 * f)
        .zip(x.chunks_exact(2 * f))
        .zip(dy.chunks_exact(f))
        .for_each(|((dx, x), dy)| {
            let (gate, up) = x.split_at(f);
            let (dgate, dup) = dx.split_at_mut(f);
            swiglu_grad(dy, gate, up, dgate, dup);
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testing::{check_grad, seeded};

    #[test]
    fn backward_matches_finite_differences() {
        let (n, f) = (3, 5);
        let x: Vec<f32> = seeded(n * 2 * f, 1).iter().map(|v| v * 4.0).collect();
        let dy = seeded(n * f, 2);
        let loss = |x: &[f32]| {
            let mut y = vec![0.0; n * f];
            swiglu_fwd(x, f, &mut y);
            y.iter().zip(&dy).map(|(a, b)| (a * b) as f64).sum::<f64>()
        };
        let mut dx = vec![0.0; n * 2 * f];
        swiglu_bwd(&dy, &x, f, &mut dx);
        check_grad("dx", &x, &dx, loss);
    }
}
