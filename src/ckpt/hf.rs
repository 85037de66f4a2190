//! Hugging Face weight files: `model.safetensors`, sharded `model-0000i-of-0000N.safetensors` +
//! `model.safetensors.index.json`, or `pytorch_model*.bin` (through the safe `.pt` reader), read
//! with bounds-checked `pread`s; and a streaming sharded safetensors writer.

use super::torch::pickle::{TensorRef, Value};
use super::torch::TorchFile;
use crate::tensor::dtype::{bf16_bits, f8e4m3_to_f32};
use crate::tensor::host::{decode_f32, Tensor};
use crate::tensor::DType;
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
    /// A float8 e4m3fn tensor (where `Safetensors` says) with its f32 scales `[⌈out/b₀⌉,
    /// ⌈in/b₁⌉]`, one per `block`, read dequantized to bf16.
    Fp8Blocks {
        file: usize,
        start: u64,
        scales: Box<Entry>,
        block: [usize; 2],
    },
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
    /// The block of the float8 tensors read dequantized, and how many there are.
    fp8: Option<([usize; 2], usize)>,
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
        Dtype::F8_E4M3 => DType::F8E4M3,
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
        DType::F8E4M3 => Dtype::F8_E4M3,
    }
}

/// A float8 e4m3fn matrix of `shape` dequantized to bf16 bytes, each `block` times its scale
/// (`scales` row-major `[⌈rows/b₀⌉, ⌈cols/b₁⌉]`): `bf16(f32(x) · s)`, as DeepSeek-V3's
/// inference/kernel.py `weight_dequant` computes it under fp8_cast_bf16.py's bf16 default dtype.
pub fn dequantize_blocks(
    raw: &[u8],
    [rows, cols]: [usize; 2],
    scales: &[f32],
    block: [usize; 2],
) -> Vec<u8> {
    let per_row = cols.div_ceil(block[1]);
    let mut out = Vec::with_capacity(rows * cols * 2);
    for (r, row) in raw.chunks_exact(cols.max(1)).take(rows).enumerate() {
        let s = &scales[(r / block[0]) * per_row..][..per_row];
        for (c, &x) in row.iter().enumerate() {
            let v = f8e4m3_to_f32(x) * s[c / block[1]];
            out.extend_from_slice(&bf16_bits(v).to_le_bytes());
        }
    }
    out
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
            fp8: None,
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

    /// Read every float8 e4m3fn weight `W` as bf16, dequantized by its block scales
    /// `W_scale_inv` (f32 `[⌈out/b₀⌉, ⌈in/b₁⌉]` for `block` `[b₀, b₁]`, as DeepSeek-V3 ships
    /// its weights and `quantization_config.weight_block_size` says); the scales are then no
    /// tensors of their own. A float8 tensor without its scales is an error naming both.
    pub fn dequantize_fp8(&mut self, block: [usize; 2]) -> Result<()> {
        let fp8: Vec<String> = (self.entries.iter())
            .filter(|(_, e)| e.dtype == DType::F8E4M3)
            .map(|(n, _)| n.clone())
            .collect();
        for name in &fp8 {
            let scale_name = format!("{name}_scale_inv");
            let path = || {
                self.file_of(name)
                    .map_or(String::new(), |p| p.display().to_string())
            };
            let e = &self.entries[name];
            let [rows, cols] = e.shape[..] else {
                bail!(
                    "{}: float8 tensor {name} has shape {:?}; block scales need a matrix",
                    path(),
                    e.shape
                );
            };
            let want = vec![rows.div_ceil(block[0]), cols.div_ceil(block[1])];
            match self.entries.get(&scale_name) {
                Some(s) if s.shape == want && s.dtype == DType::F32 => {}
                Some(s) => bail!(
                    "{}: {scale_name} is {} {:?}; the scales of {name} {:?} in {block:?} blocks \
                     are float32 {want:?}",
                    path(),
                    s.dtype.torch_name(),
                    s.shape,
                    e.shape
                ),
                None => bail!("{}: float8 tensor {name} has no {scale_name}", path()),
            }
            let Location::Safetensors { file, start } = e.loc else {
                bail!(
                    "{}: float8 tensor {name} outside a safetensors file",
                    path()
                );
            };
            let shape = e.shape.clone();
            let scales = self.entries.remove(&scale_name).expect("checked above");
            if !matches!(scales.loc, Location::Safetensors { .. }) {
                bail!("{scale_name} outside a safetensors file");
            }
            self.entries.insert(
                name.clone(),
                Entry {
                    dtype: DType::BF16,
                    shape,
                    loc: Location::Fp8Blocks {
                        file,
                        start,
                        scales: Box::new(scales),
                        block,
                    },
                },
            );
        }
        self.fp8 = Some((block, fp8.len()));
        Ok(())
    }

    /// The block of the float8 weights read dequantized and how many there are (`None`: none).
    pub fn fp8(&self) -> Option<([usize; 2], usize)> {
        self.fp8
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
            Location::Safetensors { file, .. }
            | Location::Torch { file, .. }
            | Location::Fp8Blocks { file, .. } => self.files[*file].0.as_path(),
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
            Location::Fp8Blocks {
                file,
                start,
                scales,
                block,
            } => {
                let (path, f) = &self.files[*file];
                let at = |what: &str| format!("{}: reading {what} of {name}", path.display());
                let mut raw = vec![0u8; e.shape.iter().product()];
                f.read_exact_at(&mut raw, *start)
                    .with_context(|| at("float8 values"))?;
                let Location::Safetensors { file, start } = scales.loc else {
                    unreachable!("scales are read from safetensors files");
                };
                let mut bytes = vec![0u8; scales.nbytes()];
                let (spath, sf) = &self.files[file];
                sf.read_exact_at(&mut bytes, start).with_context(|| {
                    format!("{}: reading the scales of {name}", spath.display())
                })?;
                let mut s = vec![0f32; bytes.len() / 4];
                decode_f32(&bytes, DType::F32, &mut s)?;
                out.extend(dequantize_blocks(
                    &raw,
                    [e.shape[0], e.shape[1]],
                    &s,
                    *block,
                ));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::dtype::bf16_to_f32;

    #[test]
    fn float8_blocks_take_their_own_scale_cut_short_at_the_edges() {
        // a 3 × 5 matrix of 1.0 (0x38) in 2 × 2 blocks: scales [2, 3] row-major
        let raw = vec![0x38u8; 15];
        let scales = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let out = dequantize_blocks(&raw, [3, 5], &scales, [2, 2]);
        let values: Vec<f32> = (out.chunks_exact(2))
            .map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect();
        assert_eq!(
            values,
            [
                1.0, 1.0, 2.0, 2.0, 3.0, //
                1.0, 1.0, 2.0, 2.0, 3.0, //
                4.0, 4.0, 5.0, 5.0, 6.0,
            ]
        );
        // the product is rounded to bf16 once: 1.125 · 1.0078125 = 1.1337890625 → 1.1328125
        let out = dequantize_blocks(&[0x39], [1, 1], &[1.007_812_5], [128, 128]);
        assert_eq!(
            bf16_to_f32(u16::from_le_bytes([out[0], out[1]])),
            1.132_812_5
        );
    }
}
