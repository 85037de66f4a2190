//! Writing a checkpoint: each rank's `model_optim_rng.pt` (and `distrib_optim.pt`) into a
//! temporary iteration directory, renamed into place before the tracker names it.

use super::{iteration_dir, pack_unit, param_groups, rank_dir_of, stored_units};
use super::{DistributedState, GroupHyper, OptimizerState, Snapshot, DISTRIBUTED_FILE, SAVE_DIR};
use crate::ckpt::config::{megatron_args, ParallelArgs};
use crate::ckpt::grouped::grouped_key;
use crate::ckpt::layout::{chunk_entries, te_grouped_entries, Parallel};
use crate::ckpt::megatron::{RANK_FILE, TRACKER};
use crate::ckpt::torch::pickle::{StorageRef, TensorRef, Value};
use crate::ckpt::torch::save::PtWriter;
use crate::data::tekken::is_tekken_path;
use crate::model::params::ParamTable;
use crate::tensor::host::Tensor;
use crate::tensor::DType;
use crate::util::{AtomicFile, TempOutput};
use anyhow::{Context, Result};
use serde_json::Value as Json;
use std::io::Write;
use std::path::{Path, PathBuf};

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
pub(super) struct Storages {
    pub(super) data: Vec<Vec<u8>>,
}

