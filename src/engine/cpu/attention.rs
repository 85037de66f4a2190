//! Causal grouped-query attention for training, forward and backward, shaped as
//! aclnnFlashAttentionScore / aclnnFlashAttentionScoreGrad: the forward pass saves only the
//! log-sum-exp of each query row's scores, and the backward pass recomputes the probabilities
//! block by block (FlashAttention-2's backward), so no `[S, S]` matrix per head is kept.
//!
//! Legend: T = rows (tokens of all sequences, sequence after sequence), nh = query heads,
//! ng = key/value heads (query groups), d = head dim, qw = nh·d, kw = ng·d. A *segment* is a
//! run of rows that attend to each other causally (a sequence, or a document inside one with
//! `--reset-attention-mask`); no row sees another segment. Head h reads key/value group
//! `h / (nh/ng)`.
//!
//! With attention dropout the probabilities are multiplied by the mask's factors after the
//! softmax (the log-sum-exp is the softmax's), and the backward pass draws the same factors
//! again: `dV = (P∘M)ᵀ·dO`, `dS = P∘(dP∘M − D)` with `D = Σ dO∘O` as without dropout (`O`
//! already holds the mask: `Σ_j P·M·dP = dO·O`).
//!
//! With a key [`Selection`] (DeepSeek sparse attention) a query row's scores of the keys it
//! did not select are −∞ before the softmax, in the forward and the backward pass alike, so
//! their probabilities are e^−87 of the row's largest at most (the exponential's clamp).

use super::bf16_gemm::{self, Operand};
use super::gemm;
use crate::engine::dropout::Mask;
use crate::engine::{AttentionShape, Segment, Selection};
use crate::tensor::dtype::bf16_to_f32;
use crate::tensor::matmul::{gemm_into, Store, Strided};
use crate::tensor::simd::{self, narrow_bf16, softmax};
use crate::tensor::SharedOut;
use rayon::prelude::*;
use std::ops::Range;

/// Query rows per block: a block's scores (rows × keys) stay in L2.
const BLOCK: usize = 64;

/// Shapes of one attention call.
#[derive(Clone, Copy)]
pub struct Layout<'a> {
    /// Heads, groups, head dim, scale.
    pub shape: AttentionShape,
    /// The segments, covering rows `0..T` in order.
    pub segments: &'a [Range<usize>],
    /// Attention dropout's mask (of every row), if any.
    pub dropout: Option<&'a Mask<'a>>,
    /// The keys each query row attends to, if not every key it sees.
    pub selection: Option<&'a Selection>,
}

thread_local! {
    /// [`Layout::select`]'s marks of a row's kept keys.
    static KEPT: std::cell::RefCell<Vec<bool>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Layout<'_> {
    fn qw(&self) -> usize {
        self.shape.heads * self.shape.head_dim
    }
    fn kw(&self) -> usize {
        self.shape.groups * self.shape.head_dim
    }
    fn rows(&self) -> usize {
        self.segments.last().map_or(0, |s| s.end)
    }

    /// Query row `row`'s `scores` of the keys from row `keys` on, −∞ for every key the
    /// selection (if any) does not name.
    fn select(&self, row: usize, keys: usize, scores: &mut [f32]) {
        let Some(selection) = self.selection else {
            return;
        };
        KEPT.with_borrow_mut(|kept| {
            kept.clear();
            kept.resize(scores.len(), false);
            for key in selection.keys_of(row) {
                if let Some(at) = key.checked_sub(keys).filter(|&at| at < kept.len()) {
                    kept[at] = true;
                }
            }
            for (score, _) in scores.iter_mut().zip(kept.iter()).filter(|(_, &k)| !k) {
                *score = f32::NEG_INFINITY;
            }
        });
    }

    /// Query row `row`'s probabilities for head `h` over its segment's keys from `keys`, times
    /// the dropout mask's factors (nothing without dropout).
    fn drop_probs(&self, h: usize, (row, keys): (usize, usize), probs: &mut [f32]) {
        if let Some(mask) = self.dropout {
            mask.scale_probs(h, row, keys, probs);
        }
    }

    /// The dropout mask's factors of query row `row`, head `h`, over `visible` keys from
    /// `keys`, in `buf` (`None` without dropout).
    fn factors<'b>(
        &self,
        h: usize,
        (row, keys, visible): (usize, usize, usize),
        buf: &'b mut Vec<f32>,
    ) -> Option<&'b [f32]> {
        let mask = self.dropout?;
        buf.clear();
        buf.resize(visible, 1.0);
        mask.scale_probs(h, row, keys, buf);
        Some(buf)
    }
}

