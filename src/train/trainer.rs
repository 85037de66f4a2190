//! The training state of one rank and Megatron's loop over it (megatron/training/training.py
//! `train`, `train_step`): set-up, the iterations, optimizer steps, logging, validation, saving
//! and the exit conditions.

use super::config::TrainConfig;
use super::init::initial_params;
use super::launch::Groups;
use super::optim::{self, Optimizer};
use super::parallel::{Axis, Stage};
use super::report::{chrono_now, flops_model};
use super::{checkpoint, data, distrib, log, tensorboard, SkippedIterations, TrainSummary};
use crate::arch::roles::Role;
use crate::engine::comm::{Communicator, Counted, ReduceOp};
use crate::engine::{Backend, Op};
use crate::model::decoder::Ids;
use crate::model::params::{LoraSpec, ParamTable};
use crate::model::ModelSpec;
use crate::tensor::DType;
use crate::util::{progress_bar, ProgressUnit};
use anyhow::{anyhow, bail, Context, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// One model chunk of a rank's pipeline stage: its parameters' ids, numbered within it, and
/// where its parameters sit among the rank's.
pub(super) struct Chunk {
    pub(super) ids: Ids,
    pub(super) params: std::ops::Range<usize>,
}

/// Running sums of one log interval (`training_log`'s `total_loss_dict`).
#[derive(Default)]
struct Interval {
    loss_sum: f32,
    advanced: u64,
    skipped: u64,
    nan: u64,
    tokens: u64,
    start: Option<Instant>,
    /// The MoE auxiliary losses' and the multi-token prediction losses' per-iteration values,
    /// summed (tracker order).
    tracked: Vec<(String, f64)>,
}

/// The training state.
pub(super) struct Trainer<B: Backend> {
    pub(super) b: B,
    pub(super) cfg: TrainConfig,
    pub(super) spec: ModelSpec,
    pub(super) table: ParamTable,
    /// The model chunks of this rank's stage (one without a virtual pipeline).
    pub(super) chunks: Vec<Chunk>,
    pub(super) params: Vec<B::Tensor>,
    pub(super) grads: Vec<B::Tensor>,
    /// Whether `grads` hold zeros (fresh, or left so by the optimizer's step).
    pub(super) grads_zeroed: bool,
    /// `--log-num-zeros-in-grad`: the step just taken's count, when it is reported.
    pub(super) zeros_in_grad: Option<f64>,
    pub(super) opt: Optimizer<B::Tensor>,
    pub(super) iteration: u64,
    pub(super) consumed_train: u64,
    pub(super) consumed_valid: u64,
    /// `--dataloader-type cyclic`: the random sampler's permutations in use.
    pub(super) perms: data::Permutations,
    /// Samples the schedule has counted (successful steps × G).
    pub(super) schedule_steps: u64,
    pub(super) flops: f64,
    pub(super) quiet: bool,
    pub(super) stop: Option<Arc<AtomicBool>>,
    pub(super) tensorboard: Option<tensorboard::TensorBoard>,
    /// Elements of the whole model (every rank's shards).
    pub(super) model_numel: usize,
    /// The tensor-parallel group (None: one rank), its collectives counted.
    pub(super) tp: Option<Counted<B::Tensor>>,
    /// The data-parallel group (None: one rank), its collectives counted.
    pub(super) dp: Option<Counted<B::Tensor>>,
    /// The pipeline-parallel group (None: one stage), its collectives counted.
    pub(super) pp: Option<Counted<B::Tensor>>,
    /// The expert-parallel group (None: every expert here), its collectives counted.
    pub(super) ep: Option<Counted<B::Tensor>>,
    /// The expert-data-parallel group under expert parallelism (None: one rank, or no expert
    /// parallelism, where the data-parallel group reduces the experts' gradients too).
    pub(super) edp: Option<Counted<B::Tensor>>,
    /// The expert tensor-parallel group where it is not the tensor-parallel one (1 < ETP <
    /// TP: a block of its ranks); None at ETP = TP or 1.
    pub(super) etp: Option<Counted<B::Tensor>>,
    /// The distributed optimizer's state (`--use-distributed-optimizer`; `opt` then holds
    /// none): the parameters' over the data-parallel group, and under expert parallelism the
    /// routed experts' apart over the expert-data-parallel group (megatron-core's
    /// `ChainedOptimizer` of two); empty without it.
    pub(super) sharded: Vec<distrib::Sharded<B::Tensor>>,
    /// This rank's pipeline stage.
    pub(super) stage: Stage,
    /// The global rank (0 alone): rank 0 logs; the ranks of data-parallel rank 0 save.
    pub(super) rank: usize,
    /// The MoE layers' auxiliary losses of the step (None for a dense model).
    pub(super) moe: Option<super::moe::MoeTracker>,
    /// DeepSeek sparse attention's indexer loss, where the model has an indexer.
    pub(super) indexer: Option<super::dsa::IndexerTracker>,
    /// The multi-token prediction depths' losses of the step (None without them).
    pub(super) mtp: Option<super::mtp::MtpTracker>,
    /// `--stage dpo`: the frozen reference (the weights training started from), in the
    /// layout of `params`: a copy of each trained parameter (the frozen ones, a LoRA base, are
    /// the reference's already).
    pub(super) reference: Option<Vec<Option<B::Tensor>>>,
    /// `--stage dpo`: the reference's row losses of each micro-batch of the pass about to run
    /// (on the last pipeline stage; none elsewhere).
    pub(super) reference_losses: Option<Vec<Option<Vec<f32>>>>,
    /// `--stage dpo`: the sum of the step's micro-batches' reward accuracies on this rank.
    pub(super) accuracy: f64,
}

impl<B: Backend> Trainer<B> {
    pub(super) fn new(
        b: B,
        cfg: TrainConfig,
        quiet: bool,
        groups: Groups<B::Tensor>,
    ) -> Result<Self> {
        if cfg.dropout.1.is_some() && !b.supports(Op::AttentionDropout, cfg.model.dtype) {
            bail!(
                "--attention-dropout (Megatron's default 0.1 when not given) is not built on {}; \
                 pass --attention-dropout 0",
                b.describe()
            );
        }
        let tp = (
            groups.tp.as_ref().map_or(0, |g| g.rank()),
            cfg.layout.size(Axis::Tp),
        );
        let mut spec =
            ModelSpec::at_length(&cfg.model, Some(cfg.seq_length))?.tensor_parallel(tp.1);
        spec.router_f32 = cfg.router_f32;
        spec.capacity = cfg.capacity;
        let vpp = cfg.virtual_pipeline.map_or(1, |v| v.chunks);
        let pp_rank = groups.pp.as_ref().map_or(0, |g| g.rank());
        let stage = Stage::of(&cfg.stages, vpp, pp_rank, cfg.dualpipev);
        let rank = groups.rank;
        let lora = cfg.lora.as_ref().map(|l| &l.spec);
        let mut table = ParamTable::new(&cfg.model, cfg.vocab_padded, lora);
        if cfg.init_std.1.is_some() {
            // training.py passes default_skip_embedding_weight_decay when
            // --embedding-init-method-std is given: no decay on parameters named "embedding".
            for p in table
                .params
                .iter_mut()
                .filter(|p| p.name.contains("embedding"))
            {
                p.decay = false;
            }
        }
        let model_numel = table.numel();
        let ep = (
            groups.ep.as_ref().map_or(0, |g| g.rank()),
            cfg.layout.size(Axis::Ep),
        );
        let etp = cfg.layout.expert_tensor_parallel();
        let tables = (table.tensor_parallel(&cfg.model, (tp.1, etp)))
            .expert_parallel(&cfg.model, ep)
            .pipeline_chunks(&stage.chunks, (stage.first(), stage.last()));
        let mine = ParamTable::concat(&tables);
        let mut host = initial_params(&cfg, (&table, &mine), tp)?;
        let table = mine;
        let lora_scale = lora.map_or(1.0, LoraSpec::scale);
        let mut start = 0;
        let mut chunks = Vec::with_capacity(tables.len());
        for (t, layers) in tables.iter().zip(&stage.chunks) {
            let ids = Ids::new(t, layers.clone(), lora_scale)
                .ok_or_else(|| anyhow!("internal: parameter table incomplete"))?;
            let params = start..start + t.params.len();
            start = params.end;
            chunks.push(Chunk { ids, params });
        }
        if let Some(dir) = cfg.lora.as_ref().and_then(|l| l.load.as_ref()) {
            let at = (tp, stage.rank(), ep);
            let at = (&table, at, cfg.grouped_experts);
            checkpoint::load_named(dir, at, |p| p.lora.is_some(), &mut host)?;
        }
        let params: Vec<B::Tensor> = host
            .iter()
            .map(|t| b.upload(t))
            .collect::<std::result::Result<_, _>>()?;
        // Frozen parameters (LoRA's base) get no gradient buffer.
        let grads = table
            .params
            .iter()
            .map(|p| b.zeros(if p.trainable { &p.shape } else { &[0] }, DType::F32))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let trained: Vec<bool> = table.params.iter().map(|p| p.trainable).collect();
        // With the distributed optimizer the Adam state is the rank's pieces' only.
        let mut sharded = Vec::new();
        if let Some(buckets) = cfg.distributed_optimizer {
            // a pipeline's tied embedding (and its copy) has a bucket of its own
            let shared = cfg.model.tied && stage.count > 1;
            let own_bucket = |i: usize| shared && table.params[i].canon.role == Role::Embedding;
            // distributed_data_parallel.py: no buckets after the first pipeline stage
            let size = buckets.size.filter(|_| stage.first());
            let size = size.map(|s| s.elements(table.numel()));
            let at = (size, buckets.pad_high, own_bucket);
            let [dp, edp] = [&groups.dp, &groups.edp]
                .map(|g| g.as_ref().map_or((0, 1), |g| (g.rank(), g.size())));
            // the routed experts under expert parallelism: their own buffers, over EDP
            let expert = |i: usize| ep.1 > 1 && table.params[i].canon.role.expert().is_some();
            for (experts, group) in [(false, dp), (true, edp)] {
                if experts && ep.1 == 1 {
                    continue;
                }
                let part = |i: usize| expert(i) == experts;
                let table_params = (&table, &params[..], cfg.grouped_experts, part);
                sharded.push(distrib::Sharded::new(
                    &b,
                    table_params,
                    group,
                    at,
                    cfg.adam,
                )?);
            }
        }
        let whole_state = match sharded.is_empty() {
            false => vec![false; trained.len()],
            true => trained.clone(),
        };
        let opt = Optimizer::new(&b, &table, &params, whole_state, cfg.adam)?;
        let stop = if cfg.exit.on_signal {
            Some(crate::util::defer_signals()?)
        } else {
            None
        };
        let tensorboard = cfg
            .tensorboard
            .as_ref()
            .filter(|_| rank == 0)
            .map(|(dir, _)| tensorboard::TensorBoard::create(dir))
            .transpose()?;
        let moe = super::moe::MoeTracker::new(&cfg.model, cfg.aux_losses.as_ref());
        let mut t = Trainer {
            moe,
            indexer: super::dsa::IndexerTracker::new(&cfg.model),
            mtp: super::mtp::MtpTracker::new(cfg.model.mtp_depths()),
            b,
            spec,
            table,
            chunks,
            params,
            grads,
            grads_zeroed: true,
            zeros_in_grad: None,
            opt,
            sharded,
            iteration: 0,
            consumed_train: 0,
            consumed_valid: 0,
            perms: data::Permutations::default(),
            schedule_steps: 0,
            flops: 0.0,
            quiet,
            stop,
            tensorboard,
            model_numel,
            tp: groups.tp.map(Counted::new),
            dp: groups.dp.map(Counted::new),
            pp: groups.pp.map(Counted::new),
            ep: groups.ep.map(Counted::new),
            edp: groups.edp.map(Counted::new),
            etp: groups.etp.map(Counted::new),
            stage,
            rank,
            cfg,
            reference: None,
            reference_losses: None,
            accuracy: 0.0,
        };
        t.resume(&trained)?;
        if t.cfg.preference.is_some() {
            let copy = |(p, &trained): (&B::Tensor, &bool)| {
                (trained.then(|| t.b.download(p).and_then(|h| t.b.upload(&h)))).transpose()
            };
            let copies = t.params.iter().zip(&trained).map(copy);
            t.reference = Some(copies.collect::<Result<_, _>>()?);
        }
        Ok(t)
    }

    /// The step's MoE auxiliary losses and multi-token prediction losses as Megatron logs them
    /// (every rank takes part in their reduction), the trackers reset; none for a dense model
    /// without prediction depths.
    fn tracked_losses(&mut self) -> Result<Vec<(String, f64)>> {
        fn group<T: crate::engine::comm::Payload>(
            g: &Option<Counted<T>>,
        ) -> Option<&dyn Communicator<Tensor = T>> {
            g.as_ref().map(|g| g.uncounted())
        }
        let c = &self.cfg;
        let micro_batches = c.global_batch / c.micro_batch / c.data_parallel;
        let mut out = Vec::new();
        if let Some(tracker) = &mut self.moe {
            let groups = (group(&self.pp), group(&self.tp), group(&self.dp));
            let moe = tracker.take(groups, micro_batches)?;
            out.extend(moe.into_iter().map(|(name, v)| (name.to_string(), v)));
        }
        if let Some(tracker) = &mut self.indexer {
            let groups = (group(&self.pp), group(&self.tp), group(&self.dp));
            out.push(tracker.take(groups, micro_batches)?);
        }
        if self.cfg.preference.is_some() {
            // a loss-dictionary entry: the micro-batches' mean, averaged over the data-parallel
            // ranks (only the last pipeline stage holds them)
            let mut sum = [std::mem::take(&mut self.accuracy)];
            for g in [group(&self.pp), group(&self.dp)].into_iter().flatten() {
                g.all_reduce_f64(&mut sum, ReduceOp::Sum)?;
            }
            let name = "rewards/accuracies".to_string();
            out.insert(0, (name, sum[0] / (micro_batches * c.data_parallel) as f64));
        }
        if let Some(tracker) = &mut self.mtp {
            out.extend(tracker.take((group(&self.pp), group(&self.dp)), micro_batches)?);
        }
        Ok(out)
    }

    /// One training iteration: returns (loss, grad norm, applied, tokens).
    fn train_step(&mut self, train: &data::Source) -> Result<(f32, f64, bool, u64)> {
        if !self.grads_zeroed {
            for g in &mut self.grads {
                *g = self.b.zeros(self.b.shape(g), DType::F32)?;
            }
        }
        self.grads_zeroed = false;
        let (losses, mut tokens) = self.passes(train, self.consumed_train, true)?;
        let mut n: f32 = losses
            .iter()
            .map(|(_, mask)| mask.iter().sum::<f32>())
            .sum();
        // Data parallel: gradients summed over the ranks; the losses of every rank's
        // micro-batches known to each (finalize_model_grads' all-reduces), and over pipeline
        // stages to every stage.
        let mut everyone = None;
        self.sum_norm_grads()?;
        self.sum_shared_embedding()?;
        self.update_expert_biases()?;
        let dp = self
            .dp
            .as_ref()
            .map(|g| g as &dyn Communicator<Tensor = B::Tensor>);
        let groups = shard_groups(&self.dp, &self.edp);
        match (self.sharded.is_empty(), dp) {
            (false, _) => {
                for (part, group) in self.sharded.iter_mut().zip(groups) {
                    part.reduce_scatter(&self.b, &self.grads, group)?;
                }
            }
            (true, Some(_)) => {
                let mut grads = std::mem::take(&mut self.grads);
                let summed = (grads.iter_mut().enumerate()).try_for_each(|(i, g)| {
                    (self.gradient_group(i))
                        .map_or(Ok(()), |group| group.all_reduce(g, ReduceOp::Sum))
                });
                self.grads = grads;
                summed?;
            }
            (true, None) => {}
        }
        if self.dp.is_some() {
            tokens = self.summed(tokens as f32)? as u64;
        }
        if self.dp.is_some() || self.pp.is_some() {
            let sums = self.everyones_losses(&losses)?;
            n = sums.tokens();
            everyone = Some(sums);
        }
        if self.cfg.averaging == data::LossAveraging::PerToken && n > 0.0 {
            let scale = 1.0 / n;
            let grads: Vec<&mut B::Tensor> = match self.sharded.is_empty() {
                false => (self.sharded.iter_mut())
                    .flat_map(|s| &mut s.grads)
                    .collect(),
                true => self.grads.iter_mut().collect(),
            };
            for g in grads {
                self.b.scale(g, scale)?;
            }
        }
        // The gradient norm waits for the device; the losses are read after it without
        // another wait, and the update is queued after both are known.
        let grad_norm = self.model_norm(&self.of_params(|s| &s.grads, &self.grads))?;
        let sums = match everyone {
            Some(sums) => sums,
            None => self.loss_sums(&losses)?,
        };
        let loss = sums.report(self.token_weighted());
        let lr = self.cfg.schedule.lr(self.schedule_steps);
        let wd = self.cfg.schedule.wd(self.schedule_steps);
        let skip = self.cfg.skip_non_finite;
        let applies = !skip || (loss.is_finite() && grad_norm.is_finite());
        // Counted after clipping, as Megatron counts them, before the step zeroes them.
        self.zeros_in_grad = match self.cfg.log_norms.1 && self.reports(self.iteration + 1) {
            true if applies => Some(self.count_zeros(self.cfg.adam.clip_scale(grad_norm))?),
            true => Some(self.count_zeros(1.0)?),
            false => None,
        };
        let report = if loss.is_finite() || !skip {
            self.apply(grad_norm, (lr, wd))?
        } else {
            optim::StepReport {
                grad_norm: f64::NAN,
                applied: false,
            }
        };
        if report.applied {
            self.schedule_steps += self.cfg.global_batch as u64;
        }
        // The distributed optimizer's step zeroes its own pieces, not these.
        self.grads_zeroed = report.applied && self.sharded.is_empty();
        self.consumed_train += self.cfg.global_batch as u64;
        Ok((loss, report.grad_norm, report.applied, tokens))
    }

    /// One optimizer step with the gradient norm `grad_norm` at `(lr, wd)`: over the whole
    /// model, or over this rank's pieces, whose parameters every rank then gathers.
    fn apply(&mut self, grad_norm: f64, (lr, wd): (f64, f64)) -> Result<optim::StepReport> {
        let skip = self.cfg.skip_non_finite;
        if self.sharded.is_empty() {
            let (params, grads) = (&mut self.params, &mut self.grads);
            return Ok(self
                .opt
                .apply(&self.b, params, grads, grad_norm, (lr, wd), skip)?);
        }
        let groups = shard_groups(&self.dp, &self.edp);
        let mut report = None;
        for (sharded, group) in self.sharded.iter_mut().zip(groups) {
            let (main, grads) = (&mut sharded.main, &mut sharded.grads);
            let step = sharded
                .opt
                .apply(&self.b, main, grads, grad_norm, (lr, wd), skip)?;
            if step.applied {
                sharded.gather_params(&self.b, &mut self.params, group)?;
            }
            report.get_or_insert(step);
        }
        report.ok_or_else(|| anyhow!("internal: a distributed optimizer of no parts"))
    }

    /// The lm loss over `iters` global batches of `split` from sample `start`, reduced over all
    /// their micro-batches as the training loss is.
    fn evaluate(
        &mut self,
        split: &data::Source,
        name: &str,
        start: u64,
        iters: u64,
    ) -> Result<f64> {
        let g = self.cfg.global_batch as u64;
        let cyclic = self.cfg.loader == data::Loader::Cyclic;
        if !cyclic && start + iters * g > split.len() as u64 {
            bail!(
                "the {name} split has {} samples, fewer than the evaluations ask for",
                split.len()
            );
        }
        let mut all = data::LossSums::default();
        for i in 0..iters {
            let (losses, _) = self.passes(split, start + i * g, false)?;
            all.extend(self.everyones_losses(&losses)?);
        }
        Ok(f64::from(all.report(self.token_weighted())))
    }

    /// Validation over `eval_iters` global batches from where the last one stopped.
    fn validate(&mut self, valid: &data::Source, iters: u64) -> Result<f64> {
        let loss = self.evaluate(valid, "validation", self.consumed_valid, iters)?;
        self.consumed_valid += iters * self.cfg.global_batch as u64;
        Ok(loss)
    }

    /// Print (above the progress bar) one line; rank 0 speaks for all.
    pub(super) fn say(&self, bar: &indicatif::ProgressBar, line: &str) {
        if self.rank != 0 {
            return;
        }
        if bar.is_hidden() {
            println!("{line}");
        } else {
            bar.println(line);
        }
    }

    /// One tensor per piece of the distributed optimizer's parts (`of` a part), or without it
    /// `whole`'s, one per parameter, each with its table parameter.
    pub(super) fn of_params<'a>(
        &'a self,
        of: impl Fn(&'a distrib::Sharded<B::Tensor>) -> &'a [B::Tensor],
        whole: &'a [B::Tensor],
    ) -> Vec<(usize, &'a B::Tensor)> {
        match self.sharded.is_empty() {
            true => whole.iter().enumerate().collect(),
            false => (self.sharded.iter())
                .flat_map(|s| (s.pieces.iter().zip(of(s))).map(move |(p, t)| (s.table_param(p), t)))
                .collect(),
        }
    }

    /// This rank's tensor-parallel rank and the group's size.
    pub(super) fn tp(&self) -> (usize, usize) {
        self.tp.as_ref().map_or((0, 1), |g| (g.rank(), g.size()))
    }

    /// The shard of split parameter `p` this rank holds, and how many there are
    /// ([`super::parallel::Layout::shard`]).
    pub(super) fn shard(&self, p: &crate::model::params::ParamInfo) -> (usize, usize) {
        let expert = p.canon.role.expert().is_some();
        self.cfg.layout.shard(expert, self.tp())
    }

    /// This rank's expert-parallel rank and the group's size.
    pub(super) fn ep(&self) -> (usize, usize) {
        self.ep.as_ref().map_or((0, 1), |g| (g.rank(), g.size()))
    }

    /// An expert-parallel rank and size as checkpoint files name them
    /// ([`super::checkpoint::file_ep`]).
    pub(super) fn file_ep(&self, ep: (usize, usize)) -> (usize, usize) {
        super::checkpoint::file_ep(ep, self.tp().1, self.cfg.tp_extend_ep)
    }

    /// Whether a parameter is a routed expert's under expert parallelism: one that the other
    /// expert-parallel ranks do not hold.
    pub(super) fn expert_parallel(&self, param: usize) -> bool {
        self.ep.is_some() && self.table.params[param].canon.role.expert().is_some()
    }

    /// The group a parameter's gradient is summed over after the micro-batches: the
    /// data-parallel one, or for a routed expert under expert parallelism the expert-data-
    /// parallel one (megatron-core's `expert_parallel_buffers`; the expert saw every
    /// expert-parallel rank's tokens already).
    pub(super) fn gradient_group(
        &self,
        param: usize,
    ) -> Option<&dyn Communicator<Tensor = B::Tensor>> {
        let group = match self.expert_parallel(param) {
            true => &self.edp,
            false => &self.dp,
        };
        group
            .as_ref()
            .map(|g| g as &dyn Communicator<Tensor = B::Tensor>)
    }

    pub(super) fn activations(&self) -> DType {
        if self.cfg.bf16 {
            DType::BF16
        } else {
            DType::F32
        }
    }

    pub(super) fn train(mut self) -> Result<TrainSummary> {
        self.check_vocab()?;
        let splits = self.datasets()?;
        let [Some(train), valid, test] = splits else {
            bail!("--split {:?} gives the train split no data", self.cfg.split);
        };
        let c_iters = self.cfg.train_iters;
        let remaining = c_iters - self.iteration.min(c_iters);
        let needed = self.consumed_train + remaining * self.cfg.global_batch as u64;
        let cyclic = self.cfg.loader == data::Loader::Cyclic;
        if cyclic {
            // The random sampler cycles: it needs one draw of M × DP samples, and the consumed
            // counts of the checkpoint on whole draws of each split's epoch.
            let splits = [
                (Some(&train), self.consumed_train, "train"),
                (valid.as_ref(), self.consumed_valid, "validation"),
                (test.as_ref(), 0, "test"),
            ];
            for (split, consumed, name) in splits {
                if let Some(split) = split {
                    (self.random_sampler(split).locate(consumed))
                        .with_context(|| format!("the {name} split"))?;
                }
            }
        } else if needed > train.len() as u64 {
            // Megatron's sampler would run out of samples part-way (a `release` checkpoint
            // starts at iteration 0 but keeps its consumed samples).
            bail!(
                "the train split holds {} samples; starting at sample {} (the --load \
                 checkpoint's consumed samples), {remaining} iterations × --global-batch-size {} \
                 need {needed}",
                train.len(),
                self.consumed_train,
                self.cfg.global_batch
            );
        }
        // --save is made ready only once everything else is checked: a run refused leaves none.
        if let Some(save) = self.cfg.save.as_ref().filter(|_| self.rank == 0) {
            self.check_planned_saves(save)?;
            checkpoint::prepare(&save.dir, self.cfg.tokenizer.path())?;
        }
        let params = self.model_numel;
        if !self.quiet {
            eprintln!(
                "mindkit train: {} parameters, {} layers, hidden {}, vocabulary {} (padded {}), {} on {}",
                params,
                self.cfg.model.layers,
                self.cfg.model.hidden,
                self.cfg.model.vocab,
                self.cfg.vocab_padded,
                if self.cfg.bf16 { "bf16" } else { "fp32" },
                self.b.describe()
            );
            let c = &self.cfg;
            if c.layout.world() > 1 {
                let chunks = match c.virtual_pipeline {
                    Some(v) => format!(
                        " in {} model chunks each (interleaved, groups of {})",
                        v.chunks, v.group
                    ),
                    None => String::new(),
                };
                let split = match c.layout.size(Axis::Etp) {
                    etp if etp == c.layout.size(Axis::Tp) => String::new(),
                    etp => format!("{etp} expert tensor-parallel × "),
                };
                let experts = match c.layout.size(Axis::Ep) {
                    1 => String::new(),
                    ep => format!(
                        " ({split}{ep} expert-parallel × {} expert-data-parallel)",
                        c.layout.size(Axis::Edp)
                    ),
                };
                eprintln!(
                    "mindkit train: {} ranks: {} tensor-parallel × {} pipeline stages {:?}{chunks} × {} data-parallel{experts}, {} micro-batches per data-parallel rank per iteration",
                    c.layout.world(),
                    c.layout.size(Axis::Tp),
                    c.layout.size(Axis::Pp),
                    c.stages,
                    c.data_parallel,
                    c.global_batch / (c.micro_batch * c.data_parallel)
                );
            }
            for (flag, why) in &self.cfg.inert {
                eprintln!("mindkit train: note: --{flag} has no effect here: {why}");
            }
        }
        let bar = progress_bar(c_iters, ProgressUnit::Iterations, !self.quiet);
        bar.set_position(self.iteration);
        let started = Instant::now();
        let flops_model = flops_model(&self.cfg);
        let g = self.cfg.global_batch as u64;
        let mut interval = Interval::default();
        let (mut last_loss, mut saved, mut stopped) = (None, None, None);
        let mut saved_at = None;
        let mut total_tokens = 0u64;
        let mut skipped = SkippedIterations::default();
        while self.iteration < c_iters {
            interval.start.get_or_insert_with(Instant::now);
            let (loss, grad_norm, applied, tokens) = self.train_step(&train)?;
            self.iteration += 1;
            let tracked = self.tracked_losses()?;
            for (i, (name, v)) in tracked.iter().enumerate() {
                match interval.tracked.get_mut(i) {
                    Some(slot) => slot.1 += v,
                    None => interval.tracked.push((name.clone(), *v)),
                }
            }
            if let (Some(tb), false) = (&mut self.tensorboard, tracked.is_empty()) {
                // track_moe_metrics and track_mtp_metrics write them every iteration.
                let scalars: Vec<(&str, f64)> =
                    tracked.iter().map(|(n, v)| (n.as_str(), *v)).collect();
                tb.scalars(self.iteration, self.consumed_train, &scalars)?;
            }
            self.flops += log::flops_per_step(&flops_model, g);
            total_tokens += tokens;
            interval.tokens += tokens;
            if applied {
                interval.advanced += 1;
                interval.loss_sum += loss;
            } else {
                let nan = u64::from(!loss.is_finite() || !grad_norm.is_finite());
                interval.skipped += 1;
                interval.nan += nan;
                skipped.skipped += 1;
                skipped.not_finite += nan;
            }
            skipped.run += 1;
            bar.set_position(self.iteration);
            bar.set_message(format!("lm loss {loss:.4}"));
            // Megatron prints the schedule one step ahead (what the next update will use).
            let lr_printed = self.cfg.schedule.lr(self.schedule_steps) as f32;
            let tb_now = self.tensorboard_now(self.iteration);
            let log_now = self.iteration.is_multiple_of(self.cfg.log_interval);
            let mut logged = None;
            let norms = if self.reports(self.iteration) {
                self.norms()?
            } else {
                (None, None)
            };
            if let (Some(tb), true) = (&mut self.tensorboard, tb_now) {
                let mut scalars = vec![
                    ("learning-rate", f64::from(lr_printed)),
                    ("batch-size", g as f64),
                    ("lm loss", f64::from(loss)),
                    ("loss-scale", 1.0),
                    ("grad-norm", f64::from(grad_norm as f32)),
                ];
                scalars.extend(norms.0.map(|z| ("num-zeros", z)));
                scalars.extend(norms.1.map(|p| ("params-norm", p)));
                tb.scalars(self.iteration, self.consumed_train, &scalars)?;
            }
            if log_now {
                let seconds = interval.start.map_or(0.0, |s| s.elapsed().as_secs_f64());
                let n = (interval.advanced + interval.skipped).max(1);
                let per_iteration = seconds / n as f64;
                let mean = f64::from(interval.loss_sum) / interval.advanced.max(1) as f64;
                let line = log::IterationLine {
                    time: chrono_now(),
                    iteration: self.iteration,
                    train_iters: c_iters,
                    consumed_samples: self.consumed_train,
                    seconds_per_iteration: per_iteration,
                    tflops: self
                        .cfg
                        .log_throughput
                        .then(|| log::flops_per_step(&flops_model, g) / (per_iteration * 1e12)),
                    lr: lr_printed,
                    global_batch: g,
                    loss: mean,
                    tracked: (interval.tracked.iter())
                        .map(|(name, v)| (name.clone(), v / interval.advanced.max(1) as f64))
                        .collect(),
                    grad_norm: Some(grad_norm as f32),
                    num_zeros: norms.0,
                    params_norm: norms.1,
                    skipped: interval.skipped,
                    nan: interval.nan,
                    tokens_per_second: interval.tokens as f64 / seconds.max(1e-9),
                };
                self.say(&bar, &line.to_string());
                logged = Some(n);
                if let Some(tb) = &mut self.tensorboard {
                    tb.scalars(
                        self.iteration,
                        self.consumed_train,
                        &[
                            ("iteration-time", per_iteration),
                            ("throughput", line.tokens_per_second),
                        ],
                    )?;
                }
                last_loss = Some(mean);
                interval = Interval::default();
            }
            if let (Some((every, iters)), Some(valid)) = (self.cfg.eval, valid.as_ref()) {
                if self.iteration.is_multiple_of(every) {
                    let loss = self.validate(valid, iters)?;
                    self.say(
                        &bar,
                        &log::validation_box(&format!("iteration {}", self.iteration), loss),
                    );
                    self.write_validation(loss)?;
                }
            }
            let interval_save = self
                .cfg
                .save
                .as_ref()
                .and_then(|s| s.interval)
                .is_some_and(|n| self.iteration.is_multiple_of(n));
            if interval_save {
                saved = self.save(&bar)?;
                saved_at = Some(self.iteration);
            }
            let exit = self.agreed_exit(started)?;
            // After the exit flags' all-reduce: each interval counts whole iterations.
            let comm = logged.and_then(|n| self.comm_line(n));
            if let Some(comm) = comm.filter(|_| self.cfg.log_comm_stats) {
                self.say(&bar, &comm);
            }
            if let Some(why) = exit {
                if saved_at != Some(self.iteration) {
                    saved = self.save(&bar)?;
                    saved_at = Some(self.iteration);
                }
                self.say(
                    &bar,
                    &format!("[exiting program {why}] datetime: {} ", chrono_now()),
                );
                stopped = Some(why);
                break;
            }
        }
        if stopped.is_none() {
            if self.iteration > 0 && saved_at != Some(self.iteration) {
                saved = self.save(&bar)?;
            }
            if let (Some((_, iters)), Some(valid)) = (self.cfg.eval, valid.as_ref()) {
                if cyclic || self.consumed_valid + iters * g <= valid.len() as u64 {
                    let loss = self.validate(valid, iters)?;
                    let prefix = format!("iteration {} on validation set", self.iteration);
                    self.say(&bar, &log::validation_box(&prefix, loss));
                    self.write_validation(loss)?;
                }
            }
            // Megatron's pretrain() ends with the test split, read from its start.
            if let (Some((_, iters)), Some(test)) = (self.cfg.eval, test.as_ref()) {
                let loss = self.evaluate(test, "test", 0, iters)?;
                let prefix = format!("iteration {} on test set", self.iteration);
                self.say(&bar, &log::validation_box(&prefix, loss));
                // Under the same tag as validation, as evaluate_and_print_results writes it.
                self.write_validation(loss)?;
            }
        }
        bar.finish_and_clear();
        let seconds = started.elapsed().as_secs_f64();
        Ok(TrainSummary {
            iteration: self.iteration,
            consumed_samples: self.consumed_train,
            last_loss,
            seconds,
            tokens_per_second: total_tokens as f64 / seconds.max(1e-9),
            stopped,
            saved,
            skipped,
        })
    }

    /// [`Trainer::exit_reason`], agreed by all ranks: one rank's reason stops them all
    /// (Megatron all-reduces its exit flags).
    fn agreed_exit(&self, started: Instant) -> Result<Option<String>> {
        let mine = self.exit_reason(started);
        if self.tp.is_none() && self.dp.is_none() && self.pp.is_none() {
            return Ok(mine);
        }
        let mut flag = [f32::from(u8::from(mine.is_some()))];
        // Over the data-parallel group, the tensor-parallel one, then the pipeline: every rank
        // of the world.
        for group in [&self.dp, &self.tp, &self.pp].into_iter().flatten() {
            group.all_reduce_f32(&mut flag, ReduceOp::Max)?;
        }
        let anyone = flag[0] > 0.0;
        Ok(mine.or_else(|| anyone.then(|| "as another rank stops.".into())))
    }

    /// Why the run should save and stop now (`checkpoint_and_decide_exit`).
    fn exit_reason(&self, started: Instant) -> Option<String> {
        let e = self.cfg.exit;
        if self.stop.as_ref().is_some_and(|s| s.load(Ordering::SeqCst)) {
            return Some("after receiving SIGTERM.".into());
        }
        if let Some(minutes) = e.minutes {
            let elapsed = started.elapsed().as_secs_f64() / 60.0;
            if elapsed > minutes {
                return Some(format!("after {elapsed} minutes"));
            }
        }
        match e.interval {
            Some(n) if self.iteration.is_multiple_of(n) => {
                Some(format!("at iteration {}", self.iteration))
            }
            _ => None,
        }
    }
}

/// The groups the distributed optimizer's parts are sharded over: the data-parallel group, and
/// the routed experts' expert-data-parallel one.
fn shard_groups<'a, T: crate::engine::comm::Payload>(
    dp: &'a Option<Counted<T>>,
    edp: &'a Option<Counted<T>>,
) -> [Option<&'a dyn Communicator<Tensor = T>>; 2] {
    [dp, edp].map(|g| g.as_ref().map(|g| g as &dyn Communicator<Tensor = T>))
}
