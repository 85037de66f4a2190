//! Megatron's `torch_dist` checkpoints (megatron-core 0.15 `dist_checkpointing` over torch's
//! distributed checkpoint, DCP; `docs/checkpoints.md` §5): `iter_XXXXXXX/{metadata.json,
//! common.pt, .metadata, __R_K.distcp}`. The `.metadata` index (a pickle of DCP's `Metadata`, read
//! by the allow-list unpickler: its classes rebuilt as data, anything else refused by name) gives
//! each tensor's global shape and the chunks that tile it, each a whole `torch.save` archive at a
//! byte range of a `.distcp` file. A tensor is read by copying the parts of the chunks that hold
//! the asked region into one buffer: memory is the region and one chunk, never the checkpoint.
//!
//! What each global tensor is in the model ([`keys`]): the sharded state dict's names
//! (megatron-core's `sharded_state_dict`; the local spec's norms under Transformer Engine's names),
//! layers stacked along a leading axis or keyed one by one, routed experts along another.

mod keys;
mod write;

pub use keys::{chained_prefix, placement, Placement, OPTIMIZER_STATE};
pub use write::{
    dist_args, extra_state_fqns, write_common, write_index, ChunkAt, ChunkRecord, DistTarget,
    ItemFile,
};

use super::config::arg_uint;
use super::layout::Parallel;
use super::torch::pickle::{self, DcpClass, Object, TensorRef, Value};
use super::torch::TorchFile;
use super::transform::gather_tp;
use crate::arch::family::Family;
use crate::arch::roles::{canonical, Canon, Role};
use crate::arch::{ModelConfig, MtpLayout};
use crate::tensor::host::Tensor;
use crate::tensor::DType;
use anyhow::{anyhow, bail, Context, Result};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

/// The index's name in an iteration directory.
const METADATA: &str = ".metadata";
/// The file naming the backends (its presence marks the format).
const METADATA_JSON: &str = "metadata.json";
/// The non-sharded state (args, iteration, scheduler).
const COMMON: &str = "common.pt";
/// Bytes the `.metadata` pickle may have: a 671B model's index is tens of megabytes.
const MAX_METADATA_BYTES: u64 = 1 << 30;
/// Dimensions a global tensor may have.
const MAX_DIMS: usize = 8;

/// Whether `dir` (a checkpoint root with a tracker, or an iteration directory) holds a
/// `torch_dist` checkpoint.
pub fn is_torch_dist(dir: &Path) -> bool {
    iteration_dir(dir).is_ok_and(|d| d.join(METADATA_JSON).is_file())
}

/// The iteration directory of a root (its tracker's iteration), or `dir` itself.
fn iteration_dir(dir: &Path) -> Result<PathBuf> {
    if dir.join(METADATA_JSON).is_file() {
        return Ok(dir.to_path_buf());
    }
    let tracker = dir.join(super::megatron::TRACKER);
    let text = std::fs::read_to_string(&tracker)
        .with_context(|| format!("reading {}", tracker.display()))?;
    let sub = match text.trim() {
        "release" => "release".to_string(),
        t => format!(
            "iter_{:07}",
            t.parse::<u64>().map_err(|_| anyhow!(
                "{}: expected an iteration number or \"release\", found {t:?}",
                tracker.display()
            ))?
        ),
    };
    Ok(dir.join(sub))
}

/// One chunk of a global tensor: where it sits and where its bytes are.
#[derive(Debug, Clone)]
struct Chunk {
    offsets: Vec<usize>,
    sizes: Vec<usize>,
    /// The `.distcp` file and the byte range of its item.
    file: usize,
    range: std::ops::Range<u64>,
}

/// Where one `ShardedObject` (a byte item: `torch.save` of the object) is stored: its `.distcp`
/// file and byte range.
#[derive(Debug, Clone)]
struct StoredObject {
    file: usize,
    range: std::ops::Range<u64>,
}

/// What a checkpoint's index names: its data files, global tensors and objects.
struct Index {
    files: Vec<PathBuf>,
    tensors: BTreeMap<String, GlobalTensor>,
    objects: BTreeMap<String, StoredObject>,
}

