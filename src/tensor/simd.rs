//! The CPU backend's inner loops, compiled once per instruction set and chosen at run time
//! (the binary targets baseline x86-64, so without this they would run on SSE2).

use super::dtype::{bf16_bits, bf16_to_f32};
use crate::tensor::DType;
use half::f16;
use half::slice::HalfBitsSliceExt;
use half::slice::HalfFloatSliceExt;

/// Independent accumulators: enough lanes for a 512-bit register, so the loop vectorizes
/// without reassociating a single sum.
const LANES: usize = 16;

macro_rules! dot_body {
    ($a:expr, $b:expr, $fma:expr) => {{
        let (a, b): (&[f32], &[f32]) = ($a, $b);
        let n = a.len().min(b.len());
        let whole = n / LANES * LANES;
        let mut acc = [0f32; LANES];
        for (x, y) in a[..whole]
            .chunks_exact(LANES)
            .zip(b[..whole].chunks_exact(LANES))
        {
            for i in 0..LANES {
                acc[i] = $fma(x[i], y[i], acc[i]);
            }
        }
        let mut tail = 0f32;
        for i in whole..n {
            tail = $fma(a[i], b[i], tail);
        }
        acc.iter().sum::<f32>() + tail
    }};
}

fn plain(x: f32, y: f32, acc: f32) -> f32 {
    acc + x * y
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
    dot_body!(a, b, f32::mul_add)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_body!(a, b, f32::mul_add)
}

/// `Σ a[i]·b[i]` over the shorter of the two.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has the features the function was compiled for.
            return unsafe { dot_avx512(a, b) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: as above.
            return unsafe { dot_avx2(a, b) };
        }
    }
    dot_body!(a, b, plain)
}

fn widen_bf16(src: &[u16], dst: &mut [f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16_to_f32(s);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn widen_bf16_avx512(src: &[u16], dst: &mut [f32]) {
    widen_bf16(src, dst)
}

fn narrow_bf16_loop(src: &[f32], dst: &mut [u16]) {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = bf16_bits(x);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn narrow_bf16_avx512(src: &[f32], dst: &mut [u16]) {
    narrow_bf16_loop(src, dst)
}

/// Round f32 values to bfloat16 bits (nearest, ties to even), element for element.
pub fn narrow_bf16(src: &[f32], dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
    {
        // SAFETY: the CPU has the features the function was compiled for.
        return unsafe { narrow_bf16_avx512(src, dst) };
    }
    narrow_bf16_loop(src, dst)
}

/// Widen half-precision bits (`dtype` F16 or BF16) to f32, element for element (exact).
pub fn widen(src: &[u16], dtype: DType, dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    match dtype {
        // half converts whole slices with F16C when the CPU has it.
        DType::F16 => <[f16]>::convert_to_f32_slice(src[..n].reinterpret_cast(), &mut dst[..n]),
        _ => {
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has the feature the function was compiled for.
                return unsafe { widen_bf16_avx512(&src[..n], &mut dst[..n]) };
            }
            widen_bf16(&src[..n], &mut dst[..n])
        }
    }
}

/// `e^x` on 16 lanes: `x = n·ln 2 + r` with |r| ≤ ln 2 / 2, a degree-6 polynomial for `e^r`
/// (Cephes' expf coefficients, about 1 ulp) and `2^n` applied by `vscalefps`, which gives 0
/// and +inf past the f32 range without bit tricks. Inputs are clamped first so that ±inf
/// stay finite through the reduction.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn exp16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let x = _mm512_min_ps(
        _mm512_max_ps(x, _mm512_set1_ps(-104.0)),
        _mm512_set1_ps(89.0),
    );
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    // ln 2 in two parts, the first exact in few bits, so that n·LN2_HI has no rounding error.
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm512_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let r2 = _mm512_mul_ps(r, r);
    let e = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0)));
    _mm512_scalef_ps(e, n)
}