/// `x ·= factors` element for element (over the factors' length).
fn times(x: &mut [f32], factors: &[f32]) {
    x.iter_mut().zip(factors).for_each(|(x, f)| *x *= f);
}

/// A row's `P` and `dS` ([`softmax_grad_row`]) under dropout `factors`: `dP ∘ M` before,
/// `P ∘ M` (for `dV`) after.
fn dropout_grad_row(
    p: &mut [f32],
    dp: &mut [f32],
    visible: usize,
    stats: (f32, f32),
    factors: Option<&[f32]>,
) {
    if let Some(f) = factors {
        times(dp, f);
    }
    softmax_grad_row(p, dp, visible, stats);
    if let Some(f) = factors {
        times(p, f);
    }
}

/// `o [T, qw]` and `lse [T, nh]` (both overwritten) of `softmax(scale·q·kᵀ + causal) · v`.
pub fn attention_fwd(q: &[f32], k: &[f32], v: &[f32], at: Layout, o: &mut [f32], lse: &mut [f32]) {
    let s = at.shape;
    let (d, qw, kw, nh) = (s.head_dim, at.qw(), at.kw(), s.heads);
    let per_group = nh / s.groups;
    assert!(
        q.len() == at.rows() * qw && k.len() == at.rows() * kw && v.len() == k.len(),
        "internal: attention shapes"
    );
    let out = SharedOut(o.as_mut_ptr());
    let lse_out = SharedOut(lse.as_mut_ptr());
    query_blocks(at, BLOCK)
        .into_par_iter()
        .for_each_init(Vec::new, |scores, (seg, h, t0)| {
            let rows = (seg.len() - t0).min(BLOCK);
            let seen = t0 + rows;
            let g = h / per_group;
            let q_at = (seg.start + t0) * qw + h * d;
            let kv_at = seg.start * kw + g * d;
            scores.clear();
            scores.resize(rows * seen, 0f32);
            // SAFETY: q rows seg.start + t0.. (rows of them) and k/v rows seg.start.. (seen ≤
            // seg.len() of them) lie inside the asserted shapes; this task alone writes o's block
            // (those rows, head h's d columns) and lse's (those rows, column h).
            unsafe {
                gemm_into(
                    scores.as_mut_ptr(),
                    seen,
                    (rows, seen, d),
                    Strided::rows(q, q_at, qw),
                    Strided::columns(k, kv_at, kw),
                    s.scale,
                    Store::Overwrite,
                );
                for (r, row) in scores.chunks_exact_mut(seen).enumerate() {
                    at.select(seg.start + t0 + r, seg.start, &mut row[..t0 + r + 1]);
                    let log_sum = softmax_lse(row, t0 + r + 1);
                    *lse_out.at((seg.start + t0 + r) * nh + h) = log_sum;
                    at.drop_probs(h, (seg.start + t0 + r, seg.start), &mut row[..t0 + r + 1]);
                }
                gemm_into(
                    out.at(q_at),
                    qw,
                    (rows, d, seen),
                    Strided::rows(scores, 0, seen),
                    Strided::rows(v, kv_at, kw),
                    1.0,
                    Store::Overwrite,
                );
            }
        });
}

/// Every (segment, head, first row) of blocks of `block` query rows.
fn query_blocks(at: Layout, block: usize) -> Vec<(Range<usize>, usize, usize)> {
    at.segments
        .iter()
        .flat_map(|seg| {
            (0..at.shape.heads).flat_map(move |h| {
                (0..seg.len().div_ceil(block)).map(move |b| (seg.clone(), h, b * block))
            })
        })
        .collect()
}

/// Every (segment, group): a backward task (it alone writes the group's `dk`, `dv` columns of
/// the segment's rows and its heads' `dq` columns).
fn group_tasks(at: Layout) -> Vec<(Range<usize>, usize)> {
    at.segments
        .iter()
        .flat_map(|seg| (0..at.shape.groups).map(move |g| (seg.clone(), g)))
        .collect()
}

/// A row's probabilities `P = e^(scores − lse)` and score gradients `dS = P ∘ (dP − D)`, in
/// place over its `visible` keys (the rest zeroed).
fn softmax_grad_row(p: &mut [f32], dp: &mut [f32], visible: usize, (lse, delta): (f32, f32)) {
    simd::exp_sub(&mut p[..visible], lse, 1.0);
    for (dp, &p) in dp[..visible].iter_mut().zip(&p[..visible]) {
        *dp = p * (*dp - delta);
    }
    p[visible..].fill(0.0);
    dp[visible..].fill(0.0);
}

