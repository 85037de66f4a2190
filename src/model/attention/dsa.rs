//! DeepSeek sparse attention's lightning indexer ([`crate::arch::Dsa`]; MindSpeed-LLM's
//! mindspeed_llm/tasks/models/transformer/dsa_indexer.py `DSAIndexer`, its
//! multi_latent_attention.py): which keys each query of a multi-latent attention attends to,
//! and the indexer's own loss.
//!
//! The indexer's queries `q [n, H·d]` (`wq_b` of the query latent), keys `k [n, d]`
//! (`k_norm(wk(x))`) and head weights `w [n, H]` (`weights_proj(x)·H^-½·d^-½`) come from
//! detached inputs; RoPE turns the first `dr` dimensions of each. A query row `t` scores the
//! keys it sees `I(t, s) = Σ_j w_tj·relu(q_tj·k_s)` and selects its `topk` best (in f32 on the
//! host, as MindSpeed-LLM's `bf16_index` sums in f32).
//!
//! The loss (its `npu_sparse_lightning_indexer_grad_kl_loss`, documented as
//! `Σ_t KL(p_t ‖ softmax(I_t))` over the selected keys): `p_t` the main attention's
//! probabilities of the selected keys summed over the heads and normalised, both sides
//! clamped at 1e-8, summed over the rows, divided by the rows, times `--indexer-loss-coeff`.
//! Its gradient `dI = softmax(I)·Σp − p` reaches the indexer's weights only, scaled as the main
//! loss's backward is (`DSAIndexerLossAutoScaler`).
//!
//! Legend: n = rows of the pass, H = the indexer's heads, d = its head dimension, dr = the
//! rotated dimensions, K = keys selected per row.

use super::rotate;
use crate::arch::roles::{Canon, Role};
use crate::engine::{Backend, EngineError, Result, Selection};
use crate::model::columns::{assemble, cols};
use crate::model::linear::Linear;
use crate::model::norm::{Norm, NormSaved};
use crate::model::params::ParamTable;
use crate::model::Pass;
use rayon::prelude::*;
use std::ops::Range;

/// The eps of the indexer key's LayerNorm (dsa_indexer.py `LayerNorm`).
const KEY_NORM_EPS: f64 = 1e-6;

/// The clamp of both distributions in the loss.
const LOSS_EPS: f32 = 1e-8;

/// One layer's lightning indexer.
#[derive(Debug, Clone, Copy)]
pub(super) struct Indexer {
    /// `wq_b` `[H·d, q_lora]`.
    q_up: Linear,
    /// `wk` `[d, h]`.
    key: Linear,
    /// `k_norm` (a LayerNorm, γ and β `[d]`).
    key_norm: Norm,
    /// `weights_proj` `[H, h]`.
    weights: Linear,
}

/// What the indexer's backward pass needs of its forward pass.
pub(super) struct IndexerSaved<T> {
    /// The detached inputs: the hidden state `[n, h]` and the query latent `[n, q_lora]`.
    x: T,
    qr: T,
    /// `wk`'s output and the key norm's statistics.
    key_norm: NormSaved<T>,
    /// On the host: the rotated queries `[n, H·d]` and keys `[n, d]`, the scaled head weights
    /// `[n, H]`.
    q: Vec<f32>,
    k: Vec<f32>,
    w: Vec<f32>,
}

/// An indexer's selection, its selected keys' scores `[n, K]` (0 where none), and what its
/// backward pass needs.
pub(super) type Indexed<T> = (Selection, Vec<f32>, IndexerSaved<T>);

impl Indexer {
    /// Layer `layer`'s indexer in `table`, `None` if the layer has none.
    pub(super) fn of(table: &ParamTable, layer: usize) -> Option<Indexer> {
        let at = Some(layer);
        let linear = |role| Linear::of(table, (role, None), at);
        table.index(Canon {
            role: Role::IndexerKeyNorm,
            layer: at,
        })?;
        Some(Indexer {
            q_up: linear(Role::IndexerQUp)?,
            key: linear(Role::IndexerKey)?,
            key_norm: Norm::of(table, Role::IndexerKeyNorm, at)?,
            weights: linear(Role::IndexerWeights)?,
        })
    }

