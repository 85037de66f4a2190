//! One step's micro-batches through this rank's pipeline stage: forward and backward passes
//! of its model chunks in the schedule's order ([`pipeline`]), and the point-to-point
//! exchanges between stages.

use super::config::TrainConfig;
use super::data;
use super::pipeline;
use super::trainer::{Chunk, Trainer};
use crate::arch::roles::Role;
use crate::arch::MtpLayout;
use crate::engine::comm::{Communicator, Counted};
use crate::engine::Backend;
use crate::model::decoder::{backward, forward, MicroBatch, Saved};
use crate::model::dropout::Dropout;
use crate::model::parallel::TensorParallel;
use crate::model::params::ParamInfo;
use crate::tensor::DType;
use anyhow::{anyhow, Result};

/// What came from the previous and from the next pipeline stage.
type Neighbours<T> = (Option<T>, Option<T>);

/// A micro-batch's per-token losses, still on the device (on the last pipeline stage), and
/// its loss mask.
pub(super) type PendingLoss<T> = (Option<T>, Vec<f32>);

impl<B: Backend> Trainer<B> {
    /// [`Trainer::step_batches`], after (under `--stage dpo`) the reference's forward passes
    /// of the same micro-batches, whose row losses the policy's passes then read.
    pub(super) fn passes(
        &mut self,
        split: &data::Source,
        from: u64,
        train: bool,
    ) -> Result<(Vec<PendingLoss<B::Tensor>>, u64)> {
        if let Some(mut reference) = self.reference.take() {
            let swap = |params: &mut [B::Tensor], reference: &mut [Option<B::Tensor>]| {
                for (p, r) in params.iter_mut().zip(reference) {
                    if let Some(r) = r {
                        std::mem::swap(p, r);
                    }
                }
            };
            swap(&mut self.params, &mut reference);
            let scored = self.step_batches(split, from, false);
            swap(&mut self.params, &mut reference);
            self.reference = Some(reference);
            let download = |(loss, _): &PendingLoss<B::Tensor>| {
                loss.as_ref().map(|t| self.b.download_f32(t)).transpose()
            };
            let rows = scored?.0.iter().map(download).collect::<Result<_, _>>()?;
            self.reference_losses = Some(rows);
        }
        self.step_batches(split, from, train)
    }

    /// A DPO micro-batch on the last pipeline stage: the policy's row losses `out` and the
    /// reference's become its pair losses (what is logged, as one value of weight 1) and each
    /// row's loss gradient for the backward pass.
    fn preference_loss(
        &mut self,
        out: &B::Tensor,
        reference: Option<&Vec<f32>>,
        prepared: &mut data::Prepared,
        train: bool,
    ) -> Result<PendingLoss<B::Tensor>> {
        let (Some(dpo), Some(reference)) = (self.cfg.preference, reference) else {
            return Err(anyhow!(
                "internal: a DPO pass without the reference's losses"
            ));
        };
        let k = self.cfg.global_batch / self.cfg.micro_batch;
        let policy = self.b.download_f32(out)?;
        let rows = (&policy[..], &reference[..]);
        let scored = dpo.score(rows, &prepared.mask, self.cfg.micro_batch, k);
        if train {
            self.accuracy += scored.accuracy;
        }
        prepared.batch.dloss = scored.dloss;
        let loss = self.b.upload_f32(&[1], &[scored.loss as f32])?;
        Ok((Some(loss), vec![1.0]))
    }

