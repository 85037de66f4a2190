//! The one decoder layer every family runs, in training and in inference: input norm →
//! attention kind → residual sum → norm → MLP kind → residual sum (megatron-core
//! megatron/core/transformer/transformer_layer.py `TransformerLayer`). A family is the kinds
//! it composes ([`Attention`], [`Mlp`]), never a copy of this code.
//!
//! A paired model's layers ([`crate::arch::ModelConfig::paired`], LongCat-Flash: MindSpeed-LLM
//! mindspeed_llm/tasks/models/transformer/longcat_transformer_layer.py) are this layer twice:
//! the first also routes its MLP's normed input through a mixture of experts ([`Shortcut`])
//! whose output the second adds to its own after its MLP's residual sum.
//!
//! Legend: T = rows (this rank's block of them under sequence parallelism), h = hidden.

use super::attention::{Attend, Attention, AttentionSaved};
use super::dropout::dropped;
use super::mlp::moe::{Moe, Saved as MoeSaved};
use super::mlp::{Mlp, MlpSaved};
use super::norm::{Norm, NormSaved};
use super::params::ParamTable;
use super::Pass;
use crate::arch::roles::Role;
use crate::engine::dropout::Site;
use crate::engine::{Backend, Result};
use std::ops::Range;

/// Where one layer's parameters sit in the table, by kind.
#[derive(Debug, Clone)]
pub(super) struct Layer {
    /// Its index in the whole model.
    index: usize,
    /// The norm before the attention.
    input_norm: Norm,
    attention: Attention,
    /// The norm before the MLP.
    post_norm: Norm,
    mlp: Mlp,
    /// Its part in a paired model's shortcut experts.
    shortcut: Option<Shortcut>,
}

/// A layer's part in a paired model's shortcut mixture of experts.
#[derive(Debug, Clone)]
enum Shortcut {
    /// It routes its MLP's normed input through these experts (the first of a pair).
    Routes(Moe),
    /// It adds the output of the experts the layer before it routed (the second).
    Adds,
}

/// What flows from a pair's first layer to its second: in the forward pass the shortcut
/// experts' output `[T, h]`, in the backward pass its gradient.
pub(super) type Carry<T> = Option<T>;

/// What one layer's backward pass needs of its forward pass.
pub(super) struct LayerSaved<T> {
    /// The input norm's: the layer's input (residual) `[T, h]` and its statistics.
    norm1: NormSaved<T>,
    attention: AttentionSaved<T>,
    /// The second norm's: the residual after the attention `[T, h]` and its statistics.
    norm2: NormSaved<T>,
    mlp: MlpSaved<T>,
    shortcut: Option<MoeSaved<T>>,
}

impl<T> LayerSaved<T> {
    /// Its attention's DeepSeek sparse attention indexer loss (training, where it has one).
    pub(super) fn indexer_loss(&self) -> Option<f32> {
        self.attention.indexer_loss()
    }

    /// Its MoE block's losses and token counts (training only).
    pub(super) fn moe_stats(&self) -> Option<&super::mlp::moe::losses::RouterStats> {
        match &self.shortcut {
            Some(s) => s.stats(),
            None => self.mlp.moe_stats(),
        }
    }
}

impl Layer {
    /// Its index in the whole model.
    pub(super) fn index(&self) -> usize {
        self.index
    }

    /// Whether inference absorbs its attention's key-value up projection (multi-latent
    /// attention's).
    pub(super) fn absorbs(&self) -> bool {
        self.attention.absorbs()
    }

    /// Layer `layer` of `table`, `None` if the table lacks any of its parameters.
    pub(super) fn of(table: &ParamTable, layer: usize) -> Option<Layer> {
        let mlp = Mlp::of(table, layer)?;
        let routes = |l| match Mlp::of(table, l) {
            Some(Mlp::Dense(_)) => Moe::of(table, l),
            _ => None,
        };
        let shortcut = match routes(layer) {
            Some(moe) => Some(Shortcut::Routes(moe)),
            None if layer > 0 && routes(layer - 1).is_some() => Some(Shortcut::Adds),
            None => None,
        };
        Some(Layer {
            index: layer,
            input_norm: Norm::of(table, Role::InputNorm, Some(layer))?,
            attention: Attention::of(table, layer)?,
            post_norm: Norm::of(table, Role::PostNorm, Some(layer))?,
            mlp,
            shortcut,
        })
    }

