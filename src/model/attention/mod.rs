//! The attention kinds of the decoder layer: what sits between the layer's input norm and
//! its first residual sum. Each kind has a forward pass returning its output and what its
//! backward pass needs, and that backward pass; inference runs the same forward pass over a
//! KV cache.

mod dsa;
mod gqa;
mod mla;

use crate::engine::{Backend, Result, Segment};
use crate::model::params::ParamTable;
use crate::model::Pass;
use gqa::Gqa;
pub(in crate::model) use mla::Absorbed;
use mla::Mla;
use std::ops::Range;

/// DeepSeek sparse attention's key selection of the last layer of a pass that made one, which
/// the layers after it without an indexer of their own attend by
/// ([`crate::arch::Dsa::computes`]).
pub(in crate::model) type SharedSelection =
    std::cell::RefCell<Option<std::rc::Rc<crate::engine::Selection>>>;

/// A layer's attention.
// one per layer, built once and copied as a plain value: the variants' sizes do not matter
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Copy)]
pub(in crate::model) enum Attention {
    /// Grouped-query (or multi-head) self-attention.
    Gqa(Gqa),
    /// Multi-latent attention.
    Mla(Mla),
}

/// What an attention's backward pass needs of its forward pass.
pub(in crate::model) enum AttentionSaved<T> {
    /// Of [`Attention::Gqa`].
    Gqa(gqa::Saved<T>),
    /// Of [`Attention::Mla`].
    Mla(mla::Saved<T>),
}

/// Where the keys and values a query attends to come from.
pub(in crate::model) enum Attend<'a, T> {
    /// Training: the rows' own, causally within each of these row ranges (sequences, or
    /// documents with `--reset-attention-mask`); under DeepSeek sparse attention those of the
    /// pass's selection.
    Segments(&'a [Range<usize>], &'a SharedSelection),
    /// Inference (grouped-query attention): this layer's cache, which the new rows' keys and
    /// values extend first.
    Cached {
        /// Keys `[slots, capacity, kw]` of every cached sequence.
        keys: &'a mut T,
        /// Values, alike.
        values: &'a mut T,
        /// Each sequence's new rows.
        segments: &'a [Segment],
    },
    /// Inference (multi-latent attention): this layer's cache of the compressed latent, which
    /// the new rows extend first, attended through the up projection absorbed into the
    /// queries and the output.
    Latent {
        /// The normed key-value latent and the rotated shared key part `[slots, capacity,
        /// kv_lora + dr]` of every cached sequence.
        cache: &'a mut T,
        /// The layer's up projection, by head.
        absorbed: &'a Absorbed<T>,
        /// Each sequence's new rows.
        segments: &'a [Segment],
    },
}

/// The log-sum-exp a training forward pass kept for the backward pass (none where it attended
/// over a cache), and the output gradient `dy` with every rank's rows under sequence
/// parallelism.
pub(in crate::model) fn backward_inputs<'a, B: Backend>(
    p: &Pass<B>,
    lse: &'a Option<B::Tensor>,
    dy: &B::Tensor,
) -> Result<(&'a B::Tensor, Option<B::Tensor>)> {
    let Some(lse) = lse else {
        return Err(crate::engine::EngineError::Invalid {
            op: "attention backward",
            msg: "the forward pass attended over a cache and kept no statistics".into(),
        });
    };
    Ok((lse, crate::model::parallel::gathered(p.b, p.tp, dy)?))
}

impl<T> AttentionSaved<T> {
    /// The DeepSeek sparse attention indexer loss of its forward pass, where its layer
    /// computed one (training).
    pub(in crate::model) fn indexer_loss(&self) -> Option<f32> {
        match self {
            AttentionSaved::Mla(s) => s.indexer_loss(),
            AttentionSaved::Gqa(_) => None,
        }
    }
}

impl Attention {
    /// Layer `layer`'s attention in `table`, `None` if the table lacks it.
    pub(in crate::model) fn of(table: &ParamTable, layer: usize) -> Option<Attention> {
        (Gqa::of(table, layer).map(Attention::Gqa))
            .or_else(|| Mla::of(table, layer).map(Attention::Mla))
    }

    /// Whether inference absorbs its key-value up projection ([`Absorbed`]): multi-latent
    /// attention's.
    pub(in crate::model) fn absorbs(&self) -> bool {
        matches!(self, Attention::Mla(_))
    }

    /// The attention of the normed input `h [T, h]`: its output `[T, h]` (summed over the
    /// tensor-parallel ranks) and what the backward pass needs.
    pub(in crate::model) fn forward<B: Backend>(
        &self,
        p: &Pass<B>,
        h: B::Tensor,
        attend: Attend<B::Tensor>,
    ) -> Result<(B::Tensor, AttentionSaved<B::Tensor>)> {
        match self {
            Attention::Gqa(a) => {
                let (out, saved) = a.forward(p, h, attend)?;
                Ok((out, AttentionSaved::Gqa(saved)))
            }
            Attention::Mla(a) => {
                let (out, saved) = a.forward(p, h, attend)?;
                Ok((out, AttentionSaved::Mla(saved)))
            }
        }
    }

    /// The gradient of the normed input given `dy`, the gradient of the output, over the
    /// row ranges the forward pass attended within; accumulates the parameters' gradients.
    pub(in crate::model) fn backward<B: Backend>(
        &self,
        p: &Pass<B>,
        grads: &mut [B::Tensor],
        saved: AttentionSaved<B::Tensor>,
        dy: (&B::Tensor, &[Range<usize>]),
    ) -> Result<B::Tensor> {
        match (self, saved) {
            (Attention::Gqa(a), AttentionSaved::Gqa(s)) => a.backward(p, grads, s, dy),
            (Attention::Mla(a), AttentionSaved::Mla(s)) => a.backward(p, grads, s, dy),
            _ => unreachable!("an attention's saved state is its own kind's"),
        }
    }
}

/// RoPE on the rotated parts `x [n, heads·dr]`, de-interleaved first (forward) or
/// re-interleaved after the inverse rotation (backward).
pub(in crate::model) fn rotate<B: Backend>(
    p: &crate::model::Pass<B>,
    x: &mut B::Tensor,
    heads: usize,
    inverse: bool,
) -> Result<()> {
    let b = p.b;
    let n = b.shape(x)[0];
    let dr = b.shape(x)[1] / heads.max(1);
    let half = dr / 2;
    // element (row, head, i, j) at pair i, member j: interleaved (2i + j), halves (j·half + i)
    let interleaved = crate::engine::StridedView {
        shape: [n * heads, 2, half],
        strides: [dr, 1, 2],
        offset: 0,
    };
    let (cos, sin) = p.rope;
    if !inverse {
        *x = b.gather(x, interleaved, &[n, heads * dr])?;
        return b.rope(x, cos, sin, dr, false);
    }
    b.rope(x, cos, sin, dr, true)?;
    let mut out = b.zeros(&[n, heads * dr], b.dtype(x))?;
    b.scatter(x, &mut out, interleaved)?;
    *x = out;
    Ok(())
}
