//! Megatron's `MMIDIDX` indexed dataset: the `.bin` token file and its `.idx` index.
//!
//! Layout (Megatron-LM `megatron/core/datasets/indexed_dataset.py`, `_IndexWriter` /
//! `_IndexReader`, unchanged since 2020), all little-endian, no alignment padding:
//!
//! | offset      | size | field                                           |
//! |-------------|------|-------------------------------------------------|
//! | 0           | 9    | magic `MMIDIDX\0\0`                             |
//! | 9           | 8    | version, u64 = 1                                |
//! | 17          | 1    | dtype code (see [`DType`])                      |
//! | 18          | 8    | S = sequence count, u64                         |
//! | 26          | 8    | D = document count + 1, u64                     |
//! | 34          | 4·S  | sequence lengths, i32                           |
//! | 34+4S       | 8·S  | sequence byte pointers into `.bin`, i64         |
//! | 34+12S      | 8·D  | document indices `[0, e1, e2, …]`, i64          |
//!
//! The writer streams tokens into `.bin` and keeps only the lengths and document
//! boundaries in memory (12 bytes per sequence), so memory stays small for any corpus.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::util::{self, AtomicFile, OutputError, OutputKind};

/// The 9-byte magic at the start of every `.idx` file.
pub const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// Size of the fixed `.idx` header: magic, version, dtype code, two counts.
pub const HEADER_LEN: usize = 34;

/// Errors reading or writing an indexed dataset.
#[derive(Debug, thiserror::Error)]
pub enum IndexedError {
    /// An I/O error on the named file.
    #[error("{path}: {cause}")]
    Io {
        /// The file being read or written.
        path: PathBuf,
        /// The underlying error.
        cause: std::io::Error,
    },
    /// The `.idx` does not start with `MMIDIDX`.
    #[error("{path}: not a Megatron mmap index (bad magic; legacy `TNTIDX` lazy/cached indexes are not supported)")]
    BadMagic {
        /// The `.idx` file.
        path: PathBuf,
    },
    /// Version other than 1.
    #[error("{path}: unsupported index version {version} (expected 1)")]
    BadVersion {
        /// The `.idx` file.
        path: PathBuf,
        /// The version found.
        version: u64,
    },
    /// Unknown dtype code.
    #[error("{path}: unknown dtype code {code}")]
    BadDType {
        /// The `.idx` file.
        path: PathBuf,
        /// The code found.
        code: u8,
    },
    /// Structural inconsistency (sizes, pointers, document indices).
    #[error("{path}: corrupt index: {what}")]
    Corrupt {
        /// The file at fault.
        path: PathBuf,
        /// What is inconsistent.
        what: String,
    },
    /// A token does not fit the dataset's dtype.
    #[error("token id {token} does not fit dtype {dtype} (use --dtype int32)")]
    TokenOutOfRange {
        /// The offending token.
        token: i64,
        /// The dtype name.
        dtype: &'static str,
    },
    /// Creating, checking or moving an output into place failed.
    #[error(transparent)]
    Output(#[from] OutputError),
    /// The `.bin` is not the one the `.idx` describes (e.g. one of them was replaced alone).
    #[error(
        "{bin} is {bin_len} bytes but {idx} describes {expected} bytes of tokens: the pair does \
         not belong together (one was replaced, truncated or damaged); regenerate both"
    )]
    Mismatch {
        /// The `.bin` file.
        bin: PathBuf,
        /// The `.idx` file.
        idx: PathBuf,
        /// Length of the `.bin`.
        bin_len: u64,
        /// Bytes the index accounts for.
        expected: u64,
    },
    /// Merged inputs disagree on dtype.
    #[error("{path}: dtype {got} differs from the first input's {expected}")]
    DTypeMismatch {
        /// The input at fault.
        path: PathBuf,
        /// dtype of the first input.
        expected: &'static str,
        /// dtype of this input.
        got: &'static str,
    },
}