    /// The selection of the rows of `x [n, h]` (every row) with query latent `qr [n, q_lora]`
    /// within `segments`, each row's `topk` best keys.
    pub(super) fn select<B: Backend>(
        &self,
        p: &Pass<B>,
        (x, qr): (B::Tensor, B::Tensor),
        segments: &[Range<usize>],
        dr: usize,
    ) -> Result<Indexed<B::Tensor>> {
        let b = p.b;
        let dsa = dsa_of(p)?;
        let (heads, dim) = (dsa.heads, dsa.head_dim);
        let (mut q, _) = self.q_up.forward(p, &qr)?;
        let (k_raw, _) = self.key.forward(p, &x)?;
        let (mut k, key_norm) = self.key_norm.forward_eps(p, k_raw, KEY_NORM_EPS)?;
        rope_first(p, &mut q, (heads, dim, dr), false)?;
        rope_first(p, &mut k, (1, dim, dr), false)?;
        let (w, _) = self.weights.forward(p, &x)?;
        let factor = ((heads * dim) as f64).sqrt().recip() as f32;
        let (q, k) = (b.download_f32(&q)?, b.download_f32(&k)?);
        let w: Vec<f32> = (b.download_f32(&w)?.iter()).map(|v| v * factor).collect();
        let host = (&q[..], &k[..], &w[..]);
        let (selection, scores) = top_keys(host, segments, (heads, dim), dsa.topk);
        let saved = IndexerSaved {
            x,
            qr,
            key_norm,
            q,
            k,
            w,
        };
        Ok((selection, scores, saved))
    }

    /// Accumulates the indexer's weights' gradients given `d_scores [n, K]`, the loss's
    /// gradient with respect to the selected keys' scores.
    pub(super) fn backward<B: Backend>(
        &self,
        p: &Pass<B>,
        grads: &mut [B::Tensor],
        (s, selection, d_scores): (&IndexerSaved<B::Tensor>, &Selection, &[f32]),
        dr: usize,
    ) -> Result<()> {
        let b = p.b;
        let dsa = dsa_of(p)?;
        let (heads, dim) = (dsa.heads, dsa.head_dim);
        let n = selection.rows();
        let (dq, dk, dw) = score_grads((&s.q, &s.k, &s.w), selection, d_scores, (heads, dim));
        let factor = ((heads * dim) as f64).sqrt().recip() as f32;
        let dw: Vec<f32> = dw.iter().map(|v| v * factor).collect();
        let dtype = b.dtype(&s.x);
        let upload = |v: &[f32], w: usize| -> Result<B::Tensor> {
            let t = b.upload_f32(&[n, w], v)?;
            b.cast(&t, dtype)
        };
        let mut dq = upload(&dq, heads * dim)?;
        rope_first(p, &mut dq, (heads, dim, dr), true)?;
        self.q_up.backward(p, grads, &dq, (&s.qr, None))?;
        let mut dk = upload(&dk, dim)?;
        rope_first(p, &mut dk, (1, dim, dr), true)?;
        let dk_raw = self.key_norm.backward(p, grads, &dk, &s.key_norm)?;
        self.key.backward(p, grads, &dk_raw, (&s.x, None))?;
        self.weights
            .backward(p, grads, &upload(&dw, heads)?, (&s.x, None))?;
        Ok(())
    }
}

/// The model's sparse attention.
fn dsa_of<B: Backend>(p: &Pass<B>) -> Result<crate::arch::Dsa> {
    p.spec
        .mla
        .and_then(|m| m.dsa)
        .ok_or_else(|| EngineError::Invalid {
            op: "DeepSeek sparse attention",
            msg: "the model has no indexer shape".into(),
        })
}

