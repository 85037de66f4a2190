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

use super::parallel::Stage;
use crate::arch::ModelConfig;
use crate::ckpt::config::{megatron_args, ParallelArgs};
use crate::ckpt::layout::{chunk_entries, KeyLayout, Parallel};
use crate::ckpt::megatron::{rank_dir, RANK_FILE, TRACKER};
use crate::ckpt::torch::pickle::{StorageRef, TensorRef, Value};
use crate::ckpt::torch::save::PtWriter;
use crate::ckpt::torch::TorchFile;
use crate::model::params::ParamTable;
use crate::tensor::host::Tensor;
use crate::tensor::DType;
use crate::util::{AtomicFile, OutputKind, TempOutput};
use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value as Json;
use std::io::Write;
use std::path::{Path, PathBuf};

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
/// `get_parameter_state_dp_zero`), written as `distrib_optim.pt`.
pub struct DistributedState {
    /// Main parameters, first and second moments: the flat buffer's buckets, each up to its
    /// last parameter (alignment gaps zero); with several buffers (one per model chunk), one
    /// after the other.
    pub world: [Vec<f32>; 3],
    /// The elements of each buffer in `world` (its `numel_unpadded`).
    pub buffers: Vec<usize>,
    /// The model parameters' dtype (the buffer's key pairs it with the f32 gradients').
    pub param_dtype: DType,
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
    /// Model parameters on the host, in table order (dtype = `cfg.dtype`).
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
    /// The distributed optimizer's state (its data-parallel rank 0's, gathered).
    pub distributed: Option<DistributedState>,
    /// The scheduler's state dict.
    pub scheduler: Option<Json>,
    /// FLOPs so far.
    pub flops: f64,
    /// Extra model tensors by model chunk and Megatron key (LoRA adapters), saved after the
    /// base weights.
    pub extra: Vec<(usize, String, Tensor)>,
    /// This rank's tensor-parallel rank and the group's size (its `mp_rank_TT`, and `args`).
    pub tp: (usize, usize),
    /// This rank's pipeline stage (its `_PPP`, and which layers its file holds).
    pub stage: &'a Stage,
    /// Layers of every stage (recorded in `args` when uneven).
    pub stages: &'a [usize],
}

/// The `mp_rank_TT[_PPP]` directory of tensor-parallel rank `tp` on `stage`.
pub fn rank_dir_of(tp: usize, stage: &Stage) -> String {
    rank_dir(tp, stage.index, stage.count)
}

/// The pickled form of a JSON value (the scheduler's state dict).
/// A JSON value as the pickle value Python's json module would give.
pub fn json_value(j: &Json) -> Value {
    match j {
        Json::Null => Value::None,
        Json::Bool(b) => Value::Bool(*b),
        Json::Number(n) => n
            .as_i64()
            .map(Value::Int)
            .unwrap_or_else(|| Value::Float(n.as_f64().unwrap_or(f64::NAN))),
        Json::String(s) => Value::Str(s.clone()),
        Json::Array(a) => Value::List(a.iter().map(json_value).collect()),
        Json::Object(o) => Value::Dict(
            o.iter()
                .map(|(k, v)| (Value::Str(k.clone()), json_value(v)))
                .collect(),
        ),
    }
}

fn s(k: &str) -> Value {
    Value::Str(k.to_string())
}

/// Storages of one rank file, in the order the pickle names them.
#[derive(Default)]
struct Storages {
    data: Vec<Vec<u8>>,
}

