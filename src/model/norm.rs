//! A norm of the residual stream: RMSNorm γ (the LLaMA family), or LayerNorm γ and β
//! (`--normalization LayerNorm`, [`crate::arch::ModelConfig::layer_norm`]; megatron-core's
//! local spec builds `FusedLayerNorm`, MindSpeed-LLM's `PTNorm` a `torch.nn.LayerNorm`),
//! forward and backward. Which it is follows from the table: a LayerNorm's β is there.
//!
//! Legend: T = rows, h = hidden.

use super::linear::{two_mut, Linear};
use super::params::ParamTable;
use super::Pass;
use crate::arch::roles::{Canon, Role};
use crate::engine::{Backend, Result};

/// A norm's parameters in the table: γ `[h]`, and a LayerNorm's β `[h]`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Norm {
    gamma: usize,
    beta: Option<usize>,
}

/// The final norm and the output layer (its weight the embedding's where tied).
#[derive(Debug, Clone, Copy)]
pub(super) struct Head {
    pub(super) norm: Norm,
    pub(super) output: Linear,
}

/// What a norm's backward pass needs of its forward pass: its input `[T, h]` and the rows'
/// statistics (RMSNorm's `rstd [T]`, LayerNorm's means and rstds `[2T]`), f32.
pub(super) struct NormSaved<T> {
    pub(super) x: T,
    stats: T,
}

impl Norm {
    /// The norm of role `role` (`InputNorm`, `PostNorm`, `FinalNorm`) in layer `layer` of
    /// `table` with its bias when the table holds one; `None` if it lacks γ.
    pub(super) fn of(table: &ParamTable, role: Role, layer: Option<usize>) -> Option<Norm> {
        let at = |role| table.index(Canon { role, layer });
        Some(Norm {
            gamma: at(role)?,
            beta: at(role.norm_bias()),
        })
    }

    /// The normed `x [T, h]`, and what the backward pass needs (`x` kept).
    pub(super) fn forward<B: Backend>(
        &self,
        p: &Pass<B>,
        x: B::Tensor,
    ) -> Result<(B::Tensor, NormSaved<B::Tensor>)> {
        self.forward_eps(p, x, p.spec.norm_eps)
    }

    /// [`Norm::forward`] with its own `eps`.
    pub(super) fn forward_eps<B: Backend>(
        &self,
        p: &Pass<B>,
        x: B::Tensor,
        eps: f64,
    ) -> Result<(B::Tensor, NormSaved<B::Tensor>)> {
        let (b, gamma) = (p.b, &p.params[self.gamma]);
        let (y, stats) = match self.beta {
            Some(beta) => b.layer_norm(&x, (gamma, &p.params[beta]), eps)?,
            None => b.rms_norm(&x, gamma, eps)?,
        };
        Ok((y, NormSaved { x, stats }))
    }

    /// An RMSNorm of γ `gamma` (a multi-token prediction depth's).
    pub(super) fn rms(gamma: usize) -> Norm {
        Norm { gamma, beta: None }
    }

    /// The normed `x` alone (inference).
    pub(super) fn apply<B: Backend>(&self, p: &Pass<B>, x: B::Tensor) -> Result<B::Tensor> {
        Ok(self.forward(p, x)?.0)
    }

    /// `dx [T, h]` given `dy`, the gradient of the normed output; accumulates the gradients
    /// of γ and β where they are trained.
    pub(super) fn backward<B: Backend>(
        &self,
        p: &Pass<B>,
        grads: &mut [B::Tensor],
        dy: &B::Tensor,
        s: &NormSaved<B::Tensor>,
    ) -> Result<B::Tensor> {
        let (b, gamma) = (p.b, &p.params[self.gamma]);
        let Some(beta) = self.beta else {
            let dgamma = p.trainable[self.gamma].then(|| &mut grads[self.gamma]);
            return b.rms_norm_bwd(dy, &s.x, gamma, &s.stats, dgamma);
        };
        let (dgamma, dbeta) = two_mut(grads, self.gamma, beta);
        let dgamma = p.trainable[self.gamma].then_some(dgamma);
        let dbeta = p.trainable[beta].then_some(dbeta);
        b.layer_norm_bwd((dy, &s.x), gamma, &s.stats, (dgamma, dbeta))
    }
}
