//! Megatron's torch-format checkpoint directory: `latest_checkpointed_iteration.txt`,
//! `iter_0000001/` (or `release/`), `mp_rank_TT[_PPP]/model_optim_rng.pt` holding
//! `{args, checkpoint_version: 3.0, iteration, model | model0..}` (`docs/checkpoints.md` §1, §8).

mod write;

pub use write::MegatronTarget;

use super::config::arg_uint;
use super::grouped::{expert_view, grouped_key};
use super::layout::{self, chunk_entries, rank_grid, KeyLayout, Parallel};
use super::torch::pickle::{TensorRef, Value};
use super::torch::TorchFile;
use super::transform::{gather_tp, shard_shape};
use crate::arch::family::Family;
use crate::arch::roles::{Canon, Role};
use crate::arch::{ModelConfig, MtpLayout};
use crate::tensor::host::Tensor;
use crate::tensor::DType;
use anyhow::{anyhow, bail, Context, Result};
use rayon::prelude::*;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// Rank files a checkpoint may have (TP × PP): far above any training job's, and a bound on
/// what a rank directory's name or the args can make mindkit look for.
const MAX_RANK_FILES: usize = 1 << 16;

/// Tracker file naming the latest iteration.
pub const TRACKER: &str = "latest_checkpointed_iteration.txt";
/// The file of one rank in an iteration directory.
pub const RANK_FILE: &str = "model_optim_rng.pt";

/// `mp_rank_TT` or `mp_rank_TT_PPP`, as Megatron names a rank's directory.
pub fn rank_dir(tp: usize, pp: usize, pp_size: usize) -> String {
    if pp_size > 1 {
        format!("mp_rank_{tp:02}_{pp:03}")
    } else {
        format!("mp_rank_{tp:02}")
    }
}

/// A rank's directory with its expert-parallel rank appended when there are several
/// (`mp_rank_TT[_PPP]_EEE`, Megatron's `get_checkpoint_name`).
pub fn expert_rank_dir(tp: usize, pp: (usize, usize), ep: (usize, usize)) -> String {
    let dir = rank_dir(tp, pp.0, pp.1);
    match ep.1 > 1 {
        true => format!("{dir}_{:03}", ep.0),
        false => dir,
    }
}

/// Whether `dir` looks like a Megatron torch-format checkpoint (root or iteration directory).
pub fn is_megatron_dir(dir: &Path) -> bool {
    dir.join(TRACKER).is_file() || has_rank_dirs(dir)
}

fn has_rank_dirs(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("mp_rank_"))
        })
        .unwrap_or(false)
}

/// The iteration directory of a checkpoint root (via the tracker), or `dir` itself.
fn iteration_dir(dir: &Path) -> Result<PathBuf> {
    if has_rank_dirs(dir) {
        return Ok(dir.to_path_buf());
    }
    let tracker = dir.join(TRACKER);
    let text = std::fs::read_to_string(&tracker)
        .with_context(|| format!("reading {}", tracker.display()))?;
    let text = text.trim();
    let sub = match text.parse::<u64>() {
        Ok(i) => format!("iter_{i:07}"),
        Err(_) if text == "release" => "release".into(),
        Err(_) => bail!(
            "{}: expected an iteration number or \"release\", found {text:?}",
            tracker.display()
        ),
    };
    let it = dir.join(&sub);
    if !it.is_dir() {
        bail!("{} names {sub}, which does not exist", tracker.display());
    }
    Ok(it)
}

/// The numbers of a rank directory `mp_rank_TT[_PPP][_EEE]` (one to three).
fn parse_rank_dir(name: &str) -> Result<Vec<usize>> {
    let parts = (name["mp_rank_".len()..].split('_'))
        .map(|s| {
            s.parse::<usize>()
                .map_err(|_| anyhow!("unexpected rank directory {name}"))
        })
        .collect::<Result<Vec<usize>>>()?;
    if parts.len() > 3 {
        bail!("unexpected rank directory {name}");
    }
    Ok(parts)
}

