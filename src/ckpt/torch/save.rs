//! Writing `.pt` files as `torch.save` does: a protocol-2 pickle (the only protocol torch's
//! `weights_only` loader accepts) in `<archive>/data.pkl`, then each storage as a stored,
//! 64-byte-aligned record `<archive>/data/<key>`, streamed one at a time, zip64 when large.
//! The file is written under a temporary name and renamed by [`PtWriter::finish`]; a write
//! error leaves no file and prints nothing but that error.

use super::pickle::{StorageRef, TensorRef, Value};
use super::TorchError;
use crate::tensor::DType;
use crate::util::{AtomicFile, OutputKind};
use std::borrow::Cow;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use zip::write::SimpleFileOptions;

type Result<T> = std::result::Result<T, TorchError>;

/// A `.pt` file as an output.
pub static PT_FILE: OutputKind = OutputKind {
    tag: "pt",
    what: "torch file",
    dir: None,
};

/// Streams one `.pt` file: the object first, then its storages in key order.
pub struct PtWriter {
    /// `None` once finished.
    zip: Option<zip::ZipWriter<Sink>>,
    /// Set by the sink on a write error, and here when dropped unfinished (see [`Sink`]).
    discarding: Arc<AtomicBool>,
    path: PathBuf,
    archive: String,
}

impl PtWriter {
    /// Start `path` with the pickled `root`, whose tensors name storages that
    /// [`PtWriter::write_storage`] then supplies. Refuses an existing file unless `force`.
    pub fn create(path: &Path, root: &Value, force: bool) -> Result<Self> {
        let fail = |what: String| TorchError::Archive {
            path: path.to_path_buf(),
            what,
        };
        let file = AtomicFile::create(path, &PT_FILE, force)?;
        let archive = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "archive".into());
        let pickle = pickle_of(root).map_err(|e| fail(e.to_string()))?;
        let discarding = Arc::new(AtomicBool::new(false));
        let sink = Sink {
            file,
            discarding: discarding.clone(),
            position: 0,
            len: 0,
        };
        let mut w = PtWriter {
            zip: Some(zip::ZipWriter::new(sink)),
            discarding,
            path: path.to_path_buf(),
            archive,
        };
        for (name, bytes) in opening_records(pickle) {
            w.record(name, &bytes)?;
        }
        Ok(w)
    }

    fn record(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        self.begin_record(name, bytes.len() as u64)?;
        self.append(bytes)
    }

    /// Open record `name` of `len` bytes, which [`PtWriter::append`] then writes.
    fn begin_record(&mut self, name: &str, len: u64) -> Result<()> {
        let options = record_options(len);
        let full = format!("{}/{name}", self.archive);
        let path = self.path.clone();
        self.open_zip(name)?
            .start_file(full, options)
            .map_err(|e| archive_error(&path, &format!("writing record {name}"), e))
    }

    /// The archive, unless a write failed.
    fn open_zip(&mut self, name: &str) -> Result<&mut zip::ZipWriter<Sink>> {
        match self.zip.as_mut() {
            Some(zip) if !self.discarding.load(Ordering::Relaxed) => Ok(zip),
            _ => Err(TorchError::Archive {
                path: self.path.clone(),
                what: format!("writing record {name} after a failed write"),
            }),
        }
    }

    /// Bytes of the open record.
    fn append(&mut self, bytes: &[u8]) -> Result<()> {
        let path = self.path.clone();
        (self.open_zip("data")?.write_all(bytes)).map_err(|cause| TorchError::Io { path, cause })
    }

    /// Write storage `key`'s little-endian bytes.
    pub fn write_storage(&mut self, key: &str, bytes: &[u8]) -> Result<()> {
        self.record(&format!("data/{key}"), bytes)
    }

    /// Start storage `key` of `len` bytes, written in parts by [`PtWriter::write_part`] (a
    /// grouped tensor, expert after expert, so that one expert is in memory at a time).
    pub fn begin_storage(&mut self, key: &str, len: u64) -> Result<()> {
        self.begin_record(&format!("data/{key}"), len)
    }

    /// The next bytes of the storage [`PtWriter::begin_storage`] started.
    pub fn write_part(&mut self, bytes: &[u8]) -> Result<()> {
        self.append(bytes)
    }

    /// Close the archive and move it into place.
    pub fn finish(mut self) -> Result<()> {
        self.record(VERSION_RECORD.0, VERSION_RECORD.1)?;
        let zip = self.zip.take().ok_or_else(|| TorchError::Archive {
            path: self.path.clone(),
            what: "finished twice".into(),
        })?;
        let sink = zip
            .finish()
            .map_err(|e| archive_error(&self.path, "finishing the archive", e))?;
        if sink.discarding() {
            return Err(TorchError::Archive {
                path: self.path.clone(),
                what: "finishing the archive after a failed write".into(),
            });
        }
        sink.file.finish()?;
        Ok(())
    }
}

