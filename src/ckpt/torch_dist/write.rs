//! Writing Megatron's `torch_dist` checkpoints as megatron-core 0.15.3 loads them with the
//! local spec (`--ckpt-format torch_dist`): every canonical tensor a chunk of its global
//! tensor ([`keys::placement`]), each chunk one `torch.save` item appended to `__0_0.distcp`
//! (one tensor in memory at a time), every linear layer's `_extra_state` object item
//! (megatron-core's local linears save `None` there, and loading asks for it), then the
//! `.metadata` index (DCP's `Metadata` as megatron-core's `MCoreMetadata`), `common.pt` and
//! `metadata.json`, the tracker last. The directory is written whole or not at all by the
//! caller's temporary output.

use super::{keys, COMMON, METADATA, METADATA_JSON};
use crate::arch::roles::{canonical, canonical_shape, Canon};
use crate::arch::ModelConfig;
use crate::ckpt::config::{megatron_args, ParallelArgs};
use crate::ckpt::layout::Parallel;
use crate::ckpt::megatron::TRACKER;
use crate::ckpt::torch::pickle::Value;
use crate::ckpt::torch::save::{contiguous, write_archive, Pickler, PtWriter};
use crate::tensor::host::Tensor;
use crate::tensor::DType;
use anyhow::{anyhow, bail, Context, Result};
use std::collections::BTreeMap;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::Path;

/// The one data file written.
const DATA_FILE: &str = "__0_0.distcp";
/// The iteration written (as the torch format's conversions write).
const ITERATION: u64 = 1;
/// DCP's module of its index classes.
const DCP: &str = "torch.distributed.checkpoint.metadata";
/// The names of megatron-core's linear modules (ColumnParallelLinear, RowParallelLinear), each
/// with an `_extra_state`.
const LINEARS: [&str; 10] = [
    "linear_qkv",
    "linear_proj",
    "linear_fc1",
    "linear_fc2",
    "linear_q_proj",
    "linear_q_down_proj",
    "linear_q_up_proj",
    "linear_kv_down_proj",
    "linear_kv_up_proj",
    "eh_proj",
];

/// What to write.
pub struct DistTarget<'a> {
    /// Architecture (dtype = target dtype).
    pub cfg: &'a ModelConfig,
    /// The parallel layout the args record (the tensors are global: any layout loads them).
    pub par: &'a Parallel,
    /// `--make-vocab-size-divisible-by`.
    pub divisible_by: usize,
    /// Source args to keep (Megatron → Megatron), else empty.
    pub base_args: &'a [(String, Value)],
    /// Where the checkpoint will be once in place (the index records it, as DCP's
    /// `checkpoint_id`).
    pub final_dir: &'a Path,
    /// The args record grouped experts (`moe_grouped_gemm`): megatron-core's GroupedMLP
    /// shards its weights as SequentialMLP's, expert by expert, so the tensors are the same.
    pub grouped: bool,
}

/// A stored item: its data file (in the iteration directory) and byte range there.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Stored {
    file: String,
    offset: u64,
    length: u64,
}

/// A chunk written of a global tensor, as the index records it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ChunkRecord {
    /// The global tensor's key.
    pub key: String,
    /// Its element type's torch name.
    dtype: String,
    /// Its global shape.
    shape: Vec<usize>,
    /// Where the chunk starts.
    offsets: Vec<usize>,
    /// The chunk's shape.
    sizes: Vec<usize>,
    /// How many of the leading axes index layers or experts (one item each).
    lead: usize,
    /// Its bytes.
    item: Stored,
}

/// A global tensor: element type, shape and its chunks (offsets, sizes, item).
struct Global {
    dtype: DType,
    shape: Vec<usize>,
    chunks: Vec<(Vec<usize>, Vec<usize>, Stored)>,
}

/// Where a tensor goes: its global tensor's key, the leading indices that select it and those
/// axes' sizes, its own global shape (vocabulary padded) and where the tensor written starts
/// in it.
pub struct ChunkAt<'a> {
    /// The global tensor's key.
    pub key: &'a str,
    /// Indices on the leading axes (stacked layers, experts).
    pub at: &'a [usize],
    /// Those axes' sizes.
    pub lead: &'a [usize],
    /// The shape under the leading axes.
    pub shape: &'a [usize],
    /// The written tensor's offsets in that shape.
    pub offsets: &'a [usize],
}

