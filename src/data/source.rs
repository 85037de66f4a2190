//! Record streams from raw data files: `.jsonl`, `.json` (array or one object per line),
//! `.txt` (one document per line), each optionally `.gz`, plus `.parquet` and HF `datasets`
//! `.arrow` files, given as files, directories or globs.
//!
//! Everything streams: a JSON array is walked element by element, parquet and arrow are
//! read batch by batch, so memory stays bounded whatever the input size.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

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
}

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

/// Input formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// One JSON object per line (also `.json` files that do not start with `[`).
    JsonLines,
    /// `.json`: an array, or JSON lines, decided by the first non-blank byte.
    Json,
    /// One document per line, as `{"text": line}`.
    Text,
    /// Apache Parquet.
    Parquet,
    /// Arrow IPC stream or file (HF `datasets` cache files).
    Arrow,
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

/// Expand files, directories (their supported files, sorted by name) and globs into
/// an ordered list of input files.
pub fn expand_inputs(inputs: &[PathBuf]) -> Result<Vec<InputFile>> {
    let mut out = Vec::new();
    for input in inputs {
        let text = input.to_string_lossy();
        if input.is_dir() {
            let mut files: Vec<PathBuf> = std::fs::read_dir(input)
                .map_err(|cause| SourceError::Io {
                    path: input.clone(),
                    cause,
                })?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file() && detect(p).is_some())
                .collect();
            // As MindSpeed-LLM: a directory's format is its most common extension, so a
            // stray README.txt or checksum list beside the .json files is left out.
            let mut counts: std::collections::BTreeMap<(u8, bool), usize> = Default::default();
            let key = |p: &Path| detect(p).map(|(f, gz)| (f as u8, gz));
            for f in &files {
                *counts.entry(key(f).unwrap_or((0, false))).or_default() += 1;
            }
            if let Some((&best, _)) = counts.iter().max_by_key(|(_, &n)| n) {
                files.retain(|f| key(f) == Some(best));
            }
            files.sort();
            if files.is_empty() {
                return Err(SourceError::NotFound(input.clone()));
            }
            for f in files {
                out.push(input_file(f)?);
            }
        } else if input.exists() {
            out.push(input_file(input.clone())?);
        } else if text.contains(['*', '?', '[']) {
            let mut files: Vec<PathBuf> = glob::glob(&text)
                .map_err(|e| SourceError::Columnar {
                    path: input.clone(),
                    what: format!("bad glob: {e}"),
                })?
                .filter_map(|p| p.ok())
                .filter(|p| p.is_file())
                .collect();
            files.sort();
            if files.is_empty() {
                return Err(SourceError::NotFound(input.clone()));
            }
            for f in files {
                out.push(input_file(f)?);
            }
        } else {
            return Err(SourceError::NotFound(input.clone()));
        }
    }
    Ok(out)
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

impl RecordReader {
    /// A reader over `files`, in order.
    pub fn new(files: Vec<InputFile>) -> Self {
        RecordReader {
            files,
            progress: Arc::new(AtomicU64::new(0)),
        }
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
            return match first_non_blank(&mut reader, &f.path)? {
                Some(b'[') => read_json_array(reader, file, index, sink),
                _ => read_json_stream(reader, file, index, sink),
            };
        }
        let text_mode = f.format == Format::Text;
        let mut line = Vec::new();
        let mut number = 0u64;
        loop {
            line.clear();
            let n = reader
                .read_until(b'\n', &mut line)
                .map_err(|cause| SourceError::Io {
                    path: f.path.clone(),
                    cause: std::io::Error::new(
                        cause.kind(),
                        format!("after line {number}: {cause}"),
                    ),
                })?;
            if n == 0 {
                return Ok(());
            }
            number += 1;
            if !text_mode && line.iter().all(|b| b.is_ascii_whitespace()) {
                continue;
            }
            let loc = || Location {
                file: file.clone(),
                number,
                unit: "line",
            };
            let offered = offer(index, sink, || match text_mode {
                true => parse_text_line(&line, loc()),
                false => parse_json_line(&line, loc()),
            });
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
            emit_batch(&batch, &file_arc, &mut rows, index, sink)?;
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
        type Batches =
            Box<dyn Iterator<Item = arrow::error::Result<arrow::record_batch::RecordBatch>>>;
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
            let batch: arrow::record_batch::RecordBatch =
                batch.map_err(|e| columnar(format!("after row {rows}: {e}")))?;
            emit_batch(&batch, &file_arc, &mut rows, index, sink)?;
        }
        self.progress.fetch_add(f.size, Ordering::Relaxed);
        Ok(())
    }
}

