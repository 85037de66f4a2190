//! Block transposes for packing matrix-product operands: for the bf16 products a 32 × 32 block
//! of bf16 bits and a 16 × 16 block of bf16 pairs (and the pair interleave of two rows), for
//! the f32 panel kernel f32 matrices in 16 × 16 blocks — moved in AVX-512 registers (five or
//! four rounds of two-source permutes, each swapping the off-diagonal halves of ever smaller
//! sub-blocks) instead of one element at a time. Callers run the bf16 ones only where bf16
//! products run, which implies AVX-512BW ([`super::bf16_gemm::available`] checks it), the f32
//! one where AVX-512F is.

/// `dst[r · dst_pitch + q] = src[q · pitch + r]` for `r, q < 32`.
///
/// # Panics
/// If a slice is shorter than its 32 rows.
pub fn columns(src: &[u16], pitch: usize, dst: &mut [u16], dst_pitch: usize) {
    assert!(
        src.len() >= 31 * pitch + 32 && dst.len() >= 31 * dst_pitch + 32,
        "internal: transpose block outside its slices"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F/BW are there (module contract); 32 rows of 32 elements of each slice
    // (asserted above) are read or written.
    unsafe {
        columns_avx512(src.as_ptr(), pitch, dst.as_mut_ptr(), dst_pitch)
    }
    #[cfg(not(target_arch = "x86_64"))]
    for r in 0..32 {
        for q in 0..32 {
            dst[r * dst_pitch + q] = src[q * pitch + r];
        }
    }
}

/// `dst[p · 16 + c] = src[c · pitch + 2p] | src[c · pitch + 2p + 1] << 16` for `p, c < 16`:
/// the pair rows of one 16-column tile panel read from 16 stored columns.
///
/// # Panics
/// If `src` is shorter than its 16 rows.
pub fn pairs(src: &[u16], pitch: usize, dst: &mut [u32; 256]) {
    assert!(
        src.len() >= 15 * pitch + 32,
        "internal: transpose block outside its slice"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F is there (module contract); 16 rows of 32 elements of `src` (asserted
    // above) are read, `dst` is written whole.
    unsafe {
        words_avx512(src.as_ptr().cast(), pitch * 2, dst.as_mut_ptr().cast(), 64)
    }
    #[cfg(not(target_arch = "x86_64"))]
    for p in 0..16 {
        for c in 0..16 {
            let at = c * pitch + 2 * p;
            dst[p * 16 + c] = u32::from(src[at]) | u32::from(src[at + 1]) << 16;
        }
    }
}

/// `dst[c · dst_pitch + r] = src[r · pitch + c]` for `r < rows`, `c < cols`: whole 16 × 16
/// blocks in registers, the ragged edges one element at a time. Callers run it only where
/// AVX-512F is (the f32 panel kernel's condition).
///
/// # Panics
/// If a slice is shorter than its rows.
pub fn f32_matrix(
    src: &[f32],
    pitch: usize,
    (rows, cols): (usize, usize),
    dst: &mut [f32],
    dst_pitch: usize,
) {
    if rows == 0 || cols == 0 {
        return;
    }
    assert!(
        src.len() >= (rows - 1) * pitch + cols && dst.len() >= (cols - 1) * dst_pitch + rows,
        "internal: transpose outside its slices"
    );
    let (whole_rows, whole_cols) = (rows / 16 * 16, cols / 16 * 16);
    for r0 in (0..whole_rows).step_by(16) {
        for c0 in (0..whole_cols).step_by(16) {
            let (from, to) = (&src[r0 * pitch + c0..], &mut dst[c0 * dst_pitch + r0..]);
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX-512F is there (contract); the block's 16 rows of 16 elements lie
            // inside both slices (asserted above).
            unsafe {
                words_avx512(
                    from.as_ptr().cast(),
                    pitch * 4,
                    to.as_mut_ptr().cast(),
                    dst_pitch * 4,
                )
            }
            #[cfg(not(target_arch = "x86_64"))]
            for r in 0..16 {
                for c in 0..16 {
                    to[c * dst_pitch + r] = from[r * pitch + c];
                }
            }
        }
    }
    for r in 0..rows {
        let first = if r < whole_rows { whole_cols } else { 0 };
        for c in first..cols {
            dst[c * dst_pitch + r] = src[r * pitch + c];
        }
    }
}

/// `out[c] = lo[c] | hi[c] << 16` for `c < 16`: one pair row of a tile panel from two stored
/// rows.
///
/// # Safety
/// `out` is valid for writing 16 elements.
///
/// # Panics
/// If `lo` or `hi` is shorter than 16.
pub unsafe fn interleave(lo: &[u16], hi: &[u16], out: *mut u32) {
    assert!(
        lo.len() >= 16 && hi.len() >= 16,
        "internal: interleave rows too short"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F/BW are there (module contract); 16 elements of each row are read
    // (asserted), 16 written (the caller's promise).
    unsafe {
        interleave_avx512(lo.as_ptr(), hi.as_ptr(), out)
    }
    #[cfg(not(target_arch = "x86_64"))]
    for c in 0..16 {
        // SAFETY: the caller's 16 elements.
        unsafe { out.add(c).write(u32::from(lo[c]) | u32::from(hi[c]) << 16) };
    }
}

/// Permute indices of one round over `LANES` lanes that swaps sub-blocks of `s` lanes between
/// rows `i` (`low`) and `i + s` (`!low`): lanes below `LANES` pick the first row, the others
/// the second.
#[cfg(target_arch = "x86_64")]
const fn round_indices<const LANES: usize>(s: usize, low: bool) -> [u16; LANES] {
    let mut idx = [0u16; LANES];
    let mut j = 0;
    while j < LANES {
        idx[j] = match (j & s == 0, low) {
            (true, true) => j,
            (false, true) => LANES + j - s,
            (true, false) => j + s,
            (false, false) => LANES + j,
        } as u16;
        j += 1;
    }
    idx
}

/// The index vectors (low, high) of the rounds over 32 lanes of 16 bits, `s` = 16, 8, …, 1.
#[cfg(target_arch = "x86_64")]
const ROUNDS_16: [([u16; 32], [u16; 32]); 5] = {
    let mut r = [([0u16; 32], [0u16; 32]); 5];
    let mut i = 0;
    while i < 5 {
        r[i] = (round_indices(16 >> i, true), round_indices(16 >> i, false));
        i += 1;
    }
    r
};

/// The index vectors of the rounds over 16 lanes of 32 bits, `s` = 8, 4, 2, 1.
#[cfg(target_arch = "x86_64")]
const ROUNDS_32: [([u32; 16], [u32; 16]); 4] = {
    let mut r = [([0u32; 16], [0u32; 16]); 4];
    let mut i = 0;
    while i < 4 {
        let (low, high) = (
            round_indices::<16>(8 >> i, true),
            round_indices::<16>(8 >> i, false),
        );
        let mut j = 0;
        while j < 16 {
            (r[i].0[j], r[i].1[j]) = (low[j] as u32, high[j] as u32);
            j += 1;
        }
        i += 1;
    }
    r
};

/// Transposes `N` rows of `N` lanes in registers: round after round (`s` = N / 2, …, 1, each
/// with its (low, high) index vectors from `rounds`), rows `i` and `i + s` swap their
/// off-diagonal sub-blocks of `s` lanes through `permute(a, indices, b)` (lanes below `N`
/// from `a`). The callers, compiled for AVX-512, pass the vector operations as closures.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn transpose_rows<const N: usize>(
    rows: &mut [std::arch::x86_64::__m512i; N],
    rounds: impl Iterator<Item = (std::arch::x86_64::__m512i, std::arch::x86_64::__m512i)>,
    permute: impl Fn(
        std::arch::x86_64::__m512i,
        std::arch::x86_64::__m512i,
        std::arch::x86_64::__m512i,
    ) -> std::arch::x86_64::__m512i,
) {
    for (round, (low, high)) in rounds.enumerate() {
        let s = N >> (round + 1);
        for i in (0..N).filter(|i| i & s == 0) {
            let (a, b) = (rows[i], rows[i + s]);
            rows[i] = permute(a, low, b);
            rows[i + s] = permute(a, high, b);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn columns_avx512(src: *const u16, pitch: usize, dst: *mut u16, dst_pitch: usize) {
    use std::arch::x86_64::*;
    // SAFETY (loads and stores): the caller's 32 rows of 32 elements.
    let mut rows: [__m512i; 32] =
        std::array::from_fn(|q| unsafe { _mm512_loadu_si512(src.add(q * pitch).cast()) });
    // SAFETY: 32 u16 indices are 64 bytes.
    let load = |v: &[u16; 32]| unsafe { _mm512_loadu_si512(v.as_ptr().cast()) };
    let rounds = ROUNDS_16.iter().map(|(low, high)| (load(low), load(high)));
    transpose_rows(&mut rows, rounds, |a, idx, b| {
        _mm512_permutex2var_epi16(a, idx, b)
    });
    for (r, row) in rows.iter().enumerate() {
        // SAFETY: as above.
        unsafe { _mm512_storeu_si512(dst.add(r * dst_pitch).cast(), *row) };
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn interleave_avx512(lo: *const u16, hi: *const u16, out: *mut u32) {
    use std::arch::x86_64::*;
    // Lane j of the result: element j / 2 of `lo` (j even) or of `hi` (j odd, at 16 + j / 2
    // of the joined register).
    const INDICES: [u16; 32] = {
        let mut idx = [0u16; 32];
        let mut j = 0;
        while j < 32 {
            idx[j] = (j / 2 + if j % 2 == 0 { 0 } else { 16 }) as u16;
            j += 1;
        }
        idx
    };
    // SAFETY: the caller's 16 elements of each row and of `out`; the indices are 64 bytes.
    unsafe {
        let joined = _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_loadu_si256(lo.cast())),
            _mm256_loadu_si256(hi.cast()),
        );
        let idx = _mm512_loadu_si512(INDICES.as_ptr().cast());
        _mm512_storeu_si512(out.cast(), _mm512_permutexvar_epi16(idx, joined));
    }
}

/// 16 rows of 16 32-bit words (`pitch` bytes apart) transposed into 16 rows `dst_pitch` bytes
/// apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn words_avx512(src: *const u8, pitch: usize, dst: *mut u8, dst_pitch: usize) {
    use std::arch::x86_64::*;
    // SAFETY (loads and stores): the caller's 16 rows of 64 bytes in each.
    let mut rows: [__m512i; 16] =
        std::array::from_fn(|c| unsafe { _mm512_loadu_si512(src.add(c * pitch).cast()) });
    // SAFETY: 16 u32 indices are 64 bytes.
    let load = |v: &[u32; 16]| unsafe { _mm512_loadu_si512(v.as_ptr().cast()) };
    let rounds = ROUNDS_32.iter().map(|(low, high)| (load(low), load(high)));
    transpose_rows(&mut rows, rounds, |a, idx, b| {
        _mm512_permutex2var_epi32(a, idx, b)
    });
    for (p, row) in rows.iter().enumerate() {
        // SAFETY: as above.
        unsafe { _mm512_storeu_si512(dst.add(p * dst_pitch).cast(), *row) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_transpose_as_defined() {
        if !super::super::bf16_gemm::available() {
            eprintln!("skipped: no bf16 products (and so no AVX-512BW promise) on this CPU");
            return;
        }
        let (pitch, dst_pitch) = (37, 40);
        let src: Vec<u16> = (0..32 * pitch).map(|i| (i * 7 + 3) as u16).collect();
        let mut dst = vec![0u16; 32 * dst_pitch];
        columns(&src, pitch, &mut dst, dst_pitch);
        for r in 0..32 {
            for q in 0..32 {
                assert_eq!(dst[r * dst_pitch + q], src[q * pitch + r], "({r}, {q})");
            }
        }
        let mut pair_rows = [0u32; 256];
        pairs(&src, pitch, &mut pair_rows);
        for p in 0..16 {
            for c in 0..16 {
                let at = c * pitch + 2 * p;
                let want = u32::from(src[at]) | u32::from(src[at + 1]) << 16;
                assert_eq!(pair_rows[p * 16 + c], want, "({p}, {c})");
            }
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            let values: Vec<f32> = src.iter().map(|&v| v as f32).collect();
            let (rows, cols) = (31, 21);
            let mut out = vec![0f32; cols * 41];
            f32_matrix(&values, pitch, (rows, cols), &mut out, 41);
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(out[c * 41 + r], values[r * pitch + c], "({r}, {c})");
                }
            }
        }
        let mut row = [0u32; 16];
        // SAFETY: `row` holds 16 elements.
        unsafe { interleave(&src[5..], &src[5 + pitch..], row.as_mut_ptr()) };
        for (c, &v) in row.iter().enumerate() {
            let want = u32::from(src[5 + c]) | u32::from(src[5 + pitch + c]) << 16;
            assert_eq!(v, want, "{c}");
        }
    }
}
