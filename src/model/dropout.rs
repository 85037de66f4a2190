//! Training's dropout at the places megatron-core applies it in a GPT model: hidden dropout
//! (`--hidden-dropout`) on the embedding's output (megatron-core
//! megatron/core/models/common/embeddings/language_model_embedding.py `embedding_dropout`) and
//! on the attention's and the MLP's outputs before each residual sum
//! (megatron/core/transformer/transformer_layer.py `self_attn_bda` / `mlp_bda`,
//! megatron/core/fusions/fused_bias_dropout.py: `residual + dropout(x + bias)`), attention
//! dropout (`--attention-dropout`) on the softmax probabilities
//! (megatron/core/transformer/dot_product_attention.py `attention_dropout`). The masks are
//! mindkit's own ([`crate::engine::dropout`]): keyed by global coordinates, so every parallel
//! layout draws the single-rank run's masks.
//!
//! Legend: T = rows of the micro-batch (this rank's block under sequence parallelism), h =
//! hidden.

use super::Pass;
use crate::engine::dropout::{Mask, Rate, RowAt, Site};
use crate::engine::{Backend, Result};

/// One training micro-batch's dropout: the probabilities and where each row sits.
#[derive(Debug, Clone)]
pub struct Dropout {
    /// `--seed`.
    pub seed: u32,
    /// `--hidden-dropout`, `None` for 0.
    pub hidden: Option<Rate>,
    /// `--attention-dropout`, `None` for 0.
    pub attention: Option<Rate>,
    /// `--moe-input-jitter-eps`: each MoE router's input multiplied by draws of
    /// U(1 − ε, 1 + ε) (megatron-core router.py `apply_input_jitter`).
    pub jitter: Option<f32>,
    /// `[T]` each row's sample (its consumed-sample index) and position.
    rows: Vec<RowAt>,
}

impl Dropout {
    /// The random draws of a micro-batch whose first sample is the run's `first_sample`-th and
    /// whose rows sit at `positions` (0 where a sample starts): dropout's, and its routers'
    /// (`router`: the input jitter's ε, and whether a router samples its experts, SparseMixer's);
    /// `None` where nothing is drawn.
    pub fn new(
        seed: u32,
        (hidden, attention): (Option<Rate>, Option<Rate>),
        (jitter, sampled): (Option<f32>, bool),
        first_sample: u64,
        positions: &[usize],
    ) -> Option<Dropout> {
        if hidden.or(attention).is_none() && jitter.is_none() && !sampled {
            return None;
        }
        let mut sample = first_sample;
        let rows = positions
            .iter()
            .enumerate()
            .map(|(r, &position)| {
                if position == 0 && r > 0 {
                    sample += 1;
                }
                RowAt {
                    sample,
                    position: position as u32,
                }
            })
            .collect();
        Some(Dropout {
            seed,
            hidden,
            attention,
            jitter,
            rows,
        })
    }
}

/// Hidden dropout's mask of a residual-stream tensor of `p`'s rows (this rank's block of them
/// under sequence parallelism) at `site` of layer `layer`; `None` without hidden dropout.
fn hidden_mask<'a, B: Backend>(p: &Pass<'a, B>, layer: usize, site: Site) -> Option<Mask<'a>> {
    let d = p.dropout?;
    let rows = rows_here(p)?;
    Some(Mask {
        seed: d.seed,
        rate: d.hidden?,
        layer,
        site,
        rows,
        first_head: 0,
    })
}

/// Where this rank's rows of the residual stream sit (its block of them under sequence
/// parallelism), in training; `None` where nothing is drawn.
pub(super) fn rows_here<'a, B: Backend>(p: &Pass<'a, B>) -> Option<&'a [RowAt]> {
    let d = p.dropout?;
    Some(match p.tp.filter(|tp| tp.sequence_parallel) {
        Some(tp) => {
            let n = d.rows.len() / tp.group.size();
            &d.rows[tp.group.rank() * n..][..n]
        }
        None => &d.rows[..],
    })
}

/// `x [T, h]` after hidden dropout at `site` of layer `layer` (or its gradient's backward
/// pass, the same product); `None` without hidden dropout (x itself is meant).
pub(super) fn dropped<B: Backend>(
    p: &Pass<B>,
    x: &B::Tensor,
    (layer, site): (usize, Site),
) -> Result<Option<B::Tensor>> {
    hidden_mask(p, layer, site)
        .map(|m| p.b.dropout(x, &m))
        .transpose()
}

/// Attention dropout's mask of layer `layer` over every row of the micro-batch, from this
/// rank's first head; `None` without attention dropout.
pub(super) fn attention_mask<'a, B: Backend>(p: &Pass<'a, B>, layer: usize) -> Option<Mask<'a>> {
    let d = p.dropout?;
    let tp_rank = p.tp.map_or(0, |tp| tp.group.rank());
    Some(Mask {
        seed: d.seed,
        rate: d.attention?,
        layer,
        site: Site::AttentionProbs,
        rows: &d.rows,
        first_head: tp_rank * p.spec.attention.heads,
    })
}