impl Storages {
    /// A tensor value over a new storage holding `t`.
    fn tensor(&mut self, t: &Tensor) -> Value {
        let shape: Vec<u64> = t.shape.iter().map(|&n| n as u64).collect();
        let mut stride = vec![1u64; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            stride[i] = stride[i + 1] * shape[i + 1];
        }
        let numel = shape.iter().product();
        let key = self.data.len().to_string();
        self.data.push(t.data.clone());
        Value::Tensor(Box::new(TensorRef {
            storage: StorageRef {
                key,
                dtype: t.dtype,
                location: "cpu".into(),
                numel,
            },
            offset: 0,
            shape,
            stride,
        }))
    }
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

/// One torch parameter group as Megatron saves it: its group keys, torch AdamW's settings, and
/// its `params` ids — or, for the distributed optimizer, no ids and the step count.
fn group_value(
    decay: bool,
    h: &GroupHyper,
    params: Option<Vec<Value>>,
    step: Option<u64>,
) -> Value {
    let mult = if decay { 1.0 } else { 0.0 };
    let mut items = vec![
        (s("wd_mult"), Value::Float(mult)),
        (s("lr_mult"), Value::Float(1.0)),
        (s("is_expert_parallel"), Value::Bool(false)),
        (s("is_decoupled_lr"), Value::Bool(false)),
        (s("max_lr"), Value::Float(h.max_lr)),
        (s("min_lr"), Value::Float(h.min_lr)),
        (s("lr"), Value::Float(h.lr)),
        (
            s("betas"),
            Value::Tuple(vec![Value::Float(h.betas.0), Value::Float(h.betas.1)]),
        ),
        (s("eps"), Value::Float(h.eps)),
        (s("weight_decay"), Value::Float(h.weight_decay * mult)),
        (s("amsgrad"), Value::Bool(false)),
        (s("maximize"), Value::Bool(false)),
        (s("foreach"), Value::None),
        (s("capturable"), Value::Bool(false)),
        (s("differentiable"), Value::Bool(false)),
        (s("fused"), Value::None),
        (s("decoupled_weight_decay"), Value::Bool(true)),
    ];
    items.extend(params.map(|ids| (s("params"), Value::List(ids))));
    items.extend(step.map(|n| (s("step"), Value::Int(n as i64))));
    Value::Dict(items)
}

/// The distributed optimizer's `optimizer` entry of `model_optim_rng.pt`: the parameter groups
/// without ids or state, each with the step count (`DistributedOptimizer.state_dict`); the
/// state is in `distrib_optim.pt`.
fn distributed_groups(table: &ParamTable, d: &DistributedState) -> Value {
    let trained: Vec<bool> = table.params.iter().map(|p| p.trainable).collect();
    let groups = param_groups(table, &trained)
        .iter()
        .map(|(decay, _)| group_value(*decay, &d.hyper, None, Some(d.steps)))
        .collect();
    Value::Dict(vec![(
        s("optimizer"),
        Value::Dict(vec![(s("param_groups"), Value::List(groups))]),
    )])
}

/// `distrib_optim.pt`: `{"buckets_coalesced": True, 0: {(param dtype, float32): {"param",
/// "exp_avg", "exp_avg_sq": f32 [numel_unpadded], "numel_unpadded"}}, 1: …}`, a key per buffer
/// (megatron-core's `gbuf_idx`: one buffer per model chunk, mindkit's parameters sharing one
/// dtype).
fn write_distributed(path: &Path, d: &DistributedState) -> Result<()> {
    let mut st = Storages::default();
    let mut root = vec![(s("buckets_coalesced"), Value::Bool(true))];
    let mut at = 0;
    for (i, &n) in d.buffers.iter().enumerate() {
        let mut state = Vec::new();
        for (key, values) in ["param", "exp_avg", "exp_avg_sq"].iter().zip(&d.world) {
            let bytes = values[at..at + n]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect();
            state.push((s(key), st.tensor(&Tensor::new(DType::F32, vec![n], bytes))));
        }
        state.push((s("numel_unpadded"), Value::Int(n as i64)));
        let dtypes = Value::Tuple(vec![
            Value::TorchDType(d.param_dtype),
            Value::TorchDType(DType::F32),
        ]);
        root.push((
            Value::Int(i as i64),
            Value::Dict(vec![(dtypes, Value::Dict(state))]),
        ));
        at += n;
    }
    let mut w = PtWriter::create(path, &Value::Dict(root), false)?;
    for (key, bytes) in st.data.iter().enumerate() {
        w.write_storage(&key.to_string(), bytes)?;
    }
    w.finish()?;
    Ok(())
}

/// The torch optimizer `state_dict` (and the bf16 wrapper) of `opt`.
fn optimizer_value(table: &ParamTable, opt: &OptimizerState, st: &mut Storages) -> Value {
    let trained: Vec<bool> = opt.exp_avg.iter().map(Option::is_some).collect();
    let groups = param_groups(table, &trained);
    let mut state = Vec::new();
    let mut id = 0i64;
    let mut ids = vec![Vec::new(); groups.len()];
    for (g, (_, members)) in groups.iter().enumerate() {
        for &p in members {
            if let (Some(m), Some(v)) = (&opt.exp_avg[p], &opt.exp_avg_sq[p]) {
                let step = Tensor::new(
                    DType::F32,
                    vec![],
                    (opt.steps as f32).to_le_bytes().to_vec(),
                );
                state.push((
                    Value::Int(id),
                    Value::Dict(vec![
                        (s("step"), st.tensor(&step)),
                        (s("exp_avg"), st.tensor(m)),
                        (s("exp_avg_sq"), st.tensor(v)),
                    ]),
                ));
            }
            ids[g].push(Value::Int(id));
            id += 1;
        }
    }
    let saved_groups = groups
        .iter()
        .zip(ids)
        .map(|((decay, _), ids)| group_value(*decay, &opt.hyper, Some(ids), None));
    let torch = Value::Dict(vec![
        (s("state"), Value::Dict(state)),
        (s("param_groups"), Value::List(saved_groups.collect())),
    ]);
    match &opt.main {
        None => torch,
        Some(main) => {
            let lists = groups
                .iter()
                .map(|(_, members)| {
                    Value::List(
                        members
                            .iter()
                            .filter_map(|&p| main[p].as_ref().map(|t| st.tensor(t)))
                            .collect(),
                    )
                })
                .collect();
            Value::Dict(vec![
                (s("optimizer"), torch),
                (s("fp32_from_fp16_params"), Value::List(lists)),
            ])
        }
    }
}

/// Set (or add) `args.key`.
pub fn set_arg(args: &mut Vec<(String, Value)>, key: &str, v: Value) {
    match args.iter_mut().find(|(k, _)| k == key) {
        Some(slot) => slot.1 = v,
        None => args.push((key.to_string(), v)),
    }
}

/// Make `--save` ready before any training: the directory created, proven writable by a
/// temporary file, and the tokenizer files copied beside the checkpoints (as `mindkit
/// convert` does, so that the checkpoint converts back to a complete HF directory and
/// resumes without naming the tokenizer again).
pub fn prepare(save: &Path, tokenizer: &Path) -> Result<()> {
    std::fs::create_dir_all(save)
        .with_context(|| format!("--save {}: cannot create it", save.display()))?;
    drop(
        AtomicFile::create(&save.join(TRACKER), &SAVE_DIR, true)
            .with_context(|| format!("--save {}: cannot write there", save.display()))?,
    );
    let dir = if tokenizer.is_dir() {
        tokenizer.to_path_buf()
    } else {
        tokenizer
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default()
    };
    if !save.join("tokenizer.json").is_file() && !save.join("vocab.json").is_file() {
        crate::ckpt::hf::copy_side_files(&dir, save)?;
    }
    Ok(())
}

/// The `iter_XXXXXXX` name of an iteration.
pub fn iteration_dir(iteration: u64) -> String {
    format!("iter_{iteration:07}")
}

/// Write a one-rank checkpoint of `snap` under `save`: the iteration directory first
/// (temporary, then renamed), the tracker last. Returns the rank file written.
pub fn save(save: &Path, snap: &Snapshot) -> Result<PathBuf> {
    let temp = begin(save, snap.iteration)?;
    write_rank(temp.path(), snap)?;
    finish(save, temp, snap)
}

/// The temporary directory of iteration `iteration`'s checkpoint under `save`, which every
/// rank writes its file into before [`finish`] renames it.
pub fn begin(save: &Path, iteration: u64) -> Result<TempOutput> {
    std::fs::create_dir_all(save).with_context(|| format!("creating --save {}", save.display()))?;
    Ok(TempOutput::dir(
        &save.join(iteration_dir(iteration)),
        &SAVE_DIR,
        true,
    )?)
}

/// Rename the complete iteration directory of `snap` (the first rank's) into place, then
/// point the tracker at it. Returns the first rank's file.
pub fn finish(save: &Path, temp: TempOutput, snap: &Snapshot) -> Result<PathBuf> {
    temp.commit()?;
    let mut tracker = AtomicFile::create(&save.join(TRACKER), &SAVE_DIR, true)?;
    tracker.write_all(snap.iteration.to_string().as_bytes())?;
    tracker.finish()?;
    Ok(save
        .join(iteration_dir(snap.iteration))
        .join(rank_dir_of(0, snap.stage))
        .join(RANK_FILE))
}

/// Write this rank's `mp_rank_TT[_PPP]/model_optim_rng.pt` of `snap` into the iteration
/// directory `dir`.
pub fn write_rank(dir: &Path, snap: &Snapshot) -> Result<()> {
    let stage = snap.stage;
    let vpp = stage.chunks.len();
    let parallel = Parallel {
        tp: snap.tp.1,
        pp: stage.count,
        vpp,
        stage_layers: snap.stages.to_vec(),
    };
    let mut args = megatron_args(
        snap.cfg,
        &ParallelArgs {
            tp: snap.tp.1,
            pp: stage.count,
            vpp,
            first_last: parallel.first_last(),
            padded_vocab: snap.table.vocab_padded,
            divisible_by: snap.divisible_by,
        },
        &snap.args,
    );
    for (k, v) in &snap.args {
        set_arg(&mut args, k, v.clone());
    }
    let mut st = Storages::default();
    // A LoRA-only checkpoint (--lora-ckpt-filter) keeps only adapter keys, as MindSpeed-LLM's
    // filter does: not even the Transformer Engine layout's `_extra_state` placeholders.
    let base_saved = snap.saved.iter().any(|&s| s);
    let mut models = Vec::with_capacity(vpp);
    for (v, layers) in stage.chunks.iter().enumerate() {
        let entries = chunk_entries(
            snap.layout,
            snap.cfg,
            &layers.clone().collect::<Vec<_>>(),
            stage.first() && v == 0,
            stage.last() && v + 1 == vpp,
            stage.count,
        );
        let mut model = Vec::new();
        for (path, canon) in &entries {
            let value = match canon {
                None if !base_saved => continue,
                None => Value::None,
                Some(c) => match snap.table.index(*c).filter(|&i| snap.saved[i]) {
                    Some(i) => st.tensor(&snap.params[i]),
                    None => continue,
                },
            };
            model.push((s(&path.join(".")), value));
        }
        for (_, key, t) in snap.extra.iter().filter(|(chunk, ..)| *chunk == v) {
            model.push((s(key), st.tensor(t)));
        }
        // megatron/training/checkpointing.py `generate_state_dict`: `model`, or `model0`,
        // `model1`, … with model chunks
        let name = match vpp {
            1 => "model".to_string(),
            _ => format!("model{v}"),
        };
        models.push((s(&name), Value::Dict(model)));
    }
    let mut root = vec![
        (s("args"), Value::Namespace(args)),
        (s("checkpoint_version"), Value::Float(3.0)),
        (s("iteration"), Value::Int(snap.iteration as i64)),
    ];
    root.extend(models);
    if let Some(opt) = &snap.optimizer {
        root.push((s("optimizer"), optimizer_value(snap.table, opt, &mut st)));
    }
    if let Some(d) = &snap.distributed {
        root.push((s("optimizer"), distributed_groups(snap.table, d)));
    }
    if let Some(sched) = &snap.scheduler {
        root.push((s("opt_param_scheduler"), json_value(sched)));
    }
    root.push((
        s("num_floating_point_operations_so_far"),
        Value::Float(snap.flops),
    ));
    let rank = dir.join(rank_dir_of(snap.tp.0, stage));
    std::fs::create_dir_all(&rank).with_context(|| format!("creating {}", rank.display()))?;
    let mut w = PtWriter::create(&rank.join(RANK_FILE), &Value::Dict(root), false)?;
    for (key, bytes) in st.data.iter().enumerate() {
        w.write_storage(&key.to_string(), bytes)?;
    }
    w.finish()?;
    if let Some(d) = &snap.distributed {
        write_distributed(&rank.join(DISTRIBUTED_FILE), d)?;
    }
    Ok(())
}

/// Replace `host[i]` by the tensor named `table.params[i].name` in this rank's file of the
/// checkpoint `dir` (`at`: its tensor-parallel and pipeline rank and their sizes), for every
/// parameter `pick` selects (the LoRA adapters of `--lora-load`): shapes checked, cast to the
/// parameter's dtype.
pub fn load_named(
    dir: &Path,
    (table, at): (&ParamTable, RankAt),
    pick: impl Fn(&crate::model::params::ParamInfo) -> bool,
    host: &mut [Tensor],
) -> Result<()> {
    let path = rank_file(dir, at)?;
    let f = TorchFile::open(&path)?;
    // each model chunk's keys (`model`, or `model0`, `model1`, …)
    let mut chunks = Vec::new();
    for chunk in crate::ckpt::megatron::chunks(&f)? {
        let mut keys = std::collections::BTreeMap::new();
        crate::ckpt::megatron::flatten(chunk, false, &path, &mut keys)?;
        chunks.push(keys);
    }
    for (p, slot) in table.params.iter().zip(host.iter_mut()) {
        if !pick(p) {
            continue;
        }
        let Some(Value::Tensor(t)) = chunks.get(p.chunk).and_then(|k| k.get(&p.name)) else {
            bail!(
                "{}: no {} (the adapter does not match --lora-r / --lora-target-modules)",
                path.display(),
                p.name
            );
        };
        let t = f.read_tensor(&p.name, t)?;
        if t.shape != p.shape {
            bail!(
                "{}: {} has shape {:?}, this run's adapter {:?}",
                path.display(),
                p.name,
                t.shape,
                p.shape
            );
        }
        *slot = t.cast(slot.dtype).map_err(|e| anyhow!(e))?;
    }
    Ok(())
}

/// What a checkpoint holds besides the model weights (read by [`load_state`]).
pub struct Resumed {
    /// Completed iterations.
    pub iteration: u64,
    /// `args.consumed_train_samples`, `args.consumed_valid_samples`.
    pub consumed_train: u64,
    /// Validation samples consumed.
    pub consumed_valid: u64,
    /// FLOPs so far.
    pub flops: f64,
    /// The scheduler state (`num_steps`, …), if saved.
    pub scheduler: Option<Json>,
    /// The optimizer state, if saved.
    pub optimizer: Option<OptimizerState>,
}

fn int_of(v: Option<&Value>) -> Option<u64> {
    match v? {
        Value::Int(i) => u64::try_from(*i).ok(),
        Value::Float(f) if *f >= 0.0 && f.fract() == 0.0 => Some(*f as u64),
        _ => None,
    }
}

fn float_of(v: Option<&Value>) -> Option<f64> {
    match v? {
        Value::Int(i) => Some(*i as f64),
        Value::Float(f) => Some(*f),
        _ => None,
    }
}

fn value_json(v: &Value) -> Json {
    match v {
        Value::Bool(b) => Json::Bool(*b),
        Value::Int(i) => Json::from(*i),
        Value::Float(f) => Json::from(*f),
        Value::Str(s) => Json::String(s.clone()),
        Value::List(a) | Value::Tuple(a) => Json::Array(a.iter().map(value_json).collect()),
        Value::Dict(items) => Json::Object(
            items
                .iter()
                .filter_map(|(k, v)| match k {
                    Value::Str(k) => Some((k.clone(), value_json(v))),
                    _ => None,
                })
                .collect(),
        ),
        _ => Json::Null,
    }
}

/// A rank's place in a checkpoint's layout: `((tp rank, TP), (pp rank, PP))`.
pub type RankAt = ((usize, usize), (usize, usize));

/// The iteration directory of a checkpoint directory: the tracker's, or `dir` itself.
fn checkpoint_iteration_dir(dir: &Path) -> Result<PathBuf> {
    Ok(if dir.join(TRACKER).is_file() {
        let text = std::fs::read_to_string(dir.join(TRACKER))?;
        let text = text.trim();
        let sub = match text.parse::<u64>() {
            Ok(i) => iteration_dir(i),
            Err(_) if text == "release" => "release".into(),
            Err(_) => bail!(
                "{}: not an iteration number: {text:?}",
                dir.join(TRACKER).display()
            ),
        };
        dir.join(sub)
    } else {
        dir.to_path_buf()
    })
}

/// The first rank's file of a checkpoint of any layout (`mp_rank_00`, or `mp_rank_00_000` of
/// a pipeline).
fn first_rank_file(dir: &Path) -> Result<PathBuf> {
    let iter_dir = checkpoint_iteration_dir(dir)?;
    ["mp_rank_00", "mp_rank_00_000"]
        .iter()
        .map(|r| iter_dir.join(r).join(RANK_FILE))
        .find(|f| f.is_file())
        .ok_or_else(|| anyhow!("{}: no mp_rank_00[_000]/{RANK_FILE}", iter_dir.display()))
}

/// The file of tensor-parallel rank `tp.0` of `tp.1` on pipeline stage `pp.0` of `pp.1` in a
/// checkpoint directory (root or iteration directory), which must be of that layout.
pub fn rank_file(dir: &Path, (tp, pp): RankAt) -> Result<PathBuf> {
    let iter_dir = checkpoint_iteration_dir(dir)?;
    let name = rank_dir(tp.0, pp.0, pp.1);
    let file = iter_dir.join(&name).join(RANK_FILE);
    // a rank beyond this layout's, or a stage of another pipeline, is another layout's
    let other_layout = iter_dir.join(rank_dir(tp.1, pp.0, pp.1)).exists()
        || iter_dir.join(rank_dir(tp.0, pp.1, pp.1 + 1)).exists()
        || (pp.1 == 1 && iter_dir.join(rank_dir(0, 0, 2)).exists());
    if !file.is_file() || other_layout {
        bail!(
            "{}: resuming training state on tensor-parallel rank {} of {}, pipeline stage {} of \
             {} needs a checkpoint of the same layout ({name}/{RANK_FILE}); load the weights of \
             other layouts with --finetune or --no-load-optim",
            iter_dir.display(),
            tp.0,
            tp.1,
            pp.0,
            pp.1,
        );
    }
    Ok(file)
}

/// The distributed optimizer's state in this rank's `distrib_optim.pt` of the checkpoint `dir`
/// (`at`: its place in the layout), whose buffer must hold `numel_unpadded` elements: the
/// world tensors of main parameters and moments ([`DistributedState::world`]) and the steps
/// taken (the parameter groups' `step` in `model_optim_rng.pt`).
pub fn load_distributed(dir: &Path, at: RankAt, buffers: &[usize]) -> Result<([Vec<f32>; 3], u64)> {
    let model = rank_file(dir, at)?;
    let path = model.with_file_name(DISTRIBUTED_FILE);
    if !path.is_file() {
        bail!(
            "{}: no {DISTRIBUTED_FILE}: the checkpoint was saved without --use-distributed-optimizer; \
             resume without it, or pass --no-load-optim",
            model.display()
        );
    }
    let groups = TorchFile::open(&model)?;
    let step = (groups.root().get("optimizer"))
        .and_then(|o| o.get("optimizer"))
        .and_then(|o| o.get("param_groups"))
        .and_then(|g| match g {
            Value::List(groups) => groups.first().and_then(|g| int_of(g.get("step"))),
            _ => None,
        });
    let steps = step.ok_or_else(|| {
        anyhow!(
            "{}: no optimizer step count in its parameter groups",
            model.display()
        )
    })?;
    let f = TorchFile::open(&path)?;
    let Value::Dict(items) = f.root() else {
        bail!("{}: not a dict", path.display());
    };
    let saved = items
        .iter()
        .filter(|(k, _)| matches!(k, Value::Int(_)))
        .count();
    if saved != buffers.len() {
        bail!(
            "{}: {saved} buffer(s), this run has {} (one per model chunk): another layout",
            path.display(),
            buffers.len()
        );
    }
    let mut world: [Vec<f32>; 3] = Default::default();
    for (i, &n) in buffers.iter().enumerate() {
        let buffer = items.iter().find(|(k, _)| *k == Value::Int(i as i64));
        let state = match buffer.map(|(_, v)| v) {
            Some(Value::Dict(by_dtype)) if by_dtype.len() == 1 => &by_dtype[0].1,
            _ => bail!("{}: no buffer {i} of one dtype pair", path.display()),
        };
        let saved = int_of(state.get("numel_unpadded"));
        if saved != Some(n as u64) {
            bail!(
                "{}: its buffer {i} holds {saved:?} elements, this run's {n}: another model, \
                 layout or bucket size (--overlap-grad-reduce, --ddp-bucket-size)",
                path.display()
            );
        }
        for (slot, key) in world.iter_mut().zip(["param", "exp_avg", "exp_avg_sq"]) {
            let Some(Value::Tensor(t)) = state.get(key) else {
                bail!("{}: no {key} in buffer {i}", path.display());
            };
            let t = f.read_tensor(key, t)?;
            let values = crate::tensor::host::to_f32(&t).map_err(|e| anyhow!(e))?;
            if values.len() != n {
                bail!(
                    "{}: {key} of buffer {i} holds {} elements, not {n}",
                    path.display(),
                    values.len()
                );
            }
            slot.extend(values);
        }
    }
    Ok((world, steps))
}

/// The progress a rank file records: iteration, consumed samples, FLOPs and the scheduler.
fn progress(path: &Path, root: &Value) -> Result<Resumed> {
    let arg = |k: &str| root.get("args").and_then(|a| a.get(k));
    Ok(Resumed {
        iteration: int_of(root.get("iteration"))
            .ok_or_else(|| anyhow!("{}: no iteration", path.display()))?,
        consumed_train: int_of(arg("consumed_train_samples")).unwrap_or(0),
        consumed_valid: int_of(arg("consumed_valid_samples")).unwrap_or(0),
        flops: float_of(root.get("num_floating_point_operations_so_far")).unwrap_or(0.0),
        scheduler: root.get("opt_param_scheduler").map(value_json),
        optimizer: None,
    })
}

/// The progress of a checkpoint of any layout (`--no-load-optim`: Megatron still takes the
/// iteration and consumed samples; the weights are resharded as they load), from its first
/// rank's file.
pub fn load_progress(dir: &Path) -> Result<Resumed> {
    let path = first_rank_file(dir)?;
    let f = TorchFile::open(&path)?;
    progress(&path, f.root())
}

/// Read the training state of a checkpoint written by [`save`] (or by Megatron on one rank):
/// iteration, consumed samples, scheduler, and — unless `weights_only` — the optimizer state
/// mapped back onto `table` (groups matched as Megatron's `_filter_and_reorder_param_groups`
/// matches them, by weight-decay multiplier).
pub fn load_state(
    dir: &Path,
    (table, at): (&ParamTable, RankAt),
    trained: &[bool],
    weights_only: bool,
) -> Result<Resumed> {
    let path = rank_file(dir, at)?;
    let (tp, pp) = at;
    let f = TorchFile::open(&path)?;
    let root = f.root();
    let args = root.get("args");
    let arg = |k: &str| args.and_then(|a| a.get(k));
    if let Some(saved) = int_of(arg("tensor_model_parallel_size")).filter(|&n| n != tp.1 as u64) {
        bail!(
            "{}: saved by {saved} tensor-parallel ranks, this run has {}: resuming its training \
             state needs the same layout; load its weights with --finetune or --no-load-optim",
            path.display(),
            tp.1
        );
    }
    if let Some(saved) = int_of(arg("pipeline_model_parallel_size")).filter(|&n| n != pp.1 as u64) {
        bail!(
            "{}: saved by {saved} pipeline stages, this run has {}: resuming its training \
             state needs the same layout; load its weights with --finetune or --no-load-optim",
            path.display(),
            pp.1
        );
    }
    let chunks = table.params.last().map_or(1, |p| p.chunk + 1) as u64;
    let saved = int_of(arg("virtual_pipeline_model_parallel_size")).unwrap_or(1);
    if saved != chunks {
        bail!(
            "{}: saved with {saved} model chunk(s) per pipeline stage, this run has {chunks}: \
             resuming its training state needs the same layout; load its weights with \
             --finetune or --no-load-optim",
            path.display()
        );
    }
    let mut resumed = progress(&path, root)?;
    if weights_only {
        return Ok(resumed);
    }
    let Some(opt) = root.get("optimizer") else {
        bail!(
            "{} holds no optimizer state (saved with --no-save-optim?); resume with --no-load-optim, or start a new run from its weights with --finetune",
            path.display()
        );
    };
    let (torch, main_lists) = match opt.get("fp32_from_fp16_params") {
        Some(Value::List(lists)) => (opt.get("optimizer").unwrap_or(opt), Some(lists)),
        _ => (opt, None),
    };
    let groups = param_groups(table, trained);
    let distributed = || {
        anyhow!(
            "{}: saved with --use-distributed-optimizer (its Adam state is in {DISTRIBUTED_FILE}); \
             resume with it, or pass --no-load-optim",
            path.display()
        )
    };
    let Some(Value::List(saved_groups)) = torch.get("param_groups") else {
        if opt
            .get("optimizer")
            .and_then(|o| o.get("param_groups"))
            .is_some()
        {
            return Err(distributed());
        }
        bail!("{}: optimizer without param_groups", path.display());
    };
    let n = table.params.len();
    let mut state = OptimizerState {
        steps: 0,
        exp_avg: vec![None; n],
        exp_avg_sq: vec![None; n],
        main: main_lists.map(|_| vec![None; n]),
        hyper: GroupHyper {
            lr: 0.0,
            max_lr: 0.0,
            min_lr: 0.0,
            weight_decay: 0.0,
            betas: (0.9, 0.999),
            eps: 1e-8,
        },
    };
    let states = torch.get("state");
    for (g, (decay, members)) in groups.iter().enumerate() {
        let want_mult = if *decay { 1.0 } else { 0.0 };
        let saved = saved_groups
            .iter()
            .enumerate()
            .find(|(_, sg)| float_of(sg.get("wd_mult")) == Some(want_mult))
            .or_else(|| saved_groups.get(g).map(|sg| (g, sg)));
        let (saved_index, saved) = match saved {
            Some(x) => x,
            None if members.is_empty() => continue,
            None => bail!(
                "{}: the optimizer has no parameter group for weight-decay multiplier {want_mult}",
                path.display()
            ),
        };
        let Some(Value::List(ids)) = saved.get("params") else {
            return Err(distributed());
        };
        if ids.len() != members.len() {
            bail!(
                "{}: optimizer group {saved_index} holds {} parameters, this model's has {}: the \
                 checkpoint is of another model or LoRA setting (use --no-load-optim)",
                path.display(),
                ids.len(),
                members.len()
            );
        }
        if *decay {
            state.hyper.lr = float_of(saved.get("lr")).unwrap_or(0.0);
            state.hyper.weight_decay = float_of(saved.get("weight_decay")).unwrap_or(0.0);
        }
        for (j, (id, &p)) in ids.iter().zip(members).enumerate() {
            let name = &table.params[p].name;
            let entry = match (states, id) {
                (Some(Value::Dict(items)), Value::Int(i)) => items
                    .iter()
                    .find(|(k, _)| *k == Value::Int(*i))
                    .map(|(_, v)| v),
                _ => None,
            };
            if let Some(entry) = entry {
                let read = |k: &str| -> Result<Tensor> {
                    match entry.get(k) {
                        Some(Value::Tensor(t)) => Ok(f.read_tensor(name, t)?),
                        _ => bail!("{}: optimizer state of {name} lacks {k}", path.display()),
                    }
                };
                let m = read("exp_avg")?;
                if m.shape != table.params[p].shape {
                    bail!(
                        "{}: optimizer state of {name} is {:?}, the parameter {:?}",
                        path.display(),
                        m.shape,
                        table.params[p].shape
                    );
                }
                state.exp_avg[p] = Some(m);
                state.exp_avg_sq[p] = Some(read("exp_avg_sq")?);
                state.steps = match entry.get("step") {
                    Some(Value::Tensor(t)) => {
                        let t = f.read_tensor(name, t)?;
                        crate::tensor::host::to_f32(&t)
                            .map_err(|e| anyhow!(e))?
                            .first()
                            .copied()
                            .unwrap_or(0.0) as u64
                    }
                    other => int_of(other).unwrap_or(0),
                };
            }
            if let (Some(main), Some(lists)) = (state.main.as_mut(), main_lists) {
                match lists.get(saved_index).and_then(|l| match l {
                    Value::List(v) => v.get(j),
                    _ => None,
                }) {
                    Some(Value::Tensor(t)) => main[p] = Some(f.read_tensor(name, t)?),
                    _ => bail!("{}: no f32 main parameter for {name}", path.display()),
                }
            }
        }
    }
    resumed.optimizer = Some(state);
    Ok(resumed)
}
