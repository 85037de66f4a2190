//! Record streams from raw data files: `.jsonl`, `.json` (array or one object per line),
//! `.txt` (one document per line), each optionally `.gz`, plus `.parquet` and HF `datasets`
//! `.arrow` files, given as files, directories or globs.
//!
//! Everything streams: a JSON array is walked element by element, parquet and arrow are
//! read batch by batch, so memory stays bounded whatever the input size; one record (a line,
//! an array element, a row) is refused above a size cap ([`DEFAULT_MAX_RECORD_BYTES`]) before
//! it is held whole.
//!
//! A directory or glob lists files of one format: files of several formats in one listing are
//! an error unless a format is chosen ([`expand_inputs_as`]), so a stray `README.txt` beside the
//! data is never read instead of (or as well as) it.

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arrow::array::ArrayRef;
use arrow::datatypes::{DataType, Field, FieldRef, Schema};
use arrow::error::ArrowError;
use arrow::record_batch::{RecordBatch, RecordBatchOptions};
use serde_json::{Map, Value};

use super::untrusted::{check_rows, contain_panics, Contained};

/// Where a record came from, for error messages.
#[derive(Debug, Clone)]
pub struct Location {
    /// The input file.
    pub file: Arc<PathBuf>,
    /// 1-based line (JSON lines, text), element (JSON array) or row (parquet, arrow).
    pub number: u64,
    /// What `number` counts.
    pub unit: &'static str,
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{} {}", self.file.display(), self.unit, self.number)
    }
}

/// A record that could not be read; skippable with `--skip-bad-records`.
#[derive(Debug, Clone)]
pub struct BadRecord {
    /// Where it is.
    pub loc: Location,
    /// Short reason category, for the summary ("malformed json", "invalid utf-8", ...).
    pub reason: &'static str,
    /// Details.
    pub detail: String,
}

impl std::fmt::Display for BadRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}: {}", self.loc, self.reason, self.detail)
    }
}

/// One input record: a JSON object (text lines become `{"text": line}`).
#[derive(Debug)]
pub struct Record {
    /// The fields.
    pub fields: Map<String, Value>,
    /// Where it came from.
    pub loc: Location,
    /// Its size in the input (line, element or row as JSON), for bounding memory downstream.
    pub bytes: u64,
}

/// Default cap on one record's size: far above any real document, and low enough that the
/// tokenizer's working memory for it (many times its size) fits a normal machine.
pub const DEFAULT_MAX_RECORD_BYTES: u64 = 64 << 20;

/// `reason` of a record above the size cap.
pub const TOO_LARGE: &str = "record too large";

/// Fatal input errors: the stream cannot continue past them.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// I/O error on a file.
    #[error("{path}: {cause}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause (not a `#[source]`, so that chained reports do not print it twice).
        cause: std::io::Error,
    },
    /// No such file, or a glob / directory that matched nothing usable.
    #[error("{0}: no such input (or no .json/.jsonl/.txt/.parquet/.arrow files in it)")]
    NotFound(PathBuf),
    /// A file whose extension is not a supported format.
    #[error("{0}: unsupported input format (expected .json, .jsonl, .txt (optionally .gz), .parquet or .arrow)")]
    Unsupported(PathBuf),
    /// A directory or glob listing files of more than one format.
    #[error("{input}: holds files of different formats ({listing}); choose the one to read with --input-format {choices} (files of the others are then skipped and counted), or name the files")]
    MixedFormats {
        /// The directory or glob.
        input: PathBuf,
        /// The files by format, e.g. `jsonl: corpus.jsonl; txt: README.txt`.
        listing: String,
        /// The formats found, as `--input-format` names them, e.g. `jsonl|txt`.
        choices: String,
    },
    /// A directory or glob with no file of the chosen format.
    #[error("{input}: no {format} files in it (--input-format {format})")]
    NoneOfFormat {
        /// The directory or glob.
        input: PathBuf,
        /// The chosen format.
        format: Format,
    },
    /// A file named on the command line whose format is not the chosen one.
    #[error("{path}: a {found} file, but --input-format is {format} (name only {format} files, or leave --input-format out)")]
    NotOfFormat {
        /// The file.
        path: PathBuf,
        /// Its format by extension.
        found: Format,
        /// The chosen format.
        format: Format,
    },
    /// A record error that cannot be skipped (e.g. inside a JSON array, where the parser
    /// cannot resynchronise).
    #[error("{0}")]
    Bad(BadRecord),
    /// Parquet / arrow decoding failure (truncated or corrupt file).
    #[error("{path}: {what}")]
    Columnar {
        /// The file.
        path: PathBuf,
        /// What failed.
        what: String,
    },
    /// The consumer asked to stop (an error downstream).
    #[error("stopped")]
    Stopped,
}

type Result<T> = std::result::Result<T, SourceError>;

/// Input formats (`--input-format` names them by their usual extension).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Format {
    /// `.jsonl` / `.ndjson` (optionally `.gz`): one JSON object per line.
    #[value(name = "jsonl")]
    JsonLines,
    /// `.json` (optionally `.gz`): an array, or a sequence of objects, decided by the first
    /// non-blank byte.
    #[value(name = "json")]
    Json,
    /// `.txt` / `.text` (optionally `.gz`): one document per line, as `{"text": line}`.
    #[value(name = "txt")]
    Text,
    /// `.parquet`: Apache Parquet.
    #[value(name = "parquet")]
    Parquet,
    /// `.arrow`: Arrow IPC stream or file (HF `datasets` cache files).
    #[value(name = "arrow")]
    Arrow,
}