/// A rank directory's `(tp, pp, ep)` ranks and whether it names its stage, given whether the
/// checkpoint is pipeline- and expert-parallel (`mp_rank_TT_NNN` is a stage unless only the
/// experts are split).
fn rank_of(parts: &[usize], (pipelined, expert): (bool, bool)) -> (usize, usize, usize, bool) {
    match *parts {
        [t] => (t, 0, 0, false),
        [t, e] if expert && !pipelined => (t, 0, e, false),
        [t, p] => (t, p, 0, true),
        [t, p, e, ..] => (t, p, e, true),
        [] => (0, 0, 0, false),
    }
}

/// The rank files of a checkpoint ([`open_rank_files`]).
pub struct RankFiles {
    /// The iteration directory.
    pub iter_dir: PathBuf,
    /// Each stage's files, in [`rank_grid`] order.
    pub files: Vec<Vec<TorchFile>>,
    /// Tensor-parallel size.
    pub tp: usize,
    /// Expert-parallel size.
    pub ep: usize,
    /// Expert tensor-parallel size (TP, or 1: whole experts in files of some TP × EP pairs).
    pub etp: usize,
    /// MindSpeed-LLM's `--moe-tp-extend-ep` under TP > 1: whole experts in every file of the
    /// grid ([`Parallel::tp_extend`]).
    pub tp_extend: bool,
}

/// The iteration directory of `dir` and its rank files, all opened in parallel: per stage,
/// one for each `(tp, ep)` pair of [`rank_grid`]. The layout is the larger of the rank
/// directories present and what rank 0's args say the checkpoint was saved with, so that a
/// missing rank directory is reported by its path, not mistaken for a smaller layout; every
/// expected file is checked before the others are read.
pub fn open_rank_files(dir: &Path) -> Result<RankFiles> {
    let iter_dir = iteration_dir(dir)?;
    let mut names: Vec<Vec<usize>> = Vec::new();
    for e in std::fs::read_dir(&iter_dir)? {
        let name = e?.file_name().to_string_lossy().into_owned();
        if name.starts_with("mp_rank_") {
            names.push(parse_rank_dir(&name)?);
        }
    }
    let Some(shortest) = names.iter().min_by_key(|n| n.len()) else {
        bail!("{}: no mp_rank_* directories", iter_dir.display());
    };
    // Rank 0's directory, whatever the layout: mp_rank_00, mp_rank_00_000 or mp_rank_00_000_000.
    let first_path = iter_dir
        .join(format!("mp_rank_00{}", "_000".repeat(shortest.len() - 1)))
        .join(RANK_FILE);
    if !first_path.is_file() {
        bail!("missing rank file {}", first_path.display());
    }
    let first = TorchFile::open(&first_path)?;
    let (saved_tp, saved_pp, saved_ep, (saved_etp, tp_extend)) = saved_layout(&first)?;
    let kinds = (saved_pp > 1 || shortest.len() == 3, saved_ep > 1);
    let ranks: Vec<_> = names.iter().map(|n| rank_of(n, kinds)).collect();
    let found =
        |f: fn(&(usize, usize, usize, bool)) -> usize| ranks.iter().map(f).max().unwrap_or(0) + 1;
    let (tp, pp, ep) = (
        found(|r| r.0).max(saved_tp),
        found(|r| r.1).max(saved_pp),
        found(|r| r.2).max(saved_ep),
    );
    let etp = match saved_etp {
        _ if tp_extend => 1,
        e if e == saved_tp => tp,
        e => e,
    };
    if let Some(fault) = (!tp_extend)
        .then(|| layout::expert_grid_fault(tp, ep, etp))
        .flatten()
    {
        bail!("{}: {fault}", first.path().display());
    }
    // `mp_rank_00_000` names a pipeline-parallel checkpoint even when its other stages are gone.
    let named_stage = ranks.iter().any(|r| r.3);
    let rank_path = |t, p, e| {
        let named_pp = if named_stage { pp.max(2) } else { pp };
        (iter_dir.join(expert_rank_dir(t, (p, named_pp), (e, ep)))).join(RANK_FILE)
    };
    let layout = format!(
        "rank directories present {} × {} × {}, rank 0's args say TP {saved_tp} × PP \
         {saved_pp} × EP {saved_ep}{}",
        found(|r| r.0),
        found(|r| r.1),
        found(|r| r.2),
        match (etp, tp_extend) {
            (_, true) => ", experts spread over TP × EP (moe_tp_extend_ep)".to_string(),
            (1, _) if tp > 1 => ", whole experts".to_string(),
            (e, _) if e != tp => format!(", experts split over ETP {e}"),
            _ => String::new(),
        }
    );
    if (tp.checked_mul(pp).and_then(|n| n.checked_mul(ep))).is_none_or(|n| n > MAX_RANK_FILES) {
        bail!(
            "{}: TP {tp} × PP {pp} × EP {ep} ({layout}) is more than the {MAX_RANK_FILES} rank \
             files mindkit reads",
            iter_dir.display()
        );
    }
    let grid = rank_grid(tp, ep, if tp_extend { tp } else { etp });
    let paths: Vec<(usize, usize, PathBuf)> = (0..pp)
        .flat_map(|p| grid.iter().enumerate().map(move |(m, &te)| (p, m, te)))
        .map(|(p, m, (t, e))| (p, m, rank_path(t, p, e)))
        .collect();
    let missing: Vec<String> = (paths.iter())
        .filter(|(.., path)| !path.is_file())
        .map(|(.., path)| path.display().to_string())
        .collect();
    if !missing.is_empty() {
        let shown = missing.len().min(8);
        let more = match missing.len() - shown {
            0 => String::new(),
            n => format!(" and {n} more"),
        };
        bail!(
            "missing rank file{} {}{more} (the checkpoint is TP {tp} × PP {pp} × EP {ep}: {layout})",
            if missing.len() > 1 { "s" } else { "" },
            missing[..shown].join(", ")
        );
    }
    let mut first = Some(first);
    let opened: Vec<TorchFile> = paths
        .par_iter()
        .map(|(p, m, path)| match (p, m) {
            (0, 0) => Ok(None),
            _ => TorchFile::open(path).map(Some),
        })
        .collect::<std::result::Result<Vec<_>, _>>()?
        .into_iter()
        .map(|f| f.or_else(|| first.take()).expect("rank 0 is opened once"))
        .collect();
    let mut files: Vec<Vec<TorchFile>> = (0..pp).map(|_| Vec::new()).collect();
    for ((p, ..), f) in paths.iter().zip(opened) {
        files[*p].push(f);
    }
    Ok(RankFiles {
        iter_dir,
        files,
        tp,
        ep,
        etp,
        tp_extend,
    })
}