/// Lanes `0..len.min(16)` set.
#[cfg(target_arch = "x86_64")]
fn lanes(len: usize) -> u16 {
    ((1u32 << len.min(16)) - 1) as u16
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn softmax_avx512(v: &mut [f32], scale: f32) {
    use std::arch::x86_64::*;
    let s = _mm512_set1_ps(scale);
    let p = v.as_mut_ptr();
    let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
    // SAFETY (all three loops): lanes i..i + 16 are masked to the slice's length.
    for i in (0..v.len()).step_by(16) {
        let m = lanes(v.len() - i);
        let x = unsafe { _mm512_maskz_loadu_ps(m, p.add(i)) };
        max = _mm512_mask_max_ps(max, m, max, _mm512_mul_ps(x, s));
    }
    let max = _mm512_set1_ps(_mm512_reduce_max_ps(max));
    let mut sum = _mm512_setzero_ps();
    for i in (0..v.len()).step_by(16) {
        let m = lanes(v.len() - i);
        let x = unsafe { _mm512_maskz_loadu_ps(m, p.add(i)) };
        let e = exp16(_mm512_fmsub_ps(x, s, max));
        sum = _mm512_mask_add_ps(sum, m, sum, e);
        unsafe { _mm512_mask_storeu_ps(p.add(i), m, e) };
    }
    let sum = _mm512_set1_ps(_mm512_reduce_add_ps(sum));
    for i in (0..v.len()).step_by(16) {
        let m = lanes(v.len() - i);
        let x = unsafe { _mm512_maskz_loadu_ps(m, p.add(i)) };
        unsafe { _mm512_mask_storeu_ps(p.add(i), m, _mm512_div_ps(x, sum)) };
    }
}

/// `e^x` without a libm call: the same reduction and Cephes polynomial as `exp16`, `2^n`
/// built in the exponent bits (inputs clamped to where that stays a normal f32). Plain
/// arithmetic only, so a loop of it vectorizes under the target features of its caller.
#[inline(always)]
fn exp_poly(x: f32) -> f32 {
    let x = x.clamp(-87.3, 88.7);
    let n = (x * std::f32::consts::LOG2_E).round();
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let mut p = 1.987_569_1e-4f32;
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        p = p * r + c;
    }
    let e = p * (r * r) + r + 1.0;
    e * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

/// [`exp_sub`] in plain arithmetic (vectorized by the caller's target features).
#[inline(always)]
fn exp_sub_portable(v: &mut [f32], shift: f32, scale: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = v.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (x, a) in c.iter_mut().zip(acc.iter_mut()) {
            *x = scale * exp_poly(*x - shift);
            *a += *x;
        }
    }
    for x in chunks.into_remainder() {
        *x = scale * exp_poly(*x - shift);
        acc[0] += *x;
    }
    acc.iter().sum()
}

/// [`sum_exp_sub`] in plain arithmetic.
#[inline(always)]
fn sum_exp_sub_portable(v: &[f32], shift: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = v.chunks_exact(LANES);
    for c in &mut chunks {
        for (x, a) in c.iter().zip(acc.iter_mut()) {
            *a += exp_poly(*x - shift);
        }
    }
    for x in chunks.remainder() {
        acc[0] += exp_poly(*x - shift);
    }
    acc.iter().sum()
}

/// [`swiglu_grad`] in plain arithmetic.
#[inline(always)]
fn swiglu_grad_portable(dy: &[f32], gate: &[f32], up: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
    for i in 0..dy.len() {
        let a = gate[i];
        let s = 1.0 / (1.0 + exp_poly(-a));
        dgate[i] = dy[i] * up[i] * s * (1.0 + a * (1.0 - s));
        dup[i] = dy[i] * a * s;
    }
}