impl Format {
    /// The name `--input-format` gives it.
    pub fn name(self) -> &'static str {
        match self {
            Format::JsonLines => "jsonl",
            Format::Json => "json",
            Format::Text => "txt",
            Format::Parquet => "parquet",
            Format::Arrow => "arrow",
        }
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One input file and how to read it.
#[derive(Debug, Clone)]
pub struct InputFile {
    /// Path on disk.
    pub path: PathBuf,
    /// Format.
    pub format: Format,
    /// gzip-compressed.
    pub gzip: bool,
    /// Size on disk.
    pub size: u64,
}

fn detect(path: &Path) -> Option<(Format, bool)> {
    let name = path.file_name()?.to_string_lossy().to_lowercase();
    let (stem, gzip) = match name.strip_suffix(".gz") {
        Some(s) => (s.to_string(), true),
        None => (name, false),
    };
    let ext = stem.rsplit('.').next()?;
    let format = match ext {
        "jsonl" | "ndjson" => Format::JsonLines,
        "json" => Format::Json,
        "txt" | "text" => Format::Text,
        "parquet" if !gzip => Format::Parquet,
        "arrow" if !gzip => Format::Arrow,
        _ => return None,
    };
    Some((format, gzip))
}

fn input_file(path: PathBuf) -> Result<InputFile> {
    let (format, gzip) = detect(&path).ok_or_else(|| SourceError::Unsupported(path.clone()))?;
    let size = std::fs::metadata(&path)
        .map_err(|cause| SourceError::Io {
            path: path.clone(),
            cause,
        })?
        .len();
    Ok(InputFile {
        path,
        format,
        gzip,
        size,
    })
}

/// A listed file that is not read.
#[derive(Debug, Clone)]
pub struct SkippedFile {
    /// The file.
    pub path: PathBuf,
    /// Its format, or `None` for an extension no format has.
    pub format: Option<Format>,
}

impl std::fmt::Display for SkippedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = self.path.file_name().unwrap_or(self.path.as_os_str());
        match self.format {
            Some(format) => write!(f, "{} ({format})", name.to_string_lossy()),
            None => write!(f, "{} (unsupported)", name.to_string_lossy()),
        }
    }
}

/// The files to read, and the files of directories and globs left out.
#[derive(Debug, Clone, Default)]
pub struct Inputs {
    /// Files to read, in order.
    pub files: Vec<InputFile>,
    /// Listed files not read: of another format than the chosen one, or of none.
    pub skipped: Vec<SkippedFile>,
}

/// Expand files, directories (their files, sorted by name) and globs into an ordered list of
/// input files; a directory or glob must list files of one format (see [`expand_inputs_as`]).
pub fn expand_inputs(inputs: &[PathBuf]) -> Result<Vec<InputFile>> {
    expand_inputs_as(inputs, None).map(|i| i.files)
}

/// [`expand_inputs`] reading only files of `format` when one is given: the other files of a
/// directory or glob are skipped (and listed in [`Inputs::skipped`]), and a file named directly
/// must be of that format. Without a format, a directory or glob holding files of several
/// formats is an error listing them: which one is the data is the user's call, not ours.
pub fn expand_inputs_as(inputs: &[PathBuf], format: Option<Format>) -> Result<Inputs> {
    let mut out = Inputs::default();
    for input in inputs {
        let text = input.to_string_lossy();
        if input.is_dir() {
            let listed = std::fs::read_dir(input)
                .map_err(|cause| SourceError::Io {
                    path: input.clone(),
                    cause,
                })?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file())
                .collect();
            select_listed(input, listed, format, &mut out)?;
        } else if input.exists() {
            let file = input_file(input.clone())?;
            match format {
                Some(wanted) if wanted != file.format => {
                    return Err(SourceError::NotOfFormat {
                        path: input.clone(),
                        found: file.format,
                        format: wanted,
                    })
                }
                _ => out.files.push(file),
            }
        } else if text.contains(['*', '?', '[']) {
            let listed = glob::glob(&text)
                .map_err(|e| SourceError::Columnar {
                    path: input.clone(),
                    what: format!("bad glob: {e}"),
                })?
                .filter_map(|p| p.ok())
                .filter(|p| p.is_file())
                .collect();
            select_listed(input, listed, format, &mut out)?;
        } else {
            return Err(SourceError::NotFound(input.clone()));
        }
    }
    Ok(out)
}

/// The files of one directory or glob: those of the one format present (or of `wanted`), in
/// name order; the rest go to `out.skipped`.
fn select_listed(
    input: &Path,
    mut listed: Vec<PathBuf>,
    wanted: Option<Format>,
    out: &mut Inputs,
) -> Result<()> {
    listed.sort();
    let mut by_format: BTreeMap<Format, Vec<PathBuf>> = BTreeMap::new();
    for path in listed {
        match detect(&path) {
            Some((format, _)) => by_format.entry(format).or_default().push(path),
            None => out.skipped.push(SkippedFile { path, format: None }),
        }
    }
    let chosen = match wanted {
        Some(format) => format,
        None => {
            let mut formats = by_format.keys();
            match (formats.next(), formats.next()) {
                (None, _) => return Err(SourceError::NotFound(input.to_path_buf())),
                (Some(&only), None) => only,
                (Some(_), Some(_)) => return Err(mixed_formats(input, &by_format)),
            }
        }
    };
    let Some(files) = by_format.remove(&chosen) else {
        return Err(SourceError::NoneOfFormat {
            input: input.to_path_buf(),
            format: chosen,
        });
    };
    for (format, paths) in by_format {
        out.skipped
            .extend(paths.into_iter().map(|path| SkippedFile {
                path,
                format: Some(format),
            }));
    }
    for path in files {
        out.files.push(input_file(path)?);
    }
    Ok(())
}