    /// Forward (and, for training, backward) of K micro-batches from `split` at `from`:
    /// returns each micro-batch's loss mask with, on the last pipeline stage, its losses (on
    /// the device), and the rows processed. Over pipeline stages the passes run in
    /// Megatron's order ([`pipeline`]: 1F1B, or interleaved over model chunks); each chunk's
    /// gradients add in micro-batch order, as on one stage.
    pub(super) fn step_batches(
        &mut self,
        split: &data::Source,
        from: u64,
        train: bool,
    ) -> Result<(Vec<PendingLoss<B::Tensor>>, u64)> {
        let c = &self.cfg;
        let (m, k) = (c.micro_batch, c.global_batch / c.micro_batch);
        // Megatron's sampler (`single`): rank r's j-th micro-batch is the (j·DP + r)-th of the
        // global batch; `cyclic`: its j-th draw from its own bucket. Every micro-batch weighs
        // 1/K of the whole batch (the gradients are summed over the ranks).
        let (dp, dp_rank) = self.dp.as_ref().map_or((1, 0), |g| (g.size(), g.rank()));
        let random = self.random_sampler(split);
        let mut batches = Vec::with_capacity(k / dp);
        for j in 0..k / dp {
            let at = from + ((j * dp + dp_rank) * m) as u64;
            let ids: Vec<u64> = match c.loader {
                data::Loader::Single => (at..at + m as u64).collect(),
                // every rank's sampler counts the M × DP samples of each draw
                data::Loader::Cyclic => {
                    random.micro_batch(from + (j * dp * m) as u64, &mut self.perms)?
                }
            };
            let mut prepared = split.micro_batch(&ids, k, c.averaging)?;
            // Dropout and the MoE auxiliary losses in training only; dropout keyed by the
            // consumed-sample index `at` of the first sample: no evaluation drops anything.
            if train {
                // MindSpeed-LLM moves its depths' documents with their ids, megatron-core not
                let moved = c
                    .model
                    .mtp
                    .is_some_and(|m| m.layout == MtpLayout::Mindspeed);
                let mtp = (c.model.mtp_depths(), c.mtp_loss_scale, moved);
                let mtp = data::mtp_rows(&prepared, mtp, k, c.averaging);
                let b = &mut prepared.batch;
                b.dropout = Dropout::new(c.seed, c.dropout, c.router_noise, at, &b.positions);
                b.aux = c.aux_losses.clone();
                b.indexer = c.indexer_loss;
                b.mtp = mtp;
            }
            batches.push(prepared);
        }
        let reference = self.reference_losses.take();
        let tokens = batches.iter().map(|p| p.batch.tokens.len() as u64).sum();
        let pipe = self.pipeline(batches.len());
        let mut losses: Vec<PendingLoss<B::Tensor>> =
            batches.iter().map(|p| (None, p.mask.clone())).collect();
        let mut inputs = std::collections::HashMap::new();
        let mut out_grads = std::collections::HashMap::new();
        let mut outputs = std::collections::HashMap::new();
        let mut saved = std::collections::HashMap::new();
        let mut in_grads = std::collections::HashMap::new();
        let missing = |what: &str, slot: pipeline::Slot| {
            anyhow!(
                "internal: pipeline schedule: no {what} for chunk {} micro-batch {}",
                slot.0,
                slot.1
            )
        };
        for op in pipe.ops(train) {
            match op {
                pipeline::Op::Forward(slot) => {
                    let batch = &batches[slot.1].batch;
                    let (out, fwd) = self.forward_pass(slot.0, batch, inputs.remove(&slot))?;
                    match (pipe.model_last(slot.0), pipe.turns(slot.0)) {
                        (true, _) if reference.is_some() => {
                            let rows = reference.as_ref().and_then(|r| r[slot.1].as_ref());
                            let prepared = &mut batches[slot.1];
                            losses[slot.1] = self.preference_loss(&out, rows, prepared, train)?;
                        }
                        (true, _) => losses[slot.1].0 = Some(out),
                        (false, Some(c)) => _ = inputs.insert((c, slot.1), out),
                        (false, None) => _ = outputs.insert(slot, out),
                    }
                    if train {
                        if let (Some(m), Some(aux)) = (&mut self.moe, &self.cfg.aux_losses) {
                            m.add(&fwd.moe_stats(), aux.balancing);
                        }
                        if let Some(m) = &mut self.mtp {
                            m.add(fwd.mtp_losses());
                        }
                        if let Some(t) = &mut self.indexer {
                            t.add(&fwd.indexer_losses());
                        }
                        saved.insert(slot, fwd);
                    }
                }
                pipeline::Op::Backward(slot) => {
                    let fwd = saved
                        .remove(&slot)
                        .ok_or_else(|| missing("forward pass", slot))?;
                    let batch = &batches[slot.1].batch;
                    let grad = out_grads.remove(&slot);
                    if let Some(d) = self.backward_pass(slot, batch, fwd, grad)? {
                        // where the V turns, chunk 1's input gradient is chunk 0's output's
                        match pipe.turned_from(slot.0) {
                            Some(c) => _ = out_grads.insert((c, slot.1), d),
                            None => _ = in_grads.insert(slot, d),
                        }
                    }
                }
                pipeline::Op::Exchange(x) => {
                    let to_next = match x.send_next {
                        Some(slot) => {
                            Some(outputs.get(&slot).ok_or_else(|| missing("output", slot))?)
                        }
                        None => None,
                    };
                    let to_prev = match x.send_prev {
                        Some(slot) => Some(
                            in_grads
                                .get(&slot)
                                .ok_or_else(|| missing("input gradient", slot))?,
                        ),
                        None => None,
                    };
                    let rows = |slot: pipeline::Slot| batches[slot.1].batch.tokens.len();
                    let (from_prev, from_next) = self.p2p(&pipe, &x, (to_next, to_prev), rows)?;
                    if let (Some(slot), Some(t)) = (x.recv_prev, from_prev) {
                        inputs.insert(slot, t);
                    }
                    if let (Some(slot), Some(t)) = (x.recv_next, from_next) {
                        out_grads.insert(slot, t);
                    }
                    if let Some(slot) = x.send_prev {
                        in_grads.remove(&slot);
                    }
                    if let Some(slot) = x.send_next {
                        outputs.remove(&slot);
                    }
                }
            }
        }
        Ok((losses, tokens))
    }