/// [`silu_mul`] in plain arithmetic.
#[inline(always)]
fn silu_mul_portable(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &a), &b) in out.iter_mut().zip(gate).zip(up) {
        *o = a / (1.0 + exp_poly(-a)) * b;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn exp_sub_avx2(v: &mut [f32], shift: f32, scale: f32) -> f32 {
    exp_sub_portable(v, shift, scale)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn sum_exp_sub_avx2(v: &[f32], shift: f32) -> f32 {
    sum_exp_sub_portable(v, shift)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn swiglu_grad_avx2(dy: &[f32], gate: &[f32], up: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
    swiglu_grad_portable(dy, gate, up, dgate, dup)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn silu_mul_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
    silu_mul_portable(gate, up, out)
}

/// Whether the AVX2 builds of the portable loops can run here.
fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn exp_sub_avx512(v: &mut [f32], shift: f32, scale: f32) -> f32 {
    use std::arch::x86_64::*;
    let (sh, sc) = (_mm512_set1_ps(shift), _mm512_set1_ps(scale));
    let p = v.as_mut_ptr();
    let mut sum = _mm512_setzero_ps();
    for i in (0..v.len()).step_by(16) {
        let m = lanes(v.len() - i);
        // SAFETY: lanes i..i + 16 are masked to the slice's length.
        let x = unsafe { _mm512_maskz_loadu_ps(m, p.add(i)) };
        let e = _mm512_mul_ps(exp16(_mm512_sub_ps(x, sh)), sc);
        sum = _mm512_mask_add_ps(sum, m, sum, e);
        unsafe { _mm512_mask_storeu_ps(p.add(i), m, e) };
    }
    _mm512_reduce_add_ps(sum)
}

/// `v[i] = scale · e^(v[i] − shift)` in place; returns the sum of the new values (summed in
/// 16 lanes, then across them).
pub fn exp_sub(v: &mut [f32], shift: f32, scale: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has the feature the function was compiled for.
        return unsafe { exp_sub_avx512(v, shift, scale) };
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has the features the function was compiled for.
        return unsafe { exp_sub_avx2(v, shift, scale) };
    }
    exp_sub_portable(v, shift, scale)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn sum_exp_sub_avx512(v: &[f32], shift: f32) -> f32 {
    use std::arch::x86_64::*;
    let sh = _mm512_set1_ps(shift);
    let mut sum = _mm512_setzero_ps();
    for i in (0..v.len()).step_by(16) {
        let m = lanes(v.len() - i);
        // SAFETY: lanes i..i + 16 are masked to the slice's length.
        let x = unsafe { _mm512_maskz_loadu_ps(m, v.as_ptr().add(i)) };
        sum = _mm512_mask_add_ps(sum, m, sum, exp16(_mm512_sub_ps(x, sh)));
    }
    _mm512_reduce_add_ps(sum)
}

/// `Σ e^(v[i] − shift)`, `v` unchanged.
pub fn sum_exp_sub(v: &[f32], shift: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has the feature the function was compiled for.
        return unsafe { sum_exp_sub_avx512(v, shift) };
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has the features the function was compiled for.
        return unsafe { sum_exp_sub_avx2(v, shift) };
    }
    sum_exp_sub_portable(v, shift)
}

/// `max` over [`LANES`] independent running maxima, so that the loop vectorizes (the maximum
/// does not depend on the order; NaNs are skipped as `f32::max` skips them).
#[inline]
fn max_lanes(v: &[f32]) -> f32 {
    let chunks = v.chunks_exact(LANES);
    let tail = chunks
        .remainder()
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for c in chunks {
        for i in 0..LANES {
            lanes[i] = lanes[i].max(c[i]);
        }
    }
    lanes.iter().copied().fold(tail, f32::max)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn max_avx512(v: &[f32]) -> f32 {
    max_lanes(v)
}

/// The largest value (−∞ for an empty slice).
pub fn max(v: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has the feature the function was compiled for.
        return unsafe { max_avx512(v) };
    }
    max_lanes(v)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn swiglu_grad_avx512(dy: &[f32], gate: &[f32], up: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
    use std::arch::x86_64::*;
    let one = _mm512_set1_ps(1.0);
    for i in (0..dy.len()).step_by(16) {
        let m = lanes(dy.len() - i);
        // SAFETY: lanes i..i + 16 are masked to the length every slice shares.
        unsafe {
            let g = _mm512_maskz_loadu_ps(m, dy.as_ptr().add(i));
            let a = _mm512_maskz_loadu_ps(m, gate.as_ptr().add(i));
            let b = _mm512_maskz_loadu_ps(m, up.as_ptr().add(i));
            let s = _mm512_div_ps(
                one,
                _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), a))),
            );
            let silu = _mm512_mul_ps(a, s);
            // d gate = dy·up·σ(a)(1 + a(1 − σ(a))), d up = dy·silu(a).
            let ds = _mm512_mul_ps(s, _mm512_fmadd_ps(a, _mm512_sub_ps(one, s), one));
            _mm512_mask_storeu_ps(
                dgate.as_mut_ptr().add(i),
                m,
                _mm512_mul_ps(_mm512_mul_ps(g, b), ds),
            );
            _mm512_mask_storeu_ps(dup.as_mut_ptr().add(i), m, _mm512_mul_ps(g, silu));
        }
    }
}

/// The gradients of `silu(gate) · up` for `dy`: `dgate = dy·up·σ(a)(1 + a(1 − σ(a)))`,
/// `dup = dy·silu(a)` (all slices of one length).
pub fn swiglu_grad(dy: &[f32], gate: &[f32], up: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
    assert!(
        gate.len() == dy.len()
            && up.len() == dy.len()
            && dgate.len() == dy.len()
            && dup.len() == dy.len()
    );
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has the feature the function was compiled for.
        return unsafe { swiglu_grad_avx512(dy, gate, up, dgate, dup) };
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has the features the function was compiled for.
        return unsafe { swiglu_grad_avx2(dy, gate, up, dgate, dup) };
    }
    swiglu_grad_portable(dy, gate, up, dgate, dup)
}

