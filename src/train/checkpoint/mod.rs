//! Megatron torch-format training checkpoints (megatron/training/checkpointing.py,
//! `--ckpt-format torch`): `<save>/iter_XXXXXXX/mp_rank_00/model_optim_rng.pt` holding `args`,
//! `checkpoint_version` 3.0, `iteration`, `model`, `optimizer` (the torch optimizer's
//! `state_dict`: Adam moments and step per parameter id, two parameter groups; with `--bf16`
//! wrapped with the f32 main parameters as `fp32_from_fp16_params`), `opt_param_scheduler` and
//! `num_floating_point_operations_so_far`; then `latest_checkpointed_iteration.txt`. The
//! iteration directory is written under a temporary name and renamed into place before the
//! tracker names it, so an interrupted save leaves the previous checkpoint the latest one.
//!
//! No `rng_state` is written (mindkit's training draws no random numbers after
//! initialisation): Megatron loads these checkpoints with `--no-load-rng` or `--finetune`.
//!
//! Here what a checkpoint holds and the names both sides share; writing is `write`, reading
//! back (resuming) is `read`.

mod dist;
mod read;
mod write;

pub use dist::{data_file, group_steps, saved_steps, write_part, write_root, DistOptimizer};

pub use read::{
    is_release, load_distributed, load_named, load_progress, load_state, progress, rank_file,
    Resumed,
};
pub use write::{begin, finish, json_value, prepare, save, set_arg, write_rank};

use super::parallel::Stage;
use crate::arch::roles::Role;
use crate::arch::ModelConfig;
use crate::ckpt::layout::KeyLayout;
use crate::ckpt::megatron::expert_rank_dir;
use crate::ckpt::torch::pickle::Value;
use crate::model::params::ParamTable;
use crate::tensor::host::Tensor;
use crate::tensor::DType;
use crate::util::OutputKind;
use serde_json::Value as Json;

/// A checkpoint directory (`--save`) as an output: mindkit adds iteration directories and the
/// tracker, and never removes anything else.
pub static SAVE_DIR: OutputKind = OutputKind {
    tag: "ckpt",
    what: "training checkpoint",
    dir: None,
};

/// The optimizer's state on the host, in parameter-table order.
pub struct OptimizerState {
    /// Optimizer steps taken.
    pub steps: u64,
    /// Adam moments (f32), `None` for frozen parameters.
    pub exp_avg: Vec<Option<Tensor>>,
    /// Second moments.
    pub exp_avg_sq: Vec<Option<Tensor>>,
    /// f32 main parameters (`--bf16`), `None` for frozen parameters.
    pub main: Option<Vec<Option<Tensor>>>,
    /// Hyper-parameters recorded in the parameter groups.
    pub hyper: GroupHyper,
}

/// The distributed optimizer's state of one tensor-parallel rank of one stage, gathered to its
/// data-parallel rank 0 (megatron/core/optimizer/distrib_optimizer.py
/// `get_parameter_state_dp_zero`), written as `distrib_optim.pt`; under expert parallelism
/// one of the dense parameters' (over the data-parallel ranks) and one of the routed
/// experts' (over the expert-data-parallel ranks).
pub struct DistributedState {
    /// Main parameters, first and second moments: the flat buffer's buckets, each up to its
    /// last parameter (alignment gaps zero); with several buffers (one per model chunk and
    /// parameter dtype), one after the other. `None` on a rank that is not the group's rank 0
    /// (it saved none).
    pub world: Option<[Vec<f32>; 3]>,
    /// Whether it is the routed experts' (under expert parallelism).
    pub experts: bool,
    /// The elements of each buffer in `world` (its `numel_unpadded`) and its parameters' dtype
    /// (the buffer's key pairs it with the f32 gradients').
    pub buffers: Vec<(usize, DType)>,
    /// Steps taken.
    pub steps: u64,
    /// The groups' settings.
    pub hyper: GroupHyper,
}

/// The file the distributed optimizer's state goes in, beside `model_optim_rng.pt`.
pub const DISTRIBUTED_FILE: &str = "distrib_optim.pt";

/// What the torch parameter groups record.
#[derive(Debug, Clone, Copy)]
pub struct GroupHyper {
    /// Current learning rate.
    pub lr: f64,
    /// `--lr`, `--min-lr`.
    pub max_lr: f64,
    /// `--min-lr`.
    pub min_lr: f64,
    /// Current weight decay of the decayed group.
    pub weight_decay: f64,
    /// β₁, β₂.
    pub betas: (f64, f64),
    /// ε.
    pub eps: f64,
}

