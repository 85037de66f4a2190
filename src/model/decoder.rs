//! The decoder stack for training: one micro-batch's forward pass through a model or
//! pipeline stage (embedding, the [`Layer`]s, final norm, output layer, cross entropy),
//! keeping what the backward pass needs, and the backward pass in exactly the reverse order
//! (as llm.c writes `gpt2_forward` / `gpt2_backward`), over the engine's [`Backend`]
//! operators.
//!
//! Legend: T = rows (tokens of the micro-batch, sequence after sequence), h = hidden,
//! Vp = padded vocabulary. Parameters and gradients are indexed by the [`ParamTable`];
//! gradients are f32 and **accumulate** across micro-batches.
//!
//! Under tensor parallelism each rank holds its shard of the parameters and runs this same
//! code on its heads, groups, FFN columns and vocabulary rows, with Megatron's collectives
//! (megatron-core megatron/core/tensor_parallel/layers.py, mappings.py, cross_entropy.py):
//! the row-parallel outputs (linear_proj, linear_fc2) and the vocabulary-parallel embedding
//! are all-reduced in the forward pass, the column-parallel inputs' gradients (linear_qkv,
//! linear_fc1, the output layer) in the backward pass, and the cross entropy reduces its
//! maximum, target logit and Σexp over the vocabulary shards. With sequence parallelism the
//! residual stream and the norms hold this rank's rows only: the sums become reduce-scatters,
//! and the column-parallel layers' inputs and the row-parallel layers' output gradients are
//! all-gathered (the inputs again in the backward pass, as Megatron re-gathers them for the
//! weight gradients rather than keep them).
//!
//! A pipeline stage runs the same code on its layers: the first from the embedding, the others
//! from the previous stage's output; the last to the loss, the others to their output, whose
//! gradient the backward pass then takes from the next stage.

use super::attention::Attend;
use super::dropout::{dropped, Dropout};
use super::layer::{Layer, LayerSaved};
use super::linear::Linear;
use super::mtp::{Depth, DepthSaved};
use super::norm::{Head, Norm, NormSaved};
use super::parallel::{gathered, local_ids, reduced, ExpertGroups, TensorParallel};
use super::params::ParamTable;
use super::{AuxLosses, IndexerLoss, ModelSpec, Pass, RouterStats};
use crate::arch::roles::{Canon, Role};
use crate::engine::comm::ReduceOp;
use crate::engine::dropout::Site;
use crate::engine::{Backend, EngineError, Result};
use crate::tensor::DType;
use std::ops::Range;

/// Where every parameter of a model or pipeline stage sits in the table, and which are
/// trained.
#[derive(Debug, Clone)]
pub struct Ids {
    /// The input embedding (the first pipeline stage).
    pub(super) embedding: Option<usize>,
    pub(super) layers: Vec<Layer>,
    /// The final norm and output layer (the last stage; the output layer may be the
    /// embedding, or on a later stage than the first its copy).
    pub(super) head: Option<Head>,
    /// Multi-token prediction's depths (on the last stage) and the embedding they look up
    /// (on a later stage than the first its copy).
    depths: Vec<Depth>,
    depth_embedding: Option<usize>,
    pub(super) trainable: Vec<bool>,
    /// LoRA's alpha / r.
    pub(super) lora_scale: f32,
}

