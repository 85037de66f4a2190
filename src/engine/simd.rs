//! The CPU backend's inner loops, compiled once per instruction set and chosen at run time
//! (the binary targets baseline x86-64, so without this they would run on SSE2).

use crate::ckpt::tensor::bf16_bits;
use crate::ckpt::torch::pickle::DType;
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
        *d = f32::from_bits(u32::from(s) << 16);
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