/// The data file as the sink of one archive at a time: positions counted from the open
/// archive's start, as a stream's are; the position kept here, so that asking for it (as the
/// zip writer does for every record) does not flush the buffer. After a write error it takes
/// bytes without writing them: the zip writer's drop, finishing the archive, then has nothing
/// to fail on and print (the error has already been returned; the directory is discarded).
struct DataFile {
    file: BufWriter<std::fs::File>,
    /// Where the open archive starts.
    base: u64,
    /// The absolute position.
    pos: u64,
    /// The file's length.
    len: u64,
    failed: bool,
}

impl DataFile {
    /// `result`, remembering a failure.
    fn note<T>(&mut self, result: std::io::Result<T>) -> std::io::Result<T> {
        self.failed |= result.is_err();
        result
    }
}

impl Write for DataFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = match self.failed {
            true => buf.len(),
            false => {
                let written = self.file.write(buf);
                self.note(written)?
            }
        };
        self.pos += n as u64;
        self.len = self.len.max(self.pos);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self.failed {
            true => Ok(()),
            false => {
                let flushed = self.file.flush();
                self.note(flushed)
            }
        }
    }
}

impl Seek for DataFile {
    fn seek(&mut self, pos: SeekFrom) -> std::io::Result<u64> {
        let target = match pos {
            SeekFrom::Start(n) => self.base.checked_add(n),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
            SeekFrom::End(d) => self.len.checked_add_signed(d),
        };
        let target = target
            .filter(|&t| t >= self.base)
            .ok_or_else(|| std::io::Error::other("seek outside the item"))?;
        if target != self.pos && !self.failed {
            let moved = self.file.seek(SeekFrom::Start(target));
            self.note(moved)?;
        }
        self.pos = target;
        Ok(self.pos - self.base)
    }
}

/// One data file of a checkpoint, items appended one after the other (one in memory at a
/// time).
pub struct ItemFile {
    data: DataFile,
    path: std::path::PathBuf,
    name: String,
}

impl ItemFile {
    /// Create data file `name` in `iter_dir`.
    pub fn create(iter_dir: &Path, name: &str) -> Result<Self> {
        let path = iter_dir.join(name);
        let file =
            std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(ItemFile {
            data: DataFile {
                file: BufWriter::with_capacity(8 << 20, file),
                base: 0,
                pos: 0,
                len: 0,
                failed: false,
            },
            path,
            name: name.to_string(),
        })
    }

    /// Append one `torch.save(root)` item.
    fn append(&mut self, root: &Value, storages: &[&[u8]]) -> Result<Stored> {
        let d = &mut self.data;
        d.base = d.len;
        d.seek(SeekFrom::Start(0))?;
        write_archive(&mut *d, &self.path, root, storages)?;
        Ok(Stored {
            file: self.name.clone(),
            offset: d.base,
            length: d.len - d.base,
        })
    }

    /// Append tensor `t` as a chunk of a global tensor placed by `to`.
    pub fn tensor(&mut self, to: &ChunkAt, t: &Tensor) -> Result<ChunkRecord> {
        let mut sizes = vec![1; to.at.len()];
        sizes.extend(&t.shape);
        let dims: Vec<u64> = sizes.iter().map(|&n| n as u64).collect();
        let root = contiguous("0", t.dtype, &dims);
        let item =
            (self.append(&root, &[&t.data])).with_context(|| format!("writing {}", to.key))?;
        let mut shape = to.lead.to_vec();
        shape.extend(to.shape);
        let mut offsets = to.at.to_vec();
        offsets.extend(to.offsets);
        Ok(ChunkRecord {
            key: to.key.to_string(),
            dtype: t.dtype.torch_name().to_string(),
            shape,
            offsets,
            sizes,
            lead: to.at.len(),
            item,
        })
    }

    /// Append megatron-core's local linears' extra state (`None`, saved as a one-item list)
    /// under each of `fqns`.
    pub fn extra_states(&mut self, fqns: Vec<String>) -> Result<Vec<(String, Stored)>> {
        let none = Value::List(vec![Value::None]);
        (fqns.into_iter())
            .map(|fqn| Ok((fqn, self.append(&none, &[])?)))
            .collect()
    }

    /// Flush and sync it.
    pub fn finish(mut self) -> Result<()> {
        let d = &mut self.data;
        (d.file.flush())
            .and_then(|_| d.file.get_ref().sync_all())
            .with_context(|| format!("writing {}", self.path.display()))
    }
}

