//! Gradients and losses across ranks after the micro-batches (megatron/core/distributed/
//! finalize_model_grads.py): the sequence-parallel norm and tied-embedding gradient sums, the
//! losses gathered to every rank, and the model-wide sums behind the gradient norm, the
//! parameter norm and the zeros counted in the gradient.

use super::data;
use super::step::PendingLoss;
use super::trainer::Trainer;
use crate::arch::roles::{Canon, Role};
use crate::engine::comm::{Communicator, Counted, ReduceOp};
use crate::engine::Backend;
use crate::tensor::DType;
use anyhow::{anyhow, Result};

impl<B: Backend> Trainer<B> {
    /// The trained norm weights each tensor-parallel rank holds whole but takes the gradient
    /// of over its part only: under sequence parallelism the norms of the residual stream (a
    /// LayerNorm's β too) and
    /// an MoE layer's router and shared-expert gate, over its rows (Megatron's
    /// `sequence_parallel` attribute); the q/k layernorms, over its heads.
    pub(super) fn trained_norms(&self) -> Vec<usize> {
        let sp = self.cfg.sequence_parallel;
        let partial = |r| match r {
            Role::InputNorm
            | Role::PostNorm
            | Role::FinalNorm
            | Role::InputNormBias
            | Role::PostNormBias
            | Role::FinalNormBias
            | Role::MtpEmbedNorm
            | Role::MtpHiddenNorm
            | Role::MtpNorm
            | Role::Router
            | Role::SharedGate
            | Role::QLatentNorm
            | Role::KvLatentNorm => sp,
            Role::QNorm | Role::KNorm => true,
            _ => false,
        };
        (self.table.params.iter().enumerate())
            .filter(|(_, p)| p.trainable && partial(p.canon.role))
            .map(|(i, _)| i)
            .collect()
    }

    /// A norm weight's gradient that covers this rank's rows or heads only (see
    /// [`Trainer::trained_norms`]) is summed over the tensor-parallel ranks in one all-reduce
    /// of them all, as megatron-core sums the `sequence_parallel` parameters and, with
    /// `qk_layernorm`, the q/k layernorms (megatron/core/distributed/finalize_model_grads.py
    /// `_allreduce_non_tensor_model_parallel_grads`). A row-parallel bias needs none here:
    /// its gradient is taken over every row.
    pub(super) fn sum_norm_grads(&mut self) -> Result<()> {
        let Some(tp) = self.tp.as_ref() else {
            return Ok(());
        };
        let norms: Vec<(usize, usize)> = (self.trained_norms().into_iter())
            .map(|i| (i, self.table.params[i].numel()))
            .collect();
        if norms.is_empty() {
            return Ok(());
        }
        let total = norms.iter().map(|&(_, n)| n).sum();
        let mut flat = self.b.zeros(&[total], DType::F32)?;
        let mut at = 0;
        for &(i, n) in &norms {
            self.b.copy_range((&self.grads[i], 0), (&mut flat, at), n)?;
            at += n;
        }
        tp.all_reduce(&mut flat, ReduceOp::Sum)?;
        let mut at = 0;
        for (i, n) in norms {
            self.b.copy_range((&flat, at), (&mut self.grads[i], 0), n)?;
            at += n;
        }
        Ok(())
    }

    /// Aux-loss-free balancing after the step's micro-batches (megatron-core
    /// finalize_model_grads.py `_update_router_expert_bias`, moe_utils.py
    /// `get_updated_expert_bias`): each of this stage's expert biases moves by
    /// `--moe-router-bias-update-rate` up for the experts that got fewer tokens than the mean
    /// over the experts and down for those that got more (f32, `torch.sign`: not at all for
    /// the mean), the tokens summed over the tensor- and data-parallel ranks.
    pub(super) fn update_expert_biases(&mut self) -> Result<()> {
        let Some(tracker) = self.moe.as_mut() else {
            return Ok(());
        };
        let counts = tracker.take_tokens();
        let Some(experts) = counts.first().map(|(_, c)| c.len()) else {
            return Ok(());
        };
        let mut tokens: Vec<f32> = counts.iter().flat_map(|(_, c)| c.iter().copied()).collect();
        for group in [&self.tp, &self.dp].into_iter().flatten() {
            group.all_reduce_f32(&mut tokens, ReduceOp::Sum)?;
        }
        let rate = self.cfg.expert_bias_rate as f32;
        for ((layer, _), tokens) in counts.iter().zip(tokens.chunks(experts)) {
            let canon = Canon {
                role: Role::ExpertBias,
                layer: Some(*layer),
            };
            let i = (self.table.index(canon))
                .ok_or_else(|| anyhow!("internal: no expert bias of layer {layer} on this rank"))?;
            let mut bias = self.b.download_f32(&self.params[i])?;
            let mean = tokens.iter().sum::<f32>() / experts as f32;
            for (b, &t) in bias.iter_mut().zip(tokens) {
                let offset = mean - t;
                if offset != 0.0 {
                    *b += offset.signum() * rate;
                }
            }
            self.params[i] = self.b.upload_f32(&[experts], &bias)?;
        }
        Ok(())
    }

