//! The MLP kinds of the decoder layer: what sits between the layer's second norm and its
//! second residual sum, each with a forward pass returning its output and what its backward
//! pass needs, and that backward pass.

mod dense;
pub(in crate::model) mod moe;

use crate::engine::{Backend, Result};
use crate::model::params::ParamTable;
use crate::model::Pass;
use dense::Dense;
use moe::Moe;

/// A layer's MLP.
#[derive(Debug, Clone)]
pub(in crate::model) enum Mlp {
    /// The dense MLP.
    Dense(Dense),
    /// Routed experts (and shared ones).
    Moe(Moe),
}

/// What an MLP's backward pass needs of its forward pass.
pub(in crate::model) enum MlpSaved<T> {
    /// Of [`Mlp::Dense`].
    Dense(dense::Saved<T>),
    /// Of [`Mlp::Moe`].
    Moe(moe::Saved<T>),
}

impl<T> MlpSaved<T> {
    /// An MoE layer's losses and token counts of the forward pass (training only).
    pub(in crate::model) fn moe_stats(&self) -> Option<&moe::losses::RouterStats> {
        match self {
            MlpSaved::Moe(s) => s.stats(),
            MlpSaved::Dense(_) => None,
        }
    }
}

impl Mlp {
    /// Layer `layer`'s MLP in `table`, `None` if the table lacks it.
    pub(in crate::model) fn of(table: &ParamTable, layer: usize) -> Option<Mlp> {
        match Dense::of(table, layer) {
            Some(d) => Some(Mlp::Dense(d)),
            None => Moe::of(table, layer).map(Mlp::Moe),
        }
    }

    /// The MLP of the normed input `h [T, h]`: its output `[T, h]` (summed over the
    /// tensor-parallel ranks) and what the backward pass needs.
    pub(in crate::model) fn forward<B: Backend>(
        &self,
        p: &Pass<B>,
        h: B::Tensor,
    ) -> Result<(B::Tensor, MlpSaved<B::Tensor>)> {
        match self {
            Mlp::Dense(m) => {
                let (out, saved) = m.forward(p, h)?;
                Ok((out, MlpSaved::Dense(saved)))
            }
            Mlp::Moe(m) => {
                let (out, saved) = m.forward(p, h)?;
                Ok((out, MlpSaved::Moe(saved)))
            }
        }
    }

    /// The gradient of the normed input given `dy`, the gradient of the output; accumulates
    /// the parameters' gradients.
    pub(in crate::model) fn backward<B: Backend>(
        &self,
        p: &Pass<B>,
        grads: &mut [B::Tensor],
        saved: MlpSaved<B::Tensor>,
        dy: &B::Tensor,
    ) -> Result<B::Tensor> {
        match (self, saved) {
            (Mlp::Dense(m), MlpSaved::Dense(s)) => m.backward(p, grads, s, dy),
            (Mlp::Moe(m), MlpSaved::Moe(s)) => m.backward(p, grads, s, dy),
            _ => unreachable!("an MLP's saved values are its own kind's"),
        }
    }
}
