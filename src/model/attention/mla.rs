//! Multi-latent attention, megatron-core's `MLASelfAttention` with the local spec
//! (megatron/core/transformer/multi_latent_attention.py; transformers' `DeepseekV3Attention`):
//! queries up-projected from a normed low-rank latent (or projected from the input), keys and
//! values up-projected from a second normed latent; each head's query and key end in a
//! rotated part, the key's shared by all heads and taken from the latent's projection. RoPE
//! acts on those parts with their dimensions de-interleaved first (pairs `(2i, 2i+1)` become
//! `(i, i + d/2)`, as megatron-core's `apply_rotary_pos_emb` does under
//! `multi_latent_attention` and transformers' `apply_rotary_pos_emb_interleave`), so the
//! weights are DeepSeek's as they are. The values are padded to the query heads' width for
//! the one attention kernel (as MindSpeed-LLM pads them without `--mla-fa-without-pad`): the
//! padding's output is zero and dropped, its gradient zero.
//!
//! Inference caches, per position, only the normed key-value latent and the rotated shared key
//! part, and attends over them with the up projection absorbed ([`Absorbed`]: DeepSeek-V3's
//! inference/model.py `attn_impl="absorb"`): each head's query without RoPE times its key
//! up projection scores the latent directly, and the attention-weighted latent times its
//! value up projection is its output, so the context is never up-projected.
//!
//! Under tensor parallelism the down projections are column-parallel like the up
//! projections, their outputs gathered whole (megatron-core's local spec), or one replicated
//! projection that every rank computes whole (MindSpeed-LLM's deepseek_spec `linear_qkv`);
//! under sequence parallelism the latents' norms take this rank's rows.
//!
//! Legend: n = rows of the pass (every rank's under sequence parallelism), nh = this rank's
//! heads, dn = a head's dimensions without RoPE, dr = with, dq = dn + dr, dv = a value head's,
//! kv_lora = the key-value latent's.

use super::dsa::{self, Indexer, IndexerSaved};
use super::{rotate, Attend};
use crate::arch::roles::{Canon, Role};
use crate::engine::{
    AttentionShape, Backend, EngineError, Result, Segment, Selection, StridedView,
};
use crate::model::columns::{assemble, cols, columns_gathered, own_columns, own_rows};
use crate::model::dropout::attention_mask;
use crate::model::layer::rms_grad;
use crate::model::linear::Linear;
use crate::model::parallel::{all_reduced, gathered, reduced};
use crate::model::params::ParamTable;
use crate::model::Pass;
use crate::tensor::host::Tensor as HostTensor;
use std::ops::Range;
use std::rc::Rc;

/// The parameters of one layer's multi-latent attention.
#[derive(Debug, Clone, Copy)]
pub(in crate::model) struct Mla {
    /// The layer's index in the whole model (attention dropout's masks are keyed by it).
    layer: usize,
    /// The projections out of the input.
    down: Down,
    /// What makes the queries of the first projection's output.
    q: Query,
    /// kv_layernorm γ `[kv_lora]`.
    kv_norm: Option<usize>,
    /// linear_kv_up_proj `[nh(dn + dv), kv_lora]` (or its two parts).
    kv_up: Up,
    /// linear_proj `[h, nh·dv]` (row-parallel).
    proj: Linear,
    /// DeepSeek sparse attention's indexer, where the layer has its own.
    indexer: Option<Indexer>,
}

/// The projections out of the input: the queries' first (their latent's down projection,
/// or every head's query) and the key-value latent's with the shared rotated key part.
#[derive(Debug, Clone, Copy)]
enum Down {
    /// megatron-core's column-parallel linear_q_down_proj (or linear_q_proj) and
    /// linear_kv_down_proj `[kv_lora + dr, h]`.
    Apart(Linear, Linear),
    /// MindSpeed-LLM's replicated linear_qkv `[q_rank + kv_lora + dr, h]`.
    Fused(Linear),
}

/// How queries are made of the first projection's output.
#[derive(Debug, Clone, Copy)]
enum Query {
    /// Through a latent: its norm (q_layernorm), then the up projection.
    Latent(Option<usize>, Up),
    /// They are that output.
    Direct,
}

/// An up projection out of a latent, its output per head the part without RoPE (queries and
/// keys) then the rotated part (queries) or the value (keys and values).
#[derive(Debug, Clone, Copy)]
enum Up {
    /// One linear layer: linear_q_up_proj, linear_kv_up_proj.
    Whole(Linear),
    /// The two parts' (`--mla-mm-split`): linear_qk_nope and linear_qk_rope, linear_kv_nope
    /// and linear_v.
    Split(Linear, Linear),
}

/// An up projection's adapters' `x·Aᵀ` (of its one linear layer, or of each part).
type UpAdapters<T> = [Option<T>; 2];