/// The error for a listing of several formats, naming a few files of each.
fn mixed_formats(input: &Path, by_format: &BTreeMap<Format, Vec<PathBuf>>) -> SourceError {
    const SHOWN: usize = 3;
    let listing: Vec<String> = by_format
        .iter()
        .map(|(format, paths)| {
            let mut names: Vec<String> = paths
                .iter()
                .take(SHOWN)
                .map(|p| {
                    p.file_name()
                        .unwrap_or(p.as_os_str())
                        .to_string_lossy()
                        .into_owned()
                })
                .collect();
            if paths.len() > SHOWN {
                names.push(format!("and {} more", paths.len() - SHOWN));
            }
            format!("{format}: {}", names.join(", "))
        })
        .collect();
    let choices: Vec<&str> = by_format.keys().map(|f| f.name()).collect();
    SourceError::MixedFormats {
        input: input.to_path_buf(),
        listing: listing.join("; "),
        choices: choices.join("|"),
    }
}

/// What a reader hands to its consumer.
pub enum Item {
    /// A good record.
    Record(Record),
    /// A record that could not be parsed.
    Bad(BadRecord),
}

/// Consumer callback: receives each item with its global index (input order, counting
/// good and bad records alike). Returning `false` stops the stream.
pub trait Sink {
    /// Should record number `index` be parsed at all (sharding)?
    fn wants(&mut self, index: u64) -> bool;
    /// Receive one item.
    fn accept(&mut self, index: u64, item: Item) -> bool;
}

/// Streams records from a list of input files, counting consumed bytes in `progress`.
pub struct RecordReader {
    files: Vec<InputFile>,
    progress: Arc<AtomicU64>,
    max_record_bytes: u64,
    columns: Option<BTreeSet<String>>,
}

/// Counts bytes read from the underlying file (compressed bytes for `.gz`).
struct CountingReader<R> {
    inner: R,
    progress: Arc<AtomicU64>,
}

impl<R: Read> Read for CountingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.progress.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// Counts the bytes of the JSON value being parsed and fails the read once they pass `cap`,
/// so that a huge array element or object is refused before serde_json has built it whole.
/// The parser resets `used` before each value.
struct RecordBudget<R> {
    inner: R,
    used: Rc<Cell<u64>>,
    cap: u64,
}

impl<R: Read> Read for RecordBudget<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        let used = self.used.get() + n as u64;
        self.used.set(used);
        if used > self.cap {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                too_large_detail(None, self.cap),
            ));
        }
        Ok(n)
    }
}

/// The detail of a record above the cap (`bytes` when its whole size is known).
fn too_large_detail(bytes: Option<u64>, cap: u64) -> String {
    let size = match bytes {
        Some(n) => format!("{n} bytes, more"),
        None => "more".to_string(),
    };
    format!("{size} than the {cap}-byte limit on one record (raise it with --max-record-bytes; tokenizing a record takes about 100 times its size in memory)")
}

/// How reading one line ended.
enum LineRead {
    /// End of input.
    End,
    /// A line, in the buffer.
    Line,
    /// A line longer than the cap, of this many bytes (newline excluded), read through and dropped.
    TooLong(u64),
}

/// Read one line (its newline included) into `line`, holding at most `cap` bytes of it.
fn read_line_capped(
    reader: &mut dyn BufRead,
    line: &mut Vec<u8>,
    cap: u64,
) -> std::io::Result<LineRead> {
    line.clear();
    let mut length = 0u64;
    loop {
        let buf = reader.fill_buf()?;
        if buf.is_empty() {
            return Ok(match length {
                0 => LineRead::End,
                n if n > cap => LineRead::TooLong(n),
                _ => LineRead::Line,
            });
        }
        let newline = memchr::memchr(b'\n', buf);
        let take = newline.map_or(buf.len(), |i| i + 1);
        let content = newline.map_or(take, |i| i) as u64;
        length += content;
        if length <= cap {
            line.extend_from_slice(&buf[..take]);
        } else {
            line.clear();
        }
        reader.consume(take);
        if newline.is_some() {
            return Ok(if length > cap {
                LineRead::TooLong(length)
            } else {
                LineRead::Line
            });
        }
    }
}

impl RecordReader {
    /// A reader over `files`, in order, with the default record size cap, reading every column.
    pub fn new(files: Vec<InputFile>) -> Self {
        RecordReader {
            files,
            progress: Arc::new(AtomicU64::new(0)),
            max_record_bytes: DEFAULT_MAX_RECORD_BYTES,
            columns: None,
        }
    }

    /// Refuse records (lines, array elements, rows as JSON) larger than `bytes`: a line is a
    /// bad record (skippable), an element of a JSON array stops the stream.
    pub fn with_max_record_bytes(mut self, bytes: u64) -> Self {
        self.max_record_bytes = bytes;
        self
    }

    /// Read only these top-level columns of parquet and arrow files: the others are neither
    /// converted nor checked (a binary image column beside the text need not be UTF-8).
    /// Records from JSON and text keep every field.
    pub fn with_columns(mut self, columns: impl IntoIterator<Item = String>) -> Self {
        self.columns = Some(columns.into_iter().collect());
        self
    }

    /// Shared counter of input bytes consumed so far.
    pub fn progress(&self) -> Arc<AtomicU64> {
        self.progress.clone()
    }

