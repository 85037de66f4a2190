//! Rank wiring: the command line to one [`Trainer`] per rank, as threads of this process
//! (CPU thread groups, or one NPU each over HCCL) or as one of a launcher's processes (socket
//! groups through torch's store, HCCL root info through it, or a rank table). The only file of
//! `train` that reaches for the NPU backend.

use super::config::{self, TrainConfig};
use super::parallel::{Axis, Layout};
use super::trainer::Trainer;
use super::{args, store, TrainSummary};
use crate::device::{self, DeviceKind, Job};
use crate::engine::comm::Communicator;
use crate::engine::cpu::Cpu;
use crate::engine::{Backend, EngineError};
use crate::npu::comm::Hccl;
use crate::npu::Npu;
use anyhow::{anyhow, bail, Context, Result};
use std::path::PathBuf;
use std::sync::Mutex;

/// Run `mindkit train` with Megatron / MindSpeed-LLM flags (program and subcommand removed).
/// A run that skipped every iteration's update trained nothing: an error with its summary.
pub fn run(argv: &[String]) -> Result<TrainSummary> {
    let summary = launch_ranks(argv)?;
    if summary.nothing_trained() {
        bail!("nothing was trained: {summary}");
    }
    Ok(summary)
}

/// [`run`]'s ranks, wired as the command line and the launcher say.
fn launch_ranks(argv: &[String]) -> Result<TrainSummary> {
    let parsed = args::Args::parse(argv)?;
    let quiet = parsed.has("quiet");
    let device = parsed
        .get("device")
        .unwrap_or("cpu")
        .parse::<DeviceKind>()
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
    device::run(
        device,
        Alone {
            parsed: &parsed,
            quiet,
        },
    )
}

/// A single rank on the backend `--device` names: the flags resolved once it is open.
struct Alone<'a> {
    parsed: &'a args::Args,
    quiet: bool,
}

impl Job for Alone<'_> {
    type Output = TrainSummary;

    fn run<B: Backend>(self, backend: B) -> Result<TrainSummary> {
        let cfg = config::resolve(self.parsed)?;
        Trainer::new(backend, cfg, self.quiet, Groups::alone())?.train()
    }
}

/// A group's collectives on a backend's tensors.
type Comm<T> = Box<dyn Communicator<Tensor = T>>;

/// One rank's place among the ranks: its global rank and the tensor-, data-, pipeline-,
/// expert- and expert-data-parallel groups it belongs to (`None` where it is alone along that
/// axis).
pub struct Groups<T> {
    pub(super) rank: usize,
    pub(super) tp: Option<Comm<T>>,
    pub(super) dp: Option<Comm<T>>,
    pub(super) pp: Option<Comm<T>>,
    pub(super) ep: Option<Comm<T>>,
    pub(super) edp: Option<Comm<T>>,
    /// Expert tensor parallelism apart from tensor parallelism (1 < ETP < TP).
    pub(super) etp: Option<Comm<T>>,
}

/// The axes a rank has a group along, in the order every rank joins them.
const GROUP_AXES: [Axis; 6] = [Axis::Tp, Axis::Dp, Axis::Pp, Axis::Ep, Axis::Edp, Axis::Etp];

impl<T> Groups<T> {
    /// A single rank.
    fn alone() -> Self {
        Groups {
            rank: 0,
            tp: None,
            dp: None,
            pp: None,
            ep: None,
            edp: None,
            etp: None,
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
            if joins(layout, axis) {
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
            Axis::Ep => &mut self.ep,
            Axis::Edp => &mut self.edp,
            Axis::Etp => &mut self.etp,
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

/// Whether a rank of `layout` has a group along `axis`: where the axis has several ranks,
/// along the expert-data-parallel one only with expert parallelism (else it is the
/// data-parallel group), and along the expert tensor-parallel one only where it is not the
/// tensor-parallel group (ETP < TP).
fn joins(layout: &Layout, axis: Axis) -> bool {
    let n = layout.size(axis);
    n > 1
        && match axis {
            Axis::Edp => layout.size(Axis::Ep) > 1,
            Axis::Etp => n < layout.size(Axis::Tp),
            _ => true,
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
        if !joins(layout, axis) {
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
/// tensor-, data-, pipeline-, expert-, expert-data- and expert tensor-parallel groups as
/// subgroups 1 to 6.
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
                let many = joins(&cfg.layout, axis);
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
    if layout.world() == layout.size(Axis::Dp) && layout.size(Axis::Ep) == 1 {
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