/// `D [T, nh]`: per row and head `Σ dO ∘ O`, the softmax Jacobian's correction term, of
/// elements `widen` reads as f32.
fn deltas<E: Copy + Sync>(
    d_o: &[E],
    o: &[E],
    at: Layout,
    widen: impl Fn(E) -> f32 + Sync,
) -> Vec<f32> {
    let (d, qw, nh) = (at.shape.head_dim, at.qw(), at.shape.heads);
    let mut delta = vec![0f32; at.rows() * nh];
    delta
        .par_chunks_mut(nh)
        .zip(d_o.par_chunks(qw).zip(o.par_chunks(qw)))
        .for_each(|(dl, (gr, orow))| {
            for (h, dl) in dl.iter_mut().enumerate() {
                let span = h * d..(h + 1) * d;
                *dl = gr[span.clone()]
                    .iter()
                    .zip(&orow[span])
                    .map(|(&a, &b)| widen(a) * widen(b))
                    .sum();
            }
        });
    delta
}

/// Softmax of `row[..visible]` in place (the rest zeroed); returns its log-sum-exp.
fn softmax_lse(row: &mut [f32], visible: usize) -> f32 {
    let (seen, masked) = row.split_at_mut(visible);
    masked.fill(0.0);
    let max = simd::max(seen);
    let sum = simd::exp_sub(seen, max, 1.0);
    let inv = 1.0 / sum;
    seen.iter_mut().for_each(|x| *x *= inv);
    max + sum.ln()
}

/// The gradients of [`attention_fwd`]: `dq [T, qw]`, `dk`, `dv [T, kw]`, all overwritten.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd(
    d_o: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    lse: &[f32],
    at: Layout,
    (dq, dk, dv): (&mut [f32], &mut [f32], &mut [f32]),
) {
    let s = at.shape;
    let (d, qw, kw, nh) = (s.head_dim, at.qw(), at.kw(), s.heads);
    let per_group = nh / s.groups;
    let rows = at.rows();
    assert!(
        [q.len(), o.len(), d_o.len(), dq.len()]
            .iter()
            .all(|&n| n == rows * qw)
            && [k.len(), v.len(), dk.len(), dv.len()]
                .iter()
                .all(|&n| n == rows * kw)
            && lse.len() == rows * nh,
        "internal: attention gradient shapes"
    );
    let delta = deltas(d_o, o, at, |x| x);
    dk.fill(0.0);
    dv.fill(0.0);
    let (dq_out, dk_out, dv_out) = (
        SharedOut(dq.as_mut_ptr()),
        SharedOut(dk.as_mut_ptr()),
        SharedOut(dv.as_mut_ptr()),
    );
    group_tasks(at).into_par_iter().for_each_init(
        || (Vec::new(), Vec::new(), Vec::new()),
        |(p, dp, factors), (seg, g)| {
            let kv_at = seg.start * kw + g * d;
            for h in g * per_group..(g + 1) * per_group {
                for t0 in (0..seg.len()).step_by(BLOCK) {
                    let rows = (seg.len() - t0).min(BLOCK);
                    let seen = t0 + rows;
                    let q_at = (seg.start + t0) * qw + h * d;
                    p.clear();
                    p.resize(rows * seen, 0f32);
                    dp.clear();
                    dp.resize(rows * seen, 0f32);
                    // SAFETY: as in attention_fwd for q, k, v, dO; this task alone writes dq's
                    // block (these rows, head h — heads of group g belong to this task) and the
                    // group's dk/dv columns for this segment's rows.
                    unsafe {
                        gemm_into(
                            p.as_mut_ptr(),
                            seen,
                            (rows, seen, d),
                            Strided::rows(q, q_at, qw),
                            Strided::columns(k, kv_at, kw),
                            s.scale,
                            Store::Overwrite,
                        );
                        gemm_into(
                            dp.as_mut_ptr(),
                            seen,
                            (rows, seen, d),
                            Strided::rows(d_o, q_at, qw),
                            Strided::columns(v, kv_at, kw),
                            1.0,
                            Store::Overwrite,
                        );
                        for r in 0..rows {
                            let row = seg.start + t0 + r;
                            let stats = (lse[row * nh + h], delta[row * nh + h]);
                            let (pr, dpr) = (
                                &mut p[r * seen..(r + 1) * seen],
                                &mut dp[r * seen..(r + 1) * seen],
                            );
                            let visible = t0 + r + 1;
                            at.select(row, seg.start, &mut pr[..visible]);
                            let f = at.factors(h, (row, seg.start, visible), factors);
                            dropout_grad_row(pr, dpr, visible, stats, f);
                        }
                        // dq = scale · dS · K; dk += scale · dSᵀ · Q; dv += Pᵀ · dO.
                        gemm_into(
                            dq_out.at(q_at),
                            qw,
                            (rows, d, seen),
                            Strided::rows(dp, 0, seen),
                            Strided::rows(k, kv_at, kw),
                            s.scale,
                            Store::Overwrite,
                        );
                        gemm_into(
                            dk_out.at(kv_at),
                            kw,
                            (seen, d, rows),
                            Strided::columns(dp, 0, seen),
                            Strided::rows(q, q_at, qw),
                            s.scale,
                            Store::Accumulate,
                        );
                        gemm_into(
                            dv_out.at(kv_at),
                            kw,
                            (seen, d, rows),
                            Strided::columns(p, 0, seen),
                            Strided::rows(d_o, q_at, qw),
                            1.0,
                            Store::Accumulate,
                        );
                    }
                }
            }
        },
    );
}