/// A contiguous CPU tensor of `shape` over the whole of storage `key`.
pub fn contiguous(key: &str, dtype: DType, shape: &[u64]) -> Value {
    let mut stride = vec![1u64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        stride[i] = stride[i + 1] * shape[i + 1];
    }
    Value::Tensor(Box::new(TensorRef {
        storage: StorageRef {
            key: key.to_string(),
            dtype,
            location: "cpu".into(),
            numel: shape.iter().product(),
        },
        offset: 0,
        shape: shape.to_vec(),
        stride,
    }))
}

/// The pickle of `root` (protocol 2, as `torch.save` writes it).
fn pickle_of(root: &Value) -> std::result::Result<Vec<u8>, Unpicklable> {
    let mut pickle = vec![op::PROTO, 2];
    write_value(&mut pickle, root)?;
    pickle.push(b'.');
    Ok(pickle)
}

/// The records an archive opens with: the pickle, then torch's format markers.
fn opening_records(pickle: Vec<u8>) -> [(&'static str, Vec<u8>); 4] {
    [
        ("data.pkl", pickle),
        (".format_version", b"1".to_vec()),
        (".storage_alignment", b"64".to_vec()),
        ("byteorder", b"little".to_vec()),
    ]
}

/// The record an archive closes with.
const VERSION_RECORD: (&str, &[u8]) = ("version", b"3\n");

/// How each record is stored: uncompressed, 64-byte aligned, zip64 when large.
fn record_options(len: u64) -> SimpleFileOptions {
    SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Stored)
        .with_alignment(64)
        .large_file(len >= u32::MAX as u64)
}

/// One `torch.save(root)` archive written into `sink` as torch writes into a stream: under
/// the archive directory `archive`, every position counted from the sink's start, the
/// storages `"0"`, `"1"`, … given in order. A distributed checkpoint's items are such
/// archives, one after the other in a `.distcp` file. `path` names the file in errors.
pub fn write_archive<W: Write + Seek>(
    sink: W,
    path: &Path,
    root: &Value,
    storages: &[&[u8]],
) -> Result<W> {
    let fail = |doing: &str, e| archive_error(path, doing, e);
    let pickle = pickle_of(root).map_err(|e| TorchError::Archive {
        path: path.to_path_buf(),
        what: e.to_string(),
    })?;
    let opening = opening_records(pickle);
    let records = (opening.iter())
        .map(|(name, bytes)| (name.to_string(), bytes.as_slice()))
        .chain((storages.iter().enumerate()).map(|(i, s)| (format!("data/{i}"), *s)))
        .chain([(VERSION_RECORD.0.to_string(), VERSION_RECORD.1)]);
    let mut zip = zip::ZipWriter::new(sink);
    for (name, bytes) in records {
        zip.start_file(
            format!("archive/{name}"),
            record_options(bytes.len() as u64),
        )
        .map_err(|e| fail(&format!("writing record {name}"), e))?;
        zip.write_all(bytes).map_err(|cause| TorchError::Io {
            path: path.to_path_buf(),
            cause,
        })?;
    }
    zip.finish().map_err(|e| fail("finishing the archive", e))
}

impl Drop for PtWriter {
    fn drop(&mut self) {
        self.discarding.store(true, Ordering::Relaxed);
    }
}