/// The `_extra_state` objects megatron-core asks for beside the linear layers' weights among
/// `records` (the model's, not their optimizer state): one per linear module and leading index ([`object_fqn`]).
pub fn extra_state_fqns(records: &[ChunkRecord]) -> Vec<String> {
    // linear module → (the leading axes' sizes, the offsets of each item)
    let mut extra: BTreeMap<String, (Vec<usize>, Vec<Vec<usize>>)> = BTreeMap::new();
    for r in records.iter().filter(|r| !keys::is_not_model(&r.key)) {
        if let Some(module) = linear_module(&r.key) {
            let (lead, at) = (&r.shape[..r.lead], &r.offsets[..r.lead]);
            let slot = (extra.entry(format!("{module}._extra_state")))
                .or_insert_with(|| (lead.to_vec(), Vec::new()));
            if !slot.1.iter().any(|a| a == at) {
                slot.1.push(at.to_vec());
            }
        }
    }
    (extra.iter())
        .flat_map(|(key, (lead, items))| items.iter().map(|at| object_fqn(key, at, lead)))
        .collect()
}

/// Write the `.metadata` index of every rank's `records` and `objects` into `iter_dir`;
/// `final_dir` is where the checkpoint will be (DCP's `checkpoint_id`).
pub fn write_index(
    iter_dir: &Path,
    records: Vec<ChunkRecord>,
    objects: &[(String, Stored)],
    final_dir: &Path,
) -> Result<()> {
    let mut tensors: BTreeMap<String, Global> = BTreeMap::new();
    for r in records {
        let dtype = crate::ckpt::torch::pickle::dtype_of_torch_name(&r.dtype)
            .ok_or_else(|| anyhow!("internal: dtype {} of {}", r.dtype, r.key))?;
        let global = tensors.entry(r.key.clone()).or_insert_with(|| Global {
            dtype,
            shape: r.shape.clone(),
            chunks: Vec::new(),
        });
        if global.dtype != dtype || global.shape != r.shape {
            bail!(
                "internal: chunks of {} disagree on its dtype or shape ({:?} {:?}, {dtype:?} {:?})",
                r.key,
                global.dtype,
                global.shape,
                r.shape
            );
        }
        global.chunks.push((r.offsets, r.sizes, r.item));
    }
    let id = final_dir.join(iter_dir.file_name().unwrap_or_default());
    let index = metadata_pickle(&tensors, objects, &id)?;
    write_file(&iter_dir.join(METADATA), &index)
}

/// Write `common.pt` (the entries, and the sharded state dict's content metadata:
/// megatron/training/checkpointing.py `_build_sharded_state_dict_metadata`) and
/// `metadata.json`, which marks the format, into `iter_dir`.
/// `entries` may hold tensors over `storages` (named by their index); `content` adds to the
/// content metadata.
pub fn write_common(
    iter_dir: &Path,
    (mut entries, storages): (Vec<(Value, Value)>, &[Vec<u8>]),
    content: Vec<(Value, Value)>,
) -> Result<()> {
    let s = |x: &str| Value::Str(x.into());
    let mut metadata = content;
    metadata.extend([
        (s("singleton_local_shards"), Value::Bool(false)),
        (s("chained_optim_avoid_prefix"), Value::Bool(true)),
    ]);
    entries.push((s("content_metadata"), Value::Dict(metadata)));
    let mut w = PtWriter::create(&iter_dir.join(COMMON), &Value::Dict(entries), false)?;
    for (key, bytes) in storages.iter().enumerate() {
        w.write_storage(&key.to_string(), bytes)?;
    }
    w.finish()?;
    write_file(
        &iter_dir.join(METADATA_JSON),
        br#"{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}"#,
    )
}

/// `args` of a `torch_dist` checkpoint: `ckpt_format` says so.
pub fn dist_args(mut args: Vec<(String, Value)>) -> Value {
    for (k, v) in &mut args {
        if k == "ckpt_format" {
            *v = Value::Str("torch_dist".into());
        }
    }
    Value::Namespace(args)
}

