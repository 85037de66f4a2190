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
use anyhow::{anyhow, Context, Result};
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
}

/// A stored item: where it is in the data file.
struct Stored {
    offset: u64,
    length: u64,
}

/// A global tensor: element type, shape and its chunks (offsets, sizes, item).
struct Global {
    dtype: DType,
    shape: Vec<usize>,
    chunks: Vec<(Vec<usize>, Vec<usize>, Stored)>,
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

impl DataFile {
    /// Append one `torch.save(root)` item.
    fn append(&mut self, path: &Path, root: &Value, storages: &[&[u8]]) -> Result<Stored> {
        self.base = self.len;
        self.seek(SeekFrom::Start(0))?;
        write_archive(&mut *self, path, root, storages)?;
        Ok(Stored {
            offset: self.base,
            length: self.len - self.base,
        })
    }
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
                (shape.iter().product::<usize>() * c.role.dtype(self.cfg.dtype).size()) as u64
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
        let data_path = iter_dir.join(DATA_FILE);
        let file = std::fs::File::create(&data_path)
            .with_context(|| format!("creating {}", data_path.display()))?;
        let mut data = DataFile {
            file: BufWriter::with_capacity(8 << 20, file),
            base: 0,
            pos: 0,
            len: 0,
            failed: false,
        };
        let mut tensors: BTreeMap<String, Global> = BTreeMap::new();
        // linear module → (the leading axes' sizes, the offsets of each item)
        let mut extra: BTreeMap<String, (Vec<usize>, Vec<Vec<usize>>)> = BTreeMap::new();
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
                let mut sizes = vec![1; p.at.len()];
                sizes.extend(&t.shape);
                let dims: Vec<u64> = sizes.iter().map(|&n| n as u64).collect();
                let root = contiguous("0", t.dtype, &dims);
                let stored = (data.append(&data_path, &root, &[&t.data]))
                    .with_context(|| format!("writing {}", p.key))?;
                progress(t.data.len() as u64);
                let mut shape = p.lead.clone();
                shape.extend(self.shape(c, padded));
                let mut offsets = p.at.clone();
                offsets.extend(std::iter::repeat_n(0, t.shape.len()));
                let global = tensors.entry(p.key.clone()).or_insert_with(|| Global {
                    dtype: t.dtype,
                    shape,
                    chunks: Vec::new(),
                });
                global.chunks.push((offsets, sizes, stored));
                if let Some(module) = linear_module(&p.key) {
                    let slot = (extra.entry(format!("{module}._extra_state")))
                        .or_insert_with(|| (p.lead.clone(), Vec::new()));
                    if !slot.1.contains(&p.at) {
                        slot.1.push(p.at);
                    }
                }
            }
            Ok(())
        })?;
        // megatron-core's local linears' extra state: `None`, saved as a one-item list
        let none = Value::List(vec![Value::None]);
        let mut objects = Vec::new();
        for (key, (lead, items)) in &extra {
            for at in items {
                let fqn = object_fqn(key, at, lead);
                let stored = data.append(&data_path, &none, &[])?;
                objects.push((fqn, stored));
            }
        }
        data.file
            .flush()
            .and_then(|_| data.file.get_ref().sync_all())
            .with_context(|| format!("writing {}", data_path.display()))?;
        let id = self
            .final_dir
            .join(iter_dir.file_name().unwrap_or_default());
        let index = metadata_pickle(&tensors, &objects, &id)?;
        write_file(&iter_dir.join(METADATA), &index)?;
        self.write_common(&iter_dir.join(COMMON), padded)?;
        write_file(
            &iter_dir.join(METADATA_JSON),
            br#"{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}"#,
        )?;
        write_file(&dir.join(TRACKER), ITERATION.to_string().as_bytes())
    }

    /// `common.pt`: args, checkpoint version, iteration and the sharded state dict's content
    /// metadata (megatron/training/checkpointing.py `_build_sharded_state_dict_metadata`).
    fn write_common(&self, path: &Path, padded: usize) -> Result<()> {
        let par = self.par;
        let mut args = megatron_args(
            self.cfg,
            &ParallelArgs::of(par, padded, self.divisible_by, false),
            self.base_args,
        );
        for (k, v) in &mut args {
            if k == "ckpt_format" {
                *v = Value::Str("torch_dist".into());
            }
        }
        let s = |x: &str| Value::Str(x.into());
        let root = Value::Dict(vec![
            (s("args"), Value::Namespace(args)),
            (s("checkpoint_version"), Value::Float(3.0)),
            (s("iteration"), Value::Int(ITERATION as i64)),
            (
                s("content_metadata"),
                Value::Dict(vec![
                    (s("singleton_local_shards"), Value::Bool(false)),
                    (s("chained_optim_avoid_prefix"), Value::Bool(true)),
                ]),
            ),
        ]);
        PtWriter::create(path, &root, false)?.finish()?;
        Ok(())
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
            (s("relative_path"), s(DATA_FILE)),
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