impl Up {
    /// Layer `layer`'s up projection `whole` in `table`, whole or split.
    fn of(table: &ParamTable, layer: usize, whole: Role) -> Option<Up> {
        let linear = |role| Linear::of(table, (role, None), Some(layer));
        if let Some(up) = linear(whole) {
            return Some(Up::Whole(up));
        }
        let [first, second] = whole.up_parts()?;
        Some(Up::Split(linear(first)?, linear(second)?))
    }

    /// `y [n, nh·(w0 + w1)]` of the latent `x [n, r]` and its adapters' `x·Aᵀ`, given the
    /// parts' widths per head `[w0, w1]`.
    fn forward<B: Backend>(
        self,
        p: &Pass<B>,
        x: &B::Tensor,
        [w0, w1]: [usize; 2],
    ) -> Result<(B::Tensor, UpAdapters<B::Tensor>)> {
        match self {
            Up::Whole(up) => {
                let (y, u) = up.forward(p, x)?;
                Ok((y, [u, None]))
            }
            Up::Split(first, second) => {
                let (y0, u0) = first.forward(p, x)?;
                let (y1, u1) = second.forward(p, x)?;
                let (n, nh) = (p.b.shape(x)[0], p.spec.attention.heads);
                let y = assemble(p.b, n, nh, w0 + w1, &[(&y0, w0, 0), (&y1, w1, w0)])?;
                Ok((y, [u0, u1]))
            }
        }
    }

    /// `dx [n, r]` of [`Up::forward`] given `dy [n, nh·(w0 + w1)]` (a partial sum over the
    /// tensor-parallel ranks' heads), accumulating the weights' gradients.
    fn backward<B: Backend>(
        self,
        p: &Pass<B>,
        grads: &mut [B::Tensor],
        dy: &B::Tensor,
        (x, u, [w0, w1]): (&B::Tensor, &UpAdapters<B::Tensor>, [usize; 2]),
    ) -> Result<B::Tensor> {
        match self {
            Up::Whole(up) => up.backward(p, grads, dy, (x, u[0].as_ref())),
            Up::Split(first, second) => {
                let b = p.b;
                let (n, nh, w) = (b.shape(dy)[0], p.spec.attention.heads, w0 + w1);
                let part = |at: usize, width: usize| {
                    b.gather(dy, cols(n, nh * w, (nh, w), at, width), &[n, nh * width])
                };
                let mut dx = first.backward(p, grads, &part(0, w0)?, (x, u[0].as_ref()))?;
                let dx1 = second.backward(p, grads, &part(w0, w1)?, (x, u[1].as_ref()))?;
                b.add_assign(&mut dx, &dx1)?;
                Ok(dx)
            }
        }
    }
}

/// A latent's norm: its input (this rank's rows) and `rstd`.
type NormSaved<T> = Option<(T, T)>;

/// What the backward pass needs of a latent (of the queries or the keys and values).
struct LatentSaved<T> {
    /// The norm's input and statistics.
    norm: NormSaved<T>,
    /// The up projection's input (the normed latent, every row) and adapters' `x·Aᵀ`.
    up_input: T,
    up_lora: UpAdapters<T>,
}

/// What the backward pass needs of the forward pass.
pub(in crate::model) struct Saved<T> {
    /// The normed input `[T, h]` (this rank's rows under sequence parallelism).
    h: T,
    /// The down projections' adapters `x·Aᵀ` (of [`Down::Apart`]'s two, or the fused one).
    down_lora: [Option<T>; 2],
    /// Of the query latent (`None`: direct queries).
    q: Option<LatentSaved<T>>,
    /// Of the key-value latent (no up projection's adapter where it attended over the cache).
    kv: LatentSaved<T>,
    /// The attention's queries, keys, padded values and output `[n, nh·dq]`, and its
    /// log-sum-exp (`None` both where it attended over the latent cache).
    attention: Option<[T; 4]>,
    lse: Option<T>,
    /// linear_proj's input `[n, nh·dv]` and adapter `x·Aᵀ`.
    o: T,
    proj_lora: Option<T>,
    /// DeepSeek sparse attention's.
    sparse: Option<SparseSaved<T>>,
}

/// What the backward pass needs of DeepSeek sparse attention, and its loss.
struct SparseSaved<T> {
    /// The keys each row attended to (its own indexer's, or an earlier layer's).
    selection: Rc<Selection>,
    /// Its own indexer's, in training: what its backward pass needs and the gradient of the
    /// indexer loss with respect to the selected keys' scores.
    indexer: Option<(IndexerSaved<T>, Vec<f32>)>,
    /// The indexer loss (its coefficient included) as the tracker records it.
    loss: Option<f32>,
}

