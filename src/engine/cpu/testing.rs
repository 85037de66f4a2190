//! Helpers for the kernels' unit tests: deterministic inputs and finite-difference checks of
//! analytic gradients.

/// `len` values in [−1, 1) from a fixed linear congruential sequence per `seed`.
pub fn seeded(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Assert that `grad` is the gradient of `f` at `x` (central differences in f64 of an f32
/// computation, step 1e-3; tolerance relative to the gradient's largest entry).
pub fn check_grad(name: &str, x: &[f32], grad: &[f32], f: impl Fn(&[f32]) -> f64) {
    assert_eq!(x.len(), grad.len(), "{name}: shapes");
    let scale = grad.iter().fold(1e-3f32, |m, g| m.max(g.abs())) as f64;
    let step = 1e-3f32;
    let mut probe = x.to_vec();
    for i in 0..x.len() {
        probe[i] = x[i] + step;
        let up = f(&probe);
        probe[i] = x[i] - step;
        let down = f(&probe);
        probe[i] = x[i];
        let numeric = (up - down) / (2.0 * step as f64);
        let err = (numeric - grad[i] as f64).abs() / scale;
        assert!(
            err < 2e-2,
            "{name}[{i}]: analytic {} vs numeric {numeric} (error {err:.2e} of {scale:.2e})",
            grad[i]
        );
    }
}