impl Ids {
    /// Look up in `table` every parameter of a model or pipeline stage holding `layers`
    /// (`lora_scale`: the adapters' alpha / r, if any): the embedding unless a shared copy,
    /// the final norm with the output layer if there.
    pub fn new(table: &ParamTable, layers: Range<usize>, lora_scale: f32) -> Option<Ids> {
        let at = |role| table.index(Canon { role, layer: None });
        let embedding = at(Role::Embedding);
        let head = match Norm::of(table, Role::FinalNorm, None) {
            Some(norm) => {
                let output = Linear::of(table, (Role::Output, Some(Role::OutputBias)), None);
                let output = output.or(embedding.map(Linear::weight))?;
                Some(Head { norm, output })
            }
            None => None,
        };
        let depths = match head {
            Some(_) => Depth::all_of(table)?,
            None => Vec::new(),
        };
        Some(Ids {
            embedding: embedding.filter(|&e| !table.params[e].shared),
            layers: layers.map(|l| Layer::of(table, l)).collect::<Option<_>>()?,
            head,
            depth_embedding: embedding.filter(|_| !depths.is_empty()),
            depths,
            trainable: table.params.iter().map(|p| p.trainable).collect(),
            lora_scale,
        })
    }

    /// The embedding and the head `(final norm, output layer)` of a whole model (`None` for
    /// a pipeline stage that lacks either).
    pub(super) fn whole_model(&self) -> Option<(usize, Head)> {
        self.embedding.zip(self.head)
    }

    /// A pass over `params` (indexed as this table) with these rotary tables and dropout.
    pub(super) fn pass<'a, B: Backend>(
        &'a self,
        (b, spec): (&'a B, &'a ModelSpec),
        params: &'a [B::Tensor],
        (tp, (ep, etp)): (
            Option<&'a TensorParallel<'a, B::Tensor>>,
            ExpertGroups<'a, B::Tensor>,
        ),
        rope: (&'a B::Tensor, &'a B::Tensor),
        ((dropout, aux, indexer), sequences): Regularisers<'a>,
    ) -> Pass<'a, B> {
        Pass {
            b,
            spec,
            params,
            trainable: &self.trainable,
            lora_scale: self.lora_scale,
            tp,
            ep,
            etp,
            rope,
            dropout,
            aux,
            indexer,
            sequences,
            inference: false,
        }
    }
}

/// One micro-batch.
#[derive(Debug, Clone)]
pub struct MicroBatch {
    /// `[T]` input ids.
    pub tokens: Vec<u32>,
    /// `[T]` target ids.
    pub labels: Vec<u32>,
    /// `[T]` the gradient of the objective with respect to each row's loss (Megatron's
    /// `mask / max(n, 1) / K`, or the mask itself with per-token loss).
    pub dloss: Vec<f32>,
    /// Attention segments (row ranges covering `0..T`): each sequence, or each document of it
    /// with `--reset-attention-mask`.
    pub segments: Vec<Range<usize>>,
    /// `[T]` RoPE position of each row (0..S per sequence: Megatron's RoPE does not read
    /// `position_ids`).
    pub positions: Vec<usize>,
    /// Training's dropout (`None`: none, as in evaluation).
    pub dropout: Option<Dropout>,
    /// Training's MoE auxiliary losses (`None`: none, as in evaluation).
    pub aux: Option<AuxLosses>,
    /// Training's DeepSeek sparse attention indexer loss (`None`: none, as in evaluation).
    pub indexer: Option<IndexerLoss>,
    /// Multi-token prediction's rows of each depth in training (none in evaluation, which
    /// reports the main loss only).
    pub mtp: Vec<DepthRows>,
}

/// One multi-token prediction depth's rows of a micro-batch: depth k looks k + 1 ahead.
#[derive(Debug, Clone)]
pub struct DepthRows {
    /// `[T]` the input ids rolled left by k + 1 within each sequence, 0 past its end
    /// (megatron-core `roll_tensor`, once per depth).
    pub tokens: Vec<u32>,
    /// `[T]` the targets, rolled alike.
    pub labels: Vec<u32>,
    /// `[T]` the loss mask, rolled alike.
    pub mask: Vec<f32>,
    /// `[T]` the gradient of the objective with respect to each row's loss: the depth's share
    /// of the loss (`--mtp-loss-scaling-factor` / depths) times the mask over its count and
    /// the micro-batches (megatron-core `MTPLossAutoScaler`), or times the mask alone with
    /// per-token loss.
    pub dloss: Vec<f32>,
    /// Attention segments: the sequences', or with `--reset-attention-mask` the documents'
    /// moved k + 1 rows back with the ids (MindSpeed-LLM
    /// `generate_mtp_batch_list_on_this_tp_rank`).
    pub segments: Vec<Range<usize>>,
}