    /// `--dataloader-type cyclic`'s sampler of `split` on this data-parallel rank.
    pub(super) fn random_sampler(&self, split: &data::Source) -> data::RandomSampler {
        let (ranks, rank) = self.dp.as_ref().map_or((1, 0), |g| (g.size(), g.rank()));
        data::RandomSampler {
            total: split.len() as u64,
            micro_batch: self.cfg.micro_batch,
            ranks,
            rank,
        }
    }

    /// This rank's stage of the pipeline over `micro` micro-batches.
    fn pipeline(&self, micro: usize) -> pipeline::Pipeline {
        let v = self.cfg.virtual_pipeline;
        pipeline::Pipeline {
            stages: self.stage.count,
            chunks: self.chunks.len(),
            micro,
            group: v.map_or(self.stage.count, |v| v.group),
            stage: self.stage.index,
            v_shape: self.cfg.dualpipev,
        }
    }

    /// One micro-batch forward through model chunk `chunk` of this rank's stage.
    fn forward_pass(
        &self,
        chunk: usize,
        batch: &MicroBatch,
        input: Option<B::Tensor>,
    ) -> Result<(B::Tensor, Saved<B::Tensor>)> {
        let tp = tensor_parallel(self.tp.as_ref(), &self.cfg);
        let etp = expert_tensor_parallel((self.tp.as_ref(), self.etp.as_ref()), &self.cfg);
        let Chunk { ids, params } = &self.chunks[chunk];
        Ok(forward(
            &self.b,
            &self.spec,
            (ids, &self.params[params.clone()]),
            (batch, input),
            self.activations(),
            (
                tp.as_ref(),
                (
                    self.ep.as_ref().map(|g| g as &dyn Communicator<Tensor = _>),
                    etp.as_ref(),
                ),
            ),
        )?)
    }