/// A zip error, naming the file; an I/O cause is shown as such (e.g. "No space left on device").
fn archive_error(path: &Path, doing: &str, e: zip::result::ZipError) -> TorchError {
    match e {
        zip::result::ZipError::Io(cause) => TorchError::Io {
            path: path.to_path_buf(),
            cause,
        },
        other => TorchError::Archive {
            path: path.to_path_buf(),
            what: format!("{doing}: {other}"),
        },
    }
}

/// Where the archive's bytes go. `ZipWriter`'s drop finishes an unfinished archive and, if that
/// fails, prints a debug line to stderr (`ZipWriter drop failed: Io(…)`) on top of the real
/// error. So after the first write error, or once the [`PtWriter`] is dropped unfinished, the
/// sink takes bytes and seeks without writing them, keeping the position a file would have:
/// the drop then has nothing to fail on, and the temporary file is removed with the sink.
struct Sink {
    file: AtomicFile,
    /// Set on the first error and when abandoned; shared with the [`PtWriter`].
    discarding: Arc<AtomicBool>,
    position: u64,
    len: u64,
}

impl Sink {
    fn discarding(&self) -> bool {
        self.discarding.load(Ordering::Relaxed)
    }

    fn moved_to(&mut self, position: u64) -> u64 {
        self.position = position;
        self.len = self.len.max(position);
        position
    }

    /// `result`, switching to discarding on an error.
    fn note<T>(&self, result: std::io::Result<T>) -> std::io::Result<T> {
        if result
            .as_ref()
            .is_err_and(|e| e.kind() != std::io::ErrorKind::Interrupted)
        {
            self.discarding.store(true, Ordering::Relaxed);
        }
        result
    }
}

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = match self.discarding() {
            true => buf.len(),
            false => {
                let written = self.file.write(buf);
                self.note(written)?
            }
        };
        self.moved_to(self.position + n as u64);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self.discarding() {
            true => Ok(()),
            false => {
                let flushed = self.file.flush();
                self.note(flushed)
            }
        }
    }
}

impl Seek for Sink {
    fn seek(&mut self, pos: SeekFrom) -> std::io::Result<u64> {
        if !self.discarding() {
            let moved = self.file.seek(pos);
            let moved = self.note(moved)?;
            return Ok(self.moved_to(moved));
        }
        let target = match pos {
            SeekFrom::Start(n) => Some(n),
            SeekFrom::Current(d) => self.position.checked_add_signed(d),
            SeekFrom::End(d) => self.len.checked_add_signed(d),
        };
        let target = target.ok_or_else(|| std::io::Error::other("seek before the start"))?;
        Ok(self.moved_to(target))
    }
}

/// Protocol-2 opcodes, as CPython's `pickle.py` names them.
mod op {
    pub const PROTO: u8 = 0x80;
    pub const MARK: u8 = b'(';
    pub const NONE: u8 = b'N';
    pub const NEWTRUE: u8 = 0x88;
    pub const NEWFALSE: u8 = 0x89;
    pub const BININT1: u8 = b'K';
    pub const BININT2: u8 = b'M';
    pub const BININT: u8 = b'J';
    pub const LONG1: u8 = 0x8a;
    pub const BINFLOAT: u8 = b'G';
    pub const BINUNICODE: u8 = b'X';
    pub const EMPTY_LIST: u8 = b']';
    pub const APPENDS: u8 = b'e';
    pub const EMPTY_TUPLE: u8 = b')';
    pub const TUPLE: u8 = b't';
    pub const EMPTY_DICT: u8 = b'}';
    pub const SETITEMS: u8 = b'u';
    pub const GLOBAL: u8 = b'c';
    pub const REDUCE: u8 = b'R';
    pub const NEWOBJ: u8 = 0x81;
    pub const BUILD: u8 = b'b';
    pub const BINPERSID: u8 = b'Q';
}

/// A value the pickle writer cannot write on its own (what it holds, debug-printed).
#[derive(Debug, thiserror::Error)]
#[error("cannot pickle {0} on its own")]
struct Unpicklable(String);

