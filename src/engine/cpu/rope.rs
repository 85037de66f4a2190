//! Rotary position embedding, half-rotation (`rotate_half`) mode, on every head of each row
//! (aclnnRotaryPositionEmbedding mode 0, and its grad).
//!
//! Legend: n = rows, d = head dim, r = the rotated dimensions of a head (d, or fewer with a
//! partial rotation), half = r/2; `cos`, `sin` are `[n, half]`. A head's `(x1, x2)` halves of
//! its first r dimensions become `(x1·cos − x2·sin, x2·cos + x1·sin)`, the rest stay. The
//! rotation is orthogonal, so its backward pass is the same rotation by −θ.

/// Rotate every head of `x [n, width]` (heads of `head_dim`) in place; `inverse` rotates by
/// −θ (the backward pass). One thread: the backend runs blocks of rows in parallel.
pub fn rope(
    x: &mut [f32],
    (width, head_dim): (usize, usize),
    (cos, sin): (&[f32], &[f32]),
    inverse: bool,
) {
    let half = cos.len() / (x.len() / width).max(1);
    let sign = if inverse { -1.0f32 } else { 1.0 };
    x.chunks_mut(width).enumerate().for_each(|(r, row)| {
        let (c, s) = (
            &cos[r * half..(r + 1) * half],
            &sin[r * half..(r + 1) * half],
        );
        for head in row.chunks_exact_mut(head_dim) {
            let (a, b) = head[..2 * half].split_at_mut(half);
            for i in 0..half {
                // As transformers' `q·cos + rotate_half(q)·sin`, rounding for rounding.
                let (x1, x2, s) = (a[i], b[i], sign * s[i]);
                a[i] = x1 * c[i] + -x2 * s;
                b[i] = x2 * c[i] + x1 * s;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testing::{check_grad, seeded};

    #[test]
    fn backward_is_the_inverse_rotation() {
        // heads of 4 rotated whole, and heads of 8 rotated in their first 4 dimensions
        for (head_dim, width) in [(4, 8), (8, 16)] {
            let (n, half) = (3, 2);
            let x = seeded(n * width, 1);
            let angles = seeded(n * half, 2);
            let cos: Vec<f32> = angles.iter().map(|a| (a * 3.0).cos()).collect();
            let sin: Vec<f32> = angles.iter().map(|a| (a * 3.0).sin()).collect();
            let dy = seeded(n * width, 3);
            let shape = (width, head_dim);
            let loss = |x: &[f32]| {
                let mut y = x.to_vec();
                rope(&mut y, shape, (&cos, &sin), false);
                y.iter().zip(&dy).map(|(a, b)| (a * b) as f64).sum::<f64>()
            };
            let mut dx = dy.clone();
            rope(&mut dx, shape, (&cos, &sin), true);
            check_grad("dx", &x, &dx, loss);
            // the unrotated dimensions pass through
            let mut y = x.clone();
            rope(&mut y, shape, (&cos, &sin), false);
            for (i, (a, b)) in x.iter().zip(&y).enumerate() {
                if i % head_dim >= 2 * half {
                    assert_eq!(a, b);
                }
            }
        }
    }
}
