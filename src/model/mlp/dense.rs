//! The dense SwiGLU MLP, Megatron's `MLP` with `--swiglu`: linear_fc1 to `[gate; up]`,
//! `silu(gate)·up`, linear_fc2 (megatron-core megatron/core/transformer/mlp.py). Its
//! rank-local part ([`SwiGlu`]) is also each expert of an MoE layer, there with the
//! activation scaled per token by the routing weight (`MLP.forward`'s `per_token_scale`).
//!
//! Legend: T = rows, h = hidden, F = ffn (this rank's columns under tensor parallelism).

use crate::arch::roles::Role;
use crate::engine::{Backend, Result};
use crate::model::linear::Linear;
use crate::model::parallel::{gathered, reduced};
use crate::model::params::ParamTable;
use crate::model::Pass;

/// linear_fc1 `[2F, h]` (column-parallel) and linear_fc2 `[h, F]` (row-parallel).
#[derive(Debug, Clone, Copy)]
pub(in crate::model) struct SwiGlu {
    fc1: Linear,
    fc2: Linear,
}

/// What [`SwiGlu::backward`] needs of [`SwiGlu::forward`].
pub(in crate::model) struct SwiGluSaved<T> {
    /// fc1's output `[T, 2F]`, the SwiGLU `[T, F]` and, when scaled per row, fc2's input.
    up: T,
    act: T,
    scaled: Option<T>,
    /// `x·Aᵀ` of the adapters of linear_fc1 and linear_fc2.
    lora: [Option<T>; 2],
}

impl SwiGlu {
    /// The pair of `(fc1, fc2)` roles in layer `layer` of `table`, `None` if it lacks them.
    pub(in crate::model) fn of(
        table: &ParamTable,
        (fc1, fc2): (Role, Role),
        layer: usize,
    ) -> Option<SwiGlu> {
        let at = Some(layer);
        Some(SwiGlu {
            fc1: Linear::of(table, (fc1, None), at)?,
            fc2: Linear::of(table, (fc2, None), at)?,
        })
    }

    /// The weights of linear_fc1 and linear_fc2 when they are bare ([`Linear::bare`]).
    pub(in crate::model) fn bare(&self) -> Option<(usize, usize)> {
        self.fc1.bare().zip(self.fc2.bare())
    }

    /// This rank's partial sum `fc2(swiglu(fc1(x)) · w) [T, h]` (no collectives), `w [T]` the
    /// optional per-row scale of the activation.
    pub(in crate::model) fn forward<B: Backend>(
        &self,
        p: &Pass<B>,
        x: &B::Tensor,
        w: Option<&B::Tensor>,
    ) -> Result<(B::Tensor, SwiGluSaved<B::Tensor>)> {
        let b = p.b;
        let (up, u_fc1) = self.fc1.forward(p, x)?;
        let act = b.swiglu(&up)?;
        let scaled = w.map(|w| b.scale_rows(&act, w)).transpose()?;
        let (out, u_fc2) = self.fc2.forward(p, scaled.as_ref().unwrap_or(&act))?;
        let saved = SwiGluSaved {
            up,
            act,
            scaled,
            lora: [u_fc1, u_fc2],
        };
        Ok((out, saved))
    }

    /// `dx [T, h]` (a partial sum over the tensor-parallel ranks) of [`SwiGlu::forward`] given
    /// its input `x` and the gradient `dy` of its output, accumulating the parameters'
    /// gradients; with a row scale `w`, also its gradient (this rank's columns' part).
    pub(in crate::model) fn backward<B: Backend>(
        &self,
        p: &Pass<B>,
        grads: &mut [B::Tensor],
        s: SwiGluSaved<B::Tensor>,
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
        let dup = b.swiglu_bwd(&dact, &s.up)?;
        let dx = self.fc1.backward(p, grads, &dup, (x, u_fc1.as_ref()))?;
        Ok((dx, dw))
    }
}

/// The parameters of one layer's dense MLP.
#[derive(Debug, Clone, Copy)]
pub(in crate::model) struct Dense(SwiGlu);

/// What the backward pass needs of the forward pass.
pub(in crate::model) struct Saved<T> {
    /// The normed input `[T, h]` (this rank's rows under sequence parallelism).
    h: T,
    swiglu: SwiGluSaved<T>,
}

impl Dense {
    /// Layer `layer`'s MLP in `table`, `None` if the table lacks it.
    pub(in crate::model) fn of(table: &ParamTable, layer: usize) -> Option<Dense> {
        SwiGlu::of(table, (Role::Fc1, Role::Fc2), layer).map(Dense)
    }

    /// `fc2(swiglu(fc1(h)))` summed over the tensor-parallel ranks: `[T, h]`.
    pub(in crate::model) fn forward<B: Backend>(
        &self,
        p: &Pass<B>,
        h: B::Tensor,
    ) -> Result<(B::Tensor, Saved<B::Tensor>)> {
        let all = gathered(p.b, p.tp, &h)?;
        let (out, swiglu) = self.0.forward(p, all.as_ref().unwrap_or(&h), None)?;
        Ok((reduced(p.b, p.tp, out)?, Saved { h, swiglu }))
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
            s.swiglu,
            (
                h_all.as_ref().unwrap_or(&s.h),
                dy_all.as_ref().unwrap_or(dy),
                None,
            ),
        )?;
        reduced(b, p.tp, dh)
    }
}
