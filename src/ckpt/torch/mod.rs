//! PyTorch `.pt` files (the zip format of `torch.save`, torch ≥ 1.6), read safely and lazily.
//!
//! The archive is memory-mapped; `data.pkl` goes through the allow-list unpickler in
//! [`pickle`]; tensor bytes are slices of the stored `data/<key>` records, bounds-checked,
//! never copied until asked for. Layout of the archive: `docs/checkpoints.md` §4.

pub mod pickle;
pub mod save;

use crate::tensor::host::Tensor;
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
    /// Record name (without the archive prefix) → byte range in the file and stored CRC-32.
    records: HashMap<String, Record>,
    /// The records whose CRC-32 has been checked (each once, when first read).
    checked: std::sync::Mutex<std::collections::HashSet<String>>,
    root: Value,
}

/// A stored record: its bytes' range in the file and the CRC-32 the archive gives them.
#[derive(Debug, Clone, Copy)]
struct Record {
    start: usize,
    len: usize,
    crc: u32,
}

/// Whether `file`'s bytes `start..start + len` have CRC-32 `crc`: read in chunks with `pread`,
/// so a record of gigabytes costs one pass and a few megabytes of memory.
fn crc_matches(file: &File, r: Record) -> std::io::Result<Option<u32>> {
    use std::os::unix::fs::FileExt;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; r.len.min(4 << 20)];
    let mut at = 0;
    while at < r.len {
        let n = buf.len().min(r.len - at);
        file.read_exact_at(&mut buf[..n], (r.start + at) as u64)?;
        hasher.update(&buf[..n]);
        at += n;
    }
    let computed = hasher.finalize();
    Ok((computed != r.crc).then_some(computed))
}

/// Why a record is refused when its CRC-32 is not the stored one.
fn crc_mismatch(name: &str, stored: u32, computed: u32) -> String {
    format!(
        "record {name} fails its CRC-32 check (stored {stored:08x}, computed {computed:08x}): \
         the file is damaged"
    )
}

impl TorchFile {
    /// Open and unpickle `path`. Tensor data is not read.
    pub fn open(path: &Path) -> Result<Self> {
        let io = |cause| TorchError::Io {
            path: path.to_path_buf(),
            cause,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: read-only map; checkpoint files are not modified while being converted, and
        // every offset into the map is bounds-checked below.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let len = map.len();
        Self::from_map(path, (file, map), 0..len)
    }

    /// Open the `torch.save` archive stored at bytes `range` of `path` (an item of a
    /// distributed checkpoint's `.distcp` file: a whole archive whose offsets count from its
    /// first byte), unpickled; tensor data is not read.
    pub fn open_item(path: &Path, range: std::ops::Range<u64>) -> Result<Self> {
        let io = |cause| TorchError::Io {
            path: path.to_path_buf(),
            cause,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: as in `open`.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        if range.start > range.end || range.end > map.len() as u64 {
            return Err(TorchError::Archive {
                path: path.to_path_buf(),
                what: format!(
                    "item at bytes {}..{} runs past the file's {} bytes",
                    range.start,
                    range.end,
                    map.len()
                ),
            });
        }
        Self::from_map(path, (file, map), range.start as usize..range.end as usize)
    }

    /// The archive at bytes `range` of an opened, mapped file.
    fn from_map(
        path: &Path,
        (file, map): (File, Mmap),
        range: std::ops::Range<usize>,
    ) -> Result<Self> {
        let io = |cause| TorchError::Io {
            path: path.to_path_buf(),
            cause,
        };
        let archive_err = |what: String| TorchError::Archive {
            path: path.to_path_buf(),
            what,
        };
        let base = range.start;
        let bytes = &map[range];
        if !bytes.starts_with(b"PK\x03\x04") {
            return Err(archive_err(
                "not a zip-format torch file (the legacy pre-1.6 tar/raw-pickle format is unsupported: \
                 re-save it with torch.save in torch >= 1.6)"
                    .into(),
            ));
        }
        let mut records = index_records(bytes).map_err(archive_err)?;
        records.values_mut().for_each(|r| r.start += base);
        for name in ["byteorder", "data.pkl"] {
            if let Some(&r) = records.get(name) {
                if let Some(computed) = crc_matches(&file, r).map_err(io)? {
                    return Err(archive_err(crc_mismatch(name, r.crc, computed)));
                }
            }
        }
        if let Some(r) = records.get("byteorder") {
            if &map[r.start..r.start + r.len] != b"little" {
                return Err(archive_err("big-endian tensor data is unsupported".into()));
            }
        }
        let pkl = records
            .get("data.pkl")
            .ok_or_else(|| archive_err("no data.pkl record".into()))?;
        let root = pickle::parse(&map[pkl.start..pkl.start + pkl.len]).map_err(|cause| {
            TorchError::Pickle {
                path: path.to_path_buf(),
                cause,
            }
        })?;
        Ok(TorchFile {
            path: path.to_path_buf(),
            file,
            map,
            records,
            checked: Default::default(),
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

    /// All bytes of a storage (its `numel` elements), straight from the map, once its record
    /// has passed its CRC-32 check. `name` (the tensor using it) is only used in errors.
    pub fn storage_bytes(&self, name: &str, s: &StorageRef) -> Result<&[u8]> {
        let err = |what: String| self.tensor_error(name, what);
        let record = format!("data/{}", s.key);
        let &r = self
            .records
            .get(&record)
            .ok_or_else(|| err(format!("storage record {record} is missing")))?;
        self.check_crc(name, &record, r)?;
        let (start, len) = (r.start, r.len);
        match s.numel.checked_mul(s.dtype.size() as u64) {
            Some(n) if n <= len as u64 => Ok(&self.map[start..start + n as usize]),
            _ => Err(err(format!(
                "storage data/{} holds {len} bytes, fewer than its {} elements",
                s.key, s.numel
            ))),
        }
    }

    /// Check record `record`'s CRC-32 the first time one of its tensors (`name`) is read.
    fn check_crc(&self, name: &str, record: &str, r: Record) -> Result<()> {
        let done = |set: &std::collections::HashSet<String>| set.contains(record);
        if self.checked.lock().map(|s| done(&s)).unwrap_or(false) {
            return Ok(());
        }
        let mismatch = crc_matches(&self.file, r).map_err(|cause| TorchError::Io {
            path: self.path.clone(),
            cause,
        })?;
        if let Some(computed) = mismatch {
            return Err(self.tensor_error(name, crc_mismatch(record, r.crc, computed)));
        }
        if let Ok(mut set) = self.checked.lock() {
            set.insert(record.to_string());
        }
        Ok(())
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

    /// Bytes `from..from + into.len()` of a contiguous tensor's data read into `into` (a part
    /// of a large tensor without a copy of the whole).
    pub fn read_tensor_part(
        &self,
        name: &str,
        t: &TensorRef,
        from: usize,
        into: &mut [u8],
    ) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let (start, len) = self.tensor_range(name, t)?;
        if from.checked_add(into.len()).is_none_or(|end| end > len) {
            return Err(self.tensor_error(
                name,
                format!("bytes {from}..+{} of its {len} asked for", into.len()),
            ));
        }
        (self.file.read_exact_at(into, (start + from) as u64)).map_err(|cause| TorchError::Io {
            path: self.path.clone(),
            cause,
        })
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
fn index_records(map: &[u8]) -> std::result::Result<HashMap<String, Record>, String> {
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
        let record = Record {
            start: start as usize,
            len: len as usize,
            crc: entry.crc32(),
        };
        records.insert(rest.to_string(), record);
    }
    Ok(records)
}