    /// One micro-batch backward through model chunk `slot.0`: the gradient of its input on
    /// all but the model's first chunk. The gradients that a bf16 model holds as bf16 tensors
    /// upstream ([`rounds_per_pass`]) are this pass's contribution rounded to bf16, added to
    /// what earlier micro-batches left (megatron-core
    /// `distributed/distributed_data_parallel.py` `_make_backward_post_hook`:
    /// `param.main_grad.add_(param.grad.data)`): the chunk's first micro-batch finds its
    /// gradients zero and rounds them in place, a later one computes into zeroed stand-ins.
    fn backward_pass(
        &mut self,
        (chunk, micro): pipeline::Slot,
        batch: &MicroBatch,
        saved: Saved<B::Tensor>,
        grad: Option<B::Tensor>,
    ) -> Result<Option<B::Tensor>> {
        let tp = tensor_parallel(self.tp.as_ref(), &self.cfg);
        let etp = expert_tensor_parallel((self.tp.as_ref(), self.etp.as_ref()), &self.cfg);
        let Chunk { ids, params } = &self.chunks[chunk];
        let rounded: Vec<usize> = params
            .clone()
            .filter(|&i| rounds_per_pass(&self.table.params[i], &self.cfg))
            .collect();
        let mut earlier = Vec::new();
        if micro > 0 {
            for &i in &rounded {
                let zero = self.b.zeros(self.b.shape(&self.grads[i]), DType::F32)?;
                earlier.push(std::mem::replace(&mut self.grads[i], zero));
            }
        }
        let d = backward(
            &self.b,
            &self.spec,
            (
                ids,
                &self.params[params.clone()],
                &mut self.grads[params.clone()],
            ),
            (batch, grad),
            saved,
            (
                tp.as_ref(),
                (
                    self.ep.as_ref().map(|g| g as &dyn Communicator<Tensor = _>),
                    etp.as_ref(),
                ),
            ),
        )?;
        if earlier.is_empty() {
            for &i in &rounded {
                self.b.round_to(&mut self.grads[i], DType::BF16)?;
            }
        }
        for (&i, mut sum) in rounded.iter().zip(earlier) {
            self.b.add_rounded(&mut sum, &self.grads[i], DType::BF16)?;
            self.grads[i] = sum;
        }
        Ok(d)
    }

    /// Megatron's point-to-point step between pipeline stages
    /// (megatron/core/pipeline_parallel/p2p_communication.py `_p2p_ops`): the sends (`to_next`,
    /// `to_prev`) and receives of `x`, an even stage sending first and an odd one receiving
    /// first, so that each send meets its receive even where a send waits for it. The stages
    /// form a ring (the last one's next is the first, for the interleaved schedule's chunks);
    /// a received tensor has `rows(slot)` rows of the micro-batch it serves (over the
    /// tensor-parallel ranks under sequence parallelism). Returns what came from the previous
    /// and the next stage.
    fn p2p(
        &self,
        pipe: &pipeline::Pipeline,
        x: &pipeline::Exchange,
        (to_next, to_prev): (Option<&B::Tensor>, Option<&B::Tensor>),
        rows: impl Fn(pipeline::Slot) -> usize,
    ) -> Result<Neighbours<B::Tensor>> {
        let Some(pp) = &self.pp else {
            return Ok((None, None));
        };
        let me = self.stage.index;
        // along the model: the next stage's chunk takes the output (the previous one's, back
        // up a V's second leg)
        let chunk = |slot: Option<pipeline::Slot>| slot.map_or(0, |s| s.0);
        let next = |slot| pipe.downstream(chunk(slot));
        let prev = |slot| pipe.upstream(chunk(slot));
        let sp = match self.cfg.sequence_parallel {
            true => self.tp().1,
            false => 1,
        };
        let recv = |slot: pipeline::Slot, from| -> Result<B::Tensor> {
            let shape = [rows(slot) / sp, self.cfg.model.hidden];
            let mut x = self.b.zeros(&shape, self.activations())?;
            pp.recv(&mut x, from)?;
            Ok(x)
        };
        let (mut from_prev, mut from_next) = (None, None);
        let ops: [u8; 4] = if me.is_multiple_of(2) {
            [0, 1, 2, 3]
        } else {
            [1, 0, 3, 2]
        };
        for op in ops {
            match op {
                0 => (to_next.map(|t| pp.send(t, next(x.send_next))))
                    .transpose()
                    .map(drop)?,
                1 => from_prev = x.recv_prev.map(|s| recv(s, prev(Some(s)))).transpose()?,
                2 => (to_prev.map(|t| pp.send(t, prev(x.send_prev))))
                    .transpose()
                    .map(drop)?,
                _ => from_next = x.recv_next.map(|s| recv(s, next(Some(s)))).transpose()?,
            }
        }
        Ok((from_prev, from_next))
    }
}

