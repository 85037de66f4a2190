//! Multi-token prediction's depths after the decoder (megatron-core megatron/core/transformer/
//! multi_token_prediction.py `MultiTokenPredictionLayer`; MindSpeed-LLM mindspeed_llm/core/
//! transformer/multi_token_prediction.py `mtp_layer_forward`, `mtp_block_forward`), forward and
//! backward, on the last pipeline stage: depth k embeds the ids rolled k + 1 ahead, normalises
//! that embedding and the hidden state it is handed, projects their concatenation `[e; h]`
//! (`eh_proj`, column-parallel: its output gathered over the tensor-parallel ranks, as
//! megatron-core 0.15's `gather_from_tensor_model_parallel_region`, whose backward takes this
//! rank's columns), runs one decoder [`Layer`], and scores the next-but-k tokens through its own
//! final norm and the shared output layer. What it hands to depth k + 1 is its output, normed
//! (megatron-core) or not (MindSpeed-LLM, DeepSeek-V3): [`crate::arch::MtpLayout`].
//!
//! Legend: T = rows (this rank's block of them under sequence parallelism), h = hidden.

use super::attention::Attend;
use super::columns::{assemble, columns, columns_gathered, own_columns, own_rows};
use super::decoder::{head_backward, head_forward, DepthRows, HeadSaved};
use super::dropout::dropped;
use super::layer::{rms_grad, Layer, LayerSaved};
use super::linear::Linear;
use super::norm::{Head, Norm};
use super::parallel::{gathered, local_ids, reduced};
use super::params::ParamTable;
use super::Pass;
use crate::arch::roles::{Canon, Role};
use crate::engine::dropout::Site;
use crate::engine::{Backend, Result};
use crate::tensor::DType;

/// Where one depth's parameters sit in the table.
#[derive(Debug, Clone)]
pub(super) struct Depth {
    /// Its canonical layer (the decoder's layers + its depth).
    index: usize,
    /// RMSNorm γ `[h]` of the embedding (`enorm`) and of the hidden state (`hnorm`).
    embed_norm: usize,
    hidden_norm: usize,
    /// `eh_proj [h, 2h]` (this rank's rows).
    proj: Linear,
    layer: Layer,
    /// Its final norm γ `[h]`.
    norm: usize,
}

/// What one depth's backward pass needs of its forward pass.
pub(super) struct DepthSaved<T> {
    /// Its canonical layer.
    index: usize,
    /// The embedding `[T, h]` and the rstds `[T]` of its norm and of the hidden state's.
    e: T,
    rstd_e: T,
    rstd_h: T,
    /// `[enorm(e); hnorm(h)]` `[T, 2h]`, every row under sequence parallelism.
    c: T,
    layer: LayerSaved<T>,
    /// Its final norm, output layer and loss.
    pub(super) head: HeadSaved<T>,
}

impl<T> DepthSaved<T> {
    /// Its MoE block's losses and token counts (training), by its canonical layer.
    pub(super) fn moe_stats(&self) -> (usize, Option<&super::mlp::moe::losses::RouterStats>) {
        (self.index, self.layer.moe_stats())
    }

    /// Its attention's indexer loss (training, under DeepSeek sparse attention), by its
    /// canonical layer.
    pub(super) fn indexer_loss(&self) -> (usize, Option<f32>) {
        (self.index, self.layer.indexer_loss())
    }
}

impl Depth {
    /// The depths of `table` (none without multi-token prediction, or off its last stage).
    pub(super) fn all_of(table: &ParamTable) -> Option<Vec<Depth>> {
        let mut out = Vec::new();
        for l in table.decoder_layers.. {
            let at = |role| {
                table.index(Canon {
                    role,
                    layer: Some(l),
                })
            };
            let Some(proj) = Linear::of(table, (Role::MtpProj, None), Some(l)) else {
                break;
            };
            out.push(Depth {
                index: l,
                embed_norm: at(Role::MtpEmbedNorm)?,
                hidden_norm: at(Role::MtpHiddenNorm)?,
                proj,
                layer: Layer::of(table, l)?,
                norm: at(Role::MtpNorm)?,
            });
        }
        Some(out)
    }

