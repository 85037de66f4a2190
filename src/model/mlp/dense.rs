//! The dense SwiGLU MLP, Megatron's `MLP` with `--swiglu`: linear_fc1 to `[gate; up]`,
//! `silu(gate)·up`, linear_fc2 (megatron-core megatron/core/transformer/mlp.py).
//!
//! Legend: T = rows, h = hidden, F = ffn (this rank's columns under tensor parallelism).

use crate::arch::roles::Role;
use crate::engine::{Backend, Result};
use crate::model::linear::Linear;
use crate::model::parallel::{gathered, reduced};
use crate::model::params::ParamTable;
use crate::model::Pass;

/// The parameters of one layer's MLP.
#[derive(Debug, Clone, Copy)]
pub(in crate::model) struct Dense {
    /// linear_fc1 `[2F, h]` (column-parallel).
    fc1: Linear,
    /// linear_fc2 `[h, F]` (row-parallel).
    fc2: Linear,
}

/// What the backward pass needs of the forward pass.
pub(in crate::model) struct Saved<T> {
    /// The normed input `[T, h]` (this rank's rows under sequence parallelism).
    h: T,
    /// fc1's output `[T, 2F]` and the SwiGLU `[T, F]`.
    up: T,
    act: T,
    /// `x·Aᵀ` of the adapters of linear_fc1 and linear_fc2.
    lora: [Option<T>; 2],
}

impl Dense {
    /// Layer `layer`'s MLP in `table`, `None` if the table lacks it.
    pub(in crate::model) fn of(table: &ParamTable, layer: usize) -> Option<Dense> {
        let at = Some(layer);
        Some(Dense {
            fc1: Linear::of(table, (Role::Fc1, None), at)?,
            fc2: Linear::of(table, (Role::Fc2, None), at)?,
        })
    }

    /// `fc2(swiglu(fc1(h)))` summed over the tensor-parallel ranks: `[T, h]`.
    pub(in crate::model) fn forward<B: Backend>(
        &self,
        p: &Pass<B>,
        h: B::Tensor,
    ) -> Result<(B::Tensor, Saved<B::Tensor>)> {
        let b = p.b;
        let all = gathered(b, p.tp, &h)?;
        let (up, u_fc1) = self.fc1.forward(p, all.as_ref().unwrap_or(&h))?;
        let act = b.swiglu(&up)?;
        let (out, u_fc2) = self.fc2.forward(p, &act)?;
        let saved = Saved {
            h,
            up,
            act,
            lora: [u_fc1, u_fc2],
        };
        Ok((reduced(b, p.tp, out)?, saved))
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
        let [u_fc1, u_fc2] = &s.lora;
        let all = gathered(b, p.tp, dy)?;
        let dy = all.as_ref().unwrap_or(dy);
        let dact = self.fc2.backward(p, grads, dy, (&s.act, u_fc2.as_ref()))?;
        let dup = b.swiglu_bwd(&dact, &s.up)?;
        let all = gathered(b, p.tp, &s.h)?;
        let h = all.as_ref().unwrap_or(&s.h);
        let dh = self.fc1.backward(p, grads, &dup, (h, u_fc1.as_ref()))?;
        reduced(b, p.tp, dh)
    }
}