    /// The loss sums of micro-batches' losses (read from the device; the last pipeline
    /// stage's).
    pub(super) fn loss_sums(&self, losses: &[PendingLoss<B::Tensor>]) -> Result<data::LossSums> {
        let mut sums = data::LossSums::default();
        for (loss, mask) in losses {
            let loss = loss
                .as_ref()
                .ok_or_else(|| anyhow!("internal: losses read off the last pipeline stage"))?;
            let (s, n) = data::masked_sum(&self.b.download_f32(loss)?, mask);
            sums.push(s, n);
        }
        Ok(sums)
    }

    /// The loss sums of every micro-batch of the global batch, known to every rank: gathered
    /// over the last pipeline stage's data-parallel ranks, then sent from it to the other
    /// stages (Megatron reports the loss from the last stage; here rank 0 logs it).
    pub(super) fn everyones_losses(
        &self,
        losses: &[PendingLoss<B::Tensor>],
    ) -> Result<data::LossSums> {
        if self.pp.is_none() {
            return self.gathered(self.loss_sums(losses)?);
        }
        let mut flat = vec![0f32; 2 * self.cfg.global_batch / self.cfg.micro_batch];
        if self.stage.last() {
            flat = self.gathered(self.loss_sums(losses)?)?.flat();
        }
        if let Some(pp) = &self.pp {
            pp.broadcast_f32(&mut flat, self.stage.head())?;
        }
        Ok(data::LossSums::interleaved(&flat, 1))
    }

    /// The tied embedding's gradient summed over the first pipeline stage (its lookup's) and
    /// the last (its copy's, as the output layer), the same sum on both so that the copies
    /// stay equal (megatron/core/distributed/finalize_model_grads.py
    /// `_allreduce_word_embedding_grads`, an all-reduce of the two here a send each way).
    pub(super) fn sum_shared_embedding(&mut self) -> Result<()> {
        let (Some(pp), false) = (&self.pp, self.stage.first() && self.stage.last()) else {
            return Ok(());
        };
        let embedding = Canon {
            role: Role::Embedding,
            layer: None,
        };
        // only the first and last stage hold the embedding (or its copy: the tied output
        // layer, or the multi-token prediction depths' embedding)
        let copied = self.cfg.model.tied || self.cfg.model.mtp.is_some();
        let at = self.table.index(embedding);
        let Some(i) = at.filter(|&i| copied && self.table.params[i].trainable) else {
            return Ok(());
        };
        let (first, last) = (0, self.stage.count - 1);
        let mut theirs = self.b.zeros(&self.table.params[i].shape, DType::F32)?;
        if self.stage.first() {
            pp.send(&self.grads[i], last)?;
            pp.recv(&mut theirs, last)?;
        } else {
            pp.recv(&mut theirs, first)?;
            pp.send(&self.grads[i], first)?;
        }
        // IEEE addition commutes: both stages get the same bits.
        self.b.add_assign(&mut self.grads[i], &theirs)?;
        Ok(())
    }

    /// Every data-parallel rank's loss sums, in the single rank's order of micro-batches (rank
    /// r's j-th is the (j·DP + r)-th), so the reported loss is the single rank's.
    fn gathered(&self, local: data::LossSums) -> Result<data::LossSums> {
        let Some(dp) = &self.dp else {
            return Ok(local);
        };
        let all = dp.all_gather_f32(&local.flat())?;
        Ok(data::LossSums::interleaved(&all, dp.size()))
    }

    /// `x` summed over the data-parallel ranks.
    pub(super) fn summed(&self, x: f32) -> Result<f32> {
        let Some(dp) = &self.dp else {
            return Ok(x);
        };
        let mut sum = [x];
        dp.all_reduce_f32(&mut sum, ReduceOp::Sum)?;
        Ok(sum[0])
    }

    /// Megatron's `count_zeros_fp32` over the trained gradients multiplied by `scale` (the clip
    /// coefficient the step is about to apply).
    pub(super) fn count_zeros(&self, scale: f32) -> Result<f64> {
        let grads = self.of_params(|s| &s.grads, &self.grads);
        let zeros = |tensors: &[&B::Tensor]| -> Result<f64> {
            let mut n = 0;
            for g in tensors {
                n += (self.b.download_f32(g)?.iter())
                    .filter(|&&x| x * scale == 0.0)
                    .count();
            }
            Ok(n as f64)
        };
        self.model_summed(&grads, zeros)
    }

    /// `--log-num-zeros-in-grad` and `--log-params-norm` of the step just taken, when asked
    /// for: over the trained parameters (their f32 main copies under `--bf16`), Megatron's
    /// `count_zeros_fp32` (counted before the step) and `calc_params_l2_norm`.
    pub(super) fn norms(&self) -> Result<(Option<f64>, Option<f64>)> {
        let zeros = self.zeros_in_grad;
        let whole = self.opt.main.as_deref().unwrap_or(&self.params);
        let params = match self.cfg.log_norms.0 {
            false => None,
            true => Some(self.model_norm(&self.of_params(|s| &s.main, whole))?),
        };
        Ok((zeros, params))
    }

