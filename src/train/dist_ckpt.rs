//! `torch_dist` checkpoints of a run (`--ckpt-format torch_dist`, [`checkpoint::write_part`]):
//! saved by every rank, each writing the main replicas it holds, and resumed from — weights,
//! progress, schedule and the model-shaped optimizer state, resharded to this run's layout; or
//! the distributed optimizer's `dp_reshardable` buckets megatron-core saves by default, at the
//! layout that saved them.

use super::checkpoint;
use super::parallel::Axis;
use super::resume::agreed;
use super::trainer::Trainer;
use crate::ckpt::torch::pickle::Value;
use crate::ckpt::torch_dist::{ChunkRecord, TorchDistCkpt};
use crate::ckpt::transform::{read_regrouped, tp_shard};
use crate::engine::comm::{Communicator, Counted, MAX_HOST_BYTES};
use crate::engine::Backend;
use crate::tensor::host::{to_f32, Tensor as HostTensor};
use crate::tensor::DType;
use anyhow::{anyhow, bail, Result};

impl<B: Backend> Trainer<B> {
    /// Restore progress, schedule and (unless `no_optim`) the optimizer's state from the
    /// `torch_dist` checkpoint `ck` (`release`: a converted model, iteration 0 and nothing
    /// else), each parameter's state read whole and cut to this rank's shard.
    pub(super) fn resume_dist(
        &mut self,
        ck: &TorchDistCkpt,
        (no_optim, release): (bool, bool),
    ) -> Result<()> {
        let common = ck.common()?;
        let state = checkpoint::progress(common.path(), common.root())?;
        self.restore_progress(&state, release);
        if no_optim || release {
            return Ok(());
        }
        let dir = ck.iter_dir.display();
        if self.cfg.model.f32_norms_in_half() {
            bail!(
                "--load {dir}: a torch_dist optimizer state with f32 norms beside bf16 weights \
                 (--init-norm-weight-in-fp32 --bf16) is not built; pass --no-load-optim"
            );
        }
        let in_buckets = match ck.optimizer.as_deref() {
            None => bail!(
                "--load {dir} holds no optimizer state (saved with --no-save-optim?); resume with \
                 --no-load-optim, or start a new run from its weights with --finetune"
            ),
            Some(kind) => !kind.starts_with("model-shaped"),
        };
        self.restore_schedule(&state)?;
        if in_buckets {
            return self.load_dp_buckets(ck);
        }
        let steps = checkpoint::saved_steps(&common)?;
        let states = (0..self.table.params.len())
            .map(|i| match self.table.params[i].trainable {
                true => self.saved_state(ck, i).map(Some),
                false => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        let b = &self.b;
        if !self.sharded.is_empty() {
            for sharded in self.sharded.iter_mut() {
                let world = sharded.world_of(&|i| states[i].clone())?;
                let [main, m, v] = &world;
                sharded.load(b, [main, m, v], steps)?;
            }
            return Ok(());
        }
        for (i, state) in states.into_iter().enumerate() {
            let Some([main, m, v]) = state else { continue };
            let shape = self.table.params[i].shape.clone();
            self.opt.exp_avg[i] = b.upload_f32(&shape, &m)?;
            self.opt.exp_avg_sq[i] = b.upload_f32(&shape, &v)?;
            if let Some(slot) = self.opt.main.as_mut().map(|mains| &mut mains[i]) {
                *slot = b.upload_f32(&shape, &main)?;
            }
        }
        self.opt.steps = steps;
        Ok(())
    }

    /// The index of this rank's data-parallel group of the distributed optimizer's part
    /// `experts` in a `dp_reshardable` save: its rank in the model-parallel group, TP × PP
    /// for the dense part, expert TP × EP × PP for the routed experts' (megatron-core
    /// optimizer/__init__.py `get_megatron_optimizer`, `data_parallel_group_idx`;
    /// parallel_state.py `get_ranks('tp-pp')`, `get_ranks('tp-ep-pp')` of the experts).
    fn dp_group_index(&self, experts: bool) -> usize {
        let layout = &self.cfg.layout;
        let (tp, tps) = layout.shard(experts, self.tp());
        let (ep, eps) = match experts {
            true => (
                layout.coordinate(self.rank, Axis::Ep),
                layout.size(Axis::Ep),
            ),
            false => (0, 1),
        };
        (self.stage.index * eps + ep) * tps + tp
    }

    /// The steps of part `chain` (its keys' prefix) of a `dp_reshardable` save: its
    /// parameter groups are not in `common.pt` but in the object
    /// `{chain}optimizer.distributed.dp_group_idx_{group}.optimizer` (distrib_optimizer.py
    /// `sharded_state_dict`).
    fn bucket_steps(&self, ck: &TorchDistCkpt, chain: &str, group: usize) -> Result<u64> {
        let fqn = format!("{chain}optimizer.distributed.dp_group_idx_{group}.optimizer/shard_0_1");
        let what = format!("--load {}: {fqn}", ck.iter_dir.display());
        let saved = (ck.object(&fqn)?).ok_or_else(|| anyhow!("{what}: no such object"))?;
        // DCP saves a ShardedObject's value; a list of one where wrapped
        let torch = match &saved {
            Value::List(one) if one.len() == 1 => &one[0],
            other => other,
        };
        checkpoint::group_steps(torch, &what)
    }

    /// The distributed optimizer's state from megatron-core's default `dp_reshardable`
    /// buckets (distrib_optimizer.py `sharded_param_state_dp_reshardable`), of each part —
    /// the dense parameters', and under expert parallelism the routed experts' of their own
    /// (megatron-core's chained optimizers): the buckets read whole and laid end to end as
    /// the world tensors, which must be this run's buffers bucket for bucket — the layout,
    /// model, bucket size and trained parameters that saved them (megatron-core reshards
    /// them over data-parallel ranks alone).
    fn load_dp_buckets(&mut self, ck: &TorchDistCkpt) -> Result<()> {
        let dir = ck.iter_dir.display();
        let parts = self.sharded.len();
        if parts == 0 {
            bail!(
                "--load {dir} holds the distributed optimizer's dp_reshardable buckets \
                 (megatron-core's default), which only the distributed optimizer reads: add \
                 --use-distributed-optimizer, or resume with --no-load-optim"
            );
        }
        if (parts > 1) != (ck.chained_optimizers > 0) {
            let saved = ck.chained_optimizers.max(1);
            bail!(
                "--load {dir} holds the dp_reshardable state of {saved} chained distributed \
                 optimizer(s) where this run has {parts} (megatron-core chains an optimizer of \
                 the routed experts' own to the dense one's under expert parallelism): saved \
                 with another --expert-model-parallel-size; resume with --no-load-optim, or \
                 save with --dist-ckpt-optim-fully-reshardable"
            );
        }
        // a stage without routed experts has no optimizer of theirs, nor a chain
        let held: Vec<usize> = (0..parts)
            .filter(|&part| !self.sharded[part].units.is_empty())
            .collect();
        for (i, &part) in held.iter().enumerate() {
            let chain = match held.len() {
                1 => String::new(),
                _ => crate::ckpt::torch_dist::chained_prefix(i),
            };
            let group = self.dp_group_index(part == 1);
            let steps = self.bucket_steps(ck, &chain, group)?;
            let world = self.saved_buckets(ck, (&chain, group), part)?;
            let [main, m, v] = &world;
            self.sharded[part].load(&self.b, [main, m, v], steps)?;
        }
        Ok(())
    }

    /// The world tensors (main copy, first and second moments) of distributed-optimizer
    /// part `part` from its buckets in data-parallel group `group` of the save's optimizer
    /// `chain`, the buckets' sizes checked against this run's.
    fn saved_buckets(
        &self,
        ck: &TorchDistCkpt,
        (chain, group): (&str, usize),
        part: usize,
    ) -> Result<[Vec<f32>; 3]> {
        let dir = ck.iter_dir.display();
        let layout = &self.sharded[part].layout;
        let want: Vec<usize> = layout.buckets.iter().map(|b| b.unpadded).collect();
        let mut world: [Vec<f32>; 3] = Default::default();
        for (w, state) in world.iter_mut().zip(["param", "exp_avg", "exp_avg_sq"]) {
            let buckets = ck.dp_bucket_states(chain, group, state)?;
            let sizes: Vec<usize> = buckets.iter().map(|t| t.shape[0]).collect();
            if sizes != want {
                bail!(
                    "--load {dir}: the distributed optimizer's {chain}{state} of data-parallel \
                     group {group} is saved in buckets of {sizes:?} elements where this \
                     run's buffers hold {want:?}: saved with another layout, model, bucket \
                     size or set of trained parameters (megatron-core reshards dp_reshardable \
                     state over data-parallel ranks alone); resume with --no-load-optim, or \
                     save with --dist-ckpt-optim-fully-reshardable"
                );
            }
            for t in &buckets {
                w.extend(to_f32(t).map_err(|e| anyhow!("--load {dir}: {state}: {e}"))?);
            }
        }
        Ok(world)
    }

    /// Parameter `i`'s main copy, first and second moments (f32, flat) from `ck`: this rank's
    /// shard of each. The main copy is `fp32_param` (a `--bf16` run's) or `param` (the
    /// distributed optimizer's), or the weights themselves when they are f32.
    fn saved_state(&self, ck: &TorchDistCkpt, i: usize) -> Result<[Vec<f32>; 3]> {
        let p = &self.table.params[i];
        let read = |names: &[&str]| -> Result<Option<HostTensor>> {
            for name in names {
                let missing = std::cell::Cell::new(false);
                let t = read_regrouped(&ck.cfg, p.canon, &|c| {
                    ck.read_state(name, c)?.ok_or_else(|| {
                        missing.set(true);
                        anyhow!("no {name}")
                    })
                });
                match t {
                    Ok(t) => return self.shard_of(p, t).map(Some),
                    Err(_) if missing.get() => continue,
                    Err(e) => return Err(e),
                }
            }
            Ok(None)
        };
        let what = |name: &str| {
            format!(
                "--load {}: no optimizer state {name} for {} (saved with --no-save-optim? pass \
                 --no-load-optim)",
                ck.iter_dir.display(),
                p.name
            )
        };
        let m = read(&["exp_avg"])?.ok_or_else(|| anyhow!(what("exp_avg")))?;
        let v = read(&["exp_avg_sq"])?.ok_or_else(|| anyhow!(what("exp_avg_sq")))?;
        let main = match read(&["fp32_param", "param"])? {
            Some(t) => t,
            None if ck.cfg.dtype == DType::F32 => {
                let t = read_regrouped(&ck.cfg, p.canon, &|c| ck.read_padded(c))?;
                self.shard_of(p, t)?
            }
            None => bail!(what("fp32_param")),
        };
        let f32s = |t: &HostTensor| to_f32(t).map_err(|e| anyhow!("{}: {e}", p.name));
        Ok([f32s(&main)?, f32s(&m)?, f32s(&v)?])
    }

    /// This rank's part of the whole tensor `t` of parameter `p`: its shape checked, cut
    /// to its tensor-parallel shard.
    fn shard_of(&self, p: &crate::model::params::ParamInfo, t: HostTensor) -> Result<HostTensor> {
        let padded = self.cfg.vocab_padded;
        let (r, ranks) = self.shard(p);
        let t = match p.tp_split && ranks > 1 {
            true => tp_shard(p.canon.role, &t, r, ranks, padded),
            false => t,
        };
        if t.shape != p.shape {
            bail!(
                "--load: the optimizer state of {} has shape {:?} here, the parameter {:?} (the \
                 checkpoint's padded vocabulary or model differs from the flags')",
                p.name,
                t.shape,
                p.shape
            );
        }
        Ok(t)
    }

    /// Save a `torch_dist` checkpoint ([`checkpoint::write_part`]): every rank takes part,
    /// each writing the main replicas it holds — the dense parameters on data-parallel rank
    /// 0 (a copy every tensor-parallel rank holds on its rank 0), the routed experts on
    /// expert-data-parallel rank 0 — and the first rank the index of all of them.
    pub(super) fn save_dist(
        &self,
        dir: &std::path::Path,
        gathered: Option<Vec<Option<[Vec<f32>; 3]>>>,
    ) -> Result<std::path::PathBuf> {
        let mut snap = self.snapshot(None)?;
        let opt = self.dist_optimizer(&mut snap, gathered)?;
        let coordinate = |axis| self.cfg.layout.coordinate(self.rank, axis);
        let writes: Vec<bool> = (self.table.params.iter())
            .map(|p| {
                !p.shared
                    && match p.canon.role.expert() {
                        Some(_) => coordinate(Axis::Edp) == 0,
                        None => coordinate(Axis::Dp) == 0 && (p.tp_split || self.tp().0 == 0),
                    }
            })
            .collect();
        // over every rank: the data-parallel groups first, so that each group's rank 0 has
        // the directory's name from the first rank before it passes it on
        let groups: Vec<_> = [&self.dp, &self.pp, &self.tp]
            .into_iter()
            .flatten()
            .map(Counted::uncounted)
            .collect();
        let (temp, into) = self.start_save(&groups, dir, snap.iteration)?;
        let file = checkpoint::data_file(self.rank);
        let written = match writes.iter().any(|&w| w) {
            true => checkpoint::write_part(&into, &file, (&snap, &writes), opt.as_ref()),
            false => Ok(Vec::new()),
        };
        let records = agreed(&groups, written)?;
        let records = gather_records(&groups, records)?;
        if let Some(temp) = temp {
            checkpoint::write_root(&into, (&snap, records), opt.as_ref(), dir)?;
            checkpoint::finish(dir, temp, &snap)?;
        }
        Ok(dir.join(checkpoint::iteration_dir(snap.iteration)))
    }

    /// The optimizer's state of `snap` model-shaped for a `torch_dist` save: the
    /// non-distributed optimizer's as it is, the distributed optimizer's cut out of the
    /// buffers `gathered` on each group's rank 0 (`None` with `--no-save-optim`).
    fn dist_optimizer(
        &self,
        snap: &mut checkpoint::Snapshot,
        gathered: Option<Vec<Option<[Vec<f32>; 3]>>>,
    ) -> Result<Option<checkpoint::DistOptimizer>> {
        let hyper = self.group_hyper();
        if let Some(o) = snap.optimizer.take() {
            return Ok(Some(checkpoint::DistOptimizer {
                exp_avg: o.exp_avg,
                exp_avg_sq: o.exp_avg_sq,
                main: o.main,
                steps: o.steps,
                hyper,
                distributed: false,
                chained: snap.ep.1 > 1,
            }));
        }
        let Some(gathered) = gathered else {
            return Ok(None);
        };
        let n = self.table.params.len();
        let mut states: [Vec<Option<HostTensor>>; 3] = Default::default();
        states.iter_mut().for_each(|s| s.resize(n, None));
        for (sharded, world) in self.sharded.iter().zip(gathered) {
            let Some(world) = world else { continue };
            for (param, flat) in sharded.param_states(&world)? {
                let shape = self.table.params[param].shape.clone();
                for (slot, values) in states.iter_mut().zip(flat) {
                    let t = HostTensor::from_f32(DType::F32, shape.clone(), &values)
                        .map_err(|e| anyhow::anyhow!(e))?;
                    slot[param] = Some(t);
                }
            }
        }
        let [main, exp_avg, exp_avg_sq] = states;
        Ok(Some(checkpoint::DistOptimizer {
            exp_avg,
            exp_avg_sq,
            main: Some(main),
            steps: self.sharded.first().map_or(0, |s| s.opt.steps),
            hyper,
            distributed: true,
            chained: self.sharded.len() > 1,
        }))
    }
}

/// Every rank's chunk `records` of a `torch_dist` save on every rank of `groups`, gathered
/// group after group in pieces a host collective carries.
fn gather_records<C: Communicator + ?Sized>(
    groups: &[&C],
    records: Vec<ChunkRecord>,
) -> Result<Vec<ChunkRecord>> {
    let mut all = records;
    for g in groups {
        let bytes = serde_json::to_vec(&all)?;
        let lengths = g.all_gather_bytes(&(bytes.len() as u64).to_le_bytes())?;
        let lengths: Vec<usize> = (lengths.chunks_exact(8))
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()) as usize)
            .collect();
        let longest = lengths.iter().copied().max().unwrap_or(0);
        let mut padded = bytes;
        padded.resize(longest, 0);
        let mut everyone = vec![Vec::with_capacity(longest); g.size()];
        for piece in (0..longest).step_by(MAX_HOST_BYTES) {
            let end = (piece + MAX_HOST_BYTES).min(longest);
            let got = g.all_gather_bytes(&padded[piece..end])?;
            for (r, part) in got.chunks_exact(end - piece).enumerate() {
                everyone[r].extend_from_slice(part);
            }
        }
        all = Vec::new();
        for (bytes, &n) in everyone.iter().zip(&lengths) {
            let part: Vec<ChunkRecord> = serde_json::from_slice(&bytes[..n])?;
            all.extend(part);
        }
    }
    Ok(all)
}
