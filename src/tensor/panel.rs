//! Matrix products on packed panels: the CPU backend's prefill and decode matmul, its f32
//! training products (`engine/cpu/gemm.rs` packs their right operands), and the LoRA merge's
//! low-rank update. A weight `w [m, k]` is stored as ⌈m / 32⌉ panels of
//! k × 32 elements (weight rows become panel columns), in the weight's own dtype, so one
//! AVX-512 micro-kernel reads 32 output columns per inner step with two vector loads.
//!
//! bf16 weights on CPUs with AVX512_BF16 are packed in k-pairs for `vdpbf16ps`, which
//! multiplies bf16 × bf16 pairs and accumulates in f32: the activations are rounded to bf16
//! first (as bf16 inference does), at twice the f32 FMA rate.

use super::simd::narrow_bf16;
use super::SharedOut;
use crate::tensor::DType;
use anyhow::{bail, Result};
use half::{bf16, f16};
use rayon::prelude::*;

/// Columns of a panel: two 512-bit registers of f32.
pub const PANEL: usize = 32;

/// Rows of the output one f32 micro-tile covers: 12 × 2 accumulators leave 8 of the 32 vector
/// registers for the panel loads and the broadcasts (6 rows ran ~10 % slower, 14 spill).
#[cfg(target_arch = "x86_64")]
const FMA_ROWS: usize = 12;
/// Rows of the output one bf16-pair micro-tile covers (6 × 2 accumulators).
#[cfg(target_arch = "x86_64")]
const PAIR_ROWS: usize = 6;

/// How a panel's elements are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PanelType {
    /// f32, row q of the panel holding column entries `(q, 0..32)`.
    F32,
    /// bf16 bits, laid out as F32, widened in registers.
    Bf16,
    /// f16 bits, laid out as F32, widened in registers.
    F16,
    /// bf16 bits in k-pairs: row q/2 holds `(q, c), (q + 1, c)` next to each other for
    /// c in 0..32 (`vdpbf16ps` operands); an odd k is padded with a zero row.
    Bf16Pairs,
}

impl PanelType {
    /// The panel type for weights of `dtype` on this CPU; `None` where the kernel cannot
    /// run (no AVX-512) or the dtype is not a float one.
    pub fn for_weights(dtype: DType) -> Option<Self> {
        if !has_panel_kernel() {
            return None;
        }
        match dtype {
            DType::F32 => Some(PanelType::F32),
            DType::F16 => Some(PanelType::F16),
            DType::BF16 if has_bf16_pairs() => Some(PanelType::Bf16Pairs),
            DType::BF16 => Some(PanelType::Bf16),
            _ => None,
        }
    }

    /// Bytes an element takes.
    pub fn size(self) -> usize {
        match self {
            PanelType::F32 => 4,
            PanelType::Bf16 | PanelType::F16 | PanelType::Bf16Pairs => 2,
        }
    }

    /// Elements one panel of inner dimension `k` holds.
    pub fn panel_len(self, k: usize) -> usize {
        match self {
            PanelType::Bf16Pairs => k.div_ceil(2) * 2 * PANEL,
            _ => k * PANEL,
        }
    }

    /// Where entry `(q, c)` (inner index, column) lies in its panel, in elements.
    fn offset(self, q: usize, c: usize) -> usize {
        match self {
            PanelType::Bf16Pairs => ((q / 2) * PANEL + c) * 2 + q % 2,
            _ => q * PANEL + c,
        }
    }

    /// The element stored in `bytes` (little-endian), as f32.
    fn decode(self, bytes: &[u8]) -> f32 {
        match self {
            PanelType::F32 => f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
            PanelType::Bf16 | PanelType::Bf16Pairs => {
                bf16::from_bits(u16::from_le_bytes([bytes[0], bytes[1]])).to_f32()
            }
            PanelType::F16 => f16::from_bits(u16::from_le_bytes([bytes[0], bytes[1]])).to_f32(),
        }
    }
}

/// A matrix `[m, k]` packed as panels.
#[derive(Debug, Clone)]
pub struct Panels {
    ty: PanelType,
    k: usize,
    m: usize,
    bytes: Vec<u8>,
}

