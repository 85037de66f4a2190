//! This rank's routed experts on their tokens. Bare experts (no bias, no adapter) run all at
//! once: the tokens permuted expert after expert ([`Backend::permute`], megatron-core
//! megatron/core/transformer/moe/moe_utils.py `permute`; aclnnMoeTokenPermute on the NPU),
//! linear_fc1 and linear_fc2 each one grouped matmul over every expert (experts.py
//! `GroupedMLP`, MindSpeed-LLM's `--moe-grouped-gemm`; aclnnGroupedMatmulV4 on the NPU), each
//! token's outputs summed back into its row ([`Backend::unpermute`]). Experts with adapters or
//! biases run one after the other, each a [`Ffn`] (SwiGLU). Both compute each expert's rows with the
//! same products, in the same permuted order.

use super::super::dense::{Ffn, FfnSaved};
use crate::arch::moe::Routed;
use crate::engine::dispatch::Dispatch;
use crate::engine::{Backend, Result};
use crate::model::Pass;

/// This rank's routed experts: global experts `first..first + experts.len()`, each token
/// choosing `topk`.
pub(super) struct Local<'a> {
    pub(super) experts: &'a [Ffn],
    pub(super) first: usize,
    pub(super) topk: usize,
}

/// What the backward pass needs of the experts' forward pass.
pub(super) enum Saved<T> {
    /// Expert after expert: those that had tokens.
    Each(Vec<ExpertSaved<T>>),
    /// All at once; `None` when no token came to this rank's experts.
    Grouped(Option<Box<GroupedSaved<T>>>),
}

/// One expert's share of a forward pass.
pub(super) struct ExpertSaved<T> {
    expert: usize,
    /// Its choices (`token · topk + slot`, tokens ascending) and their routing weights `[n]`
    /// (f32).
    choices: Vec<usize>,
    weights: T,
    swiglu: FfnSaved<T>,
}

/// The grouped forward pass.
pub(super) struct GroupedSaved<T> {
    /// The tokens' choices of this rank's experts, and how many rows each expert has.
    dispatch: Dispatch,
    counts: Vec<usize>,
    /// The permuted rows' routing weights `[P]` (f32), linear_fc1's output `[P, 2F]`, the
    /// SwiGLU `[P, F]` and it scaled by the weights.
    weights: T,
    up: T,
    act: T,
    scaled: T,
}

/// `grads[i]` for each `Some(i)`, mutably (the indices distinct).
fn grads_at<'a, T>(grads: &'a mut [T], at: &[Option<usize>]) -> Vec<Option<&'a mut T>> {
    let mut slots: Vec<Option<&mut T>> = grads.iter_mut().map(Some).collect();
    at.iter().map(|i| i.and_then(|i| slots[i].take())).collect()
}

/// The parameters at `at`.
fn params<'a, B: Backend>(p: &Pass<'a, B>, at: &[usize]) -> Vec<&'a B::Tensor> {
    at.iter().map(|&i| &p.params[i]).collect()
}

