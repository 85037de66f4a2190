//! The dense MLP, Megatron's `MLP` (megatron-core megatron/core/transformer/mlp.py): linear_fc1,
//! the activation, linear_fc2 — with `--swiglu` fc1 to `[gate; up]` and `silu(gate)·up`, with
//! `--squared-relu` fc1 to one projection and `relu(x)²` ([`Activation`]). Its rank-local
//! part ([`Ffn`]) is also each expert of an MoE layer (SwiGLU), there with the activation
//! scaled per token by the routing weight (`MLP.forward`'s `per_token_scale`).
//!
//! Legend: T = rows, h = hidden, F = ffn (this rank's columns under tensor parallelism).

use crate::arch::roles::Role;
use crate::arch::Activation;
use crate::engine::{Backend, Result};
use crate::model::linear::Linear;
use crate::model::parallel::{gathered, reduced};
use crate::model::params::ParamTable;
use crate::model::Pass;

/// linear_fc1 `[2F, h]` (gated) or `[F, h]` (column-parallel), the activation and
/// linear_fc2 `[h, F]` (row-parallel).
#[derive(Debug, Clone, Copy)]
pub(in crate::model) struct Ffn {
    fc1: Linear,
    fc2: Linear,
    act: Activation,
}

/// What [`Ffn::backward`] needs of [`Ffn::forward`].
pub(in crate::model) struct FfnSaved<T> {
    /// fc1's output `[T, 2F]` or `[T, F]`, the activation `[T, F]` and, when scaled per row,
    /// fc2's input.
    up: T,
    act: T,
    scaled: Option<T>,
    /// `x·Aᵀ` of the adapters of linear_fc1 and linear_fc2.
    lora: [Option<T>; 2],
}

impl Ffn {
    /// The pair of `(fc1, fc2)` roles in layer `layer` of `table` with activation `act`
    /// between them, `None` if it lacks them.
    pub(in crate::model) fn of(
        table: &ParamTable,
        (fc1, fc2): (Role, Role),
        layer: usize,
        act: Activation,
    ) -> Option<Ffn> {
        let at = Some(layer);
        Some(Ffn {
            fc1: Linear::of(table, (fc1, None), at)?,
            fc2: Linear::of(table, (fc2, None), at)?,
            act,
        })
    }

    /// The weights of linear_fc1 and linear_fc2 when they are bare ([`Linear::bare`]).
    pub(in crate::model) fn bare(&self) -> Option<(usize, usize)> {
        self.fc1.bare().zip(self.fc2.bare())
    }

    /// This rank's partial sum `fc2(act(fc1(x)) · w) [T, h]` (no collectives), `w [T]` the
    /// optional per-row scale of the activation.
    pub(in crate::model) fn forward<B: Backend>(
        &self,
        p: &Pass<B>,
        x: &B::Tensor,
        w: Option<&B::Tensor>,
    ) -> Result<(B::Tensor, FfnSaved<B::Tensor>)> {
        let b = p.b;
        let (up, u_fc1) = self.fc1.forward(p, x)?;
        let act = match self.act {
            Activation::SwiGlu => b.swiglu(&up)?,
            Activation::SquaredRelu => b.squared_relu(&up)?,
        };
        let scaled = w.map(|w| b.scale_rows(&act, w)).transpose()?;
        let (out, u_fc2) = self.fc2.forward(p, scaled.as_ref().unwrap_or(&act))?;
        let saved = FfnSaved {
            up,
            act,
            scaled,
            lora: [u_fc1, u_fc2],
        };
        Ok((out, saved))
    }

    /// `dx [T, h]` (a partial sum over the tensor-parallel ranks) of [`Ffn::forward`] given
    /// its input `x` and the gradient `dy` of its output, accumulating the parameters'
    /// gradients; with a row scale `w`, also its gradient (this rank's columns' part).
    pub(in crate::model) fn backward<B: Backend>(
        &self,
        p: &Pass<B>,
        grads: &mut [B::Tensor],
        s: FfnSaved<B::Tensor>,
        (x, dy, w): (&B::Tensor, &B::Tensor, Option<&B::Tensor>),
    ) -> Result<(B::Tensor, Option<Vec<f32>>)> {
        let b = p.b;
        let [u_fc1, u_fc2] = &s.lora;
        let fc2_in = s.scaled.as_ref().unwrap_or(&s.act);
        let dfc2_in = self.fc2.backward(p, grads, dy, (fc2_in, u_fc2.as_ref()))?;
        let (dact, dw) = match w {
            Some(w) => (
                b.scale_rows(&dfc2_in, w)?,
                Some(b.row_dots(&dfc2_in, &s.act)?),
            ),
            None => (dfc2_in, None),
        };
        let dup = match self.act {
            Activation::SwiGlu => b.swiglu_bwd(&dact, &s.up)?,
            Activation::SquaredRelu => b.squared_relu_bwd(&dact, &s.up)?,
        };
        let dx = self.fc1.backward(p, grads, &dup, (x, u_fc1.as_ref()))?;
        Ok((dx, dw))
    }
}

/// The parameters of one layer's dense MLP.
#[derive(Debug, Clone, Copy)]
pub(in crate::model) struct Dense(Ffn);

/// What the backward pass needs of the forward pass.
pub(in crate::model) struct Saved<T> {
    /// The normed input `[T, h]` (this rank's rows under sequence parallelism).
    h: T,
    ffn: FfnSaved<T>,
}

impl Dense {
    /// Layer `layer`'s MLP in `table`, `None` if the table lacks it.
    pub(in crate::model) fn of(table: &ParamTable, layer: usize) -> Option<Dense> {
        let fc1 = match table.activation.gated() {
            true => Role::Fc1,
            false => Role::Up,
        };
        Ffn::of(table, (fc1, Role::Fc2), layer, table.activation).map(Dense)
    }

    /// `fc2(act(fc1(h)))` summed over the tensor-parallel ranks: `[T, h]`.
    pub(in crate::model) fn forward<B: Backend>(
        &self,
        p: &Pass<B>,
        h: B::Tensor,
    ) -> Result<(B::Tensor, Saved<B::Tensor>)> {
        let all = gathered(p.b, p.tp, &h)?;
        let (out, ffn) = self.0.forward(p, all.as_ref().unwrap_or(&h), None)?;
        Ok((reduced(p.b, p.tp, out)?, Saved { h, ffn }))
    }

    /// `dh [T, h]` of [`Dense::forward`] given the gradient `dy [T, h]` of its output,
    /// accumulating the parameters' gradients.
    pub(in crate::model) fn backward<B: Backend>(
        &self,
        p: &Pass<B>,
        grads: &mut [B::Tensor],
        s: Saved<B::Tensor>,
        dy: &B::Tensor,
    ) -> Result<B::Tensor> {
        let b = p.b;
        let dy_all = gathered(b, p.tp, dy)?;
        // Megatron re-gathers the input for the weight gradients rather than keep it.
        let h_all = gathered(b, p.tp, &s.h)?;
        let (dh, _) = self.0.backward(
            p,
            grads,
            s.ffn,
            (
                h_all.as_ref().unwrap_or(&s.h),
                dy_all.as_ref().unwrap_or(dy),
                None,
            ),
        )?;
        reduced(b, p.tp, dh)
    }
}