type Result<T> = std::result::Result<T, IndexedError>;

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> IndexedError + '_ {
    move |cause| IndexedError::Io {
        path: path.to_path_buf(),
        cause,
    }
}

/// Element type of the `.bin` file, with Megatron's numeric codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// code 1
    U8,
    /// code 2
    I8,
    /// code 3
    I16,
    /// code 4
    I32,
    /// code 5
    I64,
    /// code 6
    F64,
    /// code 7
    F32,
    /// code 8
    U16,
}

impl DType {
    /// Megatron's code for this dtype.
    pub fn code(self) -> u8 {
        match self {
            DType::U8 => 1,
            DType::I8 => 2,
            DType::I16 => 3,
            DType::I32 => 4,
            DType::I64 => 5,
            DType::F64 => 6,
            DType::F32 => 7,
            DType::U16 => 8,
        }
    }

    /// Parse Megatron's dtype code.
    pub fn from_code(code: u8) -> Option<DType> {
        Some(match code {
            1 => DType::U8,
            2 => DType::I8,
            3 => DType::I16,
            4 => DType::I32,
            5 => DType::I64,
            6 => DType::F64,
            7 => DType::F32,
            8 => DType::U16,
            _ => return None,
        })
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::I16 | DType::U16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// numpy name.
    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F64 => "float64",
            DType::F32 => "float32",
            DType::U16 => "uint16",
        }
    }

    /// Megatron's `DType.optimal_dtype`: uint16 when `vocab_size < 65500`, else int32.
    pub fn optimal_for_vocab(vocab_size: usize) -> DType {
        if vocab_size < 65500 {
            DType::U16
        } else {
            DType::I32
        }
    }

    /// Append one token in this dtype (little-endian) to `out`.
    fn encode(self, token: i64, out: &mut Vec<u8>) -> Result<()> {
        let range_err = || IndexedError::TokenOutOfRange {
            token,
            dtype: self.name(),
        };
        match self {
            DType::U8 => out.push(u8::try_from(token).map_err(|_| range_err())?),
            DType::I8 => out.extend(i8::try_from(token).map_err(|_| range_err())?.to_le_bytes()),
            DType::I16 => out.extend(i16::try_from(token).map_err(|_| range_err())?.to_le_bytes()),
            DType::U16 => out.extend(u16::try_from(token).map_err(|_| range_err())?.to_le_bytes()),
            DType::I32 => out.extend(i32::try_from(token).map_err(|_| range_err())?.to_le_bytes()),
            DType::I64 => out.extend(token.to_le_bytes()),
            DType::F32 => out.extend((token as f32).to_le_bytes()),
            DType::F64 => out.extend((token as f64).to_le_bytes()),
        }
        Ok(())
    }

    /// Decode one element from exactly `self.size()` little-endian bytes.
    fn decode(self, b: &[u8]) -> i64 {
        let mut w = [0u8; 8];
        w[..b.len()].copy_from_slice(b);
        match self {
            DType::U8 => b[0] as i64,
            DType::I8 => b[0] as i8 as i64,
            DType::I16 => i16::from_le_bytes([b[0], b[1]]) as i64,
            DType::U16 => u16::from_le_bytes([b[0], b[1]]) as i64,
            DType::I32 => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
            DType::I64 => i64::from_le_bytes(w),
            DType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
            DType::F64 => f64::from_le_bytes(w) as i64,
        }
    }
}

/// `{prefix}.bin` and `{prefix}.idx`.
pub fn bin_idx_paths(prefix: &Path) -> (PathBuf, PathBuf) {
    let p = prefix.as_os_str().to_owned();
    let mut bin = p.clone();
    bin.push(".bin");
    let mut idx = p;
    idx.push(".idx");
    (PathBuf::from(bin), PathBuf::from(idx))
}

/// A `.bin` or `.idx` file as an output.
pub static DATASET_FILE: OutputKind = OutputKind {
    tag: "data",
    what: "dataset file",
    dir: None,
};

