//! Grouped-query (and multi-head) self-attention, Megatron's `SelfAttention` with the local
//! spec: the fused QKV projection in GQA-group order, rotary embedding of q and k, causal
//! attention, the output projection (megatron-core megatron/core/transformer/attention.py).
//!
//! Legend: T = rows, h = hidden, qw = heads·d, kw = groups·d (this rank's heads and groups
//! under tensor parallelism).

use super::Attend;
use crate::arch::roles::Role;
use crate::engine::{Backend, EngineError, Result};
use crate::model::linear::Linear;
use crate::model::parallel::{gathered, reduced};
use crate::model::params::ParamTable;
use crate::model::Pass;
use std::ops::Range;

/// The parameters of one layer's attention.
#[derive(Debug, Clone, Copy)]
pub(in crate::model) struct Gqa {
    /// linear_qkv `[ng(nh/ng+2)d, h]` (column-parallel).
    qkv: Linear,
    /// linear_proj `[h, qw]` (row-parallel).
    proj: Linear,
}

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
}

impl Gqa {
    /// Layer `layer`'s attention in `table`, `None` if the table lacks it.
    pub(in crate::model) fn of(table: &ParamTable, layer: usize) -> Option<Gqa> {
        let at = Some(layer);
        Some(Gqa {
            qkv: Linear::of(table, (Role::Qkv, Some(Role::QkvBias)), at)?,
            proj: Linear::of(table, (Role::Proj, Some(Role::ProjBias)), at)?,
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
        let (mut q, mut k, v) = b.split_qkv(&qkv, shape)?;
        let (cos, sin) = p.rope;
        b.rope(&mut q, cos, sin, false)?;
        b.rope(&mut k, cos, sin, false)?;
        let (o, lse) = match attend {
            Attend::Segments(segments) => {
                let (o, lse) = b.attention(&q, &k, &v, segments, shape)?;
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
        let Some(lse) = &s.lse else {
            return Err(EngineError::Invalid {
                op: "attention backward",
                msg: "the forward pass attended over a cache and kept no statistics".into(),
            });
        };
        let all = gathered(b, p.tp, dy)?;
        let dy = all.as_ref().unwrap_or(dy);
        let d_o = self.proj.backward(p, grads, dy, (&s.o, u_proj.as_ref()))?;
        let (mut dq, mut dk, dv) =
            b.attention_bwd(&d_o, &s.q, &s.k, &s.v, &s.o, lse, segments, shape)?;
        let (cos, sin) = p.rope;
        b.rope(&mut dq, cos, sin, true)?;
        b.rope(&mut dk, cos, sin, true)?;
        let dqkv = b.merge_qkv(&dq, &dk, &dv, shape)?;
        let all = gathered(b, p.tp, &s.h)?;
        let h = all.as_ref().unwrap_or(&s.h);
        let dh = self.qkv.backward(p, grads, &dqkv, (h, u_qkv.as_ref()))?;
        reduced(b, p.tp, dh)
    }
}
