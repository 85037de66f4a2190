//! Squared ReLU, a non-gated MLP's activation (megatron-core megatron/core/activations.py
//! `squared_relu`): `y = relu(x)²`, `dx = 2·relu(x)·dy`.

/// `y = relu(x)²` (overwrites `y`).
pub fn squared_relu_fwd(x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        let r = x.max(0.0);
        *y = r * r;
    }
}

/// `dx` (overwritten) of [`squared_relu_fwd`]: `2·relu(x)·dy`.
pub fn squared_relu_bwd(dy: &[f32], x: &[f32], dx: &mut [f32]) {
    for ((dx, &dy), &x) in dx.iter_mut().zip(dy).zip(x) {
        *dx = 2.0 * x.max(0.0) * dy;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testing::{check_grad, seeded};

    #[test]
    fn backward_matches_finite_differences() {
        let x: Vec<f32> = seeded(40, 3).iter().map(|v| v * 4.0).collect();
        let dy = seeded(40, 4);
        let loss = |x: &[f32]| {
            let mut y = vec![0.0; x.len()];
            squared_relu_fwd(x, &mut y);
            y.iter().zip(&dy).map(|(a, b)| (a * b) as f64).sum::<f64>()
        };
        let mut dx = vec![0.0; 40];
        squared_relu_bwd(&dy, &x, &mut dx);
        check_grad("dx", &x, &dx, loss);
        assert!(x.iter().zip(&dx).any(|(&x, &d)| x < 0.0 && d == 0.0));
    }
}