/// Check `{prefix}.bin/.idx` as outputs before any work (see [`util::check_output`]): neither
/// may be one of `inputs`, nor exist without `force`.
pub fn check_output(prefix: &Path, inputs: &[&Path], force: bool) -> Result<()> {
    let (bin, idx) = bin_idx_paths(prefix);
    util::check_output(&bin, &DATASET_FILE, inputs, force)?;
    util::check_output(&idx, &DATASET_FILE, inputs, force)?;
    Ok(())
}

/// Streams a dataset to `{prefix}.bin/.idx`.
///
/// Both files are written under temporary names in the target directory and renamed
/// into place by [`IndexedWriter::finish`]; dropping an unfinished writer removes them,
/// so a failed run never leaves a valid-looking output behind.
pub struct IndexedWriter {
    dtype: DType,
    bin: AtomicFile,
    force: bool,
    bin_path: PathBuf,
    idx_path: PathBuf,
    lengths: Vec<i32>,
    doc_indices: Vec<i64>,
    scratch: Vec<u8>,
    tokens: u64,
}

impl IndexedWriter {
    /// Start writing `{prefix}.bin/.idx` with `dtype`. Fails if they exist and `!force`, or
    /// if an interrupted earlier run left temporaries for them (removed with `force`).
    pub fn create(prefix: &Path, dtype: DType, force: bool) -> Result<Self> {
        check_output(prefix, &[], force)?;
        let (bin_path, idx_path) = bin_idx_paths(prefix);
        Ok(IndexedWriter {
            dtype,
            bin: AtomicFile::create(&bin_path, &DATASET_FILE, force)?,
            force,
            bin_path,
            idx_path,
            lengths: Vec::new(),
            doc_indices: vec![0],
            scratch: Vec::new(),
            tokens: 0,
        })
    }

    /// The dtype being written.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Append one sequence (Megatron's `add_item`).
    pub fn add_sequence<T: Copy + Into<i64>>(&mut self, tokens: &[T]) -> Result<()> {
        let len = i32::try_from(tokens.len()).map_err(|_| IndexedError::Corrupt {
            path: self.bin_path.clone(),
            what: format!("sequence of {} tokens exceeds i32", tokens.len()),
        })?;
        self.scratch.clear();
        self.scratch.reserve(tokens.len() * self.dtype.size());
        for &t in tokens {
            self.dtype.encode(t.into(), &mut self.scratch)?;
        }
        self.bin
            .write_all(&self.scratch)
            .map_err(io_err(&self.bin_path))?;
        self.lengths.push(len);
        self.tokens += tokens.len() as u64;
        Ok(())
    }

    /// Close the current document (Megatron's `end_document`). A document with no
    /// sequences repeats the previous index, exactly as Megatron does.
    pub fn end_document(&mut self) {
        self.doc_indices.push(self.lengths.len() as i64);
    }

    /// Append a whole document of one sequence per entry of `sequences`.
    pub fn add_document<T: Copy + Into<i64>>(&mut self, sequences: &[Vec<T>]) -> Result<()> {
        for s in sequences {
            self.add_sequence(s)?;
        }
        self.end_document();
        Ok(())
    }

    /// Append every sequence and document of an existing dataset (Megatron's `add_index`).
    pub fn append_dataset(&mut self, other: &IndexedDataset) -> Result<()> {
        if other.dtype() != self.dtype {
            return Err(IndexedError::DTypeMismatch {
                path: other.idx_path.clone(),
                expected: self.dtype.name(),
                got: other.dtype().name(),
            });
        }
        let offset = self.lengths.len() as i64;
        for i in 0..other.len() {
            self.lengths.push(other.sequence_length(i) as i32);
        }
        for d in 1..other.doc_count() + 1 {
            self.doc_indices.push(offset + other.doc_index(d));
        }
        let bytes = other.bin_bytes();
        self.bin.write_all(bytes).map_err(io_err(&self.bin_path))?;
        self.tokens += (bytes.len() / self.dtype.size()) as u64;
        Ok(())
    }

