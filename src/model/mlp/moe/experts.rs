//! This rank's routed experts on their tokens. Bare experts (no bias, no adapter) run all at
//! once: the tokens permuted expert after expert by one row gather (megatron-core
//! megatron/core/transformer/moe/moe_utils.py `permute`), linear_fc1 and linear_fc2 each one
//! grouped matmul over every expert (experts.py `GroupedMLP`, MindSpeed-LLM's
//! `--moe-grouped-gemm`; aclnnGroupedMatmulV4 on the NPU), the outputs added back into their
//! rows by one indexed add (`unpermute`). Experts with adapters or biases run one after the
//! other, each a [`SwiGlu`]. Both compute each expert's rows with the same products, added
//! into the output in the same order.

use super::super::dense::{SwiGlu, SwiGluSaved};
use crate::arch::moe::Routed;
use crate::engine::{Backend, Result};
use crate::model::Pass;

/// Each global expert's tokens (rows of the M, ascending) and their routing weights.
pub(super) type Tokens = Vec<(Vec<usize>, Vec<f32>)>;

/// This rank's routed experts: global experts `first..first + experts.len()`.
pub(super) struct Local<'a> {
    pub(super) experts: &'a [SwiGlu],
    pub(super) first: usize,
}

/// What the backward pass needs of the experts' forward pass.
pub(super) enum Saved<T> {
    /// Expert after expert: those that had tokens.
    Each(Vec<ExpertSaved<T>>),
    /// All at once; `None` when no token came to this rank's experts.
    Grouped(Option<GroupedSaved<T>>),
}

/// One expert's share of a forward pass.
pub(super) struct ExpertSaved<T> {
    expert: usize,
    /// Its tokens and their routing weights `[n]` (f32).
    rows: Vec<usize>,
    weights: T,
    swiglu: SwiGluSaved<T>,
}

/// The grouped forward pass.
pub(super) struct GroupedSaved<T> {
    /// Every expert's tokens, expert after expert (the permuted order), and how many each has.
    rows: Vec<usize>,
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

/// Row `row`'s routing-weight gradient for `expert`.
fn record(routes: &[Routed], dweights: &mut [Vec<f32>], (row, expert): (usize, usize), d: f32) {
    let slot = (routes[row].experts.iter())
        .position(|&x| x == expert)
        .expect("the expert is among the row's");
    dweights[row][slot] = d;
}

impl Local<'_> {
    /// linear_fc1's weights of every expert and linear_fc2's, if all are bare.
    fn bare(&self) -> Option<[Vec<usize>; 2]> {
        let pairs: Vec<(usize, usize)> = self
            .experts
            .iter()
            .map(SwiGlu::bare)
            .collect::<Option<_>>()?;
        let (fc1, fc2) = pairs.into_iter().unzip();
        Some([fc1, fc2])
    }

    /// Adds into `out [M, h]` this rank's experts' outputs on their tokens among the rows of
    /// `x [M, h]` (`tokens` holds every global expert's).
    pub(super) fn forward<B: Backend>(
        &self,
        p: &Pass<B>,
        x: &B::Tensor,
        tokens: Tokens,
        out: &mut B::Tensor,
    ) -> Result<Saved<B::Tensor>> {
        let b = p.b;
        let mine = tokens.into_iter().skip(self.first).take(self.experts.len());
        if let Some([fc1, fc2]) = self.bare() {
            let (mut rows, mut counts, mut w) = (Vec::new(), Vec::new(), Vec::new());
            for (r, we) in mine {
                counts.push(r.len());
                rows.extend(r);
                w.extend(we);
            }
            if rows.is_empty() {
                return Ok(Saved::Grouped(None));
            }
            let weights = b.upload_f32(&[w.len()], &w)?;
            let up = b.grouped_matmul(&b.select_rows(x, &rows)?, &params(p, &fc1), &counts)?;
            let act = b.swiglu(&up)?;
            let scaled = b.scale_rows(&act, &weights)?;
            let y = b.grouped_matmul(&scaled, &params(p, &fc2), &counts)?;
            b.index_add_rows(out, &y, &rows)?;
            let saved = GroupedSaved {
                rows,
                counts,
                weights,
                up,
                act,
                scaled,
            };
            return Ok(Saved::Grouped(Some(saved)));
        }
        let mut each = Vec::new();
        for (expert, (rows, w)) in (self.first..).zip(mine) {
            if rows.is_empty() {
                continue;
            }
            let weights = b.upload_f32(&[rows.len()], &w)?;
            let xe = b.select_rows(x, &rows)?;
            let (y, swiglu) = self.experts[expert - self.first].forward(p, &xe, Some(&weights))?;
            b.index_add_rows(out, &y, &rows)?;
            each.push(ExpertSaved {
                expert,
                rows,
                weights,
                swiglu,
            });
        }
        Ok(Saved::Each(each))
    }