impl<T> Saved<T> {
    /// The indexer loss of the forward pass, where its layer computed one.
    pub(in crate::model) fn indexer_loss(&self) -> Option<f32> {
        self.sparse.as_ref()?.loss
    }
}

impl Mla {
    /// Layer `layer`'s multi-latent attention in `table`, `None` if the table lacks it.
    pub(in crate::model) fn of(table: &ParamTable, layer: usize) -> Option<Mla> {
        let at = Some(layer);
        let linear = |role| Linear::of(table, (role, None), at);
        let norm = |role| table.index(Canon { role, layer: at });
        let q = match Up::of(table, layer, Role::QUp) {
            Some(up) => Query::Latent(norm(Role::QLatentNorm), up),
            None => Query::Direct,
        };
        let down = match linear(Role::QkvDown) {
            Some(fused) => Down::Fused(fused),
            None => {
                let q_down = linear(Role::QDown).or_else(|| linear(Role::QProj))?;
                Down::Apart(q_down, linear(Role::KvDown)?)
            }
        };
        Some(Mla {
            layer,
            down,
            q,
            kv_norm: norm(Role::KvLatentNorm),
            kv_up: Up::of(table, layer, Role::KvUp)?,
            proj: linear(Role::Proj)?,
            indexer: Indexer::of(table, layer),
        })
    }

    /// `proj(attention(q, k, v))`, summed over the tensor-parallel ranks: `[T, h]`.
    pub(in crate::model) fn forward<B: Backend>(
        &self,
        p: &Pass<B>,
        h: B::Tensor,
        attend: Attend<B::Tensor>,
    ) -> Result<(B::Tensor, Saved<B::Tensor>)> {
        let b = p.b;
        let shape = p.spec.attention;
        let d = dims(p)?;
        let all = gathered(b, p.tp, &h)?;
        let x = all.as_ref().unwrap_or(&h);
        let ([q_first, kv_down], down_lora) = self.down_forward(p, x, &d)?;
        let dsa = p.spec.mla.and_then(|m| m.dsa);
        let copy = |t: &B::Tensor| b.cast(t, b.dtype(t));
        // the indexer's detached inputs, in training and evaluation alike
        let mut indexer_in = match (self.indexer, &attend, dsa) {
            (Some(_), Attend::Segments(..), Some(dsa)) => {
                let qr = (!dsa.normed_query).then(|| copy(&q_first)).transpose()?;
                Some((copy(x)?, qr))
            }
            _ => None,
        };
        let (q, q_saved) = match self.q {
            Query::Latent(norm, up) => {
                let (q, saved) = up_from_latent(p, q_first, (norm, up), (Latent::Query, &d))?;
                if let Some((_, qr @ None)) = &mut indexer_in {
                    *qr = Some(copy(&saved.up_input)?);
                }
                (q, Some(saved))
            }
            Query::Direct => (q_first, None),
        };
        let n = b.shape(&kv_down)[0];
        let row = d.kv_lora + d.r;
        let c_kv = b.gather(
            &kv_down,
            cols(n, row, (1, row), 0, d.kv_lora),
            &[n, d.kv_lora],
        )?;
        let mut k_pe = b.gather(&kv_down, cols(n, row, (1, row), d.kv_lora, d.r), &[n, d.r])?;
        let (c_kv, kv_norm) = normed_latent(p, c_kv, self.kv_norm, Latent::KeyValue)?;
        let nh = shape.heads;
        let qw = d.n + d.r;
        let mut q_pe = b.gather(&q, cols(n, nh * qw, (nh, qw), d.n, d.r), &[n, nh * d.r])?;
        rotate(p, &mut q_pe, nh, false)?;
        rotate(p, &mut k_pe, 1, false)?;
        let mut sparse = None;
        let (o, attention, lse, kv_up) = match attend {
            Attend::Segments(segments, shared) => {
                let (kv, up_lora) = self.kv_up.forward(p, &c_kv, Latent::KeyValue.widths(&d))?;
                let (q_full, k_full, v_full) = full_heads(p, &d, (&q, &q_pe), (&kv, &k_pe))?;
                let qkv = (&q_full, &k_full, &v_full);
                let (o_full, lse) = match dsa {
                    None => {
                        let mask = attention_mask(p, self.layer);
                        b.attention(qkv.0, qkv.1, qkv.2, segments, shape, mask.as_ref())?
                    }
                    Some(_) => {
                        let at = (segments, shared, &d);
                        let (out, saved) = self.sparse_forward(p, qkv, at, indexer_in)?;
                        sparse = Some(saved);
                        out
                    }
                };
                let o = b.gather(&o_full, cols(n, nh * qw, (nh, qw), 0, d.v), &[n, nh * d.v])?;
                (
                    o,
                    Some([q_full, k_full, v_full, o_full]),
                    Some(lse),
                    up_lora,
                )
            }
            Attend::Latent { .. } if dsa.is_some() => {
                return Err(EngineError::Invalid {
                    op: "multi-latent attention",
                    msg: "DeepSeek sparse attention over a KV cache (generation) is not built"
                        .into(),
                })
            }
            Attend::Latent {
                cache,
                absorbed,
                segments,
            } => {
                let latent = assemble(
                    b,
                    n,
                    1,
                    row,
                    &[(&c_kv, d.kv_lora, 0), (&k_pe, d.r, d.kv_lora)],
                )?;
                b.kv_store(cache, &latent, segments)?;
                let o = absorbed.attend(p, &d, (&q, &q_pe), cache, segments)?;
                (o, None, None, [None, None])
            }
            Attend::Cached { .. } => {
                return Err(EngineError::Invalid {
                    op: "multi-latent attention",
                    msg: "its cache holds the key-value latent, not keys and values".into(),
                })
            }
        };
        let (out, proj_lora) = self.proj.forward(p, &o)?;
        let saved = Saved {
            h,
            down_lora,
            q: q_saved,
            kv: LatentSaved {
                norm: kv_norm,
                up_input: c_kv,
                up_lora: kv_up,
            },
            attention,
            lse,
            o,
            proj_lora,
            sparse,
        };
        Ok((reduced(b, p.tp, out)?, saved))
    }