impl Storages {
    /// A tensor value over a new storage holding `t`.
    pub(super) fn tensor(&mut self, t: &Tensor) -> Value {
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

/// One torch parameter group as Megatron saves it: its group keys, torch AdamW's settings, and
/// its `params` ids — or, for the distributed optimizer, no ids and the step count.
pub(super) fn group_value(
    (decay, experts): (bool, bool),
    h: &GroupHyper,
    params: Option<Vec<Value>>,
    step: Option<Value>,
) -> Value {
    let mult = if decay { 1.0 } else { 0.0 };
    let mut items = vec![
        (s("wd_mult"), Value::Float(mult)),
        (s("lr_mult"), Value::Float(1.0)),
        (s("is_expert_parallel"), Value::Bool(experts)),
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
    items.extend(step.map(|n| (s("step"), n)));
    Value::Dict(items)
}

/// The distributed optimizer's `optimizer` entry of `model_optim_rng.pt`: the parameter groups
/// without ids or state, each with the step count (`DistributedOptimizer.state_dict`); the
/// state is in `distrib_optim.pt`. Under expert parallelism the `ChainedOptimizer`'s list of
/// the dense parameters' optimizer's and the routed experts'.
fn distributed_groups(table: &ParamTable, parts: &[DistributedState]) -> Value {
    let trained: Vec<bool> = table.params.iter().map(|p| p.trainable).collect();
    let one = |d: &DistributedState| {
        let members = match parts.len() {
            1 => trained.clone(),
            _ => super::expert_mask(table, &trained, d.experts),
        };
        let groups = param_groups(table, &members)
            .iter()
            .map(|(decay, _)| {
                group_value(
                    (*decay, d.experts),
                    &d.hyper,
                    None,
                    Some(Value::Int(d.steps as i64)),
                )
            })
            .collect();
        Value::Dict(vec![(
            s("optimizer"),
            Value::Dict(vec![(s("param_groups"), Value::List(groups))]),
        )])
    };
    match parts {
        [d] => one(d),
        _ => Value::List(parts.iter().map(one).collect()),
    }
}

/// `distrib_optim.pt` of the parts this rank gathered (megatron-core's
/// `ChainedOptimizer.save_parameter_state`: a list, `None` for a part another rank saves,
/// under expert parallelism), if any.
fn write_distributed_parts(path: &Path, parts: &[DistributedState]) -> Result<()> {
    if parts.iter().all(|d| d.world.is_none()) {
        return Ok(());
    }
    let mut st = Storages::default();
    let root = match parts {
        [d] => distributed_value(d, &mut st),
        _ => Value::List(
            parts
                .iter()
                .map(|d| distributed_value(d, &mut st))
                .collect(),
        ),
    };
    let mut w = PtWriter::create(path, &root, false)?;
    for (key, bytes) in st.data.iter().enumerate() {
        w.write_storage(&key.to_string(), bytes)?;
    }
    w.finish()?;
    Ok(())
}

/// One optimizer's state in `distrib_optim.pt`: `{"buckets_coalesced": True, 0: {(param dtype,
/// float32): {"param", "exp_avg", "exp_avg_sq": f32 [numel_unpadded], "numel_unpadded"}}, 1:
/// …}`, a key per buffer (megatron-core's `gbuf_idx`: a buffer per model chunk and parameter
/// dtype); `None` where this rank gathered none.
fn distributed_value(d: &DistributedState, st: &mut Storages) -> Value {
    let Some(world) = &d.world else {
        return Value::None;
    };
    let mut root = vec![(s("buckets_coalesced"), Value::Bool(true))];
    let mut at = 0;
    for (i, &(n, dtype)) in d.buffers.iter().enumerate() {
        let mut state = Vec::new();
        for (key, values) in ["param", "exp_avg", "exp_avg_sq"].iter().zip(world) {
            let bytes = values[at..at + n]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect();
            state.push((s(key), st.tensor(&Tensor::new(DType::F32, vec![n], bytes))));
        }
        state.push((s("numel_unpadded"), Value::Int(n as i64)));
        let dtypes = Value::Tuple(vec![
            Value::TorchDType(dtype),
            Value::TorchDType(DType::F32),
        ]);
        root.push((
            Value::Int(i as i64),
            Value::Dict(vec![(dtypes, Value::Dict(state))]),
        ));
        at += n;
    }
    Value::Dict(root)
}

/// The `optimizer` entry of `opt` for `ep` expert-parallel ranks: one optimizer's state dict,
/// or under expert parallelism megatron-core's `ChainedOptimizer.state_dict`, the list of the
/// dense parameters' optimizer's and the routed experts' (megatron/core/optimizer/__init__.py
/// `get_megatron_optimizer`: expert-parallel parameters have an optimizer of their own).
fn optimizers_value(
    table: &ParamTable,
    opt: &OptimizerState,
    st: &mut Storages,
    (grouped, ep): (bool, usize),
) -> Value {
    let trained: Vec<bool> = opt.exp_avg.iter().map(Option::is_some).collect();
    match ep > 1 {
        false => optimizer_value(table, opt, st, (&trained, false, grouped)),
        true => Value::List(
            [false, true]
                .map(|experts| {
                    let mask = super::expert_mask(table, &trained, experts);
                    optimizer_value(table, opt, st, (&mask, experts, grouped))
                })
                .into(),
        ),
    }
}

/// The torch optimizer `state_dict` (and the bf16 wrapper) of `opt`'s `trained` parameters
/// (the routed experts' with `experts`), a parameter id per stored unit ([`stored_units`]:
/// grouped experts are one parameter each).
fn optimizer_value(
    table: &ParamTable,
    opt: &OptimizerState,
    st: &mut Storages,
    (trained, experts, grouped): (&[bool], bool, bool),
) -> Value {
    let groups = param_groups(table, trained);
    let units: Vec<Vec<Vec<usize>>> = (groups.iter())
        .map(|(_, members)| stored_units(table, members, grouped))
        .collect();
    let packed = |unit: &[usize], of: &[Option<Tensor>]| -> Option<Tensor> {
        let tensors: Option<Vec<&Tensor>> = unit.iter().map(|&p| of[p].as_ref()).collect();
        Some(pack_unit(table, unit, &tensors?, grouped))
    };
    let mut state = Vec::new();
    let mut id = 0i64;
    let mut ids = vec![Vec::new(); groups.len()];
    for (g, units) in units.iter().enumerate() {
        for unit in units {
            if let (Some(m), Some(v)) = (packed(unit, &opt.exp_avg), packed(unit, &opt.exp_avg_sq))
            {
                let step = Tensor::new(
                    DType::F32,
                    vec![],
                    (opt.steps as f32).to_le_bytes().to_vec(),
                );
                state.push((
                    Value::Int(id),
                    Value::Dict(vec![
                        (s("step"), st.tensor(&step)),
                        (s("exp_avg"), st.tensor(&m)),
                        (s("exp_avg_sq"), st.tensor(&v)),
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
        .map(|((decay, _), ids)| group_value((*decay, experts), &opt.hyper, Some(ids), None));
    let torch = Value::Dict(vec![
        (s("state"), Value::Dict(state)),
        (s("param_groups"), Value::List(saved_groups.collect())),
    ]);
    match &opt.main {
        None => torch,
        Some(main) => {
            let lists = units
                .iter()
                .map(|units| {
                    Value::List(
                        (units.iter())
                            .filter_map(|unit| packed(unit, main).map(|t| st.tensor(&t)))
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
    check_tokenizer_files(save, tokenizer)?;
    std::fs::create_dir_all(save)
        .with_context(|| format!("--save {}: cannot create it", save.display()))?;
    drop(
        AtomicFile::create(&save.join(TRACKER), &SAVE_DIR, true)
            .with_context(|| format!("--save {}: cannot write there", save.display()))?,
    );
    let is_checkpoint = |name: &str| name.starts_with("iter_") || name == TRACKER;
    let stale = crate::util::remove_stale_temporaries(save, is_checkpoint)
        .with_context(|| format!("--save {}", save.display()))?;
    if !stale.is_empty() {
        let names: Vec<String> = stale.iter().map(|p| p.display().to_string()).collect();
        eprintln!(
            "mindkit: warning: --save {}: removed what an interrupted run left: {}",
            save.display(),
            names.join(", ")
        );
    }
    if is_tekken_file(tokenizer) {
        // named as a Magistral checkpoint names it, and as `Tokenizer::load` finds it in a
        // directory
        std::fs::copy(tokenizer, save.join(TEKKEN))
            .with_context(|| format!("copying {} into --save", tokenizer.display()))?;
    } else if !save.join("tokenizer.json").is_file() && !save.join("vocab.json").is_file() {
        crate::ckpt::hf::copy_side_files(&tokenizer_dir(tokenizer), save)?;
    }
    Ok(())
}

/// The name of a tekken tokenizer's file beside the checkpoints.
const TEKKEN: &str = "tekken.json";

/// Whether the run's tokenizer is a tekken file (`--tokenizer-type MagistralTokenizer`).
fn is_tekken_file(tokenizer: &Path) -> bool {
    tokenizer.is_file() && is_tekken_path(tokenizer)
}

/// The directory a tokenizer's files are in (`tokenizer` names it, or one of its files).
fn tokenizer_dir(tokenizer: &Path) -> PathBuf {
    if tokenizer.is_dir() {
        tokenizer.to_path_buf()
    } else {
        tokenizer
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default()
    }
}

/// The files that define a tokenizer's vocabulary: one of them in `--save` that the run's
/// tokenizer lacks or holds otherwise would be kept beside checkpoints it does not fit.
const TOKENIZER_FILES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    TEKKEN,
];

/// Refuse a `--save` that already holds another tokenizer than the run's (`tokenizer`).
pub fn check_tokenizer_files(save: &Path, tokenizer: &Path) -> Result<()> {
    let from = tokenizer_dir(tokenizer);
    for name in TOKENIZER_FILES {
        let Ok(there) = std::fs::read(save.join(name)) else {
            continue;
        };
        let ours = match name == TEKKEN && is_tekken_file(tokenizer) {
            true => tokenizer.to_path_buf(),
            false => from.join(name),
        };
        if std::fs::read(ours).ok().as_ref() != Some(&there) {
            anyhow::bail!(
                "--save {}: its {name} is not the tokenizer this run trains with ({}); move it \
                 away or --save elsewhere",
                save.display(),
                tokenizer.display()
            );
        }
    }
    Ok(())
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
        .join(rank_dir_of(0, snap.stage, (0, snap.file_ep().1)))
        .join(RANK_FILE))
}

/// The parallel layout a rank's `snap` is saved with, and the `args` recording it (with the
/// run's own).
pub fn layout_args(snap: &Snapshot) -> (Parallel, Vec<(String, Value)>) {
    let stage = snap.stage;
    let vpp = stage.chunks.len();
    let parallel = Parallel {
        tp: snap.tp.1,
        pp: stage.count,
        vpp,
        stage_layers: snap.stages.to_vec(),
        ep: snap.file_ep().1,
        etp: snap.etp,
        tp_extend: snap.tp_extend,
        dualpipev: stage.dualpipev,
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
            ep: snap.file_ep().1,
            etp: snap.etp,
            tp_extend: snap.tp_extend,
            grouped: snap.grouped || snap.te_grouped,
            dualpipev: parallel.dualpipev,
        },
        &snap.args,
    );
    for (k, v) in &snap.args {
        set_arg(&mut args, k, v.clone());
    }
    (parallel, args)
}

/// Write this rank's `mp_rank_TT[_PPP]/model_optim_rng.pt` of `snap` into the iteration
/// directory `dir`.
pub fn write_rank(dir: &Path, snap: &Snapshot) -> Result<()> {
    let stage = snap.stage;
    let vpp = stage.chunks.len();
    let (parallel, args) = layout_args(snap);
    let mut st = Storages::default();
    // A LoRA-only checkpoint (--lora-ckpt-filter) keeps only adapter keys, as MindSpeed-LLM's
    // filter does: not even the Transformer Engine layout's `_extra_state` placeholders.
    let base_saved = snap.saved.iter().any(|&s| s);
    let mut models = Vec::with_capacity(vpp);
    for (v, layers) in stage.chunks.iter().enumerate() {
        let mut entries = chunk_entries(
            snap.layout,
            snap.cfg,
            &layers.clone().collect::<Vec<_>>(),
            parallel.chunk_ends(stage.index, v),
            stage.count,
            snap.ep,
        );
        if snap.te_grouped {
            entries = te_grouped_entries(entries);
        }
        let mut model = Vec::new();
        // With grouped experts, each layer's local experts' fc1 (fc2) weights go into one
        // tensor under the grouped key, in expert order.
        let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
        for (path, canon) in &entries {
            let key = path.join(".");
            let group = (snap.grouped).then(|| grouped_key(&key)).flatten();
            let value = match canon {
                None if !base_saved => continue,
                None => Value::None,
                Some(c) => match (snap.table.index(*c).filter(|&i| snap.saved[i]), group) {
                    (Some(i), Some((g, _))) => {
                        match groups.iter_mut().find(|(k, _)| *k == g) {
                            Some((_, members)) => members.push(i),
                            None => {
                                model.push((s(&g), Value::None));
                                groups.push((g, vec![i]));
                            }
                        }
                        continue;
                    }
                    (Some(i), None) => st.tensor(&snap.params[i]),
                    (None, _) => continue,
                },
            };
            model.push((s(&key), value));
        }
        for (g, members) in groups {
            let tensors: Vec<&Tensor> = members.iter().map(|&i| &snap.params[i]).collect();
            let packed = pack_unit(snap.table, &members, &tensors, true);
            if let Some(slot) = model.iter_mut().find(|(k, _)| *k == s(&g)) {
                slot.1 = st.tensor(&packed);
            }
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
        root.push((
            s("optimizer"),
            optimizers_value(snap.table, opt, &mut st, (snap.grouped, snap.ep.1)),
        ));
    }
    if !snap.distributed.is_empty() {
        root.push((
            s("optimizer"),
            distributed_groups(snap.table, &snap.distributed),
        ));
    }
    if let Some(sched) = &snap.scheduler {
        root.push((s("opt_param_scheduler"), json_value(sched)));
    }
    root.push((
        s("num_floating_point_operations_so_far"),
        Value::Float(snap.flops),
    ));
    let rank = dir.join(rank_dir_of(snap.tp.0, stage, snap.file_ep()));
    std::fs::create_dir_all(&rank).with_context(|| format!("creating {}", rank.display()))?;
    let mut w = PtWriter::create(&rank.join(RANK_FILE), &Value::Dict(root), false)?;
    for (key, bytes) in st.data.iter().enumerate() {
        w.write_storage(&key.to_string(), bytes)?;
    }
    w.finish()?;
    if !snap.distributed.is_empty() {
        write_distributed_parts(&rank.join(DISTRIBUTED_FILE), &snap.distributed)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tekken_tokenizer_is_kept_beside_the_checkpoints_and_another_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (save, other) = (dir.path().join("save"), dir.path().join("other"));
        std::fs::create_dir_all(&other).unwrap();
        let tekken = dir.path().join("tekken_240911.json");
        std::fs::write(&tekken, b"{\"vocab\": []}").unwrap();
        prepare(&save, &tekken).unwrap();
        assert_eq!(
            std::fs::read(save.join(TEKKEN)).unwrap(),
            b"{\"vocab\": []}"
        );
        prepare(&save, &tekken).unwrap();
        let another = other.join("tekken.json");
        std::fs::write(&another, b"{\"vocab\": [1]}").unwrap();
        let err = prepare(&save, &another).unwrap_err().to_string();
        assert!(err.contains("tekken.json is not the tokenizer"), "{err}");
        assert_eq!(
            std::fs::read(save.join(TEKKEN)).unwrap(),
            b"{\"vocab\": []}"
        );
    }
}
