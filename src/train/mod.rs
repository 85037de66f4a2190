//! `mindkit train`: Megatron-LM core 0.15 pretraining on one rank of this engine — the same
//! samples in the same order ([`crate::data::gpt_dataset`]), the same loss averaging, AdamW,
//! learning-rate schedule and clipping, Megatron's log lines and torch-format checkpoints.
//!
//! The loop (megatron/training/training.py `train` / `train_step`): per iteration, K
//! micro-batches forward and backward (gradients accumulated in f32), the global gradient norm
//! and clip, one AdamW step at `lr((i − 1)·G)`, then logging, validation, saving and the exit
//! conditions. Flags: [`args`]; their resolution: [`config`].
//!
//! Across ranks ([`parallel`]): each rank holds its tensor-parallel shard of its pipeline
//! stage's parameters (one model chunk, or several with a virtual pipeline) and trains its
//! data-parallel slice of the batch; the stages run the micro-batches in Megatron's 1F1B or
//! interleaved order ([`pipeline`]), and the gradients are summed over the data-parallel
//! group (and the tied embedding's over the first and last stage) before one AdamW step.

pub mod args;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod distrib;
pub mod log;
pub mod optim;
pub mod parallel;
pub mod pipeline;
pub mod schedule;
pub mod store;
pub mod tensorboard;

use crate::arch::roles::{Canon, Role};
use crate::ckpt::torch::pickle::Value;
use crate::ckpt::transform::tp_shard;
use crate::data::gpt_dataset::{build_splits, SampleConfig};
use crate::data::sft_dataset::{index as sft_index, legacy_split, SftDataset};
use crate::engine::comm::{Communicator, Counted, ReduceOp};
use crate::engine::cpu::Cpu;
use crate::engine::{Backend, DeviceKind, EngineError};
use crate::model::decoder::{backward, forward, Ids, MicroBatch, Saved};
use crate::model::parallel::TensorParallel;
use crate::model::params::{LoraPart, LoraSpec, ParamInfo, ParamTable};
use crate::model::ModelSpec;
use crate::npu::comm::Hccl;
use crate::npu::Npu;
use crate::tensor::host::Tensor as HostTensor;
use crate::tensor::DType;
use crate::util::{progress_bar, ProgressUnit};
use anyhow::{anyhow, bail, Context, Result};
use config::{ScheduleSource, Start, TrainConfig};
use optim::Optimizer;
use parallel::{Axis, Layout, Stage};
use rand::SeedableRng;
use rand_distr::Distribution;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// How a run ended.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    /// The last completed iteration.
    pub iteration: u64,
    /// Samples consumed.
    pub consumed_samples: u64,
    /// The last logged lm loss.
    pub last_loss: Option<f64>,
    /// Wall time of the loop.
    pub seconds: f64,
    /// Tokens trained on per second.
    pub tokens_per_second: f64,
    /// Why it stopped early, if it did.
    pub stopped: Option<String>,
    /// The last checkpoint written.
    pub saved: Option<std::path::PathBuf>,
}

impl std::fmt::Display for TrainSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "trained to iteration {} ({} samples) in {:.1} s, {:.0} tokens/s",
            self.iteration, self.consumed_samples, self.seconds, self.tokens_per_second
        )?;
        if let Some(l) = self.last_loss {
            write!(f, ", lm loss {l:.4}")?;
        }
        if let Some(p) = &self.saved {
            write!(f, "; checkpoint {}", p.display())?;
        }
        if let Some(why) = &self.stopped {
            write!(f, " (stopped: {why})")?;
        }
        Ok(())
    }
}

/// Run `mindkit train` with Megatron / MindSpeed-LLM flags (program and subcommand removed).
pub fn run(argv: &[String]) -> Result<TrainSummary> {
    let parsed = args::Args::parse(argv)?;
    let quiet = parsed.has("quiet");
    let device = parsed
        .get("device")
        .unwrap_or("cpu")
        .parse::<crate::engine::DeviceKind>()
        .map_err(|e| anyhow!("--device: {e}"))?;
    let npu_id = parsed
        .get("npu-id")
        .map(|id| id.parse::<i32>().map_err(|e| anyhow!("--npu-id {id}: {e}")))
        .transpose()?;
    let device = device.with_npu_id(npu_id).map_err(anyhow::Error::msg)?;
    let rank_table = parsed.get("rank-table-file").map(PathBuf::from);
    if let Some(launch) = store::from_launcher()? {
        // torch_npu reads RANK_TABLE_FILE for its NPU ranks; MindSpeed-LLM scripts export it.
        let from_env = || std::env::var_os("RANK_TABLE_FILE").map(PathBuf::from);
        let rank_table = match device {
            DeviceKind::Npu(_) => rank_table.or_else(from_env),
            DeviceKind::Cpu => rank_table,
        };
        let cfg = config::resolve(&parsed)?;
        return as_process(&launch, cfg, (quiet, rank_table), device);
    }
    if let Some(table) = rank_table {
        bail!(
            "--rank-table-file {}: a rank table joins ranks started by a launcher (torchrun, Slurm), one process each",
            table.display()
        );
    }
    if config::world_size(&parsed)? > 1 {
        return on_threads(config::resolve(&parsed)?, quiet, device);
    }
    // The device first: without CANN, `--device npu` says so before the flags are read.
    crate::npu::with_backend!(device, |backend| {
        let cfg = config::resolve(&parsed)?;
        Trainer::new(backend, cfg, quiet, Groups::alone())?.train()
    })
}

/// A group's collectives on a backend's tensors.
type Comm<T> = Box<dyn Communicator<Tensor = T>>;

/// One rank's place among the ranks: its global rank and the tensor-, data- and
/// pipeline-parallel groups it belongs to (`None` where it is alone along that axis).
pub struct Groups<T> {
    rank: usize,
    tp: Option<Comm<T>>,
    dp: Option<Comm<T>>,
    pp: Option<Comm<T>>,
}

/// The axes a rank has a group along, in the order every rank joins them.
const GROUP_AXES: [Axis; 3] = [Axis::Tp, Axis::Dp, Axis::Pp];

impl<T> Groups<T> {
    /// A single rank.
    fn alone() -> Self {
        Groups {
            rank: 0,
            tp: None,
            dp: None,
            pp: None,
        }
    }

    /// Rank `rank`'s groups of `layout`: `join(axis)` makes its communicator along each axis
    /// where the layout has more than one rank, in [`GROUP_AXES`] order (every rank joins in
    /// this order).
    fn of_layout(
        rank: usize,
        layout: &Layout,
        mut join: impl FnMut(Axis) -> Result<Comm<T>>,
    ) -> Result<Self> {
        let mut groups = Groups {
            rank,
            ..Groups::alone()
        };
        for axis in GROUP_AXES {
            if layout.size(axis) > 1 {
                *groups.slot(axis) = Some(join(axis)?);
            }
        }
        Ok(groups)
    }

    /// The group along `axis`.
    fn slot(&mut self, axis: Axis) -> &mut Option<Comm<T>> {
        match axis {
            Axis::Tp => &mut self.tp,
            Axis::Pp => &mut self.pp,
            _ => &mut self.dp,
        }
    }

    /// Rank `rank` of a data-parallel run (one group of every rank).
    fn data_parallel(rank: usize, dp: Comm<T>) -> Self {
        Groups {
            rank,
            dp: Some(dp),
            ..Groups::alone()
        }
    }
}

/// A rank's backend and its groups.
type RankSetup<B> = (B, Groups<<B as crate::engine::Device>::Tensor>);

/// Every rank's thread communicators of `layout` along [`GROUP_AXES`] (`None` where it is
/// alone along that axis), by global rank.
type ThreadComms = Vec<Option<crate::engine::cpu::comm::ThreadComm>>;

fn thread_groups(layout: &Layout, timeout: std::time::Duration) -> Vec<ThreadComms> {
    let mut comms: Vec<ThreadComms> = (0..layout.world())
        .map(|_| GROUP_AXES.iter().map(|_| None).collect())
        .collect();
    for (a, &axis) in GROUP_AXES.iter().enumerate() {
        if layout.size(axis) == 1 {
            continue;
        }
        for members in layout.groups(&[axis]) {
            let group = crate::engine::cpu::comm::thread_group(members.len(), timeout);
            for (comm, &r) in group.into_iter().zip(&members) {
                comms[r][a] = Some(comm);
            }
        }
    }
    comms
}