/// Pickle `v` with protocol-2 opcodes.
fn write_value(out: &mut Vec<u8>, v: &Value) -> std::result::Result<(), Unpicklable> {
    match v {
        Value::None => out.push(op::NONE),
        Value::Bool(b) => out.push(if *b { op::NEWTRUE } else { op::NEWFALSE }),
        Value::Int(i) => write_int(out, *i),
        Value::Float(f) => {
            out.push(op::BINFLOAT);
            out.extend_from_slice(&f.to_be_bytes());
        }
        Value::Str(s) => write_str(out, s),
        Value::Bytes(b) => {
            // Protocol 2 has no bytes opcode: torch (like pickle) emits _codecs.encode(latin-1 text).
            write_global(out, "_codecs", "encode");
            out.push(op::MARK);
            write_str(out, &b.iter().map(|&c| c as char).collect::<String>());
            write_str(out, "latin1");
            out.extend_from_slice(&[op::TUPLE, op::REDUCE]);
        }
        Value::List(items) => {
            out.push(op::EMPTY_LIST);
            for chunk in items.chunks(1000) {
                out.push(op::MARK);
                for item in chunk {
                    write_value(out, item)?;
                }
                out.push(op::APPENDS);
            }
        }
        Value::Tuple(items) => write_tuple(out, items.iter().map(Item::Value).collect())?,
        Value::Dict(items) => {
            out.push(op::EMPTY_DICT);
            write_items(out, items.iter().map(|(k, v)| (Cow::Borrowed(k), v)))?;
        }
        Value::Namespace(attrs) => {
            write_global(out, "argparse", "Namespace");
            out.extend_from_slice(&[op::EMPTY_TUPLE, op::NEWOBJ, op::EMPTY_DICT]);
            write_items(
                out,
                attrs
                    .iter()
                    .map(|(k, v)| (Cow::Owned(Value::Str(k.clone())), v)),
            )?;
            out.push(op::BUILD);
        }
        Value::TorchDType(d) => write_global(out, "torch", d.torch_name()),
        Value::Tensor(t) => write_tensor(out, t)?,
        Value::Storage(_) | Value::Global(_) | Value::Object(_) => {
            return Err(Unpicklable(format!("{v:?}")))
        }
    }
    Ok(())
}

/// A tuple element: a value, a storage's persistent id, or the empty backward-hooks
/// `OrderedDict()` of a tensor.
enum Item<'a> {
    Value(&'a Value),
    Storage(String, DType, u64),
    EmptyOrderedDict,
}

fn write_tuple(out: &mut Vec<u8>, items: Vec<Item>) -> std::result::Result<(), Unpicklable> {
    if items.is_empty() {
        out.push(op::EMPTY_TUPLE);
        return Ok(());
    }
    out.push(op::MARK);
    for item in items {
        match item {
            Item::Value(v) => write_value(out, v)?,
            Item::Storage(key, dtype, numel) => {
                if !super::pickle::has_storage_class(dtype) {
                    return Err(Unpicklable(format!("a {} storage", dtype.torch_name())));
                }
                out.push(op::MARK);
                write_str(out, "storage");
                write_global(out, "torch", dtype.storage_class());
                write_str(out, &key);
                write_str(out, "cpu");
                write_int(out, numel as i64);
                out.extend_from_slice(&[op::TUPLE, op::BINPERSID]);
            }
            Item::EmptyOrderedDict => {
                write_global(out, "collections", "OrderedDict");
                out.extend_from_slice(&[op::EMPTY_TUPLE, op::REDUCE]);
            }
        }
    }
    out.push(op::TUPLE);
    Ok(())
}

/// `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())`.
fn write_tensor(out: &mut Vec<u8>, t: &TensorRef) -> std::result::Result<(), Unpicklable> {
    let ints = |xs: &[u64]| Value::Tuple(xs.iter().map(|&x| Value::Int(x as i64)).collect());
    let (offset, shape, stride) = (Value::Int(t.offset as i64), ints(&t.shape), ints(&t.stride));
    write_global(out, "torch._utils", "_rebuild_tensor_v2");
    write_tuple(
        out,
        vec![
            Item::Storage(t.storage.key.clone(), t.storage.dtype, t.storage.numel),
            Item::Value(&offset),
            Item::Value(&shape),
            Item::Value(&stride),
            Item::Value(&Value::Bool(false)),
            Item::EmptyOrderedDict,
        ],
    )?;
    out.push(op::REDUCE);
    Ok(())
}

