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

use super::gemm::{gemm_into, Store, Strided};
use crate::engine::simd::{self, softmax};
use crate::engine::{AttentionShape, Segment, SharedOut};
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
    let tasks: Vec<(Range<usize>, usize, usize)> = at
        .segments
        .iter()
        .flat_map(|seg| {
            (0..nh).flat_map(move |h| {
                (0..seg.len().div_ceil(BLOCK)).map(move |b| (seg.clone(), h, b * BLOCK))
            })
        })
        .collect();
    tasks
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
                    let log_sum = softmax_lse(row, t0 + r + 1);
                    *lse_out.at((seg.start + t0 + r) * nh + h) = log_sum;
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
    // D = rowsum(dO ∘ O) per (row, head): the softmax Jacobian's correction term.
    let mut delta = vec![0f32; rows * nh];
    delta
        .par_chunks_mut(nh)
        .zip(d_o.par_chunks(qw).zip(o.par_chunks(qw)))
        .for_each(|(dl, (gr, orow))| {
            for (h, dl) in dl.iter_mut().enumerate() {
                let span = h * d..(h + 1) * d;
                *dl = gr[span.clone()]
                    .iter()
                    .zip(&orow[span])
                    .map(|(a, b)| a * b)
                    .sum();
            }
        });
    dk.fill(0.0);
    dv.fill(0.0);
    let (dq_out, dk_out, dv_out) = (
        SharedOut(dq.as_mut_ptr()),
        SharedOut(dk.as_mut_ptr()),
        SharedOut(dv.as_mut_ptr()),
    );
    let tasks: Vec<(Range<usize>, usize)> = at
        .segments
        .iter()
        .flat_map(|seg| (0..s.groups).map(move |g| (seg.clone(), g)))
        .collect();
    tasks.into_par_iter().for_each_init(
        || (Vec::new(), Vec::new()),
        |(p, dp), (seg, g)| {
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
                            let (l, dl) = (lse[row * nh + h], delta[row * nh + h]);
                            let visible = t0 + r + 1;
                            let (pr, dpr) = (
                                &mut p[r * seen..(r + 1) * seen],
                                &mut dp[r * seen..(r + 1) * seen],
                            );
                            simd::exp_sub(&mut pr[..visible], l, 1.0);
                            for (dp, &p) in dpr[..visible].iter_mut().zip(&pr[..visible]) {
                                *dp = p * (*dp - dl);
                            }
                            pr[visible..].fill(0.0);
                            dpr[visible..].fill(0.0);
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

    /// The definition: every row against the visible rows of its segment, in f64.
    fn naive(q: &[f32], k: &[f32], v: &[f32], segments: &[Range<usize>]) -> Vec<f64> {
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
                    let keys: Vec<usize> = (seg.start..=i).collect();
                    let max = keys.iter().map(|&j| score(j)).fold(f64::MIN, f64::max);
                    let z: f64 = keys.iter().map(|&j| (score(j) - max).exp()).sum();
                    for &j in &keys {
                        let p = (score(j) - max).exp() / z;
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
        let s = shape();
        // Two sequences; the second split in two documents; one longer than a block.
        let segments = [0..70, 70..75, 75..80];
        let rows = 80;
        let (qw, kw) = (s.heads * s.head_dim, s.groups * s.head_dim);
        let q = seeded(rows * qw, 1);
        let k = seeded(rows * kw, 2);
        let v = seeded(rows * kw, 3);
        let at = Layout {
            shape: s,
            segments: &segments,
        };
        let (mut o, mut lse) = (vec![0.0; rows * qw], vec![0.0; rows * s.heads]);
        attention_fwd(&q, &k, &v, at, &mut o, &mut lse);
        let want = naive(&q, &k, &v, &segments);
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