impl Panels {
    /// Pack `m` rows of `k` little-endian elements (the weight's bytes, its dtype matching
    /// `ty`), panels in parallel.
    pub fn pack(ty: PanelType, data: &[u8], (m, k): (usize, usize)) -> Result<Self> {
        let size = ty.size();
        if data.len() != m * k * size {
            bail!(
                "[{m}, {k}] needs {} bytes, holds {}",
                m * k * size,
                data.len()
            );
        }
        let panel_bytes = ty.panel_len(k) * size;
        let mut bytes = vec![0u8; m.div_ceil(PANEL) * panel_bytes];
        if k > 0 {
            bytes
                .par_chunks_mut(panel_bytes)
                .zip(data.par_chunks(PANEL * k * size))
                .for_each(|(panel, rows)| {
                    for (c, row) in rows.chunks_exact(k * size).enumerate() {
                        for (q, e) in row.chunks_exact(size).enumerate() {
                            panel[ty.offset(q, c) * size..][..size].copy_from_slice(e);
                        }
                    }
                });
        }
        Ok(Panels { ty, k, m, bytes })
    }

    /// The panels' bytes where they hold bf16 pairs ([`PanelType::Bf16Pairs`]): ⌈m / 32⌉
    /// panels of ⌈k / 2⌉ pair rows, each the 32 columns' `(q, q + 1)` pairs side by side.
    pub fn bf16_pairs(&self) -> Option<&[u8]> {
        (self.ty == PanelType::Bf16Pairs).then_some(&self.bytes[..])
    }

    /// The dtype of the weights it holds.
    pub fn dtype(&self) -> DType {
        match self.ty {
            PanelType::F32 => DType::F32,
            PanelType::F16 => DType::F16,
            PanelType::Bf16 | PanelType::Bf16Pairs => DType::BF16,
        }
    }

    /// Rows `from..to` of the original matrix, widened to f32 (a slow path, for inspection).
    pub fn unpack_rows(&self, from: usize, to: usize, out: &mut Vec<f32>) {
        let (size, panel_len) = (self.ty.size(), self.ty.panel_len(self.k));
        out.clear();
        out.extend((from..to).flat_map(|j| {
            let panel = (j / PANEL) * panel_len;
            (0..self.k).map(move |q| {
                let at = (panel + self.ty.offset(q, j % PANEL)) * size;
                self.ty.decode(&self.bytes[at..at + size])
            })
        }));
    }

    /// `out [n, m] = x [n, k] · wᵀ`, one task a panel: decoding streams the weights once,
    /// prefill keeps a panel hot in cache for every row.
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        let (k, m) = (self.k, self.m);
        assert!(
            x.len() >= n * k,
            "internal: matmul of {} values as [{n}, {k}]",
            x.len()
        );
        let mut out = vec![0f32; n * m];
        if n == 0 || m == 0 {
            return out;
        }
        // vdpbf16ps multiplies bf16 by bf16: round the activations once, rows padded to k-pairs.
        let pairs = self.ty == PanelType::Bf16Pairs;
        let (lhs, lhs_stride) = if pairs {
            let stride = k.div_ceil(2) * 2;
            (LhsRows::Bf16(bf16_rows(x, (n, k), (n, stride))), stride)
        } else {
            (LhsRows::F32(x), k)
        };
        let panel_bytes = self.ty.panel_len(k) * self.ty.size();
        let dst = SharedOut(out.as_mut_ptr());
        (0..m.div_ceil(PANEL)).into_par_iter().for_each(|b| {
            let product = PanelProduct {
                // SAFETY: column b·PANEL < m of row 0 lies inside the n × m output.
                dst: unsafe { dst.at(b * PANEL) },
                dst_stride: m,
                lhs: lhs.as_ptr(),
                lhs_stride,
                panel: self.bytes[b * panel_bytes..].as_ptr(),
                panel_type: self.ty,
                rows: n,
                k,
                width: (m - b * PANEL).min(PANEL),
                pair_rows: SIDE_BY_SIDE,
            };
            // SAFETY: panels exist only where the kernel runs (`PanelType::for_weights`);
            // lhs holds n rows of lhs_stride ≥ k elements of the type the panel type reads;
            // panel b holds panel_len(k) elements; the task writes columns of its own panel in
            // the n rows of the n × m output only (row stride m), disjoint from the others.
            unsafe { panel_product(&product, 1.0, false) };
        });
        out
    }
}