/// TP × PP × EP as rank 0's args record them (1 × 1 × 1 when they do not), the expert
/// tensor-parallel size (TP when they do not), and whether the routed experts are spread
/// whole over TP × EP with MindSpeed-LLM's `moe_tp_extend_ep` under TP > 1.
fn saved_layout(first: &TorchFile) -> Result<(usize, usize, usize, (usize, bool))> {
    let args = match first.root().get("args") {
        Some(Value::Namespace(a)) => a.as_slice(),
        _ => &[],
    };
    let size = |name| {
        arg_uint(args, name)
            .map(|n| n.unwrap_or(1).max(1))
            .with_context(|| first.path().display().to_string())
    };
    let tp = size("tensor_model_parallel_size")?;
    let etp = arg_uint(args, "expert_tensor_parallel_size")
        .with_context(|| first.path().display().to_string())?;
    let extend = matches!(
        args.iter().find(|(k, _)| k == "moe_tp_extend_ep"),
        Some((_, Value::Bool(true)))
    );
    if extend && etp == Some(1) && tp > 1 {
        bail!(
            "{}: args say both moe_tp_extend_ep and expert_tensor_parallel_size 1, which \
             MindSpeed-LLM refuses together",
            first.path().display()
        );
    }
    Ok((
        tp,
        size("pipeline_model_parallel_size")?,
        size("expert_model_parallel_size")?,
        (etp.filter(|&e| e > 0).unwrap_or(tp), tp > 1 && extend),
    ))
}

/// Whether a state-dict key is a LoRA factor (`….lora_A.default.weight`, `lora_b`, …, or
/// MindSpeed-LLM's grouped experts' `weight1_lora_a`, …).
pub fn is_lora_key(key: &str) -> bool {
    key.contains(".lora_") || super::grouped::GroupedLora::of(key).is_some()
}