/// RoPE on the first `dr` of the `d` dimensions of each of `heads` heads of `x [n, heads·d]`
/// (`inverse`: its backward), on the halves `(i, i + dr/2)` or, with
/// [`crate::arch::Dsa::rope_pairs_adjacent`], on neighbouring pairs (de-interleaved first, as
/// multi-latent attention's own rotated parts; the indexer's dot products do not see the order).
fn rope_first<B: Backend>(
    p: &Pass<B>,
    x: &mut B::Tensor,
    (heads, d, dr): (usize, usize, usize),
    inverse: bool,
) -> Result<()> {
    let b = p.b;
    if !dsa_of(p)?.rope_pairs_adjacent {
        return b.rope(x, p.rope.0, p.rope.1, d, inverse);
    }
    let n = b.shape(x)[0];
    let part = |at, w| b.gather(x, cols(n, heads * d, (heads, d), at, w), &[n, heads * w]);
    let mut rotated = part(0, dr)?;
    rotate(p, &mut rotated, heads, inverse)?;
    let rest = part(dr, d - dr)?;
    *x = assemble(b, n, heads, d, &[(&rotated, dr, 0), (&rest, d - dr, dr)])?;
    Ok(())
}

/// The rows' scores `I(t, s)` of the keys `s` each sees and its `topk` best (the higher
/// first, the earlier key first among equals; −1 past the keys it sees), with their scores.
fn top_keys(
    (q, k, w): (&[f32], &[f32], &[f32]),
    segments: &[Range<usize>],
    (heads, d): (usize, usize),
    topk: usize,
) -> (Selection, Vec<f32>) {
    let n = segments.last().map_or(0, |s| s.end);
    let rows: Vec<(usize, usize)> = (segments.iter())
        .flat_map(|s| s.clone().map(move |t| (t, s.start)))
        .collect();
    let picked: Vec<(Vec<i32>, Vec<f32>)> = rows
        .par_iter()
        .map(|&(t, start)| {
            let mut scored: Vec<(f32, usize)> = (start..=t)
                .map(|s| (score((q, k, w), (t, s), (heads, d)), s))
                .collect();
            scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            scored.truncate(topk);
            let mut keys: Vec<i32> = scored.iter().map(|&(_, s)| s as i32).collect();
            let mut values: Vec<f32> = scored.iter().map(|&(v, _)| v).collect();
            keys.resize(topk, -1);
            values.resize(topk, 0.0);
            (keys, values)
        })
        .collect();
    debug_assert_eq!(picked.len(), n);
    let (keys, scores): (Vec<Vec<i32>>, Vec<Vec<f32>>) = picked.into_iter().unzip();
    (Selection::new(keys.concat(), topk), scores.concat())
}

/// `I(t, s) = Σ_j w_tj·relu(q_tj·k_s)`.
fn score(
    (q, k, w): (&[f32], &[f32], &[f32]),
    (t, s): (usize, usize),
    (heads, d): (usize, usize),
) -> f32 {
    let key = &k[s * d..][..d];
    (0..heads)
        .map(|j| {
            let query = &q[(t * heads + j) * d..][..d];
            let dot: f32 = query.iter().zip(key).map(|(a, b)| a * b).sum();
            w[t * heads + j] * dot.max(0.0)
        })
        .sum()
}

/// The gradients `(dq [n, H·d], dk [n, d], dw [n, H])` of the selected keys' scores given
/// theirs, `d_scores [n, K]`.
fn score_grads(
    (q, k, w): (&[f32], &[f32], &[f32]),
    selection: &Selection,
    d_scores: &[f32],
    (heads, d): (usize, usize),
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let n = selection.rows();
    let per_row = selection.per_row();
    let (mut dq, mut dk, mut dw) = (
        vec![0f32; n * heads * d],
        vec![0f32; n * d],
        vec![0f32; n * heads],
    );
    for t in 0..n {
        let chosen = &selection.keys()[t * per_row..][..per_row];
        for (&s, &g) in chosen.iter().zip(&d_scores[t * per_row..][..per_row]) {
            let Ok(s) = usize::try_from(s) else { continue };
            for j in 0..heads {
                let at = (t * heads + j) * d;
                let dot: f32 = (q[at..at + d].iter())
                    .zip(&k[s * d..][..d])
                    .map(|(a, b)| a * b)
                    .sum();
                if dot <= 0.0 {
                    continue;
                }
                dw[t * heads + j] += g * dot;
                let dz = g * w[t * heads + j];
                for c in 0..d {
                    dq[at + c] += dz * k[s * d + c];
                    dk[s * d + c] += dz * q[at + c];
                }
            }
        }
    }
    (dq, dk, dw)
}