/// Everything a checkpoint records.
pub struct Snapshot<'a> {
    /// Architecture (dtype = the model parameters').
    pub cfg: &'a ModelConfig,
    /// Parameters, in table order.
    pub table: &'a ParamTable,
    /// Model parameters on the host, in table order (dtype: `cfg.dtype`, the expert bias f32).
    pub params: Vec<Tensor>,
    /// Which parameters go into the file (all, or the LoRA ones with `--lora-ckpt-filter`).
    pub saved: Vec<bool>,
    /// Key layout of `model`.
    pub layout: KeyLayout,
    /// `--make-vocab-size-divisible-by`.
    pub divisible_by: usize,
    /// Completed iterations.
    pub iteration: u64,
    /// Training state recorded in `args`.
    pub args: Vec<(String, Value)>,
    /// Optimizer state (`None` with `--no-save-optim` or the distributed optimizer).
    pub optimizer: Option<OptimizerState>,
    /// The distributed optimizer's state (its data-parallel rank 0's, gathered): none, one,
    /// or under expert parallelism the dense parameters' and the routed experts'.
    pub distributed: Vec<DistributedState>,
    /// The scheduler's state dict.
    pub scheduler: Option<Json>,
    /// FLOPs so far.
    pub flops: f64,
    /// Extra model tensors by model chunk and Megatron key (LoRA adapters), saved after the
    /// base weights.
    pub extra: Vec<(usize, String, Tensor)>,
    /// This rank's tensor-parallel rank and the group's size (its `mp_rank_TT`, and `args`).
    pub tp: (usize, usize),
    /// This rank's expert-parallel rank and the group's size: which experts its file holds,
    /// and its `_EEE` and `args` ([`Snapshot::file_ep`]).
    pub ep: (usize, usize),
    /// Expert tensor-parallel size (a divisor of TP; 1: whole experts).
    pub etp: usize,
    /// MindSpeed-LLM's `--moe-tp-extend-ep` under TP > 1: the expert-parallel group spans the
    /// TP ranks, files are named by the rank in its EP groups of TP-sized blocks.
    pub tp_extend: bool,
    /// This rank's pipeline stage (its `_PPP`, and which layers its file holds).
    pub stage: &'a Stage,
    /// Layers of every stage (recorded in `args` when uneven).
    pub stages: &'a [usize],
    /// Routed experts saved as MindSpeed-LLM's grouped tensors (`--moe-grouped-gemm`).
    pub grouped: bool,
    /// Routed experts saved as TEGroupedMLP's (`--moe-grouped-gemm`, Transformer Engine).
    pub te_grouped: bool,
}

/// How the checkpoint stores a parameter group's members: one unit per parameter, except that
/// with grouped experts a layer's routed experts' linear_fc1 weights are one unit (`weight1`)
/// and their linear_fc2 weights another (`weight2`), and so are each of their LoRA factors
/// (`weight1_lora_a`, …), each at its first member's place (the order megatron-core's
/// `GroupedMLP` and MindSpeed-LLM's `LoraParallelGroupedMLP` register them).
pub fn stored_units(table: &ParamTable, members: &[usize], grouped: bool) -> Vec<Vec<usize>> {
    let mut units: Vec<Vec<usize>> = Vec::new();
    let mut at: std::collections::HashMap<_, usize> = std::collections::HashMap::new();
    for &p in members {
        let info = &table.params[p];
        let (chunk, layer, lora) = (info.chunk, info.canon.layer, info.lora);
        let key = match (grouped, info.canon.role) {
            (true, Role::ExpertFc1(_)) => Some((chunk, layer, 1, lora)),
            (true, Role::ExpertFc2(_)) => Some((chunk, layer, 2, lora)),
            _ => None,
        };
        match key.and_then(|k| at.get(&k).copied()) {
            Some(i) => units[i].push(p),
            None => {
                if let Some(k) = key {
                    at.insert(k, units.len());
                }
                units.push(vec![p]);
            }
        }
    }
    units
}

/// Whether a unit of [`stored_units`] is a grouped tensor.
pub fn is_grouped_unit(table: &ParamTable, unit: &[usize], grouped: bool) -> bool {
    grouped && table.params[unit[0]].canon.role.expert().is_some()
}