/// A tensor found in a rank file: which file of its stage ([`rank_grid`] order), its reference, and
/// whether it is stored transposed (a routed expert inside grouped tensors).
struct Shard {
    file: usize,
    key: String,
    tensor: TensorRef,
    transposed: bool,
}

/// An opened Megatron checkpoint, tensors indexed by canonical name.
pub struct MegatronCkpt {
    /// The iteration directory.
    pub iter_dir: PathBuf,
    /// Detected parallel layout.
    pub par: Parallel,
    /// Detected key layout.
    pub layout: KeyLayout,
    /// Model architecture.
    pub cfg: ModelConfig,
    /// `args` of rank 0 (empty if absent).
    pub args: Vec<(String, Value)>,
    /// Rows of the padded embedding over all TP ranks.
    pub padded_vocab: usize,
    /// LoRA tensors found next to the weights (set aside, not converted).
    pub lora_tensors: usize,
    /// Whether the routed experts are stored as grouped tensors ([`super::grouped`]), or in
    /// the Transformer-Engine layout as `TEGroupedMLP`'s ([`layout::te_grouped_entries`]).
    pub grouped: bool,
    /// Rank files, `[pp][m]` for the `(tp, ep)` pair `m` of [`Parallel::rank_files`].
    files: Vec<Vec<TorchFile>>,
    /// Canonical tensor → (stage, shard per TP rank).
    index: HashMap<Canon, (usize, Vec<Shard>)>,
}

/// Longest `.`-joined key a model chunk may hold (Megatron's are under 200 bytes).
const MAX_FLAT_KEY: usize = 4096;
/// Bytes all `.`-joined keys of a model chunk may take: a nested dict of long keys would
/// otherwise repeat its prefixes into every leaf's name, far beyond the pickle's size.
const MAX_FLAT_KEYS_TOTAL: usize = 64 << 20;

/// A model chunk's tensors flattened to `.`-joined keys (legacy names normalised, a LoRA-wrapped
/// module's `base_layer` dropped). `file` is only used in errors.
pub fn flatten(
    v: &Value,
    legacy: bool,
    file: &Path,
    out: &mut BTreeMap<String, Value>,
) -> Result<()> {
    let mut flat = Flattener {
        file,
        legacy,
        out,
        prefix: String::new(),
        total: 0,
    };
    flat.walk(v)
}

/// [`flatten`]'s state: one key buffer, grown and cut back level by level (a deep nest of
/// long keys never holds a copy per level); dict nesting is bounded by the pickle reader.
struct Flattener<'a> {
    file: &'a Path,
    legacy: bool,
    out: &'a mut BTreeMap<String, Value>,
    prefix: String,
    total: usize,
}

impl Flattener<'_> {
    fn walk(&mut self, v: &Value) -> Result<()> {
        let Value::Dict(items) = v else {
            self.total += self.prefix.len();
            self.check()?;
            let key = self.prefix.replace(".base_layer.", ".");
            let key = if self.legacy {
                layout::normalise_legacy(&key)
            } else {
                key
            };
            self.out.insert(key, v.clone());
            return Ok(());
        };
        for (k, val) in items {
            let Value::Str(k) = k else { continue };
            let len = self.prefix.len();
            if len > 0 {
                self.prefix.push('.');
            }
            self.prefix.push_str(k);
            self.check()?;
            self.walk(val)?;
            self.prefix.truncate(len);
        }
        Ok(())
    }

    fn check(&self) -> Result<()> {
        if self.prefix.len() > MAX_FLAT_KEY || self.total > MAX_FLAT_KEYS_TOTAL {
            let start: String = self.prefix.chars().take(80).collect();
            bail!(
                "{}: model key {start}… ({} bytes; keys take {} bytes in all) exceeds \
                 mindkit's bounds of {MAX_FLAT_KEY} bytes per key and {MAX_FLAT_KEYS_TOTAL} \
                 in all: the checkpoint is damaged or hostile",
                self.file.display(),
                self.prefix.len(),
                self.total,
            );
        }
        Ok(())
    }
}

/// Whether a model chunk is the legacy nested model (`language_model` at its top).
pub fn is_legacy_chunk(chunk: &Value) -> bool {
    matches!(chunk, Value::Dict(items) if items.iter().any(|(k, _)| matches!(k, Value::Str(s) if s == "language_model")))
}

