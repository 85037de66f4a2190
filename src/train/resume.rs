//! Checkpoints of a run: the training state restored from `--load` (or `--lora-load`) and
//! saved to `--save`, one file per model-parallel rank.

use super::checkpoint;
use super::config::{SaveConfig, ScheduleSource, Start};
use super::trainer::Trainer;
use crate::ckpt::megatron::TRACKER;
use crate::ckpt::torch::pickle::Value;
use crate::engine::comm::{Communicator, Counted, ReduceOp};
use crate::engine::Backend;
use crate::model::params::LoraSpec;
use crate::tensor::host::Tensor as HostTensor;
use crate::tensor::DType;
use anyhow::{bail, Result};
use std::os::unix::ffi::OsStrExt;
use std::time::Instant;

impl<B: Backend> Trainer<B> {
    /// Restore iteration, samples, schedule and optimizer from `--load` (unless
    /// `--finetune`, an HF directory, or `--no-load-optim` for the last two).
    pub(super) fn resume(&mut self, trained: &[bool]) -> Result<()> {
        // With LoRA the training state travels with the adapters (--lora-load).
        let (dir, no_optim) = match (&self.cfg.start, &self.cfg.lora) {
            (
                Start::Load {
                    resume: true,
                    no_optim,
                    ..
                },
                Some(l),
            ) => match &l.load {
                Some(dir) => (dir.clone(), *no_optim),
                None => return Ok(()),
            },
            (
                Start::Load {
                    dir,
                    resume: true,
                    no_optim,
                    ..
                },
                None,
            ) => (dir.clone(), *no_optim),
            _ => return Ok(()),
        };
        // Megatron's load_checkpoint (Megatron-LM megatron/training/checkpointing.py): a
        // `release` checkpoint starts at iteration 0 and loads no optimizer, scheduler or RNG
        // state; the consumed samples still come from its args.
        let release = checkpoint::is_release(&dir)?;
        if let Start::Load { input, .. } = &self.cfg.start {
            let input = input.clone();
            if let Some(ck) = input.torch_dist().filter(|_| self.cfg.lora.is_none()) {
                return self.resume_dist(ck, (no_optim, release));
            }
        }
        let no_optim = no_optim || release;
        let extend = self.cfg.tp_extend_ep;
        let at = (self.tp(), self.stage.rank(), self.file_ep(self.ep()));
        // the distributed optimizer's state is in its own file
        let state = match no_optim {
            true => checkpoint::load_progress(&dir)?,
            false => {
                let weights_only = !self.sharded.is_empty();
                checkpoint::load_state(
                    &dir,
                    (&self.table, at),
                    trained,
                    (weights_only, self.cfg.grouped_experts, self.cfg.dualpipev),
                )?
            }
        };
        self.restore_progress(&state, release);
        if no_optim {
            return Ok(());
        }
        self.restore_schedule(&state)?;
        if !self.sharded.is_empty() {
            // Under expert parallelism the dense parameters' state is in the file its
            // data-parallel rank 0 saved — rank `t` of the stage, whose expert-parallel rank
            // is `t / ETP mod EP` in the expert view (0 when ETP = TP) —, the experts' in each
            // rank's own.
            let chained = self.sharded.len() > 1;
            let etp = self.cfg.layout.expert_tensor_parallel();
            let (tp, pp, mine) = at;
            let eps = self.ep().1;
            let dense = checkpoint::file_ep((tp.0 / etp % eps, eps), tp.1, extend);
            for (k, sharded) in self.sharded.iter_mut().enumerate() {
                let at = (tp, pp, if k == 0 { dense } else { mine });
                let buffers = sharded.layout.buffer_numel_unpadded();
                let part = chained.then_some(k);
                let (world, steps) = checkpoint::load_distributed(&dir, at, &buffers, part)?;
                let [main, m, v] = &world;
                sharded.load(&self.b, [main, m, v], steps)?;
            }
            return Ok(());
        }
        let Some(opt) = state.optimizer else {
            return Ok(());
        };
        let b = &self.b;
        // Loaded moments become f32 whatever they were saved in, as torch's
        // `Optimizer.load_state_dict` casts a state to its f32 main parameter's dtype: under
        // --o2-optimizer, as in MindSpeed-LLM, they are bf16 only in a run that starts without
        // optimizer state.
        let wide = |t: &HostTensor| -> Result<B::Tensor> { Ok(b.cast(&b.upload(t)?, DType::F32)?) };
        for (i, (m, v)) in opt.exp_avg.into_iter().zip(opt.exp_avg_sq).enumerate() {
            if let (Some(m), Some(v)) = (m, v) {
                self.opt.exp_avg[i] = wide(&m)?;
                self.opt.exp_avg_sq[i] = wide(&v)?;
            }
        }
        if let (Some(main), Some(saved)) = (self.opt.main.as_mut(), opt.main) {
            for (slot, t) in main.iter_mut().zip(saved) {
                if let Some(t) = t {
                    *slot = b.upload(&t)?;
                }
            }
        }
        self.opt.steps = opt.steps;
        Ok(())
    }