    /// The depth's per-row losses `[T]` against `rows.labels`, given the hidden state `hand`
    /// it is handed and the embedding table `embedding`, and what its backward pass needs.
    pub(super) fn forward<B: Backend>(
        &self,
        p: &Pass<B>,
        (hand, embedding): (&B::Tensor, usize),
        rows: &DepthRows,
        (activations, output): (DType, Linear),
    ) -> Result<(B::Tensor, DepthSaved<B::Tensor>)> {
        let (b, eps, h) = (p.b, p.spec.norm_eps, p.spec.hidden);
        let mut e = b.embedding(&p.params[embedding], &local_ids(p.tp, &rows.tokens))?;
        if activations != DType::F32 {
            e = b.cast(&e, activations)?;
        }
        let e = reduced(b, p.tp, e)?;
        let e = dropped(p, &e, (self.index, Site::Embedding))?.unwrap_or(e);
        let (en, rstd_e) = b.rms_norm(&e, &p.params[self.embed_norm], eps)?;
        let (hn, rstd_h) = b.rms_norm(hand, &p.params[self.hidden_norm], eps)?;
        let n = b.shape(&en)[0];
        let c = assemble(b, n, 1, 2 * h, &[(&en, h, 0), (&hn, h, h)])?;
        let c = gathered(b, p.tp, &c)?.unwrap_or(c);
        let (y, _) = self.proj.forward(p, &c)?;
        let y = own_rows(b, p.tp, columns_gathered(b, p.tp, y)?)?;
        let (out, layer) = self.layer.forward(
            p,
            (y, &mut None),
            Attend::Segments(&rows.segments, &Default::default()),
        )?;
        let head_at = Head {
            norm: Norm::rms(self.norm),
            output,
        };
        let (loss, head) = head_forward(p, out, &head_at, &rows.labels)?;
        let saved = DepthSaved {
            index: self.index,
            e,
            rstd_e,
            rstd_h,
            c,
            layer,
            head,
        };
        Ok((loss, saved))
    }

    /// The gradient of the hidden state the depth was handed (`hand`), for the objective
    /// `Σ rows.dloss · loss` and `dnext`, the next depth's gradient of what this one handed it
    /// (its output, or that normed: `normed`); accumulates the parameters' gradients, the
    /// embedding's into `embedding`'s.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn backward<B: Backend>(
        &self,
        p: &Pass<B>,
        grads: &mut [B::Tensor],
        (s, hand, rows): (DepthSaved<B::Tensor>, &B::Tensor, &DepthRows),
        (embedding, output): (usize, Linear),
        (dnext, normed): (Option<B::Tensor>, bool),
    ) -> Result<B::Tensor> {
        let (b, h) = (p.b, p.spec.hidden);
        let targets = (&rows.labels[..], &rows.dloss[..]);
        let (to_norm, to_out) = match normed {
            true => (dnext, None),
            false => (None, dnext),
        };
        let head_at = Head {
            norm: Norm::rms(self.norm),
            output,
        };
        let mut dout = head_backward(p, grads, targets, s.head, &head_at, to_norm)?;
        if let Some(d) = to_out {
            b.add_assign(&mut dout, &d)?;
        }
        let dy = self
            .layer
            .backward(p, grads, s.layer, (dout, &rows.segments, &mut None))?;
        let dy = gathered(b, p.tp, &dy)?.unwrap_or(dy);
        let dy = own_columns(b, p.tp, dy)?;
        let dc = self.proj.backward(p, grads, &dy, (&s.c, None))?;
        let dc = reduced(b, p.tp, dc)?;
        let (den, dhn) = (columns(b, &dc, 0, h)?, columns(b, &dc, h, h)?);
        let de = rms_grad(p, grads, (&den, &s.e), self.embed_norm, &s.rstd_e)?;
        let dhand = rms_grad(p, grads, (&dhn, hand), self.hidden_norm, &s.rstd_h)?;
        if p.trainable[embedding] {
            let de = dropped(p, &de, (self.index, Site::Embedding))?.unwrap_or(de);
            let all = gathered(b, p.tp, &de)?;
            let tokens = local_ids(p.tp, &rows.tokens);
            b.embedding_bwd(all.as_ref().unwrap_or(&de), &tokens, &mut grads[embedding])?;
        }
        Ok(dhand)
    }
}