/// This process's groups of `layout` over its socket connections to every rank: its
/// tensor-, data- and pipeline-parallel groups as subgroups 1, 2 and 3.
fn socket_groups(
    world: crate::engine::cpu::comm::SocketComm,
    layout: &Layout,
    rank: usize,
) -> Result<Groups<crate::engine::cpu::CpuTensor>> {
    Groups::of_layout(rank, layout, |axis| {
        let id = 1 + GROUP_AXES.iter().position(|&a| a == axis).unwrap_or(0) as u32;
        Ok(Box::new(
            world.subgroup(id, layout.group_of(rank, &[axis]))?,
        ))
    })
}

/// Train with the layout's ranks as threads of this process: on the CPU backend through
/// thread groups, or (data parallelism) one NPU each from `--npu-id` on through HCCL.
fn on_threads(cfg: TrainConfig, quiet: bool, device: DeviceKind) -> Result<TrainSummary> {
    match device {
        DeviceKind::Cpu => {
            let comms: Vec<_> = thread_groups(&cfg.layout, cfg.rank_timeout)
                .into_iter()
                .map(|g| Mutex::new(Some(g)))
                .collect();
            run_ranks(&cfg, quiet, |rank| {
                let mine = comms[rank].lock().ok().and_then(|mut g| g.take());
                let mine = mine.ok_or_else(|| anyhow!("internal: rank {rank} set up twice"))?;
                let mut groups = Groups {
                    rank,
                    ..Groups::alone()
                };
                for (axis, comm) in GROUP_AXES.into_iter().zip(mine) {
                    *groups.slot(axis) = comm.map(|c| Box::new(c) as Comm<_>);
                }
                Ok::<RankSetup<Cpu>, anyhow::Error>((Cpu, groups))
            })
        }
        DeviceKind::Npu(first) => {
            // One HCCL root info per group, made before the ranks start.
            let roots = |axis| -> Result<Vec<crate::npu::comm::HcclRootInfo>> {
                let n = cfg.layout.world() / cfg.layout.size(axis);
                let many = cfg.layout.size(axis) > 1;
                (0..if many { n } else { 0 })
                    .map(|_| Ok(crate::npu::comm::root_info()?))
                    .collect()
            };
            let roots = GROUP_AXES
                .iter()
                .map(|&axis| roots(axis))
                .collect::<Result<Vec<_>>>()?;
            run_ranks(&cfg, quiet, |rank| {
                let npu = Npu::open(first + rank as i32)?;
                let groups = hccl_groups(&npu, &cfg.layout, rank, |axis, g, _| {
                    let a = GROUP_AXES.iter().position(|&x| x == axis).unwrap_or(0);
                    Ok(roots[a][g])
                })?;
                Ok::<RankSetup<Npu>, anyhow::Error>((npu, groups))
            })
        }
    }
}

/// Rank `rank`'s HCCL communicators of `layout` on `npu`, each from the root info
/// `root(axis, group index, whether this rank is the group's first)` gives.
fn hccl_groups(
    npu: &Npu,
    layout: &Layout,
    rank: usize,
    mut root: impl FnMut(Axis, usize, bool) -> Result<crate::npu::comm::HcclRootInfo>,
) -> Result<Groups<crate::npu::NpuTensor>> {
    Groups::of_layout(rank, layout, |axis| {
        let all = layout.groups(&[axis]);
        let g = all.iter().position(|m| m.contains(&rank)).unwrap_or(0);
        let at = all[g].iter().position(|&r| r == rank).unwrap_or(0);
        let info = root(axis, g, at == 0)?;
        Ok(Box::new(Hccl::join(npu, all[g].len(), at, &info)?))
    })
}

/// Train as one rank of a launcher's processes (torchrun, Slurm), each on NPU `--npu-id` +
/// LOCAL_RANK with `--device npu` (Megatron takes `LOCAL_RANK`'s device). The ranks meet
/// through the launcher's store — every rank's socket address on the CPU backend, rank 0's
/// HCCL root info on NPUs — or, on NPUs given a rank table file, through HCCL's own rendezvous.
fn as_process(
    launch: &store::Launch,
    cfg: TrainConfig,
    (quiet, rank_table): (bool, Option<PathBuf>),
    device: DeviceKind,
) -> Result<TrainSummary> {
    let (rank, ranks) = (launch.rank, launch.world_size);
    let quiet = quiet || rank > 0;
    let context = || format!("rank {rank} of {ranks}");
    let timeout = cfg.rank_timeout;
    match (device, rank_table) {
        (DeviceKind::Cpu, Some(_)) => {
            bail!("--rank-table-file (RANK_TABLE_FILE) joins NPUs over HCCL: it needs --device npu")
        }
        (DeviceKind::Cpu, None) => {
            // Rank 0 may host the store: it stays up until this rank is done.
            let (_server, mut store) = launch.connect(timeout)?;
            let comm = socket_group_through(&mut store, launch, timeout)?;
            let groups = socket_groups(comm, &cfg.layout, rank)?;
            Trainer::new(Cpu, cfg, quiet, groups)
                .and_then(Trainer::train)
                .with_context(context)
        }
        (DeviceKind::Npu(first), table) => {
            let npu = Npu::open(first + launch.local_rank as i32)?;
            let groups = match table {
                Some(table) => {
                    let world = Hccl::join_table(&npu, &table, ranks, rank).with_context(|| {
                        format!("joining by the rank table {}", table.display())
                    })?;
                    table_groups(&npu, world, &cfg.layout, rank)?
                }
                None => {
                    let (_server, mut store) = launch.connect(timeout)?;
                    hccl_groups(&npu, &cfg.layout, rank, |axis, g, first| {
                        let key = format!("hccl_root_info/{}/{g}", axis.token());
                        root_info_through(&mut store, launch, &key, first)
                    })?
                }
            };
            Trainer::new(npu, cfg, quiet, groups)
                .and_then(Trainer::train)
                .with_context(context)
        }
    }
}

/// Rank `rank`'s groups of `layout` from the communicator of every rank a rank table made:
/// that communicator itself when every rank is data-parallel, else a sub-communicator per
/// axis (HCCL's `HcclCreateSubCommConfig`, as torch_npu makes its process groups), each named
/// by its axis and first rank.
fn table_groups(
    npu: &Npu,
    world: Hccl,
    layout: &Layout,
    rank: usize,
) -> Result<Groups<crate::npu::NpuTensor>> {
    if layout.world() == layout.size(Axis::Dp) {
        return Ok(Groups::data_parallel(rank, Box::new(world)));
    }
    let world = std::rc::Rc::new(world);
    Groups::of_layout(rank, layout, |axis| {
        let members = layout.group_of(rank, &[axis]);
        let a = GROUP_AXES.iter().position(|&x| x == axis).unwrap_or(0) as u64;
        let id = (a + 1) << 32 | members[0] as u64;
        let comm = Hccl::sub(&world, npu, &members, id)
            .with_context(|| format!("joining the {} group {members:?}", axis.token()))?;
        Ok(Box::new(comm))
    })
}

/// The CPU ranks' socket group: each rank listens on its interface that reaches the store,
/// sets that address in the store and reads every other rank's.
fn socket_group_through(
    store: &mut store::TcpStore,
    launch: &store::Launch,
    timeout: std::time::Duration,
) -> Result<crate::engine::cpu::comm::SocketComm> {
    let listener = std::net::TcpListener::bind((store.local_ip()?, 0))
        .context("listening for the other ranks")?;
    let key = |r: usize| launch.key(&format!("cpu_group/{r}"));
    store.set(
        &key(launch.rank),
        listener.local_addr()?.to_string().as_bytes(),
    )?;
    let peers = (0..launch.world_size)
        .map(|r| {
            let addr = String::from_utf8(store.get(&key(r))?)?;
            addr.parse()
                .with_context(|| format!("rank {r}'s address {addr:?} in the store"))
        })
        .collect::<Result<Vec<std::net::SocketAddr>>>()?;
    // Unique to this launch attempt: a rank of another job or attempt is refused.
    let token = u64::from(launch.master_port) << 32 | u64::from(launch.restart_count);
    let comm =
        crate::engine::cpu::comm::socket_group(launch.rank, listener, &peers, token, timeout)?;
    Ok(comm)
}