/// Query rows per block of the bf16 products: few, large products, so that their
/// set-up costs little (the masked half of the diagonal block is computed and discarded).
const BF16_BLOCK: usize = 128;

/// The bf16 bits of one attention call's `q [T, qw]`, `k`, `v [T, kw]`.
#[derive(Clone, Copy)]
pub struct Bf16Qkv<'a> {
    pub q: &'a [u16],
    pub k: &'a [u16],
    pub v: &'a [u16],
}

/// Head (or group) `h`'s columns of `x [T, width]` from row `row` as a product operand:
/// `[rows, d]` (`Rows`) or its transpose (`Transposed`).
fn head_operand(
    x: &[u16],
    (row, width): (usize, usize),
    h: usize,
    d: usize,
    layout: gemm::Layout,
) -> Operand<'_> {
    Operand {
        bits: &x[row * width + h * d..],
        layout,
        pitch: Some(width),
    }
}

/// `out = / += a · b` for `a [m, k]`, `b [k, n]` into contiguous f32 rows.
fn product(a: Operand, b: Operand, shape: (usize, usize, usize), out: &mut [f32], store: Store) {
    let dst = bf16_gemm::Dst::F32 {
        out,
        stride: shape.2,
        store,
        transposed: false,
    };
    bf16_gemm::matmul(a, b, shape, dst);
}

/// Rounded to bf16 into `bits` (resized to match).
fn narrowed(values: &[f32], bits: &mut Vec<u16>) {
    bits.resize(values.len(), 0);
    narrow_bf16(values, bits);
}

/// [`attention_fwd`] of bf16 `q`, `k`, `v` with its bf16 products (`bf16_gemm`): scores summed in
/// f32, softmax in f32, the probabilities rounded to bf16 for `P·V` (as FlashAttention's bf16
/// kernels and Megatron's unfused bf16 attention do). Call only where [`bf16_gemm::available`].
pub fn attention_fwd_bf16(x: Bf16Qkv, at: Layout, o: &mut [f32], lse: &mut [f32]) {
    let s = at.shape;
    let (d, qw, kw, nh) = (s.head_dim, at.qw(), at.kw(), s.heads);
    let (n, per_group) = (at.rows(), nh / s.groups);
    assert!(
        x.q.len() == n * qw && x.k.len() == n * kw && x.v.len() == n * kw,
        "internal: attention shapes"
    );
    assert!(
        o.len() == n * qw && lse.len() == n * nh,
        "internal: attention outputs"
    );
    let (out, lse_out) = (SharedOut(o.as_mut_ptr()), SharedOut(lse.as_mut_ptr()));
    query_blocks(at, BF16_BLOCK).into_par_iter().for_each_init(
        || (Vec::new(), Vec::new(), Vec::new()),
        |(scores, probs, block_o), (seg, h, t0)| {
            let (rows, g, row) = (
                (seg.len() - t0).min(BF16_BLOCK),
                h / per_group,
                seg.start + t0,
            );
            let seen = t0 + rows;
            let q = head_operand(x.q, (row, qw), h, d, gemm::Layout::Rows);
            let k_t = head_operand(x.k, (seg.start, kw), g, d, gemm::Layout::Transposed);
            scores.resize(rows * seen, 0.0);
            product(q, k_t, (rows, d, seen), scores, Store::Overwrite);
            for (r, sc) in scores.chunks_exact_mut(seen).enumerate() {
                let visible = t0 + r + 1;
                sc[..visible].iter_mut().for_each(|v| *v *= s.scale);
                at.select(row + r, seg.start, &mut sc[..visible]);
                let log_sum = softmax_lse(sc, visible);
                // SAFETY: row + r < T; this task alone writes lse's (rows of the block, h).
                unsafe { *lse_out.at((row + r) * nh + h) = log_sum };
                at.drop_probs(h, (row + r, seg.start), &mut sc[..visible]);
            }
            narrowed(scores, probs);
            block_o.resize(rows * d, 0.0);
            let v = head_operand(x.v, (seg.start, kw), g, d, gemm::Layout::Rows);
            product(
                bf16_gemm::Operand::rows(probs),
                v,
                (rows, seen, d),
                block_o,
                Store::Overwrite,
            );
            for (r, values) in block_o.chunks_exact(d).enumerate() {
                // SAFETY: row + r < T, columns h·d.. + d < qw; this task alone writes them.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        values.as_ptr(),
                        out.at((row + r) * qw + h * d),
                        d,
                    )
                };
            }
        },
    );
}