/// Whether a parameter's gradient is rounded to bf16 after each backward pass before it adds
/// into its f32 main gradient: upstream's autograd gives a bf16 parameter a bf16 `.grad`,
/// except for the linear layers' weights under gradient-accumulation fusion, whose products
/// add straight into the f32 main gradient (megatron-core `tensor_parallel/layers.py`
/// `LinearWithGradAccumulationAndAsyncCommunication.backward`, `wgrad_gemm_accum_fp32`;
/// MindSpeed's NPU kernel alike). Linear weights: the projections, the output layer (also a
/// later pipeline stage's copy of a tied embedding, and a tied embedding on one stage, whose
/// output-layer product upstream fuses) and LoRA's factors (peft's megatron layers are
/// Megatron linear layers). Biases, norms and an embedding that is only looked up are always
/// rounded (docs/training.md §3.4), unless they are f32.
///
/// An MoE layer's experts and shared experts are linear layers too (SequentialMLP, SharedExpertMLP);
/// grouped experts (`--moe-grouped-gemm`, GroupedMLP's grouped matmul) fuse their accumulation only
/// with MindSpeed's `--gemm-gradient-accumulation-fusion`. The router's product and the shared
/// experts' gate are plain bf16 products, rounded.
fn rounds_per_pass(p: &ParamInfo, cfg: &TrainConfig) -> bool {
    let tied_on_one_stage =
        p.canon.role == Role::Embedding && cfg.model.tied && cfg.stages.len() == 1;
    let expert = matches!(p.canon.role, Role::ExpertFc1(_) | Role::ExpertFc2(_));
    let linear_weight = p.lora.is_some()
        || p.shared
        || tied_on_one_stage
        || expert
        || matches!(
            p.canon.role,
            Role::Qkv
                | Role::Proj
                | Role::Fc1
                | Role::Up
                | Role::Fc2
                | Role::Output
                | Role::SharedFc1
                | Role::SharedFc2
                | Role::QDown
                | Role::QUp
                | Role::QProj
                | Role::KvDown
                | Role::KvUp
                | Role::QUpNope
                | Role::QUpRope
                | Role::KvUpNope
                | Role::ValueUp
                | Role::MtpProj
        );
    let fused = match expert && cfg.grouped_experts && p.lora.is_none() {
        true => cfg.gemm_gradient_accumulation_fusion,
        false => cfg.gradient_accumulation_fusion,
    };
    // an f32 parameter (--init-norm-weight-in-fp32's norms) has an f32 `.grad`
    cfg.bf16 && p.trainable && p.dtype != DType::F32 && !(fused && linear_weight)
}

/// The ranks a rank's routed experts are split over, as a pass takes them: the
/// tensor-parallel group `tp` at ETP = TP, the expert tensor-parallel group `etp` (its own
/// block of them) where ETP is less, none for whole experts.
fn expert_tensor_parallel<'a, T: crate::engine::comm::Payload>(
    (tp, etp): (Option<&'a Counted<T>>, Option<&'a Counted<T>>),
    cfg: &TrainConfig,
) -> Option<TensorParallel<'a, T>> {
    match cfg.layout.expert_tensor_parallel() {
        1 => None,
        _ => tensor_parallel(etp.or(tp), cfg),
    }
}

/// A rank's place in tensor parallelism over `group`.
fn tensor_parallel<'a, T: crate::engine::comm::Payload>(
    group: Option<&'a Counted<T>>,
    cfg: &TrainConfig,
) -> Option<TensorParallel<'a, T>> {
    group.map(|group| {
        let rows = cfg.vocab_padded / group.size();
        let first = group.rank() * rows;
        TensorParallel {
            group: group as &dyn Communicator<Tensor = T>,
            vocab: first..first + rows,
            sequence_parallel: cfg.sequence_parallel,
        }
    })
}
