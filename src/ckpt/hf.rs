//! Hugging Face weight files: `model.safetensors`, sharded `model-0000i-of-0000N.safetensors` +
//! `model.safetensors.index.json`, or `pytorch_model*.bin` (through the safe `.pt` reader), read
//! with bounds-checked `pread`s; and a streaming sharded safetensors writer.

use super::tensor::Tensor;
use super::torch::pickle::{DType, TensorRef, Value};
use super::torch::TorchFile;
use anyhow::{anyhow, bail, Context, Result};
use rayon::prelude::*;
use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Where one HF tensor lives.
enum Location {
    /// Absolute byte range in a safetensors file.
    Safetensors { file: usize, start: u64 },
    /// A tensor in a `pytorch_model*.bin`.
    Torch { file: usize, tensor: TensorRef },
}

/// One tensor's description.
pub struct Entry {
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<usize>,
    loc: Location,
}

impl Entry {
    /// Bytes of data.
    pub fn nbytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// The weights of an HF model directory, indexed by tensor name; data read on demand.
pub struct HfWeights {
    files: Vec<(PathBuf, File)>,
    torch: HashMap<usize, TorchFile>,
    entries: BTreeMap<String, Entry>,
}

/// safetensors dtype names ⇄ ours.
fn from_st(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::F64 => DType::F64,
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I64 => DType::I64,
        Dtype::I32 => DType::I32,
        Dtype::I16 => DType::I16,
        Dtype::I8 => DType::I8,
        Dtype::U8 => DType::U8,
        Dtype::BOOL => DType::Bool,
        _ => return None,
    })
}

fn to_st(d: DType) -> Dtype {
    match d {
        DType::F64 => Dtype::F64,
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I64 => Dtype::I64,
        DType::I32 => Dtype::I32,
        DType::I16 => Dtype::I16,
        DType::I8 => Dtype::I8,
        DType::U8 => Dtype::U8,
        DType::Bool => Dtype::BOOL,
    }
}

/// The weight files of an HF directory, in the order an index names them.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    for (index, single) in [
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ] {
        let index_path = dir.join(index);
        if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .with_context(|| format!("reading {}", index_path.display()))?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{}: not valid JSON", index_path.display()))?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| anyhow!("{}: no \"weight_map\" object", index_path.display()))?;
            let mut files: Vec<PathBuf> = Vec::new();
            for f in map.values() {
                let f = f
                    .as_str()
                    .ok_or_else(|| anyhow!("{}: a weight_map value is not a string", index))?;
                let p = dir.join(f);
                if !files.contains(&p) {
                    files.push(p);
                }
            }
            return Ok(files);
        }
        if dir.join(single).exists() {
            return Ok(vec![dir.join(single)]);
        }
    }
    bail!(
        "{}: no model.safetensors, model.safetensors.index.json, pytorch_model.bin or \
         pytorch_model.bin.index.json",
        dir.display()
    )
}

impl HfWeights {
    /// Index every tensor of the model in `dir`. Missing shards, bad headers and offsets
    /// outside a file are errors naming the file.
    pub fn open(dir: &Path) -> Result<Self> {
        Self::open_files(weight_files(dir)?)
    }

    /// Index the tensors of the given safetensors / `.bin` files.
    pub fn open_files(paths: Vec<PathBuf>) -> Result<Self> {
        let mut w = HfWeights {
            files: Vec::new(),
            torch: HashMap::new(),
            entries: BTreeMap::new(),
        };
        for path in paths {
            if !path.exists() {
                bail!(
                    "missing weight shard {} (named by the index)",
                    path.display()
                );
            }
            let idx = w.files.len();
            let file = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
            if path.extension().is_some_and(|e| e == "safetensors") {
                w.index_safetensors(idx, &path, &file)?;
            } else {
                let pt = TorchFile::open(&path)?;
                w.index_torch(idx, &pt)?;
                w.torch.insert(idx, pt);
            }
            w.files.push((path, file));
        }
        Ok(w)
    }