/// A global tensor of the checkpoint.
#[derive(Debug, Clone)]
pub struct GlobalTensor {
    /// Element type.
    pub dtype: DType,
    /// Global shape (as stored: reformulated when `flattened`).
    pub shape: Vec<usize>,
    /// The original global shape of an N-D flattened tensor — megatron-core's
    /// `flattened_range` ShardedTensors (the distributed optimizer's deprecated
    /// `fully_sharded_model_space` state), stored as `[X/x, Y/y, …, x·y·…]`, one row per
    /// local chunk of local shape `[x, y, …]` (dist_checkpointing/strategies/torch.py
    /// `_mcore_to_torch_sharded_tensor`; `mcore_data[key]['nd_reformulated_orig_global_shape']`).
    pub flattened: Option<Vec<usize>>,
    chunks: Vec<Chunk>,
}

impl GlobalTensor {
    /// Its global shape: the original one of an N-D flattened tensor.
    pub fn global_shape(&self) -> &[usize] {
        self.flattened.as_deref().unwrap_or(&self.shape)
    }

    /// The chunks it is saved in.
    pub fn chunks(&self) -> usize {
        self.chunks.len()
    }
}

/// An opened `torch_dist` checkpoint.
pub struct TorchDistCkpt {
    /// The iteration directory.
    pub iter_dir: PathBuf,
    /// Model architecture (from `common.pt`'s args).
    pub cfg: ModelConfig,
    /// `args` of `common.pt`.
    pub args: Vec<(String, Value)>,
    /// The parallel layout the args say it was saved with (TP, PP, EP; `torch_dist` reshards
    /// on load, so any layout reads it).
    pub par: Parallel,
    /// Rows of the padded vocabulary (the embedding's global rows).
    pub padded_vocab: usize,
    files: Vec<PathBuf>,
    tensors: BTreeMap<String, GlobalTensor>,
    objects: BTreeMap<String, StoredObject>,
    /// Canonical tensor → the global tensor holding it and the leading indices that select it.
    index: HashMap<Canon, (String, Vec<usize>)>,
    /// Whether the optimizer's state is saved, and how (`ckpt info`).
    pub optimizer: Option<String>,
    /// How many chained optimizers' states the save holds, each under its
    /// [`keys::chained_prefix`] (0: not chained).
    pub chained_optimizers: usize,
}

impl TorchDistCkpt {
    /// Open the checkpoint in `dir`: its backends, args and index checked, every tensor of the
    /// model found (`family` overrides the detection).
    pub fn open(dir: &Path, family: Option<&'static Family>) -> Result<Self> {
        let iter_dir = iteration_dir(dir)?;
        check_backends(&iter_dir.join(METADATA_JSON))?;
        let common_path = iter_dir.join(COMMON);
        let common = TorchFile::open(&common_path)?;
        let args = match common.root().get("args") {
            Some(Value::Namespace(a)) => a.clone(),
            _ => bail!("{}: no args Namespace", common_path.display()),
        };
        let meta_path = iter_dir.join(METADATA);
        let Index {
            files,
            tensors,
            objects,
        } = read_index(&iter_dir, &meta_path)?;
        let emb = tensors
            .get(keys::EMBEDDING)
            .ok_or_else(|| anyhow!("{}: no tensor {}", meta_path.display(), keys::EMBEDDING))?;
        let padded_vocab = emb.shape[0];
        let mut cfg = ModelConfig::from_megatron_args(&args, family, emb.dtype, padded_vocab)
            .with_context(|| common_path.display().to_string())?;
        if cfg.paired {
            bail!(
                "{}: args.spec is MindSpeed-LLM's longcat_spec, whose layer torch_dist is not read \
                 for (save it with --ckpt-format torch)",
                common_path.display()
            );
        }
        if let Some(m) = &mut cfg.mtp {
            // megatron-core keeps each depth's final norm in its layer, MindSpeed-LLM in the block
            if tensors.contains_key("mtp.layers.0.final_layernorm.weight") {
                m.layout = MtpLayout::Mcore;
            }
        }
        let size = |name| -> Result<usize> {
            Ok(arg_uint(&args, name)
                .with_context(|| common_path.display().to_string())?
                .unwrap_or(1)
                .max(1))
        };
        let (tp, pp, ep) = (
            size("tensor_model_parallel_size")?,
            size("pipeline_model_parallel_size")?,
            size("expert_model_parallel_size")?,
        );
        let par = Parallel::new(&cfg, tp, pp.min(cfg.layers.max(1)), 1, (None, None))
            .and_then(|p| p.with_experts(&cfg, (ep, tp)))
            .unwrap_or(Parallel {
                tp: 1,
                pp: 1,
                vpp: 1,
                stage_layers: vec![cfg.layers],
                ep: 1,
                etp: 1,
                tp_extend: false,
                dualpipev: false,
            });
        let (optimizer, chained_optimizers) = keys::optimizer_kind(
            (tensors.iter()).map(|(k, t)| (k.as_str(), t.flattened.is_some())),
        );
        let mut ck = TorchDistCkpt {
            iter_dir,
            cfg,
            args,
            par,
            padded_vocab,
            files,
            tensors,
            objects,
            index: HashMap::new(),
            optimizer,
            chained_optimizers,
        };
        ck.build_index(&meta_path)?;
        Ok(ck)
    }