/// What a pass of training adds: its dropout and MoE auxiliary losses, and the sequences of its
/// rows.
pub(super) type Regularisers<'a> = (
    (
        Option<&'a Dropout>,
        Option<&'a AuxLosses>,
        Option<&'a IndexerLoss>,
    ),
    usize,
);

impl MicroBatch {
    /// Its dropout and auxiliary losses, and its sequences (the rows at position 0).
    fn regularisers(&self) -> Regularisers<'_> {
        let sequences = self.positions.iter().filter(|&&p| p == 0).count();
        let losses = (self.aux.as_ref(), self.indexer.as_ref());
        ((self.dropout.as_ref(), losses.0, losses.1), sequences)
    }
}

/// What the final norm and output layer's backward pass needs.
pub(super) struct HeadSaved<T> {
    /// The final norm's input `[T, h]` and statistics, and its normed output.
    pub(super) norm: NormSaved<T>,
    pub(super) hf: T,
    /// Logits `[T, Vp]` and their log-sum-exp `[T]`.
    logits: T,
    lse: T,
}

/// What a micro-batch's backward pass through a model or pipeline stage needs of its forward
/// pass.
pub struct Saved<T> {
    layers: Vec<LayerSaved<T>>,
    /// The global index of each of `layers`.
    layer_index: Vec<usize>,
    head: Option<HeadSaved<T>>,
    depths: Vec<DepthSaved<T>>,
    /// Each depth's `(Σ loss·mask, Σ mask)` (training).
    mtp_losses: Vec<(f32, f32)>,
    /// RoPE tables `[T, d/2]` of the micro-batch.
    cos: T,
    sin: T,
}

/// Run one micro-batch forward through the model, or through a pipeline stage given the
/// previous stage's output as `input`. Returns its output — with the output layer the `[T]`
/// per-row losses (f32), on an earlier pipeline stage its `[T, h]` output (this rank's rows
/// under sequence parallelism) for the next stage — and what [`backward`] needs.
pub fn forward<B: Backend>(
    b: &B,
    spec: &ModelSpec,
    (ids, params): (&Ids, &[B::Tensor]),
    (batch, input): (&MicroBatch, Option<B::Tensor>),
    activations: DType,
    (tp, experts): (Option<&TensorParallel<B::Tensor>>, ExpertGroups<B::Tensor>),
) -> Result<(B::Tensor, Saved<B::Tensor>)> {
    let (cos, sin) = spec.rope_tables(&batch.positions);
    let half = spec.rope_table_shape(batch.tokens.len());
    let (cos, sin) = (b.upload_f32(&half, &cos)?, b.upload_f32(&half, &sin)?);
    let p = ids.pass(
        (b, spec),
        params,
        (tp, experts),
        (&cos, &sin),
        batch.regularisers(),
    );
    let mut x = match (input, ids.embedding) {
        (Some(x), _) => x,
        (None, Some(e)) => {
            let mut x = b.embedding(&params[e], &local_ids(tp, &batch.tokens))?;
            if activations != DType::F32 {
                x = b.cast(&x, activations)?;
            }
            let x = reduced(b, tp, x)?;
            dropped(&p, &x, (0, Site::Embedding))?.unwrap_or(x)
        }
        (None, None) => {
            return Err(EngineError::Invalid {
                op: "forward",
                msg: "a pipeline stage without the embedding needs the previous stage's output"
                    .into(),
            })
        }
    };
    let mut layers = Vec::with_capacity(ids.layers.len());
    let mut carry = None;
    let shared = Default::default();
    for layer in &ids.layers {
        let attend = Attend::Segments(&batch.segments, &shared);
        let (out, saved) = layer.forward(&p, (x, &mut carry), attend)?;
        layers.push(saved);
        x = out;
    }
    let (out, head) = match ids.head {
        Some(at) => {
            let (loss, head) = head_forward(&p, x, &at, &batch.labels)?;
            (loss, Some(head))
        }
        None => (x, None),
    };
    let (depths, mtp_losses) = match &head {
        Some(head) => depths_forward(&p, ids, batch, head, activations)?,
        None => Default::default(),
    };
    let saved = Saved {
        layers,
        layer_index: ids.layers.iter().map(Layer::index).collect(),
        head,
        depths,
        mtp_losses,
        cos,
        sin,
    };
    Ok((out, saved))
}