    fn insert(&mut self, name: String, entry: Entry, path: &Path) -> Result<()> {
        if self.entries.insert(name.clone(), entry).is_some() {
            bail!(
                "{}: tensor {name} appears in two weight files",
                path.display()
            );
        }
        Ok(())
    }

    fn index_safetensors(&mut self, idx: usize, path: &Path, file: &File) -> Result<()> {
        // SAFETY: read-only map of a file we do not modify; only the header is touched.
        let map = unsafe { memmap2::Mmap::map(file) }
            .with_context(|| format!("mapping {}", path.display()))?;
        let (n, meta) = safetensors::SafeTensors::read_metadata(&map)
            .map_err(|e| anyhow!("{}: bad safetensors file: {e}", path.display()))?;
        let base = 8 + n as u64;
        for (name, info) in meta.tensors() {
            let dtype = from_st(info.dtype).ok_or_else(|| {
                anyhow!(
                    "{}: tensor {name}: unsupported dtype {:?}",
                    path.display(),
                    info.dtype
                )
            })?;
            let entry = Entry {
                dtype,
                shape: info.shape.clone(),
                loc: Location::Safetensors {
                    file: idx,
                    start: base + info.data_offsets.0 as u64,
                },
            };
            self.insert(name, entry, path)?;
        }
        Ok(())
    }

    fn index_torch(&mut self, idx: usize, pt: &TorchFile) -> Result<()> {
        let Value::Dict(items) = pt.root() else {
            bail!("{}: not a state dict", pt.path().display());
        };
        for (k, v) in items {
            let (Value::Str(name), Value::Tensor(t)) = (k, v) else {
                bail!("{}: entry {k:?} is not a named tensor", pt.path().display());
            };
            let entry = Entry {
                dtype: t.storage.dtype,
                shape: t.shape.iter().map(|&n| n as usize).collect(),
                loc: Location::Torch {
                    file: idx,
                    tensor: TensorRef::clone(t),
                },
            };
            self.insert(name.clone(), entry, pt.path())?;
        }
        Ok(())
    }

    /// The weight files, in the order an index names them.
    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|(p, _)| p.as_path())
    }

    /// All tensors, by name.
    pub fn entries(&self) -> &BTreeMap<String, Entry> {
        &self.entries
    }

    /// The file holding `name`.
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.entries.get(name).map(|e| match &e.loc {
            Location::Safetensors { file, .. } | Location::Torch { file, .. } => {
                self.files[*file].0.as_path()
            }
        })
    }

    /// Read tensor `name` into memory.
    pub fn read(&self, name: &str) -> Result<Tensor> {
        let mut data = Vec::new();
        let e = self.read_append(name, &mut data)?;
        Ok(Tensor::new(e.dtype, e.shape.clone(), data))
    }

    /// Append tensor `name`'s bytes to `out` (so concatenations need no second copy).
    pub fn read_append(&self, name: &str, out: &mut Vec<u8>) -> Result<&Entry> {
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| anyhow!("tensor {name} is missing from the HF weights"))?;
        match &e.loc {
            Location::Safetensors { file, start } => {
                let (path, f) = &self.files[*file];
                let from = out.len();
                out.resize(from + e.nbytes(), 0);
                f.read_exact_at(&mut out[from..], *start)
                    .with_context(|| format!("{}: reading tensor {name}", path.display()))?;
            }
            Location::Torch { file, tensor } => {
                out.extend_from_slice(&self.torch[file].read_tensor(name, tensor)?.data)
            }
        }
        Ok(e)
    }
}

/// One tensor to be written: its name, dtype and shape (known before its data).
#[derive(Clone)]
pub struct Planned {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<usize>,
}