    /// Tokens written so far.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Sequences written so far.
    pub fn sequences(&self) -> usize {
        self.lengths.len()
    }

    /// Documents closed so far.
    pub fn documents(&self) -> usize {
        self.doc_indices.len() - 1
    }

    /// Write the `.idx` and move both files into place. Returns bytes written (bin + idx).
    pub fn finish(self) -> Result<u64> {
        let (bin_len, bin) = self.bin.close()?;
        let mut idx = AtomicFile::create(&self.idx_path, &DATASET_FILE, self.force)?;
        // Streamed, not built in memory: the index is the one part that grows with the input.
        write_index(&mut idx, self.dtype, &self.lengths, &self.doc_indices)
            .map_err(io_err(&self.idx_path))?;
        let (idx_len, idx) = idx.close()?;
        // .idx last: readers key on it, and commit_all removes the old one before the renames,
        // so a crash between them leaves a .bin without an .idx rather than a mismatched pair.
        util::commit_all(vec![bin, idx])?;
        Ok(bin_len + idx_len)
    }
}

/// Serialise a complete `.idx`: header, lengths, pointers (int64 running sum), doc indices.
pub fn encode_index(dtype: DType, lengths: &[i32], doc_indices: &[i64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + 12 * lengths.len() + 8 * doc_indices.len());
    write_index(&mut out, dtype, lengths, doc_indices).expect("writing to a Vec cannot fail");
    out
}

/// Stream a complete `.idx` to `out` (see [`encode_index`]); returns the bytes written.
pub fn write_index(
    out: &mut impl Write,
    dtype: DType,
    lengths: &[i32],
    doc_indices: &[i64],
) -> std::io::Result<u64> {
    out.write_all(MAGIC)?;
    out.write_all(&1u64.to_le_bytes())?;
    out.write_all(&[dtype.code()])?;
    out.write_all(&(lengths.len() as u64).to_le_bytes())?;
    out.write_all(&(doc_indices.len() as u64).to_le_bytes())?;
    for &l in lengths {
        out.write_all(&l.to_le_bytes())?;
    }
    let mut pointer: i64 = 0;
    for &l in lengths {
        out.write_all(&pointer.to_le_bytes())?;
        pointer += l as i64 * dtype.size() as i64;
    }
    for &d in doc_indices {
        out.write_all(&d.to_le_bytes())?;
    }
    Ok((HEADER_LEN + 12 * lengths.len() + 8 * doc_indices.len()) as u64)
}

/// A read-only, memory-mapped `{prefix}.bin/.idx` pair, fully validated on open.
pub struct IndexedDataset {
    idx_path: PathBuf,
    bin_path: PathBuf,
    dtype: DType,
    idx: Mmap,
    bin: Option<Mmap>,
    seq_count: usize,
    doc_count_plus_one: usize,
}

