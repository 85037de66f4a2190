//! Training checkpoints in megatron-core's default format, `torch_dist` (`--ckpt-format
//! torch_dist`; megatron/training/checkpointing.py over megatron-core 0.15.3's
//! dist_checkpointing): every writing rank appends the main replicas of its parameters — and
//! their optimizer state, model-shaped — to a data file of its own as chunks of the global
//! tensors (`ShardedTensor`s); the first rank then writes the index of every rank's chunks,
//! `common.pt` and `metadata.json`, and the iteration directory is renamed into place before
//! the tracker names it, as for the torch format.
//!
//! The optimizer's state (megatron/core/optimizer/optimizer.py and distrib_optimizer.py
//! `sharded_state_dict`, dist_checkpointing/optimizer.py `optim_state_to_sharding_state`):
//! each parameter's `optimizer.state.{exp_avg, exp_avg_sq}.<its key>`, sharded as it is, with
//! the f32 main copy as `fp32_param` (`--bf16`); the distributed optimizer's in its
//! `fully_reshardable` form (`--dist-ckpt-optim-fully-reshardable`: `param`, `exp_avg`,
//! `exp_avg_sq`, which megatron-core loads whatever that flag says when it loads), not its
//! default `dp_reshardable` buckets, which only a run of the same layout could load. What is
//! not sharded — the parameter groups and the step — goes to `common.pt`. No RNG state is
//! written (`args.no_save_rng`, as for the torch format), so megatron-core asks for none.

use super::write::{group_value, layout_args, set_arg, Storages};
use super::{param_groups, GroupHyper, Snapshot};
use crate::arch::roles::canonical_shape;
use crate::ckpt::torch::pickle::Value;
use crate::ckpt::torch::TorchFile;
use crate::ckpt::torch_dist::{self, placement, ChunkAt, ChunkRecord, ItemFile, OPTIMIZER_STATE};
use crate::ckpt::transform::shard_places;
use crate::tensor::host::{to_f32, Tensor};
use crate::tensor::DType;
use anyhow::{anyhow, bail, Result};
use std::path::Path;

/// The optimizer's state a `torch_dist` checkpoint holds, model-shaped, by table index.
pub struct DistOptimizer {
    /// First moments of the trained parameters (`None` for the others).
    pub exp_avg: Vec<Option<Tensor>>,
    /// Second moments.
    pub exp_avg_sq: Vec<Option<Tensor>>,
    /// f32 main parameters (`--bf16`, or the distributed optimizer's).
    pub main: Option<Vec<Option<Tensor>>>,
    /// Steps taken.
    pub steps: u64,
    /// The groups' settings.
    pub hyper: GroupHyper,
    /// Whether it is the distributed optimizer's (`fully_reshardable`).
    pub distributed: bool,
    /// Whether the routed experts have an optimizer of their own (expert parallelism:
    /// megatron-core's `ChainedOptimizer` of two).
    pub chained: bool,
}

impl DistOptimizer {
    /// The name of the main copies' state.
    fn main_name(&self) -> &'static str {
        match self.distributed {
            true => "param",
            false => "fp32_param",
        }
    }

    /// Parameter `i`'s states as saved: name and tensor.
    fn states(&self, i: usize) -> Vec<(&'static str, &Tensor)> {
        let main = self.main.as_ref().and_then(|m| m[i].as_ref());
        [
            (self.main_name(), main),
            ("exp_avg", self.exp_avg[i].as_ref()),
            ("exp_avg_sq", self.exp_avg_sq[i].as_ref()),
        ]
        .into_iter()
        .filter_map(|(name, t)| t.map(|t| (name, t)))
        .collect()
    }
}

/// The data file of the writing rank at `index` among the model-parallel ranks.
pub fn data_file(index: usize) -> String {
    format!("__{index}_0.distcp")
}

/// The data file the first rank writes the linear layers' extra state into.
const OBJECTS_FILE: &str = "__0_1.distcp";