/// The model chunks of a rank file: `model`, or `model0..` with virtual pipeline.
pub fn chunks(pt: &TorchFile) -> Result<Vec<&Value>> {
    let root = pt.root();
    if let Some(m) = root.get("model") {
        return Ok(vec![m]);
    }
    let mut out = vec![];
    while let Some(m) = root.get(&format!("model{}", out.len())) {
        out.push(m);
    }
    if out.is_empty() {
        bail!("{}: no \"model\" or \"model0\" entry", pt.path().display());
    }
    Ok(out)
}

fn detect_layout(keys: &BTreeMap<String, Value>) -> KeyLayout {
    if keys.keys().any(|k| k.starts_with("language_model.")) {
        KeyLayout::Legacy
    } else if keys.keys().any(|k| k.contains(".layer_norm_weight")) {
        KeyLayout::McoreTe
    } else {
        KeyLayout::Mcore
    }
}

impl MegatronCkpt {
    /// Open every rank file under `dir` (a root with a tracker, or an iteration directory),
    /// detect TP/PP/VPP, layout and dtype, and index the tensors. `family` overrides detection.
    /// LoRA tensors are set aside (counted in `lora_tensors`); wrapped base weights
    /// (`….base_layer.weight`) are read under their plain names.
    pub fn open(dir: &Path, family: Option<&'static Family>) -> Result<Self> {
        Self::index(open_rank_files(dir)?, family)
    }

    fn index(ranks: RankFiles, family: Option<&'static Family>) -> Result<Self> {
        let RankFiles {
            iter_dir,
            files,
            tp,
            ep,
            etp,
            tp_extend,
        } = ranks;
        let pp = files.len();
        let first = &files[0][0];
        let args = match first.root().get("args") {
            Some(Value::Namespace(a)) => a.clone(),
            _ => Vec::new(),
        };
        // flat[p][t][v]: key → value
        let mut flat: Vec<Vec<Vec<BTreeMap<String, Value>>>> = Vec::new();
        let mut layout = None;
        for stage in &files {
            let mut per_tp = Vec::new();
            for f in stage {
                let mut per_chunk = Vec::new();
                for c in chunks(f)? {
                    let mut m = BTreeMap::new();
                    let legacy = is_legacy_chunk(c);
                    flatten(c, legacy, f.path(), &mut m)?;
                    layout.get_or_insert_with(|| detect_layout(&m));
                    per_chunk.push(m);
                }
                per_tp.push(per_chunk);
            }
            flat.push(per_tp);
        }
        let layout = layout.expect("at least one chunk");
        let vpp = flat[0][0].len();
        // Layers per (stage, chunk) from the keys of TP rank 0.
        let mut stage_layers = vec![0usize; pp];
        for (p, stage) in flat.iter().enumerate() {
            if stage[0].len() != vpp {
                bail!(
                    "{}: {} model chunks, rank 0 has {vpp}",
                    files[p][0].path().display(),
                    stage[0].len()
                );
            }
            for chunk in &stage[0] {
                let n = chunk
                    .keys()
                    .filter_map(|k| layout::layer_index(k))
                    .max()
                    .map_or(0, |m| m + 1);
                stage_layers[p] += n;
            }
        }
        let emb_key = layout::flat_key(&layout::global_key(layout, Role::Embedding, false));
        let emb = match flat[0][0][0].get(&emb_key) {
            Some(Value::Tensor(t)) => t.clone(),
            _ => bail!(
                "{}: no embedding tensor {emb_key}",
                files[0][0].path().display()
            ),
        };
        let padded_vocab = emb.shape[0] as usize * tp;
        let mut cfg =
            ModelConfig::from_megatron_args(&args, family, emb.storage.dtype, padded_vocab)
                .with_context(|| format!("{}", files[0][0].path().display()))?;
        let dualpipev = crate::ckpt::config::dualpipev_of(&args)
            .with_context(|| format!("{}", files[0][0].path().display()))?;
        if let Some(m) = &mut cfg.mtp {
            // MindSpeed-LLM keeps the depths' final norms in the block (`mtp.final_layernorms`)
            let last = match dualpipev {
                true => &flat[0][0][1],
                false => &flat[pp - 1][0][vpp - 1],
            };
            if last.contains_key("mtp.layers.0.final_layernorm.weight") {
                m.layout = MtpLayout::Mcore;
            }
        }
        let total: usize = stage_layers.iter().sum();
        if total != cfg.stored_layers() {
            bail!(
                "args say num_layers = {} but the rank files hold {total} layers",
                cfg.stored_layers()
            );
        }
        // a paired model's layers are two decoder layers each
        let stage_layers = stage_layers.iter().map(|n| n * cfg.sublayers()).collect();
        let par = Parallel {
            tp,
            pp,
            vpp,
            stage_layers,
            ep: 1,
            etp: tp,
            tp_extend: false,
            dualpipev: false,
        };
        let par = match dualpipev {
            true => Parallel { vpp: 1, ..par }.with_dualpipev(&cfg),
            false => Ok(par),
        }
        .with_context(|| format!("{}: args.schedules_method", files[0][0].path().display()))?
        .with_experts(&cfg, (ep, if tp_extend { tp } else { etp }))
        .and_then(|p| match tp_extend {
            true => p.with_tp_extend(&cfg),
            false => Ok(p),
        })
        .with_context(|| {
            format!(
                "{}: the expert-parallel rank directories",
                iter_dir.display()
            )
        })?;
        let mut ck = MegatronCkpt {
            iter_dir,
            par,
            layout,
            cfg,
            args,
            padded_vocab,
            lora_tensors: 0,
            grouped: false,
            files,
            index: HashMap::new(),
        };
        ck.build_index(flat)?;
        Ok(ck)
    }