/// Multi-token prediction's depths in training, after the main model's `head`: what each
/// depth's backward pass needs, and each one's `(Σ loss·mask, Σ mask)`.
type DepthsForward<T> = (Vec<DepthSaved<T>>, Vec<(f32, f32)>);

fn depths_forward<B: Backend>(
    p: &Pass<B>,
    ids: &Ids,
    batch: &MicroBatch,
    head: &HeadSaved<B::Tensor>,
    activations: DType,
) -> Result<DepthsForward<B::Tensor>> {
    let (Some(embedding), Some(Head { output, .. })) = (ids.depth_embedding, ids.head) else {
        return Ok(Default::default());
    };
    let mut saved: Vec<DepthSaved<B::Tensor>> = Vec::with_capacity(ids.depths.len());
    let mut losses = Vec::with_capacity(ids.depths.len());
    for (depth, rows) in ids.depths.iter().zip(&batch.mtp) {
        let from = saved.last().map_or(head, |s| &s.head);
        let hand = if p.spec.mtp_normed_handoff() {
            &from.hf
        } else {
            &from.norm.x
        };
        let at = (hand, embedding);
        let (loss, s) = depth.forward(p, at, rows, (activations, output))?;
        let loss = p.b.download_f32(&loss)?;
        let sum = loss.iter().zip(&rows.mask).map(|(l, m)| l * m).sum();
        losses.push((sum, rows.mask.iter().sum()));
        saved.push(s);
    }
    Ok((saved, losses))
}

impl<T> Saved<T> {
    /// The auxiliary losses' values and token counts of the MoE layers of the forward pass
    /// (in training), by global layer index: the decoder's, then the multi-token prediction
    /// depths'.
    pub fn moe_stats(&self) -> Vec<(usize, &RouterStats)> {
        let depths = self.depths.iter().map(|d| d.moe_stats());
        (self.layer_index.iter().zip(&self.layers))
            .map(|(&l, s)| (l, s.moe_stats()))
            .chain(depths)
            .filter_map(|(l, s)| Some((l, s?)))
            .collect()
    }

    /// DeepSeek sparse attention's indexer losses of the forward pass (in training), by
    /// canonical layer: the decoder's layers', then the multi-token prediction depths'.
    pub fn indexer_losses(&self) -> Vec<(usize, f32)> {
        let depths = self.depths.iter().map(|d| d.indexer_loss());
        (self.layer_index.iter().zip(&self.layers))
            .map(|(&l, s)| (l, s.indexer_loss()))
            .chain(depths)
            .filter_map(|(l, loss)| Some((l, loss?)))
            .collect()
    }

    /// Each multi-token prediction depth's `(Σ loss·mask, Σ mask)` of the forward pass (in
    /// training).
    pub fn mtp_losses(&self) -> &[(f32, f32)] {
        &self.mtp_losses
    }
}