/// The `n` rows of `k` values of `x` rounded to bf16 (nearest even) as `rows` rows of `stride`
/// elements, zero past the values (`rows ≥ n`, `stride ≥ k`), rows in parallel.
pub(crate) fn bf16_rows(
    x: &[f32],
    (n, k): (usize, usize),
    (rows, stride): (usize, usize),
) -> Vec<u16> {
    let mut bits = vec![0u16; rows * stride];
    if k > 0 {
        bits.par_chunks_mut(stride)
            .zip(x[..n * k].par_chunks(k))
            .for_each(|(dst, src)| narrow_bf16(src, &mut dst[..k]));
    }
    bits
}

/// The left operand of a panel product: f32 rows, or bf16 rows for `Bf16Pairs` panels.
enum LhsRows<'a> {
    F32(&'a [f32]),
    Bf16(Vec<u16>),
}

impl LhsRows<'_> {
    fn as_ptr(&self) -> *const u8 {
        match self {
            LhsRows::F32(v) => v.as_ptr() as *const u8,
            LhsRows::Bf16(v) => v.as_ptr() as *const u8,
        }
    }
}

/// Where a panel product reads and writes: row `i` of the output at `dst + i·dst_stride`,
/// row `i` of the left operand at `lhs + i·lhs_stride` elements (f32, or bf16 for
/// `Bf16Pairs` panels), the panel in `panel_type`'s layout.
#[derive(Clone, Copy)]
struct PanelProduct {
    dst: *mut f32,
    dst_stride: usize,
    lhs: *const u8,
    lhs_stride: usize,
    panel: *const u8,
    panel_type: PanelType,
    /// Rows of the output and of `lhs`.
    rows: usize,
    /// The inner dimension.
    k: usize,
    /// Output columns the panel holds (≤ [`PANEL`]; the rest of it is padding).
    width: usize,
    /// Where a `Bf16Pairs` panel's pair rows lie.
    pair_rows: PairRows,
}

/// Where the pair rows of a `Bf16Pairs` panel lie, in bf16 elements: pair row `r` of columns
/// 0..16 at `r · step`, that of columns 16..32 `hi` further.
#[derive(Clone, Copy)]
struct PairRows {
    step: usize,
    hi: usize,
}

/// [`Panels`]' pair rows: the 32 columns side by side.
const SIDE_BY_SIDE: PairRows = PairRows {
    step: 2 * PANEL,
    hi: PANEL,
};

/// Whether the panel kernel can run here (AVX-512F).
pub fn has_panel_kernel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether bf16 pairs can be multiplied here (AVX512_BF16).
pub(crate) fn has_bf16_pairs() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `PanelType` as a const generic (enums cannot be one on stable Rust).
#[cfg(target_arch = "x86_64")]
const KIND_F32: u8 = 0;
#[cfg(target_arch = "x86_64")]
const KIND_BF16: u8 = 1;
#[cfg(target_arch = "x86_64")]
const KIND_F16: u8 = 2;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::__m512;

/// Row `q` of a panel of `KIND` elements, widened: columns 0..16 and 16..32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn panel_row<const KIND: u8>(panel: *const u8, q: usize) -> (__m512, __m512) {
    use std::arch::x86_64::*;
    if KIND == KIND_F32 {
        let row = (panel as *const f32).add(q * PANEL);
        return (_mm512_loadu_ps(row), _mm512_loadu_ps(row.add(16)));
    }
    let row = (panel as *const u16).add(q * PANEL);
    let (lo, hi) = (
        _mm256_loadu_si256(row as *const __m256i),
        _mm256_loadu_si256(row.add(16) as *const __m256i),
    );
    if KIND == KIND_BF16 {
        // bf16 is the top half of an f32: widen each u16 and shift it up.
        let widen = |h| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)));
        (widen(lo), widen(hi))
    } else {
        (_mm512_cvtph_ps(lo), _mm512_cvtph_ps(hi))
    }
}