    /// Find every canonical tensor's global tensor; every model tensor must be claimed.
    fn build_index(&mut self, meta_path: &Path) -> Result<()> {
        let mut used = HashSet::new();
        for c in canonical(&self.cfg) {
            // a tied output layer is the embedding
            let source = match c.role == Role::Output && self.cfg.tied {
                true => Canon {
                    role: Role::Embedding,
                    layer: None,
                },
                false => c,
            };
            let candidates = keys::candidates(&self.cfg, source);
            let found = candidates.iter().find(|(name, at)| {
                self.tensors
                    .get(name)
                    .is_some_and(|t| t.shape.len() > at.len())
            });
            let Some((name, at)) = found else {
                bail!(
                    "{}: no tensor holds {c:?} (looked for {})",
                    meta_path.display(),
                    candidates
                        .iter()
                        .map(|(n, at)| format!("{n}{at:?}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            };
            let t = &self.tensors[name];
            if at.iter().zip(&t.shape).any(|(&i, &n)| i >= n) {
                bail!(
                    "{}: {name} {:?} has no entry {at:?} for {c:?}",
                    meta_path.display(),
                    t.shape
                );
            }
            used.insert(name.clone());
            self.index.insert(c, (name.clone(), at.clone()));
        }
        if let Some(extra) =
            (self.tensors.keys()).find(|k| !used.contains(*k) && !keys::is_not_model(k))
        {
            bail!(
                "{}: tensor {extra} is not part of a supported {} model",
                meta_path.display(),
                self.cfg.family.name
            );
        }
        Ok(())
    }

    /// Read one canonical tensor (the vocabulary cut to the model's rows).
    pub fn read(&self, c: Canon) -> Result<Tensor> {
        let mut t = self.read_padded(c)?;
        let vocab = self.cfg.vocab;
        match c.role {
            // the padding cut off in place (a copy would double the largest tensor)
            r if r.vocab_rows() && t.shape[0] >= vocab => {
                t.data.truncate(vocab * t.row_bytes());
                t.shape[0] = vocab;
                Ok(t)
            }
            r if r.vocab_rows() => gather_tp(c.role, &[t], vocab),
            _ => Ok(t),
        }
    }

    /// Read one canonical tensor with all its vocabulary rows.
    pub fn read_padded(&self, c: Canon) -> Result<Tensor> {
        let (name, at) = self
            .index
            .get(&c)
            .ok_or_else(|| anyhow!("the checkpoint has no tensor for {c:?}"))?;
        self.region(name, at)
    }

    /// The optimizer's state `state` (`exp_avg`, `exp_avg_sq`, `fp32_param`) of one canonical
    /// tensor, model-shaped (megatron-core's non-distributed optimizer, or the distributed
    /// one's `fully_reshardable` form), with all its vocabulary rows; `None` when the
    /// checkpoint holds no such state.
    pub fn read_state(&self, state: &str, c: Canon) -> Result<Option<Tensor>> {
        let (name, at) = self
            .index
            .get(&c)
            .ok_or_else(|| anyhow!("the checkpoint has no tensor for {c:?}"))?;
        let key = format!("{}{state}.{name}", keys::OPTIMIZER_STATE);
        // under chained optimizers' prefixes where a save added them
        let chains = (0..self.chained_optimizers).map(|i| keys::chained_prefix(i) + &key);
        let Some(key) = std::iter::once(key.clone())
            .chain(chains)
            .find(|k| self.tensors.contains_key(k))
        else {
            return Ok(None);
        };
        let (t, param) = (&self.tensors[&key], &self.tensors[name]);
        if t.global_shape() != param.shape {
            bail!(
                "{}: {key} has shape {:?}, its parameter {:?}",
                self.iter_dir.join(METADATA).display(),
                t.global_shape(),
                param.shape
            );
        }
        match t.flattened {
            Some(_) => self.flattened_region(&key, at).map(Some),
            None => self.region(&key, at).map(Some),
        }
    }

    /// The distributed optimizer's `dp_reshardable` state `state` (`param`, `exp_avg`,
    /// `exp_avg_sq`) of data-parallel group `group` of the optimizer whose keys start with
    /// `chain` ([`keys::chained_prefix`], or empty): each bucket's 1-D tensor of its unpadded
    /// elements, buffer after buffer, bucket after bucket; empty when the checkpoint has none.
    pub fn dp_bucket_states(&self, chain: &str, group: usize, state: &str) -> Result<Vec<Tensor>> {
        let prefix = keys::dp_bucket_prefix(chain, group);
        let mut found: Vec<((usize, usize), &str)> = (self.tensors.keys())
            .filter_map(|k| {
                let rest = k.strip_prefix(&prefix)?;
                Some((keys::dp_bucket_of(rest, state)?, k.as_str()))
            })
            .collect();
        found.sort();
        let index = self.iter_dir.join(METADATA);
        if let Some(((b, k), key)) = found.first().filter(|(first, _)| *first != (0, 0)) {
            bail!(
                "{}: {key} is the first bucket of data-parallel group {group} ({b}, {k}), not \
                 buffer 0's bucket 0",
                index.display()
            );
        }
        for pair in found.windows(2) {
            let [(a, _), (b, key)] = pair else { continue };
            let next = (a.0 == b.0 && b.1 == a.1 + 1) || (b.0 == a.0 + 1 && b.1 == 0);
            if !next {
                bail!(
                    "{}: {key} follows bucket {a:?}: the buckets of a buffer must run from 0 \
                     without gaps, one dtype each",
                    index.display()
                );
            }
        }
        (found.into_iter())
            .map(|(_, key)| match self.tensors[key].shape.len() {
                1 => self.region(key, &[]),
                _ => bail!("{}: {key} is not 1-D", index.display()),
            })
            .collect()
    }

    /// The object `ShardedObject` `fqn` holds (`{key}/shard_{offsets}_{shape}`, megatron-core
    /// dist_checkpointing/mapping.py `ShardedObject.unique_key`), read by the safe unpickler;
    /// `None` when the checkpoint has no such object.
    pub fn object(&self, fqn: &str) -> Result<Option<Value>> {
        let Some(at) = self.objects.get(fqn) else {
            return Ok(None);
        };
        let item = TorchFile::open_item(&self.files[at.file], at.range.clone())
            .with_context(|| format!("{}: object {fqn}", self.files[at.file].display()))?;
        Ok(Some(item.root().clone()))
    }

    /// `common.pt`: args, iteration, scheduler and the optimizer's non-sharded state.
    pub fn common(&self) -> Result<TorchFile> {
        Ok(TorchFile::open(&self.iter_dir.join(COMMON))?)
    }

    /// The part of global tensor `name` at leading indices `at` (all of the other dimensions),
    /// copied out of every chunk that holds some of it.
    fn region(&self, name: &str, at: &[usize]) -> Result<Tensor> {
        let t = &self.tensors[name];
        let shape = t.shape[at.len()..].to_vec();
        let size = t.dtype.size();
        let mut out = vec![0u8; shape.iter().product::<usize>() * size];
        for chunk in &t.chunks {
            let holds = (at.iter().enumerate())
                .all(|(d, &i)| (chunk.offsets[d]..chunk.offsets[d] + chunk.sizes[d]).contains(&i));
            if !holds {
                continue;
            }
            let path = &self.files[chunk.file];
            let item = TorchFile::open_item(path, chunk.range.clone())?;
            let what = format!("{name} chunk at {:?}", chunk.offsets);
            let Value::Tensor(tr) = item.root() else {
                bail!("{}: {what}: the item is not a tensor", path.display());
            };
            check_item(tr, chunk, t.dtype)
                .with_context(|| format!("{}: {what}", path.display()))?;
            // the chunk's block at the leading indices, read alone; then its place in the
            // region, or the region itself when the block is all of it
            let lead: usize = (at.iter().enumerate())
                .map(|(d, &i)| {
                    (i - chunk.offsets[d]) * chunk.sizes[d + 1..].iter().product::<usize>()
                })
                .sum();
            let inner = &chunk.sizes[at.len()..];
            let (from, len) = (lead * size, inner.iter().product::<usize>() * size);
            if inner == shape.as_slice() {
                item.read_tensor_part(&what, tr, from, &mut out)?;
                continue;
            }
            let mut block = vec![0u8; len];
            item.read_tensor_part(&what, tr, from, &mut block)?;
            place(
                &mut out,
                &shape,
                (&block, inner),
                &chunk.offsets[at.len()..],
                size,
            );
        }
        Ok(Tensor::new(t.dtype, shape, out))
    }

    /// [`Self::region`] of N-D flattened tensor `name` ([`GlobalTensor::flattened`]): each
    /// local chunk's row of the reformulated tensor that holds some of the region read, and
    /// its block put in place.
    fn flattened_region(&self, name: &str, at: &[usize]) -> Result<Tensor> {
        let t = &self.tensors[name];
        let orig = t.global_shape();
        let local: Vec<usize> = orig.iter().zip(&t.shape).map(|(o, f)| o / f).collect();
        let (shape, inner) = (&orig[at.len()..], &local[at.len()..]);
        let size = t.dtype.size();
        let mut out = vec![0u8; shape.iter().product::<usize>() * size];
        // the element of the leading indices in a local chunk, and its block's length
        let skip: usize = (at.iter().enumerate())
            .map(|(d, &i)| i % local[d] * local[d + 1..].iter().product::<usize>())
            .sum();
        let len = inner.iter().product::<usize>();
        let grid = &t.shape[at.len()..orig.len()];
        for k in 0..grid.iter().product::<usize>() {
            let mut fragment: Vec<usize> = at.iter().zip(&local).map(|(i, l)| i / l).collect();
            let mut rest = k;
            let tail: Vec<usize> = (grid.iter().rev())
                .map(|&g| {
                    let i = rest % g;
                    rest /= g;
                    i
                })
                .collect();
            fragment.extend(tail.iter().rev());
            let row = self.region(name, &fragment)?;
            let block = &row.data[skip * size..(skip + len) * size];
            let offsets: Vec<usize> = (fragment[at.len()..].iter().zip(inner))
                .map(|(f, l)| f * l)
                .collect();
            place(&mut out, shape, (block, inner), &offsets, size);
        }
        Ok(Tensor::new(t.dtype, shape.to_vec(), out))
    }

    /// The `.distcp` files and the index, for `ckpt info`.
    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(PathBuf::as_path)
    }

    /// Every global tensor: name, dtype, shape (`ckpt info --keys`).
    pub fn tensors(&self) -> impl Iterator<Item = (&str, &GlobalTensor)> {
        self.tensors.iter().map(|(k, v)| (k.as_str(), v))
    }
}

/// The index of iteration directory `iter_dir` read and checked, and every chunk's item opened
/// and its tensor read (the fuzz target's walk: everything but the model's names); returns the
/// chunks read.
pub fn read_every_chunk(iter_dir: &Path) -> Result<usize> {
    let Index { files, tensors, .. } = read_index(iter_dir, &iter_dir.join(METADATA))?;
    let mut n = 0;
    for (name, t) in &tensors {
        for chunk in &t.chunks {
            let path = &files[chunk.file];
            let item = TorchFile::open_item(path, chunk.range.clone())?;
            let Value::Tensor(tr) = item.root() else {
                bail!("{name}: an item is not a tensor");
            };
            check_item(tr, chunk, t.dtype)?;
            item.read_tensor(name, tr)?;
            n += 1;
        }
    }
    Ok(n)
}

/// `metadata.json` names torch_dist as the sharded backend (megatron-core
/// dist_checkpointing/core.py `CheckpointingConfig`).
fn check_backends(path: &Path) -> Result<()> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: not valid JSON", path.display()))?;
    match json.get("sharded_backend").and_then(|v| v.as_str()) {
        Some("torch_dist") => Ok(()),
        other => bail!(
            "{}: sharded_backend {other:?}: only torch_dist checkpoints are read (zarr is \
             deprecated in megatron-core)",
            path.display()
        ),
    }
}

/// The `.distcp` files and every tensor of the index of `iter_dir`, checked: chunks inside their
/// tensor, tiling it exactly, each stored in a file of the directory within its bounds.
fn read_index(iter_dir: &Path, path: &Path) -> Result<Index> {
    let len = std::fs::metadata(path)
        .with_context(|| format!("reading {}", path.display()))?
        .len();
    if len > MAX_METADATA_BYTES {
        bail!(
            "{}: {len} bytes, more than any checkpoint's index",
            path.display()
        );
    }
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let root = pickle::parse(&bytes).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    index_of(iter_dir, &root).with_context(|| path.display().to_string())
}

/// [`read_index`] of the unpickled `.metadata`.
fn index_of(iter_dir: &Path, root: &Value) -> Result<Index> {
    let meta = object(root, DcpClass::Metadata, "the index")?;
    let attr = |o: &Object, name: &str| -> Result<Value> {
        o.get(name)
            .cloned()
            .ok_or_else(|| anyhow!("{:?} has no {name}", o.class))
    };
    let Value::Dict(storage) = attr(meta, "storage_data")? else {
        bail!("storage_data is not a dict");
    };
    // (fqn, chunk offsets) → (file name, byte range)
    let mut stored: HashMap<(String, Vec<usize>), (String, std::ops::Range<u64>)> = HashMap::new();
    for (k, v) in &storage {
        let key = object(k, DcpClass::MetadataIndex, "a storage_data key")?;
        let fqn = string(key.get("fqn"), "MetadataIndex.fqn")?;
        let offsets = match key.get("offset") {
            None | Some(Value::None) => Vec::new(),
            Some(v) => uints(v, "MetadataIndex.offset")?,
        };
        let info = object(v, DcpClass::StorageInfo, "a storage_data value")?;
        let file = string(info.get("relative_path"), "_StorageInfo.relative_path")?;
        let (at, n) = (
            uint(info.get("offset"), "_StorageInfo.offset")? as u64,
            uint(info.get("length"), "_StorageInfo.length")? as u64,
        );
        let end = at
            .checked_add(n)
            .ok_or_else(|| anyhow!("{fqn}: storage range overflows"))?;
        stored.insert((fqn, offsets), (file, at..end));
    }
    let Value::Dict(entries) = attr(meta, "state_dict_metadata")? else {
        bail!("state_dict_metadata is not a dict");
    };
    let mut files = DataFiles::default();
    let mut tensors = BTreeMap::new();
    let mut objects = BTreeMap::new();
    for (k, v) in &entries {
        let Value::Str(fqn) = k else {
            bail!("a state_dict_metadata key is not a string");
        };
        let Value::Object(o) = v else {
            bail!("{fqn}: not a storage metadata object");
        };
        if o.class == DcpClass::BytesStorage {
            let (file, range) = stored
                .get(&(fqn.clone(), Vec::new()))
                .cloned()
                .ok_or_else(|| anyhow!("{fqn}: no storage for the object"))?;
            let file = files.id(iter_dir, &file, &range, fqn)?;
            objects.insert(fqn.clone(), StoredObject { file, range });
            continue;
        }
        let o = object(v, DcpClass::TensorStorage, fqn)?;
        let shape = uints(&attr(o, "size")?, &format!("{fqn}: size"))?;
        if shape.len() > MAX_DIMS {
            bail!("{fqn}: {} dimensions", shape.len());
        }
        let dtype = tensor_dtype(o).with_context(|| fqn.clone())?;
        let Value::List(chunk_list) = attr(o, "chunks")? else {
            bail!("{fqn}: chunks is not a list");
        };
        let mut chunks = Vec::with_capacity(chunk_list.len());
        for c in &chunk_list {
            let c = object(c, DcpClass::Chunk, fqn)?;
            let offsets = uints(&attr(c, "offsets")?, &format!("{fqn}: chunk offsets"))?;
            let sizes = uints(&attr(c, "sizes")?, &format!("{fqn}: chunk sizes"))?;
            let (file, range) = stored
                .get(&(fqn.clone(), offsets.clone()))
                .cloned()
                .ok_or_else(|| anyhow!("{fqn}: no storage for its chunk at {offsets:?}"))?;
            let what = format!("{fqn}: chunk at {offsets:?}");
            let id = files.id(iter_dir, &file, &range, &what)?;
            chunks.push(Chunk {
                offsets,
                sizes,
                file: id,
                range,
            });
        }
        check_tiling(&shape, &chunks).with_context(|| fqn.clone())?;
        tensors.insert(
            fqn.clone(),
            GlobalTensor {
                dtype,
                shape,
                flattened: None,
                chunks,
            },
        );
    }
    if let Some(v) = meta.get("mcore_data") {
        flattened_shapes(v, &mut tensors)?;
    }
    Ok(Index {
        files: files.paths,
        tensors,
        objects,
    })
}

/// The original shapes `mcore_data` (megatron-core's `MCoreMetadata`) records of its N-D
/// flattened tensors, checked against their reformulated shapes and set on `tensors`.
fn flattened_shapes(
    mcore_data: &Value,
    tensors: &mut BTreeMap<String, GlobalTensor>,
) -> Result<()> {
    let Value::Dict(entries) = mcore_data else {
        bail!("mcore_data is not a dict");
    };
    for (k, v) in entries {
        let Value::Str(fqn) = k else {
            bail!("an mcore_data key is not a string");
        };
        let Some(shape) = v.get("nd_reformulated_orig_global_shape") else {
            continue;
        };
        let what = format!("mcore_data[{fqn}]");
        let orig = uints(shape, &what)?;
        let t = (tensors.get_mut(fqn))
            .ok_or_else(|| anyhow!("{what}: the index has no such tensor"))?;
        let (n, stored) = (orig.len(), &t.shape);
        // [X/x, …, x·…]: each dimension a whole number of local chunks, the last their size
        let regular = stored.len() == n + 1
            && (orig.iter().zip(stored)).all(|(&o, &f)| f > 0 && o % f == 0)
            && (orig.iter().zip(stored))
                .map(|(&o, &f)| o / f)
                .try_fold(1usize, |acc, x| acc.checked_mul(x))
                == Some(stored[n]);
        if !regular {
            bail!(
                "{what}: original shape {orig:?} is not the reformulated {stored:?} of an N-D \
                 flattened tensor ([X/x, …, x·…])"
            );
        }
        t.flattened = Some(orig);
    }
    Ok(())
}

/// The data files an index names, each checked once: its path and size by name.
#[derive(Default)]
struct DataFiles {
    paths: Vec<PathBuf>,
    by_name: HashMap<String, (usize, u64)>,
}

impl DataFiles {
    /// The number of data file `file` of `iter_dir`, which must hold `range` (of `what`).
    fn id(
        &mut self,
        iter_dir: &Path,
        file: &str,
        range: &std::ops::Range<u64>,
        what: &str,
    ) -> Result<usize> {
        if file.is_empty() || file.contains('/') || file.contains('\\') || file.starts_with('.') {
            bail!("{what}: stored in {file:?}, not a file of the checkpoint directory");
        }
        let n = self.paths.len();
        let &mut (id, size) = match self.by_name.entry(file.to_string()) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let path = iter_dir.join(file);
                let size = std::fs::metadata(&path)
                    .with_context(|| format!("{what}: its file {}", path.display()))?
                    .len();
                self.paths.push(path);
                e.insert((n, size))
            }
        };
        if range.end > size {
            bail!(
                "{what}: stored at bytes {}..{} of {file}, which has {size}",
                range.start,
                range.end
            );
        }
        Ok(id)
    }
}