/// The key a unit is stored under: its parameter's, or a grouped tensor's
/// ([`crate::ckpt::grouped::grouped_key`]).
pub fn unit_key(table: &ParamTable, unit: &[usize], grouped: bool) -> String {
    let name = &table.params[unit[0]].name;
    match is_grouped_unit(table, unit, grouped) {
        true => crate::ckpt::grouped::grouped_key(name).map_or_else(|| name.clone(), |(g, _)| g),
        false => name.clone(),
    }
}

/// The tensor stored for a unit, from its members' tensors (a grouped tensor packs them).
pub fn pack_unit(table: &ParamTable, unit: &[usize], tensors: &[&Tensor], grouped: bool) -> Tensor {
    if !is_grouped_unit(table, unit, grouped) {
        return tensors[0].clone();
    }
    let info = &table.params[unit[0]];
    let name = match info.canon.role {
        Role::ExpertFc1(_) => "experts.weight1",
        _ => "experts.weight2",
    };
    let shape = crate::ckpt::grouped::grouped_shape(name, &info.shape, unit.len());
    let shards: Vec<Tensor> = tensors.iter().map(|&t| t.clone()).collect();
    Tensor::new(
        tensors[0].dtype,
        shape.iter().map(|&n| n as usize).collect(),
        crate::ckpt::grouped::pack(&shards),
    )
}

/// A unit's members' tensors from the tensor stored for it.
pub fn unpack_unit(
    table: &ParamTable,
    unit: &[usize],
    stored: Tensor,
    grouped: bool,
) -> Vec<Tensor> {
    if !is_grouped_unit(table, unit, grouped) {
        return vec![stored];
    }
    let shape = &table.params[unit[0]].shape;
    let (m, k) = (shape[0], shape[1]);
    let bytes = m * k * stored.dtype.size();
    (0..unit.len())
        .map(|i| {
            let block = stored.data[i * bytes..(i + 1) * bytes].to_vec();
            Tensor::new(stored.dtype, vec![k, m], block).transposed()
        })
        .collect()
}

impl Snapshot<'_> {
    /// The expert-parallel rank and size in the file's name and `args`: the group's, or with
    /// `--moe-tp-extend-ep` its block of TP ranks (rank `e·TP + t` holds file `_EEE` = e).
    pub fn file_ep(&self) -> (usize, usize) {
        file_ep(self.ep, self.tp.1, self.tp_extend)
    }
}

/// An expert-parallel rank and size `ep` as checkpoint files name them: under
/// `--moe-tp-extend-ep` (the group spanning `tp` ranks) in blocks of `tp`.
pub fn file_ep(ep: (usize, usize), tp: usize, tp_extend: bool) -> (usize, usize) {
    match tp_extend {
        true => (ep.0 / tp, ep.1 / tp),
        false => ep,
    }
}

/// The `mp_rank_TT[_PPP]` directory of tensor-parallel rank `tp` on `stage`.
pub fn rank_dir_of(tp: usize, stage: &Stage, ep: (usize, usize)) -> String {
    expert_rank_dir(tp, stage.rank(), ep)
}

/// Megatron's parameter groups over the trained parameters, as `(weight decay, members)`:
/// one per decay setting present, in the order their first members come in the table (a
/// pipeline stage without the embedding starts with a norm: its no-decay group comes first),
/// members in table order (megatron/core/optimizer/__init__.py `_get_param_groups`). Ids are
/// consecutive group by group.
pub fn param_groups(table: &ParamTable, trained: &[bool]) -> Vec<(bool, Vec<usize>)> {
    let mut groups: Vec<(bool, Vec<usize>)> = Vec::new();
    for (i, p) in table.params.iter().enumerate().filter(|&(i, _)| trained[i]) {
        match groups.iter_mut().find(|(decay, _)| *decay == p.decay) {
            Some((_, members)) => members.push(i),
            None => groups.push((p.decay, vec![i])),
        }
    }
    groups
}

/// Of the `trained` parameters, the routed experts' (`experts`) or the others.
pub fn expert_mask(table: &ParamTable, trained: &[bool], experts: bool) -> Vec<bool> {
    (table.params.iter().zip(trained))
        .map(|(p, &t)| t && p.canon.role.expert().is_some() == experts)
        .collect()
}

/// The `iter_XXXXXXX` name of an iteration.
pub fn iteration_dir(iteration: u64) -> String {
    format!("iter_{iteration:07}")
}

/// A rank's place in a checkpoint's layout: `((tp rank, TP), (pp rank, PP), (ep rank, EP))`.
pub type RankAt = ((usize, usize), (usize, usize), (usize, usize));