    /// Total input bytes on disk.
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }

    /// Stream every record into `sink`. Returns the number of records seen.
    pub fn run(&self, sink: &mut dyn Sink) -> Result<u64> {
        let mut index = 0u64;
        for f in &self.files {
            match f.format {
                Format::Parquet => self.read_parquet(f, &mut index, sink)?,
                Format::Arrow => self.read_arrow(f, &mut index, sink)?,
                _ => self.read_text_like(f, &mut index, sink)?,
            }
        }
        Ok(index)
    }

    fn open(&self, f: &InputFile) -> Result<Box<dyn BufRead>> {
        let file = File::open(&f.path).map_err(|cause| SourceError::Io {
            path: f.path.clone(),
            cause,
        })?;
        let counted = CountingReader {
            inner: file,
            progress: self.progress.clone(),
        };
        Ok(if f.gzip {
            Box::new(BufReader::with_capacity(
                1 << 20,
                flate2::read::MultiGzDecoder::new(BufReader::new(counted)),
            ))
        } else {
            Box::new(BufReader::with_capacity(1 << 20, counted))
        })
    }

    fn read_text_like(&self, f: &InputFile, index: &mut u64, sink: &mut dyn Sink) -> Result<()> {
        let mut reader = self.open(f)?;
        let file = Arc::new(f.path.clone());
        if f.format == Format::Json {
            let json = JsonInput {
                file,
                used: Rc::new(Cell::new(0)),
                cap: self.max_record_bytes,
            };
            return match first_non_blank(&mut reader, &f.path)? {
                Some(b'[') => json.read_array(reader, index, sink),
                _ => json.read_stream(reader, index, sink),
            };
        }
        let text_mode = f.format == Format::Text;
        let mut line = Vec::new();
        let mut number = 0u64;
        loop {
            let read = read_line_capped(reader.as_mut(), &mut line, self.max_record_bytes)
                .map_err(|cause| SourceError::Io {
                    path: f.path.clone(),
                    cause: std::io::Error::new(
                        cause.kind(),
                        format!("after line {number}: {cause}"),
                    ),
                })?;
            number += 1;
            let loc = || Location {
                file: file.clone(),
                number,
                unit: "line",
            };
            let offered = match read {
                LineRead::End => return Ok(()),
                LineRead::TooLong(bytes) => offer(index, sink, || {
                    Item::Bad(BadRecord {
                        loc: loc(),
                        reason: TOO_LARGE,
                        detail: too_large_detail(Some(bytes), self.max_record_bytes),
                    })
                }),
                LineRead::Line if !text_mode && line.iter().all(u8::is_ascii_whitespace) => true,
                LineRead::Line => offer(index, sink, || match text_mode {
                    true => parse_text_line(&line, loc()),
                    false => parse_json_line(&line, loc()),
                }),
            };
            if !offered {
                return Err(SourceError::Stopped);
            }
        }
    }

    fn read_parquet(&self, f: &InputFile, index: &mut u64, sink: &mut dyn Sink) -> Result<()> {
        use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
        let columnar = |what: String| SourceError::Columnar {
            path: f.path.clone(),
            what,
        };
        let file = File::open(&f.path).map_err(|cause| SourceError::Io {
            path: f.path.clone(),
            cause,
        })?;
        let not_readable = |e: String| columnar(format!("not a readable parquet file: {e}"));
        super::parquet_footer::check(&f.path).map_err(not_readable)?;
        let builder = contain_panics(|| ParquetRecordBatchReaderBuilder::try_new(file))
            .map_err(not_readable)?
            .map_err(|e| not_readable(e.to_string()))?;
        let groups = builder.metadata().row_groups().iter();
        let declared = groups.fold(0i64, |n, g| n.saturating_add(g.num_rows()));
        check_rows(declared, f.size, "the file").map_err(not_readable)?;
        let total_rows = builder.metadata().file_metadata().num_rows().max(1) as u64;
        let reader = contain_panics(|| builder.with_batch_size(1024).build())
            .map_err(not_readable)?
            .map_err(|e| columnar(e.to_string()))?;
        let mut rows = 0u64;
        let file_arc = Arc::new(f.path.clone());
        for batch in Contained::new(reader) {
            let batch = batch.map_err(|e| columnar(format!("after row {rows}: {e}")))?;
            self.emit_batch(&batch, &file_arc, &mut rows, index, sink)?;
            self.progress.fetch_add(
                f.size * batch.num_rows() as u64 / total_rows,
                Ordering::Relaxed,
            );
        }
        Ok(())
    }

    fn read_arrow(&self, f: &InputFile, index: &mut u64, sink: &mut dyn Sink) -> Result<()> {
        use arrow::ipc::reader::{FileReader, StreamReader};
        let columnar = |what: String| SourceError::Columnar {
            path: f.path.clone(),
            what,
        };
        let open = || {
            File::open(&f.path).map_err(|cause| SourceError::Io {
                path: f.path.clone(),
                cause,
            })
        };
        super::arrow_ipc::check(&f.path)
            .map_err(|e| columnar(format!("malformed arrow data: {e}")))?;
        let mut magic = [0u8; 6];
        let is_file_format = open()?.read_exact(&mut magic).is_ok() && &magic == b"ARROW1";
        let (kind, file) = (if is_file_format { "file" } else { "stream" }, open()?);
        let not_readable = |e: String| columnar(format!("not a readable arrow {kind}: {e}"));
        type Batches = Box<dyn Iterator<Item = arrow::error::Result<RecordBatch>>>;
        let batches = contain_panics(|| -> arrow::error::Result<Batches> {
            Ok(if is_file_format {
                Box::new(FileReader::try_new(BufReader::new(file), None)?)
            } else {
                Box::new(StreamReader::try_new(BufReader::new(file), None)?)
            })
        })
        .map_err(not_readable)?
        .map_err(|e| not_readable(e.to_string()))?;
        let mut rows = 0u64;
        let file_arc = Arc::new(f.path.clone());
        for batch in Contained::new(batches) {
            let batch: RecordBatch =
                batch.map_err(|e| columnar(format!("after row {rows}: {e}")))?;
            self.emit_batch(&batch, &file_arc, &mut rows, index, sink)?;
        }
        self.progress.fetch_add(f.size, Ordering::Relaxed);
        Ok(())
    }

    /// Convert an Arrow batch to JSON objects (nested lists and structs included) and emit
    /// them: only the columns asked for, binary values decoded as UTF-8 text, rows above the
    /// size cap refused.
    fn emit_batch(
        &self,
        batch: &RecordBatch,
        file: &Arc<PathBuf>,
        rows: &mut u64,
        index: &mut u64,
        sink: &mut dyn Sink,
    ) -> Result<()> {
        let columnar = |what: String| SourceError::Columnar {
            path: file.as_ref().clone(),
            what,
        };
        let batch = self
            .project(batch)
            .map_err(|e| columnar(format!("after row {rows}: {e}")))?;
        let (batch, undecodable) = decode_binary_columns(&batch).map_err(columnar)?;
        let mut buf = Vec::new();
        {
            let mut writer = arrow::json::LineDelimitedWriter::new(&mut buf);
            writer
                .write(&batch)
                .and_then(|_| writer.finish())
                .map_err(|e| columnar(format!("cannot convert rows after {rows} to JSON: {e}")))?;
        }
        let lines = buf.split(|&b| b == b'\n').filter(|l| !l.is_empty());
        for (row, line) in lines.enumerate() {
            *rows += 1;
            let loc = Location {
                file: file.clone(),
                number: *rows,
                unit: "row",
            };
            let make = || match undecodable.get(&row) {
                Some(detail) => Item::Bad(BadRecord {
                    loc,
                    reason: "invalid utf-8",
                    detail: detail.clone(),
                }),
                None if line.len() as u64 > self.max_record_bytes => Item::Bad(BadRecord {
                    loc,
                    reason: TOO_LARGE,
                    detail: too_large_detail(Some(line.len() as u64), self.max_record_bytes),
                }),
                None => parse_json_line(line, loc),
            };
            if !offer(index, sink, make) {
                return Err(SourceError::Stopped);
            }
        }
        Ok(())
    }

    /// The batch's columns that were asked for (all of them when none were named).
    fn project(&self, batch: &RecordBatch) -> std::result::Result<RecordBatch, ArrowError> {
        let Some(columns) = &self.columns else {
            return Ok(batch.clone());
        };
        let schema = batch.schema();
        let keep: Vec<usize> = (0..schema.fields().len())
            .filter(|&i| columns.contains(schema.field(i).name()))
            .collect();
        batch.project(&keep)
    }
}

