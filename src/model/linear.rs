//! A linear layer of the decoder: `y = x·Wᵀ (+ bias)`, with its LoRA adapter
//! (MindSpeed-LLM's, through peft) and Megatron's tensor-parallel split (column- or
//! row-parallel), forward and backward.
//!
//! Legend: T = rows, k = input width, m = output width, r = adapter rank.

use super::parallel::{all_reduced, counts_once};
use super::Pass;
use crate::arch::roles::{Canon, Role};
use crate::ckpt::transform::is_row_parallel;
use crate::engine::{Backend, Result};

use super::params::{LoraPart, ParamTable};

/// A linear layer: its weight, bias and LoRA factors in the parameter table.
#[derive(Debug, Clone, Copy)]
pub(super) struct Linear {
    pub(super) w: usize,
    pub(super) bias: Option<usize>,
    /// `(A, B)` of its adapter.
    lora: Option<(usize, usize)>,
    /// Row-parallel (split on its input: linear_proj, linear_fc2), else column-parallel.
    row: bool,
    /// Whether its weight is split over the tensor-parallel ranks (not a whole expert's).
    split: bool,
}

impl Linear {
    /// The layer of role `role` (and its bias role) in layer `layer` of `table`, or `None`
    /// if the table lacks its weight.
    pub(super) fn of(
        table: &ParamTable,
        (role, bias): (Role, Option<Role>),
        layer: Option<usize>,
    ) -> Option<Linear> {
        let canon = Canon { role, layer };
        let w = table.index(canon)?;
        Some(Linear {
            w,
            bias: bias.and_then(|role| table.index(Canon { role, layer })),
            lora: table
                .lora_index(canon, LoraPart::A)
                .zip(table.lora_index(canon, LoraPart::B)),
            row: is_row_parallel(role),
            split: table.params[w].tp_split,
        })
    }

    /// A plain column-parallel weight (the output layer).
    pub(super) fn weight(w: usize) -> Linear {
        Linear {
            w,
            bias: None,
            lora: None,
            row: false,
            split: true,
        }
    }

    /// Its weight when it is all there is (no bias, no adapter): then `y = x·Wᵀ` on every
    /// rank, whatever the parallelism.
    pub(super) fn bare(&self) -> Option<usize> {
        (self.bias.is_none() && self.lora.is_none()).then_some(self.w)
    }

    /// `y [T, m] = x·Wᵀ (+ bias) + s·(x·Aᵀ)·Bᵀ`; returns `y` and, with an adapter, `x·Aᵀ`
    /// `[T, r]` for the backward pass. Under tensor parallelism a row-parallel layer's `y` is
    /// a partial sum the caller reduces: its bias and adapter term are added by one rank, and
    /// its adapter's `A` being row-parallel too (peft's megatron LoRA layer,
    /// peft/tuners/lora/tp_layer.py), `x·Aᵀ` is summed over the ranks here — all-reduced
    /// under sequence parallelism too, `x` holding every row. peft computes the whole
    /// adapters' (column-parallel `A`, row-parallel `B`) gradients there over each rank's rows
    /// and MindSpeed-LLM sums them over TP as `sequence_parallel` parameters
    /// (mindspeed_llm/training/training.py `model_provider_func_wrapper`): the same sums,
    /// taken here over every row at once.
    pub(super) fn forward<B: Backend>(
        self,
        p: &Pass<B>,
        x: &B::Tensor,
    ) -> Result<(B::Tensor, Option<B::Tensor>)> {
        let b = p.b;
        let tp = p.tp.filter(|_| self.split);
        let once = !self.row || counts_once(tp);
        let bias = self.bias.filter(|_| once).map(|i| &p.params[i]);
        let mut y = b.matmul(x, &p.params[self.w], bias)?;
        let Some((a, bb)) = self.lora else {
            return Ok((y, None));
        };
        let mut u = b.matmul(x, &p.params[a], None)?;
        if self.row {
            u = all_reduced(tp, u)?;
        }
        if once {
            let update = b.matmul(&u, &p.params[bb], None)?;
            b.add_assign(&mut y, &b.scaled(&update, p.lora_scale)?)?;
        }
        Ok((y, Some(u)))
    }

    /// `dx [T, k]` of [`Linear::forward`] given `dy [T, m]`, its input `x` and `u = x·Aᵀ`,
    /// accumulating the gradients of whatever of W, bias, A, B is trained. Under tensor
    /// parallelism a column-parallel layer's `dx` is a partial sum the caller reduces; its
    /// adapter's `B` being column-parallel too, `x·Aᵀ`'s gradient is summed over the ranks
    /// here and the adapter's part of `dx`, alike on every rank, added by one.
    pub(super) fn backward<B: Backend>(
        self,
        p: &Pass<B>,
        grads: &mut [B::Tensor],
        dy: &B::Tensor,
        (x, u): (&B::Tensor, Option<&B::Tensor>),
    ) -> Result<B::Tensor> {
        let b = p.b;
        let tp = p.tp.filter(|_| self.split);
        let trained = |i: usize| p.trainable[i];
        let w = &p.params[self.w];
        let mut dx = match self.bias.filter(|&bi| trained(self.w) && trained(bi)) {
            Some(bi) => {
                let (dw, db) = two_mut(grads, self.w, bi);
                b.matmul_bwd(dy, x, w, Some(dw), Some(db))?
            }
            None => {
                let dw = trained(self.w).then(|| &mut grads[self.w]);
                b.matmul_bwd(dy, x, w, dw, None)?
            }
        };
        if let (Some((a, bb)), Some(u)) = (self.lora, u) {
            // y += s·u·Bᵀ with u = x·Aᵀ.
            let dys = b.scaled(dy, p.lora_scale)?;
            let mut du = b.matmul_bwd(&dys, u, &p.params[bb], Some(&mut grads[bb]), None)?;
            if !self.row {
                du = all_reduced(tp, du)?;
            }
            let dx_a = b.matmul_bwd(&du, x, &p.params[a], Some(&mut grads[a]), None)?;
            if self.row || counts_once(tp) {
                b.add_assign(&mut dx, &dx_a)?;
            }
        }
        Ok(dx)
    }
}

/// Two distinct elements of a slice, mutably.
pub(super) fn two_mut<T>(v: &mut [T], i: usize, j: usize) -> (&mut T, &mut T) {
    assert_ne!(i, j, "internal: one gradient taken twice");
    if i < j {
        let (a, b) = v.split_at_mut(j);
        (&mut a[i], &mut b[0])
    } else {
        let (a, b) = v.split_at_mut(i);
        (&mut b[0], &mut a[j])
    }
}