fn write_items<'a>(
    out: &mut Vec<u8>,
    items: impl Iterator<Item = (Cow<'a, Value>, &'a Value)>,
) -> std::result::Result<(), Unpicklable> {
    let items: Vec<_> = items.collect();
    for chunk in items.chunks(1000) {
        out.push(op::MARK);
        for (k, v) in chunk {
            write_value(out, k)?;
            write_value(out, v)?;
        }
        out.push(op::SETITEMS);
    }
    Ok(())
}

fn write_int(out: &mut Vec<u8>, i: i64) {
    match i {
        0..=0xff => out.extend_from_slice(&[op::BININT1, i as u8]),
        0x100..=0xffff => {
            out.push(op::BININT2);
            out.extend_from_slice(&(i as u16).to_le_bytes());
        }
        _ if i32::try_from(i).is_ok() => {
            out.push(op::BININT);
            out.extend_from_slice(&(i as i32).to_le_bytes());
        }
        _ => {
            out.extend_from_slice(&[op::LONG1, 8]);
            out.extend_from_slice(&i.to_le_bytes());
        }
    }
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.push(op::BINUNICODE);
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write_global(out: &mut Vec<u8>, module: &str, name: &str) {
    out.push(op::GLOBAL);
    out.extend_from_slice(format!("{module}\n{name}\n").as_bytes());
}

/// A protocol-2 pickle written opcode by opcode, for instances of classes a [`Value`] does
/// not describe (a distributed checkpoint's index, `.metadata`): each method appends what
/// the pickle opcode it is named after does.
pub struct Pickler(Vec<u8>);

impl Default for Pickler {
    fn default() -> Self {
        Pickler(vec![op::PROTO, 2])
    }
}

impl Pickler {
    /// A value of a plain type.
    pub fn value(&mut self, v: &Value) -> std::result::Result<(), impl std::error::Error> {
        write_value(&mut self.0, v)
    }

    /// A string.
    pub fn str(&mut self, s: &str) {
        write_str(&mut self.0, s);
    }

    /// An int.
    pub fn int(&mut self, i: i64) {
        write_int(&mut self.0, i);
    }

    /// A bool.
    pub fn bool(&mut self, b: bool) {
        self.0.push(if b { op::NEWTRUE } else { op::NEWFALSE });
    }

    /// `None`.
    pub fn none(&mut self) {
        self.0.push(op::NONE);
    }

    /// `module.name`.
    pub fn global(&mut self, module: &str, name: &str) {
        write_global(&mut self.0, module, name);
    }

    /// The start of a tuple's, a dict's or a list's items.
    pub fn mark(&mut self) {
        self.0.push(op::MARK);
    }

    /// A tuple of the items since the mark.
    pub fn tuple(&mut self) {
        self.0.push(op::TUPLE);
    }

    /// The callable below called with the tuple on top.
    pub fn reduce(&mut self) {
        self.0.push(op::REDUCE);
    }

    /// `cls.__new__(cls)` of `module.class` (as `copyreg.__newobj__` pickles an instance).
    pub fn new_object(&mut self, module: &str, class: &str) {
        write_global(&mut self.0, module, class);
        self.0.extend_from_slice(&[op::EMPTY_TUPLE, op::NEWOBJ]);
    }

    /// The object below given the state on top (its `__dict__`, or `__setstate__`'s argument).
    pub fn build(&mut self) {
        self.0.push(op::BUILD);
    }

    /// An empty dict.
    pub fn empty_dict(&mut self) {
        self.0.push(op::EMPTY_DICT);
    }

    /// The key-value pairs since the mark set in the dict below them.
    pub fn set_items(&mut self) {
        self.0.push(op::SETITEMS);
    }

    /// An empty list.
    pub fn empty_list(&mut self) {
        self.0.push(op::EMPTY_LIST);
    }

    /// The items since the mark appended to the list below them.
    pub fn appends(&mut self) {
        self.0.push(op::APPENDS);
    }

    /// The pickle's bytes, ended.
    pub fn finish(mut self) -> Vec<u8> {
        self.0.push(b'.');
        self.0
    }
}