/// `dst = base + scale · acc` for a tile's rows from `i0` (`base` is `dst` when
/// `accumulate`, else 0), the panel's `width` columns only.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_tile<const ROWS: usize>(
    p: &PanelProduct,
    i0: usize,
    acc: &[[__m512; 2]; ROWS],
    scale: f32,
    accumulate: bool,
) {
    use std::arch::x86_64::*;
    let lo: std::arch::x86_64::__mmask16 = ((1u32 << p.width.min(16)) - 1) as u16;
    let hi: std::arch::x86_64::__mmask16 = ((1u32 << p.width.saturating_sub(16)) - 1) as u16;
    let s = _mm512_set1_ps(scale);
    let (base_lo, base_hi) = if accumulate { (lo, hi) } else { (0, 0) };
    for (ii, acc) in acc.iter().enumerate() {
        let d = p.dst.add((i0 + ii) * p.dst_stride);
        let d0 = _mm512_fmadd_ps(acc[0], s, _mm512_maskz_loadu_ps(base_lo, d));
        let d1 = _mm512_fmadd_ps(acc[1], s, _mm512_maskz_loadu_ps(base_hi, d.add(16)));
        _mm512_mask_storeu_ps(d, lo, d0);
        _mm512_mask_storeu_ps(d.add(16), hi, d1);
    }
}

/// Rows `i0..i0 + ROWS` of the product on f32 FMAs (panel elements widened as loaded), each
/// output summed in registers over the whole inner dimension.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_tile<const ROWS: usize, const KIND: u8>(
    p: &PanelProduct,
    i0: usize,
    scale: f32,
    accumulate: bool,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
    let lhs = (p.lhs as *const f32).add(i0 * p.lhs_stride);
    for q in 0..p.k {
        let (a0, a1) = panel_row::<KIND>(p.panel, q);
        for (ii, acc) in acc.iter_mut().enumerate() {
            let b = _mm512_set1_ps(*lhs.add(ii * p.lhs_stride + q));
            acc[0] = _mm512_fmadd_ps(b, a0, acc[0]);
            acc[1] = _mm512_fmadd_ps(b, a1, acc[1]);
        }
    }
    store_tile::<ROWS>(p, i0, &acc, scale, accumulate);
}

/// Rows `i0..i0 + ROWS` of the product on `vdpbf16ps` (bf16 lhs rows, `Bf16Pairs` panel).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pair_tile<const ROWS: usize>(p: &PanelProduct, i0: usize, scale: f32, accumulate: bool) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
    let lhs = (p.lhs as *const u16).add(i0 * p.lhs_stride);
    let panel = p.panel as *const u16;
    for pair in 0..p.k.div_ceil(2) {
        let row = panel.add(pair * p.pair_rows.step);
        let a0: __m512bh = std::mem::transmute(_mm512_loadu_si512(row as *const __m512i));
        let a1: __m512bh =
            std::mem::transmute(_mm512_loadu_si512(row.add(p.pair_rows.hi) as *const __m512i));
        for (ii, acc) in acc.iter_mut().enumerate() {
            let x = (lhs.add(ii * p.lhs_stride + 2 * pair) as *const i32).read_unaligned();
            let b: __m512bh = std::mem::transmute(_mm512_set1_epi32(x));
            acc[0] = _mm512_dpbf16_ps(acc[0], a0, b);
            acc[1] = _mm512_dpbf16_ps(acc[1], a1, b);
        }
    }
    store_tile::<ROWS>(p, i0, &acc, scale, accumulate);
}

/// Every row of `p` on the f32 FMA kernel for panels of `KIND`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_rows<const KIND: u8>(p: &PanelProduct, scale: f32, accumulate: bool) {
    for i0 in (0..p.rows).step_by(FMA_ROWS) {
        match (p.rows - i0).min(FMA_ROWS) {
            12 => fma_tile::<12, KIND>(p, i0, scale, accumulate),
            11 => fma_tile::<11, KIND>(p, i0, scale, accumulate),
            10 => fma_tile::<10, KIND>(p, i0, scale, accumulate),
            9 => fma_tile::<9, KIND>(p, i0, scale, accumulate),
            8 => fma_tile::<8, KIND>(p, i0, scale, accumulate),
            7 => fma_tile::<7, KIND>(p, i0, scale, accumulate),
            6 => fma_tile::<6, KIND>(p, i0, scale, accumulate),
            5 => fma_tile::<5, KIND>(p, i0, scale, accumulate),
            4 => fma_tile::<4, KIND>(p, i0, scale, accumulate),
            3 => fma_tile::<3, KIND>(p, i0, scale, accumulate),
            2 => fma_tile::<2, KIND>(p, i0, scale, accumulate),
            _ => fma_tile::<1, KIND>(p, i0, scale, accumulate),
        }
    }
}