    /// DeepSeek sparse attention of the full heads `(q, k, v)` within `segments`: by this
    /// layer's indexer's selection of the detached `indexer_in` (kept in `shared` for the
    /// layers after it), or by the selection an earlier layer left there. Returns the output
    /// and log-sum-exp, and what the backward pass needs (in training with its own indexer,
    /// the indexer loss and its gradient).
    #[allow(clippy::type_complexity)]
    fn sparse_forward<B: Backend>(
        &self,
        p: &Pass<B>,
        (q, k, v): (&B::Tensor, &B::Tensor, &B::Tensor),
        (segments, shared, d): (&[Range<usize>], &super::SharedSelection, &Dims),
        indexer_in: Option<(B::Tensor, Option<B::Tensor>)>,
    ) -> Result<((B::Tensor, B::Tensor), SparseSaved<B::Tensor>)> {
        let indexed = match (self.indexer, indexer_in) {
            (Some(ix), Some((x, Some(qr)))) => Some(ix.select(p, (x, qr), segments, d.r)?),
            _ => None,
        };
        let (selection, indexed) = match indexed {
            Some((selection, scores, saved)) => {
                let selection = Rc::new(selection);
                *shared.borrow_mut() = Some(selection.clone());
                (selection, Some((scores, saved)))
            }
            None => (shared_selection(shared, self.layer)?, None),
        };
        let (shape, mask) = (p.spec.attention, attention_mask(p, self.layer));
        let (o, lse) =
            p.b.sparse_attention(q, k, v, segments, shape, mask.as_ref(), &selection)?;
        let saved = sparse_saved(p, selection, indexed, (q, k, &lse))?;
        Ok(((o, lse), saved))
    }