/// `v = softmax(scale · v)` in place, as transformers computes it: scaled values, their
/// maximum subtracted, exponentiated, divided by the sum.
pub fn softmax(v: &mut [f32], scale: f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has the feature the function was compiled for.
        return unsafe { softmax_avx512(v, scale) };
    }
    v.iter_mut().for_each(|x| *x *= scale);
    let sum = exp_sub(v, max(v), 1.0);
    v.iter_mut().for_each(|x| *x /= sum);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn silu_mul_avx512(gate: &[f32], up: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = out.len().min(gate.len()).min(up.len());
    let one = _mm512_set1_ps(1.0);
    for i in (0..n).step_by(16) {
        let m = lanes(n - i);
        // SAFETY: lanes i..i + 16 are masked to n, within all three slices.
        unsafe {
            let a = _mm512_maskz_loadu_ps(m, gate.as_ptr().add(i));
            let b = _mm512_maskz_loadu_ps(m, up.as_ptr().add(i));
            let sig = _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), a)));
            let o = _mm512_mul_ps(_mm512_div_ps(a, sig), b);
            _mm512_mask_storeu_ps(out.as_mut_ptr().add(i), m, o);
        }
    }
}

/// `out = silu(gate) · up` element for element, `silu(a) = a / (1 + e^-a)`.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has the feature the function was compiled for.
        return unsafe { silu_mul_avx512(gate, up, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has the features the function was compiled for.
        return unsafe { silu_mul_avx2(gate, up, out) };
    }
    silu_mul_portable(gate, up, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_in_lanes_equals_the_fold_and_skips_nans() {
        for n in [0, 1, 15, 16, 17, 100] {
            let mut v: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32) - 5.0).collect();
            if n > 20 {
                v[3] = f32::NAN;
                v[90] = 7.5;
            }
            let want = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max(&v), want, "{n} values");
        }
    }

    #[test]
    fn dot_matches_the_scalar_loop() {
        let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b: Vec<f32> = (0..37).map(|i| 1.0 / (i as f32 + 1.0)).collect();
        let want: f64 = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (*x as f64) * (*y as f64))
            .sum();
        assert!((dot(&a, &b) as f64 - want).abs() < 1e-5);
    }

    #[test]
    fn widening_is_exact() {
        let values = [1.5f32, -2.25, 65504.0, 6.1e-5, 0.0, -0.0];
        let f16_bits: Vec<u16> = values.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
        let bf16_bits: Vec<u16> = values
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
        let mut out = vec![0f32; values.len()];
        widen(&f16_bits, DType::F16, &mut out);
        for (o, b) in out.iter().zip(&f16_bits) {
            assert_eq!(*o, f16::from_bits(*b).to_f32());
        }
        widen(&bf16_bits, DType::BF16, &mut out);
        for (o, b) in out.iter().zip(&bf16_bits) {
            assert_eq!(*o, half::bf16::from_bits(*b).to_f32());
        }
    }

    #[test]
    fn softmax_matches_the_definition() {
        for len in [1usize, 5, 16, 17, 100, 1500] {
            let mut v: Vec<f32> = (0..len)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.7)
                .collect();
            let scale = 0.125f32;
            let max = v
                .iter()
                .map(|&x| (x * scale) as f64)
                .fold(f64::MIN, f64::max);
            let sum: f64 = v.iter().map(|&x| ((x * scale) as f64 - max).exp()).sum();
            let want: Vec<f64> = v
                .iter()
                .map(|&x| ((x * scale) as f64 - max).exp() / sum)
                .collect();
            softmax(&mut v, scale);
            for (got, want) in v.iter().zip(&want) {
                assert!(
                    (*got as f64 - want).abs() <= 4e-6 * want.max(1e-30) + 1e-12,
                    "{got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn silu_mul_matches_the_definition_over_the_whole_range() {
        let gate: Vec<f32> = (0..203)
            .map(|i| (i as f32 - 101.0) * 1.05)
            .chain([f32::INFINITY, f32::NEG_INFINITY, 0.0])
            .collect();
        let up: Vec<f32> = (0..gate.len()).map(|i| 1.0 + i as f32 * 0.01).collect();
        let mut out = vec![f32::NAN; gate.len()];
        silu_mul(&gate, &up, &mut out);
        for ((o, &a), &b) in out.iter().zip(&gate).zip(&up) {
            let want = if a == f32::INFINITY {
                f64::INFINITY
            } else {
                a as f64 / (1.0 + (-(a as f64)).exp()) * b as f64
            };
            if want.is_nan() {
                assert!(o.is_nan(), "silu({a})·{b}: {o}, not NaN");
            } else if want.is_infinite() {
                assert_eq!(*o as f64, want);
            } else {
                assert!(
                    (*o as f64 - want).abs() <= 2e-7 * want.abs() + 1e-30,
                    "silu({a})·{b}: {o} vs {want}"
                );
            }
        }
    }
}