    /// Match every expected key of every chunk to its tensors; check shapes against the config.
    fn build_index(&mut self, flat: Vec<Vec<Vec<BTreeMap<String, Value>>>>) -> Result<()> {
        let grid = self.par.rank_files();
        for (p, stage) in flat.into_iter().enumerate() {
            for (m, mut per_chunk) in stage.into_iter().enumerate() {
                let (t, e) = grid[m];
                let path = self.files[p][m].path().to_path_buf();
                for (v, chunk) in per_chunk.iter_mut().enumerate() {
                    let layers = self.par.chunk_layers(p, v);
                    let mut entries = chunk_entries(
                        self.layout,
                        &self.cfg,
                        &layers,
                        self.par.chunk_ends(p, v),
                        self.par.pp,
                        self.par.expert_block((t, e)),
                    );
                    if chunk.keys().any(|k| layout::is_te_grouped_key(k)) {
                        entries = layout::te_grouped_entries(entries);
                        self.grouped = true;
                    }
                    let mut grouped_keys = Vec::new();
                    for (key, canon) in entries {
                        let key = layout::flat_key(&key);
                        let found = chunk.remove(&key);
                        let Some(canon) = canon else { continue };
                        let ranks = self.par.split_of(canon.role);
                        let want = shard_shape(&self.cfg, canon.role, ranks, self.padded_vocab);
                        let (tensor, transposed) = match found {
                            Some(Value::Tensor(tensor)) => (*tensor, false),
                            _ => match self.grouped_view(chunk, &key, &want)? {
                                Some((g, view)) => {
                                    grouped_keys.push(g);
                                    (view, true)
                                }
                                None => bail!(
                                    "{}: missing tensor {key} (layout {}, {} layers)",
                                    path.display(),
                                    self.layout.name(),
                                    self.cfg.layers
                                ),
                            },
                        };
                        let got: Vec<usize> = match transposed {
                            true => tensor.shape.iter().rev().map(|&n| n as usize).collect(),
                            false => tensor.shape.iter().map(|&n| n as usize).collect(),
                        };
                        if got != want {
                            bail!(
                                "{}: tensor {key} has shape {got:?}, but the checkpoint args \
                                 (hidden {}, heads {}, groups {}, ffn {}, split {ranks} ways) imply {want:?}",
                                path.display(),
                                self.cfg.hidden,
                                self.cfg.heads,
                                self.cfg.groups,
                                self.cfg.ffn
                            );
                        }
                        // Several files hold each shard (the dense tensors on every
                        // expert-parallel rank, whole experts on several TP ranks): the
                        // first's is read.
                        let slot = self.index.entry(canon).or_insert_with(|| (p, Vec::new()));
                        if slot.0 == p && slot.1.len() == t % ranks {
                            slot.1.push(Shard {
                                file: m,
                                key,
                                tensor,
                                transposed,
                            });
                        }
                    }
                    self.grouped |= !grouped_keys.is_empty();
                    grouped_keys.iter().for_each(|g| _ = chunk.remove(g));
                    let tensors = chunk.iter().filter(|(k, v)| {
                        matches!(v, Value::Tensor(_)) && !k.ends_with("_extra_state")
                    });
                    let (lora, leftover): (Vec<&String>, Vec<&String>) =
                        tensors.map(|(k, _)| k).partition(|k| is_lora_key(k));
                    self.lora_tensors += lora.len();
                    if let Some(k) = leftover.first() {
                        bail!(
                            "{}: tensor {k} is not part of a supported {} model ({} more unexpected)",
                            path.display(),
                            self.cfg.family.name,
                            leftover.len() - 1
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// Read and un-shard one canonical tensor with all its vocabulary rows (the padding
    /// included, for a checkpoint's own padded vocabulary).
    pub fn read_padded(&self, c: Canon) -> Result<Tensor> {
        let parts = self.read_shards(c)?;
        let rows = parts.iter().map(|t| t.shape[0]).sum();
        gather_tp(c.role, &parts, rows)
    }

    /// Read and un-shard one canonical tensor.
    pub fn read(&self, c: Canon) -> Result<Tensor> {
        gather_tp(c.role, &self.read_shards(c)?, self.cfg.vocab)
    }

    /// A routed expert's shard (`want`, of per-expert key `key`) as a view of the chunk's
    /// grouped tensor holding it, with that tensor's key; `None` when the chunk has none.
    fn grouped_view(
        &self,
        chunk: &BTreeMap<String, Value>,
        key: &str,
        want: &[usize],
    ) -> Result<Option<(String, TensorRef)>> {
        let Some((g, le)) = grouped_key(key) else {
            return Ok(None);
        };
        let Some(Value::Tensor(t)) = chunk.get(&g) else {
            return Ok(None);
        };
        let blocks = self.par.expert_blocks();
        let local = self.cfg.moe.as_ref().map_or(0, |m| m.experts / blocks);
        Ok(Some((g.clone(), expert_view((&g, t), le, (want, local))?)))
    }

    /// The TP shards of one canonical tensor, in rank order.
    fn read_shards(&self, c: Canon) -> Result<Vec<Tensor>> {
        let (p, shards) = self
            .index
            .get(&c)
            .ok_or_else(|| anyhow!("the checkpoint has no tensor for {c:?}"))?;
        shards
            .iter()
            .map(|s| {
                let t = self.files[*p][s.file].read_tensor(&s.key, &s.tensor)?;
                Ok(if s.transposed { t.transposed() } else { t })
            })
            .collect()
    }

    /// The rank files, stage by stage.
    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().flatten().map(TorchFile::path)
    }

    /// Every rank file with its size and tensors (`.`-joined key, dtype, shape), for `ckpt info`.
    pub fn rank_files(&self) -> Result<Vec<RankFileInfo>> {
        let mut out = Vec::new();
        for f in self.files.iter().flatten() {
            let mut keys = BTreeMap::new();
            for (v, c) in chunks(f)?.into_iter().enumerate() {
                let mut m = BTreeMap::new();
                flatten(c, false, f.path(), &mut m)?;
                for (k, val) in m {
                    if let Value::Tensor(t) = val {
                        let k = if self.par.vpp > 1 {
                            format!("model{v}.{k}")
                        } else {
                            k
                        };
                        keys.insert(k, (t.storage.dtype, t.shape.clone()));
                    }
                }
            }
            let bytes = std::fs::metadata(f.path()).map_or(0, |m| m.len());
            out.push(RankFileInfo {
                path: f.path().to_path_buf(),
                bytes,
                tensors: keys.into_iter().map(|(k, (d, s))| (k, d, s)).collect(),
            });
        }
        Ok(out)
    }
}

/// One rank file as `ckpt info` shows it.
pub struct RankFileInfo {
    /// The file.
    pub path: PathBuf,
    /// Its size.
    pub bytes: u64,
    /// Tensors: key, dtype, shape.
    pub tensors: Vec<(String, DType, Vec<u64>)>,
}