impl DistTarget<'_> {
    /// Padded vocabulary rows.
    pub fn padded_vocab(&self) -> usize {
        self.par.padded_vocab(self.cfg.vocab, self.divisible_by)
    }

    /// Bytes of tensor data the checkpoint will hold.
    pub fn total_bytes(&self) -> u64 {
        let padded = self.padded_vocab();
        (canonical(self.cfg).into_iter())
            .map(|c| {
                let shape = self.shape(c, padded);
                (shape.iter().product::<usize>() * c.role.dtype(self.cfg).size()) as u64
            })
            .sum()
    }

    /// The global shape of canonical tensor `c` (the vocabulary padded).
    fn shape(&self, c: Canon, padded: usize) -> Vec<usize> {
        let mut shape = canonical_shape(self.cfg, c.role);
        if c.role.vocab_rows() {
            shape[0] = padded;
        }
        shape
    }

    /// Write the checkpoint into `dir` (normally a temporary directory). `read` yields
    /// canonical tensors in the target dtype; `progress` gets bytes written.
    pub fn write(
        &self,
        dir: &Path,
        read: &(dyn Fn(Canon) -> Result<Tensor> + Sync),
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<()> {
        let padded = self.padded_vocab();
        let iter_dir = dir.join(format!("iter_{ITERATION:07}"));
        std::fs::create_dir_all(&iter_dir)
            .with_context(|| format!("creating {}", iter_dir.display()))?;
        let mut data = ItemFile::create(&iter_dir, DATA_FILE)?;
        let mut records = Vec::new();
        // the next tensor read while one is written
        std::thread::scope(|scope| -> Result<()> {
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            let cfg = self.cfg;
            scope.spawn(move || {
                for c in canonical(cfg) {
                    let t = read(c);
                    let failed = t.is_err();
                    if tx.send(t.map(|t| (c, t))).is_err() || failed {
                        break;
                    }
                }
            });
            for next in rx {
                let (c, t) = next?;
                let t = match c.role {
                    r if r.vocab_rows() && t.shape[0] != padded => t.rows_padded(0, padded),
                    _ => t,
                };
                let p = keys::placement(self.cfg, c);
                let to = ChunkAt {
                    key: &p.key,
                    at: &p.at,
                    lead: &p.lead,
                    shape: &self.shape(c, padded),
                    offsets: &vec![0; t.shape.len()],
                };
                records.push(data.tensor(&to, &t)?);
                progress(t.data.len() as u64);
            }
            Ok(())
        })?;
        let objects = data.extra_states(extra_state_fqns(&records))?;
        data.finish()?;
        write_index(&iter_dir, records, &objects, self.final_dir)?;
        self.write_common(&iter_dir, padded)?;
        write_file(&dir.join(TRACKER), ITERATION.to_string().as_bytes())
    }

    /// `common.pt`: args, checkpoint version and iteration.
    fn write_common(&self, iter_dir: &Path, padded: usize) -> Result<()> {
        let args = megatron_args(
            self.cfg,
            &ParallelArgs::of(self.par, padded, self.divisible_by, self.grouped),
            self.base_args,
        );
        let s = |x: &str| Value::Str(x.into());
        let entries = vec![
            (s("args"), dist_args(args)),
            (s("checkpoint_version"), Value::Float(3.0)),
            (s("iteration"), Value::Int(ITERATION as i64)),
        ];
        write_common(iter_dir, (entries, &[]), Vec::new())
    }
}

/// The linear module a global weight belongs to, if it is a linear layer's weight.
fn linear_module(key: &str) -> Option<&str> {
    let module = key.strip_suffix(".weight")?;
    let last = module.rsplit('.').next()?;
    LINEARS.contains(&last).then_some(module)
}

/// A sharded object's name (megatron-core dist_checkpointing/mapping.py
/// `ShardedObject.unique_key`): its key, offsets and global shape, `.`-joined; an object
/// with no leading axes is the one item of shape (1,).
fn object_fqn(key: &str, at: &[usize], lead: &[usize]) -> String {
    let join = |xs: &[usize]| {
        xs.iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(".")
    };
    match lead.is_empty() {
        true => format!("{key}/shard_0_1"),
        false => format!("{key}/shard_{}_{}", join(at), join(lead)),
    }
}

/// Write a whole small file.
fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}