/// `data_type` with every binary type in it replaced by the matching string type, or `None`
/// when it holds no binary. Parquet writers without a UTF-8 annotation store text as
/// `binary`; read as it is, the JSON conversion would give its hex digits.
fn text_type(data_type: &DataType) -> Option<DataType> {
    use DataType::*;
    // Converted fields become nullable: an invalid value is read as null (and its row refused).
    let field = |f: &FieldRef| {
        text_type(f.data_type())
            .map(|t| Arc::new(f.as_ref().clone().with_data_type(t).with_nullable(true)))
    };
    match data_type {
        Binary | BinaryView => Some(Utf8),
        LargeBinary => Some(LargeUtf8),
        List(f) => field(f).map(List),
        LargeList(f) => field(f).map(LargeList),
        FixedSizeList(f, n) => field(f).map(|f| FixedSizeList(f, *n)),
        Map(f, sorted) => field(f).map(|f| Map(f, *sorted)),
        Dictionary(key, value) => text_type(value).map(|v| Dictionary(key.clone(), Box::new(v))),
        Struct(fields) => {
            let converted: Vec<Option<FieldRef>> = fields.iter().map(field).collect();
            if converted.iter().all(Option::is_none) {
                return None;
            }
            let fields = fields.iter().zip(converted);
            Some(Struct(
                fields
                    .map(|(f, c)| c.unwrap_or_else(|| f.clone()))
                    .collect(),
            ))
        }
        _ => None,
    }
}

/// The batch with its binary columns decoded as UTF-8 text, and the rows (0-based in the
/// batch) holding invalid UTF-8, each with a message naming the column.
fn decode_binary_columns(
    batch: &RecordBatch,
) -> std::result::Result<(RecordBatch, BTreeMap<usize, String>), String> {
    let schema = batch.schema();
    let mut undecodable = BTreeMap::new();
    let mut fields = Vec::with_capacity(schema.fields().len());
    let mut columns = Vec::with_capacity(batch.num_columns());
    for (field, column) in schema.fields().iter().zip(batch.columns()) {
        let Some(target) = text_type(field.data_type()) else {
            fields.push(field.clone());
            columns.push(column.clone());
            continue;
        };
        let name = field.name();
        if !arrow::compute::can_cast_types(field.data_type(), &target) {
            return Err(format!(
                "column {name:?} of type {} holds binary values that cannot be read as text",
                field.data_type()
            ));
        }
        let (decoded, bad_rows) = decode_utf8(column, &target)
            .map_err(|e| format!("column {name:?}: cannot read binary values as text: {e}"))?;
        for (row, why) in bad_rows {
            undecodable.entry(row).or_insert_with(|| {
                format!("column {name:?} (binary, read as text) is not valid UTF-8: {why}")
            });
        }
        fields.push(Arc::new(Field::new(name, target, true)));
        columns.push(decoded);
    }
    let schema = Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()));
    let options = RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
    let batch = RecordBatch::try_new_with_options(schema, columns, &options)
        .map_err(|e| format!("cannot read binary columns as text: {e}"))?;
    Ok((batch, undecodable))
}