/// Append the main replicas `writes` (by table index) of `snap`'s parameters, and with `opt`
/// their optimizer state, to data file `name` in `iter_dir`: each tensor-parallel shard a
/// chunk (SwiGLU's two: its gate and up rows lie apart in the global tensor) of its global
/// tensor at its layer's and expert's index. Returns the chunks for the index.
pub fn write_part(
    iter_dir: &Path,
    name: &str,
    (snap, writes): (&Snapshot, &[bool]),
    opt: Option<&DistOptimizer>,
) -> Result<Vec<ChunkRecord>> {
    let mut file = ItemFile::create(iter_dir, name)?;
    let mut records = Vec::new();
    let table = snap.table;
    for (i, p) in (table.params.iter().enumerate()).filter(|&(i, _)| writes[i]) {
        let c = p.canon;
        let to = placement(snap.cfg, c);
        let mut shape = canonical_shape(snap.cfg, c.role);
        if c.role.vocab_rows() {
            shape[0] = table.vocab_padded;
        }
        let (r, ranks) = match (p.tp_split, c.role.expert()) {
            (false, _) => (0, 1),
            // a routed expert's shard is its expert tensor-parallel rank's (ETP dividing TP)
            (true, Some(_)) => (snap.tp.0 % snap.etp, snap.etp),
            (true, None) => snap.tp,
        };
        let mut tensors = vec![(None, &snap.params[i])];
        if let Some(o) = opt {
            tensors.extend(o.states(i).into_iter().map(|(n, t)| (Some(n), t)));
        }
        for (state, t) in tensors {
            let key = match state {
                Some(s) => format!("{OPTIMIZER_STATE}{s}.{}", to.key),
                None => to.key.clone(),
            };
            for (rows, offsets) in shard_places(c.role, &t.shape, r, ranks) {
                let part;
                let block = match rows.len() == t.shape[0] {
                    true => t,
                    false => {
                        part = t.rows(rows.start, rows.end);
                        &part
                    }
                };
                let at = ChunkAt {
                    key: &key,
                    at: &to.at,
                    lead: &to.lead,
                    shape: &shape,
                    offsets: &offsets,
                };
                records.push(file.tensor(&at, block)?);
            }
        }
    }
    file.finish()?;
    Ok(records)
}

/// The first rank's part after every rank's: the linear layers' extra state, the index of
/// every rank's `records`, and `common.pt` (args, iteration, scheduler, FLOPs, the
/// optimizer's parameter groups and step) with `metadata.json`. `final_dir` is where the
/// checkpoint will be.
pub fn write_root(
    iter_dir: &Path,
    (snap, records): (&Snapshot, Vec<ChunkRecord>),
    opt: Option<&DistOptimizer>,
    final_dir: &Path,
) -> Result<()> {
    let mut objects_file = ItemFile::create(iter_dir, OBJECTS_FILE)?;
    let objects = objects_file.extra_states(torch_dist::extra_state_fqns(&records))?;
    objects_file.finish()?;
    torch_dist::write_index(iter_dir, records, &objects, final_dir)?;
    let s = |x: &str| Value::Str(x.into());
    let (_, mut args) = layout_args(snap);
    set_arg(&mut args, "no_save_rng", Value::Bool(true));
    if opt.is_some_and(|o| o.distributed) {
        set_arg(
            &mut args,
            "dist_ckpt_optim_fully_reshardable",
            Value::Bool(true),
        );
    }
    let mut storages = Storages::default();
    let mut entries = vec![
        (s("args"), torch_dist::dist_args(args)),
        (s("checkpoint_version"), Value::Float(3.0)),
        (s("iteration"), Value::Int(snap.iteration as i64)),
    ];
    if let Some(o) = opt {
        entries.push((s("optimizer"), optimizer_common(snap, o, &mut storages)));
    }
    if let Some(sched) = &snap.scheduler {
        entries.push((s("opt_param_scheduler"), super::json_value(sched)));
    }
    entries.push((
        s("num_floating_point_operations_so_far"),
        Value::Float(snap.flops),
    ));
    let mut content = Vec::new();
    if opt.is_some_and(|o| o.distributed) {
        content = vec![
            (s("distrib_optim_sharding_type"), s("fully_reshardable")),
            (
                s("distrib_optim_fully_reshardable_mem_efficient"),
                Value::Bool(false),
            ),
        ];
    }
    torch_dist::write_common(iter_dir, (entries, &storages.data), content)
}