    /// The trained parameters this rank counts in a model-wide sum: its shards, and the
    /// parameters every tensor-parallel rank holds a copy of on its rank 0 only (Megatron's
    /// `param_is_not_tensor_parallel_duplicate`), and not a pipeline's embedding copy
    /// (`param_is_not_shared`). Whole experts are each rank's own (the expert-parallel group
    /// spans the tensor-parallel ranks), their LoRA factors too; split experts' whole LoRA
    /// factors are copies, as the dense layers'.
    fn counted(&self) -> Vec<usize> {
        let first = self.tp.as_ref().is_none_or(|g| g.rank() == 0);
        (self.table.params.iter().enumerate())
            .filter(|&(i, p)| {
                // a routed expert's whole factors on its expert tensor-parallel rank 0
                let own = match self.expert_parallel(i) {
                    true => p.tp_split || self.shard(p).0 == 0,
                    false => first || p.tp_split,
                };
                p.trainable && !p.shared && own
            })
            .map(|(i, _)| i)
            .collect()
    }

    /// `x` summed over the model-parallel ranks (tensor-parallel, then pipeline stages), in
    /// f32 as Megatron reduces its norms (megatron/core/optimizer/clip_grads.py
    /// `get_grad_norm_fp32`, one all-reduce over the model-parallel group there).
    fn mp_summed(&self, x: f64) -> Result<f64> {
        if self.tp.is_none() && self.pp.is_none() {
            return Ok(x);
        }
        let mut sum = [x as f32];
        for group in [&self.tp, &self.pp].into_iter().flatten() {
            group.all_reduce_f32(&mut sum, ReduceOp::Sum)?;
        }
        Ok(f64::from(sum[0]))
    }

    /// Of `tensors` (each with its table parameter: [`Trainer::of_params`]), those this rank
    /// counts in a model-wide sum ([`Trainer::counted`]): the dense parameters' and, apart, the
    /// routed experts' under expert parallelism.
    fn counted_of<'a>(&self, tensors: &[(usize, &'a B::Tensor)]) -> [Vec<&'a B::Tensor>; 2] {
        let counted = self.counted();
        let (experts, dense): (Vec<_>, Vec<_>) = (tensors.iter())
            .filter(|(i, _)| counted.contains(i))
            .partition(|&&(i, _)| self.expert_parallel(i));
        [dense, experts].map(|part| part.into_iter().map(|&(_, t)| t).collect())
    }

    /// A model-wide sum of `part` (squares, zeros) over `tensors` (as
    /// [`Trainer::counted_of`] takes them): this rank's, the routed experts' summed over the
    /// expert-parallel ranks holding the others (megatron-core's expert optimizer reduces over
    /// its expert model-parallel group), then over the ranks holding the other parts: the
    /// model-parallel ones, and with the distributed optimizer (each data-parallel rank holding
    /// its pieces) the data-parallel ones first (Megatron all-reduces the distributed
    /// optimizer's norms over every rank).
    fn model_summed(
        &self,
        tensors: &[(usize, &B::Tensor)],
        part: impl Fn(&[&B::Tensor]) -> Result<f64>,
    ) -> Result<f64> {
        let [dense, experts] = self.counted_of(tensors);
        let sharded = !self.sharded.is_empty();
        let over = |x: f64, groups: &[&Option<Counted<B::Tensor>>]| -> Result<f64> {
            let mut sum = [x as f32];
            for g in groups.iter().copied().flatten() {
                g.all_reduce_f32(&mut sum, ReduceOp::Sum)?;
            }
            Ok(f64::from(sum[0]))
        };
        let mut x = part(&dense)?;
        if sharded && self.dp.is_some() {
            x = over(x, &[&self.dp])?;
        }
        if self.ep.is_none() {
            return self.mp_summed(x);
        }
        let edp = if sharded { &self.edp } else { &None };
        let experts = over(part(&experts)?, &[edp, &self.ep])?;
        match self.cfg.layout.expert_tensor_parallel() == self.tp().1 {
            true => self.mp_summed(x + experts),
            // the expert-parallel group spans tensor-parallel ranks: the experts' sums over
            // their expert tensor-parallel ranks only
            false => {
                let experts = over(experts, &[&self.etp])?;
                over(over(x, &[&self.tp])? + experts, &[&self.pp])
            }
        }
    }

    /// The L2 norm of the whole model's `tensors` (gradients or parameters, as
    /// [`Trainer::counted_of`] takes them), over the ranks holding its parts.
    pub(super) fn model_norm(&self, tensors: &[(usize, &B::Tensor)]) -> Result<f64> {
        let squares = |counted: &[&B::Tensor]| -> Result<f64> {
            match counted.is_empty() {
                true => Ok(0.0),
                false => Ok(self.b.sum_squares(counted)?),
            }
        };
        Ok(self.model_summed(tensors, squares)?.sqrt())
    }
}