/// Every row of `p` on the bf16-pair kernel.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pair_rows(p: &PanelProduct, scale: f32, accumulate: bool) {
    for i0 in (0..p.rows).step_by(PAIR_ROWS) {
        match (p.rows - i0).min(PAIR_ROWS) {
            6 => pair_tile::<6>(p, i0, scale, accumulate),
            5 => pair_tile::<5>(p, i0, scale, accumulate),
            4 => pair_tile::<4>(p, i0, scale, accumulate),
            3 => pair_tile::<3>(p, i0, scale, accumulate),
            2 => pair_tile::<2>(p, i0, scale, accumulate),
            _ => pair_tile::<1>(p, i0, scale, accumulate),
        }
    }
}

/// `dst = base + scale · lhs · panel` over all rows of `p` (`base` is `dst` when
/// `accumulate`, else 0).
///
/// # Safety
/// [`has_panel_kernel`] is true (and AVX512_BF16 is present for `Bf16Pairs`); `p`
/// addresses only live memory: `rows` output rows of `width` columns, `rows` lhs rows of `k`
/// elements (rounded up to even for `Bf16Pairs`), one panel; no other thread touches the
/// output rows' `width` columns meanwhile.
unsafe fn panel_product(p: &PanelProduct, scale: f32, accumulate: bool) {
    #[cfg(target_arch = "x86_64")]
    match p.panel_type {
        PanelType::F32 => fma_rows::<KIND_F32>(p, scale, accumulate),
        PanelType::Bf16 => fma_rows::<KIND_BF16>(p, scale, accumulate),
        PanelType::F16 => fma_rows::<KIND_F16>(p, scale, accumulate),
        PanelType::Bf16Pairs => pair_rows(p, scale, accumulate),
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("panel product without the panel kernel: {}", p.rows);
}

/// One panel that [`rows_times_panel`] reads.
#[derive(Clone, Copy)]
pub(crate) enum Panel {
    /// `k × PANEL` f32 (the lhs rows are f32).
    F32(*const f32),
    /// bf16 pairs for `vdpbf16ps` (the lhs rows are bf16, of an even `k`, zero where the panel
    /// is padding): `k / 2` pair rows `step` elements apart, each 16 `(q, q + 1)` pairs of
    /// columns 0..16 and, `hi` elements further, 16 of columns 16..32 (the AMX tiles'
    /// right-operand layout, or [`Panels`]').
    Bf16Pairs {
        bits: *const u16,
        step: usize,
        hi: usize,
    },
}

/// `dst = / += lhs · panel` for one panel (its first `width` columns live): `rows` output rows
/// `dst_stride` apart, lhs rows of `k` elements `lhs_stride` apart (of the panel's element
/// type); each output summed in registers over the k inner elements in order, then stored or
/// added.
///
/// # Safety
/// [`has_panel_kernel`] is true (and AVX512_BF16 is there for bf16 pairs); the `rows × width`
/// outputs, the `rows × k` lhs elements and the panel's `k` rows lie inside live buffers; no
/// other thread touches those outputs.
pub(crate) unsafe fn rows_times_panel(
    (dst, dst_stride): (*mut f32, usize),
    (lhs, lhs_stride): (*const u8, usize),
    panel: Panel,
    (rows, k, width): (usize, usize, usize),
    accumulate: bool,
) {
    let (panel, panel_type, pair_rows) = match panel {
        Panel::F32(values) => (values as *const u8, PanelType::F32, SIDE_BY_SIDE),
        Panel::Bf16Pairs { bits, step, hi } => (
            bits as *const u8,
            PanelType::Bf16Pairs,
            PairRows { step, hi },
        ),
    };
    let product = PanelProduct {
        dst,
        dst_stride,
        lhs,
        lhs_stride,
        panel,
        panel_type,
        rows,
        k,
        width,
        pair_rows,
    };
    // SAFETY: forwarded from the caller.
    unsafe { panel_product(&product, 1.0, accumulate) };
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
    if !has_panel_kernel() {
        return false;
    }
    assert!(dst.len() >= n * m && rhs.len() >= k * m && ls >= k);
    assert!(n == 0 || lhs.len() >= (n - 1) * ls + k);
    // The 32 columns of rhs a tile reads are copied next to each other first: rows of rhs
    // lie m floats apart, often a multiple of 4 KiB, and would all land in one L1 set.
    let mut panel = vec![0f32; k * PANEL];
    for j0 in (0..m).step_by(PANEL) {
        let width = (m - j0).min(PANEL);
        for (q, row) in panel.chunks_exact_mut(PANEL).enumerate() {
            row[..width].copy_from_slice(&rhs[q * m + j0..q * m + j0 + width]);
        }
        let product = PanelProduct {
            dst: dst[j0..].as_mut_ptr(),
            dst_stride: m,
            lhs: lhs.as_ptr() as *const u8,
            lhs_stride: ls,
            panel: panel.as_ptr() as *const u8,
            panel_type: PanelType::F32,
            rows: n,
            k,
            width,
            pair_rows: SIDE_BY_SIDE,
        };
        // SAFETY: the kernel exists; rows < n, columns j0..j0 + width < m, q < k and the
        // panel is k × PANEL, all inside the slices (checked above).
        unsafe { panel_product(&product, scale, true) };
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Little-endian bytes of `values` stored as `ty`, and the values as stored.
    fn stored(ty: PanelType, values: &[f32]) -> (Vec<u8>, Vec<f32>) {
        let mut bytes = Vec::new();
        let mut exact = Vec::new();
        for &v in values {
            let (b, e) = match ty {
                PanelType::F32 => (v.to_le_bytes().to_vec(), v),
                PanelType::F16 => {
                    let h = f16::from_f32(v);
                    (h.to_le_bytes().to_vec(), h.to_f32())
                }
                _ => {
                    let h = bf16::from_f32(v);
                    (h.to_le_bytes().to_vec(), h.to_f32())
                }
            };
            bytes.extend(b);
            exact.push(e);
        }
        (bytes, exact)
    }

    #[test]
    fn packed_products_match_the_definition() {
        if !has_panel_kernel() {
            return; // no AVX-512 here: weights stay row-major and the GEMM path runs
        }
        let mut types = vec![PanelType::F32, PanelType::F16, PanelType::Bf16];
        if has_bf16_pairs() {
            types.push(PanelType::Bf16Pairs);
        }
        for ty in types {
            for &(n, m, k) in &[(1, 5, 3), (4, 33, 7), (7, 64, 16), (13, 70, 45)] {
                let w: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
                    .collect();
                let x: Vec<f32> = (0..n * k)
                    .map(|i| ((i * 53 % 89) as f32 - 44.0) / 32.0)
                    .collect();
                let (bytes, w) = stored(ty, &w);
                let panels = Panels::pack(ty, &bytes, (m, k)).unwrap();
                let mut unpacked = Vec::new();
                panels.unpack_rows(0, m, &mut unpacked);
                assert_eq!(unpacked, w, "{ty:?} unpacks to what it packed");
                // The pair kernel multiplies bf16-rounded activations.
                let x: Vec<f32> = match ty {
                    PanelType::Bf16Pairs => x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
                    _ => x,
                };
                let out = panels.matmul(&x, n);
                for i in 0..n {
                    for j in 0..m {
                        let want: f64 = (0..k)
                            .map(|q| x[i * k + q] as f64 * w[j * k + q] as f64)
                            .sum();
                        let got = out[i * m + j] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "{ty:?} [{n},{m},{k}] ({i},{j}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn packing_checks_the_byte_count() {
        assert!(Panels::pack(PanelType::F32, &[0u8; 10], (2, 2)).is_err());
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
}