/// The chunks lie inside `shape`, overlap nowhere and cover it (their volumes add up to it).
fn check_tiling(shape: &[usize], chunks: &[Chunk]) -> Result<()> {
    let mut covered: u128 = 0;
    for (i, c) in chunks.iter().enumerate() {
        if c.offsets.len() != shape.len() || c.sizes.len() != shape.len() {
            bail!(
                "chunk {i} has {} dimensions, the tensor {}",
                c.offsets.len(),
                shape.len()
            );
        }
        let inside = (c.offsets.iter().zip(&c.sizes).zip(shape))
            .all(|((&o, &s), &n)| o.checked_add(s).is_some_and(|e| e <= n));
        if !inside {
            bail!(
                "chunk at {:?} of {:?} runs outside the tensor {shape:?}",
                c.offsets,
                c.sizes
            );
        }
        for d in &chunks[..i] {
            let overlap = (c.offsets.iter().zip(&c.sizes))
                .zip(d.offsets.iter().zip(&d.sizes))
                .all(|((&a, &n), (&b, &m))| a < b + m && b < a + n);
            if overlap && c.sizes.iter().all(|&n| n > 0) {
                bail!("chunks at {:?} and {:?} overlap", d.offsets, c.offsets);
            }
        }
        covered += c.sizes.iter().map(|&n| n as u128).product::<u128>();
    }
    let total: u128 = shape.iter().map(|&n| n as u128).product();
    if covered != total {
        bail!("its chunks cover {covered} of its {total} elements (missing chunks)");
    }
    Ok(())
}