    /// The layer's output `[T, h]` for input `x [T, h]`, and what the backward pass needs;
    /// `carry` takes the shortcut experts' output from a pair's first layer to its second.
    pub(super) fn forward<B: Backend>(
        &self,
        p: &Pass<B>,
        (x, carry): (B::Tensor, &mut Carry<B::Tensor>),
        attend: Attend<B::Tensor>,
    ) -> Result<(B::Tensor, LayerSaved<B::Tensor>)> {
        let b = p.b;
        let (h1, norm1) = self.input_norm.forward(p, x)?;
        // Each sum is `residual + dropout(output)` (hidden dropout in training).
        let (attended, attention) = self.attention.forward(p, h1, attend)?;
        let at = (self.index, Site::AttentionOutput);
        let mut x_mid = dropped(p, &attended, at)?.unwrap_or(attended);
        b.add_assign(&mut x_mid, &norm1.x)?;
        let (h2, norm2) = self.post_norm.forward(p, x_mid)?;
        let shortcut = match &self.shortcut {
            Some(Shortcut::Routes(moe)) => {
                let (routed, saved) = moe.forward(p, b.cast(&h2, b.dtype(&h2))?)?;
                *carry = Some(routed);
                Some(saved)
            }
            _ => None,
        };
        let (mlp_out, mlp) = self.mlp.forward(p, h2)?;
        let mut out = dropped(p, &mlp_out, (self.index, Site::MlpOutput))?.unwrap_or(mlp_out);
        b.add_assign(&mut out, &norm2.x)?;
        if let Some(Shortcut::Adds) = self.shortcut {
            b.add_assign(&mut out, &take_carry(carry)?)?;
        }
        let saved = LayerSaved {
            norm1,
            attention,
            norm2,
            mlp,
            shortcut,
        };
        Ok((out, saved))
    }

    /// The gradient of the layer's input given `dout`, the gradient of its output (the
    /// forward pass attended within `segments`); accumulates the parameters' gradients.
    /// `carry` takes the gradient of the shortcut experts' output from a pair's second layer
    /// back to its first.
    pub(super) fn backward<B: Backend>(
        &self,
        p: &Pass<B>,
        grads: &mut [B::Tensor],
        s: LayerSaved<B::Tensor>,
        (dout, segments, carry): (B::Tensor, &[Range<usize>], &mut Carry<B::Tensor>),
    ) -> Result<B::Tensor> {
        let b = p.b;
        if let Some(Shortcut::Adds) = self.shortcut {
            *carry = Some(b.cast(&dout, b.dtype(&dout))?);
        }
        // out = x_mid + dropout(mlp(norm(x_mid))): dout flows to both.
        let dmlp = dropped(p, &dout, (self.index, Site::MlpOutput))?;
        let mut dh2 = self
            .mlp
            .backward(p, grads, s.mlp, dmlp.as_ref().unwrap_or(&dout))?;
        if let (Some(Shortcut::Routes(moe)), Some(saved)) = (&self.shortcut, s.shortcut) {
            let routed = moe.backward(p, grads, saved, &take_carry(carry)?)?;
            b.add_assign(&mut dh2, &routed)?;
        }
        let mut dx_mid = self.post_norm.backward(p, grads, &dh2, &s.norm2)?;
        b.add_assign(&mut dx_mid, &dout)?;
        // x_mid = x + dropout(attention(norm(x))).
        let dattn = dropped(p, &dx_mid, (self.index, Site::AttentionOutput))?;
        let dh1 = self.attention.backward(
            p,
            grads,
            s.attention,
            (dattn.as_ref().unwrap_or(&dx_mid), segments),
        )?;
        let mut dx = self.input_norm.backward(p, grads, &dh1, &s.norm1)?;
        b.add_assign(&mut dx, &dx_mid)?;
        Ok(dx)
    }
}

/// What a pair's first layer handed its second (or the second its first), taken.
fn take_carry<T>(carry: &mut Carry<T>) -> Result<T> {
    carry
        .take()
        .ok_or_else(|| crate::engine::EngineError::Invalid {
            op: "paired layer",
            msg: "the second layer of a pair ran without its first".into(),
        })
}

/// `dx` of `y = rms_norm(x)·γ` given `dy`, accumulating γ's gradient (parameter `gamma`) when
/// it is trained.
pub(in crate::model) fn rms_grad<B: Backend>(
    p: &Pass<B>,
    grads: &mut [B::Tensor],
    (dy, x): (&B::Tensor, &B::Tensor),
    gamma: usize,
    rstd: &B::Tensor,
) -> Result<B::Tensor> {
    let dgamma = p.trainable[gamma].then(|| &mut grads[gamma]);
    p.b.rms_norm_bwd(dy, x, &p.params[gamma], rstd, dgamma)
}