    /// `dh [T, h]` of [`Mla::forward`] given the gradient `dy [T, h]` of its output (summed
    /// over the tensor-parallel ranks), accumulating the parameters' gradients.
    pub(in crate::model) fn backward<B: Backend>(
        &self,
        p: &Pass<B>,
        grads: &mut [B::Tensor],
        s: Saved<B::Tensor>,
        (dy, segments): (&B::Tensor, &[Range<usize>]),
    ) -> Result<B::Tensor> {
        let b = p.b;
        let shape = p.spec.attention;
        let d = dims(p)?;
        let (lse, all) = super::backward_inputs(p, &s.lse, dy)?;
        let dy = all.as_ref().unwrap_or(dy);
        let d_o = self
            .proj
            .backward(p, grads, dy, (&s.o, s.proj_lora.as_ref()))?;
        let n = b.shape(&d_o)[0];
        let (nh, qw, kw) = (shape.heads, d.n + d.r, d.n + d.v);
        let d_o_full = assemble(b, n, nh, qw, &[(&d_o, d.v, 0)])?;
        let Some([q_full, k_full, v_full, o_full]) = &s.attention else {
            return Err(EngineError::Invalid {
                op: "multi-latent attention backward",
                msg: "the forward pass attended over the latent cache".into(),
            });
        };
        let mask = attention_mask(p, self.layer);
        let (dq_full, dk_full, dv_full) = match &s.sparse {
            Some(sparse) => b.sparse_attention_bwd(
                &d_o_full,
                (q_full, k_full, v_full),
                (o_full, lse),
                segments,
                shape,
                mask.as_ref(),
                &sparse.selection,
            )?,
            None => b.attention_bwd(
                &d_o_full,
                q_full,
                k_full,
                v_full,
                o_full,
                lse,
                segments,
                shape,
                mask.as_ref(),
            )?,
        };
        if let (Some(ix), Some(sparse)) = (self.indexer, &s.sparse) {
            if let Some((saved, d_scores)) = &sparse.indexer {
                ix.backward(p, grads, (saved, &sparse.selection, d_scores), d.r)?;
            }
        }
        let part = |t: &B::Tensor, at: usize, w: usize| {
            b.gather(t, cols(n, nh * qw, (nh, qw), at, w), &[n, nh * w])
        };
        let mut dq_pe = part(&dq_full, d.n, d.r)?;
        rotate(p, &mut dq_pe, nh, true)?;
        let dq = assemble(
            b,
            n,
            nh,
            qw,
            &[(&part(&dq_full, 0, d.n)?, d.n, 0), (&dq_pe, d.r, d.n)],
        )?;
        // the shared rotated key part: its gradient summed over every head, on every rank
        let dk_pe_all = part(&dk_full, d.n, d.r)?;
        let mut dk_pe = b.gather(&dk_pe_all, cols(n, nh * d.r, (1, d.r), 0, d.r), &[n, d.r])?;
        for head in 1..nh {
            let one = cols(n, nh * d.r, (1, d.r), head * d.r, d.r);
            b.add_assign(&mut dk_pe, &b.gather(&dk_pe_all, one, &[n, d.r])?)?;
        }
        let mut dk_pe = all_reduced(p.tp, dk_pe)?;
        rotate(p, &mut dk_pe, 1, true)?;
        let dkv = assemble(
            b,
            n,
            nh,
            kw,
            &[
                (&part(&dk_full, 0, d.n)?, d.n, 0),
                (&part(&dv_full, 0, d.v)?, d.v, d.n),
            ],
        )?;
        let kv = (self.kv_norm, self.kv_up);
        let d_c_kv = latent_bwd(p, grads, dkv, (kv, Latent::KeyValue, &d), &s.kv)?;
        let row = d.kv_lora + d.r;
        let d_kv_down = assemble(
            b,
            n,
            1,
            row,
            &[(&d_c_kv, d.kv_lora, 0), (&dk_pe, d.r, d.kv_lora)],
        )?;
        let d_q_first = match (self.q, &s.q) {
            (Query::Latent(norm, up), Some(saved)) => {
                latent_bwd(p, grads, dq, ((norm, up), Latent::Query, &d), saved)?
            }
            (Query::Direct, None) => dq,
            _ => unreachable!("the saved query path is the layer's"),
        };
        self.down_backward(p, grads, [d_q_first, d_kv_down], (&s.h, &s.down_lora))
    }

    /// The down projections of the input `x [n, h]` (every row): the queries' first
    /// projection (the query latent whole, or this rank's heads' queries) and the key-value
    /// latent with the rotated key part `[n, kv_lora + dr]` whole, and their adapters' `x·Aᵀ`.
    #[allow(clippy::type_complexity)]
    fn down_forward<B: Backend>(
        &self,
        p: &Pass<B>,
        x: &B::Tensor,
        d: &Dims,
    ) -> Result<([B::Tensor; 2], [Option<B::Tensor>; 2])> {
        let b = p.b;
        let q_latent = matches!(self.q, Query::Latent(..));
        match self.down {
            Down::Apart(q_down, kv_down) => {
                let (q, u_q) = q_down.forward(p, x)?;
                let q = if q_latent {
                    columns_gathered(p.b, p.tp, q)?
                } else {
                    q
                };
                let (kv, u_kv) = kv_down.forward(p, x)?;
                Ok(([q, columns_gathered(p.b, p.tp, kv)?], [u_q, u_kv]))
            }
            Down::Fused(fused) => {
                let (y, u) = fused.forward(p, x)?;
                let (n, w) = (b.shape(&y)[0], b.shape(&y)[1]);
                let kv_w = d.kv_lora + d.r;
                let q_w = w - kv_w;
                let q = b.gather(&y, cols(n, w, (1, w), 0, q_w), &[n, q_w])?;
                let kv = b.gather(&y, cols(n, w, (1, w), q_w, kv_w), &[n, kv_w])?;
                Ok(([q, kv], [u, None]))
            }
        }
    }