/// `column` cast to `target` (its binary values decoded as UTF-8), with the rows that are not
/// valid UTF-8 (null in the result) and why. The row-by-row search runs only when the column
/// as a whole fails to decode.
fn decode_utf8(
    column: &ArrayRef,
    target: &DataType,
) -> std::result::Result<(ArrayRef, Vec<(usize, String)>), ArrowError> {
    use arrow::compute::{cast_with_options, CastOptions};
    let strict = CastOptions {
        safe: false,
        ..CastOptions::default()
    };
    if let Ok(decoded) = cast_with_options(column, target, &strict) {
        return Ok((decoded, Vec::new()));
    }
    // A slice shares its parent's value buffer, which the cast validates whole: copy the row.
    let row_error = |row: usize| {
        let index = arrow::array::UInt64Array::from(vec![row as u64]);
        let copy = arrow::compute::take(column.as_ref(), &index, None)?;
        cast_with_options(&copy, target, &strict).map(|_| ())
    };
    let bad_rows = (0..column.len())
        .filter_map(|row| row_error(row).err().map(|e| (row, e.to_string())))
        .collect();
    let lenient = cast_with_options(column, target, &CastOptions::default())?;
    Ok((lenient, bad_rows))
}

fn first_non_blank(reader: &mut Box<dyn BufRead>, path: &Path) -> Result<Option<u8>> {
    loop {
        let buf = reader.fill_buf().map_err(|cause| SourceError::Io {
            path: path.to_path_buf(),
            cause,
        })?;
        if buf.is_empty() {
            return Ok(None);
        }
        // Skip a UTF-8 byte-order mark and whitespace before peeking.
        let skip = buf
            .iter()
            .position(|b| !b.is_ascii_whitespace() && ![0xEF, 0xBB, 0xBF].contains(b));
        match skip {
            Some(p) => {
                let b = buf[p];
                return Ok(Some(b));
            }
            None => {
                let n = buf.len();
                reader.consume(n);
            }
        }
    }
}

fn strip_newline(line: &[u8]) -> &[u8] {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    line.strip_suffix(b"\r").unwrap_or(line)
}

fn parse_text_line(line: &[u8], loc: Location) -> Item {
    match std::str::from_utf8(strip_newline(line)) {
        Ok(s) => {
            let mut fields = Map::new();
            fields.insert("text".into(), Value::String(s.to_string()));
            Item::Record(Record {
                fields,
                loc,
                bytes: line.len() as u64,
            })
        }
        Err(e) => Item::Bad(BadRecord {
            loc,
            reason: "invalid utf-8",
            detail: e.to_string(),
        }),
    }
}

fn parse_json_line(line: &[u8], loc: Location) -> Item {
    if let Err(e) = std::str::from_utf8(line) {
        return Item::Bad(BadRecord {
            loc,
            reason: "invalid utf-8",
            detail: e.to_string(),
        });
    }
    match serde_json::from_slice::<Value>(line) {
        Ok(value) => object_item(value, loc, line.len() as u64),
        Err(e) => Item::Bad(BadRecord {
            loc,
            reason: "malformed json",
            detail: e.to_string(),
        }),
    }
}

/// The JSON type name of a value, for messages.
pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Number the next record and hand it to `sink` if the sink wants it (sharding), building it
/// with `make` only then. Returns false when the sink stops the stream.
fn offer(index: &mut u64, sink: &mut dyn Sink, make: impl FnOnce() -> Item) -> bool {
    let i = *index;
    *index += 1;
    !sink.wants(i) || sink.accept(i, make())
}

/// A top-level JSON value as a record: objects are records, anything else a bad record.
fn object_item(value: Value, loc: Location, bytes: u64) -> Item {
    match value {
        Value::Object(fields) => Item::Record(Record { fields, loc, bytes }),
        other => Item::Bad(BadRecord {
            loc,
            reason: "not a json object",
            detail: format!("found {}", type_name(&other)),
        }),
    }
}

/// A `.json` file being parsed, with the size budget of its current value.
struct JsonInput {
    file: Arc<PathBuf>,
    /// Bytes of the value being parsed (shared with the [`RecordBudget`] reader).
    used: Rc<Cell<u64>>,
    cap: u64,
}

impl JsonInput {
    fn budgeted(&self, reader: Box<dyn BufRead>) -> RecordBudget<Box<dyn BufRead>> {
        RecordBudget {
            inner: reader,
            used: self.used.clone(),
            cap: self.cap,
        }
    }

    /// The error for a parse failure at `(number, unit)` of the file: a value above the cap,
    /// or malformed JSON / a read error.
    fn failure(
        &self,
        e: &serde_json::Error,
        number: u64,
        unit: &'static str,
        context: String,
    ) -> SourceError {
        let too_large = self.used.get() > self.cap;
        let (loc, reason, detail) = if too_large {
            let loc = Location {
                file: self.file.clone(),
                number,
                unit,
            };
            (loc, TOO_LARGE, too_large_detail(None, self.cap))
        } else {
            let loc = Location {
                file: self.file.clone(),
                number: e.line() as u64,
                unit: "line",
            };
            let reason = if e.is_io() {
                "read error"
            } else {
                "malformed json"
            };
            (loc, reason, format!("{e} ({context})"))
        };
        SourceError::Bad(BadRecord {
            loc,
            reason,
            detail,
        })
    }

