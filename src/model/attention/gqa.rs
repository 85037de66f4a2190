//! Grouped-query (and multi-head) self-attention, Megatron's `SelfAttention` with the local
//! spec: the fused QKV projection in GQA-group order, optionally an RMSNorm of each query and
//! key head (`--qk-layernorm`, Qwen3), rotary embedding of q and k, causal attention, the
//! output projection (megatron-core megatron/core/transformer/attention.py
//! `get_query_key_value_tensors`: the norms act on `[sq, b, heads, d]` before RoPE).
//!
//! Legend: T = rows, h = hidden, qw = heads·d, kw = groups·d (this rank's heads and groups
//! under tensor parallelism).

use super::Attend;
use crate::arch::roles::{Canon, Role};
use crate::engine::{Backend, Result};
use crate::model::dropout::attention_mask;
use crate::model::layer::rms_grad;
use crate::model::linear::Linear;
use crate::model::parallel::{gathered, reduced};
use crate::model::params::ParamTable;
use crate::model::Pass;
use std::ops::Range;

/// The parameters of one layer's attention.
#[derive(Debug, Clone, Copy)]
pub(in crate::model) struct Gqa {
    /// The layer's index in the whole model (attention dropout's masks are keyed by it).
    layer: usize,
    /// linear_qkv `[ng(nh/ng+2)d, h]` (column-parallel).
    qkv: Linear,
    /// linear_proj `[h, qw]` (row-parallel).
    proj: Linear,
    /// q_layernorm and k_layernorm γ `[d]` (whole on every tensor-parallel rank).
    qk_norm: Option<(usize, usize)>,
}

/// A head norm's input `[T, w]` and its `rstd [T·heads]`, kept for its backward pass.
type NormSaved<T> = Option<(T, T)>;

/// What the backward pass needs of the forward pass.
pub(in crate::model) struct Saved<T> {
    /// The normed input `[T, h]` (this rank's rows under sequence parallelism).
    h: T,
    /// Rotated queries `[T, qw]` and keys `[T, kw]`, values `[T, kw]`.
    q: T,
    k: T,
    v: T,
    /// Attention output `[T, qw]` and its log-sum-exp `[T, heads]` (`None` where the keys
    /// and values came from a cache: inference keeps no statistics).
    o: T,
    lse: Option<T>,
    /// `x·Aᵀ` of the adapters of linear_qkv and linear_proj.
    lora: [Option<T>; 2],
    /// The q and k head norms' inputs and statistics.
    qk_norm: [NormSaved<T>; 2],
}

impl Gqa {
    /// Layer `layer`'s attention in `table`, `None` if the table lacks it.
    pub(in crate::model) fn of(table: &ParamTable, layer: usize) -> Option<Gqa> {
        let at = Some(layer);
        let norm = |role| table.index(Canon { role, layer: at });
        Some(Gqa {
            layer,
            qkv: Linear::of(table, (Role::Qkv, Some(Role::QkvBias)), at)?,
            proj: Linear::of(table, (Role::Proj, Some(Role::ProjBias)), at)?,
            qk_norm: norm(Role::QNorm).zip(norm(Role::KNorm)),
        })
    }