/// The `.metadata` pickle: megatron-core's `MCoreMetadata` (torch's DCP `Metadata` with
/// `mcore_data`) of the tensors and objects written.
fn metadata_pickle(
    tensors: &BTreeMap<String, Global>,
    objects: &[(String, Stored)],
    checkpoint_id: &Path,
) -> Result<Vec<u8>> {
    let mut p = Pickler::default();
    let value = |p: &mut Pickler, v: &Value| -> Result<()> {
        p.value(v).map_err(|e| anyhow!("internal: {e}"))
    };
    let s = |x: &str| Value::Str(x.into());
    p.new_object(
        "megatron.core.dist_checkpointing.strategies.torch",
        "MCoreMetadata",
    );
    p.empty_dict();
    p.mark();
    // state_dict_metadata
    p.str("state_dict_metadata");
    p.empty_dict();
    p.mark();
    for (fqn, g) in tensors {
        p.str(fqn);
        p.new_object(DCP, "TensorStorageMetadata");
        p.empty_dict();
        p.mark();
        p.str("properties");
        tensor_properties(&mut p, g.dtype);
        p.str("size");
        torch_size(&mut p, &g.shape);
        p.str("chunks");
        p.empty_list();
        p.mark();
        for (offsets, sizes, _) in &g.chunks {
            p.new_object(DCP, "ChunkStorageMetadata");
            p.empty_dict();
            p.mark();
            p.str("offsets");
            torch_size(&mut p, offsets);
            p.str("sizes");
            torch_size(&mut p, sizes);
            p.set_items();
            p.build();
        }
        p.appends();
        p.set_items();
        p.build();
    }
    for (fqn, _) in objects {
        p.str(fqn);
        p.new_object(DCP, "BytesStorageMetadata");
    }
    p.set_items();
    p.str("planner_data");
    p.none();
    // storage_data: MetadataIndex(fqn, offset, index) → _StorageInfo(path, offset, length)
    p.str("storage_data");
    p.empty_dict();
    p.mark();
    let chunks = (tensors.iter())
        .flat_map(|(fqn, g)| g.chunks.iter().map(move |(o, _, st)| (fqn, Some(o), st)));
    let items = chunks.chain(objects.iter().map(|(fqn, st)| (fqn, None, st)));
    for (fqn, offsets, stored) in items {
        p.new_object(DCP, "MetadataIndex");
        p.empty_dict();
        p.mark();
        p.str("fqn");
        p.str(fqn);
        p.str("offset");
        match offsets {
            Some(o) => torch_size(&mut p, o),
            None => p.none(),
        }
        p.str("index");
        p.none();
        p.set_items();
        p.build();
        p.new_object("torch.distributed.checkpoint.filesystem", "_StorageInfo");
        let info = Value::Dict(vec![
            (s("relative_path"), s(&stored.file)),
            (s("offset"), Value::Int(stored.offset as i64)),
            (s("length"), Value::Int(stored.length as i64)),
            (s("transform_descriptors"), Value::None),
        ]);
        value(&mut p, &info)?;
        p.build();
    }
    p.set_items();
    p.str("storage_meta");
    p.new_object(DCP, "StorageMeta");
    let meta = Value::Dict(vec![
        (s("checkpoint_id"), s(&checkpoint_id.display().to_string())),
        (s("save_id"), s(&save_id())),
        (s("load_id"), Value::None),
        (s("modules"), Value::List(Vec::new())),
    ]);
    value(&mut p, &meta)?;
    p.build();
    p.str("version");
    p.str("1.0.0");
    // megatron-core's data of each tensor: nothing reformulated
    p.str("mcore_data");
    let mcore: Vec<(Value, Value)> = (tensors.keys())
        .map(|k| (s(k), Value::Dict(Vec::new())))
        .collect();
    value(&mut p, &Value::Dict(mcore))?;
    p.set_items();
    p.build();
    Ok(p.finish())
}

/// `TensorProperties` of a dense CPU tensor: its `__setstate__` tuple (dtype, layout,
/// requires_grad, memory format, pin_memory).
fn tensor_properties(p: &mut Pickler, dtype: DType) {
    p.new_object(DCP, "TensorProperties");
    p.mark();
    p.global("torch", dtype.torch_name());
    p.global("torch.serialization", "_get_layout");
    p.mark();
    p.str("torch.strided");
    p.tuple();
    p.reduce();
    p.bool(false);
    p.global(DCP, "_MEM_FORMAT_ENCODING");
    p.mark();
    p.int(0);
    p.tuple();
    p.reduce();
    p.bool(false);
    p.tuple();
    p.build();
}

/// `torch.Size(dims)`.
fn torch_size(p: &mut Pickler, dims: &[usize]) {
    p.global("torch", "Size");
    p.mark();
    p.mark();
    dims.iter().for_each(|&d| p.int(d as i64));
    p.tuple();
    p.tuple();
    p.reduce();
}

/// A random id in UUID 4's form (DCP's `save_id`).
fn save_id() -> String {
    let b: [u8; 16] = rand::random();
    let hex =
        |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
    format!(
        "{}-{}-4{}-{:x}{}-{}",
        hex(0..4),
        hex(4..6),
        &hex(6..8)[1..],
        8 | (b[8] & 3),
        &hex(8..10)[1..],
        hex(10..16)
    )
}