    /// Not an array: a sequence of JSON objects, one per line or pretty-printed over many
    /// lines (e.g. one moss-003 conversation per file).
    fn read_stream(
        &self,
        reader: Box<dyn BufRead>,
        index: &mut u64,
        sink: &mut dyn Sink,
    ) -> Result<()> {
        let mut stream =
            serde_json::Deserializer::from_reader(self.budgeted(reader)).into_iter::<Value>();
        let mut number = 0u64;
        loop {
            self.used.set(0);
            let Some(next) = stream.next() else {
                return Ok(());
            };
            number += 1;
            let value = next.map_err(|e| {
                self.failure(&e, number, "object", format!("after object {}", number - 1))
            })?;
            let loc = Location {
                file: self.file.clone(),
                number,
                unit: "object",
            };
            let bytes = self.used.get();
            if !offer(index, sink, || object_item(value, loc, bytes)) {
                return Err(SourceError::Stopped);
            }
        }
    }

    /// Walk a top-level JSON array element by element without holding it in memory.
    fn read_array(
        &self,
        reader: Box<dyn BufRead>,
        index: &mut u64,
        sink: &mut dyn Sink,
    ) -> Result<()> {
        use serde::de::{DeserializeSeed, IgnoredAny, SeqAccess, Visitor};

        struct ArrayVisitor<'a> {
            json: &'a JsonInput,
            index: &'a mut u64,
            sink: &'a mut dyn Sink,
            stopped: &'a mut bool,
        }
        impl<'de> Visitor<'de> for ArrayVisitor<'_> {
            type Value = ();
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON array of objects")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<(), A::Error> {
                let mut element = 0u64;
                loop {
                    let i = *self.index;
                    let wanted = self.sink.wants(i);
                    self.json.used.set(0);
                    let got = if wanted {
                        seq.next_element::<Value>()?
                    } else {
                        seq.next_element::<IgnoredAny>()?.map(|_| Value::Null)
                    };
                    let Some(value) = got else { return Ok(()) };
                    element += 1;
                    *self.index += 1;
                    if !wanted {
                        continue;
                    }
                    let loc = Location {
                        file: self.json.file.clone(),
                        number: element,
                        unit: "element",
                    };
                    let bytes = self.json.used.get();
                    if !self.sink.accept(i, object_item(value, loc, bytes)) {
                        *self.stopped = true;
                        return Err(serde::de::Error::custom("stopped"));
                    }
                }
            }
        }
        impl<'de> DeserializeSeed<'de> for ArrayVisitor<'_> {
            type Value = ();
            fn deserialize<D: serde::Deserializer<'de>>(
                self,
                d: D,
            ) -> std::result::Result<(), D::Error> {
                d.deserialize_seq(self)
            }
        }

        let mut stopped = false;
        let mut de = serde_json::Deserializer::from_reader(self.budgeted(reader));
        let start = *index;
        let result = ArrayVisitor {
            json: self,
            index,
            sink,
            stopped: &mut stopped,
        }
        .deserialize(&mut de)
        .and_then(|_| de.end());
        match result {
            Ok(()) => Ok(()),
            Err(_) if stopped => Err(SourceError::Stopped),
            Err(e) => {
                let done = *index - start;
                Err(self.failure(
                    &e,
                    done + 1,
                    "element",
                    format!("in the array, after element {done}"),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Collect(Vec<std::result::Result<Value, String>>);
    impl Sink for Collect {
        fn wants(&mut self, _: u64) -> bool {
            true
        }
        fn accept(&mut self, _: u64, item: Item) -> bool {
            self.0.push(match item {
                Item::Record(r) => Ok(Value::Object(r.fields)),
                Item::Bad(b) => Err(b.to_string()),
            });
            true
        }
    }

    fn read(name: &str, bytes: &[u8]) -> (Result<u64>, Vec<std::result::Result<Value, String>>) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        let files = expand_inputs(&[p]).unwrap();
        let mut sink = Collect(Vec::new());
        let n = RecordReader::new(files).run(&mut sink);
        (n, sink.0)
    }

    #[test]
    fn jsonl_with_bad_lines() {
        let (n, items) = read(
            "a.jsonl",
            b"{\"text\":\"a\"}\n\n{bad\n[1]\n{\"text\":\"\xff\"}\n",
        );
        assert_eq!(n.unwrap(), 4);
        assert!(items[0].is_ok());
        assert!(items[1]
            .as_ref()
            .unwrap_err()
            .contains("a.jsonl:line 3: malformed json"));
        assert!(items[2].as_ref().unwrap_err().contains("not a json object"));
        assert!(items[3].as_ref().unwrap_err().contains("invalid utf-8"));
    }

    #[test]
    fn json_array_streams() {
        let (n, items) = read("a.json", b" [ {\"a\":1}, {\"a\":2} ]\n");
        assert_eq!(n.unwrap(), 2);
        assert_eq!(items.len(), 2);
    }

    #[test]
    fn json_array_truncated_is_fatal_with_location() {
        let (n, _) = read("a.json", b"[{\"a\":1},\n{\"a\":");
        let e = n.unwrap_err().to_string();
        assert!(
            e.contains("a.json:line 2") && e.contains("after element 1"),
            "{e}"
        );
    }

    #[test]
    fn pretty_printed_object() {
        let (n, items) = read("a.json", b"{\n  \"chat\": {\n \"turn_1\": {}\n }\n}\n");
        assert_eq!(n.unwrap(), 1);
        assert!(items[0].is_ok());
    }

    #[test]
    fn json_object_per_line() {
        let (n, _) = read("a.json", b"{\"a\":1}\n{\"a\":2}\n");
        assert_eq!(n.unwrap(), 2);
    }

    #[test]
    fn gz_and_text() {
        use std::io::Write;
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(b"one\r\n\ntwo").unwrap();
        let (n, items) = read("a.txt.gz", &enc.finish().unwrap());
        assert_eq!(n.unwrap(), 3);
        assert_eq!(items[0].as_ref().unwrap()["text"], "one");
        assert_eq!(items[1].as_ref().unwrap()["text"], "");
        assert_eq!(items[2].as_ref().unwrap()["text"], "two");
    }

    #[test]
    fn unsupported_and_missing() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.csv");
        std::fs::write(&p, b"a").unwrap();
        assert!(matches!(
            expand_inputs(&[p]),
            Err(SourceError::Unsupported(_))
        ));
        assert!(matches!(
            expand_inputs(&[dir.path().join("nope.jsonl")]),
            Err(SourceError::NotFound(_))
        ));
    }

    #[test]
    fn truncated_parquet_is_an_error() {
        let (n, _) = read("a.parquet", b"PAR1garbage");
        assert!(n
            .unwrap_err()
            .to_string()
            .contains("not a readable parquet file"));
    }

    #[test]
    fn lines_are_held_up_to_the_cap() {
        let text = b"short\nexactly10\n0123456789ab\nlast";
        // A tiny buffer, so that lines straddle refills.
        let mut reader = BufReader::with_capacity(3, &text[..]);
        let mut line = Vec::new();
        let mut got = Vec::new();
        loop {
            match read_line_capped(&mut reader, &mut line, 10).unwrap() {
                LineRead::End => break,
                LineRead::Line => got.push(String::from_utf8(line.clone()).unwrap()),
                LineRead::TooLong(n) => {
                    assert!(line.is_empty());
                    got.push(format!("too long: {n}"));
                }
            }
        }
        assert_eq!(got, ["short\n", "exactly10\n", "too long: 12", "last"]);
    }

    #[test]
    fn listing_of_several_formats_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["a.jsonl", "b.jsonl", "c.json", "README.txt", "LICENSE"] {
            std::fs::write(dir.path().join(name), b"{}\n").unwrap();
        }
        let input = [dir.path().to_path_buf()];
        let e = expand_inputs(&input).unwrap_err().to_string();
        assert!(
            e.contains("jsonl: a.jsonl, b.jsonl; json: c.json; txt: README.txt")
                && e.contains("--input-format jsonl|json|txt"),
            "{e}"
        );
        let chosen = expand_inputs_as(&input, Some(Format::JsonLines)).unwrap();
        let names = |paths: Vec<&PathBuf>| -> Vec<String> {
            paths
                .iter()
                .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
                .collect()
        };
        assert_eq!(
            names(chosen.files.iter().map(|f| &f.path).collect()),
            ["a.jsonl", "b.jsonl"]
        );
        let skipped: Vec<String> = chosen.skipped.iter().map(ToString::to_string).collect();
        assert_eq!(
            skipped,
            ["LICENSE (unsupported)", "c.json (json)", "README.txt (txt)"]
        );
        assert!(matches!(
            expand_inputs_as(&input, Some(Format::Parquet)),
            Err(SourceError::NoneOfFormat { .. })
        ));
    }

    #[test]
    fn binary_types_read_as_text() {
        let item = Arc::new(Field::new("item", DataType::Binary, false));
        let list = DataType::List(item);
        let text_list = text_type(&list).unwrap();
        assert_eq!(
            text_list,
            DataType::List(Arc::new(Field::new("item", DataType::Utf8, true)))
        );
        let fields = vec![
            Field::new("role", DataType::Utf8, true),
            Field::new("content", DataType::LargeBinary, true),
        ];
        let Some(DataType::Struct(converted)) = text_type(&DataType::Struct(fields.into())) else {
            panic!("a struct with a binary field converts")
        };
        assert_eq!(converted[0].data_type(), &DataType::Utf8);
        assert_eq!(converted[1].data_type(), &DataType::LargeUtf8);
        assert_eq!(text_type(&DataType::Utf8), None);
        assert_eq!(text_type(&DataType::Int64), None);
    }

    #[test]
    fn nested_binary_is_read_as_text() {
        use arrow::array::{BinaryArray, ListArray, StructArray};
        use arrow::buffer::OffsetBuffer;
        use arrow::datatypes::Fields;
        let bytes = |v: [&'static [u8]; 4]| -> ArrayRef { Arc::new(BinaryArray::from(v.to_vec())) };
        let roles = bytes([b"human", b"gpt", b"human", b"gpt"]);
        let contents = bytes([b"hi", b"hello", b"bad \xff", b"x"]);
        let fields = Fields::from(vec![
            Field::new("from", DataType::Binary, false),
            Field::new("value", DataType::Binary, false),
        ]);
        let messages = StructArray::new(fields.clone(), vec![roles, contents], None);
        let item = Arc::new(Field::new("item", DataType::Struct(fields), false));
        let offsets = OffsetBuffer::new(vec![0, 2, 4].into());
        let list = ListArray::new(item, offsets, Arc::new(messages), None);
        let batch = RecordBatch::try_from_iter([("conversations", Arc::new(list) as ArrayRef)]);
        let batch = batch.unwrap();
        let mut buf = Vec::new();
        let mut w = parquet::arrow::ArrowWriter::try_new(&mut buf, batch.schema(), None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        let (n, items) = read("a.parquet", &buf);
        assert_eq!(n.unwrap(), 2);
        let first = items[0].as_ref().unwrap();
        assert_eq!(first["conversations"][1]["value"], "hello");
        let e = items[1].as_ref().unwrap_err();
        assert!(
            e.contains("a.parquet:row 2: invalid utf-8: column \"conversations\""),
            "{e}"
        );
    }
}