impl Planned {
    fn nbytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// Split groups of tensors (a group is produced at once, and stays in one file) into shards of
/// at most `max_bytes` (a group larger than that gets a shard of its own).
pub fn plan_shards(groups: &[Vec<Planned>], max_bytes: u64) -> Vec<Vec<usize>> {
    let mut shards: Vec<Vec<usize>> = vec![];
    let mut size = 0u64;
    for (i, g) in groups.iter().enumerate() {
        let bytes: u64 = g.iter().map(|p| p.nbytes() as u64).sum();
        if shards.is_empty() || (size + bytes > max_bytes && size > 0) {
            shards.push(vec![]);
            size = 0;
        }
        shards.last_mut().expect("pushed").push(i);
        size += bytes;
    }
    shards
}

/// The file name of shard `i` (0-based) of `n`, as transformers names them.
pub fn shard_name(i: usize, n: usize) -> String {
    if n == 1 {
        "model.safetensors".into()
    } else {
        format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
    }
}

/// Write one safetensors file whose header lists `planned` in order; `produce(g)` yields the
/// tensors of group `g` in the same order. Offsets are known from the header, so groups are
/// produced and written (`pwrite`) in parallel, each as soon as it is ready.
pub fn write_safetensors(
    path: &Path,
    planned: &[&Vec<Planned>],
    produce: impl Fn(usize) -> Result<Vec<Tensor>> + Sync,
) -> Result<u64> {
    let mut infos = Vec::new();
    let mut group_offsets = Vec::with_capacity(planned.len());
    let mut offset = 0usize;
    for g in planned {
        group_offsets.push(offset);
        for p in g.iter() {
            let n = p.nbytes();
            let info = TensorInfo {
                dtype: to_st(p.dtype),
                shape: p.shape.clone(),
                data_offsets: (offset, offset + n),
            };
            infos.push((p.name.clone(), info));
            offset += n;
        }
    }
    let meta_map = HashMap::from([("format".to_string(), "pt".to_string())]);
    let meta = Metadata::new(Some(meta_map), infos)
        .map_err(|e| anyhow!("{}: building the header: {e}", path.display()))?;
    let mut header = serde_json::to_vec(&meta)?;
    header.resize(header.len().next_multiple_of(8), b' ');
    let data_start = 8 + header.len() as u64;
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let io = |e| anyhow!("{}: {e}", path.display());
    file.set_len(data_start + offset as u64).map_err(io)?;
    let mut head = (header.len() as u64).to_le_bytes().to_vec();
    head.extend_from_slice(&header);
    file.write_all_at(&head, 0).map_err(io)?;
    planned
        .par_iter()
        .enumerate()
        .try_for_each(|(g, group)| -> Result<()> {
            let tensors = produce(g)?;
            let mut at = data_start + group_offsets[g] as u64;
            for (p, t) in group.iter().zip(&tensors) {
                if t.dtype != p.dtype || t.shape != p.shape {
                    bail!(
                        "internal: tensor {} came out as {:?} {:?}, planned {:?} {:?}",
                        p.name,
                        t.dtype,
                        t.shape,
                        p.dtype,
                        p.shape
                    );
                }
                file.write_all_at(&t.data, at).map_err(io)?;
                at += t.data.len() as u64;
            }
            Ok(())
        })?;
    Ok(data_start + offset as u64)
}

/// The `model.safetensors.index.json` for shards written by [`write_safetensors`].
pub fn index_json(shards: &[(String, Vec<String>)], total_size: u64) -> serde_json::Value {
    let mut map = serde_json::Map::new();
    for (file, names) in shards {
        for n in names {
            map.insert(n.clone(), file.clone().into());
        }
    }
    serde_json::json!({"metadata": {"total_size": total_size}, "weight_map": map})
}

/// Files of an HF directory that are not weights and travel with a conversion unchanged.
pub const SIDE_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
];

/// Copy the [`SIDE_FILES`] present in `from` into `to`, each created as a new file (with the
/// umask's permissions, as every output; `fs::copy` would carry over the source's mode).
pub fn copy_side_files(from: &Path, to: &Path) -> Result<usize> {
    let mut n = 0;
    for f in SIDE_FILES {
        let src = from.join(f);
        if src.is_file() {
            File::open(&src)
                .and_then(|mut s| std::io::copy(&mut s, &mut File::create(to.join(f))?))
                .with_context(|| format!("copying {}", src.display()))?;
            n += 1;
        }
    }
    Ok(n)
}