/// [`attention_bwd`] of bf16 operands with its bf16 products (`bf16_gemm`; probabilities and
/// score gradients rounded to bf16 for the products, as FlashAttention's bf16 backward does;
/// softmax and sums in f32). Call only where [`bf16_gemm::available`].
pub fn attention_bwd_bf16(
    (d_o, o): (&[u16], &[u16]),
    x: Bf16Qkv,
    lse: &[f32],
    at: Layout,
    (dq, dk, dv): (&mut [f32], &mut [f32], &mut [f32]),
) {
    let s = at.shape;
    let (d, qw, kw, nh) = (s.head_dim, at.qw(), at.kw(), s.heads);
    let (n, per_group) = (at.rows(), nh / s.groups);
    assert!(
        [x.q.len(), o.len(), d_o.len(), dq.len()]
            .iter()
            .all(|&l| l == n * qw)
            && [x.k.len(), x.v.len(), dk.len(), dv.len()]
                .iter()
                .all(|&l| l == n * kw)
            && lse.len() == n * nh,
        "internal: attention gradient shapes"
    );
    let delta = deltas(d_o, o, at, bf16_to_f32);
    let (dq_out, dk_out, dv_out) = (
        SharedOut(dq.as_mut_ptr()),
        SharedOut(dk.as_mut_ptr()),
        SharedOut(dv.as_mut_ptr()),
    );
    group_tasks(at).into_par_iter().for_each(|(seg, g)| {
        let (mut p, mut dp, mut block_dq) = (Vec::new(), Vec::new(), Vec::new());
        let (mut p_bits, mut ds_bits, mut factors) = (Vec::new(), Vec::new(), Vec::new());
        let (mut dk_g, mut dv_g) = (vec![0f32; seg.len() * d], vec![0f32; seg.len() * d]);
        let group = |x, layout| head_operand(x, (seg.start, kw), g, d, layout);
        for h in g * per_group..(g + 1) * per_group {
            for t0 in (0..seg.len()).step_by(BF16_BLOCK) {
                let (rows, row) = ((seg.len() - t0).min(BF16_BLOCK), seg.start + t0);
                let seen = t0 + rows;
                let q = head_operand(x.q, (row, qw), h, d, gemm::Layout::Rows);
                let grad = head_operand(d_o, (row, qw), h, d, gemm::Layout::Rows);
                p.resize(rows * seen, 0.0);
                dp.resize(rows * seen, 0.0);
                let shape = (rows, d, seen);
                product(
                    q,
                    group(x.k, gemm::Layout::Transposed),
                    shape,
                    &mut p,
                    Store::Overwrite,
                );
                product(
                    grad,
                    group(x.v, gemm::Layout::Transposed),
                    shape,
                    &mut dp,
                    Store::Overwrite,
                );
                for (r, (pr, dpr)) in p
                    .chunks_exact_mut(seen)
                    .zip(dp.chunks_exact_mut(seen))
                    .enumerate()
                {
                    let stats = (lse[(row + r) * nh + h], delta[(row + r) * nh + h]);
                    let visible = t0 + r + 1;
                    pr[..visible].iter_mut().for_each(|v| *v *= s.scale);
                    at.select(row + r, seg.start, &mut pr[..visible]);
                    let f = at.factors(h, (row + r, seg.start, visible), &mut factors);
                    dropout_grad_row(pr, dpr, visible, stats, f);
                }
                narrowed(&p, &mut p_bits);
                narrowed(&dp, &mut ds_bits);
                // dq = scale · dS · K; dk += dSᵀ · Q and dv += Pᵀ · dO (dk scaled at the end).
                block_dq.resize(rows * d, 0.0);
                let ds = bf16_gemm::Operand::rows(&ds_bits);
                product(
                    ds,
                    group(x.k, gemm::Layout::Rows),
                    (rows, seen, d),
                    &mut block_dq,
                    Store::Overwrite,
                );
                for (r, values) in block_dq.chunks_exact(d).enumerate() {
                    // SAFETY: row + r < T, head h of group g: this task alone writes it.
                    let dst = unsafe { dq_out.slice((row + r) * qw + h * d, d) };
                    dst.iter_mut()
                        .zip(values)
                        .for_each(|(o, &v)| *o = v * s.scale);
                }
                let (ds_t, p_t) = (
                    bf16_gemm::Operand::transposed(&ds_bits),
                    bf16_gemm::Operand::transposed(&p_bits),
                );
                product(
                    ds_t,
                    q,
                    (seen, rows, d),
                    &mut dk_g[..seen * d],
                    Store::Accumulate,
                );
                product(
                    p_t,
                    grad,
                    (seen, rows, d),
                    &mut dv_g[..seen * d],
                    Store::Accumulate,
                );
            }
        }
        for (r, (dk_row, dv_row)) in dk_g.chunks_exact(d).zip(dv_g.chunks_exact(d)).enumerate() {
            let at = (seg.start + r) * kw + g * d;
            // SAFETY: the segment's rows, group g's columns: this task's alone.
            let (dk_dst, dv_dst) = unsafe { (dk_out.slice(at, d), dv_out.slice(at, d)) };
            dk_dst
                .iter_mut()
                .zip(dk_row)
                .for_each(|(o, &v)| *o = v * s.scale);
            dv_dst.copy_from_slice(dv_row);
        }
    });
}