    /// `dh [T, h]` of [`Mla::down_forward`] given its outputs' gradients (the latents' whole,
    /// summed over the ranks' heads; direct queries' this rank's), accumulating the weights'
    /// gradients: summed over the tensor-parallel ranks where the projections are split; a
    /// replicated projection's is whole on every rank, this rank's rows of it taken.
    fn down_backward<B: Backend>(
        &self,
        p: &Pass<B>,
        grads: &mut [B::Tensor],
        [d_q, d_kv]: [B::Tensor; 2],
        (h, down_lora): (&B::Tensor, &[Option<B::Tensor>; 2]),
    ) -> Result<B::Tensor> {
        let b = p.b;
        let all_h = gathered(b, p.tp, h)?;
        let x = all_h.as_ref().unwrap_or(h);
        match self.down {
            Down::Apart(q_down, kv_down) => {
                let d_kv = own_columns(p.b, p.tp, d_kv)?;
                let mut dh = kv_down.backward(p, grads, &d_kv, (x, down_lora[1].as_ref()))?;
                let d_q = match self.q {
                    Query::Latent(..) => own_columns(p.b, p.tp, d_q)?,
                    Query::Direct => d_q,
                };
                let dh_q = q_down.backward(p, grads, &d_q, (x, down_lora[0].as_ref()))?;
                b.add_assign(&mut dh, &dh_q)?;
                reduced(b, p.tp, dh)
            }
            Down::Fused(fused) => {
                let n = b.shape(&d_q)[0];
                let (q_w, kv_w) = (b.shape(&d_q)[1], b.shape(&d_kv)[1]);
                let d_y = assemble(b, n, 1, q_w + kv_w, &[(&d_q, q_w, 0), (&d_kv, kv_w, q_w)])?;
                let dh = fused.backward(p, grads, &d_y, (x, down_lora[0].as_ref()))?;
                own_rows(p.b, p.tp, dh)
            }
        }
    }
}

/// The key-value up projection split by head for attention over the latent cache
/// (DeepSeek-V3's inference/model.py `MLA` with `attn_impl="absorb"`, MindSpeed-LLM's
/// `--enable-mla-absorb`): each head's key part `W_uk [dn, kv_lora]`, transposed, folds into
/// its query (`q_nope·W_uk` scores the latent as `q_nope·(W_uk·c)` scores the key) and its
/// value part `W_uv [dv, kv_lora]` maps its output out of the latent (`(p·C)·W_uvᵀ = p·(C·W_uvᵀ)`).
pub(in crate::model) struct Absorbed<T> {
    /// `W_ukᵀ [kv_lora, dn]` of each head.
    keys: Vec<T>,
    /// `W_uv [dv, kv_lora]` of each head.
    values: Vec<T>,
}

impl<T> Absorbed<T> {
    /// Of the key-value up projection `w [heads·(dn + dv), kv_lora]` (linear_kv_up_proj, whole,
    /// as the checkpoint holds it) of a model of multi-latent attention `m`, uploaded to `b` as
    /// matmul weights.
    pub(in crate::model) fn new<B: Backend<Tensor = T>>(
        b: &B,
        w: &HostTensor,
        heads: usize,
        m: &crate::arch::Mla,
    ) -> Result<Self> {
        let (dn, kv_lora) = (m.qk_head_dim, m.kv_lora_rank);
        let kw = dn + m.v_head_dim;
        if w.shape != [heads * kw, kv_lora] {
            return Err(EngineError::Invalid {
                op: "multi-latent attention",
                msg: format!(
                    "the key-value up projection is {:?}, not [{}, {kv_lora}]",
                    w.shape,
                    heads * kw
                ),
            });
        }
        let mut absorbed = Absorbed {
            keys: Vec::with_capacity(heads),
            values: Vec::with_capacity(heads),
        };
        for at in (0..heads).map(|h| h * kw) {
            let keys = w.rows(at, at + dn).transposed();
            absorbed.keys.push(b.upload_matrix(&keys)?);
            absorbed
                .values
                .push(b.upload_matrix(&w.rows(at + dn, at + kw))?);
        }
        Ok(absorbed)
    }