/// The optimizer's part of `common.pt`: what its `sharded_state_dict` leaves unsharded — the
/// parameter groups without their ids (megatron-core re-attaches the run's), and the step:
/// torch Adam's, shared by every parameter (`state.common_step`, a 0-d f32 tensor, absent
/// before the first step), or the distributed optimizer's in each group. Under expert
/// parallelism one per optimizer, keyed 0 (the dense parameters') and 1 (the experts').
fn optimizer_common(snap: &Snapshot, o: &DistOptimizer, st: &mut Storages) -> Value {
    let s = |x: &str| Value::Str(x.into());
    let trained: Vec<bool> = snap.table.params.iter().map(|p| p.trainable).collect();
    let one = |experts: bool, st: &mut Storages| {
        let mask = match o.chained {
            true => super::expert_mask(snap.table, &trained, experts),
            false => trained.clone(),
        };
        let step = (o.distributed).then_some(Value::Float(o.steps as f64));
        let groups = (param_groups(snap.table, &mask).iter())
            .map(|(decay, _)| group_value((*decay, experts), &o.hyper, None, step.clone()))
            .collect();
        let groups = (s("param_groups"), Value::List(groups));
        if o.distributed {
            return Value::Dict(vec![
                (s("optimizer"), Value::Dict(vec![groups])),
                (s("param_state_sharding_type"), s("fully_reshardable")),
            ]);
        }
        let mut state = Vec::new();
        if o.steps > 0 {
            let step = Tensor::new(DType::F32, vec![], (o.steps as f32).to_le_bytes().to_vec());
            state.push((s("common_step"), st.tensor(&step)));
        }
        let torch = Value::Dict(vec![(s("state"), Value::Dict(state)), groups]);
        match o.main.is_some() {
            true => Value::Dict(vec![(s("optimizer"), torch)]),
            false => torch,
        }
    };
    match o.chained {
        false => one(false, st),
        true => Value::Dict(vec![
            (Value::Int(0), one(false, st)),
            (Value::Int(1), one(true, st)),
        ]),
    }
}

/// The step count the optimizer part of a `torch_dist` checkpoint's `common.pt` records (see
/// [`optimizer_common`]): 0 when it records none (no step taken).
pub fn saved_steps(common: &TorchFile) -> Result<u64> {
    let path = common.path().display();
    let Some(optimizer) = common.root().get("optimizer") else {
        bail!("{path}: no optimizer state (saved with --no-save-optim: pass --no-load-optim)");
    };
    // the first optimizer of a ChainedOptimizer's (each records the same steps)
    let first = match optimizer {
        Value::Dict(items) => items.iter().find(|(k, _)| *k == Value::Int(0)),
        _ => None,
    };
    let part = first.map_or(optimizer, |(_, v)| v);
    let torch = part.get("optimizer").unwrap_or(part);
    if let Some(Value::Tensor(t)) = torch.get("state").and_then(|s| s.get("common_step")) {
        let step = to_f32(&common.read_tensor("common_step", t)?)
            .map_err(|e| anyhow!("{path}: common_step: {e}"))?;
        return match step.as_slice() {
            [n] if *n >= 0.0 && n.fract() == 0.0 => Ok(*n as u64),
            _ => bail!("{path}: common_step is {step:?}, not a step count"),
        };
    }
    group_steps(torch, &path.to_string())
}

/// The step count the parameter groups of a torch optimizer's `state_dict()` (`torch`,
/// without its state) record, as megatron-core's `state_dict()` sets them (`what` names it):
/// 0 when they record none.
pub fn group_steps(torch: &Value, what: &str) -> Result<u64> {
    let Some(Value::List(groups)) = torch.get("param_groups") else {
        bail!("{what}: the optimizer state has no param_groups");
    };
    Ok(groups
        .first()
        .and_then(|g| super::read::int_of(g.get("step")))
        .unwrap_or(0))
}