impl Local<'_> {
    /// linear_fc1's weights of every expert and linear_fc2's, if all are bare.
    fn bare(&self) -> Option<[Vec<usize>; 2]> {
        let pairs: Vec<(usize, usize)> =
            self.experts.iter().map(Ffn::bare).collect::<Option<_>>()?;
        let (fc1, fc2) = pairs.into_iter().unzip();
        Some([fc1, fc2])
    }

    /// Each row's kept choices of this rank's experts (`kept[row][slot]`).
    fn dispatch(&self, routes: &[Routed], kept: &[Vec<bool>]) -> Dispatch {
        let local = self.first..self.first + self.experts.len();
        let choices = routes.iter().zip(kept).flat_map(|(r, k)| {
            (r.experts.iter().zip(k))
                .map(|(e, &kept)| (kept && local.contains(e)).then(|| (e - local.start) as u32))
        });
        Dispatch::new(choices.collect(), self.topk, self.experts.len())
            .expect("every row chooses topk experts")
    }

    /// This rank's experts' outputs `[M, h]` on their tokens among the rows of `x [M, h]`
    /// (`kept[row][slot]` says which of each row's `routes` run).
    pub(super) fn forward<B: Backend>(
        &self,
        p: &Pass<B>,
        x: &B::Tensor,
        (routes, kept): (&[Routed], &[Vec<bool>]),
    ) -> Result<(B::Tensor, Saved<B::Tensor>)> {
        let b = p.b;
        let dispatch = self.dispatch(routes, kept);
        let routed = &dispatch.order()[..dispatch.len()];
        let weight = |&i: &usize| routes[i / self.topk].weights[i % self.topk];
        let counts = dispatch.counts();
        if let Some([fc1, fc2]) = self.bare() {
            if dispatch.is_empty() {
                return Ok((b.zeros(b.shape(x), b.dtype(x))?, Saved::Grouped(None)));
            }
            let w: Vec<f32> = routed.iter().map(weight).collect();
            let weights = b.upload_f32(&[w.len()], &w)?;
            let xp = b.permute(x, &dispatch)?;
            let up = b.grouped_matmul(&xp, &params(p, &fc1), &counts)?;
            let act = b.swiglu(&up)?;
            let scaled = b.scale_rows(&act, &weights)?;
            let y = b.grouped_matmul(&scaled, &params(p, &fc2), &counts)?;
            let out = b.unpermute(&y, &dispatch)?;
            let saved = GroupedSaved {
                dispatch,
                counts,
                weights,
                up,
                act,
                scaled,
            };
            return Ok((out, Saved::Grouped(Some(Box::new(saved)))));
        }
        let mut out = b.zeros(b.shape(x), b.dtype(x))?;
        let mut each = Vec::new();
        let mut at = 0;
        for (expert, &n) in (self.first..).zip(&counts) {
            let choices = routed[at..at + n].to_vec();
            at += n;
            if choices.is_empty() {
                continue;
            }
            let w: Vec<f32> = choices.iter().map(weight).collect();
            let weights = b.upload_f32(&[w.len()], &w)?;
            let rows = self.rows(&choices);
            let xe = b.select_rows(x, &rows)?;
            let (y, swiglu) = self.experts[expert - self.first].forward(p, &xe, Some(&weights))?;
            b.index_add_rows(&mut out, &y, &rows)?;
            each.push(ExpertSaved {
                expert,
                choices,
                weights,
                swiglu,
            });
        }
        Ok((out, Saved::Each(each)))
    }

    /// The rows of flattened choices.
    fn rows(&self, choices: &[usize]) -> Vec<usize> {
        choices.iter().map(|i| i / self.topk).collect()
    }

    /// The gradient `[M, h]` of `x` given `dy [M, h]`, the gradient of the output, with the
    /// routing weights' gradients written into `dweights` (`[row][slot]`, this rank's experts'
    /// share); accumulates the experts' parameters' gradients.
    pub(super) fn backward<B: Backend>(
        &self,
        p: &Pass<B>,
        grads: &mut [B::Tensor],
        s: Saved<B::Tensor>,
        (x, dy): (&B::Tensor, &B::Tensor),
        dweights: &mut [Vec<f32>],
    ) -> Result<B::Tensor> {
        let b = p.b;
        let k = self.topk;
        match s {
            Saved::Grouped(None) => b.zeros(b.shape(x), b.dtype(x)),
            Saved::Grouped(Some(g)) => {
                let [fc1, fc2] = self.bare().expect("the forward pass's bare experts");
                let trained = |ws: &[usize]| -> Vec<Option<usize>> {
                    ws.iter().map(|&i| p.trainable[i].then_some(i)).collect()
                };
                let dyp = b.unpermute_bwd(dy, &g.dispatch)?;
                let mut dw2 = grads_at(grads, &trained(&fc2));
                let dscaled =
                    b.grouped_matmul_bwd(&dyp, &g.scaled, &params(p, &fc2), &g.counts, &mut dw2)?;
                drop(dw2);
                let dact = b.scale_rows(&dscaled, &g.weights)?;
                let dw = b.row_dots(&dscaled, &g.act)?;
                let dup = b.swiglu_bwd(&dact, &g.up)?;
                let xp = b.permute(x, &g.dispatch)?;
                let mut dw1 = grads_at(grads, &trained(&fc1));
                let dxp = b.grouped_matmul_bwd(&dup, &xp, &params(p, &fc1), &g.counts, &mut dw1)?;
                for (&i, d) in g.dispatch.order().iter().zip(dw) {
                    dweights[i / k][i % k] = d;
                }
                b.permute_bwd(&dxp, &g.dispatch)
            }
            Saved::Each(each) => {
                let mut dx = b.zeros(b.shape(x), b.dtype(x))?;
                for e in each {
                    let rows = self.rows(&e.choices);
                    let dy_e = b.select_rows(dy, &rows)?;
                    let xe = b.select_rows(x, &rows)?;
                    let (dx_e, dw) = self.experts[e.expert - self.first].backward(
                        p,
                        grads,
                        e.swiglu,
                        (&xe, &dy_e, Some(&e.weights)),
                    )?;
                    b.index_add_rows(&mut dx, &dx_e, &rows)?;
                    let dw = dw.expect("a scaled expert's weight gradient");
                    for (&i, d) in e.choices.iter().zip(dw) {
                        dweights[i / k][i % k] = d;
                    }
                }
                Ok(dx)
            }
        }
    }
}