    /// The attention output `[n, nh·dv]` of the queries `q [n, nh·dq]` (their rotated parts
    /// `q_pe [n, nh·dr]` rotated) over each segment's cached latents `[slots, capacity, kv_lora
    /// + dr]`: the heads' absorbed queries `[q_nope·W_uk | q_pe]` attend, as one key-value
    /// group, to the rows `[c_kv | k_pe]` as keys and as values (the output's rotated part,
    /// softmax · k_pe, is dropped), then each head's `softmax · c_kv` is up-projected by its
    /// `W_uv`.
    fn attend<B: Backend<Tensor = T>>(
        &self,
        p: &Pass<B>,
        d: &Dims,
        (q, q_pe): (&T, &T),
        cache: &T,
        segments: &[Segment],
    ) -> Result<T> {
        let b = p.b;
        let shape = p.spec.attention;
        let (nh, n) = (shape.heads, b.shape(q)[0]);
        if self.keys.len() != nh {
            return Err(EngineError::Invalid {
                op: "multi-latent attention",
                msg: format!("{} heads absorbed for {nh}", self.keys.len()),
            });
        }
        let (qw, lw) = (d.n + d.r, d.kv_lora + d.r);
        let mut q_latent = b.zeros(&[n, nh * lw], b.dtype(q))?;
        for (h, w_uk) in self.keys.iter().enumerate() {
            let q_nope = b.gather(q, cols(n, nh * qw, (1, qw), h * qw, d.n), &[n, d.n])?;
            let absorbed = b.matmul(&q_nope, w_uk, None)?;
            let part = cols(n, nh * lw, (1, lw), h * lw, d.kv_lora);
            b.scatter(&absorbed, &mut q_latent, part)?;
        }
        b.scatter(
            q_pe,
            &mut q_latent,
            cols(n, nh * lw, (nh, lw), d.kv_lora, d.r),
        )?;
        let latent = AttentionShape {
            heads: nh,
            groups: 1,
            head_dim: lw,
            scale: shape.scale,
        };
        let o_latent = b.cached_attention(&q_latent, cache, cache, segments, latent)?;
        let mut o = b.zeros(&[n, nh * d.v], b.dtype(&o_latent))?;
        for (h, w_uv) in self.values.iter().enumerate() {
            let part = cols(n, nh * lw, (1, lw), h * lw, d.kv_lora);
            let c = b.gather(&o_latent, part, &[n, d.kv_lora])?;
            let part = cols(n, nh * d.v, (1, d.v), h * d.v, d.v);
            b.scatter(&b.matmul(&c, w_uv, None)?, &mut o, part)?;
        }
        Ok(o)
    }
}

/// Every head's query `[n, nh·dq]` (its part without RoPE, then its rotated `q_pe`), key
/// `[n, nh·dq]` (its part of the up-projected latent `kv`, then the shared rotated `k_pe`) and
/// value `[n, nh·dq]` (padded), for the one attention kernel.
fn full_heads<B: Backend>(
    p: &Pass<B>,
    d: &Dims,
    (q, q_pe): (&B::Tensor, &B::Tensor),
    (kv, k_pe): (&B::Tensor, &B::Tensor),
) -> Result<(B::Tensor, B::Tensor, B::Tensor)> {
    let b = p.b;
    let (nh, n) = (p.spec.attention.heads, b.shape(q)[0]);
    let (kw, qw) = (d.n + d.v, d.n + d.r);
    let k_pe_all = b.gather(
        k_pe,
        StridedView {
            shape: [n, nh, d.r],
            strides: [d.r, 0, 1],
            offset: 0,
        },
        &[n, nh * d.r],
    )?;
    let heads = |parts: &[(&B::Tensor, usize, usize)]| assemble(b, n, nh, qw, parts);
    let q_nope = b.gather(q, cols(n, nh * qw, (nh, qw), 0, d.n), &[n, nh * d.n])?;
    let q_full = heads(&[(&q_nope, d.n, 0), (q_pe, d.r, d.n)])?;
    let k_nope = b.gather(kv, cols(n, nh * kw, (nh, kw), 0, d.n), &[n, nh * d.n])?;
    let v = b.gather(kv, cols(n, nh * kw, (nh, kw), d.n, d.v), &[n, nh * d.v])?;
    let k_full = heads(&[(&k_nope, d.n, 0), (&k_pe_all, d.r, d.n)])?;
    let v_full = heads(&[(&v, d.v, 0)])?;
    Ok((q_full, k_full, v_full))
}

/// The dimensions of the pass's multi-latent attention.
struct Dims {
    n: usize,
    r: usize,
    v: usize,
    kv_lora: usize,
}

fn dims<B: Backend>(p: &Pass<B>) -> Result<Dims> {
    let m = p.spec.mla.ok_or_else(|| EngineError::Invalid {
        op: "multi-latent attention",
        msg: "the model has no multi-latent attention shape".into(),
    })?;
    Ok(Dims {
        n: m.qk_head_dim,
        r: m.rope_dim,
        v: m.v_head_dim,
        kv_lora: m.kv_lora_rank,
    })
}

/// Which of the two latents.
#[derive(Clone, Copy)]
enum Latent {
    Query,
    KeyValue,
}

impl Latent {
    /// The widths per head of its up projection's output parts: the queries' without RoPE
    /// and rotated, the keys' and the values'.
    fn widths(self, d: &Dims) -> [usize; 2] {
        match self {
            Latent::Query => [d.n, d.r],
            Latent::KeyValue => [d.n, d.v],
        }
    }
}

/// The factor the latent's norm output is scaled by ([`crate::arch::Mla::latent_scales`]).
fn latent_scale<B: Backend>(p: &Pass<B>, latent: Latent) -> Option<f32> {
    let scales = p.spec.mla?.latent_scales(p.spec.hidden);
    scales[latent as usize]
}