/// A group's HCCL root info under `name` in the store: made here on its `first` rank and set
/// in the store, read from it on the others.
fn root_info_through(
    store: &mut store::TcpStore,
    launch: &store::Launch,
    name: &str,
    first: bool,
) -> Result<crate::npu::comm::HcclRootInfo> {
    let key = launch.key(name);
    if first {
        let root = crate::npu::comm::root_info()?;
        store.set(&key, &root.to_bytes())?;
        return Ok(root);
    }
    let bytes = store.get(&key)?;
    crate::npu::comm::HcclRootInfo::from_bytes(&bytes).ok_or_else(|| {
        anyhow!(
            "the store's {key} holds {} bytes, not an HCCL root info",
            bytes.len()
        )
    })
}

/// Run every rank of the layout in its own thread on what `setup` gives it; rank 0
/// logs and saves. The summary is rank 0's; when ranks fail, the first failure that is not a
/// collective failing because of another rank (the root cause) is returned.
fn run_ranks<B: Backend>(
    cfg: &TrainConfig,
    quiet: bool,
    setup: impl Fn(usize) -> Result<RankSetup<B>> + Sync,
) -> Result<TrainSummary> {
    let results: Vec<Result<TrainSummary>> = std::thread::scope(|s| {
        let ranks: Vec<_> = (0..cfg.layout.world())
            .map(|rank| {
                let setup = &setup;
                s.spawn(move || {
                    let (b, groups) = setup(rank)?;
                    Trainer::new(b, cfg.clone(), quiet || rank > 0, groups)
                        .and_then(Trainer::train)
                        .with_context(|| format!("rank {rank}"))
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|r| r.join().unwrap_or_else(|_| Err(anyhow!("a rank panicked"))))
            .collect()
    });
    let mut failures: Vec<anyhow::Error> = Vec::new();
    let mut summary = None;
    for r in results {
        match r {
            Ok(s) => {
                summary.get_or_insert(s);
            }
            Err(e) => failures.push(e),
        }
    }
    let collective = |e: &anyhow::Error| {
        e.chain().any(|c| {
            matches!(
                c.downcast_ref::<EngineError>(),
                Some(EngineError::Collective { .. })
            )
        })
    };
    match failures.iter().position(|e| !collective(e)) {
        Some(i) => Err(failures.swap_remove(i)),
        None if !failures.is_empty() => Err(failures.swap_remove(0)),
        None => summary.ok_or_else(|| anyhow!("internal: no rank reported")),
    }
}

/// Megatron's `num_floating_point_operations` inputs of this model.
fn flops_model(cfg: &TrainConfig) -> log::FlopsModel {
    let m = &cfg.model;
    log::FlopsModel {
        layers: m.layers,
        hidden: m.hidden,
        heads: m.heads,
        groups: m.groups,
        head_dim: m.head_dim,
        ffn: m.ffn,
        vocab_padded: cfg.vocab_padded,
        seq_length: cfg.seq_length,
    }
}

/// The starting weights of this rank's parameters `mine` (a tensor-parallel shard of a
/// pipeline stage of the model `whole`): base weights from `--load` (padded to the run's
/// vocabulary, cast to its dtype) or initialised as megatron-core does — normal(0, σ) for
/// matrices (σ/√(2L) for linear_proj and linear_fc2; the embedding's own σ if given), ones for
/// norms, zeros for biases —, and LoRA factors as peft initialises them: A uniform in ±1/√in
/// (kaiming uniform with a = √5), B zeros. Seeded by `--seed`; no generator can reproduce
/// torch's draws, so the statistics match, not the values. Every tensor of the model is drawn
/// in turn, as one rank would (a stage reads only its own), and cut to tensor-parallel rank
/// `tp.0`'s shard of `tp.1`.
fn initial_params(
    cfg: &TrainConfig,
    (whole, mine): (&ParamTable, &ParamTable),
    tp: (usize, usize),
) -> Result<Vec<HostTensor>> {
    let (std, embedding_std) = cfg.init_std;
    let scaled = std / (2.0 * cfg.model.layers as f64).sqrt();
    let mut rng = rand::rngs::StdRng::seed_from_u64(u64::from(cfg.seed));
    let dtype = cfg.model.dtype;
    let mut draw = |p: &ParamInfo| -> Result<Vec<f32>> {
        let n = p.numel();
        Ok(match (p.lora, p.canon.role) {
            (Some(LoraPart::A), _) => {
                let bound = 1.0 / (p.shape[1] as f32).sqrt();
                let uniform = rand_distr::Uniform::new(-bound, bound)
                    .map_err(|e| anyhow!("LoRA init: {e}"))?;
                (0..n).map(|_| uniform.sample(&mut rng)).collect()
            }
            (Some(LoraPart::B), _) | (None, Role::QkvBias | Role::ProjBias) => vec![0.0; n],
            (None, Role::InputNorm | Role::PostNorm | Role::FinalNorm) => vec![1.0; n],
            (None, role) => {
                let sigma = match role {
                    Role::Embedding => embedding_std.unwrap_or(std),
                    _ if p.scaled_init => scaled,
                    _ => std,
                };
                let normal = rand_distr::Normal::new(0.0f32, sigma as f32)
                    .map_err(|e| anyhow!("--init-method-std {sigma}: {e}"))?;
                (0..n).map(|_| normal.sample(&mut rng)).collect()
            }
        })
    };
    let mut out: Vec<Option<HostTensor>> = vec![None; mine.params.len()];
    for p in &whole.params {
        let slots: Vec<usize> = (mine.params.iter().enumerate())
            .filter(|(_, q)| q.canon == p.canon && q.lora == p.lora)
            .map(|(i, _)| i)
            .collect();
        let t = match (&cfg.start, p.lora) {
            (Start::Load { .. }, None) if slots.is_empty() => continue,
            (Start::Load { input, .. }, None) => {
                let t = input
                    .read_padded(p.canon, whole.vocab_padded)
                    .with_context(|| format!("--load: {}", p.name))?;
                if t.shape != p.shape {
                    bail!(
                        "--load: {} has shape {:?}, the flags imply {:?}",
                        p.name,
                        t.shape,
                        p.shape
                    );
                }
                t.cast(dtype).map_err(|e| anyhow!(e))?
            }
            // drawn whether kept or not: every stage's generator goes through the whole model
            _ => HostTensor::from_f32(dtype, p.shape.clone(), &draw(p)?).map_err(|e| anyhow!(e))?,
        };
        let t = match tp.1 > 1 && p.tp_split {
            true => tp_shard(p.canon.role, &t, tp.0, tp.1, whole.vocab_padded),
            false => t,
        };
        for i in slots {
            out[i] = Some(t.clone());
        }
    }
    out.into_iter()
        .zip(&mine.params)
        .map(|(t, p)| t.ok_or_else(|| anyhow!("internal: no initial value for {}", p.name)))
        .collect()
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

/// What came from the previous and from the next pipeline stage.
type Neighbours<T> = (Option<T>, Option<T>);

/// One model chunk of a rank's pipeline stage: its parameters' ids, numbered within it, and
/// where its parameters sit among the rank's.
struct Chunk {
    ids: Ids,
    params: std::ops::Range<usize>,
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
}

/// The training state.
/// A micro-batch's per-token losses, still on the device (on the last pipeline stage), and
/// its loss mask.
type PendingLoss<T> = (Option<T>, Vec<f32>);

struct Trainer<B: Backend> {
    b: B,
    cfg: TrainConfig,
    spec: ModelSpec,
    table: ParamTable,
    /// The model chunks of this rank's stage (one without a virtual pipeline).
    chunks: Vec<Chunk>,
    params: Vec<B::Tensor>,
    grads: Vec<B::Tensor>,
    /// Whether `grads` hold zeros (fresh, or left so by the optimizer's step).
    grads_zeroed: bool,
    /// `--log-num-zeros-in-grad`: the step just taken's count, when it is reported.
    zeros_in_grad: Option<f64>,
    opt: Optimizer<B::Tensor>,
    iteration: u64,
    consumed_train: u64,
    consumed_valid: u64,
    /// Samples the schedule has counted (successful steps × G).
    schedule_steps: u64,
    flops: f64,
    quiet: bool,
    stop: Option<Arc<AtomicBool>>,
    tensorboard: Option<tensorboard::TensorBoard>,
    /// Elements of the whole model (every rank's shards).
    model_numel: usize,
    /// The tensor-parallel group (None: one rank), its collectives counted.
    tp: Option<Counted<B::Tensor>>,
    /// The data-parallel group (None: one rank), its collectives counted.
    dp: Option<Counted<B::Tensor>>,
    /// The pipeline-parallel group (None: one stage), its collectives counted.
    pp: Option<Counted<B::Tensor>>,
    /// The distributed optimizer's state (`--use-distributed-optimizer`; `opt` then holds
    /// none).
    sharded: Option<distrib::Sharded<B::Tensor>>,
    /// This rank's pipeline stage.
    stage: Stage,
    /// The global rank (0 alone): rank 0 logs; the ranks of data-parallel rank 0 save.
    rank: usize,
}

impl<B: Backend> Trainer<B> {
    fn new(b: B, cfg: TrainConfig, quiet: bool, groups: Groups<B::Tensor>) -> Result<Self> {
        let tp = (
            groups.tp.as_ref().map_or(0, |g| g.rank()),
            cfg.layout.size(Axis::Tp),
        );
        let spec = ModelSpec::from_config(&cfg.model)?.tensor_parallel(tp.1);
        let vpp = cfg.virtual_pipeline.map_or(1, |v| v.chunks);
        let stage = Stage::of(&cfg.stages, vpp, groups.pp.as_ref().map_or(0, |g| g.rank()));
        let rank = groups.rank;
        if let Some(save) = cfg.save.as_ref().filter(|_| rank == 0) {
            checkpoint::prepare(&save.dir, cfg.tokenizer.path())?;
        }
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
        let tables = (table.tensor_parallel(&cfg.model, tp.1))
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
            let at = (tp, stage.rank());
            checkpoint::load_named(dir, (&table, at), |p| p.lora.is_some(), &mut host)?;
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
        let sharded = match cfg.distributed_optimizer {
            Some(buckets) => {
                let dp = groups.dp.as_ref().map_or((0, 1), |g| (g.rank(), g.size()));
                // a pipeline's tied embedding (and its copy) has a bucket of its own
                let shared = cfg.model.tied && stage.count > 1;
                let own_bucket = |i: usize| shared && table.params[i].canon.role == Role::Embedding;
                let table_params = (&table, &params[..]);
                // distributed_data_parallel.py: no buckets after the first pipeline stage
                let size = buckets.size.filter(|_| stage.first());
                let size = size.map(|s| s.elements(table.numel()));
                let at = (size, buckets.pad_high, own_bucket);
                Some(distrib::Sharded::new(&b, table_params, dp, at, cfg.adam)?)
            }
            None => None,
        };
        let whole_state = match sharded {
            Some(_) => vec![false; trained.len()],
            None => trained.clone(),
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
        let mut t = Trainer {
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
            schedule_steps: 0,
            flops: 0.0,
            quiet,
            stop,
            tensorboard,
            model_numel,
            tp: groups.tp.map(Counted::new),
            dp: groups.dp.map(Counted::new),
            pp: groups.pp.map(Counted::new),
            stage,
            rank,
            cfg,
        };
        t.resume(&trained)?;
        Ok(t)
    }

    /// Restore iteration, samples, schedule and optimizer from `--load` (unless
    /// `--finetune`, an HF directory, or `--no-load-optim` for the last two).
    fn resume(&mut self, trained: &[bool]) -> Result<()> {
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
        let at = (self.tp(), self.stage.rank());
        // the distributed optimizer's state is in its own file
        let state = match no_optim {
            true => checkpoint::load_progress(&dir)?,
            false => {
                let weights_only = self.sharded.is_some();
                checkpoint::load_state(&dir, (&self.table, at), trained, weights_only)?
            }
        };
        self.iteration = state.iteration;
        self.consumed_train = state.consumed_train;
        self.consumed_valid = state.consumed_valid;
        self.flops = state.flops;
        if no_optim {
            return Ok(());
        }
        if let Some(sched) = &state.scheduler {
            self.schedule_steps = sched.get("num_steps").and_then(|v| v.as_u64()).unwrap_or(0);
            self.apply_checkpoint_schedule(sched)?;
        }
        if let Some(sharded) = self.sharded.as_mut() {
            let buffers = sharded.layout.buffer_numel_unpadded();
            let (world, steps) = checkpoint::load_distributed(&dir, at, &buffers)?;
            let [main, m, v] = &world;
            sharded.load(&self.b, [main, m, v], steps)?;
            return Ok(());
        }
        let Some(opt) = state.optimizer else {
            return Ok(());
        };
        let b = &self.b;
        for (i, (m, v)) in opt.exp_avg.into_iter().zip(opt.exp_avg_sq).enumerate() {
            if let (Some(m), Some(v)) = (m, v) {
                self.opt.exp_avg[i] = b.upload(&m)?;
                self.opt.exp_avg_sq[i] = b.upload(&v)?;
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

    /// The data of every split the run reads.
    fn datasets(&self) -> Result<[Option<data::Source>; 3]> {
        let c = &self.cfg;
        let g = c.global_batch as u64;
        let (valid, test) = match c.eval {
            Some((interval, iters)) => (
                Some((c.train_iters / interval + 1) * iters * g),
                Some(iters * g),
            ),
            None => (None, None),
        };
        if let Some(sft) = &c.sft {
            let ds = Arc::new(SftDataset::open(&sft.prefix)?);
            let ranges = legacy_split(&c.split, ds.len())?;
            let source = |range: std::ops::Range<usize>, n: u64| data::Source::Sft {
                data: ds.clone(),
                index: sft_index(range, n, sft.order),
                rows: sft.rows,
            };
            if ranges[0].is_empty() {
                bail!(
                    "{}: the train split of --split {:?} holds none of its {} samples",
                    sft.prefix.display(),
                    c.split,
                    ds.len()
                );
            }
            let train = source(ranges[0].clone(), c.train_samples);
            let valid = valid
                .map(|n| source(ranges[1].clone(), n))
                .filter(|v| !v.is_empty());
            let test = test
                .map(|n| source(ranges[2].clone(), n))
                .filter(|t| !t.is_empty());
            return Ok([Some(train), valid, test]);
        }
        let wanted = [true, c.eval.is_some(), c.eval.is_some()];
        let [train, valid, test] = build_splits(
            &c.blend,
            &c.split,
            [Some(c.train_samples), valid, test],
            wanted,
            &SampleConfig {
                seq_length: c.seq_length,
                seed: c.seed,
                surplus: c.surplus,
            },
        )?;
        let source = |samples| data::Source::Pretrain {
            samples,
            masks: c.masks,
        };
        Ok([train.map(source), valid.map(source), test.map(source)])
    }

    /// The lm loss is token-weighted except for MindSpeed-LLM's fine-tuning default.
    fn token_weighted(&self) -> bool {
        self.cfg.sft.is_none() || self.cfg.averaging == data::LossAveraging::PerToken
    }

    fn activations(&self) -> DType {
        if self.cfg.bf16 {
            DType::BF16
        } else {
            DType::F32
        }
    }

    /// Check the data's token ids against the model's vocabulary before any work.
    fn check_vocab(&self) -> Result<()> {
        for prefix in &self.cfg.blend.prefixes {
            let max = match &self.cfg.sft {
                Some(sft) => SftDataset::open(&sft.prefix)?.max_token(),
                None => crate::data::indexed::IndexedDataset::open(prefix)?.max_token(),
            };
            if max >= self.cfg.vocab_padded as i64 {
                bail!(
                    "{}: token id {max} is outside the model's vocabulary of {} (padded {}): the \
                     data was made with another tokenizer",
                    prefix.display(),
                    self.cfg.model.vocab,
                    self.cfg.vocab_padded
                );
            }
        }
        Ok(())
    }

    /// Forward (and, for training, backward) of K micro-batches from `split` at `from`:
    /// returns each micro-batch's loss mask with, on the last pipeline stage, its losses (on
    /// the device), and the rows processed. Over pipeline stages the passes run in
    /// Megatron's order ([`pipeline`]: 1F1B, or interleaved over model chunks); each chunk's
    /// gradients add in micro-batch order, as on one stage.
    fn step_batches(
        &mut self,
        split: &data::Source,
        from: u64,
        train: bool,
    ) -> Result<(Vec<PendingLoss<B::Tensor>>, u64)> {
        let c = &self.cfg;
        let (m, k) = (c.micro_batch, c.global_batch / c.micro_batch);
        // Megatron's sampler: rank r's j-th micro-batch is the (j·DP + r)-th of the global
        // batch; every micro-batch weighs 1/K of the whole batch (the gradients are summed
        // over the ranks).
        let (dp, dp_rank) = self.dp.as_ref().map_or((1, 0), |g| (g.size(), g.rank()));
        let mut batches = Vec::with_capacity(k / dp);
        for j in 0..k / dp {
            let at = from + ((j * dp + dp_rank) * m) as u64;
            batches.push(split.micro_batch(at, m, k, c.averaging)?);
        }
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
                    match pipe.model_last(slot.0) {
                        true => losses[slot.1].0 = Some(out),
                        false => _ = outputs.insert(slot, out),
                    }
                    if train {
                        saved.insert(slot, fwd);
                    }
                }
                pipeline::Op::Backward(slot) => {
                    let fwd = saved
                        .remove(&slot)
                        .ok_or_else(|| missing("forward pass", slot))?;
                    let batch = &batches[slot.1].batch;
                    let grad = out_grads.remove(&slot);
                    if let Some(d) = self.backward_pass(slot.0, batch, fwd, grad)? {
                        in_grads.insert(slot, d);
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
                    let (from_prev, from_next) = self.p2p(&x, (to_next, to_prev), rows)?;
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

    /// This rank's stage of the pipeline over `micro` micro-batches.
    fn pipeline(&self, micro: usize) -> pipeline::Pipeline {
        let v = self.cfg.virtual_pipeline;
        pipeline::Pipeline {
            stages: self.stage.count,
            chunks: self.chunks.len(),
            micro,
            group: v.map_or(self.stage.count, |v| v.group),
            stage: self.stage.index,
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
        let Chunk { ids, params } = &self.chunks[chunk];
        Ok(forward(
            &self.b,
            &self.spec,
            (ids, &self.params[params.clone()]),
            (batch, input),
            self.activations(),
            tp.as_ref(),
        )?)
    }

    /// One micro-batch backward through model chunk `chunk`: the gradient of its input on
    /// all but the model's first chunk.
    fn backward_pass(
        &mut self,
        chunk: usize,
        batch: &MicroBatch,
        saved: Saved<B::Tensor>,
        grad: Option<B::Tensor>,
    ) -> Result<Option<B::Tensor>> {
        let tp = tensor_parallel(self.tp.as_ref(), &self.cfg);
        let Chunk { ids, params } = &self.chunks[chunk];
        Ok(backward(
            &self.b,
            &self.spec,
            (
                ids,
                &self.params[params.clone()],
                &mut self.grads[params.clone()],
            ),
            (batch, grad),
            saved,
            tp.as_ref(),
        )?)
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
        x: &pipeline::Exchange,
        (to_next, to_prev): (Option<&B::Tensor>, Option<&B::Tensor>),
        rows: impl Fn(pipeline::Slot) -> usize,
    ) -> Result<Neighbours<B::Tensor>> {
        let Some(pp) = &self.pp else {
            return Ok((None, None));
        };
        let (me, count) = (self.stage.index, self.stage.count);
        let (next, prev) = ((me + 1) % count, (me + count - 1) % count);
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
        let ops: [u8; 4] = if me % 2 == 0 {
            [0, 1, 2, 3]
        } else {
            [1, 0, 3, 2]
        };
        for op in ops {
            match op {
                0 => to_next.map(|t| pp.send(t, next)).transpose().map(drop)?,
                1 => from_prev = x.recv_prev.map(|s| recv(s, prev)).transpose()?,
                2 => to_prev.map(|t| pp.send(t, prev)).transpose().map(drop)?,
                _ => from_next = x.recv_next.map(|s| recv(s, next)).transpose()?,
            }
        }
        Ok((from_prev, from_next))
    }

    /// The trained norm weights: under sequence parallelism, the parameters whose gradients
    /// each rank takes over its rows only (Megatron's `sequence_parallel` attribute).
    fn trained_norms(&self) -> Vec<usize> {
        let norm = |r| matches!(r, Role::InputNorm | Role::PostNorm | Role::FinalNorm);
        (self.table.params.iter().enumerate())
            .filter(|(_, p)| p.trainable && norm(p.canon.role))
            .map(|(i, _)| i)
            .collect()
    }

    /// Under sequence parallelism a norm weight's gradient covers this rank's rows only:
    /// summed over the tensor-parallel ranks in one all-reduce of them all
    /// (megatron/core/distributed/finalize_model_grads.py
    /// `_allreduce_non_tensor_model_parallel_grads`). A row-parallel bias needs none here:
    /// its gradient is taken over every row.
    fn sum_norm_grads(&mut self) -> Result<()> {
        let Some(tp) = self.tp.as_ref().filter(|_| self.cfg.sequence_parallel) else {
            return Ok(());
        };
        let norms = self.trained_norms();
        let mut flat = Vec::new();
        for &i in &norms {
            flat.extend(self.b.download_f32(&self.grads[i])?);
        }
        let mut t = self.b.upload_f32(&[flat.len()], &flat)?;
        tp.all_reduce(&mut t, ReduceOp::Sum)?;
        let summed = self.b.download_f32(&t)?;
        let mut at = 0;
        for i in norms {
            let n = self.table.params[i].numel();
            let shape = self.table.params[i].shape.clone();
            self.grads[i] = self.b.upload_f32(&shape, &summed[at..at + n])?;
            at += n;
        }
        Ok(())
    }

    /// The loss sums of micro-batches' losses (read from the device; the last pipeline
    /// stage's).
    fn loss_sums(&self, losses: &[PendingLoss<B::Tensor>]) -> Result<data::LossSums> {
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
    fn everyones_losses(&self, losses: &[PendingLoss<B::Tensor>]) -> Result<data::LossSums> {
        if self.pp.is_none() {
            return self.gathered(self.loss_sums(losses)?);
        }
        let mut flat = vec![0f32; 2 * self.cfg.global_batch / self.cfg.micro_batch];
        if self.stage.last() {
            flat = self.gathered(self.loss_sums(losses)?)?.flat();
        }
        let mut t = self.b.upload_f32(&[flat.len()], &flat)?;
        if let Some(pp) = &self.pp {
            pp.broadcast(&mut t, self.stage.count - 1)?;
        }
        Ok(data::LossSums::interleaved(&self.b.download_f32(&t)?, 1))
    }

    /// The tied embedding's gradient summed over the first pipeline stage (its lookup's) and
    /// the last (its copy's, as the output layer), the same sum on both so that the copies
    /// stay equal (megatron/core/distributed/finalize_model_grads.py
    /// `_allreduce_word_embedding_grads`, an all-reduce of the two here a send each way).
    fn sum_shared_embedding(&mut self) -> Result<()> {
        let (Some(pp), false) = (&self.pp, self.stage.first() && self.stage.last()) else {
            return Ok(());
        };
        let embedding = Canon {
            role: Role::Embedding,
            layer: None,
        };
        // only the first and last stage hold the embedding (or its copy)
        let tied = self.cfg.model.tied;
        let at = self.table.index(embedding);
        let Some(i) = at.filter(|&i| tied && self.table.params[i].trainable) else {
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
        let flat = local.flat();
        let mine = self.b.upload_f32(&[flat.len()], &flat)?;
        let mut all = self.b.zeros(&[flat.len() * dp.size()], DType::F32)?;
        dp.all_gather(&mine, &mut all)?;
        Ok(data::LossSums::interleaved(
            &self.b.download_f32(&all)?,
            dp.size(),
        ))
    }

    /// `x` summed over the data-parallel ranks.
    fn summed(&self, x: f32) -> Result<f32> {
        let Some(dp) = &self.dp else {
            return Ok(x);
        };
        let mut t = self.b.upload_f32(&[1], &[x])?;
        dp.all_reduce(&mut t, ReduceOp::Sum)?;
        Ok(self.b.download_f32(&t)?[0])
    }

    /// One training iteration: returns (loss, grad norm, applied, tokens).
    fn train_step(&mut self, train: &data::Source) -> Result<(f32, f64, bool, u64)> {
        if !self.grads_zeroed {
            for g in &mut self.grads {
                *g = self.b.zeros(self.b.shape(g), DType::F32)?;
            }
        }
        self.grads_zeroed = false;
        let (losses, mut tokens) = self.step_batches(train, self.consumed_train, true)?;
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
        let dp = self
            .dp
            .as_ref()
            .map(|g| g as &dyn Communicator<Tensor = B::Tensor>);
        match (self.sharded.as_mut(), dp) {
            (Some(sharded), dp) => sharded.reduce_scatter(&self.b, &self.grads, dp)?,
            (None, Some(dp)) => {
                for g in &mut self.grads {
                    dp.all_reduce(g, ReduceOp::Sum)?;
                }
            }
            (None, None) => {}
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
            let grads = match self.sharded.as_mut() {
                Some(sharded) => &mut sharded.grads,
                None => &mut self.grads,
            };
            for g in grads {
                self.b.scale(g, scale)?;
            }
        }
        // The gradient norm waits for the device; the losses are read after it without
        // another wait, and the update is queued after both are known.
        let grad_norm = match &self.sharded {
            Some(sharded) => self.model_norm(&sharded.grads)?,
            None => self.model_norm(&self.grads)?,
        };
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
        self.grads_zeroed = report.applied && self.sharded.is_none();
        self.consumed_train += self.cfg.global_batch as u64;
        Ok((loss, report.grad_norm, report.applied, tokens))
    }

    /// One optimizer step with the gradient norm `grad_norm` at `(lr, wd)`: over the whole
    /// model, or over this rank's pieces, whose parameters every rank then gathers.
    fn apply(&mut self, grad_norm: f64, (lr, wd): (f64, f64)) -> Result<optim::StepReport> {
        let skip = self.cfg.skip_non_finite;
        let Some(sharded) = self.sharded.as_mut() else {
            let (params, grads) = (&mut self.params, &mut self.grads);
            return Ok(self
                .opt
                .apply(&self.b, params, grads, grad_norm, (lr, wd), skip)?);
        };
        let (main, grads) = (&mut sharded.main, &mut sharded.grads);
        let report = sharded
            .opt
            .apply(&self.b, main, grads, grad_norm, (lr, wd), skip)?;
        if report.applied {
            let dp = self
                .dp
                .as_ref()
                .map(|g| g as &dyn Communicator<Tensor = B::Tensor>);
            sharded.gather_params(&self.b, &mut self.params, self.cfg.model.dtype, dp)?;
        }
        Ok(report)
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
        if start + iters * g > split.len() as u64 {
            bail!(
                "the {name} split has {} samples, fewer than the evaluations ask for",
                split.len()
            );
        }
        let mut all = data::LossSums::default();
        for i in 0..iters {
            let (losses, _) = self.step_batches(split, start + i * g, false)?;
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
    fn say(&self, bar: &indicatif::ProgressBar, line: &str) {
        if self.rank != 0 {
            return;
        }
        if bar.is_hidden() {
            println!("{line}");
        } else {
            bar.println(line);
        }
    }

    /// The host copy of everything a checkpoint holds.
    fn snapshot(&self, gathered: Option<[Vec<f32>; 3]>) -> Result<checkpoint::Snapshot<'_>> {
        let b = &self.b;
        let params = self
            .params
            .iter()
            .map(|p| b.download(p))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let save = self.cfg.save.as_ref();
        let hyper = checkpoint::GroupHyper {
            lr: self.cfg.schedule.lr(self.schedule_steps),
            max_lr: self.cfg.schedule.max_lr,
            min_lr: self.cfg.schedule.min_lr,
            weight_decay: self.cfg.schedule.wd(self.schedule_steps),
            betas: self.cfg.adam.betas,
            eps: self.cfg.adam.eps,
        };
        let distributed = match (gathered, &self.sharded) {
            (Some(world), Some(sharded)) => Some(checkpoint::DistributedState {
                world,
                buffers: sharded.layout.buffer_numel_unpadded(),
                param_dtype: self.cfg.model.dtype,
                steps: sharded.opt.steps,
                hyper,
            }),
            _ => None,
        };
        let optimizer = match save {
            Some(s) if !s.no_optim && self.sharded.is_none() => {
                let trained = |i: usize| self.table.params[i].trainable;
                let host = |ts: &[B::Tensor]| -> Result<Vec<Option<HostTensor>>> {
                    (ts.iter().enumerate())
                        .map(|(i, t)| Ok(trained(i).then(|| b.download(t)).transpose()?))
                        .collect()
                };
                Some(checkpoint::OptimizerState {
                    steps: self.opt.steps,
                    exp_avg: host(&self.opt.exp_avg)?,
                    exp_avg_sq: host(&self.opt.exp_avg_sq)?,
                    main: self.opt.main.as_deref().map(host).transpose()?,
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
            for (p, t) in self.table.params.iter().zip(&params) {
                if p.lora.is_some() {
                    extra.push((p.chunk, p.name.clone(), t.clone()));
                }
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
            stage: &self.stage,
            stages: &c.stages,
        })
    }

    /// This rank's tensor-parallel rank and the group's size.
    fn tp(&self) -> (usize, usize) {
        self.tp.as_ref().map_or((0, 1), |g| (g.rank(), g.size()))
    }

    /// Save a checkpoint: the ranks of data-parallel rank 0 write one file each, the
    /// tracker last (by rank 0, once every file is complete).
    fn save(&self, bar: &indicatif::ProgressBar) -> Result<Option<std::path::PathBuf>> {
        let start = Instant::now();
        // The distributed optimizer's state goes to data-parallel rank 0 first: every
        // data-parallel rank sends its pieces.
        let gathered = match (&self.sharded, &self.cfg.save) {
            (Some(sharded), Some(save)) if !save.no_optim => {
                let dp = self.dp.as_ref().map(Counted::uncounted);
                sharded.gathered_state(&self.b, dp)?
            }
            _ => None,
        };
        let writes = self.dp.as_ref().is_none_or(|g| g.rank() == 0);
        let Some(save) = self.cfg.save.as_ref().filter(|_| writes) else {
            return Ok(None);
        };
        let snap = self.snapshot(gathered)?;
        // Over the model-parallel ranks: the pipeline stages, then each stage's TP group.
        let groups: Vec<_> = [&self.pp, &self.tp]
            .into_iter()
            .flatten()
            .map(Counted::uncounted)
            .collect();
        let path = match groups.is_empty() {
            true => checkpoint::save(&save.dir, &snap)?,
            false => self.save_shards(&groups, &save.dir, &snap)?,
        };
        let ((t, tps), (p, pps)) = (self.tp(), self.stage.rank());
        self.say(
            bar,
            &format!(
                "  successfully saved checkpoint from iteration {:>7} to {} [ t {}/{tps}, p {}/{pps} ] ({:.1} s)",
                self.iteration,
                save.dir.display(),
                t + 1,
                p + 1,
                start.elapsed().as_secs_f64()
            ),
        );
        Ok(Some(path))
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
        const NAME: usize = 256;
        let b = &self.b;
        let temp = match groups.iter().all(|g| g.rank() == 0) {
            true => Some(checkpoint::begin(dir, snap.iteration)),
            false => None,
        };
        // [length or −1 on failure, the name's bytes…]
        let mut message = vec![0f32; NAME + 1];
        let name = temp.as_ref().map(|t| match t {
            Ok(t) => t.path().file_name().map(|n| n.as_encoded_bytes().to_vec()),
            Err(_) => None,
        });
        match name.flatten().filter(|n| n.len() <= NAME) {
            Some(n) => {
                message[0] = n.len() as f32;
                for (slot, &byte) in message[1..].iter_mut().zip(&n) {
                    *slot = f32::from(byte);
                }
            }
            None => message[0] = -1.0,
        }
        let mut t = b.upload_f32(&[NAME + 1], &message)?;
        for g in groups {
            g.broadcast(&mut t, 0)?;
        }
        let message = b.download_f32(&t)?;
        let temp = temp.transpose()?;
        if message[0] < 0.0 {
            bail!(
                "model-parallel rank 0 could not start the checkpoint in {}",
                dir.display()
            );
        }
        let name: Vec<u8> = (message[1..=message[0] as usize].iter())
            .map(|&x| x as u8)
            .collect();
        let into = dir.join(String::from_utf8_lossy(&name).as_ref());
        let written = checkpoint::write_rank(&into, snap);
        let mut failed = b.upload_f32(&[1], &[f32::from(u8::from(written.is_err()))])?;
        for g in groups.iter().rev() {
            g.all_reduce(&mut failed, ReduceOp::Max)?;
        }
        written?;
        if b.download_f32(&failed)?[0] > 0.0 {
            bail!("another model-parallel rank failed to write its part of the checkpoint");
        }
        match temp {
            Some(temp) => checkpoint::finish(dir, temp, snap),
            None => Ok(dir
                .join(checkpoint::iteration_dir(snap.iteration))
                .join(checkpoint::rank_dir_of(snap.tp.0, snap.stage))
                .join(crate::ckpt::megatron::RANK_FILE)),
        }
    }

    fn train(mut self) -> Result<TrainSummary> {
        self.check_vocab()?;
        let splits = self.datasets()?;
        let [Some(train), valid, test] = splits else {
            bail!("--split {:?} gives the train split no data", self.cfg.split);
        };
        let c_iters = self.cfg.train_iters;
        if self.consumed_train
            + (c_iters - self.iteration.min(c_iters)) * self.cfg.global_batch as u64
            > train.len() as u64
        {
            bail!("internal: the train split holds fewer samples than the run consumes");
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
                eprintln!(
                    "mindkit train: {} ranks: {} tensor-parallel × {} pipeline stages {:?}{chunks} × {} data-parallel, {} micro-batches per data-parallel rank per iteration",
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
        while self.iteration < c_iters {
            interval.start.get_or_insert_with(Instant::now);
            let (loss, grad_norm, applied, tokens) = self.train_step(&train)?;
            self.iteration += 1;
            self.flops += log::flops_per_step(&flops_model, g);
            total_tokens += tokens;
            interval.tokens += tokens;
            if applied {
                interval.advanced += 1;
                interval.loss_sum += loss;
            } else {
                interval.skipped += 1;
                interval.nan += u64::from(!loss.is_finite() || !grad_norm.is_finite());
            }
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
                if self.consumed_valid + iters * g <= valid.len() as u64 {
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
        })
    }

    /// Whether iteration `iteration` is logged or written to TensorBoard.
    fn reports(&self, iteration: u64) -> bool {
        iteration.is_multiple_of(self.cfg.log_interval) || self.tensorboard_now(iteration)
    }

    /// Whether iteration `iteration` writes TensorBoard scalars.
    fn tensorboard_now(&self, iteration: u64) -> bool {
        (self.cfg.tensorboard.as_ref()).is_some_and(|t| iteration.is_multiple_of(t.1))
    }

    /// Megatron's `count_zeros_fp32` over the trained gradients multiplied by `scale` (the clip
    /// coefficient the step is about to apply).
    fn count_zeros(&self, scale: f32) -> Result<f64> {
        let grads = match &self.sharded {
            Some(sharded) => &sharded.grads,
            None => &self.grads,
        };
        let mut n = 0;
        for g in self.counted_of(grads) {
            n += (self.b.download_f32(g)?.iter())
                .filter(|&&x| x * scale == 0.0)
                .count();
        }
        self.model_summed(n as f64)
    }

    /// `--log-num-zeros-in-grad` and `--log-params-norm` of the step just taken, when asked
    /// for: over the trained parameters (their f32 main copies under `--bf16`), Megatron's
    /// `count_zeros_fp32` (counted before the step) and `calc_params_l2_norm`.
    fn norms(&self) -> Result<(Option<f64>, Option<f64>)> {
        let zeros = self.zeros_in_grad;
        let params = match (self.cfg.log_norms.0, &self.sharded, self.opt.main.as_ref()) {
            (false, _, _) => None,
            (true, Some(sharded), _) => Some(self.model_norm(&sharded.main)?),
            (true, None, Some(main)) => Some(self.model_norm(main)?),
            (true, None, None) => Some(self.model_norm(&self.params)?),
        };
        Ok((zeros, params))
    }

    /// The trained parameters this rank counts in a model-wide sum: its shards, and the
    /// parameters every tensor-parallel rank holds a copy of on its rank 0 only (Megatron's
    /// `param_is_not_tensor_parallel_duplicate`), and not a pipeline's embedding copy
    /// (`param_is_not_shared`).
    fn counted(&self) -> Vec<usize> {
        let first = self.tp.as_ref().is_none_or(|g| g.rank() == 0);
        (self.table.params.iter().enumerate())
            .filter(|(_, p)| p.trainable && !p.shared && (first || p.tp_split))
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
        let mut t = self.b.upload_f32(&[1], &[x as f32])?;
        for group in [&self.tp, &self.pp].into_iter().flatten() {
            group.all_reduce(&mut t, ReduceOp::Sum)?;
        }
        Ok(f64::from(self.b.download_f32(&t)?[0]))
    }

    /// Of `tensors` (one per entry of the table, or with the distributed optimizer one per
    /// piece), those this rank counts in a model-wide sum: of its [`Trainer::counted`]
    /// parameters.
    fn counted_of<'a>(&self, tensors: &'a [B::Tensor]) -> Vec<&'a B::Tensor> {
        let counted = self.counted();
        match &self.sharded {
            Some(sharded) => (sharded.pieces.iter().zip(tensors))
                .filter(|(p, _)| counted.contains(&p.param))
                .map(|(_, t)| t)
                .collect(),
            None => counted.iter().map(|&i| &tensors[i]).collect(),
        }
    }

    /// `x`, this rank's part of a model-wide sum, summed over the ranks holding the other
    /// parts: the model-parallel ranks, and with the distributed optimizer (each data-parallel
    /// rank holding its pieces) the data-parallel ones first (Megatron all-reduces the
    /// distributed optimizer's norms over every rank).
    fn model_summed(&self, x: f64) -> Result<f64> {
        let x = match (&self.sharded, &self.dp) {
            (Some(_), Some(_)) => f64::from(self.summed(x as f32)?),
            _ => x,
        };
        self.mp_summed(x)
    }

    /// The L2 norm of the whole model's `tensors` (gradients or parameters, as
    /// [`Trainer::counted_of`] takes them), over the ranks holding its parts.
    fn model_norm(&self, tensors: &[B::Tensor]) -> Result<f64> {
        let counted = self.counted_of(tensors);
        let local = match counted.is_empty() {
            true => 0.0,
            false => self.b.sum_squares(&counted)?,
        };
        Ok(self.model_summed(local)?.sqrt())
    }

    fn write_validation(&mut self, loss: f64) -> Result<()> {
        let ppl = self.cfg.tensorboard_ppl;
        if let Some(tb) = &mut self.tensorboard {
            let mut scalars = vec![("lm loss validation", loss)];
            if ppl {
                scalars.push(("lm loss validation ppl", loss.min(20.0).exp()));
            }
            tb.scalars(self.iteration, self.consumed_train, &scalars)?;
        }
        Ok(())
    }

    /// `--log-comm-stats`: what this rank's collectives moved per iteration over the last
    /// `iterations`, group by group, beside Megatron's for the layout: the data-parallel
    /// gradient all-reduce (every trained parameter's gradient in f32: Megatron reduces
    /// gradients in f32 under --bf16 too), and per micro-batch the tensor-parallel
    /// all-reduces of `[T, h]` activations (the embedding's and each layer's two row-parallel
    /// outputs forward, the output layer's and each layer's two column-parallel inputs'
    /// gradients backward) and the cross entropy's three of `[T]` f32.
    fn comm_line(&self, iterations: u64) -> Option<String> {
        let per = |x: u64| x as f64 / iterations.max(1) as f64;
        let counted = |g: &Counted<B::Tensor>| -> String {
            (g.take().iter())
                .map(|(name, c)| format!("{name} {} calls {} bytes", per(c.calls), per(c.bytes)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut parts = Vec::new();
        if let Some(dp) = &self.dp {
            let trained: usize = (self.table.params.iter())
                .filter(|p| p.trainable)
                .map(ParamInfo::numel)
                .sum();
            let megatron = match &self.sharded {
                // the padded buffer's gradients reduce-scattered in f32, this rank's part of its
                // parameters all-gathered in their dtype
                Some(sharded) => {
                    let (numel, dtype) = (sharded.layout.numel(), self.cfg.model.dtype);
                    format!(
                        "distributed optimizer's reduce-scatter: {numel} buffer elements × 4 bytes = {} bytes; all-gather: {numel} / {} × {} bytes = {} bytes",
                        4 * numel,
                        dp.size(),
                        dtype.size(),
                        numel / dp.size() * dtype.size()
                    )
                }
                None => format!(
                    "gradient all-reduce: {trained} parameters × 4 bytes = {} bytes",
                    4 * trained
                ),
            };
            parts.push(format!(
                "data-parallel rank {} of {}: {} | Megatron's {megatron}",
                dp.rank(),
                dp.size(),
                counted(dp),
            ));
        }
        if let Some(tp) = &self.tp {
            parts.push(format!(
                "tensor-parallel rank {} of {}: {} | Megatron's {}",
                tp.rank(),
                tp.size(),
                counted(tp),
                self.tp_formula(tp.size())
            ));
        }
        if let Some(pp) = &self.pp {
            parts.push(format!(
                "pipeline stage {} of {}: {} | Megatron's {}",
                pp.rank(),
                pp.size(),
                counted(pp),
                self.pp_formula()
            ));
        }
        (!parts.is_empty()).then(|| format!(" [comm] per iteration, {}", parts.join("; ")))
    }

    /// Megatron's tensor-parallel traffic per iteration over `tp` ranks, in the counts' terms
    /// (an all-gather counts this rank's part, a reduce-scatter its whole input). Per
    /// micro-batch of T rows: the cross entropy's three all-reduces of `[T]` f32, and of
    /// `[T, h]` activations either 4L + 2 all-reduces (the embedding's and each layer's two
    /// row-parallel outputs forward, the output layer's and each layer's two column-parallel
    /// inputs' gradients backward) or, under sequence parallelism, 4L + 2 reduce-scatters in
    /// their place and 6L + 3 all-gathers (the column-parallel inputs forward and again
    /// backward, the row-parallel output gradients and the embedding's); then per iteration
    /// the norm weights' gradient all-reduce under sequence parallelism.
    fn tp_formula(&self, tp: usize) -> String {
        let c = &self.cfg;
        let (rows, layers, hidden) = (c.micro_batch * c.seq_length, c.model.layers, c.model.hidden);
        let k = c.global_batch / (c.micro_batch * c.data_parallel);
        let a = self.activations();
        let block = rows * hidden * a.size();
        let entropy = 3 * rows * 4;
        if !c.sequence_parallel {
            // With LoRA, each adapter's x·Aᵀ (row-parallel layers, forward) or its gradient
            // (column-parallel layers, backward) too.
            let (adapters, r) = c
                .lora
                .as_ref()
                .map_or((0, 0), |l| (l.spec.targets.len() * layers, l.spec.r));
            let bytes = k * ((4 * layers + 2) * block + adapters * rows * r * a.size() + entropy);
            return format!(
                "all-reduces: ({} × [{rows}, {hidden}] {a:?} + {adapters} × [{rows}, {r}] {a:?} + 3 × [{rows}] f32) × {k} micro-batches = {bytes} bytes",
                4 * layers + 2
            );
        }
        let norms: usize = (self.trained_norms().into_iter())
            .map(|i| self.table.params[i].numel())
            .sum();
        format!(
            "all-gathers: {} × [{}, {hidden}] {a:?} × {k} micro-batches = {} bytes; reduce-scatters: {} × [{rows}, {hidden}] {a:?} × {k} = {} bytes; all-reduces: 3 × [{rows}] f32 × {k} + {norms} norm gradients × 4 = {} bytes",
            6 * layers + 3,
            rows / tp,
            k * (6 * layers + 3) * block / tp,
            4 * layers + 2,
            k * (4 * layers + 2) * block,
            k * entropy + 4 * norms
        )
    }

    /// Megatron's point-to-point traffic per iteration of this pipeline stage: per
    /// micro-batch of T rows and model chunk, the chunk's output `[T', h]` sent to the next
    /// stage (but from the model's last chunk) and its input's gradient sent to the previous
    /// (but from the model's first) (T' = T / TP under sequence parallelism), the same
    /// received; the tied embedding's gradient `[Vp / TP, h]` f32 sent and received between the
    /// first and last stage; and the schedule's bubble, (PP − 1) / (V·K + PP − 1) of the
    /// iteration with K micro-batches and V model chunks per stage (each stage idles for
    /// PP − 1 forward and backward slots of one chunk; V = 1 is 1F1B's (PP − 1) / (K + PP − 1)).
    fn pp_formula(&self) -> String {
        let c = &self.cfg;
        let tp = self.tp().1;
        let rows = c.micro_batch * c.seq_length / if c.sequence_parallel { tp } else { 1 };
        let a = self.activations();
        let k = c.global_batch / (c.micro_batch * c.data_parallel);
        let block = rows * c.model.hidden * a.size();
        let (first, last) = (self.stage.first(), self.stage.last());
        let v = self.chunks.len();
        let sends = k * (2 * v - usize::from(last) - usize::from(first));
        let tied = self.cfg.model.tied
            && (first || last)
            && self
                .table
                .params
                .iter()
                .any(|p| p.canon.role == Role::Embedding && p.trainable);
        let embedding = match tied {
            true => c.vocab_padded / tp * c.model.hidden * 4,
            false => 0,
        };
        let p = self.stage.count;
        let (bubble, vk) = match v {
            1 => ("(PP − 1) / (K + PP − 1)".to_string(), k),
            _ => (format!("(PP − 1) / ({v}·K + PP − 1)"), v * k),
        };
        format!(
            "sends and receives, each: {sends} × [{rows}, {}] {a:?} + {} × [{}, {}] f32 = {} bytes; bubble {bubble} = {}/{} = {:.3}",
            c.model.hidden,
            usize::from(tied),
            c.vocab_padded / tp,
            c.model.hidden,
            sends * block + embedding,
            p - 1,
            vk + p - 1,
            (p - 1) as f64 / (vk + p - 1) as f64
        )
    }

    /// [`Trainer::exit_reason`], agreed by all ranks: one rank's reason stops them all
    /// (Megatron all-reduces its exit flags).
    fn agreed_exit(&self, started: Instant) -> Result<Option<String>> {
        let mine = self.exit_reason(started);
        if self.tp.is_none() && self.dp.is_none() && self.pp.is_none() {
            return Ok(mine);
        }
        let mut flag = self
            .b
            .upload_f32(&[1], &[f32::from(u8::from(mine.is_some()))])?;
        // Over the data-parallel group, the tensor-parallel one, then the pipeline: every rank
        // of the world.
        for group in [&self.dp, &self.tp, &self.pp].into_iter().flatten() {
            group.all_reduce(&mut flag, ReduceOp::Max)?;
        }
        let anyone = self.b.download_f32(&flag)?[0] > 0.0;
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

/// Local time as Megatron prints it (`%Y-%m-%d %H:%M:%S`).
fn chrono_now() -> String {
    chrono::Local::now().format("%Y-%m-%d %H:%M:%S").to_string()
}
