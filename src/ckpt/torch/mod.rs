//! PyTorch `.pt` files (the zip format of `torch.save`, torch ≥ 1.6), read safely and lazily.
//!
//! The archive is memory-mapped; `data.pkl` goes through the allow-list unpickler in
//! [`pickle`]; tensor bytes are slices of the stored `data/<key>` records, bounds-checked,
//! never copied until asked for. Layout of the archive: `reference/ckpt.md` §4.

pub mod pickle;
pub mod save;

use super::tensor::Tensor;
use memmap2::Mmap;
use pickle::{StorageRef, TensorRef, Value};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// Errors reading a `.pt` file; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum TorchError {
    /// I/O failure.
    #[error("{path}: {cause}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        cause: std::io::Error,
    },
    /// Not a zip archive, or a damaged one.
    #[error("{path}: {what}")]
    Archive {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// `data.pkl` was refused.
    #[error("{path}: data.pkl: {cause}")]
    Pickle {
        /// The file.
        path: PathBuf,
        /// Why.
        cause: pickle::PickleError,
    },
    /// Creating or moving an output file into place failed.
    #[error(transparent)]
    Output(#[from] crate::util::OutputError),
    /// A tensor whose bytes cannot be served.
    #[error("{path}: tensor {name}: {what}")]
    Tensor {
        /// The file.
        path: PathBuf,
        /// The tensor's key in the checkpoint.
        name: String,
        /// What is wrong.
        what: String,
    },
}

type Result<T> = std::result::Result<T, TorchError>;

/// An open `.pt` file: its unpickled object, and the stored records its tensors point into.
pub struct TorchFile {
    path: PathBuf,
    file: File,
    map: Mmap,
    /// Record name (without the archive prefix) → byte range in the file.
    records: HashMap<String, (usize, usize)>,
    root: Value,
}

impl TorchFile {
    /// Open and unpickle `path`. Tensor data is not read.
    pub fn open(path: &Path) -> Result<Self> {
        let io = |cause| TorchError::Io {
            path: path.to_path_buf(),
            cause,
        };
        let archive_err = |what: String| TorchError::Archive {
            path: path.to_path_buf(),
            what,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: read-only map; checkpoint files are not modified while being converted, and
        // every offset into the map is bounds-checked below.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        if !map.starts_with(b"PK\x03\x04") {
            return Err(archive_err(
                "not a zip-format torch file (the legacy pre-1.6 tar/raw-pickle format is unsupported: \
                 re-save it with torch.save in torch >= 1.6)"
                    .into(),
            ));
        }
        let records = index_records(&map).map_err(archive_err)?;
        if let Some(&(start, len)) = records.get("byteorder") {
            if &map[start..start + len] != b"little" {
                return Err(archive_err("big-endian tensor data is unsupported".into()));
            }
        }
        let &(start, len) = records
            .get("data.pkl")
            .ok_or_else(|| archive_err("no data.pkl record".into()))?;
        let root = pickle::parse(&map[start..start + len]).map_err(|cause| TorchError::Pickle {
            path: path.to_path_buf(),
            cause,
        })?;
        Ok(TorchFile {
            path: path.to_path_buf(),
            file,
            map,
            records,
            root,
        })
    }

    /// The file it was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The unpickled object (a state dict, or Megatron's top-level dict).
    pub fn root(&self) -> &Value {
        &self.root
    }

    /// All bytes of a storage (its `numel` elements), straight from the map.
    /// `name` (the tensor using it) is only used in errors.
    pub fn storage_bytes(&self, name: &str, s: &StorageRef) -> Result<&[u8]> {
        let err = |what: String| self.tensor_error(name, what);
        let &(start, len) = self
            .records
            .get(&format!("data/{}", s.key))
            .ok_or_else(|| err(format!("storage record data/{} is missing", s.key)))?;
        match s.numel.checked_mul(s.dtype.size() as u64) {
            Some(n) if n <= len as u64 => Ok(&self.map[start..start + n as usize]),
            _ => Err(err(format!(
                "storage data/{} holds {len} bytes, fewer than its {} elements",
                s.key, s.numel
            ))),
        }
    }

    fn tensor_error(&self, name: &str, what: String) -> TorchError {
        TorchError::Tensor {
            path: self.path.clone(),
            name: name.to_string(),
            what,
        }
    }

    /// The little-endian bytes of a contiguous tensor, straight from the map.
    /// `name` is only used in errors.
    pub fn tensor_bytes(&self, name: &str, t: &TensorRef) -> Result<&[u8]> {
        let (start, len) = self.tensor_range(name, t)?;
        Ok(&self.map[start..start + len])
    }

    /// A contiguous tensor read into memory with `pread` (not through the map, so resident
    /// memory stays bounded by what the caller holds). `name` is only used in errors.
    pub fn read_tensor(&self, name: &str, t: &TensorRef) -> Result<Tensor> {
        use std::os::unix::fs::FileExt;
        let (start, len) = self.tensor_range(name, t)?;
        let mut data = vec![0u8; len];
        self.file
            .read_exact_at(&mut data, start as u64)
            .map_err(|cause| TorchError::Io {
                path: self.path.clone(),
                cause,
            })?;
        let shape = t.shape.iter().map(|&n| n as usize).collect();
        Ok(Tensor::new(t.storage.dtype, shape, data))
    }

    /// Byte range of a contiguous tensor in the file, checked against its storage record.
    fn tensor_range(&self, name: &str, t: &TensorRef) -> Result<(usize, usize)> {
        let err = |what: String| self.tensor_error(name, what);
        if !t.is_contiguous() {
            return Err(err(format!(
                "non-contiguous view (shape {:?}, stride {:?}) is unsupported",
                t.shape, t.stride
            )));
        }
        let storage = self.storage_bytes(name, &t.storage)?;
        let size = t.storage.dtype.size() as u64;
        let end = t.offset.checked_add(t.numel());
        if end.is_none_or(|e| e > t.storage.numel) {
            return Err(err(format!(
                "offset {} + {} elements runs past its storage of {}",
                t.offset,
                t.numel(),
                t.storage.numel
            )));
        }
        let base = storage.as_ptr() as usize - self.map.as_ptr() as usize;
        Ok((
            base + (t.offset * size) as usize,
            (t.numel() * size) as usize,
        ))
    }
}

/// Map every stored record to its byte range; the archive prefix (first entry's directory) is
/// stripped. Compressed records, records outside the file, or an archive without a prefix are errors.
fn index_records(map: &[u8]) -> std::result::Result<HashMap<String, (usize, usize)>, String> {
    let mut zip = zip::ZipArchive::new(std::io::Cursor::new(map))
        .map_err(|e| format!("damaged zip archive: {e}"))?;
    let mut records = HashMap::new();
    let mut prefix: Option<String> = None;
    for i in 0..zip.len() {
        let entry = zip
            .by_index_raw(i)
            .map_err(|e| format!("zip entry {i}: {e}"))?;
        let name = entry.name().to_string();
        let Some((dir, rest)) = name.split_once('/') else {
            return Err(format!(
                "zip entry {name:?} is outside the archive directory"
            ));
        };
        let prefix = prefix.get_or_insert_with(|| dir.to_string());
        if dir != prefix.as_str() {
            continue;
        }
        if entry.compression() != zip::CompressionMethod::Stored {
            return Err(format!(
                "record {name} is compressed; torch.save stores records uncompressed"
            ));
        }
        let (start, len) = (entry.data_start(), entry.size());
        if start
            .checked_add(len)
            .is_none_or(|end| end > map.len() as u64)
        {
            return Err(format!("record {name} runs past the end of the file"));
        }
        records.insert(rest.to_string(), (start as usize, len as usize));
    }
    Ok(records)
}