    /// The checkpoints this run will write, checked before its first iteration (Megatron
    /// finds a clash only when it saves): `--save` inside the checkpoint it loads, a tracker
    /// that is not a file, an iteration directory (or file) already where a save of this run
    /// goes — every `--save-interval` and at the end, which `--exit-interval` may bring
    /// forward — and a `--train-iters` below the loaded iteration, whose final save would
    /// rewrite that iteration.
    pub(super) fn check_planned_saves(&self, save: &SaveConfig) -> Result<()> {
        let c = &self.cfg;
        let dir = &save.dir;
        let loaded = match &c.start {
            Start::Load { dir, .. } => Some(dir),
            Start::Scratch => None,
        };
        let lora = c.lora.as_ref().and_then(|l| l.load.as_ref());
        for input in loaded.into_iter().chain(lora) {
            if let Err(e @ crate::util::OutputError::InsideInput { .. }) =
                crate::util::check_not_input(dir, &[input.as_path()])
            {
                bail!("--save: {e}");
            }
        }
        let tracker = dir.join(TRACKER);
        if std::fs::symlink_metadata(&tracker).is_ok_and(|m| !m.is_file()) {
            bail!(
                "--save {}: {} is not a file (Megatron's tracker of the last checkpoint)",
                dir.display(),
                tracker.display()
            );
        }
        if self.iteration > c.train_iters {
            bail!(
                "--train-iters {} is below iteration {} of the --load checkpoint: nothing to \
                 train, and the final save would rewrite iteration {}",
                c.train_iters,
                self.iteration,
                self.iteration
            );
        }
        let from = self.iteration;
        let first_after = |every: u64| (from / every + 1).saturating_mul(every);
        let last = c
            .exit
            .interval
            .map_or(c.train_iters, |n| first_after(n).min(c.train_iters));
        let planned = |i: u64| {
            i > from
                && i <= last
                && (i == last || save.interval.is_some_and(|n| i.is_multiple_of(n)))
        };
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Ok(());
        };
        let mut clashes: Vec<(u64, String)> = entries
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let i = name.strip_prefix("iter_")?.parse::<u64>().ok()?;
                (name == checkpoint::iteration_dir(i) && planned(i)).then_some((i, name))
            })
            .collect();
        clashes.sort();
        if let Some((i, name)) = clashes.first() {
            bail!(
                "--save {}: {name} is there already, and this run saves iteration {i} there; \
                 move it away or --save elsewhere",
                dir.display()
            );
        }
        Ok(())
    }

    /// A checkpoint's iteration (0 for a `release` one), consumed samples and FLOPs.
    pub(super) fn restore_progress(&mut self, state: &checkpoint::Resumed, release: bool) {
        self.iteration = if release { 0 } else { state.iteration };
        self.consumed_train = state.consumed_train;
        self.consumed_valid = state.consumed_valid;
        self.flops = state.flops;
    }

    /// A checkpoint's scheduler state, if saved: its step count and settings.
    pub(super) fn restore_schedule(&mut self, state: &checkpoint::Resumed) -> Result<()> {
        if let Some(sched) = &state.scheduler {
            self.schedule_steps = sched.get("num_steps").and_then(|v| v.as_u64()).unwrap_or(0);
            self.apply_checkpoint_schedule(sched)?;
        }
        Ok(())
    }

    /// Megatron's `OptimizerParamScheduler.load_state_dict`: the checkpoint's settings must
    /// equal the command line's unless told which to use.
    fn apply_checkpoint_schedule(&mut self, sched: &serde_json::Value) -> Result<()> {
        let s = &mut self.cfg.schedule;
        let num = |k: &str| sched.get(k).and_then(|v| v.as_f64());
        let checks: [(&str, &str, f64, Option<f64>); 4] = [
            ("max_lr", "--lr", s.max_lr, num("max_lr")),
            ("min_lr", "--min-lr", s.min_lr, num("min_lr")),
            (
                "lr_warmup_steps",
                "warmup",
                s.warmup_steps,
                num("lr_warmup_steps"),
            ),
            (
                "lr_decay_steps",
                "decay length",
                s.decay_steps as f64,
                num("lr_decay_steps"),
            ),
        ];
        for (key, what, ours, theirs) in checks {
            let Some(theirs) = theirs else { continue };
            match self.cfg.schedule_source {
                ScheduleSource::CommandLine => {}
                ScheduleSource::Checkpoint => match key {
                    "max_lr" => s.max_lr = theirs,
                    "min_lr" => s.min_lr = theirs,
                    "lr_warmup_steps" => s.warmup_steps = theirs,
                    _ => s.decay_steps = theirs as u64,
                },
                ScheduleSource::Check if ours != theirs => bail!(
                    "the checkpoint's schedule has {key} {theirs}, the command line {what} gives \
                     {ours}: pass --override-opt-param-scheduler to use the command line's or \
                     --use-checkpoint-opt-param-scheduler to keep the checkpoint's"
                ),
                ScheduleSource::Check => {}
            }
        }
        Ok(())
    }

    /// What the optimizer's parameter groups record now.
    pub(super) fn group_hyper(&self) -> checkpoint::GroupHyper {
        checkpoint::GroupHyper {
            lr: self.cfg.schedule.lr(self.schedule_steps),
            max_lr: self.cfg.schedule.max_lr,
            min_lr: self.cfg.schedule.min_lr,
            weight_decay: self.cfg.schedule.wd(self.schedule_steps),
            betas: self.cfg.adam.betas,
            eps: self.cfg.adam.eps,
        }
    }

    /// The host copy of everything a checkpoint holds.
    pub(super) fn snapshot(
        &self,
        gathered: Option<Vec<Option<[Vec<f32>; 3]>>>,
    ) -> Result<checkpoint::Snapshot<'_>> {
        let b = &self.b;
        let params = self
            .params
            .iter()
            .map(|p| b.download(p))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let save = self.cfg.save.as_ref();
        let hyper = self.group_hyper();
        let chained = self.sharded.len() > 1;
        let distributed = (gathered
            .into_iter()
            .flatten()
            .zip(&self.sharded)
            .enumerate())
        .map(|(k, (world, sharded))| checkpoint::DistributedState {
            world,
            experts: chained && k == 1,
            buffers: (sharded.layout.buffer_numel_unpadded().into_iter())
                .zip(sharded.dtypes.iter().copied())
                .collect(),
            steps: sharded.opt.steps,
            hyper,
        })
        .collect();
        let optimizer = match save {
            Some(s) if !s.no_optim && self.sharded.is_empty() => {
                let trained = |i: usize| self.table.params[i].trainable;
                // megatron-core keeps no main copy of a parameter already f32 (its
                // `fp32_from_fp32_groups`: --init-norm-weight-in-fp32's norms)
                let widened = |i: usize| trained(i) && self.table.params[i].dtype != DType::F32;
                let host = |ts: &[B::Tensor], kept: &dyn Fn(usize) -> bool| {
                    (ts.iter().enumerate())
                        .map(|(i, t)| Ok(kept(i).then(|| b.download(t)).transpose()?))
                        .collect::<Result<Vec<Option<HostTensor>>>>()
                };
                Some(checkpoint::OptimizerState {
                    steps: self.opt.steps,
                    exp_avg: host(&self.opt.exp_avg, &trained)?,
                    exp_avg_sq: host(&self.opt.exp_avg_sq, &trained)?,
                    main: (self.opt.main.as_deref())
                        .map(|m| host(m, &widened))
                        .transpose()?,
                    hyper,
                })
            }
            _ => None,
        };
        let c = &self.cfg;
        let int = |v: u64| Value::Int(v as i64);
        let recorded = c.recorded.iter();
        let mut args: Vec<_> = recorded
            .map(|(k, v)| (k.to_string(), checkpoint::json_value(v)))
            .collect();
        args.extend([
            ("iteration".to_string(), int(self.iteration)),
            ("train_iters".into(), int(c.train_iters)),
            ("consumed_train_samples".into(), int(self.consumed_train)),
            ("consumed_valid_samples".into(), int(self.consumed_valid)),
            ("skipped_train_samples".into(), int(0)),
            ("seq_length".into(), int(c.seq_length as u64)),
            ("micro_batch_size".into(), int(c.micro_batch as u64)),
            ("global_batch_size".into(), int(c.global_batch as u64)),
            ("seed".into(), int(u64::from(c.seed))),
            ("lr".into(), Value::Float(c.schedule.max_lr)),
            ("min_lr".into(), Value::Float(c.schedule.min_lr)),
            (
                "lr_decay_style".into(),
                Value::Str(c.schedule.decay_style.name().into()),
            ),
        ]);
        let filter = c.lora.as_ref().is_some_and(|l| l.ckpt_filter);
        let mut extra = Vec::new();
        if let Some(l) = &c.lora {
            args.extend(lora_args(&l.spec));
            let (table, grouped) = (&self.table, c.grouped_experts);
            let adapters: Vec<usize> = (0..table.params.len())
                .filter(|&i| table.params[i].lora.is_some())
                .collect();
            for unit in checkpoint::stored_units(table, &adapters, grouped) {
                let tensors: Vec<&HostTensor> = unit.iter().map(|&i| &params[i]).collect();
                let key = checkpoint::unit_key(table, &unit, grouped);
                let packed = checkpoint::pack_unit(table, &unit, &tensors, grouped);
                extra.push((table.params[unit[0]].chunk, key, packed));
            }
        }
        Ok(checkpoint::Snapshot {
            cfg: &c.model,
            table: &self.table,
            saved: self
                .table
                .params
                .iter()
                .map(|p| p.lora.is_none() && !filter)
                .collect(),
            params,
            layout: save.map_or(crate::ckpt::layout::KeyLayout::Mcore, |s| s.layout),
            divisible_by: c.divisible_by,
            iteration: self.iteration,
            args,
            optimizer,
            distributed,
            scheduler: save
                .filter(|s| !s.no_optim)
                .map(|_| c.schedule.state_dict(self.schedule_steps)),
            flops: self.flops,
            extra,
            tp: self.tp(),
            ep: self.ep(),
            etp: c.layout.expert_tensor_parallel(),
            tp_extend: c.tp_extend_ep,
            stage: &self.stage,
            stages: &c.stages,
            grouped: c.grouped_experts,
            te_grouped: c.te_grouped_experts,
        })
    }

    /// Save a checkpoint: the ranks of data-parallel rank 0 write one file each, the
    /// tracker last (by rank 0, once every file is complete).
    pub(super) fn save(&self, bar: &indicatif::ProgressBar) -> Result<Option<std::path::PathBuf>> {
        let start = Instant::now();
        // The distributed optimizer's state goes to data-parallel rank 0 first: every
        // data-parallel rank sends its pieces (the routed experts' under expert parallelism to
        // expert-data-parallel rank 0).
        let gathered = match &self.cfg.save {
            Some(save) if !save.no_optim && !self.sharded.is_empty() => {
                let groups = [&self.dp, &self.edp].map(|g| g.as_ref().map(Counted::uncounted));
                let parts = (self.sharded.iter().zip(groups))
                    .map(|(sharded, group)| sharded.gathered_state(&self.b, group))
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                Some(parts)
            }
            _ => None,
        };
        if let Some(save) = self.cfg.save.as_ref().filter(|s| s.dist) {
            let path = self.save_dist(&save.dir, gathered)?;
            self.say_saved(bar, &save.dir, start);
            return Ok(Some(path));
        }
        // Megatron's torch format: expert-data-parallel rank 0 of each expert-parallel rank
        // (data-parallel rank 0 without expert parallelism) writes.
        let writers = if self.ep.is_some() {
            &self.edp
        } else {
            &self.dp
        };
        let writes = writers.as_ref().is_none_or(|g| g.rank() == 0);
        let Some(save) = self.cfg.save.as_ref().filter(|_| writes) else {
            return Ok(None);
        };
        let snap = self.snapshot(gathered)?;
        // Over the model-parallel ranks: the pipeline stages, then each stage's TP group, then
        // the expert-parallel ranks.
        let groups: Vec<_> = [&self.pp, &self.tp, &self.ep]
            .into_iter()
            .flatten()
            .map(Counted::uncounted)
            .collect();
        let path = match groups.is_empty() {
            true => checkpoint::save(&save.dir, &snap)?,
            false => self.save_shards(&groups, &save.dir, &snap)?,
        };
        self.say_saved(bar, &save.dir, start);
        Ok(Some(path))
    }

    /// Megatron's line for a checkpoint saved.
    pub(super) fn say_saved(
        &self,
        bar: &indicatif::ProgressBar,
        dir: &std::path::Path,
        start: Instant,
    ) {
        let ((t, tps), (p, pps)) = (self.tp(), self.stage.rank());
        self.say(
            bar,
            &format!(
                "  successfully saved checkpoint from iteration {:>7} to {} [ t {}/{tps}, p {}/{pps} ] ({:.1} s)",
                self.iteration,
                dir.display(),
                t + 1,
                p + 1,
                start.elapsed().as_secs_f64()
            ),
        );
    }

    /// Every model-parallel rank's file into one temporary iteration directory that its rank 0
    /// makes (its name sent down `groups`, each from its rank 0: the pipeline, then the
    /// tensor-parallel group) and renames into place once all are written; a rank that fails
    /// makes the save fail on all, leaving no directory behind.
    fn save_shards(
        &self,
        groups: &[&dyn Communicator<Tensor = B::Tensor>],
        dir: &std::path::Path,
        snap: &checkpoint::Snapshot,
    ) -> Result<std::path::PathBuf> {
        let (temp, into) = self.start_save(groups, dir, snap.iteration)?;
        agreed(groups, checkpoint::write_rank(&into, snap))?;
        match temp {
            Some(temp) => checkpoint::finish(dir, temp, snap),
            None => Ok(dir
                .join(checkpoint::iteration_dir(snap.iteration))
                .join(checkpoint::rank_dir_of(
                    snap.tp.0,
                    snap.stage,
                    snap.file_ep(),
                ))
                .join(crate::ckpt::megatron::RANK_FILE)),
        }
    }

    /// The temporary iteration directory of a save over `groups` (its first rank's, `None`
    /// elsewhere) and its path, which the first rank sends down `groups` in order.
    pub(super) fn start_save(
        &self,
        groups: &[&dyn Communicator<Tensor = B::Tensor>],
        dir: &std::path::Path,
        iteration: u64,
    ) -> Result<(Option<crate::util::TempOutput>, std::path::PathBuf)> {
        let temp = match groups.iter().all(|g| g.rank() == 0) {
            true => Some(checkpoint::begin(dir, iteration)),
            false => None,
        };
        // The directory's name, or none when rank 0 could not start it (a name is never
        // empty).
        let mut name = match &temp {
            Some(Ok(t)) => t.path().file_name().map(|n| n.as_bytes().to_vec()),
            _ => None,
        }
        .unwrap_or_default();
        for g in groups {
            g.broadcast_bytes(&mut name, 0)?;
        }
        let temp = temp.transpose()?;
        if name.is_empty() {
            bail!(
                "model-parallel rank 0 could not start the checkpoint in {}",
                dir.display()
            );
        }
        Ok((temp, dir.join(std::ffi::OsStr::from_bytes(&name))))
    }
}

/// `written` once every rank of `groups` has written its part: a rank that fails makes the
/// save fail on all.
pub(super) fn agreed<T, C: Communicator + ?Sized>(groups: &[&C], written: Result<T>) -> Result<T> {
    let mut failed = [f32::from(u8::from(written.is_err()))];
    for g in groups.iter().rev() {
        g.all_reduce_f32(&mut failed, ReduceOp::Max)?;
    }
    let written = written?;
    if failed[0] > 0.0 {
        bail!("another rank failed to write its part of the checkpoint");
    }
    Ok(written)
}

/// What MindSpeed-LLM records of LoRA in `args` (read back by `mindkit lora merge`).
fn lora_args(l: &LoraSpec) -> Vec<(String, Value)> {
    let modules = l
        .targets
        .iter()
        .filter_map(|&r| LoraSpec::module(r))
        .map(|m| Value::Str(m.into()))
        .collect();
    vec![
        ("lora_r".into(), Value::Int(l.r as i64)),
        ("lora_alpha".into(), Value::Float(l.alpha)),
        ("lora_target_modules".into(), Value::List(modules)),
    ]
}