/// Inference attention over a KV cache `[slots, capacity, kw]`: each segment's new query rows
/// (segment after segment in `q`) attend causally to positions `0..=past + i` of their slot.
/// Returns `o [rows, qw]`.
pub fn cached_attention_fwd(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    (capacity, kw): (usize, usize),
    segments: &[Segment],
    s: AttentionShape,
) -> Vec<f32> {
    let (d, qw) = (s.head_dim, s.heads * s.head_dim);
    let per_group = s.heads / s.groups;
    let mut starts = Vec::with_capacity(segments.len());
    let mut row = 0;
    for seg in segments {
        starts.push(row);
        row += seg.len;
    }
    let mut out = vec![0f32; row * qw];
    let shared = SharedOut(out.as_mut_ptr());
    let tasks: Vec<(usize, usize, usize)> = segments
        .iter()
        .enumerate()
        .flat_map(|(i, seg)| {
            (0..s.heads)
                .flat_map(move |h| (0..seg.len.div_ceil(BLOCK)).map(move |b| (i, h, b * BLOCK)))
        })
        .collect();
    tasks
        .par_iter()
        .for_each_init(Vec::new, |scores, &(i, h, t0)| {
            let seg = segments[i];
            let rows = (seg.len - t0).min(BLOCK);
            // Keys the block's last query sees; earlier queries mask the tail off.
            let seen = seg.past + t0 + rows;
            let kv = seg.slot * capacity * kw + (h / per_group) * d;
            let at = (starts[i] + t0) * qw + h * d;
            scores.clear();
            scores.resize(rows * seen, 0f32);
            // SAFETY: the caller checked that q holds the segments' rows and that each
            // segment's `past + len` fits its slot of the cache; scores is rows × seen. The
            // output block (rows of this segment, columns h·d..(h+1)·d) belongs to this
            // (segment, head, block) task only.
            unsafe {
                gemm_into(
                    scores.as_mut_ptr(),
                    seen,
                    (rows, seen, d),
                    Strided::rows(q, at, qw),
                    Strided::columns(keys, kv, kw),
                    1.0,
                    Store::Overwrite,
                );
                for (r, row) in scores.chunks_exact_mut(seen).enumerate() {
                    let (visible, masked) = row.split_at_mut(seg.past + t0 + r + 1);
                    softmax(visible, s.scale);
                    masked.fill(0.0);
                }
                gemm_into(
                    shared.at(at),
                    qw,
                    (rows, d, seen),
                    Strided::rows(scores, 0, seen),
                    Strided::rows(values, kv, kw),
                    1.0,
                    Store::Overwrite,
                );
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testing::{check_grad, seeded};

    fn shape() -> AttentionShape {
        AttentionShape {
            heads: 4,
            groups: 2,
            head_dim: 3,
            scale: 1.0 / 3f32.sqrt(),
        }
    }

    /// The definition: every row against the visible rows of its segment (those selected,
    /// with a selection), in f64, each probability times its dropout factor.
    fn naive(
        (q, k, v): (&[f32], &[f32], &[f32]),
        segments: &[Range<usize>],
        dropout: Option<&Mask>,
        selection: Option<&Selection>,
    ) -> Vec<f64> {
        let s = shape();
        let (d, qw, kw) = (s.head_dim, s.heads * s.head_dim, s.groups * s.head_dim);
        let rows = segments.last().unwrap().end;
        let mut o = vec![0f64; rows * qw];
        for seg in segments {
            for i in seg.clone() {
                for h in 0..s.heads {
                    let g = h / (s.heads / s.groups);
                    let score = |j: usize| -> f64 {
                        (0..d)
                            .map(|c| (q[i * qw + h * d + c] * k[j * kw + g * d + c]) as f64)
                            .sum::<f64>()
                            * s.scale as f64
                    };
                    let chosen =
                        |j: &usize| selection.is_none_or(|s| s.keys_of(i).any(|k| k == *j));
                    let keys: Vec<usize> = (seg.start..=i).filter(chosen).collect();
                    let mut factors = vec![1f32; i + 1 - seg.start];
                    if let Some(m) = dropout {
                        m.scale_probs(h, i, seg.start, &mut factors);
                    }
                    let max = keys.iter().map(|&j| score(j)).fold(f64::MIN, f64::max);
                    let z: f64 = keys.iter().map(|&j| (score(j) - max).exp()).sum();
                    for &j in &keys {
                        let p = (score(j) - max).exp() / z * f64::from(factors[j - seg.start]);
                        for c in 0..d {
                            o[i * qw + h * d + c] += p * v[j * kw + g * d + c] as f64;
                        }
                    }
                }
            }
        }
        o
    }

    #[test]
    fn forward_matches_the_definition_and_backward_finite_differences() {
        use crate::engine::dropout::{Rate, RowAt, Site};
        let s = shape();
        // Two sequences; the second split in two documents; one longer than a block.
        let segments = [0..70, 70..75, 75..80];
        let rows = 80;
        let (qw, kw) = (s.heads * s.head_dim, s.groups * s.head_dim);
        let q = seeded(rows * qw, 1);
        let k = seeded(rows * kw, 2);
        let v = seeded(rows * kw, 3);
        // Without dropout, and through a fixed attention-dropout mask (the backward pass draws
        // it again): rows 0..70 one sample, 70..80 another.
        let places: Vec<RowAt> = (0..rows)
            .map(|r| RowAt {
                sample: u64::from(r >= 70),
                position: (r % 70) as u32,
            })
            .collect();
        let mask = Mask {
            seed: 3,
            rate: Rate::new(0.25).unwrap(),
            layer: 1,
            site: Site::AttentionProbs,
            rows: &places,
            first_head: 0,
        };
        // DeepSeek sparse attention's selection: three keys per row, drawn from the row's
        // segment up to it (its first key always), one of them −1, a later row or another
        // segment's row at times (ignored).
        let picks = seeded(rows * 3, 5);
        let keys = (0..rows)
            .flat_map(|i| {
                let seg = segments.iter().find(|s| s.contains(&i)).unwrap();
                let pick = |at: usize| (picks[i * 3 + at].abs() * 997.0) as usize;
                let any = (pick(1) % rows) as i32;
                let seen = (seg.start + pick(2) % (i + 1 - seg.start)) as i32;
                [
                    seg.start as i32,
                    if pick(0) % 2 == 0 { -1 } else { any },
                    seen,
                ]
            })
            .collect();
        let selection = Selection::new(keys, 3);
        let cases = [
            (None, None),
            (Some(&mask), None),
            (Some(&mask), Some(&selection)),
        ];
        for (dropout, selection) in cases {
            let at = Layout {
                shape: s,
                segments: &segments,
                dropout,
                selection,
            };
            let (mut o, mut lse) = (vec![0.0; rows * qw], vec![0.0; rows * s.heads]);
            attention_fwd(&q, &k, &v, at, &mut o, &mut lse);
            let want = naive((&q, &k, &v), &segments, dropout, selection);
            for (i, (a, b)) in o.iter().zip(&want).enumerate() {
                assert!((*a as f64 - b).abs() < 1e-5, "o[{i}] {a} vs {b}");
            }
            let d_o = seeded(rows * qw, 4);
            let loss = |q: &[f32], k: &[f32], v: &[f32]| {
                let (mut o, mut lse) = (vec![0.0; rows * qw], vec![0.0; rows * s.heads]);
                attention_fwd(q, k, v, at, &mut o, &mut lse);
                o.iter().zip(&d_o).map(|(a, b)| (a * b) as f64).sum::<f64>()
            };
            let (mut dq, mut dk, mut dv) = (
                vec![0.0; rows * qw],
                vec![0.0; rows * kw],
                vec![0.0; rows * kw],
            );
            attention_bwd(&d_o, &q, &k, &v, &o, &lse, at, (&mut dq, &mut dk, &mut dv));
            check_grad("dq", &q, &dq, |x| loss(x, &k, &v));
            check_grad("dk", &k, &dk, |x| loss(&q, x, &v));
            check_grad("dv", &v, &dv, |x| loss(&q, &k, x));
        }
    }

    /// bf16 bits of `v` and the f32 values they hold.
    fn rounded(v: &[f32]) -> (Vec<u16>, Vec<f32>) {
        let mut bits = vec![0u16; v.len()];
        narrow_bf16(v, &mut bits);
        let values = bits.iter().copied().map(bf16_to_f32).collect();
        (bits, values)
    }

    /// `|a − b| ≤ tol · max |b|` element for element.
    fn close(name: &str, a: &[f32], b: &[f32], tol: f32) {
        let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= tol * scale,
                "{name}[{i}]: {x} vs {y} (of {scale})"
            );
        }
    }

    #[test]
    fn bf16_attention_on_bf16_products_matches_the_f32_kernels_within_bf16_rounding() {
        if !bf16_gemm::available() {
            eprintln!("skipped: neither AMX nor AVX512_BF16 on this CPU");
            return;
        }
        let s = AttentionShape {
            heads: 4,
            groups: 2,
            head_dim: 40,
            scale: 1.0 / 40f32.sqrt(),
        };
        // A sequence longer than one block of BF16_BLOCK rows, then two short documents.
        let segments = [0..300, 300..310, 310..320];
        let rows = 320;
        let (qw, kw) = (s.heads * s.head_dim, s.groups * s.head_dim);
        let scaled = |v: Vec<f32>| v.iter().map(|x| 3.0 * x).collect::<Vec<_>>();
        let (qb, q) = rounded(&scaled(seeded(rows * qw, 1)));
        let (kb, k) = rounded(&scaled(seeded(rows * kw, 2)));
        let (vb, v) = rounded(&seeded(rows * kw, 3));
        let at = Layout {
            shape: s,
            segments: &segments,
            dropout: None,
            selection: None,
        };
        let x = Bf16Qkv {
            q: &qb,
            k: &kb,
            v: &vb,
        };
        let (mut o_ref, mut lse_ref) = (vec![0.0; rows * qw], vec![0.0; rows * s.heads]);
        attention_fwd(&q, &k, &v, at, &mut o_ref, &mut lse_ref);
        let (mut o, mut lse) = (vec![0.0; rows * qw], vec![0.0; rows * s.heads]);
        attention_fwd_bf16(x, at, &mut o, &mut lse);
        close("lse", &lse, &lse_ref, 1e-5);
        close("o", &o, &o_ref, 1e-2);

        let (ob, o) = rounded(&o);
        let (gb, d_o) = rounded(&seeded(rows * qw, 4));
        let zeros = |n| vec![0.0; n];
        let mut want = (zeros(rows * qw), zeros(rows * kw), zeros(rows * kw));
        let grads = (&mut want.0[..], &mut want.1[..], &mut want.2[..]);
        attention_bwd(&d_o, &q, &k, &v, &o, &lse, at, grads);
        let mut got = (zeros(rows * qw), zeros(rows * kw), zeros(rows * kw));
        attention_bwd_bf16(
            (&gb, &ob),
            x,
            &lse,
            at,
            (&mut got.0, &mut got.1, &mut got.2),
        );
        close("dq", &got.0, &want.0, 2e-2);
        close("dk", &got.1, &want.1, 2e-2);
        close("dv", &got.2, &want.2, 2e-2);
    }
}