fn read_u64(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

fn map_file(path: &Path) -> Result<Option<Mmap>> {
    let file = File::open(path).map_err(io_err(path))?;
    if file.metadata().map_err(io_err(path))?.len() == 0 {
        return Ok(None);
    }
    // SAFETY: the file is opened read-only and mindkit never writes to a path it has
    // mapped (writers go to a temp file and rename); truncation by another process
    // would be the user's error, as with Megatron's numpy memmap.
    let map = unsafe { Mmap::map(&file) }.map_err(io_err(path))?;
    Ok(Some(map))
}

impl IndexedDataset {
    /// Open `{prefix}.idx` and `{prefix}.bin`, checking every size and pointer.
    pub fn open(prefix: &Path) -> Result<Self> {
        let (bin_path, idx_path) = bin_idx_paths(prefix);
        let idx = map_file(&idx_path)?.ok_or_else(|| IndexedError::Corrupt {
            path: idx_path.clone(),
            what: "empty file".into(),
        })?;
        let corrupt = |what: String| IndexedError::Corrupt {
            path: idx_path.clone(),
            what,
        };
        if idx.len() < HEADER_LEN {
            return Err(corrupt(format!(
                "{} bytes, shorter than the {HEADER_LEN}-byte header",
                idx.len()
            )));
        }
        if &idx[..9] != MAGIC {
            return Err(IndexedError::BadMagic { path: idx_path });
        }
        let version = read_u64(&idx, 9);
        if version != 1 {
            return Err(IndexedError::BadVersion {
                path: idx_path,
                version,
            });
        }
        let dtype = DType::from_code(idx[17]).ok_or(IndexedError::BadDType {
            path: idx_path.clone(),
            code: idx[17],
        })?;
        let s = read_u64(&idx, 18);
        let d = read_u64(&idx, 26);
        let expected = s
            .checked_mul(12)
            .and_then(|x| d.checked_mul(8).and_then(|y| x.checked_add(y)))
            .and_then(|x| x.checked_add(HEADER_LEN as u64))
            .ok_or_else(|| corrupt(format!("counts overflow (sequences {s}, documents {d})")))?;
        // Multimodal indexes carry one extra mode byte per sequence.
        if idx.len() as u64 != expected && idx.len() as u64 != expected.saturating_add(s) {
            return Err(corrupt(format!(
                "file is {} bytes but header says {s} sequences and {d} document indices ({expected} bytes)",
                idx.len()
            )));
        }
        if d == 0 {
            return Err(corrupt("document index list is empty".into()));
        }
        let bin = map_file(&bin_path)?;
        let ds = IndexedDataset {
            idx_path,
            bin_path,
            dtype,
            idx,
            bin,
            seq_count: s as usize,
            doc_count_plus_one: d as usize,
        };
        ds.validate()?;
        Ok(ds)
    }

    fn validate(&self) -> Result<()> {
        let corrupt = |path: &Path, what: String| IndexedError::Corrupt {
            path: path.to_path_buf(),
            what,
        };
        let bin_len = self.bin_bytes().len() as u64;
        // The pair's consistency first, so that an .idx beside another run's .bin is reported
        // as such (naming both) rather than as a sequence out of range. A damaged last entry
        // is left to the per-sequence checks below.
        if let Some(expected) = self.indexed_bytes() {
            if expected != bin_len {
                return Err(IndexedError::Mismatch {
                    bin: self.bin_path.clone(),
                    idx: self.idx_path.clone(),
                    bin_len,
                    expected,
                });
            }
        }
        for i in 0..self.seq_count {
            let len = self.raw_length(i);
            if len < 0 {
                return Err(corrupt(
                    &self.idx_path,
                    format!("sequence {i} has negative length {len}"),
                ));
            }
            let ptr = self.raw_pointer(i);
            let end = (len as u64)
                .checked_mul(self.dtype.size() as u64)
                .and_then(|b| u64::try_from(ptr).ok().and_then(|p| p.checked_add(b)));
            match end {
                Some(e) if e <= bin_len => {}
                _ => {
                    return Err(corrupt(
                        &self.bin_path,
                        format!(
                            "sequence {i} (pointer {ptr}, {len} tokens) lies outside the {bin_len}-byte .bin"
                        ),
                    ))
                }
            }
        }
        let mut prev = 0i64;
        for k in 0..self.doc_count_plus_one {
            let v = self.doc_index(k);
            if (k == 0 && v != 0) || v < prev || v as u64 > self.seq_count as u64 {
                return Err(corrupt(
                    &self.idx_path,
                    format!("document index {k} = {v} is out of order or range"),
                ));
            }
            prev = v;
        }
        if prev as usize != self.seq_count {
            return Err(corrupt(
                &self.idx_path,
                format!(
                    "last document index {prev} != sequence count {}",
                    self.seq_count
                ),
            ));
        }
        Ok(())
    }

    /// Bytes of `.bin` the index accounts for: the end of its last sequence (pointers are a
    /// running sum of lengths, as Megatron writes them); `None` if that entry is invalid.
    fn indexed_bytes(&self) -> Option<u64> {
        let Some(last) = self.seq_count.checked_sub(1) else {
            return Some(0);
        };
        let len = u64::try_from(self.raw_length(last)).ok()?;
        let pointer = u64::try_from(self.raw_pointer(last)).ok()?;
        len.checked_mul(self.dtype.size() as u64)?
            .checked_add(pointer)
    }

    fn raw_length(&self, i: usize) -> i32 {
        let at = HEADER_LEN + 4 * i;
        let b = &self.idx[at..at + 4];
        i32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }

    fn raw_pointer(&self, i: usize) -> i64 {
        read_u64(&self.idx, HEADER_LEN + 4 * self.seq_count + 8 * i) as i64
    }

    /// Path of the `.idx` file.
    pub fn idx_path(&self) -> &Path {
        &self.idx_path
    }

    /// The token dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of sequences.
    pub fn len(&self) -> usize {
        self.seq_count
    }

    /// True when there are no sequences.
    pub fn is_empty(&self) -> bool {
        self.seq_count == 0
    }

    /// Number of documents (entries in the document index minus one).
    pub fn doc_count(&self) -> usize {
        self.doc_count_plus_one - 1
    }

    /// Entry `k` of the document index (`0 ..= doc_count()`).
    pub fn doc_index(&self, k: usize) -> i64 {
        read_u64(&self.idx, HEADER_LEN + 12 * self.seq_count + 8 * k) as i64
    }

    /// Token count of sequence `i`.
    pub fn sequence_length(&self, i: usize) -> usize {
        self.raw_length(i) as usize
    }

    /// Sequences `[start, end)` that form document `k`.
    pub fn document_sequences(&self, k: usize) -> std::ops::Range<usize> {
        self.doc_index(k) as usize..self.doc_index(k + 1) as usize
    }

    /// The tokens of sequence `i`.
    pub fn sequence(&self, i: usize) -> Vec<i64> {
        let size = self.dtype.size();
        let start = self.raw_pointer(i) as usize;
        let end = start + self.sequence_length(i) * size;
        self.bin_bytes()[start..end]
            .chunks_exact(size)
            .map(|c| self.dtype.decode(c))
            .collect()
    }

    /// Tokens `from..from + len` of sequence `i` (clipped to its end), appended to `out`.
    pub fn tokens_into(&self, i: usize, from: usize, len: usize, out: &mut Vec<i64>) {
        let size = self.dtype.size();
        let n = self.sequence_length(i);
        let (from, to) = (from.min(n), from.saturating_add(len).min(n));
        let start = self.raw_pointer(i) as usize;
        let bytes = &self.bin_bytes()[start + from * size..start + to * size];
        out.extend(bytes.chunks_exact(size).map(|c| self.dtype.decode(c)));
    }

    /// The largest token id in the `.bin` (a parallel scan; −1 when empty).
    pub fn max_token(&self) -> i64 {
        use rayon::prelude::*;
        let size = self.dtype.size();
        self.bin_bytes()
            .par_chunks(size * (1 << 16))
            .map(|block| {
                block
                    .chunks_exact(size)
                    .map(|c| self.dtype.decode(c))
                    .max()
                    .unwrap_or(-1)
            })
            .max()
            .unwrap_or(-1)
    }

    /// The whole `.bin` contents.
    pub fn bin_bytes(&self) -> &[u8] {
        self.bin.as_deref().unwrap_or(&[])
    }

    /// Total tokens over all sequences.
    pub fn total_tokens(&self) -> u64 {
        (0..self.seq_count)
            .map(|i| self.sequence_length(i) as u64)
            .sum()
    }
}

/// Merge datasets in the given order into `output` (Megatron's `tools/merge_datasets.py`).
/// Returns (documents, sequences, tokens, bytes written).
pub fn merge(inputs: &[PathBuf], output: &Path, force: bool) -> Result<(usize, usize, u64, u64)> {
    let first = inputs.first().ok_or_else(|| IndexedError::Corrupt {
        path: output.to_path_buf(),
        what: "no inputs to merge".into(),
    })?;
    let input_files: Vec<PathBuf> = inputs
        .iter()
        .flat_map(|p| <[PathBuf; 2]>::from(bin_idx_paths(p)))
        .collect();
    let input_files: Vec<&Path> = input_files.iter().map(PathBuf::as_path).collect();
    check_output(output, &input_files, force)?;
    let first = IndexedDataset::open(first)?;
    let mut writer = IndexedWriter::create(output, first.dtype(), force)?;
    writer.append_dataset(&first)?;
    drop(first);
    for p in &inputs[1..] {
        let ds = IndexedDataset::open(p)?;
        writer.append_dataset(&ds)?;
    }
    let (docs, seqs, tokens) = (writer.documents(), writer.sequences(), writer.tokens());
    let bytes = writer.finish()?;
    Ok((docs, seqs, tokens, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn worked_example_from_reference() {
        // docs/data.md §1.1: lengths 5,3,7 uint16 -> 102-byte idx, pointers 0,10,16.
        let bytes = encode_index(DType::U16, &[5, 3, 7], &[0, 1, 2, 3]);
        assert_eq!(bytes.len(), 102);
        assert_eq!(&bytes[..9], MAGIC);
        assert_eq!(bytes[17], 8);
        let ptr = |i: usize| read_u64(&bytes, 34 + 12 + 8 * i);
        assert_eq!((ptr(0), ptr(1), ptr(2)), (0, 10, 16));
    }

    fn write(dir: &Path, docs: &[Vec<Vec<i64>>], dtype: DType) -> PathBuf {
        let prefix = dir.join("ds");
        let mut w = IndexedWriter::create(&prefix, dtype, true).unwrap();
        for d in docs {
            w.add_document(d).unwrap();
        }
        w.finish().unwrap();
        prefix
    }

    proptest! {
        #[test]
        fn round_trip(docs in prop::collection::vec(
            prop::collection::vec(prop::collection::vec(0i64..65535, 0..20), 0..4), 0..30),
            wide in any::<bool>()) {
            let dir = tempfile::tempdir().unwrap();
            let dtype = if wide { DType::I32 } else { DType::U16 };
            let prefix = write(dir.path(), &docs, dtype);
            let ds = IndexedDataset::open(&prefix).unwrap();
            prop_assert_eq!(ds.doc_count(), docs.len());
            let mut seq = 0;
            for (k, d) in docs.iter().enumerate() {
                prop_assert_eq!(ds.document_sequences(k), seq..seq + d.len());
                for s in d {
                    prop_assert_eq!(&ds.sequence(seq), s);
                    seq += 1;
                }
            }
        }
    }

    #[test]
    fn token_out_of_range_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = IndexedWriter::create(&dir.path().join("x"), DType::U16, false).unwrap();
        let err = w.add_sequence(&[70000i64]).unwrap_err();
        assert!(
            err.to_string().contains("does not fit dtype uint16"),
            "{err}"
        );
    }

    #[test]
    fn unfinished_writer_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut w = IndexedWriter::create(&dir.path().join("x"), DType::I32, false).unwrap();
            w.add_document(&[vec![1i64, 2]]).unwrap();
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn refuses_to_overwrite_without_force() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = write(dir.path(), &[vec![vec![1]]], DType::I32);
        let err = IndexedWriter::create(&prefix, DType::I32, false)
            .err()
            .unwrap();
        assert!(matches!(
            err,
            IndexedError::Output(OutputError::Exists { .. })
        ));
    }

    fn corrupt_open(mutate: impl FnOnce(&mut Vec<u8>)) -> IndexedError {
        let dir = tempfile::tempdir().unwrap();
        let prefix = write(
            dir.path(),
            &[vec![vec![1, 2, 3]], vec![vec![4]]],
            DType::U16,
        );
        let (_, idx) = bin_idx_paths(&prefix);
        let mut bytes = std::fs::read(&idx).unwrap();
        mutate(&mut bytes);
        std::fs::write(&idx, bytes).unwrap();
        IndexedDataset::open(&prefix).err().unwrap()
    }

    #[test]
    fn bad_magic() {
        assert!(matches!(
            corrupt_open(|b| b[0] = b'X'),
            IndexedError::BadMagic { .. }
        ));
    }

    #[test]
    fn bad_version() {
        assert!(matches!(
            corrupt_open(|b| b[9] = 2),
            IndexedError::BadVersion { .. }
        ));
    }

    #[test]
    fn bad_dtype() {
        assert!(matches!(
            corrupt_open(|b| b[17] = 99),
            IndexedError::BadDType { .. }
        ));
    }

    #[test]
    fn truncated_index() {
        assert!(matches!(
            corrupt_open(|b| b.truncate(40)),
            IndexedError::Corrupt { .. }
        ));
        assert!(matches!(
            corrupt_open(|b| b.truncate(10)),
            IndexedError::Corrupt { .. }
        ));
    }

    #[test]
    fn huge_counts_do_not_allocate() {
        let e = corrupt_open(|b| b[18..26].copy_from_slice(&u64::MAX.to_le_bytes()));
        assert!(matches!(e, IndexedError::Corrupt { .. }), "{e}");
    }

    #[test]
    fn pointer_outside_bin() {
        // pointer of sequence 0 lives at 34 + 4*2 (the last one is checked against the .bin's
        // length first: mismatched_pair_refused)
        let e = corrupt_open(|b| b[42..50].copy_from_slice(&1000i64.to_le_bytes()));
        assert!(e.to_string().contains("outside"), "{e}");
    }

    #[test]
    fn mismatched_pair_refused() {
        // A crash between the renames of a replace (before the .idx was removed first) left the
        // previous run's .idx beside the new .bin: both the longer and the shorter case.
        for (old, new) in [
            (vec![1i64, 2], vec![1i64, 2, 3]),
            (vec![1, 2, 3], vec![4, 5]),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let prefix = write(dir.path(), &[vec![old]], DType::U16);
            let (bin, idx) = bin_idx_paths(&prefix);
            let old_idx = std::fs::read(&idx).unwrap();
            write(dir.path(), &[vec![new]], DType::U16);
            std::fs::write(&idx, old_idx).unwrap();
            let e = IndexedDataset::open(&prefix).err().unwrap();
            assert!(matches!(e, IndexedError::Mismatch { .. }), "{e}");
            let msg = e.to_string();
            for path in [&bin, &idx] {
                assert!(msg.contains(&*path.to_string_lossy()), "{msg}");
            }
        }
    }

    #[test]
    fn merge_refuses_an_input_as_output() {
        let dir = tempfile::tempdir().unwrap();
        let a = write(dir.path(), &[vec![vec![1, 2]]], DType::U16);
        let e = merge(std::slice::from_ref(&a), &a, true).unwrap_err();
        assert!(
            matches!(e, IndexedError::Output(OutputError::IsInput { .. })),
            "{e}"
        );
        assert_eq!(IndexedDataset::open(&a).unwrap().sequence(0), vec![1, 2]);
    }

    #[test]
    fn merge_concatenates() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        let b = dir.path().join("b");
        for (p, docs) in [
            (&a, vec![vec![vec![1i64, 2]], vec![]]),
            (&b, vec![vec![vec![3], vec![4, 5]]]),
        ] {
            let mut w = IndexedWriter::create(p, DType::U16, false).unwrap();
            for d in &docs {
                w.add_document(d).unwrap();
            }
            w.finish().unwrap();
        }
        let out = dir.path().join("c");
        let (docs, seqs, tokens, _) = merge(&[a, b], &out, false).unwrap();
        assert_eq!((docs, seqs, tokens), (3, 3, 5));
        let ds = IndexedDataset::open(&out).unwrap();
        assert_eq!(
            (0..4).map(|k| ds.doc_index(k)).collect::<Vec<_>>(),
            vec![0, 1, 1, 3]
        );
        assert_eq!(ds.sequence(2), vec![4, 5]);
    }
}