/// The per-row losses `[T]` of the last layer's output `x`: final norm, output layer, cross
/// entropy against `labels`.
pub(super) fn head_forward<B: Backend>(
    p: &Pass<B>,
    x: B::Tensor,
    at: &Head,
    labels: &[u32],
) -> Result<(B::Tensor, HeadSaved<B::Tensor>)> {
    let b = p.b;
    let (hf, norm) = at.norm.forward(p, x)?;
    let all = gathered(b, p.tp, &hf)?;
    let (logits, _) = at.output.forward(p, all.as_ref().unwrap_or(&hf))?;
    let (loss, lse) = match p.tp {
        Some(tp) => vocab_parallel_cross_entropy(b, tp, &logits, &tp.local(labels))?,
        None => b.cross_entropy(&logits, labels)?,
    };
    let saved = HeadSaved {
        norm,
        hf,
        logits,
        lse,
    };
    Ok((loss, saved))
}

/// The gradient of the objective `Σ dloss · loss` against `labels` with respect to the last
/// layer's output: through the cross entropy, the output layer and the final norm, whose
/// gradients it adds; `dhf`: a further gradient of the normed output (a multi-token prediction
/// depth was handed it).
pub(super) fn head_backward<B: Backend>(
    p: &Pass<B>,
    grads: &mut [B::Tensor],
    (labels, dloss): (&[u32], &[f32]),
    head: HeadSaved<B::Tensor>,
    at: &Head,
    dhf: Option<B::Tensor>,
) -> Result<B::Tensor> {
    let b = p.b;
    let HeadSaved {
        norm,
        hf,
        logits,
        lse,
    } = head;
    let dloss = b.upload_f32(&[labels.len()], dloss)?;
    let labels = local_ids(p.tp, labels);
    let dlogits = b.cross_entropy_bwd(logits, &labels, &lse, &dloss)?;
    let all = gathered(b, p.tp, &hf)?;
    let whole = all.as_ref().unwrap_or(&hf);
    let from_logits = at.output.backward(p, grads, &dlogits, (whole, None))?;
    drop(dlogits);
    let mut from_logits = reduced(b, p.tp, from_logits)?;
    if let Some(d) = dhf {
        b.add_assign(&mut from_logits, &d)?;
    }
    at.norm.backward(p, grads, &from_logits, &norm)
}

/// The backward pass of [`forward`] in reverse order, for the objective `Σ dloss · loss`, from
/// the loss (with the output layer) or from `dout`, the next pipeline stage's gradient of this
/// stage's output: adds every parameter's gradient into `grads`. Returns, without the
/// embedding, the gradient of the stage's input for the previous stage.
pub fn backward<B: Backend>(
    b: &B,
    spec: &ModelSpec,
    (ids, params, grads): (&Ids, &[B::Tensor], &mut [B::Tensor]),
    (batch, dout): (&MicroBatch, Option<B::Tensor>),
    saved: Saved<B::Tensor>,
    (tp, experts): (Option<&TensorParallel<B::Tensor>>, ExpertGroups<B::Tensor>),
) -> Result<Option<B::Tensor>> {
    let Saved {
        layers,
        head,
        depths,
        cos,
        sin,
        ..
    } = saved;
    let p = ids.pass(
        (b, spec),
        params,
        (tp, experts),
        (&cos, &sin),
        batch.regularisers(),
    );
    let mut dx = match (head, ids.head, dout) {
        (Some(head), Some(at), _) => {
            let dhand = depths_backward(&p, (ids, grads), batch, &head, depths)?;
            let targets = (&batch.labels[..], &batch.dloss[..]);
            let (to_norm, to_out) = match spec.mtp_normed_handoff() {
                true => (dhand, None),
                false => (None, dhand),
            };
            let mut dx = head_backward(&p, grads, targets, head, &at, to_norm)?;
            if let Some(d) = to_out {
                b.add_assign(&mut dx, &d)?;
            }
            dx
        }
        (_, _, Some(dout)) => dout,
        _ => {
            return Err(EngineError::Invalid {
                op: "backward",
                msg: "a pipeline stage without the output layer needs the gradient of its output"
                    .into(),
            })
        }
    };
    let mut carry = None;
    for (layer, s) in ids.layers.iter().zip(layers).rev() {
        dx = layer.backward(&p, grads, s, (dx, &batch.segments, &mut carry))?;
    }
    let Some(e) = ids.embedding else {
        return Ok(Some(dx));
    };
    if ids.trainable[e] {
        let tokens = local_ids(tp, &batch.tokens);
        let dx = dropped(&p, &dx, (0, Site::Embedding))?.unwrap_or(dx);
        let all = gathered(b, tp, &dx)?;
        b.embedding_bwd(all.as_ref().unwrap_or(&dx), &tokens, &mut grads[e])?;
    }
    Ok(None)
}