/// The latent `c [n, r]` normed (over this rank's rows under sequence parallelism, then
/// gathered) and scaled where the model says, and what the norm's backward pass needs.
fn normed_latent<B: Backend>(
    p: &Pass<B>,
    c: B::Tensor,
    norm: Option<usize>,
    latent: Latent,
) -> Result<(B::Tensor, NormSaved<B::Tensor>)> {
    let b = p.b;
    match norm {
        Some(g) => {
            let own = own_rows(p.b, p.tp, c)?;
            let (y, rstd) = b.rms_norm(&own, &p.params[g], p.spec.latent_eps)?;
            let mut all = gathered(b, p.tp, &y)?.unwrap_or(y);
            if let Some(s) = latent_scale(p, latent) {
                all = b.scaled(&all, s)?;
            }
            Ok((all, Some((own, rstd))))
        }
        None => Ok((c, None)),
    }
}

/// The up projection of the normed latent `c [n, r]` ([`normed_latent`]).
fn up_from_latent<B: Backend>(
    p: &Pass<B>,
    c: B::Tensor,
    (norm, up): (Option<usize>, Up),
    (latent, d): (Latent, &Dims),
) -> Result<(B::Tensor, LatentSaved<B::Tensor>)> {
    let (normed, norm) = normed_latent(p, c, norm, latent)?;
    let (out, up_lora) = up.forward(p, &normed, latent.widths(d))?;
    let saved = LatentSaved {
        norm,
        up_input: normed,
        up_lora,
    };
    Ok((out, saved))
}

/// The gradient of the latent `c [n, r]` (every row, whole) of [`up_from_latent`] given its
/// output's `dy`.
fn latent_bwd<B: Backend>(
    p: &Pass<B>,
    grads: &mut [B::Tensor],
    dy: B::Tensor,
    ((norm, up), latent, d): ((Option<usize>, Up), Latent, &Dims),
    s: &LatentSaved<B::Tensor>,
) -> Result<B::Tensor> {
    let b = p.b;
    let saved = (&s.up_input, &s.up_lora, latent.widths(d));
    let d_normed = up.backward(p, grads, &dy, saved)?;
    // a column-parallel layer's input gradient: partial over the ranks' heads
    let mut d_normed = reduced(b, p.tp, d_normed)?;
    if let (Some(s), Some(_)) = (latent_scale(p, latent), norm) {
        d_normed = b.scaled(&d_normed, s)?;
    }
    match (norm, &s.norm) {
        (Some(g), Some((x, rstd))) => {
            let dc = rms_grad(p, grads, (&d_normed, x), g, rstd)?;
            Ok(gathered(b, p.tp, &dc)?.unwrap_or(dc))
        }
        _ => Ok(gathered(b, p.tp, &d_normed)?.unwrap_or(d_normed)),
    }
}

/// The selection an earlier layer of the pass made, for a layer without an indexer of its own.
fn shared_selection(shared: &super::SharedSelection, layer: usize) -> Result<Rc<Selection>> {
    shared.borrow().clone().ok_or_else(|| EngineError::Invalid {
        op: "DeepSeek sparse attention",
        msg: format!(
            "layer {layer} shares the key selection of an earlier layer, but no layer before it \
             in this pass made one (a pipeline stage must start with a layer that has an indexer)"
        ),
    })
}

/// The sparse attention's saved state: in training, with its own indexer's selection, the
/// indexer loss and its gradient, of the main attention's queries, keys and log-sum-exps.
fn sparse_saved<B: Backend>(
    p: &Pass<B>,
    selection: Rc<Selection>,
    indexed: Option<(Vec<f32>, IndexerSaved<B::Tensor>)>,
    (q, k, lse): (&B::Tensor, &B::Tensor, &B::Tensor),
) -> Result<SparseSaved<B::Tensor>> {
    let b = p.b;
    let (Some((scores, saved)), Some(training)) = (indexed, p.indexer) else {
        return Ok(SparseSaved {
            selection,
            indexer: None,
            loss: None,
        });
    };
    let shape = p.spec.attention;
    let width = b.shape(q)[1] / shape.heads;
    let host = (
        &b.download_f32(q)?[..],
        &b.download_f32(k)?[..],
        &b.download_f32(lse)?[..],
    );
    let probs = dsa::selected_probs(host, &selection, (shape.heads, width, shape.scale));
    let (loss, d_scores) = dsa::indexer_loss(
        &selection,
        (&probs, &scores),
        (training.coeff, training.scale),
    );
    Ok(SparseSaved {
        selection,
        indexer: Some((saved, d_scores)),
        loss: Some(loss),
    })
}
