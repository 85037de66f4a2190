//! Reading a checkpoint back: the LoRA adapters of `--lora-load`, and the training state a
//! resumed run restores (progress, scheduler, optimizer, the distributed optimizer's buffers).

use super::{expert_mask, is_grouped_unit, iteration_dir, param_groups, stored_units};
use super::{unit_key, unpack_unit};
use super::{GroupHyper, OptimizerState, RankAt, DISTRIBUTED_FILE};
use crate::ckpt::megatron::{expert_rank_dir, RANK_FILE, TRACKER};
use crate::ckpt::torch::pickle::Value;
use crate::ckpt::torch::TorchFile;
use crate::model::params::ParamTable;
use crate::tensor::host::Tensor;
use crate::tensor::DType;
use anyhow::{anyhow, bail, Result};
use serde_json::Value as Json;
use std::path::{Path, PathBuf};

/// Replace `host[i]` by the tensor named `table.params[i].name` in this rank's file of the
/// checkpoint `dir` (`at`: its tensor-parallel and pipeline rank and their sizes), for every
/// parameter `pick` selects (the LoRA adapters of `--lora-load`; with `grouped` experts their
/// factors unpacked from MindSpeed-LLM's grouped tensors): shapes checked, cast to the
/// parameter's dtype.
pub fn load_named(
    dir: &Path,
    (table, at, grouped): (&ParamTable, RankAt, bool),
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
    let picked: Vec<usize> = (0..table.params.len())
        .filter(|&i| pick(&table.params[i]))
        .collect();
    for unit in stored_units(table, &picked, grouped) {
        let (p, key) = (&table.params[unit[0]], unit_key(table, &unit, grouped));
        let Some(Value::Tensor(t)) = chunks.get(p.chunk).and_then(|k| k.get(&key)) else {
            bail!(
                "{}: no {key} (the adapter does not match --lora-r / --lora-target-modules / \
                 --moe-grouped-gemm)",
                path.display()
            );
        };
        let t = f.read_tensor(&key, t)?;
        let want = match is_grouped_unit(table, &unit, grouped) {
            true => (crate::ckpt::grouped::grouped_shape(&key, &p.shape, unit.len()).iter())
                .map(|&n| n as usize)
                .collect(),
            false => p.shape.clone(),
        };
        if t.shape != want {
            bail!(
                "{}: {key} has shape {:?}, this run's adapter {want:?}",
                path.display(),
                t.shape
            );
        }
        for (&i, part) in unit.iter().zip(unpack_unit(table, &unit, t, grouped)) {
            host[i] = part.cast(host[i].dtype).map_err(|e| anyhow!(e))?;
        }
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

pub(super) fn int_of(v: Option<&Value>) -> Option<u64> {
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

/// Whether the tracker of checkpoint directory `dir` says `release` (a converted model, not a
/// point of a run).
pub fn is_release(dir: &Path) -> Result<bool> {
    let tracker = dir.join(TRACKER);
    Ok(tracker.is_file() && std::fs::read_to_string(&tracker)?.trim() == "release")
}

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
pub fn rank_file(dir: &Path, (tp, pp, ep): RankAt) -> Result<PathBuf> {
    let iter_dir = checkpoint_iteration_dir(dir)?;
    let name = expert_rank_dir(tp.0, pp, ep);
    let file = iter_dir.join(&name).join(RANK_FILE);
    // a rank beyond this layout's, or a stage of another pipeline, is another layout's
    let exists = |tp, pp, ep| iter_dir.join(expert_rank_dir(tp, pp, ep)).exists();
    let other_layout = exists(tp.1, pp, ep)
        || exists(tp.0, (pp.1, pp.1 + 1), ep)
        || (pp.1 == 1 && exists(0, (0, 2), ep))
        || (ep.1 > 1 && exists(tp.0, pp, (ep.1, ep.1)));
    if !file.is_file() || other_layout {
        let experts = match ep.1 {
            1 => String::new(),
            n => format!(", expert-parallel rank {} of {n}", ep.0),
        };
        bail!(
            "{}: resuming training state on tensor-parallel rank {} of {}, pipeline stage {} of \
             {}{experts} needs a checkpoint of the same layout ({name}/{RANK_FILE}); load the \
             weights of other layouts with --finetune or --no-load-optim",
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
/// taken (the parameter groups' `step` in `model_optim_rng.pt`). `part`: under expert
/// parallelism, which of the `ChainedOptimizer`'s two lists' entries (0 the dense
/// parameters', 1 the routed experts').
///
/// [`DistributedState::world`]: super::DistributedState::world
pub fn load_distributed(
    dir: &Path,
    at: RankAt,
    buffers: &[usize],
    part: Option<usize>,
) -> Result<([Vec<f32>; 3], u64)> {
    let model = rank_file(dir, at)?;
    let pick = |v: Option<&Value>| -> Option<Value> {
        match (part, v?) {
            (None, v) => Some(v.clone()),
            (Some(k), Value::List(parts)) => parts.get(k).cloned(),
            (Some(_), _) => None,
        }
    };
    let path = model.with_file_name(DISTRIBUTED_FILE);
    if !path.is_file() {
        bail!(
            "{}: no {DISTRIBUTED_FILE}: the checkpoint was saved without --use-distributed-optimizer; \
             resume without it, or pass --no-load-optim",
            model.display()
        );
    }
    let groups = TorchFile::open(&model)?;
    let step = pick(groups.root().get("optimizer"))
        .as_ref()
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
    let Some(Value::Dict(items)) = pick(Some(f.root())) else {
        bail!(
            "{}: not the state of {}",
            path.display(),
            match part {
                None => "one distributed optimizer (a dict)".into(),
                Some(k) => format!("expert-parallel training (a list whose entry {k} is a dict)"),
            }
        );
    };
    let saved = items
        .iter()
        .filter(|(k, _)| matches!(k, Value::Int(_)))
        .count();
    if saved != buffers.len() {
        bail!(
            "{}: {saved} buffer(s), this run has {} (one per model chunk and parameter dtype): \
             another layout, or --init-norm-weight-in-fp32 otherwise",
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

/// The progress a rank file (or a `torch_dist` checkpoint's `common.pt`) records: iteration, consumed samples, FLOPs and the scheduler.
pub fn progress(path: &Path, root: &Value) -> Result<Resumed> {
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
///
/// [`save`]: super::save
pub fn load_state(
    dir: &Path,
    (table, at): (&ParamTable, RankAt),
    trained: &[bool],
    (weights_only, grouped, dualpipev): (bool, bool, bool),
) -> Result<Resumed> {
    let path = rank_file(dir, at)?;
    let (tp, pp, ep) = at;
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
    let saved_ep = int_of(arg("expert_model_parallel_size")).unwrap_or(1);
    if saved_ep != ep.1 as u64 {
        bail!(
            "{}: saved by {saved_ep} expert-parallel ranks, this run has {}: resuming its \
             training state needs the same layout; load its weights with --finetune or \
             --no-load-optim",
            path.display(),
            ep.1
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
    let saved_v = matches!(arg("schedules_method"), Some(Value::Str(s)) if s == "dualpipev");
    let saved = match saved_v {
        true => 2,
        false => int_of(arg("virtual_pipeline_model_parallel_size")).unwrap_or(1),
    };
    if (saved, saved_v) != (chunks, dualpipev) {
        let placed = |n: u64, v: bool| match v {
            true => format!("{n} model chunks per pipeline stage in DualPipeV's V"),
            false => format!("{n} model chunk(s) per pipeline stage"),
        };
        bail!(
            "{}: saved with {}, this run has {}: resuming its training state needs the same \
             layout; load its weights with --finetune or --no-load-optim",
            path.display(),
            placed(saved, saved_v),
            placed(chunks, dualpipev)
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
    let n = table.params.len();
    let mut state = OptimizerState {
        steps: 0,
        exp_avg: vec![None; n],
        exp_avg_sq: vec![None; n],
        main: None,
        hyper: GroupHyper {
            lr: 0.0,
            max_lr: 0.0,
            min_lr: 0.0,
            weight_decay: 0.0,
            betas: (0.9, 0.999),
            eps: 1e-8,
        },
    };
    let parts: Vec<(&Value, Vec<bool>)> = match (ep.1 > 1, opt) {
        (false, _) => vec![(opt, trained.to_vec())],
        // megatron-core's ChainedOptimizer of the dense and the expert-parallel parameters'
        // optimizers saves a list of their state dicts.
        (true, Value::List(optimizers)) if optimizers.len() == 2 => (optimizers.iter())
            .zip([false, true])
            .map(|(o, experts)| (o, expert_mask(table, trained, experts)))
            .collect(),
        (true, _) => bail!(
            "{}: saved with expert parallelism, but its optimizer is not megatron-core's list of \
             two state dicts (dense and expert parameters)",
            path.display()
        ),
    };
    for (opt, trained) in parts {
        read_optimizer(&f, &path, opt, (table, &trained, grouped), &mut state)?;
    }
    resumed.optimizer = Some(state);
    Ok(resumed)
}

/// The moments, steps and f32 main parameters of the `trained` parameters from one optimizer's
/// state dict `opt` (torch's, or wrapped with `fp32_from_fp16_params`) of the file `f` at
/// `path`, into `state`.
fn read_optimizer(
    f: &TorchFile,
    path: &Path,
    opt: &Value,
    (table, trained, grouped): (&ParamTable, &[bool], bool),
    state: &mut OptimizerState,
) -> Result<()> {
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
    if let (Some(_), None) = (main_lists, &state.main) {
        state.main = Some(vec![None; table.params.len()]);
    }
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
        let units = stored_units(table, members, grouped);
        if ids.len() != units.len() {
            bail!(
                "{}: optimizer group {saved_index} holds {} parameters, this model's has {}: the \
                 checkpoint is of another model, LoRA setting or --moe-grouped-gemm (use \
                 --no-load-optim)",
                path.display(),
                ids.len(),
                units.len()
            );
        }
        if *decay {
            state.hyper.lr = float_of(saved.get("lr")).unwrap_or(0.0);
            state.hyper.weight_decay = float_of(saved.get("weight_decay")).unwrap_or(0.0);
        }
        // the f32 main copies listed are the group's parameters that are not f32 already
        let mut widened = 0;
        for (id, unit) in ids.iter().zip(&units) {
            let name = &table.params[unit[0]].name;
            let entry = match (states, id) {
                (Some(Value::Dict(items)), Value::Int(i)) => items
                    .iter()
                    .find(|(k, _)| *k == Value::Int(*i))
                    .map(|(_, v)| v),
                _ => None,
            };
            // A stored tensor checked against its unit's parameters and split among them.
            let split = |t: Tensor, what: &str| -> Result<Vec<Tensor>> {
                let parts = unpack_unit(table, unit, t, grouped);
                for (part, &p) in parts.iter().zip(unit) {
                    if part.shape != table.params[p].shape {
                        bail!(
                            "{}: {what} of {name} is {:?}, the parameter {:?}",
                            path.display(),
                            part.shape,
                            table.params[p].shape
                        );
                    }
                }
                Ok(parts)
            };
            if let Some(entry) = entry {
                let read = |k: &str| -> Result<Vec<Tensor>> {
                    match entry.get(k) {
                        Some(Value::Tensor(t)) => split(f.read_tensor(name, t)?, "optimizer state"),
                        _ => bail!("{}: optimizer state of {name} lacks {k}", path.display()),
                    }
                };
                for (&p, (m, v)) in unit
                    .iter()
                    .zip(read("exp_avg")?.into_iter().zip(read("exp_avg_sq")?))
                {
                    state.exp_avg[p] = Some(m);
                    state.exp_avg_sq[p] = Some(v);
                }
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
            let has_main = table.params[unit[0]].dtype != DType::F32;
            if let (Some(main), Some(lists), true) = (state.main.as_mut(), main_lists, has_main) {
                widened += 1;
                match lists.get(saved_index).and_then(|l| match l {
                    Value::List(v) => v.get(widened - 1),
                    _ => None,
                }) {
                    Some(Value::Tensor(t)) => {
                        let parts = split(f.read_tensor(name, t)?, "the f32 main parameter")?;
                        for (&p, t) in unit.iter().zip(parts) {
                            main[p] = Some(t);
                        }
                    }
                    _ => bail!("{}: no f32 main parameter for {name}", path.display()),
                }
            }
        }
    }
    Ok(())
}
