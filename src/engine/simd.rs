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

macro_rules! axpy_body {
    ($alpha:expr, $x:expr, $y:expr) => {{
        let (alpha, x, y): (f32, &[f32], &mut [f32]) = ($alpha, $x, $y);
        for (y, &x) in y.iter_mut().zip(x) {
            *y = x.mul_add(alpha, *y);
        }
    }};
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
fn axpy_avx512(alpha: f32, x: &[f32], y: &mut [f32]) {
    axpy_body!(alpha, x, y)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn axpy_avx2(alpha: f32, x: &[f32], y: &mut [f32]) {
    axpy_body!(alpha, x, y)
}

/// `y += alpha · x`.
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has the features the function was compiled for.
            return unsafe { axpy_avx512(alpha, x, y) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: as above.
            return unsafe { axpy_avx2(alpha, x, y) };
        }
    }
    for (y, &x) in y.iter_mut().zip(x) {
        *y += alpha * x;
    }
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

/// Rows of `dst` one micro-tile of [`rank_update`] covers.
#[cfg(target_arch = "x86_64")]
const TILE_ROWS: usize = 6;

/// `dst[i, j] += scale · Σ_p lhs[i·ls + p] · panel[p·32 + j - j0]` for `ROWS` rows from `i0`
/// and the (up to 32) columns from `j0`, kept in two registers a row.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn rank_tile<const ROWS: usize>(
    dst: &mut [f32],
    m: usize,
    lhs: &[f32],
    ls: usize,
    panel: &[f32],
    k: usize,
    scale: f32,
    (i0, j0): (usize, usize),
) {
    use std::arch::x86_64::*;
    let width = (m - j0).min(32);
    let lo: __mmask16 = ((1u32 << width.min(16)) - 1) as u16;
    let hi: __mmask16 = ((1u32 << width.saturating_sub(16)) - 1) as u16;
    let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
    for p in 0..k {
        let a0 = _mm512_loadu_ps(panel.as_ptr().add(p * 32));
        let a1 = _mm512_loadu_ps(panel.as_ptr().add(p * 32 + 16));
        for (ii, acc) in acc.iter_mut().enumerate() {
            let b = _mm512_set1_ps(*lhs.get_unchecked((i0 + ii) * ls + p));
            acc[0] = _mm512_fmadd_ps(b, a0, acc[0]);
            acc[1] = _mm512_fmadd_ps(b, a1, acc[1]);
        }
    }
    let s = _mm512_set1_ps(scale);
    for (ii, acc) in acc.iter().enumerate() {
        let d = dst.as_mut_ptr().add((i0 + ii) * m + j0);
        let d0 = _mm512_fmadd_ps(acc[0], s, _mm512_maskz_loadu_ps(lo, d));
        let d1 = _mm512_fmadd_ps(acc[1], s, _mm512_maskz_loadu_ps(hi, d.add(16)));
        _mm512_mask_storeu_ps(d, lo, d0);
        _mm512_mask_storeu_ps(d.add(16), hi, d1);
    }
}

/// `dst[n × m] += scale · lhs[n × k] · rhs[k × m]` for a small inner dimension `k` (a
/// low-rank update), `lhs` rows `ls` apart, `rhs` and `dst` row-major and contiguous. Each
/// product is summed in registers before it is scaled and added, as `W + s·(B·A)` is. Returns
/// false (and does nothing) where the CPU lacks AVX-512; the caller then uses a general GEMM.
pub fn rank_update(
    dst: &mut [f32],
    (n, m, k): (usize, usize, usize),
    (lhs, ls): (&[f32], usize),
    rhs: &[f32],
    scale: f32,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        assert!(dst.len() >= n * m && rhs.len() >= k * m && ls >= k);
        assert!(n == 0 || lhs.len() >= (n - 1) * ls + k);
        // The 32 columns of rhs a tile reads are copied next to each other first: rows of rhs
        // lie m floats apart, often a multiple of 4 KiB, and would all land in one L1 set.
        let mut panel = vec![0f32; k * 32];
        for j0 in (0..m).step_by(32) {
            let width = (m - j0).min(32);
            for (p, row) in panel.chunks_exact_mut(32).enumerate() {
                row[..width].copy_from_slice(&rhs[p * m + j0..p * m + j0 + width]);
            }
            for i0 in (0..n).step_by(TILE_ROWS) {
                // SAFETY: the CPU has AVX-512F; every index lies inside the slices (checked
                // above: rows < n, columns < m through the masks, p < k, panel k × 32).
                unsafe {
                    let at = (i0, j0);
                    match (n - i0).min(TILE_ROWS) {
                        6 => rank_tile::<6>(dst, m, lhs, ls, &panel, k, scale, at),
                        5 => rank_tile::<5>(dst, m, lhs, ls, &panel, k, scale, at),
                        4 => rank_tile::<4>(dst, m, lhs, ls, &panel, k, scale, at),
                        3 => rank_tile::<3>(dst, m, lhs, ls, &panel, k, scale, at),
                        2 => rank_tile::<2>(dst, m, lhs, ls, &panel, k, scale, at),
                        _ => rank_tile::<1>(dst, m, lhs, ls, &panel, k, scale, at),
                    }
                }
            }
        }
        return true;
    }
    let _ = (dst, n, m, k, lhs, ls, rhs, scale);
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_and_axpy_match_scalar_loops() {
        let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b: Vec<f32> = (0..37).map(|i| 1.0 / (i as f32 + 1.0)).collect();
        let want: f64 = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (*x as f64) * (*y as f64))
            .sum();
        assert!((dot(&a, &b) as f64 - want).abs() < 1e-5);
        let mut y = b.clone();
        axpy(2.0, &a, &mut y);
        for i in 0..37 {
            assert!((y[i] - (b[i] + 2.0 * a[i])).abs() < 1e-6);
        }
    }

    #[test]
    fn rank_update_matches_the_definition() {
        let (n, m, k, ls) = (13, 45, 5, 7);
        let lhs: Vec<f32> = (0..n * ls).map(|i| (i % 11) as f32 * 0.25 - 1.0).collect();
        let rhs: Vec<f32> = (0..k * m).map(|i| (i % 7) as f32 * 0.5 - 1.5).collect();
        let base: Vec<f32> = (0..n * m).map(|i| i as f32).collect();
        let mut dst = base.clone();
        if !rank_update(&mut dst, (n, m, k), (&lhs, ls), &rhs, 0.5) {
            return; // no AVX-512 here: callers use the general GEMM
        }
        for i in 0..n {
            for j in 0..m {
                let s: f32 = (0..k).map(|p| lhs[i * ls + p] * rhs[p * m + j]).sum();
                assert_eq!(dst[i * m + j], base[i * m + j] + 0.5 * s, "({i}, {j})");
            }
        }
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