    /// `proj(attention(rope(q), rope(k), v))` with `(q, k, v) = split(qkv(h))`, summed over
    /// the tensor-parallel ranks: `[T, h]`.
    pub(in crate::model) fn forward<B: Backend>(
        &self,
        p: &Pass<B>,
        h: B::Tensor,
        attend: Attend<B::Tensor>,
    ) -> Result<(B::Tensor, Saved<B::Tensor>)> {
        let b = p.b;
        let shape = p.spec.attention;
        let all = gathered(b, p.tp, &h)?;
        let (qkv, u_qkv) = self.qkv.forward(p, all.as_ref().unwrap_or(&h))?;
        let (q, k, v) = b.split_qkv(&qkv, shape)?;
        let (mut q, q_norm) = head_norm(p, q, self.qk_norm.map(|(g, _)| g))?;
        let (mut k, k_norm) = head_norm(p, k, self.qk_norm.map(|(_, g)| g))?;
        let (cos, sin) = p.rope;
        b.rope(&mut q, cos, sin, shape.head_dim, false)?;
        b.rope(&mut k, cos, sin, shape.head_dim, false)?;
        let (o, lse) = match attend {
            Attend::Segments(segments, _) => {
                let mask = attention_mask(p, self.layer);
                let (o, lse) = b.attention(&q, &k, &v, segments, shape, mask.as_ref())?;
                (o, Some(lse))
            }
            Attend::Cached {
                keys,
                values,
                segments,
            } => {
                b.kv_store(keys, &k, segments)?;
                b.kv_store(values, &v, segments)?;
                (b.cached_attention(&q, keys, values, segments, shape)?, None)
            }
            Attend::Latent { .. } => {
                return Err(crate::engine::EngineError::Invalid {
                    op: "grouped-query attention",
                    msg: "its cache holds keys and values, not a latent".into(),
                })
            }
        };
        let (out, u_proj) = self.proj.forward(p, &o)?;
        let saved = Saved {
            h,
            q,
            k,
            v,
            o,
            lse,
            lora: [u_qkv, u_proj],
            qk_norm: [q_norm, k_norm],
        };
        Ok((reduced(b, p.tp, out)?, saved))
    }

    /// `dh [T, h]` of [`Gqa::forward`] given the gradient `dy [T, h]` of its output (summed
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
        let [u_qkv, u_proj] = &s.lora;
        let (lse, all) = super::backward_inputs(p, &s.lse, dy)?;
        let dy = all.as_ref().unwrap_or(dy);
        let d_o = self.proj.backward(p, grads, dy, (&s.o, u_proj.as_ref()))?;
        let mask = attention_mask(p, self.layer);
        let (mut dq, mut dk, dv) = b.attention_bwd(
            &d_o,
            &s.q,
            &s.k,
            &s.v,
            &s.o,
            lse,
            segments,
            shape,
            mask.as_ref(),
        )?;
        let (cos, sin) = p.rope;
        b.rope(&mut dq, cos, sin, shape.head_dim, true)?;
        b.rope(&mut dk, cos, sin, shape.head_dim, true)?;
        let [q_norm, k_norm] = s.qk_norm;
        let dq = head_norm_bwd(p, grads, dq, (self.qk_norm.map(|(g, _)| g), q_norm))?;
        let dk = head_norm_bwd(p, grads, dk, (self.qk_norm.map(|(_, g)| g), k_norm))?;
        let dqkv = b.merge_qkv(&dq, &dk, &dv, shape)?;
        let all = gathered(b, p.tp, &s.h)?;
        let h = all.as_ref().unwrap_or(&s.h);
        let dh = self.qkv.backward(p, grads, &dqkv, (h, u_qkv.as_ref()))?;
        reduced(b, p.tp, dh)
    }
}

/// Each head of `x [T, w]` normed by γ (parameter `gamma`), if the attention has head norms:
/// the normed heads, and what the backward pass needs.
fn head_norm<B: Backend>(
    p: &Pass<B>,
    x: B::Tensor,
    gamma: Option<usize>,
) -> Result<(B::Tensor, NormSaved<B::Tensor>)> {
    let Some(g) = gamma else {
        return Ok((x, None));
    };
    let (y, rstd) = p.b.rms_norm(&x, &p.params[g], p.spec.norm_eps)?;
    Ok((y, Some((x, rstd))))
}

/// The gradient of [`head_norm`]'s input given `dy`, accumulating γ's.
fn head_norm_bwd<B: Backend>(
    p: &Pass<B>,
    grads: &mut [B::Tensor],
    dy: B::Tensor,
    (gamma, saved): (Option<usize>, NormSaved<B::Tensor>),
) -> Result<B::Tensor> {
    match (gamma, saved) {
        (Some(g), Some((x, rstd))) => rms_grad(p, grads, (&dy, &x), g, &rstd),
        _ => Ok(dy),
    }
}