    /// The gradient `[M, h]` of `x` given `dy [M, h]`, the gradient of the output, with the
    /// routing weights' gradients written into `dweights` (one per row and chosen expert, this
    /// rank's experts' share); accumulates the experts' parameters' gradients.
    pub(super) fn backward<B: Backend>(
        &self,
        p: &Pass<B>,
        grads: &mut [B::Tensor],
        s: Saved<B::Tensor>,
        (x, dy): (&B::Tensor, &B::Tensor),
        (routes, dweights): (&[Routed], &mut [Vec<f32>]),
    ) -> Result<B::Tensor> {
        let b = p.b;
        let mut dx = b.zeros(b.shape(x), b.dtype(x))?;
        match s {
            Saved::Grouped(None) => {}
            Saved::Grouped(Some(g)) => {
                let [fc1, fc2] = self.bare().expect("the forward pass's bare experts");
                let trained = |ws: &[usize]| -> Vec<Option<usize>> {
                    ws.iter().map(|&i| p.trainable[i].then_some(i)).collect()
                };
                let dyp = b.select_rows(dy, &g.rows)?;
                let mut dw2 = grads_at(grads, &trained(&fc2));
                let dscaled =
                    b.grouped_matmul_bwd(&dyp, &g.scaled, &params(p, &fc2), &g.counts, &mut dw2)?;
                drop(dw2);
                let dact = b.scale_rows(&dscaled, &g.weights)?;
                let dw = b.row_dots(&dscaled, &g.act)?;
                let dup = b.swiglu_bwd(&dact, &g.up)?;
                let xp = b.select_rows(x, &g.rows)?;
                let mut dw1 = grads_at(grads, &trained(&fc1));
                let dxp = b.grouped_matmul_bwd(&dup, &xp, &params(p, &fc1), &g.counts, &mut dw1)?;
                b.index_add_rows(&mut dx, &dxp, &g.rows)?;
                let experts = (g.counts.iter().enumerate())
                    .flat_map(|(e, &c)| std::iter::repeat_n(self.first + e, c));
                for ((&row, expert), d) in g.rows.iter().zip(experts).zip(dw) {
                    record(routes, dweights, (row, expert), d);
                }
            }
            Saved::Each(each) => {
                for e in each {
                    let dy_e = b.select_rows(dy, &e.rows)?;
                    let xe = b.select_rows(x, &e.rows)?;
                    let (dx_e, dw) = self.experts[e.expert - self.first].backward(
                        p,
                        grads,
                        e.swiglu,
                        (&xe, &dy_e, Some(&e.weights)),
                    )?;
                    b.index_add_rows(&mut dx, &dx_e, &e.rows)?;
                    let dw = dw.expect("a scaled expert's weight gradient");
                    for (&row, d) in e.rows.iter().zip(dw) {
                        record(routes, dweights, (row, e.expert), d);
                    }
                }
            }
        }
        Ok(dx)
    }
}