/// The stored item is the chunk: its shape and dtype.
fn check_item(t: &TensorRef, chunk: &Chunk, dtype: DType) -> Result<()> {
    let shape: Vec<usize> = t.shape.iter().map(|&n| n as usize).collect();
    if shape != chunk.sizes || t.storage.dtype != dtype {
        bail!(
            "the item holds a {} tensor {shape:?}, the index says {} {:?}",
            t.storage.dtype.torch_name(),
            dtype.torch_name(),
            chunk.sizes
        );
    }
    Ok(())
}

/// Copy `block` (row-major, shape `inner`) into `out` (row-major, shape `shape`) at `offsets`,
/// `size` bytes per element.
fn place(
    out: &mut [u8],
    shape: &[usize],
    (block, inner): (&[u8], &[usize]),
    offsets: &[usize],
    size: usize,
) {
    let Some((&last, outer)) = inner.split_last() else {
        out[..size].copy_from_slice(&block[..size]);
        return;
    };
    let row = last * size;
    let rows: usize = outer.iter().product();
    for r in 0..rows {
        // r's index in the block's outer dimensions, then its place in the tensor
        let (mut rest, mut at) = (r, 0);
        for d in (0..outer.len()).rev() {
            let i = rest % outer[d];
            rest /= outer[d];
            at += (i + offsets[d]) * shape[d + 1..].iter().product::<usize>();
        }
        at += offsets[outer.len()];
        out[at * size..at * size + row].copy_from_slice(&block[r * row..(r + 1) * row]);
    }
}