/// The backward passes of multi-token prediction's depths, the last first: the gradient of
/// the hidden state the main model handed to the first depth (`None` without depths).
fn depths_backward<B: Backend>(
    p: &Pass<B>,
    (ids, grads): (&Ids, &mut [B::Tensor]),
    batch: &MicroBatch,
    head: &HeadSaved<B::Tensor>,
    mut depths: Vec<DepthSaved<B::Tensor>>,
) -> Result<Option<B::Tensor>> {
    let (Some(embedding), Some(Head { output, .. })) = (ids.depth_embedding, ids.head) else {
        return Ok(None);
    };
    let mut dnext = None;
    while let Some(s) = depths.pop() {
        let k = depths.len();
        let from = depths.last().map_or(head, |d| &d.head);
        let normed = p.spec.mtp_normed_handoff();
        let hand = if normed { &from.hf } else { &from.norm.x };
        let saved = (s, hand, &batch.mtp[k]);
        let d = (dnext.take(), normed);
        dnext = Some(ids.depths[k].backward(p, grads, saved, (embedding, output), d)?);
    }
    Ok(dnext)
}

/// The cross entropy of logits over this rank's vocabulary shard against `labels` (rows of
/// the shard, or [`crate::engine::NO_ROW`]), as the whole vocabulary's: the shards'
/// log-sum-exps and target logits reduced over the group (Megatron's three all-reduces of
/// `[T]` f32: the maximum, the target logit, Σexp). Returns the per-row loss and the whole
/// vocabulary's log-sum-exp, which the backward pass's softmax takes.
fn vocab_parallel_cross_entropy<B: Backend>(
    b: &B,
    tp: &TensorParallel<B::Tensor>,
    logits: &B::Tensor,
    labels: &[u32],
) -> Result<(B::Tensor, B::Tensor)> {
    let (loss, lse) = b.cross_entropy(logits, labels)?;
    let (loss, lse) = (b.download_f32(&loss)?, b.download_f32(&lse)?);
    let n = [lse.len()];
    let reduced = |values: Vec<f32>, op| -> Result<Vec<f32>> {
        let mut t = b.upload_f32(&n, &values)?;
        tp.group.all_reduce(&mut t, op)?;
        b.download_f32(&t)
    };
    let max = reduced(lse.clone(), ReduceOp::Max)?;
    // A shard's loss is its log-sum-exp less the target logit if it holds the label.
    let target = reduced(
        lse.iter().zip(&loss).map(|(l, x)| l - x).collect(),
        ReduceOp::Sum,
    )?;
    let shifted = lse.iter().zip(&max).map(|(l, m)| (l - m).exp()).collect();
    let sum_exp = reduced(shifted, ReduceOp::Sum)?;
    let whole: Vec<f32> = (max.iter().zip(&sum_exp))
        .map(|(m, s)| (f64::from(*m) + f64::from(*s).ln()) as f32)
        .collect();
    let loss: Vec<f32> = whole.iter().zip(&target).map(|(l, t)| l - t).collect();
    Ok((b.upload_f32(&n, &loss)?, b.upload_f32(&n, &whole)?))
}