/// Convert an Arrow batch to JSON objects (nested lists and structs included) and emit them.
fn emit_batch(
    batch: &arrow::record_batch::RecordBatch,
    file: &Arc<PathBuf>,
    rows: &mut u64,
    index: &mut u64,
    sink: &mut dyn Sink,
) -> Result<()> {
    let mut buf = Vec::new();
    {
        let mut writer = arrow::json::LineDelimitedWriter::new(&mut buf);
        writer
            .write(batch)
            .and_then(|_| writer.finish())
            .map_err(|e| SourceError::Columnar {
                path: file.as_ref().clone(),
                what: format!("cannot convert rows after {rows} to JSON: {e}"),
            })?;
    }
    for line in buf.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        *rows += 1;
        let loc = Location {
            file: file.clone(),
            number: *rows,
            unit: "row",
        };
        if !offer(index, sink, || parse_json_line(line, loc)) {
            return Err(SourceError::Stopped);
        }
    }
    Ok(())
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
            Item::Record(Record { fields, loc })
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
        Ok(Value::Object(fields)) => Item::Record(Record { fields, loc }),
        Ok(other) => Item::Bad(BadRecord {
            loc,
            reason: "not a json object",
            detail: format!("found {}", type_name(&other)),
        }),
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

/// A `.json` that is not an array: a sequence of JSON objects, one per line or pretty-printed
/// over many lines (e.g. one moss-003 conversation per file).
fn read_json_stream(
    reader: Box<dyn BufRead>,
    file: Arc<PathBuf>,
    index: &mut u64,
    sink: &mut dyn Sink,
) -> Result<()> {
    let mut stream = serde_json::Deserializer::from_reader(reader).into_iter::<Value>();
    let mut number = 0u64;
    loop {
        let line_before = number;
        let next = stream.next();
        let Some(next) = next else { return Ok(()) };
        number += 1;
        let value = next.map_err(|e| {
            SourceError::Bad(BadRecord {
                loc: Location {
                    file: file.clone(),
                    number: e.line() as u64,
                    unit: "line",
                },
                reason: "malformed json",
                detail: format!("{e} (after object {line_before})"),
            })
        })?;
        let loc = Location {
            file: file.clone(),
            number,
            unit: "object",
        };
        if !offer(index, sink, || object_item(value, loc)) {
            return Err(SourceError::Stopped);
        }
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
fn object_item(value: Value, loc: Location) -> Item {
    match value {
        Value::Object(fields) => Item::Record(Record { fields, loc }),
        other => Item::Bad(BadRecord {
            loc,
            reason: "not a json object",
            detail: format!("found {}", type_name(&other)),
        }),
    }
}

/// Walk a top-level JSON array element by element without holding it in memory.
fn read_json_array(
    reader: Box<dyn BufRead>,
    file: Arc<PathBuf>,
    index: &mut u64,
    sink: &mut dyn Sink,
) -> Result<()> {
    use serde::de::{DeserializeSeed, IgnoredAny, SeqAccess, Visitor};

    struct ArrayVisitor<'a> {
        file: Arc<PathBuf>,
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
                    file: self.file.clone(),
                    number: element,
                    unit: "element",
                };
                if !self.sink.accept(i, object_item(value, loc)) {
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
    let mut de = serde_json::Deserializer::from_reader(reader);
    let start = *index;
    let result = ArrayVisitor {
        file: file.clone(),
        index,
        sink,
        stopped: &mut stopped,
    }
    .deserialize(&mut de)
    .and_then(|_| de.end());
    match result {
        Ok(()) => Ok(()),
        Err(_) if stopped => Err(SourceError::Stopped),
        Err(e) => Err(SourceError::Bad(BadRecord {
            loc: Location {
                file,
                number: e.line() as u64,
                unit: "line",
            },
            reason: if e.is_io() {
                "read error"
            } else {
                "malformed json"
            },
            detail: format!("{e} (in the array, after element {})", *index - start),
        })),
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
}