fn object<'a>(v: &'a Value, class: DcpClass, what: &str) -> Result<&'a Object> {
    match v {
        Value::Object(o) if o.class == class => Ok(o),
        _ => bail!("{what}: expected a {class:?} object"),
    }
}

fn string(v: Option<&Value>, what: &str) -> Result<String> {
    match v {
        Some(Value::Str(s)) => Ok(s.clone()),
        _ => bail!("{what} is not a string"),
    }
}

fn uint(v: Option<&Value>, what: &str) -> Result<usize> {
    match v {
        Some(Value::Int(i)) if *i >= 0 => Ok(*i as usize),
        _ => bail!("{what} is not a non-negative integer"),
    }
}

fn uints(v: &Value, what: &str) -> Result<Vec<usize>> {
    match v {
        Value::Tuple(items) | Value::List(items) => {
            items.iter().map(|i| uint(Some(i), what)).collect()
        }
        _ => bail!("{what} is not a tuple of integers"),
    }
}

/// A tensor's dtype from its `TensorProperties` state `(dtype, layout, requires_grad,
/// memory_format, pin_memory)`, or its `dtype` attribute.
fn tensor_dtype(o: &Object) -> Result<DType> {
    let props = o
        .get("properties")
        .ok_or_else(|| anyhow!("no properties"))?;
    let props = object(props, DcpClass::TensorProperties, "properties")?;
    let dtype = match (props.get(Object::STATE), props.get("dtype")) {
        (Some(Value::Tuple(state)), _) => state.first(),
        (_, d) => d,
    };
    match dtype {
        Some(Value::TorchDType(d)) => Ok(*d),
        _ => bail!("properties name no torch dtype"),
    }
}