/// The indexer loss of the rows' selections (its value, the coefficient included) and its
/// gradient with respect to the selected keys' scores `[n, K]`, of the main attention's
/// probabilities `probs [n, K]` (summed over the heads, 0 where no key) and the indexer's
/// `scores [n, K]`, `scale` times (the main loss's backward scale).
pub(super) fn indexer_loss(
    selection: &Selection,
    (probs, scores): (&[f32], &[f32]),
    (coeff, scale): (f32, f32),
) -> (f32, Vec<f32>) {
    let (n, per_row) = (selection.rows(), selection.per_row());
    let mut total = 0f64;
    let mut grads = vec![0f32; n * per_row];
    for t in 0..n {
        let at = t * per_row..(t + 1) * per_row;
        let valid: Vec<bool> = selection.keys()[at.clone()]
            .iter()
            .map(|&s| s >= 0)
            .collect();
        let count = valid.iter().filter(|&&v| v).count();
        let (p_row, i_row) = (&probs[at.clone()], &scores[at.clone()]);
        let mass: f32 = p_row
            .iter()
            .zip(&valid)
            .filter(|(_, &v)| v)
            .map(|(p, _)| p)
            .sum();
        let max = (i_row
            .iter()
            .zip(&valid)
            .filter(|(_, &v)| v)
            .map(|(x, _)| *x))
        .fold(f32::NEG_INFINITY, f32::max);
        let z: f32 = (i_row
            .iter()
            .zip(&valid)
            .filter(|(_, &v)| v)
            .map(|(x, _)| (x - max).exp()))
        .sum();
        let mut target_sum = 0f32;
        let target: Vec<f32> = (0..per_row)
            .map(|i| match valid[i] {
                true => (p_row[i] / mass).max(LOSS_EPS),
                false => 0.0,
            })
            .inspect(|p| target_sum += p)
            .collect();
        for i in (0..per_row).filter(|&i| valid[i] && count > 0) {
            let y = (i_row[i] - max).exp() / z;
            total += f64::from(target[i])
                * (f64::from(target[i].ln()) - f64::from(y.max(LOSS_EPS).ln()));
            grads[t * per_row + i] = coeff / n as f32 * scale * (y * target_sum - target[i]);
        }
    }
    ((f64::from(coeff) * total / n as f64) as f32, grads)
}

/// The main attention's probabilities of each row's selected keys summed over its heads
/// `[n, K]` (0 where no key), of its queries and keys `[n, heads·width]` and log-sum-exps
/// `[n, heads]`, scores scaled by `scale`.
pub(super) fn selected_probs(
    (q, k, lse): (&[f32], &[f32], &[f32]),
    selection: &Selection,
    (heads, width, scale): (usize, usize, f32),
) -> Vec<f32> {
    let per_row = selection.per_row();
    let mut probs = vec![0f32; selection.rows() * per_row];
    probs
        .par_chunks_mut(per_row)
        .enumerate()
        .for_each(|(t, row)| {
            let chosen = &selection.keys()[t * per_row..][..per_row];
            for (p, &s) in row.iter_mut().zip(chosen) {
                let Ok(s) = usize::try_from(s) else { continue };
                *p = (0..heads)
                    .map(|h| {
                        let (qa, ka) = ((t * heads + h) * width, (s * heads + h) * width);
                        let dot: f32 = (q[qa..qa + width].iter())
                            .zip(&k[ka..ka + width])
                            .map(|(a, b)| a * b)
                            .sum();
                        (scale * dot - lse[t * heads + h]).exp()
                    })
                    .sum();
            }
        });
    probs
}
